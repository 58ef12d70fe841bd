"""A researcher's week, on the paths users hit: sweeps launched together, requeues that append
--resume_from_checkpoint latest to the same command, two jobs on one folder, preemption by the scheduler.

Runs are train.main in this process (test_train.run_main, suite time) from a working folder of their own,
where default-named runs go to runs/; what needs a launcher is launched.
"""

import json
import secrets
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_reliability import run_with_faults
from test_sources import two_source_flags
from test_train import logged_scalars, run_main, weights

import train
from train_parts import logs, run

RUN = ("--batch_size", 8, "--chunk_size", 3, "--lr", 1e-3, "--eval_steps", 1000, "--max_steps", 4)


@pytest.fixture
def in_a_folder(tmp_path, monkeypatch):
    """Where default-named runs are written: runs/ of a fresh working folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"


def test_jobs_started_in_the_same_second_get_their_own_folders(
    in_a_folder, monkeypatch, data, model_without_dropout
):
    """Two jobs of a sweep, started in the same second and drawing the same random suffix (the worst case):
    the second finds the folder taken and trains in one of its own; neither sees the other's files."""
    frozen = time.localtime()
    monkeypatch.setattr(time, "localtime", lambda *_: frozen)
    suffixes = iter(["beef", "beef", "cafe"])
    monkeypatch.setattr(secrets, "token_hex", lambda size: next(suffixes))
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 2)
    run_main(monkeypatch, *flags)
    run_main(monkeypatch, *flags, "--lr", 1e-4)
    folders = sorted(folder.name for folder in in_a_folder.iterdir())
    assert [name.rsplit("-", 1)[1] for name in folders] == ["beef", "cafe"]
    assert folders[0].rsplit("-", 1)[0] == folders[1].rsplit("-", 1)[0]  # the same model, data and second
    for folder in folders:
        assert sorted(p.name for p in (in_a_folder / folder / "checkpoints").iterdir()) == [
            "step_2",
            "step_4",
        ]
        assert (in_a_folder / folder / "final").is_dir()


def test_default_run_names_carry_seconds_and_a_random_suffix():
    started = time.strptime("2026-12-01 12:30:05", "%Y-%m-%d %H:%M:%S")
    name = run.default_run_name("models/all-MiniLM-L6-v2", "data/wordnet_train.jsonl.gz", started, "0a1b")
    assert name == "all-MiniLM-L6-v2-wordnet_train-20261201-123005-0a1b"
    names = {run.default_run_name("m", "d.jsonl", started) for _ in range(20)}
    assert len(names) > 15  # 4 random hex digits
    assert run.default_run_name("org/bge-small", ["org/nli:train", "b.csv"], started, "ff").startswith(
        "bge-small-nli+1-20261201-123005"
    )


def test_a_requeue_of_the_same_command_continues_the_newest_run_of_its_flags(
    in_a_folder, monkeypatch, capsys, data, model_without_dropout
):
    """A preempted default-named run, requeued a minute later with the same command plus
    --resume_from_checkpoint latest (what a cluster's requeue does), continues its own folder, never a
    sweep sibling's (another --lr) and never from scratch; it reaches the uninterrupted run's weights. The
    stop message's command resumes it too. Without any run of these flags, latest stops in one line."""
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 1)
    with pytest.raises(SystemExit) as exited:
        run_main(monkeypatch, *flags, "--resume_from_checkpoint", "latest")
    assert (
        "no run of these flags and this launch (precision, backend, processes) under runs has a complete"
        in (str(exited.value.code))
    )
    assert not in_a_folder.exists() or not any(in_a_folder.iterdir())  # nothing created

    run_main(monkeypatch, *flags, "--lr", 3e-3)  # a sweep sibling, finished
    with pytest.raises(SystemExit) as exited:  # preempted at its third step
        run_with_faults(None, *flags, faults={"GRADCACHE_FAULT_SIGNAL": "SIGINT:3"})
    assert exited.value.code == 0
    stopped = capsys.readouterr().out
    command = shlex.split(stopped.split("Continue with the same launcher and ")[1].splitlines()[0])
    run_dir = command[command.index("--output_dir") + 1]
    assert "--lr 3e-3" not in stopped and not (in_a_folder.parent / run_dir / "final").exists()

    time.sleep(1.1)  # the requeue starts later: another default name
    run_main(monkeypatch, *flags, "--resume_from_checkpoint", "latest")
    out = capsys.readouterr().out
    assert f"continuing {run_dir}, of these flags" in out and "starting from scratch" not in out
    assert len(list(in_a_folder.iterdir())) == 2  # no third folder
    straight = in_a_folder.parent / "straight"
    run_main(monkeypatch, *flags, "--output_dir", straight)
    resumed, reference = weights(in_a_folder.parent / run_dir / "final"), weights(straight / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    assert command[0] == "train.py" and command[-2:] == ["--resume_from_checkpoint", "latest"]


def test_a_second_job_on_a_folder_in_use_stops_naming_the_first(
    tmp_path, monkeypatch, data, model_without_dropout
):
    """A folder held by a running job (another process holding its lock) is refused in one line, whatever
    the flags say (--overwrite too), and nothing of it is touched."""
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys, time; from train_parts import run; "
         "lock = run.lock_run_folder(pathlib.Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
         str(folder)],
        stdout=subprocess.PIPE, text=True, cwd=Path(train.__file__).parent,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as exited:
            flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--overwrite")
            run_main(monkeypatch, *flags, "--output_dir", folder)
    finally:
        holder.kill()
    assert f"is in use by a running job (process {holder.pid} on" in str(exited.value.code)
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]


