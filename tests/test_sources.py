"""Several --data sources (issue 18): every optimizer step reads one source on every process, in a seeded
order that a resume replays, with that source's columns, prompts, in-batch negatives and distillation.

The order is checked as accelerate deals the batches out; the training against one process holding the
global batch (two ZeRO-3 processes with cross-process negatives against a plain one-process run), and a
resumed run against an uninterrupted one.

    .venv/bin/python -m pytest -q tests/test_sources.py
"""

import collections
import json

import datasets
import pytest
import torch
from references import Exactness, assert_exact, reference_objective, relative_error, teacher_of
from test_train import (
    CONFIGS,
    DTYPES,
    SGD_LR,
    fails_with,
    in_steps,
    launch,
    launch_deepspeed,
    logged_scalars,
    record_batches,
    recorded_batches,
    recording_environment,
    run_main,
    sgd_launch,
    sharded_loader,
    updates,
    weights,
)
from test_trust import sgd_replay

import train


def texts(prefix, rows):
    return [f"{prefix} {i}" for i in range(rows)]


TRIPLETS = datasets.Dataset.from_dict(
    {"anchor": texts("a", 40), "positive": texts("p", 40), "negative_1": texts("n", 40)}
)
PAIRS = datasets.Dataset.from_dict({"anchor": texts("q", 24), "positive": texts("d", 24)})


def steps_of(loader, epoch, accumulation):
    """The optimizer steps of one process's `epoch`: lists of `accumulation` batches."""
    loader.set_epoch(epoch)
    batches = list(loader)
    return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]


