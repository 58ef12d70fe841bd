"""train.py end to end against replays that share none of the project's code: gradient accumulation on one and
two processes, a non-finite step in the middle of a run, and teacher-scored positives drawn over epochs; and
gradcache across two gloo processes of uneven batches (tests/offsets_worker.py), in seconds.

Each run trains with SGD in place of AdamW (test_train.SGD_LR: an update is the gradient itself, so a wrong
scale shows) and records, through a test double around gradcache.gradcache_step, the texts of every batch
as it trained on them: the replay takes its batches from that record, never from train.py's sampler. The
replay is sentence-transformers' public API (MultipleNegativesRankingLoss, the model's own tokenizer),
plain torch SGD, the learning rate from the schedule's definition and the teacher's scores read from the
raw JSON with the json module, in float32 and float64, judged by tests/references.py's rule. Each negative
control is a replay that takes a wrong path (the accumulated batches contrasted as one, the fields
swapped, the skipped update applied, the masks left out), which the run must fail.
"""

import copy
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from references import (
    assert_exact,
    assert_inexact,
    float64,
    masked_contrastive_loss,
    materialized_contrastive_loss,
    reference_objective,
    relative_error,
    teacher_of,
)
from safetensors.torch import load_file
from test_train import (
    CONFIGS,
    REPO,
    SGD_LR,
    WORDS,
    in_steps,
    launch,
    logged_scalars,
    record_batches,
    recorded_batches,
    recording_environment,
    run_main,
    sgd_launch,
    weights,
    write_rows,
)

DTYPES = (torch.float32, torch.float64)


def rate_factor(updates_done, total_steps, warmup_ratio=0.1):
    """The linear schedule as README.md defines it: the warmup steps climb to the peak, the first already at
    peak / warmup, then a linear decay to 0 after the last step; it counts applied updates only."""
    warmup = round(warmup_ratio * total_steps)
    if updates_done < warmup:
        return (updates_done + 1) / warmup
    return max(0.0, 1 - (updates_done - warmup) / max(1, total_steps - warmup))


def ranking_loss(model, batches):
    """sentence-transformers' MultipleNegativesRankingLoss on each batch, their mean (what DDP and
    accelerate's accumulation average the gradients of)."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    loss_fn = MultipleNegativesRankingLoss(model, scale=20.0)
    losses = [loss_fn([model.preprocess(texts) for texts in batch], None) for batch in batches]
    return sum(losses) / len(losses)


def sgd_replay(model_folder, steps, dtype, total_steps, loss_fn=ranking_loss, skipped=()):
    """Plain torch SGD at SGD_LR x rate_factor over `steps` (each: the batches of one optimizer step), no
    clipping; the steps in `skipped` (1-based) apply nothing and leave the schedule where it was. Returns
    each step's weights (float64), and the losses, gradient norms and rates of the steps."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_folder), device="cpu").to(dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    replayed = {"weights": [], "losses": [], "grad_norms": [], "rates": []}
    updates_done = 0
    for number, batches in enumerate(steps, start=1):
        rate = SGD_LR * rate_factor(updates_done, total_steps)
        replayed["rates"].append(rate)
        if number not in skipped:
            loss = loss_fn(model, batches)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            replayed["grad_norms"].append(
                float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            )
            replayed["losses"].append(float(loss.detach()))
            for group in sgd.param_groups:
                group["lr"] = rate
            sgd.step()
            sgd.zero_grad()
            updates_done += 1
        replayed["weights"].append(
            {name: w.detach().double().clone() for name, w in model.state_dict().items()}
        )
    return replayed


def updates(trained, initial, names=None):
    """What training changed, in float64, over `names` (default: every weight)."""
    return {name: trained[name].double() - initial[name].double() for name in names or initial}


def tokens(model_folder, batches):
    """The tokens of every text of `batches`, as the model's own tokenizer counts them (no padding)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_folder), device="cpu")
    texts = [text for batch in batches for column in batch for text in column]
    encoded = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)
    return sum(len(ids) for ids in encoded["input_ids"])


def check_logged_batch(run_dir, printed, model_folder, steps, processes, batch_size, accumulation):
    """The effective batch and the negatives per anchor, logged and printed, are the launch's numbers, and the
    logged throughput counts that batch: examples/s over tokens/s is the step's examples over its tokens."""
    logged = logged_scalars(run_dir)
    effective = processes * batch_size * accumulation
    assert {value for _, value in logged["train/effective_batch_size"]} == {effective}
    assert f"effective_batch_size: {effective}\n" in printed
    assert f"negatives_per_example: {batch_size * 2 - 1}\n" in printed  # a positive and a hard negative
    ratios = [
        e / t
        for (_, e), (_, t) in zip(
            logged["train/examples_per_second"], logged["train/tokens_per_second"], strict=True
        )
    ]
    expected = [effective / tokens(model_folder, step) for step in steps]
    assert ratios == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------
