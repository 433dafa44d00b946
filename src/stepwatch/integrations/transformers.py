"""stepwatch's callbacks inside the Hugging Face ``Trainer``.

Keep training with ``transformers.Trainer``; hand stepwatch's monitors to it through one
Trainer callback::

    from transformers import Trainer, TrainingArguments
    from stepwatch import AnomalyMonitor, LossMonitor, RunRecorder
    from stepwatch.integrations.transformers import StepwatchCallback

    trainer = Trainer(model=model, args=TrainingArguments("out", eval_strategy="epoch"),
                      train_dataset=train_ds, eval_dataset=eval_ds)
    watch = StepwatchCallback([RunRecorder(db="runs.db"), AnomalyMonitor(), LossMonitor(10)])
    watch.attach(trainer)  # runs in this Trainer and records its own step loss
    with watch:  # optional: a failure inside train() is stored as 'failed' right away
        trainer.train()

then ``stepwatch serve runs.db`` shows the run. The loss is the Trainer's, however it computes
it: the model's (``{'loss': ..., 'logits': ...}``, a ``ModelOutput``, or a tuple whose first
item is it), ``compute_loss_func``'s, label smoothing's or your own ``compute_loss``'s.

What the bridge reads from the Trainer:

- **the loss, without a device sync.** The Trainer hands callbacks no loss. While the Trainer
  the callback was attached to (:meth:`StepwatchCallback.attach`) trains, the bridge wraps
  its ``training_step`` (on that Trainer object only; it is
  put back when training ends, or fails inside ``with callback:``; after a failure outside it,
  at this callback's next ``train()``) and keeps what it returns for each micro-batch: the
  detached loss the Trainer adds up for its own log (a device tensor: nothing is read on quiet
  steps). The step's loss is their sum, as the Trainer adds them: the micro-batches' mean, or,
  for a model normalised over the whole accumulated batch (``num_items_in_batch``), its whole
  loss. That is the loss the Trainer logs, step by step, before its ``logging_nan_inf_filter``
  hides non-finite ones, however it was computed: by the model, ``compute_loss_func``,
  ``label_smoothing_factor`` or a ``compute_loss`` of your own.
  :meth:`StepwatchCallback.record_loss` hands over a different one. (Passed to a Trainer's
  ``callbacks`` without ``attach``, or called by something that is not a Trainer, the bridge
  reads the ``loss`` the model returns through a forward hook instead, combined the same way;
  a loss computed outside the model must then be handed over with ``record_loss``, or the run
  stops with an error naming these ways.) This reach into the Trainer is the bridge's only
  one, in ``_transformers_loss.py``, written for the releases its ``WRITTEN_FOR`` names.
- the step (``on_optimizer_step``: once per optimizer step, so one step spans all the
  gradient-accumulation micro-batches), the epoch, the steps per epoch
  (``ceil(len(train_dataloader) / gradient_accumulation_steps)``, or ``max_steps`` for a
  loader without a length) and the epochs (``num_train_epochs``, or fewer under ``max_steps``);
- **gradients**: ``on_optimizer_step`` comes after ``optimizer.step()`` and before the
  Trainer's ``zero_grad``, so gradient detectors read them there. They are the gradients the
  optimizer used: clipped to ``max_grad_norm`` (default 1.0); NaN gradients stay NaN. The
  step's global norm before clipping, as the Trainer computes it (its accelerator's
  ``clip_grad_norm_``, kept while an attached Trainer trains), is ``cb_params.grad_norm``,
  and AnomalyMonitor's explosion and non-finite detectors judge it (without ``attach``: the
  clipped gradients' norm, at most ``max_grad_norm``; set ``max_grad_norm=0`` to watch raw
  norms).
  Sharded: accelerate shards the model (``TrainingArguments(fsdp=...)``) only on GPUs. On the
  CPU it drops ``fsdp`` and the Trainer trains under DDP, every rank holding the whole model:
  the bridge says so once (a warning) and watches the DDP run it is, gradient detectors and
  rollback on; :meth:`StepwatchCallback.attach` refuses a model sharded beforehand with
  ``fully_shard`` (the Trainer's DDP cannot wrap its DTensor parameters). Under FSDP2 on
  GPUs (``fsdp_config={"fsdp_version": 2}``: DTensor parameters) the gradient detectors read
  the full model's gradients and a rollback restores each rank's shards (a path the test
  suite, which runs on CPUs, does not cover). Under DeepSpeed or FSDP1 the gradients are
  flattened partitions and the gradient detectors are off.
  Under fp16 the optimizer's loss scaler is the run's: a step it skips for overflowing
  gradients is not measured;
- the learning rate (the optimizer's), and the values of each evaluation under stepwatch's
  names (``eval_loss``, ``eval_<metric>``) at the end of its epoch; the evaluation's timings
  are left out. With several evaluation datasets (a dict) the first one's values end the
  epoch (the monitors act on them) and the others are stored at the same step;
- the rank and the number of processes (``args.process_index``, ``args.world_size``); the
  run is recorded by rank 0.
- the host config: ``args.to_dict()`` and ``model_config`` (the model's ``config``);
- ``cb_params.outputs`` (the model's output, detached) at the steps the callbacks look at:
  every step when one of them has a per-step hook (``on_train_step_begin``/``end``), else the
  steps a monitor's wake is due (a forward hook is on the model for those steps only; at a
  step woken by a NaN or an alarming loss it is None; with several GPUs in one process,
  ``DataParallel``, one replica's share). ``train_dataset_element`` is the micro-batch the
  Trainer's ``training_step`` got;
- a run resumed with ``train(resume_from_checkpoint=...)`` is recorded from the
  checkpoint's step on (``state.global_step``).

The actions, on the Trainer's controls:

- ``'stop'``: ``control.should_training_stop``; the Trainer leaves its loop after the step.
- ``'reduce_lr'`` (and ``ReduceLROnPlateau``): the optimizer's parameter groups and the
  scheduler's base rates, so the Trainer's schedule goes on from the lower rate.
- ``'snapshot'``: a Trainer checkpoint folder (the weights as ``save_pretrained`` writes them,
  or ``model.safetensors`` for a plain torch module, ``optimizer.pt``, ``scheduler.pt``,
  ``scaler.pt`` under fp16, ``rng_state.pth``, ``trainer_state.json``):
  ``trainer.train(resume_from_checkpoint=folder)`` resumes from it and
  ``from_pretrained(folder)`` loads the model. A snapshot taken during a step gets its
  schedule and trainer state at that step's ``on_step_end``.
- ``'rollback'``: the model, the optimizer (accelerate's wrapper loads state in place), the
  LR schedule and fp16's loss scaler are restored to a copy taken every ``rollback_every``
  steps; the Trainer goes on counting steps with the next batches. Under DeepSpeed or FSDP1,
  rollback stops instead.

A failure: the Trainer has no hook for an exception inside ``train()`` (``on_train_end`` is
skipped). Inside ``with callback:`` the run is stored ``failed`` (``interrupted`` for Ctrl-C)
as the exception leaves ``train()``. Without it: a script that dies of it stores ``failed``
when the interpreter exits; a process that lives on (a notebook) keeps the run ``running``
until its next ``train()`` with this callback (which stores it ``failed`` first) or its exit;
a killed process shows ``crashed`` (stale heartbeat, dead pid).
"""

