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
    "scale": "5. How far the batch goes: full steps to 65,536, the loss stage alone, its masks, the guide, "
    "no in-batch negatives, a sparse encoder",
    "checkpointing": "6. Gradient checkpointing inside the chunks: memory saved, time paid",
    "budget": "7. Budgeted Gradient Cache: the stage-1 graphs kept against the no-cache lower bound",
    "data_scale": "8. Data beyond memory: millions of triples converted once, memory-mapped by 2 processes",
    "sharding_memory": "9. Sharded models: peak memory per process under DDP, ZeRO-3 and FSDP2",
    "multi_vector_memory": "10. Multi-vector (ColBERT) models: a step's memory beyond its token matrices, "
    "beside sentence-transformers' cached loss",
}
BUDGET_ALL_TARGET, BUDGET_LINEAR_POINTS = 1.05, 0.05  # every graph kept: the lower bound's compute
DEVICES = {"cpu": "", "gpu": " --device cuda --preset gpu", "smoke": " --preset smoke"}
# The commands that fill a section, where it is not `python bench/<name>.py` with the device's flags.
COMMANDS = {
    ("budget", "cpu"): "speed.py --budget_sweep --rounds 3",
    ("budget", "gpu"): "gpu_check.py --budget_sweep",
    ("data_scale", "cpu"): "data_scale.py --sizes 1000000 3000000 10000000",
    ("data_scale", "gpu"): "data_scale.py  # the data path is the CPU's alone: the CPU section stands",
    ("sharding_memory", "gpu"): "gpu_check.py  # FSDP2 on 2 GPUs; the CPU section measures the sharding",
}


def command(name, preset):
    script = COMMANDS.get((name, preset)) or f"{name}.py{DEVICES.get(preset, ' --preset ' + preset)}"
    return f"python bench/{script}"


MEMORY_TARGET, ST_TARGET, PLAIN_TARGET, TILED_TIME_TARGET = 1.15, 0.7, 1.25, 1.3
ST_TARGET_MIN_BATCH, TILED_TIME_MAX_BATCH, FULL_STEP_BATCH = 256, 4096, 65536
LOSS_STAGE_TARGETS = {16384: 2**30, 65536: 2 * 2**30}  # batch -> bytes the loss stage may add
MASKED_LOSS_TARGET = (16384, 2**30)  # with the false-negative masks on, their inputs counted too
# Without in-batch negatives, no cache: group_step skips the second forward, so its step is faster
GROUP_SPEED_TARGET = 1.0
# A sparse step beyond its vocabulary-sized representations and their gradients: flat in the batch
SPARSE_FLAT_TARGET = 1.25  # at the larger batch, at most this times the smaller batch's
# A multi-vector (ColBERT) step beyond its token matrices and their gradients: flat in the batch, asked of
# batches 1,024 and 4,096
MULTI_VECTOR_FLAT_TARGET, MULTI_VECTOR_BATCHES = 1.25, (1024, 4096)

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
    """Ours flat with a token budget (largest batch vs batch 64, or the smallest run), plain growing."""
    points = {(p["method"], p["batch_size"]): p for p in saved["results"]}
    ours = sorted(b for m, b in points if m == "ours" and points[m, b]["fits"])
    plain = sorted(b for m, b in points if m == "plain" and points[m, b]["fits"])
    chunk_tokens = saved["settings"].get("chunk_tokens")
    rows, why = [], []
    if len(ours) >= 2:
        small, large = 64 if 64 in ours else ours[0], ours[-1]
        peak_small, peak_large = points["ours", small], points["ours", large]
        ratio = peak_large["step_peak_bytes"] / peak_small["step_peak_bytes"]
        rows.append(
            [
                f"memory: with --chunk_tokens, ours' step peak at batch {large} at most {MEMORY_TARGET}x the "
                f"one at batch {small}",
                f"{ratio:.2f}x ({mib(peak_large['step_peak_bytes'])} against "
                f"{mib(peak_small['step_peak_bytes'])}), "
                + (
                    f"chunks of {chunk_tokens} tokens"
                    if chunk_tokens
                    else f"chunks of {saved['settings']['chunk_size']} examples"
                ),
                verdict(ratio, MEMORY_TARGET)
                if chunk_tokens
                else "not checked: this run had no token budget",
            ]
        )
        if ratio > MEMORY_TARGET:
            why.append(memory_miss(points, small, large))
    if len(plain) >= 2:
        first, last = points["plain", plain[0]], points["plain", plain[-1]]
        failed = [p["batch_size"] for p in saved["results"] if p["method"] == "plain" and not p["fits"]]
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


def growth_exponent(points, key):
    """e in value ~ batch^e between the two largest batches: how a reading grows with the batch."""
    (b1, v1), (b2, v2) = sorted((b, key(p)) for b, p in points.items())[-2:]
    return math.log(v2 / v1) / math.log(b2 / b1) if v1 > 0 and v2 > 0 else None


