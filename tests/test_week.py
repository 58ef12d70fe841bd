"""A researcher's week, on the paths users hit: sweeps launched together, requeues that append
--resume_from_checkpoint latest to the same command, two jobs on one folder, preemption by the scheduler.

Runs are train.main in this process (test_train.run_main, suite time) from a working folder of their own,
where default-named runs go to runs/; what needs a launcher is launched.
"""

import shlex
import subprocess
import sys
import time

import pytest
import torch
from test_reliability import run_with_faults
from test_train import run_main, weights

import train

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
    monkeypatch.setattr(train.secrets, "token_hex", lambda size: next(suffixes))
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
    name = train.default_run_name("models/all-MiniLM-L6-v2", "data/wordnet_train.jsonl.gz", started, "0a1b")
    assert name == "all-MiniLM-L6-v2-wordnet_train-20261201-123005-0a1b"
    names = {train.default_run_name("m", "d.jsonl", started) for _ in range(20)}
    assert len(names) > 15  # 4 random hex digits
    assert train.default_run_name("org/bge-small", ["org/nli:train", "b.csv"], started, "ff").startswith(
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
    assert "no run of these flags under runs has a complete checkpoint" in str(exited.value.code)
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
        [sys.executable, "-c", "import sys, time, train; lock=train.lock_run_folder(train.Path(sys.argv[1]))"
         "; print('held', flush=True); time.sleep(60)", str(folder)],
        stdout=subprocess.PIPE, text=True, cwd=train.Path(train.__file__).parent,
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
