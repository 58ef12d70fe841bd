"""Assembles bench/RESULTS.md from what the benchmark scripts wrote into bench/results/.

Every number in RESULTS.md comes from those files: the tables each script wrote, and the targets of the
issue checked against its JSON. Run a benchmark again, then this:

    python bench/make_results.py

A section whose results are missing says which command fills it.
"""

import argparse
import json
import math
import os
import re
import statistics
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SECTIONS = {
    "memory": "1. Peak memory of one training step against the batch size",
    "speed": "2. Cost of a step",
    "memory_cap": "3. Largest batch under a memory cap",
    "quality": "4. Batch size and quality",
}
DEVICES = {"cpu": "", "gpu": " --device cuda --preset gpu", "smoke": " --preset smoke"}
MEMORY_TARGET, ST_TARGET, PLAIN_TARGET = 1.15, 0.7, 1.25

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--results_dir", default=str(BENCH_DIR / "results"))
parser.add_argument("--presets", nargs="+", default=["cpu", "gpu"], help="the first one is checked")
parser.add_argument("--output", default=str(BENCH_DIR / "RESULTS.md"))


def load(results_dir, name, preset):
    path = results_dir / f"{name}_{preset}.json"
    return json.loads(path.read_text()) if path.exists() else None


def verdict(measured, limit):
    if measured <= limit:
        return "met"
    return f"missed by {measured / limit - 1:.0%}"


def mib(num_bytes):
    return f"{num_bytes / 2**20:,.0f} MiB"


def memory_targets(saved):
    """Ours flat (largest batch vs batch 64, or the smallest run), plain growing."""
    points = {(p["method"], p["batch_size"]): p for p in saved["points"]}
    ours = sorted(b for m, b in points if m == "ours" and points[m, b]["fits"])
    plain = sorted(b for m, b in points if m == "plain" and points[m, b]["fits"])
    rows, why = [], []
    if len(ours) >= 2:
        small, large = 64 if 64 in ours else ours[0], ours[-1]
        peak_small, peak_large = points["ours", small], points["ours", large]
        ratio = peak_large["step_peak_bytes"] / peak_small["step_peak_bytes"]
        rows.append(
            [
                f"memory: ours' step peak at batch {large} at most {MEMORY_TARGET}x the one at batch {small}",
                f"{ratio:.2f}x ({mib(peak_large['step_peak_bytes'])} against "
                f"{mib(peak_small['step_peak_bytes'])})",
                verdict(ratio, MEMORY_TARGET),
            ]
        )
        if ratio > MEMORY_TARGET:
            why.append(memory_miss(points, small, large))
    if len(plain) >= 2:
        first, last = points["plain", plain[0]], points["plain", plain[-1]]
        failed = [p["batch_size"] for p in saved["points"] if p["method"] == "plain" and not p["fits"]]
        stop = f"; batch {failed[0]} did not fit in {saved['settings']['cap_gib']:g} GiB" if failed else ""
        grows = all(
            points["plain", a]["step_peak_bytes"] < points["plain", b]["step_peak_bytes"]
            for a, b in zip(plain, plain[1:], strict=False)
        )
        rows.append(
            [
                "memory: plain training grows with the batch",
                f"batch {plain[0]}: {mib(first['step_peak_bytes'])}, batch {plain[-1]}: "
                f"{mib(last['step_peak_bytes'])}{stop}",
                "met" if grows else "missed: not increasing",
            ]
        )
    return rows, why