def memory_miss(points, small, large):
    """The readings behind ours' growth: phase peaks and the longest texts of each batch (no reasons)."""
    low, high = points["ours", small], points["ours", large]
    chunks_high, chunks_low = high["phase_peak_bytes"]["chunks"], low["phase_peak_bytes"]["chunks"]
    notes = [
        f"Memory: at batch {large} the peak during the chunks (stages 1 and 3, with the optimizer) is "
        f"{mib(chunks_high)} against {mib(chunks_low)} at batch {small}; the longest text is "
        f"{high['longest_text_tokens']} tokens at batch {large} against {low['longest_text_tokens']} at "
        f"batch {small}."
    ]
    if high.get("held_between_chunks_bytes") and low.get("held_between_chunks_bytes"):
        held_high, held_low = high["held_between_chunks_bytes"], low["held_between_chunks_bytes"]
        notes.append(
            f"Between the chunks of stage 3 the step holds {mib(held_high)} at batch {large} against "
            f"{mib(held_low)} at batch {small} (the parameter gradients, and the representation gradients: "
            f"{mib(high['representation_gradient_bytes'])} against "
            f"{mib(low['representation_gradient_bytes'])}); the chunks add at most "
            f"{mib(high['step_peak_bytes'] - held_high)} above that against "
            f"{mib(low['step_peak_bytes'] - held_low)}."
        )
    same_length = min(
        b
        for m, b in points
        if m == "ours" and points[m, b].get("longest_text_tokens") == high["longest_text_tokens"]
    )
    if same_length < large:
        notes.append(
            f"From batch {same_length} to {large}, whose longest texts have the same length, the peak grows "
            f"{high['step_peak_bytes'] / points['ours', same_length]['step_peak_bytes']:.2f}x."
        )
    if "phase_added_bytes" in high:
        ours = {b: p for (m, b), p in points.items() if m == "ours" and p["fits"]}
        exponent = growth_exponent(ours, lambda p: p["phase_added_bytes"]["loss"])
        notes.append(
            f"Stage 2, the loss, adds {mib(high['phase_added_bytes']['loss'])} above its inputs at batch "
            f"{large}"
            + (f", growing as batch^{exponent:.1f} over the two largest batches." if exponent else ".")
        )
    st_high, st_low = points.get(("st", large)), points.get(("st", small))
    if st_high and st_low and st_high["fits"] and st_low["fits"]:
        notes.append(
            f"Sentence-transformers' cached loss peaks at {mib(st_high['step_peak_bytes'])} at batch "
            f"{large}, "
            f"{st_high['step_peak_bytes'] / st_low['step_peak_bytes']:.2f}x its peak at batch {small}."
        )
    process_ratio = (high["baseline_bytes"] + high["step_peak_bytes"]) / (
        low["baseline_bytes"] + low["step_peak_bytes"]
    )
    notes.append(
        f"Counted with what the process holds before the step (model, AdamW state, libraries: "
        f"{mib(high['baseline_bytes'])}), the peak at batch {large} is {process_ratio:.2f}x the one at "
        f"batch {small}."
    )
    return " ".join(notes)


def paired_ratios(runs, numerator, denominator):
    return [a["seconds"] / b["seconds"] for a, b in zip(runs[numerator], runs[denominator], strict=True)]


def speed_targets(saved):
    rows, why = [], []
    measurements = saved["results"]["measurements"]
    chunk_tokens = saved["settings"].get("chunk_tokens")
    budget = f"equal token budget ({chunk_tokens})" if chunk_tokens else "equal token budget"
    chunk = f"equal chunk ({saved['settings']['chunk_size']} examples)"
    comparisons = [
        # (ours' variant, the other, limit, smallest batch checked, the target's words)
        ("ours", "ST cached", ST_TARGET, 0, "ours at most {}x one of ST cached at equal batch and " + chunk),
        (
            "ours, token budget",
            "ST cached, token budget",
            ST_TARGET,
            ST_TARGET_MIN_BATCH,
            f"ours at most {{}}x one of ST cached at equal batch and {budget}, batch {ST_TARGET_MIN_BATCH} "
            "and up",
        ),
        ("ours", "plain", PLAIN_TARGET, 0, "ours at most {}x one of plain at equal batch, where plain fits"),
        (
            "group-only, no cache",
            "group-only, cached",
            GROUP_SPEED_TARGET,
            0,
            "the loss without in-batch negatives, chunks back-propagated directly (group_step), at most {}x "
            "one through the cache at equal batch and " + chunk + ": it skips a forward",
        ),
    ]
    for ours, other, limit, min_batch, words in comparisons:
        target = "speed: a step of " + words.format(limit)
        timed = measurements
        if other == "group-only, cached":  # in rounds of its own where speed.py timed it so (--parts group)
            timed = saved["results"].get("group_measurements", measurements)
        measured = [
            (m["batch_size"], statistics.median(paired_ratios(m["runs"], ours, other)), m)
            for m in timed
            if other in m["runs"] and ours in m["runs"] and m["batch_size"] >= min_batch
        ]
        if not measured:
            if other == "ST cached, token budget":
                reason = (
                    "no token budget in this run" if not chunk_tokens else f"no batch of {min_batch} or more"
                )
                rows.append([target, "-", f"not measured: {reason}"])
            continue
        worst = max(ratio for _, ratio, _ in measured)
        rows.append(
            [
                target,
                ", ".join(f"batch {batch}: {ratio:.2f}x" for batch, ratio, _ in measured),
                verdict(worst, limit),
            ]
        )
        if worst > limit:
            missed = [m for _, ratio, m in measured if ratio > limit]
            why.append(speed_miss(ours, other, missed))
    agreement = saved["results"]["agreement"]
    difference = agreement["max_gradient_difference"]["ours"]
    rows.append(
        [
            "exactness: no speed-up changes the gradient",
            f"ours vs plain at batch {agreement['batch_size']}, dropout off: largest gradient difference "
            f"{difference:.1e} of the largest gradient; the exactness tests are tests/test_gradcache.py",
            "met" if difference < 1e-4 else "missed",
        ]
    )
    return rows, why


def median_part(measurement, name, *parts):
    return statistics.median(sum(p.get(part, 0.0) for part in parts) for p in measurement["parts"][name])


