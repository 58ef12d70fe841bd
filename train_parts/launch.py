"""What the launch sets, not train.py's flags: mixed precision, the backend and DeepSpeed stage, the processes
(accelerate's config and `accelerate launch` flags). Recorded in each checkpoint and in final/'s card; a
resume's launch must be the checkpoint's.

Flags served: none of train.py's; the accelerate config's mixed_precision, distributed_type, the DeepSpeed
config's zero_stage and num_processes. A DeepSpeed config that accelerate would not run as DeepSpeed stops.
"""

import contextlib
import os

from accelerate import DistributedType
from accelerate.utils import broadcast_object_list

from .common import fail

__all__ = ["check_deepspeed_runs", "launch_facts", "launch_differences", "main_process_first"]


def check_deepspeed_runs(accelerator):
    """A DeepSpeed config that accelerate runs as something else stops in one line: with ACCELERATE_USE_CPU
    set (cpu_ddp_2proc.yaml's variable, left in a job's shell), accelerate runs its processes as plain DDP."""
    asked = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if asked and accelerator.distributed_type != DistributedType.DEEPSPEED:
        fail(
            "a DeepSpeed accelerate config, but accelerate runs these processes as "
            f"{accelerator.distributed_type.value}: ACCELERATE_USE_CPU="
            f"{os.environ.get('ACCELERATE_USE_CPU', '(unset)')} turns DeepSpeed off. Unset "
            "ACCELERATE_USE_CPU (DeepSpeed runs on CPUs with DS_ACCELERATOR=cpu), or launch "
            "cpu_ddp_2proc.yaml for DDP."
        )


def launch_facts(accelerator):
    """What the launch sets (its accelerate config and flags), not train.py's flags: mixed precision, the
    backend and DeepSpeed stage, the processes. Saved in each checkpoint; a resume's must be the same."""
    plugin = accelerator.state.deepspeed_plugin
    return {
        "mixed_precision": str(accelerator.mixed_precision),
        "distributed_type": accelerator.distributed_type.value,
        "zero_stage": plugin.zero_stage if plugin else None,
        "processes": accelerator.num_processes,
    }


def launch_differences(state, facts):
    """`facts` (launch_facts) that differ from a checkpoint's, as 'mixed_precision bf16 (this launch: no)'; a
    checkpoint older than these records only its processes."""
    saved = state.get("launch", facts) | {"processes": state["processes"]}
    return [f"{k} {saved[k]} (this launch: {v})" for k, v in facts.items() if saved[k] != v]


@contextlib.contextmanager
def main_process_first(accelerator):
    """accelerate's main_process_first (the main process fills a cache, the others then read it), but when the
    main process fails inside, the others stop quietly (their line goes to torchrun's summary alone): its
    error line is the run's, where they failed in the barrier with a gloo traceback printed before it."""
    if not accelerator.is_main_process:
        if broadcast_object_list([None])[0]:  # waits for the main process's outcome
            raise SystemExit("train.py: stopped with the main process, whose error line is the run's")
        yield
        return
    try:
        yield
    except BaseException:
        broadcast_object_list([True])
        raise
    broadcast_object_list([False])
