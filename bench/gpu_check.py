"""GPU check: Gradient Cache under fp16 and bf16 on CUDA, through accelerate and through DeepSpeed.

    python bench/gpu_check.py

The fp16 half of tests/test_backends.py, which cannot run on a CPU. With the same worker, model, data and
full-batch fp32 reference (tests/backend_worker.py), one process on the GPU trains 3 SGD steps with
gradcache_step under:
  - accelerate's native mixed precision: fp32, fp16 with its GradScaler (the loss scale must reach the
    gradients exactly once, through accelerator.backward), bf16 autocast;
  - DeepSpeed ZeRO-2 and ZeRO-3 with fp16 (DeepSpeed's dynamic loss scaler) and bf16;
  - FSDP2 on 2 GPUs (NCCL) in fp32, bf16 and fp16, where 2 GPUs are lent (not yet run on one).
It prints a markdown table (setup, max relative differences, tolerance, pass/fail) and writes it to
$OUT/gpu_check.md when OUT is set, else to bench/results/gpu_check.md. Exits 1 if a row fails or could not
run. Two short torchrun launches (their CPU counterparts take about 15 s each): well under 3 minutes.

Then fp16 overflows through train.py itself, on a tiny BERT (tests/test_train.py's), one process each:
  - accelerate's GradScaler (accelerate_configs/fp16.yaml) starting at 2^24 (tests/faults sets it);
  - DeepSpeed ZeRO-2 fp16 with "initial_scale_power": 24;
each must overflow its first steps, skip and count them (never as non-finite steps, whatever
--max_bad_steps 2 says), lower the scale, then train to finite weights. Two more launches, about a minute.

    python bench/gpu_check.py --overflow_only    # only these two runs

The graph_budget sweep of bench/speed.py on the GPU, nothing else: gradcache_step keeping 0, 1/4, 1/2 and
all of its stage-1 graphs against the no-cache lower bound, at batch 256 and 1,024, chunk 32, the whole
all-MiniLM-L6-v2, peak memory by torch.cuda.max_memory_allocated; the table goes to $OUT/gpu_budget_sweep.md
and budget_gpu.json/.md (else bench/results/; copy those into bench/results/ for make_results.py). Two
warm-up and three measured rounds: about a minute on one GPU.

    python bench/gpu_check.py --budget_sweep

Last, --attn_implementation flash_attention_2 (needs the flash-attn package) on the tiny Llama, a bfloat16
base with a LoRA adapter, loaded as train.py loads it: a gradcache_step in chunks of 3 against the same
model with sdpa on the full batch in one graph, by tests/references.py's rule with that bfloat16 reference
in the float32 reference's place (the truth: the model in float64); seconds.

    python bench/gpu_check.py --flash_attention_only
"""

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]  # gradcache.py, the worker, speed.py

from backend_worker import Case, compare, launch, markdown_table, passes  # noqa: E402

ACCELERATE_CASES = [
    Case("cuda-fp32"),
    Case("cuda-fp16-grad-scaler", mixed_precision="fp16"),
    Case("cuda-fp16-grad-scaler-two-towers", two_towers=True, mixed_precision="fp16"),
    Case("cuda-bf16-autocast", mixed_precision="bf16"),
]
DEEPSPEED_CASES = [
    Case("cuda-zero2-fp16", zero_stage=2, mixed_precision="fp16"),
    Case("cuda-zero3-fp16", zero_stage=3, mixed_precision="fp16"),
    Case("cuda-zero3-fp16-two-towers", zero_stage=3, two_towers=True, mixed_precision="fp16"),
    Case("cuda-zero2-bf16", zero_stage=2, mixed_precision="bf16"),
    Case("cuda-zero3-bf16", zero_stage=3, mixed_precision="bf16"),
]
# FSDP2 (accelerate_configs/fsdp2.yaml's plugin) on 2 GPUs, NCCL: fp32, bf16 (the plugin's mixed precision
# policy) and fp16 (accelerate's FSDP2 grad scaler), towers with cross-process negatives, accumulation.
FSDP2_ON_2_GPUS = dict(world_size=2, fsdp2=True)
FSDP2_CASES = [
    Case("cuda-fsdp2-fp32", **FSDP2_ON_2_GPUS),
    Case("cuda-fsdp2-bf16-two-towers-cross", **FSDP2_ON_2_GPUS, mixed_precision="bf16", two_towers=True,
         cross_process_negatives=True),
    Case("cuda-fsdp2-fp16-accumulate2", **FSDP2_ON_2_GPUS, mixed_precision="fp16", accumulation_steps=2),
]  # fmt: skip