def speed_miss(ours, other, measurements):
    """Where the time of the batches that missed goes, part by part, against the other variant's."""
    notes = []
    for m in measurements:
        batch, step = m["batch_size"], median_part(m, ours, *m["parts"][ours][0])
        forward = {
            name: median_part(m, name, "forward no grad", "forward with grad")
            for name in (ours, other, "ours, unsorted")
            if name in m["parts"]
        }
        overhead = median_part(m, ours, "stage 2: loss and its gradient", "selecting chunks")
        note = (
            f"batch {batch}: {ours} spends {overhead:.2f} s of a {step:.2f} s step in stage 2 and chunk "
            f"selection; its forward passes take {forward[ours]:.2f} s against {forward[other]:.2f} s for "
            f"{other}"
        )
        backward = [median_part(m, name, "backward and the rest") for name in (ours, other)]
        note += f"; the backward and the rest {backward[0]:.2f} s against {backward[1]:.2f} s"
        if ours == "ours" and "ours, unsorted" in forward:
            note += f"; unsorted chunks' forward passes take {forward['ours, unsorted']:.2f} s"
        notes.append(note)
    return f"Speed, {ours} against {other}: " + "; ".join(notes) + "."


def quality_claim(saved):
    """The paper's claim and the masks, as bench/quality.py's verdicts computed from the seeds' runs."""
    import argparse

    from quality import verdicts

    if "runs" not in saved["results"]:  # saved before the seeds and the verdicts: one run per batch size
        before, *trained = saved["results"]
        measured = ", ".join(f"batch {run['batch_size']}: {run['mrr@10']:.4f}" for run in trained)
        row = [
            "claim of the paper: a bigger batch is better (equal epochs)",
            f"dev MRR@10 {measured} (before fine-tuning {before['mrr@10']:.4f}), one seed each",
            "no verdict without seeds: rerun bench/quality.py",
        ]
        return [row], []
    rows = [
        [
            question
            if question.startswith("masks")
            else f"claim of the paper, a bigger batch is better: {question}",
            f"dev MRR@10 {difference:+.4f} (standard error {error:.4f})",
            word,
        ]
        for question, difference, error, word in verdicts(
            saved["results"], argparse.Namespace(**saved["settings"])
        )
    ]
    return rows, []


def scale_targets(saved):
    """The issue's scale targets: the loss stage's memory in a full step, the tiled loss's time, 65,536."""
    results, rows = saved["results"], []
    steps = {p["batch_size"]: p for p in results["steps"]}
    for batch, limit in LOSS_STAGE_TARGETS.items():
        target = f"loss stage: a step at batch {batch:,} adds at most {mib(limit)} beyond its inputs"
        point = steps.get(batch)
        if point is None or not point["fits"]:
            rows.append([target, "-", "missed: the step did not fit" if point else "not measured"])
            continue
        added = point["phase_added_bytes"]["loss"]
        rows.append([target, f"{mib(added)} ({model_name(point)})", verdict(added, limit)])
    timed = [p for p in results["loss_time"] if p["batch_size"] <= TILED_TIME_MAX_BATCH]
    target = f"tiled loss time at most {TILED_TIME_TARGET}x the materialized one where both fit"
    if timed:
        ratios = [(p["batch_size"], statistics.median(tiled_ratios(p))) for p in timed]
        rows.append(
            [
                target,
                ", ".join(f"batch {batch}: {ratio:.2f}x" for batch, ratio in ratios),
                verdict(max(ratio for _, ratio in ratios), TILED_TIME_TARGET),
            ]
        )
    else:
        rows.append([target, "-", "not measured"])
    target = f"a full training step at batch {FULL_STEP_BATCH:,}, three columns, on this machine"
    point = steps.get(FULL_STEP_BATCH)
    if point is None:
        rows.append([target, "-", "not measured"])
    elif not point["fits"]:
        cap = saved["settings"].get("step_cap_gib")
        rows.append([target, f"did not fit in {cap:g} GiB" if cap else "did not fit", "missed"])
    else:
        process_peak = point["baseline_bytes"] + point["step_peak_bytes"]
        ram = saved["provenance"].get("ram_bytes")
        fits = point["fits"] and (ram is None or process_peak < ram)
        rows.append(
            [
                target,
                f"process peak {mib(process_peak)}"
                + (f" of {mib(ram)} RAM" if ram else "")
                + f", step {point['seconds'] / 60:.0f} min ({model_name(point)})",
                "met" if fits else "missed: did not fit",
            ]
        )
    masked_rows, why = masked_loss_targets(results)
    more = guide_targets(results) + group_memory_targets(results) + sparse_memory_targets(results)
    return rows + masked_rows + more, why


def masked_loss_targets(results):
    """The loss stage with every false-negative mask on (scale.py part d) against the 1 GiB target."""
    batch, limit = MASKED_LOSS_TARGET
    target = (
        f"masked loss stays tiled: at batch {batch:,}, identity, margin and guide masks on, the loss stage "
        f"adds at most {mib(limit)}, masks included"
    )
    points = {(p["variant"], p["batch_size"]): p for p in results.get("masked_loss_memory", [])}
    masked, unmasked = points.get(("all", batch)), points.get(("none", batch))
    if masked is None:
        return [[target, "-", "not measured: `python bench/scale.py`, part d"]], []
    total = masked["added_bytes"] + masked["mask_input_bytes"]
    measured = (
        f"{mib(total)}: {mib(masked['added_bytes'])} above the representations and the masks' inputs, plus "
        f"{mib(masked['mask_input_bytes'])} of those inputs (ids, guide representations)"
    )
    if unmasked is not None:
        added = masked["added_bytes"] - unmasked["added_bytes"]
        measured += (
            f"; unmasked {mib(unmasked['added_bytes'])} in the same run, so the masks add {mib(added)} "
            f"({masked['added_bytes'] / unmasked['added_bytes']:.2f}x)"
        )
    measured += " (stage 2 alone, random representations)"
    why = []
    if total > limit:
        each = [
            f"{variant} {mib(points[variant, batch]['added_bytes'])}"
            for variant in ("none", "identity", "margin", "guide", "all")
            if (variant, batch) in points
        ]
        why.append(f"Masked loss at batch {batch:,}, above the representations: " + ", ".join(each) + ".")
    return [[target, measured, verdict(total, limit)]], why