def test_the_first_warmup_step_trains(tmp_path, monkeypatch, data, model_without_dropout):
    """With warmup the first step trains at --lr / warmup steps (transformers' schedules gave it 0: a step
    spent for nothing), the peak is reached at the last warmup step, then the decay; every logged rate is the
    schedule's, computed here from its definition."""
    steps, warmup, lr = 10, 3, 1e-3  # warmup: round(0.3 x 10)
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--max_steps", steps, "--lr", lr)
    run_main(monkeypatch, *flags, "--warmup_ratio", 0.3, "--output_dir", tmp_path, "--save_steps", 0)
    rates = [rate for _, rate in logged_scalars(tmp_path)["train/learning_rate"]]
    linear = [
        lr * (k + 1) / warmup if k < warmup else lr * (steps - k) / (steps - warmup) for k in range(steps)
    ]
    assert rates == pytest.approx(linear) and min(rates) > 0


def test_masks_that_take_out_most_candidates_are_shown_and_warned_once(
    tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """A loose margin (every candidate scoring above the positive's score - 1, in cosine) masks most
    negatives: one warning line, naming the share as train/masked_fraction logs it and the flags to change;
    the progress bar shows the share at every step. The default margin (none) masks no more than the
    repeated texts and says nothing."""
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 0)
    run_main(monkeypatch, *flags, "--false_negative_margin", -1, "--output_dir", tmp_path / "loose")
    out, err = capsys.readouterr()
    warnings = [line for line in out.splitlines() if "the false-negative masks took out" in line]
    assert len(warnings) == 1 and "--false_negative_margin -1" in warnings[0], out
    step, share = (
        int(warnings[0].split("step ")[1].split(":")[0]),
        warnings[0].split("took out ")[1].split("%")[0],
    )
    logged = dict(logged_scalars(tmp_path / "loose")["train/masked_fraction"])
    assert logged[step] > 0.2 and share == f"{logged[step]:.0%}".rstrip("%")
    assert "masked=" in err  # the bar
    run_main(monkeypatch, *flags, "--output_dir", tmp_path / "default")
    assert "the false-negative masks took out" not in capsys.readouterr().out


def test_weights_that_are_not_finite_are_never_saved(tmp_path, monkeypatch, data, model_without_dropout):
    """A step that leaves the weights infinite (stood in for by an optimizer step writing inf into one
    weight at step 3): the checkpoint of step 3 is not written, and the stop names step_2 to resume from."""
    real_step = torch.optim.AdamW.step
    taken = []

    def overflowing_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        taken.append(1)
        if len(taken) == 3:
            self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 1)
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *flags, "--output_dir", tmp_path)
    checkpoints = tmp_path / "checkpoints"
    assert "after step 3 the weights are no longer finite: not saved." in stopped.value.code
    assert f"--resume_from_checkpoint {checkpoints / 'step_2'}" in stopped.value.code
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]


