"""Benchmark 9: peak memory per process of a Gradient Cache step under DDP, DeepSpeed ZeRO-3 and FSDP2.

A random BERT-base (12 layers, hidden 768, MiniLM's vocabulary: about 110M parameters) built in code, big
enough that its weights, gradients and AdamW state (16 bytes a parameter unsharded) dominate the small
batch's activations. Each point launches `train.py` with the backend's config from accelerate_configs/ at 2
and 4 processes, the same global batch and chunk, two AdamW steps, and reads what the largest process holds
after the steps (train.py's logged memory/rss_gib) and the largest peak resident set of the whole launch,
loading and the final gathering included (getrusage of the waited-for children, in a fresh wrapper process
per launch). On CPU, FSDP2 runs through tests/fsdp_shim.py (accelerate picks FSDP only on accelerators), as
the tests run it.

    python bench/sharding_memory.py                  # CPU: 6 launches, about 10 min on 2 busy cores
    python bench/sharding_memory.py --preset smoke   # a 2-layer model, 2 processes: a minute

Writes bench/results/sharding_memory_<preset>.{json,md}.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

REPO = Path(__file__).resolve().parents[1]
BACKENDS = {"ddp": "cpu_ddp_2proc.yaml", "zero3": "deepspeed_zero3.yaml", "fsdp2": "fsdp2.yaml"}
RUNS_AS = {"ddp": "MULTI_CPU", "zero3": "DEEPSPEED", "fsdp2": "FSDP"}  # what train.py must report
PRESETS = {
    "cpu": {"layers": 12, "processes": [2, 4], "batch_size": 32, "chunk_size": 8},
    "smoke": {"layers": 2, "processes": [2], "batch_size": 8, "chunk_size": 4},
}
# Runs a command and prints the largest peak resident set (bytes) of the processes it waited for.
PEAK = (
    "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]);"
    "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, done.returncode)"
)


def build_model(folder: Path, layers: int) -> int:
    """A random BERT over MiniLM's tokenizer, mean pooled, saved as a sentence-transformers folder."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(harness.model_path())
    sizes = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=128)
    config = BertConfig(vocab_size=tokenizer.vocab_size, num_hidden_layers=layers, **sizes)
    BertModel(config).save_pretrained(folder / "bert")
    tokenizer.save_pretrained(folder / "bert")
    transformer = Transformer(str(folder / "bert"), max_seq_length=64)
    model = SentenceTransformer(modules=[transformer, Pooling(768, "mean")])
    model.save(str(folder / "model"))
    return sum(p.numel() for p in model.parameters())


def write_pairs(path: Path, rows: int) -> Path:
    words = [f"word{i}" for i in range(200)]
    with path.open("w") as out:
        for i in range(rows):
            text = " ".join(words[(i * 7 + k) % 200] for k in range(12))
            out.write(json.dumps({"anchor": f"{text} q{i}", "positive": f"{text} d{i}"}) + "\n")
    return path


