"""Multi-vector models (ColBERT: sentence-transformers' MultiVectorEncoder): the flags that do not fit them,
and their loss, in-batch negatives scored by MaxSim over token matrices, tile by tile.

A text's representation is its token matrix with the model's scoring mask (MultiVectorMask's: padding and
skip-list words out, query expansion in) as a last channel (`models.representation`); gradcache keeps each
chunk's at the chunk's own width (`gradcache.TokenMatrices`).

Flags served: the --scale default (1, sentence-transformers' MultiVectorMultipleNegativesRankingLoss's),
--distill_weight and --distill_temperature (the KL to a teacher's scores over each anchor's own group, on
MaxSim), and the refusal of --matryoshka_dims, --similarity, --symmetric, --in_batch_negatives off,
--false_negative_margin and --guide_model for such a model.
"""

import dataclasses
import math

import torch
from sentence_transformers import MultiVectorEncoder
from torch.utils.checkpoint import checkpoint

from gradcache import TokenMatrices, collective_device, distillation, gather_from_all_processes

from .common import fail

__all__ = ["MultiVectorFlags", "is_multi_vector", "check_flags", "maxsim_loss", "maxsim", "TILE_ELEMENTS"]
__all__ += ["loss_options", "group_maxsim", "gather_token_matrices"]


@dataclasses.dataclass(frozen=True)
class MultiVectorFlags:
    """The flags a multi-vector model refuses (`common.flags_of(MultiVectorFlags, args)`)."""

    model: str
    similarity: str | None = None
    matryoshka_dims: tuple | None = None
    symmetric: bool = False
    false_negative_margin: float | None = None
    guide_model: str | None = None


def is_multi_vector(model):
    return isinstance(model, MultiVectorEncoder)


def check_flags(model, flags, group_only=False):
    """The flags that do not fit a multi-vector model, refused one at a time: it scores by MaxSim over token
    vectors (no pooled vector to truncate, normalize or compare by cosine), in one direction, with in-batch
    negatives, as sentence-transformers' MultiVectorMultipleNegativesRankingLoss does."""
    if not is_multi_vector(model):
        return
    refused = {
        "--matryoshka_dims": "it has no pooled vector whose prefixes could be trained",
        "--similarity": "it scores by MaxSim over its token vectors, not one vector's cosine or dot product",
        "--symmetric": "MaxSim is not symmetric: the loss scores queries against documents only",
        "--in_batch_negatives off": "its loss is the in-batch one (MultiVectorMultipleNegativesRankingLoss)",
        "--false_negative_margin": "the margin masks compare pooled vectors",
        "--guide_model": "the guide's masks compare pooled vectors",
    }
    given = {
        "--matryoshka_dims": bool(flags.matryoshka_dims),
        "--similarity": bool(flags.similarity),
        "--symmetric": flags.symmetric,
        "--in_batch_negatives off": group_only,
        "--false_negative_margin": flags.false_negative_margin is not None,
        "--guide_model": bool(flags.guide_model),
    }
    if refusal := next((flag for flag, is_given in given.items() if is_given), None):
        fail(
            f"{refusal}: --model {flags.model} is a multi-vector model (ColBERT): {refused[refusal]}. "
            f"Drop {refusal}."
        )


# Elements of a score tile's token similarities (query rows x document rows x query tokens x document tokens):
# 2^24, 64 MiB in float32, as large as one more T x T dense tile of the tiled loss at T = 4096.
TILE_ELEMENTS = 2**24


def maxsim(queries, documents):
    """MaxSim of every query against every document of a tile -> queries x documents: per query token the
    largest similarity to a document token the document's mask keeps, summed over the tokens the query's
    mask keeps (sentence-transformers' colbert_scores). Each input: rows x tokens x (dimensions + mask)."""
    similarities = torch.einsum("qtd,ksd->qkts", queries[..., :-1], documents[..., :-1])
    return best_matches_summed(similarities, queries[:, None, :, -1], documents[None, :, None, :, -1])


def own_row_maxsim(queries, documents):
    """MaxSim of each query against the document of its own row only -> rows (maxsim's diagonal; the other
    pairs are never computed). Each input: rows x tokens x (dimensions + mask)."""
    similarities = torch.einsum("rtd,rsd->rts", queries[..., :-1], documents[..., :-1])
    return best_matches_summed(similarities, queries[..., -1], documents[:, None, :, -1])