def test_a_checkpoint_that_is_bad_itself_is_named_so_with_the_one_before_it(
    tmp_path, monkeypatch, data, model_without_dropout
):
    """Weights that are finite but give a non-finite loss (a destructive step just before a checkpoint,
    stood in for by scaling step_3's weights to 1e30): resumed from step_3, the run stops after
    --max_bad_steps saying that step_3 itself is the cause and naming step_2, instead of step_3 again (which
    a lower --lr cannot fix: the advice looped)."""
    from safetensors.torch import load_file, save_file

    flags = (
        "--model",
        model_without_dropout,
        "--data",
        data[0],
        *RUN,
        "--save_steps",
        1,
        "--max_bad_steps",
        1,
    )
    run_main(monkeypatch, *flags, "--output_dir", tmp_path)
    checkpoints = tmp_path / "checkpoints"
    saved = checkpoints / "step_3" / "model.safetensors"
    save_file({name: value * 1e30 for name, value in load_file(saved).items()}, saved)
    with pytest.raises(SystemExit) as stopped:
        run_main(
            monkeypatch, *flags, "--output_dir", tmp_path, "--resume_from_checkpoint", checkpoints / "step_3"
        )
    assert f"They began right where this run resumed at {checkpoints / 'step_3'}" in stopped.value.code
    assert f"Resume from the one before it, {checkpoints / 'step_2'}" in stopped.value.code


@pytest.mark.parametrize("mode", ["online", "online_only"])
def test_wandb_online_without_network_or_key_logs_offline_or_stops_at_once(
    mode, tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """Without network (this machine) or without a key, online used to retry for 112 s and end in a
    100-line traceback: now online logs offline, saying so and how to upload, and online_only stops in one
    line before anything is written (no empty tensorboard/)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 0, "--max_steps", 1)
    started = time.monotonic()
    if mode == "online_only":
        with pytest.raises(SystemExit) as stopped:
            run_main(monkeypatch, *flags, "--wandb_mode", mode, "--output_dir", tmp_path / "run")
        assert stopped.value.code.startswith("train.py: error: --wandb_mode online_only: ")
        assert not (tmp_path / "run" / "tensorboard").exists() and not (tmp_path / "run" / "wandb").exists()
    else:
        run_main(monkeypatch, *flags, "--wandb_mode", mode, "--output_dir", tmp_path / "run")
        assert "--wandb_mode online: " in capsys.readouterr().out
        assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert time.monotonic() - started < 60


def test_cross_process_negatives_apply_to_the_sources_with_in_batch_negatives(sources, model_without_dropout):
    """A source without in-batch negatives has no other rows to contrast with: it trains on its own groups
    while the others contrast across processes (the whole run was refused); with no such source at all,
    --cross_process_negatives is refused in one line."""
    two = two_source_flags(model_without_dropout, sources, "--cross_process_negatives")
    args = train.parse_args([*map(str, two), "--in_batch_negatives", "on", "off"])
    assert [s.cross_process_negatives for s in train.source_settings(args)] == [True, False]
    with pytest.raises(SystemExit, match="no --data source has in-batch negatives"):
        train.parse_args([*map(str, two), "--in_batch_negatives", "off"])


def test_without_in_batch_negatives_the_accuracy_within_each_group_is_logged(
    tmp_path, monkeypatch, data, model_without_dropout
):
    """group_loss counts the rows whose positive scores highest of their own group (it logged no accuracy):
    3 of 4 rows built so, the fourth's hard negative on its anchor; a group-only run logs it."""
    import gradcache

    anchor = torch.eye(4, 8)
    positive, negative = anchor + 0.1 * torch.roll(anchor, 1, 0), anchor.flip(0)
    negative[3] = anchor[3]  # row 3: its hard negative is the anchor itself, above its positive
    stats = {}
    gradcache.group_loss(anchor, positive, negative, stats=stats)
    assert stats["in_batch_accuracy"] == 3 / 4
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--in_batch_negatives", "off")
    run_main(monkeypatch, *flags, "--output_dir", tmp_path, "--save_steps", 0)
    assert all(0 <= value <= 1 for _, value in logged_scalars(tmp_path)["train/in_batch_accuracy"])


def test_a_run_says_its_graph_budget_and_logs_the_groups_kept(
    tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """The default keeps the last group's graph; a budget that holds them all keeps every group, encoding no
    chunk twice (plain training's compute): the start line says so, train/kept_groups logs it. (Exactness
    with budgets: every row of tests/test_matrix.py.)"""
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 0, "--max_steps", 2)
    run_main(monkeypatch, *flags, "--output_dir", tmp_path / "default")
    assert "--graph_budget none (the last group): the first step kept the graphs of 1 group(s)" in (
        capsys.readouterr().out
    )
    assert [value for _, value in logged_scalars(tmp_path / "default")["train/kept_groups"]] == [1, 1]
    run_main(monkeypatch, *flags, "--output_dir", tmp_path / "all", "--graph_budget", 10**6)
    out = capsys.readouterr().out
    said = out.split("the first step kept the graphs of ")[1].split("\n")[0]
    kept, chunks = int(said.split(" ")[0]), int(said.split("of its ")[1].split(" ")[0])
    assert kept == chunks > 1 and "; 0 of its" in said  # every chunk its own group: none encoded twice
    measured = float(said.split("group(s), ")[1].split(" MiB of saved tensors")[0])
    assert measured > 0 and "memory/peak_rss_gib logs it" in said  # what was kept; a CPU peak: more
    assert [value for _, value in logged_scalars(tmp_path / "all")["train/kept_groups"]] == [kept, kept]


def test_the_bar_shows_the_stage_of_a_step_and_warnings_print_above_it(
    tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """A long step froze the bar: it shows each group's stage (encode k/n, backward k/n). A library's warning
    during a step was printed into the bar's line; it comes on a line of its own."""
    step = train.gradient_cache_step

    def warning_step(*args, **kwargs):
        warnings.warn("a library's warning during the step", UserWarning, stacklevel=1)
        return step(*args, **kwargs)

    def to_stderr(message, category, filename, lineno, file=None, line=None):  # Python's own, outside pytest
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    monkeypatch.setattr(train, "gradient_cache_step", warning_step)
    monkeypatch.setattr(warnings, "showwarning", to_stderr)  # pytest would record it, not print it
    monkeypatch.setattr(logs, "STAGE_SECONDS", 0.0)  # every stage shown (once a second in a run)
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 0, "--max_steps", 2)
    run_main(monkeypatch, *flags, "--output_dir", tmp_path / "run")
    out, err = capsys.readouterr()
    groups = 3 * 3  # chunks of 3 of the 8 anchors, positives and negatives, a group each; the last kept
    assert f"{groups - 1} of its {groups} chunks were encoded twice" in out
    for said in (f"encode 1/{groups}", f"encode {groups}/{groups}", f"backward {groups - 1}/{groups - 1}"):
        assert said in err, said
    warned = [line for line in err.splitlines() if "UserWarning: a library's warning during the step" in line]
    assert len(warned) == 1 and warned[0].split("\r")[-1].startswith(__file__), warned


def test_a_requeue_continues_only_a_run_of_the_same_launch(
    in_a_folder, monkeypatch, capsys, data, model_without_dropout
):
    """An fp32 job and its bf16 sibling (`accelerate launch --mixed_precision bf16` sets
    ACCELERATE_MIXED_PRECISION), of the same flags, both preempted at step 3, the bf16 one later: the fp32
    requeue with latest continues the fp32 run (it continued the bf16 sibling's, the newer, leaving the
    fp32 run at step 2), the bf16 requeue its own; an explicit resume of the bf16 run under fp32 stops in
    one line naming the difference."""
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--save_steps", 1)
    folders = {}
    for precision in ("no", "bf16"):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
        with pytest.raises(SystemExit):
            run_with_faults(None, *flags, faults={"GRADCACHE_FAULT_SIGNAL": "SIGINT:3"})
        command = shlex.split(capsys.readouterr().out.split("Continue with the same launcher and ")[1])
        folders[precision] = command[command.index("--output_dir") + 1]
        time.sleep(1.1)  # the next launch: another default name
    for precision in ("no", "bf16"):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
        run_main(monkeypatch, *flags, "--resume_from_checkpoint", "latest")
        assert f"continuing {folders[precision]}," in capsys.readouterr().out
        run_dir = in_a_folder.parent / folders[precision]
        assert (run_dir / "final").is_dir()
        state = json.loads((run_dir / "checkpoints" / "step_4" / "trainer_state.json").read_text())
        assert state["launch"]["mixed_precision"] == precision
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *flags, "--output_dir", folders["bf16"], "--resume_from_checkpoint", "latest")
    assert "mixed_precision bf16 (this launch: no): it trained under another launch" in stopped.value.code
    assert "\n" not in stopped.value.code
    assert len(list(in_a_folder.iterdir())) == 2


