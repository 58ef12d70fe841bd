"""How a model loads: its own code only with --trust_remote_code, a LoRA base in --model_dtype, the attention
kernel of --attn_implementation, the model classes train.py does not train refused, and the families the
README lists, each as a tiny model of its architecture built here.
"""

import copy
import functools
import json

import pytest
import torch
from references import (
    StageOneRecorder,
    assert_exact,
    float64,
    materialized_contrastive_loss,
    parameter_gradients,
)
from test_any_model import COLUMNS, column_texts, trained_as
from test_gradcache import assert_gradients_exact, unchunked_reference
from test_train import (
    build_tiny_model,
    launch_deepspeed,
    run_main,
    weights,
    zero3_partitioning_everything,
)

import train

# ---------------------------------------------------------------------------------------------------------
from train_parts import models

# --trust_remote_code
# ---------------------------------------------------------------------------------------------------------

CONFIGURATION = """from transformers import BertConfig


class TinyConfig(BertConfig):
    model_type = "tiny-bert"
"""
MODELING = """from transformers import BertModel

from .configuration_tiny import TinyConfig


class TinyModel(BertModel):
    config_class = TinyConfig
"""


def build_custom_code_model(folder):
    """The tiny BERT of build_tiny_model as a model that ships its code: a BERT subclass of a model type
    transformers does not know, named by config.json's auto_map (as nomic-embed, gte-Qwen2 ship theirs)."""
    model = build_tiny_model(folder, dropout=0.0)
    (model / "configuration_tiny.py").write_text(CONFIGURATION)
    (model / "modeling_tiny.py").write_text(MODELING)
    config = json.loads((model / "config.json").read_text())
    config |= {"model_type": "tiny-bert", "architectures": ["TinyModel"]}
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModel": "modeling_tiny.TinyModel",
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def one_line_error(capsys, call, pattern):
    """`call` stops with one line (train.fail) matching `pattern`."""
    with pytest.raises(SystemExit, match=pattern) as stopped:
        call()
    assert "\n" not in str(stopped.value), str(stopped.value)
    return str(stopped.value)


def test_a_model_with_its_own_code_needs_trust_remote_code(tmp_path, data, monkeypatch, capsys):
    """Without the flag, one line before anything loads (transformers' own refusal is a ValueError of three
    lines under a traceback), for --model and for --guide_model."""
    custom = build_custom_code_model(tmp_path)
    expected = r"runs code of its own \(config.json auto_map\): add --trust_remote_code if you trust it\.$"
    one_line_error(capsys, lambda: models.load_model(str(custom), "cpu"), rf"--model {custom} {expected}")
    (tmp_path / "plain").mkdir()
    plain = build_tiny_model(tmp_path / "plain", dropout=0.0)
    run = ("--output_dir", tmp_path / "run", "--data", data[0], "--dev_data", "", "--batch_size", 8)
    with pytest.raises(SystemExit, match=rf"--guide_model {custom} {expected}"):
        run_main(monkeypatch, *run, "--model", plain, "--guide_model", custom, "--max_steps", 1)


@pytest.mark.parametrize("flags", [[], ["--lora_r", "4"]], ids=["full", "lora"])
def test_with_trust_remote_code_it_trains_saves_its_code_and_reloads(
    tmp_path, data, monkeypatch, capsys, flags
):
    from sentence_transformers import SentenceTransformer

    custom = build_custom_code_model(tmp_path)
    run = ("--output_dir", tmp_path / "run", "--model", custom, "--data", data[0], "--dev_data", "")
    run += ("--batch_size", 8, "--chunk_size", 4, "--max_steps", 2, "--lr", 1e-2, "--save_steps", 1, *flags)
    run_main(monkeypatch, *run, "--trust_remote_code", "--guide_model", custom)  # the guide's code too
    final = tmp_path / "run" / "final"
    assert "load it with SentenceTransformer(path, trust_remote_code=True)" in capsys.readouterr().out
    base = custom if flags else final  # a LoRA final/ names its base model, which holds the code
    assert (base / "modeling_tiny.py").is_file() and (base / "configuration_tiny.py").is_file()
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        SentenceTransformer(str(final), device="cpu")
    reloaded = SentenceTransformer(str(final), device="cpu", trust_remote_code=True)
    assert type(reloaded[0].auto_model).__name__ == "TinyModel"
    assert reloaded.encode(["w1 w2", "w3"], convert_to_tensor=True).shape == (2, 32)
    trained = reloaded.state_dict()
    if flags:
        assert max(float(value.abs().max()) for name, value in trained.items() if "lora_B" in name) > 0
    else:
        initial = SentenceTransformer(str(custom), device="cpu", trust_remote_code=True).state_dict()
        assert max((trained[n] - initial[n]).abs().max().item() for n in initial) > 1e-4
    # the checkpoint was written with the code trusted: resuming without the flag is refused
    with pytest.raises(
        SystemExit, match=r"--trust_remote_code True \(this launch: False\).*not this model's"
    ):
        run_main(monkeypatch, *run, "--max_steps", 3, "--resume_from_checkpoint", "latest")


