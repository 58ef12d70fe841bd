"""accelerate's FSDP on CPU processes, for tests only (never in train.py, never in the copied files).

accelerate 1.15 picks FSDP only for accelerator devices (`AcceleratorState.__init__`, accelerate/state.py): on
CPU processes an FSDP config runs as MULTI_CPU, a silent DDP, which train.py refuses. `install()` makes the
state FSDP after accelerate built it, with the plugin accelerate was given or built from the config's
environment, as it would on GPUs; `accelerator.prepare` then shards with fully_shard over gloo (parameters
DTensors, gradients reduce-scattered). A launched train.py gets it from a sitecustomize
(`sitecustomize_line`).
"""

import functools

__all__ = ["install", "sitecustomize_line"]


def install():
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "fsdp_on_cpu", False):
        return

    @functools.wraps(original)
    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            # as accelerate records its choice: each later AcceleratorState() copies PartialState's in
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init.fsdp_on_cpu = True
    AcceleratorState.__init__ = init


def sitecustomize_line():
    """What a sitecustomize.py says to install the shim (tests/ on the launched processes' PYTHONPATH)."""
    return "import fsdp_shim\n\nfsdp_shim.install()\n"
