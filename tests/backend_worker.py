"""Runs `gradcache_step` under a training backend and compares what it did with a plain full-batch reference.

Shared by tests/test_backends.py (CPU) and bench/gpu_check.py (CUDA). As a script it is the worker that
`launch` starts under torchrun; one launch runs several cases in sequence, each with a fresh Accelerator:

    ACCELERATE_USE_CPU=true PYTHONPATH=. torchrun --standalone --nproc_per_node 2 \\
        tests/backend_worker.py OUT_DIR '[{"name": "ddp", "world_size": 2}]'
    DS_ACCELERATOR=cpu PYTHONPATH=. torchrun --standalone --nproc_per_node 2 \\
        tests/backend_worker.py OUT_DIR '[{"name": "zero3", "zero_stage": 3, "world_size": 2}]'

The JSON list holds `Case` fields. A case with `zero_stage` runs under DeepSpeed, one without runs DDP when
launched with several processes; one launch holds one kind (accelerate keeps ACCELERATE_USE_DEEPSPEED set
in the environment once a DeepSpeed plugin was given). Each rank writes OUT_DIR/<case>.rank<r>.pt.
"""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from references import StageOneRecorder, exactness, materialized_contrastive_loss, plain_rows
from torch import nn

import gradcache
from gradcache import accelerate_sync_context, contrastive_loss, gradcache_step
from train_parts import fsdp

REPO = Path(__file__).resolve().parent.parent
PER_PROCESS_BATCH = 6
CHUNK_SIZE = 4  # does not divide PER_PROCESS_BATCH: the last chunk of every column is short
NUM_COLUMNS = 3  # anchor, positive, one hard negative
NUM_STEPS = 3  # optimizer steps per case
LEARNING_RATE = 1.0  # plain SGD: each update is the gradient itself, large enough to stand out of rounding
LOSS_TILE_SIZE = 5  # divides neither a process's rows nor the global batch: several tiles, the last short
VOCAB_SIZE = 50
MAX_LENGTH = 12
MODEL_SEED = 1234
DATA_SEED = 99

# fp32 runs are exact by tests/references.py's rule: as close to the float64 reference as the float32 one.
# bf16 and fp16 runs stay within a budget of the float64 reference instead, relative differences
# (references.relative_error) for the losses, the first step's gradient and the update after NUM_STEPS steps:
# bf16 keeps 8 significant bits (rounding 4e-3) and the loss multiplies cosine similarities by 20 before the
# softmax: a plain unchunked bf16 run already differs from fp32 by up to 3e-2 in the gradient here, and three
# steps at this learning rate compound it (9e-2). fp16 keeps 11 bits. A structural error (a chunk lost,
# a gradient scaled twice or by the wrong world size) costs order 1.
TOLERANCE = {
    "bf16": {"loss": 0.1, "gradient": 0.1, "update": 0.3},
    "fp16": {"loss": 0.05, "gradient": 0.05, "update": 0.15},
}
METRICS = ("loss", "gradient", "update")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    zero_stage: int | None = None  # DeepSpeed ZeRO stage; None runs without DeepSpeed
    world_size: int = 1
    two_towers: bool = False
    cross_process_negatives: bool = False
    mixed_precision: str = "no"  # accelerate's choice: "no", "bf16" or "fp16"
    accumulation_steps: int = 1  # micro-batches per optimizer step, through accelerator.accumulate()
    offload: tuple = ()  # ZeRO-Offload to the CPU: "optimizer" and/or "param"
    plain_torch: bool = False  # no accelerate at all: Tensor.backward and a plain optimizer
    use_sync_context: bool = True  # False is a negative control: every chunk synchronizes
    symmetric: bool = False  # the loss adds the positive -> anchor direction
    matryoshka_dims: tuple = ()  # the loss sums over these renormalized prefixes (of the 8 dimensions)
    uneven: bool = False  # cross-process negatives only: rank 0 holds a row less, the last rank one more
    dropout: float = 0.0  # each rank draws its own masks (its own seed): see `record_stage_one`
    fsdp2: bool = False  # FSDP2 (fully_shard) through accelerate; on CPU processes by tests/fsdp_shim.py
    # An FSDP2 negative control: "per-chunk" (every chunk reduce-scatters, its surrogate divided by the groups
    # of chunks, as accelerate's accumulate() over chunks would), "no-replay" (stage 3 draws new dropout
    # masks), "drop-rank" (the last rank's gradients never reach the reduce-scatter)
    control: str = ""


