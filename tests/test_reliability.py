"""Reliability of train.py: a killed run resumes bit for bit, bad data is named or skipped, a non-finite step
never reaches the weights, and a chunk that runs out of memory is halved, in one process and in two.

Faults are injected by tests/faults/sitecustomize.py into the launched processes (see its docstring), or
installed by `run_with_faults` in this process, for one-process runs that need no process of their own: a
launch costs the suite its start-up (suite time). A kill and what needs several processes stay launched.
"""

import importlib.util
import json
import math
import os
import string
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fsdp import shim_environment
from test_sources import two_source_flags
from test_train import CONFIGS, launch, logged_scalars, run_main, weights, zero3_partitioning_everything

import gradcache
import train
from train_parts import pairs, run

FAULTS = Path(__file__).parent / "faults"
RUN = ("--batch_size", 8, "--chunk_size", 3, "--lr", 1e-3, "--wandb_mode", "disabled", "--eval_steps", 1000)


def launch_with_faults(output_dir, *args, faults=None, processes=1, check=True, fsdp2=False):
    """train.py launched on CPU processes (cpu.yaml, cpu_ddp_2proc.yaml, or with `fsdp2` fsdp2.yaml through
    tests/fsdp_shim.py) with tests/faults/sitecustomize.py's faults installed."""
    config = CONFIGS / ("fsdp2.yaml" if fsdp2 else "cpu.yaml" if processes == 1 else "cpu_ddp_2proc.yaml")
    env = fault_environment(Path(output_dir).parent, fsdp2) | {"ACCELERATE_USE_CPU": "true"}
    return launch(config, output_dir, *RUN, *args, processes=processes, env=env | (faults or {}), check=check)


def fault_environment(folder, fsdp2=False):
    """The environment of a launch with tests/faults' sitecustomize.py; under FSDP2 the shim's (written in
    `folder`) runs it first."""
    env = {"PYTHONPATH": f"{FAULTS}{os.pathsep}{Path(__file__).parents[1]}"}
    if fsdp2:
        env = shim_environment(folder, f"exec(open({str(FAULTS / 'sitecustomize.py')!r}).read())\n")
        env |= {"PYTHONPATH": f"{env['PYTHONPATH']}{os.pathsep}{Path(__file__).parents[1]}"}
    return env


def run_with_faults(output_dir, *args, faults=None):
    """train.main in this process (test_train.run_main) with tests/faults/sitecustomize.py's test doubles
    installed as it installs them at the start of a launched process; both undone when it returns."""
    import accelerate

    assert "GRADCACHE_FAULT_KILL" not in (faults or {})  # it would kill the test
    if "--resume_from_checkpoint" in args:
        # TensorBoard reads event files in name order, <start second>.<host>.<pid>: a resume within the second
        # the interrupted launch started, from a lower pid, would be read first and its steps purged as stale.
        time.sleep(1.01 - time.time() % 1)
    with pytest.MonkeyPatch.context() as patch:
        if faults:
            doubled = ("cache_representation_gradients", "backpropagate_cache", "group_step")
            for name in (*doubled, "gradcache_step"):
                patch.setattr(gradcache, name, getattr(gradcache, name))
            for name in ("save_state", "__init__"):
                patch.setattr(accelerate.Accelerator, name, getattr(accelerate.Accelerator, name))
            for name, value in faults.items():
                patch.setenv(name, value)
            spec = importlib.util.spec_from_file_location("faults_in_process", FAULTS / "sitecustomize.py")
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        run_main(patch, *(("--output_dir", output_dir) if output_dir else ()), *RUN, *args)  # None: default


def checkpoint_weights(checkpoint):
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


# ---------------------------------------------------------------------------------------------------------
# Crash safety
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data, model_with_dropout):
    """The reference of the resumed runs, trained in this process (suite time): the launched runs that are
    killed must still reach its weights, bit for bit."""
    run = tmp_path_factory.mktemp("uninterrupted")
    args = ("--model", model_with_dropout, "--data", data[0], "--max_steps", 6, "--save_steps", 2)
    run_with_faults(run, *args)
    return run


