"""What every bridge shares: the host as the run engine sees it, and one run driven by host
hooks.

A bridge is a host trainer's callback holding a :class:`Bridge`. From the host's hooks it
calls :meth:`Bridge.begin` (the host's controls, network and optimizer, as :class:`Host`),
:meth:`Bridge.step` after each optimizer step, :meth:`Bridge.epoch_end` with the epoch's
values, and :meth:`Bridge.end`; ``step`` and ``epoch_end`` return whether to stop, and the
bridge sets the host's own stop flag. Each training of the host is one
:class:`~stepwatch.train.engine.RunEngine`, driven through its public API as ``Model`` and
``stepwatch.watch`` drive it, so the stepwatch callbacks see the cb_params and run view they
see under ``stepwatch.Model``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..monitor import values as names
from ..train.callback._callback import normalize_callbacks
from ..train.engine import RunEngine
from ..train.sharded import is_sharded
from ..view.host import HostControls

__all__ = [
    "Bridge",
    "BridgeFace",
    "Host",
    "RateFunctions",
    "clean_config",
    "host_values",
    "sharding_of",
]

logger = logging.getLogger("stepwatch")


@dataclass
class Host:
    """A host trainer, as a bridge hands it to the run engine.

    Attributes:
        controls: what the host lets the monitors do (:class:`~stepwatch.view.host.HostControls`:
            its name, state copies for rollback, learning rates, checkpoint writer, whether
            gradients are on torch parameters, its loss scaler and settings).
        network: what the host trains (``cb_params.network``): a torch module, or the host's
            own network object (a MindSpore ``Cell``).
        optimizer: the host's optimizer (``cb_params.optimizer``), of the host's own kind.
        rank / world: this process's rank and the number of processes.
    """

    controls: HostControls
    network: Any
    optimizer: Any
    rank: int = 0
    world: int = 1


class RateFunctions:
    """:class:`~stepwatch.view.host.LearningRates` of a host whose optimizer has one learning
    rate, read and written by two functions (Keras, MindSpore)."""

    def __init__(self, get: Callable[[], float], set: Callable[[float], None]) -> None:
        self._get, self._set = get, set

    def get(self) -> list[float]:
        return [float(self._get())]

    def set(self, rates: Sequence[float]) -> None:
        if len(rates) != 1:
            raise ValueError(
                f"got {len(rates)} learning rates for a host optimizer of one rate; pass one."
            )
        self._set(float(rates[0]))

    def __repr__(self) -> str:
        return f"RateFunctions(lr={self._get():g})"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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
        if callable(value) and hasattr(value, "__qualname__"):  # a function, a class
            return f"{getattr(value, '__module__', '') or ''}.{value.__qualname__}".lstrip(".")
        text = _ADDRESS.sub("", str(value))  # no memory address: equal settings, equal text
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


def sharding_of(module: Any) -> str | None:
    """How a host's torch module is sharded over the ranks: ``'fsdp2'`` (``fully_shard``: its
    parameters are DTensors, whose gradients the detectors read as the full model's and
    whose shards a rollback copies rank by rank), ``'fsdp1'`` (``FullyShardedDataParallel``:
    flattened shards, which stepwatch does not read), or None (whole on every rank)."""
    if not isinstance(module, torch.nn.Module):
        return None
    if "torch.distributed.fsdp" in sys.modules:  # (else nothing is sharded with it)
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            return "fsdp1"
    return "fsdp2" if is_sharded(module) else None


class Bridge:
    """The stepwatch side of a host trainer's callback: it drives one
    :class:`~stepwatch.train.engine.RunEngine` per training of the host.

    Args:
        callbacks: a stepwatch Callback or a list of them (checked now).
    """

    def __init__(self, callbacks: Any = None, owner: str = "StepwatchCallback") -> None:
        if callbacks is None:
            raise TypeError(
                f"{owner}() got no callbacks: pass the stepwatch callbacks it runs, "
                f"{owner}([RunRecorder(), AnomalyMonitor(), ...]) (an empty list runs none). A "
                "trainer handed the class itself makes one this way: pass an instance."
            )
        self.callbacks = normalize_callbacks(callbacks)
        self.run: RunEngine | None = None  # the run in progress
        self.last: RunEngine | None = None  # the latest run, in progress or ended

    @property
    def running(self) -> bool:
        return self.run is not None

    def begin(self, host: Host, *, epochs: int, initial_epoch: int = 0, **run: Any) -> RunEngine:
        """Open the run: the callbacks' ``on_train_begin`` hooks run here.

        Args:
            host: the host's controls and parts.
            epochs: the host's last epoch (its total, counted from 1).
            initial_epoch: epochs a resumed host run already did; the run's epoch numbers
                count on from there.
            run: the rest of :class:`~stepwatch.train.engine.RunEngine`'s arguments:
                ``steps_per_epoch``, ``initial_step``, ``dataset``, ``lr_scheduler``,
                ``loss_fn``.
        """
        if self.run is not None:  # a run the host never ended (it crashed between fits)
            self.end(RuntimeError("the host started a new run before ending this one"))
        epochs, initial_epoch = max(1, int(epochs)), max(0, int(initial_epoch))
        run["steps_per_epoch"] = max(1, int(run["steps_per_epoch"]))
        run["initial_step"] = max(0, int(run.get("initial_step", 0)))
        engine = RunEngine(
            self.callbacks,
            host.controls,
            network=host.network,
            optimizer=host.optimizer,
            # the run trains the epochs after the ones already done
            epochs=max(1, epochs - initial_epoch) if initial_epoch else epochs,
            initial_epoch=initial_epoch,
            rank=host.rank,
            world=host.world,
            **run,
        )
        engine.open()
        self.run = self.last = engine
        return engine

    def epoch_begins(self, epoch: int, total: bool = False) -> None:
        """The host's next epoch is ``epoch`` (1-based), for a host that tells where a resumed
        run starts only when its first epoch begins; ``total``: the ``epochs`` given to
        :meth:`begin` counted from epoch 1, not from where the run starts."""
        if self.run is not None:
            self.run.number_epochs(epoch, total=total)

    def step(self, loss: torch.Tensor, outputs: Any = None, batch: Any = None) -> bool:
        """One optimizer step is done: run the step hooks; return whether to stop."""
        run = self.run
        if run is None:
            return False
        try:
            return run.step(loss, outputs, batch)
        except BaseException as exc:
            self.end(exc)
            raise

    def epoch_end(self, values: Mapping[str, float] | None = None) -> bool:
        """An epoch is done, with its values under stepwatch's names (``loss`` replaces the
        mean of the step losses); return whether to stop."""
        run = self.run
        if run is None:
            return False
        try:
            return run.end_epoch(values)
        except BaseException as exc:
            self.end(exc)
            raise

    def end(self, exc: BaseException | None = None) -> None:
        """Close the run: ``on_train_end`` when the host finished, the callbacks' exit with
        ``exc`` when it failed (RunRecorder stores ``failed``, or ``interrupted`` for a
        KeyboardInterrupt)."""
        run, self.run = self.run, None
        if run is not None:
            run.close(exc)


# Hooks another trainer asks its callbacks for first, and the trainer each one means: a
# bridge handed to the wrong trainer is told which bridge belongs there.
_ASKED_BY = {
    "set_model": "keras",
    "set_params": "keras",
    "on_batch_begin": "keras",
    "on_batch_end": "keras",
    "on_train_batch_begin": "keras",
    "setup": "lightning",
    "teardown": "lightning",
    "on_fit_start": "lightning",
    "on_train_batch_start": "lightning",
    "on_exception": "lightning",
    "on_init_end": "transformers",
    "on_step_begin": "transformers",
    "on_optimizer_step": "transformers",
    "begin": "mindspore",
    "step_end": "mindspore",
    "on_train_step_end": "mindspore",
}


class BridgeFace:
    """What every bridge's ``StepwatchCallback`` shows its user, over its :class:`Bridge`."""

    _bridge: Bridge
    host = ""  # the trainer this bridge runs in ('keras', 'lightning', ...)

    def __getattr__(self, name: str) -> Any:
        # Only for what the bridge's own trainer class lacks: another trainer's first hook.
        other = _ASKED_BY.get(name)
        if other is not None and other != self.host:
            raise AttributeError(
                f"{type(self).__module__}.StepwatchCallback is stepwatch's bridge into "
                f"{self.host}, and {other} asked it for its hook {name!r}: in {other}, use "
                f"stepwatch.integrations.{other}.StepwatchCallback([...]) instead."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def callbacks(self) -> list[Any]:
        """The stepwatch callbacks this bridge runs."""
        return list(self._bridge.callbacks)

    @property
    def run(self) -> RunEngine | None:
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
