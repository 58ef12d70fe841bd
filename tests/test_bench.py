"""Smoke tests of the benchmarks in bench/: each script on its smallest preset (`--preset smoke`) writes
results whose numbers show, in small, what its full run is there to show, and bench/make_results.py
assembles them into a RESULTS.md."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from references import (
    ROUNDING_MULTIPLE,
    Exactness,
    assert_exact,
    materialized_contrastive_loss,
    relative_error,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # where the scripts import their harness from
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(name, out_dir, *extra):
    """`python bench/<name>.py --preset smoke --out_dir <out_dir> <extra>` in a fresh process, as a user runs
    it (in this process, torch's threads would already be spinning, and crawl on a busy machine)."""
    command = [
        sys.executable,
        str(ROOT / "bench" / f"{name}.py"),
        "--preset",
        "smoke",
        "--out_dir",
        str(out_dir),
        "--allow_dirty",  # a developer runs the tests before committing; the results say so
        *extra,
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=600)
    stem = out_dir / f"{name}_smoke"
    assert stem.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE)
    markdown = stem.with_suffix(".md").read_text()
    assert f"`python bench/{name}.py --preset smoke" in markdown  # the command that made it
    return json.loads(stem.with_suffix(".json").read_text()), markdown


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_results")


SCRIPTS = ("memory", "speed", "memory_cap", "quality", "scale", "checkpointing", "multi_vector_memory")


@pytest.fixture(scope="module")
def smoke_run(results_dir):
    """smoke_run(name): run_script(name) once per module; several tests read the same run."""
    runs = {}

    def run(name):
        if name not in runs:
            runs[name] = run_script(name, results_dir)
        return runs[name]

    return run


def test_memory_chunked_steps_hold_less_than_the_full_batch(smoke_run):
    saved, markdown = smoke_run("memory")
    peaks = {p["method"]: p["step_peak_bytes"] for p in saved["results"] if p["fits"]}
    assert len(saved["results"]) == len(peaks) == 2
    # a quarter of the batch's activations alive at a time (chunk 4 of batch 16): less than plain
    assert 0 < peaks["ours"] < peaks["plain"]
    assert set(saved["results"][0]["phase_peak_bytes"]) == {"step"}
    ours = next(p for p in saved["results"] if p["method"] == "ours")
    assert set(ours["phase_peak_bytes"]) == set(ours["phase_added_bytes"]) == {"chunks", "loss"}
    # Two readings taken apart, above the same baseline: what the step held between chunks (the resident
    # set just after a chunk's backward, its parameter gradients alive) cannot exceed the peak of the phase
    # it was read in (the high-water mark since that phase began). A phase window opened late or closed
    # early, or a reading against another baseline, would break it.
    assert 0 < ours["held_between_chunks_bytes"] <= ours["phase_peak_bytes"]["chunks"]
    # the loss stage alone: above its own start, where stage 1's kept chunk and the representations are
    # already alive, so not above what the step holds at that moment
    assert ours["phase_added_bytes"]["loss"] <= ours["phase_peak_bytes"]["loss"]
    assert "| batch |" in markdown and "ST cached (MiB)" in markdown


