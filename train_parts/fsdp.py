"""FSDP2 (PyTorch's fully_shard, accelerate's `fsdp_version: 2`): the launch checked, each transformer layer
its own unit, and Gradient Cache's sync context: gradients reduce-scattered once per optimizer step.

Flags served: none of train.py's; the accelerate config's distributed_type FSDP, fsdp_version and
fsdp_transformer_layer_cls_to_wrap (accelerate_configs/fsdp2.yaml), with --gradient_accumulation_steps.
"""

import collections
import contextlib
import os

import torch
from accelerate import DistributedType

import gradcache

from .common import fail
from .models import transformers_models

__all__ = ["check_launch", "collective_passes", "prepare", "sync_context", "complete_optimizer_state"]


def check_launch(accelerator):
    """Stops, in one line, an FSDP1 config, and an FSDP config that accelerate runs as something else: on CPU
    processes it picks FSDP only for accelerator devices and silently falls back to DDP."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":  # accelerate's default is 1
        fail(
            "an FSDP1 accelerate config (fsdp_version: 1): train.py shards with FSDP2 (fully_shard). Launch "
            "with accelerate_configs/fsdp2.yaml, or set fsdp_version: 2 in your config."
        )
    if accelerator.distributed_type != DistributedType.FSDP:
        fail(
            "an FSDP accelerate config, but accelerate runs these processes as "
            f"{accelerator.distributed_type.value} (it picks FSDP only on GPUs and other accelerators: on "
            "CPUs it falls back to DDP). Launch it on GPUs, or on a CPU use "
            "accelerate_configs/cpu_ddp_2proc.yaml."
        )


def collective_passes(accelerator):
    """Whether every forward and backward is a collective (DeepSpeed's ZeRO, FSDP's all-gathers): a process
    out of memory cannot wait for the others to agree, and a step cannot be redone, since the backend holds
    gradients of its own that zero_grad does not clear."""
    return accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)


def prepare(accelerator, module, *others):
    """accelerator.prepare(module, *others); under FSDP2 with no layer class named in the config, each layer
    of the transformers models inside (their `_no_split_modules`: BertLayer, Qwen3DecoderLayer...) is its own
    fully_shard unit, as accelerate does for a bare transformers model: a sentence-transformers model names
    none, and the whole model would be one unit, gathered whole at every forward."""
    fsdp = accelerator.distributed_type == DistributedType.FSDP  # else the state has no fsdp_plugin
    if fsdp and accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap is None:
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = layer_classes(module)
    return accelerator.prepare(module, *others)


def layer_classes(module):
    """The names of the layer classes of the transformers models in `module`, but those holding a parameter
    tied to one outside them (a SPLADE's BertEmbeddings: its word embeddings are the MLM head's decoder),
    which fully_shard refuses to put in two units."""
    names = {name for model in transformers_models(module) for name in model._no_split_modules or ()}
    uses = collections.Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    tied = {type(sub).__name__ for sub in module.modules() if any(uses[id(p)] > 1 for p in sub.parameters())}
    return sorted(names - tied)


def sync_context(accelerator, engine):
    """gradcache's `sync_context`: under FSDP2 only the last chunk of the last batch of an accumulation window
    reduce-scatters its gradients (`set_requires_gradient_sync`); the others accumulate unsharded gradients.
    accelerate's no_sync cannot nest: leaving it turns synchronization back on, inside accelerate's own
    accumulate() of a batch that must not synchronize. Elsewhere `gradcache.accelerate_sync_context`."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return gradcache.accelerate_sync_context(accelerator, engine)

    @contextlib.contextmanager
    def synchronizing(is_last):
        outer_sync = accelerator.sync_gradients
        accelerator.sync_gradients = outer_sync and is_last
        engine.set_requires_gradient_sync(outer_sync and is_last)
        try:
            yield
        finally:
            accelerator.sync_gradients = outer_sync
            engine.set_requires_gradient_sync(outer_sync)

    return synchronizing


def complete_optimizer_state(accelerator, optimizer):
    """Under FSDP2, after the first update: optimizer state for the parameters that had no gradient (a BERT's
    pooler under mean pooling), as torch's distributed checkpoint gives every parameter when it loads one
    (`_init_optim_state`: a step at learning rate 0 on zero gradients). Without it, a checkpoint holds no
    state for them and its resume stops with "Missing key in checkpoint state_dict: optimizer.state...".
    Done once, in every run alike, so that a resumed run continues the uninterrupted one bit for bit."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch optimizer
    if accelerator.distributed_type != DistributedType.FSDP or not optimizer.state:  # no update yet
        return
    stateless = [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad and not optimizer.state.get(p)
    ]
    if not stateless:
        return
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for parameter in stateless:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for group, learning_rate in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = learning_rate
    for parameter in stateless:
        parameter.grad = None