# ---------------------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------------------


class TinyEncoder(nn.Module):
    """Embedding, a tanh layer, masked mean pooling and a projection, with sentence-transformers' interface:
    a features dict in, `{'sentence_embedding': ...}` out. Dropout (off unless a case asks) after the tanh.
    """

    def __init__(self, width=16, out_features=8, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, width)
        self.hidden = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)
        self.project = nn.Linear(width, out_features)

    def forward(self, features):
        hidden = self.dropout(torch.tanh(self.hidden(self.embed(features["input_ids"]))))
        mask = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
        return {"sentence_embedding": self.project(pooled)}


class TwoTowers(nn.Module):
    """A query tower for the anchors and a document tower for positives and negatives, in one module."""

    def __init__(self):
        super().__init__()
        self.query = TinyEncoder()
        self.document = TinyEncoder()

    def forward(self, features, tower):
        return (self.query if tower == "query" else self.document)(features)


def make_model(case):
    torch.manual_seed(MODEL_SEED)
    assert not (case.two_towers and case.dropout), "dropout cases use the shared encoder"
    return TwoTowers() if case.two_towers else TinyEncoder(dropout=case.dropout)


def tower_names(case):
    """The tower of each column: anchors through the query tower, the rest through the document tower."""
    return ["query"] + ["document"] * (NUM_COLUMNS - 1) if case.two_towers else [None] * NUM_COLUMNS


def make_columns(batch_size, generator):
    columns = []
    for _ in range(NUM_COLUMNS):
        lengths = torch.randint(2, MAX_LENGTH + 1, (batch_size,), generator=generator)
        mask = (torch.arange(MAX_LENGTH) < lengths[:, None]).long()
        input_ids = torch.randint(1, VOCAB_SIZE, (batch_size, MAX_LENGTH), generator=generator) * mask
        columns.append({"input_ids": input_ids, "attention_mask": mask, "modality": "text"})
    return columns