def guide_targets(results):
    """The guide's encoding (scale.py part e): one chunk if, at the larger batch, it needs less than the
    smaller batch encoded at once; encoding the whole batch would need more than that."""
    target = "the guide model's memory is one chunk: it never encodes the whole batch at once"
    points = results.get("guide_memory")
    if not points:
        return [[target, "-", "not measured: `python bench/scale.py`, part e"]]
    chunked = sorted((p for p in points if p["chunk_size"] < p["batch_size"]), key=lambda p: p["batch_size"])
    at_once = [p for p in points if p["chunk_size"] >= p["batch_size"]]
    small, large, whole = chunked[0], chunked[-1], at_once[0]

    def own(point):  # the encoding's own memory: its peak less the representations it returns
        return point["added_bytes"] - point["output_bytes"]

    growth = large["batch_size"] / small["batch_size"]
    measured = (
        f"train.guide_representations, chunks of {small['chunk_size']} texts, peak less the representations "
        f"it returns: {mib(own(small))} at batch {small['batch_size']:,}, {mib(own(large))} at batch "
        f"{large['batch_size']:,} ({own(large) / own(small):.2f}x for {growth:.0f}x the batch); batch "
        f"{whole['batch_size']:,} encoded at once: {mib(own(whole))}"
    )
    if own(large) < own(whole):
        word = (
            f"met: at {growth:.0f}x the batch, less than batch {whole['batch_size']:,} encoded at once "
            f"({own(large) / own(whole):.2f}x)"
        )
    else:
        word = (
            f"missed: at batch {large['batch_size']:,}, not less than batch {whole['batch_size']:,} at once"
        )
    return [[target, measured, word]]


def group_memory_targets(results):
    """group_step's step (scale.py part f): one chunk if, at the larger batch, it peaks below the smaller
    batch in one chunk."""
    target = "without in-batch negatives, group_step's memory stays one chunk"
    points = results.get("group_memory")
    if not points:
        return [[target, "-", "not measured: `python bench/scale.py --parts f`"]]
    steps = {(p["method"], p["batch_size"], p["chunk_size"]): p["step_peak_bytes"] for p in points}
    chunked = sorted((b, c) for m, b, c in steps if m == "group" and c < b)
    (small, chunk), (large, _) = chunked[0], chunked[-1]
    one_chunk = steps["group", small, small]
    measured = (
        f"step peak, chunks of {chunk} rows: {mib(steps['group', small, chunk])} at batch {small:,}, "
        f"{mib(steps['group', large, chunk])} at batch {large:,} "
        f"({steps['group', large, chunk] / steps['group', small, chunk]:.2f}x for {large / small:.0f}x the "
        f"batch); through the cache {mib(steps['group cached', large, chunk])} at batch {large:,}; batch "
        f"{small:,} in one chunk: {mib(one_chunk)}"
    )
    if steps["group", large, chunk] < one_chunk:
        word = f"met: at {large / small:.0f}x the batch, less than batch {small:,} in one chunk"
    else:
        word = f"missed: at batch {large:,}, not less than batch {small:,} in one chunk"
    return [[target, measured, word]]


def sparse_memory_targets(results):
    """A SPLADE step (scale.py part g): what it holds beyond the batch's representations and their
    gradients (B x 3 x vocabulary fp32 each, which no method avoids) stays flat as the batch grows."""
    target = (
        "a sparse encoder's step holds, beyond its vocabulary-sized representations and their gradients, at "
        f"most {SPARSE_FLAT_TARGET}x as much at the larger batch as at the smaller"
    )
    points = sorted(results.get("sparse_memory", []), key=lambda p: p["batch_size"])
    if not points:
        return [[target, "-", "not measured: `python bench/scale.py --parts g`"]]
    small, large = points[0], points[-1]
    growth, ratio = (
        large["batch_size"] / small["batch_size"],
        large["beyond_batch_bytes"] / small["beyond_batch_bytes"],
    )

    def stage(point):  # where the step peaked
        peaks = point["phase_peak_bytes"]
        return "stage 2" if peaks["loss"] >= peaks["chunks"] else "the chunks of stage 1 or 3"

    measured = "; ".join(
        f"batch {p['batch_size']:,}: step peak {mib(p['step_peak_bytes'])} (in {stage(p)}), representations "
        f"and gradients {mib(2 * p['representation_bytes'])}, beyond them {mib(p['beyond_batch_bytes'])}"
        for p in (small, large)
    )
    measured += (
        f" ({ratio:.2f}x beyond them for {growth:.0f}x the batch; the vocabulary {small['vocabulary']:,})"
    )
    word = f"met: {ratio:.2f}x" if ratio <= SPARSE_FLAT_TARGET else f"missed: {ratio:.2f}x"
    return [[target, measured, word]]


