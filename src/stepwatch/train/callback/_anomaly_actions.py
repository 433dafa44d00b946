"""What :class:`AnomalyMonitor` measures on the device and what its actions do: gradient
statistics in one packed tensor, and the snapshot, reduce_lr and rollback actions."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._validation import _got, check_arity, nearest_existing
from ...monitor.detectors import DETECTORS, Alert
from ...view.host import StateControl
from ...view.run import view_of
from ..resume import build_checkpoint
from ..serialization import write_checkpoint

__all__ = [
    "ACTIONS", "ActivationStats", "GradStats", "StateKeeper", "check_actions",
    "check_snapshot_dir", "classes_of", "reduce_lr", "write_snapshot",
]  # fmt: skip

ACTIONS = ("warn", "stop", "snapshot", "reduce_lr", "rollback")
ActionSpec = str | Callable[[Alert, Any], Any]

logger = logging.getLogger("stepwatch")


def _one_action(name: str, value: Any) -> tuple[ActionSpec, ...]:
    if callable(value):
        check_arity(name, value, "fn(alert, run_context)", (None, None))
        return (value,)
    if isinstance(value, str):
        if value not in ACTIONS:
            raise ValueError(
                f"'{name}' must be one of {', '.join(map(repr, ACTIONS))} or a callable "
                f"fn(alert, run_context), but got {value!r}."
            )
        return (value,)
    if isinstance(value, (list, tuple)) and value:
        return tuple(a for item in value for a in _one_action(name, item))
    raise TypeError(
        f"'{name}' must be an action name ({', '.join(map(repr, ACTIONS))}), a callable "
        f"fn(alert, run_context) or a list of them, but got {_got(value)}."
    )


def check_actions(
    action: Any, kinds: Sequence[str] = tuple(DETECTORS)
) -> tuple[tuple[ActionSpec, ...], dict[str, tuple[ActionSpec, ...]]]:
    """``(default actions, {kind: actions})`` from ``action``: one action, a list of them, or a
    dict of detector kind (one of ``kinds``) -> action(s) (kinds not in it warn)."""
    if isinstance(action, Mapping):
        per_kind = {}
        for kind, value in action.items():
            if kind not in kinds:
                known = ", ".join(map(repr, kinds))
                raise ValueError(
                    f"'action' names an unknown detector kind {kind!r}; known: {known}."
                )
            per_kind[kind] = _one_action(f"action[{kind!r}]", value)
        return ("warn",), per_kind
    return _one_action("action", action), {}


def check_snapshot_dir(snapshot_dir: Any) -> Path | None:
    if snapshot_dir is None:
        return None
    if not isinstance(snapshot_dir, (str, Path)) or not str(snapshot_dir):
        raise TypeError(
            f"'snapshot_dir' must be a folder path (str or Path), got {_got(snapshot_dir)}."
        )
    path = Path(snapshot_dir)
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(
            f"'snapshot_dir' must be a folder, but {str(existing)!r} is a file; pass a folder "
            "path (it is created when the first snapshot is written)."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"'snapshot_dir' {str(path)!r} cannot be written ({str(existing)!r} is read-only or "
            "not yours); pass a folder where snapshots can be written."
        )
    return path


class GradStats:
    """Per-layer gradient statistics, measured on the device in one op per layer and packed in
    one tensor, so they reach the host in one transfer.

    A *layer* is a trainable parameter with two or more dimensions (a weight matrix or a
    convolution kernel); a network without any is measured parameter by parameter. For each
    output unit (row) of each layer the device computes its gradient's norm; the host sums
    them into the layer's norm and counts the rows whose gradient is exactly zero, which is a
    dead ReLU unit's signature.
    """

    def __init__(self, network: torch.nn.Module) -> None:
        named = [(n, p) for n, p in network.named_parameters() if p.requires_grad]
        layers = [(n, p) for n, p in named if p.dim() >= 2] or named
        self.names = [n for n, _ in layers]
        self.params = [p for _, p in layers]
        self.rows = [max(1, p.shape[0]) if p.dim() else 1 for p in self.params]
        self._matrix = [p.dim() == 2 and p.shape[0] > 0 for p in self.params]  # no reshape op
        self._starts = [0, *itertools.accumulate(self.rows)][:-1]
        self._size = sum(self.rows)
        self._buffer: torch.Tensor | None = None  # the measurement, reused
        self._views: list[torch.Tensor] = []
        self._shape = (-2, 0)  # the buffer's device index and length

    def measure(self, extra: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
        """``[row norms of each layer..., extra...]`` on the device in one 1-D float32 tensor,
        or None when some layer has no gradient yet. ``extra``: single values (0-d tensors on
        the same device) to pack with them.

        The tensor is the same buffer at each call (written in place, one op a layer and no
        concatenation): read or copy it before the next measurement."""
        params = self.params
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or len(grads) < len(params):
            return None
        buffer, views = self._buffer, self._views
        where, size = grads[0].get_device(), self._size + len(extra)  # (-1: the CPU)
        if buffer is None or (where, size) != self._shape:
            self._shape = (where, size)
            buffer = torch.empty(size, dtype=torch.float32, device=grads[0].device)
            self._buffer = buffer
            views = self._views = [buffer[s : s + r] for s, r in zip(self._starts, self.rows)]
        norm = torch.linalg.vector_norm
        f32 = torch.float32
        for g, r, matrix, out in zip(grads, self.rows, self._matrix, views):
            g = g if matrix else g.reshape(r, -1)
            if g.dtype is torch.float64:  # (norm's dtype= does not narrow)
                out.copy_(norm(g, dim=1))
            else:
                norm(g, dim=1, dtype=f32, out=out)
        if extra:
            torch.stack(list(extra), out=buffer[self._size :])
        return buffer

    def split(self, host: torch.Tensor) -> tuple[float, list[float], list[float], list[float]]:
        """``(global norm, norms, dead fractions, extra values)`` from a measurement on the
        host."""
        values = host.tolist()
        norms, dead = [], []
        for start, rows in zip(self._starts, self.rows):
            layer = values[start : start + rows]
            norms.append(math.hypot(*layer))
            dead.append(layer.count(0.0) / rows)
        end = self._starts[-1] + self.rows[-1]
        return math.hypot(*norms), norms, dead, values[end:]


class ActivationStats:
    """The fraction of each tanh/sigmoid module's outputs at the rails (|tanh| > 0.99, a
    sigmoid within 0.005 of 0 or 1), measured on the device in the forward pass after
    :meth:`arm` and taken with the gradient statistics: forward hooks exist only between the
    two, so a step that is not sampled runs no hook. A module used twice keeps its larger
    fraction. Not for a compiled network (a hook there would recompile it)."""

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self.names = [n for n, _ in modules]
        self.modules = [m for _, m in modules]
        self._handles: list[Any] = []
        self._seen: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, network: torch.nn.Module) -> ActivationStats | None:
        """The statistics of ``network``'s tanh/sigmoid modules; None when it has none."""
        if hasattr(network, "_orig_mod"):
            return None
        found = [(n, m) for n, m in network.named_modules() if isinstance(m, (nn.Tanh, nn.Sigmoid))]
        return cls(found) if found else None

    def arm(self) -> None:
        if not self._handles:
            self._handles = [
                m.register_forward_hook(functools.partial(self._hook, i))
                for i, m in enumerate(self.modules)
            ]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.numel():
            return
        with torch.no_grad():
            y = output.detach()
            if isinstance(module, nn.Sigmoid):
                y = y * 2.0 - 1.0
            frac = (y.abs() > 0.99).float().mean()
            prev = self._seen.get(index)
            self._seen[index] = frac if prev is None else torch.maximum(prev, frac)

    def take(self) -> list[torch.Tensor]:
        """The fractions (one 0-d tensor per module) when every module was seen, else none;
        the hooks are removed."""
        self.disarm()
        seen, self._seen = self._seen, {}
        if len(seen) < len(self.modules):
            return []
        return [seen[i] for i in range(len(self.modules))]


