"""``stepwatch.watch``: stepwatch's callbacks in a training loop you write yourself.

The loop trains as it always did and tells the run what happened: ``run.step(loss)`` after each
optimizer step, ``run.epoch_end(...)`` after each epoch. The run fills the same run view and
cb_params as :class:`stepwatch.Model`'s loop, so every callback - LossMonitor, AnomalyMonitor,
RunRecorder, ProgressBar, your own MindSpore-style ``Callback`` - works unchanged, and their
actions reach the loop: a stop sets ``run.should_stop``, ``reduce_lr`` changes the optimizer,
``rollback`` restores the network and optimizer in place.
"""

from __future__ import annotations

import logging
import numbers
import warnings
from typing import Any

import torch
from torch import nn

from .._tensor import check_loss
from .._validation import _got, check_int, user_stacklevel
from .callback._callback import normalize_callbacks
from .checks import check_optimizer
from .engine import RunEngine, torch_controls

__all__ = ["WatchedRun", "watch"]

logger = logging.getLogger("stepwatch")

_NEVER = 1 << 62  # a step no run reaches
_DONE = _NEVER + 1  # the long-epoch warning was given


class WatchedRun(RunEngine):
    """One run of a hand-written training loop, watched by stepwatch's callbacks.

    Made by :func:`watch`; use it as a context manager. It is the
    :class:`~stepwatch.train.engine.RunEngine` that ``Model`` and the bridges drive too, with
    the checks a hand-written loop needs: between ``__enter__`` and ``__exit__`` the
    callbacks' ``on_train_begin`` ... ``on_train_end`` hooks run as in ``Model.train``: the
    epoch-begin hooks when an epoch's first step arrives, the step hooks in :meth:`step`, the
    epoch-end hooks in :meth:`epoch_end`.

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
    ) -> None:
        super().__init__(
            callbacks,
            torch_controls("loop", network, optimizer, lr_scheduler=lr_scheduler, dataset=dataset),
            network=network,
            optimizer=optimizer,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            loss_fn=loss_fn,
            lr_scheduler=lr_scheduler,
            dataset=dataset,
        )
        self._steps_per_epoch = steps_per_epoch
        self._long_after = _NEVER  # a step past the epoch's steps_per_epoch: warn once
        self._warned: set[str] = set()  # the warnings given once

    # -- the run ---------------------------------------------------------------------------------
    def __enter__(self) -> WatchedRun:
        if self.state != "new":
            raise RuntimeError("this run was already started; call stepwatch.watch(...) again")
        self.open()
        return self

    def begin_epoch(self) -> None:
        super().begin_epoch()
        p = self.cb_params
        if p.cur_epoch_num > p.initial_epoch + p.epoch_num:
            self._warn_once(
                "epochs",
                f"epoch {p.cur_epoch_num} is past watch(epochs={p.initial_epoch + p.epoch_num}): "
                "progress and the run's config count that many. Pass the epochs the loop runs.",
            )
        if self._long_after != _DONE:
            self._long_after = self.step_num + self._steps_per_epoch

    def step(self, loss: torch.Tensor, outputs: Any = None, batch: Any = None) -> bool:
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

        Returns:
            Whether a callback asked the run to stop (:attr:`should_stop`).

        Raises:
            TypeError: ``loss`` is not a tensor. ValueError: it holds more than one value.
            RuntimeError: the run is not open (outside ``with``, or after it ended).
        """
        if self.state != "running":
            raise RuntimeError(
                "run.step() was called outside the run: use it inside 'with stepwatch.watch(...) "
                "as run:', before the block ends."
                if self.state == "ended"
                else "run.step() was called before the run started: enter it first with "
                "'with stepwatch.watch(...) as run:'."
            )
        if type(loss) is not torch.Tensor or (loss.ndim and loss.numel() != 1):
            check_loss(
                "run.step()", loss, "the step's loss tensor (the one backward() was called on)"
            )
        if not self.in_epoch:
            self.begin_epoch()
        if self.step_num >= self._long_after:
            self._long_after = _DONE
            warnings.warn(
                f"epoch {self.epoch_num} has more steps than steps_per_epoch="
                f"{self._steps_per_epoch}; step numbers within the epoch will be off (and "
                "without run.epoch_end() every step counts as this epoch's). Pass "
                "watch(..., steps_per_epoch=len(loader)) and call run.epoch_end() after each "
                "epoch.",
                UserWarning,
                stacklevel=2,
            )
        return super().step(loss, outputs, batch)

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
        if self.state != "running":
            raise RuntimeError(
                "run.epoch_end() was called outside the run: use it inside 'with "
                "stepwatch.watch(...) as run:'."
            )
        # Every value is read before anything changes: a bad one leaves the epoch as it was.
        read = {name: _number(name, value) for name, value in values.items()}
        if loss is not None:
            read["loss"] = _number("loss", loss)
        if not self.in_epoch:
            self._warn_once(
                "empty",
                "run.epoch_end() was called with no run.step() since the last epoch's end: this "
                "makes an epoch without steps. Call it once after each epoch.",
            )
            self.begin_epoch()
        steps = self.epoch_steps
        if 0 < steps < self._steps_per_epoch and not self.should_stop:
            self._warn_once(
                "short",
                f"epoch {self.epoch_num} had {steps} steps, not steps_per_epoch="
                f"{self._steps_per_epoch}: step numbers within the epoch are off. Pass "
                "watch(..., steps_per_epoch=len(loader)) (batches, not samples).",
            )
        misnamed = sorted(n for n in read if n.startswith("val_"))
        if misnamed:
            self._warn_once(
                "val",
                f"{', '.join(map(repr, misnamed))} is recorded as a training value "
                f"(train_{misnamed[0]}): name validation values eval_<name> (eval_loss, "
                "eval_accuracy).",
            )
        self.end_epoch(read)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(exc if exc_type is not None else None)


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
        TypeError / ValueError: an argument of the wrong type or value, naming it; an
            ``optimizer`` that updates none of ``network``'s parameters; a callback
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
    if network is not None and optimizer is not None:
        check_optimizer(network, optimizer)  # as Model checks it: else nothing would learn
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
