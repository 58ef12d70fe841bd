"""Benchmark 5: how far the batch goes, and what the loss stage costs on the way, false-negative masks on.

Seven parts, on anchor, positive and hard-negative columns (d = 384 representations):

    a. steps   peak memory of one full training step of gradcache_step (AdamW included) from batch 64 up,
               on data/wordnet_train.jsonl.gz; each point in a fresh process (CPU) as in bench/memory.py,
               with stage 2 (the loss and its gradients) also read alone, above its own inputs. Above
               --full_model_max_batch the model is all-MiniLM-L6-v2 cut to its first --cut_layers
               layer(s), so that the largest batches finish in minutes: the claim is about memory, and
               the loss stage does not depend on the depth of the encoder.
    b. loss    stage 2 alone on random representations: the tiled loss (gradcache.contrastive_loss)
               against the materialized one (tests/references.py, the whole B x 2B score matrix), peak
               above the inputs, each point in a fresh process, the materialized one until it no longer
               fits under --loss_cap_gib.
    c. time    seconds of stage 2 alone, tiled against materialized, in one process, alternating, where
               both fit: the median of the per-round ratios.
    d. masks   stage 2 alone as in b, the tiled loss with train.py's false-negative masks on
               (gradcache.FalseNegatives, built by harness.false_negative_masks): identity (text ids that
               repeat within and across columns, and two known positives per anchor), margin
               (--false_negative_margin 0.1), guide (a second set of fp32 representations, d = 384, as
               train.guide_representations returns them), and all three together, side by side with the
               unmasked loss, each point in a fresh process. Peak above the inputs; the masks' own inputs
               (ids, guide representations: train.py holds them before the step, as it holds the
               representations) are allocated before the window and reported apart, so that "masks
               included" can count them too. The representations are random: the masks' memory does not
               depend on what they mask (the share masked is reported, not claimed).
    e. guide   peak memory of train.guide_representations itself (the guide encoding every column of the
               batch, chunk_size texts at a time, without gradients) at two batch sizes with the same
               chunk, and at the smaller batch encoded at once (chunk = batch) for contrast; each point in
               a fresh process (the smoke preset: one process, as train.py takes seconds to import), full
               all-MiniLM-L6-v2 as the guide. The window also holds the
               representations it returns (batch x columns x d, fp32), reported apart: what is left, the
               encoding's own memory, stays flat as the batch grows if the guide never holds more than a
               chunk (sentence-transformers' encode also stacks one column's rows at its end: O(batch x d)).
               The cheapest honest reading: the real function, on real texts, two batch sizes; no training
               step is needed, since the guide runs before the step and holds nothing of it.
    f. group   peak memory of one training step of the loss without in-batch negatives (AdamW included),
               full all-MiniLM-L6-v2, chunks of --chunk_size rows: gradcache.group_step (each chunk
               back-propagated directly) and the same loss through gradcache_step, at two batch sizes,
               and group_step at the smaller batch in one chunk (chunk = batch) for contrast; each point
               in a fresh process (the smoke preset: one process, the cut model). One chunk if the peak
               stays flat as the batch grows, below the batch in one chunk.
    g. sparse  peak memory of one training step of a SPLADE model (harness.build_splade_model: a small random
               BERT with its masked-language-model head over MiniLM's 30,522-token vocabulary,
               SpladePooling("max")) as train.py trains it: its contrastive loss with the FLOPS regularizers
               (train.loss_function, SparsityPenalty) through gradcache_step, chunks of --chunk_size
               rows, AdamW included, at two batch sizes, each in a fresh process on CPU. Representations are
               vocabulary-sized: the batch's own (stage 1's cache) and their gradients (stage 2's) are
               B x columns x 30,522 fp32 each, reported apart; what the step holds beyond them should not
               grow with the batch.

    python bench/scale.py                             # CPU: to 65,536; about 55 min on 2 quiet cores (est.)
    python bench/scale.py --device cuda --preset gpu  # one H200: to 1,048,576, full model; 10-15 min (est.)
    python bench/scale.py --preset smoke              # seconds: the test suite runs this
    python bench/scale.py --parts f                   # part f again; the others stay as saved

Writes bench/results/scale_<preset>.{json,md,png}.
"""

import statistics
import time

