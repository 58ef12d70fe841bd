"""Multi-vector models (ColBERT, sentence-transformers' MultiVectorEncoder): a MultiVectorEncoder folder
trains as one, through train.py's own functions, exactly as sentence-transformers'
MultiVectorMultipleNegativesRankingLoss trains it on the whole batch (float64 truth, references.py's rule),
its token matrices cached chunk by chunk (gradcache.TokenMatrices) and scored by MaxSim tile by tile
(multi_vector.TiledMaxSim); distilled from a teacher's scores (--distill_weight: that loss plus a plain-torch
KL over each anchor's own group), also with a Router's query and document towers; saved as a
MultiVectorEncoder that still encodes a matrix per text; the flags that do not fit it refused in one line.
Across processes: tests/test_matrix.py's "colbert" rows.
"""

import functools
import json
import random

import pytest
import torch
from references import (
    StageOneRecorder,
    maxsim_distilled_loss,
    maxsim_group_kl,
    maxsim_kept_in_float64,
    retrieval_evaluator,
)
from test_any_model import COLUMNS, column_texts, trained_as
from test_gradcache import assert_gradients_exact, assert_gradients_inexact
from test_model_flags import one_line_error
from test_train import CONFIGS, WORDS, build_tiny_model, launch, logged_scalars, run_main, write_rows

import train
from gradcache import TokenMatrices
from train_parts import models, multi_vector


def sentence_transformers_reference(columns):
    """`reference(copies, cast)` for test_gradcache's rule: sentence-transformers' own loss (scale 1, its
    default) on the whole batch, in one graph, each column tokenized with its task as train.py did."""
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    def replayed(copies, cast):
        (copied,) = copies
        features = [
            dict(column) | {"task": models.role_task(name)}
            for column, name in zip(columns, COLUMNS, strict=True)
        ]
        with maxsim_kept_in_float64():
            loss = MultiVectorMultipleNegativesRankingLoss(copied)(features)
        loss.backward()
        return loss.detach()

    return replayed


def masks_ignored(queries, documents, maxsim=multi_vector.maxsim):
    """A planted bug: MaxSim over every position, padding and skip-list words included."""
    unmasked = [torch.cat([x[..., :-1], torch.ones_like(x[..., -1:])], dim=-1) for x in (queries, documents)]
    return maxsim(*unmasked)


def max_over_query_tokens(queries, documents):
    """A planted bug: the max taken over the query's tokens, the sum over the document's."""
    similarities = torch.einsum("qtd,ksd->qkts", queries[..., :-1], documents[..., :-1])
    return similarities.amax(dim=-2).sum(dim=-1)


def documents_from_another_chunk(loss_fn):
    """A planted bug: the cache hands the loss each document column with its first two chunks' rows swapped,
    so that a document's tokens are another chunk's."""

    @functools.wraps(loss_fn)
    def swapped(anchor, *documents, **keywords):
        swapped = [TokenMatrices([c.indices[1], c.indices[0], *c.indices[2:]], c.blocks) for c in documents]
        return loss_fn(anchor, *swapped, **keywords)

    return swapped


