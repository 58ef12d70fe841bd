"""Gradient Cache: a contrastive batch of any size for the memory of one chunk, with exact gradients.

Gao, Zhang, Han, Callan. "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup".
RepL4NLP 2021. https://arxiv.org/abs/2101.06983

An in-batch-negatives loss L(r_1, ..., r_B) couples every representation r_i = f(x_i; theta) of the
batch, so plain back-propagation keeps the activations of all B examples alive. The chain rule splits
the gradient at the representations:

    dL/dtheta = sum_i  (dL/dr_i)^T  dr_i/dtheta

The first factor needs every r_i but no activations; each term of the sum needs one example's
activations but no other example. So one training step is:

    1. encode        the batch chunk by chunk under no_grad, keeping only the representations
                     (and each chunk's RNG state, so that dropout can be replayed);
    2. cache         compute the full-batch loss on the detached representations and
                     g_i = dL/dr_i, the representation gradients;
    3. re-encode     chunk by chunk with grad, replaying the chunk's RNG state (the same dropout masks),
                     and back-propagate the surrogate sum_i <r_i, g_i>: the chunk's share of dL/dtheta.

The parameter gradients equal the full batch's; peak memory is one chunk's activations. Stage 2 never
holds the B x N scores: `contrastive_loss` tiles them with a running log-sum-exp (Inf-CL, Cheng et al.
2024), each process its own rows. The last chunk keeps its stage-1 graph (N chunks, N - 1 re-encodings;
`graph_budget`: as many as fit), chunks group texts of similar length (`Refinements`), `chunk_size`
examples or `chunk_tokens` padded tokens, one plan on all processes (`plan_step`: ZeRO-2/3 passes are
collectives). Without in-batch negatives `group_step` back-propagates each chunk of rows at once, no
cache. Guards: a loss or gradient not finite leaves the step `skipped`; a chunk out of memory raises
`ChunkOutOfMemory` (naming a size that fits) on all processes together, or alone (`agreed=False`).

Torch alone: the framework enters through `backward(surrogate)` (`accelerator.backward`: the fp16 loss
scale, DeepSpeed's step) and `sync_context(is_last)` (`accelerate_sync_context`).

Part I, the step: the outlines `gradcache_step` and `group_step`, their prologue and loop of backward
passes, the three stages, then what they rest on (refinements, the chunk plan, inputs, RNG replay,
processes and out of memory, checks, the accelerate adapter). Part II, the loss: `contrastive_loss` and
`group_loss` on one skeleton (normalize, Matryoshka sizes, distillation), their terms, masks, tiles.
"""

import contextlib
import dataclasses
import functools
import inspect
import itertools
import typing
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["gradcache_step", "group_step", "StepReport", "ChunkOutOfMemory", "StepInterrupted", "refinements"]
__all__ += ["contrastive_loss", "group_loss", "FalseNegatives", "accelerate_sync_context", "any_process"]
__all__ += ["with_side_data", "takes_keyword"]
__all__ += ["tokenize_per_chunk", "select_examples", "plan_chunks", "plan_step", "GROUP_FORWARDS"]
# Parts that train.py, tests/ and bench/ call or replace on their own.
__all__ += ["check_examples_independent", "cache_representation_gradients", "backpropagate_cache"]
__all__ += ["check_loss_takes_local_rows", "gather_from_all_processes", "largest_on_any_process"]
__all__ += ["collective_device", "distillation"]


# ============================== Part I. The step =========================================================
@dataclasses.dataclass
class StepReport:
    loss: torch.Tensor  # detached full-batch loss (the global batch's with cross-process negatives)
    num_chunks: int  # chunk forwards of stage 1, all columns together
    num_reencoded: int  # chunks encoded again in stage 3 (num_chunks minus the kept groups')
    rep_grad_norm: float  # norm of the cached representation gradients, all columns together
    skipped: bool = False  # the loss or its representation gradients were not finite: nothing back-propagated
    kept_groups: int = 0  # groups whose stage-1 graph stage 3 back-propagated (not re-encoded)
    kept_bytes: float = 0.0  # their saved tensors' bytes as estimated against graph_budget (0: not measured)


def gradcache_step(
    encoders, columns: Sequence, loss_fn: Callable | None = None,
    chunk_size: int | Sequence[int] | None = None, *, chunk_tokens: int | Sequence[int] | None = None,
    lengths: Sequence | None = None, backward: Callable = torch.Tensor.backward,
    sync_context: Callable = lambda is_last: contextlib.nullcontext(), get_rep: Callable | None = None,
    select: Callable | Sequence[Callable] | None = None, cross_process_negatives: bool = False,
    allow_batch_mixing: bool = False, agree_on_out_of_memory: bool = True,
    encode_group: Callable | None = None, graph_budget: float | None = None,
    interrupt: Callable | None = None,
) -> StepReport:  # fmt: skip
    """Accumulate into `.grad` the exact full-batch gradient of `loss_fn` over `columns`.
    encoders:     one callable shared by all columns, or one per column (towers), called on a chunk's input.
    encode_group: instead (encoders None), `encode_group(inputs, columns)` encodes a group's chunk inputs
                  (one chunk of every column) in one call: under DDP a backward follows one forward of all.
    columns:      the batch, a column each (anchor, positive, negatives...): features dict, tensor, or other.
    loss_fn:      loss(*reps) -> scalar on the batch's representations, in column order; cross-process
                  negatives: loss(*global_reps, local_rows=slice) -> this process's share. `contrastive_loss`.
    chunk_size:   examples per chunk (an int or one per column), 32 by default; chunk_tokens: instead,
                  padded tokens per chunk: a chunk takes as many examples, longest first, as fit.
    lengths:      tokens per example, one sequence per column (None: a features dict's attention mask).
    select:       select(column, index) -> the encoder's input for those examples, one or one per column
                  (`tokenize_per_chunk` for raw texts; `select_examples`). get_rep: output -> representation.
    backward:     called on each surrogate scalar (`accelerator.backward`). sync_context: entered around
                  each group's forward and backward, is_last=True for the last (`accelerate_sync_context`).
    cross_process_negatives: contrast with every process's representations (DDP, FSDP, DeepSpeed).
    agree_on_out_of_memory: all processes raise `ChunkOutOfMemory` together. False where every pass is a
                  collective (DeepSpeed ZeRO-2/3): the process that ran out raises at once, unagreed.
    graph_budget: bytes of stage-1 graphs to keep (`keep_graphs`): the last groups that fit keep theirs and
                  are not re-encoded (math.inf: every group; 0: none). None: the last group only.
    interrupt:    interrupt(stage, group, groups) -> True abandons the step (`StepInterrupted`, gradients
                  partial); called before each group's forward on every process alike, so it may agree
                  across processes (a signal); stage "encode" (stage 1) or "backward" (stage 3)."""
    columns, loss_fn = list(columns), loss_fn or contrastive_loss
    chunking = chunk_limits(chunk_size, chunk_tokens, len(columns))
    lengths, encode, together = prepare_step(
        encoders, columns, chunking, lengths, select, get_rep, encode_group, allow_batch_mixing
    )
    check_loss_takes_local_rows(loss_fn, cross_process_negatives)
    groups = plan_step(columns, *chunking, lengths, together)
    out_of_memory = OutOfMemory(agree_on_out_of_memory, *chunking)
    encoded = EncodingPass(encode, columns, groups, out_of_memory, interrupt)
    # The kept groups' graphs live from stage 1 to stage 3, and their sync context stays open as long.
    with contextlib.ExitStack() as kept_sync:
        sizes = None if graph_budget is None else group_sizes(groups, columns, lengths)
        keep_graphs(encoded, graph_budget, sizes, sync_context, kept_sync, out_of_memory)
        out_of_memory.agree()  # before stage 2's collectives
        loss, rep_grads = cache_representation_gradients(loss_fn, encoded.cache, cross_process_negatives)
        reencoded = groups[: len(groups) - len(encoded.kept)]
        report = stage_two_report(loss, rep_grads, groups, reencoded, encoded)
        if report.skipped:
            return report
        if encoded.kept:  # first, in one backward, while their graphs are alive (each freed as it is done)
            with out_of_memory.watch(collective=not reencoded):
                backpropagate_cache(sum(encoded.kept, []), encoded.kept_reps, rep_grads, backward)
            encoded.kept_reps = None
    reencode = functools.partial(reencode_and_backpropagate, encoded.rng_states, encode, rep_grads, backward)
    backpropagate_in_turn(reencoded, reencode, sync_context, out_of_memory, interrupt)
    return report


