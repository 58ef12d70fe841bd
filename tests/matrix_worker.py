"""One row of the feature matrix (tests/test_matrix.py): train.py's step under a backend, several processes.

Each rank loads the row's tiny sentence-transformers model with train.py's model flags
(`models.model_options`: --attn_implementation, --trust_remote_code), prepares it with train.py's own flags
(`train.parse_args`, `models.prepare_model`), wraps it as train.py does (`models.training_module`)
and runs NUM_STEPS optimizer steps of `train.gradient_cache_step` (the function train.py's loop calls) on
its shard of the global batch of texts, with plain SGD so that every update is the gradient itself. It
saves the losses gradcache reported, the trained weights, and the attention implementation and classes
the model was loaded with. As a script it is what `launch` starts under torchrun; one launch runs the
rows of one process count in sequence (DDP rows before DeepSpeed rows):

    DS_ACCELERATOR=cpu PYTHONPATH=.:tests torchrun --standalone --nproc_per_node 2 \\
        tests/matrix_worker.py OUT_DIR MODELS_JSON '[{"name": "...", "backend": "zero2", ...}]'
"""

import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import torch
from backend_worker import reset_accelerate_state, save_atomically

NUM_STEPS = 3
LEARNING_RATE = {"shared": 0.5, "towers": 0.5, "decoder": 0.02, "splade": 0.5, "inference-free": 0.5}
LEARNING_RATE["colbert"] = 0.5
# SGD: each update is the gradient; the decoder (a random Llama) diverges at 0.1, and a diverging run turns
# rounding into large differences
PER_PROCESS_BATCH = 8
UNEVEN_BATCHES = {2: [5, 11], 3: [4, 7, 13]}  # the same global batch, split unevenly over the ranks
CHUNK_SIZE = 3  # divides no batch: the last chunk of every column is short
CHUNK_TOKENS = 30  # two or three texts of 2-13 words: processes plan different numbers of chunks
MATRYOSHKA_DIMS = (32, 16, 8)  # the tiny models are 32-dimensional
FALSE_NEGATIVE_MARGIN = 0.04  # masks a few percent of the candidates of these untrained models
GUIDE = {"model": "shared", "margin": 0.04}  # "masked" rows: a frozen guide model masks too (GIST)
DISTILLATION = {"weight": 0.5, "temperature": 2.0}
COLUMNS = ("anchor", "positive", "negative_1")
# Rows of two --data sources alternate them step by step: the row's own, then pairs (no hard negatives) with
# a query prompt of their own and in-batch negatives on, and no teacher scores, whatever the first source has.
SECOND_SOURCE = {"columns": COLUMNS[:2], "query_prompt": "find: "}
WORDS = [f"w{i}" for i in range(60)]
SEED = 1234
# The sparse encoders (SparseEncoder, SPLADE): FLOPS weights large enough to matter in the gradients, unequal
# so that a swap of the two shows, and warmed up over every step: the 3 steps weigh 0, 1/9 and 4/9 of them.
SPARSE_MODELS = ("splade", "inference-free")
SPARSITY = {"query_weight": 2e-2, "document_weight": 4e-2, "warmup_ratio": 1.0}


@dataclasses.dataclass(frozen=True)
class Row:
    backend: str  # "plain" (one process, no wrapper), "ddp", "zero1", "zero2", "zero3", "fsdp2" (fsdp_shim)
    processes: int
    chunking: str  # "size" (--chunk_size), "tokens" (--chunk_tokens), "uneven" (size, uneven batches)
    model: str  # "shared" (a BERT), "towers" (Router: query and document BERTs), "decoder" (Llama),
    # "splade" (a SparseEncoder: BERT's masked-language-model head, max pooled), "inference-free" (a
    # SparseEncoder Router: static query weights, the SPLADE BERT for documents), "colbert" (a
    # MultiVectorEncoder: the BERT's token vectors, MaxSim)
    loss: str  # "one-way", "symmetric", "matryoshka"
    adapter: str  # "none", "lora", "checkpointing"
    cross: bool  # --cross_process_negatives
    negatives: str  # "in-batch", "group" (--in_batch_negatives off)
    extra: str  # "none", "masked" (repeated texts, a margin and a guide model), "distilled" (teacher scores)
    sources: int  # 1, or 2: steps from the row's source and SECOND_SOURCE in turn (several --data)
    budget: str = "none"  # --graph_budget: "none" (the last group only), "some" (half the last step's), "all"
    attention: str = "sdpa"  # --attn_implementation: "sdpa" or "eager", of every transformers model in it
    code: str = "library"  # "library" (transformers' classes), "remote" ("shared"'s BERT as a model that
    # ships its code, config.json's auto_map: --trust_remote_code; test_model_flags.build_custom_code_model)

    @property
    def folder(self):
        """The key of the row's model folder: the model's, or "custom" (the BERT with its own code)."""
        return "custom" if self.code == "remote" else self.model

    @property
    def name(self):
        cross = "cross" if self.cross else "local"
        parts = (
            self.backend,
            f"{self.processes}proc",
            self.chunking,
            self.model,
            self.loss,
            self.adapter,
            cross,
            self.negatives,
            self.extra,
            f"{self.sources}src",
            f"budget-{self.budget}",
            self.attention,
            *([self.code] if self.code == "remote" else []),  # a name seeds its row's batches: kept
        )
        return "-".join(parts)


