"""How :class:`~.anomaly.AnomalyMonitor` acts on an alert: the actions asked for each kind
(checked when the monitor is made), the alert path and the bounded window of alerts kept in
memory (:class:`Actions`), and the stop, reduce_lr, snapshot and rollback actions
(:class:`Rollback`: copies of the training state, and a rollback after which the same kind of
alert returns goes to an older copy)."""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..._validation import _got, check_arity, nearest_existing
from ...monitor.detectors import DETECTORS, Alert
from ...view.host import StateControl
from ...view.run import RunView, view_of
from ..resume import build_checkpoint
from ..serialization import write_checkpoint, writes_here
from ._callback import RunContext

__all__ = [
    "ACTIONS",
    "Actions",
    "Rollback",
    "StateKeeper",
    "check_actions",
    "check_snapshot_dir",
    "reduce_lr",
    "state_control",
    "write_snapshot",
]

ACTIONS = ("warn", "stop", "snapshot", "reduce_lr", "rollback")
ActionSpec = str | Callable[[Alert, Any], Any]
# Kinds whose "stop" marks the run as gone wrong (saving callbacks keep the weights out);
# a plateau, a run that does not learn or overfitting stops a healthy model that is done.
_DONE_KINDS = frozenset({"plateau", "overfitting", "threshold", "not_learning", "lr_negligible"})


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
    # A folder made and removed there: permission bits say yes to root where the file system
    # says no (/proc, a read-only mount), so ask the file system itself.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".stepwatch-probe-", dir=existing))
    except OSError as err:
        raise ValueError(
            f"'snapshot_dir' {str(path)!r} cannot be written (no folder can be made in "
            f"{str(existing)!r}: {err.strerror or err}); pass a folder where snapshots can be "
            "written."
        ) from None
    return path


def state_control(view: RunView) -> StateControl | None:
    """What copies and restores the training state for a rollback, or None where the trainer
    cannot be restored mid-run: the state control the trainer put in its run view
    (stepwatch's ``TrainingState`` for a torch run, the host's own for Keras or MindSpore).
    The one place the rollback chooses it."""
    return view.state


class StateKeeper:
    """Copies of the training state taken every ``every`` steps, for rollback: the newest
    ``keep``, so that one taken before an anomaly's onset is at hand when the anomaly is read a
    few steps later, and an older one when the first rollback's copy turns out to hold it.

    A rollback goes to the newest copy taken before the alert's step. When an alert of the
    same kind comes back while the copy its last rollback went to is still kept, that copy
    and every one taken after it (they descend from it) are dropped: the next rollback goes
    to an older copy."""

    def __init__(self, state: StateControl, every: int, keep: int = 4) -> None:
        self.state = state
        self.every = every
        self.keep = max(2, keep)
        self.states: list[tuple[int, Any]] = []
        self._targets: dict[str, int] = {}  # kind -> the copy its last rollback went to

    def maybe_keep(self, step: int) -> None:
        """Copy the state of ``step`` (its update done): at the run's first step and at the
        multiples of ``every``."""
        if step % self.every and self.states:
            return
        self.states = [*self.states[1 - self.keep :], (step, self.state.capture())]

    def tried(self, kind: str) -> int | None:
        """The step of the copy the last rollback for ``kind`` went to, if that copy is still
        kept (the same kind coming back now means the copy holds the anomaly), else None."""
        at = self._targets.get(kind)
        return at if at is not None and any(s == at for s, _ in self.states) else None

    def restore_before(self, step: int, kind: str = "") -> int | None:
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
        self.state.restore(state)
        self._targets[kind] = at
        return at


class Rollback:
    """The ``'rollback'`` action: the copies it goes back to (a :class:`StateKeeper` while the
    run's trainer can restore its state, made only when some kind's action is a rollback),
    its limit, and its count, which is the run's record of rollbacks
    (:attr:`~stepwatch.view.run.RunView.rollbacks`: ``(restored_step, at_step)`` each).

    Args:
        limit: rollbacks allowed in one run.
        every: steps between the copies.
        wanted: copies are kept (some kind's action is a rollback).
    """

    def __init__(self, limit: int, every: int, wanted: bool) -> None:
        self.limit = limit
        self.every = every
        self.wanted = wanted
        self.reset()

    def reset(self) -> None:
        self.keeper: StateKeeper | None = None
        self.done: list[tuple[int, int]] = []  # the run view's list while a run is on

    def begin(self, view: RunView) -> None:
        self.done = view.rollbacks
        state = state_control(view) if self.wanted else None
        keep = min(self.limit, 3) + 1
        self.keeper = StateKeeper(state, self.every, keep) if state is not None else None

    @property
    def count(self) -> int:
        """Rollbacks done in this run (the last run, after it ended)."""
        return len(self.done)

    def keep(self, step: int) -> None:
        """Copy the state when ``step`` is one of the copies' steps."""
        if self.keeper is not None:
            self.keeper.maybe_keep(step)

    def roll(self, alert: Alert, now: int) -> tuple[int | None, int | None]:
        """Restore the newest copy from before ``alert``'s step (an older one when the same
        kind came back after a rollback) at step ``now``: ``(its step or None when there is
        none, the copy the last rollback for this kind went to when it came back)``."""
        assert self.keeper is not None
        tried = self.keeper.tried(alert.kind)  # the same kind came back after a rollback
        at = self.keeper.restore_before(alert.step, alert.kind)
        if at is not None:
            self.done.append((at, now))
        return at, tried


