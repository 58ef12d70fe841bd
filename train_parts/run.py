"""A run's life on disk: its name and folder (locked while it runs), the check that a resume continues the
same run, checkpoints published whole, resume bit for bit, and preemption (SIGTERM, Ctrl-C).

Flags served: --run_name, --output_dir, --overwrite, --resume_from_checkpoint, --save_steps,
--save_total_limit, --save_on_each_node. A run is identified by its flags: this module takes them whole.
"""

import atexit
import dataclasses
import glob
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy
import torch
from accelerate.utils import broadcast_object_list

from .common import fail
from .launch import launch_differences, launch_facts

# fmt: off
__all__ = [
    "default_run_name", "data_name", "claim_output_dir", "lock_run_folder", "checkpoint_to_resume",
    "Progress", "batches_from", "Preemption", "save_now", "stop_preempted", "resume_command",
    "resume_training", "set_peak_learning_rate", "save_checkpoint", "complete_checkpoints",
    "latest_checkpoint",
]
# fmt: on


def data_name(source):
    """A data source's short name: its file's stem (wordnet_train), or a hub data set's name."""
    return re.sub(r"(\.(jsonl|json|csv|tsv|parquet))?(\.gz)?$", "", Path(source.split(":")[0]).name)


def default_run_name(model, data, started, suffix=None):
    """<model folder>-<data file stem>-<start time>-<4 random hex digits> (with several sources the first's
    stem, +N): jobs of a sweep started in the same second get their own folders too."""
    suffix = suffix or secrets.token_hex(2)
    return f"{run_prefix(model, data)}-{time.strftime('%Y%m%d-%H%M%S', started)}-{suffix}"


def run_prefix(model, data):
    """What default run names of this model and data begin with: <model folder>-<data file stem>(+N)."""
    data = [data] if isinstance(data, str) else data
    return f"{Path(model).name}-{data_name(data[0])}" + (f"+{len(data) - 1}" if len(data) > 1 else "")


def claim_output_dir(args, accelerator):
    """The run's folder, the same on every process, held by this run alone (`lock_run_folder`): a default
    name is new, its folder created exclusively; with --resume_from_checkpoint latest and no --output_dir or
    --run_name, the newest run of the same flags (`newest_run_like`). A folder holding a previous run stops
    the launch before anything is written, unless continuing or replacing it was asked for. Returns the lock,
    which main holds until the run ends."""
    agreed, lock = [args.run_name, args.output_dir, None, None], None
    if accelerator.is_main_process:
        try:
            if args.named_by_default and args.resume_from_checkpoint == "latest":
                agreed[:2] = newest_run_like(args, launch_facts(accelerator))
            elif args.named_by_default:
                agreed[:2] = new_run_folder(args)
            lock = lock_run_folder(Path(agreed[1]))
        except RunFolderError as error:
            agreed[3] = str(error)
        folders = [Path(agreed[1]) / name for name in ("final", "checkpoints")]  # "" for nothing
        agreed[2] = " and ".join(f"{f.name}/" for f in folders if f.is_dir() and any(f.iterdir()))
    args.run_name, args.output_dir, previous, error = broadcast_object_list(agreed)
    if error:
        fail(error)
    output_dir = Path(args.output_dir)
    if previous and not (args.resume_from_checkpoint or args.overwrite):
        fail(
            f"{output_dir} holds a previous run ({previous}). Continue it with --resume_from_checkpoint "
            "latest, replace it with --overwrite, or pass another --output_dir."
        )
    if previous and args.overwrite and not args.resume_from_checkpoint:  # else 'latest' could pick its own
        if accelerator.is_local_main_process if args.save_on_each_node else accelerator.is_main_process:
            for name in ("final", "checkpoints"):
                shutil.rmtree(output_dir / name, ignore_errors=True)
        accelerator.print(f"--overwrite: deleted the previous run's {previous} in {output_dir}")
        accelerator.wait_for_everyone()
    # The Accelerator was made with this process's own name.
    accelerator.project_configuration.project_dir = str(output_dir)
    accelerator.project_configuration.logging_dir = str(output_dir / "tensorboard")
    return lock


