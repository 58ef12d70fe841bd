"""Benchmark 2: what a step of this project costs against plain training and sentence-transformers' cache.

In one process, the variants take turns on the same batches (A, B, C, A, B, C, ..., the order rotated
every round); warm-up rounds are left out; each variant's time is the median over the measured rounds,
and each ratio the median of the per-round ratios, so a load change on the machine hits both sides of a
ratio alike. A step is the gradient of the batch plus the AdamW step; tokenization is left out (it is the
same for every variant). Variants: plain full batch (where it fits), sentence-transformers'
CachedMultipleNegativesRankingLoss, and gradcache_step with length-sorted chunks and last-chunk reuse each
switched on and off (up to --ablation_max_batch), all chunked by --chunk_size examples; and, where
--chunk_tokens is set, ours chunked by that padded-token budget against sentence-transformers' cached
loss at its best setting, `mini_batch_num_tokens` equal to it (a budget of tokens without padding). The
loss without in-batch negatives (`gradcache.group_loss`) runs both through the cache (gradcache_step) and
without it (`gradcache.group_step`: each chunk of rows back-propagated directly, no second forward), at
the same batch and chunk (--chunk_size rows of group_step against as many texts per cached chunk), in
rounds of their own (`--parts group`).
Model forward hooks split each step into encoding without and with gradient, the optimizer and the rest
(backward, loss); for ours also stage 2 (the loss and its gradient) and chunk selection.

Before timing, a sanity check: plain, ours and ST with dropout off give the same loss and gradients.

    python bench/speed.py                               # CPU: batches 64, 256, 1024; about 70 min
    python bench/speed.py --device cuda --preset gpu    # one GPU: batches 1024 and 4096, a few minutes
    python bench/speed.py --preset smoke                # tiny batches, seconds: the test suite runs this
    python bench/speed.py --parts group                 # the group-only pair again, the rest as saved
    python bench/speed.py --budget_sweep                # graph_budget: time and peak by graphs kept

The budget sweep (`budget_sweep`, also bench/gpu_check.py --budget_sweep on CUDA) times gradcache_step with
graph_budget at 0, 1/4, 1/2 and all of the step's graph bytes against the no-cache lower bound (each
example's forward and backward once, in the same chunks, no stage 1), and reads each one's peak memory
(CPU: the resident set's high-water mark, with glibc returning freed blocks; CUDA: max_memory_allocated);
it prints a table and writes nothing. Its default is short (one warm-up, one measured round; 1 layer of
all-MiniLM-L6-v2 on CPU: --sweep_layers 0 for all six).

Writes bench/results/speed_<preset>.{json,md,png}.
"""

import json
import math
import os
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import harness
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# After harness, which puts the repository root (gradcache.py) on the path.
import gradcache  # noqa: E402