def classes_of(loss_fn: Any, outputs: Any) -> int | None:
    """The number of classes of a CrossEntropyLoss/NLLLoss classifier (the outputs' width),
    or None for another loss or unknown outputs."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return None
    if not isinstance(outputs, torch.Tensor) or outputs.ndim < 2:
        return None
    classes = int(outputs.shape[1])
    return classes if classes >= 2 else None


class StateKeeper:
    """Copies of the training state taken every ``every`` steps, for rollback: the newest
    ``keep``, so that one taken before an anomaly's onset is at hand when the anomaly is read a
    few steps later, and an older one when the first rollback's copy turns out to hold it.

    A rollback goes to the newest copy taken before the alert's step. When an alert of the
    same kind comes back while the copy its last rollback went to is still kept, that copy
    and every one taken after it (they descend from it) are dropped: the next rollback goes
    to an older copy."""

    def __init__(self, every: int, keep: int = 4) -> None:
        self.every = every
        self.keep = max(2, keep)
        self.states: list[tuple[int, dict[str, Any]]] = []
        self._targets: dict[str, int] = {}  # kind -> the copy its last rollback went to

    def maybe_keep(self, step: int, cb_params: Any) -> None:
        if step % self.every:
            return
        state = _state_control(cb_params).capture()
        self.states = [*self.states[1 - self.keep :], (step, state)]

    def tried(self, kind: str) -> int | None:
        """The step of the copy the last rollback for ``kind`` went to, if that copy is still
        kept (the same kind coming back now means the copy holds the anomaly), else None."""
        at = self._targets.get(kind)
        return at if at is not None and any(s == at for s, _ in self.states) else None

    def restore_before(self, step: int, cb_params: Any, kind: str = "") -> int | None:
        """Restore the newest state taken before ``step`` (and, when ``kind`` came back after
        a rollback, before that rollback's copy); return its step (None if none). States
        taken at or after ``step`` are dropped: they may hold the anomaly."""
        limit = step
        tried = self.tried(kind)
        if tried is not None:
            limit = min(limit, tried)
        self.states = [(s, state) for s, state in self.states if s < limit]
        if not self.states:
            return None
        at, state = self.states[-1]
        _state_control(cb_params).restore(state)
        self._targets[kind] = at
        return at


def _state_control(cb_params: Any) -> StateControl:
    """The trainer's state control (the run view's): rollback copies and restores through it."""
    state = view_of(cb_params).state
    if state is None:  # the keeper is made only where the trainer restores
        raise RuntimeError("this run's trainer cannot restore its state in place")
    return state


def host_restores(view: Any) -> bool:
    """Whether the trainer lets a rollback restore its weights and optimizer in place."""
    return view.state is not None


def note_no_gradients(view: Any, detectors: Sequence[Any]) -> None:
    """Say once, on rank 0, that a host without gradients (nor the network) turns the
    gradient and activation detectors off."""
    if view.rank == 0:
        kinds = "/".join(d.kind for d in detectors if d is not None and d.kind != "saturation")
        also = any(d is not None and d.kind == "saturation" for d in detectors)
        logger.info(
            "AnomalyMonitor: %s gives no gradients, so the %s detectors are off%s",
            view.host,
            kinds,
            " (and saturation, which rides on their sampled steps)" if also else "",
        )


def reduce_lr(cb_params: Any, factor: float) -> list[float]:
    """Multiply every parameter group's learning rate (and a scheduler's base rates, which
    it would otherwise restore) by ``factor``; return the new rates."""
    rates = view_of(cb_params).rates
    if rates is None:
        return []
    rates.set([rate * factor for rate in rates.get()])
    scheduler = cb_params.get("lr_scheduler")
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    return rates.get()


def reduce_lr_outcome(cb_params: Any, factor: float) -> str:
    """The ``'reduce_lr'`` action: what :func:`reduce_lr` did, in words."""
    try:
        rates = reduce_lr(cb_params, factor)
    except ValueError as exc:  # a host whose rate is a schedule it owns
        return f"learning rate not reduced: {exc}"
    return f"learning rate reduced to {rates[0]:g}" if rates else "no optimizer"


def snapshot_outcome(
    folder: Path, alert: Alert, cb_params: Any, window: Mapping[str, Sequence[Any]]
) -> str:
    """The ``'snapshot'`` action: :func:`write_snapshot`, and what it did in words."""
    try:
        path = write_snapshot(folder, alert, cb_params, window)
    except OSError as exc:
        return f"snapshot failed: {exc}"
    return f"snapshot written to {path}"


def write_snapshot(
    folder: Path, alert: Alert, cb_params: Any, window: Mapping[str, Sequence[Any]]
) -> Path:
    """Write a checkpoint of the run as it is now (resumable, through the checkpoint code;
    under a bridge, the host trainer's own checkpoint) and, beside it, the alert and the
    recent metric window as JSON; return the checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"anomaly-{alert.kind}-step{alert.step}"
    save = view_of(cb_params).controls.save
    if save is not None:
        path = save(folder / stem)
    else:
        checkpoint = build_checkpoint(cb_params, epoch_complete=False)
        path = write_checkpoint(checkpoint, folder / f"{stem}.pt")  # sharded: every rank
        if cb_params.rank_id != 0:
            return path

    def clean(value: Any) -> Any:
        return value if not isinstance(value, float) or math.isfinite(value) else str(value)

    record = {
        "alert": {k: clean(v) for k, v in asdict(alert).items()},
        "checkpoint": path.name,
        "trained_step": int(cb_params.progress.trained_step),
        "window": {k: [clean(v) for v in vs] for k, vs in window.items()},
    }
    tmp = folder / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(folder / f"{stem}.json")
    return path