def test_speed_compares_equal_work_and_times_every_variant(smoke_run):
    saved, markdown = smoke_run("speed")
    # The sanity check the benchmark prints, by references.py's rule: each method's loss against the float64
    # truth of the same batch, and each gradient's distance to plain's (all the benchmark keeps) within what
    # the rule leaves it: |ours - plain| <= |ours - truth| + |plain - truth|, plain's distance taken as up to
    # ROUNDING_MULTIPLE x the float32 reference's own.
    agreement = saved["results"]["agreement"]
    losses = agreement["losses"]
    assert agreement["batch_size"] == min(saved["settings"]["batch_sizes"])
    float32, truth = (
        agreement_reference(saved["settings"], dtype) for dtype in (torch.float32, torch.float64)
    )
    for method, loss in losses.items():
        measured = assert_exact(loss, float32["loss"], truth["loss"], f"{method}, loss")
        print(f"speed agreement, {method}, loss: {measured}")
    # The wrong path: the batch's hard negatives left out of the candidates
    wrong = agreement_reference(saved["settings"], torch.float64, columns=2)
    control = Exactness(
        relative_error(losses["ours"], wrong["loss"]), relative_error(float32["loss"], truth["loss"])
    )
    assert not control.holds, f"ours' loss matches the reference without its hard negatives: {control}"
    print(f"speed agreement, ours' loss against the reference without hard negatives: {control.error:.1e}")
    e_ref = relative_error(float32["gradients"], truth["gradients"])
    largest = {name: float(reference["gradients"].abs().max()) for name, reference in (("32", float32),
               ("64", truth))}  # fmt: skip
    allowed = (Exactness(0.0, e_ref).bound + ROUNDING_MULTIPLE * e_ref) * largest["64"] / largest["32"]
    print(f"speed agreement, gradients: {agreement['max_gradient_difference']} (allowed {allowed:.1e})")
    assert max(agreement["max_gradient_difference"].values()) <= allowed
    assert allowed < 1e-4  # a gradient off by 1e-4 of its largest entry fails
    (measurement,) = saved["results"]["measurements"]
    assert set(measurement["runs"]) == {
        "plain",
        "ST cached",
        "ours",
        "ours, unsorted",
        "ours, no reuse",
        "ours, unsorted, no reuse",
        "ST cached, token budget",
        "ours, token budget",
    }
    (group,) = saved["results"]["group_measurements"]  # the group-only pair, in rounds of its own
    assert set(group["runs"]) == {"group-only, cached", "group-only, no cache"}
    for name, runs in [*measurement["runs"].items(), *group["runs"].items()]:
        assert len(runs) == saved["settings"]["rounds"]
        assert len(runs) == len((group if name.startswith("group") else measurement)["parts"][name])
        assert all(run["seconds"] > 0 for run in runs)
        # the tokens its forward passes took: padding included, stage 1's and 3's both for the cached ones
        assert all(run["tokens"]["padded"] >= run["tokens"]["real"] > 0 for run in runs)
    (cached,), (direct,) = (group["runs"][name] for name in ("group-only, cached", "group-only, no cache"))
    assert direct["tokens"]["real"] < cached["tokens"]["real"]  # no second forward
    assert "| group-only, no cache |" in markdown  # its parts: forward with grad, backward...
    (plain,) = measurement["parts"]["plain"]
    assert plain["forward with grad"] > 0 and "forward no grad" not in plain
    for name in ("ours", "ST cached"):  # encoded without grad first, then again with grad
        (parts,) = measurement["parts"][name]
        assert parts["forward no grad"] > 0 and parts["forward with grad"] > 0
    assert measurement["parts"]["ours"][0]["stage 2: loss and its gradient"] > 0
    assert "ours / ST cached" in markdown


def agreement_reference(settings, dtype, columns=None):
    """speed.py's agreement batch (the first rows of its texts, batch min(batch_sizes)) on its model in
    `dtype`, dropout off, through the whole score matrix (references.materialized_contrastive_loss), plain
    autograd: the loss and every parameter's gradient, flattened in parameter order. A wrong path: only the
    first `columns` columns (2: the hard negatives left out)."""
    import harness

    model = harness.load_model("cpu").to(dtype).eval()
    texts = harness.load_texts(max(settings["batch_sizes"]) * (settings["warmup"] + settings["rounds"]))
    features = harness.tokenize(model, texts, 0, min(settings["batch_sizes"]))
    loss = materialized_contrastive_loss(
        *[model(dict(f))["sentence_embedding"] for f in features[:columns]], scale=20.0
    )
    loss.backward()
    gradients = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"loss": loss.item(), "gradients": gradients.double()}


def test_memory_cap_stops_plain_where_ours_still_fits(smoke_run):
    saved, markdown = smoke_run("memory_cap")
    by_method = {result["method"]: result for result in saved["results"]}
    batch = saved["settings"]["start_batch"]
    # plain ran out of memory under the cap, an allocation failing inside the step (not a crash)
    (plain_probe,) = by_method["plain"]["probes"]
    assert not plain_probe["fits"] and "died" not in plain_probe
    assert by_method["plain"]["largest_fit"] is None and by_method["plain"]["smallest_failure"] == batch
    (ours_probe,) = by_method["ours"]["probes"]
    assert ours_probe["fits"] and ours_probe["step_peak_bytes"] < saved["settings"]["cap_gib"] * 2**30
    assert by_method["ours"]["largest_fit"] == batch
    assert "largest batch that fit" in markdown


