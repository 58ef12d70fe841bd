"""gradcache_step is exact under every backend: plain torch, accelerate, DDP and DeepSpeed ZeRO-1/2/3.

Each case trains 3 SGD steps with Gradient Cache (anchor, positive and hard-negative columns, chunks of 4
in a per-process batch of 6) and is compared with plain torch on the global batch, in one process,
unchunked: the losses, the first step's gradient and the weight updates after the third step
(tests/backend_worker.py holds the model, the data, the reference and the worker). Cases of more than one
process, and all DeepSpeed cases, run under torchrun on the CPU (gloo; DeepSpeed's CPU accelerator), one
launch per backend and process count (three processes: tests/test_matrix.py); the rest run in this
process. A case named "-cross" contrasts with the examples of every process (cross-process negatives: each
process computes its own rows of the loss, tiled, against everyone's candidates); "-symmetric-matryoshka"
adds the reverse direction and Matryoshka prefixes; "-uneven" gives the ranks different batch sizes;
"-accumulate2" runs two micro-batches per optimizer step in `accelerator.accumulate()`; "-dropout" draws
dropout masks on each of two processes from a seed of its own, against a replay of what each stage 1 encoded.
Every fp32 comparison is tests/references.py's rule: the float64 reference is the truth, and the run must be
as close to it as the float32 reference is.

    .venv/bin/python -m pytest -q tests/test_backends.py

fp16 runs end to end only on a GPU: here the loss scale is checked with a CPU GradScaler, and
bench/gpu_check.py runs accelerate's GradScaler and DeepSpeed's fp16 on CUDA.
"""

import functools
import math
import subprocess
import sys

import pytest
import torch
from backend_worker import (
    CHUNK_SIZE,
    LEARNING_RATE,
    METRICS,
    NUM_COLUMNS,
    NUM_STEPS,
    PER_PROCESS_BATCH,
    REPO,
    Case,
    compare,
    initial_weights,
    launch,
    load_results,
    loss_options,
    make_micro_batches,
    make_model,
    markdown_table,
    reference_run,
    reset_accelerate_state,
    run_case,
    updates,
    within,
)
from references import (
    Exactness,
    StageOneRecorder,
    assert_exact,
    materialized_contrastive_loss,
    relative_error,
)

from gradcache import accelerate_sync_context, gradcache_step


def local_rows_cases():
    """Cross-process negatives with the whole loss: symmetric, Matryoshka, ranks of different sizes. The
    matrix covers three processes (tests/test_matrix.py: zero2-3proc-uneven-...-cross, zero3-3proc-...-cross
    symmetric, ddp-2proc-uneven-...-matryoshka-cross), in its own three-process launch."""
    full = dict(cross_process_negatives=True, symmetric=True, matryoshka_dims=(8, 5, 3), uneven=True)
    yield Case("ddp-2proc-cross-symmetric-matryoshka-uneven", world_size=2, **full)


FP32_CASES = [
    Case("torch", plain_torch=True),
    Case("torch-two-towers", plain_torch=True, two_towers=True),
    Case("accelerate"),
    Case("accelerate-two-towers", two_towers=True),
    Case("accelerate-accumulate2", accumulation_steps=2),
    Case("accelerate-two-towers-accumulate2", two_towers=True, accumulation_steps=2),
    Case("ddp-2proc", world_size=2),
    Case("ddp-2proc-two-towers", world_size=2, two_towers=True),
    Case("ddp-2proc-cross", world_size=2, cross_process_negatives=True),
    Case("ddp-2proc-two-towers-cross", world_size=2, two_towers=True, cross_process_negatives=True),
    Case("ddp-2proc-accumulate2", world_size=2, accumulation_steps=2),
    # DeepSpeed, each stage with both encoders in some case; more in tests/test_matrix.py
    Case("zero1-2proc-shared", 1, 2),
    Case("zero2-2proc-two-towers-cross", 2, 2, two_towers=True, cross_process_negatives=True),
    Case("zero3-2proc-cross", 3, 2, cross_process_negatives=True),
    Case("zero2-2proc-accumulate2", 2, 2, accumulation_steps=2),
    Case("zero3-2proc-two-towers-accumulate2", 3, 2, two_towers=True, accumulation_steps=2),
    Case("zero2-2proc-two-towers-offload-optimizer", 2, 2, two_towers=True, offload=("optimizer",)),
    Case("zero3-2proc-two-towers-offload-all", 3, 2, two_towers=True, offload=("optimizer", "param")),
    *local_rows_cases(),
]
BF16_CASES = [
    Case("accelerate-bf16-autocast", mixed_precision="bf16"),
    Case("accelerate-two-towers-bf16-autocast", two_towers=True, mixed_precision="bf16"),
    Case("zero2-2proc-bf16", 2, 2, mixed_precision="bf16"),
    Case("zero3-2proc-two-towers-bf16", 3, 2, two_towers=True, mixed_precision="bf16"),
]
# Negative control: accelerator.backward on every chunk with no sync context makes DeepSpeed step per chunk.
WITHOUT_SYNC_CONTEXT = Case("zero2-2proc-without-sync-context", 2, 2, use_sync_context=False)
# Dropout on two processes, each drawing its own masks: against a replay of what each one's stage 1 encoded.
DROPOUT = Case("ddp-2proc-dropout", world_size=2, dropout=0.2)
ALL_CASES = [*FP32_CASES, *BF16_CASES, WITHOUT_SYNC_CONTEXT, DROPOUT]
DDP_CASES = [case for case in ALL_CASES if case.world_size > 1 and case.zero_stage is None]

