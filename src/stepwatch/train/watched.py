"""``stepwatch.watch``: stepwatch's callbacks in a training loop you write yourself.

The loop trains as it always did and tells the run what happened: ``run.step(loss)`` after each
optimizer step, ``run.epoch_end(...)`` after each epoch. The run fills the same run view and
cb_params as :class:`stepwatch.Model`'s loop, so every callback - LossMonitor, AnomalyMonitor,
RunRecorder, ProgressBar, your own MindSpore-style ``Callback`` - works unchanged, and their
actions reach the loop: a stop sets ``run.should_stop``, ``reduce_lr`` changes the optimizer,
``rollback`` restores the network and optimizer in place.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import time
import warnings
from typing import Any

import torch
from torch import nn

from .._tensor import check_loss, detached
from .._validation import _got, check_int, user_stacklevel
from ..distributed import rank_and_world
from ..view.run import RunView
from .callback._callback import CallbackList, CallbackParams, RunContext, normalize_callbacks
from .parts import Parts, new_cb_params

__all__ = ["WatchedRun", "watch"]

logger = logging.getLogger("stepwatch")

_EVAL_PREFIX = "eval_"
_NEVER = 1 << 62  # a step no run reaches
_DONE = _NEVER + 1  # the long-epoch warning was given


class WatchedRun:
    """One run of a hand-written training loop, watched by stepwatch's callbacks.

    Made by :func:`watch`; use it as a context manager. Between ``__enter__`` and
    ``__exit__`` the callbacks' ``on_train_begin`` ... ``on_train_end`` hooks run as in
    ``Model.train``: the epoch-begin hooks when an epoch's first step arrives, the step hooks
    in :meth:`step`, the epoch-end hooks in :meth:`epoch_end`.

    Attributes:
        cb_params: the run's cb_params (the same fields ``Model.train`` gives callbacks).
        run_context: the RunContext every hook receives.
        view: the run view (:class:`stepwatch.view.RunView`).
        rollbacks: ``(restored_step, at_step)`` for every rollback an action did: the network
            and optimizer are as they were after ``restored_step``; the batches of the steps
            after it, up to ``at_step``, were trained and undone.
    """

    def __init__(
        self,
        network: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        callbacks: list[Any],
        epochs: int,
        steps_per_epoch: int,
        loss_fn: Any = None,
        lr_scheduler: Any = None,
        dataset: Any = None,
        host: Any = None,
        initial_step: int = 0,
        initial_epoch: int = 0,
    ) -> None:
        # ``host``: a bridge's host controls (stepwatch.integrations), None for a user's loop;
        # a resumed host run goes on from ``initial_step`` / ``initial_epoch``.
        self._host = host
        self._initial = (initial_step, initial_epoch)
        self._network = network
        self._optimizer = optimizer
        self._callbacks = callbacks
        self._epochs = epochs
        self._steps_per_epoch = steps_per_epoch
        self._loss_fn = loss_fn
        self._lr_scheduler = lr_scheduler
        self._dataset = dataset
        self.rollbacks: list[tuple[int, int]] = []
        self._state = "new"  # new -> running -> ended
        self._in_epoch = False
        self._step = 0  # the global step of the last run.step() (cb_params has it at looks)
        self._epoch_first = 1  # the epoch's first step
        self._long_after = _NEVER  # a step past the epoch's steps_per_epoch: warn once
        self._every_step = False  # some step hook runs at every step
        self._warned: set[str] = set()  # the other warnings given once
        self._last_step_end = 0.0
        self._last_seen = 0  # the last step a hook or the tap's clock saw
        self._stack = contextlib.ExitStack()
        self.cb_params: CallbackParams
        self.run_context: RunContext
        self.view: RunView
        self._cb_list: CallbackList

    # -- what the loop reads ---------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once a callback asked the run to stop: leave the loop (it stays True after the
        run ended, with :attr:`stop_reason` saying why)."""
        return self._state != "new" and self.run_context.stop_requested

    @property
    def stop_reason(self) -> str | None:
        """Why the run was asked to stop (``'nonfinite at step 37'``), or None."""
        return self.run_context.stop_reason if self._state != "new" else None

    @property
    def stop_kind(self) -> str | None:
        """``'requested'``, ``'interrupted'`` or ``'anomaly'`` once a stop was asked, else None."""
        return self.run_context.stop_kind if self._state != "new" else None

    @property
    def step_num(self) -> int:
        """The global step of the last :meth:`step` (0 before the first)."""
        return self._step if self._state != "new" else 0

    @property
    def epoch_num(self) -> int:
        """The current epoch, 1-based (0 before the first step)."""
        return int(self.cb_params.cur_epoch_num) if self._state != "new" else 0

    @property
    def looks_next(self) -> bool:
        """Whether the callbacks look at the next :meth:`step`, as far as can be foreseen (a
        loss above the tap's alarm, or NaN, wakes them unforeseen): gather outputs for it."""
        return self._every_step or self._step + 1 >= self._tap.wake

    # -- the run ---------------------------------------------------------------------------------
    def __enter__(self) -> WatchedRun:
        if self._state != "new":
            raise RuntimeError("this run was already started; call stepwatch.watch(...) again")
        host = self._host
        rank, world = (host.rank, host.world) if host is not None else rank_and_world()
        # A bridge's host may train something that is not a torch module (a MindSpore Cell):
        # cb_params still shows it, as the host's own callbacks would see it.
        foreign = self._network is not None and not isinstance(self._network, nn.Module)
        network = self._network if isinstance(self._network, nn.Module) else nn.Module()
        parts = Parts(
            network=network,
            loss_fn=self._loss_fn,
            optimizer=self._optimizer,
            device=_device_of(network),
            metrics={},
            eval_network=network,
        )
        cb_list = CallbackList(self._callbacks, rank)
        p = new_cb_params(parts, cb_list, rank, world)
        if foreign:
            p.network = p.train_network = p.eval_network = self._network
        p.mode = "train"
        initial_step, initial_epoch = self._initial
        p.epoch_num = max(1, self._epochs - initial_epoch) if initial_epoch else self._epochs
        p.initial_epoch = p.cur_epoch_num = initial_epoch
        p.batch_num = self._steps_per_epoch
        p.initial_step = p.cur_step_num = p.progress.trained_step = initial_step
        p.train_dataset = self._dataset
        p.dataset_sink_mode = False
        p.train_dataset_element = None
        p.lr_scheduler = self._lr_scheduler
        if host is not None and host.loss_scaler is not None:
            p.loss_scaler = host.loss_scaler
        p.train_results = {}
        p.run_view = self.view = RunView(
            p,
            host=host.name if host is not None else "loop",
            rank=rank,
            world=world,
            grads=host.grads if host is not None else self._network is not None,
        )
        self._tap = self.view.tap
        if host is not None:
            self.view.controls, self.view.config = host, host.config
        self.cb_params, self._cb_list = p, cb_list
        self._step, self._every_step = initial_step, cb_list.every_step
        self.run_context = RunContext(p)
        self._stack.enter_context(cb_list.entered())
        self._state = "running"
        try:
            cb_list.call("on_train_begin", self.run_context)
        except BaseException:
            self._state = "ended"
            self._stack.__exit__(*_exc_info())
            raise
        return self

    def _host_epoch(self, epoch: int, total: bool = False) -> None:
        """A bridge's host says its next epoch is ``epoch`` (1-based): number it so (a host
        that tells its first epoch only when it begins, as a resumed Keras or MindSpore fit).
        ``total``: the run's ``epochs`` counted every epoch from 1 (Keras), not only those
        this run trains (MindSpore), so the epochs still to train shrink by the ones skipped."""
        if not self._in_epoch and self._state == "running":
            p = self.cb_params
            before = max(0, int(epoch) - 1)
            if p.cur_epoch_num == p.initial_epoch:  # no epoch yet: the run starts there
                if total:
                    p.epoch_num = max(1, p.initial_epoch + p.epoch_num - before)
                p.initial_epoch = before
            p.cur_epoch_num = before

    @property
    def _epoch_steps(self) -> int:
        return self._step - self._epoch_first + 1 if self._in_epoch else 0

    def _sync_step(self) -> None:
        """cb_params' step fields as of the last run.step() (set there only at looks)."""
        p = self.cb_params
        p.cur_step_num = p.progress.trained_step = self._step

    def _begin_epoch(self) -> None:
        self._sync_step()
        p = self.cb_params
        p.cur_epoch_num += 1
        if self._host is None and p.cur_epoch_num > p.initial_epoch + p.epoch_num:
            self._warn_once("epochs", f"epoch {p.cur_epoch_num} is past watch(epochs="
                            f"{p.initial_epoch + p.epoch_num}): progress and the run's config "
                            "count that many. Pass the epochs the loop runs.")  # fmt: skip
        p.loss = None
        p.__dict__.pop("eval_results", None)
        p.__dict__.pop("metrics", None)
        self._in_epoch, self._epoch_first = True, self._step + 1
        if self._long_after != _DONE:
            self._long_after = self._step + self._steps_per_epoch
        self.view.tap.begin_epoch(p.cur_epoch_num, p.cur_step_num + 1)
        self._cb_list.call("on_train_epoch_begin", self.run_context)
        self._last_step_end = time.perf_counter()
        self._last_seen = p.cur_step_num

    def step(self, loss: torch.Tensor, outputs: Any = None, batch: Any = None) -> None:
        """Tell the run that one optimizer step is done.

        Call it after ``optimizer.step()`` (and before the next ``zero_grad``, so gradient
        monitors can read the gradients). Nothing here waits for an accelerator: a plain CPU
        loss goes into the run's loss tap as a float (reading it waits for nothing), any other
        as a detached tensor, read in batches. :attr:`step_num` counts every step. With no
        step hook in the run that runs every step, cb_params' per-step fields
        (``cur_step_num``, ``loss_tensor``, ``outputs``, ``train_dataset_element``,
        ``step_time``) are set at the steps a monitor looks at, as ``stepwatch.Model`` sets
        them, and before every other hook.

        Args:
            loss: the step's loss, a single-value tensor (the one you called ``backward`` on).
            outputs: the network's output for the batch (``cb_params.outputs``), optional.
            batch: the batch (``cb_params.train_dataset_element``), optional.

        Raises:
            TypeError: ``loss`` is not a tensor. ValueError: it holds more than one value.
            RuntimeError: the run is not open (outside ``with``, or after it ended).
        """
        if self._state != "running":
            raise RuntimeError(
                "run.step() was called outside the run: use it inside 'with stepwatch.watch(...) "
                "as run:', before the block ends."
                if self._state == "ended"
                else "run.step() was called before the run started: enter it first with "
                "'with stepwatch.watch(...) as run:'."
            )
        if type(loss) is not torch.Tensor or (loss.ndim and loss.numel() != 1):
            check_loss(
                "run.step()", loss, "the step's loss tensor (the one backward() was called on)"
            )
        if not self._in_epoch:
            self._begin_epoch()
        step = self._step = self._step + 1
        if step > self._long_after:
            self._long_after = _DONE
            warnings.warn(
                f"epoch {self.cb_params.cur_epoch_num} has more steps than steps_per_epoch="
                f"{self._steps_per_epoch}; step numbers within the epoch will be off (and "
                "without run.epoch_end() every step counts as this epoch's). Pass "
                "watch(..., steps_per_epoch=len(loader)) and call run.epoch_end() after each "
                "epoch.",
                UserWarning,
                stacklevel=2,
            )
        # A plain CPU loss goes into the tap as a float (reading it waits for nothing); one
        # above the tap's alarm (or NaN) wakes it now. Any other loss goes in unread.
        # (LossTap.push, inlined: this runs every step.)
        tap = self._tap
        if type(loss) is torch.Tensor and loss.is_cpu:
            value = loss.item()
            tap.pending.append(value)
            if not value <= tap.alarm:
                tap.alarmed()
        else:
            tap.pending.append(loss.detach())
        due = step >= tap.wake
        if not (due or self._every_step):
            return  # nobody looks at this step: its fields wait for the next look
        p = self.cb_params
        p.cur_step_num = p.progress.trained_step = step
        fns = self._cb_list.fns
        begin, end = fns["on_train_step_begin"], fns["on_train_step_end"]
        p.train_dataset_element = batch
        p.loss_tensor = loss.detach()
        p.outputs = detached(outputs)
        # Since the last step a hook or the tap's clock saw: this one, or a mean over several.
        p.step_time = (time.perf_counter() - self._last_step_end) / (step - self._last_seen)
        self._last_seen = step
        rolled = self.view.rollbacks
        seen = len(rolled)
        try:
            # The step has already run: its begin hooks see it just before the tap's calls
            # due at it and its end hooks.
            for fn in begin:
                fn(self.run_context)
            if due:
                tap.tick()
            for fn in end:
                fn(self.run_context)
        except BaseException as exc:
            self._cb_list.annotate(exc)
            raise
        if len(rolled) > seen:
            self.rollbacks.extend(rolled[seen:])
        self._last_step_end = time.perf_counter()

    def epoch_end(self, loss: float | None = None, **values: float) -> None:
        """Tell the run that an epoch is done, with its values.

        The epoch's mean training loss is computed from the steps' losses (one host read);
        ``loss`` replaces it. Other values are named as stepwatch names them: ``eval_loss``,
        ``eval_<metric>`` (validation values: ``cb_params.eval_results``) and
        ``train_<metric>`` or a bare ``<metric>`` (training values:
        ``cb_params.train_results``). Once a run gets a validation value it validates, so a
        bare metric name in ``EarlyStopping(monitor=...)`` means its validation value.

        Raises:
            RuntimeError: the run is not open. TypeError: a value is not a number.
        """
        if self._state != "running":
            raise RuntimeError(
                "run.epoch_end() was called outside the run: use it inside 'with "
                "stepwatch.watch(...) as run:'."
            )
        # Every value is read before anything changes: a bad one leaves the epoch as it was.
        read = {name: _number(name, value) for name, value in values.items()}
        given = _number("loss", loss) if loss is not None else None
        mine = self._host is None  # a hand-written loop (a bridge's host numbers its own)
        if not self._in_epoch and mine:
            self._warn_once("empty", "run.epoch_end() was called with no run.step() since the "
                            "last epoch's end: this makes an epoch without steps. Call it once "
                            "after each epoch.")  # fmt: skip
        if not self._in_epoch:
            self._begin_epoch()
        self._sync_step()
        p = self.cb_params
        steps = self._epoch_steps
        if mine and 0 < steps < self._steps_per_epoch and not self.run_context.stop_requested:
            self._warn_once("short", f"epoch {p.cur_epoch_num} had {steps} steps, not "
                            f"steps_per_epoch={self._steps_per_epoch}: step numbers within "
                            "the epoch are off. Pass watch(..., steps_per_epoch=len(loader)) "
                            "(batches, not samples).")  # fmt: skip
        misnamed = sorted(n for n in read if n.startswith("val_"))
        if misnamed and mine:
            self._warn_once("val", f"{', '.join(map(repr, misnamed))} is recorded as a training "
                            f"value (train_{misnamed[0]}): name validation values eval_<name> "
                            "(eval_loss, eval_accuracy).")  # fmt: skip
        total = self.view.tap.end_epoch()
        train: dict[str, Any] = {}
        if given is not None:
            train["loss"] = given
        elif total is not None and self._epoch_steps:
            train["loss"] = float(total) / self._epoch_steps
        evals: dict[str, Any] = {}
        for name, number in read.items():
            if name.startswith(_EVAL_PREFIX):
                key = name if name == "eval_loss" else name[len(_EVAL_PREFIX) :]
                evals[key] = number
            else:
                train[name.removeprefix("train_")] = number
        p.train_results = train
        p.loss = train.get("loss")
        if evals:
            self.view.validates = True
            p.eval_results = evals
            p.metrics = {k: v for k, v in evals.items() if k != "eval_loss"}  # as MindSpore
        self._in_epoch = False
        self._cb_list.call("on_train_epoch_end", self.run_context)
        p.__dict__.pop("eval_results", None)
        p.__dict__.pop("metrics", None)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._state != "running":
            return
        self._sync_step()  # for the hooks: the last step, not the last look's
        try:
            if exc_type is None:
                if self._in_epoch and self._epoch_steps:
                    self.epoch_end()  # the last epoch's values, as Model.train has them
                self._cb_list.call("on_train_end", self.run_context)
        except BaseException:
            self._state = "ended"
            self._stack.__exit__(*_exc_info())
            raise
        self._state = "ended"
        self._stack.__exit__(exc_type, exc, tb)
        if self.run_context.stop_requested:
            p = self.cb_params
            logger.info(
                "training stopped at epoch %d, step %d: %s",
                p.cur_epoch_num,
                p.cur_step_num,
                self.run_context.stop_reason or "a callback requested a stop",
            )


