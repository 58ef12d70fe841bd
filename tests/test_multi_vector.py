"""Multi-vector models (ColBERT, sentence-transformers' MultiVectorEncoder): a MultiVectorEncoder folder
trains as one, through train.py's own functions, exactly as sentence-transformers'
MultiVectorMultipleNegativesRankingLoss trains it on the whole batch (float64 truth, references.py's rule),
its token matrices cached chunk by chunk (gradcache.TokenMatrices) and scored by MaxSim tile by tile
(multi_vector.TiledMaxSim); saved as a MultiVectorEncoder that still encodes a matrix per text; the flags that
do not fit it refused in one line. Across processes: tests/test_matrix.py's "colbert" rows.
"""

import functools
import json

import pytest
import torch
from references import StageOneRecorder, maxsim_kept_in_float64
from test_any_model import COLUMNS, column_texts, trained_as
from test_gradcache import assert_gradients_exact, assert_gradients_inexact
from test_model_flags import one_line_error
from test_train import CONFIGS, build_tiny_model, launch, logged_scalars, run_main

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


def test_a_colbert_folder_trains_into_a_multi_vector_encoder_that_reloads(
    tmp_path, data, monkeypatch, capsys
):
    from sentence_transformers import MultiVectorEncoder

    folder = build_tiny_model(tmp_path, dropout=0.1, kind="colbert")
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
        ["--distill_weight", "1"],
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


def test_two_processes_share_the_multi_vector_evaluation(tmp_path, data):
    """Two DDP processes, cross-process negatives, each encoding half the dev set: the token matrices are
    gathered with their lengths, and the scores before training are those of one process evaluating alone."""
    from sentence_transformers import MultiVectorEncoder

    from train_parts import pairs

    folder = build_tiny_model(tmp_path, dropout=0.0, kind="colbert")
    launch(
        CONFIGS / "cpu_ddp_2proc.yaml", tmp_path / "run", "--model", folder, "--data", data[0], "--dev_data",
        data[1], "--batch_size", 4, "--chunk_size", 3, "--max_steps", 1, "--eval_steps", 1,
        "--cross_process_negatives", "--wandb_mode", "disabled",
        processes=2, env={"ACCELERATE_USE_CPU": "true"},
    )  # fmt: skip
    logged = logged_scalars(tmp_path / "run")["eval/dev_maxsim_ndcg@10"]  # coarse: the gather itself is below
    evaluator = pairs.build_evaluator(
        pairs.load_pairs(str(data[1]))[0], 500, {}, say=len, kind="multi-vector"
    )
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