class RunFolderError(Exception):
    """The main process's reason to stop the launch: broadcast, then every process stops with it."""


def new_run_folder(args):
    """(run name, folder) of a new default-named run, the folder created here, exclusively: a job started
    in the same second with the same random suffix takes another suffix."""
    for _ in range(10):
        try:
            Path(args.output_dir).mkdir(parents=True)
            return args.run_name, args.output_dir
        except FileExistsError:
            args.run_name = f"{args.run_name.rsplit('-', 1)[0]}-{secrets.token_hex(2)}"
            args.output_dir = str(Path(args.output_dir).with_name(args.run_name))
    raise RunFolderError(f"could not create a new folder for the run in {Path(args.output_dir).parent}.")


# What a requeued launch may change and still be the same run (newest_run_like).
NOT_THE_RUN = ("run_name", "output_dir", "resume_from_checkpoint", "overwrite", "named_by_default", "command")


def newest_run_like(args, facts):
    """(run name, folder) of the newest default-named run, beside this launch's default folder, whose newest
    checkpoint this launch continues: the same model and data, every other flag the same (a sweep's runs
    differ in one), and the same launch (`launch_facts`). None such stops the launch naming what there is."""
    runs, prefix = Path(args.output_dir).parent, args.run_name.rsplit("-", 3)[0]
    flags = json.loads(json.dumps({k: v for k, v in vars(args).items() if k not in NOT_THE_RUN}))
    same, other = [], []
    for folder in runs.glob(f"{glob.escape(prefix)}-*") if runs.is_dir() else ():
        if checkpoint := latest_checkpoint(folder / "checkpoints"):
            state = json.loads((checkpoint / "trainer_state.json").read_text())
            differ = [
                f"--{k} {state['args'].get(k)}" for k, v in flags.items() if state["args"].get(k, v) != v
            ]
            differ += launch_differences(state, facts)
            (other if differ else same).append((checkpoint, differ))
    if same:
        checkpoint = max(same, key=lambda found: (found[0] / "trainer_state.json").stat().st_mtime)[0]
        print(
            f"train.py: --resume_from_checkpoint latest: continuing {checkpoint.parents[1]}, of these flags "
            "and this launch"
        )
        return checkpoint.parents[1].name, str(checkpoint.parents[1])
    others = "; ".join(f"{c.parents[1]} ({', '.join(d[:3])})" for c, d in other[:3])
    raise RunFolderError(
        f"--resume_from_checkpoint latest without --output_dir: no run of these flags and this launch "
        f"(precision, backend, processes) under {runs} has a "
        f"complete checkpoint{f' (others: {others})' if others else ''}. Pass the --output_dir of the run to "
        "continue, or drop --resume_from_checkpoint to start a new one."
    )