def checkpointing_claim(saved):
    """--gradient_checkpointing against none, per chunk size: the step's peak and the step time."""
    results = saved["results"]
    peaks = {(p["chunk_size"], p["gradient_checkpointing"]): p["step_peak_bytes"] for p in results["memory"]}
    measured, savings = [], []
    for timing in results["time"]:
        chunk = timing["chunk_size"]
        without, with_ = peaks[chunk, False], peaks[chunk, True]
        seconds = timing["seconds"]
        time_ratio = statistics.median(
            a / b for a, b in zip(seconds["with"], seconds["without"], strict=True)
        )
        measured.append(
            f"chunk {chunk}: {mib(without)} without, {mib(with_)} with ({with_ / without:.2f}x), step time "
            f"{time_ratio:.2f}x"
        )
        savings.append((chunk, 1 - with_ / without))
    not_lower = [str(chunk) for chunk, saving in savings if saving <= 0]
    least, most = min(saving for _, saving in savings), max(saving for _, saving in savings)
    row = [
        f"gradient checkpointing lowers the peak memory of a step (batch {saved['settings']['batch_size']})",
        "; ".join(measured),
        f"holds at every chunk size, by {least:.1%} to {most:.1%}"
        if not not_lower
        else f"not at chunk {', '.join(not_lower)}",
    ]
    return [row], []


def budget_targets(saved):
    """graph_budget: every group kept within 5% of the lower bound, and the step's ratio falling with the
    share of groups kept, in proportion (within 5 points of the line from none kept to all kept)."""
    rows, reasons = [], []
    by_batch = {}
    for batch, name, kept, _, ratio, peak in saved["rows"]:
        if name.startswith("kept "):
            shown = kept.split(" of ")
            by_batch.setdefault(batch, []).append((int(shown[0]) / int(shown[1]), float(ratio[:-1]), peak))
    for batch, points in sorted(by_batch.items()):
        points.sort()
        (none_share, none_ratio, _), (all_share, all_ratio, _) = points[0], points[-1]
        off = [abs(r - (none_ratio + (s - none_share) / (all_share - none_share) * (all_ratio - none_ratio)))
               for s, r, _ in points]  # fmt: skip
        shown = ", ".join(f"{s:.0%} kept {r:.2f}x" for s, r, _ in points)
        shown += f"; at most {max(off) * 100:.0f} points off the line from none to all"
        rows.append([f"batch {batch}: every group kept, at most {BUDGET_ALL_TARGET}x the lower bound",
                     f"{all_ratio:.2f}x", verdict(all_ratio, BUDGET_ALL_TARGET)])  # fmt: skip
        proportion = f"batch {batch}: the ratio falls in proportion to the share kept (within 5 points)"
        rows.append([proportion, shown, verdict(max(off), BUDGET_LINEAR_POINTS)])
        if all_ratio > BUDGET_ALL_TARGET:
            reasons.append(f"batch {batch}: keeping every graph costs {all_ratio:.2f}x the lower bound (a "
                           "shared CPU: the lower bound itself varies from round to round)")  # fmt: skip
    return rows, reasons


DATA_RSS_TARGET, DATA_FIRST_STEP_TARGET, DATA_TARGET_TRIPLES = 300 * 2**20, 60.0, 10_000_000


def data_scale_targets(saved):
    """Data beyond memory: the data's own resident memory a process at most 300 MB at 10 million triples and
    flat from the smallest size up; the first batch of a reused conversion within 60 s of the launch; the
    conversion at least as fast as today's reading, side by side on the same records."""
    saved.setdefault("provenance", {"commit": saved["commit"], "uncommitted_changes": saved["dirty"]})
    points = {point["triples"]: point for point in saved["sizes"]}
    rows, reasons = [], []
    for triples, point in sorted(points.items()):
        reused = max(max(r["data_rss_anon"], r["data_rss_anon_peak"]) for r in point["reusing"])
        converting = max(r["data_rss_anon_peak"] for r in point["converting"])
        rows.append([f"{triples:,} triples: the data's resident memory a process (its peak, of 2 processes) "
                     f"at most {mib(DATA_RSS_TARGET)}", f"reused {mib(reused)}, converting {mib(converting)}",
                     verdict(max(reused, converting), DATA_RSS_TARGET)])  # fmt: skip
        first = max(r["first_batch_s"] for r in point["reusing"])
        rows.append([f"{triples:,} triples: the first batch of a reused conversion within "
                     f"{DATA_FIRST_STEP_TARGET:.0f} s of the launch", f"{first:.1f} s",
                     verdict(first, DATA_FIRST_STEP_TARGET)])  # fmt: skip
        if first > DATA_FIRST_STEP_TARGET:
            masks = max(r["positives_s"] for r in point["reusing"])
            reasons.append(f"Data, {triples:,} triples: the reused first batch came {first:.1f} s after the "
                           f"launch, {masks:.1f} s of it positives_by_anchor (--mask_repeated_texts on: "
                           f"read from the data cache); load average {saved['load_average']:.1f} on "
                           f"{saved['cpus']} cores at the start.")  # fmt: skip
    for triples, point in sorted(points.items()):
        if training := point.get("training"):
            highest = mib(max(training["rss_anon_peak"]))
            rows.append([f"{triples:,} triples: train.py trains {training['steps']} steps in 2 processes "
                         "(the bundled model, the reused conversion)", f"in {training['seconds']:.0f} s, the "
                         f"highest resident memory a process {highest} (model, optimizer and data)",
                         "measured"])  # fmt: skip
    if len(points) >= 2:
        (small, low), (large, high) = sorted(points.items())[0], sorted(points.items())[-1]
        peak = [max(r["data_rss_anon_peak"] for r in p["reusing"]) for p in (low, high)]
        rows.append([f"memory flat: the reused peak at {large:,} triples against {small:,}",
                     f"{peak[1] / peak[0]:.2f}x for {large / small:.0f}x the triples",
                     "measured"])  # fmt: skip
        if "training" in low and "training" in high:
            grown = max(high["training"]["rss_anon_peak"]) - max(low["training"]["rss_anon_peak"])
            rows.append([f"memory flat while training: train.py's highest resident memory a process at "
                         f"{large:,} triples less at {small:,}, at most {mib(DATA_RSS_TARGET)}",
                         f"{grown / 2**20:+,.0f} MiB for {large / small:.0f}x the triples",
                         verdict(grown, DATA_RSS_TARGET)])  # fmt: skip
    if DATA_TARGET_TRIPLES not in points:
        largest = max(points, default=0)
        rows.append(
            [f"{DATA_TARGET_TRIPLES:,} triples measured", f"the largest run: {largest:,}", "not reached"]
        )
        reasons.append(f"Data: {DATA_TARGET_TRIPLES:,} triples did not run in this session (the largest that "
                       f"did: {largest:,}); the command above runs it.")  # fmt: skip
    if rate := saved.get("rate"):
        ratio = rate["conversion_s"] / rate["today_s"]
        rows.append([f"the conversion at least as fast as today's reading ({rate['records']:,} records, "
                     "one process, side by side)", f"{rate['records'] / rate['conversion_s']:,.0f} records/s "
                     f"against {rate['records'] / rate['today_s']:,.0f} ({ratio:.2f}x the time)",
                     verdict(ratio, 1.0)])  # fmt: skip
    return rows, reasons


