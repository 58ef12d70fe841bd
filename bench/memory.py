"""Benchmark 1: peak memory of one training step against the batch size, at a fixed chunk budget.

Plain full-batch training (until it no longer fits under the cap), this project's gradcache_step and
sentence-transformers' CachedMultipleNegativesRankingLoss at the same chunk budget (a token budget where
the preset names one, else a number of examples), on anchor, positive and hard-negative columns of
data/wordnet_train.jsonl.gz. Ours gets texts and token counts and tokenizes each chunk in the step, as
train.py does; plain and ST get the batch tokenized beforehand. For ours, stage 2 (the loss and its
gradients) is also read alone: its peak above the memory at its own start, i.e. above its inputs and the
graph of the chunk kept for reuse.
On CPU every point runs in a fresh process and reads the peak resident set above the one just before
the step (bench/harness.py says what is in it); on CUDA every point reads torch.cuda.max_memory_allocated
above the memory allocated before the step.

    python bench/memory.py                               # CPU: batches 32..4096, about 1 h on 2 busy cores
    python bench/memory.py --device cuda --preset gpu    # one GPU: batches 32..32768, a few minutes
    python bench/memory.py --preset smoke                # tiny batches, seconds: the test suite runs this

Writes bench/results/memory_<preset>.{json,md,png}.
"""

import harness
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ALL = list(harness.METHODS)
# chunk_tokens: ours chunks by that padded-token budget, ST's cached loss by that many tokens (its
# mini_batch_num_tokens); None chunks both by chunk_size examples.
PRESETS = {
    "cpu": {
        "batch_sizes": [2**k for k in range(5, 13)],
        "chunk_size": 32,
        "chunk_tokens": 1024,
        "cap_gib": 8.0,
        "methods": ALL,
    },
    "gpu": {
        "batch_sizes": [2**k for k in range(5, 16)],
        "chunk_size": 32,
        "chunk_tokens": 8192,
        "cap_gib": None,
        "methods": ALL,
    },
    # the test suite's: seconds, two fresh processes (ST's point measures like plain's, its step runs in
    # the smoke run of speed.py)
    "smoke": {
        "batch_sizes": [16],
        "chunk_size": 4,
        "chunk_tokens": None,
        "cap_gib": 8.0,
        "methods": ["plain", "ours"],
    },
}

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--batch_sizes", type=int, nargs="+", help="override the preset's batch sizes")
parser.add_argument("--chunk_size", type=int, help="override the preset's chunk size")
parser.add_argument("--chunk_tokens", type=int, help="override the preset's chunk token budget")
parser.add_argument(
    "--cap_gib", type=float, help="memory a step may use above its baseline (default: the preset's)"
)
parser.add_argument("--methods", nargs="+", choices=harness.METHODS, help="default: the preset's")


def measure(args):
    """Every (method, batch) point; a method stops at the first batch that does not fit."""
    cap_bytes = None if args.cap_gib is None else int(args.cap_gib * 2**30)
    on_cuda = args.device.startswith("cuda")
    points = []
    for method in args.methods:
        for batch_size in args.batch_sizes:
            kwargs = {
                "method": method,
                "batch_size": batch_size,
                "chunk_size": args.chunk_size,
                "chunk_tokens": args.chunk_tokens,
                "device": args.device,
                "cap_bytes": cap_bytes,
                # ours as train.py runs it: each chunk tokenized in the step, the batch never padded whole
                "tokenize_per_chunk": method == "ours",
            }
            # CUDA's allocator statistics are exact per window; CPU needs a fresh process per point.
            point = (
                harness.measure_step_memory(**kwargs)
                if on_cuda
                else harness.measure_in_fresh_process(**kwargs)
            )
            points.append(point)
            shown = harness.mib(point["step_peak_bytes"]) + " MiB" if point["fits"] else "did not fit"
            print(f"{method:>5} batch {batch_size:>6}: {shown}", flush=True)
            if not point["fits"]:
                break
    return points


def table(points, args):
    by_key = {(p["method"], p["batch_size"]): p for p in points}

    def cell(method, batch_size):
        return harness.memory_cell(points, "method", method, batch_size, "step_peak_bytes", args.cap_gib)

    ours_reference = next(
        (by_key[("ours", b)] for b in (64, *args.batch_sizes) if ("ours", b) in by_key),
        None,
    )
    header = [
        "batch",
        "longest text (tokens)",
        "plain (MiB)",
        "ours (MiB)",
        "ours: stage 2, the loss, above its inputs (MiB)",
        "ST cached (MiB)",
        f"ours / ours at batch {ours_reference['batch_size'] if ours_reference else '-'}",
    ]
    rows = []
    for batch_size in args.batch_sizes:
        ours = by_key.get(("ours", batch_size))
        longest = max(
            (p.get("longest_text_tokens", 0) for p in points if p["batch_size"] == batch_size), default=0
        )
        rows.append(
            [
                batch_size,
                longest or "-",
                cell("plain", batch_size),
                cell("ours", batch_size),
                loss_stage_cell(ours),
                cell("st", batch_size),
                f"{ours['step_peak_bytes'] / ours_reference['step_peak_bytes']:.2f}x"
                if ours and ours["fits"] and ours_reference
                else "-",
            ]
        )
    return harness.markdown_table(header, rows)


def loss_stage_cell(ours):
    """What stage 2 allocates itself; results of older scripts only have its peak above the step's start."""
    if not ours or not ours["fits"]:
        return "-"
    if "phase_added_bytes" not in ours:
        return "not measured by this run's script"
    return harness.mib(ours["phase_added_bytes"]["loss"])


def chunking_description(args):
    if getattr(args, "chunk_tokens", None):
        return f"chunks of {args.chunk_tokens} tokens"
    return f"chunk {args.chunk_size}"


def plot(points, args, path):
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for method in args.methods:
        fitting = [p for p in points if p["method"] == method and p["fits"]]
        if fitting:
            axes.plot(
                [p["batch_size"] for p in fitting],
                [p["step_peak_bytes"] / 2**20 for p in fitting],
                marker="o",
                label=harness.METHOD_LABELS[method],
            )
        failed = [p for p in points if p["method"] == method and not p["fits"]]
        if failed and args.cap_gib is not None:
            axes.plot(
                [p["batch_size"] for p in failed],
                [args.cap_gib * 1024] * len(failed),
                marker="x",
                linestyle="none",
                color="black",
                label=f"{harness.METHOD_LABELS[method]}: did not fit in {args.cap_gib:g} GiB",
            )
    harness.log_axes(
        axes,
        ylabel="peak memory of one step above baseline (MiB)",
        title=f"Memory of one training step, {chunking_description(args)} ({args.device})",
    )
    harness.save_figure(figure, path)


def main(argv=None):
    harness.run_benchmark("memory", parser, PRESETS, measure, table, plot, "memory vs batch size", argv)


if __name__ == "__main__":
    main()
