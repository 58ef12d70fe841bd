"""Run by tests/test_trust.py under torchrun with 2 CPU processes holding uneven batches (5 and 3 rows):
gradcache steps with cross-process negatives over DDP, plain, with false-negative masks (masked_ids), and
in chunks of 1 (rank 1 then pads), and with a loss not finite on rank 1 alone; their losses, gradients
and skip decisions saved to OUT_DIR/rank<r>.pt.

Usage: torchrun --nproc_per_node 2 tests/offsets_worker.py OUT_DIR
"""

import contextlib
import datetime
import functools
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


def masked_ids():
    """(ids of each column's texts, each row's other right answers) of the 8 global rows, as train.py gathers
    them: row 6 (rank 1's second) repeats row 1's anchor; row 2's other right answers are row 6's positive
    and row 0's hard negative, and row 7's is row 1's positive: masks across the processes' boundary."""
    anchors, positives, negatives = torch.arange(8), 100 + torch.arange(8), 200 + torch.arange(8)
    anchors[6] = 1
    others = torch.full((8, 2), -1)
    others[2], others[7, 0] = torch.tensor([106, 200]), 101
    return [anchors, positives, negatives], others


def not_finite_on_rank_1(*reps, **options):
    """contrastive_loss, NaN on rank 1 alone: every process must skip the step."""
    loss = gradcache.contrastive_loss(*reps, **options)
    return loss * float("nan") if dist.get_rank() == 1 else loss


def main(out_dir):
    # A rank that took another path would leave the other waiting: fail in 30 s, not at the test's timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyEncoder(dropout=0.0))

    def sync_context(is_last):
        return contextlib.nullcontext() if is_last else model.no_sync()

    ids, others = masked_ids()
    masks = gradcache.FalseNegatives(ids=ids, other_positives=others)
    masked = functools.partial(gradcache.contrastive_loss, false_negatives=masks, symmetric=True)
    cases = {  # (loss, chunk size, cross-process negatives): chunks of 1 leave rank 1 two padding chunks
        "plain": (gradcache.contrastive_loss, 2, True),
        "masked": (masked, 2, True),
        "padded": (gradcache.contrastive_loss, 1, True),
        # Each process sees its own loss alone. Last: a process that decided alone would hang the other.
        "one_skips": (not_finite_on_rank_1, 2, False),
    }
    results = {}
    for name, (loss_fn, chunk_size, cross_process_negatives) in cases.items():
        report = gradcache.gradcache_step(
            model, uneven_batch(rank), loss_fn, chunk_size, sync_context=sync_context,
            cross_process_negatives=cross_process_negatives,
        )  # fmt: skip
        grads = {name: p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None}
        results[name] = {"loss": report.loss, "grads": grads, "skipped": report.skipped}
        model.zero_grad()
    torch.save(results, Path(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo workers now and then abort in interpreter teardown, after their work is done


if __name__ == "__main__":
    main(*sys.argv[1:])
