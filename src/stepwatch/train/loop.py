"""The training run: epochs, the training epoch with its fast path, and the evaluation pass.

``Model`` checks the arguments and hands the loop its parts (:class:`Parts`) and what to run
(:class:`RunPlan`); the loop never imports ``Model``. Where a resumed run continues comes from
:mod:`stepwatch.train.resume`.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..dataset import (
    ContinuingBatches,
    check_batch,
    dataset_size,
    feed,
    move,
    set_epoch,
    split_loss,
)
from ..distributed import rank_and_world
from .callback._callback import CallbackList, CallbackParams, RunContext
from .resume import find_resume_point, rng_state, set_rng_state, skip_then_restore

__all__ = ["Parts", "RunPlan", "eval_pass", "new_cb_params", "run"]

logger = logging.getLogger("stepwatch")

# Step losses are folded into the epoch sum in chunks: one stack+sum per chunk keeps the
# per-step cost to a list append and never waits for the device.
_LOSS_CHUNK = 256


@dataclass
class Parts:
    """What the loop trains and evaluates with (a ``Model`` hands over its own)."""

    network: nn.Module
    loss_fn: Any
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    metrics: dict[str, Any]
    eval_network: nn.Module
    # Training-batch metrics accumulate in their own copies so validation never mixes in.
    train_metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def train_network(self) -> nn.Module:
        return self.network


@dataclass
class RunPlan:
    """One ``train``/``fit`` call, its arguments checked."""

    epoch: int
    train_dataset: Iterable[Any]
    callbacks: CallbackList
    batch_num: int
    valid_dataset: Iterable[Any] | None = None
    valid_frequency: int | list[int] = 1
    dataset_sink_mode: bool = False
    sink_size: int = -1
    initial_epoch: int = 0
    resume_from: Any = None


def _fold(total: torch.Tensor | None, pending: list[torch.Tensor]) -> torch.Tensor | None:
    if not pending:
        return total
    chunk = torch.stack(pending).float().sum()
    pending.clear()
    return chunk if total is None else total + chunk


def _to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _evaluate(name: str, metric: Any) -> Any:
    """``metric.eval()`` as a Python value; an error names the metric, as a callback's does."""
    try:
        return _to_python(metric.eval())
    except BaseException as exc:
        exc.add_note(f"(raised in metric {name!r}, {type(metric).__name__}.eval)")
        raise


def should_eval(epoch_number: int, valid_frequency: int | list[int]) -> bool:
    if isinstance(valid_frequency, list):
        return epoch_number in valid_frequency
    return epoch_number % valid_frequency == 0


def new_cb_params(parts: Parts, cb_list: CallbackList, rank: int, world: int) -> CallbackParams:
    """The cb_params every run starts from (mode ``'eval'``; a training run switches it)."""
    return CallbackParams(
        train_network=parts.network,
        network=parts.network,
        eval_network=parts.eval_network,
        loss_fn=parts.loss_fn,
        optimizer=parts.optimizer,
        metrics=parts.metrics,
        device=parts.device,
        rank_id=rank,
        device_number=world,
        parallel_mode="data_parallel" if world > 1 else "stand_alone",
        list_callback=cb_list,
        mode="eval",
        cur_step_num=0,
        cur_epoch_num=0,
        last_save_ckpt_step=None,
        latest_ckpt_file=None,
        step_time=0.0,
    )