def test_with_trust_remote_code_lora_trains_under_zero3_in_two_processes(tmp_path, data):
    """Two processes import the model's code (transformers copies it into its modules cache) and load the
    model partitioned; every parameter split, the frozen base too."""
    from sentence_transformers import SentenceTransformer

    custom = build_custom_code_model(tmp_path)
    launch_deepspeed(
        zero3_partitioning_everything(tmp_path), tmp_path / "run", "--model", custom, "--data", data[0],
        "--dev_data", "", "--batch_size", 8, "--chunk_size", 4, "--max_steps", 2, "--lr", 1e-2,
        "--wandb_mode", "disabled", "--lora_r", 4, "--trust_remote_code", processes=2,
    )  # fmt: skip
    reloaded = SentenceTransformer(str(tmp_path / "run" / "final"), device="cpu", trust_remote_code=True)
    assert type(reloaded[0].auto_model).__name__ == "TinyModel"
    trained = reloaded.state_dict()
    assert max(float(value.abs().max()) for name, value in trained.items() if "lora_B" in name) > 0


def test_a_checkpoint_older_than_the_model_flags_resumes_at_their_defaults(tmp_path, monkeypatch):
    """A trainer_state.json without --trust_remote_code and --model_dtype (written before they existed) is
    this launch's with their defaults: the resume check passes, and the launch stops at the next check."""
    flags = ["--model", "m", "--data", "x.jsonl"]
    saved = vars(train.parse_args(flags))
    del saved["trust_remote_code"], saved["model_dtype"]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"processes": 1, "args": saved}))
    with pytest.raises(SystemExit, match="no such file or folder: x.jsonl"):
        run_main(monkeypatch, *flags, "--output_dir", tmp_path / "run", "--resume_from_checkpoint", tmp_path)
    with pytest.raises(SystemExit, match=r"--model_dtype float32 \(this launch: bfloat16\)"):
        run_main(
            monkeypatch, *flags, "--lora_r", 8, "--model_dtype", "bfloat16",
            "--output_dir", tmp_path / "run2", "--resume_from_checkpoint", tmp_path,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# --model_dtype: the frozen base of a LoRA adapter in bfloat16
# ---------------------------------------------------------------------------------------------------------


def test_a_lower_precision_base_needs_lora(capsys):
    one_line_error(
        capsys,
        lambda: train.parse_args(["--model", "m", "--model_dtype", "bfloat16"]),
        r"--model_dtype bfloat16 is for the frozen base under --lora_r: the weights that train stay in "
        r"float32\. For lower-precision compute, pass --mixed_precision bf16 to accelerate launch\.$",
    )


def test_a_bfloat16_base_lora_step_is_exact_against_the_same_dtypes_on_the_full_batch(tmp_path):
    """The adapter trains in float32 on a bfloat16 base. The reference: the same model in the same dtypes (a
    deep copy), no gradient cache, the whole batch through one graph; the truth: that model cast to float64
    (bfloat16 values are exact in float64). references.py's rule with the bfloat16 reference in the float32
    reference's place: error(run, float64) <= 4 x error(bfloat16 reference, float64) + 1e-6. The bound then
    follows bfloat16's rounding (8 bits; the chunks pad otherwise than the full batch, so the two round
    differently), as the float32 rule follows float32's."""
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="decoder")
    model, args = trained_as(folder, ["--lora_r", "4", "--model_dtype", "bfloat16"])
    dtypes = {(p.dtype, p.requires_grad) for p in model.parameters()}
    assert dtypes == {(torch.bfloat16, False), (torch.float32, True)}  # the base frozen, the adapter float32
    torch.manual_seed(2)  # peft starts B at zero, where A gets no gradient: a random B tests both
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    prompts = models.role_prompts(model)
    columns = [models.tokenize(model, column_texts(i, 12), c, prompts) for i, c in enumerate(COLUMNS)]
    loss_fn = functools.partial(train.loss_function(args, model), symmetric=True)
    reference_loss = functools.partial(
        materialized_contrastive_loss, scale=20.0, symmetric=True
    )  # the default
    references = []
    for copied, cast in ((copy.deepcopy(model), lambda values: values), (float64(model), float64)):
        unchunked_reference([copied] * len(columns), cast(columns), reference_loss)
        references.append(parameter_gradients(copied))
    StageOneRecorder().step(model, columns, loss_fn, 5)
    measured = assert_exact(parameter_gradients(model), *references, "bfloat16 base, LoRA gradients")
    print(f"bfloat16 base, LoRA gradients: {measured}")
    assert measured.e_ref > 1e-4  # the reference rounds as bfloat16 does, far above float32's rounding


