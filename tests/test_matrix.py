"""The feature matrix: backends x processes x chunking x models x losses x adapters x cross-process negatives
x in-batch or group-only negatives x false-negative masks or distillation x one or two data sources x graph
budgets x attention implementations (sdpa, eager) x models of transformers' classes or with code of their
own (--trust_remote_code).

Every row trains NUM_STEPS SGD steps through train.py's own step (`train.gradient_cache_step`, on a model
prepared by train.py's flags; tests/matrix_worker.py) under its backend and process count, on CPU (gloo,
DeepSpeed's CPU accelerator; FSDP2 through tests/fsdp_shim.py, each transformer layer a unit, as
train_parts/fsdp.py prepares it), and is compared with a reference that shares none of our code: the
model built from sentence-transformers and peft directly (`reference_model`), sentence-transformers' own loss
(MultipleNegativesRankingLoss, its symmetric form, MatryoshkaLoss) on the whole global batch in one process,
unchunked, dropout off, plain autograd and SGD. Without cross-process negatives the reference is the mean of
each rank's loss on its own shard (what DDP and DeepSpeed average). Rows with a loss sentence-transformers
lacks (masks of repeated texts and a margin, a teacher's scores, no in-batch negatives) take
tests/references.py's `reference_objective` instead: plain autograd on the materialized scores, masks read
entry by entry from the texts, the same in every other respect; a distilled multi-vector row takes
sentence-transformers' MultiVectorMultipleNegativesRankingLoss plus a plain-torch KL on its colbert_scores
(references.py's `maxsim_distilled_loss`). The reference shares the batches
(`global_batches`, `shard`) and, for masked rows, the guide model's folder with the run; nothing else.

The sparse encoders (models "splade" and "inference-free", SparseEncoder; rows trained with train.py's
SparsityPenalty at SPARSITY's FLOPS weights, warmed up over the NUM_STEPS steps) are compared with
sentence-transformers' SpladeLoss over SparseMultipleNegativesRankingLoss (dot products at scale 1; its
symmetric form as above), loaded as a SparseEncoder, each step's regularizer weights set by
sentence-transformers' own SpladeRegularizerWeightSchedulerCallback (warmup_ratio 1: 0, 1/9, 4/9 of them);
on the global batch with cross-process negatives, else on each shard, averaged. Their masked and distilled
rows take `reference_objective` on dot products at scale 1 plus sentence-transformers' FlopsLoss of the
anchors and of the positives and hard negatives, at the callback's weights.

The reference runs twice, in float64 (the truth) and in float32; the reported losses and the weight updates
after the last step must be as close to the float64 truth as references.py's rule allows
(4 x the float32 reference's own distance + 1e-6), and the run against the reference one step short must
fail that rule, and so must the run against the reference of the other partition (cross-process negatives
or each rank's own shard; rows with in-batch negatives, where it matters), and, for a sparse row, the run
against the reference without the FLOPS terms: the negative controls. `-s` prints each row's errors beside
the float32 reference's.

The rows are a pairwise covering: every pair of values of two dimensions appears in some row
(`test_rows_cover_every_pair`), except pairs that cannot exist: "plain" runs one process, DDP and FSDP2 two or
more, and uneven batch sizes need two processes or more; group-only negatives have no symmetric direction and
no cross-process candidates; a sparse encoder takes neither Matryoshka nor group-only negatives (train.py
refuses them). The first three rows and the seventh are the defects that issue 15
found in combinations; before its fix they crashed (gloo: "collective mismatch"), hung, trained wrong
weights without a word (update off by 100%), and crashed (DDP: "marked as ready twice"). This table is
the list of what is supported together; the README points here.
Rows 4-6 run the first three again without in-batch negatives (`gradcache.group_step`), on the same
chunk plan agreement and tower grouping. Rows of two sources (several --data, each with its flags) take
their steps from the row's source and from pairs with a query prompt of their own and in-batch negatives
in turn, as pairs.py's SourceMix deals steps: the number of columns, the prompt and the step function
(group_step, gradcache_step) change from one step to the next under the same engine.
Each row loads its model with --attn_implementation sdpa or eager (train.py's `model_options`, as
train.py loads --model), and the run checks that every transformers model in it (the inference-free
query side, a SparseStaticEmbedding, has no attention) was loaded with that implementation; every model
kind takes both, so `possible()` excludes no pair of it. The reference loads sentence-transformers'
default (sdpa) in every row: eager computes the same attention, another way. Rows of code "remote" ("shared"
rows only: `possible()`) train "shared"'s BERT as a model that ships its code (config.json's auto_map,
tests/test_model_flags.py's `build_custom_code_model`) with --trust_remote_code, and the run checks that
the model's own class was loaded; the reference loads it with sentence-transformers' trust_remote_code.

    .venv/bin/python -m pytest -q tests/test_matrix.py
"""