def run_checks(out_dir):
    """(rows of (case, comparison), notes): a launch that fails becomes a note, not a lost table."""
    rows, notes = [], []
    groups = [("accelerate", ACCELERATE_CASES)]
    if importlib.util.find_spec("deepspeed") is None:
        notes.append("DeepSpeed rows not run: deepspeed is not installed (`bash setup.sh`).")
    else:
        groups.append(("deepspeed", DEEPSPEED_CASES))
    if torch.cuda.device_count() >= 2:
        groups.append(("fsdp2", FSDP2_CASES))
    else:
        notes.append("FSDP2 rows not run: they need 2 GPUs.")
    for name, cases in groups:
        try:
            results = launch(cases, Path(out_dir) / name, world_size=cases[0].world_size, timeout=300)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            notes.append(f"{name} launch failed:\n\n```\n{error}\n```")
            continue
        for case in cases:
            rows.append((case, compare(case, results[case.name])))
            scale = results[case.name][0].get("deepspeed_first_loss_scale")
            if case.mixed_precision == "fp16" and scale is not None:
                notes.append(f"{case.name}: DeepSpeed's loss scale at step 1 was {scale:g}.")
    return rows, notes


OVERFLOW_SCALE_POWER = 24  # a tiny BERT's gradients overflow fp16 above about 2^17 (measured on a CPU)


def overflow_launch_commands(folder, model, data):
    """{name: (command, environment)}: train.py under fp16, from a loss scale that overflows at first."""
    train_args = [str(REPO / "train.py"), "--model", str(model), "--data", str(data), "--dev_data", ""]
    train_args += ["--batch_size", "8", "--chunk_size", "3", "--max_steps", "12", "--lr", "1e-3"]
    train_args += ["--max_bad_steps", "2", "--save_steps", "0", "--wandb_mode", "disabled"]
    deepspeed_config = json.loads((REPO / "accelerate_configs" / "deepspeed" / "zero2.json").read_text())
    deepspeed_config["fp16"]["initial_scale_power"] = OVERFLOW_SCALE_POWER
    (folder / "zero2_fp16.json").write_text(json.dumps(deepspeed_config))
    deepspeed_yaml = (REPO / "accelerate_configs" / "deepspeed_zero2.yaml").read_text()
    (folder / "zero2_fp16.yaml").write_text(
        deepspeed_yaml.replace("accelerate_configs/deepspeed/zero2.json", str(folder / "zero2_fp16.json"))
    )
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1"]
    scaler = {"PYTHONPATH": f"{REPO / 'tests' / 'faults'}{os.pathsep}{REPO}"}
    scaler |= {"GRADCACHE_FP16_SCALER": str(2.0**OVERFLOW_SCALE_POWER)}
    return {
        "accelerate-fp16-overflow": (
            [*accelerate, "--config_file", str(REPO / "accelerate_configs" / "fp16.yaml"), *train_args],
            scaler,
        ),
        "deepspeed-zero2-fp16-overflow": (
            [*accelerate, "--config_file", str(folder / "zero2_fp16.yaml"), "--mixed_precision", "fp16"]
            + train_args,
            {},
        ),
    }


def overflow_verdict(done, output_dir):
    """(passed, what was seen) for one fp16 overflow run."""
    from safetensors.torch import load_file
    from test_train import logged_scalars

    output = done.stdout + done.stderr
    overflows = output.count("fp16 overflow, update skipped")
    if done.returncode != 0:
        return False, f"exit {done.returncode}: {output[-800:]}"
    scales = [value for _, value in logged_scalars(output_dir)["train/loss_scale"]]
    nonfinite = [value for _, value in logged_scalars(output_dir)["train/nonfinite_steps"]]
    weights = load_file(str(output_dir / "final" / "model.safetensors"))
    finite = all(bool(torch.isfinite(value).all()) for value in weights.values())
    seen = f"{overflows} overflows, loss scale {scales[0]:g} -> {scales[-1]:g}"
    seen += f", non-finite steps {nonfinite[-1]:g}"
    passed = overflows >= 2 and scales[-1] < 2.0**OVERFLOW_SCALE_POWER and nonfinite[-1] == 0 and finite
    return passed, seen + ("" if finite else ", weights NOT finite")


