"""train.py, launched for real with `accelerate launch` on a tiny BERT built here and a tiny data file.

The launches share module-scoped fixtures: one uninterrupted run per process count, which resumed runs
must reproduce bit for bit. Exactness is judged by tests/references.py's rule against train.py's
optimization replayed without the project's code (replay_full_batch: the batches each run recorded, their
rows read from the raw file) in float32 and float64: the plain and DeepSpeed runs with SGD in place of AdamW
(SGD_LR: AdamW turns rounding noise into full steps), the chunked run also under AdamW. The validation
helpers are also called in-process, where a launch would add nothing but start-up time.
"""

import functools
import gzip
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import numpy
import pytest
import torch
import yaml
from references import Exactness, assert_exact, relative_error, retrieval_evaluator
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import train  # noqa: E402
from train_parts import models, pairs, run  # noqa: E402  (after the offline switches)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
WORDS = [f"w{i}" for i in range(60)]
ROWS = 48  # 6 batches of 8: 6 steps on one process, 3 on each of two


# ---------------------------------------------------------------------------------------------------------
# Tiny model, tiny data, one launcher
# ---------------------------------------------------------------------------------------------------------


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_tiny_model(folder, dropout, kind="mean"):
    """A tiny random sentence-transformers model over a WordPiece vocabulary of the data's tokens, saved.

    kind: "mean"    a 2-layer BERT (hidden size 32), mean pooled, no Normalize
          "cls"     the same BERT, CLS pooled, then Normalize
          "decoder" a 2-layer Llama, last-token pooled, the tokenizer padding on the left
          "router"  two BERTs, one for queries and one for documents, behind sentence-transformers' Router
          "splade"  a SparseEncoder: the BERT with its masked-language-model head, SpladePooling("max")
          "inference-free"  a SparseEncoder Router: a SparseStaticEmbedding (weights drawn around 1) for the
                    queries, the SPLADE BERT for the documents
          "colbert" a MultiVectorEncoder: the BERT, a Dense 32 -> 16 on its token embeddings, a
                    MultiVectorMask that leaves the words w0 to w4 of the documents out, Normalize (ColBERT)
          "colbert-router"  the same behind "router"'s two BERTs (query and document towers)
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Router
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertModel,
        BertTokenizerFast,
        LlamaConfig,
        LlamaModel,
    )

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    vocab += [f"{kind}{i}" for kind in "apn" for i in range(ROWS + 8)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    sizes = dict(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=32)  # fmt: skip

    def transformer(name, seed):
        torch.manual_seed(seed)
        if kind in ("splade", "inference-free"):
            BertForMaskedLM(
                BertConfig(**sizes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
            ).save_pretrained(folder / name)
            BertTokenizerFast(str(folder / "vocab.txt")).save_pretrained(folder / name)
            return Transformer(str(folder / name), transformer_task="fill-mask")
        if kind == "decoder":
            config = LlamaConfig(**sizes, num_key_value_heads=1, attention_dropout=dropout, pad_token_id=0)
            LlamaModel(config).save_pretrained(folder / name)
        else:
            config = BertConfig(**sizes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
            BertModel(config).save_pretrained(folder / name)
        padding_side = "left" if kind == "decoder" else "right"
        BertTokenizerFast(str(folder / "vocab.txt"), padding_side=padding_side).save_pretrained(folder / name)
        return Transformer(str(folder / name))

    if kind in ("splade", "inference-free"):
        document = [transformer("bert", 0), SpladePooling("max")]
        if kind == "splade":
            model = SparseEncoder(modules=document)
        else:
            query = SparseStaticEmbedding(tokenizer=document[0].tokenizer, frozen=False)
            torch.nn.init.uniform_(
                query.weight, 0.5, 1.5
            )  # not all ones: the gradients reach each weight apart
            model = SparseEncoder(modules=[Router.for_query_document([query], document)])
        model.save(str(folder / "model"))
        return folder / "model"
    if kind in ("router", "colbert-router"):
        router = Router.for_query_document([transformer("query", 0)], [transformer("document", 1)])
    if kind in ("colbert", "colbert-router"):
        return build_tiny_colbert(folder, router if kind == "colbert-router" else transformer("bert", 0))
    pooling = Pooling(32, {"cls": "cls", "decoder": "lasttoken"}.get(kind, "mean"))
    if kind == "router":
        modules = [router, pooling]
    else:
        modules = [transformer("bert" if kind != "decoder" else "llama", 0), pooling]
    model = SentenceTransformer(modules=modules + ([Normalize()] if kind == "cls" else []))
    model.save(str(folder / "model"))
    return folder / "model"


def build_tiny_colbert(folder, transformer):
    """A ColBERT on `transformer` (a Transformer, or a Router of them), saved; see build_tiny_model."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(3)
    dense = Dense(
        32, 16, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings"
    )
    mask = MultiVectorMask(skiplist_words=[f"w{i}" for i in range(5)])
    modules = [transformer, dense, mask, Normalize(module_input_name="token_embeddings")]
    MultiVectorEncoder(modules=modules).save(str(folder / "model"))
    return folder / "model"


LAUNCH_PORTS = itertools.count()


def free_port():
    """A rendezvous port that no other launch of the suite can take at the same time: each pytest-xdist
    worker counts through a range of its own, below the kernel's ephemeral ports (32768 and up), so neither
    the other worker nor a port the kernel hands out can race for it, as asking the kernel for a free port
    and closing it before the launch binds it could. A port something else holds makes accelerate launch
    pick another itself ("already in use ... standalone-like mode")."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    return 21000 + 1000 * worker + next(LAUNCH_PORTS) % 1000


def launch(
    config, output_dir, *args, processes=1, env=None, check=True, timeout=600, script=REPO / "train.py"
):
    """`accelerate launch --config_file <config> train.py ...`, from the folder of `script`; returns the
    finished process."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
    command += [str(script), "--output_dir", str(output_dir), *map(str, args)]
    # One thread a process, as conftest.py sets this one: the tiny models' matrices gain nothing from two, and
    # threads that spin-wait for each other on a busy machine made each step several times slower.
    environment = os.environ | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command,
        cwd=Path(script).parent,
        env=environment | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def run_main(monkeypatch, *argv):
    """train.main in this process, as a one-process launch: no new interpreter importing torch and
    sentence-transformers again, so seconds cheaper than a launch. Its Accelerator, environment and signal
    handlers are undone afterwards."""
    from accelerate.state import AcceleratorState, GradientState

    # Main sets it from --max_grad_norm: "auto" here, so that the test undoes it (a launch after this would
    # inherit it, and DeepSpeed clip by it).
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "auto")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        wandb = () if "--wandb_mode" in map(str, argv) else ("--wandb_mode", "disabled")
        train.main(train.parse_args([*map(str, argv), *wandb]))
    except pairs.DataError as error:  # as train.py's last lines stop on it: one line
        raise SystemExit(f"train.py: error: {error}") from error
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        for number, handler in handlers.items():  # main's own catch SIGTERM and Ctrl-C for the loop
            signal.signal(number, handler)


def sharded_loader(dataset, *flags, processes=1, process_index=0):
    """train.py's batches of `dataset` (or of a list of them, one per --data source) under `flags`, as
    accelerate deals them to one of `processes`."""
    from accelerate.data_loader import prepare_data_loader

    sources = dataset if isinstance(dataset, list) else [dataset]
    data = [f"source_{k}.jsonl" for k in range(len(sources))]
    args = train.parse_args(["--model", "m", "--data", *data, *map(str, flags)])
    loader = train.make_loader(sources, args, processes)
    return prepare_data_loader(loader, num_processes=processes, process_index=process_index)