def make_micro_batches(case):
    """Every micro-batch of the run, each holding the global batch: all ranks' examples, rank 0's first."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    count = NUM_STEPS * case.accumulation_steps
    return [make_columns(case.world_size * PER_PROCESS_BATCH, generator) for _ in range(count)]


def shard_sizes(case):
    """Rows per process; uneven sizes keep the global batch at world_size * PER_PROCESS_BATCH."""
    sizes = [PER_PROCESS_BATCH] * case.world_size
    if case.uneven:
        sizes[0], sizes[-1] = PER_PROCESS_BATCH - 1, PER_PROCESS_BATCH + 1
    return sizes


def shard(columns, rank, case):
    first = sum(shard_sizes(case)[:rank])
    rows = torch.arange(first, first + shard_sizes(case)[rank])
    return [plain_rows(column, rows) for column in columns]  # not gradcache's select_examples: its input


def loss_options(case):
    """Matryoshka weights sum to one: an SGD step at learning rate 1 stays the size of the plain loss's,
    whose rounding three steps amplify to within the tolerance (weights of 1 each reach 2e-5)."""
    if not case.matryoshka_dims:
        return {"symmetric": case.symmetric}
    weights = [1 / len(case.matryoshka_dims)] * len(case.matryoshka_dims)
    return {
        "symmetric": case.symmetric,
        "matryoshka_dims": case.matryoshka_dims,
        "matryoshka_weights": weights,
    }


def loss_function(case):
    """The loss gradcache_step computes: tiled, in tiles that divide nothing."""
    return functools.partial(contrastive_loss, tile_size=LOSS_TILE_SIZE, **loss_options(case))


def to_device(columns, device):
    return [
        {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in column.items()}
        for column in columns
    ]


# ---------------------------------------------------------------------------------------------------------
# The reference: plain torch, one process, the global batch, no chunking, fp32 on the CPU
# ---------------------------------------------------------------------------------------------------------


def reference_run(case, dtype=torch.float32):
    """Losses per rank and micro-batch, the gradient of the first step, and the final weights.

    Without cross-process negatives each rank contrasts its own examples only and the backends average
    the ranks' gradients: the loss is the mean of the per-rank losses. With them it is one loss over the
    global batch. accelerate divides each micro-batch's loss by the number of accumulation steps. In `dtype`
    (the same initial weights cast).
    """
    model = make_model(case).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    micro_batches = make_micro_batches(case)
    losses = [[] for _ in range(case.world_size)]
    first_grads = None
    for step in range(NUM_STEPS):
        optimizer.zero_grad()
        for columns in micro_batches[step * case.accumulation_steps : (step + 1) * case.accumulation_steps]:
            if case.cross_process_negatives:
                groups = [columns]
            else:
                groups = [shard(columns, rank, case) for rank in range(case.world_size)]
            group_losses = [
                materialized_contrastive_loss(*encode_columns(model, case, group), **loss_options(case))
                for group in groups
            ]
            for rank in range(case.world_size):
                losses[rank].append(group_losses[0 if case.cross_process_negatives else rank].item())
            (torch.stack(group_losses).mean() / case.accumulation_steps).backward()
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
    final_weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "first_grads": first_grads, "final_weights": final_weights}


def encode_columns(model, case, columns):
    return [
        model(column)["sentence_embedding"] if tower is None else model(column, tower)["sentence_embedding"]
        for tower, column in zip(tower_names(case), columns, strict=True)
    ]


def initial_weights(case):
    return {name: p.detach().clone() for name, p in make_model(case).named_parameters()}


def updates(weights, start):
    """What the optimizer changed. Comparing updates rather than weights keeps the initial weights, which
    dominate every entry, from hiding differences in the gradients."""
    return {name: weights[name].double().cpu() - start[name].double() for name in start}


def expected_steps_after_micro_batches(case):
    """Optimizer steps taken after each micro-batch: one per `accumulation_steps` micro-batches."""
    return [(m + 1) // case.accumulation_steps for m in range(NUM_STEPS * case.accumulation_steps)]


def compare(case, ranks):
    """Every rank's run against the case's reference in float64, beside the float32 reference's own
    distance to it (references.Exactness, worst rank): the losses, the first step's gradients and the weight
    updates after NUM_STEPS steps; and whether the optimizer stepped exactly once per batch."""
    truth, float32 = reference_run(case, torch.float64), reference_run(case, torch.float32)
    start = initial_weights(case)

    def measured(run_values, reference_values):
        return max(
            (exactness(values, reference_values(float32), reference_values(truth)) for values in run_values),
            key=lambda measured: measured.error - measured.bound,
        )

    steps = expected_steps_after_micro_batches(case)
    return {
        "loss": measured([[run["losses"] for run in ranks]], lambda reference: reference["losses"]),
        "gradient": measured(
            [run["first_grads"] for run in ranks], lambda reference: reference["first_grads"]
        ),
        "update": measured(
            [updates(run["final_weights"], start) for run in ranks],
            lambda reference: updates(reference["final_weights"], start),
        ),
        "steps_once_per_batch": all(
            run["steps_after_micro_batch"] == steps
            and run.get("deepspeed_global_steps", NUM_STEPS) == NUM_STEPS
            and run.get("deepspeed_skipped_steps", 0) == 0
            for run in ranks
        ),
    }


def markdown_table(rows):
    """rows: (case, comparison) pairs; a row passes when every difference is within the case's bound (fp32:
    references.py's rule; bf16, fp16: TOLERANCE) and the optimizer stepped once per batch."""
    columns = ["setup", "processes", "precision", "loss", "step-1 gradient", "update after 3 steps", "steps"]
    columns += ["bound (loss / gradient / update)", "result"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for case, comparison in rows:
        bounds = [bound(case, comparison[metric], metric) for metric in METRICS]
        lines.append(
            f"| {case.name} | {case.world_size} | {case.mixed_precision} | {comparison['loss'].error:.1e} "
            f"| {comparison['gradient'].error:.1e} | {comparison['update'].error:.1e} "
            f"| {'once per batch' if comparison['steps_once_per_batch'] else 'WRONG'} "
            f"| {' / '.join(f'{b:.1e}' for b in bounds)} "
            f"| {'pass' if passes(case, comparison) else 'FAIL'} |"
        )
    return "\n".join(lines) + "\n"


def bound(case, measured, metric=None):
    """The largest difference from float64 that passes: the rule's for fp32, the precision's budget else."""
    if case.mixed_precision == "no":
        return measured.bound
    return TOLERANCE[case.mixed_precision][metric]


def within(case, comparison):
    return all(comparison[m].error <= bound(case, comparison[m], m) for m in METRICS)


def passes(case, comparison):
    return within(case, comparison) and comparison["steps_once_per_batch"]


# ---------------------------------------------------------------------------------------------------------
# Launching the worker
# ---------------------------------------------------------------------------------------------------------


def launch(cases, out_dir, world_size, environment=(), timeout=600):
    """Runs `cases` in one torchrun launch of `world_size` processes; returns {name: [result per rank]}."""
    arguments = [str(out_dir), json.dumps([dataclasses.asdict(case) for case in cases])]
    torchrun(Path(__file__).resolve(), arguments, world_size, environment, timeout)
    return load_results(cases, out_dir, world_size)


def torchrun(script, arguments, world_size, environment=(), timeout=600):
    """`torchrun --standalone` of a worker script from the repository root, tests/ and the root importable."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
    ]
    command += [str(script), *arguments]  # --standalone picks a free port for the rendezvous
    python_path = os.pathsep.join(
        filter(None, [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, **dict(environment), "PYTHONPATH": python_path}
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0:
        output = (completed.stdout + completed.stderr)[-8000:]
        raise RuntimeError(f"the worker exited with {completed.returncode}:\n{output}")


def load_results(cases, out_dir, world_size):
    """{case name: [result of rank 0, rank 1, ...]} from the files the worker wrote."""
    return {
        case.name: [torch.load(Path(out_dir) / f"{case.name}.rank{rank}.pt") for rank in range(world_size)]
        for case in cases
    }


# ---------------------------------------------------------------------------------------------------------
# The worker: a run under a backend
# ---------------------------------------------------------------------------------------------------------


def run_case(case, out_dir):
    """Trains NUM_STEPS steps with gradcache_step, saves this rank's result and returns it."""
    if case.plain_torch:
        result, rank = run_plain_torch(case), 0
    else:
        from accelerate import Accelerator

        # Several Accelerators in one process (cases in sequence, other tests) need the singletons cleared.
        reset_accelerate_state()
        accelerator = Accelerator(**accelerator_arguments(case))
        try:
            result, rank = run_under_accelerate(case, accelerator), accelerator.process_index
        finally:
            reset_accelerate_state()
    save_atomically(result, Path(out_dir) / f"{case.name}.rank{rank}.pt")
    return result


def reset_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerator_arguments(case):
    from accelerate import DeepSpeedPlugin
    from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs

    handlers = []
    if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        # Launched on a CPU-only machine: without gloo named, accelerate treats each rank as process 0 of 1.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    if case.mixed_precision == "fp16":
        # accelerate's GradScaler starts at 2**16, which can overflow the first step: a skipped step would
        # leave nothing to compare. DeepSpeed's scale starts at the same 2**12 (deepspeed_config).
        handlers.append(GradScalerKwargs(init_scale=2.0**12))
    arguments = {
        "mixed_precision": case.mixed_precision,
        "gradient_accumulation_steps": case.accumulation_steps,
        "kwargs_handlers": handlers,
    }
    os.environ.pop("ACCELERATE_USE_FSDP", None)  # set by accelerate for an FSDP2 case before
    if case.zero_stage is not None:
        arguments["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=deepspeed_config(case))
    elif case.fsdp2:  # accelerate_configs/fsdp2.yaml's settings
        from accelerate import FullyShardedDataParallelPlugin
        from fsdp_shim import install

        install()  # where accelerate would not run FSDP: on CPU processes
        arguments["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
        arguments["cpu"] = not torch.cuda.is_available()
    elif not torch.cuda.is_available():
        # DDP on the CPU (gloo), also in a launch that runs DeepSpeed cases afterwards, where the
        # environment variable ACCELERATE_USE_CPU would switch DeepSpeed off.
        arguments["cpu"] = True
    return arguments


def deepspeed_config(case):
    zero = {"stage": case.zero_stage}
    zero.update({f"offload_{what}": {"device": "cpu"} for what in case.offload})
    return {
        "train_micro_batch_size_per_gpu": PER_PROCESS_BATCH,
        "gradient_accumulation_steps": case.accumulation_steps,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        # accelerate fills "auto" from its mixed_precision (DeepSpeedPlugin.set_mixed_precision).
        "fp16": {"enabled": "auto", "initial_scale_power": 12},
        "bf16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,  # plain SGD, so that each update is the gradient
        "zero_force_ds_cpu_optimizer": False,  # keep it under offload too
        "steps_per_print": 10**9,
    }


def run_under_accelerate(case, accelerator):
    model = make_model(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    optimizer_steps = count_optimizer_steps(optimizer)
    engine = None
    if case.zero_stage is not None:
        # One engine for both towers; the encoders route through it.
        engine, optimizer = accelerator.prepare(model, optimizer)
        models = [engine]
        encoders = [tower_router(engine, tower) for tower in tower_names(case)] if case.two_towers else engine
        first = record_first_gradients_before_step(engine)
    elif case.fsdp2:  # one module, prepared with its optimizer (fully_shard replaces the parameters)
        module, optimizer = accelerator.prepare(model, optimizer)
        models = [module]
        encoders = [tower_router(module, tower) for tower in tower_names(case)] if case.two_towers else module
        first = {}
    elif case.two_towers:
        # Under DDP each tower is its own DDP module.
        query, document, optimizer = accelerator.prepare(model.query, model.document, optimizer)
        models = [query, document]
        encoders = [query] + [document] * (NUM_COLUMNS - 1)
        first = {}
    else:
        models = [accelerator.prepare(model)]
        optimizer = accelerator.prepare(optimizer)
        encoders = models[0]
        first = {}
    ddp = accelerator.distributed_type in ("MULTI_CPU", "MULTI_GPU")
    allreduce_calls = count_allreduce_calls(models) if ddp else None
    # Without it (the negative control) gradcache_step's default lets every chunk synchronize.
    sync_argument = {}
    if case.use_sync_context and case.fsdp2:
        sync_argument["sync_context"] = fsdp.sync_context(accelerator, models[0])
    elif case.use_sync_context:
        sync_argument["sync_context"] = accelerate_sync_context(accelerator, *models)
    backward = fsdp2_control(case, accelerator, sync_argument)
    reduce_scatters = count_reduce_scatters() if case.fsdp2 else None

    losses, steps_after_micro_batch, allreduces_per_step, reduce_scatters_per_step = [], [], [], []
    recorder = StageOneRecorder()
    torch.manual_seed(DATA_SEED + accelerator.process_index)  # dropout: every rank its own masks
    for micro_batch, columns in enumerate(make_micro_batches(case)):
        columns = to_device(shard(columns, accelerator.process_index, case), accelerator.device)
        # The first step of a dropout case through the recorder: what stage 1 encoded, from which RNG state.
        step = recorder.step if case.dropout and micro_batch == 0 else gradcache_step
        replay = gradcache.refinements(replay_rng=case.control != "no-replay")
        with accelerator.accumulate(*models), replay:
            report = step(
                encoders,
                columns,
                loss_function(case),
                chunk_size=CHUNK_SIZE,
                backward=backward,
                cross_process_negatives=case.cross_process_negatives,
                **sync_argument,
            )
            losses.append(report.loss.item())
            if accelerator.sync_gradients and engine is None and not first:
                accelerator.unscale_gradients()  # fp16: divides by the GradScaler's scale, once
                first["grads"] = plain_gradients(model)
            optimizer.step()  # a no-op under DeepSpeed, which stepped inside accelerator.backward
            optimizer.zero_grad()
        steps_after_micro_batch.append(optimizer_steps["count"])
        if ddp and accelerator.sync_gradients:
            allreduces_per_step.append(allreduce_calls["count"])
            allreduce_calls["count"] = 0
        if reduce_scatters and accelerator.sync_gradients:
            reduce_scatters_per_step.append(reduce_scatters.pop("count", 0))

    result = {
        "losses": losses,
        "stage_one": (recorder.calls, recorder.batch_sizes) if case.dropout else None,
        "first_grads": first["grads"],
        "final_weights": full_weights(model, engine),
        "steps_after_micro_batch": steps_after_micro_batch,
    }
    if engine is not None:
        result["deepspeed_global_steps"] = engine.global_steps
        result["deepspeed_skipped_steps"] = engine.skipped_steps
        result["deepspeed_first_loss_scale"] = first["loss_scale"]
    if case.fsdp2:  # a reduce-scatter per FSDP2 unit and backward that synchronizes
        result["reduce_scatters_per_step"] = reduce_scatters_per_step
        result["units"] = sum(1 for module in models[0].modules() if hasattr(module, "unshard"))
        reduce_scatters["stop"]()
    if ddp:
        result["allreduces_per_step"] = allreduces_per_step
        result.update(allreduce_controls(case, encoders, accelerator, allreduce_calls))
    return result


def run_plain_torch(case):
    model = make_model(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    encoders = model if not case.two_towers else [tower_router(model, tower) for tower in tower_names(case)]
    losses, first_grads = [], {}
    for columns in make_micro_batches(case):
        optimizer.zero_grad()
        losses.append(gradcache_step(encoders, columns, loss_function(case), CHUNK_SIZE).loss.item())
        first_grads = first_grads or plain_gradients(model)
        optimizer.step()
    return {
        "losses": losses,
        "first_grads": first_grads,
        "final_weights": full_weights(model, None),
        "steps_after_micro_batch": list(range(1, NUM_STEPS + 1)),
    }


def tower_router(module, tower):
    return lambda features: module(features, tower)


def whole(tensor):
    """An FSDP2 DTensor's shards gathered (a collective: every rank calls it); a plain tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def plain_gradients(model):
    return {name: whole(p.grad).detach().float().cpu().clone() for name, p in model.named_parameters()}


def full_weights(model, engine):
    if engine is None:
        return {name: whole(p).detach().float().cpu().clone() for name, p in model.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param

    # A collective under ZeRO-3 (every rank calls it); the fp32 master weights, also under bf16/fp16.
    return {
        name: safe_get_full_fp32_param(p).detach().cpu().clone()
        for name, p in engine.module.named_parameters()
    }


def record_first_gradients_before_step(engine):
    """Fills the returned dict with the first step's full gradients, divided by the loss scale.

    accelerate calls `engine.step()` inside `accelerator.backward` of the syncing chunk, so the only moment
    between the last backward and the optimizer step is the start of `engine.step`: wrap it.
    `safe_get_full_grad` assembles the partitioned gradient (a collective: every rank gets here). DeepSpeed
    unscales fp16 gradients inside the step, so here they still carry the loss scale.
    """
    from deepspeed.utils import safe_get_full_grad

    first = {}
    step = engine.step

    def record_then_step(*args, **kwargs):
        if engine.global_steps == 0:
            first["loss_scale"] = float(getattr(engine.optimizer, "loss_scale", 1.0))
            first["grads"] = {
                name: safe_get_full_grad(p).detach().float().cpu() / first["loss_scale"]
                for name, p in engine.module.named_parameters()
            }
        return step(*args, **kwargs)

    engine.step = record_then_step
    return first


def count_optimizer_steps(optimizer):
    """Counts the steps the torch optimizer really takes (accelerate's and DeepSpeed's wrappers call it)."""
    counter = {"count": 0}

    def count(*_):
        counter["count"] += 1

    optimizer.register_step_post_hook(count)
    return counter


def fsdp2_control(case, accelerator, sync_argument):
    """The backward of a case: accelerator.backward, but in an FSDP2 negative control (Case.control)."""
    if case.control == "per-chunk":
        sync_argument.pop("sync_context")
        groups = math.ceil(PER_PROCESS_BATCH / CHUNK_SIZE)
        return lambda surrogate: accelerator.backward(surrogate / groups)
    if case.control == "drop-rank" and accelerator.is_last_process:
        return lambda surrogate: accelerator.backward(surrogate * 0)
    return accelerator.backward


def count_reduce_scatters():
    """Counts torch.distributed.reduce_scatter_single, FSDP2's gradient reduction; "stop" undoes it."""
    import torch.distributed as dist

    counter, reduce_scatter = {}, dist.reduce_scatter_single

    def counting(*args, **kwargs):
        counter["count"] = counter.get("count", 0) + 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting
    counter["stop"] = lambda: setattr(dist, "reduce_scatter_single", reduce_scatter)
    return counter


def count_allreduce_calls(models):
    """A DDP communication hook that counts the bucket all-reduces, then does the default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter = {"count": 0}

    def counting_allreduce(process_group, bucket):
        counter["count"] += 1
        return allreduce_hook(process_group, bucket)

    for model in models:
        model.register_comm_hook(None, counting_allreduce)
    return counter


def allreduce_controls(case, encoders, accelerator, counter):
    """All-reduces of one plain full-batch DDP step (one per bucket: what a step should cost) and of one
    gradcache_step without sync_context (one per bucket and backward). Run after the weights are saved:
    the gradients they leave behind are never read."""
    columns = to_device(
        shard(make_micro_batches(case)[0], accelerator.process_index, case), accelerator.device
    )
    towers = encoders if isinstance(encoders, list) else [encoders] * NUM_COLUMNS
    counter["count"] = 0
    reps = [tower(column)["sentence_embedding"] for tower, column in zip(towers, columns, strict=True)]
    contrastive_loss(*reps).backward()
    plain_step = counter["count"]

    backward_calls = {"count": 0}

    def counted_backward(surrogate):
        backward_calls["count"] += 1
        surrogate.backward()

    counter["count"] = 0
    gradcache_step(encoders, columns, chunk_size=CHUNK_SIZE, backward=counted_backward)
    return {
        "allreduces_plain_step": plain_step,
        "allreduces_without_sync_context": counter["count"],
        "backward_calls_per_step": backward_calls["count"],
    }


def save_atomically(result, path):
    """torch.save under a temporary name, then rename: a rank that dies never leaves half a file."""
    partial = path.with_suffix(".partial")
    torch.save(result, partial)
    partial.rename(path)


def main(out_dir, cases_json):
    os.makedirs(out_dir, exist_ok=True)
    for fields in json.loads(cases_json):
        fields["offload"] = tuple(fields.get("offload", ()))
        fields["matryoshka_dims"] = tuple(fields.get("matryoshka_dims", ()))
        run_case(Case(**fields), out_dir)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR CASES_JSON (see the module docstring)")
    main(*sys.argv[1:])
    # Skip the interpreter's teardown: there gloo's threads now and then abort a process ("terminate called
    # without an active exception") after all its results are saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