def sharding_targets(saved):
    """What sharding saves: what each backend's largest process holds after the steps against DDP's at the
    same processes, beside the saving the model's state predicts (16 bytes a parameter, of which a process
    keeps 1/N when sharded), and the whole run's peak (loading and the final gathering included)."""
    results = saved["results"]
    state = results["parameters"] * 16
    rows = []
    for processes in sorted({p["processes"] for p in results["points"]}):
        at = {p["backend"]: p for p in results["points"] if p["processes"] == processes}
        predicted = state * (1 - 1 / processes)
        for backend in ("zero3", "fsdp2"):
            held, ddp = at[backend]["held_bytes"], at["ddp"]["held_bytes"]
            peak = at[backend]["peak_bytes"] / at["ddp"]["peak_bytes"]
            rows.append([f"{backend} at {processes} processes: held after the steps against DDP's",
                         f"{held / ddp:.2f}x ({mib(ddp - held)} saved of the {mib(predicted)} the sharded "
                         f"state predicts); the whole run's peak {peak:.2f}x", "measured"])  # fmt: skip
    return rows, []


def multi_vector_targets(saved):
    """A multi-vector step (multi_vector_memory.py): what ours holds beyond its token matrices and their
    gradients, from its smallest batch to its largest; beside sentence-transformers' cached loss at the
    largest batch that loss fit. Where the asked batches did not run, the time they would take here."""
    settings = saved["settings"]
    points = {(p["method"], p["batch_size"]): p for p in saved["results"]}
    ours = sorted(b for m, b in points if m == "ours" and points[m, b]["fits"])
    small, large = points["ours", ours[0]], points["ours", ours[-1]]
    ratio = large["rest_bytes"] / small["rest_bytes"]
    target = (
        "a multi-vector (ColBERT) step holds, beyond its cached token matrices and their gradients, at most "
        f"{MULTI_VECTOR_FLAT_TARGET}x as much at the larger batch as at the smaller (asked of batches "
        f"{MULTI_VECTOR_BATCHES[0]:,} and {MULTI_VECTOR_BATCHES[1]:,})"
    )
    measured = "; ".join(
        f"batch {p['batch_size']:,}: step peak {mib(p['step_peak_bytes'])} (in {peak_stage(p)}), token "
        f"matrices {mib(p['token_matrix_bytes'])}, their gradients {mib(p['token_matrix_gradient_bytes'])}, "
        f"the rest {mib(p['rest_bytes'])}"
        for p in (small, large)
    )
    measured += (
        f" ({ratio:.2f}x the rest for {large['batch_size'] / small['batch_size']:.0f}x the batch; queries of "
        f"{settings['query_tokens']} tokens, documents of {settings['document_tokens']}, "
        f"{settings['hard_negatives']} hard negative(s) a query)"
    )
    word = f"{'met' if ratio <= MULTI_VECTOR_FLAT_TARGET else 'missed'}: {ratio:.2f}x"
    why = [multi_vector_miss(small, large)] if ratio > MULTI_VECTOR_FLAT_TARGET else []
    if (small["batch_size"], large["batch_size"]) != MULTI_VECTOR_BATCHES:
        word += f", at batches {small['batch_size']:,} and {large['batch_size']:,}"
        why.append(multi_vector_unrun(points, MULTI_VECTOR_BATCHES[1]))
    return [[target, measured, word], multi_vector_beside_st(points, settings)], why + multi_vector_starved(
        points
    )