def flags(row, model_folder, guide_folder=None):
    """The command-line flags of train.py that the row stands for (a "masked" row's guide: `guide_folder`)."""
    data = ["first.jsonl", "second.jsonl"][: row.sources]  # never read: the worker makes the batches
    chosen = ["--model", str(model_folder), "--data", *data, "--batch_size", 64]
    chosen += ["--chunk_tokens", CHUNK_TOKENS] if row.chunking == "tokens" else ["--chunk_size", CHUNK_SIZE]
    chosen += {"symmetric": ["--symmetric"], "one-way": []}.get(row.loss, [])
    if row.loss == "matryoshka":
        chosen += ["--matryoshka_dims", ",".join(map(str, MATRYOSHKA_DIMS))]
    chosen += {"lora": ["--lora_r", 4], "checkpointing": ["--gradient_checkpointing"], "none": []}[
        row.adapter
    ]
    chosen += ["--cross_process_negatives"] if row.cross else []
    chosen += ["--graph_budget", "none" if row.budget == "none" else 10**6]  # "some": halved after a step
    chosen += ["--attn_implementation", row.attention]
    chosen += ["--trust_remote_code"] if row.code == "remote" else []
    # The per-source flags: one value per source where the sources differ, the second source's last.
    if row.sources == 2:
        chosen += ["--query_prompt", "", SECOND_SOURCE["query_prompt"]]
    if row.negatives == "group":
        chosen += ["--in_batch_negatives", "off", *(["on"] if row.sources == 2 else [])]
    chosen += ["--false_negative_margin", FALSE_NEGATIVE_MARGIN] if row.extra == "masked" else []
    if row.extra == "masked" and guide_folder:
        chosen += ["--guide_model", guide_folder, "--guide_margin", GUIDE["margin"]]
    if row.extra == "distilled":  # the second source has no teacher scores
        chosen += ["--distill_weight", DISTILLATION["weight"], *([0] if row.sources == 2 else [])]
        chosen += ["--distill_temperature", DISTILLATION["temperature"]]
    if row.model in SPARSE_MODELS:
        chosen += ["--sparse_query_weight", SPARSITY["query_weight"]]
        chosen += ["--sparse_document_weight", SPARSITY["document_weight"]]
        chosen += ["--sparse_warmup_ratio", SPARSITY["warmup_ratio"]]
    return [str(flag) for flag in chosen]


def source_of_step(row, step):
    """The --data source of a step: rows of two sources take them in turn."""
    return step % row.sources


def global_batches(row):
    """NUM_STEPS global batches of texts, {column: texts}, 2-13 words each, every text distinct; "masked"
    rows plant repeats (`plant_repeats`), "distilled" rows add random teacher scores, rows x (1 + k). The
    steps of SECOND_SOURCE keep only its columns (of the repeats, the anchors')."""
    rng = random.Random(f"{row.name}")
    size = sum(batch_sizes(row))
    batches = [
        {
            column: [
                " ".join(rng.choices(WORDS, k=rng.randint(2, 13))) + f" {column[0]}{step}x{i}"
                for i in range(size)
            ]
            for column in COLUMNS
        }
        for step in range(NUM_STEPS)
    ]
    for batch in batches:
        if row.extra == "masked":
            plant_repeats(batch, row)
        if row.extra == "distilled":
            batch["teacher_scores"] = torch.tensor(
                [[rng.gauss(0, 3) for _ in COLUMNS[1:]] for _ in range(size)]
            )
    for step, batch in enumerate(batches):
        if source_of_step(row, step) == 1:
            for column in set(batch) - {*SECOND_SOURCE["columns"], "other_positives"}:
                del batch[column]
    return batches


