"""The dev evaluation's time per process count: train.py's `evaluate` (queries and corpus encoded once, a
share per process, gathered) against sentence-transformers' evaluator run on every process (each encoding
all of them: what train.py did before), on the same model and dev set, and their metrics' largest difference.

    accelerate launch --config_file accelerate_configs/cpu.yaml bench/eval_time.py
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu_ddp_2proc.yaml \\
        bench/eval_time.py --dev_corpus_size 1000

It takes train.py's flags (--model, --dev_data, --dev_queries, --dev_corpus_size, --seed) and trains
nothing. Pairs only: a BEIR folder goes through the same evaluator.
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from accelerate import Accelerator, InitProcessGroupKwargs  # noqa: E402

import train  # noqa: E402
from train_parts import logs, models, pairs  # noqa: E402


def timed(function):
    started = time.perf_counter()
    return function(), time.perf_counter() - started


def main():
    args = train.parse_args([*sys.argv[1:], "--output_dir", "unused"])
    # Several processes on a CPU: gloo, or accelerate runs each as process 0 of 1 (train.make_accelerator)
    gloo = not torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo" if gloo else None)])
    model = models.load_model(args.model, str(accelerator.device), args.pooling, accelerator.print)
    dev = pairs.load_pairs(args.dev_data, args.dev_columns)[0]
    evaluator = pairs.build_evaluator(
        dev, args.dev_queries, models.role_prompts(model), args.dev_corpus_size, args.seed, accelerator.print
    )
    model.encode(evaluator.corpus[:64])  # warm-up: the first batches pay for allocations
    every, every_seconds = timed(lambda: evaluator(model))
    shared, shared_seconds = timed(lambda: logs.evaluate(evaluator, model, accelerator, global_step=0))
    difference = max(abs(shared[f"eval/{name}"] - value) for name, value in every.items())
    accelerator.print(
        f"{accelerator.num_processes} process(es), {len(evaluator.queries)} queries, {len(evaluator.corpus)} "
        f"documents: every process encoding all {every_seconds:.1f} s, a share each "
        f"{shared_seconds:.1f} s; metrics differ by {difference:.1e}"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
