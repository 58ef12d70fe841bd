"""gradcache_step's graph_budget: stage 1 keeps as many graphs as the budget holds, and the step stays exact.

The references are tests/test_gradcache.py's (plain autograd on the full batch through copies of the modules,
float32 and float64, references.py's rule; with dropout, the replay of what stage 1 was seen to encode). The
sizing is checked against the bytes the CPU allocator really holds for a graph (the profiler's memory
events: a forward with grad less the same forward without), and across two DDP processes (gloo) with
different budgets every rank must keep the same number of groups and step on the global batch's gradient.

    .venv/bin/python -m pytest -q -n 0 tests/test_budget.py -s
"""

import contextlib
import functools
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from references import (
    StageOneRecorder,
    assert_exact,
    assert_inexact,
    float64,
    materialized_contrastive_loss,
)
from test_gradcache import (
    BATCH,
    MAX_LEN,
    VOCAB,
    TinyEncoder,
    assert_gradients_exact,
    assert_gradients_inexact,
    column_encoders,
    make_batch,
    make_encoders,
    reference_copies,
    unchunked_reference,
)

import gradcache

REPO = Path(__file__).resolve().parent.parent
# name -> the budget as a share of what every group's graph takes (None: the default, the last group only)
BUDGETS = {"none": None, "zero": 0.0, "some": 0.4, "all": math.inf}
PLANS = {"chunk_size": {"chunk_size": 4}, "chunk_tokens": {"chunk_tokens": 24}}


def all_graphs_bytes(modules, columns, encoders, plan):
    """The estimated bytes of every group's graph, from a step that keeps them all (its gradients cleared)."""
    report = gradcache.gradcache_step(
        encoders, columns, gradcache.contrastive_loss, graph_budget=math.inf, **plan
    )
    for module in modules:
        module.zero_grad(set_to_none=True)
    return report.kept_bytes, report.kept_groups


def budgeted_step(towers, share, plan, dropout=0.0, symmetric=False, frozen=False):
    """gradcache_step with a budget of `share` x every graph's bytes: (modules, report, reference, groups)."""
    loss_fn = functools.partial(gradcache.contrastive_loss, symmetric=symmetric)
    reference_loss = functools.partial(materialized_contrastive_loss, symmetric=symmetric)
    columns = make_batch(1)
    query, document = make_encoders(towers, dropout)
    modules = [query, document] if towers else [query]
    if frozen:  # LoRA-like: the embeddings and the attention frozen, the feed-forward and the head trained
        for module in modules:
            for p in [*module.embed.parameters(), *module.layer.self_attn.parameters()]:
                p.requires_grad_(False)
    encoders = column_encoders(query, document, len(columns)) if towers else query
    total, groups = all_graphs_bytes(modules, columns, encoders, plan)
    budget = None if share is None else share * total
    torch.manual_seed(1)
    recorder = StageOneRecorder()
    report = recorder.step(encoders, columns, loss_fn, graph_budget=budget, **plan)

    def reference(copies, cast):
        copied = column_encoders(copies[0], copies[-1], len(columns))
        if dropout:
            return recorder.replay(copied, reference_loss)
        return unchunked_reference(copied, cast(columns), reference_loss)

    return modules, report, reference, groups


def expected_kept(name, report, groups):
    kept = report.kept_groups
    if name == "none":
        assert kept == 1 and report.kept_bytes == 0
    elif name == "zero":
        assert kept == 0 and report.num_reencoded == report.num_chunks
    elif name == "all":
        assert kept == groups and report.num_reencoded == 0
    else:
        assert 0 < kept < groups and report.num_reencoded < report.num_chunks
    return kept


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-way", "symmetric"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", BUDGETS)
def test_exact_whatever_the_budget(name, plan, symmetric):
    modules, report, reference, groups = budgeted_step(False, BUDGETS[name], PLANS[plan], symmetric=symmetric)
    kept = expected_kept(name, report, groups)
    what = f"budget {name} ({kept} of {groups} groups kept), {plan}, symmetric={symmetric}"
    assert_gradients_exact(modules, reference, report.loss, what)