def test_a_multi_vector_step_is_exact_against_sentence_transformers_loss(tmp_path, monkeypatch):
    """train.py's loss (loss_function: multi_vector.maxsim_loss, scale 1) through a Gradient Cache step of
    chunks of 3 with a hard negative column, tiles smaller than a chunk, against
    MultiVectorMultipleNegativesRankingLoss on the batch in one graph; the three negative controls (masks
    ignored, the max over the wrong axis, a document's tokens from another chunk) fail the rule."""
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="colbert")
    model, args = trained_as(folder, [])
    assert multi_vector.is_multi_vector(model)
    prompts = models.role_prompts(model)
    columns = [models.tokenize(model, column_texts(i, 12), c, prompts) for i, c in enumerate(COLUMNS)]
    skipped = (
        columns[1]["attention_mask"].sum() - model(dict(columns[1]), task="document")["attention_mask"].sum()
    )
    assert skipped > 0  # the skip-list words leave the documents' masks: the masks are the model's
    loss_fn = train.loss_function(args, model)
    assert loss_fn.func is multi_vector.maxsim_loss and loss_fn.keywords["scale"] == 1.0
    towers = models.training_module(model, train.source_settings(args))
    monkeypatch.setattr(multi_vector, "TILE_ELEMENTS", 2 * 8 * 8)  # tiles of a few rows: many per chunk pair

    def step(loss=loss_fn):
        model.zero_grad()
        stats = {}
        report = StageOneRecorder().step(
            None, columns, functools.partial(loss, stats=stats), 3, encode_group=towers
        )
        return report, stats

    report, stats = step()
    reference = sentence_transformers_reference(columns)
    assert_gradients_exact([model], reference, report.loss, "multi-vector step")
    assert 0 <= stats["in_batch_accuracy"] <= 1
    # Negative controls
    step(documents_from_another_chunk(loss_fn))
    assert_gradients_inexact([model], reference, "a document's tokens from another chunk")
    for planted in (masks_ignored, max_over_query_tokens):
        with monkeypatch.context() as patch:
            patch.setattr(multi_vector, "maxsim", planted)
            step()
        assert_gradients_inexact([model], reference, planted.__name__)


# ---------------------------------------------------------------------------------------------------------
# A ColBERT folder trains, end to end, into a MultiVectorEncoder that encodes a matrix per text
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["colbert", "colbert-router"], ids=["one-model", "towers"])
def test_a_colbert_folder_trains_into_a_multi_vector_encoder_that_reloads(
    tmp_path, data, monkeypatch, capsys, kind
):
    """A ColBERT folder (also one of a Router's query and document towers) trained by train.main with
    dropout: saved as a MultiVectorEncoder of the same modules and masks, trained, evaluated by MaxSim."""
    from sentence_transformers import MultiVectorEncoder

    folder = build_tiny_model(tmp_path, dropout=0.1, kind=kind)
    run = ("--output_dir", tmp_path / "run", "--model", folder, "--data", data[0], "--dev_data", data[1])
    run += ("--batch_size", 8, "--chunk_size", 3, "--max_steps", 3, "--eval_steps", 3, "--lr", 5e-3)
    run_main(monkeypatch, *run)
    out = capsys.readouterr().out
    assert "load it with MultiVectorEncoder(path)" in out
    final = tmp_path / "run" / "final"
    saved = json.loads((final / "config_sentence_transformers.json").read_text())
    assert saved["model_type"] == "MultiVectorEncoder"
    reloaded, initial = (MultiVectorEncoder(str(path), device="cpu") for path in (final, folder))
    assert [type(module).__name__ for module in reloaded] == [type(module).__name__ for module in initial]
    assert reloaded[2].skiplist_words == initial[2].skiplist_words  # its masks, as the input's
    texts = column_texts(5, 6) + ["w1 w2 w30"]  # w1, w2: skip-list words, out of a document's matrix
    encoded, before = reloaded.encode_document(texts), initial.encode_document(texts)
    assert [matrix.shape for matrix in encoded] == [matrix.shape for matrix in before]
    assert encoded[-1].shape == (3, 16)  # [CLS] w30 [SEP]
    assert max(float((a - b).abs().max()) for a, b in zip(encoded, before, strict=True)) > 1e-3  # trained
    logged = {tag: [value for _, value in points] for tag, points in logged_scalars(tmp_path / "run").items()}
    assert len(logged["eval/dev_maxsim_ndcg@10"]) == 2 and len(logged["train/in_batch_accuracy"]) == 3
    assert "train/masked_fraction" in logged  # --mask_repeated_texts on, by text ids, as for any model


