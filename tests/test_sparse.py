"""Sparse encoders (SPLADE, inference-free SPLADE): a SparseEncoder folder trains as one, through train.py's
own functions, exactly as sentence-transformers' SpladeLoss trains it on the whole batch (float64 truth,
references.py's rule), its regularizers' weights warmed up as sentence-transformers' scheduler callback
warms them, evaluated by its sparse evaluator, saved as a SparseEncoder that still encodes sparse; the
flags that do not fit it refused in one line. Across processes: tests/test_matrix.py's sparse rows.
"""

import dataclasses
import functools
import json
import types

import pytest
import torch
from references import StageOneRecorder
from sentence_transformers import SparseEncoder
from test_any_model import COLUMNS, TASKS, column_texts, reference_model, trained_as
from test_gradcache import assert_gradients_exact, assert_gradients_inexact
from test_model_flags import one_line_error
from test_train import (
    build_tiny_model,
    launch_deepspeed,
    logged_scalars,
    run_main,
    zero3_partitioning_everything,
)

import train

# Weights large enough that the regularizers move the gradients of these tiny models (their FLOPS are in the
from train_parts import models, sparse
from train_parts.common import flags_of

# hundreds), and unequal, so that a query/document swap shows.
QUERY_WEIGHT, DOCUMENT_WEIGHT = 2e-3, 5e-3


def splade_weights(model, total_steps, ratio, step):
    """sentence-transformers' SpladeRegularizerWeightSchedulerCallback's weights at `step` (global_step, the
    optimizer steps done) of a run of `total_steps`, as SparseEncoderTrainer drives it."""
    from sentence_transformers.sparse_encoder.callbacks import SpladeRegularizerWeightSchedulerCallback
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss
    from transformers import TrainerControl, TrainerState

    base = SparseMultipleNegativesRankingLoss(model)
    loss = SpladeLoss(model, base, DOCUMENT_WEIGHT, query_regularizer_weight=QUERY_WEIGHT)
    callback = SpladeRegularizerWeightSchedulerCallback(loss, warmup_ratio=ratio)
    state = TrainerState(max_steps=total_steps)
    callback.on_train_begin(None, state, TrainerControl())
    state.global_step = step
    callback.on_step_begin(None, state, TrainerControl())
    return loss.query_regularizer_weight, loss.document_regularizer_weight


@pytest.mark.parametrize(("total_steps", "ratio"), [(9, 1 / 3), (10, 1 / 3), (7, 0.5), (4, 1.0), (2, 0.2)])
def test_the_warmup_follows_sentence_transformers_scheduler(tmp_path, total_steps, ratio):
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="splade")
    weights = ["--sparse_query_weight", QUERY_WEIGHT, "--sparse_document_weight", DOCUMENT_WEIGHT]
    model, args = trained_as(folder, [*map(str, weights), "--sparse_warmup_ratio", str(ratio)])
    schedule = types.SimpleNamespace(last_epoch=0)
    penalty = sparse.SparsityPenalty.of(
        flags_of(sparse.SparseFlags, args), model, schedule, total_steps, say=lambda line: None
    )
    for step in range(total_steps + 2):
        schedule.last_epoch = step
        expected = splade_weights(model, total_steps, ratio, step)
        assert penalty.weights() == pytest.approx(expected, rel=1e-12), step
    schedule.last_epoch = 0  # the first step trains the contrastive loss alone, as in sentence-transformers
    assert penalty.weights() == (0.0, 0.0)


def test_without_warmup_the_full_weights_apply_from_the_first_step(tmp_path):
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="splade")
    model, args = trained_as(folder, ["--sparse_warmup_ratio", "0"])
    penalty = sparse.SparsityPenalty.of(
        flags_of(sparse.SparseFlags, args), model, types.SimpleNamespace(last_epoch=0), 10, lambda _: None
    )
    assert penalty.weights() == (5e-5, 3e-5)  # sentence-transformers' SpladeLoss defaults, documented


def splade_reference(symmetric, query_weight, document_weight):
    """sentence-transformers' own loss on the whole batch: SpladeLoss around its
    SparseMultipleNegativesRankingLoss (scale 1, dot product), both directions when symmetric."""
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    def loss(model, features):
        directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
        base = SparseMultipleNegativesRankingLoss(
            model, directions=directions, partition_mode="per_direction" if symmetric else "joint"
        )
        splade = SpladeLoss(
            model, base, document_regularizer_weight=document_weight, query_regularizer_weight=query_weight
        )
        return sum(splade(features, labels=None).values())

    return loss


CASES = {
    "splade": ("splade", []),
    "splade-symmetric-lora": ("splade", ["--symmetric", "--lora_r", "4"]),
    "inference-free": ("inference-free", []),
}


