"""Benchmark 6: what gradient checkpointing inside the chunks saves in memory, and what it costs in time.

A training step of gradcache_step (gradient and AdamW step) at a fixed batch, for a few chunk sizes, with
and without gradient checkpointing, switched on as train.py's --gradient_checkpointing does (its
prepare_model: transformers' activation checkpointing, non-reentrant). Texts are tokenized chunk by
chunk, as train.py feeds them. Memory: the peak of one step above the process's memory just before it
(bench/harness.py says what is in it); on CPU every point runs in a fresh process, --workers of them at
a time (each reads its own resident set). Time: in one process, a model with checkpointing and one
without take turns on the same batch, the order swapped every round; the ratio is the median of the
per-round ratios, so a load change on the machine hits both sides alike.

    python bench/checkpointing.py                               # CPU: batch 256, about 15 min on 2 busy cores
    python bench/checkpointing.py --device cuda --preset gpu    # one GPU: batch 4096, a few minutes
    python bench/checkpointing.py --preset smoke                # seconds: the test suite runs this

Writes bench/results/checkpointing_<preset>.{json,md,png}.
"""

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import harness
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULTS = {"num_layers": None}
PRESETS = {
    # CPU: a chunk of the whole batch (256) is where checkpointing saves most; two rounds keep the run
    # near a quarter of an hour on a busy machine.
    "cpu": {"batch_size": 256, "chunk_sizes": [16, 64, 256], "rounds": 2, "workers": 2} | DEFAULTS,
    "gpu": {"batch_size": 4096, "chunk_sizes": [256, 1024, 4096], "rounds": 5, "workers": 1} | DEFAULTS,
    # the test suite's: seconds, a model cut to two layers
    "smoke": {"batch_size": 32, "chunk_sizes": [32], "rounds": 1, "workers": 2, "num_layers": 2},
}
VARIANTS = {"without": False, "with": True}  # name -> gradient checkpointing on
WARMUP_BATCH = 8

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--batch_size", type=int, help="the batch of every point")
parser.add_argument("--chunk_sizes", type=int, nargs="+", help="chunk sizes (examples) compared")
parser.add_argument("--rounds", type=int, help="timed steps of each variant per chunk size")
parser.add_argument("--workers", type=int, help="CPU: memory points measured at once, one process each")
parser.add_argument("--num_layers", type=int, help="keep only the model's first layers (the smoke preset)")


def memory_points(args):
    """One point per (chunk size, variant): the keyword arguments of harness.measure_step_memory."""
    return [
        {
            "method": "ours",
            "batch_size": args.batch_size,
            "chunk_size": chunk_size,
            "device": args.device,
            "num_layers": args.num_layers,
            "tokenize_per_chunk": True,
            "gradient_checkpointing": checkpointing,
        }
        for chunk_size in args.chunk_sizes
        for checkpointing in VARIANTS.values()
    ]


def prepare_timing(args):
    """The two models, their optimizers warmed up by a small step (lazy initializations, AdamW's state)."""
    models = {name: harness.load_model(args.device, args.num_layers) for name in VARIANTS}
    harness.checkpoint_activations(models["with"])
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=2e-5) for name, model in models.items()}
    texts = harness.load_texts(WARMUP_BATCH + args.batch_size, repeat=args.device.startswith("cuda"))
    warmup = harness.text_batch(models["without"], texts, 0, WARMUP_BATCH)
    for name, model in models.items():
        harness.make_train_step(harness.make_step("ours", model, WARMUP_BATCH), optimizers[name])(warmup)
    batch = harness.text_batch(models["without"], texts, WARMUP_BATCH, args.batch_size)
    return models, optimizers, batch


def time_steps(models, optimizers, batch, args):
    """Seconds per step of each variant, per chunk size: the two models take turns on the same batch."""
    timings = []
    for chunk_size in args.chunk_sizes:
        steps = {
            name: harness.make_train_step(harness.make_step("ours", model, chunk_size), optimizers[name])
            for name, model in models.items()
        }
        seconds = {name: [] for name in VARIANTS}
        for round_index in range(args.rounds):
            order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                harness.synchronize(args.device)
                started = time.perf_counter()
                steps[name](batch)
                harness.synchronize(args.device)
                seconds[name].append(time.perf_counter() - started)
                print(f"chunk {chunk_size:>5}, {name} checkpointing: {seconds[name][-1]:.2f} s", flush=True)
        timings.append({"chunk_size": chunk_size, "seconds": seconds})
    return timings