def run(parts: Parts, plan: RunPlan) -> None:
    """Train (and validate, in ``fit``) as ``plan`` says, calling the callbacks' hooks."""
    epoch, initial_epoch = plan.epoch, plan.initial_epoch
    cb_list, train_dataset, valid_dataset = plan.callbacks, plan.train_dataset, plan.valid_dataset
    sinking = plan.dataset_sink_mode and plan.sink_size > 0
    steps_per_epoch = plan.sink_size if sinking else plan.batch_num
    rank, world = rank_and_world()

    cb_params = new_cb_params(parts, cb_list, rank, world)
    cb_params.mode = "train"
    cb_params.epoch_num = epoch - initial_epoch
    cb_params.initial_epoch = initial_epoch
    cb_params.batch_num = steps_per_epoch
    cb_params.initial_step = initial_epoch * steps_per_epoch
    cb_params.cur_step_num = cb_params.initial_step
    cb_params.cur_epoch_num = initial_epoch
    cb_params.train_dataset = train_dataset
    cb_params.dataset_sink_mode = plan.dataset_sink_mode
    cb_params.train_dataset_element = None  # MindSpore has the field (None) before step 1
    if valid_dataset is not None:
        cb_params.valid_dataset = valid_dataset
    run_context = RunContext(cb_params)
    source = ContinuingBatches(train_dataset) if sinking else None

    resume = find_resume_point(
        plan.resume_from, cb_list, parts, epoch, steps_per_epoch, train_dataset
    )
    skip = 0
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
        cb_params.epoch_num = epoch - initial_epoch
        cb_params.initial_epoch = initial_epoch
        cb_params.initial_step = resume.step - skip
        # Steps continue from the checkpoint; the skipped batches were trained before it.
        cb_params.cur_step_num = resume.step
        cb_params.cur_epoch_num = initial_epoch

    progress = cb_params.progress
    progress.trained_step = cb_params.cur_step_num
    metric_names = list(parts.metrics)
    warned_nonfinite = False
    with cb_list.entered():
        cb_list.call("on_train_begin", run_context)
        if resume is not None:
            # After on_train_begin, which resets callbacks: the saved state wins.
            cb_list.load_state_dicts(resume.callback_states, f"checkpoint {resume.path!r}")
        for epoch_index in range(initial_epoch, epoch):
            cb_params.cur_epoch_num = epoch_index + 1
            cb_params.loss = None
            if skip:
                assert resume is not None and resume.epoch_rng is not None
                set_rng_state(resume.epoch_rng, train_dataset)
            progress.epoch_start_rng = rng_state(train_dataset)
            set_epoch(train_dataset, epoch_index)
            cb_list.call("on_train_epoch_begin", run_context)
            batches: Iterable[Any] = (
                itertools.islice(source, steps_per_epoch) if source is not None else train_dataset
            )
            if skip:
                assert resume is not None
                batches = skip_then_restore(batches, skip, resume.rng, train_dataset)
                skip = 0
            train_results = train_epoch(parts, batches, cb_list, cb_params, run_context)
            cb_params.train_results = train_results
            cb_params.loss = train_results.get("loss")
            shown = [name for name in train_results if name != "loss"]
            for name in shown:
                setattr(cb_params, name, train_results[name])
            if valid_dataset is not None and should_eval(epoch_index + 1, plan.valid_frequency):
                eval_in_fit(parts, valid_dataset, cb_list, cb_params, run_context, metric_names)
            cb_list.call("on_train_epoch_end", run_context)
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
            cb_params.__dict__.pop("eval_results", None)
            if run_context.stop_requested:
                break
        cb_list.call("on_train_end", run_context)
    if run_context.stop_requested:
        reason = run_context.stop_reason or "a callback requested a stop"
        logger.info(
            "training stopped at epoch %d, step %d: %s",
            cb_params.cur_epoch_num,
            cb_params.cur_step_num,
            reason,
        )


def train_epoch(
    parts: Parts,
    batches: Iterable[Any],
    cb_list: CallbackList,
    cb_params: CallbackParams,
    run_context: RunContext,
) -> dict[str, Any]:
    """Train on ``batches`` once; return the epoch's mean loss and training metrics.

    Invariants the callbacks and checkpoints rely on:

    * Nothing here reads a value back from the device per step: step losses are kept as
      detached tensors and summed in chunks; the one host read is the epoch mean at the end.
    * Gradients are zeroed at the *start* of a step, so step-end hooks can read ``.grad``.
    * ``cb_params.progress.trained_step`` is the last step whose optimizer update finished;
      a step that raises half-way is not counted (a breakpoint checkpoint resumes at it).
    * With no step hooks, cb_params' per-step fields (``cur_step_num``, ``loss_tensor``,
      ``outputs``, ``train_dataset_element``, ``step_time``) are set once after the loop:
      nobody can look at them during the epoch, so the loop does only the training.
    * ``step_time`` covers loading the batch, the step-begin hooks and the step, not the
      step-end hooks.
    * A stop requested in a step hook ends the epoch after that step.
    """
    network, loss_fn, optimizer, device = (
        parts.network,
        parts.loss_fn,
        parts.optimizer,
        parts.device,
    )
    assert optimizer is not None
    step_begin = cb_list.fns["on_train_step_begin"]
    step_end = cb_list.fns["on_train_step_end"]
    train_metrics = list(parts.train_metrics.values()) if loss_fn is not None else []
    for metric in train_metrics:
        metric.clear()
    pending: list[torch.Tensor] = []
    total: torch.Tensor | None = None
    first_step = step = cb_params.cur_step_num
    progress = cb_params.progress
    perf_counter = time.perf_counter
    network.train()
    on_cpu = device.type == "cpu"
    tensor = torch.Tensor
    hooked = bool(step_begin or step_end)
    epoch_start = last_step_end = perf_counter()
    batch: Any = None
    detached: Any = None
    outputs: Any = None
    try:
        for batch in batches:
            step += 1
            if hooked:
                cb_params.cur_step_num = step
                cb_params.train_dataset_element = batch
                for fn in step_begin:
                    fn(run_context)
            # Zero at the start of the step so step-end hooks can still read the gradients.
            optimizer.zero_grad(set_to_none=True)
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
                outputs = network(data) if type(data) is tensor else feed(network, data)
                loss = loss_fn(outputs, label)
            else:
                loss, outputs = split_loss(feed(network, move(batch, device)))
            loss.backward()
            optimizer.step()
            detached = loss.detach()
            pending.append(detached)
            if len(pending) == _LOSS_CHUNK:
                total = _fold(total, pending)
            if train_metrics:
                for metric in train_metrics:
                    metric.update(outputs, label)
            if hooked:
                cb_params.step_time = perf_counter() - last_step_end
                progress.trained_step = step
                cb_params.loss_tensor = detached
                cb_params.outputs = outputs.detach() if type(outputs) is tensor else outputs
                for fn in step_end:
                    fn(run_context)
                last_step_end = perf_counter()  # the hooks' time is not the next step's
                if run_context.stop_requested:
                    break
    except BaseException as exc:
        cb_list.annotate(exc)  # names the callback, if one raised it
        raise
    steps = step - first_step
    if steps and not hooked:
        cb_params.cur_step_num = progress.trained_step = step
        cb_params.train_dataset_element = batch
        cb_params.step_time = (perf_counter() - epoch_start) / steps
        cb_params.loss_tensor = detached
        cb_params.outputs = outputs.detach() if type(outputs) is tensor else outputs
    total = _fold(total, pending)
    results: dict[str, Any] = {}
    if total is not None and steps:
        results["loss"] = float(total) / steps
    for name, metric in parts.train_metrics.items():
        if loss_fn is not None and steps:
            results[name] = _evaluate(name, metric)
    return results