import harness
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# part d's variants: the masks each turns on (harness.MASKS)
MASK_VARIANTS = {
    "none": [],
    "identity": ["identity"],
    "margin": ["margin"],
    "guide": ["guide"],
    "all": list(harness.MASKS),
}
MASK_LABELS = {
    "none": "unmasked",
    "identity": "identity",
    "margin": f"margin {harness.FALSE_NEGATIVE_MARGIN}",
    "guide": "guide",
    "all": "all three",
}

PRESETS = {
    "cpu": {
        "step_batch_sizes": [4**k for k in range(3, 9)],  # 64 .. 65,536
        "full_model_max_batch": 1024,
        "cut_layers": 1,
        "step_cap_gib": 20.0,  # of the 24 GiB machine: a step beyond it is reported, not swapped
        "chunk_size": 32,
        "chunk_tokens": 1024,
        # the materialized loss needs about 6.5 GiB at 16,384 and 26 GiB at 32,768
        "loss_batch_sizes": [4**k for k in range(4, 9)],  # 256 .. 65,536
        "loss_cap_gib": 8.0,
        "time_batch_sizes": [256, 1024, 4096],
        "time_rounds": 3,
        # d: about 20 s per variant at 16,384 on 2 cores (the guide mask adds one product per tile)
        "mask_batch_sizes": [1024, 4096, 16384],
        "mask_variants": list(MASK_VARIANTS),
        # e: train.py's default guide chunk (--chunk_size, else 32); 3 x 4096 texts through the full model
        "guide_batch_sizes": [512, 4096],
        "guide_chunk_size": 32,
        "guide_one_process": False,
        # f: a step at 1024 rows takes about a minute; 128 rows in one chunk (384 texts) about 4 GiB
        "group_batch_sizes": [128, 1024],
        "group_one_process": False,
        "group_layers": None,
        # g: about 40 s at 1024 and 3 min at 4096 on 2 cores (the 30,522-wide head on every token)
        "sparse_batch_sizes": [1024, 4096],
        "sparse_one_process": False,
    },
    "gpu": {
        "step_batch_sizes": [4**k for k in range(3, 11)],  # 64 .. 1,048,576
        "full_model_max_batch": 2**20,
        "cut_layers": 1,
        "step_cap_gib": None,
        "chunk_size": 256,
        "chunk_tokens": 65536,
        "loss_batch_sizes": [2**k for k in range(10, 21, 2)],  # 1024 .. 1,048,576
        "loss_cap_gib": None,
        "time_batch_sizes": [1024, 4096, 16384],  # the materialized one needs about 100 GiB at 65,536
        "time_rounds": 3,
        "mask_batch_sizes": [4096, 16384, 65536],
        "mask_variants": list(MASK_VARIANTS),
        "guide_batch_sizes": [8192, 65536],
        "guide_chunk_size": 256,
        "guide_one_process": True,  # CUDA's allocator statistics are exact per window
        "group_batch_sizes": [1024, 16384],
        "group_one_process": True,
        "group_layers": None,
        "sparse_batch_sizes": [1024, 4096],
        "sparse_one_process": True,
    },
    # the test suite's: one step of the cut model, and a loss batch where the materialized loss does not
    # fit under a small cap (it needs about 108 MiB; the tiled one, with 2048 x 2048 tiles, 55 MiB)
    "smoke": {
        "step_batch_sizes": [16],
        "full_model_max_batch": 0,
        "cut_layers": 1,
        "step_cap_gib": None,
        "chunk_size": 8,
        "chunk_tokens": 256,
        "loss_batch_sizes": [2048],
        "loss_cap_gib": 80 / 1024,
        "time_batch_sizes": [256],
        "time_rounds": 1,
        "mask_batch_sizes": [256],
        "mask_variants": ["none", "all"],
        "guide_batch_sizes": [16, 64],
        "guide_chunk_size": 8,
        "guide_one_process": True,
        "group_batch_sizes": [16, 32],
        "group_one_process": True,
        "group_layers": 1,  # seconds: the memory's shape, not its size
        "sparse_batch_sizes": [16, 32],
        "sparse_one_process": True,
    },
}
DIM, NUM_COLUMNS = 384, 3
LOSSES = ("tiled", "materialized")
# part f: the loss without in-batch negatives, each chunk back-propagated directly or through the cache
GROUP_METHODS = harness.GROUP_METHODS
GROUP_LABELS = {"group": "group_step (no cache)", "group cached": "group loss, cached"}

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--step_batch_sizes", type=int, nargs="+", help="batches of part a")
parser.add_argument("--full_model_max_batch", type=int, help="above it, part a uses the cut model")
parser.add_argument("--cut_layers", type=int, help="transformer layers the cut model keeps")
parser.add_argument("--step_cap_gib", type=float, help="memory a step may use above the process before it")
parser.add_argument("--chunk_size", type=int, help="examples per chunk where there is no token budget")
parser.add_argument("--chunk_tokens", type=int, help="padded tokens per chunk (part a)")
parser.add_argument("--loss_batch_sizes", type=int, nargs="+", help="batches of part b")
parser.add_argument("--loss_cap_gib", type=float, help="memory the loss may use above its inputs (part b)")
parser.add_argument("--tile_size", type=int, help="the tiled loss's tile (default: its own choice)")
parser.add_argument("--time_batch_sizes", type=int, nargs="+", help="batches of part c")
parser.add_argument("--time_rounds", type=int, help="measured rounds per batch of part c")
parser.add_argument("--mask_batch_sizes", type=int, nargs="+", help="batches of part d")
parser.add_argument("--mask_variants", nargs="+", choices=MASK_VARIANTS, help="masks of part d")
parser.add_argument("--guide_batch_sizes", type=int, nargs=2, help="the two batches of part e")
parser.add_argument("--guide_chunk_size", type=int, help="texts the guide encodes at a time (part e)")
parser.add_argument(
    "--guide_one_process", action="store_true", default=None, help="part e's runs in one process"
)
parser.add_argument("--group_batch_sizes", type=int, nargs=2, help="the two batches of part f")
parser.add_argument(
    "--group_one_process", action="store_true", default=None, help="part f's runs in one process"
)
parser.add_argument("--sparse_batch_sizes", type=int, nargs=2, help="the two batches of part g")
parser.add_argument(
    "--sparse_one_process", action="store_true", default=None, help="part g's runs in one process"
)
parser.add_argument(
    "--parts",
    nargs="+",
    choices="abcdefg",
    help="run only these parts again (e.g. d e); the others stay as the saved json has them, each part "
    "with the commit and date of its own run",
)