def weights(model_dir):
    """A saved model's parameters, loaded the way a user loads it."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").state_dict()


def max_difference(a, b):
    assert sorted(a) == sorted(b)
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def logged_scalars(run_dir):
    """{tag: [(step, value)]} from the TensorBoard events that accelerate's tracker wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / "gradcache"))  # <logging_dir>/<project>
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# Every backend run: 3 steps of 8 examples in chunks of 3 (not a divisor), no dropout, no wandb. Clipping at
# CLIP leaves some steps unclipped, so DeepSpeed (clipping by its own config, default 1.0) must follow the
# flag to match: a uniform clip would not show, AdamW being blind to a constant gradient scale.
CLIP = 8.0
BACKEND_ARGS = ("--batch_size", 8, "--chunk_size", 3, "--max_steps", 3, "--lr", 1e-3, "--max_grad_norm", CLIP)
BACKEND_ARGS += ("--wandb_mode", "disabled")


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, data, model_without_dropout):
    """Uninterrupted plain runs, one process on cpu.yaml and two DDP processes on cpu_ddp_2proc.yaml, with a
    checkpoint at step 2 to resume from."""
    folder = tmp_path_factory.mktemp("reference")
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", data[1], *BACKEND_ARGS)
    common += ("--save_steps", 2)
    (folder / "one_record").mkdir()
    one = recording_environment(folder / "one_record", sgd=False)
    launch(CONFIGS / "cpu.yaml", folder / "one", *common, env=one)
    two = {"ACCELERATE_USE_CPU": "true"}  # see the comment in cpu_ddp_2proc.yaml
    launch(CONFIGS / "cpu_ddp_2proc.yaml", folder / "two", *common, processes=2, env=two)
    return {1: folder / "one", 2: folder / "two", "steps": recorded_steps(folder / "one_record", 1)}


# ---------------------------------------------------------------------------------------------------------
# End to end: logging, checkpoints, final model, exact resume
# ---------------------------------------------------------------------------------------------------------


def test_a_large_dev_corpus_shows_its_encoding_on_the_main_process(tmp_path, capsys):
    """A 50,000-document evaluation printed nothing for minutes: from logs.PROGRESS_CORPUS documents on,
    sentence-transformers' own bars show the queries and the corpus encoded; a small dev set stays quiet."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from sentence_transformers import SentenceTransformer

    from train_parts import logs

    model = SentenceTransformer(str(build_tiny_model(tmp_path, dropout=0.0)), device="cpu")
    accelerator = Accelerator(cpu=True)
    try:
        for documents, shown in ((logs.PROGRESS_CORPUS, True), (logs.PROGRESS_CORPUS - 1, False)):
            texts = [f"w{i}" for i in range(documents)]
            dev = datasets.Dataset.from_dict({"anchor": texts, "positive": texts})
            evaluator = pairs.build_evaluator(dev, 2, say=len)  # 2 queries against every positive
            metrics = logs.evaluate(evaluator, model, accelerator, global_step=0)
            assert ("Corpus Chunks" in capsys.readouterr().err) == shown, documents
            assert metrics["memory/peak_rss_gib"] > 0
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_end_to_end_run_logs_saves_and_resumes_exactly(
    tmp_path, data, model_with_dropout, monkeypatch, capsys
):
    # 24 examples are 3 batches an epoch: the checkpoint at step 4 sits one batch into the second epoch.
    common = (
        "--model", model_with_dropout, "--data", data[0], "--dev_data", data[1], "--max_train_examples", 24,
        "--batch_size", 8, "--chunk_size", 3, "--max_steps", 6, "--save_steps", 4, "--eval_steps", 3,
        "--lr", 1e-3, "--matryoshka_dims", "32,16",
    )  # fmt: skip
    straight = launch(CONFIGS / "cpu.yaml", tmp_path / "straight", *common)

    assert straight.stdout.count("effective_batch_size: 8") == 1  # printed once, at the start
    logged = logged_scalars(tmp_path / "straight")
    assert [step for step, _ in logged["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert {value for _, value in logged["train/global_step"]} == {0, 1, 2, 3, 4, 5, 6}
    assert [step for step, _ in logged["eval/dev_cosine_mrr@10"]] == [0, 3, 6]
    for tag in ("eval/dev_cosine_ndcg@10", "eval/dev_cosine_recall@10", "train/learning_rate"):
        assert tag in logged
    assert {value for _, value in logged["train/effective_batch_size"]} == {8}
    assert {value for _, value in logged["train/chunk_size"]} == {3}
    for tag in ("train/loss", "train/grad_norm", "train/examples_per_second", "memory/rss_gib"):
        assert all(value > 0 and value < float("inf") for _, value in logged[tag]), tag
    # The high-water mark, logged by every evaluation too (the one before training included) and by training:
    # never falling, never below the resident size logged with it (within the kernel's lazily summed
    # per-thread page counts, which the two readings take at different moments).
    peaks = logged["memory/peak_rss_gib"]
    assert [step for step, _ in peaks] == [0, 1, 2, 3, 3, 4, 5, 6, 6]
    assert [value for _, value in peaks] == sorted(value for _, value in peaks)
    rss = logged["memory/rss_gib"]
    assert all(max(v for s, v in peaks if s == step) >= value - 2**-8 for step, value in rss), (peaks, rss)
    for tag in ("train/tokens_per_second", "train/loss_dim_32", "train/loss_dim_16"):
        assert [step for step, value in logged[tag] if 0 < value < float("inf")] == [1, 2, 3, 4, 5, 6], tag
    for tag in (
        "train/in_batch_accuracy",
        "train/padding_efficiency",
    ):  # fractions (texts of one length here)
        assert all(0 <= value <= 1 for _, value in logged[tag]), tag
    tensorboard = tmp_path / "straight" / "tensorboard" / "gradcache"
    (config,) = tensorboard.glob("*/hparams.yml")
    # One subfolder for the launch's hparams: torch's add_hparams events beside accelerate's hparams.yml
    assert [path for path in tensorboard.iterdir() if path.is_dir()] == [config.parent]
    assert list(config.parent.glob("events.out.tfevents.*"))
    config = yaml.safe_load(config.read_text())  # the values the run used, not the flags' None
    assert (config["similarity"], config["max_seq_length"], config["chunk_size"]) == ("cos", 32, 3)
    assert max(value for _, value in logged["train/learning_rate"]) == pytest.approx(1e-3)
    (wandb_run,) = (tmp_path / "straight" / "wandb").glob("offline-run-*/run-*.wandb")
    wandb_records = wandb_run.read_bytes()  # protobuf records: metric names are stored as plain text
    assert b"train/loss" in wandb_records and b"eval/dev_cosine_mrr@10" in wandb_records

    checkpoints = tmp_path / "straight" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step_4", "step_6"]  # no .partial left
    state = json.loads((checkpoints / "step_4" / "trainer_state.json").read_text())
    assert (state["global_step"], state["epoch"], state["batches_done"]) == (4, 1, 1)
    final = weights(tmp_path / "straight" / "final")
    assert max_difference(final, load_file(checkpoints / "step_6" / "model.safetensors")) == 0
    assert max_difference(final, load_file(checkpoints / "step_4" / "model.safetensors")) > 1e-4

    resumed = launch(
        CONFIGS / "cpu.yaml",
        tmp_path / "resumed",
        *common,
        "--resume_from_checkpoint",
        checkpoints / "step_4",
    )
    assert "resumed from" in resumed.stdout
    (wandb_run_id,) = {
        path.name.rsplit("-", 1)[1] for path in (tmp_path / "straight" / "wandb").glob("offline-*")
    }
    assert state["wandb_run_id"] == wandb_run_id  # saved with the checkpoint, and continued from it
    assert list((tmp_path / "resumed" / "wandb").glob(f"offline-run-*-{wandb_run_id}"))
    assert [step for step, _ in logged_scalars(tmp_path / "resumed")["train/loss"]] == [5, 6]
    resumed_final = weights(tmp_path / "resumed" / "final")
    assert all(torch.equal(final[name], resumed_final[name]) for name in final)

    # A longer --max_steps: the schedule of 8 steps from the start (warmup round(0.8) = 1 step, then linear
    # decay), continued at step 4. It was the old one's rate at step 5, 0 at step 6, then the new one's.
    longer = (*common, "--save_steps", 0, "--eval_steps", 0)  # the last value of a flag counts
    resume_at_4 = ("--resume_from_checkpoint", checkpoints / "step_4")
    run_main(monkeypatch, *longer, "--max_steps", 8, "--output_dir", tmp_path / "longer", *resume_at_4)
    assert "--max_steps 8 instead of the checkpoint's --max_steps 6" in capsys.readouterr().out
    rates = logged_scalars(tmp_path / "longer")["train/learning_rate"]
    assert rates == [(step, pytest.approx(1e-3 * (8 - (step - 1)) / 7)) for step in (5, 6, 7, 8)]
    with pytest.raises(SystemExit, match="step_4 is at step 4, past this launch's 3 steps"):
        run_main(monkeypatch, *longer, "--max_steps", 3, "--output_dir", tmp_path / "shorter", *resume_at_4)


def test_two_processes_resume_bit_for_bit_with_logs_evaluation_and_checkpoints_off(
    tmp_path, data, model_without_dropout, reference_runs
):
    """'latest' is found by the main process and sent to the other. 0 turns --eval_steps, --log_steps and
    --save_steps off (each crashed at step 3 before)."""
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", data[1], *BACKEND_ARGS)
    off = ("--eval_steps", 0, "--log_steps", 0, "--save_steps", 0)
    shutil.copytree(reference_runs[2] / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_2")
    two = {"ACCELERATE_USE_CPU": "true"}
    done = launch(
        CONFIGS / "cpu_ddp_2proc.yaml", tmp_path, *common, *off, "--resume_from_checkpoint", "latest",
        processes=2, env=two,
    )  # fmt: skip
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_2'}" in done.stdout
    resumed, reference = weights(tmp_path / "final"), weights(reference_runs[2] / "final")
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["step_2"]
    assert not [tag for tag in logged_scalars(tmp_path) if tag.startswith(("train/", "eval/"))]


def test_resume_with_another_learning_rate_follows_the_new_schedule():
    """What main() does on resume: load_state restores the checkpoint's rates into the optimizer and the
    scheduler, then set_peak_learning_rate takes --lr. From there the rates are those of a run that had
    --lr from the start; without it, the checkpoint's (the bug: --lr did nothing)."""
    from transformers import get_scheduler

    def optimizer_and_schedule(learning_rate, steps_done):
        adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=learning_rate)
        scheduler = get_scheduler("cosine", adamw, num_warmup_steps=2, num_training_steps=10)
        for _ in range(steps_done):
            adamw.step()
            scheduler.step()
        return adamw, scheduler

    checkpoint = optimizer_and_schedule(1e-3, steps_done=4)
    adamw, scheduler = optimizer_and_schedule(5e-4, steps_done=0)
    adamw.load_state_dict(checkpoint[0].state_dict())
    scheduler.load_state_dict(checkpoint[1].state_dict())
    assert scheduler.get_last_lr() == checkpoint[1].get_last_lr()
    run.set_peak_learning_rate(scheduler, 5e-4)
    reference_adamw, reference = optimizer_and_schedule(5e-4, steps_done=4)
    for _ in range(6):
        assert scheduler.get_last_lr() == pytest.approx(reference.get_last_lr(), rel=1e-12)
        assert adamw.param_groups[0]["lr"] == pytest.approx(reference_adamw.param_groups[0]["lr"], rel=1e-12)
        for optimizer, schedule in ((adamw, scheduler), (reference_adamw, reference)):
            optimizer.step()
            schedule.step()