def lock_run_folder(folder):
    """An exclusive lock on <folder>/.lock, held while the run lives (released by the system when its process
    ends, however it ends): a second job using the same folder at the same time stops naming the first."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / ".lock", "a+")  # held open while the run lives
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise RunFolderError(
            f"{folder} is in use by a running job ({holder}): two jobs writing one folder would mix their "
            "checkpoints. Pass another --output_dir, or wait for that job to end."
        ) from None
    except OSError:  # a file system without locks: nothing to hold
        return lock
    lock.truncate(0)
    lock.write(f"process {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()
    if not [path for path in folder.iterdir() if path.name != ".lock"]:  # claimed empty
        atexit.register(remove_if_only_lock, folder)
    return lock


def remove_if_only_lock(folder):
    """At exit: the folder of a run refused at start-up (it holds nothing but the lock) is not left behind."""
    if folder.is_dir() and [path.name for path in folder.iterdir()] == [".lock"]:
        shutil.rmtree(folder)


# A checkpoint written with other values of these would resume at another data position (the last orders the
# batches of all processes together), or, of MODEL_KEYS, with weights that would not load into this model.
RESUME_KEYS = ("data", "data_weights", "data_sampling", "columns", "max_train_examples", "batch_size")
RESUME_KEYS += ("gradient_accumulation_steps", "seed", "cross_process_negatives")
MODEL_KEYS = ("model", "pooling", "lora_r", "lora_alpha", "lora_target_modules", "trust_remote_code")
MODEL_KEYS += ("model_dtype",)


def checkpoint_to_resume(args, accelerator, default):
    """(checkpoint, its trainer state) for --resume_from_checkpoint, the same on every process, or None to
    start from scratch. A checkpoint this launch would not continue stops it before anything is loaded.
    `default(flag)`: a flag's default (argparse's get_default), for a flag newer than the checkpoint."""
    spec, checkpoints_dir = args.resume_from_checkpoint, Path(args.output_dir) / "checkpoints"
    if not spec:
        return None
    if spec == "latest":  # looked up by the main process: other machines may see another, unfinished folder
        found = [latest_checkpoint(checkpoints_dir) if accelerator.is_main_process else None]
        if (checkpoint := broadcast_object_list(found)[0]) is None:
            accelerator.print(f"no complete checkpoint in {checkpoints_dir}: starting from scratch")
            return None
    elif not ((checkpoint := Path(spec)) / "trainer_state.json").is_file():
        fail(
            f"--resume_from_checkpoint {spec} is not a complete checkpoint (no trainer_state.json). "
            f"Pass a step_<N> folder from {checkpoints_dir}, or 'latest'."
        )
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved, processes = state["args"], state["processes"]

    def changed(keys):
        values = {k: saved.get(k, default(k)) for k in keys}  # a flag newer than the checkpoint
        return [f"--{k} {v} (this launch: {vars(args)[k]})" for k, v in values.items() if v != vars(args)[k]]

    data_order, weights = changed(RESUME_KEYS), changed(MODEL_KEYS)
    launch = launch_differences(state, launch_facts(accelerator) | {"processes": processes})  # said below
    if processes != accelerator.num_processes:
        data_order.append(f"{processes} processes (this launch: {accelerator.num_processes})")
    if data_order or weights or launch:
        why = [
            ("the data order would not continue", data_order),
            ("its weights are not this model's", weights),
            ("it trained under another launch (accelerate config or launch flags)", launch),
        ]
        fail(
            f"{checkpoint} was written with {', '.join(data_order + weights + launch)}: "
            f"{' and '.join(reason for reason, changes in why if changes)}. Launch with the checkpoint's "
            "values, or start a new --output_dir."
        )
    return checkpoint, state


@dataclasses.dataclass
class Progress:
    """Where the run stands: saved in every checkpoint's trainer_state.json, restored on resume."""

    global_step: int = 0
    epoch: int = 0
    batches_done: int = 0  # in this epoch
    skipped_steps: int = 0  # steps without an update: a non-finite loss or gradient, or an fp16 overflow
    nonfinite_steps: int = 0


def batches_from(progress, loader, accelerator, total_steps):
    """The batches from where `progress` stands, epoch after epoch: a resumed epoch goes on after the batches
    it had done. At each epoch's end `progress` moves on to the next."""
    while progress.global_step < total_steps:
        loader.set_epoch(progress.epoch)  # the sampler's order, and accelerate's count of iterations
        done = progress.batches_done
        yield from accelerator.skip_first_batches(loader, done) if done else loader
        progress.epoch, progress.batches_done = progress.epoch + 1, 0


