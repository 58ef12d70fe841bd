"""What train.py reads: every field of the data accounted for, the data forms, BEIR dev folders, paths that
name nothing. In-process and cheap: load_pairs, or main stopped before training."""

from test_train import fails_with, write_rows

import train


def test_every_record_decides_the_fields_and_each_field_is_mapped_or_listed(tmp_path, capsys):
    """The first record of a FlagEmbedding file has no negatives: the negatives of all the others were
    dropped without a word (the fields came from the first record)."""
    rows = [{"query": "q0", "pos": ["p0"], "id": 0}] + [
        {"query": f"q{i}", "pos": [f"p{i}"], "neg": [f"n{i}"], "neg_scores": [0.5], "id": i} for i in (1, 2)
    ]
    path = str(write_rows(tmp_path / "flag.jsonl", rows))
    fails_with(
        capsys,
        lambda: train.load_pairs(path),
        f"{path}, line 1 has no field 'neg' (negative) that 2 other records have",
        "--columns",
        "--skip_bad_records",
    )
    loaded, skipped = train.load_pairs(path, skip_bad_records=True)
    assert (len(loaded), skipped) == (2, 1) and loaded[0]["negative_1"] == "n1"
    printed = capsys.readouterr().out
    assert f"{path}: anchor <- query, positive <- pos, negatives <- neg; unused: id, neg_scores" in printed
    # Training without them is said so, not guessed
    none, _ = train.load_pairs(path, "negatives=")
    assert none.column_names == ["anchor", "positive"] and len(none) == 3
    assert "negatives <- none; unused: id, neg, neg_scores" in capsys.readouterr().out


def test_common_names_of_hard_negatives_are_negatives(tmp_path, capsys):
    """sentence-transformers' n-tuples (negative_1..N), MS MARCO triplets (negative), hard_negative(s):
    all negatives, in number order; scores and ids are not."""
    row = {"anchor": "a", "positive": "p", "hard_negative": "h", "hard_negatives": ["hs"]}
    row |= {f"negative_{i}": f"n{i}" for i in (1, 2, 10)} | {"negative_score": 0.3, "neg_ids": [4]}
    loaded, _ = train.load_pairs(str(write_rows(tmp_path / "mined.jsonl", [row])))
    assert list(loaded[0].values()) == ["a", "p", "h", "hs", "n1", "n2", "n10"]
    printed = capsys.readouterr().out
    assert "negatives <- hard_negative + hard_negatives + negative_1 + negative_2 + negative_10" in printed
    assert "unused: negative_score, neg_ids" in printed