def test_a_bfloat16_base_lora_run_trains_and_reloads(tmp_path, data, monkeypatch):
    folder = build_tiny_model(tmp_path, dropout=0.0, kind="decoder")
    run_main(
        monkeypatch, "--output_dir", tmp_path / "run", "--model", folder, "--data", data[0], "--dev_data", "",
        "--batch_size", 8, "--chunk_size", 3, "--max_steps", 2, "--lr", 1e-2, "--lora_r", 4,
        "--model_dtype", "bfloat16",
    )  # fmt: skip
    trained = weights(tmp_path / "run" / "final")
    assert {value.dtype for name, value in trained.items() if "lora_" in name} == {torch.float32}
    assert max(float(value.abs().max()) for name, value in trained.items() if "lora_B" in name) > 0


# ---------------------------------------------------------------------------------------------------------
# --attn_implementation
# ---------------------------------------------------------------------------------------------------------


def test_sdpa_and_eager_attention_give_the_same_gradients(tmp_path):
    """A gradcache step with sdpa against the full-batch eager reference in float32 and float64."""
    folder = build_tiny_model(tmp_path, dropout=0.0)
    (sdpa, args), (eager, _) = (trained_as(folder, ["--attn_implementation", a]) for a in ("sdpa", "eager"))
    assert [m[0].auto_model.config._attn_implementation for m in (sdpa, eager)] == ["sdpa", "eager"]
    prompts = models.role_prompts(sdpa)
    columns = [models.tokenize(sdpa, column_texts(i), c, prompts) for i, c in enumerate(COLUMNS)]
    loss_fn = functools.partial(train.loss_function(args, sdpa), symmetric=True)
    reference_loss = functools.partial(
        materialized_contrastive_loss, scale=20.0, symmetric=True
    )  # the default
    report = StageOneRecorder().step(sdpa, columns, loss_fn, 3)

    def reference(copies, cast):
        return unchunked_reference(copies * len(columns), cast(columns), reference_loss)

    assert_gradients_exact([sdpa], reference, report.loss, "sdpa against eager", reference_modules=[eager])


# ---------------------------------------------------------------------------------------------------------
# Model classes train.py does not train
# ---------------------------------------------------------------------------------------------------------