class Preemption:
    """SIGTERM (a cluster's notice before SIGKILL, which torchrun forwards to every worker), Ctrl-C and the
    launcher's end: the handler only records the signal. The processes agree (`agreed`) at every group of
    chunks, so the step stops at its next one, and the run saves the state of the step's start (`mark`,
    `rewind`): the save need not wait for the step, whatever its length, within a launcher's grace (torchrun's
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default). A second signal, even during the save, changes
    nothing."""

    def __init__(self, accelerator):
        self.received, self.accelerator, self.at = set(), accelerator, None
        # accelerate's one-process launcher runs train.py as a subprocess and dies of a SIGTERM without
        # forwarding it: its end is the notice. Only under a launcher (its variables): a parent shell may go.
        launched = {"ACCELERATE_MIXED_PRECISION", "LOCAL_RANK"} & set(os.environ)
        self.launcher = os.getppid() if launched else None
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, lambda number, frame: self.received.add(signal.Signals(number).name))
        # The flag is all-reduced on the CPU: on a GPU's process group each check would wait for the kernels.
        distributed = accelerator.num_processes > 1
        self.group = torch.distributed.new_group(backend="gloo") if distributed else None

    def agreed(self):
        """Whether any process received a signal: the same answer on every process, one all-reduce."""
        if self.launcher is not None and os.getppid() != self.launcher:
            self.received.add("the launcher's end")
        flag = torch.tensor(float(bool(self.received)))
        if self.group is not None:
            torch.distributed.all_reduce(flag, group=self.group)
        return flag.item() > 0

    def mark(self, progress):
        """Where the next optimizer step starts: the data position and the RNG states save_state writes."""
        rng = (random.getstate(), numpy.random.get_state(), torch.get_rng_state())
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.at = (progress.epoch, progress.batches_done, rng, cuda)

    def rewind(self, progress):
        """Back to the mark: the interrupted step's batches and dropout are drawn again on resume."""
        progress.epoch, progress.batches_done, rng, cuda = self.at
        random.setstate(rng[0])
        numpy.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def save_now(accelerator, model, streak, progress, derived, args, wandb_run_id):
    """The checkpoint of this step, unless one exists (a preemption right after a save) or the step is inside
    a streak of non-finite steps (`latest` would resume into the streak)."""
    checkpoint = Path(args.output_dir) / "checkpoints" / f"step_{progress.global_step}"
    if streak.in_a_row or streak.last_checkpoint == checkpoint:
        return
    state = checkpoint_state(progress, derived, args, wandb_run_id, launch_facts(accelerator))
    check_weights_finite(accelerator, model, streak, progress)
    streak.checkpointed(save_checkpoint(accelerator, checkpoint.parent, state, args.save_total_limit))


def stop_preempted(accelerator, args, signals, streak):
    """Exit 0 after the checkpoint: a launcher (accelerate's, torchrun) reports any other code as a crash.
    Inside a streak of non-finite steps none was saved: the last one before it is named, or none."""
    why, checkpoint = ", ".join(sorted(signals)) or "a signal to another process", streak.last_checkpoint
    where = "none saved inside non-finite steps, the last: " if streak.in_a_row else "saved "
    accelerator.print(
        f"stopped by {why}: {where}{checkpoint}. Continue with the same launcher and {resume_command(args)}"
    )
    accelerator.end_training()
    sys.exit(0)


def resume_command(args):
    """This launch's flags with --output_dir the run's and --resume_from_checkpoint latest: what continues
    it, whatever its default name said (the minute it started)."""
    flags, value_follows = [], False
    for flag in args.command:
        if value_follows:
            value_follows = False
        elif flag.split("=")[0] in ("--run_name", "--output_dir", "--resume_from_checkpoint"):
            value_follows = "=" not in flag
        else:
            flags.append(flag)
    return shlex.join(
        ["train.py", *flags, "--output_dir", args.output_dir, "--resume_from_checkpoint", "latest"]
    )


