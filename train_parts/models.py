"""The model: located, loaded as the sentence-transformers class it was saved as, prepared for training
(pooling, sequence length, similarity, LoRA, gradient checkpointing, towers, prompts); its tokenizer checked.

Flags served: --model, --pooling, --max_seq_length, --similarity, --matryoshka_dims (its width check),
--lora_*, --gradient_checkpointing, --trust_remote_code, --model_dtype, --attn_implementation,
--query_prompt, --document_prompt, --guide_model.
"""

import contextlib
import dataclasses
import json
from pathlib import Path

import huggingface_hub
import torch
from sentence_transformers import MultiVectorEncoder, SentenceTransformer, SparseEncoder
from sentence_transformers.base.modules import Router
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import load_file_path
from transformers import PreTrainedModel

import gradcache

from .common import fail, hub_out_of_reach, is_hub_name

# fmt: off
__all__ = [
    "ModelFlags", "locate_model", "load_model", "model_options", "prepare_model", "transformers_models",
    "load_guide", "role_prompts", "tokenize", "role_task", "training_module", "Towers", "is_router",
    "gathered_parameters", "check_tokenizers", "representation",
]
# fmt: on


@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """The flags that load and prepare the model (`common.flags_of(ModelFlags, args)`)."""

    model: str
    pooling: str | None = None
    max_seq_length: int | None = None
    similarity: str | None = None
    matryoshka_dims: tuple | None = None
    lora_r: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    model_dtype: str = "float32"
    attn_implementation: str | None = None


def locate_model(name):
    """Whether --model loads from the local cache alone: a hub name while the hub is out of reach. A name that
    is no folder and no hub name, or then not in the cache, stops at once, in one line."""
    if Path(name).expanduser().is_dir():
        return False
    if not is_hub_name(name):
        fail(f"--model: no such file or folder: {name}. Pass a model folder, or a hub name (org/name).")
    if not (offline := hub_out_of_reach()):
        return False
    try:
        huggingface_hub.snapshot_download(name, local_files_only=True)
    except huggingface_hub.errors.LocalEntryNotFoundError:
        fail(
            f"--model: no such file or folder: {name}, nor a hub model of that name in the local cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}); the hub is out of reach ({offline}). Check the "
            "path, or download the model where there is network."
        )
    return True


def load_model(name, device, pooling=None, say=print, flag="--model", **options):
    """--model as the class it was saved as (MODEL_CLASSES; else a SentenceTransformer): a folder, or a hub
    name (from the local cache alone when the hub is out of reach). A transformers model without
    sentence-transformers' modules.json pools as --pooling says: it is refused without it, never pooled by
    a silent guess. `options`: SentenceTransformer's keywords (model_options); `flag` names it in errors."""
    local_only, folder = locate_model(name), Path(name).expanduser()
    source = str(folder) if folder.is_dir() else name
    if folder.is_dir() and not any((folder / file).is_file() for file in ("modules.json", "config.json")):
        fail(f"{flag} {name}: not a model folder (no modules.json, no config.json).")
    try:  # a gated or missing hub repository too; modules.json looked up as sentence-transformers does
        plain = load_file_path(source, "modules.json", local_files_only=local_only) is None
        if plain and not pooling:
            fail(
                f"{flag} {name} is a transformers model without sentence-transformers' modules.json, so "
                "nothing says how to pool its tokens into one embedding: add --pooling mean, cls or "
                "lasttoken, as the model was trained (lasttoken for decoder embedders)."
            )
        if pooling and not plain:
            fail(f"--pooling {pooling}: --model {name} pools as its modules.json says. Drop --pooling.")
        kind = check_loadable(name, source, local_only, options.get("trust_remote_code", False), flag)
        model_class = MODEL_CLASSES.get(kind, SentenceTransformer)  # as it was saved
        model = model_class(source, device=device, local_files_only=local_only, **options)
    except OSError as err:
        fail(f"{flag} {name} could not be loaded ({err}).")
    except (ValueError, ImportError) as err:  # transformers': custom code check_loadable missed, a kernel
        fail(f"{flag} {name} could not be loaded: {str(err).splitlines()[0]}")
    check_tokenizers(model, f"{flag} {name}")
    if pooling:  # in place of sentence-transformers' guess: mean, or lasttoken for a causal language model
        index = next(i for i, module in enumerate(model) if isinstance(module, Pooling))
        model[index] = Pooling(model[index].embedding_dimension, pooling)
        say(f"train.py: --model {name}: {pooling} pooling (--pooling), saved in final/")
    return model


