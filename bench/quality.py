"""Benchmark 4: does a bigger contrastive batch train a better model here, and do false-negative masks change
the answer?

Fine-tunes all-MiniLM-L6-v2 with train.py (through `accelerate launch`, one run per point and seed) and
scores every result alike on the dev split: each dev definition retrieves its words among all distinct dev
words, MRR@10 (sentence-transformers' InformationRetrievalEvaluator). Three comparisons, each over several
seeds (the seed draws the training subset, its order and the dropout):

    equal epochs   every batch size reads the same number of examples once: a bigger batch takes fewer steps
    equal steps    every batch size takes the optimizer steps the largest batch takes in one epoch: a bigger
                   batch reads more examples
    masks          the largest batch with and without train.py's false-negative masks (--mask_flags)

Learning rate: square-root scaling, lr = reference_lr * sqrt(batch / reference_batch), the rule that keeps
Adam's update noise comparable across batch sizes (Malladi et al., NeurIPS 2022); the reference is
train.py's default (2e-4 at batch 128).

The verdict of each comparison is computed: the difference of the mean MRR@10 against the standard error of
that difference over seeds; beyond twice the standard error it is called better or worse, otherwise no
difference beyond the seed-to-seed spread.

    python bench/quality.py                             # CPU: about an hour on 2 idle cores (estimated)
    python bench/quality.py --device cuda --preset gpu  # one GPU: more data, larger batches
    python bench/quality.py --preset smoke              # seconds: the test suite runs this

Writes bench/results/quality_<preset>.{json,md,png}; the training runs go to bench/results/tmp/ and are
deleted once scored.
"""

import gzip
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import datasets
import harness
import matplotlib
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEV_FILE = harness.ROOT / "data" / "wordnet_dev.jsonl.gz"
ACCELERATE_CONFIGS = {"cpu": "accelerate_configs/cpu.yaml", "cuda": "accelerate_configs/single_gpu.yaml"}
MASK_FLAGS = "--false_negative_margin=0.1"  # Qwen3-Embedding's rule: above the positive's score + 0.1
PRESETS = {
    "cpu": {
        "batch_sizes": [32, 128, 512],
        "chunk_size": 32,
        "train_examples": 4096,
        "seeds": [1, 2, 3],
        "dev_queries": 1000,
    },
    "gpu": {
        "batch_sizes": [32, 256, 2048],
        "chunk_size": 64,
        "train_examples": 65536,
        "seeds": [1, 2, 3],
        "dev_queries": 2000,
    },
    # the test suite's: one batch size, so the two runs that launch train.py with and without masks; a corpus
    # of the words of the first 64 dev records, not of all 2000 (each of the 3 scorings encodes it whole)
    "smoke": {
        "batch_sizes": [8],
        "chunk_size": 4,
        "train_examples": 16,
        "seeds": [1],
        "dev_queries": 16,
        "dev_corpus": 64,
    },
}
SIGNIFICANT = 2.0  # standard errors of the difference of two means

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--batch_sizes", type=int, nargs="+", help="override the preset's batch sizes")
parser.add_argument("--chunk_size", type=int, help="Gradient Cache chunk of every run")
parser.add_argument("--train_examples", type=int, help="examples of an equal-epochs run (a seeded subset)")
parser.add_argument("--seeds", type=int, nargs="+", help="one run per seed at every point")
parser.add_argument("--dev_queries", type=int, help="dev definitions used as queries")
parser.add_argument(
    "--dev_corpus", type=int, help="the corpus: the words of this many first dev records (0: of all of them)"
)
parser.add_argument("--mask_flags", default=MASK_FLAGS, help="train.py flags of the masked runs")
parser.add_argument("--reference_lr", type=float, default=2e-4, help="learning rate at --reference_batch")
parser.add_argument("--reference_batch", type=int, default=128)


def learning_rate(batch_size, args):
    return args.reference_lr * math.sqrt(batch_size / args.reference_batch)


def read_jsonl(path):
    with gzip.open(path, "rt") as lines:
        return [json.loads(line) for line in lines]


def dev_train_overlap():
    """How much of the dev split the training file has seen: dev definitions and dev words found in it."""
    train, dev = read_jsonl(harness.TRAIN_FILE), read_jsonl(DEV_FILE)
    train_anchors, train_positives = {r["anchor"] for r in train}, {r["positive"] for r in train}
    train_pairs = {(r["anchor"], r["positive"]) for r in train}
    return {
        "dev_records": len(dev),
        "train_records": len(train),
        "dev_anchors_in_train": sum(r["anchor"] in train_anchors for r in dev),
        "dev_positives_in_train": sum(r["positive"] in train_positives for r in dev),
        "dev_pairs_in_train": sum((r["anchor"], r["positive"]) in train_pairs for r in dev),
    }