@pytest.mark.parametrize("name", CASES)
def test_a_sparse_step_is_exact_against_sentence_transformers_splade_loss(tmp_path, name):
    """train.py's loss (loss_function with its SparsityPenalty) through a Gradient Cache step of chunks of
    3, the weights mid warm-up, against SpladeLoss on the batch in one graph; the negative controls: the
    same step without the regularizers, and with the two weights swapped, fail the rule."""
    kind, flags = CASES[name]
    folder = build_tiny_model(tmp_path, dropout=0.0, kind=kind)
    weights = ["--sparse_query_weight", str(QUERY_WEIGHT), "--sparse_document_weight", str(DOCUMENT_WEIGHT)]
    model, args = trained_as(folder, [*weights, *flags])
    if args.lora_r:  # peft starts B at zero, where A gets no gradient: a random B tests both
        torch.manual_seed(2)
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                torch.nn.init.normal_(parameter, std=0.1)
    assert isinstance(model, SparseEncoder) and model.similarity_fn_name == "dot"
    total_steps, step = 9, 2  # warm-up over 3 steps (the default ratio, 1/3): (2/3)^2 of the weights
    schedule = types.SimpleNamespace(last_epoch=step)
    penalty = sparse.SparsityPenalty.of(
        flags_of(sparse.SparseFlags, args), model, schedule, total_steps, say=lambda line: None
    )
    query_weight, document_weight = splade_weights(model, total_steps, 1 / 3, step)
    prompts = models.role_prompts(model)
    columns = [models.tokenize(model, column_texts(i, 12), c, prompts) for i, c in enumerate(COLUMNS)]
    towers = models.Towers(model) if models.is_router(model) else None
    assert (towers is not None) == (kind == "inference-free")

    def step_with(penalty):
        model.zero_grad()
        stats = {}
        loss_fn = functools.partial(train.loss_function(args, model, penalty), stats=stats)
        recorder = StageOneRecorder()
        report = recorder.step(None if towers else model, columns, loss_fn, 3, encode_group=towers)
        return report, stats

    def reference(query, document):
        loss = splade_reference("--symmetric" in flags, query, document)

        def replayed(copies, cast):  # each column tokenized and routed by sentence-transformers itself
            (copied,) = copies
            features = [
                cast(dict(copied.preprocess(column_texts(i, 12), task=task))) | {"task": task}
                for i, task in enumerate(TASKS)
            ]
            value = loss(copied, features)
            value.backward()
            return value.detach()

        return replayed

    # The reference's model: the same weights in the saved model, from sentence-transformers and peft alone
    alone = reference_model(folder, [*weights, *flags], SparseEncoder)
    alone.load_state_dict(model.state_dict())
    report, stats = step_with(penalty)
    assert_gradients_exact([model], reference(query_weight, document_weight), report.loss, name, [alone])
    # The logged numbers: active dimensions of the batch's texts as sentence-transformers counts them.
    with torch.no_grad():
        reps = [
            model(dict(c), task=models.role_task(n))["sentence_embedding"]
            for c, n in zip(columns, COLUMNS, strict=True)
        ]
    assert stats["query_active_dims"] == pytest.approx(float((reps[0] > 0).sum(-1).double().mean()))
    documents = torch.cat(reps[1:])
    assert stats["document_active_dims"] == pytest.approx(float((documents > 0).sum(-1).double().mean()))
    assert (stats["sparse_query_weight"], stats["sparse_document_weight"]) == (query_weight, document_weight)
    # Negative controls
    step_with(None)
    right = reference(query_weight, document_weight)
    assert_gradients_inexact([model], right, f"{name} unregularized", [alone])
    swapped = dataclasses.replace(penalty, query_weight=DOCUMENT_WEIGHT, document_weight=QUERY_WEIGHT)
    step_with(swapped)
    assert_gradients_inexact([model], right, f"{name} weights swapped", [alone])


# ---------------------------------------------------------------------------------------------------------
# A SPLADE folder trains, end to end, into a SparseEncoder that is still sparse
# ---------------------------------------------------------------------------------------------------------