# The classes a model folder says it is (config_sentence_transformers.json's model_type) that train.py trains.
MODEL_CLASSES = {cls.__name__: cls for cls in (SentenceTransformer, SparseEncoder, MultiVectorEncoder)}


def check_tokenizers(model, named):
    """Stop where a tokenizer is far smaller than the embeddings it feeds: transformers loads a folder without
    tokenizer files with a 5-token stand-in, and every word would train as [UNK]."""
    for module in model.modules():
        if getattr(module, "tokenizer", None) is not None and hasattr(module, "auto_model"):
            tokens, rows = len(module.tokenizer), module.auto_model.get_input_embeddings().num_embeddings
            if tokens < rows / 2:
                fail(
                    f"{named}: its tokenizer has {tokens} tokens for the model's {rows} embedding rows (no "
                    f"tokenizer files in {module.auto_model.name_or_path}?). Add the base model's tokenizer "
                    "files there (tokenizer.json and tokenizer_config.json: tokenizer.save_pretrained)."
                )


def model_options(flags):
    """SentenceTransformer's keywords for --trust_remote_code, --model_dtype and --attn_implementation. The
    dtype always: transformers 5 would load a checkpoint saved in bfloat16 in bfloat16 ("auto")."""
    model_kwargs = {"dtype": getattr(torch, flags.model_dtype)}
    if flags.attn_implementation:
        model_kwargs["attn_implementation"] = flags.attn_implementation
    return {"trust_remote_code": flags.trust_remote_code, "model_kwargs": model_kwargs}


def check_loadable(name, source, local_only, trust_remote_code, flag="--model"):
    """The class --model was saved as (MODEL_CLASSES). Stop in one line, before
    loading, where it is another (sentence-transformers would rebuild a CrossEncoder as a mean-pooled
    bi-encoder of its base, silently), or ships code of its own (a module class, an auto_map) without
    --trust_remote_code."""

    def read(file):
        path = load_file_path(source, file, local_files_only=local_only)
        return json.loads(Path(path).read_text()) if path else {}

    kind = read("config_sentence_transformers.json").get("model_type", "SentenceTransformer")
    if kind not in MODEL_CLASSES:
        fail(
            f"{flag} {name} is a {kind} (config_sentence_transformers.json): train.py trains bi-encoders "
            f"({', '.join(MODEL_CLASSES)}). Pass one, or a transformers model with --pooling."
        )
    for module in read("modules.json") or [{"path": "", "type": "sentence_transformers"}]:
        folder = f"{module['path']}/" if module["path"] else ""
        maps = {
            file: read(folder + file).get("auto_map") for file in ("config.json", "tokenizer_config.json")
        }
        code = [f"{folder}{file} auto_map" for file, auto_map in maps.items() if auto_map]
        if not module["type"].startswith("sentence_transformers"):
            code.append(f"modules.json: {module['type']}")
        if code and not trust_remote_code:
            fail(f"{flag} {name} runs code of its own ({code[0]}): add --trust_remote_code if you trust it.")
    return kind