LAUNCH_ENVIRONMENT = {
    "ddp": {"ACCELERATE_USE_CPU": "true"},  # accelerate's DDP on the CPU (gloo)
    "deepspeed": {"DS_ACCELERATOR": "cpu"},
    # DDP cases first, then DeepSpeed ones: the worker asks accelerate for the CPU case by case.
    "mixed": {"DS_ACCELERATOR": "cpu"},
}


def launch_group(case):
    if case.world_size == 1 and case.zero_stage is None:
        return "in-process"
    return f"{'ddp' if case.zero_stage is None else 'deepspeed'}-{case.world_size}proc"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """results_of(case) -> every rank's result; runs the case's whole launch group on first use.

    A failed launch is remembered, so that its tests fail with its error instead of relaunching it.
    """
    done = {}

    def results_of(case):
        group = launch_group(case)
        if group not in done:
            cases = [c for c in ALL_CASES if launch_group(c) == group]
            out_dir = tmp_path_factory.mktemp(group)
            try:
                if group == "in-process":
                    for c in cases:
                        run_case(c, out_dir)
                    done[group] = load_results(cases, out_dir, world_size=1)
                else:
                    environment = LAUNCH_ENVIRONMENT[group.split("-")[0]]
                    done[group] = launch(cases, out_dir, cases[0].world_size, environment)
            except Exception as error:
                done[group] = error
        if isinstance(done[group], Exception):
            raise done[group]
        return done[group][case.name]

    return results_of


@pytest.fixture
def fresh_accelerate_state():
    reset_accelerate_state()
    yield
    reset_accelerate_state()


@pytest.mark.parametrize("case", FP32_CASES, ids=lambda case: case.name)
def test_fp32_matches_the_full_batch_reference(case, runs):
    comparison = compare(case, runs(case))
    print(case.name, {metric: str(comparison[metric]) for metric in METRICS})
    for metric in METRICS:
        assert comparison[metric].holds, (metric, str(comparison[metric]))
    assert comparison["steps_once_per_batch"], [run["steps_after_micro_batch"] for run in runs(case)]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda case: case.name)
def test_bf16_stays_within_tolerance_of_the_fp32_reference(case, runs):
    comparison = compare(case, runs(case))
    assert within(case, comparison), {metric: str(comparison[metric]) for metric in METRICS}
    assert comparison["steps_once_per_batch"], [run["steps_after_micro_batch"] for run in runs(case)]
    # A difference 100 times what fp32 may have shows that bf16 really computed the step.
    assert comparison["gradient"].error > 100 * comparison["gradient"].bound, str(comparison["gradient"])


@pytest.mark.parametrize("case", DDP_CASES, ids=lambda case: case.name)
def test_ddp_all_reduces_once_per_step(case, runs):
    """Counted by a DDP communication hook: one call per gradient bucket and all-reduce."""
    for run in runs(case):
        per_plain_step = run["allreduces_plain_step"]
        assert run["allreduces_per_step"] == [per_plain_step] * NUM_STEPS
        # The counter sees every all-reduce: without the sync context each backward pays one.
        assert run["backward_calls_per_step"] > 1
        assert run["allreduces_without_sync_context"] == per_plain_step * run["backward_calls_per_step"]


def test_without_sync_context_deepspeed_steps_on_every_chunk(runs):
    """The negative control of the DeepSpeed cases: their checks catch a backend stepping per chunk."""
    backward_calls_per_batch = math.ceil(PER_PROCESS_BATCH / CHUNK_SIZE) * NUM_COLUMNS
    comparison = compare(WITHOUT_SYNC_CONTEXT, runs(WITHOUT_SYNC_CONTEXT))
    for run in runs(WITHOUT_SYNC_CONTEXT):
        assert run["deepspeed_global_steps"] == NUM_STEPS * backward_calls_per_batch
    assert not comparison["steps_once_per_batch"]
    assert comparison["update"].error > 1e-2, str(comparison["update"])