def best_matches_summed(similarities, query_mask, document_mask):
    """Per query token its largest similarity (the last axis) to a document token that `document_mask`
    keeps, summed over the query tokens that `query_mask` keeps; the masks (> 0: kept) broadcast against
    the similarities without and with their last axis."""
    # The lowest number, not 0: a masked token must never win the max over negative similarities.
    similarities = similarities.masked_fill(document_mask <= 0, torch.finfo(similarities.dtype).min)
    return (similarities.amax(dim=-1) * (query_mask > 0)).sum(dim=-1)


def maxsim_loss(
    anchor, positive, *negatives, scale: float = 1.0, tile_elements: int | None = None,
    local_rows: slice | None = None, false_negatives=None, stats: dict | None = None,
    teacher_scores: torch.Tensor | None = None, distill_weight: float = 1.0, distill_temperature: float = 1.0,
):  # fmt: skip
    """In-batch negatives on MaxSim scores (MultiVectorMultipleNegativesRankingLoss), tile by tile.

    With B anchors, N = B(1 + k) candidates (the positives, then the k hard-negative columns):

        s_ij = scale MaxSim(a_i, c_j),        L = (1 / B) sum_i [ LSE_j(s_ij) - s_i,i ]

    Each column a `gradcache.TokenMatrices` (or a B x tokens x (d + 1) tensor). `TiledMaxSim` never holds
    the B x N scores nor a tile's token similarities beyond `tile_elements` (TILE_ELEMENTS).
    local_rows:       cross-process negatives: the anchors this process computes, still divided by B.
    false_negatives:  a gradcache.FalseNegatives of text ids (repeated texts, other positives): masked.
    stats:            receives "in_batch_accuracy" (and, with masks, "masked_fraction").
    teacher_scores:   B x (1 + k) teacher scores of each anchor's positive and hard negatives: adds
                      (distill_weight / B) sum_i KL(softmax(t_i / T) || softmax(g_i / T)), T the
                      distill_temperature, g_i = scale (MaxSim(a_i, p_i), MaxSim(a_i, n_i1), ...) the anchor's
                      own group (`group_maxsim`), over the local rows: gradcache.contrastive_loss's term."""
    columns = [
        column if isinstance(column, TokenMatrices) else as_blocks(column)
        for column in (anchor, positive, *negatives)
    ]
    batch_size = len(columns[0])
    rows = slice(0, batch_size) if local_rows is None else local_rows
    mask = None
    if false_negatives is not None:  # ids only (check_flags refuses the margin and the guide)
        by_row = columns[0].blocks[0].new_empty(batch_size, 0)  # the masks read the batch size and device
        mask = false_negatives.tile_masks(by_row, by_row, len(negatives), rows, scale)[0]
    queries = [
        (index - rows.start, block)
        for index, block in zip(columns[0].indices, columns[0].blocks, strict=True)
        if rows.start <= int(index[0]) < rows.stop
    ]
    candidates = [
        (index + c * batch_size, block)
        for c, column in enumerate(columns[1:])
        for index, block in zip(column.indices, column.blocks, strict=True)
    ]
    plan = TilePlan(queries, candidates, rows.start, scale, tile_elements or TILE_ELEMENTS, mask, [0, 0])
    terms = TiledMaxSim.apply(plan, *[block for _, block in queries], *[block for _, block in candidates])
    if stats is not None:
        stats["in_batch_accuracy"] = float(plan.hits[0]) / max(plan.hits[1], 1)
        if mask is not None:
            stats["masked_fraction"] = float(mask.masked) / max(mask.seen, 1)
    loss = terms.sum() / batch_size
    if teacher_scores is not None:
        student = group_maxsim(columns, rows, tile_elements or TILE_ELEMENTS) * scale
        teacher = torch.as_tensor(teacher_scores, dtype=student.dtype, device=student.device)[rows]
        loss = loss + distill_weight * distillation(student, teacher, distill_temperature).sum() / batch_size
    return loss


def loss_options(options):
    """Of the options train.py builds a loss with, those maxsim_loss takes (check_flags refused the rest)."""
    return {name: options[name] for name in ("scale", "distill_weight", "distill_temperature")}


