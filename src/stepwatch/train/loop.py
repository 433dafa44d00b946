"""The training run: epochs, the training epoch with its fast path, and the evaluation pass.

``Model`` checks the arguments and hands the loop its parts (:class:`Parts`) and what to run
(:class:`RunPlan`); the loop never imports ``Model``. Where a resumed run continues comes from
:mod:`stepwatch.train.resume`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..dataset import (
    ContinuingBatches,
    check_batch,
    feed,
    move,
    set_epoch,
    split_loss,
)
from ..distributed import rank_and_world
from .engine import RunEngine, torch_controls
from .evaluate import eval_in_fit
from .parallel import epoch_results
from .parts import Parts, RunPlan, evaluate_metric
from .resume import find_resume_point, skip_then_restore
from .sharded import full_value  # a sharded network's norm is a DTensor
from .state import rng_state, set_rng_state
from .step import cast_floats, found_inf

__all__ = ["run", "train_epoch"]

logger = logging.getLogger("stepwatch")


def should_eval(epoch_number: int, valid_frequency: int | list[int]) -> bool:
    if isinstance(valid_frequency, list):
        return epoch_number in valid_frequency
    return epoch_number % valid_frequency == 0


def run(parts: Parts, plan: RunPlan) -> None:
    """Train (and validate, in ``fit``) as ``plan`` says, driving a :class:`RunEngine`."""
    epoch, initial_epoch = plan.epoch, plan.initial_epoch
    cb_list, train_dataset, valid_dataset = plan.callbacks, plan.train_dataset, plan.valid_dataset
    sinking = plan.dataset_sink_mode and plan.sink_size > 0
    steps_per_epoch = plan.sink_size if sinking else plan.batch_num
    rank, world = rank_and_world()
    resume = find_resume_point(
        plan.resume_from, cb_list, parts, epoch, steps_per_epoch, train_dataset
    )
    skip = 0
    initial_step = initial_epoch * steps_per_epoch
    if resume is not None:
        initial_epoch, skip = resume.initial_epoch, resume.skip
        if initial_epoch >= epoch:
            logger.info(
                "nothing to train: the checkpoint is at epoch %d of %d", initial_epoch, epoch
            )
            done = getattr(resume.owner, "resume_complete", None)
            if callable(done):
                done()  # e.g. BackupAndRestore deletes a backup that has nothing left to do
            return
        initial_step = resume.step  # steps continue from the checkpoint
    controls = torch_controls(
        "stepwatch",
        parts.network,
        parts.optimizer,
        lr_scheduler=parts.lr_scheduler,
        loss_scaler=parts.loss_scaler,
        dataset=train_dataset,
    )
    engine = RunEngine(
        cb_list,
        controls,
        parts=parts,
        epochs=epoch - initial_epoch,
        steps_per_epoch=steps_per_epoch,
        initial_step=initial_step,
        initial_epoch=initial_epoch,
        dataset=train_dataset,
        valid_dataset=valid_dataset,
        rank=rank,
        world=world,
    )
    cb_params, run_context = engine.cb_params, engine.run_context
    cb_params.dataset_sink_mode = plan.dataset_sink_mode
    if resume is not None:
        # The skipped batches of the checkpoint's epoch were trained before it.
        cb_params.initial_step = resume.step - skip
        cb_params.progress.skipped_steps = int(resume.state.get("skipped_steps", 0))
    source = ContinuingBatches(train_dataset) if sinking else None
    metric_names = list(parts.metrics)
    warned_nonfinite = False
    engine.open(
        resume.callback_states if resume is not None else None,
        f"checkpoint {resume.path!r}" if resume is not None else "",
    )
    try:
        for epoch_index in range(initial_epoch, epoch):
            if skip:
                assert resume is not None and resume.epoch_rng is not None
                set_rng_state(resume.epoch_rng, train_dataset)
            cb_params.progress.epoch_start_rng = rng_state(train_dataset)
            set_epoch(train_dataset, epoch_index)
            engine.begin_epoch()
            batches: Iterable[Any] = (
                itertools.islice(source, steps_per_epoch) if source is not None else train_dataset
            )
            if skip:
                assert resume is not None
                batches = skip_then_restore(batches, skip, resume.rng, train_dataset)
                skip = 0
            train_results = train_epoch(parts, batches, engine)
            shown = [name for name in train_results if name != "loss"]
            for name in shown:  # as MindSpore: the training metrics on cb_params at the end
                setattr(cb_params, name, train_results[name])

            validate = None
            if valid_dataset is not None and should_eval(epoch_index + 1, plan.valid_frequency):
                validate = functools.partial(
                    eval_in_fit, parts, valid_dataset, cb_list, cb_params, run_context, metric_names
                )
            engine.end_epoch(train_results, evaluate=validate)
            scheduler = parts.step.lr_scheduler
            if scheduler is not None and parts.step.lr_interval == "epoch" and train_results:
                scheduler.step()  # after the epoch's callbacks, so they saw this epoch's LR
            if scheduler is not None:
                _check_rates(scheduler, parts.optimizer, epoch_index + 1)
            epoch_loss = train_results.get("loss")
            # Nobody acted on a diverged loss (a monitor would have raised or stopped the run):
            # say so once. The epoch mean was read anyway, so this costs no sync.
            if (
                epoch_loss is not None
                and not math.isfinite(epoch_loss)
                and not warned_nonfinite
                and run_context.stop_kind != "anomaly"
            ):
                warned_nonfinite = True
                warnings.warn(
                    f"the training loss of epoch {epoch_index + 1} is {epoch_loss}: training has "
                    "diverged and goes on. Lower the learning rate, or stop such runs with "
                    "LossMonitor (it raises on a NaN/Inf loss).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            for name in shown:
                cb_params.__dict__.pop(name, None)
            if run_context.stop_requested:
                break
    except BaseException as exc:
        engine.close(exc)
        raise
    engine.close()


def train_epoch(parts: Parts, batches: Iterable[Any], engine: RunEngine) -> dict[str, Any]:
    """Train on ``batches`` once; return the epoch's mean loss and training metrics.

    This is :meth:`RunEngine.step <stepwatch.train.engine.RunEngine.step>` inlined around
    the training step, on the hot path: the same loss tap, the same looks and hooks.

    Invariants the callbacks and checkpoints rely on:

    * Nothing here reads a value back from an accelerator per step: step losses go into the
      run view's loss tap (a CPU loss as a float, any other as a detached tensor), which sums
      them in chunks (and hands the chunks to the monitors that read them); the one host
      read is the epoch mean at the end.
      (The one exception, documented: with loss scaling and a per-step LR schedule, each
      optimizer step reads whether it was skipped, so a skipped step does not advance it.)
    * Gradients are zeroed at the *start* of a step (of an accumulation window), so step-end
      hooks can read ``.grad``.
    * ``cb_params.progress.trained_step`` is the last step whose backward (and, at a window's
      end, optimizer update) finished; a step that raises half-way is not counted.
    * With no step hook that runs every step (the step-end hooks of built-ins marked
      ``on_clock``, such as LossMonitor's, run only where the clock wakes), cb_params'
      per-step fields (``cur_step_num``, ``loss_tensor``, ``outputs``,
      ``train_dataset_element``, ``step_time``) are set only at the steps where the tap's
      clock wakes a monitor (:meth:`~stepwatch.view.tap.LossTap.call_at`, a chunk due) and
      once after the loop: nobody else can look at them during the epoch, so the loop does
      only the training and one comparison.
    * ``step_time`` covers loading the batch, the step-begin hooks and the step, not the
      step-end hooks or the tap's calls; at a step that only the clock sees, it is the mean
      over the steps since the last one seen.
    * The plain fp32 step (no autocast, scaling, clipping, accumulation or schedule) takes the
      shortest path; the other options add only their own work.
    * A stop requested in a step hook ends the epoch after that step.
    * In a distributed run the only collectives are DistributedDataParallel's gradient
      all-reduce (skipped on the batches of an accumulation window that do not step) and,
      after the last step, one all-reduce of the loss sum, step count and training metrics.
    """
    network, loss_fn, optimizer, device = (
        parts.network,
        parts.loss_fn,
        parts.optimizer,
        parts.device,
    )
    assert optimizer is not None
    cb_list, cb_params, run_context = engine.callbacks, engine.cb_params, engine.run_context
    opts = parts.step
    forward = opts.forward_network if opts.forward_network is not None else network
    if parts.ddp is not None and cb_params.device_number > 1:
        forward = parts.ddp  # DistributedDataParallel: backward averages the gradients
    plain = opts.plain
    scaler = opts.scaler
    grad_scaler = scaler if isinstance(scaler, torch.amp.GradScaler) else None
    accumulate = opts.accumulate
    clip_norm, clip_value = opts.clip_grad_norm, opts.clip_grad_value
    scheduler = opts.lr_scheduler if opts.lr_interval == "step" else None
    amp = opts.autocast(device)
    use_amp = opts.precision.autocast
    simple_step = scaler is None and clip_norm is None and clip_value is None and scheduler is None
    cast = opts.precision.dtype if opts.precision.cast_network else None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    no_sync = getattr(forward, "no_sync", None)  # DDP: skip the all-reduce mid-window
    batch_num = cb_params.batch_num
    step_begin = cb_list.fns["on_train_step_begin"]
    step_end = cb_list.fns["on_train_step_end"]
    train_metrics = list(parts.train_metrics.values()) if loss_fn is not None else []
    for metric in train_metrics:
        metric.clear()
    first_step = step = cb_params.cur_step_num
    tap = engine.view.tap
    pending = tap.pending
    progress = cb_params.progress
    perf_counter = time.perf_counter
    network.train()
    on_cpu = device.type == "cpu"
    tensor = torch.Tensor
    hooked = cb_list.every_step  # else the step-end hooks run where the clock wakes
    # The first step of a compiled network includes the compile: timed on its own.
    time_first = opts.forward_network is not None and "compile_seconds" not in cb_params
    epoch_start = last_step_end = perf_counter()
    last_step = step  # the last step whose fields were set (a hook or a tick saw it)
    batch: Any = None
    loss: Any = None
    outputs: Any = None
    grad_norm: Any = None
    stepping = True
    try:
        for batch in batches:
            step += 1
            if hooked:
                cb_params.cur_step_num = step
                cb_params.train_dataset_element = batch
                for fn in step_begin:
                    fn(run_context)
            if plain:
                # Zero at the start of the step so step-end hooks can still read the gradients.
                optimizer.zero_grad(set_to_none=True)
            else:
                index = (step - 1) % batch_num
                stepping = (index + 1) % accumulate == 0 or index + 1 == batch_num
                if index % accumulate == 0:
                    optimizer.zero_grad(set_to_none=True)  # the start of a window
            if loss_fn is not None:
                try:
                    data, label = batch
                except (TypeError, ValueError):
                    check_batch(batch, "train_dataset", True)
                    raise
                # Plain CPU tensors on a CPU run need no copy: skip the .to() calls.
                if not (on_cpu and type(data) is tensor and data.is_cpu):
                    data = move(data, device)
                if not (on_cpu and type(label) is tensor and label.is_cpu):
                    label = move(label, device)
                if cast is not None:
                    data = cast_floats(data, cast)
                if use_amp:
                    with amp:
                        outputs = forward(data) if type(data) is tensor else feed(forward, data)
                        loss = loss_fn(outputs, label)
                else:
                    outputs = forward(data) if type(data) is tensor else feed(forward, data)
                    loss = loss_fn(outputs, label)
            else:
                inputs = move(batch, device)
                if cast is not None:
                    inputs = cast_floats(inputs, cast)
                with amp:  # a no-op context without mixed precision
                    loss, outputs = split_loss(feed(forward, inputs))
            if plain:
                loss.backward()
                optimizer.step()
            else:
                scaled = loss / accumulate if accumulate > 1 else loss
                if scaler is not None:
                    scaled = scaler.scale(scaled)
                if stepping or no_sync is None:
                    scaled.backward()
                else:
                    with no_sync():
                        scaled.backward()
                if stepping and simple_step:
                    optimizer.step()
                elif stepping:
                    grad_norm = _optimizer_step(
                        optimizer,
                        params,
                        scaler,
                        grad_scaler,
                        clip_norm,
                        clip_value,
                        progress,
                        scheduler,
                    )
            # A plain CPU loss is read at once: that waits for nothing and keeps no tensor
            # alive; one above the tap's alarm (or NaN) wakes it now. Any other loss (an
            # accelerator's, a tensor subclass) goes in unread. (LossTap.push, inlined: this is
            # the hot path.)
            if type(loss) is tensor and loss.is_cpu:
                value = loss.item()
                pending.append(value)
                if not value <= tap.alarm:
                    tap.alarmed()
            else:
                pending.append(loss.detach())
            if train_metrics:
                for metric in train_metrics:
                    metric.update(outputs, label)
            if time_first:
                time_first = False
                cb_params.compile_seconds = perf_counter() - last_step_end
            if hooked or step >= tap.wake:
                if not hooked:
                    cb_params.cur_step_num = step
                    cb_params.train_dataset_element = batch
                # Since the last step a hook or a tick saw: this one, or a mean over several.
                cb_params.step_time = (perf_counter() - last_step_end) / (step - last_step)
                progress.trained_step = last_step = step
                cb_params.loss_tensor = loss.detach()
                cb_params.outputs = outputs.detach() if type(outputs) is tensor else outputs
                if not plain:
                    cb_params.optimizer_stepped = stepping
                    cb_params.grad_norm = grad_norm if stepping else None
                if step >= tap.wake:
                    tap.tick()  # the monitors' looks asked for at this step
                for fn in step_end:
                    fn(run_context)
                last_step_end = perf_counter()  # the hooks' time is not the next step's
                if run_context.stop_requested:
                    break
    except BaseException as exc:
        cb_list.annotate(exc)  # names the callback, if one raised it
        raise
    steps = step - first_step
    if steps and not hooked and last_step < step:
        cb_params.cur_step_num = progress.trained_step = step
        cb_params.train_dataset_element = batch
        cb_params.step_time = (perf_counter() - epoch_start) / steps
        cb_params.loss_tensor = loss.detach()
        cb_params.outputs = outputs.detach() if type(outputs) is tensor else outputs
        if not plain:
            cb_params.optimizer_stepped = stepping
            cb_params.grad_norm = grad_norm if stepping else None
    engine.took(step)
    total = tap.end_epoch()
    if cb_params.device_number > 1:
        return epoch_results(parts, total, steps)  # one collective: global loss and metrics
    results: dict[str, Any] = {}
    if total is not None and steps:
        results["loss"] = float(total) / steps
    for name, metric in parts.train_metrics.items():
        if loss_fn is not None and steps:
            results[name] = evaluate_metric(name, metric)
    return results


def _optimizer_step(
    optimizer: Any,
    params: list[Any],
    scaler: Any,
    grad_scaler: Any,
    clip_norm: float | None,
    clip_value: float | None,
    progress: Any,
    scheduler: Any,
) -> Any:
    """Unscale, clip, step (skipping an overflowed step under a GradScaler), advance the
    per-step LR schedule; return the pre-clip gradient norm (a device tensor) or None."""
    grad_norm = None
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_norm is not None:
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(params, clip_norm, foreach=True))
    elif clip_value is not None:
        torch.nn.utils.clip_grad_value_(params, clip_value, foreach=True)
    overflow = None
    if grad_scaler is not None:
        overflow = found_inf(grad_scaler, optimizer)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        if overflow is not None:
            progress.skipped_steps = overflow + progress.skipped_steps  # stays on the device
    else:
        optimizer.step()
    if scheduler is not None and (overflow is None or not bool(overflow)):
        scheduler.step()  # after the optimizer step; a skipped step does not advance it
    return grad_norm


def _check_rates(scheduler: Any, optimizer: Any, epoch: int) -> None:
    """A schedule that set a negative or NaN learning rate is an error, once an epoch (where
    reading the rates costs nothing): torch's optimizers accept it and train on silently."""
    for i, group in enumerate(optimizer.param_groups):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            continue  # a tensor rate (capturable optimizers): not read, to stay off the device
        if not (lr >= 0 and math.isfinite(lr)):
            raise ValueError(
                f"the lr_scheduler {type(scheduler).__name__} set parameter group {i}'s learning "
                f"rate to {lr} by the end of epoch {epoch}; a learning rate must be a finite "
                "number >= 0. Check its settings (a lambda returning a negative factor?)."
            )
