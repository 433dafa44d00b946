"""The run engine: one run of training, as every trainer drives it.

``stepwatch.Model``'s loop, a hand-written loop under :func:`stepwatch.watch` and each bridge
into another trainer (MindSpore, Lightning, the Hugging Face Trainer, Keras) are three ways to
feed one :class:`RunEngine`. The engine opens the run (its cb_params, run view and RunContext,
the callbacks entered and their ``on_train_begin``), takes the steps and the epochs' ends, and
closes the run in every exit path (``on_train_end`` after a finished run, the callbacks' exit
with the exception after a failed one, so ``RunRecorder`` stores the run's status and flushes).

The driver API, in the order a trainer calls it::

    engine = RunEngine(callbacks, controls, network=net, optimizer=opt, epochs=3,
                       steps_per_epoch=len(loader))
    engine.open()
    for epoch in range(3):
        engine.begin_epoch()                  # optional: step() begins an epoch too
        for batch in loader:
            ...                               # the trainer's own step
            if engine.step(loss, outputs, batch):
                break                         # a callback asked to stop
        if engine.end_epoch({"eval_loss": v}):
            break
    engine.close()                            # close(exc) when training failed

``Model``'s training epoch keeps :meth:`step`'s work inline on its hot path (it reads
:attr:`callbacks`, :attr:`cb_params` and the view's loss tap itself); everyone else calls
:meth:`step`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._tensor import detached
from ..distributed import check_launched_together, rank_and_world
from ..monitor import values as names
from ..view.host import HostControls, OptimizerRates, TorchState
from ..view.run import RunView
from .callback._callback import CallbackList, CallbackParams, RunContext
from .parts import Parts, new_cb_params
from .state import TrainingState

__all__ = ["RunEngine", "torch_controls"]

logger = logging.getLogger("stepwatch")

_EVAL_PREFIX = "eval_"


def torch_controls(
    name: str,
    network: Any,
    optimizer: Any,
    *,
    lr_scheduler: Any = None,
    loss_scaler: Any = None,
    dataset: Any = None,
    restores: bool = True,
    grads: bool | None = None,
    save: Any = None,
    config: Mapping[str, Any] | None = None,
) -> HostControls:
    """The controls of a trainer of torch objects: rollback copies of ``network``,
    ``optimizer``, ``lr_scheduler`` and ``loss_scaler`` (unless ``restores`` is False), the
    optimizer's learning rates, gradients on the network's parameters (``grads``: by default,
    when ``network`` is a torch module)."""
    module = isinstance(network, nn.Module)
    state = None
    if restores and module:
        state = TorchState(
            TrainingState(network, optimizer, lr_scheduler, loss_scaler, dataset=dataset)
        )
    return HostControls(
        name,
        state=state,
        rates=OptimizerRates(optimizer) if hasattr(optimizer, "param_groups") else None,
        save=save,
        grads=module if grads is None else grads,
        loss_scaler=loss_scaler,
        config=dict(config or {}),
    )


class RunEngine:
    """One run of training, driven by a trainer.

    Args:
        callbacks: the run's callbacks, a :class:`CallbackList` (``Model``) or a list.
        controls: what the trainer lets the monitors do (:class:`~stepwatch.view.host.HostControls`;
            :func:`torch_controls` makes them for torch objects).
        network: what trains (``cb_params.network``): a torch module or the host's own network
            object; None when the trainer does not say.
        optimizer: its optimizer (``cb_params.optimizer``), the trainer's own kind, or None.
        epochs: the epochs this run trains; steps_per_epoch: optimizer steps in each.
        initial_step / initial_epoch: steps and epochs done before the run (a resumed run
            counts on from them).
        parts: ``Model``'s parts (its loss function, device, metrics, eval network, step
            options), instead of ``network``/``optimizer``/``loss_fn``.
        loss_fn, lr_scheduler, dataset, valid_dataset: cb_params' fields of the same names.
        rank / world: this process's rank and the number of processes (by default, torch
            distributed's).

    Attributes:
        cb_params: the run's cb_params (MindSpore's face of the run).
        run_context: the RunContext every hook receives.
        view: the run view (:class:`~stepwatch.view.run.RunView`).
        callbacks: the callbacks' dispatch table (:class:`CallbackList`).
    """

    def __init__(
        self,
        callbacks: CallbackList | list[Any],
        controls: HostControls,
        *,
        network: Any = None,
        optimizer: Any = None,
        epochs: int,
        steps_per_epoch: int,
        initial_step: int = 0,
        initial_epoch: int = 0,
        parts: Parts | None = None,
        loss_fn: Any = None,
        lr_scheduler: Any = None,
        dataset: Any = None,
        valid_dataset: Any = None,
        rank: int | None = None,
        world: int | None = None,
    ) -> None:
        if rank is None or world is None:
            rank, world = rank_and_world()
        if parts is None:
            device = _device_of(network)
            parts = Parts(
                network=network,
                loss_fn=loss_fn,
                optimizer=optimizer,
                device=device,
                metrics={},
                eval_network=network,
            )
        cb_list = (
            callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks, rank)
        )
        p = new_cb_params(parts, cb_list, rank, world)
        p.mode = "train"
        p.epoch_num = epochs
        p.initial_epoch = p.cur_epoch_num = initial_epoch
        p.batch_num = steps_per_epoch
        p.initial_step = p.cur_step_num = p.progress.trained_step = initial_step
        p.train_dataset = dataset
        p.dataset_sink_mode = False
        p.train_dataset_element = None  # MindSpore has the field (None) before step 1
        if lr_scheduler is not None:
            p.lr_scheduler = lr_scheduler
        if controls.loss_scaler is not None:
            p.loss_scaler = controls.loss_scaler
        p.train_results = {}
        if valid_dataset is not None:
            p.valid_dataset = valid_dataset
        self.view = p.run_view = RunView(
            p, controls, rank=rank, world=world, validates=valid_dataset is not None
        )
        self.view.metrics = parts.metrics
        self.cb_params: CallbackParams = p
        self.callbacks = cb_list
        self.run_context = RunContext(p)
        self.state = "new"  # new -> running -> ended
        self._tap = self.view.tap
        self._every_step = cb_list.every_step
        self._in_epoch = False
        self._step = initial_step  # the last step (cb_params has it at the steps looked at)
        self._epoch_first = initial_step + 1
        self._last_step_end = 0.0
        self._last_seen = initial_step  # the last step a hook or the tap's clock saw
        self._stack = contextlib.ExitStack()

    # -- what a driver reads ---------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once a callback asked the run to stop."""
        return self.run_context.stop_requested

    @property
    def stop_reason(self) -> str | None:
        """Why the run was asked to stop (``'nonfinite at step 37'``), or None."""
        return self.run_context.stop_reason

    @property
    def stop_kind(self) -> str | None:
        """``'requested'``, ``'interrupted'`` or ``'anomaly'`` once a stop was asked."""
        return self.run_context.stop_kind

    @property
    def step_num(self) -> int:
        """The global step of the last :meth:`step`."""
        return self._step

    @property
    def epoch_num(self) -> int:
        """The current epoch, 1-based (the last one begun)."""
        return int(self.cb_params.cur_epoch_num)

    @property
    def in_epoch(self) -> bool:
        """An epoch has begun and not ended."""
        return self._in_epoch

    @property
    def epoch_steps(self) -> int:
        """Steps taken in the current epoch."""
        return self._step - self._epoch_first + 1 if self._in_epoch else 0

    @property
    def looks_next(self) -> bool:
        """Whether the callbacks look at the next :meth:`step`, as far as can be foreseen (a
        loss above the tap's alarm, or NaN, wakes them unforeseen): gather outputs for it."""
        return self._every_step or self._step + 1 >= self._tap.wake

    @property
    def rollbacks(self) -> list[tuple[int, int]]:
        """``(restored_step, at_step)`` for every rollback an action did (the run view's)."""
        return self.view.rollbacks

    # -- the run ---------------------------------------------------------------------------------
    def open(self, callback_states: Mapping[str, Any] | None = None, source: str = "") -> None:
        """Enter the callbacks and run their ``on_train_begin``; then give the stateful ones
        ``callback_states`` (a resumed run's: the saved state wins over their reset).

        Raises:
            RuntimeError: the run was opened before.
        """
        if self.state != "new":
            raise RuntimeError("this run was already opened; make a new one")
        check_launched_together()
        self._stack.enter_context(self.callbacks.entered())
        self.state = "running"
        try:
            self.callbacks.call("on_train_begin", self.run_context)
            if callback_states is not None:
                self.callbacks.load_state_dicts(callback_states, source or "the checkpoint")
        except BaseException:
            self.state = "ended"
            self._stack.__exit__(*_exc_info())
            raise

    def number_epochs(self, epoch: int, *, total: bool = False) -> None:
        """The trainer's next epoch is ``epoch`` (1-based): number it so, for a trainer that
        tells where a resumed run starts only when its first epoch begins. ``total``: the
        run's ``epochs`` counted every epoch from 1 (Keras), not only those this run trains
        (MindSpore), so the epochs still to train shrink by the ones skipped."""
        if self._in_epoch or self.state != "running":
            return
        p = self.cb_params
        before = max(0, int(epoch) - 1)
        if p.cur_epoch_num == p.initial_epoch:  # no epoch yet: the run starts there
            if total:
                p.epoch_num = max(1, p.initial_epoch + p.epoch_num - before)
            p.initial_epoch = before
        p.cur_epoch_num = before

    def begin_epoch(self) -> None:
        """An epoch begins: number it and run the ``on_train_epoch_begin`` hooks. (The first
        :meth:`step` after an epoch's end begins the next one when the driver did not.)"""
        self._sync_step()
        p = self.cb_params
        p.cur_epoch_num += 1
        p.loss = None
        p.__dict__.pop("eval_results", None)
        p.__dict__.pop("metrics", None)
        self._in_epoch, self._epoch_first = True, self._step + 1
        self._tap.begin_epoch(p.cur_epoch_num, p.cur_step_num + 1)
        self.callbacks.call("on_train_epoch_begin", self.run_context)
        self._last_step_end = time.perf_counter()
        self._last_seen = p.cur_step_num

    def step(self, loss: torch.Tensor, outputs: Any = None, batch: Any = None) -> bool:
        """One optimizer step is done: its loss goes into the run's loss tap (a plain CPU
        loss as a float, any other as a detached tensor, read in batches) and, at the steps
        the callbacks look at, the step hooks run; return whether a callback asked to stop.

        Nothing here waits for an accelerator. With no step hook that runs every step,
        cb_params' per-step fields (``cur_step_num``, ``loss_tensor``, ``outputs``,
        ``train_dataset_element``, ``step_time``) are set at the steps a monitor looks at.
        """
        if not self._in_epoch:
            self.begin_epoch()
        step = self._step = self._step + 1
        tap = self._tap
        if type(loss) is torch.Tensor and loss.is_cpu:
            value = loss.item()
            tap.pending.append(value)
            if not value <= tap.alarm:
                tap.alarmed()  # above the alarm, or NaN: the monitors look now
        else:
            tap.pending.append(loss.detach())
        due = step >= tap.wake
        if not (due or self._every_step):
            return False  # nobody looks at this step: its fields wait for the next look
        p = self.cb_params
        p.cur_step_num = p.progress.trained_step = step
        fns = self.callbacks.fns
        p.train_dataset_element = batch
        p.loss_tensor = loss.detach()
        p.outputs = detached(outputs)
        # Since the last step a hook or the tap's clock saw: this one, or a mean over several.
        p.step_time = (time.perf_counter() - self._last_step_end) / (step - self._last_seen)
        self._last_seen = step
        try:
            # The step has already run: its begin hooks see it just before the tap's calls
            # due at it and its end hooks.
            for fn in fns["on_train_step_begin"]:
                fn(self.run_context)
            if due:
                tap.tick()
            for fn in fns["on_train_step_end"]:
                fn(self.run_context)
        except BaseException as exc:
            self.callbacks.annotate(exc)
            raise
        self._last_step_end = time.perf_counter()
        return self.run_context.stop_requested

    def end_epoch(
        self,
        values: Mapping[str, float] | None = None,
        *,
        evaluate: Callable[[], None] | None = None,
    ) -> bool:
        """An epoch is done: set its values and run the ``on_train_epoch_end`` hooks; return
        whether a callback asked to stop.

        Args:
            values: the epoch's values under stepwatch's names: ``loss`` (else the mean of
                the steps' losses, one host read), ``eval_loss`` and ``eval_<metric>``
                (validation: ``cb_params.eval_results``), ``train_<metric>`` or a bare
                ``<metric>`` (training: ``cb_params.train_results``). A run that gets a
                validation value validates from then on.
            evaluate: runs after the training values are set and before the epoch-end hooks
                (``Model``'s validation pass, which sets ``cb_params.eval_results`` itself).
        """
        if not self._in_epoch:
            self.begin_epoch()
        self._sync_step()
        p = self.cb_params
        train: dict[str, Any] = {}
        evals: dict[str, Any] = {}
        for name, number in (values or {}).items():
            if name == names.LOSS:
                train[name] = number
            elif name.startswith(_EVAL_PREFIX):
                evals[name if name == "eval_loss" else name[len(_EVAL_PREFIX) :]] = number
            else:
                train[name.removeprefix("train_")] = number
        total = self._tap.end_epoch()
        if names.LOSS not in train and total is not None and self.epoch_steps:
            train[names.LOSS] = float(total) / self.epoch_steps
        p.train_results = train
        p.loss = train.get(names.LOSS)
        if evals:
            self.view.validates = True
            p.eval_results = evals
            p.metrics = {k: v for k, v in evals.items() if k != "eval_loss"}  # as MindSpore
        if evaluate is not None:
            evaluate()
        self._in_epoch = False
        self.callbacks.call("on_train_epoch_end", self.run_context)
        p.__dict__.pop("eval_results", None)
        p.__dict__.pop("metrics", None)  # as MindSpore: until the epoch's end
        return self.run_context.stop_requested

    def close(self, exc: BaseException | None = None) -> None:
        """Close the run. Without ``exc`` (the trainer finished, or stopped as asked): an
        epoch still open ends first (its values from its steps), then ``on_train_end``. With
        ``exc`` (training failed): the callbacks' exit gets it (``RunRecorder`` stores
        ``failed``, or ``interrupted`` for a KeyboardInterrupt). Closing twice does nothing."""
        if self.state != "running":
            return
        self._sync_step()  # for the hooks: the last step, not the last look's
        if exc is None:
            try:
                if self._in_epoch and self.epoch_steps:
                    self.end_epoch()  # the last epoch's values, as Model.train has them
                self.callbacks.call("on_train_end", self.run_context)
            except BaseException:
                self.state = "ended"
                self._stack.__exit__(*_exc_info())
                raise
            self.state = "ended"
            self._stack.__exit__(None, None, None)
        else:
            self.state = "ended"
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
        if self.run_context.stop_requested:
            p = self.cb_params
            logger.info(
                "training stopped at epoch %d, step %d: %s",
                p.cur_epoch_num,
                p.cur_step_num,
                self.run_context.stop_reason or "a callback requested a stop",
            )

    def took(self, step: int) -> None:
        """The driver's own inline steps (``Model``'s hot path, which does :meth:`step`'s work
        itself) ran through the global step ``step``."""
        self._step = step

    def _sync_step(self) -> None:
        """cb_params' step fields as of the last step (set in :meth:`step` only at looks);
        never back past a step the driver's inline loop set them to."""
        p = self.cb_params
        if self._step >= p.progress.trained_step:
            p.cur_step_num = p.progress.trained_step = self._step

    def __repr__(self) -> str:
        return (
            f"RunEngine({self.view.host!r}, {self.state}, step={self._step}, "
            f"epoch={self.epoch_num})"
        )


def _exc_info() -> tuple[Any, Any, Any]:
    import sys

    return sys.exc_info()


def _device_of(network: Any) -> torch.device:
    if isinstance(network, nn.Module):
        for tensor in network.parameters():
            return tensor.device
    return torch.device("cpu")