def prepare_model(model, flags):
    """The model as trained, as the flags set it: its sequence length, similarity and Matryoshka dimensions,
    a LoRA adapter, gradient checkpointing; in training mode, refused if it mixes the examples of a batch."""
    model.max_seq_length = flags.max_seq_length or model.max_seq_length
    width = model.get_embedding_dimension()
    if too_large := [dim for dim in flags.matryoshka_dims or () if dim > width]:
        dims, example = ",".join(map(str, flags.matryoshka_dims)), ",".join(str(width >> k) for k in range(4))
        fail(
            f"--matryoshka_dims {dims}: {too_large} larger than the model's {width} dimensions. Use "
            f"dimensions up to {width}, e.g. {example}."
        )
    if flags.similarity:
        model.similarity_fn_name = {"cos": "cosine", "dot": "dot"}[flags.similarity]
    elif model.similarity_fn_name not in ("cosine", "dot") and not isinstance(model, MultiVectorEncoder):
        fail(
            f"--model scores by {model.similarity_fn_name} similarity; the loss scores by cosine or dot "
            "product: pass --similarity cos or --similarity dot (the saved model will use it too)."
        )
    transformers = transformers_models(model)
    if (flags.lora_r or flags.gradient_checkpointing) and not transformers:
        fail("--lora_r and --gradient_checkpointing need a model with a transformers module (Transformer).")
    if flags.lora_r:
        add_lora_adapters(transformers, flags)
    if flags.gradient_checkpointing:
        enable_gradient_checkpointing(transformers)
    model.train()  # sentence-transformers loads in eval mode, where BatchNorm would pass the check below
    try:
        gradcache.check_examples_independent(model)
    except ValueError as err:
        fail(f"--model {flags.model}: {err}")
    return model


def transformers_models(model):
    """The model's outermost transformers models: a SPLADE's BertForMaskedLM holds a BertModel, and both are
    PreTrainedModels; an adapter goes on the outer one alone (one tower of a Router each)."""
    found = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    inner = {id(sub) for module in found for sub in module.modules() if sub is not module}
    return [module for module in found if id(module) not in inner]


def add_lora_adapters(transformers, flags):
    """A LoRA adapter on each transformers module (one per tower of a Router model), as --lora_* say."""
    try:
        from peft import LoraConfig
    except ImportError:
        fail("--lora_r needs peft: pip install peft")
    targets = flags.lora_target_modules
    config = LoraConfig(
        r=flags.lora_r,
        lora_alpha=flags.lora_alpha or 2 * flags.lora_r,
        lora_dropout=flags.lora_dropout,
        target_modules=targets if targets == "all-linear" else targets.split(","),
    )
    for transformer in transformers:
        # adapter_config.json names the base model as loaded: a local folder as typed would load final/
        # only from the launch folder, so make it absolute (a hub name stays one).
        if Path(transformer.name_or_path).exists():
            transformer.name_or_path = str(Path(transformer.name_or_path).resolve())
        transformer.add_adapter(config)  # freezes the other weights; model.save writes the adapter
        for parameter in transformer.parameters():  # on a --model_dtype base: AdamW's updates need float32
            if parameter.requires_grad and parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()


def enable_gradient_checkpointing(transformers):
    """Recompute each chunk's activations in backward; not the reentrant variant, which back-propagates
    nothing when a layer's inputs need no gradient (LoRA). activation_checkpointing_*: transformers 5.x."""
    for transformer in transformers:
        if hasattr(transformer, "activation_checkpointing_enable"):
            transformer.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            transformer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_guide(name, accelerator, trust_remote_code=False):
    """The --guide_model, frozen, whole on every process: under ZeRO-3 transformers would load it partitioned
    (its DeepSpeed config, which accelerate registers, says stage 3), and nothing would gather it."""
    if not name:
        return None
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        device = str(accelerator.device)
        guide = load_model(name, device, flag="--guide_model", trust_remote_code=trust_remote_code)
    finally:
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None and getattr(plugin, "dschf", None) is not None:
            set_hf_deepspeed_config(plugin.dschf)  # as accelerate left it
    return guide.eval().requires_grad_(False)