def test_chunked_run_reaches_sentence_transformers_full_batch_weights(
    data, model_without_dropout, reference_runs
):
    """The chunked one-process run, replayed here without the project's code: the batches it recorded, their
    rows read from the raw file, sentence-transformers' MultipleNegativesRankingLoss on each full batch,
    torch's clipping, AdamW and linear schedule, in float32 and in float64; the run's weight updates judged by
    references.py's rule. AdamW (train.py's optimizer) divides each gradient by its own root mean square, so
    a gradient that is rounding noise moves its weight by a full step either way: the float32 reference's
    distance to float64 counts that noise, and the rule's bound with it."""
    initial = weights(model_without_dropout)
    steps = reference_runs["steps"]
    float32, truth = (full_batch_replay(data, model_without_dropout, t, steps)["updates"] for t in DTYPES)
    chunked = weights(reference_runs[1] / "final")
    run = updates(chunked, initial)
    measured = assert_exact(run, float32, truth, "chunk 3 against the full-batch loss, updates")
    print(f"chunk 3 vs sentence-transformers' full-batch loss: update {measured}")
    assert max_difference(chunked, initial) > 1e-4  # the weights did move: AdamW's steps are ~1e-3


DTYPES = (torch.float32, torch.float64)


def updates(trained, initial):
    """What training changed, in float64: comparing updates keeps the initial weights, which every run
    shares, out of the relative error."""
    return {name: w.double() - initial[name].double() for name, w in trained.items()}


@pytest.mark.parametrize("processes", [1, 2])
def test_plain_runs_under_sgd_match_the_full_batch_replay(
    tmp_path, data, model_without_dropout, monkeypatch, processes
):
    """The plain runs, one process (in this one) and two DDP processes (launched), with SGD in place of AdamW
    (SGD_LR, SGD_CLIP), against replay_full_batch of the batches they recorded in float32 and float64 by
    references.py's rule: updates, logged losses and gradient norms. The wrong paths, which the run must
    fail: the replay not clipped or clipped at 1.0, and with two processes, their batches contrasted as
    one."""
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", data[1], *BACKEND_ARGS)
    common += ("--lr", SGD_LR, "--max_grad_norm", SGD_CLIP, "--output_dir", tmp_path / "run")
    if processes == 1:
        with monkeypatch.context() as patch:
            steps = record_batches(patch)  # and SGD in place of AdamW
            run_main(monkeypatch, *common)
        steps = in_steps(steps, 1)
    else:
        environment = {"ACCELERATE_USE_CPU": "true"} | recording_environment(tmp_path)
        launch(CONFIGS / "cpu_ddp_2proc.yaml", common[-1], *common[:-2], processes=2, env=environment)
        steps = recorded_steps(tmp_path, 2)
    run = updates(weights(tmp_path / "run" / "final"), weights(model_without_dropout))
    wrong_paths = CLIPPING_WRONG_PATHS | ({"contrasted as one": {"together": True}} if processes == 2 else {})
    logged = logged_scalars(tmp_path / "run")
    assert_replayed(run, logged, data, model_without_dropout, steps, f"plain x {processes}", wrong_paths)


def full_batch_replay(data, model_folder, dtype, steps, sgd=False, clip=None, together=False):
    """replay_full_batch, once per module run and arguments (the DeepSpeed cases share it)."""
    options = (sgd, clip, together)
    return _full_batch_replay(str(data[0]), str(model_folder), dtype, json.dumps(steps), *options)


@functools.cache
def _full_batch_replay(data_file, model_folder, dtype, steps, *options):
    return replay_full_batch(Path(data_file), model_folder, dtype, json.loads(steps), *options)


def raw_rows(data_file):
    """{anchor: [anchor, positive, negative]}, each record's texts read from the raw JSON lines with json."""
    records = [json.loads(line) for line in Path(data_file).read_text().splitlines()]
    return {
        record["anchor"]: [record[field] for field in ("anchor", "positive", "negative")]
        for record in records
    }


