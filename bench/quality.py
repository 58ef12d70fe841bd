"""Benchmark 4: does a bigger contrastive batch give better representations on our data?

Fine-tunes all-MiniLM-L6-v2 with train.py (through `accelerate launch`) at several batch sizes, same
chunk, same training examples and number of epochs, and scores each result on the dev split: every dev
definition retrieves its words among all distinct dev words, MRR@10 (sentence-transformers'
InformationRetrievalEvaluator). The model before fine-tuning is scored the same way.

Learning rate: square-root scaling, lr = reference_lr * sqrt(batch / reference_batch), the rule that keeps
Adam's update noise comparable across batch sizes (Malladi et al., NeurIPS 2022); the reference is
train.py's default (2e-4 at batch 128). With equal epochs a bigger batch takes fewer optimizer steps.

    python bench/quality.py                             # CPU: 8192 examples, 1 epoch, 20-35 min on 2 cores
    python bench/quality.py --device cuda --preset gpu  # one GPU: all 85k examples, 1 epoch, a few minutes
    python bench/quality.py --preset smoke              # seconds: the test suite runs this

Writes bench/results/quality_<preset>.{json,md,png}; the training runs go to bench/results/tmp/ and are
deleted once scored.
"""

import math
import re
import shlex
import shutil
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
PRESETS = {
    "cpu": {
        "batch_sizes": [32, 256, 1024],
        "chunk_size": 32,
        "train_examples": 8192,
        "epochs": 1,
        "dev_queries": 2000,
    },
    "gpu": {
        "batch_sizes": [32, 256, 1024, 4096],
        "chunk_size": 32,
        "train_examples": 0,
        "epochs": 1,
        "dev_queries": 2000,
    },
    "smoke": {"batch_sizes": [8], "chunk_size": 4, "train_examples": 16, "epochs": 1, "dev_queries": 16},
}

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--batch_sizes", type=int, nargs="+", help="override the preset's batch sizes")
parser.add_argument("--chunk_size", type=int, help="Gradient Cache chunk of every run")
parser.add_argument("--train_examples", type=int, help="seeded subset of the training file; 0 for all")
parser.add_argument("--epochs", type=int, help="epochs of every run")
parser.add_argument("--dev_queries", type=int, help="dev definitions used as queries")
parser.add_argument("--reference_lr", type=float, default=2e-4, help="learning rate at --reference_batch")
parser.add_argument("--reference_batch", type=int, default=128)
parser.add_argument("--seed", type=int, default=42)


def learning_rate(batch_size, args):
    return args.reference_lr * math.sqrt(batch_size / args.reference_batch)


def dev_evaluator(num_queries):
    """Each dev definition retrieves its own words among the words of all dev records."""
    dev = datasets.load_dataset("json", data_files=str(DEV_FILE), split="train")
    corpus_ids = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(dev["positive"]))}
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


def train(batch_size, args, run_dir):
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
        f"--epochs={args.epochs}",
        f"--lr={learning_rate(batch_size, args):.3g}",
        f"--max_train_examples={args.train_examples}",
        f"--seed={args.seed}",
        "--dev_data=",
        "--save_steps=1000000",
        "--wandb_mode=disabled",
        f"--output_dir={run_dir}",
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
    evaluator = dev_evaluator(args.dev_queries)
    runs = [
        {"batch_size": None, "label": "before fine-tuning"} | score(harness.model_path(), evaluator, device)
    ]
    print(f"before fine-tuning: {runs[0]}", flush=True)
    for batch_size in args.batch_sizes:
        run_dir = Path(args.out_dir) / "tmp" / f"quality_{args.preset}" / f"batch_{batch_size}"
        seconds, steps = train(batch_size, args, run_dir)
        run = {
            "batch_size": batch_size,
            "label": f"batch {batch_size}",
            "lr": learning_rate(batch_size, args),
            "optimizer_steps": steps,
            "train_seconds": seconds,
        } | score(run_dir / "final", evaluator, device)
        shutil.rmtree(run_dir)
        runs.append(run)
        print(run, flush=True)
    return runs


def table(runs, args):
    examples = "all" if not args.train_examples else str(args.train_examples)
    rows = [
        [
            run["label"],
            f"{run['lr']:.2g}" if run["batch_size"] else "-",
            run.get("optimizer_steps") or "-",
            f"{run['train_seconds'] / 60:.1f}" if run["batch_size"] else "-",
            f"{run['mrr@10']:.4f}",
            f"{run['ndcg@10']:.4f}",
        ]
        for run in runs
    ]
    return "\n\n".join(
        [
            f"Training: {examples} examples of data/wordnet_train.jsonl.gz (seed {args.seed}, one run per "
            "batch size), "
            f"{args.epochs} epoch(s), chunk {args.chunk_size}, lr = {args.reference_lr:g} x sqrt(batch / "
            f"{args.reference_batch}). Dev: {args.dev_queries} definitions, each retrieving its words among "
            "all dev words.",
            harness.markdown_table(
                ["model", "lr", "optimizer steps", "training (min)", "dev MRR@10", "dev NDCG@10"], rows
            ),
        ]
    )


def plot(runs, args, path):
    figure, axes = plt.subplots(figsize=(6, 4))
    trained = [run for run in runs if run["batch_size"]]
    axes.plot(
        [r["batch_size"] for r in trained], [r["mrr@10"] for r in trained], marker="o", label="fine-tuned"
    )
    axes.axhline(runs[0]["mrr@10"], color="gray", linestyle="--", label="before fine-tuning")
    harness.log_axes(
        axes,
        "dev MRR@10",
        "Batch size and retrieval quality (equal epochs)",
        xlabel="contrastive batch size",
        log_y=False,
    )
    harness.save_figure(figure, path)


def main(argv=None):
    image = "dev MRR@10 against the batch size"
    harness.run_benchmark("quality", parser, PRESETS, measure, table, plot, image, argv)


if __name__ == "__main__":
    main()