@pytest.mark.parametrize("cross_process", [False, True])
def test_every_step_reads_one_source_on_every_process_and_each_source_once_an_epoch(cross_process):
    flags = ["--batch_size", 4, "--gradient_accumulation_steps", 2]
    flags += ["--cross_process_negatives"] if cross_process else []
    loaders = [sharded_loader([TRIPLETS, PAIRS], *flags, processes=2, process_index=i) for i in range(2)]
    step_examples = 4 * 2 * 2  # batch x processes x accumulation
    for epoch in (0, 1):
        per_process = [steps_of(loader, epoch, 2) for loader in loaders]
        assert len(per_process[0]) == len(per_process[1]) == 40 // step_examples + 24 // step_examples
        read = collections.defaultdict(list)
        for step in zip(*per_process, strict=True):
            sources = {int(source) for batches in step for batch in batches for source in batch["source"]}
            assert len(sources) == 1, f"epoch {epoch}: a step mixes sources {sources}"
            (source,) = sources
            columns = {tuple(sorted(batch)) for batches in step for batch in batches}
            assert columns == {
                tuple(sorted(TRIPLETS.column_names if source == 0 else PAIRS.column_names) + ["source"])
            }
            read[source] += [text for batches in step for batch in batches for text in batch["anchor"]]
        # Every step of each source once (its last part step left out), no anchor twice.
        assert len(read[0]) == len(set(read[0])) == (40 // step_examples) * step_examples
        assert len(read[1]) == len(set(read[1])) == (24 // step_examples) * step_examples
        if cross_process:  # the step's contrastive batch (both processes' batches) holds no text twice
            for step in zip(*per_process, strict=True):
                for batches in zip(*step, strict=True):
                    together = [
                        text
                        for batch in batches
                        for column in ("anchor", "positive")
                        for text in batch[column]
                    ]
                    assert len(together) == len(set(together))


def test_the_order_is_seeded_replayed_by_a_resume_and_follows_the_weights():
    from accelerate.data_loader import skip_first_batches

    loader = sharded_loader([TRIPLETS, PAIRS], "--batch_size", 4, "--seed", 7)
    loader.set_epoch(3)
    whole = list(loader)
    resumed = skip_first_batches(loader, 5)  # as train.py's resume skips the batches of the epoch done
    resumed.set_epoch(3)
    assert [batch["anchor"] for batch in resumed] == [batch["anchor"] for batch in whole[5:]]
    again = sharded_loader([TRIPLETS, PAIRS], "--batch_size", 4, "--seed", 7)
    again.set_epoch(3)
    assert [batch["anchor"] for batch in again] == [batch["anchor"] for batch in whole]
    other_seed = sharded_loader([TRIPLETS, PAIRS], "--batch_size", 4, "--seed", 8)
    other_seed.set_epoch(3)
    assert [batch["anchor"] for batch in other_seed] != [batch["anchor"] for batch in whole]

    weighted = train.make_loader([TRIPLETS, PAIRS], args_for("--data_weights", 1, 3), 1).sampler
    drawn = [source for epoch in range(40) for source in weighted.schedule(epoch)]
    assert len(drawn) == 40 * (10 + 6)
    assert drawn.count(1) / len(drawn) == pytest.approx(0.75, abs=0.05)
    round_robin = train.make_loader([TRIPLETS, PAIRS], args_for("--data_sampling", "round_robin"), 1).sampler
    assert round_robin.schedule(0) == [0, 1] * 10  # until the larger source is read: 40 / 4 steps


def args_for(*flags):
    return train.parse_args(
        ["--model", "m", "--data", "a.jsonl", "b.jsonl", "--batch_size", "4", *map(str, flags)]
    )


def test_per_source_flags_are_checked_before_anything_loads(capsys):
    two = ["--model", "m", "--data", "a.jsonl", "b.jsonl"]
    fails_with(
        capsys, lambda: train.parse_args([*two, "--in_batch_negatives", "on", "off", "on"]), "3 values for 2"
    )
    fails_with(capsys, lambda: train.parse_args([*two, "--data_weights", "1"]), "one positive weight per")
    fails_with(
        capsys, lambda: train.parse_args([*two, "--data_weights", "1", "0"]), "one positive weight per"
    )
    fails_with(
        capsys,
        lambda: train.parse_args([*two, "--data_weights", "1", "2", "--data_sampling", "round_robin"]),
        "keep one",
    )
    fails_with(
        capsys,
        lambda: train.parse_args([*two, "--in_batch_negatives", "on", "off", "--symmetric"]),
        "--in_batch_negatives off",
    )
    args = train.parse_args([*two, "--query_prompt", "", "query: ", "--columns", "anchor=q,positive=d"])
    sources = train.source_settings(args)
    assert [(s.data, s.query_prompt, s.columns) for s in sources] == [
        ("a.jsonl", "", "anchor=q,positive=d"),
        ("b.jsonl", "query: ", "anchor=q,positive=d"),
    ]
    one = train.parse_args(["--model", "m", "--data", "a.jsonl", "--query_prompt", "q: "])
    assert (one.data, one.query_prompt) == ("a.jsonl", "q: ")  # one source: the flags as they always were


# ---------------------------------------------------------------------------------------------------------
# Training on two sources
# ---------------------------------------------------------------------------------------------------------


def two_source_flags(model, sources, *extra, chunking=("--chunk_size", 3), negatives="other"):
    """The scored triplets, then the named source read with `negatives` as its hard negatives ("" for none:
    pairs)."""
    return (
        "--model", model, "--data", *sources, "--dev_data", "",
        "--columns", "", f"anchor=query,positive=answer,negatives={negatives}",
        "--query_prompt", "", "w1 ", "--distill_weight", 0.5, 0, "--lr", 1e-3, *chunking,
        "--wandb_mode", "disabled", *extra,
    )  # fmt: skip


def test_two_sources_train_resume_exactly_log_their_source_and_save_their_prompts(
    tmp_path, sources, model_with_dropout, monkeypatch
):
    flags = two_source_flags(
        model_with_dropout, sources, "--batch_size", 8, "--in_batch_negatives", "on", "off",
        "--max_steps", 6, "--save_steps", 3,
    )  # fmt: skip
    run_main(monkeypatch, *flags, "--output_dir", tmp_path / "straight")
    logged = logged_scalars(tmp_path / "straight")
    used = [int(value) for _, value in logged["train/source"]]
    assert len(used) == 6 and set(used) == {0, 1}  # an epoch: 4 steps of 32 triplets, 2 of 16 pairs
    assert used.count(0) == 4 and used.count(1) == 2
    # Every step's accuracy: among the batch's candidates for source 0, within its own group for source 1.
    assert [step for step, _ in logged["train/in_batch_accuracy"]] == list(range(1, 7))
    saved = json.loads((tmp_path / "straight" / "final" / "config_sentence_transformers.json").read_text())
    assert saved["prompts"]["named_query"] == "w1 " and saved["prompts"]["scored_query"] == ""
    assert saved["prompts"]["query"] == ""  # the first source's, for encode_query

    step_3 = tmp_path / "straight" / "checkpoints" / "step_3"
    run_main(monkeypatch, *flags, "--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", step_3)
    straight, resumed = weights(tmp_path / "straight" / "final"), weights(tmp_path / "resumed" / "final")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    assert [int(v) for _, v in logged_scalars(tmp_path / "resumed")["train/source"]] == used[3:]


def test_two_zero3_processes_on_two_sources_train_as_one_process_holding_the_global_batch(
    tmp_path, sources, model_without_dropout, monkeypatch
):
    """Two ZeRO-3 processes, 4 examples each, contrasted together, against one plain process with the batch
    of 8: the same steps from the same sources, the same global batches, the same weights. The sources
    differ in columns (a step of pairs has one column fewer: every process must run the same passes),
    prompts and distillation; the chunks are token budgets, which the processes plan apart and agree on.
    Each run records the texts of its batches (test_trust's test double around gradcache_step); both are
    judged by references.py's rule against replay_two_sources, which shares nothing with the project: the
    recorded batches, the source and the teacher's scores of each row read from the raw JSON lines,
    sentence-transformers' model and references.reference_objective, plain SGD. The wrong paths, which
    both runs must fail: the teacher's two score fields swapped, and no distillation. Both runs take SGD in
    place of AdamW (test_train.SGD_LR: AdamW turns rounding noise into full steps)."""
    steps = ("--max_steps", STEPS, "--max_grad_norm", 0)
    tokens = ("--chunk_tokens", 30)
    common = two_source_flags(model_without_dropout, sources, *steps, chunking=tokens, negatives="")
    common += ("--lr", SGD_LR)  # the last value of a flag counts
    with monkeypatch.context() as patch:
        one_batches = record_batches(patch)  # and SGD in place of AdamW
        run_main(monkeypatch, *common, "--batch_size", 8, "--output_dir", tmp_path / "one")
    config, _ = sgd_launch(tmp_path, CONFIGS / "deepspeed_zero3.yaml")  # its DeepSpeed config takes SGD
    launch_deepspeed(
        config, tmp_path / "two", *common, "--batch_size", 4, "--cross_process_negatives",
        processes=2, env=recording_environment(tmp_path),
    )  # fmt: skip
    one_steps = in_steps(one_batches, 1)
    per_rank = [recorded_batches(tmp_path, rank) for rank in (0, 1)]
    two_steps = [rows_of(a) + rows_of(b) for a, b in zip(*per_rank, strict=True)]
    assert len(one_steps) == len(two_steps) == STEPS
    assert [sorted(rows_of(batch)) for (batch,) in one_steps] == [sorted(rows) for rows in two_steps]
    one, two = logged_scalars(tmp_path / "one"), logged_scalars(tmp_path / "two")
    float32, truth = (replay_two_sources(sources, model_without_dropout, one_steps, t) for t in DTYPES)
    assert one["train/source"] == two["train/source"]
    assert [int(v) for _, v in one["train/source"]] == truth["sources"]
    assert set(truth["sources"]) == {0, 1}
    initial = weights(model_without_dropout)
    # Wrong paths: the teacher's score fields swapped (what a data module reading them swapped would train
    # on), and the first source's distillation left out
    wrong_paths = {
        "the score fields swapped": replay_two_sources(
            sources, model_without_dropout, one_steps, torch.float64, swapped=True
        ),
        "no distillation": replay_two_sources(
            sources, model_without_dropout, one_steps, torch.float64, distill_weight=0.0
        ),
    }
    for name, folder, logged in (("one process", "one", one), ("ZeRO-3 x 2", "two", two)):
        run = {
            "updates": updates(weights(tmp_path / folder / "final"), initial),
            "losses": [value for _, value in logged["train/loss"]],
            "grad_norms": [value for _, value in logged["train/grad_norm"]],  # DeepSpeed's norm
        }
        for key, run_values in run.items():
            measured = assert_exact(run_values, float32[key], truth[key], f"{name}, {key}")
            print(f"two sources, {name}: {key} {measured}")
            for wrong_name, wrong in wrong_paths.items():
                control = Exactness(relative_error(run_values, wrong[key]), measured.e_ref)
                assert not control.holds, f"{name}, {key} matches the replay with {wrong_name}: {control}"
                print(f"two sources, {name}: {key} against {wrong_name} {control.error:.1e}")


STEPS = 4


def rows_of(batch):
    """A batch's rows: (anchor, positive, negatives...) text tuples."""
    return list(zip(*batch, strict=True))


def replay_two_sources(sources, model_folder, steps, dtype, distill_weight=0.5, swapped=False):
    """The run of two_source_flags (no hard negatives in the second source, no clipping) on the recorded
    `steps` (test_trust.in_steps: each step's batches of texts) without the project's code, in `dtype`: a
    step is the first source's when its anchors are that file's (read with json), whose rows distil at
    `distill_weight`, temperature 1, from the scores in its raw JSON lines (references.teacher_of, the fields
    exchanged with `swapped`); the second source's anchors take the query prompt "w1 ". Each whole batch is
    scored by references.reference_objective; test_trust.sgd_replay's SGD at SGD_LR and the linear schedule
    (no warmup: round(0.1 x 4) = 0). Returns the sources of the steps, the losses, the gradient norms and
    the updates."""
    teacher = teacher_of(sources[0], swapped=swapped)
    scored = {json.loads(line)["anchor"] for line in sources[0].read_text().splitlines()}
    read = []

    def loss_fn(model, batches):
        (batch,) = batches
        texts = [list(column) for column in batch]
        source = 0 if set(texts[0]) <= scored else 1
        assert source == 0 or not set(texts[0]) & scored
        read.append(source)
        rows = [teacher[a, p] for a, p in zip(texts[0], texts[1], strict=True)] if source == 0 else None
        if source == 1:
            texts[0] = ["w1 " + text for text in texts[0]]
        reps = [model(model.preprocess(column))["sentence_embedding"] for column in texts]
        return reference_objective(*reps, texts=texts, teacher=rows, distill_weight=distill_weight)

    replayed = sgd_replay(model_folder, steps, dtype, len(steps), loss_fn)
    initial = weights(model_folder)
    return replayed | {"sources": read, "updates": updates(replayed["weights"][-1], initial)}


# bf16 keeps 8 bits of mantissa: a loss within 5%, an update within 30% (in norm) of fp32's, as
# tests/backend_worker.py allows bf16 against its fp32 reference.
BF16_LOSS, BF16_UPDATE = 0.05, 0.3


def test_two_sources_under_bf16_autocast_follow_the_fp32_run(
    tmp_path, sources, model_without_dropout, monkeypatch
):
    """accelerate's bf16 (autocast) launched on the two sources, against the same run in fp32: the same
    sources step by step, the losses and weights close to fp32's, yet not equal to them (bf16 really ran).
    The teacher's scores, read as float64 from JSON, meet a student's scores computed in bf16."""
    common = two_source_flags(model_without_dropout, sources, "--batch_size", 8, "--max_steps", 4)
    run_main(monkeypatch, *common, "--output_dir", tmp_path / "fp32")
    done = launch(CONFIGS / "bf16.yaml", tmp_path / "bf16", *common)
    assert "mixed_precision: bf16" in done.stdout
    fp32, bf16 = logged_scalars(tmp_path / "fp32"), logged_scalars(tmp_path / "bf16")
    assert bf16["train/source"] == fp32["train/source"]
    assert {int(v) for _, v in bf16["train/source"]} == {0, 1}
    losses = [value for _, value in bf16["train/loss"]]
    assert losses == pytest.approx([value for _, value in fp32["train/loss"]], rel=BF16_LOSS)
    initial, reference = weights(model_without_dropout), weights(tmp_path / "fp32" / "final")
    saved = weights(tmp_path / "bf16" / "final")
    assert all(torch.isfinite(value).all() for value in saved.values())
    update = torch.cat([(reference[name] - initial[name]).flatten() for name in initial])
    off = torch.cat([(saved[name] - reference[name]).flatten() for name in initial])
    print(f"two sources, bf16 against fp32: losses {losses}, update off by {off.norm() / update.norm():.2e}")
    assert 1e-3 * update.norm() < off.norm() < BF16_UPDATE * update.norm()  # bf16 ran, and close