def test_quality_trains_through_train_py_with_and_without_masks_and_scores_the_dev_split(
    smoke_run, results_dir
):
    """The smoke preset scores on the words of the first 64 dev records, not of all 2000 (suite time): the
    evaluator's corpus, as the preset builds it, is checked here, in this process."""
    import quality

    saved, markdown = smoke_run("quality")
    settings, results = saved["settings"], saved["results"]
    assert 0 < results["before"]["mrr@10"] <= 1
    assert settings["dev_corpus"] == 64 and "among the words of the first 64 dev records" in markdown
    evaluator = quality.dev_evaluator(settings["dev_queries"], settings["dev_corpus"])
    assert len(evaluator.queries) == settings["dev_queries"] and 0 < len(evaluator.corpus) <= 64
    assert all(set(docs) <= set(evaluator.corpus_ids) for docs in evaluator.relevant_docs.values())
    (batch,) = settings["batch_sizes"]
    runs = {run["comparison"]: run for run in results["runs"]}
    assert sorted(runs) == ["masks", "shared"] and len(results["runs"]) == 2
    assert runs["masks"]["flags"] == settings["mask_flags"] and not runs["shared"]["flags"]
    for run in results["runs"]:
        assert run["optimizer_steps"] == settings["train_examples"] // batch  # as train.py printed it
        assert 0 < run["mrr@10"] <= 1 and run["train_seconds"] > 0
    # scored from train.py's saved models, which are deleted once scored
    assert not any((results_dir / "tmp" / "quality_smoke").iterdir())
    assert "**Verdicts**" in markdown and markdown.count("one seed: no verdict") == 3
    overlap = results["overlap"]
    assert 0 <= overlap["dev_pairs_in_train"] <= overlap["dev_anchors_in_train"] <= overlap["dev_records"]


def test_quality_plans_equal_epochs_equal_steps_and_masks():
    import argparse

    import quality

    args = argparse.Namespace(batch_sizes=[128, 32, 512], train_examples=4096, mask_flags="--masks")
    # the largest batch takes 4096 / 512 = 8 steps: the steps every equal-steps run takes
    assert quality.planned_runs(args) == [
        ("equal epochs", 32, 4096, ""),
        ("equal epochs", 128, 4096, ""),
        ("shared", 512, 4096, ""),
        ("equal steps", 32, 32 * 8, ""),
        ("equal steps", 128, 128 * 8, ""),
        ("masks", 512, 4096, "--masks"),
    ]


def test_quality_verdicts_weigh_the_difference_against_the_seed_spread():
    import quality

    def runs(*scores):
        return [{"mrr@10": score} for score in scores]

    # standard error of the difference: sqrt(0.02**2 / 3 + 0.02**2 / 3) = 0.01633
    difference, error, word = quality.verdict(runs(0.50, 0.52, 0.54), runs(0.55, 0.57, 0.59))
    assert math.isclose(difference, 0.05) and math.isclose(error, 0.02 * math.sqrt(2 / 3))
    assert word == "better"  # 0.05 > 2 x 0.0163
    assert quality.verdict(runs(0.50, 0.52, 0.54), runs(0.52, 0.54, 0.56))[2] == (
        "no difference beyond the seed spread"  # 0.02 < 2 x 0.0163
    )
    assert quality.verdict(runs(0.55, 0.57, 0.59), runs(0.50, 0.52, 0.54))[2] == "worse"