# 1. Gradient accumulation and the logged batch, end to end
# ---------------------------------------------------------------------------------------------------------


def one_contrast(model, batches):
    """The wrong path: the accumulated batches contrasted together as one batch."""
    joined = [[text for batch in batches for text in batch[column]] for column in range(len(batches[0]))]
    return ranking_loss(model, [joined])


def accumulation_replays(model_folder, steps):
    """The right replays in float32 and float64, and the wrong path's (one contrast) in both."""
    total = len(steps)
    right = [sgd_replay(model_folder, steps, dtype, total) for dtype in DTYPES]
    wrong = [sgd_replay(model_folder, steps, dtype, total, loss_fn=one_contrast) for dtype in DTYPES]
    return right, wrong


def judge_accumulation_run(run_dir, model_folder, steps, what):
    """The run's final updates, logged losses, gradient norms and rates against the replay; its updates
    against the wrong path's."""
    initial = weights(model_folder)
    right, wrong = accumulation_replays(model_folder, steps)
    run = updates(weights(run_dir / "final"), initial)
    last = [updates(replay["weights"][-1], initial) for replay in right]
    measured = assert_exact(run, *last, f"{what}, updates")
    wrong_last = [updates(replay["weights"][-1], initial) for replay in wrong]
    control = assert_inexact(run, *wrong_last, f"{what}, updates against one contrast")
    print(f"{what}: updates {measured}; against the batches contrasted as one {control.error:.1e}")
    logged = logged_scalars(run_dir)
    for tag, key in (("train/loss", "losses"), ("train/grad_norm", "grad_norms")):
        values = [value for _, value in logged[tag]]
        measured = assert_exact(values, right[0][key], right[1][key], f"{what}, {tag}")
        print(f"{what}: {tag} {measured}")
    rates = [value for _, value in logged["train/learning_rate"]]
    assert rates == pytest.approx(right[1]["rates"], rel=1e-6)


@pytest.mark.parametrize("accumulation", [2, 3])
def test_accumulation_on_one_process_matches_the_replayed_global_batch(
    accumulation, tmp_path, data, model_without_dropout, monkeypatch, capsys
):
    """--gradient_accumulation_steps 2 and 3, batches of 8 in chunks of 3, in this process: every optimizer
    step's update is SGD on the mean of sentence-transformers' loss over the step's batches; the logged
    effective batch is 8 x the accumulation."""
    run_dir = tmp_path / "run"
    args = ("--model", model_without_dropout, "--data", data[0], "--dev_data", "", "--batch_size", 8)
    args += (
        "--chunk_size",
        3,
        "--gradient_accumulation_steps",
        accumulation,
        "--max_steps",
        6 // accumulation,
    )
    args += ("--lr", SGD_LR, "--max_grad_norm", 0, "--save_steps", 0, "--output_dir", run_dir)
    with monkeypatch.context() as patch:
        batches = record_batches(patch)
        run_main(monkeypatch, *args)
    printed = capsys.readouterr().out
    steps = in_steps(batches, accumulation)
    assert len(steps) == 6 // accumulation and all(len(batch[0]) == 8 for batch in batches)
    check_logged_batch(run_dir, printed, model_without_dropout, steps, 1, 8, accumulation)
    judge_accumulation_run(run_dir, model_without_dropout, steps, f"accumulation {accumulation} x 1 process")


def test_accumulation_on_two_processes_matches_the_replayed_global_batch(
    tmp_path, data, model_without_dropout
):
    """Two DDP processes, batches of 4, --gradient_accumulation_steps 2: each optimizer step averages the
    loss of 4 batches (2 processes x 2), recorded by each process as it trained on them; the logged
    effective batch is 2 x 4 x 2 = 16 and the throughput counts all of it."""
    run_dir, environment = tmp_path / "run", {"ACCELERATE_USE_CPU": "true"} | recording_environment(tmp_path)
    args = ("--model", model_without_dropout, "--data", data[0], "--dev_data", "", "--batch_size", 4)
    args += ("--chunk_size", 3, "--gradient_accumulation_steps", 2, "--max_steps", 3, "--lr", SGD_LR)
    args += ("--max_grad_norm", 0, "--save_steps", 0, "--wandb_mode", "disabled")
    done = launch(CONFIGS / "cpu_ddp_2proc.yaml", run_dir, *args, processes=2, env=environment)
    per_rank = [in_steps(recorded_batches(tmp_path, rank), 2) for rank in (0, 1)]
    steps = [a + b for a, b in zip(*per_rank, strict=True)]
    assert len(steps) == 3 and all(len(step) == 4 for step in steps)
    check_logged_batch(run_dir, done.stdout, model_without_dropout, steps, 2, 4, 2)
    judge_accumulation_run(run_dir, model_without_dropout, steps, "accumulation 2 x 2 processes")


