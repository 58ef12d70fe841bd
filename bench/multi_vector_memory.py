"""Benchmark 10: peak memory of a multi-vector (ColBERT) training step, split into the batch's cached token
matrices, their gradients and the rest, beside sentence-transformers' cached multi-vector loss.

The model: a small random ColBERT built here, a BERT (--hidden_size, --num_layers) over all-MiniLM-L6-v2's
WordPiece tokenizer, saved as a MultiVectorEncoder with the modules a bare transformers folder gets
(Dense to 128 dimensions, MultiVectorMask, Normalize). The batch: an anchor (query) column, a positive and
--hard_negatives hard-negative (document) columns, of random single-token vocabulary words, every query
--query_tokens tokens long and every document --document_tokens ([CLS] and [SEP] counted); the claim is
about memory, not what is learnt.
Two ways to compute one training step (AdamW included), chunks of --chunk_size texts:

    ours  train.gradient_cache_step as train.py's loop calls it: the model loaded and prepared by train.py,
          Towers, the loss train.loss_function gives it (multi_vector.maxsim_loss, scale 1, repeated texts
          masked), each chunk tokenized as it is encoded. gradcache keeps each chunk's token matrices with
          the scoring mask as a last channel (gradcache.TokenMatrices): texts x tokens x 129 fp32;
    st    sentence-transformers' CachedMultiVectorMultipleNegativesRankingLoss (mini_batch_size = the
          chunk), driven as its trainer does: `loss(features)` then `.backward()`, the batch tokenized
          beforehand.

Each point runs in a fresh process (unless --one_process: the smoke's) and reads, as bench/memory.py does,
the peak above the state just before the step (a warm-up step at batch 8 has run): on CPU the resident
set's high-water mark (glibc's mmap threshold fixed, so that freed tensors leave it), on CUDA
max_memory_allocated; stage 2 (the loss over the whole batch and the gradients of its token matrices) is
read apart from the chunks of stages 1 and 3, and in ours its check of the token matrices' gradients
(their norm, all finite: gradcache.stage_two_report) apart from the loss. The token matrices are the bytes
of what the loss receives (for st its embeddings and masks); their gradients are as large; the rest is the
step's peak less both. st runs under --cap_gib and stops at the first batch that does not fit; the
comparison is at the largest batch it fits.

    python bench/multi_vector_memory.py                             # CPU: batches 1,024 and 4,096, ~45 min
    python bench/multi_vector_memory.py --device cuda --preset gpu  # one GPU: batches 1,024 and 4,096
    python bench/multi_vector_memory.py --preset smoke              # seconds: the test suite runs this

Writes bench/results/multi_vector_memory_<preset>.{json,md,png}.
"""

import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import unittest.mock
from pathlib import Path

import harness
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = ("ours", "st")
METHOD_LABELS = {
    "ours": "this project (train.gradient_cache_step)",
    "st": "sentence-transformers CachedMultiVectorMNRL",
}
WARMUP_BATCH = 8
PHASES = ("loss", "report", "chunks")  # Stages' readings, as the table shows them
# The CPU's time goes to stage 2, every query's MaxSim against every document of the batch (16 x 180 token
# pairs each), which grows with the square of the batch: on 2 cores a step at 4,096 takes about 20 minutes,
# so the CPU's pairs have no hard negatives (a column of them doubles the documents).
PRESETS = {
    "cpu": {"batch_sizes": [1024, 4096], "hard_negatives": 0, "query_tokens": 16, "document_tokens": 180,
            "chunk_size": 32, "hidden_size": 128, "num_layers": 2, "cap_gib": 16.0, "one_process": False},
    "gpu": {"batch_sizes": [1024, 4096], "hard_negatives": 1, "query_tokens": 16, "document_tokens": 180,
            "chunk_size": 32, "hidden_size": 128, "num_layers": 2, "cap_gib": None, "one_process": False},
    # the test suite's: every point in this process (train.py's imports take seconds in each new one), so
    # no cap, which would stay for the points after it
    "smoke": {"batch_sizes": [4, 16], "hard_negatives": 1, "query_tokens": 6, "document_tokens": 20,
              "chunk_size": 4, "hidden_size": 32, "num_layers": 1, "cap_gib": None, "one_process": True},
}  # fmt: skip

parser = harness.benchmark_parser(__doc__, PRESETS)
parser.add_argument("--batch_sizes", type=int, nargs="+", help="override the preset's batch sizes")
parser.add_argument("--hard_negatives", type=int, help="hard-negative document columns besides the positive")
parser.add_argument("--query_tokens", type=int, help="tokens of every query, [CLS] and [SEP] counted")
parser.add_argument("--document_tokens", type=int, help="tokens of every document, [CLS] and [SEP] counted")
parser.add_argument("--chunk_size", type=int, help="texts per chunk, for both methods")
parser.add_argument("--hidden_size", type=int, help="the random BERT's width")
parser.add_argument("--num_layers", type=int, help="the random BERT's layers")
parser.add_argument("--cap_gib", type=float, help="memory a step of st may use above its baseline")
parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
parser.add_argument("--one_process", action="store_true", default=None, help="every point in this process")


