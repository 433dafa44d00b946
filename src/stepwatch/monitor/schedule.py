"""One scheduling rule for every monitor: "every N steps" and/or "every T seconds".

A monitor asks ``schedule.due(step)`` on each step; the answer is True when at least ``steps``
global steps or ``seconds`` seconds have passed since the last time it was True. Counting from
the last firing (not ``step % n``) keeps the cadence right across resumed runs and epochs of any
length, as MindSpore's LossMonitor counts.
"""

from __future__ import annotations

import time

from .._validation import check_int, check_number

__all__ = ["Every", "Pace"]


class Every:
    """Fires every ``steps`` global steps and/or every ``seconds`` seconds.

    Args:
        steps: fire when ``step - last_step >= steps``; None or 0 disables the step rule.
        seconds: fire when ``seconds`` passed since the last firing; None or 0 disables it.

    With neither rule set, :meth:`due` is never True.

    Raises:
        TypeError / ValueError: negative or non-numeric arguments.

    Example:
        >>> every = Every(steps=100)
        >>> [s for s in range(1, 301) if every.due(s)]
        [100, 200, 300]
    """

    __slots__ = ("last_step", "last_time", "next_step", "seconds", "steps")

    def __init__(self, steps: int | None = None, seconds: float | None = None) -> None:
        self.steps = check_int("steps", steps, minimum=0, allow_none=True) or 0
        self.seconds = check_number("seconds", seconds, minimum=0.0, allow_none=True) or 0.0
        self.last_step = 0
        self.last_time = time.monotonic()
        self.next_step = self._next()

    def _next(self) -> float:
        """The first step that can fire; below it :meth:`due` is certainly False.

        Lets a hot hook skip the call: ``if step < every.next_step: return``.
        """
        if self.seconds:
            return self.last_step + 1
        if self.steps:
            return self.last_step + self.steps
        return float("inf")

    @property
    def enabled(self) -> bool:
        return bool(self.steps or self.seconds)

    def reset(self, step: int = 0) -> None:
        """Start counting again from ``step`` and from now."""
        self.last_step = step
        self.last_time = time.monotonic()
        self.next_step = self._next()

    def due(self, step: int) -> bool:
        """True (and counting restarts) if the schedule fires at ``step``."""
        if self.steps and step - self.last_step >= self.steps:
            if self.seconds:
                self.reset(step)
            else:  # the common case, without reading the clock
                self.last_step = step
                self.next_step = step + self.steps
            return True
        if self.seconds and time.monotonic() - self.last_time >= self.seconds:
            self.reset(step)
            return True
        return False

    def __repr__(self) -> str:
        return f"Every(steps={self.steps or None}, seconds={self.seconds or None})"


class Pace:
    """How many steps ahead a monitor on the step clock should look again, so that its looks
    come about ``per_period`` times every ``seconds``, whatever the steps' speed: the distance
    follows the step rate seen since the last look (one step ahead at first, at most twice the
    last distance, so a fast first step does not send it far ahead of slow ones, and at most
    ``most``).

    Example:
        >>> pace = Pace(seconds=0.2)
        >>> pace.reset(0)
        >>> pace.ahead(1) >= 1
        True
    """

    __slots__ = ("_ahead", "_step", "_time", "most", "per_period", "seconds")

    def __init__(self, seconds: float, per_period: int = 4, most: int = 4096) -> None:
        self.seconds = check_number("seconds", seconds, minimum=0.0)
        self.per_period = check_int("per_period", per_period, minimum=1)
        self.most = check_int("most", most, minimum=1)
        self._step, self._time, self._ahead = 0, time.perf_counter(), 1

    def reset(self, step: int) -> None:
        """Count the rate from ``step`` and from now."""
        self._step, self._time, self._ahead = step, time.perf_counter(), 1

    def ahead(self, step: int) -> int:
        """Steps from ``step`` to the next look (at least 1)."""
        now = time.perf_counter()
        elapsed, done = now - self._time, step - self._step
        self._step, self._time = step, now
        if elapsed <= 0 or done <= 0:
            return 1
        rate = int(done / elapsed * self.seconds / self.per_period)
        self._ahead = max(1, min(self.most, 2 * self._ahead, rate))
        return self._ahead
