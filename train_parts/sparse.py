"""Sparse encoders (SPLADE, inference-free): the defaults that depend on the model, the flags that do not fit
it, and the FLOPS regularizers added to the contrastive loss.

Flags served: --sparse_query_weight, --sparse_document_weight, --sparse_warmup_ratio, and the --scale default
(every model family's).
"""

import dataclasses

from sentence_transformers import MultiVectorEncoder, SparseEncoder

from .common import fail
from .models import transformers_models

__all__ = ["SparseFlags", "SPARSE_DEFAULTS", "model_default", "model_kind", "check_flags", "SparsityPenalty"]
__all__ += ["flops"]


@dataclasses.dataclass(frozen=True)
class SparseFlags:
    """The flags a sparse encoder reads, or refuses (`common.flags_of(SparseFlags, args)`)."""

    model: str
    scale: float | None = None
    similarity: str | None = None
    matryoshka_dims: tuple | None = None
    sparse_query_weight: float | None = None
    sparse_document_weight: float | None = None
    sparse_warmup_ratio: float | None = None


# The defaults of the flags that depend on the model (None): sentence-transformers' SpladeLoss's weights and
# warm-up, and the scale of its SparseMultipleNegativesRankingLoss (dot products of unnormalized weights) and
# of MultiVectorMultipleNegativesRankingLoss (MaxSim, a sum over the query's tokens); 20 for cosine.
SPARSE_DEFAULTS = {"sparse_query_weight": 5e-5, "sparse_document_weight": 3e-5, "sparse_warmup_ratio": 1 / 3}
SCALE_DEFAULT = {"dense": 20.0, "sparse": 1.0, "multi-vector": 1.0}


def model_default(flags, name, model):
    """--name as given, or its default for this model (SPARSE_DEFAULTS, SCALE_DEFAULT)."""
    if (value := getattr(flags, name)) is not None:
        return value
    return SCALE_DEFAULT[model_kind(model)] if name == "scale" else SPARSE_DEFAULTS[name]


def model_kind(model):
    """How it scores and evaluates: "sparse" (SparseEncoder), "multi-vector" (MultiVectorEncoder), "dense"."""
    if isinstance(model, (SparseEncoder, MultiVectorEncoder)):
        return "sparse" if isinstance(model, SparseEncoder) else "multi-vector"
    return "dense"


def check_flags(model, flags, group_only=False):
    """The flags that do not fit the model, refused: a sparse encoder (SPLADE) trains its vocabulary-sized
    weights by dot product, with FLOPS regularizers of the whole batch (`SparsityPenalty`), as
    sentence-transformers' SpladeLoss does; a dense model has no regularizers. group_only: a --data source
    has --in_batch_negatives off."""
    if any(type(module).__name__ == "SparseAutoEncoder" for module in model.modules()):
        fail(
            f"--model {flags.model} is a CSR sparse encoder (SparseAutoEncoder): it trains with "
            "sentence-transformers' CSRLoss (reconstruction terms), which train.py does not have; it trains "
            "SPLADE models (SpladePooling), inference-free ones too."
        )
    if not isinstance(model, SparseEncoder):
        if given := [f"--{name}" for name in SPARSE_DEFAULTS if getattr(flags, name) is not None]:
            fail(f"{', '.join(given)}: for a sparse encoder (SparseEncoder); --model {flags.model} is dense.")
        return
    refused = {
        "--matryoshka_dims": bool(flags.matryoshka_dims),
        "--similarity cos": flags.similarity == "cos"
        or (not flags.similarity and model.similarity_fn_name != "dot"),
        "--in_batch_negatives off": group_only,
    }
    if refusal := [flag for flag, given in refused.items() if given]:
        fail(
            f"{refusal[0]}: --model {flags.model} is a sparse encoder, trained by dot product on its "
            "vocabulary-sized weights with FLOPS regularizers of the whole batch (no prefixes to truncate, "
            f"no norm, no per-row loss). Drop {refusal[0]}."
        )


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
    def of(cls, flags, model, schedule, total_steps, say=print):
        query, document, ratio = (model_default(flags, name, model) for name in SPARSE_DEFAULTS)
        warmup = max(1, int(total_steps * ratio)) if ratio else 0
        # SpladePooling knows its width after a first forward only: the language-model head's vocabulary's
        dimensions = max(transformer.config.vocab_size for transformer in transformers_models(model))
        say(
            f"train.py: --model {flags.model} is a sparse encoder of {dimensions} "
            f"dimensions: FLOPS regularizers {query:g} (queries), {document:g} (documents), reached after "
            f"{warmup} steps (--sparse_warmup_ratio {ratio:.3g})"
        )
        return cls(query, document, warmup, schedule)

    def weights(self):
        step = self.schedule.last_epoch
        ramp = min(1.0, step / self.warmup_steps) ** 2 if self.warmup_steps else 1.0
        return self.query_weight * ramp, self.document_weight * ramp

    def __call__(self, anchor, *documents, local_rows=None, stats=None):
        """The weighted regularizers, a term to add to the contrastive loss (this process's share of them);
        `stats` gets the mean active dimensions of this process's queries and documents and each
        regularizer's (unweighted) value."""
        rows = slice(0, len(anchor)) if local_rows is None else local_rows
        share = len(range(*rows.indices(len(anchor)))) / len(anchor)  # this process's rows of the batch
        query_flops, document_flops = flops(anchor), flops(*documents)
        query_weight, document_weight = self.weights()
        term = share * (query_weight * query_flops + document_weight * document_flops)
        if stats is not None:
            active = [(column[rows].detach() > 0).sum(-1).double().mean() for column in (anchor, *documents)]
            stats |= {"query_active_dims": float(active[0]), "query_flops": float(query_flops.detach())}
            stats |= {"document_active_dims": float(sum(active[1:]) / len(documents))}
            stats |= {"document_flops": float(document_flops.detach()), "sparse_query_weight": query_weight}
            stats["sparse_document_weight"] = document_weight
        return term


def flops(*columns):
    """sum_j (mean_i w_ij)^2 over the rows of all `columns` together: the FLOPS regularizer of a batch of
    sparse representations (no |.|: SPLADE's weights are >= 0), sentence-transformers' FlopsLoss without a
    threshold. Summed column by column: joining them would copy B x vocabulary floats per column."""
    mean = sum(column.sum(dim=0) for column in columns) / sum(len(column) for column in columns)
    return mean.square().sum()
