"""What every bridge shares: the host's controls, and one watched run driven by host hooks.

A bridge is a host trainer's callback holding a :class:`Bridge`. From the host's hooks it
calls :meth:`Bridge.begin` (the host's network, optimizer and settings, as :class:`Host`),
:meth:`Bridge.step` after each optimizer step, :meth:`Bridge.epoch_end` with the epoch's
values, and :meth:`Bridge.end`; ``step`` and ``epoch_end`` return whether to stop, and the
bridge sets the host's own stop flag. The stepwatch callbacks run
inside a :class:`~stepwatch.train.watched.WatchedRun`, so they see the cb_params and run view
they see under ``stepwatch.Model``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..monitor import values as names
from ..train.callback._callback import normalize_callbacks
from ..train.watched import WatchedRun

__all__ = ["Bridge", "BridgeFace", "Host", "HostOptimizer", "clean_config", "host_values"]

logger = logging.getLogger("stepwatch")


@dataclass
class Host:
    """A host trainer, as the bridge hands it to the run.

    Attributes:
        name: the host's name (``'lightning'``), stored with the run as ``host``.
        network: what the host trains (a torch module, or the host's own network object).
        optimizer: a torch optimizer, a :class:`HostOptimizer`, or None.
        grads: gradients are on the torch parameters of ``network`` when a step ends.
        restores: rollback may restore ``network`` and ``optimizer`` in place mid-run
            (their ``state_dict``, or ``capture``/``restore``); where False, ``'rollback'``
            stops instead.
        save: writes a checkpoint the host can load to the given path stem and returns the
            file's path (the ``'snapshot'`` action), or None for stepwatch's own checkpoint.
        config: the host's settings, stored with the run (JSON-clean: :func:`clean_config`).
        rank / world: this process's rank and the number of processes.
        loss_scaler: the host's loss scaler (a ``torch.amp.GradScaler``) under mixed precision,
            or None: AnomalyMonitor then expects overflow steps, and rollback restores it.
        capture / restore: for a host whose state is not torch ``state_dict``s (Keras,
            MindSpore): ``capture()`` returns a copy of its weights and optimizer state as the
            host keeps them, ``restore(copy)`` puts one back in place; rollback uses them.
    """

    name: str
    network: Any
    optimizer: Any
    grads: bool
    restores: bool
    save: Callable[[Path], Path] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    world: int = 1
    loss_scaler: Any = None
    capture: Callable[[], Any] | None = None
    restore: Callable[[Any], None] | None = None


class _LrGroup(dict[str, Any]):
    """One parameter group whose ``'lr'`` is the host optimizer's learning rate."""

    def __init__(self, owner: HostOptimizer) -> None:
        super().__init__()
        self._owner = owner

    def __getitem__(self, key: str) -> Any:
        if key == "lr":
            return self._owner.get_lr()
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "lr":
            self._owner.set_lr(float(value))
            return
        super().__setitem__(key, value)

    def get(self, key: str, default: Any = None) -> Any:
        return self["lr"] if key == "lr" else super().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key == "lr" or super().__contains__(key)


class HostOptimizer:
    """A host's optimizer (Keras, MindSpore) as stepwatch's callbacks read optimizers: one
    parameter group whose ``'lr'`` reads and writes the host's learning rate, so
    ``cb_params.lr``, the recorded ``lr``, ``reduce_lr`` and ``ReduceLROnPlateau`` work on it.

    Args:
        optimizer: the host's optimizer object.
        get_lr / set_lr: read and write its learning rate.
    """

    def __init__(
        self, optimizer: Any, get_lr: Callable[[], float], set_lr: Callable[[float], None]
    ) -> None:
        self.optimizer = optimizer
        self.get_lr, self.set_lr = get_lr, set_lr
        self.param_groups = [_LrGroup(self)]

    def state_dict(self) -> dict[str, Any]:
        """The learning rate only: the host keeps the rest of its optimizer's state."""
        return {"lr": self.get_lr()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "lr" in state:
            self.set_lr(float(state["lr"]))

    def __repr__(self) -> str:
        return f"HostOptimizer({type(self.optimizer).__name__}, lr={self.get_lr():g})"


def clean_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as JSON can hold it: numbers, strings, lists and dicts; anything else as
    its text, and values that cannot be turned into text left out."""

    def clean(value: Any, depth: int = 0) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if value == value and abs(value) != float("inf") else str(value)
        if depth < 4 and isinstance(value, Mapping):
            return {str(k): clean(v, depth + 1) for k, v in value.items()}
        if depth < 4 and isinstance(value, (list, tuple)):
            return [clean(v, depth + 1) for v in value]
        text = str(value)
        return text if len(text) <= 200 else text[:197] + "..."

    out = {}
    for key, value in config.items():
        try:
            out[str(key)] = clean(value)
        except Exception:  # a setting whose str() fails is not worth failing a run for
            continue
    json.dumps(out)
    return out


def host_values(values: Mapping[str, Any], *, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """A host's logged epoch values under stepwatch's names (``val_loss`` -> ``eval_loss``,
    :func:`stepwatch.monitor.values.from_host`): the single numbers among them, as floats."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key in skip:
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.detach().item()
        elif hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (TypeError, ValueError):
                continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[names.from_host(str(key))] = float(value)
    return out


class Bridge:
    """The stepwatch side of a host trainer's callback.

    Args:
        callbacks: a stepwatch Callback or a list of them (checked now).
    """

    def __init__(self, callbacks: Any = None) -> None:
        self.callbacks = normalize_callbacks(callbacks)
        self.run: WatchedRun | None = None  # the run in progress
        self.last: WatchedRun | None = None  # the latest run, in progress or ended

    @property
    def running(self) -> bool:
        return self.run is not None

    def begin(
        self,
        host: Host,
        *,
        epochs: int,
        steps_per_epoch: int,
        dataset: Any = None,
        lr_scheduler: Any = None,
        initial_step: int = 0,
        initial_epoch: int = 0,
    ) -> WatchedRun:
        """Open the run: the callbacks' ``on_train_begin`` hooks run here.

        Args:
            host: the host's controls.
            epochs: the host's last epoch (its total); steps_per_epoch: optimizer steps each.
            dataset / lr_scheduler: the host's training data and LR schedule, if torch ones.
            initial_step / initial_epoch: where a resumed host run goes on from (steps and
                epochs already done); the run's step and epoch numbers count on from there.
        """
        if self.run is not None:  # a run the host never ended (it crashed between fits)
            self.end(RuntimeError("the host started a new run before ending this one"))
        run = WatchedRun(
            host.network,
            host.optimizer,
            self.callbacks,
            max(1, int(epochs)),
            max(1, int(steps_per_epoch)),
            lr_scheduler=lr_scheduler,
            dataset=dataset,
            host=host,
            initial_step=max(0, int(initial_step)),
            initial_epoch=max(0, int(initial_epoch)),
        )
        run.__enter__()
        self.run = self.last = run
        return run

    def epoch_begins(self, epoch: int, total: bool = False) -> None:
        """The host's next epoch is ``epoch`` (1-based), for a host that tells where a resumed
        run starts only when its first epoch begins; ``total``: the ``epochs`` given to
        :meth:`begin` counted from epoch 1, not from where the run starts."""
        if self.run is not None:
            self.run._host_epoch(epoch, total)

    def step(self, loss: torch.Tensor, outputs: Any = None, batch: Any = None) -> bool:
        """One optimizer step is done: run the step hooks; return whether to stop."""
        run = self.run
        if run is None:
            return False
        try:
            run.step(loss, outputs, batch)
        except BaseException as exc:
            self.end(exc)
            raise
        return run.should_stop

    def epoch_end(self, values: Mapping[str, float] | None = None) -> bool:
        """An epoch is done, with its values under stepwatch's names (``loss`` replaces the
        mean of the step losses); return whether to stop."""
        run = self.run
        if run is None:
            return False
        values = dict(values or {})
        loss = values.pop(names.LOSS, None)
        try:
            run.epoch_end(loss, **values)
        except BaseException as exc:
            self.end(exc)
            raise
        return run.should_stop

    def end(self, exc: BaseException | None = None) -> None:
        """Close the run: ``on_train_end`` when the host finished, the callbacks' exit with
        ``exc`` when it failed (RunRecorder stores ``failed``, or ``interrupted`` for a
        KeyboardInterrupt)."""
        run, self.run = self.run, None
        if run is None:
            return
        if exc is None:
            run.__exit__(None, None, None)
        else:
            run.__exit__(type(exc), exc, exc.__traceback__)


class BridgeFace:
    """What every bridge's ``StepwatchCallback`` shows its user, over its :class:`Bridge`."""

    _bridge: Bridge

    @property
    def callbacks(self) -> list[Any]:
        """The stepwatch callbacks this bridge runs."""
        return list(self._bridge.callbacks)

    @property
    def run(self) -> WatchedRun | None:
        """The stepwatch run of the latest training, in progress or ended (``run.stop_kind``,
        ``run.rollbacks``, ``run.cb_params``), or None before the first."""
        return self._bridge.last

    @property
    def running(self) -> bool:
        """True while a run is open (the host is training, or failed without telling)."""
        return self._bridge.running

    @property
    def stop_reason(self) -> str | None:
        """Why a stepwatch callback stopped the latest training (``'nonfinite at step 20'``),
        or None."""
        run = self._bridge.last
        return run.stop_reason if run is not None else None
