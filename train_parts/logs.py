"""What a run shows: the trackers (TensorBoard, wandb), the training metrics of each log window, the progress
line, the warnings, and the evaluation on the dev set.

Flags served: --wandb_mode, --wandb_project, --log_steps (the window), --warn_masked_fraction; the numbers
in a loss's `stats` are logged as train/<name> with no list to edit.
"""

import contextlib
import dataclasses
import functools
import math
import netrc
import os
import resource
import sys
import time
import urllib.parse
import warnings
from pathlib import Path

import psutil
import torch
import yaml
from accelerate.utils import broadcast_object_list, is_wandb_available
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

from .common import fail, unreachable
from .models import gathered_parameters
from .multi_vector import gather_token_matrices

# fmt: off
__all__ = [
    "TrackingFlags", "check_wandb_installed", "start_tracking", "wandb_mode", "LogWindow", "log_training",
    "progress_line", "StageOnBar", "printing_above", "warn_if_masking_much", "evaluate",
    "split_between_processes",
]
# fmt: on


@dataclasses.dataclass(frozen=True)
class TrackingFlags:
    """The flags of the trackers (`common.flags_of(TrackingFlags, args)`)."""

    wandb_mode: str
    wandb_project: str
    run_name: str
    output_dir: str


def check_wandb_installed(mode):
    """Stop, before the run's folder is claimed, where --wandb_mode asks for wandb and it is not installed:
    accelerate leaves the tracker out silently, and the run ended in a traceback, its folder written."""
    if mode != "disabled" and not is_wandb_available():
        fail(f"--wandb_mode {mode} needs wandb, not installed: pip install wandb or --wandb_mode disabled.")


def start_tracking(accelerator, flags, config, resumed_state):
    """Print the configuration as the run uses it (`config`: the flags, and the defaults resolved) and send
    it to wandb and TensorBoard; (the wandb run's id, the same on every process (None without wandb), the
    wandb mode used: offline where online cannot be).

    A resumed run continues the wandb run of its checkpoint and may log again steps the interrupted run
    logged after its checkpoint: TensorBoard's purge_step drops what earlier event files hold from there."""
    mode, why = broadcast_object_list(
        [wandb_mode(flags.wandb_mode) if accelerator.is_main_process else None]
    )[0]
    if why and flags.wandb_mode == "online_only":  # before anything is written
        fail(
            f"--wandb_mode online_only: {why}. Log offline (--wandb_mode offline), or fix the network or key."
        )
    if why:
        sync = f"wandb sync {Path(flags.output_dir) / 'wandb'}/offline-run-*"
        accelerator.print(f"train.py: --wandb_mode online: {why}: logging offline; upload later with {sync}")
    config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
    config["wandb_mode"] = mode
    accelerator.print("\n".join(f"{name:>28}: {value}" for name, value in config.items()))
    wandb_kwargs = {"name": flags.run_name, "mode": mode, "dir": str(Path(flags.output_dir))}
    wandb_kwargs |= {"id": (resumed_state or {}).get("wandb_run_id"), "resume": "allow"}
    first_step = resumed_state["global_step"] + 1 if resumed_state else 0
    init_kwargs = {"wandb": wandb_kwargs, "tensorboard": {"purge_step": first_step}}
    accelerator.init_trackers(flags.wandb_project, init_kwargs=init_kwargs)  # config: store_configuration
    store_configuration(accelerator, config)
    run_id = None
    if accelerator.is_main_process and mode != "disabled":
        run = accelerator.get_tracker("wandb", unwrap=True)
        run.define_metric("*", step_metric="train/global_step")  # wandb drops a step below its own counter
        run_id = run.id
    return broadcast_object_list([run_id])[0], mode  # every machine's copy of a checkpoint names the run


def store_configuration(accelerator, config):
    """`config` to each tracker; TensorBoard's hparams and hparams.yml in one subfolder of this launch's
    (accelerate's tracker writes hparams.yml into a subfolder beside the one torch's add_hparams makes)."""
    for tracker in accelerator.trackers:
        if tracker.name != "tensorboard":
            tracker.store_init_configuration(config)
        elif accelerator.is_main_process:
            folder = str(time.time())  # add_hparams's own default name: one subfolder per launch
            tracker.writer.add_hparams(config, metric_dict={}, run_name=folder)
            Path(tracker.logging_dir, folder, "hparams.yml").write_text(yaml.safe_dump(config))


