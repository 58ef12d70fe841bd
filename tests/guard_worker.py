"""Run by tests/test_guards.py under torchrun with 2 CPU processes: one rank fails, every rank must agree.

Usage: torchrun --nproc_per_node 2 tests/guard_worker.py CASE OUT_DIR
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from test_gradcache import TinyEncoder, make_batch
from torch.nn.parallel import DistributedDataParallel

import gradcache


class FailingOnRank(torch.nn.Module):
    """Raises torch.OutOfMemoryError on `rank`, in stage 1 (no grad) or stage 3 (grad), as a GPU would."""

    def __init__(self, encoder, rank, stage):
        super().__init__()
        self.encoder, self.rank, self.stage = encoder, rank, stage

    def forward(self, features):
        failing_stage = 3 if torch.is_grad_enabled() else 1
        if dist.get_rank() == self.rank and failing_stage == self.stage:
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        return self.encoder(features)


def main(case, out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    encoder = TinyEncoder(dropout=0.0)
    if case.startswith("oom"):
        encoder = FailingOnRank(encoder, rank=1, stage=int(case[-1]))
    model = DistributedDataParallel(encoder)

    def loss_fn(*reps):
        loss = gradcache.contrastive_loss(*reps)
        return loss * float("nan") if case == "nan" and rank == 1 else loss

    def sync_context(is_last):
        return contextlib.nullcontext() if is_last else model.no_sync()

    outcome = {}
    try:
        with gradcache.refinements(reuse_last_chunk=False):
            report = gradcache.gradcache_step(
                model, make_batch(1, seed=rank), loss_fn, 4, sync_context=sync_context
            )
        outcome = {"skipped": report.skipped, "has_grad": any(p.grad is not None for p in model.parameters())}
    except gradcache.ChunkOutOfMemory as error:
        outcome = {"error": str(error)}
    dist.barrier()  # a rank that took another decision would leave the others waiting here or earlier
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()
    os._exit(0)  # gloo workers now and then abort in interpreter teardown, after their work is done


if __name__ == "__main__":
    main(*sys.argv[1:])