def build_colbert(folder, hidden_size, num_layers):
    """A random BERT with MiniLM's tokenizer, saved as the MultiVectorEncoder a bare transformers folder loads
    as (sentence-transformers adds Dense to 128, MultiVectorMask and Normalize)."""
    from sentence_transformers import MultiVectorEncoder
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(harness.model_path())
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=2, intermediate_size=4 * hidden_size,
    )  # fmt: skip
    BertModel(config).save_pretrained(Path(folder) / "bert")
    tokenizer.save_pretrained(Path(folder) / "bert")
    torch.manual_seed(1)  # the projection's weights
    MultiVectorEncoder(str(Path(folder) / "bert"), device="cpu").save(str(Path(folder) / "model"))
    return Path(folder) / "model"


def random_texts(tokenizer, num_rows, hard_negatives, query_tokens, document_tokens, seed=0):
    """{column: texts}, the anchors (queries), the positives and `hard_negatives` columns of documents: words
    of the vocabulary that are one token each, so that every query is query_tokens long and every document
    document_tokens, [CLS] and [SEP] counted."""
    words = [w for w in tokenizer.vocab if w.isascii() and w.isalpha() and len(w) > 2]
    words = sorted(w for w in words if tokenizer.tokenize(w) == [w])
    draw = random.Random(seed)
    negatives = [f"negative_{k}" for k in range(1, hard_negatives + 1)]
    lengths = {"anchor": query_tokens, "positive": document_tokens} | dict.fromkeys(
        negatives, document_tokens
    )
    return {
        column: [" ".join(draw.choices(words, k=length - 2)) for _ in range(num_rows)]
        for column, length in lengths.items()
    }


class Stages:
    """The step's peak per stage (harness.PeakMeter: "loss", stage 2, apart from "chunks", stages 1 and 3;
    ours_step adds "report"), stage 2's seconds, and the shapes and bytes of the token matrices stage 2
    receives."""

    def __init__(self, device):
        self.meter = harness.PeakMeter(device, "chunks")
        self.loss_seconds, self.token_matrix_bytes, self.widths = 0.0, 0, {}

    def loss_begins(self, columns):
        """columns: one list of (rows x tokens [x channels]) tensors per column, all that the loss holds."""
        self.token_matrix_bytes = sum(t.numel() * t.element_size() for column in columns for t in column)
        self.widths = {
            "query": max(t.shape[1] for t in columns[0]),
            "document": max(t.shape[1] for column in columns[1:] for t in column),
            "channels": columns[0][0].shape[-1],
        }
        self.meter.switch("loss")
        self.started = time.perf_counter()

    def loss_ends(self):
        if self.meter.phase == "loss":
            self.loss_seconds = time.perf_counter() - self.started
            self.meter.switch("chunks")