def test_scale_cut_model_step_and_loss_stage_under_a_cap(smoke_run):
    saved, markdown = smoke_run("scale")
    settings, results = saved["settings"], saved["results"]
    (step,) = results["steps"]
    assert step["fits"] and step["num_layers"] == settings["cut_layers"] == 1
    # as train.py runs it: texts tokenized chunk by chunk, chunks by a token budget
    assert step["tokenize_per_chunk"] and step["chunk_tokens"] == settings["chunk_tokens"]
    assert step["step_peak_bytes"] > 0 and set(step["phase_added_bytes"]) == {"chunks", "loss"}
    cap = settings["loss_cap_gib"] * 2**30
    by_kind = {point["kind"]: point for point in results["loss_memory"]}
    # the materialized loss ran out of memory under the cap: an allocation failed inside it (no crash)
    assert not by_kind["materialized"]["fits"] and "died" not in by_kind["materialized"]
    # the tiled loss fits: its tiles, not the 2048 x 4096 score matrix
    assert by_kind["tiled"]["fits"] and 0 < by_kind["tiled"]["added_bytes"] < cap
    (timed,) = results["loss_time"]
    assert all(len(seconds) == settings["time_rounds"] for seconds in timed["seconds"].values())
    assert "did not fit in" in markdown and "first 1 layer(s)" in markdown
    # d: the masked loss beside the unmasked one, same batch; the masks' inputs counted apart
    masked = {point["variant"]: point for point in results["masked_loss_memory"]}
    assert set(masked) == set(settings["mask_variants"]) == {"none", "all"}
    assert masked["all"]["masks"] == ["identity", "margin", "guide"] and masked["none"]["masks"] == []
    assert masked["none"]["mask_input_bytes"] == 0 < masked["all"]["mask_input_bytes"]
    # the masks mask something (repeated ids, the margin, the guide), the unmasked loss nothing
    assert masked["none"]["masked_fraction"] == 0 < masked["all"]["masked_fraction"] < 1
    assert all(point["added_bytes"] > 0 for point in masked.values())
    # e: train.guide_representations at two batches with one chunk, then the smaller one at once
    guide = [(point["batch_size"], point["chunk_size"]) for point in results["guide_memory"]]
    small, large = settings["guide_batch_sizes"]
    chunk = settings["guide_chunk_size"]
    assert guide == [(small, chunk), (large, chunk), (small, small)]
    for point in results["guide_memory"]:  # fp32 representations of 3 columns, d = 384
        assert point["output_bytes"] == point["batch_size"] * 3 * 384 * 4 and point["added_bytes"] > 0
    assert "all three / unmasked" in markdown and "peak minus returned" in markdown
    # f: group_step and the cached group loss at two batches, then group_step with the smaller in one chunk
    group = [(point["method"], point["batch_size"], point["chunk_size"]) for point in results["group_memory"]]
    small, large = settings["group_batch_sizes"]
    chunk = settings["chunk_size"]
    assert group == [
        ("group", small, chunk), ("group cached", small, chunk), ("group", large, chunk),
        ("group cached", large, chunk), ("group", small, small),
    ]  # fmt: skip
    assert all(point["fits"] and point["step_peak_bytes"] > 0 for point in results["group_memory"])
    assert "f. One training step" in markdown
    # g: a SPLADE step as train.py trains it at two batches: vocabulary-sized representations, counted apart
    sparse = results["sparse_memory"]
    assert [point["batch_size"] for point in sparse] == settings["sparse_batch_sizes"]
    for point in sparse:
        assert point["vocabulary"] == 30522 and point["step_peak_bytes"] > 0
        assert point["representation_bytes"] == point["batch_size"] * 3 * 30522 * 4
        assert point["beyond_batch_bytes"] == point["step_peak_bytes"] - 2 * point["representation_bytes"]
        # the active dimensions of the representations, counted by the loss: some, at most the vocabulary
        assert 0 < point["query_active_dims"] <= 30522 and 0 < point["document_active_dims"] <= 30522
    assert "g. One training step" in markdown and "beyond both (MiB)" in markdown


