"""What train.py reads: every field of the data accounted for, the data forms, BEIR dev folders, paths that
name nothing. In-process and cheap: load_pairs, or main stopped before training."""

import functools
import json

import huggingface_hub
import pytest
from test_train import fails_with, run_main, write_rows

import train
from train_parts import models, pairs
from train_parts.common import hub_out_of_reach
from train_parts.pairs import build_evaluator


def test_every_record_decides_the_fields_and_each_field_is_mapped_or_listed(tmp_path, capsys):
    """The first record of a FlagEmbedding file has no negatives: the negatives of all the others were
    dropped without a word (the fields came from the first record)."""
    rows = [{"query": "q0", "pos": ["p0"], "id": 0}] + [
        {"query": f"q{i}", "pos": [f"p{i}"], "neg": [f"n{i}"], "neg_scores": [0.5], "id": i} for i in (1, 2)
    ]
    path = str(write_rows(tmp_path / "flag.jsonl", rows))
    fails_with(
        capsys,
        lambda: pairs.load_pairs(path),
        f"{path}, line 1 has no field 'neg' (negative) that 2 other records have",
        "--columns",
        "--skip_bad_records",
    )
    loaded, skipped = pairs.load_pairs(path, skip_bad_records=True)
    assert (len(loaded), skipped) == (2, 1) and loaded[0]["negative_1"] == "n1"
    printed = capsys.readouterr().out
    assert f"{path}: anchor <- query, positive <- pos, negatives <- neg; unused: id, neg_scores" in printed
    # Training without them is said so, not guessed
    none, _ = pairs.load_pairs(path, "negatives=")
    assert none.column_names == ["anchor", "positive"] and len(none) == 3
    assert "negatives <- none; unused: id, neg, neg_scores" in capsys.readouterr().out


def test_common_names_of_hard_negatives_are_negatives(tmp_path, capsys):
    """sentence-transformers' n-tuples (negative_1..N), MS MARCO triplets (negative), hard_negative(s):
    all negatives, in number order; scores and ids are not."""
    row = {"anchor": "a", "positive": "p", "hard_negative": "h", "hard_negatives": ["hs"]}
    row |= {f"negative_{i}": f"n{i}" for i in (1, 2, 10)} | {"negative_score": 0.3, "neg_ids": [4]}
    loaded, _ = pairs.load_pairs(str(write_rows(tmp_path / "mined.jsonl", [row])))
    assert list(loaded[0].values()) == ["a", "p", "h", "hs", "n1", "n2", "n10"]
    printed = capsys.readouterr().out
    assert "negatives <- hard_negative + hard_negatives + negative_1 + negative_2 + negative_10" in printed
    assert "unused: negative_score, neg_ids" in printed


def data_as_loaded(monkeypatch, *argv):
    """(training pairs, dev set, skipped records) as main loads them from the command line `argv`, main
    stopped right after: no model is loaded (--model need only be a folder)."""
    loaded, load_data = [], train.load_data

    def load_and_stop(args, sources, accelerator):
        loaded.append(load_data(args, sources, accelerator))
        raise SystemExit("stopped after the data")

    monkeypatch.setattr(train, "load_data", load_and_stop)
    with pytest.raises(SystemExit, match="stopped after the data"):
        run_main(monkeypatch, *argv)
    return loaded[0]


TRIPLES = [{"anchor": f"a{i}", "positive": f'p"{i}', "negative": f"n{i}"} for i in range(4)]