def replay_full_batch(data_file, model_folder, dtype, steps, sgd=False, clip=None, together=False):
    """train.py's default optimization of the recorded `steps` (each step: its batches, one a process)
    without the project's code, in `dtype`: each batch's rows read from the raw file by their anchors,
    sentence-transformers' loss on each whole batch, their mean (what DDP and DeepSpeed average the
    gradients of), torch's clipping at `clip` (default: CLIP, SGD_CLIP with `sgd`), AdamW (`sgd`: plain SGD
    at SGD_LR) and linear schedule. The wrong path `together`: a step's batches contrasted as one batch.
    Returns the weight updates (float64) and the losses and gradient norms before clipping that train.py
    logs."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from transformers import get_scheduler

    model = SentenceTransformer(str(model_folder), device="cpu").to(dtype)
    initial = {name: w.detach().clone() for name, w in model.state_dict().items()}
    loss_fn = MultipleNegativesRankingLoss(model, scale=20.0)
    if sgd:
        adamw = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = get_scheduler("linear", adamw, 0, len(steps))  # warmup: round(0.1 * 3) = 0 steps
    clip = clip if clip is not None else SGD_CLIP if sgd else CLIP
    rows = raw_rows(data_file)
    model.train()
    losses, norms = [], []
    for step in steps:
        batches = [list(zip(*[rows[anchor] for anchor in batch[0]], strict=True)) for batch in step]
        if together:
            batches = [[[text for batch in batches for text in batch[c]] for c in range(3)]]
        loss = sum(loss_fn([model.preprocess(list(texts)) for texts in batch], None) for batch in batches)
        loss = loss / len(batches)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        losses.append(float(loss.detach()))
        adamw.step(), scheduler.step(), adamw.zero_grad()
    return {"updates": updates(model.state_dict(), initial), "losses": losses, "grad_norms": norms}


def assert_replayed(run, logged, data, model_folder, steps, what, wrong_paths):
    """The run's updates (float64, {name: tensor}) and its logged losses and gradient norms against the SGD
    replay of the recorded `steps` in float32 and float64 by references.py's rule; each of `wrong_paths`
    ({name: full_batch_replay options}, a replay taking a wrong path) must fail the same rule."""
    float32, truth = (full_batch_replay(data, model_folder, t, steps, sgd=True) for t in DTYPES)
    tags = (("train/loss", "losses"), ("train/grad_norm", "grad_norms"))  # a DeepSpeed run logs its engine's
    values = {"updates": run} | {key: [value for _, value in logged[tag]] for tag, key in tags}
    for key, run_values in values.items():
        measured = assert_exact(run_values, float32[key], truth[key], f"{what}, {key}")
        print(f"{what}: {key} {measured}")
        for name, options in wrong_paths.items():
            wrong = full_batch_replay(data, model_folder, torch.float64, steps, sgd=True, **options)
            control = Exactness(relative_error(run_values, wrong[key]), measured.e_ref)
            assert not control.holds, f"{what}, {key} matches the replay {name}: {control}"
            print(f"{what}: {key} against the replay {name} {control.error:.1e}")
    return truth


# The wrong paths of a clipped SGD run: some of its steps are clipped at SGD_CLIP, some not.
CLIPPING_WRONG_PATHS = {
    "not clipped": {"clip": math.inf},
    "clipped at 1.0 (DeepSpeed's default)": {"clip": 1.0},
}


# ---------------------------------------------------------------------------------------------------------
# Backends: DeepSpeed on its CPU accelerator must reproduce the plain runs
# ---------------------------------------------------------------------------------------------------------


def engine_weights(checkpoint):
    """The fp32 weights DeepSpeed's engine held, rebuilt from its (sharded) checkpoint by DeepSpeed itself."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")


def launch_deepspeed(config, output_dir, *args, processes, env=None):
    """About 2 in 35 two-process DeepSpeed runs on CPU abort (SIGABRT, in gloo's threads) at interpreter exit,
    after the run finished: such a run counts when its final model was saved; any other failure is retried
    once from a clean folder."""
    for attempt in (1, 2):
        done = launch(config, output_dir, *args, processes=processes, env=env, check=attempt == 2)
        aborted_at_exit = "SIGABRT" in done.stderr or "terminate called" in done.stderr
        saved = (Path(output_dir) / "final" / "modules.json").is_file()
        if done.returncode == 0 or (aborted_at_exit and saved):
            return done
        shutil.rmtree(output_dir, ignore_errors=True)


# Exactness runs take plain SGD in place of train.py's AdamW (which has no other optimizer): AdamW divides
# each gradient by its own root mean square, so a gradient that is rounding noise (the attention keys' biases,
# whose exact gradient is 0: a query's scores all shift by one constant) moves its weight by a full step of
# random sign, in float32 and float64 alike, and the float32 reference's own distance to float64 was 1e-3 of
# the largest update (measured): a bound of 4.5e-3, which an update 1 + 1e-3 times too large passed. AdamW is
# also blind to a gradient's scale. SGD's update is the gradient itself. The rate is raised so that each
# update stands far above the float32 rounding of the weights it is added to.
SGD_LR = 0.1
SGD_CLIP = 4.0  # at this rate the norm falls below CLIP after the first step: some steps clipped, some not
SGD_SITECUSTOMIZE = """import torch


class SGDInPlaceOfAdamW(torch.optim.SGD):  # written by tests/test_train.py: exactness runs
    def __init__(self, params, lr=1e-3, weight_decay=0.0, **_):
        super().__init__(params, lr=lr)


torch.optim.AdamW = SGDInPlaceOfAdamW
"""


class SGDInPlaceOfAdamW(torch.optim.SGD):
    """What SGD_SITECUSTOMIZE puts in place of torch.optim.AdamW, for runs in this process."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0, **_):
        super().__init__(params, lr=lr)


def sgd_environment(folder):
    """The environment of a launch of train.py with SGD in place of AdamW: a sitecustomize.py (written in
    `folder`) on the launched processes' PYTHONPATH."""
    site = folder / "sgd_sitecustomize"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SGD_SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def sgd_launch(folder, config):
    """(config, env) for a DeepSpeed launch of train.py with SGD in place of AdamW: sgd_environment, and the
    DeepSpeed config allowing an optimizer ZeRO has not tested (and keeping it under offload)."""
    options = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    return deepspeed_config_with(folder, config, options), sgd_environment(folder)


# ---------------------------------------------------------------------------------------------------------
# Runs that record their batches: what a replay trains on, never read through train.py's sampler
# ---------------------------------------------------------------------------------------------------------

FAULTS_SITECUSTOMIZE = REPO / "tests" / "faults" / "sitecustomize.py"

# The texts of every batch a launched process trains on, one JSON line each, in <folder>/<rank>.jsonl; a
# process's first batch starts the file anew (launch_deepspeed's retry records from the start).
RECORDING_SITECUSTOMIZE = """
import json
import os

import gradcache

step, mode = gradcache.gradcache_step, ["w"]


def recorded(encoder, columns, *args, **kwargs):
    path = os.path.join({folder!r}, os.environ.get("RANK", "0") + ".jsonl")
    with open(path, mode.pop() if mode else "a") as record:
        record.write(json.dumps([list(texts) for texts in columns]) + "\\n")
    return step(encoder, columns, *args, **kwargs)


gradcache.gradcache_step = recorded
"""


def recording_sitecustomize(folder, faults=False, sgd=True):
    """The code of a sitecustomize.py that records a launched process's batches (RECORDING_SITECUSTOMIZE) in
    folder/record, with SGD in place of AdamW (`sgd`) and tests/faults' test doubles (`faults`)."""
    (folder / "record").mkdir()
    code = (SGD_SITECUSTOMIZE if sgd else "") + RECORDING_SITECUSTOMIZE.format(folder=str(folder / "record"))
    if faults:  # one sitecustomize a process: this one runs tests/faults' too
        path = str(FAULTS_SITECUSTOMIZE)
        code += f"\nexec(compile(open({path!r}).read(), {path!r}, 'exec'))\n"
    return code


def recording_environment(folder, faults=None, sgd=True):
    """The environment of a launch that records its batches in folder/record (recording_sitecustomize), with
    SGD in place of AdamW (`sgd`) and, given `faults` ({GRADCACHE_FAULT_*: value}), tests/faults' test
    doubles."""
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(recording_sitecustomize(folder, bool(faults), sgd))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])} | (faults or {})


def recorded_batches(folder, rank):
    return [json.loads(line) for line in (folder / "record" / f"{rank}.jsonl").read_text().splitlines()]


def recorded_steps(folder, processes):
    """A launched run's optimizer steps (no accumulation): each step's batches, one a process, as recorded."""
    per_rank = [recorded_batches(folder, rank) for rank in range(processes)]
    return [list(step) for step in zip(*per_rank, strict=True)]


def record_batches(patch):
    """The texts of every batch train.main trains on in this process (a list it fills, one entry a batch:
    its columns of texts), through a test double around gradcache.gradcache_step; SGD in place of AdamW."""
    import gradcache

    batches, step = [], gradcache.gradcache_step

    def recorded(encoder, columns, *args, **kwargs):
        batches.append([list(texts) for texts in columns])
        return step(encoder, columns, *args, **kwargs)

    patch.setattr(gradcache, "gradcache_step", recorded)
    patch.setattr(torch.optim, "AdamW", SGDInPlaceOfAdamW)
    return batches


def in_steps(batches, accumulation):
    """A process's batches cut into optimizer steps of `accumulation` batches."""
    assert len(batches) % accumulation == 0
    return [batches[k : k + accumulation] for k in range(0, len(batches), accumulation)]