def test_scale_runs_some_parts_again_and_keeps_the_others_with_their_own_provenance(smoke_run, tmp_path):
    """`--parts d`: part d measured anew, parts a, b, c and e as saved, each part naming its run."""
    import scale

    saved, _ = smoke_run("scale")
    first_run = dict(saved["provenance"], date="2026-01-01 00:00 UTC", commit="0000000")  # an older run
    (tmp_path / "scale_smoke.json").write_text(json.dumps(dict(saved, provenance=first_run)))
    again, markdown = run_script("scale", tmp_path, "--parts", "d")
    assert again["provenance"]["date"] != first_run["date"]
    assert again["part_provenance"]["masked_loss_memory"] == again["provenance"]
    others = ("steps", "loss_memory", "loss_time", "guide_memory", "group_memory", "sparse_memory")
    assert all(again["part_provenance"][part] == first_run for part in others)
    assert all(again["results"][part] == saved["results"][part] for part in others)
    variants = [point["variant"] for point in again["results"]["masked_loss_memory"]]
    assert variants == saved["settings"]["mask_variants"]
    assert "- parts steps, loss_memory, loss_time, guide_memory, group_memory, sparse_memory:" in markdown
    assert "0000000" in markdown
    assert "- parts masked_loss_memory:" in markdown
    with pytest.raises(SystemExit, match="holds none"):  # nothing saved to keep: every part must run
        scale.main(["--preset", "smoke", "--out_dir", str(tmp_path / "x"), "--parts", "d", "--allow_dirty"])


def test_checkpointing_measured_as_train_py_applies_it(smoke_run):
    saved, markdown = smoke_run("checkpointing")
    settings, results = saved["settings"], saved["results"]
    points = {p["gradient_checkpointing"]: p for p in results["memory"]}
    assert set(points) == {False, True} and all(p["fits"] for p in points.values())
    # the worker's model was prepared by models.prepare_model: its transformer modules recompute, or none
    assert points[True]["checkpointed_modules"] > 0 and points[False]["checkpointed_modules"] == 0
    # stage 1 keeps its last chunk's graph for stage 3 (reuse): checkpointed, only the layers' inputs
    # stay alive through stage 2, the loss
    assert points[True]["phase_peak_bytes"]["loss"] < points[False]["phase_peak_bytes"]["loss"]
    (timing,) = results["time"]
    assert all(len(seconds) == settings["rounds"] for seconds in timing["seconds"].values())
    assert all(s > 0 for seconds in timing["seconds"].values() for s in seconds)
    assert "| chunk (examples) | peak without (MiB) | peak with (MiB) |" in markdown


def test_multi_vector_memory_splits_the_peak_into_token_matrices_their_gradients_and_the_rest(smoke_run):
    """A ColBERT step as train.py runs it and sentence-transformers' cached multi-vector loss, each at both
    batches: the token matrices counted are the batch's, at the texts' own lengths."""
    saved, markdown = smoke_run("multi_vector_memory")
    settings, points = saved["settings"], saved["results"]
    ran = [(point["method"], point["batch_size"]) for point in points]
    assert ran == [(method, batch) for method in ("ours", "st") for batch in settings["batch_sizes"]]
    queries, documents = settings["query_tokens"], settings["document_tokens"]
    tokens = queries + documents * (1 + settings["hard_negatives"])  # a row's, every text at its length
    for point in points:
        ours = point["method"] == "ours"
        assert point["fits"] and point["loss_seconds"] > 0
        # ours' stage 2 also read in its check of the gradients (gradcache.stage_two_report)
        assert set(point["phase_peak_bytes"]) == {"chunks", "loss", *(["report"] if ours else [])}
        # ours: 128 dimensions and the scoring mask as a channel, fp32; st: fp32 embeddings, boolean masks
        assert point["widths"] == {"query": queries, "document": documents, "channels": 129 if ours else 128}
        per_token = 129 * 4 if ours else 128 * 4 + 1
        assert point["token_matrix_bytes"] == point["batch_size"] * tokens * per_token
        assert point["rest_bytes"] == point["step_peak_bytes"] - 2 * point["token_matrix_bytes"]
    assert "| the rest (MiB) |" in markdown and "CachedMultiVectorMNRL" in markdown


def test_a_run_with_uncommitted_changes_is_refused_or_marked(monkeypatch):
    import harness

    monkeypatch.setattr(harness, "uncommitted_changes", lambda: [" M gradcache.py"])
    with pytest.raises(SystemExit, match="uncommitted changes"):
        harness.provenance("cpu", "python bench/memory.py")
    info = harness.provenance("cpu", "python bench/memory.py", allow_dirty=True)
    assert info["uncommitted_changes"] == [" M gradcache.py"]
    assert "UNCOMMITTED CHANGES" in harness.provenance_markdown(info)