def eval_in_fit(
    parts: Parts,
    valid_dataset: Iterable[Any],
    cb_list: CallbackList,
    cb_params: CallbackParams,
    run_context: RunContext,
    metric_names: list[str],
) -> None:
    """Validate inside ``fit``: the same cb_params, switched to the evaluation and back."""
    batch_num = dataset_size(valid_dataset, "valid_dataset")
    with cb_params.evaluating(batch_num, hide=metric_names):
        eval_pass(parts, valid_dataset, batch_num, cb_list, cb_params, run_context)


def eval_pass(
    parts: Parts,
    dataset: Iterable[Any],
    batch_num: int,
    cb_list: CallbackList,
    cb_params: CallbackParams,
    run_context: RunContext,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluate the metrics on ``dataset``; return ``(metrics, eval_results)``.

    From ``on_eval_epoch_end`` on, cb_params shows this pass's own values: each metric as an
    attribute and ``loss`` as the pass's mean loss; ``eval_results`` (the metrics plus
    ``eval_loss``) is set before ``on_eval_end``.
    """
    network = parts.eval_network
    loss_fn, device = parts.loss_fn, parts.device
    cb_params.mode = "eval"
    cb_params.valid_dataset = dataset
    cb_params.batch_num = batch_num
    step_begin = cb_list.table["on_eval_step_begin"]
    step_end = cb_list.table["on_eval_step_end"]
    call = cb_list.call
    metric_items = list(parts.metrics.values())
    for metric in metric_items:
        metric.clear()
    pending: list[torch.Tensor] = []
    total: torch.Tensor | None = None
    steps = 0
    was_training = network.training
    network.eval()
    try:
        call("on_eval_begin", run_context)
        call("on_eval_epoch_begin", run_context)
        with torch.no_grad():
            for batch in dataset:
                steps += 1
                cb_params.cur_step_num = steps
                cb_params.eval_dataset_element = batch
                if step_begin:
                    call("on_eval_step_begin", run_context)
                try:
                    data, label = batch
                except (TypeError, ValueError):
                    check_batch(batch, "valid_dataset", loss_fn is not None)
                    raise
                data, label = move(data, device), move(label, device)
                outputs = feed(network, data)
                loss = loss_fn(outputs, label) if loss_fn is not None else None
                for metric in metric_items:
                    if getattr(metric, "uses_loss", False):
                        if loss is not None:
                            metric.update(loss)
                    else:
                        metric.update(outputs, label)
                if loss is not None:
                    pending.append(loss)
                    if len(pending) == _LOSS_CHUNK:
                        total = _fold(total, pending)
                cb_params.loss_tensor = loss
                cb_params.outputs = outputs  # computed under no_grad: no graph
                if step_end:
                    call("on_eval_step_end", run_context)
        metrics = {name: _evaluate(name, m) for name, m in parts.metrics.items()}
        results = dict(metrics)
        cb_params.metrics = metrics  # from here on the values, as MindSpore has them
        total = _fold(total, pending)
        if total is not None and steps:
            results["eval_loss"] = float(total) / steps
        for name, value in metrics.items():
            if name != "loss":
                setattr(cb_params, name, value)
        cb_params.loss = results.get("eval_loss")
        call("on_eval_epoch_end", run_context)
        cb_params.eval_results = results
        call("on_eval_end", run_context)
    finally:
        network.train(was_training)
    return metrics, results