def group_step(
    encoders, columns: Sequence, loss_fn: Callable, chunk_size: int | None = None, *,
    chunk_tokens: int | None = None, lengths: Sequence | None = None,
    backward: Callable = torch.Tensor.backward,
    sync_context: Callable = lambda is_last: contextlib.nullcontext(), get_rep: Callable | None = None,
    select: Callable | Sequence[Callable] | None = None, encode_group: Callable | None = None,
    allow_batch_mixing: bool = False, agree_on_out_of_memory: bool = True, interrupt: Callable | None = None,
) -> StepReport:  # fmt: skip
    """Accumulate into `.grad` the exact gradient of a loss where each anchor sees only its own group.

    Without in-batch negatives (FlagEmbedding's no_in_batch_neg, NeMo) the loss is a sum of per-row terms,
    L = (1 / B) sum_i l(a_i, p_i, n_i1..n_ik): a chunk of rows, encoded in every column (GROUP_FORWARDS
    forwards per column, longest first), holds all its terms' inputs and is back-propagated at once.
    loss_fn: loss(*reps, rows=index) -> one term per row of a chunk (`index`: the rows in the batch, for
    side data): `group_loss`, divided by the batch size. chunk_size: rows per chunk; chunk_tokens: padded
    tokens per chunk, all columns, each text as long as its row's longest. Others: `gradcache_step`'s (DDP:
    `encode_group` even for one encoder, train.Towers). A loss not finite is found before the last backward:
    `skipped`; the trainer clears the partial gradients (not DeepSpeed's buffers: train.py stops)."""
    columns = list(columns)
    limits, by_tokens = chunk_limits(chunk_size, chunk_tokens, 1)  # one per row: all its columns together
    every_column = (limits * len(columns), by_tokens)
    lengths, encode, _ = prepare_step(
        encoders, columns, every_column, lengths, select, get_rep, encode_group, allow_batch_mixing
    )
    batch_size = batch_size_of(columns[0])
    counted = [example_lengths(column, n) for column, n in zip(columns, lengths, strict=True)]
    plan = plan_step([torch.arange(batch_size)], limits, by_tokens, [row_lengths(counted)], False)
    passes = RowChunks(encode, loss_fn, counted, batch_size, backward)
    out_of_memory = OutOfMemory(agree_on_out_of_memory, limits, by_tokens)
    backpropagate_in_turn(plan, passes, sync_context, out_of_memory, interrupt)
    # No representation gradients are cached: their norm is nan.
    return StepReport(passes.total, passes.forwards, 0, float("nan"), passes.skipped)


# --- What both steps share: the prologue, and the loop of backward passes -------------------------------
def prepare_step(encoders, columns, chunking, lengths, select, get_rep, encode_group, allow_batch_mixing):
    """Arguments checked -> (lengths per column, encode(group), together: towers' chunks in one backward)."""
    encoders = [encode_group] * len(columns) if encode_group is not None else encoders
    encoders = list(encoders) if isinstance(encoders, Sequence) else [encoders] * len(columns)
    lengths = [None] * len(columns) if lengths is None else list(lengths)
    check_step_arguments(encoders, columns, *chunking, lengths, allow_batch_mixing)
    together = encode_group is not None or len({id(encoder) for encoder in encoders}) > 1
    select, get_rep = select or select_examples, get_rep or sentence_embedding
    return lengths, group_encoder(columns, encoders, encode_group, select, get_rep), together


def chunk_limits(chunk_size, chunk_tokens, num_columns):
    """([a limit per column], by tokens): chunk_size, 32 by default, or chunk_tokens; never both."""
    if chunk_size is not None and chunk_tokens is not None:
        raise ValueError("pass chunk_size or chunk_tokens, not both (examples or padded tokens per chunk).")
    by_tokens = chunk_tokens is not None
    limit = chunk_tokens if by_tokens else 32 if chunk_size is None else chunk_size
    return (list(limit) if isinstance(limit, Sequence) else [limit] * num_columns), by_tokens


def group_encoder(columns, encoders, encode_group, select, get_rep):
    """encode(group) -> the representations of a group's chunks: each chunk's input selected from its
    column, then one call per chunk through its column's encoder, or one call for the group."""
    selects = list(select) if isinstance(select, Sequence) else [select] * len(columns)

    def encode(group):
        inputs = [selects[c](columns[c], index) for c, index, _ in group]
        if encode_group is not None:
            return [get_rep(output) for output in encode_group(inputs, [chunk.column for chunk in group])]
        return [get_rep(encoders[chunk.column](x)) for chunk, x in zip(group, inputs, strict=True)]

    return encode


def backpropagate_in_turn(groups, backpropagate_group, sync_context, out_of_memory, interrupt=None):
    """Stage 3's loop, and group_step's: `backpropagate_group(g, group, is_last)` in each group's sync context
    until it returns True; any out-of-memory agreed before the last, synchronizing backward."""
    for g, group in enumerate(groups):
        out_of_memory.raise_if_alone()  # before the interrupt's all-reduce, which the others may not reach
        stop_if_asked(interrupt, "backward", g, len(groups))
        is_last = g == len(groups) - 1
        if is_last:
            out_of_memory.agree()
        elif out_of_memory.ran_out:
            continue  # to the agreement before the last backward: no other process is waiting yet
        with out_of_memory.watch(collective=is_last), sync_context(is_last):
            if backpropagate_group(g, group, is_last):
                break
    out_of_memory.agree(collectively=False)


# --- The three stages ------------------------------------------------------------------------------------
class EncodingPass:
    """Stage 1's results: the cache (one fp32 buffer per column, in batch order: chunk tensors would fragment
    the heap; token matrices a `TokenMatrices`), each group's RNG state, the representations of the groups
    that keep a graph."""

    def __init__(self, encode, columns, groups, out_of_memory, interrupt):
        self.encode, self.columns, self.groups = encode, columns, groups
        self.out_of_memory, self.interrupt = out_of_memory, interrupt
        self.cache, self.rng_states, self.kept, self.kept_reps = [None] * len(columns), [], [], []
        self.saved_bytes = self.kept_bytes = 0

    def __call__(self, g, keep, measure=False):
        """Encodes group g, with grad where it keeps its graph; `measure`: its graph's saved bytes. After an
        out-of-memory nothing, to the agreement (the interrupt still asked: the same calls everywhere)."""
        self.out_of_memory.raise_if_alone()  # before the interrupt's all-reduce: the others may not reach it
        stop_if_asked(self.interrupt, "encode", g, len(self.groups))
        if self.out_of_memory.ran_out:
            return
        self.rng_states.append(RngState.capture())
        measuring = saved_storages() if measure else contextlib.nullcontext()
        with self.out_of_memory.watch(), torch.set_grad_enabled(keep), measuring as saved:
            reps = self.encode(self.groups[g])
        if self.out_of_memory.ran_out:
            return
        if measure:
            self.saved_bytes = sum(storage.nbytes() for storage in saved.values())
        for (c, index, padding), rep in zip(self.groups[g], reps, strict=True):
            if self.cache[c] is None:  # token matrices (several vectors a text): kept at each chunk's width
                size, rows = batch_size_of(self.columns[c]), (*rep.shape[1:],)
                self.cache[c] = (
                    TokenMatrices() if rep.dim() > 2 else rep.new_empty(size, *rows, dtype=torch.float32)
                )
            if not padding:
                self.cache[c][index.to(rep.device)] = rep.detach().float()
        if keep:
            self.kept, self.kept_reps = [*self.kept, self.groups[g]], [*self.kept_reps, *reps]


def keep_graphs(encoded, budget, sizes, sync_context, kept_sync, out_of_memory):
    """Stage 1: every group encoded, the last `kept` with grad in their sync context (entered in `kept_sync`).
    budget None, or one group: kept = 1. Else the first group's graph is measured (`saved_storages`), scaled
    by `sizes`: the last groups `budget` holds are kept, as few as on any process (ZeRO: the same passes).
    In no_sync, and back-propagated together before any synchronizing forward (DDP prepares its reduction
    there: any later backward runs it); all kept: the last forward and that backward synchronize."""
    last = len(encoded.groups) - 1
    if budget is None or last == 0 or not REFINEMENTS.reuse_last_chunk:
        for g in range(last + 1):
            keep = REFINEMENTS.reuse_last_chunk and g == last
            if keep and not out_of_memory.ran_out:
                kept_sync.enter_context(sync_context(last == 0))
            encoded(g, keep)
        return
    no_sync = kept_sync.enter_context(contextlib.ExitStack())
    no_sync.enter_context(sync_context(False))
    encoded(0, keep=budget > 0, measure=True)
    per_size = encoded.saved_bytes / max(sizes[0], 1)
    totals = itertools.accumulate(per_size * size for size in reversed(sizes))  # the last groups' bytes
    fits = sum(1 for _ in itertools.takewhile(lambda total: total <= budget, totals)) if budget > 0 else 0
    kept = -out_of_memory.agree(also=[-fits])[0]  # the fewest: one all-reduce, with any out-of-memory
    encoded.kept_bytes = per_size * sum(sizes[len(sizes) - kept :])
    if kept <= last:
        encoded.kept, encoded.kept_reps = [], []  # the first group is re-encoded: its graph goes
    for g in range(1, last + 1):
        if g == last and kept > last:
            no_sync.close()
            kept_sync.enter_context(sync_context(True))
        encoded(g, keep=g > last - kept)


