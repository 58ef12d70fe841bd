"""GPU check: Gradient Cache under fp16 and bf16 on CUDA, through accelerate and through DeepSpeed.

    python bench/gpu_check.py

The fp16 half of tests/test_backends.py, which cannot run on a CPU. With the same worker, model, data and
full-batch fp32 reference (tests/backend_worker.py), one process on the GPU trains 3 SGD steps with
gradcache_step under:
  - accelerate's native mixed precision: fp32, fp16 with its GradScaler (the loss scale must reach the
    gradients exactly once, through accelerator.backward), bf16 autocast;
  - DeepSpeed ZeRO-2 and ZeRO-3 with fp16 (DeepSpeed's dynamic loss scaler) and bf16.
It prints a markdown table (setup, max relative differences, tolerance, pass/fail) and writes it to
$OUT/gpu_check.md when OUT is set, else to bench/results/gpu_check.md. Exits 1 if a row fails or could not
run. Two short torchrun launches (their CPU counterparts take about 15 s each): well under 3 minutes.
"""

import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # gradcache.py and the shared worker

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


def run_checks(out_dir):
    """(rows of (case, comparison), notes): a launch that fails becomes a note, not a lost table."""
    rows, notes = [], []
    groups = [("accelerate", ACCELERATE_CASES)]
    if importlib.util.find_spec("deepspeed") is None:
        notes.append("DeepSpeed rows not run: deepspeed is not installed (`bash setup.sh`).")
    else:
        groups.append(("deepspeed", DEEPSPEED_CASES))
    for name, cases in groups:
        try:
            results = launch(cases, Path(out_dir) / name, world_size=1, timeout=300)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            notes.append(f"{name} launch failed:\n\n```\n{error}\n```")
            continue
        for case in cases:
            rows.append((case, compare(case, results[case.name])))
            scale = results[case.name][0].get("deepspeed_first_loss_scale")
            if case.mixed_precision == "fp16" and scale is not None:
                notes.append(f"{case.name}: DeepSpeed's loss scale at step 1 was {scale:g}.")
    return rows, notes


def main():
    if not torch.cuda.is_available():
        sys.exit(
            "gpu_check.py needs CUDA: torch sees no GPU here. The CPU checks are tests/test_backends.py."
        )
    with tempfile.TemporaryDirectory() as out_dir:
        rows, notes = run_checks(out_dir)
    header = (
        f"# Gradient Cache GPU check\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}. Max relative difference against the fp32 full-batch reference "
        "(per tensor, max|diff| / max|reference|; worst tensor).\n\n"
    )
    report = header + markdown_table(rows) + "".join(f"\n{note}\n" for note in notes)
    print(report)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(report)
    expected_rows = len(ACCELERATE_CASES) + len(DEEPSPEED_CASES)
    if len(rows) < expected_rows or not all(passes(case, comparison) for case, comparison in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
