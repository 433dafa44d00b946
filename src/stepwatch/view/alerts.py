"""One alert path: every alert a monitor raises is acted on, logged once and written to the
run store, the same way whoever raised it (``AnomalyMonitor``, ``DistributedMonitor``, a
user's own detector)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..monitor.detectors import Alert

__all__ = ["AlertPath", "Raised"]

logger = logging.getLogger("stepwatch")

# An action takes the alert and returns what it did, in words ('' for nothing).
Act = Callable[[Alert], str]


@dataclass(frozen=True, slots=True)
class Raised:
    """An alert and what was done about it (one entry per action, '' for 'warn')."""

    alert: Alert
    source: str
    actions: tuple[str, ...]

    @property
    def outcome(self) -> str:
        return "; ".join(a for a in self.actions if a)


class AlertPath:
    """Acts on, logs and records the run's alerts.

    Args:
        view: the run view (for the rank and the store the alerts are written to).
    """

    def __init__(self, view: Any) -> None:
        self._view = view
        self.raised: deque[Raised] = deque(maxlen=1000)  # the newest; the store has them all

    def emit(
        self, alert: Alert, actions: Sequence[Act] = (), *, source: str = "", act: bool = True
    ) -> Raised:
        """Run ``actions`` on ``alert`` (unless ``act`` is False: then the alert is recorded
        with 'no action' and the reason in ``source``'s words), log it once on rank 0 (logger
        ``'stepwatch'``, WARNING) with what the actions did, and write it as an ``alert`` event
        when the run has a store."""
        if act:
            done = tuple(fn(alert) for fn in actions)
        else:
            done = ("no action: its steps were rolled back",)
        raised = Raised(alert, source, done)
        self.raised.append(raised)
        view = self._view
        did = raised.outcome
        if view.rank == 0:
            logger.warning("%s%s", alert.message, f" [{did}]" if did else "")
        sink = view.sink
        if sink is not None:
            data = {"kind": alert.kind, "value": alert.value, "actions": list(done)}
            if source:
                data["source"] = source
            text = alert.message.removeprefix(f"step {alert.step}: ")  # the event has the step
            sink.event("alert", text, alert.step, alert.epoch, "warning", data)
        return raised