def test_a_splade_folder_trains_into_a_sparse_encoder_that_stays_sparse(tmp_path, data, monkeypatch, capsys):
    from sentence_transformers import SparseEncoder

    folder = build_tiny_model(tmp_path, dropout=0.1, kind="splade")
    vocabulary = SparseEncoder(str(folder), device="cpu").encode_query(["w1"]).shape[-1]
    run = ("--output_dir", tmp_path / "run", "--model", folder, "--data", data[0], "--dev_data", data[1])
    run += ("--batch_size", 8, "--chunk_size", 3, "--max_steps", 6, "--eval_steps", 6, "--lr", 5e-3)
    run += ("--sparse_query_weight", 0.05, "--sparse_document_weight", 0.05, "--sparse_warmup_ratio", 0.5)
    run += ("--guide_model", folder, "--guide_margin", 0.0)  # a sparse guide: its weights, made dense
    run_main(monkeypatch, *run)
    out = capsys.readouterr().out
    assert f"is a sparse encoder of {vocabulary} dimensions: FLOPS regularizers 0.05 (queries)" in out
    assert "load it with SparseEncoder(path)" in out
    final = tmp_path / "run" / "final"
    saved = json.loads((final / "config_sentence_transformers.json").read_text())
    assert saved["model_type"] == "SparseEncoder" and saved["similarity_fn_name"] == "dot"
    reloaded = SparseEncoder(str(final), device="cpu")
    texts = column_texts(5, 8)
    encoded = reloaded.encode_document(texts)
    assert encoded.is_sparse and encoded.shape == (8, vocabulary)
    before = SparseEncoder(str(folder), device="cpu").encode_document(texts)
    active = [
        float(model.sparsity(e)["active_dims"]) for model, e in ((reloaded, encoded), (reloaded, before))
    ]
    assert active[0] < 0.8 * active[1], active  # the regularizers took out dimensions
    logged = {tag: [value for _, value in points] for tag, points in logged_scalars(tmp_path / "run").items()}
    for name in ("query_active_dims", "document_active_dims", "query_flops", "document_flops"):
        assert len(logged[f"train/{name}"]) == 6, name
    assert logged["train/sparse_query_weight"][0] == 0.0  # the warm-up's first step
    assert logged["train/sparse_query_weight"][-1] == pytest.approx(0.05)
    # sentence-transformers' sparse evaluator: the active dimensions of the dev queries and corpus
    assert logged["eval/dev_corpus_active_dims"][-1] < logged["eval/dev_corpus_active_dims"][0]
    assert "eval/dev_dot_ndcg@10" in logged
    assert 0 < max(logged["train/masked_fraction"]) < 1  # the guide masked some candidates, not all


# ---------------------------------------------------------------------------------------------------------
# What does not fit a sparse encoder, or a dense one
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [["--matryoshka_dims", "16,8"], ["--similarity", "cos"], ["--in_batch_negatives", "off"]],
    ids=["matryoshka", "cosine", "group-only"],
)
def test_flags_that_do_not_fit_a_sparse_encoder_are_refused_in_one_line(tmp_path, capsys, flags):
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="splade")
    flag = " ".join(flags[:1] if flags[0] == "--matryoshka_dims" else flags)
    one_line_error(
        capsys,
        lambda: trained_as(folder, flags),
        rf"^train.py: error: {flag}: --model .* is a sparse encoder, trained by dot product .* "
        rf"Drop {flag}\.$",
    )


def test_the_regularizers_of_a_dense_model_are_refused(tmp_path, capsys):
    folder = build_tiny_model(tmp_path, dropout=0.0)
    one_line_error(
        capsys,
        lambda: trained_as(folder, ["--sparse_document_weight", "1e-4"]),
        r"^train.py: error: --sparse_document_weight: for a sparse encoder \(SparseEncoder\); --model .* "
        r"is dense\.$",
    )


def test_splade_under_zero3_in_two_processes_evaluates_and_saves_a_sparse_encoder(tmp_path, data):
    """The path of a multi-GPU SPLADE run: every parameter partitioned, cross-process negatives (the
    regularizers of the global batch), the sparse evaluator before and after (each process encoding the
    whole dev set: the same forward passes, which ZeRO-3 gathers collectively), final/ gathered whole."""
    from sentence_transformers import SparseEncoder

    folder = build_tiny_model(tmp_path, dropout=0.0, kind="splade")
    launch_deepspeed(
        zero3_partitioning_everything(tmp_path), tmp_path / "run", "--model", folder, "--data", data[0],
        "--dev_data", data[1], "--batch_size", 8, "--chunk_size", 3, "--max_steps", 3, "--eval_steps", 3,
        "--lr", 5e-3, "--cross_process_negatives", "--wandb_mode", "disabled", processes=2,
    )  # fmt: skip
    reloaded = SparseEncoder(str(tmp_path / "run" / "final"), device="cpu")
    initial = SparseEncoder(str(folder), device="cpu").state_dict()
    trained = reloaded.state_dict()
    assert sorted(trained) == sorted(initial)
    assert max((trained[name] - initial[name]).abs().max().item() for name in initial) > 1e-4
    assert reloaded.encode_query(column_texts(3, 4)).is_sparse
    logged = logged_scalars(tmp_path / "run")
    assert len(logged["eval/dev_query_active_dims"]) == 2 and len(logged["train/document_active_dims"]) == 3