def test_every_data_form_reads_the_same_rows(tmp_path, capsys):
    """save_to_disk folders, a folder of parquet shards, a glob of JSON lines shards, a TSV file (quotes are
    text: TSV is never quoted)."""
    import datasets

    table = datasets.Dataset.from_list(TRIPLES)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "shards" / "data").mkdir(parents=True)
    for i in (0, 1):
        table.select(range(2 * i, 2 * i + 2)).to_parquet(
            tmp_path / "shards" / "data" / f"train-0000{i}-of-00002.parquet"
        )
        write_rows(tmp_path / "shards" / f"part{i}.jsonl", TRIPLES[2 * i : 2 * i + 2])
    (tmp_path / "shards" / "README.md").write_text("not data")
    lines = ["anchor\tpositive\tnegative"] + ["\t".join(row.values()) for row in TRIPLES]
    (tmp_path / "pairs.tsv").write_text("\n".join(lines) + "\n")
    expected = [
        {"anchor": r["anchor"], "positive": r["positive"], "negative_1": r["negative"]} for r in TRIPLES
    ]
    for source in ("saved", "splits", "shards/data", "shards/*.jsonl", "pairs.tsv"):
        loaded, _ = pairs.load_pairs(str(tmp_path / source))
        assert loaded.to_list() == expected, source
    test_split, _ = pairs.load_pairs(f"{tmp_path / 'splits'}:test")
    assert test_split.to_list() == expected[:1]
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "shards/*")),
        "holds .jsonl, .md: give files of one format",
    )


def test_a_path_that_names_nothing_stops_main_at_once(tmp_path, data, monkeypatch, capsys):
    """Before anything is loaded, in one line. A misspelled local model folder is also a valid hub name: with
    the hub out of reach it is looked up in the local cache alone (the hub clients retried for 100 s)."""
    run = ("--model", tmp_path, "--data", data[0], "--output_dir", tmp_path / "run")
    for flag, value, expected in (
        ("--data", tmp_path / "trian.jsonl", f"--data: no such file or folder: {tmp_path / 'trian.jsonl'}"),
        ("--data", tmp_path / "shards/*.parquet", "(no file matches the pattern)"),
        ("--dev_data", tmp_path / "dve.jsonl", "--dev_data: no such file or folder"),
        ("--model", "./models/MiniLM", "--model: no such file or folder: ./models/MiniLM"),
        ("--model", "models/MiniLM", "nor a hub model of that name in the local cache"),
    ):
        message = fails_with(capsys, functools.partial(run_main, monkeypatch, *run, flag, value), expected)
        assert "\n" not in message.strip()
    assert "(HF_HUB_OFFLINE is set)" in message
    # Without HF_HUB_OFFLINE and without network: found out by one connection, not by retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://127.0.0.1:9")  # nothing listens
    hub_out_of_reach.cache_clear()
    try:
        fails_with(
            capsys,
            lambda: run_main(monkeypatch, *run, "--model", "models/MiniLM"),
            "the hub is out of reach (no network: 127.0.0.1 did not answer",
        )
        fails_with(
            capsys,
            lambda: run_main(monkeypatch, *run, "--data", "org/pairs"),
            "--data: no such file or folder: org/pairs, and the hub is out of reach",
            "HF_HUB_OFFLINE=1",
        )
    finally:
        hub_out_of_reach.cache_clear()


def write_beir(folder):
    """A BEIR folder: 5 documents (3 with a title), 3 queries, test qrels of which one scores 0."""
    (folder / "qrels").mkdir(parents=True)
    write_rows(
        folder / "corpus.jsonl",
        [{"_id": f"d{i}", "title": "w1" if i < 3 else "", "text": f"w{i + 2}"} for i in range(5)],
    )
    write_rows(folder / "queries.jsonl", [{"_id": f"q{i}", "text": f"w{i + 10}"} for i in range(3)])
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq0\td1\t1\nq0\td4\t2\nq1\td2\t1\nq2\td3\t0\n"
    )
    return folder


def question_answer_pairs(data, path, count=None):
    """The fixture's training pairs with the fields named question and answer."""
    rows = [json.loads(line) for line in data[0].read_text().splitlines()][:count]
    return write_rows(path, [{"question": row["anchor"], "answer": row["positive"]} for row in rows])