import dataclasses
import itertools
import json

import pytest
import torch
from backend_worker import torchrun
from matrix_worker import (
    COLUMNS,
    DISTILLATION,
    FALSE_NEGATIVE_MARGIN,
    GUIDE,
    LEARNING_RATE,
    MATRYOSHKA_DIMS,
    NUM_STEPS,
    SECOND_SOURCE,
    SEED,
    SPARSE_MODELS,
    SPARSITY,
    Row,
    global_batches,
    positives_in_data,
    shard,
    source_of_step,
    trainable_weights,
)
from references import (
    Exactness,
    exactness,
    maxsim_distilled_loss,
    maxsim_kept_in_float64,
    reference_objective,
    relative_error,
)
from test_model_flags import build_custom_code_model
from test_train import build_tiny_model

DIMENSIONS = {
    "backend": ("plain", "ddp", "zero1", "zero2", "zero3", "fsdp2"),
    "processes": (1, 2, 3),
    "chunking": ("size", "tokens", "uneven"),
    "model": ("shared", "towers", "decoder", "splade", "inference-free", "colbert"),
    "loss": ("one-way", "symmetric", "matryoshka"),
    "adapter": ("none", "lora", "checkpointing"),
    "cross": (False, True),
    "negatives": ("in-batch", "group"),
    "extra": ("none", "masked", "distilled"),
    "sources": (1, 2),
    "budget": ("none", "some", "all"),
    "attention": ("sdpa", "eager"),
    "code": ("library", "remote"),
}

