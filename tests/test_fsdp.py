"""FSDP2 (accelerate's `fsdp_version: 2`, PyTorch's fully_shard) under Gradient Cache, on CPU processes.

accelerate picks FSDP only for accelerator devices; tests/fsdp_shim.py makes its state FSDP on these CPU
processes (gloo), as it would be on GPUs, so that `accelerator.prepare` shards with fully_shard: parameters
and gradients DTensors, gradients reduce-scattered. train.py without the shim refuses the config in one
line, as it refuses an FSDP1 config.

The step: tests/backend_worker.py's cases under FSDP2, 2 processes, against plain torch on the global batch
in one process (float64 truth, tests/references.py's rule): the shared encoder, towers with cross-process
negatives, gradient accumulation (uneven batches, cross-process negatives), and dropout against a replay of
what each stage 1 encoded; a reduce-scatter per unit and optimizer step, counted. Negative controls that must
fail: every chunk reduce-scattered with its surrogate divided by the groups (what accelerate's accumulate()
over chunks does), no RNG replay, a rank's gradients dropped. tests/test_matrix.py's FSDP2 rows cross it with
the models, losses, LoRA, checkpointing, budgets and 3 processes.

    .venv/bin/python -m pytest -q tests/test_fsdp.py
"""

import os

import pytest
import torch
from backend_worker import METRICS, NUM_STEPS, Case, compare, launch
from fsdp_shim import sitecustomize_line
from references import Exactness, assert_exact, relative_error
from test_backends import replay_every_rank
from test_train import (
    BACKEND_ARGS,
    CLIPPING_WRONG_PATHS,
    CONFIGS,
    REPO,
    SGD_CLIP,
    SGD_LR,
    SGD_SITECUSTOMIZE,
    assert_replayed,
    fails_with,
    logged_scalars,
    max_difference,
    recorded_steps,
    recording_sitecustomize,
    run_main,
    updates,
    weights,
)
from test_train import launch as launch_train