def group_sizes(groups, columns, lengths):
    """Each group's padded tokens (examples x a chunk's longest; examples where lengths are unknown)."""
    counted = [example_lengths(column, n) for column, n in zip(columns, lengths, strict=True)]
    counted = [None] * len(counted) if any(n is None for n in counted) else counted
    return [sum(padded_size(index, counted[c]) for c, index, _ in group) for group in groups]


@contextlib.contextmanager
def saved_storages():
    """{(device, address): storage} of what autograd saves for backward inside, each storage once (views
    share one), without parameters' (they outlive the graph): on any device, unlike a memory counter."""
    storages = {}

    def pack(tensor):
        if not isinstance(tensor if tensor._base is None else tensor._base, nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.device, storage.data_ptr()] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


def cache_representation_gradients(loss_fn, cache, cross_process_negatives):
    """Stage 2: the full-batch loss and dL/dr for every representation, in batch order, fp32, unscaled.
    Empties `cache`: from here on the step holds the B x d gradients, not the representations too."""
    leaves = [reps.requires_grad_() for reps in cache]
    cache.clear()
    with torch.autocast(leaves[0].device.type, enabled=False), torch.enable_grad():
        if spans_processes(cross_process_negatives):
            return global_batch_gradients(loss_fn, leaves)
        loss = check_scalar(loss_fn(*leaves))
        return loss.detach(), gradients(loss, leaves)


def global_batch_gradients(loss_fn, leaves):
    """Stage 2 across processes: each gathers every process's columns (detached) and computes its share L_r,
    `loss_fn(*global_columns, local_rows=slice)`; dL/dr = sum_r dL_r/dr: one all-reduce carries them and
    the shares. Cost per process: O(B_local x B_global)."""
    sizes = [
        int(n) for n in gather_from_all_processes(torch.tensor([len(leaves[0])], device=collective_device()))
    ]
    first = sum(sizes[: dist.get_rank()])
    local_rows = slice(first, first + sizes[dist.get_rank()])
    tokens = [isinstance(leaf, TokenMatrices) for leaf in leaves]
    gather = [
        TokenMatrices.gathered if t else lambda x: torch.cat(gather_from_all_processes(x)) for t in tokens
    ]
    batch = [gathered(leaf).requires_grad_() for gathered, leaf in zip(gather, leaves, strict=True)]
    share = check_scalar(loss_fn(*batch, local_rows=local_rows))
    grads = gradients(share, batch)
    summed = torch.cat([share.detach().reshape(1), *[grad.flatten() for grad in grads]])
    dist.all_reduce(summed)
    loss, grads = summed[0], summed[1:].split([grad.numel() for grad in grads])
    # DDP and DeepSpeed average over processes: each holds 1/world of the global gradient, so scale back.
    world_size = dist.get_world_size()
    shaped = [
        rows.from_flat(g * world_size) if t else (g * world_size).view_as(rows)
        for g, rows, t in zip(grads, batch, tokens, strict=True)
    ]
    return loss, [g[local_rows] for g in shaped]


def gradients(loss, inputs):
    """d loss / d input for each input (a `TokenMatrices`: block by block); zeros where the loss is not."""
    parts = [x.blocks if isinstance(x, TokenMatrices) else [x] for x in inputs]
    flat = [tensor for part in parts for tensor in part]
    grads = torch.autograd.grad(loss, flat, allow_unused=True)
    grads = iter(torch.zeros_like(x) if grad is None else grad for x, grad in zip(flat, grads, strict=True))
    return [
        x.like([next(grads) for _ in x.blocks]) if isinstance(x, TokenMatrices) else next(grads)
        for x in inputs
    ]


def spans_processes(cross_process_negatives):
    return cross_process_negatives and dist.is_initialized() and dist.get_world_size() > 1


def stage_two_report(loss, rep_grads, groups, reencoded, encoded):
    # Block by block: one flat copy of the token matrices' gradients (and its finiteness mask) was 2.8x their
    # size, the peak of a multi-vector step.
    pieces = [block for g in rep_grads for block in (g.blocks if isinstance(g, TokenMatrices) else [g])]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(piece) for piece in pieces]))
    report = StepReport(loss, sum(map(len, groups)), sum(map(len, reencoded)), float(norm))
    report.kept_groups, report.kept_bytes = len(encoded.kept), encoded.kept_bytes
    finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(piece).all()) for piece in pieces)
    report.skipped = any_process(not finite)  # an optimizer step on these gradients would poison the weights
    return report


def backpropagate_cache(group, reps, rep_grads, backward):
    """Stage 3 for one group: backward of the surrogate sum <r, dL/dr>, whose gradient is the group's share.
    A padding chunk enters with a zero weight: its backward reaches the same parameters as the others'."""
    # fp32 with autocast off: the representation gradients are unscaled, `backward` scales (fp16) once.
    with torch.autocast(reps[0].device.type, enabled=False):
        surrogate = sum(
            rep.float().sum() * 0.0 if padding else (rep.float() * rep_grads[c][index.to(rep.device)]).sum()
            for (c, index, padding), rep in zip(group, reps, strict=True)
        )
    backward(surrogate)


def reencode_and_backpropagate(rng_states, encode, rep_grads, backward, g, group, is_last):
    """Stage 3 for a group stage 1 did not keep, from its stage-1 RNG state (the same dropout masks)."""
    with rng_states[g].replay() if REFINEMENTS.replay_rng else contextlib.nullcontext():
        reps = encode(group)
    backpropagate_cache(group, reps, rep_grads, backward)


# --- group_step's pass: a chunk of rows, encoded in every column, back-propagated at once ---------------
class RowChunks:
    def __init__(self, encode, loss_fn, counted, batch_size, backward):
        self.encode, self.loss_fn, self.counted, self.backward = encode, loss_fn, counted, backward
        self.batch_size, self.total, self.forwards, self.skipped = batch_size, 0.0, 0, False

    def __call__(self, g, group, is_last):
        [(_, index, padding)] = group
        pieces = [column_pieces(None if n is None else n[index], len(index)) for n in self.counted]
        chunks = [Chunk(c, index[p], padding) for c, column in enumerate(pieces) for p in column]
        encoded = self.encode(chunks)
        reps, repeated = rows_in_order(encoded, pieces, len(index))
        self.forwards += len(encoded)
        with torch.autocast(reps[0].device.type, enabled=False):
            terms = self.loss_fn(*[rep.float() for rep in reps], **keywords_taken(self.loss_fn, rows=index))
            # padding, and a row encoded twice to keep the passes even: reach, add nothing
            loss = terms.sum() * (0.0 if padding else 1.0 / self.batch_size) + 0.0 * repeated
        self.total = self.total + loss.detach()
        self.skipped = is_last and any_process(not bool(torch.isfinite(self.total)))  # one sync per step
        if self.skipped:
            return True  # no process steps on these gradients: nor runs the backward that synchronizes
        self.backward(loss)


def column_pieces(lengths, rows):
    """The positions (0 to rows - 1) of a chunk's rows in a column's GROUP_FORWARDS forwards, longest first
    (`sort_by_length`, `lengths`; else one forward): sorted again a column pads less (batch 1,024: 1.31x the
    real tokens, the cache's 1.10x). Every process runs as many (ZeRO-3): one row is encoded again."""
    if not (REFINEMENTS.sort_by_length and lengths is not None):
        return [torch.arange(rows)]
    order = torch.argsort(lengths, descending=True, stable=True)
    return list(order.tensor_split(GROUP_FORWARDS)) if rows >= GROUP_FORWARDS else [order] * GROUP_FORWARDS


GROUP_FORWARDS = 2  # per column and chunk of rows, in group_step


def rows_in_order(outputs, pieces, rows):
    """(each column's representations in the chunk's row order, the sum of the repeated rows' ones)."""
    reps, repeated, outputs = [], 0.0, iter(outputs)
    for column in pieces:
        encoded = [next(outputs) for _ in column]
        if sum(map(len, column)) > rows:  # one row, encoded again
            repeated = repeated + sum(rep.sum() for rep in encoded[1:])
            column, encoded = column[:1], encoded[:1]
        positions = torch.cat(column).to(encoded[0].device)
        reps.append(torch.cat(encoded)[torch.argsort(positions)])
    return reps, repeated