# fmt: off
ROWS = [Row(*fields) for fields in [
    # backend, processes, chunking, model, loss, adapter, cross, negatives, extra, sources, budget, attention,
    # code ("library" unless given)
    # issue 15's defects as found, through gradcache_step
    ("zero2", 2, "tokens", "shared",  "one-way",    "none", False, "in-batch", "none", 1, "all", "sdpa"),
    ("zero3", 2, "tokens", "towers",  "one-way",    "none", False, "in-batch", "none", 1, "none", "sdpa"),
    ("zero3", 1, "tokens", "towers",  "one-way",    "none", False, "in-batch", "none", 1, "none", "sdpa"),
    # the same without in-batch negatives (group_step), and the rest of the covering
    ("zero2", 2, "tokens", "shared", "one-way",
     "none", False, "group", "masked", 1, "none", "eager", "remote"),
    ("zero3", 2, "tokens", "towers",  "one-way",    "none", False, "group", "masked", 2, "none", "eager"),
    ("zero3", 1, "tokens", "towers",  "one-way",    "none", False, "group", "distilled", 2, "none", "eager"),
    ("ddp", 2, "size", "towers", "one-way", "none", False, "in-batch", "distilled", 1, "some", "eager"),
    ("plain", 1, "size", "shared", "matryoshka",
     "checkpointing", True, "in-batch", "masked", 1, "some", "sdpa", "remote"),
    ("zero1", 2, "uneven", "decoder", "symmetric",  "lora", True, "in-batch", "none", 2, "all", "eager"),
    ("ddp", 3, "tokens", "decoder", "matryoshka",
     "checkpointing", False, "group", "masked", 2, "none", "sdpa"),
    ("plain", 1, "tokens", "towers",  "symmetric",  "lora", False, "in-batch", "distilled", 2, "all", "sdpa"),
    ("zero2", 3, "uneven", "towers", "one-way", "checkpointing", True, "in-batch", "none", 1, "all", "eager"),
    ("zero3", 3, "size", "shared", "symmetric",
     "lora", True, "in-batch", "masked", 1, "all", "eager", "remote"),
    ("zero1", 1, "size",   "decoder", "one-way",    "none", False, "group", "masked", 2, "none", "sdpa"),
    ("ddp", 2, "uneven", "shared", "matryoshka",
     "none", True, "in-batch", "none", 2, "all", "eager", "remote"),
    ("zero1", 2, "tokens", "towers", "matryoshka",
     "checkpointing", True, "in-batch", "distilled", 1, "some", "sdpa"),
    ("zero2", 1, "size",   "decoder", "matryoshka", "lora", True, "in-batch", "none", 1, "all", "eager"),
    ("zero3", 2, "uneven", "decoder", "matryoshka",
     "checkpointing", False, "group", "masked", 2, "none", "eager"),
    ("zero1", 3, "tokens", "shared", "symmetric",
     "none", False, "in-batch", "distilled", 1, "some", "eager", "remote"),
    ("plain", 1, "tokens", "decoder", "one-way",    "lora", False, "group", "none", 2, "none", "eager"),
    ("zero3", 1, "tokens", "decoder", "symmetric",
     "checkpointing", False, "in-batch", "none", 1, "some", "sdpa"),
    ("ddp", 2, "uneven", "decoder", "symmetric", "lora", True, "in-batch", "distilled", 2, "some", "eager"),
    ("plain", 1, "size",   "decoder", "symmetric",  "none", True, "in-batch", "none", 2, "none", "sdpa"),
    ("zero2", 1, "tokens", "towers", "symmetric", "none", False, "in-batch", "distilled", 2, "some", "sdpa"),
    # the sparse encoders (SPLADE's FLOPS regularizers): every backend, each
    ("plain", 1, "tokens", "splade", "one-way", "lora", True, "in-batch", "masked", 2, "some", "sdpa"),
    ("ddp", 2, "uneven", "splade", "symmetric",
     "checkpointing", False, "in-batch", "none", 1, "all", "eager"),
    ("zero1", 3, "size", "splade", "one-way", "none", True, "in-batch", "distilled", 1, "none", "eager"),
    ("zero2", 2, "tokens", "splade", "symmetric", "lora", True, "in-batch", "none", 2, "none", "eager"),
    ("zero3", 2, "uneven", "splade", "one-way", "checkpointing", True, "in-batch", "none", 1, "some", "sdpa"),
    ("plain", 1, "size", "inference-free", "symmetric",
     "checkpointing", False, "in-batch", "distilled", 1, "all", "sdpa"),
    ("ddp", 3, "tokens", "inference-free", "one-way", "lora", True, "in-batch", "none", 2, "some", "sdpa"),
    ("zero1", 2, "uneven", "inference-free", "symmetric",
     "none", False, "in-batch", "masked", 1, "none", "eager"),
    ("zero2", 2, "size", "inference-free", "one-way",
     "checkpointing", True, "in-batch", "distilled", 2, "none", "sdpa"),
    ("zero3", 2, "tokens", "inference-free", "one-way", "none", True, "in-batch", "none", 1, "all", "sdpa"),
    # FSDP2 (fully_shard, each transformer layer a unit; tests/fsdp_shim.py on these CPU processes)
    ("fsdp2", 2, "tokens", "shared", "one-way",
     "lora", True, "in-batch", "masked", 2, "some", "eager", "remote"),
    ("fsdp2", 3, "uneven", "towers", "matryoshka",
     "checkpointing", False, "group", "distilled", 1, "none", "sdpa"),
    ("fsdp2", 2, "size", "decoder", "symmetric", "none", True, "in-batch", "none", 1, "all", "sdpa"),
    ("fsdp2", 2, "uneven", "splade", "one-way",
     "checkpointing", False, "in-batch", "none", 2, "all", "eager"),
    ("fsdp2", 3, "tokens", "inference-free", "symmetric",
     "lora", True, "in-batch", "masked", 1, "some", "sdpa"),
    # the multi-vector model (ColBERT: token matrices, MaxSim): every backend, each
    ("plain", 1, "size", "colbert", "one-way", "lora", True, "in-batch", "none", 1, "some", "sdpa"),
    ("ddp", 2, "uneven", "colbert", "one-way",
     "checkpointing", True, "in-batch", "distilled", 2, "all", "eager"),
    ("zero1", 3, "tokens", "colbert", "one-way", "none", False, "in-batch", "none", 1, "none", "eager"),
    ("zero2", 2, "tokens", "colbert", "one-way",
     "checkpointing", False, "in-batch", "none", 2, "all", "sdpa"),
    ("zero3", 2, "uneven", "colbert", "one-way", "none", True, "in-batch", "none", 1, "none", "sdpa"),
    ("fsdp2", 2, "tokens", "colbert", "one-way", "lora", True, "in-batch", "none", 1, "some", "sdpa"),
]]
# fmt: on
MODEL_KINDS = {
    "shared": "mean",
    "towers": "router",
    "decoder": "decoder",
    "splade": "splade",
    "inference-free": "inference-free",
    "colbert": "colbert",
}