def ours_step(folder, device, chunk_size):
    """step(batch, stages) -> loss: one batch ({column: texts}) through train.gradient_cache_step, as train.py
    runs it, then AdamW; and the model."""
    from accelerate import Accelerator

    import gradcache
    import train
    from train_parts import fsdp, models
    from train_parts.common import flags_of

    args = train.parse_args(
        ["--model", str(folder), "--data", "unused.jsonl", "--chunk_size", str(chunk_size)]
    )
    (source,) = train.source_settings(args)
    accelerator = Accelerator(cpu=torch.device(device).type == "cpu")
    model = models.prepare_model(
        models.load_model(args.model, accelerator.device, say=lambda *_: None),
        flags_of(models.ModelFlags, args),
    )
    prompts = models.role_prompts(model, source.query_prompt, source.document_prompt)
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    engine, optimizer = fsdp.prepare(accelerator, models.training_module(model, [source]), adamw)
    engine.train()
    loss_fn = train.loss_function(source, model)
    backward, stage_two_report = accelerator.backward, gradcache.stage_two_report

    def step(batch, stages):
        @functools.wraps(loss_fn)  # its signature: train.py binds the side data the loss declares
        def metered_loss(*columns, **side_data):
            stages.loss_begins([column.blocks for column in columns])
            return loss_fn(*columns, **side_data)

        def metered_report(*arguments):  # stage 2's check of the gradients (their norm, all finite), apart
            stages.meter.switch("report")
            report = stage_two_report(*arguments)
            stages.meter.switch("loss")
            return report

        def metered_backward(surrogate):  # stage 3's first backward ends stage 2
            stages.loss_ends()
            backward(surrogate)

        # train.gradient_cache_step hands gradcache accelerator.backward
        accelerator.backward = metered_backward
        with unittest.mock.patch.object(gradcache, "stage_two_report", metered_report):
            report = train.gradient_cache_step(
                accelerator, engine, model, prompts, metered_loss, source, batch, {"chunk_size": chunk_size}
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return report.loss

    return step, model


def st_step(folder, device, chunk_size):
    """step(batch, stages) -> loss: sentence-transformers' cached multi-vector loss on the batch tokenized
    per column (its collator's tasks), `.backward()`, then AdamW; and the model."""
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
    )
    from sentence_transformers.util import batch_to_device

    from train_parts import models

    model = MultiVectorEncoder(str(folder), device=device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)

    class MeteredLoss(CachedMultiVectorMultipleNegativesRankingLoss):
        def calculate_loss_and_cache_gradients(self, reps, masks_chunks):
            self.stages.loss_begins([[*r, *m] for r, m in zip(reps, masks_chunks, strict=True)])
            try:
                return super().calculate_loss_and_cache_gradients(reps, masks_chunks)
            finally:
                self.stages.loss_ends()

    cached_loss = MeteredLoss(model, mini_batch_size=chunk_size)
    no_prompts = {"query": None, "document": None}

    def step(batch, stages):
        cached_loss.stages = stages
        features = [models.tokenize(model, texts, column, no_prompts) for column, texts in batch.items()]
        features = [batch_to_device(column, model.device) for column in features]
        loss = cached_loss(features)
        loss.backward()  # stage 3: the chunks encoded again in its backward hook
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model