@pytest.mark.parametrize(
    "config, processes",
    [
        # ZeRO-1 in one process: tests/test_configs.py launches its config, test_matrix.py rows train under it
        ("deepspeed_zero1.yaml", 2),  # ZeRO-1 refuses engine.step() inside no_sync: one sync per step
        ("deepspeed_zero2.yaml", 2),
        ("deepspeed_zero3.yaml", 2),
        ("deepspeed_zero2_offload_optimizer.yaml", 1),
        ("deepspeed_zero3_offload_params.yaml", 2),
    ],
)
def test_deepspeed_reproduces_the_plain_run(
    tmp_path, data, model_without_dropout, reference_runs, config, processes
):
    """Each DeepSpeed config trains as the plain run's optimization replayed without gradcache nor DeepSpeed
    (replay_full_batch: sentence-transformers' loss on each process's whole batch, their mean, torch's
    clipping), in float32 and float64, by references.py's rule: the weight updates, the logged losses and
    the logged gradient norms (DeepSpeed's engine's), with SGD in place of AdamW (SGD_LR), of the batches
    the run recorded (recording_environment); the wrong paths: the replay not clipped, clipped at DeepSpeed's
    default 1.0, and with two processes their batches contrasted as one. final/ holds the weights as its
    engine held them. ZeRO-2 also resumes bit for bit, under AdamW (train.py's optimizer, whose state the
    checkpoint must restore).
    ZeRO-3 runs with every parameter partitioned (zero3_partitioning_everything: the shipped config keeps
    a tiny model's parameters whole), split over the two processes, and final/ holds them whole, under the
    plain run's names, without torch's FutureWarnings: these were launches of their own, merged here (suite
    time)."""
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", data[1], *BACKEND_ARGS)
    resume_too = (config, processes) == ("deepspeed_zero2.yaml", 2)  # and resume from step 2, bit for bit
    partitioned = config == "deepspeed_zero3.yaml"
    config = zero3_partitioning_everything(tmp_path) if partitioned else CONFIGS / config
    name = f"{config.stem} x {processes}"
    sgd_config, _ = sgd_launch(tmp_path, config)
    sgd_flags = ("--lr", SGD_LR, "--max_grad_norm", SGD_CLIP)  # the last value of a flag counts
    run = tmp_path / "run"
    environment = recording_environment(tmp_path)  # and SGD in place of AdamW
    done = launch_deepspeed(sgd_config, run, *common, *sgd_flags, processes=processes, env=environment)
    assert "DistributedType.DEEPSPEED" in done.stdout and f"processes: {processes}" in done.stdout
    steps = recorded_steps(tmp_path, processes)
    saved = weights(run / "final")
    run_updates = updates(saved, weights(model_without_dropout))
    wrong_paths = CLIPPING_WRONG_PATHS | ({"contrasted as one": {"together": True}} if processes == 2 else {})
    logged = logged_scalars(run)
    truth = assert_replayed(run_updates, logged, data, model_without_dropout, steps, name, wrong_paths)
    assert max_difference(saved, engine_weights(run / "checkpoints" / "step_3")) == 0
    if partitioned:
        # torch's FutureWarning at DeepSpeed's ZeRO-3 collectives, filtered by train.py (100 lines in 8 steps)
        assert "FutureWarning: `torch.distributed." not in done.stderr
        shards = sorted((run / "checkpoints" / "step_3" / "pytorch_model").glob("*optim_states.pt"))
        assert len(shards) == 2
        # The file itself, as a tool reading it by name sees it: the names of the plain run (not gamma/beta),
        # holding what sentence-transformers loaded from it (judged above).
        saved_file, plain_file = (
            load_file(folder / "final" / "model.safetensors") for folder in (run, reference_runs[2])
        )
        assert sorted(saved_file) == sorted(plain_file)
        assert all(torch.equal(saved_file[key], saved[f"0.model.{key}"]) for key in saved_file)
    # Some steps clipped, some not, so that DeepSpeed must clip as the flag says (SGD follows the scale)
    assert min(truth["grad_norms"]) < SGD_CLIP < max(truth["grad_norms"])
    if partitioned:  # its evaluation before training, the texts split between the processes: the metrics of
        # sentence-transformers' evaluator built from the raw dev file, in this process
        from sentence_transformers import SentenceTransformer

        initial = SentenceTransformer(str(model_without_dropout), device="cpu")
        expected = retrieval_evaluator(data[1])(initial)
        tags = [tag for tag in logged if tag.startswith("eval/dev_")]
        assert sorted(tags) == sorted(f"eval/{name}" for name in expected)
        assert len(tags) == 9  # accuracy, precision and recall @1 and @10, MRR, NDCG and MAP @10
        assert all(logged[t][0] == (0, pytest.approx(expected[t[5:]], abs=1e-6)) for t in tags)
    if resume_too:  # AdamW, train.py's own: two runs of the same code, equal bit for bit
        straight, step_2 = tmp_path / "straight", tmp_path / "straight" / "checkpoints" / "step_2"
        launch_deepspeed(config, straight, *common, "--save_steps", 2, processes=2)
        launch_deepspeed(
            config, tmp_path / "resumed", *common, "--resume_from_checkpoint", step_2, processes=2
        )
        resumed, uninterrupted = (weights(folder / "final") for folder in (tmp_path / "resumed", straight))
        assert all(torch.equal(resumed[key], uninterrupted[key]) for key in uninterrupted)
        assert max_difference(uninterrupted, saved) > 1e-4  # AdamW's weights, not SGD's


def zero3_partitioning_everything(folder):
    """The shipped ZeRO-3 config with every parameter partitioned, so that each forward gathers them: the
    shipped one keeps a tiny model's parameters whole (below DeepSpeed's persistence threshold)."""
    partitioned = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    return deepspeed_config_with(folder, CONFIGS / "deepspeed_zero3.yaml", partitioned)


def deepspeed_config_with(folder, config, options):
    """A copy of the accelerate `config` (in `folder`) whose DeepSpeed JSON has `options` merged in (dicts
    merged key by key)."""
    shipped = Path(config).read_text()
    (json_path,) = [
        line.split(":", 1)[1].strip() for line in shipped.splitlines() if "deepspeed_config_file" in line
    ]
    deepspeed_config = json.loads((REPO / json_path).read_text())

    def merge(into, extra):
        for key, value in extra.items():
            if isinstance(value, dict):
                merge(into.setdefault(key, {}), value)
            else:
                into[key] = value

    merge(deepspeed_config, options)
    name = Path(config).stem
    (folder / f"{name}.json").write_text(json.dumps(deepspeed_config))
    copy = folder / f"{name}.yaml"
    copy.write_text(shipped.replace(json_path, str(folder / f"{name}.json")))
    return copy


# ---------------------------------------------------------------------------------------------------------
# Clear errors before training starts
# ---------------------------------------------------------------------------------------------------------


def test_a_bad_data_file_stops_the_launch_before_training(tmp_path, data, model_without_dropout):
    lines = data[0].read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([*lines[:4], lines[4][:-1], *lines[5:]]) + "\n")  # line 5 loses its brace
    done = launch(
        CONFIGS / "cpu.yaml",
        tmp_path / "run",
        "--model",
        model_without_dropout,
        "--data",
        broken,
        "--wandb_mode",
        "disabled",
        check=False,
    )
    assert done.returncode != 0
    assert f"{broken}, line 5 is not valid JSON" in done.stderr
    assert not (tmp_path / "run").exists()  # claimed, then refused: not left behind holding only .lock
    # One line, then the launcher's own traceback (accelerate's one-process launcher prints it for any
    # non-zero exit), which names train.py's exit status: 2, a refusal.
    (line,) = [line for line in done.stderr.splitlines() if "train.py: error:" in line]
    assert line.startswith("train.py: error:") and "returned non-zero exit status 2." in done.stderr