# ---------------------------------------------------------------------------------------------------------
# 2. A non-finite step in the middle of a run
# ---------------------------------------------------------------------------------------------------------


def test_a_bad_step_in_the_middle_skips_exactly_its_update(
    tmp_path, data, model_without_dropout, monkeypatch
):
    """Infinite gradients at step 3 and a NaN loss at step 5 of 6 (tests/faults/sitecustomize.py): the
    weights of every step checkpointed (none is saved at a bad step) equal the replay that skips exactly
    those two updates, and every logged rate is the schedule's at the updates applied so far. The wrong
    path: the replay that applies the bad steps' batches as good ones."""
    from test_reliability import run_with_faults

    run_dir, total = tmp_path / "run", 6
    args = ("--model", model_without_dropout, "--data", data[0], "--dev_data", "", "--max_steps", total)
    args += ("--lr", SGD_LR, "--max_grad_norm", 0, "--save_steps", 1, "--save_total_limit", 0)
    with monkeypatch.context() as patch:
        batches = record_batches(patch)
        run_with_faults(run_dir, *args, faults={"GRADCACHE_FAULT_INF": "3", "GRADCACHE_FAULT_NAN": "5"})
    steps = in_steps(batches, 1)
    assert len(steps) == total
    bad = (3, 5)
    logged = {tag: dict(values) for tag, values in logged_scalars(run_dir).items()}
    assert [step for step, norm in logged["train/grad_norm"].items() if math.isnan(norm)] == list(bad)
    applied_before = {step: step - 1 - sum(b < step for b in bad) for step in range(1, total + 1)}
    assert logged["train/learning_rate"] == {
        step: pytest.approx(SGD_LR * rate_factor(applied, total), rel=1e-6)
        for step, applied in applied_before.items()
    }
    right = [sgd_replay(model_without_dropout, steps, dtype, total, skipped=bad) for dtype in DTYPES]
    wrong = [sgd_replay(model_without_dropout, steps, dtype, total) for dtype in DTYPES]
    initial = weights(model_without_dropout)
    good = [step for step in range(1, total + 1) if step not in bad]
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [f"step_{s}" for s in good]
    for step in good:
        trained = load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")
        names = sorted(trained)  # the model's weights, as weights() names them
        run = updates(trained, initial, names)
        measured = assert_exact(
            run, *[updates(r["weights"][step - 1], initial, names) for r in right], f"step {step}"
        )
        print(f"bad steps 3 and 5, step {step}: updates {measured}")
    wrong_last = [updates(replay["weights"][-1], initial, names) for replay in wrong]
    control = assert_inexact(run, *wrong_last, "every step applied")
    print(f"bad steps 3 and 5: against the replay applying them {control.error:.1e}")