def measure_point(args, worker, one_process=False, **kwargs):
    """CUDA's allocator statistics are exact per window; CPU needs a fresh process per point (unless
    `one_process`: the smoke's, where train.py's imports would take seconds in each process)."""
    if one_process or args.device.startswith("cuda"):
        return harness.WORKERS[worker](device=args.device, **kwargs)
    return harness.measure_in_fresh_process(worker, device=args.device, **kwargs)


def measure_steps(args):
    """Every batch of part a, up to the first that does not fit."""
    cap_bytes = None if args.step_cap_gib is None else int(args.step_cap_gib * 2**30)
    points = []
    for batch_size in args.step_batch_sizes:
        point = measure_point(
            args,
            "step_memory",
            method="ours",
            batch_size=batch_size,
            chunk_size=args.chunk_size,
            chunk_tokens=args.chunk_tokens,
            num_layers=None if batch_size <= args.full_model_max_batch else args.cut_layers,
            tokenize_per_chunk=True,
            cap_bytes=cap_bytes,
        )
        points.append(point)
        shown = f"{harness.mib(point['step_peak_bytes'])} MiB" if point["fits"] else "did not fit"
        print(f"step batch {batch_size:>8}: {shown}", flush=True)
        if not point["fits"]:
            break
    return points


def measure_loss_memory(args):
    cap_bytes = None if args.loss_cap_gib is None else int(args.loss_cap_gib * 2**30)
    points = []
    for kind in LOSSES:
        for batch_size in args.loss_batch_sizes:
            point = measure_point(
                args,
                "loss_memory",
                kind=kind,
                batch_size=batch_size,
                dim=DIM,
                num_columns=NUM_COLUMNS,
                cap_bytes=cap_bytes,
                tile_size=args.tile_size,
            )
            points.append(point)
            shown = f"{harness.mib(point['added_bytes'])} MiB" if point["fits"] else "did not fit"
            print(f"{kind:>12} loss batch {batch_size:>8}: {shown}", flush=True)
            if not point["fits"]:
                break
    return points