@pytest.mark.parametrize("kind", ["mean", "splade"])
def test_final_holds_a_card_of_this_fine_tune(kind, tmp_path, monkeypatch, data):
    """final/README.md was the base model's own card (all-MiniLM-L6-v2's 21 training sets): it now describes
    the fine-tune, dense and sparse alike, through sentence-transformers' card machinery: the base model, the
    data source with its size and columns, the loss and its settings, the batch and its chunks, the steps,
    the learning rate, the dev metrics before and after, the command and the library versions."""
    import importlib.metadata

    from test_train import build_tiny_model

    model = build_tiny_model(tmp_path, dropout=0.0, kind=kind)
    (model / "README.md").write_text("# The base model\n\nTrained on 21 data sets of its own.\n")
    flags = (
        "--model",
        model,
        "--data",
        data[0],
        "--dev_data",
        data[1],
        *RUN,
        "--output_dir",
        tmp_path / "run",
    )
    run_main(monkeypatch, *flags, "--false_negative_margin", 0.1)
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert "21 data sets" not in card and "# The base model" not in card
    examples = len(Path(data[0]).read_text().splitlines())
    assert "# model fine-tuned with Gradient Cache" in card and f"`model`: {model}" in card
    assert "#### train\n" in card and f"* Size: {examples} training samples" in card
    assert "* Columns: anchor, positive, and negative_1" in card  # the negative field's role, numbered
    assert "<code>gradcache.contrastive_loss</code>" in card and '"false_negative_margin": 0.1' in card
    assert '"in_batch_negatives": "on"' in card and '"scale": ' in card
    for fact in ("effective_batch_size`: 8", "chunk_size`: 3", "total_steps`: 4", "lr`: 0.001"):
        assert f"- `{fact}\n" in card, fact
    assert "`mixed_precision`: no" in card and "`processes`: 1" in card  # the launch's
    assert "`command`: train.py --model" in card and "--false_negative_margin 0.1" in card
    logs = card.split("### Training Logs\n")[1].split("\n\n")[0].splitlines()
    header = [cell.strip() for cell in logs[0].strip("|").split("|")]
    rows = [
        dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")), strict=True))
        for row in logs[2:]
    ]
    ndcg = next(name for name in header if name.endswith("_ndcg@10"))
    logged = dict(logged_scalars(tmp_path / "run")[f"eval/{ndcg}"])  # TensorBoard's, before and after
    assert [(int(row["Step"]), float(row[ndcg])) for row in rows] == [
        (s, round(v, 4)) for s, v in logged.items()
    ]
    assert list(logged) == [0, 4]
    for package, name in (("sentence-transformers", "Sentence Transformers"), ("torch", "PyTorch")):
        assert f"- {name}: {importlib.metadata.version(package)}" in card