def test_a_bad_step_in_the_middle_under_deepspeed_skips_exactly_its_update(
    tmp_path, data, model_without_dropout
):
    """ZeRO-2 in one launched process (DeepSpeed's engine steps inside the last backward, and holds the
    gradients in its own buffers), a NaN loss at step 2 of 4: the final weights equal the replay that skips
    exactly that update, not the one that applies it; the logged rates are the schedule's at the updates
    applied so far."""
    total, bad = 4, (2,)
    config, _ = sgd_launch(tmp_path, CONFIGS / "deepspeed_zero2.yaml")  # its DeepSpeed config takes SGD
    environment = recording_environment(tmp_path, faults={"GRADCACHE_FAULT_NAN": "2"})
    args = ("--model", model_without_dropout, "--data", data[0], "--dev_data", "", "--max_steps", total)
    args += ("--batch_size", 8, "--chunk_size", 3, "--lr", SGD_LR, "--max_grad_norm", 0, "--save_steps", 0)
    done = launch(config, tmp_path / "run", *args, "--wandb_mode", "disabled", env=environment)
    assert "DistributedType.DEEPSPEED" in done.stdout
    assert "step 2: loss or gradient not finite, update skipped" in done.stdout
    steps = in_steps(recorded_batches(tmp_path, 0), 1)
    assert len(steps) == total
    right, wrong = (
        [
            sgd_replay(model_without_dropout, steps, dtype, total, skipped=skipped)["weights"][-1]
            for dtype in DTYPES
        ]
        for skipped in (bad, ())
    )
    initial = weights(model_without_dropout)
    run = updates(weights(tmp_path / "run" / "final"), initial)
    measured = assert_exact(run, *[updates(w, initial) for w in right], "ZeRO-2, bad step 2, updates")
    control = assert_inexact(run, *[updates(w, initial) for w in wrong], "ZeRO-2, every step applied")
    print(f"ZeRO-2, bad step 2: updates {measured}; against the replay applying it {control.error:.1e}")
    logged = {tag: dict(values) for tag, values in logged_scalars(tmp_path / "run").items()}
    assert [step for step, norm in logged["train/grad_norm"].items() if math.isnan(norm)] == list(bad)
    applied_before = {step: step - 1 - sum(b < step for b in bad) for step in range(1, total + 1)}
    assert logged["train/learning_rate"] == {
        step: pytest.approx(SGD_LR * rate_factor(applied, total), rel=1e-6)
        for step, applied in applied_before.items()
    }


# A run under float16 autocast is judged by its distance to the float64 replay relative to the update (as bf16
# is, test_sources.BF16_UPDATE): within 8 x fp16's unit roundoff 2^-11 (measured: 1.6e-4; a step's update
# applied or skipped is 20 times the budget).
FP16_UPDATE = 8 * 2**-11


def test_an_fp16_overflow_in_the_middle_skips_exactly_its_update(
    tmp_path, data, model_without_dropout, monkeypatch, capsys
):
    """accelerate's fp16 path on a CPU (float16 autocast and torch's CPU GradScaler: tests/faults), at a loss
    scale that does not overflow by itself, with infinite gradients forced at step 3 of 6: the scaler skips
    that update alone (the scale halves there, and only there), every logged rate is the schedule's at the
    updates applied so far, and the weights of every later step are the float64 replay's that skips exactly
    that update, within fp16's budget (step 3's checkpoint holds step 2's weights). The wrong path, outside
    it: the replay applying step 3's batch."""
    from test_reliability import run_with_faults

    run_dir, total, overflow = tmp_path / "run", 6, 3
    args = ("--model", model_without_dropout, "--data", data[0], "--dev_data", "", "--max_steps", total)
    args += ("--lr", SGD_LR, "--max_grad_norm", 0, "--save_steps", 1, "--save_total_limit", 0)
    faults = {"GRADCACHE_FP16_SCALER": str(2.0**10), "GRADCACHE_FAULT_INF": str(overflow)}
    with monkeypatch.context() as patch:
        batches = record_batches(patch)
        run_with_faults(run_dir, *args, faults=faults)
    printed = capsys.readouterr().out
    assert "mixed_precision: fp16" in printed
    assert f"step {overflow}: fp16 overflow, update skipped" in printed
    steps = in_steps(batches, 1)
    assert len(steps) == total
    logged = {tag: dict(values) for tag, values in logged_scalars(run_dir).items()}
    scales = logged["train/loss_scale"]
    assert [step for step in scales if scales[step] < scales.get(step - 1, 2.0**10)] == [overflow]
    assert logged["train/nonfinite_steps"] == {step: 0.0 for step in range(1, total + 1)}  # not a bad step
    applied_before = {step: step - 1 - (step > overflow) for step in range(1, total + 1)}
    assert logged["train/learning_rate"] == {
        step: pytest.approx(SGD_LR * rate_factor(applied, total), rel=1e-6)
        for step, applied in applied_before.items()
    }
    right, wrong = (
        sgd_replay(model_without_dropout, steps, torch.float64, total, skipped=skipped)["weights"]
        for skipped in ((overflow,), ())
    )
    initial = weights(model_without_dropout)
    saved = sorted(int(path.name.removeprefix("step_")) for path in (run_dir / "checkpoints").iterdir())
    assert saved == list(range(1, total + 1))  # an overflow is no bad step: its checkpoint is saved
    checkpoints = {
        step: load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors") for step in saved
    }
    before, at = checkpoints[overflow - 1], checkpoints[overflow]
    assert all(torch.equal(at[name], before[name]) for name in at)  # the overflow moved no weight
    for step, trained in checkpoints.items():
        names = sorted(trained)
        run = updates(trained, initial, names)
        error = relative_error(run, updates(right[step - 1], initial, names))
        print(f"fp16 overflow at step {overflow}, step {step}: updates {error:.1e} from the float64 replay")
        assert error <= FP16_UPDATE, f"step {step}: {error:.1e} (fp16 budget {FP16_UPDATE:.1e})"
        if step > overflow:
            applied = relative_error(run, updates(wrong[step - 1], initial, names))
            print(f"fp16 overflow, step {step}: against the replay applying step {overflow} {applied:.1e}")
            assert applied > FP16_UPDATE, f"step {step} matches the replay applying it: {applied:.1e}"