def possible(values):
    """Whether values of some dimensions can meet in a run."""
    backend, processes, chunking = (values.get(k) for k in ("backend", "processes", "chunking"))
    if processes is not None and (backend, processes == 1) in {
        ("plain", False),
        ("ddp", True),
        ("fsdp2", True),
    }:
        return False
    if values.get("negatives") == "group" and (values.get("loss") == "symmetric" or values.get("cross")):
        return False  # without in-batch negatives there is no reverse direction, nor other processes' rows
    if values.get("negatives") == "group" and values.get("budget") not in (None, "none"):
        return False  # group_step keeps no graphs: each chunk of rows is back-propagated as it is encoded
    if values.get("model") in SPARSE_MODELS and (values.get("loss"), values.get("negatives")) != (None, None):
        if values.get("loss") == "matryoshka" or values.get("negatives") == "group":
            return False  # train.py refuses them for a sparse encoder (check_sparse_flags)
    if values.get("model") == "colbert" and (
        values.get("loss") not in (None, "one-way")
        or values.get("negatives") not in (None, "in-batch")
        or values.get("extra") == "masked"  # the margin and the guide (repeated texts are masked in any row)
    ):
        return False  # train.py refuses the rest for a multi-vector model (multi_vector.check_flags)
    if values.get("code") == "remote" and values.get("model") not in (None, "shared"):
        return False  # the model that ships its code is "shared"'s BERT (build_custom_code_model)
    return not (chunking == "uneven" and (processes == 1 or backend == "plain"))


def test_rows_cover_every_pair():
    needed = {
        (a, x, b, y)
        for a, b in itertools.combinations(DIMENSIONS, 2)
        for x in DIMENSIONS[a]
        for y in DIMENSIONS[b]
        if possible({a: x, b: y})
    }
    rows = [dataclasses.asdict(row) for row in ROWS]
    assert all(possible(row) for row in rows)
    covered = {(a, row[a], b, row[b]) for row in rows for a, b in itertools.combinations(DIMENSIONS, 2)}
    assert needed <= covered, sorted(needed - covered)
    assert len({row.name for row in ROWS}) == len(ROWS)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    folders = {
        name: str(build_tiny_model(tmp_path_factory.mktemp(name), dropout=0.0, kind=kind))
        for name, kind in MODEL_KINDS.items()
    }
    return folders | {"custom": str(build_custom_code_model(tmp_path_factory.mktemp("custom")))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_folders):
    """results_of(row) -> every rank's result; the rows of one process count run in one torchrun launch
    (DDP and plain rows before DeepSpeed ones: accelerate keeps DeepSpeed switched on once it was used)."""
    done = {}

    def results_of(row):
        if row.processes not in done:
            rows = sorted(
                (r for r in ROWS if r.processes == row.processes), key=lambda r: r.backend.startswith("zero")
            )
            out_dir = tmp_path_factory.mktemp(f"matrix{row.processes}")
            arguments = [str(out_dir), json.dumps(model_folders)]
            arguments.append(json.dumps([{k: v for k, v in dataclasses.asdict(r).items()} for r in rows]))
            environment = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            try:
                torchrun("tests/matrix_worker.py", arguments, row.processes, environment, timeout=600)
                done[row.processes] = out_dir
            except Exception as error:
                done[row.processes] = error
        if isinstance(done[row.processes], Exception):
            raise done[row.processes]
        return [torch.load(done[row.processes] / f"{row.name}.rank{r}.pt") for r in range(row.processes)]

    return results_of


def sentence_transformers_loss(row, model, teacher=None):
    """The row's loss from sentence-transformers; a ColBERT's with a teacher's scores (B x (1 + k)) plus a
    plain-torch KL on its colbert_scores (references.py's maxsim_distilled_loss)."""
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    if row.model == "colbert" and teacher is not None:
        return maxsim_distilled_loss(model, teacher, DISTILLATION["weight"], DISTILLATION["temperature"])
    if row.model == "colbert":  # MaxSim at its default scale, 1
        return MultiVectorMultipleNegativesRankingLoss(model)

    if row.loss == "symmetric":
        return MultipleNegativesRankingLoss(
            model, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
        )
    if row.loss == "matryoshka":
        return MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), list(MATRYOSHKA_DIMS))
    return MultipleNegativesRankingLoss(model)