def replay_every_rank(ranks, dtype, rng_state=None):
    """The first step's gradient as DDP averages it, from tests/references.py's StageOneRecorder: every rank's
    stage-1 encodings replayed in this process (each from the RNG state recorded before it, so dropout draws
    the same masks; or all from `rng_state`, the negative control), each rank's loss on its own rows
    materialized and back-propagated through one graph, the sum divided by the number of ranks."""
    model = make_model(DROPOUT).to(dtype)
    loss_fn = functools.partial(materialized_contrastive_loss, **loss_options(DROPOUT))
    for run in ranks:
        recorder = StageOneRecorder()
        calls, recorder.batch_sizes = run["stage_one"]
        recorder.calls = [(state if rng_state is None else rng_state, entries) for state, entries in calls]
        recorder.replay([model] * NUM_COLUMNS, loss_fn)
    return {name: p.grad / len(ranks) for name, p in model.named_parameters()}


def test_dropout_on_two_processes_is_replayed_exactly(runs):
    ranks = runs(DROPOUT)
    first_states = [run["stage_one"][0][0][0] for run in ranks]
    assert not torch.equal(*first_states)  # the ranks drew from RNG states of their own
    float32, truth = (replay_every_rank(ranks, dtype) for dtype in (torch.float32, torch.float64))
    measured = assert_exact(ranks[0]["first_grads"], float32, truth, "the first step's gradients")
    print(f"{DROPOUT.name}: {measured}")
    # The negative control: other masks (every chunk replayed from one other RNG state) break the rule.
    other_state = torch.Generator().manual_seed(7).get_state()
    wrong = Exactness(
        relative_error(ranks[0]["first_grads"], replay_every_rank(ranks, torch.float64, other_state)),
        measured.e_ref,
    )
    assert not wrong.holds, f"the run matches other dropout masks: {wrong}"


def test_cross_process_negatives_change_the_gradients(runs):
    """The two 2-process references differ, so each DDP case is checked against the right one."""
    own_batch = Case("ddp-2proc", world_size=2)
    global_batch = Case("ddp-2proc", world_size=2, cross_process_negatives=True)
    assert compare(global_batch, runs(own_batch))["gradient"].error > 1e-2


def test_fp16_loss_scale_reaches_the_gradients_once(fresh_accelerate_state):
    """accelerator.backward multiplies each chunk's surrogate by the loss scale; nothing else scales.

    accelerate builds its GradScaler only for fp16 on an accelerator device (Accelerator.__init__; on the
    CPU fp16 silently trains in fp32), so this installs torch's CPU GradScaler where accelerator.backward
    and the prepared optimizer use it.
    """
    from accelerate import Accelerator

    case = Case("fp16-grad-scaler")
    float32, truth = reference_run(case, torch.float32), reference_run(case, torch.float64)
    accelerator = Accelerator()
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = make_model(case)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE))
    gradcache_step(
        model,
        make_micro_batches(case)[0],
        chunk_size=CHUNK_SIZE,
        backward=accelerator.backward,
        sync_context=accelerate_sync_context(accelerator, model),
    )
    scale = accelerator.scaler.get_scale()
    scaled = {name: p.grad / scale for name, p in model.named_parameters()}
    assert_exact(scaled, float32["first_grads"], truth["first_grads"], "scaled gradients / scale")

    # What accelerator.unscale_gradients() does on an accelerator device (there a no-op on the CPU).
    accelerator.scaler.unscale_(optimizer.optimizer)
    unscaled = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert_exact(unscaled, float32["first_grads"], truth["first_grads"], "unscaled gradients")

    optimizer.step()
    assert not accelerator.optimizer_step_was_skipped
    start = initial_weights(case)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    expected = [{name: -LEARNING_RATE * g for name, g in r["first_grads"].items()} for r in (float32, truth)]
    assert_exact(updates(weights, start), *expected, "update")


def test_markdown_table_marks_failures(runs):
    """The verdict bench/gpu_check.py prints, on CPU results: a matching case passes, the control fails."""
    passing, failing = Case("accelerate"), WITHOUT_SYNC_CONTEXT
    table = markdown_table([(case, compare(case, runs(case))) for case in (passing, failing)])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert rows[passing.name].rstrip(" |").endswith("pass")
    assert rows[failing.name].rstrip(" |").endswith("FAIL")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole GPU check")
def test_gpu_check_says_it_needs_cuda():
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode != 0
    assert "needs CUDA" in completed.stderr