@pytest.mark.parametrize(
    "flags",
    [
        ["--matryoshka_dims", "16,8"],
        ["--similarity", "cos"],
        ["--symmetric"],
        ["--in_batch_negatives", "off"],
        ["--false_negative_margin", "0.1"],
    ],
    ids=lambda flags: flags[0].lstrip("-"),
)
def test_flags_that_do_not_fit_a_multi_vector_model_are_refused_in_one_line(tmp_path, capsys, flags):
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="colbert")
    flag = " ".join(flags) if flags[0] == "--in_batch_negatives" else flags[0]
    one_line_error(
        capsys,
        lambda: trained_as(folder, flags),
        rf"^train.py: error: {flag}: --model .* is a multi-vector model \(ColBERT\): .* Drop {flag}\.$",
    )


def test_repeated_texts_leave_the_maxsim_softmax_as_in_the_materialized_scores():
    """--mask_repeated_texts on token matrices: a hard negative repeating another row's positive, and an
    anchor repeating another row's anchor, leave the rows' softmax; against sentence-transformers'
    colbert_scores materialized (B x N), the masked entries set to -inf by hand, float64."""
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

    from gradcache import FalseNegatives

    torch.manual_seed(0)
    rows, tokens, width = 6, 5, 8
    columns = []
    for _ in COLUMNS:
        vectors = torch.nn.functional.normalize(torch.randn(rows, tokens, width, dtype=torch.float64), dim=-1)
        mask = torch.rand(rows, tokens) < 0.7
        mask[:, 0] = True
        columns.append(torch.cat([vectors, mask[..., None].double()], dim=-1).requires_grad_())
    ids = [torch.arange(rows) + 100 * c for c in range(len(COLUMNS))]
    ids[2][0] = ids[1][3]  # row 0's hard negative is row 3's positive
    ids[0][4] = ids[0][1]  # rows 1 and 4 share their anchor: each one's positive is right for the other
    stats = {}
    loss = multi_vector.maxsim_loss(*columns, scale=2.0, false_negatives=FalseNegatives(ids=ids), stats=stats)
    loss.backward()
    run = [loss.detach(), *[column.grad[..., :-1].clone() for column in columns]]

    reference_columns = [column.detach().clone().requires_grad_() for column in columns]
    anchor, *documents = reference_columns
    stacked = torch.stack([d[..., :-1] for d in documents], dim=1)  # B x (1 + k) x tokens x d, query-major
    with maxsim_kept_in_float64():
        document_masks = torch.stack([d[..., -1] > 0 for d in documents], 1)
        scores = 2.0 * colbert_scores(anchor[..., :-1], stacked, anchor[..., -1] > 0, document_masks)
    masked = torch.zeros_like(scores, dtype=torch.bool)
    masked[3, 0 * 2 + 1] = True  # row 3 against row 0's hard negative (query-major: row 0, place 1)
    masked[1, 4 * 2], masked[4, 1 * 2] = True, True  # the other's positive
    loss = torch.nn.functional.cross_entropy(scores.masked_fill(masked, -torch.inf), torch.arange(rows) * 2)
    loss.backward()
    truth = [loss.detach(), *[column.grad[..., :-1] for column in reference_columns]]
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(run, truth, strict=True))
    assert stats["masked_fraction"] == pytest.approx(3 / (rows * (2 * rows - 1)))
    unmasked = multi_vector.maxsim_loss(*[c.detach() for c in columns], scale=2.0)
    assert not torch.allclose(unmasked, truth[0])  # the negative control: without the masks


# ---------------------------------------------------------------------------------------------------------
# Distillation from a teacher's scores: the KL over each anchor's own group, on MaxSim
# ---------------------------------------------------------------------------------------------------------