def sparse_loss(row, model):
    """A sparse row's loss from sentence-transformers: SpladeLoss over SparseMultipleNegativesRankingLoss
    (dot products at scale 1; both directions, each normalized apart, where the row is symmetric), with
    FLOPS regularizers of the row's maximal weights, which `regularizer_weights` then warms up."""
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    options = {}
    if row.loss == "symmetric":
        options = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
    return SpladeLoss(
        model,
        SparseMultipleNegativesRankingLoss(model, scale=1.0, **options),
        document_regularizer_weight=SPARSITY["document_weight"],
        query_regularizer_weight=SPARSITY["query_weight"],
    )


def regularizer_weights(splade):
    """Each step's (query, document) FLOPS weights, as sentence-transformers' own callback sets them on
    `splade` (a SpladeLoss) at the start of each step of a trainer of NUM_STEPS steps."""
    from sentence_transformers.sparse_encoder.callbacks import SpladeRegularizerWeightSchedulerCallback
    from transformers import TrainerControl, TrainerState

    callback = SpladeRegularizerWeightSchedulerCallback(splade, warmup_ratio=SPARSITY["warmup_ratio"])
    state = TrainerState(max_steps=NUM_STEPS, global_step=0)
    callback.on_train_begin(None, state, TrainerControl())
    for step in range(NUM_STEPS):
        state.global_step = step
        callback.on_step_begin(None, state, TrainerControl())
        yield splade.query_regularizer_weight, splade.document_regularizer_weight


def independent_loss(row, model, batch, guide, positives_of, in_batch, flops_weights=None):
    """For the rows sentence-transformers has no loss for (masks, distillation, no in-batch negatives):
    tests/references.py's, on the model's representations of the batch, masks read from the texts and the
    guide's scores ("masked" rows; each text encoded alone, whatever train.py's batches).
    positives_of: what the data (the global batch) says is right for each anchor. A sparse encoder's scores
    are dot products at scale 1, and `flops_weights` (query, document) add sentence-transformers' FlopsLoss
    of the anchors and of the positives and hard negatives together."""
    from sentence_transformers.sparse_encoder.losses import FlopsLoss

    columns = [column for column in COLUMNS if column in batch]  # a step of the second source: pairs
    guide_reps = None
    if row.extra == "masked":  # each text encoded alone (no padding), not in train.py's batches
        with torch.no_grad():
            guide_reps = [
                (guide.encode_query if column == "anchor" else guide.encode_document)(
                    batch[column], batch_size=1, convert_to_tensor=True
                )
                for column in columns
            ]

    sparse = row.model in SPARSE_MODELS

    def loss(features, labels):
        reps = [model(dict(f))["sentence_embedding"] for f in features]
        objective = reference_objective(
            *reps,
            texts=[batch[column] for column in columns],
            in_batch=in_batch,
            symmetric=row.loss == "symmetric",
            matryoshka_dims=MATRYOSHKA_DIMS if row.loss == "matryoshka" else None,
            positives_of=positives_of,
            margin=FALSE_NEGATIVE_MARGIN if row.extra == "masked" else None,
            teacher=batch.get("teacher_scores"),
            distill_weight=DISTILLATION["weight"],
            temperature=DISTILLATION["temperature"],
            guide=guide_reps,
            guide_margin=GUIDE["margin"],
            scale=1.0 if sparse else 20.0,
            similarity="dot" if sparse else "cos",
        )
        if flops_weights is None:
            return objective
        (query_weight, document_weight), flops = flops_weights, FlopsLoss(model)
        documents = flops.compute_loss_from_embeddings(torch.cat(reps[1:]))
        queries = flops.compute_loss_from_embeddings(reps[0])
        return objective + query_weight * queries + document_weight * documents

    return loss