def measure(args):
    """Memory points first, then the timed rounds. On CPU each point runs in its own process while the
    timing's models load in this one; on CUDA the allocator's statistics are the device's, so the points
    run here, one after the other, before anything else is loaded."""
    points = memory_points(args)
    if args.device.startswith("cuda"):
        memory = [harness.measure_step_memory(**point) for point in points]
        models, optimizers, batch = prepare_timing(args)
    else:
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            pending = pool.map(lambda point: harness.measure_in_fresh_process(**point), points)
            models, optimizers, batch = prepare_timing(args)
            memory = list(pending)
    for point, result in zip(points, memory, strict=True):
        result["gradient_checkpointing"] = point["gradient_checkpointing"]
        state = "on " if point["gradient_checkpointing"] else "off"
        peak = harness.mib(result["step_peak_bytes"])
        print(f"chunk {point['chunk_size']:>5}, checkpointing {state}: {peak} MiB", flush=True)
    timings = time_steps(models, optimizers, batch, args)
    parameter_bytes = sum(p.numel() * p.element_size() for p in models["without"].parameters())
    return {"memory": memory, "time": timings, "parameter_bytes": parameter_bytes}


def time_ratios(timing):
    seconds = timing["seconds"]
    return [with_ / without for with_, without in zip(seconds["with"], seconds["without"], strict=True)]


def rows_by_chunk(results):
    """chunk size -> (point without, point with, timing), in the order of the chunk sizes."""
    peaks = {(p["chunk_size"], p["gradient_checkpointing"]): p for p in results["memory"]}
    return {
        t["chunk_size"]: (peaks[t["chunk_size"], False], peaks[t["chunk_size"], True], t)
        for t in results["time"]
    }


def table(results, args):
    rows, savings = [], {}
    for chunk_size, (without, with_, timing) in rows_by_chunk(results).items():
        ratios = time_ratios(timing)
        savings[chunk_size] = without["step_peak_bytes"] - with_["step_peak_bytes"]
        rows.append(
            [
                chunk_size,
                harness.mib(without["step_peak_bytes"]),
                harness.mib(with_["step_peak_bytes"]),
                f"{with_['step_peak_bytes'] / without['step_peak_bytes']:.2f}x",
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                f"{statistics.median(timing['seconds']['without']):.2f}",
                f"{statistics.median(timing['seconds']['with']):.2f}",
            ]
        )
    header = [
        "chunk (examples)",
        "peak without (MiB)",
        "peak with (MiB)",
        "peak with / without",
        "step time with / without",
        "s/step without",
        "s/step with",
    ]
    smallest, largest = min(savings), max(savings)
    lines = [
        f"Batch {args.batch_size}, all-MiniLM-L6-v2"
        + (f" cut to its first {args.num_layers} layer(s)" if args.num_layers else "")
        + ", this project's gradcache_step with texts tokenized per chunk (as train.py runs it), with and "
        "without `--gradient_checkpointing` (train_parts.models.prepare_model). Peak: one step "
        "(gradient and AdamW step) above the process's memory before it, each point measured alone. Step "
        f"time: median of the per-round ratios over {args.rounds} round(s), the two models taking turns "
        "on the same batch (lowest-highest in brackets); seconds are medians.",
        harness.markdown_table(header, rows),
        f"Checkpointing saves {harness.mib(savings[largest])} MiB of a step's peak at chunk {largest}"
        + (f", {harness.mib(savings[smallest])} MiB at chunk {smallest}" if smallest != largest else "")
        + ". Every step also allocates the gradient of every parameter, "
        f"{harness.mib(results['parameter_bytes'])} MiB here, whatever the chunk.",
    ]
    return "\n\n".join(lines)


def plot(results, args, path):
    by_chunk = rows_by_chunk(results)
    chunks = list(by_chunk)
    figure, (memory_axes, time_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for index, name in enumerate(VARIANTS):
        peaks = [by_chunk[chunk][index]["step_peak_bytes"] / 2**20 for chunk in chunks]
        memory_axes.plot(chunks, peaks, marker="o", label=f"{name} gradient checkpointing")
    harness.log_axes(
        memory_axes,
        "peak memory of one step above baseline (MiB)",
        f"Peak memory at batch {args.batch_size} ({args.device})",
        xlabel="chunk size (examples)",
    )
    ratios = [statistics.median(time_ratios(by_chunk[chunk][2])) for chunk in chunks]
    time_axes.plot(chunks, ratios, marker="o", label="with / without")
    time_axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    harness.log_axes(
        time_axes,
        "step time ratio",
        "Step time, checkpointing on / off (median of rounds)",
        xlabel="chunk size (examples)",
        log_y=False,
    )
    harness.save_figure(figure, path)


def main(argv=None):
    image = "peak memory and step time with and without gradient checkpointing"
    harness.run_benchmark("checkpointing", parser, PRESETS, measure, table, plot, image, argv)


if __name__ == "__main__":
    main()