def test_make_results_assembles_every_section(results_dir, smoke_run):
    runs = [smoke_run(name) for name in SCRIPTS]
    output = results_dir / "RESULTS.md"
    command = [
        sys.executable,
        "bench/make_results.py",
        "--results_dir",
        str(results_dir),
        "--presets",
        "smoke",
        "--output",
        str(output),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    text = output.read_text()
    for name in SCRIPTS:
        section = (results_dir / f"{name}_smoke.md").read_text().split("\n\n")[1]
        assert section in text
    # the targets are checked against the smoke results: a verdict computed for each speed target
    targets = text.split("## Targets")[1].split("\n## ")[0]
    for other in ("ST cached", "plain"):
        assert re.search(
            rf"\| speed: a step of ours at most [\d.]+x one of {other} .*\| (met|missed by \d+%) \|", targets
        )
    assert re.search(r"\| speed: a step of the loss without in-batch .*\| (met|missed by \d+%) \|", targets)
    assert "| exactness: no speed-up changes the gradient |" in targets
    for target in (
        "loss stage: a step at batch 16,384",
        "tiled loss time",
        "a full training step at batch",
        "without in-batch negatives, group_step's memory stays one chunk",
        "a sparse encoder's step holds, beyond its vocabulary-sized representations",
        "a multi-vector \\(ColBERT\\) step holds, beyond its cached token matrices",
    ):
        assert re.search(rf"\| {target}.*\| (met.*|missed.*|not measured.*) \|", targets)
    beside = (
        r"\| a multi-vector step beside sentence-transformers' .*\| measured: ours / st, "
        r"peak [\d.]+x, wall time [\d.]+x, CPU time [\d.]+x \|"
    )
    assert re.search(beside, targets)
    verdicts = r"(holds at every chunk size, by [\d.]+% to [\d.]+%|not at chunk .*)"
    assert re.search(rf"\| gradient checkpointing lowers the peak memory .*\| {verdicts} \|", targets)
    # the runs had uncommitted changes, or one clean commit: the page says which
    commits = {run["provenance"]["commit"] for run, _ in runs}
    if len(commits) == 1 and not any(run["provenance"]["uncommitted_changes"] for run, _ in runs):
        assert f"Every section ran at commit {commits.pop()}, with a clean working tree." in text
    else:
        assert "**Not one clean commit" in text


def test_dtype_memory_halves_the_base_and_keeps_the_adapter_in_float32():
    """bench/dtype_memory.py on a Qwen2 of one layer (its two fresh processes: seconds)."""
    import dtype_memory

    tiny = ["--hidden_size", "64", "--num_layers", "1", "--vocab_size", "512", "--batch_size", "4"]
    float32, bfloat16 = dtype_memory.main([*tiny, "--chunk_size", "2", "--max_seq_length", "8"])
    assert (float32["dtype"], bfloat16["dtype"]) == ("float32", "bfloat16")
    assert bfloat16["base_bytes"] * 2 == float32["base_bytes"]
    assert bfloat16["adapter_bytes"] == float32["adapter_bytes"] and bfloat16["adapter_dtypes"] == ["float32"]


def test_eval_time_times_the_shared_evaluation_with_the_same_metrics(tmp_path, data, model_without_dropout):
    """bench/eval_time.py on two DDP processes: the evaluation shared between them and every process
    evaluating alone, timed, with their metrics' largest difference."""
    from test_train import CONFIGS, launch

    done = launch(
        CONFIGS / "cpu_ddp_2proc.yaml", tmp_path, "--model", model_without_dropout, "--dev_data", data[1],
        processes=2, env={"ACCELERATE_USE_CPU": "true"}, script=ROOT / "bench" / "eval_time.py",
    )  # fmt: skip
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("2 process(es), 8 queries")]
    assert re.search(r"all \d+\.\d s, a share each \d+\.\d s; metrics differ by", line)
    assert float(line.rsplit(" ", 1)[1]) < 1e-6