def row_lengths(counted):
    """Tokens of each row, its columns padded alike: the columns x the row's longest text; None if unknown."""
    return None if any(n is None for n in counted) else torch.stack(counted).amax(dim=0) * len(counted)


# --- The refinements: what the step does beyond the paper ------------------------------------------------
@dataclasses.dataclass
class Refinements:
    """Beyond the paper, gradients unchanged; one switched off to measure: `refinements(replay_rng=False)`."""

    reuse_last_chunk: bool = True  # stage 1 keeps the last group's graph (or graph_budget's); off: none
    replay_rng: bool = True  # stage 3 replays stage 1's RNG: without it dropout makes the gradients wrong
    sort_by_length: bool = True  # chunks of texts of similar length, so each trims its own padding


REFINEMENTS = Refinements()


@contextlib.contextmanager
def refinements(**switches):
    saved = dataclasses.replace(REFINEMENTS)
    for name in switches.keys() - vars(saved).keys():
        raise ValueError(f"no refinement {name!r}: choose from {list(vars(saved))}")
    vars(REFINEMENTS).update(switches)
    try:
        yield
    finally:
        vars(REFINEMENTS).update(vars(saved))


# --- The chunk plan: the same passes on every process ----------------------------------------------------
class Chunk(typing.NamedTuple):
    """Examples `index` of column `column`, encoded in one forward. A padding chunk repeats one example so
    that this process runs as many passes as the others: zero weight in the backward, never in the loss."""

    column: int
    index: torch.Tensor
    padding: bool = False


def plan_step(columns, limits, by_tokens, lengths, together):
    """The step's groups (what one backward covers), the same in number and shape on every process: each
    column planned alone (`plan_chunks`), its number of chunks the largest any process planned (one
    all-reduce), reached by halving the largest chunks (never over the budget), then by padding chunks. A
    shared encoder makes a group per chunk; towers (`together`) one chunk of every column per group: under
    ZeRO-3 each backward must reach every tower (DeepSpeed #1355), under DDP the same parameters."""
    counted = [example_lengths(column, n) for column, n in zip(columns, lengths, strict=True)]
    plans = [
        plan_chunks(column, lengths=n, **{"chunk_tokens" if by_tokens else "chunk_size": limit})
        for column, limit, n in zip(columns, limits, counted, strict=True)
    ]
    counts = [max(map(len, plans))] * len(plans) if together else [len(plan) for plan in plans]
    counts = largest_on_any_process(counts)
    plans = [split_to(plan, count, sizes) for plan, count, sizes in zip(plans, counts, counted, strict=True)]
    if together:
        return [[Chunk(c, *plan[s]) for c, plan in enumerate(plans)] for s in range(counts[0])]
    return [[Chunk(c, *chunk)] for c, plan in enumerate(plans) for chunk in plan]


def example_lengths(column, lengths):
    """Tokens per example: `lengths` as given, else from a features dict's attention mask, else None."""
    mask = column.get("attention_mask") if isinstance(column, Mapping) else None
    if lengths is None and isinstance(mask, torch.Tensor):
        lengths = mask.sum(dim=1)
    return None if lengths is None else torch.as_tensor(lengths).cpu()


def split_to(plan, count, lengths):
    """[(index, padding)]: `plan` with its largest chunks halved until it holds `count` chunks, then padding
    chunks (its shortest example again) where every chunk is down to one example."""
    plan = list(plan)
    while len(plan) < count and (splittable := [s for s, chunk in enumerate(plan) if len(chunk) > 1]):
        largest = max(splittable, key=lambda s: padded_size(plan[s], lengths))
        chunk = plan[largest]
        half = (len(chunk) + 1) // 2
        plan[largest : largest + 1] = [chunk[:half], chunk[half:]]
    return [(chunk, False) for chunk in plan] + [(plan[-1][-1:], True)] * (count - len(plan))


def padded_size(index, lengths):
    return len(index) * (1 if lengths is None else int(lengths[index].max()))


def plan_chunks(column, chunk_size=None, *, chunk_tokens=None, lengths=None):
    """Index tensors splitting a column into chunks of at most `chunk_size` examples or `chunk_tokens` padded
    tokens (examples x the chunk's longest; an example longer gets a chunk of its own). With `lengths` (a
    features dict's attention mask) and `Refinements.sort_by_length`, longest first (stable): each chunk
    trims its own padding, and a chunk size that does not fit fails at once."""
    if (chunk_size is None) == (chunk_tokens is None):
        raise ValueError("pass one of chunk_size (examples per chunk) and chunk_tokens (padded tokens).")
    batch_size = batch_size_of(column)
    lengths = example_lengths(column, lengths)
    if lengths is None and chunk_tokens is not None:
        raise ValueError(
            "chunk_tokens needs each example's length: pass lengths= (tokens per example) for a column "
            "without an attention mask, or use chunk_size."
        )
    if lengths is not None and lengths.shape != (batch_size,):
        raise ValueError(f"lengths holds {lengths.numel()} values for a column of {batch_size} examples.")
    sort = REFINEMENTS.sort_by_length and lengths is not None
    order = torch.argsort(lengths, descending=True, stable=True) if sort else torch.arange(batch_size)
    if chunk_tokens is None:
        return list(order.split(chunk_size))
    chunks, chunk, longest = [], [], 0
    for example, length in zip(order.tolist(), lengths[order].tolist(), strict=True):
        if chunk and (len(chunk) + 1) * max(longest, length) > chunk_tokens:
            chunks.append(chunk)
            chunk, longest = [], 0
        chunk.append(example)
        longest = max(longest, length)
    return [torch.tensor(chunk) for chunk in [*chunks, chunk]]


# --- Inputs: a features dict of batch-first tensors, a tensor, or what `select` understands ------------
def sentence_embedding(output):
    """The representation a sentence-transformers model returns; other outputs pass through."""
    return output["sentence_embedding"] if isinstance(output, Mapping) else output


def batch_size_of(column):
    if isinstance(column, Mapping):  # the attention mask's length, else the input ids', else any tensor's
        candidates = [column.get("attention_mask"), column.get("input_ids"), *column.values()]
        return len(next(value for value in candidates if isinstance(value, torch.Tensor)))
    return len(column)


class TokenMatrices:
    """A column of representations of several vectors a text (token matrices, ColBERT), kept chunk by chunk at
    each chunk's padded width: `blocks[k]` (rows x width x channels) holds examples `indices[k]` of the batch.
    Stage 1 adds a chunk's block (`cache[index] = block`), stage 3 reads its gradient block (`grads[index]`);
    the loss gets the column as it is (padding past a chunk's longest text is never held)."""

    def __init__(self, indices=(), blocks=()):
        self.indices, self.blocks = list(indices), list(blocks)

    def __setitem__(self, index, block):
        self.indices.append(index.cpu())
        self.blocks.append(block)

    def __getitem__(self, index):
        """The block of chunk `index` (an index tensor); or, a slice, the blocks of those rows, renumbered."""
        if isinstance(index, slice):
            inside = [k for k, rows in enumerate(self.indices) if index.start <= int(rows[0]) < index.stop]
            return TokenMatrices(
                [self.indices[k] - index.start for k in inside], [self.blocks[k] for k in inside]
            )
        return self.blocks[next(k for k, rows in enumerate(self.indices) if torch.equal(rows, index.cpu()))]

    def __len__(self):
        return sum(map(len, self.indices))

    @property
    def device(self):
        return self.blocks[0].device

    def like(self, blocks):
        return TokenMatrices(self.indices, blocks)

    def requires_grad_(self):
        return self.like([block.requires_grad_() for block in self.blocks])

    def flatten(self):
        return torch.cat([block.flatten() for block in self.blocks])

    def numel(self):
        return sum(block.numel() for block in self.blocks)

    def from_flat(self, flat):
        """Blocks shaped as this one's, from a flat tensor of their values."""
        return self.like(
            list(map(torch.Tensor.view_as, flat.split([b.numel() for b in self.blocks]), self.blocks))
        )

    @staticmethod
    def gathered(local):
        """Every process's TokenMatrices in rank order, joined into one: indices offset by the rows before."""
        shapes = torch.tensor([block.shape for block in local.blocks], device=local.device)
        local = (local.flatten(), torch.cat(local.indices).to(local.device), shapes)
        joined = TokenMatrices()
        for flat, indices, shapes in zip(*map(gather_from_all_processes, local), strict=True):
            values = flat.split(shapes.prod(dim=1).tolist())
            joined.blocks += [v.view(*shape) for v, shape in zip(values, shapes.tolist(), strict=True)]
            joined.indices += list((indices + len(joined)).split(shapes[:, 0].tolist()))
        return joined