def plant_repeats(batch, row):
    """In every shard: a hard negative that repeats another row's positive, one that repeats its own row's
    positive, an anchor that repeats another; and one that repeats the next shard's first positive. Each
    batch's "other_positives": {anchor: more right answers}, as a list of positives in the data gives."""
    anchors, positives, negatives = (batch[column] for column in COLUMNS)
    others, first = {}, 0
    for size in batch_sizes(row):
        negatives[first + 1] = positives[first + 3]
        negatives[first + 2] = positives[first + 2]
        anchors[first + 3] = anchors[first]
        others[anchors[first + 1]] = [negatives[first]]  # a right answer that is some row's hard negative
        first += size
        negatives[first - 1] = positives[first % len(positives)]
    batch["other_positives"] = others


def positives_in_data(batch):
    """{anchor: all its positives} as the data gives them: every row's, and the planted other positives."""
    positives = {}
    for anchor, positive in zip(batch["anchor"], batch["positive"], strict=True):
        positives.setdefault(anchor, {positive}).add(positive)
    for anchor, more in batch.get("other_positives", {}).items():
        positives[anchor] |= set(more)
    return positives


def batch_sizes(row):
    return UNEVEN_BATCHES[row.processes] if row.chunking == "uneven" else [PER_PROCESS_BATCH] * row.processes


def shard(batch, row, rank):
    first = sum(batch_sizes(row)[:rank])
    return {
        column: texts[first : first + batch_sizes(row)[rank]]
        for column, texts in batch.items()
        if column != "other_positives"
    }


def load_prepared(row, model_folder, device="cpu", guide_folder=None):
    """The model as train.py trains it: loaded with the row's model flags (`models.model_options`: the
    attention implementation), then prepared with the row's flags (LoRA seeded alike)."""
    import train
    from train_parts import models
    from train_parts.common import flags_of

    args = train.parse_args(flags(row, model_folder, guide_folder))
    model = models.load_model(
        args.model, device, args.pooling, **models.model_options(flags_of(models.ModelFlags, args))
    )
    torch.manual_seed(SEED)  # LoRA's initial A
    return models.prepare_model(model, flags_of(models.ModelFlags, args)), args


def transformers_models(model):
    """The attention implementation each transformers model inside `model` runs with, as its config says
    (a SparseStaticEmbedding, the inference-free query side, has no attention and no config), and their
    classes (a model that ships its code: its own)."""
    from transformers import PreTrainedModel

    found = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    return sorted({m.config._attn_implementation for m in found}), sorted({type(m).__name__ for m in found})


def trainable_weights(named_parameters, dtype=torch.float32):
    return {name: p.detach().to(dtype).cpu().clone() for name, p in named_parameters if p.requires_grad}


# ---------------------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------------------


def accelerator_for(row):
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)]  # as train.py: the BERT pooler
    if "LOCAL_RANK" in os.environ and not torch.cuda.is_available():
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # set by accelerate for an FSDP row before
    if row.backend.startswith("zero"):
        config = {
            "train_micro_batch_size_per_gpu": PER_PROCESS_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": int(row.backend[-1])},
            "zero_allow_untested_optimizer": True,  # plain SGD
            "steps_per_print": 10**9,
        }
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), kwargs_handlers=handlers)
    if row.backend == "fsdp2":  # accelerate_configs/fsdp2.yaml's settings, on CPU processes (fsdp_shim)
        from accelerate import FullyShardedDataParallelPlugin
        from fsdp_shim import install

        install()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
        )
        return Accelerator(cpu=True, fsdp_plugin=plugin, kwargs_handlers=handlers)
    return Accelerator(cpu=True, kwargs_handlers=handlers)


@dataclasses.dataclass
class AppliedUpdates:
    """What SparsityPenalty reads the step from, as it reads train.py's learning rate schedule: the optimizer
    steps done so far (`last_epoch`)."""

    last_epoch: int = 0