def measure_loss_time(args):
    """Stage 2 alone, tiled and materialized taking turns (order swapped every round), one warm-up round."""
    losses = {kind: harness.loss_function(kind, args.tile_size) for kind in LOSSES}
    points = []
    for batch_size in args.time_batch_sizes:
        reps = harness.random_representations(batch_size, DIM, NUM_COLUMNS, args.device)
        seconds = {kind: [] for kind in LOSSES}
        for round_index in range(args.time_rounds + 1):
            for kind in LOSSES[round_index % 2 :] + LOSSES[: round_index % 2]:
                harness.synchronize(args.device)
                started = time.perf_counter()
                harness.loss_and_gradients(losses[kind], reps)
                harness.synchronize(args.device)
                if round_index > 0:
                    seconds[kind].append(time.perf_counter() - started)
        points.append({"batch_size": batch_size, "seconds": seconds})
        print(f"loss time batch {batch_size}: {seconds}", flush=True)
    return points


def measure_masked_loss(args):
    points = []
    for batch_size in args.mask_batch_sizes:
        for variant in args.mask_variants:
            point = measure_point(
                args,
                "masked_loss_memory",
                masks=MASK_VARIANTS[variant],
                batch_size=batch_size,
                dim=DIM,
                num_columns=NUM_COLUMNS,
                tile_size=args.tile_size,
            )
            points.append({"variant": variant, **point})
            print(
                f"{MASK_LABELS[variant]:>12} loss batch {batch_size:>8}: {harness.mib(point['added_bytes'])} "
                f"MiB, {point['masked_fraction']:.1%} masked",
                flush=True,
            )
    return points


def measure_guide(args):
    """The two batches with the same chunk, then the smaller one encoded at once; a fresh process per run
    on CPU unless --guide_one_process (the smoke: train.py's imports take seconds in each process)."""
    small = min(args.guide_batch_sizes)
    runs = [(batch, args.guide_chunk_size) for batch in args.guide_batch_sizes] + [(small, small)]
    if args.guide_one_process or args.device.startswith("cuda"):
        points = harness.measure_guide_memory(runs, device=args.device)
    else:
        points = [point for run in runs for point in measure_point(args, "guide_memory", runs=[run])]
    for point in points:
        print(
            f"guide batch {point['batch_size']:>8}, chunk {point['chunk_size']:>6}: "
            f"{harness.mib(point['added_bytes'])} MiB",
            flush=True,
        )
    return points


def measure_group(args):
    """group_step and the cached group loss at both batches, then group_step with the smaller batch in one
    chunk; a fresh process per run on CPU unless --group_one_process (the smoke's, with the cut model)."""
    small = min(args.group_batch_sizes)
    runs = [(method, batch, args.chunk_size) for batch in args.group_batch_sizes for method in GROUP_METHODS]
    runs.append(("group", small, small))
    points = []
    for method, batch_size, chunk_size in runs:
        kwargs = dict(method=method, batch_size=batch_size, chunk_size=chunk_size)
        kwargs["num_layers"] = args.group_layers
        point = measure_point(args, "step_memory", args.group_one_process, **kwargs)
        points.append(point)
        print(
            f"{GROUP_LABELS[method]:>22} batch {batch_size:>6}, chunk {chunk_size:>5}: "
            f"{harness.mib(point['step_peak_bytes'])} MiB, {point['seconds']:.0f} s",
            flush=True,
        )
    return points


def measure_sparse(args):
    """A SPLADE step at both batches, each in a fresh process on CPU unless --sparse_one_process (the
    smoke's: train.py's imports take seconds in each process)."""
    points = []
    for batch_size in args.sparse_batch_sizes:
        kwargs = dict(batch_size=batch_size, chunk_size=args.chunk_size)
        point = measure_point(args, "sparse_step_memory", args.sparse_one_process, **kwargs)
        points.append(point)
        print(
            f"sparse step batch {batch_size:>6}: {harness.mib(point['step_peak_bytes'])} MiB, "
            f"{harness.mib(point['beyond_batch_bytes'])} MiB beyond the representations and their gradients",
            flush=True,
        )
    return points


PARTS = {  # --parts: each part's key in the results, and the function that measures it
    "a": ("steps", measure_steps),
    "b": ("loss_memory", measure_loss_memory),
    "c": ("loss_time", measure_loss_time),
    "d": ("masked_loss_memory", measure_masked_loss),
    "e": ("guide_memory", measure_guide),
    "f": ("group_memory", measure_group),
    "g": ("sparse_memory", measure_sparse),
}


def measure(args):
    return {key: part(args) for letter, (key, part) in PARTS.items() if letter in (args.parts or PARTS)}