def dev_evaluator(num_queries, corpus_records=0):
    """Each dev definition retrieves its own words among the words of all dev records, or of the first
    `corpus_records` of them (never fewer than the queries: each query's words are in the corpus)."""
    dev = datasets.load_dataset("json", data_files=str(DEV_FILE), split="train")
    corpus = dev if not corpus_records else dev.select(range(min(max(corpus_records, num_queries), len(dev))))
    corpus_ids = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(corpus["positive"]))}
    queries = dev.select(range(min(num_queries, len(dev))))
    return InformationRetrievalEvaluator(
        queries={f"q{i}": text for i, text in enumerate(queries["anchor"])},
        corpus={doc_id: text for text, doc_id in corpus_ids.items()},
        relevant_docs={f"q{i}": {corpus_ids[text]} for i, text in enumerate(queries["positive"])},
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1],
        precision_recall_at_k=[10],
        map_at_k=[10],
        batch_size=128,
        name="dev",
        write_csv=False,
    )


def score(model_path, evaluator, device):
    metrics = evaluator(SentenceTransformer(str(model_path), device=device))
    return {"mrr@10": metrics["dev_cosine_mrr@10"], "ndcg@10": metrics["dev_cosine_ndcg@10"]}


def planned_runs(args):
    """Every (comparison, batch size, examples, extra flags) point; each runs once per seed. The largest batch
    in one epoch is shared by the three comparisons, so it runs once."""
    largest = max(args.batch_sizes)
    smaller = sorted(batch for batch in args.batch_sizes if batch != largest)
    steps = args.train_examples // largest
    points = [("equal epochs", batch, args.train_examples, "") for batch in smaller]
    points.append(("shared", largest, args.train_examples, ""))
    points += [("equal steps", batch, batch * steps, "") for batch in smaller]
    points.append(("masks", largest, args.train_examples, args.mask_flags))
    return points