def scored_records(path, count=12):
    """FlagEmbedding-style records (query, pos, neg, pos_scores, neg_scores) of the tiny vocabulary's words
    (w0 to w4: the ColBERT's skip list), two hard negatives each, the teacher's scores multiples of 1/8 (which
    float32, as train.py reads them, holds exactly)."""
    rng = random.Random(5)

    def text(tag):
        return " ".join(rng.sample(WORDS, rng.randint(1, 9))) + f" {tag}"

    records = [
        {"query": text(f"a{i}"), "pos": [text(f"p{i}")], "neg": [text(f"n{i}"), text(f"n{i + count}")],
         "pos_scores": [rng.randint(-24, 24) / 8], "neg_scores": [rng.randint(-24, 24) / 8 for _ in "nn"]}
        for i in range(count)
    ]  # fmt: skip
    return write_rows(path, records)


def teacher_in_records(path, anchors):
    """Each anchor's teacher scores as its record holds them: its positive's, then its negatives'."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    scores = {record["query"]: record["pos_scores"] + record["neg_scores"] for record in records}
    return torch.tensor([scores[anchor] for anchor in anchors], dtype=torch.float64)


def distilled_step(folder, records, accelerator):
    """train.py's own step (train.gradient_cache_step) on the first batch that train.py reads from `records`
    (load_data, make_loader) with --distill_weight 0.5 --distill_temperature 2, in chunks of 24 tokens
    (each column planned apart: an anchor's block is not its documents'): (model, batch, step), step() running
    it on gradients zeroed and returning gradcache's report."""
    flags = ["--model", str(folder), "--data", str(records), "--batch_size", "12", "--chunk_tokens", "24"]
    args = train.parse_args([*flags, "--distill_weight", "0.5", "--distill_temperature", "2"])
    (source,) = train.source_settings(args)
    model = train.load_model(args, [source])
    (data,), _, _ = train.load_data(args, [source], accelerator)
    batch = next(iter(train.make_loader([data], args, 1)))
    engine, loss_fn = models.training_module(model, [source]), train.loss_function(source, model)
    prompts = models.role_prompts(model, source.query_prompt, source.document_prompt)

    def step():
        model.zero_grad()
        chunking = {"chunk_tokens": args.chunk_tokens}
        return train.gradient_cache_step(
            accelerator, engine, model, prompts, loss_fn, source, batch, chunking
        )

    return model, batch, step


def distilled_reference(batch, teacher, distill_weight=0.5):
    """`reference(copies, cast)` for test_gradcache's rule: references.maxsim_distilled_loss (sentence-
    transformers' loss, and a plain-torch KL on its colbert_scores) on the whole batch in one graph, at
    temperature 2, the texts tokenized by sentence-transformers with their tasks."""
    columns = ("anchor", "positive", "negative_1", "negative_2")

    def replayed(copies, cast):
        (copied,) = copies
        tasks = ["query", "document", "document", "document"]
        features = [copied.preprocess(batch[c], task=t) for c, t in zip(columns, tasks, strict=True)]
        loss = maxsim_distilled_loss(copied, cast(teacher), distill_weight, temperature=2.0)(features)
        loss.backward()
        return loss.detach()

    return replayed


