"""The base of the anomaly detectors: :class:`Alert` and :class:`Detector` (the
once-per-episode latch), and the checks their options share. No PyTorch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .._validation import _got, check_number

__all__ = ["Alert", "Detector"]


@dataclass(frozen=True, slots=True)
class Alert:
    """What a detector saw: the step (and epoch, when known), its kind, a message saying what
    was seen and what to try, and the value that triggered it."""

    step: int
    epoch: int | None
    kind: str
    message: str
    value: float


class Detector:
    """Base: holds the once-per-episode latch. Subclasses set ``kind`` and define ``update``."""

    kind: ClassVar[str] = ""
    _advice: ClassVar[str] = ""  # what to try, appended to each message

    def __init__(self) -> None:
        self._active = False

    def reset(self) -> None:
        """Forget everything seen so far, as if freshly built."""
        self._active = False
        self._streak = 0

    @property
    def in_episode(self) -> bool:
        """True while the condition of the last alert holds (until a value clears it)."""
        return self._active

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        """Feed ``values`` (taken at ``steps``) in order; return the alerts they raise."""
        update = self.update  # type: ignore[attr-defined]
        found = (update(step, value, epoch=epoch) for step, value in zip(steps, values))
        return [alert for alert in found if alert is not None]

    def alarm(self) -> float | None:
        """The smallest value that could fire this detector now: a host that reads values in
        batches hands one over at once when it is above this (or not a number), instead of
        at the batch's end. ``inf`` (the default): only a value that is not finite; ``-inf``:
        every value, at once; None: it cannot say yet (warming up), read it often."""
        return math.inf

    def _edge(self, condition: bool) -> bool:
        # True only when the condition starts; a False condition ends the episode.
        fire = condition and not self._active
        self._active = condition
        return fire

    def _alert(self, step: int, epoch: int | None, seen: str, value: float) -> Alert:
        message = f"step {step}: {seen}" + (f": {self._advice}." if self._advice else ".")
        return Alert(step, epoch, self.kind, message, float(value))


class _RunScale:
    """A run's loss scale: the mean of its first ``n`` finite values (a loss that falls to 0
    within a few steps keeps the scale it started at), or a higher level seen since. The
    detectors judge a jump against it, so that a move from 1e-7 to 1e-5 in a run that started
    at 1 is not taken for a hundredfold jump."""

    __slots__ = ("_count", "_sum", "n", "value")

    def __init__(self, n: int = 16) -> None:
        self.n = n
        self._sum = 0.0
        self._count = 0
        self.value = 0.0

    @property
    def started(self) -> bool:
        """True once the first ``n`` values are in."""
        return self._count >= self.n

    def add(self, values: Sequence[float]) -> None:
        """Take the run's next values (only the first ``n`` finite ones count)."""
        if self._count >= self.n:
            return
        for v in values:
            if math.isfinite(v):
                self._sum += v
                self._count += 1
                if self._count >= self.n:
                    break
        if self._count:
            self.value = max(self.value, self._sum / self._count)

    def raise_to(self, level: float) -> None:
        """A level the loss held: the scale is at least that."""
        if level > self.value:
            self.value = level


def _check_fraction(name: str, value: Any, *, one: bool = False) -> float:
    value = check_number(name, value)
    if not (0.0 < value < 1.0 or (one and value == 1.0)):
        bounds = "0 < x <= 1" if one else "0 < x < 1"
        raise ValueError(f"'{name}' must be a number with {bounds}, but got {_got(value)}.")
    return value


def _check_name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"'name' must be a non-empty str such as 'loss', but got {_got(value)}.")
    return value