def role_prompts(model, query_prompt=None, document_prompt=None):
    """{"query": prompt, "document": prompt}: the flags, else the prompts encode_query and encode_document
    would use (the model's "query", then "document", "passage" or "corpus", then its default prompt)."""

    def declared(*names):
        name = next((name for name in names if name in model.prompts), model.default_prompt_name)
        return model.prompts.get(name) if name else None

    query = declared("query") if query_prompt is None else query_prompt
    document = declared("document", "passage", "corpus") if document_prompt is None else document_prompt
    return {"query": query or None, "document": document or None}  # "" is no prompt


def tokenize(model, texts, column, prompts, padding=True):
    """A column's texts -> the model's input: the one place where texts become tokens. Sentence-transformers
    prepends the role's prompt (and records its length, for a Pooling with include_prompt=False), and a
    Router model routes by the task. Padded to the longest text, or with padding=False lists of token ids,
    which count the tokens the model receives; truncated to the model's max_seq_length either way."""
    task = role_task(column)
    unpadded = {"processing_kwargs": {"text": {"padding": False}, "common": {"return_tensors": None}}}
    return model.preprocess(texts, prompt=prompts[task], task=task, **({} if padding else unpadded))


def role_task(column):
    """The anchors are queries; positives and negatives documents (a Router model routes by this task)."""
    return "query" if column == "anchor" else "document"


def training_module(model, sources):
    """What accelerate wraps for training: Towers for a Router model, and for any model when a source
    (`source_settings`) has no in-batch negatives (its chunks of rows encode every column before one
    backward); the model itself otherwise."""
    grouped = is_router(model) or isinstance(model, MultiVectorEncoder)
    grouped = grouped or any(source.in_batch_negatives == "off" for source in sources)
    return Towers(model) if grouped else model


class Towers(torch.nn.Module):
    """A model (a Router's query and document towers; a multi-vector model, whose masks differ for queries)
    encoding one group of chunks in one forward, each chunk's `representation`.

    gradcache back-propagates one chunk of every column together, so every backward reaches both towers (as
    ZeRO-3 needs). DDP with find_unused_parameters reads the parameters a backward will reach from the output
    of the forward before it: one call per column would leave the query tower "unused" after the document
    call, then find its gradients too ("marked as ready twice"). One call for the group keeps one all-reduce.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs, columns):  # column 0 holds the anchors, the queries
        return [
            representation(self.model(features, task="query" if c == 0 else "document"))
            for features, c in zip(inputs, columns, strict=True)
        ]


def representation(output):
    """What gradcache caches of a text: its embedding, or a multi-vector model's token matrix with its scoring
    mask (MultiVectorMask's: padding and skip-list words out) as a last channel."""
    if "sentence_embedding" in output:
        return output["sentence_embedding"]
    vectors = output["token_embeddings"]
    return torch.cat([vectors, output["attention_mask"][..., None].to(vectors.dtype)], dim=-1)


def is_router(model):
    return any(isinstance(module, Router) for module in model.modules())


def gathered_parameters(model):
    """Under ZeRO-3 (parameters partitioned by DeepSpeed, which marks them with `ds_id`), DeepSpeed's
    GatheredParameters makes every parameter whole on every process; under FSDP2 every fully_shard unit is
    unsharded (`unsharded`); otherwise nothing to do."""
    parameters = list(model.parameters())
    units = [module for module in model.modules() if hasattr(module, "set_requires_gradient_sync")]
    if units:
        return unsharded(units)
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(parameters, modifier_rank=None)


@contextlib.contextmanager
def unsharded(units):
    """FSDP2's units (FSDPModule) all-gathered on every process, their modules holding whole parameters (which
    state_dict and save read), sharded again after. Gathered here, not first in sentence-transformers'
    inference_mode, where the whole parameters made would be inference tensors that training cannot use."""
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