def test_a_cross_encoder_is_refused_in_one_line(tmp_path, capsys):
    """sentence-transformers loads it as a SentenceTransformer, rebuilt as mean pooling over its base with a
    warning: train.py would fine-tune a bi-encoder that is not the saved model."""
    from sentence_transformers import CrossEncoder

    build_tiny_model(tmp_path, dropout=0.0)  # its transformers folder, tmp_path / "bert"
    CrossEncoder(str(tmp_path / "bert"), device="cpu").save(str(tmp_path / "cross"))
    expected = (
        r"is a CrossEncoder \(config_sentence_transformers.json\): train.py trains bi-encoders "
        r"\(SentenceTransformer, SparseEncoder, MultiVectorEncoder\)\. Pass one, or a transformers model "
        r"with --pooling\.$"
    )
    one_line_error(capsys, lambda: models.load_model(str(tmp_path / "cross"), "cpu"), expected)


# ---------------------------------------------------------------------------------------------------------
# The families of the README's table, each a tiny model of its architecture
# ---------------------------------------------------------------------------------------------------------

# family: (transformers config and model classes, pooling, padding side)
FAMILIES = {
    "qwen3-embedding": ("Qwen3", "lasttoken", "left"),
    "gte-qwen2": ("Qwen2", "lasttoken", "left"),
    "e5-mistral": ("Mistral", "lasttoken", "left"),
    "bge-m3": ("XLMRoberta", "cls", "right"),
    "mpnet": ("MPNet", "mean", "right"),
}


def build_family_model(folder, architecture, pooling, padding_side):
    """A tiny random model of `architecture` (2 layers, hidden size 32), pooled as the family pools, saved as
    a SentenceTransformer. Encoders tokenize with build_tiny_model's WordPiece vocabulary; decoders with a
    byte-level BPE of single bytes, as transformers loads Qwen2's tokenizer as Qwen2Tokenizer whatever the
    folder says."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers.pre_tokenizers import ByteLevel

    build_tiny_model(folder, dropout=0.0)  # writes folder / "vocab.txt"
    if pooling == "lasttoken":
        vocab = {"<|endoftext|>": 0} | {c: i + 1 for i, c in enumerate(sorted(ByteLevel.alphabet()))}
        end = "<|endoftext|>"
        tokenizer = transformers.Qwen2Tokenizer(
            vocab=vocab, merges=[], eos_token=end, pad_token=end, padding_side=padding_side
        )
        options = dict(num_key_value_heads=1, head_dim=16)
    else:  # no dropout: the references replay no RNG state
        tokenizer = transformers.BertTokenizerFast(str(folder / "vocab.txt"), padding_side=padding_side)
        options = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    config = getattr(transformers, f"{architecture}Config")(**sizes, **options)
    getattr(transformers, f"{architecture}Model")(config).save_pretrained(folder / architecture)
    tokenizer.save_pretrained(folder / architecture)
    modules = [Transformer(str(folder / architecture)), Pooling(32, pooling), Normalize()]
    SentenceTransformer(modules=modules).save(str(folder / "family"))
    return folder / "family"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_exact(tmp_path, family):
    """A gradcache step (chunks of 3) on the family's architecture, pooling and padding side, against the
    full batch through one graph in float32 and float64 (the decoders with LoRA, as they are fine-tuned)."""
    architecture, pooling, padding_side = FAMILIES[family]
    folder = build_family_model(tmp_path, architecture, pooling, padding_side)
    flags = ["--lora_r", "4"] if pooling == "lasttoken" else []
    model, args = trained_as(folder, flags)
    assert type(model[0].auto_model).__name__ == f"{architecture}Model"
    torch.manual_seed(2)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    prompts = models.role_prompts(model)
    columns = [models.tokenize(model, column_texts(i), c, prompts) for i, c in enumerate(COLUMNS)]
    assert (columns[0]["attention_mask"][:, 0 if padding_side == "left" else -1] == 0).any()
    loss_fn = functools.partial(train.loss_function(args, model), symmetric=True)
    reference_loss = functools.partial(
        materialized_contrastive_loss, scale=20.0, symmetric=True
    )  # the default
    report = StageOneRecorder().step(model, columns, loss_fn, 3)

    def reference(copies, cast):
        return unchunked_reference(copies * len(columns), cast(columns), reference_loss)

    assert_gradients_exact([model], reference, report.loss, family)