def select_examples(column, index):
    """The examples `index` of a column, the padding no selected example uses trimmed (trailing, leading too
    when left-padded: what tokenizing the chunk's texts alone gives). Non-tensors and 0-d tensors pass."""
    if isinstance(column, torch.Tensor):
        return column[index.to(column.device)]
    if not isinstance(column, Mapping):
        return [column[i] for i in index.tolist()]
    chunk = {
        key: value[index.to(value.device)] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
        for key, value in column.items()
    }
    mask = chunk.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.any():
        used = mask.any(dim=0).nonzero()
        first = int(used.min()) if bool(mask[:, -1].all()) else 0
        last = int(used.max()) + 1
        for key, value in chunk.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == mask.shape[1]:
                chunk[key] = value[:, first:last]
    return chunk


def tokenize_per_chunk(tokenize):
    """`select` for raw texts: `tokenize(texts)` (a model's `preprocess`, moved to the device) on each chunk's
    texts as it is encoded, padded to its longest. Give `gradcache_step` the token counts as `lengths`."""

    def select(texts, index):
        features = tokenize([texts[i] for i in index.tolist()])
        # A plain dict: DDP finds output tensors in dicts only, and sentence-transformers returns its input
        # (a BatchEncoding) with its outputs added: unseen, they leave every parameter "unused".
        return dict(features) if isinstance(features, Mapping) else features

    return select


# --- RNG replay: the re-encoding must draw the dropout masks of the first encoding -----------------------
@dataclasses.dataclass
class RngState:
    """The CPU's and initialized CUDA devices' RNG before a group's first forward: stage 3 replays them."""

    cpu: torch.Tensor
    cuda: list

    @classmethod
    def capture(cls):
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def replay(self):
        # fork_rng restores the outer state on exit, so replaying leaves the RNG where stage 1 left it.
        with torch.random.fork_rng(devices=range(len(self.cuda))):
            torch.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


# --- Between processes: the exchange of stage 2, and decisions every process takes alike ---------------
def gather_from_all_processes(local):
    """Every process's `local` (detached), in rank order; ranks may hold different sizes in any dimension."""
    world_size = dist.get_world_size()
    shape = torch.tensor(local.shape, dtype=torch.int64, device=local.device)
    shapes = [torch.empty_like(shape) for _ in range(world_size)]
    dist.all_gather(shapes, shape)
    padded = local.new_zeros(torch.stack(shapes).amax(dim=0).tolist())
    padded[tuple(slice(0, n) for n in local.shape)] = local
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    return [g[tuple(slice(0, int(n)) for n in s)] for g, s in zip(gathered, shapes, strict=True)]


def any_process(flag):
    """True on every process if `flag` is True on any (a no-op without torch.distributed)."""
    return bool(largest_on_any_process([int(flag)])[0])


def largest_on_any_process(numbers):
    """Each of `numbers` replaced by its largest value on any process: one all-reduce of a few ints."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(numbers)
    largest = torch.tensor(numbers, dtype=torch.int64, device=collective_device())
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.tolist()


def collective_device():
    """Where the default process group takes its tensors: the CPU for gloo (and MPI), else the current
    accelerator (NCCL refuses CPU tensors, whatever device the columns or the encoder live on)."""
    backend = str(dist.get_backend())
    if "gloo" in backend or backend == "mpi" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class ChunkOutOfMemory(RuntimeError):
    """A chunk did not fit (gradients may hold part of the step); `agreed` False: this process alone: end."""

    def __init__(self, message, agreed=True):
        super().__init__(message)
        self.agreed = agreed


class StepInterrupted(Exception):
    """`interrupt()` said stop, before a group's forward, on every process at the same group."""


def stop_if_asked(interrupt, stage, group, groups):
    if interrupt is not None and interrupt(stage, group, groups):
        raise StepInterrupted


class OutOfMemory:
    """One step's out-of-memory protocol: all processes raise `ChunkOutOfMemory` together, none is left in a
    collective the others will not reach. `watch()` notes an out-of-memory; the step goes on, computing
    nothing, to the next `agree()` (one all-reduce: before stage 2, before the synchronizing backward). A
    pass that is a collective (the synchronizing backward; every pass with `agree=False`) raises at once."""

    def __init__(self, agree, limits, by_tokens):
        self.agree_with_others, self.limits, self.by_tokens = agree, limits, by_tokens
        self.ran_out = self.alone = False

    @contextlib.contextmanager
    def watch(self, collective=False):
        # Raised later, outside this handler: its traceback would pin the chunk's memory.
        try:
            yield
        except torch.OutOfMemoryError:
            self.ran_out, self.alone = True, collective or not self.agree_with_others

    def raise_if_alone(self):
        if self.alone:
            raise self.error(agreed=False)

    def agree(self, collectively=True, also=()):
        """Returns `also`, numbers that ride the same all-reduce, each its largest on any process."""
        self.raise_if_alone()
        if collectively and (self.agree_with_others or also):
            ran_out, *also = largest_on_any_process([int(self.ran_out), *also])
            self.ran_out = bool(ran_out)
        if self.ran_out:
            raise self.error(agreed=True)
        return also

    def error(self, agreed):
        halves = [max(limit // 2, 1) for limit in self.limits]
        limit, smaller = (values[0] if len(set(values)) == 1 else values for values in (self.limits, halves))
        chunk = f"up to {limit} padded tokens" if self.by_tokens else f"{limit} examples"
        use = "chunk_tokens" if self.by_tokens else "chunk size"
        return ChunkOutOfMemory(
            f"a chunk of {chunk} ran out of memory (on this or another process). Use a {use} of {smaller} or "
            "less: the batch, and so the gradients, stay the same; a step takes longer.",
            agreed,
        )


# --- Checks: what cannot be exact, or cannot run, is refused with what to do -----------------------------
def check_step_arguments(encoders, columns, limits, by_tokens, lengths, allow_batch_mixing):
    if not columns:
        raise ValueError("columns is empty: pass at least an anchor and a positive column.")
    if len(encoders) != len(columns):
        raise ValueError(f"{len(encoders)} encoders for {len(columns)} columns: pass one, or one per column.")
    name, what = ("chunk_tokens", "token budgets") if by_tokens else ("chunk_size", "chunk sizes")
    if len(limits) != len(columns):
        raise ValueError(f"{len(limits)} {what} for {len(columns)} columns: pass one int or one per column.")
    for limit in limits:
        if not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"{name} must be a positive int, got {limit!r}.")
    if len(lengths) != len(columns):
        raise ValueError(f"lengths for {len(lengths)} columns, the batch has {len(columns)}: one per column.")
    sizes = [batch_size_of(column) for column in columns]
    if sizes[0] == 0:
        raise ValueError("the batch is empty: every column needs at least one example.")
    if len(set(sizes)) > 1:
        raise ValueError(f"columns hold different numbers of examples {sizes}: each needs one per row.")
    if not allow_batch_mixing:
        for encoder in {id(e): e for e in encoders}.values():
            if isinstance(encoder, nn.Module):
                check_examples_independent(encoder)


def check_scalar(loss):
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}; reduce it (mean).")
    return loss


def check_loss_takes_local_rows(loss_fn, cross_process_negatives):
    if spans_processes(cross_process_negatives) and not takes_keyword(loss_fn, "local_rows"):
        raise ValueError(
            "with cross_process_negatives each process computes only its own rows of the loss: loss_fn must "
            "accept `local_rows` (a slice of the global batch's rows) and return those rows' terms divided "
            "by the global batch size, as contrastive_loss does; or pass cross_process_negatives=False."
        )


def check_examples_independent(module):
    """Raise if `module` mixes examples across the batch (BatchNorm in training): no chunk would be exact."""
    mixing = [
        name or type(module).__name__
        for name, layer in module.named_modules()
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training
    ]
    if mixing:
        raise ValueError(
            f"Gradient Cache cannot be exact: {', '.join(mixing)} normalizes over the batch (a chunk's "
            "statistics differ). Use eval mode, replace them (LayerNorm), or pass allow_batch_mixing=True."
        )