def test_a_beir_dev_folder_is_evaluated_against_its_whole_corpus(
    tmp_path, data, model_without_dropout, monkeypatch, capsys
):
    """Its fields are BEIR's: --columns maps the training file only."""
    from sentence_transformers import SentenceTransformer

    beir = write_beir(tmp_path / "scifact")
    pairs = question_answer_pairs(data, tmp_path / "pairs.jsonl")
    run = ("--model", tmp_path, "--data", pairs, "--columns", "anchor=question,positive=answer")
    _, dev, _ = data_as_loaded(monkeypatch, *run, "--dev_data", beir, "--output_dir", tmp_path / "run")
    printed = capsys.readouterr().out
    assert f"{beir}: BEIR split test, 2 queries with relevant documents, a corpus of 5 documents" in printed
    evaluator = build_evaluator(dev, num_queries=0)
    assert len(evaluator.corpus) == 5 and "w1 w2" in evaluator.corpus and "w6" in evaluator.corpus
    assert evaluator.queries == ["w10", "w11"]
    assert evaluator.relevant_docs == {"q0": {"d1", "d4"}, "q1": {"d2"}}
    assert 0 <= evaluator(SentenceTransformer(str(model_without_dropout)))["dev_cosine_ndcg@10"] <= 1
    assert len(build_evaluator(dev, num_queries=1).queries) == 1  # --dev_queries 1
    drawn = build_evaluator(dev, num_queries=1, corpus_size=1, say=len).corpus_ids  # --dev_corpus_size 1
    assert {"d1", "d4"} < set(drawn) and len(drawn) == 3  # q0's relevant documents and one other

    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--dev_data", f"{beir}:dev", "--output_dir", tmp_path / "r2"),
        f"--dev_data {beir} has the splits test: pick one",
    )


def test_dev_pairs_map_their_own_fields(tmp_path, data, monkeypatch, capsys):
    pairs = question_answer_pairs(data, tmp_path / "pairs.jsonl")
    dev = write_rows(tmp_path / "dev.jsonl", [{"q": f"w{i}", "a": f"w{i + 9}"} for i in range(3)])
    run = ("--model", tmp_path, "--data", pairs, "--columns", "anchor=question,positive=answer")
    run += ("--dev_data", dev)
    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--output_dir", tmp_path / "r1"),
        f"{dev} has no field 'question' (anchor), 'answer' (positive) in any record",
    )
    dev_columns = ("--dev_columns", "anchor=q,positive=a")
    _, loaded, _ = data_as_loaded(monkeypatch, *run, *dev_columns, "--output_dir", tmp_path / "r2")
    assert loaded["anchor"] == ["w0", "w1", "w2"]
    assert f"{dev}: anchor <- q, positive <- a, negatives <- none; unused: none" in capsys.readouterr().out


def test_a_plain_transformers_model_needs_a_pooling(
    tmp_path, data, model_without_dropout, monkeypatch, capsys
):
    """A folder save_pretrained wrote (no modules.json) was pooled by mean, silently."""
    plain = model_without_dropout.parent / "bert"
    run = ("--data", data[0], "--output_dir", tmp_path / "run")
    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--model", plain),
        "without sentence-transformers' modules.json",
        "add --pooling mean, cls or lasttoken",
    )
    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--model", model_without_dropout, "--pooling", "cls"),
        "pools as its modules.json says. Drop --pooling.",
    )
    model = models.load_model(str(plain), "cpu", "cls")  # as main loads it with --pooling cls
    assert [module.pooling_mode for module in model if hasattr(module, "pooling_mode")] == ["cls"]
    assert f"--model {plain}: cls pooling (--pooling)" in capsys.readouterr().out


SCORED = [
    {"query": f"q{i}", "pos": [f"p{i}"], "neg": [f"n{i}"], "pos_scores": [1.0], "neg_scores": [0.5], "id": i}
    for i in range(3)
]