def _trim(items: list[Any], keep: int) -> None:
    if len(items) > keep:
        del items[: len(items) - keep]


class Actions:
    """What AnomalyMonitor does with an alert: emits it on the run's alert path (logged,
    stored, acted on), keeps the newest ``max_alerts`` alerts and outcomes, and runs the
    actions asked for its kind.

    Args:
        action: the monitor's ``action`` argument; ``kinds``: the detector kinds it may name.
        lr_factor / snapshot_dir / max_alerts / max_rollbacks / rollback_every: as the
            monitor's arguments.
        source: the name the alerts are emitted under.
    """

    def __init__(
        self,
        action: Any,
        kinds: Sequence[str],
        *,
        lr_factor: float,
        snapshot_dir: Path,
        max_alerts: int,
        max_rollbacks: int,
        rollback_every: int,
        source: str,
    ) -> None:
        self.default, self.by_kind = check_actions(action, kinds)
        self.lr_factor = lr_factor
        self.snapshot_dir = snapshot_dir
        self.max_alerts = max_alerts
        self.source = source
        every_action = [self.default, *self.by_kind.values()]
        named = {a for actions in every_action for a in actions if isinstance(a, str)}
        self.changes_optimizer = sorted(named & {"reduce_lr", "rollback"})
        self.rollback = Rollback(max_rollbacks, rollback_every, "rollback" in named)
        self.reset()

    def reset(self) -> None:
        self.alerts: list[Alert] = []
        self.outcomes: list[str] = []  # what the actions did, one entry per alert
        self.rollback.reset()
        self._view: RunView | None = None
        self._window: Callable[[], dict[str, list[Any]]] = dict
        self._rolled_back: Callable[[int], None] = _nothing
        self.ending = False  # the run is ending: no step is left after what is read now

    def begin(
        self,
        view: RunView,
        window: Callable[[], dict[str, list[Any]]],
        rolled_back: Callable[[int], None],
    ) -> None:
        """A run starts. ``window()``: the recent values a snapshot keeps; ``rolled_back(step)``:
        told after a rollback at ``step`` (what waits to be read came from undone steps)."""
        self._view = view
        self._window, self._rolled_back = window, rolled_back
        self.rollback.begin(view)

    def end(self) -> None:
        """The run is over: no view or callbacks of it kept."""
        self._view = None
        self._window, self._rolled_back = dict, _nothing

    def raise_(self, alert: Alert, run_context: RunContext, act: bool = True) -> None:
        """Emit ``alert`` (with its kind's actions when ``act``) and keep it."""
        assert self._view is not None
        actions = self.by_kind.get(alert.kind, self.default)
        raised = self._view.alerts.emit(
            alert,
            [functools.partial(self._act, action, run_context=run_context) for action in actions],
            source=self.source,
            act=act,
        )
        # the newest max_alerts in memory (the store keeps them all)
        self.alerts.append(alert)
        self.outcomes.append(raised.outcome)
        _trim(self.alerts, self.max_alerts)
        _trim(self.outcomes, self.max_alerts)

    def _act(self, action: ActionSpec, alert: Alert, *, run_context: RunContext) -> str:
        p = run_context.original_args()
        if callable(action):
            action(alert, run_context)
            return f"called {getattr(action, '__name__', type(action).__name__)}"
        if action == "warn":
            return ""
        if action == "stop":
            return _stop(alert, run_context)
        if action == "reduce_lr":
            return reduce_lr_outcome(p, self.lr_factor)
        if action == "snapshot":
            if not writes_here(p):  # a sharded run's snapshot: every rank writes its shards
                return "snapshot written by rank 0"
            return snapshot_outcome(self.snapshot_dir, alert, p, self._window())
        return self._roll_back(alert, run_context)

    def _roll_back(self, alert: Alert, run_context: RunContext) -> str:
        rollback = self.rollback
        if rollback.count >= rollback.limit:
            return f"rollback limit ({rollback.limit}) reached, {_stop(alert, run_context)}"
        if rollback.keeper is None:
            host = self._view.host if self._view is not None else "this trainer"
            stopping = _stop(alert, run_context)
            return f"{host} cannot restore weights and optimizer mid-run, {stopping}"
        now = run_context.original_args().cur_step_num
        view = self._view
        planned = view.epochs * view.steps_per_epoch if view is not None else 0
        if self.ending or 0 < planned <= now:  # the run's last step: none left after it
            return (
                f"not rolled back: the run ended at step {now}, no step is left to go on "
                f"from (the weights are step {now}'s)"
            )
        at, tried = rollback.roll(alert, now)
        if at is None:
            stopping = _stop(alert, run_context)
            what = f"copy older than step {tried}" if tried is not None else "state from before"
            if tried is None:
                what += f" step {alert.step}"
            return f"no {what} to roll back to, {stopping}"
        self._rolled_back(now)
        again = f"; the {alert.kind} came back after the rollback to {tried}" if tried else ""
        skipped = (
            f"the batches of steps {at + 1}-{now} are skipped"
            if now > at + 1
            else f"the batch of step {now} is skipped"
        )
        return f"rolled back to step {at} ({rollback.count} of {rollback.limit}{again}); {skipped}"


def _stop(alert: Alert, run_context: RunContext) -> str:
    if alert.kind in _DONE_KINDS:
        run_context.request_stop(f"{alert.kind} at step {alert.step}")
    else:
        run_context.request_stop(f"{alert.kind} at step {alert.step}", kind="anomaly")
    return "stopping training"


def _nothing(step: int) -> None:
    return None


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