@pytest.mark.parametrize("kind", ["colbert", "colbert-router"], ids=["one-model", "towers"])
def test_a_distilled_multi_vector_step_is_exact_against_sentence_transformers_loss_and_a_kl(
    tmp_path, accelerator, monkeypatch, kind
):
    """--distill_weight on a multi-vector model, and on one with towers (a MultiVectorEncoder whose Router
    sends queries and documents to two BERTs): train.py's step (chunks of 24 tokens, tiles and pieces of a
    few rows) against MultiVectorMultipleNegativesRankingLoss plus a plain-torch KL on colbert_scores over
    each anchor's own group (sentence-transformers routes each column by its task itself), with the
    teacher's scores read from the raw records, float64 truth by references.py's rule; both towers get
    gradients. The negative controls fail it: the reference without the KL; the step with the teacher's
    scores of the positive and the first negative swapped; the step with the KL on the previous row's
    group."""
    folder = build_tiny_model(tmp_path, dropout=0.0, kind=kind)
    records = scored_records(tmp_path / "scored.jsonl")
    monkeypatch.setattr(multi_vector, "TILE_ELEMENTS", 4 * 12 * 12)  # tiles and pieces of a few rows
    model, batch, step = distilled_step(folder, records, accelerator)
    reference = distilled_reference(batch, teacher_in_records(records, batch["anchor"]))
    report = step()
    assert_gradients_exact([model], reference, report.loss, f"distilled multi-vector step, {kind}")
    undistilled = distilled_reference(batch, teacher_in_records(records, batch["anchor"]), distill_weight=0)
    assert_gradients_inexact([model], undistilled, "the reference without the KL")
    if kind == "colbert-router":  # both towers trained
        for tower in ("query", "document"):
            grads = [p.grad for name, p in model.named_parameters() if f".{tower}." in name]
            assert any(grad is not None and grad.abs().sum() > 0 for grad in grads), tower
    # Negative controls: wrong paths through the step
    with monkeypatch.context() as patch:
        read = train.teacher_scores
        patch.setattr(train, "teacher_scores", lambda *given: read(*given)[:, [1, 0, 2]])
        step()
    assert_gradients_inexact(
        [model], reference, "the teacher's scores of the positive and a negative swapped"
    )
    with monkeypatch.context() as patch:
        own_groups = multi_vector.group_maxsim
        patch.setattr(multi_vector, "group_maxsim", lambda *given: own_groups(*given).roll(1, dims=0))
        step()
    assert_gradients_inexact([model], reference, "the KL on the previous row's group")


def test_the_maxsim_kl_pairs_each_anchor_with_its_own_group_across_blocks_and_processes():
    """maxsim_loss's KL term on TokenMatrices chunked otherwise in each column (an anchor's row sits in
    another block, at another position, than its documents', every block at its own width), in pieces of a
    few rows: the value and the gradients of every block equal cross-entropy plus references.py's
    maxsim_group_kl on colbert_scores materialized, float64; two processes' shares (local_rows) add up to
    the whole; without the teacher it is another loss (the negative control)."""
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores
    from sentence_transformers.util import stack_padded_token_embeddings

    torch.manual_seed(0)
    rows, width = 7, 8
    columns = []
    for tokens in (5, 6, 4):
        vectors = torch.nn.functional.normalize(torch.randn(rows, tokens, width, dtype=torch.float64), dim=-1)
        mask = torch.rand(rows, tokens) < 0.7
        mask[:, 0] = True
        columns.append(torch.cat([vectors, mask[..., None].double()], dim=-1))
    chunks = [[[0, 1, 2], [3, 4, 5, 6]], [[6, 2], [0, 4, 1], [3, 5]], [[5, 4, 3, 2, 1, 0, 6]]]

    def blocks(column, plan):  # each chunk at its own width: up to its last token that any mask keeps
        index = [torch.tensor(chunk) for chunk in plan]
        widths = [int(column[i][..., -1].any(0).nonzero().max()) + 1 for i in index]
        return TokenMatrices(index, [column[i][:, :w].clone() for i, w in zip(index, widths, strict=True)])

    teacher = torch.randn(rows, 2, dtype=torch.float64) * 3
    options = dict(scale=2.0, teacher_scores=teacher, distill_weight=0.7, distill_temperature=1.5)
    blocked = [blocks(column, plan).requires_grad_() for column, plan in zip(columns, chunks, strict=True)]
    loss = multi_vector.maxsim_loss(*blocked, tile_elements=40, **options)
    loss.backward()

    reference = [column.clone().requires_grad_() for column in columns]
    vectors, masks = [c[..., :-1] for c in reference], [c[..., -1] > 0 for c in reference]
    stacked, stacked_masks = stack_padded_token_embeddings(vectors[1:], masks[1:])
    with maxsim_kept_in_float64():
        scores = 2.0 * colbert_scores(vectors[0], stacked, masks[0], stacked_masks)
    kl = maxsim_group_kl(vectors, masks, teacher, temperature=1.5, scale=2.0)
    truth = torch.nn.functional.cross_entropy(scores, torch.arange(rows) * 2) + 0.7 * kl.mean()
    truth.backward()
    assert torch.allclose(loss, truth, atol=1e-12, rtol=0)
    for column, truth_column in zip(blocked, reference, strict=True):
        for index, block in zip(column.indices, column.blocks, strict=True):
            expected = truth_column.grad[index][:, : block.shape[1], :-1]
            assert torch.allclose(block.grad[..., :-1], expected, atol=1e-12, rtol=0)
    detached = [TokenMatrices(c.indices, [b.detach() for b in c.blocks]) for c in blocked]
    shares = [
        multi_vector.maxsim_loss(*detached, local_rows=r, **options) for r in (slice(0, 3), slice(3, 7))
    ]
    assert torch.allclose(sum(shares), truth.detach(), atol=1e-12, rtol=0)
    assert not torch.allclose(multi_vector.maxsim_loss(*detached, scale=2.0), truth.detach())