def test_distilling_names_the_teacher_scores_as_used(tmp_path, monkeypatch, capsys):
    """--distill_weight reads pos_scores and neg_scores: the field line listed them as unused."""
    path = write_rows(tmp_path / "scored.jsonl", SCORED)
    run = ("--model", tmp_path, "--data", path, "--dev_data", "", "--output_dir", tmp_path / "run")
    (loaded,), _, _ = data_as_loaded(monkeypatch, *run, "--distill_weight", 0.5)
    assert loaded["negative_scores"] == [[0.5]] * 3
    printed = capsys.readouterr().out
    assert (
        "negatives <- neg, positive_scores <- pos_scores, negative_scores <- neg_scores; unused: id"
        in printed
    )
    pairs.load_pairs(str(path))  # without distilling they are not read
    assert "negatives <- neg; unused: pos_scores, neg_scores, id" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "-inf"])
def test_a_non_finite_teacher_score_is_a_bad_record(tmp_path, capsys, bad):
    """A NaN score (JSON reads NaN and Infinity) went into the distillation loss."""
    rows = [dict(row) for row in SCORED]
    rows[1]["neg_scores"] = [bad]
    path = str(write_rows(tmp_path / "scored.jsonl", rows))
    load = functools.partial(pairs.load_pairs, path, teacher_scores=True)
    fails_with(
        capsys,
        load,
        f"{path}, line 2 has field 'neg_scores' holding {bad}, not a finite score",
        "--skip_bad_records",
    )
    loaded, skipped = load(skip_bad_records=True)
    assert skipped == 1 and loaded["anchor"] == ["q0", "q2"]


def test_skipping_is_offered_only_where_it_leaves_records(tmp_path, capsys):
    """Where no record has the teacher's scores, or none can be read, --skip_bad_records would skip all."""
    unscored = [{key: value for key, value in row.items() if "scores" not in key} for row in SCORED]
    path = str(write_rows(tmp_path / "unscored.jsonl", unscored))
    message = fails_with(
        capsys,
        lambda: pairs.load_pairs(path, teacher_scores=True),
        f"{path} has no field 'pos_scores' (positive_scores), 'neg_scores' (negative_scores) in any record",
        "--columns pos_scores=",
        "--distill_weight 0",
    )
    assert "--skip_bad_records" not in message
    path = str(write_rows(tmp_path / "some.jsonl", unscored[:1] + SCORED[1:]))  # the first has none
    fails_with(
        capsys,
        lambda: pairs.load_pairs(path, teacher_scores=True),
        f"{path}, line 1 has no field 'pos_scores'",
        "--skip_bad_records",
    )
    (tmp_path / "python.jsonl").write_text(
        "{'anchor': 'a', 'positive': 'p'}\n" * 2
    )  # Python's repr, not JSON
    message = fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "python.jsonl")),
        "line 1 is not valid JSON (column 2: expecting property name enclosed in double quotes)",
        "No record can be read",
    )
    assert "pass --skip_bad_records" not in message


def test_a_json_syntax_error_names_its_line_column_and_cause(tmp_path, capsys):
    """Python's "Invalid control character at: line 1 column 14 (char 13)" read "Invalid control character at,
    column 14"."""
    good = '{"anchor": "a", "positive": "p"}\n'
    (tmp_path / "raw.jsonl").write_text(good + '{"anchor": "a\tb", "positive": "p"}\n')
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "raw.jsonl")),
        "raw.jsonl, line 2 is not valid JSON (column 14: invalid control character, a raw tab or newline "
        "inside a string: write \\t or \\n)",
    )
    (tmp_path / "split.jsonl").write_text(good + '{"anchor": "a\nb", "positive": "p"}\n')  # a line cut in two
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "split.jsonl")),
        "split.jsonl, line 2 is not valid JSON (column 14: invalid control character, a raw tab or newline",
    )
    (tmp_path / "array.json").write_text(
        '[{"anchor": "a", "positive": "p"},\n {"anchor": "a\tb", "positive": "p"}]'
    )
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "array.json")),
        "array.json is not valid JSON (line 2, column 15: invalid control character, a raw tab or newline",
        "JSON array of records",
    )