# ---------------------------------------------------------------------------------------------------------
# 3. Teacher-scored positives, drawn anew each epoch
# ---------------------------------------------------------------------------------------------------------


def scored_records(count=16, positives=3):
    """Records with several positives, each with its teacher's score, and one scored hard negative: scores far
    apart, so that another positive's score, or the fields swapped, move the distillation's targets."""
    rng = random.Random(5)

    def text(count, tag):
        return " ".join(rng.sample(WORDS, count)) + f" {tag}"

    return [
        {"anchor": text(4, f"a{i}"), "positive": [text(2, f"p{positives * i + j}") for j in range(positives)],
         "negative": text(2, f"n{i}"), "pos_scores": [rng.uniform(-4, 4) for _ in range(positives)],
         "neg_scores": [rng.uniform(-4, 4)]}
        for i in range(count)
    ]  # fmt: skip


def distilling_loss(teacher, weight):
    """The in-batch loss plus `weight` x the KL to the teacher's scores of each row's drawn positive and
    negative (references.reference_objective), on the model's sentence embeddings."""

    def loss_fn(model, batches):
        losses = []
        for batch in batches:
            reps = [model(model.preprocess(texts))["sentence_embedding"] for texts in batch]
            rows = [teacher[anchor, positive] for anchor, positive in zip(batch[0], batch[1], strict=True)]
            losses.append(reference_objective(*reps, texts=batch, teacher=rows, distill_weight=weight))
        return sum(losses) / len(losses)

    return loss_fn


def test_drawn_positives_carry_their_own_teacher_scores_over_epochs(
    tmp_path, model_without_dropout, monkeypatch
):
    """16 records of 3 positives each, batches of 4 over two epochs with --distill_weight 2: each
    step's update is the replay's whose teacher scores are those of the positive the run drew (found by
    its text in the raw JSON). Wrong paths: the first positive's score for every draw, and the two score
    fields swapped."""
    data = write_rows(tmp_path / "scored.jsonl", scored_records())
    run_dir, total, weight = tmp_path / "run", 8, 2.0
    args = ("--model", model_without_dropout, "--data", data, "--dev_data", "", "--batch_size", 4)
    args += ("--chunk_size", 3, "--max_steps", total, "--distill_weight", weight, "--lr", SGD_LR)
    args += ("--max_grad_norm", 0, "--save_steps", 0, "--output_dir", run_dir)
    with monkeypatch.context() as patch:
        batches = record_batches(patch)
        run_main(monkeypatch, *args)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    first_positive = {record["anchor"]: record["positive"][0] for record in records}
    drawn = [(a, p) for batch in batches for a, p in zip(batch[0], batch[1], strict=True)]
    assert sum(p != first_positive[a] for a, p in drawn) > len(drawn) / 2  # most draws are other positives
    epochs = [dict(drawn[:16]), dict(drawn[16:])]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]  # drawn anew in epoch 2

    steps, initial = in_steps(batches, 1), weights(model_without_dropout)
    run = updates(weights(run_dir / "final"), initial)

    def replays(teacher):
        loss_fn = distilling_loss(teacher, weight)
        return [
            updates(sgd_replay(model_without_dropout, steps, t, total, loss_fn)["weights"][-1], initial)
            for t in DTYPES
        ]

    right = replays(teacher_of(data))
    measured = assert_exact(run, *right, "teacher-scored positives, updates")
    print(f"scored positives over two epochs: updates {measured}")
    wrong_paths = {
        "the first positive's score": dict(first_only=True),
        "the fields swapped": dict(swapped=True),
    }
    for name, wrong in wrong_paths.items():
        teacher = teacher_of(data, **wrong)
        control = assert_inexact(run, *replays(teacher), f"scored positives, {name}")
        print(f"scored positives, against {name}: {control.error:.1e}")