def environment(folder: Path, backend: str) -> dict:
    """CPU processes, one thread each; the FSDP shim on the path for FSDP2 (tests/fsdp_shim.py).
    ACCELERATE_USE_CPU for DDP and FSDP2 alone: with it, accelerate runs a DeepSpeed config as plain DDP."""
    site = folder / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import fsdp_shim\n\nfsdp_shim.install()\n")
    path = os.pathsep.join([str(site), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    extensions = REPO / ".cache" / "torch_extensions"  # setup.sh --dev builds DeepSpeed's CPU ops here
    return os.environ | {
        "PYTHONPATH": path,
        "ACCELERATE_USE_CPU": str(backend != "zero3").lower(),
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        # glibc otherwise raises its mmap threshold as big blocks are freed, keeping freed tensors resident:
        # fixed, every tensor over 64 KiB is mapped alone and unmapped when freed, so RSS follows the tensors.
        "MALLOC_MMAP_THRESHOLD_": "65536",
        **({"TORCH_EXTENSIONS_DIR": str(extensions)} if extensions.exists() else {}),
    }


def peak_of_launch(backend, processes, model, data, folder, args) -> int:
    output = folder / f"{backend}_{processes}"
    command = [sys.executable, "-c", PEAK, sys.executable, "-m", "accelerate.commands.launch"]
    command += ["--config_file", str(REPO / "accelerate_configs" / BACKENDS[backend])]
    command += ["--num_processes", str(processes), str(REPO / "train.py"), "--output_dir", str(output)]
    command += ["--model", str(model), "--data", str(data), "--dev_data", "", "--max_steps", "2"]
    command += ["--batch_size", str(args.batch_size), "--chunk_size", str(args.chunk_size)]
    command += ["--wandb_mode", "disabled", "--log_steps", "1"]
    done = subprocess.run(command, env=environment(folder, backend), cwd=REPO, capture_output=True, text=True)
    peak = [line.split() for line in done.stdout.splitlines() if line.startswith("PEAK")]
    if not peak or peak[-1][2] != "0":
        raise SystemExit(f"{backend} x {processes} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    if f"distributed_type: DistributedType.{RUNS_AS[backend]}\n" not in done.stdout:
        raise SystemExit(f"{backend} x {processes} did not run as {RUNS_AS[backend]}:\n{done.stdout[-4000:]}")
    return int(peak[-1][1]), resident_after_training(output)


def resident_after_training(output: Path) -> int:
    """The resident set train.py logs after the last step (memory/rss_gib, the largest process's): what a
    process holds while training, without the loading and the final gathering around it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output / "tensorboard" / "gradcache"))
    events.Reload()
    return int(events.Scalars("memory/rss_gib")[-1].value * 2**30)


def measure(args):
    points = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        parameters = build_model(folder, args.layers)
        data = write_pairs(folder / "pairs.jsonl", 4 * args.batch_size)
        for processes in args.processes:
            for backend in BACKENDS:
                peak, held = peak_of_launch(backend, processes, folder / "model", data, folder, args)
                points.append(
                    {"backend": backend, "processes": processes, "peak_bytes": peak, "held_bytes": held}
                )
                print(
                    f"{backend} x {processes}: peak {peak / 2**30:.2f} GiB, held {held / 2**30:.2f}",
                    flush=True,
                )
    return {"parameters": parameters, "points": points}


def ratio_to_ddp(results, point, key):
    ddp = next(p for p in results["points"] if p["processes"] == point["processes"] and p["backend"] == "ddp")
    return point[key] / ddp[key]


def table(results, args) -> str:
    """Peak per process, and its ratio to DDP's at the same number of processes."""
    state = results["parameters"] * 16 / 2**30  # fp32 weights, gradients, AdamW's two moments
    rows = [
        [p["processes"], p["backend"]]
        + [
            f"{p[key] / 2**30:.2f} ({ratio_to_ddp(results, p, key):.2f}x)"
            for key in ("held_bytes", "peak_bytes")
        ]
        for p in results["points"]
    ]
    header = [
        "processes",
        "backend",
        "held after the steps, GiB (vs DDP)",
        "peak of the whole run, GiB (vs DDP)",
    ]
    return (
        f"{results['parameters'] / 1e6:.1f}M parameters: {state:.2f} GiB of fp32 weights, gradients and "
        f"AdamW state unsharded; global batch {args.batch_size}, chunks of {args.chunk_size}, two steps.\n\n"
        + harness.markdown_table(header, rows)
    )


def plot(results, args, path):
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6, 4))
    for backend in BACKENDS:
        points = [p for p in results["points"] if p["backend"] == backend]
        axes.plot(
            [p["processes"] for p in points], [p["peak_bytes"] / 2**30 for p in points], "o-", label=backend
        )
    axes.set_xlabel("processes")
    axes.set_ylabel("peak resident set of the largest process (GiB)")
    axes.set_title(f"{results['parameters'] / 1e6:.0f}M-parameter BERT, batch {args.batch_size}")
    axes.legend()
    harness.save_figure(figure, path)


def main(argv=None):
    parser = harness.benchmark_parser(__doc__, PRESETS)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--processes", type=int, nargs="+")
    parser.add_argument("--batch_size", type=int)
    parser.add_argument("--chunk_size", type=int)
    image = "peak memory per process under DDP, ZeRO-3 and FSDP2"
    harness.run_benchmark("sharding_memory", parser, PRESETS, measure, table, plot, image, argv)


if __name__ == "__main__":
    main()