def resume_training(accelerator, resume, args, scheduler, total_steps):
    """Restore model, optimizer, scheduler and RNG states from `resume`'s checkpoint (checkpoint_to_resume's
    (checkpoint, its state), or None: a new run); where the run stands.

    The learning rate schedule is this launch's: with another --lr, --max_steps or --epochs than the
    checkpoint's, the run goes on from the checkpoint's step at the rate the new schedule (warmup and decay
    over the new total) gives there, as a run launched with these values would have reached it."""
    if resume is None:
        return Progress()
    checkpoint, state = resume
    if total_steps == state["global_step"] and (Path(args.output_dir) / "final").is_dir():
        accelerator.print(f"{args.output_dir} is complete at step {total_steps}: its model is in final/.")
        accelerator.end_training()
        sys.exit(0)  # a requeue of a finished run: nothing to redo, and final/ stays as it was saved
    if total_steps < state["global_step"]:
        fail(
            f"{checkpoint} is at step {state['global_step']}, past this launch's {total_steps} steps "
            "(--max_steps, or --epochs). Launch with --max_steps of at least that many."
        )
    accelerator.load_state(str(checkpoint))
    progress = Progress(**{field.name: state[field.name] for field in dataclasses.fields(Progress)})
    accelerator.print(
        f"resumed from {checkpoint}: step {progress.global_step}, epoch {progress.epoch}, "
        f"batch {progress.batches_done}"
    )
    set_peak_learning_rate(scheduler, args.lr)  # load_state restored the checkpoint's schedule
    if changed := [k for k in ("lr", "max_steps", "epochs") if getattr(args, k) != state["args"][k]]:
        now = ", ".join(f"--{k} {getattr(args, k)}" for k in changed)
        was = ", ".join(f"--{k} {state['args'][k]}" for k in changed)
        accelerator.print(
            f"{now} instead of the checkpoint's {was}: the learning rate follows the schedule of "
            f"{total_steps} steps at {args.lr} from here on, {scheduler.get_last_lr()[0]:.3g} at this step"
        )
    return progress


def set_peak_learning_rate(scheduler, learning_rate):
    """Rescale the schedule to another peak rate at the step it has reached (load_state restored the
    checkpoint's rates into the optimizer and the scheduler)."""
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = learning_rate
    scheduler.last_epoch -= 1
    scheduler.step()  # recomputes every group's rate from base_lrs, at the same point of the schedule


def checkpoint_state(progress, derived, args, wandb_run_id, facts):
    """What a checkpoint's trainer_state.json holds: where the run stands, and what launched it."""
    return dataclasses.asdict(progress) | {
        "launch": facts,
        "processes": derived["processes"],
        "args": vars(args),
        "wandb_run_id": wandb_run_id,  # a run resumed from this checkpoint continues it
    }


def check_weights_finite(accelerator, model, streak, progress):
    """Stop before a checkpoint of weights that are not finite (a step that overflowed them): `latest` would
    resume into it. Each process checks its own (under ZeRO-3 and FSDP2 its shard), one all-reduce."""
    local = [
        p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p) for p in model.parameters()
    ]
    finite = [torch.isfinite(part).all() for part in local]
    bad = (~torch.stack(finite).all()).float().to(accelerator.device)
    if accelerator.reduce(bad, "max").item():
        where = streak.where_to_resume()
        fail(f"after step {progress.global_step} the weights are no longer finite: not saved. {where}.")


def save_checkpoint(accelerator, checkpoints_dir, trainer_state, total_limit):
    """accelerator.save_state into step_<N>.partial, renamed to step_<N> once every process has written and
    the files are on disk: a folder named step_<N> is always complete.

    Each machine's local main process publishes its own folder, the global main process first: on a shared
    file system the others then find the work done; with --save_on_each_node each completes its own copy.
    """
    final = checkpoints_dir / f"step_{trainer_state['global_step']}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_local_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    for turn_of_main in (True, False):
        its_turn = accelerator.is_main_process if turn_of_main else not accelerator.is_main_process
        if its_turn and accelerator.is_local_main_process and partial.exists():
            (partial / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            # On disk before the rename: else a power cut could leave a step_<N> with empty files.
            for path in [*partial.rglob("*"), partial]:
                flush_to_disk(path)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)  # atomic on one file system
            flush_to_disk(checkpoints_dir)  # the rename itself
            for old in complete_checkpoints(checkpoints_dir)[:-total_limit] if total_limit else []:
                shutil.rmtree(old)  # only once the newer one is complete
        accelerator.wait_for_everyone()
    return final


def flush_to_disk(path):
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def complete_checkpoints(checkpoints_dir):
    """step_<N> folders, oldest first; a step_<N>.partial left by a crash is never one of them."""
    complete = [p for p in checkpoints_dir.glob("step_*") if p.name[5:].isdigit()]
    return sorted(complete, key=lambda p: int(p.name[5:]))


def latest_checkpoint(checkpoints_dir):
    return next(reversed(complete_checkpoints(checkpoints_dir)), None)