DEFAULTS = {"chunk_size": 32, "rounds": 5, "warmup": 1}
PRESETS = {
    # CPU: plain needs about 8 GiB for one step at batch 256 and did not fit in 8 GiB at 512
    # (bench/memory.py); ours' switches (sorting, reuse) are compared up to batch 256, and three rounds
    # are measured (each ratio's range is printed beside it), to stay well under an hour.
    "cpu": DEFAULTS
    | {
        "rounds": 3,
        "batch_sizes": [64, 256, 1024],
        "chunk_tokens": 1024,
        "plain_max_batch": 256,
        "ablation_max_batch": 256,
    },
    "gpu": DEFAULTS
    | {
        "batch_sizes": [1024, 4096],
        "chunk_tokens": 8192,
        "plain_max_batch": 4096,
        "ablation_max_batch": 4096,
    },
    "smoke": DEFAULTS
    | {
        "batch_sizes": [8],
        "chunk_tokens": 64,
        "plain_max_batch": 8,
        "ablation_max_batch": 8,
        "chunk_size": 4,
        "rounds": 1,
    },
}
# Parts of a step timed apart; "backward and the rest" is the step minus the others.
STEP_PARTS = (
    "forward no grad",
    "forward with grad",
    "stage 2: loss and its gradient",
    "selecting chunks",
    "optimizer (AdamW)",
    "backward and the rest",
)
# name -> (method, gradcache.refinements switched off, chunked by the token budget rather than by chunk_size)
VARIANTS = {
    "plain": ("plain", {}, False),
    "ST cached": ("st", {}, False),
    "ours": ("ours", {}, False),
    "ours, unsorted": ("ours", {"sort_by_length": False}, False),
    "ours, no reuse": ("ours", {"reuse_last_chunk": False}, False),
    "ours, unsorted, no reuse": ("ours", {"sort_by_length": False, "reuse_last_chunk": False}, False),
    "ST cached, token budget": ("st", {}, True),
    "ours, token budget": ("ours", {}, True),
    # The loss without in-batch negatives (each anchor against its own group), by the cache and without it
    "group-only, cached": ("group cached", {}, False),
    "group-only, no cache": ("group", {}, False),
}
TOKEN_VARIANTS = [name for name, (_, _, by_tokens) in VARIANTS.items() if by_tokens]
# --parts: "main" times every variant but the group-only pair, which "group" times on its own, side by side
GROUP_VARIANTS = ["group-only, cached", "group-only, no cache"]
PARTS = {"main": [name for name in VARIANTS if name not in GROUP_VARIANTS], "group": GROUP_VARIANTS}

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--batch_sizes", type=int, nargs="+", help="override the preset's batch sizes")
parser.add_argument("--plain_max_batch", type=int, help="largest batch plain training is run at")
parser.add_argument("--ablation_max_batch", type=int, help="largest batch ours' switches are compared at")
parser.add_argument("--chunk_size", type=int, help="override the preset's chunk size")
parser.add_argument("--chunk_tokens", type=int, help="override the preset's token budget of a chunk")
parser.add_argument("--rounds", type=int, help="measured rounds (steps per variant)")
parser.add_argument("--warmup", type=int, help="rounds run first and left out")
parser.add_argument("--budget_sweep", action="store_true", help="only the graph_budget sweep, printed")
parser.add_argument(
    "--sweep_layers", type=int, default=1, help="budget sweep: transformer layers kept, 0: all"
)
parser.add_argument(
    "--parts",
    nargs="+",
    choices=list(PARTS),
    help="run only these parts again (e.g. group); the others stay as the saved json has them",
)


class StepClock:
    """Seconds per step, and per part of a step while profiling: forward hooks on the model and wrappers
    around gradcache_step's callables. Profiling synchronizes a GPU at every part, so on CUDA the timed
    rounds run without it and one more round per variant profiles; on CPU the timed rounds profile."""

    def __init__(self, model, device):
        self.device = device
        self.profiling = False
        self.parts = {}
        self.tokens = {"padded": 0, "real": 0}
        self.forward_started = None
        self.loss_started = None
        model.register_forward_pre_hook(self.on_forward_start)
        model.register_forward_hook(self.on_forward_end)

    def now(self):
        harness.synchronize(self.device)
        return time.perf_counter()

    def add(self, part, seconds):
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def on_forward_start(self, module, args):
        mask = args[0].get("attention_mask") if args and isinstance(args[0], dict) else None
        if mask is not None:  # what the forward pays for (padded) and what it encodes (real)
            self.tokens["padded"] += mask.numel()
            self.tokens["real"] += int(mask.sum())
        if self.profiling:
            self.forward_started = self.now()

    def on_forward_end(self, module, args, output):
        if self.profiling:
            part = "forward with grad" if torch.is_grad_enabled() else "forward no grad"
            self.add(part, self.now() - self.forward_started)

    def wrap_ours(self, flags):
        """gradcache_step keyword arguments that time stage 2 and chunk selection while profiling."""
        loss_fn = partial(gradcache.contrastive_loss, scale=harness.SCALE)

        def timed_loss(*reps):
            if self.profiling:
                self.loss_started = self.now()
            return loss_fn(*reps)

        def timed_backward(surrogate):
            if self.profiling and self.loss_started is not None:  # the first backward ends stage 2
                self.add("stage 2: loss and its gradient", self.now() - self.loss_started)
                self.loss_started = None
            surrogate.backward()

        def timed_select(column, index):
            if not self.profiling:
                return gradcache.select_examples(column, index)
            started = self.now()
            chunk = gradcache.select_examples(column, index)
            self.add("selecting chunks", self.now() - started)
            return chunk

        return {**flags, "loss_fn": timed_loss, "backward": timed_backward, "select": timed_select}

    def run(self, step, optimizer, features, profile):
        """One training step: its seconds, its loss, while profiling the seconds per STEP_PARTS, and the
        tokens its forward passes took, padded and real."""
        self.profiling, self.parts, self.tokens = profile, {}, {"padded": 0, "real": 0}
        started = self.now()
        loss = step(features)
        optimizer_started = self.now() if profile else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = self.now() - started
        if profile:
            self.add("optimizer (AdamW)", started + total - optimizer_started)
            self.add("backward and the rest", total - sum(self.parts.values()))
        self.profiling = False
        return total, float(loss), self.parts, self.tokens