def train(batch_size, examples, extra_flags, seed, args, run_dir):
    """One train.py run; its own dev evaluation is switched off (this script scores every run alike)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        ACCELERATE_CONFIGS["cuda" if args.device.startswith("cuda") else "cpu"],
        "train.py",
        f"--batch_size={batch_size}",
        f"--chunk_size={min(args.chunk_size, batch_size)}",
        "--epochs=1",
        f"--lr={learning_rate(batch_size, args):.3g}",
        f"--max_train_examples={examples}",
        f"--seed={seed}",
        "--dev_data=",
        "--save_steps=0",
        "--wandb_mode=disabled",
        f"--output_dir={run_dir}",
        "--overwrite",
        *shlex.split(extra_flags),
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=harness.ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr[-4000:]}")
    # train.py prints its derived numbers at start, the optimizer steps among them
    steps = re.search(r"^\s*total_steps: (\d+)$", done.stdout, re.MULTILINE)
    return time.perf_counter() - started, int(steps.group(1)) if steps else None


def measure(args):
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    evaluator = dev_evaluator(args.dev_queries, args.dev_corpus)
    before = score(harness.model_path(), evaluator, device)
    print(f"before fine-tuning: {before}", flush=True)
    runs = []
    for seed in args.seeds:
        for comparison, batch_size, examples, flags in planned_runs(args):
            run_dir = Path(args.out_dir) / "tmp" / f"quality_{args.preset}" / f"run_{len(runs)}"
            seconds, steps = train(batch_size, examples, flags, seed, args, run_dir)
            run = {
                "comparison": comparison,
                "batch_size": batch_size,
                "examples": examples,
                "flags": flags,
                "seed": seed,
                "lr": learning_rate(batch_size, args),
                "optimizer_steps": steps,
                "train_seconds": seconds,
            } | score(run_dir / "final", evaluator, device)
            shutil.rmtree(run_dir)
            runs.append(run)
            print(run, flush=True)
    return {"before": before, "overlap": dev_train_overlap(), "runs": runs}


# ---------------------------------------------------------------------------------------------------------
# From the runs to the verdicts
# ---------------------------------------------------------------------------------------------------------


def series(runs, comparison):
    """[(label, batch size, the runs of every seed)] of one comparison, in batch order. The shared run (the
    largest batch, one epoch, no masks) is a point of every comparison."""
    points = {}
    for run in runs:
        if run["comparison"] not in (comparison, "shared"):
            continue
        unmasked_reference = comparison == "masks" and run["comparison"] == "shared"
        label = f"batch {run['batch_size']}" + (", no masks" if unmasked_reference else "")
        points.setdefault((run["batch_size"], not unmasked_reference, label), []).append(run)
    return [(label, batch, points[key]) for key in sorted(points) for batch, _, label in [key]]


def mean_and_spread(values):
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def verdict(first, second):
    """How the mean MRR@10 of `second` compares with that of `first`: the difference, its standard error over
    seeds, and the word for it."""
    a, b = [r["mrr@10"] for r in first], [r["mrr@10"] for r in second]
    difference = statistics.fmean(b) - statistics.fmean(a)
    if min(len(a), len(b)) < 2:
        return difference, float("nan"), "one seed: no verdict"
    error = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    if abs(difference) <= SIGNIFICANT * error:
        return difference, error, "no difference beyond the seed spread"
    return difference, error, "better" if difference > 0 else "worse"


def verdicts(results, args):
    """(question, difference, standard error, word) of each comparison, computed from the runs: the largest
    batch against the smallest, and the masked run against the unmasked one."""
    rows = []
    for comparison in ("equal epochs", "equal steps", "masks"):
        points = series(results["runs"], comparison)
        (first, first_batch, first_runs), (last, _, last_runs) = points[0], points[-1]
        question = f"{comparison}: {last} against {first}"
        if comparison == "masks":
            question = f"masks ({args.mask_flags}) at batch {first_batch}: on against off"
        rows.append((question, *verdict(first_runs, last_runs)))
    return rows


def corpus_words(args):
    records = getattr(args, "dev_corpus", 0)  # results saved before --dev_corpus scored all of them
    return f"the words of the first {records} dev records" if records else "all dev words"


def table(results, args):
    overlap = results["overlap"]
    before = results["before"]["mrr@10"]
    sections = [
        f"Training: data/wordnet_train.jsonl.gz, {args.train_examples} examples in an equal-epochs run (one "
        f"epoch), chunk {args.chunk_size}, lr = {args.reference_lr:g} x sqrt(batch / "
        f"{args.reference_batch}), seeds {', '.join(map(str, args.seeds))}. Dev: {args.dev_queries} "
        f"definitions retrieving their words among {corpus_words(args)}. MRR@10 before training: "
        f"{before:.4f}.",
        f"Dev and train: of the {overlap['dev_records']} dev records, {overlap['dev_pairs_in_train']} "
        f"appear as a (definition, words) pair in the {overlap['train_records']} training records, "
        f"{overlap['dev_anchors_in_train']} dev definitions appear as training definitions and "
        f"{overlap['dev_positives_in_train']} dev words as training words (WordNet words have several "
        "senses).",
    ]
    for comparison in ("equal epochs", "equal steps", "masks"):
        rows = []
        for label, _, runs in series(results["runs"], comparison):
            mean, spread = mean_and_spread([r["mrr@10"] for r in runs])
            rows.append(
                [
                    label,
                    f"{runs[0]['lr']:.2g}",
                    runs[0]["optimizer_steps"] or "-",
                    runs[0]["examples"],
                    # the median: one run slowed by other work on the machine moves it less than a mean
                    f"{statistics.median(r['train_seconds'] for r in runs) / 60:.1f}",
                    f"{mean:.4f} ± {spread:.4f}",
                    ", ".join(f"{r['mrr@10']:.4f}" for r in runs),
                ]
            )
        header = ["run", "lr", "steps", "examples", "min/run (median)", "dev MRR@10 (mean ± sd)", "per seed"]
        sections.append(f"**{comparison.capitalize()}**\n\n" + harness.markdown_table(header, rows))
    rows = [
        [question, f"{difference:+.4f}", f"{error:.4f}", word]
        for question, difference, error, word in verdicts(results, args)
    ]
    sections.append(
        f"**Verdicts** (better or worse where the difference exceeds {SIGNIFICANT:g} standard errors)\n\n"
        + harness.markdown_table(["comparison", "MRR@10 difference", "standard error", "verdict"], rows)
    )
    return "\n\n".join(sections)


def plot(results, args, path):
    figure, axes = plt.subplots(figsize=(6, 4))
    for comparison, marker in (("equal epochs", "o"), ("equal steps", "s"), ("masks", "*")):
        points = series(results["runs"], comparison)
        if comparison == "masks":
            points = points[-1:]  # the masked run; the unmasked one is on both lines already
        spread = [mean_and_spread([run["mrr@10"] for run in runs]) for _, _, runs in points]
        axes.errorbar(
            [batch for _, batch, _ in points],
            [mean for mean, _ in spread],
            yerr=[sd for _, sd in spread],
            marker=marker,
            capsize=3,
            label="with masks" if comparison == "masks" else comparison,
        )
    axes.axhline(results["before"]["mrr@10"], color="gray", linestyle="--", label="before fine-tuning")
    harness.log_axes(
        axes, "dev MRR@10", "Batch size and retrieval quality", xlabel="contrastive batch size", log_y=False
    )
    harness.save_figure(figure, path)


def main(argv=None):
    image = "dev MRR@10 against the batch size, mean and spread over seeds"
    harness.run_benchmark("quality", parser, PRESETS, measure, table, plot, image, argv)


if __name__ == "__main__":
    main()