# --- Hugging Face accelerate (passed in, never imported) -------------------------------------------------
def accelerate_sync_context(accelerator, *models):
    """`sync_context` for accelerate: only the last chunk of the last outer micro-batch synchronizes. The
    others: `sync_gradients` False (DeepSpeed neither reduces nor steps) and, under DDP, `no_sync(model)`."""

    @contextlib.contextmanager
    def sync_context(is_last):
        outer_sync = accelerator.sync_gradients
        accelerator.sync_gradients = outer_sync and is_last
        try:
            with contextlib.ExitStack() as no_sync:
                # DeepSpeed's own no_sync refuses a step inside it (ZeRO-1) or does nothing (ZeRO-2/3).
                if not is_last and accelerator.distributed_type != "DEEPSPEED":
                    for model in models:
                        no_sync.enter_context(accelerator.no_sync(model))
                yield
        finally:
            accelerator.sync_gradients = outer_sync

    return sync_context


# ===== Part II. The loss of stage 2 ========================================================================
# The contract: loss(anchor, positive, *negatives, **keywords) -> a scalar (group_step: a term per row), the
# representations in column order, float32. Of these keywords a loss is given only those it declares:
#   local_rows       cross-process negatives: the slice of the global batch's rows this process computes;
#                    return their terms divided by the global batch size (required there, see above).
#   rows             group_step: the batch indices of the chunk's rows, to index the side data below.
#   false_negatives  a `FalseNegatives`: candidates of a row that are no negatives and leave its softmax.
#   teacher_scores   B x (1 + k) teacher scores of each anchor's positive and hard negatives, to distil.
#   stats            a dict for the loss's numbers, each logged by train.py as train/<name> ("_name": a
#                    running count, not logged).
# The trainer binds the last three (`with_side_data`). `contrastive_loss` and `group_loss` take them all.
def with_side_data(loss_fn, **side_data):
    """`loss_fn` with the batch's side data bound, those keywords it declares. Masks or teacher scores given
    to a loss that cannot take them stop here: it would silently train without them."""
    given = [name for name, value in side_data.items() if value is not None and name != "stats"]
    if missing := [name for name in given if not takes_keyword(loss_fn, name)]:
        raise ValueError(
            f"the loss takes no {', '.join(missing)}, built for this batch: add the keyword to the loss, or "
            "build none (train.py: --mask_repeated_texts off, no margin or guide; --distill_weight 0)."
        )
    return functools.partial(loss_fn, **keywords_taken(loss_fn, **side_data))


def keywords_taken(loss_fn, **keywords):
    return {name: value for name, value in keywords.items() if takes_keyword(loss_fn, name)}


def takes_keyword(loss_fn, name):
    """Whether `loss_fn` declares the keyword `name` (or **kwargs); a callable without a signature: yes."""
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.name == name and p.kind is not p.POSITIONAL_ONLY or p.kind is p.VAR_KEYWORD for p in parameters
    )


def contrastive_loss(
    anchor, positive, *negatives, scale: float = 20.0, similarity: str = "cos", symmetric: bool = False,
    tile_size: int | None = None, matryoshka_dims: Sequence[int] | None = None,
    matryoshka_weights: Sequence[float] | None = None, local_rows: slice | None = None,
    false_negatives: "FalseNegatives | None" = None, stats: dict | None = None,
    teacher_scores: torch.Tensor | Sequence | None = None, distill_weight: float = 1.0,
    distill_temperature: float = 1.0,
):  # fmt: skip
    """In-batch-negatives InfoNCE (MultipleNegativesRankingLoss), computed tile by tile.

    With B anchors a_i, N = B(1 + k) candidates c_j (the positives, then k hard-negative columns), the
    scale tau (inverse temperature) and pos(i) = i the index of anchor i's own positive:

        s_ij = tau <a_i, c_j>,        L = (1 / B) sum_i [ LSE_j(s_ij) - s_i,pos(i) ]

    `TiledCrossEntropy` computes each row's term tile by tile. `similarity="cos"` normalizes first, "dot"
    does not; `symmetric` averages L with the positive-to-anchor direction (a second tiled pass).

    tile_size:        rows and columns of a score tile (`default_tile_size`).
    matryoshka_dims:  sum_m w_m L(m), L(m) on the first m dimensions renormalized (MatryoshkaLoss; w = 1).
    local_rows:       the anchors (and positives) whose terms this call computes, still divided by the
                      whole B: one process's share under cross-process negatives.
    stats:            receives "in_batch_accuracy" (anchors whose positive scores highest), with masks
                      "masked_fraction" (of the candidates), with Matryoshka "loss_dim_<m>" (unweighted L(m)).
    teacher_scores:   B x (1 + k) teacher scores of each anchor's positive and hard negatives: adds
                      distill_weight x KL(teacher's softmax || student's) over the anchor's group at
                      `distill_temperature` (FlagEmbedding, tevatron), on the full width."""
    rows = slice(0, len(anchor)) if local_rows is None else local_rows
    counts = [0, 0]  # candidates masked, candidates seen
    hits = [0, 0] if stats is not None else None  # anchors whose positive scores highest, anchors
    in_batch = functools.partial(info_nce, scale=scale, symmetric=symmetric, rows=rows, tile_size=tile_size)
    in_batch = functools.partial(in_batch, false_negatives=false_negatives, counts=counts, hits=hits)
    matryoshka = (matryoshka_dims, matryoshka_weights)
    distill = (teacher_scores, distill_weight, distill_temperature)
    rows_of_terms = (rows, rows, len(anchor))  # the rows computed, their side data; a per-row term summed / B
    columns = [anchor, positive, *negatives]
    loss, terms = loss_skeleton(in_batch, columns, rows_of_terms, scale, similarity, matryoshka, distill)
    if stats is not None:
        stats["in_batch_accuracy"] = float(hits[0]) / max(hits[1], 1)
        if false_negatives is not None:
            stats["masked_fraction"] = float(counts[0]) / max(counts[1], 1)
        per_row = len(anchor) / len(range(*rows.indices(len(anchor))))  # terms are divided by the whole B
        for dim, term in zip(matryoshka_dims or (), terms or (), strict=True):
            stats[f"loss_dim_{dim}"] = float(term.detach()) * per_row
    return loss


def group_loss(
    anchor, positive, *negatives, scale: float = 20.0, similarity: str = "cos",
    matryoshka_dims: Sequence[int] | None = None, matryoshka_weights: Sequence[float] | None = None,
    rows: torch.Tensor | None = None, false_negatives: "FalseNegatives | None" = None,
    stats: dict | None = None, teacher_scores: torch.Tensor | Sequence | None = None,
    distill_weight: float = 1.0, distill_temperature: float = 1.0,
):  # fmt: skip
    """Without in-batch negatives: each anchor against its own group only, one term per row (`group_step`):

        l_i = LSE_j(s_ij) - s_i0,   s_i0 = tau <a_i, p_i>,  s_ij = tau <a_i, n_ij>   (j = 1..k)

    rows x (1 + k) scores. The options are `contrastive_loss`'s; `stats` adds up its counts over the chunks
    ("_masked", "_seen", "_hits", "_rows"), giving "masked_fraction" (with masks) and "in_batch_accuracy"
    (rows whose positive scores highest in their own group)."""
    rows = torch.arange(len(anchor)) if rows is None else rows
    counts = [0, 0]  # hard negatives masked, rows whose positive scores highest
    own_group = functools.partial(group_terms, scale=scale, rows=rows)
    own_group = functools.partial(own_group, false_negatives=false_negatives, counts=counts)
    matryoshka = (matryoshka_dims, matryoshka_weights)
    distill = (teacher_scores, distill_weight, distill_temperature)
    rows_of_terms = (slice(None), rows, None)  # every row held, its side data at `rows`; one term per row
    columns = [anchor, positive, *negatives]
    terms, _ = loss_skeleton(own_group, columns, rows_of_terms, scale, similarity, matryoshka, distill)
    if stats is not None:
        stats["_masked"] = stats.get("_masked", 0) + int(counts[0])
        stats["_seen"] = stats.get("_seen", 0) + len(anchor) * len(negatives) * len(matryoshka_dims or [0])
        if false_negatives is not None:
            stats["masked_fraction"] = stats["_masked"] / max(stats["_seen"], 1)
        stats["_hits"] = stats.get("_hits", 0) + counts[1]
        stats["_rows"] = stats.get("_rows", 0) + len(anchor) * len(matryoshka_dims or [0])
        stats["in_batch_accuracy"] = stats["_hits"] / stats["_rows"]  # within each row's own group
    return terms