from __future__ import annotations

import atexit
import logging
import math
import sys
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .._tensor import check_loss
from .._validation import _got
from ..train.engine import torch_controls
from ._bridge import Bridge, BridgeFace, Host, clean_config, host_values, sharding_of
from ._transformers_checkpoint import write_checkpoint
from ._transformers_loss import StepLoss

__all__ = ["StepwatchCallback"]

logger = logging.getLogger("stepwatch")

# Evaluation values that time the evaluation rather than judge the model.
_TIMINGS = (
    "_runtime",
    "_samples_per_second",
    "_steps_per_second",
    "_jit_compilation_time",
    "_model_preparation_time",
)

# Accelerate shards a model (FSDP) only on GPUs and other accelerators: on the CPU it drops
# TrainingArguments(fsdp=...) without a word and the Trainer trains under DDP.
_FSDP_DROPPED = (
    "stepwatch: TrainingArguments(fsdp=...) is set but the model is not sharded: accelerate "
    "shards (FSDP) only on GPUs, so on the CPU this Trainer trains under DDP, each rank "
    "holding the whole model. stepwatch watches it as the DDP run it is."
)

# The callbacks with a run open, closed as failed if the interpreter exits first.
_OPEN: weakref.WeakSet[StepwatchCallback] = weakref.WeakSet()


def _close_at_exit() -> None:  # pragma: no cover - runs at interpreter exit
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        exc = RuntimeError(
            "the process exited while transformers.Trainer.train() was running (the Trainer "
            "never called on_train_end)"
        )
    for callback in list(_OPEN):
        callback._fail(exc)


