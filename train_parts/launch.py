"""What the launch sets, not train.py's flags: mixed precision, the backend and DeepSpeed stage, the processes
(accelerate's config and `accelerate launch` flags). Recorded in each checkpoint and in final/'s card; a
resume's launch must be the checkpoint's.

Flags served: none of train.py's; the accelerate config's mixed_precision, distributed_type, the DeepSpeed
config's zero_stage and num_processes.
"""

__all__ = ["launch_facts", "launch_differences"]


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