def test_max_grad_norm_0_trains_unclipped_and_logs_the_norm(
    tmp_path, data, model_without_dropout, monkeypatch
):
    """0 is no clipping, as DeepSpeed reads it: torch's clipping to 0 zeroed every gradient, so the weights
    stayed put (no weight decay here) while the log showed the norm. With SGD in place of AdamW (whose
    update hardly follows the gradient's scale; SGD_LR), the run equals bit for bit one clipping far above
    its norms, and differs from one clipping at half its smallest norm (the control: clipping would show)."""
    monkeypatch.setattr(torch.optim, "AdamW", SGDInPlaceOfAdamW)

    def trained(name, max_grad_norm):
        run_main(
            monkeypatch, "--output_dir", tmp_path / name, "--model", model_without_dropout, "--data", data[0],
            "--batch_size", 8, "--chunk_size", 4, "--max_steps", 2, "--lr", SGD_LR, "--weight_decay", 0,
            "--max_grad_norm", max_grad_norm, "--save_steps", 0, "--dev_data", "",
        )  # fmt: skip
        norms = [value for _, value in logged_scalars(tmp_path / name)["train/grad_norm"]]
        return weights(tmp_path / name / "final"), norms

    unclipped, norms = trained("off", 0)
    assert len(norms) == 2 and all(0 < norm < float("inf") for norm in norms)
    assert max_difference(unclipped, weights(model_without_dropout)) > 1e-4
    far_above, far_norms = trained("far_above", 1e6)
    assert far_norms == norms and max_difference(far_above, unclipped) == 0
    clipped, clipped_norms = trained("clipped", min(norms) / 2)
    assert clipped_norms[0] == norms[0]  # the same first gradient, clipped
    assert max_difference(clipped, unclipped) > 1e-4


def test_an_undistributed_multi_process_launch_stops_at_start(tmp_path, data, model_without_dropout):
    """cpu_ddp_2proc.yaml without ACCELERATE_USE_CPU=true on a machine without a GPU: accelerate runs every
    process undistributed, each trained alone and wrote final/, while the run printed `processes: 2`."""
    done = launch(
        CONFIGS / "cpu_ddp_2proc.yaml", tmp_path, "--model", model_without_dropout, "--data", data[0],
        "--batch_size", 8, "--chunk_size", 4, "--max_steps", 1, "--wandb_mode", "disabled",
        processes=2, env={"ACCELERATE_USE_CPU": "false", "CUDA_VISIBLE_DEVICES": ""}, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "launched as 2 processes, but accelerate runs them undistributed" in done.stderr
    assert "ACCELERATE_USE_CPU=true" in done.stderr
    # torchrun's failure summary, printed last, names the line as the root cause (not "To enable traceback")
    assert "traceback : train.py: error: launched as 2 processes" in "\n".join(done.stderr.splitlines()[-3:])
    assert not (tmp_path / "final").exists()


def test_deepspeed_refuses_gradient_accumulation_before_training(tmp_path, data, model_without_dropout):
    common = ("--model", model_without_dropout, "--data", data[0], "--wandb_mode", "disabled")
    done = launch(
        CONFIGS / "deepspeed_zero2.yaml", tmp_path, *common, "--gradient_accumulation_steps", "2", check=False
    )
    assert done.returncode != 0
    assert "--gradient_accumulation_steps > 1 under DeepSpeed" in done.stderr
    assert "Raise --batch_size instead" in done.stderr
    assert not (tmp_path / "checkpoints").exists()


def fails_with(capsys, call, *fragments):
    """`call` stops in one line: train.py's own failure (SystemExit), or the data module's DataError, which
    train.py's last lines print as one."""
    with pytest.raises((SystemExit, pairs.DataError)) as stopped:
        call()
    stop = stopped.value
    message = str(stop.code if isinstance(stop, SystemExit) else stop) + capsys.readouterr().err
    for fragment in fragments:
        assert fragment in message
    return message


def test_argument_errors_say_what_to_do(capsys):
    fails_with(
        capsys,
        lambda: train.parse_args(["--batch_size", "8", "--chunk_size", "16"]),
        "--chunk_size 16 is larger than --batch_size 8",
        "Lower --chunk_size",
    )
    fails_with(capsys, lambda: train.parse_args(["--columns", "query=q"]), "--columns: cannot read 'query=q'")
    assert train.parse_args(["--batch_size", "8", "--chunk_size", "8"]).chunk_size == 8
    fails_with(
        capsys, lambda: train.parse_args(["--save_steps", "-1"]), "--save_steps must be 0 (off) or more"
    )
    assert train.parse_args(["--eval_steps", "0", "--log_steps", "0", "--save_steps", "0"]).save_steps == 0
    # argparse's own errors too: one line, not the usage of every flag above it
    with pytest.raises(SystemExit) as stopped:
        train.parse_args(["--batch_size", "eight"])
    assert str(stopped.value) == "train.py: error: argument --batch_size: invalid int value: 'eight'"
    assert capsys.readouterr().err == ""


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for flag, default in (("save_steps", 500), ("eval_steps", 100), ("batch_size", 128), ("lr", 0.0002)):
        help_text = shown.split(f"--{flag} {flag.upper()} ")[1].split(" --")[0]
        assert help_text.endswith(f"(default: {default})")
    assert "default: 32, or --batch_size if smaller" in shown
    formatter = train.HelpFormatter("train.py")
    undocumented = [a.dest for a in train.parser._actions if "default" not in formatter._get_help_string(a)]
    assert undocumented == ["help"]


def test_the_default_chunk_is_never_larger_than_the_batch(capsys):
    assert train.parse_args(["--model", "m", "--batch_size", "16"]).chunk_size == 16
    assert train.parse_args(["--model", "m", "--batch_size", "64"]).chunk_size == 32
    fails_with(
        capsys,
        lambda: train.parse_args(["--model", "m", "--batch_size", "16", "--chunk_size", "32"]),
        "--chunk_size 32 is larger than --batch_size 16",
    )


def test_an_anchor_without_negatives_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"anchor": f"a{i}", "positive": f"p{i}"} for i in range(4)])
    empty = tmp_path / "empty"  # a folder, but no model: a missing one would stop main before the data
    empty.mkdir()
    run = ("--model", empty, "--output_dir", tmp_path / "run", "--batch_size", 1)
    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--data", pairs),
        f"--batch_size 1 on the pairs of {pairs}, without hard negatives, leaves each anchor no negative",
        "Raise --batch_size or add hard negatives.",
    )
    # One hard negative, or a second pair in the batch, is one negative: on to the model, which is none.
    triples = write_rows(tmp_path / "triples.jsonl", [{"anchor": "a", "positive": "p", "negative": "n"}])
    fails_with(capsys, lambda: run_main(monkeypatch, *run, "--data", triples), "not a model folder")
    fails_with(
        capsys, lambda: run_main(monkeypatch, *run, "--data", pairs, "--batch_size", 2), "not a model folder"
    )


