"""Fixtures shared by the launch tests: tiny data files (one source, and two of other fields) and tiny models,
built once per module; a one-process Accelerator for the tests that call train.py's step."""

import os
import random

import pytest
import torch
from test_train import REPO, ROWS, WORDS, build_tiny_model, write_rows

# DeepSpeed's CPU extension, built by setup.sh --dev, in this checkout's own cache for every launch of the
# suite: concurrent checkouts sharing the per-user ~/.cache/torch_extensions rebuilt it in turn (87 s each).
os.environ["TORCH_EXTENSIONS_DIR"] = str(REPO / ".cache" / "torch_extensions")

# One intra-op thread in this process, as test_train.launch gives each launched one: the tiny models gain
# nothing from two, and on a busy 2-core machine two threads spin-waiting for each other made an in-process
# run of train.main two to three times slower (suite time). The bench smokes run in their own processes.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """The conversions of the tests' data (train_parts/records.py) in a folder of the session, not in the
    user's datasets cache; the runs the tests launch inherit it."""
    os.environ["GRADCACHE_DATA_CACHE"] = str(tmp_path_factory.mktemp("data_cache"))
    return os.environ["GRADCACHE_DATA_CACHE"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Train and dev JSONL with distinct texts: words shared across rows, plus one unique token per text."""
    rng = random.Random(0)
    rows = [
        {
            "anchor": " ".join(rng.sample(WORDS, 5)) + f" a{i}",
            "positive": " ".join(rng.sample(WORDS, 2)) + f" p{i}",
            "negative": " ".join(rng.sample(WORDS, 2)) + f" n{i}",
        }
        for i in range(ROWS + 8)
    ]
    folder = tmp_path_factory.mktemp("data")
    return write_rows(folder / "train.jsonl", rows[:ROWS]), write_rows(folder / "dev.jsonl", rows[ROWS:])


@pytest.fixture(scope="module")
def model_with_dropout(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("dropout"), dropout=0.1)


@pytest.fixture(scope="module")
def model_without_dropout(tmp_path_factory):
    """Chunking draws dropout masks per chunk, so chunked and unchunked runs can only agree without it."""
    return build_tiny_model(tmp_path_factory.mktemp("no_dropout"), dropout=0.0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two sources of other fields: triplets with a teacher's scores, and pairs named query/answer with one
    hard negative named other."""
    rng, folder = random.Random(1), tmp_path_factory.mktemp("sources")

    def words(count, tag):
        return " ".join(rng.sample(WORDS, count)) + f" {tag}"

    scored = [
        {"anchor": words(5, f"a{i}"), "positive": words(2, f"p{i}"), "negative": words(2, f"n{i}"),
         "pos_scores": [rng.uniform(0, 1)], "neg_scores": [rng.uniform(0, 1)]}
        for i in range(32)
    ]  # fmt: skip
    named = [
        {"query": words(4, f"a{i + 32}"), "answer": words(3, f"p{i + 32}"), "other": words(3, f"n{i + 32}")}
        for i in range(16)
    ]
    return write_rows(folder / "scored.jsonl", scored), write_rows(folder / "named.jsonl", named)


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator, as train.py's on cpu.yaml, undone after the test."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
