"""Test doubles for train.py, chosen by environment variables (tests/test_reliability.py).

tests/test_reliability.py puts this folder first on PYTHONPATH, so every Python process it launches imports
this module at start-up. Without a GRADCACHE_FAULT_* variable it does nothing.

  GRADCACHE_FAULT_KILL=<before|during|after>:<n>   SIGKILL at the n-th checkpoint: before it is written,
                                                   half-way through (model written, optimizer not), or
                                                   right after it is published
  GRADCACHE_FAULT_NAN=<b>[,<b>...]                 a NaN loss at these gradcache steps (1-based count;
                                                   group_step's steps count alike)
  GRADCACHE_FAULT_INF=<b>[,<b>...]                 infinite parameter gradients at these steps
  GRADCACHE_FAULT_OOM_ABOVE=<n>                    chunks over n examples raise torch.OutOfMemoryError in
                                                   their backward, as a GPU would
  GRADCACHE_FAULT_OOM_SYNC=1                       the backward that synchronizes the processes raises
                                                   torch.OutOfMemoryError (where the others already wait)
  GRADCACHE_FAULT_OOM_FORWARD=<n>                  the n-th forward of the run raises torch.OutOfMemoryError
  GRADCACHE_FAULT_SIGNAL=<SIGTERM|SIGINT>:<n>      that signal to this process at the n-th step, and again
                                                   while the checkpoint it leads to is written
  GRADCACHE_FAULT_SIGNAL_LAUNCHER=<n>:<seconds>    SIGTERM to the launcher (this process's parent) at the
                                                   n-th step, whose every later backward then takes that
                                                   much longer: a step longer than the launcher's grace
  GRADCACHE_FAULT_RANK=<r>                         only process r is faulty (default: all)

Not a fault but a stand-in, on every process:
  GRADCACHE_FP16_SCALER=<initial scale>            accelerate's real fp16 path on a CPU: float16 autocast and
                                                   torch.amp.GradScaler("cpu") starting at this scale, where
                                                   accelerate itself would train in fp32; on a GPU,
                                                   accelerate's own GradScaler, starting at this scale
"""

import os
import signal
import time

FAULTS = {k: v for k, v in os.environ.items() if k.startswith("GRADCACHE_FAULT_")}


def this_rank_is_faulty():
    return FAULTS.get("GRADCACHE_FAULT_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0")


def steps(name):
    return {int(b) for b in FAULTS.get(name, "").split(",") if b}


def kill():
    os.kill(os.getpid(), 9)


def install_kill(point, nth):
    import accelerate
    import torch

    save_state, replace = accelerate.Accelerator.save_state, os.replace
    calls = {"save_state": 0, "published": 0}

    def killing_save_state(self, *args, **kwargs):
        calls["save_state"] += 1
        if calls["save_state"] == nth and point == "before":
            kill()
        if calls["save_state"] == nth and point == "during":
            torch.save = lambda *a, **k: kill()  # accelerate writes the optimizer with torch.save
        return save_state(self, *args, **kwargs)

    def killing_replace(source, destination, *args, **kwargs):
        replace(source, destination, *args, **kwargs)
        if os.path.basename(str(destination)).startswith("step_"):
            calls["published"] += 1
            if calls["published"] == nth and point == "after":
                kill()

    accelerate.Accelerator.save_state = killing_save_state
    os.replace = killing_replace


def install_fp16_scaler(initial_scale):
    """On a GPU, accelerate's GradScaler with this initial scale. On a CPU, after accelerate's own set-up,
    what it does for fp16 on a GPU (accelerator.py, "Mixed precision attributes") with torch's CPU scaler."""
    import accelerate
    import torch

    setup = accelerate.Accelerator.__init__

    def fp16_setup(self, *args, **kwargs):
        if torch.cuda.is_available():
            handlers = [
                *kwargs.pop("kwargs_handlers", []),
                accelerate.GradScalerKwargs(init_scale=initial_scale),
            ]
            return setup(self, *args, **kwargs, kwargs_handlers=handlers)
        setup(self, *args, **kwargs | {"mixed_precision": "fp16"})
        self.native_amp = True
        self.scaler = torch.amp.GradScaler("cpu", init_scale=initial_scale)

    accelerate.Accelerator.__init__ = fp16_setup