@pytest.mark.parametrize("point", ["before", "during", "after"])
def test_killed_at_a_checkpoint_the_run_resumes_bit_for_bit(
    point, tmp_path, data, model_with_dropout, uninterrupted, capsys
):
    """SIGKILL before, during and after the checkpoint of step 4, in a launched process; resumed in this
    process (suite time), the run reaches the uninterrupted one's weights."""
    args = ("--model", model_with_dropout, "--data", data[0], "--max_steps", 6, "--save_steps", 2)
    killed = launch_with_faults(tmp_path, *args, faults={"GRADCACHE_FAULT_KILL": f"{point}:2"}, check=False)
    assert killed.returncode != 0
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    expected_latest = "step_4" if point == "after" else "step_2"
    if point == "during":
        assert "step_4.partial" in checkpoints  # half-written, and never taken for a complete one
    assert not (tmp_path / "final").exists()

    run_with_faults(tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert f"resumed from {tmp_path / 'checkpoints' / expected_latest}:" in capsys.readouterr().out
    # Steps 3 and 4, logged before the kill and again after the resume from step 2, show once in TensorBoard
    assert [step for step, _ in logged_scalars(tmp_path)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    resumed, reference = weights(tmp_path / "final"), weights(uninterrupted / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_saves_a_checkpoint_and_the_run_resumes_bit_for_bit(
    signal_name, tmp_path, data, model_with_dropout, uninterrupted, capsys
):
    """SIGTERM (preemption) or Ctrl-C during step 3, and again while its checkpoint is written: the step stops
    at its next group of chunks, the run saves the state of the step's start as step_2 (the data position
    and dropout's RNG included, no checkpoint being due there), says how to resume and exits 0; resumed, it
    redoes step 3 and reaches the uninterrupted run's weights bit for bit. One handler catches both signals,
    so only the SIGTERM run is resumed. The SIGTERM run is launched (its exit status is the launcher's);
    Ctrl-C, sent to this process while train.main runs in it, and the resume run here (suite time)."""
    args = ("--model", model_with_dropout, "--data", data[0], "--max_steps", 6, "--save_steps", 4)
    faults = {"GRADCACHE_FAULT_SIGNAL": f"{signal_name}:3"}
    if signal_name == "SIGTERM":
        stopped = launch_with_faults(tmp_path, *args, faults=faults).stdout
    else:
        with pytest.raises(SystemExit) as exited:
            run_with_faults(tmp_path, *args, faults=faults)
        assert exited.value.code == 0
        stopped = capsys.readouterr().out
    checkpoints = tmp_path / "checkpoints"
    assert f"stopped by {signal_name}: saved {checkpoints / 'step_2'}." in stopped
    assert "--resume_from_checkpoint latest" in stopped
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2"]
    assert json.loads((checkpoints / "step_2" / "trainer_state.json").read_text())["batches_done"] == 2
    assert not (tmp_path / "final").exists()
    if signal_name == "SIGINT":
        return

    run_with_faults(tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert f"resumed from {checkpoints / 'step_2'}:" in capsys.readouterr().out
    resumed, reference = weights(tmp_path / "final"), weights(uninterrupted / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path, sources, model_with_dropout):
    """Only rank 1 gets SIGTERM, during step 2: the all-reduce of the flag stops rank 0 too, at the same
    group of chunks, both save step 2's start as step_1, and the resumed run reaches the uninterrupted one's
    weights (also: a signal saves with --save_steps 0). On two
    --data sources of other columns, prompts and distillation (3 steps an epoch, of 2 triplet steps and 1 of
    pairs): the resumed processes take up the order of the sources where it stopped, dropout too."""
    args = (*two_source_flags(model_with_dropout, sources), "--max_steps", 4, "--save_steps", 0)
    faults = {"GRADCACHE_FAULT_SIGNAL": "SIGTERM:2", "GRADCACHE_FAULT_RANK": "1"}
    launch_with_faults(tmp_path / "straight", *args, processes=2)
    stopped = launch_with_faults(tmp_path / "stopped", *args, faults=faults, processes=2)
    checkpoint = tmp_path / "stopped" / "checkpoints" / "step_1"
    assert f"stopped by a signal to another process: saved {checkpoint}." in stopped.stdout
    assert not (tmp_path / "stopped" / "final").exists()
    resume = ("--resume_from_checkpoint", "latest")
    resumed = launch_with_faults(tmp_path / "stopped", *args, *resume, processes=2)
    assert f"resumed from {checkpoint}:" in resumed.stdout
    resumed, reference = weights(tmp_path / "stopped" / "final"), weights(tmp_path / "straight" / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    straight_sources = logged_scalars(tmp_path / "straight")["train/source"]
    assert {int(source) for _, source in straight_sources} == {0, 1}
    assert logged_scalars(tmp_path / "stopped")["train/source"] == straight_sources


@pytest.mark.parametrize("fsdp2", [False, True], ids=["ddp", "fsdp2"])
def test_a_signal_to_the_launcher_saves_within_its_grace_whatever_the_step_length(
    fsdp2, tmp_path, data, model_with_dropout
):
    """A scheduler's SIGTERM to `accelerate launch` (torchrun), which forwards it to the workers and kills
    them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later: here 3 s, with step 3 made 2 s longer per backward
    than the grace in all (the save waited for the step's end, and none was written). The step stops at
    its next group, the state of its start is saved as step_2 at once, and the run resumes to the
    uninterrupted run's weights bit for bit. The launcher itself exits 1 (torchrun's SignalException).
    Under DDP and under FSDP2 (each process saves its shard of the model and of AdamW's state)."""
    args = ("--model", model_with_dropout, "--data", data[0], "--max_steps", 4, "--save_steps", 0)
    faults = {"GRADCACHE_FAULT_SIGNAL_LAUNCHER": "3:2", "GRADCACHE_FAULT_RANK": "0"}
    grace = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}
    launch_with_faults(tmp_path / "straight", *args, processes=2, fsdp2=fsdp2)
    stopped = launch_with_faults(
        tmp_path / "stopped", *args, faults=faults | grace, processes=2, check=False, fsdp2=fsdp2
    )
    checkpoint = tmp_path / "stopped" / "checkpoints" / "step_2"
    assert stopped.returncode == 1 and "SignalException" in stopped.stderr
    assert f"stopped by SIGTERM: saved {checkpoint}." in stopped.stdout, stopped.stdout[-2000:]
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_2"]
    resumed = launch_with_faults(
        tmp_path / "stopped", *args, "--resume_from_checkpoint", "latest", processes=2, fsdp2=fsdp2
    )
    assert f"resumed from {checkpoint}:" in resumed.stdout
    assert ("distributed_type: DistributedType.FSDP" in resumed.stdout) == fsdp2
    resumed, reference = weights(tmp_path / "stopped" / "final"), weights(tmp_path / "straight" / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_signal_to_a_one_process_launcher_saves_and_resumes_bit_for_bit(
    tmp_path, data, model_with_dropout, uninterrupted, capsys
):
    """A scheduler's SIGTERM to a one-process `accelerate launch` (cpu.yaml; single_gpu.yaml takes the same
    path): its launcher runs train.py as a subprocess and dies of the signal without forwarding it (rc
    -SIGTERM). train.py sees its launcher gone at its next group of chunks, saves step 3's start as step_2
    and stops (it used to train on, unseen, to final/); resumed, it reaches the uninterrupted weights."""
    args = ("--model", model_with_dropout, "--data", data[0], "--max_steps", 6, "--save_steps", 2)
    faults = {"GRADCACHE_FAULT_SIGNAL_LAUNCHER": "3:1"}  # a second a backward: time for it to die
    stopped = launch_with_faults(tmp_path, *args, faults=faults, check=False)  # waits for train.py's output
    checkpoint = tmp_path / "checkpoints" / "step_2"
    assert stopped.returncode == -15
    assert f"stopped by the launcher's end: saved {checkpoint}." in stopped.stdout, stopped.stdout[-2000:]
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_2"]
    assert not (tmp_path / "final").exists()
    run_with_faults(tmp_path, *args, "--resume_from_checkpoint", "latest")
    assert f"resumed from {checkpoint}:" in capsys.readouterr().out
    resumed, reference = weights(tmp_path / "final"), weights(uninterrupted / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


class Process:
    """One process of a two-machine job, as save_checkpoint sees it: wait_for_everyone is a barrier, and
    save_state writes this process's file (accelerate: the main process the model, each its RNG state)."""

    def __init__(self, rank, barrier):
        self.rank, self.barrier = rank, barrier
        self.is_main_process, self.is_local_main_process = rank == 0, True  # one process per machine

    def wait_for_everyone(self):
        self.barrier.wait(timeout=10)

    def save_state(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"random_states_{self.rank}.pkl").write_text("state")


@pytest.mark.parametrize("shared_file_system", [True, False])
def test_checkpoints_on_two_machines_are_completed_once_on_each_file_system(tmp_path, shared_file_system):
    barrier = threading.Barrier(2)
    folders = [tmp_path / "shared"] * 2 if shared_file_system else [tmp_path / "m0", tmp_path / "m1"]
    state = {"global_step": 1}
    machines = [
        threading.Thread(target=run.save_checkpoint, args=(Process(rank, barrier), folders[rank], state, 0))
        for rank in (0, 1)
    ]
    for machine in machines:
        machine.start()
    for machine in machines:
        machine.join(timeout=30)
    expected = {"random_states_0.pkl", "random_states_1.pkl"} if shared_file_system else None
    for rank, folder in enumerate(folders):
        assert [path.name for path in folder.iterdir()] == ["step_1"]  # no .partial left
        written = {path.name for path in (folder / "step_1").iterdir()}
        assert written == (expected or {f"random_states_{rank}.pkl"}) | {"trainer_state.json"}


# ---------------------------------------------------------------------------------------------------------
# Bad data: every malformed record is named with its line, or skipped and counted
# ---------------------------------------------------------------------------------------------------------


def without(record, field):
    return {key: value for key, value in record.items() if key != field}


GOOD = {"anchor": "a question", "positive": "its answer", "negative": "another answer"}
texts = st.text(string.ascii_letters + " ", min_size=1, max_size=20).filter(str.strip)
good_records = st.fixed_dictionaries({"anchor": texts, "positive": texts, "negative": texts})
NOT_TEXTS = [7, 2.5, True, ["a", 7], [], {"x": 1}]  # a list of texts is a list of positives
MALFORMED = {  # kind: (records or lines, what the message must say)
    "missing field": (st.sampled_from(["anchor", "positive"]).map(lambda f: without(GOOD, f)), "no field"),
    "not a string": (st.sampled_from(NOT_TEXTS).map(lambda v: GOOD | {"positive": v}), "not a text"),
    "empty text": (st.sampled_from(["", " ", "\t \n"]).map(lambda v: GOOD | {"anchor": v}), "empty"),
    "too long": (st.just(GOOD | {"negative": "x" * 101}), "over --max_text_chars 100"),
    "invalid utf-8": (st.just(b'{"anchor": "caf\xe9", "positive": "p", "negative": "n"}'), "not valid UTF-8"),
    "not json": (st.just(b'{"anchor": "a", "positive": '), "not valid JSON"),
    "raw tab": (st.just(b'{"anchor": "a\tb", "positive": "p"}'), "column 14: invalid control character"),
    "not an object": (st.sampled_from([b"[1, 2]", b'"text"', b"3"]), "not an object"),
}


def as_line(record):
    return record if isinstance(record, bytes) else json.dumps(record).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    good=st.lists(good_records, min_size=1, max_size=6),
    kind=st.sampled_from(sorted(MALFORMED)),
    data_draw=st.data(),
)
def test_every_malformed_record_is_named_or_skipped(tmp_path, capsys, good, kind, data_draw):
    strategy, problem = MALFORMED[kind]
    bad = data_draw.draw(strategy)
    position = data_draw.draw(st.integers(0, len(good)))
    lines = [as_line(r) for r in good[:position]] + [as_line(bad)] + [as_line(r) for r in good[position:]]
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")

    with pytest.raises(pairs.DataError) as stopped:
        pairs.load_pairs(str(path), max_text_chars=100)
    message = str(stopped.value)
    assert (
        f"{path}, line {position + 1} " in message and problem in message and "--skip_bad_records" in message
    )

    dataset, skipped = pairs.load_pairs(str(path), skip_bad_records=True, max_text_chars=100)
    assert skipped == 1
    assert dataset.to_list() == [
        {"anchor": r["anchor"], "positive": r["positive"], "negative_1": r["negative"]} for r in good
    ]
    assert f"line {position + 1}" in capsys.readouterr().out


def test_a_file_of_only_bad_records_stops_even_when_skipping(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(
        pairs.DataError,
        match="has no field 'anchor' .anchor., 'positive' .positive. in any record.*--columns",
    ):
        pairs.load_pairs(str(path), skip_bad_records=True)


def test_a_data_error_under_two_processes_is_the_main_process_line(tmp_path, data, model_without_dropout):
    """A bad record under DDP: the main process's line, once, and no other process's traceback (the other
    failed in accelerate's main_process_first barrier when the main process left it, with a gloo traceback
    printed before the line)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(data[0]).read_text() + '{"anchor": "cut off", "positive"\n')
    done = launch_with_faults(
        tmp_path / "run", "--model", model_without_dropout, "--data", bad, processes=2, check=False
    )
    printed = done.stdout + done.stderr
    line = f"train.py: error: {bad}, line {len(Path(data[0]).read_text().splitlines()) + 1} is not valid JSON"
    assert done.returncode != 0 and printed.count(line) == 2, printed[-3000:]  # its own, torchrun's summary
    before_summary = printed.split("Traceback (most recent call last)")[0]
    assert line in before_summary and "[rank1]" not in printed, printed[-3000:]
    assert "stopped with the main process" in printed  # the other process's line, in torchrun's summary


# ---------------------------------------------------------------------------------------------------------
# Non-finite steps and out-of-memory chunks, in one process and in two
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_a_non_finite_step_never_reaches_the_weights(
    processes, tmp_path, data, model_without_dropout, capsys
):
    """A NaN loss at step 2 and infinite gradients at step 3 (on rank 1 only with two processes): the final
    weights are those of step 1, on every process. One process runs in this process (suite time)."""
    faults = {"GRADCACHE_FAULT_NAN": "2", "GRADCACHE_FAULT_INF": "3"}
    args = ("--model", model_without_dropout, "--data", data[0], "--max_steps", 3, "--save_steps", 1)
    if processes == 2:
        faults |= {"GRADCACHE_FAULT_RANK": "1"}
        done = launch_with_faults(tmp_path, *args, faults=faults, processes=processes)
        output = done.stdout + done.stderr
    else:
        run_with_faults(tmp_path, *args, faults=faults)
        output = "".join(capsys.readouterr())
    final, step_1 = weights(tmp_path / "final"), checkpoint_weights(tmp_path / "checkpoints" / "step_1")
    assert all(torch.equal(final[name], step_1[name]) for name in step_1)
    assert all(torch.isfinite(value).all() for value in final.values())
    logged = {tag: dict(values) for tag, values in logged_scalars(tmp_path).items()}
    assert logged["train/nonfinite_steps"] == {1: 0, 2: 1, 3: 2}
    # a skipped step has no gradient norm: NaN, not the norm of the step before
    assert math.isfinite(logged["train/grad_norm"][1]) and math.isnan(logged["train/grad_norm"][2])
    assert math.isnan(logged["train/grad_norm"][3])
    for step in (2, 3):
        assert f"step {step}: loss or gradient not finite, update skipped" in output


@pytest.mark.parametrize("config", ["cpu.yaml", "deepspeed_zero2.yaml", "fsdp2.yaml"])
def test_a_non_finite_step_without_in_batch_negatives(config, tmp_path, data, model_without_dropout, capsys):
    """group_step finds the loss not finite only at its last chunk, the first chunks back-propagated: on the
    CPU the step is skipped and its gradients cleared, so the weights stay those of step 1; under DeepSpeed,
    and FSDP2 (2 processes, its unsynced gradients), whose buffers already hold them, the run stops naming
    the checkpoint before. The CPU run runs in this process (suite time); the others are launched."""
    args = ("--model", model_without_dropout, "--data", data[0], "--max_steps", 2, "--save_steps", 1)
    args += ("--in_batch_negatives", "off")
    if config == "cpu.yaml":
        run_with_faults(tmp_path, *args, faults={"GRADCACHE_FAULT_NAN": "2"})
        assert "step 2: loss or gradient not finite, update skipped" in "".join(capsys.readouterr())
        step_1 = checkpoint_weights(tmp_path / "checkpoints" / "step_1")  # of models.Towers: "model." first
        final = weights(tmp_path / "final")
        assert all(torch.equal(final[name.removeprefix("model.")], step_1[name]) for name in step_1)
        return
    env = fault_environment(tmp_path, fsdp2=config == "fsdp2.yaml") | {"GRADCACHE_FAULT_NAN": "2"}
    processes = 2 if config == "fsdp2.yaml" else 1
    done = launch(CONFIGS / config, tmp_path, *RUN, *args, env=env, check=False, processes=processes)
    assert done.returncode != 0
    assert (
        "step 2: the loss was not finite, and without in-batch negatives DeepSpeed or FSDP2 already holds "
        "the gradients of its first chunks, which would leak into the next step. Resume from the last "
        f"checkpoint ({tmp_path / 'checkpoints' / 'step_1'})"
    ) in done.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_steps_non_finite_in_a_row_stop_the_run_naming_the_last_checkpoint_before_them(
    tmp_path, data, model_without_dropout
):
    """No checkpoint is saved inside the streak (it saved steps 4 and 5, and named step_5 to resume from: into
    the streak, with the weights that led to it). Also: --save_total_limit 2 keeps the two newest. In this
    process (suite time): the launched stop's one line is tests/test_train.py's bad data file."""
    args = ("--model", model_without_dropout, "--data", data[0], "--max_steps", 6, "--save_steps", 1)
    args += ("--save_total_limit", 2, "--max_bad_steps", 3)
    with pytest.raises(SystemExit) as stopped:
        run_with_faults(tmp_path, *args, faults={"GRADCACHE_FAULT_NAN": "4,5,6"})
    step_3 = tmp_path / "checkpoints" / "step_3"
    assert str(stopped.value).startswith("train.py: error: 3 steps in a row (through step 6)")
    assert f"The last checkpoint before them is {step_3}: resume from it" in str(stopped.value)
    assert not (tmp_path / "final").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]


def test_non_finite_steps_from_the_start_stop_saying_there_is_no_checkpoint(
    tmp_path, data, model_without_dropout, monkeypatch
):
    cache = gradcache.cache_representation_gradients

    def nan_cache(*args):
        loss, rep_grads = cache(*args)
        return loss * math.nan, rep_grads

    monkeypatch.setattr(gradcache, "cache_representation_gradients", nan_cache)
    args = ("--model", model_without_dropout, "--data", data[0], "--output_dir", tmp_path, *RUN)
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *args, "--max_steps", 4, "--save_steps", 1, "--max_bad_steps", 2)
    assert str(stopped.value) == (
        "train.py: error: 2 steps in a row (through step 2) had a loss or gradient that is not finite; "
        "none of them changed the weights. No checkpoint was saved before them: start again with a lower "
        "--lr, or check the data of these steps."
    )
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("processes", [1, 2])
def test_out_of_memory_halves_the_chunk_and_keeps_the_gradients(
    processes, tmp_path, data, model_without_dropout
):
    """With --auto_chunk_size a chunk that runs out of memory (on rank 1 only with two processes) is halved,
    and the run equals one with the halved chunk from the start. Two processes are launched; one runs in
    this process (suite time)."""
    args = ("--model", model_without_dropout, "--data", data[0], "--max_steps", 2, "--chunk_size", 4)
    faults = {"GRADCACHE_FAULT_OOM_ABOVE": "2"} | ({"GRADCACHE_FAULT_RANK": "1"} if processes == 2 else {})
    # Without --auto_chunk_size the run stops, naming both ways out: tests/test_chunks.py, in this process.
    if processes == 2:
        launch_with_faults(tmp_path / "auto", *args, "--auto_chunk_size", faults=faults, processes=processes)
        launch_with_faults(tmp_path / "small", *args[:-2], "--chunk_size", 2, processes=processes)
    else:  # with a guide model, which must encode at the halved chunk too: one chunk size in force
        guided, guide_chunks = ("--guide_model", model_without_dropout), []
        encode = train.guide_representations

        def recorded(guide, batch, gather, chunk_size=32):
            guide_chunks.append(chunk_size)
            return encode(guide, batch, gather, chunk_size)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train, "guide_representations", recorded)
            run_with_faults(tmp_path / "auto", *args, *guided, "--auto_chunk_size", faults=faults)
        assert guide_chunks == [4, 2, 2]  # step 1 at 4, redone at 2; step 2 at 2
        run_with_faults(tmp_path / "small", *args[:-2], *guided, "--chunk_size", 2)
    auto, small = weights(tmp_path / "auto" / "final"), weights(tmp_path / "small" / "final")
    assert max((auto[name] - small[name]).abs().max().item() for name in small) <= 1e-6
    assert [value for _, value in logged_scalars(tmp_path / "auto")["train/chunk_size"]] == [2, 2]
    assert not math.isnan(dict(logged_scalars(tmp_path / "auto")["train/loss"])[2])


# ---------------------------------------------------------------------------------------------------------
# fp16: the loss scaler's overflows are skipped steps, never bad ones
# ---------------------------------------------------------------------------------------------------------


def test_fp16_overflows_are_skipped_by_the_scaler_and_training_goes_on(
    tmp_path, data, model_without_dropout, capsys
):
    """accelerate's real fp16 path on a CPU (float16 autocast, a CPU GradScaler: see tests/faults), starting
    at a scale that overflows the first steps, more of them in a row than --max_bad_steps; a NaN loss at
    step 5 is a bad step, and must leave the scaler working. In this process (suite time)."""
    args = ("--model", model_without_dropout, "--data", data[0], "--max_steps", 6, "--save_steps", 3)
    initial_scale = 2.0**22  # the tiny model's gradients overflow float16 from about 2**19 up
    faults = {"GRADCACHE_FP16_SCALER": str(initial_scale), "GRADCACHE_FAULT_NAN": "5"}
    run_with_faults(tmp_path, *args, "--max_bad_steps", 2, faults=faults)
    done = capsys.readouterr()
    assert "mixed_precision: fp16" in done.out
    logged = {tag: dict(values) for tag, values in logged_scalars(tmp_path).items()}
    scales, skipped = logged["train/loss_scale"], logged["train/skipped_steps"]
    overflows = [step for step in scales if scales[step] < scales.get(step - 1, initial_scale)]
    assert len(overflows) > 2 and overflows == list(range(1, len(overflows) + 1))  # the first steps
    assert all(f"step {step}: fp16 overflow, update skipped" in done.out for step in overflows)
    assert logged["train/nonfinite_steps"] == {step: float(step >= 5) for step in range(1, 7)}
    assert skipped[6] == len(overflows) + 1  # the overflows and the NaN, no more
    assert "step 5: loss or gradient not finite, update skipped" in done.out
    initial, final = weights(model_without_dropout), weights(tmp_path / "final")
    if len(overflows) >= 3:  # no overflowing update reached the weights
        step_3 = checkpoint_weights(tmp_path / "checkpoints" / "step_3")
        assert all(torch.equal(step_3[name], initial[name]) for name in step_3)
    assert all(torch.isfinite(value).all() for value in final.values())
    assert max(float((final[name] - initial[name]).abs().max()) for name in initial) > 1e-4  # it trained


# ---------------------------------------------------------------------------------------------------------
# Out of memory where the processes cannot agree: the job ends, with the chunk size to use, and never hangs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["zero3", "ddp"])
def test_out_of_memory_on_one_process_ends_every_process(backend, tmp_path, data, model_without_dropout):
    """ZeRO-3: rank 1 runs out in a forward of stage 1, while rank 0 gathers parameters for the next one.
    DDP: rank 1 runs out in the backward that synchronizes, while rank 0 waits in its all-reduce (with
    --auto_chunk_size, which would otherwise redo the step alone)."""
    args = ("--model", model_without_dropout, "--data", data[0], "--max_steps", 2, "--eval_steps", 0)
    env = {"PYTHONPATH": f"{FAULTS}{os.pathsep}{Path(__file__).parents[1]}", "GRADCACHE_FAULT_RANK": "1"}
    if backend == "zero3":
        config, env = zero3_partitioning_everything(tmp_path), env | {"GRADCACHE_FAULT_OOM_FORWARD": "2"}
    else:
        config, args = CONFIGS / "cpu_ddp_2proc.yaml", (*args, "--auto_chunk_size")
        env |= {"GRADCACHE_FAULT_OOM_SYNC": "1", "ACCELERATE_USE_CPU": "true"}
    done = launch(config, tmp_path / "run", *RUN, *args, processes=2, env=env, check=False, timeout=240)
    assert done.returncode != 0
    assert "ran out of memory" in done.stderr and "Relaunch with --chunk_size 1." in done.stderr
    assert "chunk size of 1 or less" in done.stderr  # chunks of 3
    assert not (tmp_path / "run" / "final").exists()
