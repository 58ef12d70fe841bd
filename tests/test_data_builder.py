"""Checks data/build_wordnet.py and the WordNet data set it built (data/wordnet_*.jsonl.gz)."""

import gzip
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
WORDNET_DIR = Path("/usr/share/wordnet")
SPLITS = ("train", "dev")
FIELDS = ("anchor", "positive", "negative")

# Known synsets: their words, their definition, and example sentences from their gloss.
KNOWN_SYNSETS = {
    "dog, domestic dog, Canis familiaris": (
        "a member of the genus Canis (probably descended from the common wolf) that has been "
        "domesticated by man since prehistoric times; occurs in many breeds",
        ["the dog barked all night"],
    ),
    "worsted": (
        "a woolen fabric with a hard textured surface and no nap; woven of worsted yarns",
        ["he wore a worsted suit"],
    ),
    "coerce, hale, squeeze, pressure, force": (
        "to cause to do through pressure or necessity, by physical, moral or intellectual means",
        ["She forced him to take a job in the city", "He squeezed her for information"],
    ),
    "enclose, hold in, confine": ("close in", ["darkness enclosed him"]),
}


def load_builder():
    spec = importlib.util.spec_from_file_location("build_wordnet", DATA_DIR / "build_wordnet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return {
        split: gzip.decompress((DATA_DIR / f"wordnet_{split}.jsonl.gz").read_bytes()).decode()
        for split in SPLITS
    }


@pytest.fixture(scope="module")
def records(texts) -> dict[str, list[dict]]:
    return {split: [json.loads(line) for line in text.splitlines()] for split, text in texts.items()}


def test_rebuild_has_the_same_records(tmp_path):
    if not (WORDNET_DIR / "data.noun").is_file():
        pytest.fail(f"WordNet 3.0 is missing from {WORDNET_DIR}: run `bash setup.sh --dev`")
    builder = DATA_DIR / "build_wordnet.py"
    command = [sys.executable, str(builder), "--wordnet_dir", str(WORDNET_DIR), "--out_dir", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True)
    for split in SPLITS:
        name = f"wordnet_{split}.jsonl.gz"
        # By content: the compressed bytes depend on the zlib build, the records must not.
        rebuilt, shipped = (gzip.decompress((folder / name).read_bytes()) for folder in (tmp_path, DATA_DIR))
        assert rebuilt == shipped, f"rebuilt {name} differs"


@pytest.mark.parametrize(
    ("gloss", "definition"),
    [
        ('a feline; "the cat sat"; "a cat nap"', "a feline"),
        ('quick or easy earnings, "they are traders out to make a fast buck"', "quick or easy earnings"),
        (
            'progress (especially in the phrase "make strides"); "big strides"',
            'progress (especially in the phrase "make strides")',
        ),
        (
            'promise of reward as in "carrot and stick"; "used the carrot"',
            'promise of reward as in "carrot and stick"',
        ),
        ('focus once again; The physicist refocused the light beam"', "focus once again"),
        ("a definition without examples", "a definition without examples"),
    ],
)
def test_definition_drops_examples(gloss, definition):
    assert load_builder().definition_of(gloss) == definition


def test_split_sizes(records):
    assert len(records["dev"]) == 2000
    assert len(records["train"]) > 80_000


def test_records_hold_three_non_empty_strings(records):
    for record in records["train"] + records["dev"]:
        assert set(record) == set(FIELDS)
        assert all(isinstance(record[field], str) and record[field].strip() for field in FIELDS), record


def test_anchors_are_unique_and_splits_disjoint(records):
    train_anchors = [record["anchor"] for record in records["train"]]
    dev_anchors = [record["anchor"] for record in records["dev"]]
    assert len(set(train_anchors)) == len(train_anchors)
    assert len(set(dev_anchors)) == len(dev_anchors)
    assert not set(train_anchors) & set(dev_anchors)


def test_negative_differs_from_positive(records):
    assert all(record["negative"] != record["positive"] for record in records["train"] + records["dev"])


def test_known_synsets_keep_definition_and_lose_examples(records, texts):
    anchors_by_positive = {
        record["positive"]: record["anchor"] for record in records["train"] + records["dev"]
    }
    all_text = "".join(texts.values())
    for positive, (definition, examples) in KNOWN_SYNSETS.items():
        assert anchors_by_positive[positive] == definition
        for example in examples:
            assert example not in all_text


def test_no_example_left_in_anchors(records):
    # Examples follow the definition as a separator and a quote; quotes in parentheses are definition.
    for record in records["train"] + records["dev"]:
        outside_parentheses = re.sub(r"\([^)]*\)", "", record["anchor"])
        assert not re.search(r'[;:,]\s*"', outside_parentheses), record["anchor"]
        assert not record["anchor"].endswith((";", ":", ",")), record["anchor"]