def test_a_clipping_variable_other_than_max_grad_norm_is_refused(tmp_path, monkeypatch):
    """DeepSpeed clips by ACCELERATE_GRADIENT_CLIPPING (accelerate launch --gradient_clipping sets it, a shell
    may hold it from another job): a value other than --max_grad_norm's would clip otherwise, silently."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    args = train.parse_args(["--model", "m", "--max_grad_norm", "0", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="ACCELERATE_GRADIENT_CLIPPING=1.0 .* but --max_grad_norm 0.0"):
        train.main(args)


def test_max_grad_norm_and_max_bad_steps_are_validated(capsys):
    fails_with(
        capsys, lambda: train.parse_args(["--max_grad_norm", "-1"]), "--max_grad_norm must be 0 (no clipping)"
    )
    assert train.parse_args(["--max_grad_norm", "0"]).max_grad_norm == 0
    # 0 stopped the run after a good first step, calling it the last of 0 bad steps in a row
    fails_with(capsys, lambda: train.parse_args(["--max_bad_steps", "0"]), "must be at least 1", "default 5")
    assert train.parse_args(["--max_bad_steps", "1"]).max_bad_steps == 1


@pytest.mark.parametrize(
    "line, fragments",
    [
        # truncated: the error is one past its 48 characters (column 49), not at the next line's column 1
        ('{"anchor": "a", "positive": "b", "negative": "c"', ["line 2 is not valid JSON (column 49: "]),
        ('{"anchor": "a", "answer": "b", "negative": "c"}', ["line 2", "no field 'positive'", "--columns"]),
        (
            '{"anchor": "a", "positive": "  ", "negative": "c"}',
            ["line 2 has field 'positive' empty", "--skip_bad_records"],
        ),
        (
            '{"anchor": "a", "positive": 7, "negative": "c"}',
            ["line 2 has field 'positive' = int 7, not a text"],
        ),
        ('["a", "b", "c"]', ["line 2 is a JSON list"]),
    ],
)
def test_json_lines_errors_name_the_line(tmp_path, capsys, line, fragments):
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as file:  # gzipped, as the bundled data
        file.write('{"anchor": "x", "positive": "y", "negative": "z"}\n' + line + "\n")
    fails_with(capsys, lambda: pairs.load_pairs(str(path)), str(path), *fragments)


def test_a_json_file_is_an_array_of_records_or_json_lines(tmp_path, capsys):
    rows = [{"anchor": f"a{i}", "positive": f"p{i}", "negative": f"n{i}"} for i in range(3)]
    (tmp_path / "array.json").write_text(
        json.dumps(rows, indent=2)
    )  # read as JSON lines, it failed on line 1
    write_rows(tmp_path / "lines.json", rows)
    with gzip.open(tmp_path / "array.json.gz", "wt") as file:
        json.dump(rows, file)
    for name in ("array.json", "lines.json", "array.json.gz"):
        loaded, _ = pairs.load_pairs(str(tmp_path / name))
        assert loaded.to_list() == [
            {"anchor": r["anchor"], "positive": r["positive"], "negative_1": r["negative"]} for r in rows
        ]

    # An array is checked record by record, as JSON lines are line by line.
    bad = [rows[0], {**rows[1], "positive": " "}, ["a2", "p2"]]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    load_bad = functools.partial(pairs.load_pairs, str(tmp_path / "bad.json"))
    fails_with(capsys, load_bad, "bad.json, record 2 has field 'positive' empty", "--skip_bad_records")
    loaded, skipped = load_bad(skip_bad_records=True)
    assert len(loaded) == 1 and skipped == 2
    assert "record 2 has field 'positive' empty" in capsys.readouterr().out

    # Any other shape: what a .json file should hold
    (tmp_path / "object.json").write_text(json.dumps({"data": rows}, indent=2))
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "object.json")),
        "holds one JSON dict over several lines",
        "JSON array of records",
        "JSON lines",
    )
    (tmp_path / "broken.json").write_text(json.dumps(rows, indent=2)[:-2])
    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "broken.json")),
        "broken.json is not valid JSON (",
        "JSON array of records",
    )


def test_csv_and_parquet_load_with_a_column_mapping(tmp_path, capsys):
    import pandas

    table = pandas.DataFrame(
        {"question": ["q1", "q2"], "answer": ["1990", "a2"], "n1": ["x", "y"], "n2": ["u", "v"]}
    )
    columns = "anchor=question,positive=answer,negatives=n1+n2"
    table.to_csv(tmp_path / "pairs.csv", index=False)
    table.to_parquet(tmp_path / "pairs.parquet")
    for name in ("pairs.csv", "pairs.parquet"):
        loaded, skipped = pairs.load_pairs(str(tmp_path / name), columns)
        assert skipped == 0
        assert loaded.column_names == ["anchor", "positive", "negative_1", "negative_2"]
        assert loaded[0] == {"anchor": "q1", "positive": "1990", "negative_1": "x", "negative_2": "u"}

    fails_with(
        capsys,
        lambda: pairs.load_pairs(str(tmp_path / "pairs.csv")),
        "no field 'anchor' (anchor), 'positive' (positive)",
        "'answer'",
        "--columns",
    )
    table.loc[1, "n2"] = None
    table.to_csv(tmp_path / "gap.csv", index=False)
    fails_with(
        capsys, lambda: pairs.load_pairs(str(tmp_path / "gap.csv"), columns), "record 2 has field 'n2' empty"
    )
    fails_with(
        capsys, lambda: pairs.load_pairs(str(tmp_path / "missing.csv"), columns), "no such file or folder"
    )


def test_csv_fields_are_texts_as_written(tmp_path):
    """Read as text, not parsed: pandas made "007" 7, "1e3" 1000.0 and "NA" an empty field."""
    (tmp_path / "numeric.csv").write_text("anchor,positive\n007,1e3\n42,2.50\n")
    loaded, _ = pairs.load_pairs(str(tmp_path / "numeric.csv"))
    assert loaded.to_dict() == {"anchor": ["007", "42"], "positive": ["1e3", "2.50"]}
    (tmp_path / "missing.csv").write_text("anchor,positive,negative\nNA,null,n/a\n")
    loaded, _ = pairs.load_pairs(str(tmp_path / "missing.csv"))
    assert loaded[0] == {"anchor": "NA", "positive": "null", "negative_1": "n/a"}


def test_model_and_checkpoint_errors(tmp_path, capsys, monkeypatch):
    """The checkpoint to resume from is found before anything is loaded: main stops there, or (none found) at
    the data file, which does not exist here."""
    fails_with(
        capsys, lambda: models.load_model(str(tmp_path / "nowhere"), "cpu"), "--model: no such file or folder"
    )
    run = ("--model", "m", "--data", tmp_path / "missing.jsonl", "--output_dir", tmp_path)
    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--resume_from_checkpoint", tmp_path),
        "not a complete checkpoint",
        "'latest'",
    )
    # Each written with another seed, so that main names the one it would resume from.
    state = {"processes": 1, "args": vars(train.parse_args(list(map(str, run)))) | {"seed": 7}}
    for name in ("step_2", "step_10", "step_12.partial"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "trainer_state.json").write_text(json.dumps(state))
    fails_with(
        capsys,
        lambda: run_main(monkeypatch, *run, "--resume_from_checkpoint", "latest"),
        f"{tmp_path / 'checkpoints' / 'step_10'} was written with --seed 7",
    )
    empty = ("--output_dir", tmp_path / "empty", "--resume_from_checkpoint", "latest")
    with pytest.raises(SystemExit, match="--data: no such file or folder: .*missing.jsonl"):
        run_main(monkeypatch, *run, *empty)
    none_found = f"no complete checkpoint in {tmp_path / 'empty' / 'checkpoints'}: starting from scratch"
    assert none_found in capsys.readouterr().out


def test_a_second_run_into_the_same_folder_is_refused_unless_overwrite(
    tmp_path, data, model_without_dropout, monkeypatch
):
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", "", "--batch_size", 8)
    common += ("--chunk_size", 4, "--max_steps", 1, "--wandb_mode", "disabled")
    common += ("--output_dir", tmp_path)
    run_main(monkeypatch, *common)  # in this process: launches cost the suite its time
    first = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert tmp_path / "final" / "model.safetensors" in first

    with pytest.raises(SystemExit) as refused:
        run_main(monkeypatch, *common, "--lr", 1e-3)
    refusal = f"{tmp_path} holds a previous run (final/ and checkpoints/). Continue it with"
    assert refusal in str(refused.value) and "--resume_from_checkpoint" in str(refused.value)
    assert "--overwrite" in str(refused.value)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == first

    before = weights(tmp_path / "final")
    run_main(monkeypatch, *common, "--lr", 1e-3, "--overwrite")
    assert max_difference(weights(tmp_path / "final"), before) > 0  # the second run's model


def test_default_run_names_go_under_runs():
    args = train.parse_args(["--data", "somewhere/pairs.csv"])
    assert args.run_name.startswith("all-MiniLM-L6-v2-pairs-") and args.named_by_default
    assert args.output_dir == str(Path("runs") / args.run_name)
    assert train.parse_args(["--model", "m", "--run_name", "mine"]).output_dir == str(Path("runs") / "mine")


# ---------------------------------------------------------------------------------------------------------
# Batches and evaluation set
# ---------------------------------------------------------------------------------------------------------


def test_batches_hold_no_duplicate_texts_and_follow_seed_and_epoch():
    import datasets

    rng = random.Random(1)  # positives and negatives drawn from one small pool: random batches would repeat
    documents = [rng.sample(range(30), 2) for _ in range(64)]
    rows = {
        "anchor": [f"q{rng.randrange(40)}" for _ in range(64)],
        "positive": [f"d{positive}" for positive, _ in documents],
        "negative_1": [f"d{negative}" for _, negative in documents],
    }
    dataset = datasets.Dataset.from_dict(rows)

    def epoch_batches(seed, epoch):
        loader = sharded_loader(dataset, "--batch_size", 4, "--chunk_size", 2, "--seed", seed)
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader)
        return batches

    for batch in epoch_batches(0, 0) + epoch_batches(0, 1):
        texts = [text for column in batch.values() for text in column]
        assert len(texts) == len(set(texts))
    assert epoch_batches(0, 1) == epoch_batches(0, 1)
    assert epoch_batches(0, 1) != epoch_batches(0, 0) != epoch_batches(1, 0)


def test_cross_process_negatives_keep_the_global_batch_free_of_duplicates():
    """The loader as train.py builds it and accelerate shards it over 4 processes: with
    --cross_process_negatives the contrastive batch of a step is the 4 local batches together, which must
    hold no text twice (each process's own batch did not, their union did). Skipping batches, as a resumed
    run does, replays the same order."""
    import datasets
    from accelerate.data_loader import skip_first_batches

    rng = random.Random(3)  # texts from small pools: batches drawn blindly would repeat some
    documents = [rng.sample(range(150), 2) for _ in range(96)]
    dataset = datasets.Dataset.from_dict(
        {
            "anchor": [f"q{rng.randrange(300)}" for _ in range(96)],
            "positive": [f"d{positive}" for positive, _ in documents],
            "negative_1": [f"d{negative}" for _, negative in documents],
        }
    )
    processes = 4

    def steps(cross_process_negatives, epoch):
        """Each step's batches, one per process, and process 1's batches from its third on, as resumed."""
        flags = ("--batch_size", 4, "--chunk_size", 2) + (
            ("--cross_process_negatives",) * cross_process_negatives
        )
        loaders = [
            sharded_loader(dataset, *flags, processes=processes, process_index=i) for i in range(processes)
        ]
        for loader in loaders:
            loader.set_epoch(epoch)
        local = [list(loader) for loader in loaders]
        loaders[1].set_epoch(epoch)
        assert list(skip_first_batches(loaders[1], 2)) == local[1][2:]
        return list(zip(*local, strict=True))

    def repeated_texts(batches):
        texts = [text for batch in batches for column in batch.values() for text in column]
        return len(texts) - len(set(texts))

    for epoch in (0, 1):
        together = steps(True, epoch)
        assert len(together) == 6  # 96 examples, 16 a step
        assert all(repeated_texts(step) == 0 for step in together)
        assert together == steps(True, epoch)  # seeded
        alone = steps(False, epoch)  # the control: each batch distinct, not the union
        assert all(repeated_texts([batch]) == 0 for step in alone for batch in step)
        assert sum(repeated_texts(step) for step in alone) > 0


def test_resuming_with_cross_process_negatives_toggled_is_refused(tmp_path, monkeypatch):
    flags = ["--model", "m", "--data", "x.jsonl", "--cross_process_negatives"]
    state = {"processes": 2, "args": vars(train.parse_args(flags)) | {"cross_process_negatives": False}}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    changed = (
        r"--cross_process_negatives False \(this launch: True\), 2 processes \(this launch: 1\): the data"
    )
    with pytest.raises(SystemExit, match=changed):
        run_main(monkeypatch, *flags, "--output_dir", tmp_path / "run", "--resume_from_checkpoint", tmp_path)


def test_resuming_with_another_model_or_adapter_is_refused_in_one_line(tmp_path, monkeypatch):
    """load_state failed on the weights with a state_dict traceback of 89 lines."""
    flags = ["--model", "m", "--data", "x.jsonl", "--lora_r", "8"]
    saved = {"model": "other", "pooling": "cls", "lora_r": 0}
    state = {"processes": 1, "args": vars(train.parse_args(flags)) | saved}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, *flags, "--output_dir", tmp_path / "run", "--resume_from_checkpoint", tmp_path)
    assert str(stopped.value) == (
        f"train.py: error: {tmp_path} was written with --model other (this launch: m), --pooling cls (this "
        "launch: None), --lora_r 0 (this launch: 8): its weights are not this model's. Launch with the "
        "checkpoint's values, or start a new --output_dir."
    )


def test_evaluator_retrieves_each_query_positive_among_distinct_positives():
    import datasets

    dev = datasets.Dataset.from_dict({"anchor": ["q0", "q1", "q2"], "positive": ["p", "p", "r"]})
    evaluator = pairs.build_evaluator(dev, num_queries=2)
    assert evaluator.queries == ["q0", "q1"]
    assert sorted(evaluator.corpus) == ["p", "r"]
    assert evaluator.relevant_docs == {"q0": {"d0"}, "q1": {"d0"}}


def test_dev_corpus_size_keeps_the_relevant_documents_and_seeded_others():
    """--dev_corpus_size N: the evaluated queries' relevant documents and N others drawn by --seed, in the
    corpus's order; the start line says how many of the corpus's."""
    dev = {"anchor": [f"q{i}" for i in range(40)], "positive": [f"p{i}" for i in range(40)]}
    lines = []
    evaluator = pairs.build_evaluator(dev, 5, corpus_size=10, seed=1, say=lines.append)
    assert lines == ["train.py: dev set: 5 queries against 15 documents (5 relevant + 10 drawn of 40)"]
    assert {"p0", "p1", "p2", "p3", "p4"} <= set(evaluator.corpus) and len(evaluator.corpus) == 15
    assert evaluator.corpus_ids == sorted(evaluator.corpus_ids, key=lambda doc_id: int(doc_id[1:]))
    again, other_seed = (pairs.build_evaluator(dev, 5, corpus_size=10, seed=s, say=len) for s in (1, 2))
    assert again.corpus_ids == evaluator.corpus_ids != other_seed.corpus_ids
    for whole in (0, 35, 100):  # 0, or as many others as there are: the whole corpus
        assert len(pairs.build_evaluator(dev, 5, corpus_size=whole, say=lines.append).corpus) == 40
    assert lines[-1] == "train.py: dev set: 5 queries against 40 documents (all of 40)"


COUNTING_SITECUSTOMIZE = """import os

if "RANK" in os.environ:  # written by tests/test_train.py: the launched processes, not the launcher
    from sentence_transformers import SentenceTransformer

    def counting(name, encode):
        def counted(self, inputs, *args, **kwargs):
            with open(os.path.join({folder!r}, os.environ["RANK"]), "a") as counts:
                counts.write(f"{{name}}:{{len(inputs)}}\\n")
            return encode(self, inputs, *args, **kwargs)

        return counted

    for name in ("encode_query", "encode_document"):
        setattr(SentenceTransformer, name, counting(name, getattr(SentenceTransformer, name)))
"""


def test_the_processes_share_the_dev_corpus_and_log_the_one_process_metrics(
    tmp_path, data, model_without_dropout, monkeypatch
):
    """The dev queries and corpus are encoded once per evaluation, half of them on each of two processes, and
    gathered: the metrics logged are those of sentence-transformers' evaluator built from the raw dev file
    (references.retrieval_evaluator), exactly on one process, within a float tolerance on two (other
    batches). The evaluation's time per process count is
    printed (bench/eval_time.py times the default model and dev set)."""
    from sentence_transformers import SentenceTransformer

    rng = random.Random(1)
    words = [rng.sample(WORDS, 2) for _ in range(55)]
    rows = [{"anchor": f"{a} a{i}", "positive": f"{p} p{i}"} for i, (a, p) in enumerate(words)]
    dev = write_rows(tmp_path / "dev.jsonl", rows)  # 55 texts: 28, and 27 + 1 repeat, on two processes
    common = ("--model", model_without_dropout, "--data", data[0], "--dev_data", dev, "--max_steps", 1)
    common += ("--batch_size", 8, "--save_steps", 0, "--wandb_mode", "disabled")
    counts = tmp_path / "counts"
    site = tmp_path / "site"
    counts.mkdir(), site.mkdir()
    (site / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE.format(folder=str(counts)))
    environment = {"ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(site)}
    launch(CONFIGS / "cpu_ddp_2proc.yaml", tmp_path / "two", *common, processes=2, env=environment)
    shares = ["encode_query:28", "encode_document:28"] * 2  # 55 queries, 55 documents; 2 evaluations
    assert {rank: (counts / rank).read_text().split() for rank in "01"} == {rank: shares for rank in "01"}
    run_main(monkeypatch, *common, "--output_dir", tmp_path / "one")

    expected = retrieval_evaluator(dev)(SentenceTransformer(str(model_without_dropout), device="cpu"))
    one, two = (logged_scalars(tmp_path / name) for name in ("one", "two"))
    for name, value in expected.items():  # step 0: before training, the same model
        assert one[f"eval/{name}"][0] == (0, float(numpy.float32(value))), name  # TensorBoard's float32
        assert two[f"eval/{name}"][0] == (0, pytest.approx(value, abs=1e-6)), name
    for processes, logged in ((1, one), (2, two)):
        print(f"evaluation, {processes} process(es): {logged['eval/seconds'][0][1]:.2f} s")
