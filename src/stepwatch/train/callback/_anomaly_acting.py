"""How :class:`~.anomaly.AnomalyMonitor` acts on an alert: the alert path, the bounded window
of alerts kept in memory, and the stop and rollback actions (a rollback after which the same
kind of alert returns goes to an older copy)."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...monitor.detectors import Alert, Detector
from ...view.run import RunView, view_of
from ..serialization import writes_here
from ._anomaly_actions import StateKeeper, reduce_lr_outcome, snapshot_outcome
from ._callback import RunContext

__all__ = ["Acting"]

# Kinds whose "stop" marks the run as gone wrong (saving callbacks keep the weights out);
# a plateau, a run that does not learn or overfitting stops a healthy model that is done.
_DONE_KINDS = frozenset({"plateau", "overfitting", "threshold", "not_learning", "lr_negligible"})


def _trim(items: list[Any], keep: int) -> None:
    if len(items) > keep:
        del items[: len(items) - keep]


class Acting:
    """The acting half of AnomalyMonitor (a mixin: the monitor holds the state named here)."""

    alerts: list[Alert]
    outcomes: list[str]
    rollbacks: int
    max_rollbacks: int
    max_alerts: int
    lr_factor: float
    snapshot_dir: Path
    _view: RunView | None
    _rank: int
    _keeper: StateKeeper | None
    _kind_actions: dict[str, tuple[Any, ...]]
    _default_actions: tuple[Any, ...]
    _history: dict[str, deque[Any]]
    _loss_window: deque[tuple[Any, Any]]
    window: int
    _undone: int
    _inflight: deque[tuple[Any, ...]]
    _block: list[Any]
    _slow_wait: list[Any]
    _slow_count: int
    detectors: list[Detector]

    def _raise(self, alert: Alert, run_context: RunContext, act: bool = True) -> None:
        assert self._view is not None
        actions = self._kind_actions.get(alert.kind, self._default_actions)
        raised = self._view.alerts.emit(
            alert,
            [functools.partial(self._act, action, run_context=run_context) for action in actions],
            source=type(self).__name__,
            act=act,
        )
        # the newest max_alerts in memory (the store keeps them all)
        self.alerts.append(alert)
        self.outcomes.append(raised.outcome)
        _trim(self.alerts, self.max_alerts)
        _trim(self.outcomes, self.max_alerts)

    def _act(
        self, action: str | Callable[..., Any], alert: Alert, *, run_context: RunContext
    ) -> str:
        p = run_context.original_args()
        if callable(action):
            action(alert, run_context)
            return f"called {getattr(action, '__name__', type(action).__name__)}"
        if action == "warn":
            return ""
        if action == "stop":
            return self._stop(alert, run_context)
        if action == "reduce_lr":
            return reduce_lr_outcome(p, self.lr_factor)
        if action == "snapshot":
            if not writes_here(p):  # a sharded run's snapshot: every rank writes its shards
                return "snapshot written by rank 0"
            window = self._window()
            return snapshot_outcome(self.snapshot_dir, alert, p, window)
        return self._rollback(alert, run_context)

    def _window(self) -> dict[str, list[Any]]:
        """The recent values a snapshot keeps: the last ``window`` step losses and gradient
        norms, with their steps."""
        steps: list[int] = []
        losses: list[float] = []
        for chunk_steps, chunk_losses in self._loss_window:
            steps.extend(chunk_steps)
            losses.extend(chunk_losses)
        window: dict[str, list[Any]] = {"step": steps[-self.window :]}
        window["loss"] = losses[-self.window :]
        return window | {k: list(v) for k, v in self._history.items()}

    def _stop(self, alert: Alert, run_context: RunContext) -> str:
        if alert.kind in _DONE_KINDS:
            run_context.request_stop(f"{alert.kind} at step {alert.step}")
        else:
            run_context.request_stop(f"{alert.kind} at step {alert.step}", kind="anomaly")
        return "stopping training"

    def _rollback(self, alert: Alert, run_context: RunContext) -> str:
        if self.rollbacks >= self.max_rollbacks:
            return (
                f"rollback limit ({self.max_rollbacks}) reached, {self._stop(alert, run_context)}"
            )
        p = run_context.original_args()
        if self._keeper is None:
            stopping, host = self._stop(alert, run_context), view_of(p).host
            return f"{host} cannot restore weights and optimizer mid-run, {stopping}"
        tried = self._keeper.tried(alert.kind)  # the same kind came back after a rollback
        at = self._keeper.restore_before(alert.step, p, alert.kind)
        if at is None:
            stopping = self._stop(alert, run_context)
            what = f"copy older than step {tried}" if tried is not None else "state from before"
            if tried is None:
                what += f" step {alert.step}"
            return f"no {what} to roll back to, {stopping}"
        self.rollbacks += 1
        # What is still waiting to be read came from the undone steps.
        self._undone = p.cur_step_num
        self._inflight.clear()
        self._block = []
        self._slow_wait, self._slow_count = [], 0
        for detector in self.detectors:
            restart = getattr(detector, "restart_level", None)
            if restart is not None:
                restart()  # the restored state is judged afresh: the same kind may fire again
        now = p.cur_step_num
        assert self._view is not None
        self._view.rollbacks.append((at, now))
        again = f"; the {alert.kind} came back after the rollback to {tried}" if tried else ""
        skipped = (
            f"the batches of steps {at + 1}-{now} are skipped"
            if now > at + 1
            else f"the batch of step {now} is skipped"
        )
        return (
            f"rolled back to step {at} ({self.rollbacks} of {self.max_rollbacks}{again}); {skipped}"
        )