FSDP2 = dict(world_size=2, fsdp2=True)
EXACT = [
    Case("fsdp2-2proc", **FSDP2),
    Case("fsdp2-2proc-two-towers-cross", **FSDP2, two_towers=True, cross_process_negatives=True),
    Case("fsdp2-2proc-accumulate2", **FSDP2, accumulation_steps=2),
    Case("fsdp2-2proc-cross-uneven-accumulate2", **FSDP2, cross_process_negatives=True, uneven=True,
         accumulation_steps=2),
]  # fmt: skip
DROPOUT = Case("fsdp2-2proc-dropout", **FSDP2, dropout=0.2)
PER_CHUNK = Case("fsdp2-2proc-per-chunk", **FSDP2, control="per-chunk")
DROP_RANK = Case("fsdp2-2proc-drop-rank", **FSDP2, control="drop-rank")
NO_REPLAY = Case("fsdp2-2proc-dropout-no-replay", **FSDP2, dropout=0.2, control="no-replay")
CASES = [*EXACT, DROPOUT, PER_CHUNK, DROP_RANK, NO_REPLAY]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case name: every rank's result}, from one 2-process launch of all the cases."""
    return launch(CASES, tmp_path_factory.mktemp("fsdp2"), 2, {"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("case", EXACT, ids=lambda case: case.name)
def test_the_step_under_fsdp2_is_exact_and_reduce_scatters_once_per_step(case, runs):
    ranks = runs[case.name]
    comparison = compare(case, ranks)
    print(case.name, {metric: str(comparison[metric]) for metric in METRICS})
    for metric in METRICS:
        assert comparison[metric].holds, (metric, str(comparison[metric]))
    assert comparison["steps_once_per_batch"], [run["steps_after_micro_batch"] for run in ranks]
    # One reduce-scatter per FSDP2 unit and optimizer step, whatever the chunks and accumulated batches.
    assert all(run["reduce_scatters_per_step"] == [run["units"]] * NUM_STEPS for run in ranks)


def test_dropout_under_fsdp2_is_replayed_and_without_replay_is_not(runs):
    ranks, unreplayed = runs[DROPOUT.name], runs[NO_REPLAY.name]
    float32, truth = (replay_every_rank(ranks, dtype) for dtype in (torch.float32, torch.float64))
    measured = assert_exact(ranks[0]["first_grads"], float32, truth, "the first step's gradients")
    # The control: stage 3 drew masks of its own, against the replay of what its stage 1 encoded.
    reference = replay_every_rank(unreplayed, torch.float64)
    wrong = Exactness(relative_error(unreplayed[0]["first_grads"], reference), measured.e_ref)
    print(f"{DROPOUT.name}: {measured}; without RNG replay {wrong}")
    assert not wrong.holds, f"a run without RNG replay matches its replay: {wrong}"


@pytest.mark.parametrize("control", [PER_CHUNK, DROP_RANK], ids=lambda case: case.name)
def test_the_negative_controls_fail(control, runs):
    """Every chunk synchronized with its surrogate divided by the groups (each a reduce-scatter: the counter
    sees them), and a rank's gradients dropped, are caught by the rule the exact cases pass."""
    ranks = runs[control.name]
    comparison = compare(control, ranks)
    print(control.name, {metric: str(comparison[metric]) for metric in METRICS})
    assert not comparison["gradient"].holds and not comparison["update"].holds
    if control == PER_CHUNK:
        assert all(run["reduce_scatters_per_step"][0] > run["units"] for run in ranks)


REFUSALS = {
    "1": ("fsdp_version: 1", "accelerate_configs/fsdp2.yaml"),
    "2": ("runs these processes as NO", "Launch it on GPUs"),
}


@pytest.mark.parametrize("version", REFUSALS)
def test_an_fsdp1_config_and_fsdp_that_accelerate_does_not_run_are_refused_in_one_line(
    version, tmp_path, monkeypatch, capsys, data, model_without_dropout
):
    """What an FSDP config's launch sets (ACCELERATE_USE_FSDP, FSDP_VERSION) in a process where accelerate
    runs no FSDP (one CPU process): version 1 is refused naming fsdp2.yaml, version 2 naming what runs."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", version)
    run = ("--model", model_without_dropout, "--data", data[0], "--output_dir", tmp_path / "run")
    fails_with(capsys, lambda: run_main(monkeypatch, *run), *REFUSALS[version])


def test_fsdp2_yaml_on_cpus_without_the_shim_stops_in_one_line(tmp_path, data, model_without_dropout):
    """accelerate runs the shipped config's processes as DDP on CPUs: the run stops before training."""
    done = launch_train(
        CONFIGS / "fsdp2.yaml", tmp_path, "--model", model_without_dropout, "--data", data[0],
        "--max_steps", 1, "--wandb_mode", "disabled",
        processes=2, env={"ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""}, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "an FSDP accelerate config, but accelerate runs these processes as MULTI_CPU" in done.stderr
    last_lines = "\n".join(done.stderr.splitlines()[-3:])  # torchrun's summary: the line is the root cause
    assert "traceback : train.py: error: an FSDP accelerate config" in last_lines
    assert not (tmp_path / "checkpoints").exists()


def shim_environment(folder, first=SGD_SITECUSTOMIZE):
    """A launch of train.py under FSDP2 on CPU processes, with SGD in place of AdamW (tests/test_train.py's
    exactness runs, or what `first` says): a sitecustomize.py (in `folder`) that installs both, and
    ACCELERATE_USE_CPU."""
    site = folder / "fsdp_sitecustomize"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(first + "\n" + sitecustomize_line())
    path = os.pathsep.join(filter(None, [str(site), str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""}


def test_train_py_under_fsdp2_trains_exactly_saves_whole_and_resumes_bit_for_bit(
    tmp_path, data, model_without_dropout
):
    """accelerate_configs/fsdp2.yaml, 2 processes: train.py's run equals the plain optimization replayed on
    each process's whole batch (tests/test_train.py's assert_replayed: the batches the run recorded, SGD,
    clipped), by references.py's rule: the updates of final/ (gathered whole, loaded by
    sentence-transformers in one process) and the logged losses and gradient norms, none of which the
    replay not clipped, clipped at 1.0 or with the processes' batches contrasted as one reaches; a sharded
    checkpoint at step 2 (each process its part), from which a second launch resumes to the same final
    weights bit for bit. It evaluates before and after training."""
    env = shim_environment(tmp_path, recording_sitecustomize(tmp_path))  # and SGD in place of AdamW
    env["PYTHONPATH"] += os.pathsep + str(REPO)  # the recording imports gradcache at start-up
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", data[1], *BACKEND_ARGS)
    common += ("--lr", SGD_LR, "--max_grad_norm", SGD_CLIP, "--save_steps", 2)
    run = tmp_path / "run"
    done = launch_train(CONFIGS / "fsdp2.yaml", run, *common, processes=2, env=env)
    assert "DistributedType.FSDP" in done.stdout and "processes: 2" in done.stdout, done.stdout[-3000:]
    assert f"saved {run / 'final'}: load it with SentenceTransformer(path)" in done.stdout  # not FSDP...
    saved = weights(run / "final")
    run_updates = updates(saved, weights(model_without_dropout))
    wrong_paths = CLIPPING_WRONG_PATHS | {"contrasted as one": {"together": True}}
    steps, logged = recorded_steps(tmp_path, 2), logged_scalars(run)
    assert_replayed(run_updates, logged, data, model_without_dropout, steps, "fsdp2 x 2", wrong_paths)
    assert [step for step, _ in logged["eval/dev_cosine_mrr@10"]] == [0, 3]
    step_2 = run / "checkpoints" / "step_2"
    shards = sorted(path.name for path in step_2.rglob("*.distcp"))
    assert len(shards) >= 2, sorted(path.name for path in step_2.rglob("*"))  # each process wrote its own
    resumed = tmp_path / "resumed"
    launch_train(
        CONFIGS / "fsdp2.yaml", resumed, *common, "--resume_from_checkpoint", step_2, processes=2, env=env
    )
    assert max_difference(weights(resumed / "final"), saved) == 0