class StepwatchCallback(BridgeFace, TrainerCallback):
    """Run stepwatch callbacks inside ``transformers.Trainer.train``.

    Args:
        callbacks: a stepwatch ``Callback`` or a list of them (``RunRecorder``,
            ``AnomalyMonitor``, ``LossMonitor``, ``ProgressBar``, your own stepwatch
            ``Callback`` subclasses, ...). They get stepwatch's cb_params: ``cur_step_num``
            (the optimizer step), ``cur_epoch_num``, ``net_outputs`` (the step's loss),
            ``outputs`` (the model's output for the last micro-batch, detached, at the steps
            they look at) and the rest.

    Raises:
        TypeError: ``callbacks`` is not a stepwatch Callback or a list of them.

    Attributes:
        run: the stepwatch run while training (a ``RunEngine``), else None.

    Example:
        >>> watch = StepwatchCallback([RunRecorder(db="runs.db"), AnomalyMonitor()])
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[watch])
        >>> with watch:
        ...     trainer.train()
    """

    host = "transformers"

    def __init__(self, callbacks: Any = None) -> None:
        super().__init__()
        self._bridge = Bridge(callbacks, "transformers.StepwatchCallback")
        self._loss = StepLoss(self._bridge)  # the step's loss, outputs and inputs
        self._trainer: weakref.ref[Any] | None = None  # the Trainer attach() named
        self._args: TrainingArguments | None = None
        self._state: TrainerState | None = None
        self._model: nn.Module | None = None
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._in_step = False
        self._unfinished: list[Path] = []  # snapshots whose step has not ended yet
        self._evals: dict[str, float] = {}  # this epoch's evaluation values
        self._epoch_waits = False  # the epoch ended; its evaluation comes next
        self._epoch_done = False  # ... and came: further evaluations are stored directly

    # -- the Trainer this callback runs in -------------------------------------------------------
    def attach(self, trainer: transformers.Trainer) -> StepwatchCallback:
        """Run in ``trainer`` and record its own step loss: this callback is added to its
        callbacks (unless they hold it already), and while it trains the bridge reads the
        loss its ``training_step`` returns - however it was computed. Returns this callback.

        Without it, the bridge reads the ``loss`` the model returns (a loss computed outside
        the model then needs :meth:`record_loss`).

        Raises:
            TypeError: ``trainer`` is not a ``transformers.Trainer``.
            ValueError: ``trainer``'s model is already sharded (``fully_shard``) but the
                Trainer does not shard it (accelerate's FSDP is for GPUs: on the CPU the
                Trainer trains under DDP, which cannot take sharded parameters).

        Example:
            >>> trainer = Trainer(model=model, args=args, train_dataset=ds)
            >>> watch = StepwatchCallback([RunRecorder(db="runs.db")]).attach(trainer)
            >>> trainer.train()
        """
        if not isinstance(trainer, transformers.Trainer):
            raise TypeError(
                f"attach() takes the transformers.Trainer this callback runs in, but got "
                f"{_got(trainer)}: pass the Trainer (StepwatchCallback([...]).attach(trainer))."
            )
        if (
            sharding_of(trainer.model) == "fsdp2"
            and not getattr(trainer, "is_fsdp_enabled", False)
            and trainer.args.world_size > 1
        ):
            raise ValueError(
                "attach() got a Trainer whose model is sharded already (fully_shard: its "
                "parameters are DTensors) while the Trainer itself does not shard "
                "(TrainingArguments(fsdp=...) is off, or dropped: accelerate runs FSDP only on "
                f"GPUs, and this one trains on {trainer.args.device.type!r}), so it trains "
                "under DDP, which cannot wrap sharded parameters (train() would fail in "
                "accelerate's prepare). Pass the unsharded model with TrainingArguments(fsdp=True, "
                "fsdp_config={'fsdp_version': 2}) on GPUs, or train the sharded model with "
                "stepwatch.watch or stepwatch.Model."
            )
        if not any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(self)
        self._trainer = weakref.ref(trainer)
        return self

    def _attached(self) -> Any:
        """The Trainer :meth:`attach` named, while this callback is still among its callbacks."""
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or not any(cb is self for cb in trainer.callback_handler.callbacks):
            return None
        return trainer

    # -- what a Trainer with its own loss calls ------------------------------------------------
    def record_loss(self, loss: torch.Tensor) -> None:
        """Hand over a loss of your own for the current micro-batch, to record instead of the
        Trainer's.

        The bridge records the loss the Trainer's ``training_step`` returns, however it was
        computed (the model, ``compute_loss_func``, label smoothing, your own
        ``compute_loss``); call this only to record a different one. Call it once per
        micro-batch, in ``compute_loss``, with the micro-batch's loss as a per-batch mean (it
        is detached, nothing is read). The step's loss is then the mean of what was handed
        over in its micro-batches. (Called by something that is not a Trainer, the bridge
        reads the model's loss from its forward, and a loss computed outside the model must
        be handed over this way.)

        Args:
            loss: a one-value torch tensor.

        Raises:
            TypeError: ``loss`` is not a torch tensor. ValueError: it holds more than one value.
        """
        check_loss("record_loss()", loss, "the micro-batch's loss tensor")
        if self._bridge.running and torch.is_grad_enabled():  # not an evaluation's loss
            self._loss.record(loss)

    # -- a failure, where the Trainer has no hook for it ---------------------------------------
    def __enter__(self) -> StepwatchCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._release()
        self._bridge.end(exc)

    # -- the Trainer's hooks -------------------------------------------------------------------
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._bridge.running:  # a train() that failed outside 'with': store it failed
            self._fail(RuntimeError("the Trainer started training again before this run ended"))
        self._args, self._state, self._model = args, state, model
        self._optimizer, self._scheduler = optimizer, lr_scheduler
        # An optimizer that may skip a step: read whether it did at each step. Accelerate's
        # own without a GradScaler never does (its step_was_skipped stays False).
        plain = type(optimizer).__name__ == "AcceleratedOptimizer" and (
            getattr(optimizer, "scaler", None) is None
        )
        self._may_skip = hasattr(optimizer, "step_was_skipped") and not plain
        self._in_step, self._unfinished = False, []
        self._evals, self._epoch_waits, self._epoch_done = {}, False, False
        sharding = sharding_of(model)
        # DeepSpeed and FSDP1 keep the gradients and state in flattened partitions that
        # stepwatch does not read; FSDP2's DTensors it reads as the full model's.
        opaque = bool(getattr(args, "deepspeed", None)) or sharding == "fsdp1"
        if getattr(args, "fsdp", None) and sharding is None and args.process_index == 0:
            logger.warning(_FSDP_DROPPED)
        torch_parts = isinstance(model, nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
        trainer = self._attached()
        if trainer is None and getattr(args, "n_gpu", 1) > 1:
            logger.warning(
                "stepwatch: this Trainer runs %d GPUs in one process (DataParallel); the "
                "bridge sees the model's loss once per replica. Run one process per GPU "
                "(torchrun) for exact step losses.",
                args.n_gpu,
            )
        controls = torch_controls(
            "transformers",
            model,
            optimizer,
            lr_scheduler=lr_scheduler,
            # fp16 on a GPU: accelerate's optimizer steps through a GradScaler
            loss_scaler=getattr(optimizer, "scaler", None),
            dataset=train_dataloader,
            restores=torch_parts and not opaque,
            grads=isinstance(model, nn.Module) and not opaque,
            save=self._save if isinstance(model, nn.Module) else None,
            config=clean_config(_config(args, model)),
        )
        host = Host(
            controls, model, optimizer, rank=int(args.process_index), world=int(args.world_size)
        )
        steps_per_epoch = _steps_per_epoch(args, state, train_dataloader)
        epochs = max(1, int(state.num_train_epochs or 1))
        if state.max_steps and state.max_steps > 0:
            epochs = min(epochs, math.ceil(state.max_steps / steps_per_epoch))
        atexit.unregister(_close_at_exit)
        atexit.register(_close_at_exit)  # after RunWriter's own exit handler: runs before it
        _OPEN.add(self)
        self._loss.attach(trainer, model, args.gradient_accumulation_steps)
        done = int(state.global_step)  # > 0: resumed from a checkpoint, go on from its step
        try:
            self._bridge.begin(
                host,
                epochs=epochs,
                steps_per_epoch=steps_per_epoch,
                dataset=train_dataloader,
                lr_scheduler=lr_scheduler,
                initial_step=done,
                initial_epoch=done // steps_per_epoch,
            )
        except BaseException:
            self._release()
            raise

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        step = self._loss
        if step.taken or step.handed or step.losses or step.missing:
            step.reset()  # what a step that did not finish left
        if step.hook is None and step.trainer is not None:
            run = self._bridge.run
            if run is not None and run.looks_next:  # the callbacks look: gather the outputs
                step.hook_outputs()
                step.outputs_hook = True
        return self._end_waiting_epoch(control) if self._epoch_waits else control

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._loss.close_micro_batch()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        bridge = self._bridge
        run = bridge.run
        if run is None:
            return control
        step = self._loss
        # The global gradient norm before clipping, as the Trainer computed it (or None).
        run.cb_params.grad_norm, step.norm = step.norm, None
        taken = step.taken
        if len(taken) == 1 and not step.handed and not taken[0].ndim:
            # The common step: one micro-batch, whose training_step gave a 0-d loss (the rest
            # of StepLoss's bookkeeping is for accumulation, record_loss and other callers).
            loss = taken[0]
            step.taken = []
            outputs, inputs = step.outputs, step.inputs
            step.outputs = step.inputs = None  # (the outputs may be large: not kept)
        else:
            try:
                loss, outputs, inputs = step.take(state.global_step + 1)
            except RuntimeError as exc:
                self._fail(exc)
                raise
        if self._may_skip:  # fp16 on a GPU: accelerate's optimizer may skip an overflow
            run.cb_params.optimizer_stepped = not self._optimizer.step_was_skipped
        self._in_step = True
        try:
            run.step(loss, outputs, inputs)  # (Bridge.step, inlined: this runs every step)
        except BaseException as exc:
            bridge.end(exc)
            self._release()
            raise
        finally:
            self._in_step = False
            if step.outputs_hook:
                step.end_step(run)
        if run.should_stop:
            control.should_training_stop = True
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._unfinished:
            return
        unfinished, self._unfinished = self._unfinished, []
        for folder in unfinished:
            try:
                self._finish_snapshot(folder)
            except OSError as exc:
                logger.error("stepwatch: snapshot %s is incomplete: %s", folder, exc)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._epoch_done = False
        return self._end_waiting_epoch(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if not self._bridge.running:
            return control
        # The Trainer evaluates after on_epoch_end: the epoch's values wait for on_evaluate.
        self._epoch_waits = True
        if control.should_evaluate:
            return control
        return self._end_waiting_epoch(control)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> TrainerControl:
        run = self._bridge.run
        if run is None:
            return control
        values = host_values(
            {k: v for k, v in (metrics or {}).items() if k != "epoch" and not k.endswith(_TIMINGS)}
        )
        if self._epoch_done:  # a further dataset of the epoch's evaluation
            sink = run.view.sink
            for key, value in values.items():
                if sink is not None:
                    sink.log(key, value, run.step_num, run.epoch_num)
            return control
        self._evals.update(values)
        return self._end_waiting_epoch(control)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._bridge.running:
            return
        self._end_waiting_epoch(control)
        self.on_step_end(args, state, control)
        self._release()
        self._bridge.end()

    # -- epochs ---------------------------------------------------------------------------------
    def _end_waiting_epoch(self, control: TrainerControl) -> TrainerControl:
        if not self._epoch_waits or not self._bridge.running:
            return control
        self._epoch_waits, self._epoch_done = False, True
        values, self._evals = self._evals, {}
        try:
            stop = self._bridge.epoch_end(values)
        except BaseException:  # the bridge ended the run: let go of the Trainer and model too
            self._release()
            raise
        if stop:
            control.should_training_stop = True
        return control

    def _release(self) -> None:
        self._loss.release()
        _OPEN.discard(self)

    # -- snapshots: a Trainer checkpoint folder ------------------------------------------------
    def _save(self, stem: Path) -> Path:
        """Write the model, the optimizer and the random generators to the folder ``stem``
        now, and the schedule and trainer state when the step ends (the Trainer steps its
        scheduler and counts the step after ``on_optimizer_step``)."""
        model, args = self._model, self._args
        assert isinstance(model, nn.Module) and args is not None
        folder = write_checkpoint(Path(stem), model, self._optimizer, args)
        if self._in_step:
            self._unfinished.append(folder)
        else:
            self._finish_snapshot(folder)
        return folder

    def _finish_snapshot(self, folder: Path) -> None:
        if self._scheduler is not None and hasattr(self._scheduler, "state_dict"):
            torch.save(self._scheduler.state_dict(), folder / "scheduler.pt")
        if self._state is not None:
            self._state.save_to_json(str(folder / "trainer_state.json"))


def _steps_per_epoch(args: TrainingArguments, state: TrainerState, loader: Any) -> int:
    """Optimizer steps per epoch, as the Trainer counts them."""
    accumulation = max(1, int(args.gradient_accumulation_steps))
    try:
        batches = len(loader) if loader is not None else None
    except TypeError:  # an iterable loader: the Trainer runs max_steps in one "epoch"
        batches = None
    if batches:
        return max(1, math.ceil(batches / accumulation))
    return max(1, int(state.max_steps or 1))


def _config(args: TrainingArguments, model: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"transformers": transformers.__version__, **args.to_dict()}
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if callable(to_dict):
        config["model_config"] = to_dict()
    return config