def time_ratios(point):
    """Per round, tiled seconds over materialized seconds (both ran in the same round)."""
    seconds = point["seconds"]
    return [tiled / other for tiled, other in zip(seconds["tiled"], seconds["materialized"], strict=True)]


def model_description(point):
    layers = point.get("num_layers")
    return "all-MiniLM-L6-v2" if layers is None else f"all-MiniLM-L6-v2, first {layers} layer(s)"


def steps_table(points, args):
    cap = getattr(args, "step_cap_gib", None)
    rows = [
        [
            point["batch_size"],
            model_description(point),
            point["longest_text_tokens"],
            harness.mib(point["step_peak_bytes"]),
            harness.mib(point["baseline_bytes"] + point["step_peak_bytes"]),
            harness.mib(point["phase_added_bytes"]["loss"]),
            f"{point['seconds']:.0f}",
        ]
        if point["fits"]
        else [point["batch_size"], model_description(point), "-", *[f"did not fit in {cap:g} GiB"] * 3, "-"]
        for point in points
    ]
    chunks = f"chunk {args.chunk_size}"
    if args.chunk_tokens:
        chunks = f"chunks of {args.chunk_tokens} padded tokens"
    if points and points[0].get("tokenize_per_chunk"):
        chunks += ", the batch as texts tokenized chunk by chunk (as train.py does)"
    return "\n\n".join(
        [
            f"a. One training step of gradcache_step (AdamW included), {chunks}. Above batch "
            f"{args.full_model_max_batch} the model keeps only its first {args.cut_layers} layer(s), so that "
            "the step finishes in minutes; the loss stage is the same for any depth.",
            harness.markdown_table(
                [
                    "batch",
                    "model",
                    "longest text (tokens)",
                    "step peak above the process before it (MiB)",
                    "process peak, all included (MiB)",
                    "stage 2 alone, above its inputs (MiB)",
                    "step (s)",
                ],
                rows,
            ),
        ]
    )


def loss_memory_table(points, args):
    by_key = {(p["kind"], p["batch_size"]): p for p in points}

    def cell(kind, batch_size):
        return harness.memory_cell(points, "kind", kind, batch_size, "added_bytes", args.loss_cap_gib)

    rows = []
    for batch_size in args.loss_batch_sizes:
        tiled, materialized = by_key.get(("tiled", batch_size)), by_key.get(("materialized", batch_size))
        inputs = (tiled or materialized)["input_bytes"] if (tiled or materialized) else None
        both = tiled and materialized and tiled["fits"] and materialized["fits"]
        rows.append(
            [
                batch_size,
                harness.mib(inputs) if inputs else "-",
                cell("tiled", batch_size),
                cell("materialized", batch_size),
                f"{materialized['added_bytes'] / tiled['added_bytes']:.1f}x" if both else "-",
            ]
        )
    return "\n\n".join(
        [
            f"b. Stage 2 alone (loss and representation gradients) on random fp32 representations, "
            f"{NUM_COLUMNS} columns of d = {DIM}: peak above the inputs, each point in a fresh process.",
            harness.markdown_table(
                ["batch", "inputs (MiB)", "tiled (MiB)", "materialized (MiB)", "materialized / tiled"], rows
            ),
        ]
    )


def loss_time_table(points, args):
    rows = []
    for point in points:
        ratios = time_ratios(point)
        rows.append(
            [
                point["batch_size"],
                f"{statistics.median(point['seconds']['tiled']):.3f}",
                f"{statistics.median(point['seconds']['materialized']):.3f}",
                f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            ]
        )
    return "\n\n".join(
        [
            f"c. Seconds of stage 2 alone, median of {args.time_rounds} rounds (one warm-up round left out), "
            "tiled and materialized taking turns.",
            harness.markdown_table(
                ["batch", "tiled (s)", "materialized (s)", "tiled / materialized (lowest-highest)"], rows
            ),
        ]
    )


def mask_cell(point):
    """Its MiB and the candidates it masked per anchor (the share of the batch's 2B - 1 times that)."""
    per_anchor = point["masked_fraction"] * (point["batch_size"] * (point["num_columns"] - 1) - 1)
    return f"{harness.mib(point['added_bytes'])} ({per_anchor:.2f})"