def group_maxsim(columns, rows, tile_elements):
    """MaxSim of each anchor of `rows` (a slice) against its own group only, column c's row i (its positive,
    then its hard negatives) -> rows x (1 + k); columns: TokenMatrices. Row by row (`own_row_maxsim`), in
    pieces of rows that share an anchor block and a document block, each at most `tile_elements` token
    similarities, recomputed in backward (checkpoint): no piece's similarities are held."""
    local = torch.arange(rows.start, rows.stop)
    anchors = block_of_each_row(columns[0])[local]
    scores = []
    for documents in columns[1:]:
        where = block_of_each_row(documents)[local]
        pairs = anchors[:, 0] * len(documents.blocks) + where[:, 0]
        pieces, order = [], []
        for pair in pairs.unique().tolist():
            chosen = (pairs == pair).nonzero()[:, 0]  # positions among the local rows
            queries = columns[0].blocks[pair // len(documents.blocks)]
            candidates = documents.blocks[pair % len(documents.blocks)]
            side = max(1, tile_elements // max(queries.shape[1] * candidates.shape[1], 1))
            for piece in chosen.split(side):
                positions = anchors[piece, 1].to(queries.device), where[piece, 1].to(queries.device)
                pieces.append(checkpoint(rows_maxsim, queries, candidates, *positions, **RECOMPUTED))
                order.append(piece)
        scores.append(torch.cat(pieces)[torch.argsort(torch.cat(order)).to(pieces[0].device)])
    return torch.stack(scores, dim=1)


# torch's checkpoint without its RNG bookkeeping: MaxSim draws no random numbers.
RECOMPUTED = {"use_reentrant": False, "preserve_rng_state": False}


def rows_maxsim(queries, documents, query_rows, document_rows):
    """own_row_maxsim of some rows of two blocks, the rows taken inside (a checkpoint then holds the blocks,
    not copies of the rows)."""
    return own_row_maxsim(queries[query_rows], documents[document_rows])


def block_of_each_row(column):
    """(block, position in the block) of each row of a TokenMatrices: rows x 2, in batch order."""
    where = torch.empty(len(column), 2, dtype=torch.long)
    for k, rows in enumerate(column.indices):
        rows = rows.cpu()
        where[rows] = torch.stack([torch.full_like(rows, k), torch.arange(len(rows))], dim=1)
    return where


def as_blocks(column):
    """A B x tokens x (d + 1) tensor as one block of every row."""
    return TokenMatrices([torch.arange(len(column))], [column])


@dataclasses.dataclass
class TilePlan:
    """What TiledMaxSim tiles: (local row positions, block) of the queries, (candidate indices, block) of the
    candidates (column c's row r is candidate c x B + r; row i's target is candidate first_row + i)."""

    queries: list
    candidates: list
    first_row: int
    scale: float
    tile_elements: int
    mask: object  # a gradcache TileMask, or None
    hits: list  # [rows whose target scores highest, rows]

    def tiles(self):
        """(query block, its rows, candidate block, its rows, local rows, candidate indices): pieces of two
        blocks whose token similarities fit tile_elements."""
        for q, (positions, queries) in enumerate(self.queries):
            for c, (indices, candidates) in enumerate(self.candidates):
                per_pair = max(queries.shape[1] * candidates.shape[1], 1)
                side = max(1, math.isqrt(self.tile_elements // per_pair))
                for i in range(0, len(queries), side):
                    for j in range(0, len(candidates), side):
                        query_rows, candidate_rows = slice(i, i + side), slice(j, j + side)
                        yield q, query_rows, c, candidate_rows, positions[query_rows], indices[candidate_rows]

    def scores(self, query_block, candidate_block, local, columns):
        """The tile's scaled scores, masked entries -inf, and (rows, columns) of the targets in it."""
        scores = maxsim(query_block, candidate_block) * self.scale
        local_rows = local.to(scores.device)
        hit = columns.to(scores.device)[None, :] == (local_rows + self.first_row)[:, None]
        targets = hit.nonzero(as_tuple=True)
        if self.mask is not None:
            scores = scores.masked_fill(
                self.mask(scores, local_rows, columns.to(scores.device), *targets), -torch.inf
            )
        return scores, targets


class TiledMaxSim(torch.autograd.Function):
    """Each local anchor's cross-entropy over every candidate, LSE_j(s_ij) - s_i,target, from tiles of a query
    block's rows against a candidate block's rows: an online log-sum-exp forward (running maximum and sum per
    row), and a backward that recomputes each tile and back-propagates G = g (P - Y) through its MaxSim (the
    tile's own small graph), as gradcache's TiledCrossEntropy does for single vectors."""

    @staticmethod
    def forward(ctx, plan, *blocks):
        rows = sum(len(positions) for positions, _ in plan.queries)
        device = blocks[0].device
        row_max = torch.full((rows,), torch.finfo(blocks[0].dtype).min, dtype=blocks[0].dtype, device=device)
        row_sum, target_scores = torch.zeros_like(row_max), torch.zeros_like(row_max)
        for q, query_rows, c, candidate_rows, local, columns in plan.tiles():
            query_block, candidate_block = (
                plan.queries[q][1][query_rows],
                plan.candidates[c][1][candidate_rows],
            )
            scores, (at_row, at_column) = plan.scores(query_block, candidate_block, local, columns)
            local = local.to(device)
            target_scores[local[at_row]] = scores[at_row, at_column]
            if plan.mask is not None:  # what the masks took out: -inf, which no score reaches otherwise
                plan.mask.masked = plan.mask.masked + torch.isneginf(scores).sum()
                plan.mask.seen += scores.numel() - len(at_row)
            new_max = torch.maximum(row_max[local], scores.amax(dim=1))
            row_sum[local] = row_sum[local] * torch.exp(row_max[local] - new_max) + (
                scores - new_max[:, None]
            ).exp().sum(1)
            row_max[local] = new_max
        plan.hits[0] += int((target_scores >= row_max).sum())
        plan.hits[1] += rows
        ctx.plan = plan
        ctx.save_for_backward(row_max, row_sum, *blocks)
        return row_sum.log() - (target_scores - row_max)

    @staticmethod
    def backward(ctx, grad_rows):
        plan, (row_max, row_sum, *blocks) = ctx.plan, ctx.saved_tensors
        queries, candidates = blocks[: len(plan.queries)], blocks[len(plan.queries) :]
        grad_queries = [torch.zeros_like(block) for block in queries]
        grad_candidates = [torch.zeros_like(block) for block in candidates]
        for q, query_rows, c, candidate_rows, local, columns in plan.tiles():
            with torch.enable_grad():
                query_block = queries[q][query_rows].detach().requires_grad_()
                candidate_block = candidates[c][candidate_rows].detach().requires_grad_()
                scores, (at_row, at_column) = plan.scores(query_block, candidate_block, local, columns)
            local = local.to(scores.device)
            weights = (
                (scores.detach() - row_max[local, None]).exp() / row_sum[local, None] * grad_rows[local, None]
            )
            weights[at_row, at_column] -= grad_rows[local[at_row]]
            grad_query, grad_candidate = torch.autograd.grad(scores, (query_block, candidate_block), weights)
            grad_queries[q][query_rows] += grad_query
            grad_candidates[c][candidate_rows] += grad_candidate
        return None, *grad_queries, *grad_candidates


def gather_token_matrices(embeddings):
    """Every process's token matrices in rank order, as the multi-vector evaluator's embed_inputs makes them:
    a list of tokens x d tensors (documents), or one rows x tokens x d tensor, zero-padded (queries)."""
    padded = embeddings if torch.is_tensor(embeddings) else torch.nn.utils.rnn.pad_sequence(embeddings, True)
    device = padded.device
    pieces = gather_from_all_processes(padded.to(collective_device()))
    if torch.is_tensor(embeddings):
        width = max(piece.shape[1] for piece in pieces)
        return torch.cat(
            [torch.nn.functional.pad(piece, (0, 0, 0, width - piece.shape[1])) for piece in pieces]
        ).to(device)
    lengths = torch.tensor([len(matrix) for matrix in embeddings], device=collective_device())
    counts = torch.cat(gather_from_all_processes(lengths)).tolist()
    rows = [row for piece in pieces for row in piece]
    return [row[:count].to(device) for row, count in zip(rows, counts, strict=True)]