def wandb_mode(asked):
    """(--wandb_mode as the run can use it, why not as asked): online only where wandb's server answers
    within 3 s and a key is there (else wandb retries for minutes, then ends in a traceback)."""
    if asked not in ("online", "online_only"):
        return asked, ""
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if why := unreachable(url):
        return "offline", why
    try:
        keys = netrc.netrc(os.environ.get("NETRC")).authenticators(urllib.parse.urlsplit(url).hostname)
    except (OSError, netrc.NetrcParseError):
        keys = None
    keyed = "WANDB_API_KEY" in os.environ or keys
    return ("online", "") if keyed else ("offline", "no key (WANDB_API_KEY, or wandb login)")


@dataclasses.dataclass
class LogWindow:
    """What happened since the last log: the means of its numbers become the logged training metrics."""

    sums: dict = dataclasses.field(default_factory=dict)  # the loss and each number of `stats`, over batches
    counts: dict = dataclasses.field(default_factory=dict)  # the batches that had each
    steps: int = 0
    seconds: float = 0.0  # training only: evaluation, logging and checkpoints left out

    def add(self, loss, stats, seconds):
        """One batch: its loss, and every number the step and the loss put in `stats`, each logged as
        train/<name> (a name that starts with "_" is a loss's running counter, not a metric)."""
        self.seconds += seconds
        for name, value in {"loss": loss, **stats}.items():
            if not name.startswith("_"):
                self.sums[name] = self.sums.get(name, 0.0) + float(value)
                self.counts[name] = self.counts.get(name, 0) + 1

    def examples_per_second(self, effective_batch_size):
        return self.steps * effective_batch_size / self.seconds


def reduced(accelerator, values, reduction):
    """{name: number} reduced over the processes ("sum", "mean", "max") in one all-reduce."""
    tensors = {name: torch.tensor(float(value), dtype=torch.float64, device=accelerator.device)
               for name, value in values.items()}  # fmt: skip
    return {name: value.item() for name, value in accelerator.reduce(tensors, reduction).items()}


def peak_rss_gib():
    """The process's resident high-water mark since it started (the kernel's ru_maxrss, KiB on Linux): it
    holds the evaluation's peak too, which the resident size read at a log misses."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def log_training(accelerator, progress, window, derived, batches_per_epoch, loss_scale=None, **values):
    """The training metrics of the window, with `values` as train/<name>, to TensorBoard and wandb."""
    reduce = functools.partial(reduced, accelerator)
    means = {f"train/{name}": total / window.counts[name] for name, total in window.sums.items()}
    tokens = reduce({"tokens": window.sums.get("tokens", 0)}, "sum")["tokens"]  # of every process
    metrics = {
        "train/global_step": progress.global_step,
        "train/epoch": progress.epoch + progress.batches_done / batches_per_epoch,
        **reduce(means, "mean"),  # per batch; each process's batch counts alike
        "train/effective_batch_size": derived["effective_batch_size"],
        "train/examples_per_second": window.examples_per_second(derived["effective_batch_size"]),
        "train/tokens_per_second": tokens / window.seconds,
        "train/skipped_steps": progress.skipped_steps,
        "train/nonfinite_steps": progress.nonfinite_steps,
    }
    grad_norm = values.pop("grad_norm")  # None: the step applied no update
    values["grad_norm"] = float("nan") if grad_norm is None else float(grad_norm)
    metrics |= {f"train/{name}": value for name, value in values.items()}
    memory = {
        "memory/rss_gib": psutil.Process().memory_info().rss / 2**30,
        "memory/peak_rss_gib": peak_rss_gib(),
    }
    if accelerator.device.type == "cuda":  # the peaks since the last log
        memory["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(accelerator.device) / 2**30
        memory["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(accelerator.device) / 2**30
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    metrics |= reduce(memory, "max")  # the process that needs the most
    if loss_scale is not None:
        metrics["train/loss_scale"] = float(loss_scale)
    accelerator.log(metrics, step=progress.global_step)


# The bar shows a step's stage at most this often: a job's log file keeps every redraw.
STAGE_SECONDS = 1.0


class StageOnBar:
    """gradcache's `interrupt(stage, group, groups)` that also shows on the progress bar where a step is
    ("encode 3/16", "backward 5/15"): a step of minutes left the bar frozen; while `showing_on(bar)`."""

    def __init__(self, interrupt):
        self.interrupt, self.bar, self.shown = interrupt, None, -math.inf

    @contextlib.contextmanager
    def showing_on(self, bar):
        self.bar = bar
        try:
            yield
        finally:
            self.bar = None

    def __call__(self, stage, group, groups):
        if self.bar is not None and time.monotonic() - self.shown >= STAGE_SECONDS:
            self.bar.set_description_str(f"{stage} {group + 1}/{groups}")
            self.shown = time.monotonic()
        return self.interrupt()


@contextlib.contextmanager
def printing_above(bar):
    """Python's warnings and the libraries' log records written above the progress bar (tqdm.write, tqdm's
    logging_redirect_tqdm) while it lives, not into its line."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    show = warnings.showwarning

    def above(message, category, filename, lineno, file=None, line=None):
        bar.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip(), file=sys.stderr)

    warnings.showwarning = above
    try:
        with logging_redirect_tqdm():
            yield
    finally:
        warnings.showwarning = show


