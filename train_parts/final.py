"""final/: the trained model saved whole (gathered under ZeRO-3; with --merge_lora, the adapter merged in),
with a model card of this fine-tune, written by sentence-transformers' own card machinery (`model_card_data`):
never the base model's card, which sentence-transformers would copy.

Flags served: --merge_lora; the card shows every flag and the numbers derived from them (`describe_training`).
"""

import contextlib
import json
import shlex

import torch

from .common import is_hub_name
from .models import gathered_parameters, transformers_models

__all__ = ["describe_training", "save_final_model", "merge_lora_adapters", "loading_class"]

# The flags of the loss, shown with it on the card (those that do not apply are left out: None).
LOSS_FLAGS = ("scale", "similarity", "symmetric", "cross_process_negatives", "mask_repeated_texts")
LOSS_FLAGS += ("false_negative_margin", "false_negative_margin_strategy", "guide_model", "guide_margin")
LOSS_FLAGS += ("distill_temperature", "matryoshka_dims", "matryoshka_weights", "loss_tile_size")
LOSS_FLAGS += ("sparse_query_weight", "sparse_document_weight", "sparse_warmup_ratio")
NOT_SHOWN = ("command", "named_by_default", "run_name", "output_dir")  # the command shows them


def describe_training(model, config, sources, evaluations, default):
    """The card of this fine-tune in model.model_card_data, which model.save writes as final/README.md.

    `config`: the run's settings as printed at its start (flags, defaults resolved, derived numbers);
    `sources`: per --data source, (name, examples, text columns, --in_batch_negatives, --distill_weight);
    `evaluations`: {step: the dev metrics, or None}, before and after training; `default(flag)`: its default
    (a number derived from the flags has none, and shows with the flags set)."""
    card = model.model_card_data
    card.local_files_only = True  # no network at run time: the hub is not asked about the base model
    card.generate_widget_examples = False  # no forward on the main process alone (under ZeRO-3: a hang)
    card.add_tags(["generated_from_trainer", "gradcache"])  # a card of its own, not the loaded one
    base = config["model"]
    card.base_model = base if is_hub_name(base) and not base.startswith(("/", ".")) else None
    card.model_name = f"{base.rstrip('/').split('/')[-1]} fine-tuned with Gradient Cache (train.py)"
    loss = {name: config[name] for name in LOSS_FLAGS if config.get(name) not in (None, "", (), [])}
    card.train_datasets = [
        {"name": name, "size": size, "columns": columns, "loss": {
            "fullname": f"gradcache.{'contrastive' if in_batch == 'on' else 'group'}_loss",
            "config_code": json_block(loss | {"in_batch_negatives": in_batch, "distill_weight": distill}),
        }}
        for name, size, columns, in_batch, distill in sources
    ]  # fmt: skip
    shown = {k: v for k, v in config.items() if k not in NOT_SHOWN}
    card.non_default_hyperparameters = {k: v for k, v in shown.items() if v != default(k)}
    card.non_default_hyperparameters["command"] = shlex.join(["train.py", *config["command"]])
    card.all_hyperparameters = shown
    card.training_logs = [
        {"Step": step} | {k.removeprefix("eval/"): round(v, 4) for k, v in metrics.items() if "@10" in k}
        for step, metrics in evaluations.items()
        if metrics
    ]


def json_block(settings):
    return f"```json\n{json.dumps(settings, indent=2, default=str)}\n```"


def save_final_model(accelerator, model, path, merge_lora=False):
    """Save in sentence-transformers format. Under ZeRO-3 every process gathers the partitioned parameters
    and the main process saves them whole.

    transformers' save_pretrained writes back the checkpoint names each weight renaming it applied at load.
    Its ZeRO-3 loader keeps every renaming it knows, used or not, so LayerNorm weights would be saved as the
    legacy gamma/beta; keep those that matched, as its ordinary loader does: the same names from all backends.
    """
    for module in model.modules():
        if renamings := getattr(module, "_weight_conversions", None):
            module._weight_conversions = [renaming for renaming in renamings if renaming.was_used()]
    fsdp2 = getattr(accelerator, "is_fsdp2", False)  # accelerate 1.0 has no FSDP2
    with whole_weights(accelerator, model) if fsdp2 else gathered_parameters(model):
        if accelerator.is_main_process:
            if merge_lora:
                merge_lora_adapters(model)
            model.save(str(path))
    accelerator.wait_for_everyone()


@contextlib.contextmanager
def whole_weights(accelerator, model):
    """FSDP2: the full state dict (accelerator.get_state_dict, every process gathering) in place of the main
    process's sharded parameters while it saves, put back after. The parameters fully_shard unshards are
    views into its gather buffer, which safetensors cannot read ("invalid python storage")."""
    state = accelerator.get_state_dict(model)
    sharded = {}
    if accelerator.is_main_process:
        for name, tensor in state.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            slots = module._parameters if leaf in module._parameters else module._buffers
            sharded[name] = (slots, leaf, slots[leaf])
            slots[leaf] = (
                torch.nn.Parameter(tensor, requires_grad=False) if slots is module._parameters else tensor
            )
    try:
        yield
    finally:
        for slots, leaf, original in sharded.values():
            slots[leaf] = original


def merge_lora_adapters(model):
    """Fold every LoRA adapter into the weights it adapts (peft's merge, then the base layer back in place):
    the model saves as a plain one, which loads without peft. Training ends here: the adapter is gone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for transformer in transformers_models(model):
        for name, layer in list(transformer.named_modules()):
            if isinstance(layer, BaseTunerLayer):
                layer.merge()
                parent, _, attribute = name.rpartition(".")
                setattr(transformer.get_submodule(parent), attribute, layer.get_base_layer())
        transformer._hf_peft_config_loaded = False  # else save_pretrained writes the adapter alone
        del transformer.peft_config


def loading_class(model):
    """The sentence-transformers class that loads the saved model (SentenceTransformer, SparseEncoder,
    MultiVectorEncoder): FSDP2's fully_shard swaps the model's class for FSDP<class>."""
    return next(cls for cls in type(model).__mro__ if cls.__module__.startswith("sentence_transformers"))
