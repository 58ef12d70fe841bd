"""The tiled contrastive loss against the materialized one, sentence-transformers' losses, and a memory probe.

`gradcache.contrastive_loss` never builds the B x N score matrix. Here it must equal, by references.py's rule
(as close to the float64 truth as the float32 reference is), the plain-autograd loss of tests/references.py
that does (values and representation gradients), for
every combination of direction, hard negatives, similarity and tile shape; equal sentence-transformers'
MultipleNegativesRankingLoss and MatryoshkaLoss; and a dispatch-mode probe that sees every tensor an
operation returns proves that no B x N tensor is ever allocated, forward or backward.

    .venv/bin/python -m pytest -q tests/test_loss.py
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from references import (
    Exactness,
    assert_exact,
    float64,
    masked_contrastive_loss,
    materialized_contrastive_loss,
    parameter_gradients,
    reference_objective,
    relative_error,
)
from test_gradcache import random_texts, tiny_sentence_transformer
from torch.utils._python_dispatch import TorchDispatchMode

import gradcache
import train
from train_parts import models
from train_parts.common import flags_of

BATCH = 37  # a prime: no tile size divides it
WIDTH = 16


def make_reps(num_negatives, batch=BATCH, width=WIDTH, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, width, generator=generator).requires_grad_() for _ in range(2 + num_negatives)]


def value_and_gradients(loss_fn, reps, **options):
    loss = loss_fn(*reps, **options)
    return loss.detach(), torch.autograd.grad(loss, reps)


def relative_gradient_difference(grads, reference):
    """max|g - g_ref| / max|g_ref| over the gradients of all representations together."""
    largest = max(float(r.abs().max()) for r in reference)
    return max(float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True)) / largest


def summed_shares(loss_fn, reps, bounds):
    """(loss, gradients) summed over the shares of a partition of the rows: what the processes compute
    under cross-process negatives, each its own rows against every candidate."""
    shares = [value_and_gradients(loss_fn, reps, local_rows=slice(a, b)) for a, b in bounds]
    return sum(loss for loss, _ in shares), [sum(g) for g in zip(*[g for _, g in shares], strict=True)]


def references(reference_fn, reps, **options):
    """The reference's (loss, gradients) in float32 and in float64 (the same representations, cast)."""
    return value_and_gradients(reference_fn, reps, **options), value_and_gradients(
        reference_fn, float64(reps), **options
    )


def assert_matches(actual, reference_fn, reps, **options):
    """references.py's rule, for the loss and for the gradients of every representation together."""
    (ref_loss, ref_grads), (true_loss, true_grads) = references(reference_fn, reps, **options)
    assert_exact(actual[0], ref_loss, true_loss, "loss")
    assert_exact(actual[1], ref_grads, true_grads, "gradients")


def assert_fails(actual, reference_fn, reps, **options):
    """A negative control: the loss or the gradients of a deliberately wrong computation break the rule."""
    (ref_loss, ref_grads), (true_loss, true_grads) = references(reference_fn, reps, **options)
    with pytest.raises(AssertionError):
        assert_exact(actual[0], ref_loss, true_loss, "loss")
        assert_exact(actual[1], ref_grads, true_grads, "gradients")