def measure_point(method, folder, batch_size, device, chunk_size, texts_shape, cap_bytes=None):
    """One training step of `method` at `batch_size` (texts_shape: random_texts' keywords), its peak above
    the state before it, split."""
    from transformers import AutoTokenizer

    make_step = {"ours": ours_step, "st": st_step}[method]
    step, model = make_step(folder, device, chunk_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = random_texts(tokenizer, batch_size + WARMUP_BATCH, **texts_shape)
    batch = {column: rows[:batch_size] for column, rows in texts.items()}
    step({column: rows[batch_size:] for column, rows in texts.items()}, Stages(device))  # lazy inits, AdamW
    harness.synchronize(device)
    stages = Stages(device)
    if cap_bytes is not None:
        harness.cap_process_memory(device, cap_bytes)
    # and the CPU time: on a shared machine the wall time follows the others' load, which varies
    load_average, started, cpu_started = os.getloadavg()[0], time.perf_counter(), time.process_time()
    try:
        step(batch, stages)
        fits = True
    except Exception as error:  # only running out of memory is an answer; anything else is a bug
        if not harness.is_out_of_memory(error):
            raise
        fits = False
    harness.synchronize(device)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    stages.meter.switch("done")
    peak = max(stages.meter.peaks.values())
    return {
        "method": method,
        "batch_size": batch_size,
        "fits": fits,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # of every thread of the process
        "load_average": load_average,  # the machine's, at the step's start
        "loss_seconds": stages.loss_seconds,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "baseline_bytes": stages.meter.baseline,
        "step_peak_bytes": peak,
        # chunks: stages 1 and 3; loss: stage 2; report (ours): stage 2's check of the gradients
        "phase_peak_bytes": stages.meter.peaks,
        "phase_added_bytes": stages.meter.added,  # each phase above what the step held at its start
        "token_matrix_bytes": stages.token_matrix_bytes,
        "token_matrix_gradient_bytes": stages.token_matrix_bytes,  # one gradient per value, as large
        "rest_bytes": peak - 2 * stages.token_matrix_bytes,
        "widths": stages.widths,  # tokens of the longest query and document, channels a token
    }


def measure_in_fresh_process(**kwargs):
    """measure_point in a new Python process (CPU: nothing of earlier points stays resident), under glibc's
    fixed mmap threshold (harness.MALLOC_ENV). A process that dies under a cap counts as not fitting."""
    env = {**os.environ, **harness.MALLOC_ENV}
    command = [sys.executable, __file__, "worker", json.dumps(kwargs)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if kwargs.get("cap_bytes") is None:
        raise RuntimeError(f"measuring {kwargs} failed:\n{done.stderr[-4000:]}")
    return {**kwargs, "fits": False, "died": done.stderr.strip().splitlines()[-1:]}


def measure(args):
    """Every (method, batch) point, the model built once, each in a fresh process unless --one_process; st
    stops at the first batch that does not fit."""
    cap_bytes = None if args.cap_gib is None else int(args.cap_gib * 2**30)
    texts_shape = {
        name: getattr(args, name) for name in ("hard_negatives", "query_tokens", "document_tokens")
    }
    points = []
    with tempfile.TemporaryDirectory() as folder:
        model = build_colbert(folder, args.hidden_size, args.num_layers)
        for method in args.methods:
            for batch_size in args.batch_sizes:
                measured = measure_point if args.one_process else measure_in_fresh_process
                point = measured(
                    method=method, folder=str(model), batch_size=batch_size, device=args.device,
                    chunk_size=args.chunk_size, texts_shape=texts_shape,
                    cap_bytes=cap_bytes if method == "st" else None,
                )  # fmt: skip
                points.append(point)
                shown = f"{harness.mib(point['step_peak_bytes'])} MiB" if point["fits"] else "did not fit"
                print(f"{method:>4} batch {batch_size:>5}: {shown}", flush=True)
                if not point["fits"]:
                    break
    return points


def table(points, args):
    header = [
        "method", "batch", "tokens: query / document", "step peak (MiB)", "token matrices (MiB)",
        "their gradients (MiB)", "the rest (MiB)",
        "peak of stage 2's loss / of its check of the gradients / of the chunks (MiB)", "stage 2 (s)",
        "step (s)", "step, CPU time (s)", "load average at its start",
    ]  # fmt: skip
    rows = []
    for point in points:
        label = METHOD_LABELS[point["method"]]
        if not point["fits"]:
            cap = "device memory" if args.cap_gib is None else f"{harness.mib(args.cap_gib * 2**30)} MiB"
            rows.append([label, point["batch_size"], "-", f"did not fit in {cap}", *["-"] * 8])
            continue
        peaks = point["phase_peak_bytes"]
        rows.append([
            label, point["batch_size"], f"{point['widths']['query']} / {point['widths']['document']}",
            harness.mib(point["step_peak_bytes"]), harness.mib(point["token_matrix_bytes"]),
            harness.mib(point["token_matrix_gradient_bytes"]), harness.mib(point["rest_bytes"]),
            " / ".join(harness.mib(peaks[phase]) if phase in peaks else "-" for phase in PHASES),
            f"{point['loss_seconds']:.0f}", f"{point['seconds']:.0f}", f"{point['cpu_seconds']:.0f}",
            f"{point['load_average']:.1f}",
        ])  # fmt: skip
    where = "every point in this one process" if args.one_process else "each point in a fresh process"
    intro = (
        f"A random ColBERT (BERT, hidden size {args.hidden_size}, {args.num_layers} layer(s), MiniLM's "
        f"tokenizer, 128 dimensions a token), queries of {args.query_tokens} tokens, documents of "
        f"{args.document_tokens} (a query, its positive and {args.hard_negatives} hard negative(s) a row), "
        f"chunks of {args.chunk_size} texts. One training step (AdamW included) above the process just "
        f"before it, {where}. The token matrices: what stage 2 receives (ours: fp32 with the scoring mask as "
        "a last channel; st: its fp32 embeddings and boolean masks); their gradients as large; the rest: the "
        "peak less both. A chunk of ours is one chunk of every column in one forward (train.py's Towers, for "
        "a multi-vector model), of st one column's chunk."
    )
    return intro + "\n\n" + harness.markdown_table(header, rows)


def plot(points, args, path):
    """Per method (line style): the step's peak, the rest, the token matrices and their gradients."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    readings = (
        ("step peak", "tab:blue", lambda p: p["step_peak_bytes"]),
        ("the rest", "tab:orange", lambda p: p["rest_bytes"]),
        ("token matrices and gradients", "tab:green", lambda p: 2 * p["token_matrix_bytes"]),
    )
    for method, style in (("ours", "o-"), ("st", "s--")):
        fitting = [p for p in points if p["method"] == method and p["fits"]]
        for what, color, read in readings if fitting else ():
            megabytes = [max(read(p), 1) / 2**20 for p in fitting]
            label = f"{METHOD_LABELS[method]}: {what}"
            axes.plot([p["batch_size"] for p in fitting], megabytes, style, color=color, label=label)
    harness.log_axes(
        axes,
        ylabel="MiB above the process before the step",
        title=f"Multi-vector step, documents of {args.document_tokens} tokens ({args.device})",
        xlabel=f"batch size (examples; a query and {1 + args.hard_negatives} document(s) each)",
    )
    harness.save_figure(figure, path)


def main(argv=None):
    harness.run_benchmark(
        "multi_vector_memory", parser, PRESETS, measure, table, plot, "multi-vector step memory", argv
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:  # a point of measure_in_fresh_process: its keyword arguments as JSON
        print(json.dumps(measure_point(**json.loads(sys.argv[2]))))
    else:
        main()
