"""Run by tests/test_trust.py under torchrun with 2 CPU processes holding uneven batches (5 and 3 rows): one
gradcache step with cross-process negatives over DDP, its loss and gradients saved to OUT_DIR/rank<r>.pt.

Usage: torchrun --nproc_per_node 2 tests/offsets_worker.py OUT_DIR
"""

import contextlib
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from test_gradcache import TinyEncoder, make_column
from torch.nn.parallel import DistributedDataParallel

import gradcache

ROWS = (5, 3)  # uneven: rank 1's rows start at 5, not at 3


def uneven_batch(rank):
    """Rank `rank`'s anchors, positives and hard negatives: ROWS[rank] rows each, drawn from the rank."""
    generator = torch.Generator().manual_seed(rank)
    return [make_column(generator, ROWS[rank]) for _ in range(3)]


def main(out_dir):
    # A rank that took another path would leave the other waiting: fail in 30 s, not at the test's timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyEncoder(dropout=0.0))

    def sync_context(is_last):
        return contextlib.nullcontext() if is_last else model.no_sync()

    report = gradcache.gradcache_step(
        model, uneven_batch(rank), gradcache.contrastive_loss, 2, sync_context=sync_context,
        cross_process_negatives=True,
    )  # fmt: skip
    grads = {name: p.grad for name, p in model.module.named_parameters()}
    torch.save({"loss": report.loss, "grads": grads}, Path(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo workers now and then abort in interpreter teardown, after their work is done


if __name__ == "__main__":
    main(*sys.argv[1:])
