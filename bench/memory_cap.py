"""Benchmark 3: the largest batch whose training step fits under a fixed memory cap, plain vs this project.

The cap is memory a step may allocate beyond what the process holds just before it (model, AdamW state,
the batch: tokenized for plain; for ours texts and token counts, each chunk tokenized in the step, as
train.py does). CPU: every probe runs in a fresh process whose address space is limited to its
size before the step plus the cap (RLIMIT_AS), so an allocation beyond it fails; CUDA: the process's
share of the device is limited the same way (torch.cuda.set_per_process_memory_fraction). The search
doubles the batch from --start_batch until a step fails or --max_batch is reached, then bisects between
the last batch that fit and the first that did not (multiples of 8).

    python bench/memory_cap.py                              # CPU: cap 1 GiB, about 15 min on 2 cores
    python bench/memory_cap.py --device cuda --preset gpu   # one GPU: cap 16 GiB, a few minutes
    python bench/memory_cap.py --preset smoke               # seconds: the test suite runs this

Writes bench/results/memory_cap_<preset>.{json,md,png}.
"""

import harness
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

PRESETS = {
    "cpu": {"cap_gib": 1.0, "chunk_size": 32, "start_batch": 32, "max_batch": 4096, "bisections": 3},
    "gpu": {"cap_gib": 16.0, "chunk_size": 32, "start_batch": 256, "max_batch": 2**17, "bisections": 4},
    "smoke": {"cap_gib": 0.25, "chunk_size": 4, "start_batch": 16, "max_batch": 16, "bisections": 0},
}
METHODS = ("plain", "ours")

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--cap_gib", type=float, help="memory a step may use beyond the process's before it")
parser.add_argument("--chunk_size", type=int, help="chunk size of ours")
parser.add_argument("--start_batch", type=int, help="first batch tried")
parser.add_argument("--max_batch", type=int, help="largest batch tried (bounds the run time)")
parser.add_argument("--bisections", type=int, help="bisection probes after the doubling")
parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))


def search(method, args):
    """Every probe of one method; the batch it fits and the one it does not come from them."""
    on_cuda = args.device.startswith("cuda")
    measure_point = harness.measure_step_memory if on_cuda else harness.measure_in_fresh_process
    probes = []

    def fits(batch_size):
        point = measure_point(
            method=method,
            batch_size=batch_size,
            chunk_size=args.chunk_size,
            device=args.device,
            cap_bytes=int(args.cap_gib * 2**30),
            tokenize_per_chunk=method == "ours",  # as train.py: the batch is never tokenized as a whole
        )
        probes.append(point)
        print(f"{method:>5} batch {batch_size:>6}: {'fits' if point['fits'] else 'does not fit'}", flush=True)
        return point["fits"]

    batch_size, largest_fit, smallest_failure = args.start_batch, None, None
    while batch_size <= args.max_batch:
        if not fits(batch_size):
            smallest_failure = batch_size
            break
        largest_fit, batch_size = batch_size, batch_size * 2
    for _ in range(args.bisections if largest_fit and smallest_failure else 0):
        middle = (largest_fit + smallest_failure) // 16 * 8
        if middle <= largest_fit:
            break
        if fits(middle):
            largest_fit = middle
        else:
            smallest_failure = middle
    return {
        "method": method,
        "largest_fit": largest_fit,
        "smallest_failure": smallest_failure,
        "probes": probes,
    }


def describe_largest(result, args):
    if result["largest_fit"] is None:
        return f"none (batch {args.start_batch} did not fit)"
    if result["smallest_failure"] is None:
        return f"{result['largest_fit']} or more (the search stops at {args.max_batch})"
    return str(result["largest_fit"])


def table(results, args):
    rows = []
    for result in results:
        probes = ", ".join(
            f"{p['batch_size']}: " + (f"{harness.mib(p['step_peak_bytes'])} MiB" if p["fits"] else "no")
            for p in sorted(result["probes"], key=lambda p: p["batch_size"])
        )
        rows.append(
            [
                harness.METHOD_LABELS[result["method"]],
                describe_largest(result, args),
                result["smallest_failure"] or "-",
                probes,
            ]
        )
    by_method = {result["method"]: result for result in results}
    lines = [
        f"Cap: {args.cap_gib:g} GiB beyond the process's memory before the step; chunk {args.chunk_size}.",
        harness.markdown_table(
            ["method", "largest batch that fit", "smallest that did not", "probes (batch: step peak)"], rows
        ),
    ]
    if all(by_method.get(m, {}).get("largest_fit") for m in METHODS):
        ratio = by_method["ours"]["largest_fit"] / by_method["plain"]["largest_fit"]
        bound = "at least " if by_method["ours"]["smallest_failure"] is None else ""
        lines.append(f"Largest batch, ours / plain: {bound}{ratio:.0f}x.")
    return "\n\n".join(lines)


def plot(results, args, path):
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for result in results:
        probes = sorted(result["probes"], key=lambda p: p["batch_size"])
        label = harness.METHOD_LABELS[result["method"]]
        fitting = [p for p in probes if p["fits"]]
        (line,) = axes.plot(
            [p["batch_size"] for p in fitting],
            [p["step_peak_bytes"] / 2**20 for p in fitting],
            marker="o",
            label=f"{label}: fits",
        )
        failed = [p["batch_size"] for p in probes if not p["fits"]]
        if failed:
            axes.plot(
                failed,
                [args.cap_gib * 1024] * len(failed),
                marker="x",
                markersize=9,
                linestyle="none",
                color=line.get_color(),
                label=f"{label}: did not fit",
            )
    axes.axhline(args.cap_gib * 1024, color="black", linewidth=0.8, linestyle="--", label="cap")
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(ticker.ScalarFormatter())
    axes.set_xlabel("batch size (examples; 3 texts each)")
    axes.set_ylabel("peak memory of one step above baseline (MiB)")
    axes.set_title(f"Batch sizes probed under a {args.cap_gib:g} GiB cap ({args.device})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def measure(args):
    return [search(method, args) for method in args.methods]


def main(argv=None):
    image = "largest batch under a memory cap"
    harness.run_benchmark("memory_cap", parser, PRESETS, measure, table, plot, image, argv)


if __name__ == "__main__":
    main()