def run_overflow_checks(out_dir):
    """Markdown rows, and whether all passed."""
    from test_train import ROWS, WORDS, build_tiny_model, write_rows

    folder = Path(out_dir)
    model = build_tiny_model(folder, dropout=0.1)
    texts = [
        {"anchor": f"{WORDS[i % 60]} a{i}", "positive": f"p{i}", "negative": f"n{i}"} for i in range(ROWS)
    ]
    data = write_rows(folder / "train.jsonl", texts)
    rows, all_passed = ["| fp16 overflow run | passed | seen |", "| --- | --- | --- |"], True
    for name, (command, env) in overflow_launch_commands(folder, model, data).items():
        output_dir = folder / name
        done = subprocess.run(
            [*command, "--output_dir", str(output_dir)],
            cwd=REPO,
            env=os.environ | {"HF_HUB_OFFLINE": "1"} | env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        passed, seen = overflow_verdict(done, output_dir)
        rows.append(f"| {name} | {'yes' if passed else 'NO'} | {seen} |")
        all_passed &= passed
    return "\n".join(rows) + "\n", all_passed


def run_budget_sweep():
    """bench/speed.py's graph_budget sweep on CUDA; the markdown table, also written beside gpu_check.md."""
    import harness
    import speed

    rows = speed.budget_sweep("cuda", (256, 1024), chunk_size=32, rounds=3, warmup=2, num_layers=0)
    header = ["batch", "budget (of all graphs)", "groups kept", "seconds", "/ lower bound", "peak MiB"]
    report = (
        f"# graph_budget sweep\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}: gradcache_step "
        "(gradient only) against the no-cache lower bound, chunk 32, all-MiniLM-L6-v2; peak above the "
        "step's start, torch.cuda.max_memory_allocated.\n\n" + harness.markdown_table(header, rows) + "\n"
    )
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_budget_sweep.md").write_text(report)
    info = harness.provenance("cuda", "python bench/gpu_check.py --budget_sweep", allow_dirty=True)
    speed.save_budget_sweep(rows, info, argparse.Namespace(device="cuda", out_dir=out))  # RESULTS.md's part
    return report


def run_flash_attention_check(out_dir, attention="flash_attention_2", device="cuda"):
    """(markdown, passed) of the flash-attention check (the module docstring). `attention` and `device` let
    the same check run on a CPU with another kernel."""
    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "\nflash_attention_2: not run, flash-attn is not installed (pip install flash-attn).\n", False
    import copy
    import functools

    from references import exactness, float64, materialized_contrastive_loss, parameter_gradients
    from test_any_model import COLUMNS, column_texts
    from test_gradcache import unchunked_reference
    from test_train import build_tiny_model

    import gradcache
    import train
    from train_parts import models
    from train_parts.common import flags_of

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    folder = build_tiny_model(Path(out_dir), dropout=0.0, kind="decoder")

    def loaded(kernel):
        flags = ["--lora_r", "4", "--model_dtype", "bfloat16", "--attn_implementation", kernel]
        args = train.parse_args(["--model", str(folder), "--data", "unused.jsonl", *flags])
        return models.prepare_model(
            models.load_model(args.model, device, **models.model_options(flags_of(models.ModelFlags, args))),
            flags_of(models.ModelFlags, args),
        )

    run, reference = loaded(attention), loaded("sdpa")
    torch.manual_seed(2)  # peft starts B at zero, where A gets no gradient: a random B tests both
    for name, parameter in run.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    reference.load_state_dict(run.state_dict())  # the adapter's A too: each load draws its own
    prompts = models.role_prompts(run)
    columns = [models.tokenize(run, column_texts(i, 12), c, prompts) for i, c in enumerate(COLUMNS)]
    reference_loss = functools.partial(materialized_contrastive_loss, symmetric=True)
    gradients = []
    for copied, cast in ((copy.deepcopy(reference), lambda values: values), (float64(reference), float64)):
        unchunked_reference([copied] * len(columns), cast(columns), reference_loss)
        gradients.append(parameter_gradients(copied))
    loss_fn = functools.partial(gradcache.contrastive_loss, symmetric=True)
    gradcache.gradcache_step(run, columns, loss_fn, 3)
    measured = exactness(parameter_gradients(run), *gradients)
    rows = "| attention | LoRA gradients against float64 | passed |\n| --- | --- | --- |\n"
    return f"\n{rows}| {attention}, bfloat16 base | {measured} | {'yes' if measured.holds else 'NO'} |\n", (
        measured.holds
    )


def main():
    options = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    options.add_argument(
        "--overflow_only", action="store_true", help="only the fp16 overflow runs of train.py"
    )
    options.add_argument("--budget_sweep", action="store_true", help="only the graph_budget sweep")
    options.add_argument(
        "--flash_attention_only", action="store_true", help="only the flash_attention_2 check"
    )
    parsed = options.parse_args()
    overflow_only, flash_only = parsed.overflow_only, parsed.flash_attention_only
    if not torch.cuda.is_available():
        sys.exit(
            "gpu_check.py needs CUDA: torch sees no GPU here. The CPU checks are tests/test_backends.py."
        )
    if parsed.budget_sweep:
        run_budget_sweep()
        return
    rows, notes, overflow_table, overflow_passed = [], [], "", True
    with tempfile.TemporaryDirectory() as out_dir:
        if not (overflow_only or flash_only):
            rows, notes = run_checks(out_dir)
        if not flash_only:
            overflow_table, overflow_passed = run_overflow_checks(out_dir)
        flash_table, flash_passed = (
            run_flash_attention_check(Path(out_dir) / "flash") if not overflow_only else ("", True)
        )
    header = (
        f"# Gradient Cache GPU check\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}. Max relative difference against the fp32 full-batch reference "
        "(per tensor, max|diff| / max|reference|; worst tensor).\n\n"
    )
    report = (
        header
        + ("" if overflow_only or flash_only else markdown_table(rows))
        + "".join(f"\n{note}\n" for note in notes)
    )
    report += "\n" + overflow_table + flash_table
    print(report)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(report)
    expected_rows = 0 if overflow_only or flash_only else len(ACCELERATE_CASES) + len(DEEPSPEED_CASES)
    if len(rows) < expected_rows or not all(passes(case, comparison) for case, comparison in rows):
        sys.exit(1)
    if not (overflow_passed and flash_passed):
        sys.exit(1)


if __name__ == "__main__":
    main()