def variant_max_batch(name, args):
    if name in TOKEN_VARIANTS and not args.chunk_tokens:
        return 0
    if name == "plain":
        return args.plain_max_batch
    if name in ("ours", "ST cached", "group-only, cached", "group-only, no cache", *TOKEN_VARIANTS):
        return math.inf
    return args.ablation_max_batch


def make_variant_step(name, model, args, clock):
    method, switches, by_tokens = VARIANTS[name]
    chunk_tokens = args.chunk_tokens if by_tokens else None
    if method != "ours":
        return harness.make_step(method, model, args.chunk_size, chunk_tokens)
    kwargs = clock.wrap_ours({})
    loss_fn = kwargs.pop("loss_fn")
    chunks = harness.chunking(args.chunk_size, chunk_tokens)

    def step(features):
        with gradcache.refinements(**switches):
            return gradcache.gradcache_step(model, features, loss_fn, **chunks, **kwargs).loss

    return step


def check_agreement(model, features, chunk_size):
    """Loss and gradients of ours and ST against plain, dropout off: the benchmark compares equal work."""
    model.eval()
    results = {}
    for method in ("plain", "ours", "st"):
        model.zero_grad(set_to_none=True)
        loss = harness.make_step(method, model, chunk_size)(features)
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[method] = (float(loss), grads)
    model.zero_grad(set_to_none=True)
    model.train()
    plain_loss, plain_grads = results["plain"]
    scale = float(plain_grads.abs().max())
    return {
        "batch_size": len(features[0]["input_ids"]),
        "losses": {method: loss for method, (loss, _) in results.items()},
        "max_gradient_difference": {
            method: float((grads - plain_grads).abs().max()) / scale
            for method, (_, grads) in results.items()
            if method != "plain"
        },
    }