# ---------------------------------------------------------------------------------------------------------
# Caught in seconds: uneven processes' row offsets in the global batch
# ---------------------------------------------------------------------------------------------------------


def global_batch_gradients(encoder, batches, dtype, together=True, masks=None):
    """references.py's materialized loss on the processes' batches, its gradients by parameter name, in
    `dtype`: the global batch contrasted as one (`together`), or the wrong path, each process's batch alone
    (the mean of their losses: no cross-process negatives). `masks`: (ids, other positives) of the global
    batch for masked_contrastive_loss, symmetric."""
    encoder = float64(encoder) if dtype == torch.float64 else copy.deepcopy(encoder)

    def loss_of(columns):
        reps = [encoder(column)["sentence_embedding"] for column in columns]
        if masks is None:
            return materialized_contrastive_loss(*reps)
        ids, others = masks
        return masked_contrastive_loss(*reps, symmetric=True, ids=ids, other_positives=others)[0]

    if together:
        keys = ("input_ids", "attention_mask")
        joined = [{key: torch.cat([batch[c][key] for batch in batches]) for key in keys} for c in range(3)]
        loss = loss_of(joined)
    else:
        loss = sum(loss_of(batch) for batch in batches) / len(batches)
    loss.backward()
    return {"loss": loss.detach(), "grads": {name: p.grad for name, p in encoder.named_parameters()}}


def test_uneven_processes_contrast_the_global_batch_at_their_own_row_offsets(tmp_path):
    """Two gloo processes (tests/offsets_worker.py) of 5 and 3 rows, gradcache steps with cross-process
    negatives over DDP, chunks of 2: the loss and DDP's averaged gradients on both are the full global
    batch's (8 rows contrasted together, through one graph) by references.py's rule; plain, with masks of
    repeated anchors and of the data's other positives that cross the processes' boundary (symmetric), and
    in chunks of 1, where rank 1 runs two padding chunks to match rank 0's passes. A loss not finite on
    rank 1 alone is skipped by both.
    Wrong paths: each batch contrasted alone; the masks left out. Seconds, where the 3-process matrix launch
    took minutes; a hang fails in 30 s."""
    from offsets_worker import masked_ids, uneven_batch
    from test_gradcache import TinyEncoder

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    environment = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run(
        [*torchrun, str(REPO / "tests" / "offsets_worker.py"), str(tmp_path)],
        env=environment | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    torch.manual_seed(0)
    encoder, batches = TinyEncoder(dropout=0.0), [uneven_batch(rank) for rank in (0, 1)]
    cases = {
        "plain": ({}, {"together": False}, "each batch alone"),
        "masked": ({"masks": masked_ids()}, {}, "the masks left out"),
        "padded": ({}, {"together": False}, "each batch alone"),
    }
    for run in ranks:  # the loss not finite on rank 1 alone: both skip, nothing back-propagated anywhere
        one_skips = run.pop("one_skips")
        assert one_skips["skipped"] is True and one_skips["grads"] == {}
    for case, (right_path, wrong_path, wrong_name) in cases.items():
        right = [global_batch_gradients(encoder, batches, dtype, **right_path) for dtype in DTYPES]
        wrong = [global_batch_gradients(encoder, batches, dtype, **wrong_path) for dtype in DTYPES]
        grads = [run[case]["grads"] for run in ranks]
        assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])  # DDP's average
        for rank, run in enumerate(ranks):
            run = {key: run[case][key] for key in ("loss", "grads")}
            measured = assert_exact(run, *right, f"{case}, rank {rank}, loss and gradients")
            control = assert_inexact(run, *wrong, f"{case}, rank {rank}, against {wrong_name}")
            print(f"uneven ranks, {case}, rank {rank}: {measured}; against {wrong_name} {control.error:.1e}")


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed's extension, built once per checkout
# ---------------------------------------------------------------------------------------------------------


def test_deepspeed_extensions_are_built_and_found_in_the_checkouts_own_cache():
    """setup.sh --dev builds DeepSpeed's CPU extension where every launch of the suite looks for it (conftest
    sets TORCH_EXTENSIONS_DIR): the checkout's own .cache, not the per-user cache that concurrent checkouts
    rebuilt in turn."""
    folder = REPO / ".cache" / "torch_extensions"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(folder)
    assert 'TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions"' in (REPO / "setup.sh").read_text()
    assert ".cache/" in (REPO / ".gitignore").read_text().splitlines()