def masked_loss_table(points, args):
    by_key = {(p["variant"], p["batch_size"]): p for p in points}
    variants = [v for v in MASK_VARIANTS if v in args.mask_variants]
    rows = []
    for batch_size in args.mask_batch_sizes:
        measured = {v: by_key[v, batch_size] for v in variants if (v, batch_size) in by_key}
        if not measured:
            continue
        unmasked, masked = measured.get("none"), measured.get("all")
        both = unmasked and masked
        rows.append(
            [
                batch_size,
                harness.mib(next(iter(measured.values()))["input_bytes"]),
                harness.mib(max(p["mask_input_bytes"] for p in measured.values())),
                *[mask_cell(measured[v]) if v in measured else "-" for v in variants],
                harness.mib(masked["added_bytes"] - unmasked["added_bytes"]) if both else "-",
                f"{masked['added_bytes'] / unmasked['added_bytes']:.2f}x" if both else "-",
            ]
        )
    header = [
        "batch",
        "inputs (MiB)",
        "masks' inputs, all three (MiB)",
        *[f"{MASK_LABELS[v]} (MiB, masked per anchor)" for v in variants],
        "all three minus unmasked (MiB)",
        "all three / unmasked",
    ]
    return "\n\n".join(
        [
            f"d. Stage 2 alone as in b, the tiled loss with the false-negative masks on: identity (ids that "
            f"repeat, two known positives per anchor), margin {harness.FALSE_NEGATIVE_MARGIN} (absolute), "
            f"guide (a second set of d = {DIM} representations), and all three. Peak above the inputs, the "
            "masks' own inputs (ids, guide representations) allocated before it and listed apart; each point "
            "in a fresh process. The candidates masked per anchor (of 2B - 1) are those of random "
            "representations and ids: the memory does not depend on how many.",
            harness.markdown_table(header, rows),
        ]
    )


def guide_table(points, args):
    rows = [
        [
            point["batch_size"],
            point["chunk_size"],
            "yes" if point["chunk_size"] >= point["batch_size"] else "no",
            point["longest_text_tokens"],
            harness.mib(point["added_bytes"]),
            harness.mib(point["output_bytes"]),
            harness.mib(point["added_bytes"] - point["output_bytes"]),
        ]
        for point in points
    ]
    return "\n\n".join(
        [
            "e. The guide model's encoding, train.guide_representations (full all-MiniLM-L6-v2 as the guide, "
            "every column of the batch, no gradients): peak above the process before it, "
            + (
                "every point in one process"
                if getattr(args, "guide_one_process", False) or args.device.startswith("cuda")
                else "each point in a fresh process"
            )
            + ", the representations it returns counted apart.",
            harness.markdown_table(
                [
                    "batch",
                    "chunk (texts)",
                    "whole batch at once",
                    "longest text (tokens)",
                    "peak (MiB)",
                    "representations returned (MiB)",
                    "peak minus returned (MiB)",
                ],
                rows,
            ),
        ]
    )


def group_table(points, args):
    rows = [
        [
            GROUP_LABELS[point["method"]],
            point["batch_size"],
            point["chunk_size"],
            "yes" if point["chunk_size"] >= point["batch_size"] else "no",
            point["longest_text_tokens"],
            harness.mib(point["step_peak_bytes"]),
            f"{point['seconds']:.0f}",
        ]
        for point in points
    ]
    where = (
        "every point in one process"
        if getattr(args, "group_one_process", False) or args.device.startswith("cuda")
        else "each point in a fresh process"
    )
    layers = getattr(args, "group_layers", None)
    model = "" if layers is None else f", the model cut to {layers} layer(s)"
    return "\n\n".join(
        [
            "f. One training step (AdamW included) of the loss without in-batch negatives "
            "(`gradcache.group_loss`, each anchor against its own positive and hard negative), chunks of "
            f"rows (a chunk of c rows encodes c texts of each column): peak above the process before it, "
            f"{where}{model}.",
            harness.markdown_table(
                [
                    "step",
                    "batch",
                    "chunk (rows)",
                    "whole batch in one chunk",
                    "longest text (tokens)",
                    "peak (MiB)",
                    "seconds (one step)",
                ],
                rows,
            ),
        ]
    )