def measure(args):
    model = harness.load_model(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    clock = StepClock(model, args.device)
    texts = harness.load_texts(max(args.batch_sizes) * (args.warmup + args.rounds))
    results = {}
    if "main" in (args.parts or PARTS):
        features = harness.tokenize(model, texts, 0, min(args.batch_sizes))
        results["agreement"] = check_agreement(model, features, args.chunk_size)
        print(f"agreement: {results['agreement']}", flush=True)
        results["measurements"] = measure_variants(PARTS["main"], model, optimizer, clock, texts, args)
    if "group" in (args.parts or PARTS):
        results["group_measurements"] = measure_variants(PARTS["group"], model, optimizer, clock, texts, args)
    return results


def measure_variants(variants, model, optimizer, clock, texts, args):
    """Every batch: the variants taking turns on the same batches, round after round."""
    total_rounds = args.warmup + args.rounds
    profile_timed_rounds = not args.device.startswith("cuda")
    measurements = []
    for batch_size in args.batch_sizes:
        names = [name for name in variants if batch_size <= variant_max_batch(name, args)]
        steps = {name: make_variant_step(name, model, args, clock) for name in names}
        runs, parts = {name: [] for name in names}, {name: [] for name in names}
        did_not_fit = []
        # on CUDA one more round, profiling
        for round_index in range(total_rounds + (not profile_timed_rounds)):
            timed = round_index < total_rounds
            features = harness.tokenize(model, texts, round_index % total_rounds * batch_size, batch_size)
            rotation = round_index % len(names)
            for name in names[rotation:] + names[:rotation]:
                try:
                    seconds, loss, step_parts, tokens = clock.run(
                        steps[name], optimizer, features, profile=profile_timed_rounds or not timed
                    )
                except Exception as error:  # a variant out of memory leaves the comparison, others raise
                    if not harness.is_out_of_memory(error):
                        raise
                    optimizer.zero_grad(set_to_none=True)
                    did_not_fit.append(name)
                    continue
                if round_index >= args.warmup and timed:
                    runs[name].append({"seconds": seconds, "loss": loss, "tokens": tokens})
                if round_index >= args.warmup and step_parts:
                    parts[name].append(step_parts)
                print(f"batch {batch_size} round {round_index} {name}: {seconds:.2f} s", flush=True)
            names = [name for name in names if name not in did_not_fit]
        measurements.append(
            {
                "batch_size": batch_size,
                "runs": {name: runs[name] for name in names},
                "parts": {name: parts[name] for name in names},
                "did_not_fit": did_not_fit,
            }
        )
    return measurements


def group_measurement(results, measurement):
    """The group-only pair's measurement at this batch: its own part's (runs saved before it had one kept
    the pair among the others)."""
    apart = {m["batch_size"]: m for m in results.get("group_measurements", [])}
    return apart.get(measurement["batch_size"], measurement)


def paired_ratio(runs, numerator, denominator):
    """Median over rounds of numerator/denominator, and the range: both ran in the same round."""
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs[numerator], runs[denominator], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def ratio_cell(runs, numerator, denominator):
    if numerator not in runs or denominator not in runs:
        return "-"
    median, low, high = paired_ratio(runs, numerator, denominator)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def median_seconds(runs, name):
    return statistics.median(run["seconds"] for run in runs[name])


def encoding_ratio(measurement):
    """Median encoding seconds (forward passes) of length-sorted chunks over chunks in batch order."""
    parts = measurement["parts"]
    if "ours" not in parts or "ours, unsorted" not in parts:
        return "-"
    encoding = {
        name: statistics.median(p["forward no grad"] + p["forward with grad"] for p in parts[name])
        for name in ("ours", "ours, unsorted")
    }
    return f"{encoding['ours'] / encoding['ours, unsorted']:.2f}x"


def tokens_cell(measurement, name):
    """The tokens a step's forward passes took, with padding, and their share of padding; the same every
    round at one batch (the rounds' batches differ: the median). Runs saved before it was counted: -."""
    counted = [run["tokens"] for run in measurement["runs"][name] if "tokens" in run]
    if not counted:
        return "-"
    padded = statistics.median(tokens["padded"] for tokens in counted)
    real = statistics.median(tokens["real"] for tokens in counted)
    return f"{padded:,.0f} ({padded / real:.2f}x)"


def time_cell(measurement, name):
    if name in measurement["did_not_fit"]:
        return "did not fit"
    return f"{median_seconds(measurement['runs'], name):.2f}" if name in measurement["runs"] else "-"


def table(results, args):
    agreement = results["agreement"]
    names = {"plain": "plain", "ours": "ours", "st": "ST cached"}
    losses = ", ".join(f"{names[m]} {loss:.6f}" for m, loss in agreement["losses"].items())
    gradient_diffs = ", ".join(f"{names[m]} {d:.1e}" for m, d in agreement["max_gradient_difference"].items())
    sections = [
        f"Sanity, dropout off, batch {agreement['batch_size']}: losses {losses}; largest gradient "
        f"difference to plain, relative to plain's largest gradient: {gradient_diffs}."
    ]
    ratio_rows, time_rows, part_rows = [], [], []
    for measurement in results["measurements"]:
        batch_size, runs = measurement["batch_size"], measurement["runs"]
        group = group_measurement(results, measurement)
        ratio_rows.append(
            [
                batch_size,
                ratio_cell(runs, "ours", "ST cached"),
                ratio_cell(runs, "ours, token budget", "ST cached, token budget"),
                ratio_cell(runs, "ST cached, token budget", "ST cached"),
                ratio_cell(runs, "ours", "plain"),
                ratio_cell(runs, "ST cached", "plain"),
                ratio_cell(runs, "ours, unsorted", "ours"),
                ratio_cell(runs, "ours, no reuse", "ours"),
                ratio_cell(runs, "ours, unsorted, no reuse", "ours"),
                ratio_cell(runs, "ours, unsorted, no reuse", "ST cached"),
                encoding_ratio(measurement),
                ratio_cell(group["runs"], "group-only, no cache", "group-only, cached"),
            ]
        )
        time_rows.append(
            [batch_size]
            + [time_cell(group if name in GROUP_VARIANTS else measurement, name) for name in VARIANTS]
        )
        profiled = ("plain", "ST cached", "ours", "ours, unsorted", *TOKEN_VARIANTS)
        shown = [(measurement, name) for name in profiled] + [(group, name) for name in GROUP_VARIANTS]
        for source, name in shown:
            if name in source["runs"]:
                step_parts = source["parts"][name]
                medians = [statistics.median(p.get(part, 0.0) for p in step_parts) for part in STEP_PARTS]
                seconds = [median_seconds(source["runs"], name), *medians]
                cells = [f"{value:.2f}" for value in seconds] + [tokens_cell(source, name)]
                part_rows.append([batch_size, name, *cells])
    sections.append(
        "Step time ratios: median of the per-round ratios (lowest-highest over "
        f"{args.rounds} rounds; {args.warmup} warm-up round(s) left out), chunk {args.chunk_size}"
        + (
            f"; token budget {args.chunk_tokens} (ours: padded tokens per chunk; ST cached: its "
            "mini_batch_num_tokens, tokens without padding). "
            if getattr(args, "chunk_tokens", None)
            else " (no token budget in this run). "
        )
        + "Below 1 means the first is faster. Plain runs up to batch "
        f"{args.plain_max_batch} (the memory benchmark shows what it needs beyond), ours with its switches "
        f"off up to batch {args.ablation_max_batch}. The group-only pair (the loss without in-batch "
        "negatives, through the cache and without it) "
        + ("in rounds of its own." if "group_measurements" in results else "in the same rounds.")
    )
    sections.append(
        harness.markdown_table(
            [
                "batch",
                "ours / ST cached",
                "ours / ST cached, both by token budget",
                "ST cached: token budget / chunk",
                "ours / plain",
                "ST cached / plain",
                "ours unsorted / ours",
                "ours no reuse / ours",
                "ours unsorted, no reuse / ours",
                "ours unsorted, no reuse / ST cached",
                "encoding: sorted / unsorted chunks",
                "group-only: no cache / cached",
            ],
            ratio_rows,
        )
    )
    sections.append("Median seconds per step (gradient + AdamW step):")
    sections.append(harness.markdown_table(["batch", *VARIANTS], time_rows))
    sections.append(
        "Where the time goes: median seconds per step and per part (medians need not add up to the step)."
    )
    header = ["batch", "variant", "step", *STEP_PARTS, "tokens encoded, padded (padded / real)"]
    sections.append(harness.markdown_table(header, part_rows))
    return "\n\n".join(sections)


def plot(results, args, path):
    """Per batch, each variant's step time over ours': median of the per-round ratios, bars their range."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    measurements = results["measurements"]
    shown = PARTS["main"]  # the group-only pair is timed against itself, not against ours
    width = 0.8 / len(shown)
    for v, name in enumerate(shown):
        xs, medians, lows, highs = [], [], [], []
        for m, measurement in enumerate(measurements):
            if name in measurement["runs"]:
                median, low, high = paired_ratio(measurement["runs"], name, "ours")
                xs.append(m + (v - (len(shown) - 1) / 2) * width)
                medians.append(median)
                lows.append(median - low)
                highs.append(high - median)
        axes.bar(xs, medians, width, yerr=[lows, highs], capsize=2, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(measurements)), [f"batch {m['batch_size']}" for m in measurements])
    axes.set_ylabel("step time / ours' in the same round")
    axes.set_title("Step time relative to this project (lower is faster)")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- The graph_budget sweep: how much keeping stage 1's graphs buys, against the no-cache lower bound ----
SWEEP_SHARES = {"0": 0.0, "1/4": 0.25, "1/2": 0.5, "all": math.inf}  # of the step's graph bytes


def lower_bound_step(model, chunk_size, features):
    """Each example's forward and backward once, in gradcache's chunks, no stage 1 and no loss stage: what
    no cache can beat (the gradient it leaves is not the contrastive loss's)."""
    for column in features:
        for index in gradcache.plan_chunks(column, chunk_size):
            reps = model(gradcache.select_examples(column, index))["sentence_embedding"]
            reps.sum().backward()


def budgeted_step(model, chunk_size, budget, features):
    loss_fn = partial(gradcache.contrastive_loss, scale=harness.SCALE)
    return gradcache.gradcache_step(model, features, loss_fn, chunk_size=chunk_size, graph_budget=budget)


def timed_with_peak(step, features, device):
    """(seconds, peak bytes above the memory before, what `step` returned)."""
    baseline = harness.start_peak_window(device)
    started = time.perf_counter()
    result = step(features)
    harness.synchronize(device)
    return time.perf_counter() - started, harness.peak_since_window(device) - baseline, result


def budget_sweep(device="cpu", batch_sizes=(256, 1024), chunk_size=32, rounds=1, warmup=1, num_layers=1):
    """The rows of the sweep's table (also printed): per batch and budget, the groups kept, the median step
    (gradient only) over the measured rounds, its ratio to the lower bound in the same round, the peak."""
    model = harness.load_model(device, num_layers or None)
    texts = harness.load_texts(max(batch_sizes) * (warmup + rounds))
    rows = []
    for batch_size in batch_sizes:
        features = harness.tokenize(model, texts, 0, batch_size)
        total = budgeted_step(model, chunk_size, math.inf, features).kept_bytes
        model.zero_grad(set_to_none=True)
        steps = {"no cache (lower bound)": partial(lower_bound_step, model, chunk_size)}
        steps |= {f"kept {name}": partial(budgeted_step, model, chunk_size, share * total)
                  for name, share in SWEEP_SHARES.items()}  # fmt: skip
        seen = {name: [] for name in steps}  # (seconds, peak, report) per measured round
        for round_index in range(warmup + rounds):
            features = harness.tokenize(model, texts, round_index * batch_size, batch_size)
            names = list(steps)[round_index % len(steps) :] + list(steps)[: round_index % len(steps)]
            for name in names:
                measured = timed_with_peak(steps[name], features, device)
                model.zero_grad(set_to_none=True)
                if round_index >= warmup:
                    seen[name].append(measured)
        lower = seen["no cache (lower bound)"]
        for name, runs in seen.items():
            report = runs[-1][2]
            kept = "-" if report is None else f"{report.kept_groups} of {report.num_chunks}"
            ratio = statistics.median(run[0] / low[0] for run, low in zip(runs, lower, strict=True))
            seconds, peak = statistics.median(run[0] for run in runs), max(run[1] for run in runs)
            rows.append([batch_size, name, kept, f"{seconds:.2f}", f"{ratio:.2f}x", f"{peak / 2**20:,.0f}"])
    header = ["batch", "budget (of all graphs)", "groups kept", "seconds", "/ lower bound", "peak MiB"]
    print(f"graph_budget sweep, {device}, chunk {chunk_size}, {rounds} round(s) after {warmup} warm-up:")
    print(harness.markdown_table(header, rows), flush=True)
    return rows


def save_budget_sweep(rows, info, args):
    """budget_<preset>.json and .md in --out_dir: the sweep's rows and their run (bench/make_results.py)."""
    preset = "gpu" if args.device.startswith("cuda") else "cpu"
    header = ["batch", "budget (of all graphs)", "groups kept", "seconds", "/ lower bound", "peak MiB"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"budget_{preset}.json").write_text(
        json.dumps({"provenance": info, "header": header, "rows": rows})
    )
    table = harness.markdown_table(header, rows)
    (out / f"budget_{preset}.md").write_text(harness.provenance_markdown(info) + "\n\n" + table + "\n")


def main(argv=None):
    args = parser.parse_known_args(argv)[0]
    if args.budget_sweep:
        if args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # RSS to follow the tensors
            os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | harness.MALLOC_ENV)
        batch_sizes = args.batch_sizes or [256, 1024]
        rounds, warmup = args.rounds or 1, 1 if args.warmup is None else args.warmup
        command = shlex.join(["python", "bench/speed.py", *(sys.argv[1:] if argv is None else argv)])
        info = harness.provenance(args.device, command, args.allow_dirty)  # before: a clean tree or refused
        rows = budget_sweep(
            args.device, batch_sizes, args.chunk_size or 32, rounds, warmup, args.sweep_layers
        )
        save_budget_sweep(rows, info, args)
        return
    harness.run_benchmark("speed", parser, PRESETS, measure, table, plot, "step time relative to ours", argv)


if __name__ == "__main__":
    main()