@pytest.mark.parametrize("tile_size", [5, 64, None], ids=["tile-5", "tile-over-batch", "tile-automatic"])
@pytest.mark.parametrize("similarity, scale", [("cos", 20.0), ("dot", 1.0)], ids=["cos", "dot"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
@pytest.mark.parametrize("num_negatives", [0, 1, 3], ids=lambda n: f"{n}-negatives")
def test_tiled_equals_materialized(num_negatives, symmetric, similarity, scale, tile_size):
    reps = make_reps(num_negatives)
    options = dict(scale=scale, similarity=similarity, symmetric=symmetric)
    tiled = value_and_gradients(gradcache.contrastive_loss, reps, tile_size=tile_size, **options)
    assert_matches(tiled, materialized_contrastive_loss, reps, **options)


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
def test_matryoshka_tiled_equals_materialized(symmetric):
    reps = make_reps(2)
    options = dict(symmetric=symmetric, matryoshka_dims=(16, 12, 5), matryoshka_weights=(1.0, 0.5, 2.0))
    tiled = value_and_gradients(gradcache.contrastive_loss, reps, tile_size=7, **options)
    assert_matches(tiled, materialized_contrastive_loss, reps, **options)


@pytest.mark.parametrize("matryoshka_dims", [None, (16, 8)], ids=["full", "matryoshka"])
def test_local_rows_sum_to_the_whole_loss(matryoshka_dims):
    """What each process computes under cross-process negatives: the shares of a partition of the rows."""
    reps = make_reps(1)
    loss_fn = functools.partial(
        gradcache.contrastive_loss, symmetric=True, tile_size=6, matryoshka_dims=matryoshka_dims
    )
    assert_matches(
        summed_shares(loss_fn, reps, [(0, 13), (13, 30), (30, 37)]),
        materialized_contrastive_loss,
        reps,
        symmetric=True,
        matryoshka_dims=matryoshka_dims,
    )


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation returns while the mode is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def largest_tensors(loss_fn, reps):
    """(largest forward tensor, largest backward tensor) of one loss and its gradient."""
    with LargestTensor() as forward:
        loss = loss_fn(*reps)
    with LargestTensor() as backward:
        torch.autograd.grad(loss, reps)
    return forward.numel, backward.numel


def test_no_batch_by_candidates_tensor_is_ever_allocated():
    batch, width, tile = 96, 8, 16
    reps = make_reps(1, batch=batch, width=width)
    candidates = 2 * batch
    tiled = functools.partial(gradcache.contrastive_loss, symmetric=True, tile_size=tile)
    # The bound: the candidate matrix (N x d, with its gradient) or one tile, never B x N.
    bound = max(candidates * width, tile * tile)
    assert max(largest_tensors(tiled, reps)) <= bound < batch * candidates
    # The probe sees both passes: the materialized loss allocates the B x N scores and their gradient.
    materialized = functools.partial(materialized_contrastive_loss, symmetric=True)
    assert min(largest_tensors(materialized, reps)) >= batch * candidates


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
def test_equals_sentence_transformers_multiple_negatives_ranking_loss(symmetric):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    # The loss only scores embeddings here (compute_loss_from_embeddings): it never calls its model.
    st_loss = MultipleNegativesRankingLoss(
        None, scale=20.0, directions=directions, partition_mode="per_direction"
    )
    reps = make_reps(2)
    ours = value_and_gradients(gradcache.contrastive_loss, reps, symmetric=symmetric, tile_size=8)
    assert_matches(ours, lambda *r: st_loss.compute_loss_from_embeddings(list(r), None), reps)


def test_matryoshka_gradcache_step_equals_sentence_transformers(tmp_path, monkeypatch):
    """Parameter gradients of gradcache_step in chunks against MatryoshkaLoss(MNRL) on the full batch."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, words = tiny_sentence_transformer(tmp_path)
    model.eval()  # no dropout: the full-batch reference draws no masks
    references32_64 = copy.deepcopy(model), float64(model)
    columns = [model.preprocess(random_texts(words, 10, seed)) for seed in range(3)]
    dims, weights = (32, 16, 8), (1.0, 0.5, 0.25)
    loss_fn = functools.partial(
        gradcache.contrastive_loss, matryoshka_dims=dims, matryoshka_weights=weights, tile_size=3
    )
    report = gradcache.gradcache_step(model, columns, loss_fn, 4)

    losses, gradients = [], []
    for reference in references32_64:
        st_loss = MatryoshkaLoss(
            reference, MultipleNegativesRankingLoss(reference), list(dims), list(weights)
        )
        st_value = st_loss(columns, None)
        st_value.backward()
        losses.append(st_value.detach())
        gradients.append(parameter_gradients(reference))
    assert_exact(report.loss, *losses, "loss")
    assert_exact(parameter_gradients(model), *gradients, "parameter gradients")


# ---- negative controls: a loss off by a little fails the same rule ----


@pytest.mark.parametrize("kind", ["dense", "masks", "distillation", "group-only"])
def test_a_slightly_wrong_loss_fails_the_rule(kind):
    """One deliberate error per kind of loss, each small: a scale 1 + 1e-4 too large, one planted repeat no
    longer masked, a temperature 1% off, a group-only loss with a scale 1 + 1e-4 too large. The
    right loss passes the comparison that the wrong one fails."""
    reps = reps_with_near_duplicates(2)
    ids = duplicated_ids(2)
    teacher = torch.randn(BATCH, 3, generator=torch.Generator().manual_seed(5)) * 3
    if kind == "dense":

        def loss(*columns, scale=20.0):
            return gradcache.contrastive_loss(*columns, scale=scale, symmetric=True, tile_size=6)

        right, wrong = loss, functools.partial(loss, scale=20.0 * (1 + 1e-4))
        reference = functools.partial(materialized_contrastive_loss, symmetric=True)
    elif kind == "masks":
        fewer = [column.clone() for column in ids]
        fewer[1][0] = 10**6  # row 0's positive repeated a hard negative of another row; now a text of its own

        def right(*columns, ids=ids):
            spec = gradcache.FalseNegatives(ids=ids)
            return gradcache.contrastive_loss(*columns, tile_size=5, false_negatives=spec)

        wrong = functools.partial(right, ids=fewer)

        def reference(*columns):
            return masked_contrastive_loss(*columns, ids=ids)[0]
    elif kind == "distillation":

        def right(*columns, temperature=2.0):
            return gradcache.contrastive_loss(
                *columns, teacher_scores=teacher, distill_weight=0.7, distill_temperature=temperature
            )

        wrong = functools.partial(right, temperature=2.0 * 1.01)

        def reference(*columns):
            kl = kl_reference(*columns, teacher=teacher, scale=20.0, temperature=2.0, weight=0.7)
            return materialized_contrastive_loss(*columns) + kl
    else:

        def right(*columns, scale=20.0):
            return gradcache.group_loss(*columns, scale=scale).sum() / BATCH

        wrong = functools.partial(right, scale=20.0 * (1 + 1e-4))
        texts = [[f"{c}-{i}" for i in range(BATCH)] for c in range(len(reps))]

        def reference(*columns):
            return reference_objective(*columns, texts=texts, in_batch=False)

    assert_matches(value_and_gradients(right, reps), reference, reps)
    assert_fails(value_and_gradients(wrong, reps), reference, reps)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(similarity="euclid"), "similarity must be 'cos' or 'dot'"),
        (dict(matryoshka_dims=(16, 32)), "matryoshka dimension 32 is not a prefix of the 16-dimensional"),
        (
            dict(matryoshka_dims=(16, 8), matryoshka_weights=(1.0,)),
            "1 matryoshka_weights for 2 matryoshka_dims",
        ),
    ],
)
def test_bad_loss_options_say_what_to_do(options, message):
    with pytest.raises(ValueError, match=message):
        gradcache.contrastive_loss(*make_reps(0), **options)


def test_cross_process_negatives_refuse_a_loss_without_local_rows(monkeypatch):
    monkeypatch.setattr(gradcache, "spans_processes", lambda cross_process_negatives: cross_process_negatives)
    columns = [torch.randn(6, 4), torch.randn(6, 4)]
    encoder = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="loss_fn must accept `local_rows`"):
        gradcache.gradcache_step(
            encoder, columns, lambda a, b: (a * b).sum(), 3, cross_process_negatives=True
        )
    assert all(p.grad is None for p in encoder.parameters())
    gradcache.check_loss_takes_local_rows(functools.partial(gradcache.contrastive_loss, scale=5.0), True)


def test_train_matryoshka_and_tile_arguments(tmp_path, capsys):
    from test_train import fails_with

    args = train.parse_args(["--matryoshka_dims", "384,256,64", "--matryoshka_weights", "1,1,0.5"])
    assert (args.matryoshka_dims, args.matryoshka_weights) == ((384, 256, 64), (1.0, 1.0, 0.5))
    assert train.parse_args([]).matryoshka_dims is None
    fails_with(
        capsys, lambda: train.parse_args(["--matryoshka_dims", "384,0"]), "distinct positive dimensions"
    )
    fails_with(capsys, lambda: train.parse_args(["--matryoshka_dims", "384,x"]), "comma-separated numbers")
    fails_with(
        capsys,
        lambda: train.parse_args(["--matryoshka_dims", "384,256", "--matryoshka_weights", "1"]),
        "has 1 weights for 2 dimensions",
    )
    fails_with(capsys, lambda: train.parse_args(["--matryoshka_weights", "1"]), "needs --matryoshka_dims")
    fails_with(
        capsys, lambda: train.parse_args(["--loss_tile_size", "0"]), "--loss_tile_size must be at least 1"
    )
    model, _ = tiny_sentence_transformer(tmp_path)  # 32 dimensions
    fails_with(
        capsys,
        lambda: models.prepare_model(
            model, flags_of(models.ModelFlags, train.parse_args(["--matryoshka_dims", "64,32"]))
        ),
        "[64] larger than the model's 32 dimensions",
    )
    models.prepare_model(model, flags_of(models.ModelFlags, train.parse_args(["--matryoshka_dims", "32,8"])))


# ---- false negatives masked inside the tiled loss ----


def reps_with_near_duplicates(num_negatives, batch=BATCH, seed=0):
    """Positives near their anchors (cosine about 0.7), and the first hard negatives of the batch close to
    the next row's positive: near-duplicates that a margin should find."""
    generator = torch.Generator().manual_seed(seed)
    anchor = torch.randn(batch, WIDTH, generator=generator)
    positive = anchor + torch.randn(batch, WIDTH, generator=generator)
    negatives = [torch.randn(batch, WIDTH, generator=generator) for _ in range(num_negatives)]
    negatives[0][:12] = positive[1:13] + 0.1 * torch.randn(12, WIDTH, generator=generator)
    return [column.requires_grad_() for column in (anchor, positive, *negatives)]


def duplicated_ids(num_negatives, batch=BATCH, seed=0):
    """Text ids with repeats planted: some positives repeat other rows' positives or negatives, some anchors
    repeat other anchors."""
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.arange(batch) + 1000 * column for column in range(2 + num_negatives)]
    for column in range(2 + num_negatives):
        repeats = torch.randint(0, batch, (6,), generator=generator)
        ids[column][repeats[:3]] = ids[column][repeats[3:]]  # a few repeats within the column
    ids[1][:4] = ids[-1][10:14]  # positives that come again as hard negatives of other rows
    return ids


@pytest.mark.parametrize("tile_size", [5, None], ids=["tile-5", "tile-automatic"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
@pytest.mark.parametrize(
    "by", ["ids", "margin", "relative-margin", "ids-and-margin"], ids=lambda by: f"by-{by}"
)
def test_false_negatives_masked_tile_by_tile_equal_the_masked_matrix(by, symmetric, tile_size):
    reps = reps_with_near_duplicates(2)
    ids = duplicated_ids(2) if "ids" in by else None
    # Qwen3-Embedding masks above the positive + 0.1, GIST above the positive - margin, NV-Retriever above
    # 95% of it: with random negatives only the planted near-duplicates come close to either.
    margin = {"ids": None, "margin": -0.1, "relative-margin": 0.95, "ids-and-margin": -0.1}[by]
    relative = by == "relative-margin"
    stats = {}
    spec = gradcache.FalseNegatives(ids=ids, margin=margin, relative=relative)
    tiled = value_and_gradients(
        gradcache.contrastive_loss, reps, symmetric=symmetric, tile_size=tile_size, false_negatives=spec,
        stats=stats,
    )  # fmt: skip
    reference_stats = {}

    def reference(*columns):
        loss, reference_stats["masked_fraction"] = masked_contrastive_loss(
            *columns, symmetric=symmetric, ids=ids, margin=margin, relative=relative
        )
        return loss

    assert_matches(tiled, reference, reps)
    assert stats["masked_fraction"] == pytest.approx(reference_stats["masked_fraction"], abs=1e-12)
    assert 0 < stats["masked_fraction"] < 0.05  # the planted repeats and near-duplicates, not the rest
    unmasked = value_and_gradients(gradcache.contrastive_loss, reps, symmetric=symmetric)
    assert abs(float(tiled[0] - unmasked[0])) > 1e-3  # and masking changes the loss


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
def test_an_anchors_other_positives_are_masked_too(symmetric):
    """Texts that are right answers of a row's anchor without being its positive in this batch (another of
    its positives in the data) leave the row's softmax; -1 fills the rows with fewer."""
    reps, ids = [rep.detach() for rep in make_reps(2)], duplicated_ids(2)
    others = torch.full((BATCH, 3), -1)
    others[0, :2] = torch.stack([ids[2][5], ids[3][9]])  # hard negatives of other rows
    others[7, 0], others[8, 2] = ids[1][20], ids[1][7]  # positives of other rows, one of them 7's own
    # Right answers look like it: each close to the anchor that it answers, so its softmax weight counts.
    reps[2][5], reps[3][9], reps[1][20], reps[1][7] = reps[0][0], reps[0][0], reps[0][7], reps[0][8]
    reps = [rep.requires_grad_() for rep in reps]
    spec = gradcache.FalseNegatives(ids=ids, other_positives=others)
    stats = {}
    loss_fn = functools.partial(gradcache.contrastive_loss, symmetric=symmetric, tile_size=5)
    tiled = value_and_gradients(loss_fn, reps, false_negatives=spec, stats=stats)
    fractions = {}

    def reference(*columns):
        loss, fractions["reference"] = masked_contrastive_loss(
            *columns, symmetric=symmetric, ids=ids, other_positives=others.tolist()
        )
        return loss

    assert_matches(tiled, reference, reps)
    assert stats["masked_fraction"] == pytest.approx(fractions["reference"], abs=1e-12)
    without_others = value_and_gradients(loss_fn, reps, false_negatives=gradcache.FalseNegatives(ids=ids))
    assert relative_gradient_difference(tiled[1], without_others[1]) > 1e-3  # they leave the softmax


def test_masked_local_rows_sum_to_the_whole_masked_loss():
    """Across processes each computes its own rows against every candidate: ids and thresholds are global."""
    reps = reps_with_near_duplicates(1)
    spec = gradcache.FalseNegatives(ids=duplicated_ids(1), margin=-0.1)
    loss_fn = functools.partial(gradcache.contrastive_loss, symmetric=True, tile_size=6, false_negatives=spec)
    ids, margin = spec.ids, spec.margin
    assert_matches(
        summed_shares(loss_fn, reps, [(0, 13), (13, 30), (30, 37)]),
        lambda *columns: masked_contrastive_loss(*columns, symmetric=True, ids=ids, margin=margin)[0],
        reps,
    )


# ---- distillation from teacher scores ----


def kl_reference(anchor, positive, *negatives, teacher, scale, temperature, weight):
    """The distillation term row by row, from its definition: KL(p_teacher || p_student) over each anchor's
    own positive and hard negatives, the student's scores the scaled cosines, both softmaxes at T."""
    anchor, *candidates = [F.normalize(column, dim=-1) for column in (anchor, positive, *negatives)]
    total = 0
    for i in range(len(anchor)):
        student = torch.stack([scale * (anchor[i] @ column[i]) for column in candidates]) / temperature
        p_teacher = torch.softmax(torch.as_tensor(teacher[i], dtype=student.dtype) / temperature, 0)
        total = total + (p_teacher * (p_teacher.log() - torch.log_softmax(student, 0))).sum()
    return weight * total / len(anchor)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distillation_adds_the_kl_to_the_teacher_over_each_group(temperature):
    reps = make_reps(3)
    teacher = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(5)) * 3
    options = dict(teacher_scores=teacher, distill_weight=0.7, distill_temperature=temperature, tile_size=6)
    distilled = value_and_gradients(gradcache.contrastive_loss, reps, **options)

    def reference(*columns):
        kl = kl_reference(*columns, teacher=teacher, scale=20.0, temperature=temperature, weight=0.7)
        return materialized_contrastive_loss(*columns) + kl

    assert_matches(distilled, reference, reps)
    loss_fn = functools.partial(gradcache.contrastive_loss, **options)
    assert_matches(
        summed_shares(loss_fn, reps, [(0, 20), (20, 37)]), reference, reps
    )  # each process: its rows


def test_stats_report_in_batch_accuracy_and_the_loss_of_each_matryoshka_size():
    """What train.py logs as train/in_batch_accuracy and train/loss_dim_<m>, against whole score matrices."""
    anchor, positive, negative = make_reps(1)
    anchor = (anchor + 2 * positive).detach()  # most anchors, not all, rank their own positive first
    stats, dims = {}, (16, 4)
    loss = gradcache.contrastive_loss(
        anchor, positive, negative, tile_size=5, matryoshka_dims=dims, stats=stats, local_rows=slice(3, 20)
    )

    def accuracy(dim):
        a, c = (F.normalize(x[:, :dim], dim=-1) for x in (anchor, torch.cat([positive, negative])))
        return (a @ c.T).argmax(dim=1)[3:20].eq(torch.arange(3, 20)).float().mean().item()

    assert 0.3 < stats["in_batch_accuracy"] < 1
    assert stats["in_batch_accuracy"] == pytest.approx((accuracy(16) + accuracy(4)) / 2)

    def size_loss(dim, dtype, rows=slice(3, 20)):  # plain torch: the mean over `rows` of that size's loss
        a, c = (F.normalize(x[:, :dim].to(dtype), dim=-1) for x in (anchor, torch.cat([positive, negative])))
        return F.cross_entropy(20.0 * a @ c.T, torch.arange(BATCH), reduction="none")[rows].mean().item()

    for (
        dim
    ) in dims:  # the mean over the rows computed, of the loss of that size alone, by references.py's rule
        float32, truth = (size_loss(dim, dtype) for dtype in (torch.float32, torch.float64))
        measured = assert_exact(stats[f"loss_dim_{dim}"], float32, truth, f"loss_dim_{dim}")
        every_row = Exactness(
            relative_error(stats[f"loss_dim_{dim}"], size_loss(dim, torch.float64, slice(None))),
            measured.e_ref,
        )
        assert not every_row.holds, f"loss_dim_{dim} is the mean over every row: {every_row}"
    assert float(loss) == pytest.approx(sum(stats[f"loss_dim_{dim}"] for dim in dims) * 17 / BATCH)


# ---- without in-batch negatives: each anchor against its own group ----


def texts_of(ids):
    """Texts standing for ids, and {anchor text: its right answers}: the positives of every row with that
    anchor (what train.py's positives_by_anchor collects from the data), as the reference reads masks."""
    texts = [[f"t{int(i)}" for i in column] for column in ids]
    positives_of = {}
    for anchor, positive in zip(texts[0], texts[1], strict=True):
        positives_of.setdefault(anchor, set()).add(positive)
    return texts, positives_of


@pytest.mark.parametrize("matryoshka_dims", [None, (16, 8)], ids=["full", "matryoshka"])
@pytest.mark.parametrize("extra", ["none", "masked", "distilled"])
def test_group_loss_equals_the_reference_and_splits_by_rows(extra, matryoshka_dims):
    """group_loss row by row against the materialized group loss; the terms of a partition of the rows sum to
    the whole (what group_step back-propagates chunk by chunk)."""
    reps, ids = make_reps(2), duplicated_ids(2)  # random: a loss of order 1, not one cancelled to 1e-3
    ids[2][:3] = ids[1][:3]  # hard negatives that repeat their own row's positive
    texts, positives_of = texts_of(ids)
    # Every row's right answers, as ids: the positives of the rows that share its anchor (-1 fills).
    answers = [[int(j) for j in ids[1][ids[0] == a]] for a in ids[0]]
    others = torch.tensor([row + [-1] * (max(map(len, answers)) - len(row)) for row in answers])
    teacher = torch.randn(BATCH, 3, generator=torch.Generator().manual_seed(2)) * 3
    options = dict(matryoshka_dims=matryoshka_dims)
    if extra == "masked":
        options["false_negatives"] = gradcache.FalseNegatives(ids=ids, margin=-0.1, other_positives=others)
    if extra == "distilled":
        options |= dict(teacher_scores=teacher, distill_weight=0.7, distill_temperature=2.0)
    stats = {}

    def ours(*columns):
        return gradcache.group_loss(*columns, stats=stats, **options).sum() / BATCH

    def reference(*columns):
        return reference_objective(
            *columns, texts=texts, in_batch=False, matryoshka_dims=matryoshka_dims,
            positives_of=positives_of if extra == "masked" else None,
            margin=-0.1 if extra == "masked" else None,
            teacher=teacher if extra == "distilled" else None, distill_weight=0.7, temperature=2.0,
        )  # fmt: skip

    assert_matches(value_and_gradients(ours, reps), reference, reps)
    if extra == "masked":
        assert 0 < stats["masked_fraction"] < 1
    chunks = [torch.arange(0, 13), torch.arange(13, 30), torch.arange(30, 37)]

    def by_chunks(*columns):
        return (
            sum(
                gradcache.group_loss(*[c[rows] for c in columns], rows=rows, **options).sum()
                for rows in chunks
            )
            / BATCH
        )

    assert_matches(value_and_gradients(by_chunks, reps), reference, reps)


# ---- a guide model's scores choose the mask (GIST) ----


@pytest.mark.parametrize("negatives", ["in-batch-one-way", "in-batch-symmetric", "group"])
def test_guide_scores_mask_what_the_guide_ranks_above_the_positive(negatives):
    """Candidates a frozen guide scores above its score of the row's positive (+ margin) leave the softmax,
    in both directions; the guide's representations have their own width, and get no gradient."""
    reps = make_reps(2)
    generator = torch.Generator().manual_seed(9)
    guide = [torch.randn(BATCH, 8, generator=generator) for _ in reps]
    guide[1] = guide[0] + 0.8 * guide[1]  # the guide's positives close to its anchors: few masked
    spec = gradcache.FalseNegatives(guide=guide, guide_margin=0.05)
    texts = [
        [f"{c}-{i}" for i in range(BATCH)] for c in range(len(reps))
    ]  # all distinct: only the guide masks
    symmetric = negatives == "in-batch-symmetric"
    stats = {}
    if negatives == "group":

        def ours(*columns):
            return gradcache.group_loss(*columns, false_negatives=spec, stats=stats).sum() / BATCH
    else:
        ours = functools.partial(
            gradcache.contrastive_loss, symmetric=symmetric, tile_size=6, false_negatives=spec, stats=stats
        )

    def reference(*columns):
        return reference_objective(
            *columns, texts=texts, in_batch=negatives != "group", symmetric=symmetric, guide=guide,
            guide_margin=0.05,
        )  # fmt: skip

    assert_matches(value_and_gradients(ours, reps), reference, reps)
    assert 0 < stats["masked_fraction"] < 0.5