def sparse_table(points, args):
    rows = [
        [
            point["batch_size"],
            point["chunk_size"],
            point["longest_text_tokens"],
            harness.mib(point["step_peak_bytes"]),
            harness.mib(point["phase_peak_bytes"]["chunks"]),
            harness.mib(point["phase_peak_bytes"]["loss"]),
            harness.mib(point["representation_bytes"]),
            harness.mib(point["representation_gradient_bytes"]),
            harness.mib(point["beyond_batch_bytes"]),
            f"{point['query_active_dims']:,.0f} / {point['document_active_dims']:,.0f}",
            f"{point['seconds']:.0f}",
        ]
        for point in points
    ]
    on_cuda = getattr(args, "sparse_one_process", False) or args.device.startswith("cuda")
    where = "every point in one process" if on_cuda else "each point in a fresh process"
    vocabulary = points[0]["vocabulary"] if points else 0
    return "\n\n".join(
        [
            "g. One training step (AdamW included) of a SPLADE model, a small random BERT with its "
            f"masked-language-model head over a {vocabulary:,}-token vocabulary and SpladePooling, as "
            "train.py trains it (contrastive loss, dot product, FLOPS regularizers at full weight), chunks "
            f"of rows: peak above the process before it, {where}. The batch's representations (stage 1's "
            "cache) and their gradients (stage 2's) are batch x 3 x vocabulary fp32 each; the step's memory "
            "beyond them is the last memory column. Stages 1 and 3 hold the cache or the gradients and one "
            "chunk's graph; stage 2 both, the loss's tiles and stage 1's last chunk, kept for stage 3. The "
            "active dimensions are those of the random model before training.",
            harness.markdown_table(
                [
                    "batch",
                    "chunk (rows)",
                    "longest text (tokens)",
                    "step peak (MiB)",
                    "stages 1 and 3 (MiB)",
                    "stage 2 (MiB)",
                    "representations (MiB)",
                    "their gradients (MiB)",
                    "beyond both (MiB)",
                    "active dimensions, query / document",
                    "seconds (one step)",
                ],
                rows,
            ),
        ]
    )


def plot(results, args, path):
    figure, (steps_axes, loss_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = [point for point in results["steps"] if point["fits"]]
    batches = [p["batch_size"] for p in steps]
    steps_axes.plot(batches, [p["step_peak_bytes"] / 2**20 for p in steps], marker="o", label="step peak")
    steps_axes.plot(
        batches,
        [p["phase_added_bytes"]["loss"] / 2**20 for p in steps],
        marker="s",
        label="stage 2 alone, above its inputs",
    )
    harness.log_axes(steps_axes, "MiB above the process before it", f"a. Training steps ({args.device})")
    for kind in LOSSES:
        fitting = [p for p in results["loss_memory"] if p["kind"] == kind and p["fits"]]
        if fitting:
            batches = [p["batch_size"] for p in fitting]
            loss_axes.plot(batches, [p["added_bytes"] / 2**20 for p in fitting], marker="o", label=kind)
        failed = [p["batch_size"] for p in results["loss_memory"] if p["kind"] == kind and not p["fits"]]
        if failed and args.loss_cap_gib is not None:
            loss_axes.plot(
                failed,
                [args.loss_cap_gib * 1024] * len(failed),
                marker="x",
                linestyle="none",
                color="black",
                label=f"{kind}: did not fit in {harness.mib(args.loss_cap_gib * 2**30)} MiB",
            )
    for variant in ("all",):
        masked = [p for p in results.get("masked_loss_memory", []) if p["variant"] == variant]
        if masked:
            loss_axes.plot(
                [p["batch_size"] for p in masked],
                [p["added_bytes"] / 2**20 for p in masked],
                marker="^",
                label=f"tiled, masks: {MASK_LABELS[variant]} (d)",
            )
    harness.log_axes(loss_axes, "MiB above the inputs", "b, d. The loss stage alone")
    harness.save_figure(figure, path)


def table(results, args):
    tables = [
        steps_table(results["steps"], args),
        loss_memory_table(results["loss_memory"], args),
        loss_time_table(results["loss_time"], args),
    ]
    if "masked_loss_memory" in results:  # results saved before parts d and e have neither
        tables.append(masked_loss_table(results["masked_loss_memory"], args))
        tables.append(guide_table(results["guide_memory"], args))
    if "group_memory" in results:  # results saved before part f have none
        tables.append(group_table(results["group_memory"], args))
    if "sparse_memory" in results:  # results saved before part g have none
        tables.append(sparse_table(results["sparse_memory"], args))
    return "\n\n".join(tables)


def main(argv=None):
    image = "memory of the step and of the loss stage against the batch size"
    harness.run_benchmark("scale", parser, PRESETS, measure, table, plot, image, argv)


if __name__ == "__main__":
    main()