def reference_model(row, model_folder, dtype):
    """The row's model from sentence-transformers and peft alone, none of train.py's code: loaded, a LoRA
    adapter of rank 4 (alpha 8, every linear layer, no dropout: train.py's defaults for --lora_r 4) seeded
    as the worker seeds it, on each outermost transformers model (a SPLADE's BertForMaskedLM, not the
    BertModel inside it), non-reentrant gradient checkpointing, in `dtype`, in training mode. The model's
    own similarity (cosine; a sparse encoder's: dot product) is what sentence-transformers' losses score
    with. A sparse row's model loads as a SparseEncoder."""
    from peft import LoraConfig
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer, SparseEncoder
    from transformers import PreTrainedModel

    model_class = SparseEncoder if row.model in SPARSE_MODELS else SentenceTransformer
    model_class = MultiVectorEncoder if row.model == "colbert" else model_class
    model = model_class(model_folder, device="cpu", trust_remote_code=row.code == "remote")
    found = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    inner = {id(sub) for module in found for sub in module.modules() if sub is not module}
    transformers = [module for module in found if id(module) not in inner]  # SPLADE's: BertForMaskedLM
    torch.manual_seed(SEED)  # LoRA's initial A, drawn in the same order as the worker's
    for transformer in transformers:
        if row.adapter == "lora":
            transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        if row.adapter == "checkpointing":
            transformer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(dtype).train()


def reference_run(
    row, model_folder, guide_folder, dtype=torch.float64, cross=None, regularized=True, steps=NUM_STEPS
):
    """Losses of each rank at each step, and the trained weights: one process, the global batch, unchunked,
    in `dtype` (the guide, which only decides masks, stays float32). A step of the second source (rows of
    two) has its columns and in-batch negatives, and its query prompt written before each anchor here, as
    sentence-transformers' prompt is a prefix of the text. `cross` (default: the row's) chooses between
    every rank's rows against the global batch and each rank's loss on its own shard. A sparse row's loss is
    SpladeLoss (`sparse_loss`), its FLOPS weights warmed up by sentence-transformers' callback, or
    references.py's objective plus FlopsLoss; `regularized=False` drops the FLOPS terms, `steps` fewer than
    NUM_STEPS stops early (negative controls)."""
    from sentence_transformers import SentenceTransformer

    cross = row.cross if cross is None else cross
    model = reference_model(row, model_folder, dtype)
    start = trainable_weights(model.named_parameters())
    guide = SentenceTransformer(guide_folder, device="cpu") if row.extra == "masked" else None
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE[row.model]
    )
    losses = [[] for _ in range(row.processes)]
    sparse = row.model in SPARSE_MODELS
    splade = sparse_loss(row, model) if sparse else None
    schedule = regularizer_weights(splade) if sparse else [None] * NUM_STEPS
    for (step, batch), weights in itertools.islice(
        zip(enumerate(global_batches(row)), schedule, strict=True), steps
    ):
        second_source = source_of_step(row, step) == 1
        in_batch = second_source or row.negatives == "in-batch"
        prompt = SECOND_SOURCE["query_prompt"] if second_source else ""
        parts = [batch] if cross else [shard(batch, row, rank) for rank in range(row.processes)]
        part_losses = []
        for part in parts:
            if in_batch and row.extra == "none" and sparse:
                loss = splade  # SpladeLoss: a dict of its terms
            elif in_batch and (row.extra == "none" or row.model == "colbert"):
                loss = sentence_transformers_loss(row, model, part.get("teacher_scores"))
            else:
                flops = weights if regularized else None
                loss = independent_loss(row, model, part, guide, positives_in_data(batch), in_batch, flops)
            features = [
                model.preprocess([prompt + text for text in part["anchor"]], task="query"),
                *(model.preprocess(part[c], task="document") for c in COLUMNS[1:] if c in part),
            ]
            with maxsim_kept_in_float64():
                value = loss(features, labels=None)
            if isinstance(value, dict):  # SpladeLoss's terms; without its regularizers, the contrastive ones
                value = sum(v for k, v in value.items() if regularized or not k.endswith("regularizer_loss"))
            part_losses.append(value)
        for rank in range(row.processes):
            losses[rank].append(part_losses[0 if cross else rank].item())
        optimizer.zero_grad()
        torch.stack(part_losses).mean().backward()
        optimizer.step()
    weights = trainable_weights(model.named_parameters(), torch.float64)
    return losses, {name: weights[name] - start[name] for name in weights}


@dataclasses.dataclass
class Measured:
    """A run's (or a reference's) losses per rank and step, and its weight updates by parameter."""

    losses: list
    updates: dict