def memory_miss(points, small, large):
    """Where ours' growth comes from, from the phase peaks and the longest texts of each batch."""
    low, high = points["ours", small], points["ours", large]
    st = points.get(("st", large))
    st_note = (
        f" Sentence-transformers' cached loss, which chunks that loss, peaks at {mib(st['step_peak_bytes'])} "
        f"at batch {large}: the same growth, from the same longest chunk."
        if st
        else ""
    )
    chunks_high, chunks_low = high["phase_peak_bytes"]["chunks"], low["phase_peak_bytes"]["chunks"]
    same_length = min(
        b
        for m, b in points
        if m == "ours" and points[m, b].get("longest_text_tokens") == high["longest_text_tokens"]
    )
    same_length_note = (
        f" From batch {same_length} to {large}, whose longest texts have the same length, the peak grows "
        f"{high['step_peak_bytes'] / points['ours', same_length]['step_peak_bytes']:.2f}x."
        if same_length < large
        else ""
    )
    process_ratio = (high["baseline_bytes"] + high["step_peak_bytes"]) / (
        low["baseline_bytes"] + low["step_peak_bytes"]
    )
    return (
        f"Memory: at batch {large} the peak during the chunks (stages 1 and 3, with the optimizer) is "
        f"{mib(chunks_high)} against {mib(chunks_low)} at batch {small}: a chunk is padded to its longest "
        "text, and the chunk holding the batch's longest texts costs the most; the longest text is "
        f"{high['longest_text_tokens']} tokens at batch {large} against {low['longest_text_tokens']} at "
        f"batch {small}, and attention memory grows with the square of it.{same_length_note} The peak "
        "during stage 2, the "
        f"loss over the whole batch (a {large} x {2 * large} score matrix, its softmax and their gradients, "
        f"not chunked), is {mib(high['phase_peak_bytes']['loss'])}, growing with the square of the batch."
        f"{st_note} Counted with what the process holds before the step (model, AdamW state, libraries: "
        f"{mib(high['baseline_bytes'])}), the peak at batch {large} is {process_ratio:.2f}x the one at "
        f"batch {small}."
    )


def paired_ratios(runs, numerator, denominator):
    return [a["seconds"] / b["seconds"] for a, b in zip(runs[numerator], runs[denominator], strict=True)]


def speed_targets(saved):
    rows, why = [], []
    measurements = saved["results"]["measurements"]
    for other, limit in (("ST cached", ST_TARGET), ("plain", PLAIN_TARGET)):
        measured = [
            (m["batch_size"], statistics.median(paired_ratios(m["runs"], "ours", other)), m)
            for m in measurements
            if other in m["runs"] and "ours" in m["runs"]
        ]
        if not measured:
            continue
        worst = max(ratio for _, ratio, _ in measured)
        rows.append(
            [
                f"speed: a step of ours at most {limit}x one of {other} at equal batch"
                + (" and chunk" if other == "ST cached" else ", where plain fits"),
                ", ".join(f"batch {batch}: {ratio:.2f}x" for batch, ratio, _ in measured),
                verdict(worst, limit),
            ]
        )
        if worst > limit:
            missed = [m for _, ratio, m in measured if ratio > limit]
            why.append(speed_miss(other, missed, saved["settings"]["chunk_size"]))
    agreement = saved["results"]["agreement"]
    difference = agreement["max_gradient_difference"]["ours"]
    rows.append(
        [
            "exactness: no speed-up changes the gradient",
            f"ours vs plain at batch {agreement['batch_size']}, dropout off: largest gradient difference "
            f"{difference:.1e} of the largest gradient (float32 rounding); the exactness tests are "
            "tests/test_gradcache.py",
            "met" if difference < 1e-4 else "missed",
        ]
    )
    return rows, why


def median_part(measurement, name, *parts):
    return statistics.median(sum(p.get(part, 0.0) for part in parts) for p in measurement["parts"][name])


def speed_miss(other, measurements, chunk_size):
    """Where ours' time goes at the batches that missed, against the other variant's."""
    smallest = min(m["batch_size"] for m in measurements)
    chunks_per_column = math.ceil(smallest / chunk_size)
    notes = []
    for m in measurements:
        batch, step = m["batch_size"], median_part(m, "ours", *m["parts"]["ours"][0])
        encoding = {
            name: median_part(m, name, "forward no grad", "forward with grad")
            for name in ("ours", "ours, unsorted", other)
            if name in m["parts"]
        }
        overhead = median_part(m, "ours", "stage 2: loss and its gradient", "selecting chunks")
        note = (
            f"batch {batch}: ours spends {overhead:.2f} s of a {step:.2f} s step in stage 2 and chunk "
            f"selection, the rest in the model (forward passes {encoding['ours']:.2f} s against "
            f"{encoding[other]:.2f} s for {other}, then backward)"
        )
        if "ours, unsorted" in encoding:
            note += (
                f"; sorting by length cuts the forward time to "
                f"{encoding['ours'] / encoding['ours, unsorted']:.2f}x of chunks in batch order"
            )
        notes.append(note)
    return (
        f"Speed against {other}: "
        + "; ".join(notes)
        + ". The saving is padding: a chunk is padded to its longest text, so it grows with the number of "
        f"chunks a column is cut into ({chunks_per_column} per column at batch {smallest} with chunk "
        f"{chunk_size}) and with the spread of lengths."
    )