def run_row(row, model_folder, out_dir, guide_folder):
    import train
    from train_parts import fsdp, models, sparse
    from train_parts.common import flags_of

    reset_accelerate_state()
    accelerator = accelerator_for(row)
    assert accelerator.num_processes == row.processes, (accelerator.num_processes, row)
    model, args = load_prepared(row, model_folder, str(accelerator.device), guide_folder)
    attention, classes = transformers_models(model)  # what --attn_implementation, --trust_remote_code loaded
    guide = models.load_guide(args.guide_model, accelerator, args.trust_remote_code)
    sources = train.source_settings(args)  # each source's flags, as train.py deals them out
    prompts = [models.role_prompts(model, source.query_prompt, source.document_prompt) for source in sources]
    trained = models.training_module(model, sources)  # Towers as train.py wraps: Router, or group-only
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE[row.model]
    )
    engine, optimizer = fsdp.prepare(accelerator, trained, optimizer)
    engine.train()
    chunking = {"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {"chunk_size": args.chunk_size}
    budget = train.GraphBudget(args.graph_budget, accelerator)
    updates = AppliedUpdates()
    penalty = None  # a sparse encoder's FLOPS regularizers, warmed up over NUM_STEPS steps
    if row.model in SPARSE_MODELS:
        penalty = sparse.SparsityPenalty.of(
            flags_of(sparse.SparseFlags, args), model, updates, NUM_STEPS, say=lambda *_: None
        )
    loss_fns = [train.loss_function(source, model, penalty) for source in sources]
    losses, chunks, masked, kept = [], [], [], []
    for step, batch in enumerate(global_batches(row)):
        source = source_of_step(row, step)
        positives = positives_in_data(batch)  # what train.py's positives_by_anchor reads from the data
        known = train.positives_by_anchor(
            {"anchor": list(positives), "positive": list(map(list, positives.values()))}
        )
        stats = {}  # what train.py logs: the masked fraction among them
        report = train.gradient_cache_step(
            accelerator,
            engine,
            model,
            prompts[source],
            loss_fns[source],
            sources[source],
            shard(batch, row, accelerator.process_index),
            chunking,
            stats=stats,
            known_positives=known,
            guide=guide,
            graph_budget=budget,
        )
        optimizer.step()  # a no-op under DeepSpeed, which stepped inside the last accelerator.backward
        optimizer.zero_grad()
        updates.last_epoch += 1
        losses.append(report.loss.item())
        chunks.append(report.num_chunks)
        kept.append((report.kept_groups, report.num_reencoded))
        if row.budget == "some" and report.kept_bytes:  # half of what this step kept: some groups, not all
            budget.bytes = report.kept_bytes / 2
        masked.append(stats["masked_fraction"])
    if row.backend.startswith("zero"):
        from deepspeed.utils import safe_get_full_fp32_param

        # A collective under ZeRO-3: every rank gathers; names without Towers' "model." prefix.
        named = [(n.removeprefix("model."), p) for n, p in engine.module.named_parameters()]
        weights = {n: safe_get_full_fp32_param(p).cpu().clone() for n, p in named if p.requires_grad}
    elif row.backend == "fsdp2":  # each rank's shards gathered whole (a collective)
        named = [(n, p.full_tensor()) for n, p in model.named_parameters() if p.requires_grad]
        weights = trainable_weights(named)
    else:
        weights = trainable_weights(model.named_parameters())
    result = {"losses": losses, "chunks": chunks, "weights": weights, "masked": masked, "kept": kept}
    result |= {"attention": attention, "classes": classes, "backend": accelerator.distributed_type.value}
    result["units"] = sorted(type(m).__name__ for m in engine.modules() if hasattr(m, "unshard"))  # FSDP2's
    save_atomically(result, Path(out_dir) / f"{row.name}.rank{accelerator.process_index}.pt")
    reset_accelerate_state()


def main(out_dir, models_json, rows_json):
    os.makedirs(out_dir, exist_ok=True)
    models = json.loads(models_json)
    for fields in json.loads(rows_json):
        row = Row(**fields)
        run_row(row, models[row.folder], out_dir, models[GUIDE["model"]])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR MODELS_JSON ROWS_JSON (see the module docstring)")
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads now and then abort the interpreter's teardown, after the results are saved