def multi_vector_starved(points):
    """A note where ours' and st's steps at the largest batch both ran got unlike shares of the cores (CPU
    seconds a wall second more than a quarter apart): the wall time ratio then measures the machine."""
    both = [b for m, b in points if m == "st" and points[m, b]["fits"] and ("ours", b) in points]
    if not both:
        return []
    ours, st = points["ours", max(both)], points["st", max(both)]
    share = [p["cpu_seconds"] / p["seconds"] for p in (ours, st)]
    if abs(share[0] / share[1] - 1) <= 0.25:
        return []
    return [
        f"Multi-vector beside st at batch {max(both):,}: ours' step ran at {share[0]:.2f} CPU seconds a "
        f"second of wall time, st's at {share[1]:.2f} (the same threads): the cores were shared with other "
        f"work during {'ours' if share[0] < share[1] else 'st'}', so the wall time ratio "
        f"({ours['seconds'] / st['seconds']:.2f}x) {'over' if share[0] < share[1] else 'under'}states ours' "
        "time; the CPU time ratio "
        f"({ours['cpu_seconds'] / st['cpu_seconds']:.2f}x) compares the work."
    ]


MULTI_VECTOR_PHASES = {
    "loss": "stage 2's loss",
    "report": "stage 2's check of the gradients",
    "chunks": "the chunks of stage 1 or 3",
}


def peak_stage(point):
    """Where a multi-vector step peaked (multi_vector_memory.py's phases)."""
    peaks = point["phase_peak_bytes"]
    return MULTI_VECTOR_PHASES[max(peaks, key=peaks.get)]


def multi_vector_miss(small, large):
    """The readings behind ours' rest growing: where the larger batch peaked; what stage 2's loss holds
    beyond the token matrices and their gradients; what its check of the gradients allocates."""

    def beyond(point):
        return point["phase_peak_bytes"]["loss"] - 2 * point["token_matrix_bytes"]

    batches = f"batch {small['batch_size']:,} and {large['batch_size']:,}"
    note = (
        f"Multi-vector, ours: at batch {large['batch_size']:,} the step peaks in {peak_stage(large)}. Stage "
        f"2's loss holds, beyond the token matrices and their gradients, {mib(beyond(small))} and "
        f"{mib(beyond(large))} at {batches} ({beyond(large) / beyond(small):.2f}x)."
    )
    if "report" in large["phase_added_bytes"]:
        added = [p["phase_added_bytes"]["report"] for p in (small, large)]
        note += (
            " Its check of the gradients (gradcache.stage_two_report: their norm, all finite) allocates "
            f"{mib(added[0])} and {mib(added[1])} above its start at {batches}, "
            f"{added[1] / large['token_matrix_gradient_bytes']:.1f}x the gradients' bytes."
        )
    return note


def multi_vector_beside_st(points, settings):
    """Ours against sentence-transformers' cached multi-vector loss at the largest batch that loss fit."""
    cap = f"{settings['cap_gib']:g} GiB beyond the process" if settings.get("cap_gib") else "no memory cap"
    target = (
        "a multi-vector step beside sentence-transformers' CachedMultiVectorMultipleNegativesRankingLoss at "
        f"the largest batch it fits ({cap}), side by side in one run"
    )
    fitting = sorted(b for m, b in points if m == "st" and points[m, b]["fits"])
    if not fitting or ("ours", fitting[-1]) not in points:
        return [target, "-", "not measured"]
    batch = fitting[-1]
    ours, st = points["ours", batch], points["st", batch]
    stopped = sorted(b for m, b in points if m == "st" and not points[m, b]["fits"])

    def pair(read):
        return f"{mib(read(ours))} against {mib(read(st))} ({read(ours) / read(st):.2f}x)"

    def stage_two(point):  # the loss, and ours' check of the gradients
        return max(point["phase_peak_bytes"].get(phase, 0) for phase in ("loss", "report"))

    measured = (
        f"batch {batch:,}, ours against st: step peak {pair(lambda p: p['step_peak_bytes'])}; beyond the "
        f"token matrices and their gradients {pair(lambda p: p['rest_bytes'])}; the chunks (stages 1 and 3) "
        f"{pair(lambda p: p['phase_peak_bytes']['chunks'])}; stage 2 {pair(stage_two)}; a step's CPU time "
        f"{ours['cpu_seconds']:.0f} s against {st['cpu_seconds']:.0f} s; its wall time "
        f"{ours['seconds']:.0f} s against {st['seconds']:.0f} s, the load average "
        f"{ours['load_average']:.1f} and {st['load_average']:.1f} at their starts (stage 2 "
        f"{ours['loss_seconds']:.0f} s against {st['loss_seconds']:.0f} s)"
    )
    measured += f"; batch {stopped[0]:,} did not fit" if stopped else "; st fit at every batch run"
    peak, wall = ours["step_peak_bytes"] / st["step_peak_bytes"], ours["seconds"] / st["seconds"]
    cpu = ours["cpu_seconds"] / st["cpu_seconds"]
    return [
        target,
        measured,
        f"measured: ours / st, peak {peak:.2f}x, wall time {wall:.2f}x, CPU time {cpu:.2f}x",
    ]


def multi_vector_unrun(points, batch):
    """What a step at the asked `batch` would take here, from the two largest batches run: stage 2's seconds
    (every query's MaxSim against every document) extrapolated at their measured growth, the rest of the
    step in proportion to the batch."""
    notes = []
    for method in ("ours", "st"):
        runs = {b: p for (m, b), p in points.items() if m == method and p["fits"]}
        if len(runs) < 2:
            continue
        largest = max(runs)
        exponent = growth_exponent(runs, lambda p: p["loss_seconds"])
        point, scale = runs[largest], batch / largest
        minutes = (
            point["loss_seconds"] * scale**exponent + (point["seconds"] - point["loss_seconds"]) * scale
        ) / 60
        notes.append(
            f"{method}: a step at batch {largest:,} took {point['seconds']:.0f} s, "
            f"{point['loss_seconds']:.0f} s of it in stage 2, whose time grew as batch^{exponent:.1f} over "
            f"the two largest batches: about {minutes:.0f} min a step at {batch:,}"
        )
    return f"Multi-vector: batch {batch:,} was not run on this machine; " + "; ".join(notes) + "."