def install_step_faults():
    import accelerate
    import torch

    import gradcache

    cache, backpropagate = gradcache.cache_representation_gradients, gradcache.backpropagate_cache
    gradcache_step, group_step = gradcache.gradcache_step, gradcache.group_step
    step = {"count": 0, "forwards": 0}
    oom_above = int(FAULTS.get("GRADCACHE_FAULT_OOM_ABOVE", 0))
    oom_forward = int(FAULTS.get("GRADCACHE_FAULT_OOM_FORWARD", 0))

    def faulty_step(encoder, *args, **kwargs):
        def counting_encoder(features):
            step["forwards"] += 1
            if step["forwards"] == oom_forward:
                raise torch.OutOfMemoryError("CUDA out of memory (test double)")
            return encoder(features)

        return gradcache_step(counting_encoder, *args, **kwargs)

    def faulty_cache(*args):
        step["count"] += 1
        if step["count"] == signal_step:
            os.kill(os.getpid(), signal_number)
        if step["count"] == launcher_step:
            os.kill(os.getppid(), signal.SIGTERM)
            step["slow"] = slow_seconds
        loss, rep_grads = cache(*args)
        if step["count"] in steps("GRADCACHE_FAULT_NAN"):
            return loss * float("nan"), [g * float("nan") for g in rep_grads]
        return loss, rep_grads

    def faulty_group_step(encoders, columns, loss_fn, *args, **kwargs):
        step["count"] += 1
        if step["count"] in steps("GRADCACHE_FAULT_NAN"):
            return group_step(
                encoders,
                columns,
                lambda *reps, **options: loss_fn(*reps, **options) * float("nan"),
                *args,
                **kwargs,
            )
        return group_step(encoders, columns, loss_fn, *args, **kwargs)

    def faulty_backpropagate(group, reps, rep_grads, backward):
        time.sleep(step.get("slow", 0))
        if oom_above and max(len(chunk.index) for chunk in group) > oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        if "GRADCACHE_FAULT_OOM_SYNC" in FAULTS and accelerate.state.GradientState().sync_gradients:
            raise torch.OutOfMemoryError("CUDA out of memory (test double)")
        if step["count"] in steps("GRADCACHE_FAULT_INF"):
            return backpropagate(group, reps, rep_grads, lambda surrogate: backward(surrogate * float("inf")))
        return backpropagate(group, reps, rep_grads, backward)

    if "GRADCACHE_FAULT_SIGNAL" in FAULTS:
        name, nth = FAULTS["GRADCACHE_FAULT_SIGNAL"].split(":")
        signal_number, signal_step = getattr(signal, name), int(nth)
        save_state = accelerate.Accelerator.save_state

        def signalled_save_state(self, *args, **kwargs):
            os.kill(os.getpid(), signal_number)
            return save_state(self, *args, **kwargs)

        accelerate.Accelerator.save_state = signalled_save_state
    else:
        signal_step = 0
    launcher_step, slow_seconds = map(float, FAULTS.get("GRADCACHE_FAULT_SIGNAL_LAUNCHER", "0:0").split(":"))
    gradcache.cache_representation_gradients = faulty_cache
    gradcache.backpropagate_cache = faulty_backpropagate
    gradcache.group_step = faulty_group_step
    if oom_forward:
        gradcache.gradcache_step = faulty_step


if "GRADCACHE_FP16_SCALER" in os.environ:
    install_fp16_scaler(float(os.environ["GRADCACHE_FP16_SCALER"]))
if FAULTS and this_rank_is_faulty():
    if "GRADCACHE_FAULT_KILL" in FAULTS:
        point, nth = FAULTS["GRADCACHE_FAULT_KILL"].split(":")
        install_kill(point, int(nth))
    else:
        install_step_faults()