@pytest.mark.parametrize("name", ["some", "all"])
def test_exact_with_towers_dropout_and_frozen_parameters(name):
    """Separate towers (a group is a chunk of every column), dropout drawn in every forward, and a model
    of which only some parameters train: the kept groups need no replay, the re-encoded ones replay."""
    modules, report, reference, groups = budgeted_step(
        True, BUDGETS[name], PLANS["chunk_size"], 0.2, True, True
    )
    kept = expected_kept(name, report, groups)
    frozen = [p for module in modules for p in module.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
    assert_gradients_exact(
        modules, reference, report.loss, f"towers, dropout, frozen: {kept} of {groups} kept"
    )


# ---- negative controls: each wrong step fails the same rule ----


def test_a_kept_group_back_propagated_twice_is_caught():
    calls = []

    def backward(surrogate):  # the first backward is the kept groups': run twice
        calls.append(surrogate)
        surrogate.backward(retain_graph=len(calls) == 1)
        if len(calls) == 1:
            surrogate.backward()

    columns, encoder = make_batch(1), make_encoders(False, 0.0)[0]
    report = gradcache.gradcache_step(encoder, columns, None, 4, graph_budget=math.inf, backward=backward)
    assert report.kept_groups == report.num_chunks and len(calls) == 1

    def reference(copies, cast):
        return unchunked_reference(copies * 3, cast(columns), materialized_contrastive_loss)

    assert_gradients_inexact([encoder], reference, "kept groups back-propagated twice")


def test_without_rng_replay_the_reencoded_groups_are_wrong():
    with gradcache.refinements(replay_rng=False):
        modules, report, reference, groups = budgeted_step(False, 0.4, PLANS["chunk_size"], dropout=0.2)
    assert 0 < report.kept_groups < groups
    assert_gradients_inexact(modules, reference, "partial budget, no RNG replay")


# ---- the sizing: the saved tensors' bytes, as the allocator holds them ----


def held_bytes(forward):
    """Bytes the CPU allocator holds after `forward()` with grad beyond what the same forward holds without
    grad: the graph's saved tensors, measured by allocation events, not by autograd's hooks."""
    net = []
    for grad in (True, False):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            with torch.set_grad_enabled(grad):
                output = forward()  # noqa: F841 (alive until the profile ends)
        net.append(sum(event.self_cpu_memory_usage for event in prof.key_averages()))
        del output
    return net[0] - net[1]


def full_length_column(generator, batch=BATCH):
    ids = torch.randint(1, VOCAB, (batch, MAX_LEN), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_sizing_within_ten_percent_of_the_held_bytes():
    """Equal chunks: the estimate of all graphs is within 10% of what the allocator holds for them, and a
    budget 10% above k graphs' real bytes keeps k groups, 10% below keeps k - 1."""
    generator = torch.Generator().manual_seed(0)
    columns = [full_length_column(generator) for _ in range(2)]
    encoder = TinyEncoder(dropout=0.0)
    index = torch.arange(4)
    real = held_bytes(lambda: encoder(gradcache.select_examples(columns[0], index))["sentence_embedding"])
    estimate, groups = all_graphs_bytes([encoder], columns, encoder, {"chunk_size": 4})
    ratio = estimate / (real * groups)
    print(f"one group's graph: {real:,} bytes held; estimate of all {groups}: {estimate:,.0f} ({ratio:.3f}x)")
    assert groups == 6 and abs(ratio - 1) < 0.1
    for k in (1, 3, 6):
        for factor, expected in ((1.1, k), (0.9, k - 1)):
            report = gradcache.gradcache_step(encoder, columns, None, 4, graph_budget=factor * k * real)
            assert report.kept_groups == expected, (k, factor, report.kept_groups)


def test_sizing_of_a_sentence_transformers_model(tmp_path, monkeypatch):
    """A BERT through sentence-transformers: the first group's measured bytes against the held bytes."""
    from test_gradcache import random_texts, tiny_sentence_transformer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, words = tiny_sentence_transformer(tmp_path)
    model.train()
    column = model.preprocess(random_texts(words, 8, 0))
    index = torch.arange(8)
    real = held_bytes(lambda: model(gradcache.select_examples(column, index))["sentence_embedding"])
    # one column of one chunk and a budget for it: the step keeps the one group, measured
    columns = [column, model.preprocess(random_texts(words, 8, 1))]
    report = gradcache.gradcache_step(model, columns, None, 8, graph_budget=math.inf)
    assert report.kept_groups == 2
    sizes = [int(c["attention_mask"].sum(1).max()) * 8 for c in columns]
    measured = report.kept_bytes * sizes[0] / sum(sizes)  # the first group's, before scaling
    print(
        f"tiny BERT, one chunk of 8: {real:,} bytes held, {measured:,.0f} measured ({measured / real:.3f}x)"
    )
    assert abs(measured / real - 1) < 0.1


# ---- two DDP processes with different budgets ----

WORKER_CASES = {
    "inf-and-some": (math.inf, 0.4),
    "both-all": (math.inf, math.inf),
    "some-and-zero": (0.4, 0.0),
}


def ddp_worker(out_dir):
    """Under torchrun: rank r steps on make_batch(1, seed=r) with its case's budget (a share of every graph's
    bytes), DDP with no_sync on all but the last backward; writes its kept count and gradients per case."""
    from torch.nn.parallel import DistributedDataParallel

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    results = {}
    for case, shares in WORKER_CASES.items():
        torch.manual_seed(0)
        encoder = TinyEncoder(dropout=0.0)
        model = DistributedDataParallel(encoder)
        columns = make_batch(1, seed=rank)
        total, _ = all_graphs_bytes([encoder], columns, encoder, {"chunk_size": 4})

        def sync_context(is_last, model=model):
            return contextlib.nullcontext() if is_last else model.no_sync()

        budget = shares[rank] * total
        report = gradcache.gradcache_step(
            model, columns, None, 4, graph_budget=budget, sync_context=sync_context
        )
        grads = {name: p.grad.clone() for name, p in encoder.named_parameters()}
        results[case] = {"kept": report.kept_groups, "grads": grads}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # gloo workers now and then abort in interpreter teardown, after their work is done


def test_two_processes_keep_the_same_groups_and_step_on_the_global_gradient():
    from backend_worker import torchrun

    with tempfile.TemporaryDirectory() as out_dir:
        torchrun(Path(__file__).resolve(), ["ddp-worker", out_dir], world_size=2, timeout=300)
        ranks = [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(2)]
    # the reference: the mean over ranks of each rank's full-batch gradient (DDP averages), float32 and 64
    references, local = [], []  # the global batch's gradient, float32 and float64; rank 0's alone
    for dtype, cast in ((torch.float32, lambda values: values), (torch.float64, float64)):
        torch.manual_seed(0)
        (copy,) = reference_copies([TinyEncoder(dropout=0.0)], dtype)
        for rank in range(2):
            reps = [copy(column)["sentence_embedding"] for column in cast(make_batch(1, seed=rank))]
            (materialized_contrastive_loss(*reps) / 2).backward()  # DDP averages over the ranks
            if rank == 0:
                local.append({name: p.grad * 2 for name, p in copy.named_parameters()})
        references.append({name: p.grad for name, p in copy.named_parameters()})
    for case in WORKER_CASES:
        kept = [ranks[rank][case]["kept"] for rank in range(2)]
        assert kept[0] == kept[1], (case, kept)
        for rank in range(2):
            measured = assert_exact(ranks[rank][case]["grads"], *references, f"{case}, rank {rank}")
            print(f"DDP {case}: {kept[0]} of 9 groups kept on both ranks; rank {rank}: {measured}")
    assert [ranks[0][case]["kept"] for case in WORKER_CASES] == [ranks[0]["inf-and-some"]["kept"], 9, 0]
    assert 0 < ranks[0]["inf-and-some"]["kept"] < 9
    # a rank stepping on its own batch's gradient (a lost all-reduce) fails the rule
    print(f"DDP, rank 0's own gradient: {assert_inexact(local[0], *references, 'no all-reduce')}")


if __name__ == "__main__" and sys.argv[1:2] == ["ddp-worker"]:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    ddp_worker(sys.argv[2])
