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
from test_train import build_tiny_model, run_main

import train
from gradcache import TokenMatrices
from train_parts import models, multi_vector


def sentence_transformers_reference(columns):
    """`reference(copies, cast)` for test_gradcache's rule: sentence-transformers' own loss (scale 1, its
    default) on the whole batch, in one graph, each column tokenized with its task as train.py did."""
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    def replayed(copies, cast):
        (copied,) = copies
        features = [dict(column) | {"task": models.role_task(name)} for column, name in zip(columns, COLUMNS)]
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
