"""gradcache_step's guards: a non-finite loss or gradient is never back-propagated, a chunk that runs out of
memory raises ChunkOutOfMemory naming the chunk size to use, and in several processes every rank agrees."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from references import materialized_contrastive_loss
from test_gradcache import TinyEncoder, assert_gradients_exact, make_batch, unchunked_reference

import gradcache

TESTS = Path(__file__).parent


class CountingSync:
    """A sync_context that counts contexts left open (accelerate's sync flag must always be restored)."""

    def __init__(self):
        self.open = 0

    @contextlib.contextmanager
    def __call__(self, is_last):
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


def nan_loss(*reps):
    return gradcache.contrastive_loss(*reps) * float("nan")


def inf_gradient_loss(anchor, positive):
    """Finite value, infinite gradient: d sqrt(x)/dx at x = 0."""
    first = anchor[0, 0]
    return gradcache.contrastive_loss(anchor, positive) + torch.sqrt(first - first.detach())


@pytest.mark.parametrize("loss_fn", [nan_loss, inf_gradient_loss], ids=["nan-loss", "inf-gradient"])
def test_non_finite_step_is_skipped_before_any_backward(loss_fn):
    encoder = TinyEncoder(dropout=0.0)
    backward_calls = []
    sync = CountingSync()
    report = gradcache.gradcache_step(
        encoder, make_batch(0), loss_fn, 5, backward=backward_calls.append, sync_context=sync
    )
    assert report.skipped
    assert backward_calls == [] and sync.open == 0
    assert all(p.grad is None for p in encoder.parameters())


class OutOfMemoryAbove(torch.nn.Module):
    """Raises torch.OutOfMemoryError, as CUDA would, for chunks larger than `limit` in the given stages."""

    def __init__(self, encoder, limit, grad_only=False):
        super().__init__()
        self.encoder, self.limit, self.grad_only = encoder, limit, grad_only

    def forward(self, features):
        too_big = len(features["input_ids"]) > self.limit
        if too_big and (torch.is_grad_enabled() or not self.grad_only):
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        return self.encoder(features)


@pytest.mark.parametrize("grad_only", [False, True], ids=["stage-1", "stage-3"])
def test_out_of_memory_names_the_chunk_size_to_use_and_a_smaller_chunk_is_exact(grad_only):
    torch.manual_seed(0)
    encoder = OutOfMemoryAbove(TinyEncoder(dropout=0.0), limit=3, grad_only=grad_only)
    sync = CountingSync()
    columns = make_batch(1)
    with pytest.raises(
        gradcache.ChunkOutOfMemory, match="chunk of 8 examples ran out of memory.*chunk size of 4"
    ):
        gradcache.gradcache_step(encoder, columns, gradcache.contrastive_loss, 8, sync_context=sync)
    assert sync.open == 0

    for parameter in encoder.parameters():
        parameter.grad = None  # what the trainer does before it redoes the step
    report = gradcache.gradcache_step(encoder, columns, gradcache.contrastive_loss, 3, sync_context=sync)

    def reference(copies, cast):  # the initial weights: a step leaves them as they were
        return unchunked_reference(copies * 3, columns, materialized_contrastive_loss)

    assert_gradients_exact(
        [encoder.encoder], reference, report.loss, f"redone with chunks of 3 ({grad_only=})"
    )


class Forwards(torch.nn.Module):
    """Counts its forwards; raises torch.OutOfMemoryError, as CUDA would, at the `out_of_memory_at`-th."""

    def __init__(self, encoder, out_of_memory_at=0):
        super().__init__()
        self.encoder, self.calls, self.out_of_memory_at = encoder, 0, out_of_memory_at

    def forward(self, features):
        self.calls += 1
        if self.calls == self.out_of_memory_at:
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        return self.encoder(features)


@pytest.mark.parametrize("budget", [None, 2**40], ids=["last-group-kept", "all-kept"])
def test_interrupt_is_asked_before_every_forward_out_of_memory_or_not(budget):
    """A signal stops a step at its next group (train.py's `interrupt` is an all-reduce across processes),
    so every process must ask as often: before each group of stage 1 and each re-encoded one, also after
    running out of memory, when it computes nothing until the agreement. Told to stop at the k-th call,
    the step raises StepInterrupted there, having run k - 1 forwards."""
    columns = make_batch(1)
    groups = sum(-(-len(column["input_ids"]) // 2) for column in columns)  # chunks of 2, a group each
    asks = groups + (groups - 1 if budget is None else 0)  # stage 1, then the re-encoded groups

    def step(encoder, interrupt):
        return gradcache.gradcache_step(
            encoder, columns, chunk_size=2, graph_budget=budget, interrupt=interrupt
        )

    asked = Asked()
    step(Forwards(TinyEncoder(0.0)), asked)
    assert asked.calls == asks
    # Where it asks (train.py shows it on the progress bar): stage 1's groups, then the re-encoded ones.
    reencoded = asks - groups
    assert asked.where == [("encode", g, groups) for g in range(groups)] + [
        ("backward", g, reencoded) for g in range(reencoded)
    ]
    asked = Asked()
    with pytest.raises(gradcache.ChunkOutOfMemory):
        step(Forwards(TinyEncoder(0.0), out_of_memory_at=3), asked)
    assert asked.calls == groups  # the groups after the out-of-memory asked too
    for stop_at in (1, asks // 2, asks):
        encoder, asked = Forwards(TinyEncoder(0.0)), Asked(stop_at)
        with pytest.raises(gradcache.StepInterrupted):
            step(encoder, asked)
        assert encoder.calls == stop_at - 1 and asked.calls == stop_at


class Asked:
    """An interrupt that counts its calls, notes where each asks (stage, group, groups), and says stop at the
    `stop_at`-th (0: never)."""

    def __init__(self, stop_at=0):
        self.calls, self.stop_at, self.where = 0, stop_at, []

    def __call__(self, stage, group, groups):
        self.calls += 1
        self.where.append((stage, group, groups))
        return self.calls == self.stop_at


def test_out_of_memory_in_the_kept_chunk_backward_is_reported(monkeypatch):
    backpropagate = gradcache.backpropagate_cache

    def failing_first_backward(group, reps, rep_grads, backward):
        if not failing_first_backward.called:
            failing_first_backward.called = True
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        backpropagate(group, reps, rep_grads, backward)

    failing_first_backward.called = False
    monkeypatch.setattr(gradcache, "backpropagate_cache", failing_first_backward)
    sync = CountingSync()
    with pytest.raises(gradcache.ChunkOutOfMemory, match="chunk of 5 examples"):
        gradcache.gradcache_step(
            TinyEncoder(dropout=0.0), make_batch(0), gradcache.contrastive_loss, 5, sync_context=sync
        )
    assert sync.open == 0


def test_an_out_of_memory_the_other_processes_cannot_learn_of_says_so():
    """Agreed: in a stage or a chunk before the backward that synchronizes. Not agreed: in that backward
    (the others wait in its all-reduce), or anywhere when the passes are collectives (ZeRO)."""
    columns = make_batch(1)

    def raised(encoder, **options):
        with pytest.raises(gradcache.ChunkOutOfMemory) as error:
            gradcache.gradcache_step(encoder, columns, gradcache.contrastive_loss, 4, **options)
        return error.value.agreed

    stage_1 = OutOfMemoryAbove(TinyEncoder(dropout=0.0), limit=3)
    assert raised(stage_1) and not raised(stage_1, agree_on_out_of_memory=False)

    class OutOfMemoryInForwardWithGrad(torch.nn.Module):
        def __init__(self, nth):
            super().__init__()
            self.encoder, self.nth, self.calls = TinyEncoder(dropout=0.0), nth, 0

        def forward(self, features):
            self.calls += torch.is_grad_enabled()
            if self.calls == self.nth:
                raise torch.OutOfMemoryError("CUDA out of memory (test double)")
            return self.encoder(features)

    # 3 columns of 12 in chunks of 4: 9 chunks. Forwards with grad: the chunk kept in stage 1, then the 8
    # re-encoded ones, of which the last synchronizes.
    assert raised(OutOfMemoryInForwardWithGrad(nth=8))
    assert not raised(OutOfMemoryInForwardWithGrad(nth=9))
    assert not raised(OutOfMemoryInForwardWithGrad(nth=3), agree_on_out_of_memory=False)


@pytest.mark.parametrize("case", ["nan", "oom1", "oom3"])
def test_every_process_takes_the_same_decision(case, tmp_path):
    """Rank 1 alone sees a NaN loss or runs out of memory; both ranks must skip or raise, and neither hang."""
    # --standalone: the rendezvous store binds a port of its own choosing, which no other launch can take
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, str(TESTS / "guard_worker.py"), case, str(tmp_path)]
    environment = {**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert result.returncode == 0, result.stderr[-3000:]
    if case == "nan":
        assert outcomes == [{"skipped": True, "has_grad": False}] * 2
    else:
        assert all("chunk of 4 examples ran out of memory" in outcome["error"] for outcome in outcomes)


@pytest.mark.parametrize(
    "backend, accelerator, expected",
    [
        ("gloo", None, "cpu"),
        ("nccl", "cuda", "cuda:0"),
        ("cpu:gloo,cuda:nccl", "cuda", "cpu"),
        ("mpi", "cuda", "cpu"),
    ],
)
def test_collectives_go_to_the_process_group_device(monkeypatch, backend, accelerator, expected):
    """NCCL refuses CPU tensors: the plan and guard agreements go where the process group computes, whatever
    device the columns (texts) or the encoders (a Router's callables) are on. No NCCL here: the process group
    and the accelerator are stand-ins."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: backend)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator is not None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device(accelerator or "cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    assert gradcache.collective_device() == torch.device(expected)

    asked, reduced = [], []
    monkeypatch.setattr(gradcache, "collective_device", lambda: asked.append(1) or torch.device("cpu"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op: reduced.append(tensor.tolist()))
    assert gradcache.largest_on_any_process([3, 1]) == [3, 1] and not gradcache.any_process(False)
    assert reduced == [[3, 1], [0]] and len(asked) == 2