def model_name(point):
    layers = point.get("num_layers")
    return "full model" if layers is None else f"model cut to its first {layers} layer(s)"


def tiled_ratios(point):
    seconds = point["seconds"]
    return [tiled / other for tiled, other in zip(seconds["tiled"], seconds["materialized"], strict=True)]


def commits_line(loaded):
    """One clean commit for every section, or the commit of each section (of each part, where a script ran
    some parts again); loud where a tree had uncommitted changes."""
    runs = {}
    for (name, preset), saved in loaded.items():
        for part, info in (saved.get("part_provenance") or {"": saved["provenance"]}).items():
            runs[f"{name} ({preset}{', ' + part if part else ''})"] = info
    commits = {info["commit"].split(" ")[0] for info in runs.values()}
    dirty = [run for run, info in runs.items() if info.get("uncommitted_changes") or " " in info["commit"]]
    if len(commits) == 1 and not dirty:
        return f"Every section ran at commit {commits.pop()}, with a clean working tree."
    if not dirty:
        return (
            "The sections ran at several commits, each with a clean working tree: "
            + "; ".join(f"{run}: {info['commit']}" for run, info in runs.items())
            + "."
        )
    return (
        "**Not one clean commit: these results are not reproducible as a whole.** "
        + "; ".join(f"{run}: {info['commit']}" for run, info in runs.items())
        + f". Uncommitted changes in: {', '.join(dirty)}."
    )


def section_text(results_dir, name, preset, output):
    path = results_dir / f"{name}_{preset}.md"
    if not path.exists():
        return f"Not measured yet: `{command(name, preset)}`."
    # Images are linked relative to results/; RESULTS.md lives elsewhere.
    prefix = os.path.relpath(results_dir, output.parent)
    return re.sub(r"\]\(([^)/]+\.png)\)", rf"]({prefix}/\1)", path.read_text().strip())


def main(argv=None):
    args = parser.parse_args(argv)
    results_dir, output = Path(args.results_dir), Path(args.output)
    checked = args.presets[0]
    loaded = {
        (name, preset): saved
        for name in SECTIONS
        for preset in args.presets
        if (saved := load(results_dir, name, preset)) is not None
    }
    checks = {
        "memory": memory_targets,
        "speed": speed_targets,
        "quality": quality_claim,
        "scale": scale_targets,
        "checkpointing": checkpointing_claim,
        "budget": budget_targets,
        "data_scale": data_scale_targets,
        "sharding_memory": sharding_targets,
        "multi_vector_memory": multi_vector_targets,
    }
    target_rows, why = [], []
    for name, check in checks.items():
        if (name, checked) in loaded:
            rows, reasons = check(loaded[name, checked])
            target_rows += rows
            why += reasons
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python bench/make_results.py` from bench/results/, where the benchmark scripts write "
        "their tables, plots and JSON; no number here is typed by hand. Each section names the command, "
        "date, commit and machine of its run.",
        "",
        commits_line(loaded),
        "",
        "Compared: a training step of all-MiniLM-L6-v2 on anchor, positive and hard-negative columns of "
        "data/wordnet_train.jsonl.gz, in-batch negatives with cosine similarity (`contrastive_loss` at "
        "`harness.SCALE`), computed three ways: **plain** (the full batch through the model at once), "
        "**ours** (`gradcache.gradcache_step`) and **ST cached** (sentence-transformers' "
        "`CachedMultipleNegativesRankingLoss`) at the same chunk: the same number of examples, or the same "
        "token budget where a section says so. Section 5 also measures the loss stage alone on random "
        "representations; section 6 compares ours with and without gradient checkpointing; section 10 "
        "trains a multi-vector (ColBERT) model beside sentence-transformers' "
        "`CachedMultiVectorMultipleNegativesRankingLoss`.",
        "",
        f"## Targets (checked on the {checked} results)",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
        *("| " + " | ".join(row) + " |" for row in target_rows),
    ]
    if why:
        lines += ["", "### The readings behind the misses", "", *(f"- {reason}" for reason in why)]
    for name, title in SECTIONS.items():
        lines += ["", f"## {title}"]
        for preset in args.presets:
            lines += ["", f"### {preset.upper()}", "", section_text(results_dir, name, preset, output)]
    lines += [
        "",
        "## Regenerating every section at one commit",
        "",
        "Commit first: a script refuses to run on uncommitted changes (its outputs, bench/results/ and this "
        "file, excepted), so that each section names the commit that ran. Then, from the repository root "
        "on a quiet machine, one command per benchmark and the assembly; commit the results after:",
        "",
        *(f"    {command(name, 'cpu')}" for name in SECTIONS),
        "    python bench/make_results.py",
        "",
        "On a machine with one GPU the same with the GPU presets, each sized for minutes on an H200 "
        "(estimates: the GPU presets have not run yet). Where the results must travel back (the project's "
        "device tool returns what is written under $OUT), add `--out_dir $OUT` to each and copy the files "
        "into bench/results/ before assembling.",
        "",
        *(f"    {command(name, 'gpu')}" for name in SECTIONS),
        "    python bench/make_results.py",
    ]
    output.write_text("\n".join(lines) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
