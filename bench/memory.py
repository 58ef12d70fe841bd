"""Benchmark 1: peak memory of one training step against the batch size, at a fixed chunk size.

Plain full-batch training (until it no longer fits under the cap), this project's gradcache_step and
sentence-transformers' CachedMultipleNegativesRankingLoss at the same chunk size, on anchor, positive
and hard-negative columns of data/wordnet_train.jsonl.gz. On CPU every point runs in a fresh process and
reads the peak resident set above the one just before the step (bench/harness.py says what is in it); on
CUDA every point reads torch.cuda.max_memory_allocated above the memory allocated before the step.

    python bench/memory.py                               # CPU: batches 32..4096, about 1 h on 2 busy cores
    python bench/memory.py --device cuda --preset gpu    # one GPU: batches 32..32768, a few minutes
    python bench/memory.py --preset smoke                # tiny batches, seconds: the test suite runs this

Writes bench/results/memory_<preset>.{json,md,png}.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

import harness
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

ALL = list(harness.METHODS)
PRESETS = {
    "cpu": {"batch_sizes": [2**k for k in range(5, 13)], "chunk_size": 32, "cap_gib": 8.0, "methods": ALL},
    "gpu": {"batch_sizes": [2**k for k in range(5, 16)], "chunk_size": 32, "cap_gib": None, "methods": ALL},
    # the test suite's: seconds, two fresh processes (ST's point measures like plain's, its step runs in
    # the smoke run of speed.py)
    "smoke": {"batch_sizes": [16], "chunk_size": 4, "cap_gib": 8.0, "methods": ["plain", "ours"]},
}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
parser.add_argument("--preset", choices=PRESETS, default=None, help="default: gpu on cuda, cpu otherwise")
parser.add_argument("--batch_sizes", type=int, nargs="+", help="override the preset's batch sizes")
parser.add_argument("--chunk_size", type=int, help="override the preset's chunk size")
parser.add_argument(
    "--cap_gib", type=float, help="memory a step may use above its baseline (default: the preset's)"
)
parser.add_argument("--methods", nargs="+", choices=harness.METHODS, help="default: the preset's")
parser.add_argument("--out_dir", default=str(harness.RESULTS_DIR), help="where the results go")
parser.add_argument("--render_only", action="store_true", help="redo table and plot from the saved json")


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
                "device": args.device,
                "cap_bytes": cap_bytes,
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
    cap = "device memory" if args.cap_gib is None else f"{args.cap_gib:g} GiB"

    def cell(method, batch_size):
        point = by_key.get((method, batch_size))
        if point is None:
            return "not run (a smaller batch did not fit)" if method in {p["method"] for p in points} else "-"
        return harness.mib(point["step_peak_bytes"]) if point["fits"] else f"did not fit in {cap}"

    ours_reference = next(
        (by_key[("ours", b)] for b in (64, *args.batch_sizes) if ("ours", b) in by_key),
        None,
    )
    header = [
        "batch",
        "longest text (tokens)",
        "plain (MiB)",
        "ours (MiB)",
        "ours: peak during stage 2, the loss (MiB)",
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
                harness.mib(ours["phase_peak_bytes"]["loss"]) if ours and ours["fits"] else "-",
                cell("st", batch_size),
                f"{ours['step_peak_bytes'] / ours_reference['step_peak_bytes']:.2f}x"
                if ours and ours["fits"] and ours_reference
                else "-",
            ]
        )
    return harness.markdown_table(header, rows)


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
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(ticker.ScalarFormatter())
    axes.set_yscale("log", base=2)
    axes.yaxis.set_major_formatter(ticker.ScalarFormatter())
    axes.yaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_xlabel("batch size (examples; 3 texts each)")
    axes.set_ylabel("peak memory of one step above baseline (MiB)")
    axes.set_title(f"Memory of one training step, chunk {args.chunk_size} ({args.device})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def render(json_path):
    """The markdown table and the plot, from the points saved in `json_path` (the table can change alone)."""
    saved = json.loads(json_path.read_text())
    args, points = argparse.Namespace(**saved["settings"]), saved["points"]
    plot(points, args, json_path.with_suffix(".png"))
    markdown = "\n\n".join(
        [
            harness.provenance_markdown(saved["provenance"]),
            table(points, args),
            f"![memory vs batch size]({json_path.stem}.png)",
        ]
    )
    json_path.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)


def main(argv=None):
    args = parser.parse_args(argv)
    args.preset = args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")
    json_path = Path(args.out_dir) / f"memory_{args.preset}.json"
    if args.render_only:
        render(json_path)
        return
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    command = shlex.join(["python", "bench/memory.py", *(sys.argv[1:] if argv is None else argv)])
    info = harness.provenance(args.device, command)
    points = measure(args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"provenance": info, "settings": vars(args), "points": points}, indent=1))
    render(json_path)


if __name__ == "__main__":
    main()