def quality_claim(saved):
    trained = [run for run in saved["runs"] if run["batch_size"]]
    if len(trained) < 2:
        return [], []
    increasing = all(a["mrr@10"] < b["mrr@10"] for a, b in zip(trained, trained[1:], strict=False))
    row = [
        "claim of the paper: a bigger batch gives better representations (equal epochs)",
        "dev MRR@10 "
        + ", ".join(f"batch {run['batch_size']}: {run['mrr@10']:.4f}" for run in trained)
        + f" (before fine-tuning {saved['runs'][0]['mrr@10']:.4f})",
        "holds here" if increasing else "not seen in this run",
    ]
    steps = [run.get("optimizer_steps") for run in trained]
    why = []
    if not increasing and all(steps):
        why.append(
            "Quality: with equal epochs a bigger batch takes fewer optimizer steps ("
            + ", ".join(f"batch {run['batch_size']}: {n}" for run, n in zip(trained, steps, strict=True))
            + f") over {saved['settings']['train_examples'] or 'all'} training examples, one run per batch "
            "size: too few updates at the largest batch to test the claim. The GPU preset trains on all "
            "examples."
        )
    return [row], why


def section_text(results_dir, name, preset, output):
    path = results_dir / f"{name}_{preset}.md"
    if not path.exists():
        return f"Not measured yet: `python bench/{name}.py{DEVICES.get(preset, ' --preset ' + preset)}`."
    # Images are linked relative to results/; RESULTS.md lives elsewhere.
    prefix = os.path.relpath(results_dir, output.parent)
    return re.sub(r"\]\(([^)/]+\.png)\)", rf"]({prefix}/\1)", path.read_text().strip())


def main(argv=None):
    args = parser.parse_args(argv)
    results_dir, output = Path(args.results_dir), Path(args.output)
    checked = args.presets[0]
    target_rows, why = [], []
    memory, speed = load(results_dir, "memory", checked), load(results_dir, "speed", checked)
    quality = load(results_dir, "quality", checked)
    for saved, check in ((memory, memory_targets), (speed, speed_targets), (quality, quality_claim)):
        if saved is not None:
            rows, reasons = check(saved)
            target_rows += rows
            why += reasons
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python bench/make_results.py` from bench/results/, where the benchmark scripts write "
        "their tables, plots and JSON; no number here is typed by hand. Each section names the command, "
        "date, commit and machine of its run.",
        "",
        "Compared: a training step of all-MiniLM-L6-v2 on anchor, positive and hard-negative columns of "
        "data/wordnet_train.jsonl.gz, in-batch negatives with cosine similarity (`contrastive_loss` at "
        "`harness.SCALE`), computed three ways: **plain** (the full batch through the model at once), "
        "**ours** (`gradcache.gradcache_step`) and **ST cached** (sentence-transformers' "
        "`CachedMultipleNegativesRankingLoss`) at the same chunk.",
        "",
        f"## Targets (checked on the {checked} results)",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
        *("| " + " | ".join(row) + " |" for row in target_rows),
    ]
    if why:
        lines += ["", "### Why the misses", "", *(f"- {reason}" for reason in why)]
    for name, title in SECTIONS.items():
        lines += ["", f"## {title}"]
        for preset in args.presets:
            lines += ["", f"### {preset.upper()}", "", section_text(results_dir, name, preset, output)]
    lines += [
        "",
        "## Filling in the GPU column",
        "",
        "On a machine with one GPU, from the repository root: one command per benchmark, each preset sized "
        "for a few minutes on an H200 (estimates: the GPU presets have not run yet), then the assembly. "
        "Where the results must travel back (the project's device tool returns what is written under "
        "$OUT), add `--out_dir $OUT` to each and copy the files into bench/results/ before assembling.",
        "",
        *(f"    python bench/{name}.py{DEVICES['gpu']}" for name in SECTIONS),
        "    python bench/make_results.py",
    ]
    output.write_text("\n".join(lines) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