# --- The skeleton of both: normalize, each Matryoshka size, distillation; a new term goes here -----------
def loss_skeleton(own_term, columns, rows, scale, similarity, matryoshka, distill):
    """Both losses: `own_term(*columns)` normalized at each Matryoshka size, plus distillation -> (the loss,
    each size's own term or None). rows: (the rows the terms are of, their side data's indices, the batch
    size dividing a per-row sum: None keeps a term per row); matryoshka: (dims, weights); distill."""
    if similarity not in ("cos", "dot"):
        raise ValueError(f"similarity must be 'cos' or 'dot', got {similarity!r}")
    (local, side_rows, batch_size), (dims, weights) = rows, matryoshka
    if dims is None:
        normalized = [F.normalize(column, dim=-1) for column in columns] if similarity == "cos" else columns
        loss, terms = own_term(*normalized), None
    else:
        weights = check_matryoshka(dims, weights, columns[0].shape[-1])
        terms = [own_term(*[F.normalize(column[:, :dim], dim=-1) for column in columns]) for dim in dims]
        loss = sum(weight * term for weight, term in zip(weights, terms, strict=True))
    teacher_scores, distill_weight, temperature = distill
    if teacher_scores is not None:  # on the full representation, also with Matryoshka
        full = [F.normalize(c, dim=-1) for c in columns] if similarity == "cos" else columns
        student = group_scores(*full, rows=local) * scale
        teacher = torch.as_tensor(teacher_scores, dtype=student.dtype, device=student.device)[side_rows]
        kl = distillation(student, teacher, temperature)
        loss = loss + (distill_weight * kl if batch_size is None else distill_weight * kl.sum() / batch_size)
    return loss, terms


def check_matryoshka(dims, weights, width):
    weights = [1.0] * len(dims) if weights is None else list(weights)
    if len(weights) != len(dims):
        raise ValueError(f"{len(weights)} matryoshka_weights for {len(dims)} matryoshka_dims: one per dim.")
    for dim in dims:
        if not isinstance(dim, int) or not 0 < dim <= width:
            raise ValueError(
                f"matryoshka dimension {dim!r} is not a prefix of the {width}-dimensional representation: "
                f"use dimensions between 1 and {width}."
            )
    return weights


def group_scores(anchor, positive, *negatives, rows):
    """<a_i, c> for each anchor's own group only (its positive, then its hard negatives): rows x (1 + k)."""
    group = torch.stack([positive[rows], *[negative[rows] for negative in negatives]], dim=1)
    return (anchor[rows, None, :] * group).sum(dim=-1)


def distillation(student, teacher, temperature):
    """Per row, KL(softmax(teacher / T) || softmax(student / T)) over the row's group."""
    student, teacher = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    return F.kl_div(student, teacher, log_target=True, reduction="none").sum(dim=-1)


# --- Each loss's own term: the in-batch softmax, tiled, or each row's group ------------------------------
def info_nce(anchor, positive, *negatives, scale, symmetric, rows, tile_size, false_negatives, counts, hits):
    """L of `contrastive_loss` on representations as they are (already normalized for cosine)."""
    first_row = rows.start or 0  # the global index of the first local row is also that of its positive
    candidates = [positive, *negatives]  # not joined: a copy of them, vocabulary-sized for a sparse model
    masks = [None, None]
    if false_negatives is not None:
        masks = false_negatives.tile_masks(anchor, positive, len(negatives), rows, scale)
    loss = tiled_cross_entropy(anchor[rows], candidates, first_row, scale, tile_size, masks[0], hits)
    loss = loss.sum() / len(anchor)
    if symmetric:
        reverse = tiled_cross_entropy(positive[rows], [anchor], first_row, scale, tile_size, masks[1])
        loss = (loss + reverse.sum() / len(anchor)) / 2
    for mask in filter(None, masks[: 1 + symmetric]):
        counts[0], counts[1] = counts[0] + mask.masked, counts[1] + mask.seen
    return loss


def group_terms(*columns, scale, rows, false_negatives, counts):
    """`group_loss`'s term l_i over row i's group less what `false_negatives` masks (counts: masked, hits)."""
    similarities = group_scores(*columns, rows=slice(None))
    mask = torch.zeros_like(similarities, dtype=torch.bool)
    if false_negatives is not None:
        mask[:, 1:] = false_negatives.group_mask(similarities, rows)
        counts[0] = counts[0] + mask.sum()
    scores = (similarities * scale).masked_fill(mask, -torch.inf)
    counts[1] = counts[1] + int((scores.detach().argmax(dim=1) == 0).sum())  # the positive scores highest
    return torch.logsumexp(scores, dim=1) - scores[:, 0]


# --- Masks: candidates that are not negatives leave the softmax ------------------------------------------
@dataclasses.dataclass
class FalseNegatives:
    """Which in-batch candidates are not negatives of a row (they leave its softmax): as the batch grows,
    duplicates of a row's positive sit among its "negatives".

    ids:      one integer tensor per column of the global batch, an id per text (equal texts, equal ids,
              all >= 0): masks a candidate repeating the row's positive, or the positive of a row whose
              anchor repeats this row's (reverse: an anchor repeating the row's, or whose positive does).
    other_positives: with `ids`, B x P ids of each row's other right answers (-1: none), masked too
              (reverse: an anchor with the row's positive among its other positives).
    margin:   masks candidates above the row's positive + margin (Qwen3-Embedding's 0.1), or x margin
              (`relative`: NV-Retriever's 0.95); the threshold is detached.
    guide:    a frozen guide model's representations of every column (GIST): masks what the guide scores
              (cosine) above its score of the row's positive + `guide_margin`."""

    ids: Sequence | None = None
    margin: float | None = None
    relative: bool = False
    other_positives: torch.Tensor | None = None
    guide: Sequence | None = None
    guide_margin: float = 0.0
    # The guide's columns normalized once per batch, not once per Matryoshka size or group_loss chunk.
    normalized_guide: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def tile_masks(self, anchor, positive, num_negatives, rows, scale):
        """The masks of the two directions: anchors against candidates, positives against anchors."""
        query_ids = key_ids = reverse_query_ids = reverse_key_ids = thresholds = None
        guided = reverse_guided = None
        if self.ids is not None:
            anchor_ids, positive_ids, *negative_ids = self.column_ids(anchor.device)
            if len(negative_ids) != num_negatives or any(len(i) != len(anchor) for i in self.ids):
                raise ValueError("FalseNegatives.ids needs one id per text of every column of the batch.")
            others = self.other_ids(len(anchor), anchor.device)
            unpaired = [torch.stack([ids, torch.full_like(ids, -1)], 1) for ids in negative_ids]
            # Queries: (own id, ids of the right answers); keys: (own id, ids of the texts it answers).
            query_ids = torch.cat([anchor_ids[:, None], positive_ids[:, None], others], 1)[rows]
            key_ids = torch.cat([torch.stack([positive_ids, anchor_ids], 1), *unpaired])
            reverse_query_ids = torch.stack([positive_ids, anchor_ids], 1)[rows]
            reverse_key_ids = torch.cat([anchor_ids[:, None], positive_ids[:, None], others], 1)
        if self.margin is not None:
            with torch.no_grad():
                positive_similarity = (anchor[rows] * positive[rows]).sum(dim=-1)
                thresholds = self.threshold(positive_similarity) * scale  # tiles hold scaled scores
        if self.guide is not None:
            guide_anchor, guide_positive, *_ = self.guide_columns(anchor.device)
            guide_thresholds = (guide_anchor[rows] * guide_positive[rows]).sum(-1) + self.guide_margin
            guided = (guide_anchor[rows], self.normalized_guide[anchor.device][1], guide_thresholds)
            reverse_guided = (guide_positive[rows], guide_anchor, guide_thresholds)
        reverse = TileMask(reverse_query_ids, reverse_key_ids, thresholds, reverse_guided)
        return TileMask(query_ids, key_ids, thresholds, guided), reverse

    def guide_columns(self, device):
        if device not in self.normalized_guide:
            guide = (torch.as_tensor(g, device=device).float() for g in self.guide)
            anchor, *others = (F.normalize(g, dim=-1) for g in guide)
            candidates = torch.cat(others)  # every column after the anchors': those columns are its views
            self.normalized_guide[device] = [anchor, *candidates.split([len(g) for g in others])], candidates
        return self.normalized_guide[device][0]

    def group_mask(self, similarities, rows):
        """Which hard negatives leave their row's group (`group_loss`): rows x k, from the rows' similarities
        to their positive (first) and hard negatives; `rows` index the batch's ids."""
        mask = torch.zeros_like(similarities[:, 1:], dtype=torch.bool)
        rows = torch.as_tensor(rows, device=similarities.device)
        if self.ids is not None:
            _, positive_ids, *negative_ids = [ids[rows] for ids in self.column_ids(similarities.device)]
            others = self.other_ids(len(self.ids[0]), similarities.device)[rows]
            answers = torch.cat([positive_ids[:, None], others], 1)
            for j, ids in enumerate(negative_ids):
                mask[:, j] = (ids[:, None] == answers).any(dim=1)
        if self.margin is not None:
            with torch.no_grad():
                mask |= similarities[:, 1:] > self.threshold(similarities[:, :1])
        if self.guide is not None:
            guide_anchor, *guide_group = [g[rows] for g in self.guide_columns(similarities.device)]
            guide_scores = torch.stack([(guide_anchor * g).sum(-1) for g in guide_group], dim=1)
            mask |= guide_scores[:, 1:] > guide_scores[:, :1] + self.guide_margin
        return mask

    def column_ids(self, device):
        return [torch.as_tensor(i, device=device) for i in self.ids]

    def other_ids(self, batch_size, device):
        if self.other_positives is None:
            return torch.full((batch_size, 0), -1, dtype=torch.int64, device=device)
        return torch.as_tensor(self.other_positives, device=device).reshape(batch_size, -1)

    def threshold(self, positive_similarity):
        return positive_similarity * self.margin if self.relative else positive_similarity + self.margin