def _number(name: str, value: Any) -> float:
    """An epoch value as a float: a number or a one-value tensor."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # NumPy's count
        what = f"a tensor of {value.numel()} values" if isinstance(value, torch.Tensor) else None
        raise TypeError(
            f"run.epoch_end()'s {name!r} must be a number or a one-value tensor, but got "
            f"{what or _got(value)}; pass the epoch's value (e.g. a mean: tensor.mean())."
        )
    return float(value)


def _exc_info() -> tuple[Any, Any, Any]:
    import sys

    return sys.exc_info()


def _device_of(network: nn.Module) -> torch.device:
    for tensor in network.parameters():
        return tensor.device
    return torch.device("cpu")


def watch(
    network: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    callbacks: Any = None,
    *,
    epochs: int = 1,
    steps_per_epoch: int,
    loss_fn: Any = None,
    lr_scheduler: Any = None,
    dataset: Any = None,
) -> WatchedRun:
    """Watch a training loop you write yourself with stepwatch's callbacks.

    Args:
        network: the network you train (gradient detectors, rollback and snapshots need it).
        optimizer: its optimizer (``reduce_lr``, rollback and the recorded ``lr`` need it).
        callbacks: a Callback or a list of them, as for ``Model.train``.
        epochs: the epochs the loop will run (for progress, and the run's config).
        steps_per_epoch: optimizer steps per epoch, e.g. ``len(loader)``.
        loss_fn: the loss function (``cb_params.loss_fn``), optional.
        lr_scheduler: a torch LR scheduler you step yourself; rollback restores it too.
        dataset: the training data (``cb_params.train_dataset``; a DataLoader's generators are
            then part of the state snapshots save), optional.

    Returns:
        A :class:`WatchedRun`: use it as a context manager and call ``run.step(loss)`` after
        each optimizer step and ``run.epoch_end(...)`` after each epoch.

    Raises:
        TypeError / ValueError: an argument of the wrong type or value, naming it; a callback
            that measures gradients (``AnomalyMonitor``'s gradient detectors) with no
            ``network``; one that changes the optimizer (``reduce_lr`` and ``rollback``
            actions, ReduceLROnPlateau, LearningRateScheduler) with no ``optimizer``.

    Example:
        >>> run = stepwatch.watch(net, opt, callbacks=[LossMonitor(100), AnomalyMonitor()],
        ...                       epochs=3, steps_per_epoch=len(loader))
        >>> with run:
        ...     for epoch in range(3):
        ...         for x, y in loader:
        ...             opt.zero_grad(); loss = loss_fn(net(x), y); loss.backward(); opt.step()
        ...             run.step(loss)
        ...             if run.should_stop: break
        ...         run.epoch_end(eval_loss=evaluate(net))
        ...         if run.should_stop: break
    """
    if network is not None and not isinstance(network, nn.Module):
        raise TypeError(
            f"watch()'s 'network' must be a torch.nn.Module or None, but got {_got(network)}."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"watch()'s 'optimizer' must be a torch.optim.Optimizer or None, but got "
            f"{_got(optimizer)}."
        )
    cbs = normalize_callbacks(callbacks)
    epochs = check_int("epochs", epochs, minimum=1)
    steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    if network is None:
        for cb in cbs:
            if getattr(cb, "measures_gradients", False):
                raise ValueError(
                    f"{type(cb).__name__} measures gradients, which needs the network: pass "
                    "watch(network, optimizer, ...), or leave the gradient detectors out "
                    "(AnomalyMonitor(detectors=['nonfinite', 'spike', 'divergence', "
                    "'plateau']))."
                )
    if optimizer is None:
        for cb in cbs:
            why = getattr(cb, "needs_optimizer", "")
            if why:
                raise ValueError(
                    f"{type(cb).__name__} needs the optimizer ({why}): pass "
                    "watch(network, optimizer, ...)."
                )
    return WatchedRun(
        network, optimizer, cbs, epochs, steps_per_epoch, loss_fn, lr_scheduler, dataset
    )