def test_two_processes_share_the_multi_vector_evaluation(tmp_path, data):
    """Two DDP processes, cross-process negatives, each encoding half the dev set: the token matrices are
    gathered with their lengths, and the scores before training are those of one process evaluating alone."""
    from sentence_transformers import MultiVectorEncoder

    folder = build_tiny_model(tmp_path, dropout=0.0, kind="colbert")
    launch(
        CONFIGS / "cpu_ddp_2proc.yaml", tmp_path / "run", "--model", folder, "--data", data[0], "--dev_data",
        data[1], "--batch_size", 4, "--chunk_size", 3, "--max_steps", 1, "--eval_steps", 1,
        "--cross_process_negatives", "--wandb_mode", "disabled",
        processes=2, env={"ACCELERATE_USE_CPU": "true"},
    )  # fmt: skip
    logged = logged_scalars(tmp_path / "run")["eval/dev_maxsim_ndcg@10"]  # coarse: the gather itself is below
    evaluator = retrieval_evaluator(data[1], kind="multi-vector")  # from the raw dev file
    alone = evaluator(MultiVectorEncoder(str(folder), device="cpu"))["dev_maxsim_ndcg@10"]
    assert logged[0][1] == pytest.approx(alone, abs=1e-6), (logged, alone)


GATHER_WORKER = """
import sys, torch, torch.distributed as dist
from train_parts.multi_vector import gather_token_matrices
dist.init_process_group("gloo")
rank = dist.get_rank()
documents = [torch.full((3 + 2 * rank + i, 4), 10.0 * rank + i) for i in range(2 + rank)]  # uneven, all
queries = torch.full((2, 5 + rank, 4), float(rank))
gathered = gather_token_matrices(documents), gather_token_matrices(queries)
if rank == 0:
    torch.save(gathered, sys.argv[1])
dist.destroy_process_group()
"""


def test_token_matrices_of_two_processes_are_gathered_in_order_at_their_lengths(tmp_path):
    """What the evaluation's gather gives (gather_token_matrices): every process's document matrices in rank
    order, each at its own length; the queries' padded tensors zero-padded to the widest."""
    from backend_worker import torchrun

    (tmp_path / "worker.py").write_text(GATHER_WORKER)
    torchrun(tmp_path / "worker.py", [str(tmp_path / "out.pt")], 2, {"OMP_NUM_THREADS": "1"}, timeout=120)
    documents, queries = torch.load(tmp_path / "out.pt")
    expected = [torch.full((3 + 2 * r + i, 4), 10.0 * r + i) for r in (0, 1) for i in range(2 + r)]
    assert len(documents) == len(expected)
    assert all(torch.equal(d, e) for d, e in zip(documents, expected, strict=True))
    assert queries.shape == (4, 6, 4) and queries[:2, 5].abs().sum() == 0 and bool((queries[2:] == 1).all())