@dataclasses.dataclass
class TileMask:
    """The entries of a score tile that leave the softmax, the same in forward and backward: a key whose
    id is one of the query's right answers, or that answers the query's id (-1 fills both, matching none)."""

    query_ids: torch.Tensor | None  # per query row: (its own id, the ids of its right answers...)
    key_ids: torch.Tensor | None  # per key: (its id, the ids of the texts it answers..., or -1)
    thresholds: torch.Tensor | None  # per query row, in scaled scores
    guided: tuple | None = None  # a guide model's (queries, keys, per query row the score masked above)
    masked: torch.Tensor | int = 0  # counted in forward
    seen: int = 0

    def __call__(self, scores, rows, columns, local, targets):
        mask = torch.zeros_like(scores, dtype=torch.bool)
        if self.query_ids is not None:
            queries, keys = self.query_ids[rows], self.key_ids[columns]
            # One T x T comparison at a time: never T x T x (number of right answers).
            for answer in queries[:, 1:].T:
                mask |= keys[None, :, 0] == answer[:, None]
            for answered in keys[:, 1:].T:
                mask |= answered[None, :] == queries[:, 0, None]
        if self.thresholds is not None:
            mask |= scores > self.thresholds[rows, None]
        if self.guided is not None:
            guide_queries, guide_keys, guide_thresholds = self.guided
            mask |= guide_queries[rows] @ guide_keys[columns].T > guide_thresholds[rows, None]
        mask[local, targets] = False
        return mask


# --- Tiles: the B x N scores, never held at once ---------------------------------------------------------
def tiled_cross_entropy(queries, keys, first_target, scale, tile_size=None, mask=None, hits=None):
    """Per row i: LSE_j(s_ij) - s_i,t(i), s_ij = tau <q_i, k_j>, t(i) = first_target + i; never B x N; k_j
    the rows of the `keys` blocks one after the other. A `TileMask` leaves entries out (never targets);
    `hits` ([rows whose target scores highest, rows]) adds."""
    tile_size = int(tile_size or default_tile_size(len(queries), sum(map(len, keys))))
    return TiledCrossEntropy.apply(queries, int(first_target), float(scale), tile_size, mask, hits, *keys)


def default_tile_size(rows, columns):
    """2048, or the score matrix's longer side if shorter: products at full speed (CPU, batch 4096, d = 384:
    tiles of 1024, 2048, 4096 took the same time); larger costs memory (16 MiB fp32 at 2048, any batch)."""
    return max(1, min(2048, max(rows, columns)))


class TiledCrossEntropy(torch.autograd.Function):
    """Cross-entropy of each row of S = tau Q K^T against its target column t(i) = first_target + i (Y the
    one-hot targets), from T x T tiles: Inf-CL (Cheng et al. 2024).

    Forward:   for each row tile I and column tile J, S_IJ = (tau Q_I) K_J^T is folded into an online
               log-sum-exp: a running maximum m_I and sum l_I of exp(S - m_I), the sum rescaled by
               exp(old m - new m) when the maximum rises; the target scores s_i,t(i) are read from
               the tile that holds them. Output: ce_i = log l_i - (s_i,t(i) - m_i) = LSE_i - s_i,t(i).
    Backward:  with g_i = dL/dce_i, the tiles are recomputed: P_IJ = exp(S_IJ - m_I) / l_I (the softmax),
               G_IJ = g_I (P_IJ - Y_IJ), and  dQ_I += tau G_IJ K_J,   dK_J += G_IJ^T (tau Q_I).
    Memory: Q, K (its blocks as given: never joined), their gradients, m and l per row (LSE = m + log l
    would round to its magnitude) and one tile; tau Q_I one row tile at a time. Compute: four score-sized
    products, not three. P - Y in the tile: a one-hot row keeps its digits."""

    @staticmethod
    def forward(ctx, queries, first_target, scale, tile_size, mask, hits, *keys):
        # The lowest finite number, not -inf: a row whose tile is all masked must give exp(-inf - max) = 0.
        row_max = queries.new_full((len(queries),), torch.finfo(queries.dtype).min)
        row_sum, target_scores = torch.zeros_like(row_max), torch.zeros_like(row_max)
        for i, j, rows, columns, block, within in tiles(len(queries), keys, tile_size):
            scores = (queries[rows] * scale) @ keys[block][within].T
            local, targets = targets_in_tile(i, j, scores.shape, first_target, queries.device)
            target_scores[i + local] = scores[local, targets]
            if mask is not None:
                masked = mask(scores, rows, columns, local, targets)
                scores.masked_fill_(masked, -torch.inf)
                mask.masked = mask.masked + masked.sum()  # a tensor: no device sync per tile
                mask.seen += scores.numel() - len(local)
            new_max = torch.maximum(row_max[rows], scores.amax(dim=1))
            rescale = torch.exp(row_max[rows] - new_max)
            row_sum[rows] = row_sum[rows] * rescale + scores.sub_(new_max[:, None]).exp_().sum(dim=1)
            row_max[rows] = new_max
        if hits is not None:  # the row maximum includes the target: a tie counts as a hit
            hits[0], hits[1] = hits[0] + (target_scores >= row_max).sum(), hits[1] + len(queries)
        ctx.save_for_backward(queries, row_max, row_sum, *keys)
        ctx.first_target, ctx.scale, ctx.tile_size, ctx.mask = first_target, scale, tile_size, mask
        return row_sum.log() - (target_scores - row_max)

    @staticmethod
    def backward(ctx, grad_rows):
        queries, row_max, row_sum, *keys = ctx.saved_tensors
        grad_over_sum = grad_rows / row_sum  # g_i P_ij = exp(s_ij - m_i) g_i / l_i: one pass less
        grad_queries, grad_keys = torch.zeros_like(queries), [torch.zeros_like(block) for block in keys]
        for i, j, rows, columns, block, within in tiles(len(queries), keys, ctx.tile_size):
            scaled = queries[rows] * ctx.scale
            scores = scaled @ keys[block][within].T
            local, targets = targets_in_tile(i, j, scores.shape, ctx.first_target, queries.device)
            if ctx.mask is not None:  # the forward's mask, from the same scores: no gradient where masked
                scores.masked_fill_(ctx.mask(scores, rows, columns, local, targets), -torch.inf)
            weights = scores.sub_(row_max[rows, None]).exp_().mul_(grad_over_sum[rows, None])
            weights[local, targets] -= grad_rows[i + local]
            grad_queries[rows].addmm_(weights, keys[block][within], alpha=ctx.scale)
            grad_keys[block][within].addmm_(weights.T, scaled)
        return grad_queries, None, None, None, None, None, *grad_keys


def tiles(num_rows, blocks, tile_size):
    """(i, j, rows, columns, block, within): the tile at row i, column j; its keys blocks[block][within]
    (the blocks' rows one after the other, no tile spanning two)."""
    starts = list(itertools.accumulate(map(len, blocks), initial=0))
    for i, (block, keys) in itertools.product(range(0, num_rows, tile_size), enumerate(blocks)):
        for j in range(0, len(keys), tile_size):
            within = slice(j, min(j + tile_size, len(keys)))
            columns = slice(starts[block] + j, starts[block] + within.stop)
            yield i, starts[block] + j, slice(i, i + tile_size), columns, block, within


def targets_in_tile(i, j, shape, first_target, device):
    """(rows, columns) inside the tile at (i, j) where row r's target column first_target + r lies."""
    first = max(0, j - first_target - i)
    last = min(shape[0], j + shape[1] - first_target - i)
    local = torch.arange(first, max(first, last), device=device)
    return local, local + (first_target + i - j)