def progress_line(report, window, derived, stats):
    """The progress bar's numbers: the loss, the speed, and the share of candidates the masks took out."""
    line = {"loss": f"{report.loss.item():.4f}"}
    line["examples_per_s"] = f"{window.examples_per_second(derived['effective_batch_size']):.1f}"
    if "masked_fraction" in stats:
        line["masked"] = f"{stats['masked_fraction']:.0%}"
    if "query_active_dims" in stats:  # a sparse encoder's: how sparse its queries and documents are now
        line["active_dims"] = f"{stats['query_active_dims']:.0f}/{stats['document_active_dims']:.0f}"
    return line


def warn_if_masking_much(say, stats, step, threshold, mask_flags):
    """One line when the false-negative masks take out more than --warn_masked_fraction (`threshold`) of the
    candidates: the loss then learns from few negatives. `mask_flags`: {flag: value} of the masks. Whether
    it warned (main warns once)."""
    masked = stats.get("masked_fraction", 0.0)
    if masked <= threshold:
        return False
    masks = ", ".join(f"--{name} {value}" for name, value in mask_flags.items())
    say(
        f"train.py: warning: step {step}: the false-negative masks took out {masked:.0%} of the candidates "
        f"(more than --warn_masked_fraction {threshold}; {masks}): true negatives go too. Raise "
        "--guide_margin, --false_negative_margin, or use a stronger guide."
    )
    return True


# A dev corpus from this size on takes minutes to encode on a CPU: sentence-transformers' own bars (queries,
# corpus chunks) show it moving, on the main process.
PROGRESS_CORPUS = 10_000


def evaluate(evaluator, model, accelerator, global_step):
    """Score the dev split, log it (with its time, eval/seconds) and, after training started, print it.

    The processes share the encoding (split_between_processes); under ZeRO-3 their forward passes gather
    parameters collectively. The whole model is gathered here, not inside sentence-transformers'
    inference_mode: the parameters first gathered there (the small, persistent ones) would stay inference
    tensors, which training cannot back-propagate through.
    """
    started = time.perf_counter()
    evaluator.show_progress_bar = accelerator.is_main_process and len(evaluator.corpus) >= PROGRESS_CORPUS
    with gathered_parameters(model), split_between_processes(evaluator, accelerator):
        metrics = evaluator(model)  # encode switches to eval mode
    model.train()
    metrics = {f"eval/{name}": value for name, value in metrics.items()}
    metrics["eval/seconds"] = time.perf_counter() - started
    metrics |= reduced(accelerator, {"memory/peak_rss_gib": peak_rss_gib()}, "max")
    accelerator.log(metrics | {"train/global_step": global_step}, step=global_step)
    if global_step:
        accelerator.print(f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


@contextlib.contextmanager
def split_between_processes(evaluator, accelerator):
    """sentence-transformers' evaluator, its texts (the queries, each chunk of the corpus) encoded once: each
    process encodes an equal share (the last padded with repeats: under ZeRO-3 every process must run as
    many forward passes), the embeddings gathered in order (a multi-vector model's token matrices with
    their lengths), the metrics its own. One process, or a sparse encoder (its evaluator counts active
    dimensions as it encodes, on sparse CPU tensors): unchanged."""
    embed_inputs = evaluator.embed_inputs
    gather = (
        gather_token_matrices if isinstance(evaluator, MultiVectorInformationRetrievalEvaluator) else None
    )

    def embed_share(model, texts, **kwargs):
        share = -(-len(texts) // accelerator.num_processes)
        mine = list(texts[accelerator.process_index * share :][:share])
        mine += texts[: share - len(mine)]  # the repeats: dropped after the gather
        return (gather or accelerator.gather)(embed_inputs(model, mine, **kwargs))[: len(texts)]

    shared = accelerator.num_processes > 1 and not isinstance(evaluator, SparseInformationRetrievalEvaluator)
    evaluator.embed_inputs = embed_share if shared else embed_inputs
    try:
        yield
    finally:
        del evaluator.embed_inputs  # the class's again