def measure(row, ranks, start):
    """The run's losses and updates, every rank's (each rank holds the whole trained model)."""
    return Measured(
        [run["losses"] for run in ranks],
        [{name: run["weights"][name].double() - start[name] for name in start} for run in ranks],
    )


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_row_matches_sentence_transformers_on_the_global_batch(row, runs, model_folders):
    ranks = runs(row)
    # --attn_implementation loaded what the row says, in every transformers model of every rank
    assert all(run["attention"] == [row.attention] for run in ranks), [run["attention"] for run in ranks]
    # --trust_remote_code: the model's own class ran (TinyModel, a BERT), and only where the row says
    classes = [run["classes"] for run in ranks]
    assert all(("TinyModel" in names) == (row.code == "remote") for names in classes), classes
    if row.backend == "fsdp2":  # accelerate's FSDP2 sharded it, each transformer layer a unit of its own
        assert all(run["backend"] == "FSDP" for run in ranks), [run["backend"] for run in ranks]
        assert any(unit.endswith("Layer") for unit in ranks[0]["units"]), ranks[0]["units"]
    folder, guide_folder = model_folders[row.folder], model_folders[GUIDE["model"]]
    truth = Measured(*reference_run(row, folder, guide_folder, torch.float64))
    float32 = Measured(*reference_run(row, folder, guide_folder, torch.float32))
    start = trainable_weights(reference_model(row, folder, torch.float64).named_parameters())
    run = measure(row, ranks, start)
    assert all(sorted(updates) == sorted(truth.updates) for updates in run.updates)
    loss = exactness(run.losses, float32.losses, truth.losses)
    update = max(
        (exactness(updates, float32.updates, truth.updates) for updates in run.updates),
        key=lambda measured: measured.error / measured.bound,
    )
    print(f"{row.name}: loss {loss}, update {update}, chunks {ranks[0]['chunks']}, kept {ranks[0]['kept']}")
    assert loss.holds, f"loss {loss}"
    assert update.holds, f"update {update}"
    # Negative controls: the reference one step short (a lost step) fails the same rule, and so does the
    # reference of the other partition (cross-process negatives or each rank's own shard), which a backend
    # that dropped or added other processes' candidates would match.
    short = Measured(*reference_run(row, folder, guide_folder, torch.float64, steps=NUM_STEPS - 1))
    wrong = Exactness(relative_error(run.updates[0], short.updates), update.e_ref)
    assert not wrong.holds, f"the run matches the reference one step short: {wrong}"
    if row.processes > 1 and row.negatives == "in-batch":  # group-only: the partition changes no row's loss
        other = Measured(*reference_run(row, folder, guide_folder, torch.float64, cross=not row.cross))
        wrong = Exactness(relative_error(run.updates[0], other.updates), update.e_ref)
        assert not wrong.holds, f"the run matches the other partition's reference: {wrong}"
    if row.model in SPARSE_MODELS:  # the FLOPS regularizers matter: the reference without them is another
        bare = Measured(*reference_run(row, folder, guide_folder, torch.float64, regularized=False))
        wrong = Exactness(relative_error(run.updates[0], bare.updates), update.e_ref)
        print(f"{row.name}: against the reference without FLOPS terms, update {wrong}")
        assert not wrong.holds, f"the run matches the reference without FLOPS regularizers: {wrong}"
    # Every rank ran the same number of chunk passes per step: the collectives of ZeRO-2/3 line up.
    assert len({tuple(run["chunks"]) for run in ranks}) == 1
    # The budget kept what the row says, the same on every rank: all groups (none re-encoded), some, or the
    # last one's alone.
    kept = {tuple(map(tuple, run["kept"])) for run in ranks}
    assert len(kept) == 1, kept
    steps = enumerate(ranks[0]["kept"])  # gradcache_step's: a group-only row's second source is in-batch
    in_batch = [k for step, k in steps if row.negatives == "in-batch" or source_of_step(row, step)]
    if row.budget == "all":
        assert all(reencoded == 0 for _, reencoded in in_batch), in_batch
    elif row.budget == "some":
        assert in_batch[0][1] == 0 and any(0 < groups and reencoded for groups, reencoded in in_batch), (
            in_batch
        )
    else:
        assert all(groups == 1 for groups, _ in in_batch), in_batch
    if row.extra == "masked":  # the planted repeats were found
        assert all(fraction > 0 for run in ranks for fraction in run["masked"]), [
            run["masked"] for run in ranks
        ]
