"""Chunks by token budget, texts tokenized chunk by chunk, left padding trimmed: exact, and doing as they say.

References never run gradcache_step: plain autograd on the whole batch, tokenized as a whole by
sentence-transformers, through copies of the model in float32 and in float64 and references.py's materialized
loss; the run passes by references.py's rule (as close to float64 as the float32 reference). Where two
gradcache paths must give the same inputs (per-chunk tokenization against the batch tokenized once and
trimmed), the gradients must be bitwise equal.
"""

import copy
import random
import types

import pytest
import torch
from accelerate import DistributedType
from references import materialized_contrastive_loss
from test_gradcache import (
    MAX_LEN,
    VOCAB,
    CountingEncoder,
    TinyEncoder,
    assert_gradients_exact,
    unchunked_reference,
)
from test_train import WORDS, build_tiny_model

import gradcache
import train
from train_parts import models


def random_texts(count, seed, longest=20):
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, longest))) for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_model_folders(tmp_path_factory):
    return {
        dropout: build_tiny_model(tmp_path_factory.mktemp(f"dropout{dropout}"), dropout)
        for dropout in (0, 0.1)
    }


def load(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


class OutOfMemoryAbove(torch.nn.Module):
    """Raises torch.OutOfMemoryError, as CUDA would, for chunks of more than `limit` padded tokens."""

    def __init__(self, encoder, limit):
        super().__init__()
        self.encoder, self.limit = encoder, limit

    def forward(self, features):
        if features["input_ids"].numel() > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        return self.encoder(features)


class PaddedSizes(torch.nn.Module):
    """Records (examples, padded width) and the input's type of every chunk the model encodes."""

    def __init__(self, model):
        super().__init__()
        self.model, self.shapes, self.input_types = model, [], set()

    def forward(self, features):
        self.shapes.append(tuple(features["input_ids"].shape))
        self.input_types.add(type(features))
        return self.model(features)


# ---- plans ----


@pytest.mark.parametrize("budget", [1, 7, 20, 64, 1000])
def test_token_budget_plans_stay_in_budget_longest_first_and_cover_every_example_once(budget):
    lengths = torch.randint(1, 30, (97,), generator=torch.Generator().manual_seed(budget))
    plan = gradcache.plan_chunks(list(range(97)), chunk_tokens=budget, lengths=lengths)

    order = torch.cat(plan)
    assert torch.equal(order.sort().values, torch.arange(97))  # every example once
    assert torch.all(lengths[order][:-1] >= lengths[order][1:])  # longest first
    for s, chunk in enumerate(plan):
        padded = len(chunk) * int(lengths[chunk].max())
        assert padded <= budget or len(chunk) == 1  # only a lone over-long example exceeds the budget
        if s + 1 < len(plan):  # full: the next example would not have fit
            assert (len(chunk) + 1) * int(lengths[chunk].max()) > budget
    if budget == 1:
        assert len(plan) == 97


def test_plan_from_an_attention_mask_equals_the_plan_from_lengths():
    lengths = torch.tensor([3, 9, 1, 9, 4, 2, 7, 7])
    mask = (torch.arange(MAX_LEN) < lengths[:, None]).long()
    column = {"input_ids": mask * 5, "attention_mask": mask, "modality": "text"}
    from_mask = gradcache.plan_chunks(column, chunk_tokens=20)
    from_lengths = gradcache.plan_chunks(list("abcdefgh"), chunk_tokens=20, lengths=lengths)
    assert (
        [c.tolist() for c in from_mask]
        == [c.tolist() for c in from_lengths]
        == [[1, 3], [6, 7], [4, 0, 5, 2]]
    )


def test_chunk_arguments_are_checked():
    column = {"input_ids": torch.ones(4, 3, dtype=torch.long), "attention_mask": torch.ones(4, 3)}
    with pytest.raises(ValueError, match="chunk_size or chunk_tokens, not both"):
        gradcache.gradcache_step(TinyEncoder(0.0), [column, column], chunk_size=2, chunk_tokens=8)
    for both_or_neither in ({}, {"chunk_size": 2, "chunk_tokens": 8}):
        with pytest.raises(ValueError, match="pass one of chunk_size"):
            gradcache.plan_chunks(column, **both_or_neither)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        gradcache.gradcache_step(TinyEncoder(0.0), [column, column], chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens needs each example's length: pass lengths="):
        gradcache.gradcache_step(TinyEncoder(0.0), [["a"] * 4] * 2, chunk_tokens=8)
    with pytest.raises(ValueError, match="lengths holds 3 values for a column of 4 examples"):
        gradcache.gradcache_step(
            TinyEncoder(0.0), [column, column], chunk_tokens=8, lengths=[[1, 2, 3], None]
        )


# ---- exact on a sentence-transformers model ----

ROLES = ("anchor", "positive", "negative_1")
NO_PROMPTS = {"query": None, "document": None}
PROMPTS = {"query": "w1 w2", "document": "w3"}  # words of the tiny vocabulary


def test_chunk_tokens_on_text_columns_is_exact_against_the_full_batch(tiny_model_folders, accelerator):
    model = load(tiny_model_folders[0])
    columns = [random_texts(24, seed) for seed in range(3)]
    budget = 60

    counted = PaddedSizes(model)  # the engine, as accelerate would have wrapped it
    batch, args = dict(zip(ROLES, columns, strict=True)), train.parse_args([])
    loss_fn = gradcache.contrastive_loss
    report = train.gradient_cache_step(
        accelerator, counted, model, NO_PROMPTS, loss_fn, args, batch, {"chunk_tokens": budget}
    )

    def reference(copies, cast):
        (reference,) = copies  # the whole batch tokenized at once by sentence-transformers
        return unchunked_reference(
            copies * 3, [reference.preprocess(texts) for texts in columns], materialized_contrastive_loss
        )

    assert_gradients_exact([model], reference, report.loss, f"chunk_tokens {budget}")
    assert all(examples * width <= budget or examples == 1 for examples, width in counted.shapes)
    assert len({width for _, width in counted.shapes}) > 2  # each chunk padded to its own longest
    assert len({examples for examples, _ in counted.shapes}) > 2  # chunks sized by their texts


def test_tokenizing_per_chunk_gives_the_gradients_of_tokenizing_the_batch(tiny_model_folders, accelerator):
    model = load(tiny_model_folders[0.1]).train()  # dropout on: the RNG replay must line up as well
    model.max_seq_length = 12  # some texts are truncated: lengths must count what the model receives
    per_chunk, whole = model, copy.deepcopy(model)
    columns = [random_texts(20, seed) for seed in range(10, 13)]
    # Prompts too: sentence-transformers prepends them, and the lengths must count them. The token counts
    # train.py's step sorts and budgets the chunks by: the texts tokenized unpadded.
    features = [
        models.tokenize(whole, texts, role, PROMPTS) for texts, role in zip(columns, ROLES, strict=True)
    ]
    lengths = [
        torch.tensor(
            [len(ids) for ids in models.tokenize(per_chunk, texts, role, PROMPTS, padding=False)["input_ids"]]
        )
        for texts, role in zip(columns, ROLES, strict=True)
    ]
    for column_lengths, column in zip(lengths, features, strict=True):
        assert torch.equal(column_lengths, column["attention_mask"].sum(1))
    assert max(int(column_lengths.max()) for column_lengths in lengths) == 12

    engine = PaddedSizes(per_chunk)
    batch, args = dict(zip(ROLES, columns, strict=True)), train.parse_args([])
    loss_fn = gradcache.contrastive_loss
    torch.manual_seed(1)
    report = train.gradient_cache_step(
        accelerator, engine, per_chunk, PROMPTS, loss_fn, args, batch, {"chunk_tokens": 40}
    )
    assert engine.input_types == {dict}  # DDP finds output tensors in dicts only
    torch.manual_seed(1)
    whole_report = gradcache.gradcache_step(whole, features, chunk_tokens=40)

    assert torch.equal(report.loss, whole_report.loss)
    for (name, p), q in zip(per_chunk.named_parameters(), whole.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


# ---- left padding ----


def left_padded_column(lengths, seed):
    mask = (torch.arange(MAX_LEN) >= MAX_LEN - lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, mask.shape, generator=torch.Generator().manual_seed(seed)) * mask
    return {"input_ids": ids, "attention_mask": mask, "modality": "text"}


def test_left_padding_is_trimmed_per_chunk_and_stays_exact():
    lengths = torch.tensor([1, 9, 2, 8, 1, 9, 2, 8, 3, 3])
    columns = [left_padded_column(lengths, seed) for seed in range(2)]
    torch.manual_seed(0)
    encoder = CountingEncoder(TinyEncoder(dropout=0.0))
    report = gradcache.gradcache_step(encoder, columns, chunk_size=2)
    assert [width for _, width in encoder.calls[:5]] == [9, 8, 3, 2, 1]  # each chunk its own longest

    def reference(copies, cast):
        return unchunked_reference(copies * 2, columns, materialized_contrastive_loss)

    assert_gradients_exact([encoder.encoder], reference, report.loss, "left padding trimmed")


def test_a_trimmed_left_padded_chunk_is_what_tokenizing_its_texts_alone_gives(tiny_model_folders):
    model = load(tiny_model_folders[0])
    model.tokenizer.padding_side = "left"
    texts = random_texts(9, seed=5)
    batch = model.preprocess(texts)
    assert bool(batch["attention_mask"][:, -1].all()) and not bool(batch["attention_mask"][:, 0].all())
    for index in (torch.tensor([0, 3]), torch.tensor([8, 1, 2]), torch.arange(9)):
        chunk = gradcache.select_examples(batch, index)
        alone = model.preprocess([texts[i] for i in index.tolist()])
        assert sorted(chunk) == sorted(alone)
        for key, value in alone.items():
            assert torch.equal(chunk[key], value) if isinstance(value, torch.Tensor) else chunk[key] == value


# ---- out of memory names the budget to use ----


def test_out_of_memory_with_chunk_tokens_names_half_the_budget_and_train_halves_it(capsys):
    lengths = torch.tensor([9, 9, 8, 8, 7, 7, 3, 3, 2, 2, 1, 1])
    columns = [left_padded_column(lengths, seed) for seed in range(2)]
    torch.manual_seed(0)
    encoder = OutOfMemoryAbove(TinyEncoder(dropout=0.0), limit=20)
    with pytest.raises(gradcache.ChunkOutOfMemory) as raised:
        gradcache.gradcache_step(encoder, columns, chunk_tokens=36)
    assert "a chunk of up to 36 padded tokens ran out of memory" in str(raised.value)
    assert "Use a chunk_tokens of 18 or less" in str(raised.value)

    # train.py's loop: the step that ran out, stopped with what to launch, or redone from zeroed gradients
    accelerator = types.SimpleNamespace(
        distributed_type=DistributedType.NO, num_processes=1, device=torch.device("cpu"), print=print
    )
    args = train.parse_args(["--chunk_tokens", "36"])
    assert (args.chunk_tokens, args.chunk_size) == (36, None)

    def step(batch, chunking):
        return gradcache.gradcache_step(encoder, batch, **chunking)

    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.0)  # zero_grad only
    with pytest.raises(SystemExit, match="Relaunch with --chunk_tokens 18, or add --auto_chunk_size"):
        train.step_with_back_off(step, columns, {"chunk_tokens": 36}, args, accelerator, optimizer)
    args.auto_chunk_size = True
    report, chunking = train.step_with_back_off(
        step, columns, {"chunk_tokens": 36}, args, accelerator, optimizer
    )
    assert chunking == {"chunk_tokens": 18}  # never more than 18 padded tokens: fits
    assert "out of memory with --chunk_tokens 36: redoing the batch with 18" in capsys.readouterr().out

    def reference(copies, cast):  # the weights are the initial ones: the optimizer's rate is 0
        return unchunked_reference(copies * 2, columns, materialized_contrastive_loss)

    assert_gradients_exact([encoder.encoder], reference, report.loss, "redone with chunk_tokens 18")


def test_train_takes_chunk_size_or_chunk_tokens_not_both():
    args = train.parse_args([])
    assert (args.chunk_size, args.chunk_tokens) == (32, None)
    args = train.parse_args(["--chunk_tokens", "4096"])
    assert (args.chunk_size, args.chunk_tokens) == (None, 4096)
    for argv, message in [
        (["--chunk_size", "8", "--chunk_tokens", "4096"], "--chunk_size and --chunk_tokens both given"),
        (["--chunk_tokens", "0"], "--chunk_tokens must be at least 1"),
    ]:
        with pytest.raises(SystemExit, match=message):
            train.parse_args(argv)


# ---- one plan for every process ----


@pytest.mark.parametrize("budget", [None, 30, 7], ids=["chunk-size-3", "tokens-30", "tokens-7"])
@pytest.mark.parametrize("extra", [0, 2, 9, 40], ids=lambda n: f"others-plan-{n}-more")
@pytest.mark.parametrize("together", [False, True], ids=["shared", "towers"])
def test_a_process_that_planned_fewer_chunks_splits_its_largest_and_stays_in_budget(
    monkeypatch, budget, extra, together
):
    """Another process planned `extra` more chunks per column (the all-reduce is stood in for): this one
    reaches the agreed count by halving its largest chunks, never over the budget, and pads only when every
    chunk is down to one example."""
    generator = torch.Generator().manual_seed(extra)
    lengths = [torch.randint(1, 12, (size,), generator=generator) for size in (9, 9, 9)]
    columns = [list(range(9))] * 3
    limits, by_tokens = [budget or 3] * 3, budget is not None
    own = gradcache.plan_step(columns, limits, by_tokens, lengths, together)
    monkeypatch.setattr(gradcache, "largest_on_any_process", lambda counts: [n + extra for n in counts])
    agreed = gradcache.plan_step(columns, limits, by_tokens, lengths, together)

    assert len(agreed) == len(own) + (extra if together else 3 * extra)
    for c in range(3):
        chunks = [chunk for group in agreed for chunk in group if chunk.column == c]
        real = [chunk.index for chunk in chunks if not chunk.padding]
        assert sorted(torch.cat(real).tolist()) == list(range(9))  # every example once
        if budget:  # a chunk of one over-long example is the budget's only exception
            assert all(len(i) * int(lengths[c][i].max()) <= budget or len(i) == 1 for i in real)
        else:
            assert all(len(index) <= 3 for index in real)
        padding = [chunk for chunk in chunks if chunk.padding]
        assert (len(padding) > 0) == (len(chunks) > 9)  # padding only beyond one example per chunk
    if together:  # every group reaches every tower
        assert all(sorted(chunk.column for chunk in group) == [0, 1, 2] for group in agreed)