@pytest.mark.parametrize("tokenizer", ["none", "too small"])
def test_a_model_without_its_tokenizer_is_refused_naming_the_folder(tokenizer, tmp_path, monkeypatch, data):
    """A model folder without tokenizer files trained with rc 0 (transformers substitutes a 5-token tokenizer:
    every word [UNK]), as did one whose tokenizer is far smaller than its embeddings: one line naming the
    folder and what to add, before anything is trained."""
    from safetensors.torch import load_file
    from test_train import build_tiny_model
    from transformers import BertTokenizerFast

    model = build_tiny_model(tmp_path, dropout=0.0)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    if tokenizer == "too small":
        (tmp_path / "small.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nword\n")
        BertTokenizerFast(str(tmp_path / "small.txt")).save_pretrained(model)
    flags = ("--model", model, "--data", data[0], *RUN, "--output_dir", tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *flags)
    saved = load_file(str(model / "model.safetensors"))
    rows = next(len(value) for name, value in saved.items() if name.endswith("word_embeddings.weight"))
    assert (
        f"--model {model}: its tokenizer has {5 if tokenizer == 'none' else 6} tokens for the model's {rows}"
        in (stopped.value.code)
    )
    assert f"tokenizer files in {model}" in stopped.value.code and "tokenizer.json" in stopped.value.code
    assert "\n" not in stopped.value.code and not (tmp_path / "run" / "final").exists()


def test_a_requeue_of_a_finished_run_says_it_is_complete(
    tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """A finished run requeued with latest re-saved final/ as if it had trained: it says it is complete at its
    step and exits 0, final/ untouched."""
    flags = (
        "--model",
        model_without_dropout,
        "--data",
        data[0],
        *RUN,
        "--save_steps",
        2,
        "--output_dir",
        tmp_path,
    )
    run_main(monkeypatch, *flags)
    saved = (tmp_path / "final" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *flags, "--resume_from_checkpoint", "latest")
    assert stopped.value.code == 0
    assert f"{tmp_path} is complete at step 4: its model is in final/." in capsys.readouterr().out
    assert (tmp_path / "final" / "model.safetensors").stat().st_mtime_ns == saved


def test_a_missing_wandb_is_named_before_the_run_folder_is_written(
    tmp_path, monkeypatch, data, model_without_dropout
):
    """Without wandb installed (accelerate finds no package), the default --wandb_mode offline ended in a
    traceback after the run's folder was written: one line saying what to do, and no folder."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    flags = ("--model", model_without_dropout, "--data", data[0], *RUN, "--output_dir", tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *flags, "--wandb_mode", "offline")
    assert "pip install wandb or --wandb_mode disabled" in stopped.value.code
    assert not (tmp_path / "run").exists()
