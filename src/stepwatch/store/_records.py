"""The records a :class:`~stepwatch.store.RunWriter` queues (a batch of one key's points, an
event) and how their values become database values. No PyTorch: tensors are read through
their own methods, on the writer thread."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__: list[str] = []


class Batch:
    """Many values of one key, possibly still on the device until ``ready`` completes.

    Steps, times and values stay in arrays (or a ``range``) until the writer hands the rows to
    SQLite; nothing is built per point on the training thread.
    """

    __slots__ = ("epoch", "key", "ready", "span", "steps", "times", "values")

    def __init__(
        self,
        key: str,
        steps: range | np.ndarray,
        values: Any,
        epoch: int | None,
        times: np.ndarray | None,
        span: tuple[float, float],
        ready: Any,
    ) -> None:
        self.key, self.steps, self.values, self.epoch = key, steps, values, epoch
        self.times, self.span, self.ready = times, span, ready

    def __len__(self) -> int:
        return len(self.steps)

    def rows(self, key_id: int) -> tuple[int, Iterator[tuple[Any, ...]]]:
        """The number of rows and the rows, built column-wise: ``zip`` makes each tuple in C as
        SQLite reads it, so the writer holds the GIL as briefly as it can."""
        if self.ready is not None:
            self.ready.synchronize()  # waits on the writer thread, never the training thread
        import numpy as np

        values = self.values
        if hasattr(values, "detach"):
            values = values.detach().cpu().double().numpy()
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        n = min(len(self.steps), len(values))
        if self.times is not None:
            times = np.asarray(self.times, dtype=np.float64).reshape(-1)[:n]
        else:
            start, end = self.span
            times = start + (end - start) * (np.arange(1, n + 1, dtype=np.float64) / n)
        steps = self.steps
        return n, zip(
            repeat(key_id),
            steps[:n] if isinstance(steps, range) else steps[:n].tolist(),
            repeat(self.epoch),
            times.tolist(),
            values[:n].tolist(),
        )


class Event:
    __slots__ = ("data", "epoch", "kind", "level", "message", "step", "time")

    def __init__(
        self,
        kind: str,
        message: str,
        step: int | None,
        epoch: int | None,
        level: str,
        data: dict[str, Any] | None,
    ) -> None:
        self.kind, self.message, self.step, self.epoch = kind, message, step, epoch
        self.level, self.data, self.time = level, data or {}, time.time()


_NUMBERS = frozenset({float, int, bool})


def _check_step(step: Any) -> None:
    import numbers

    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"'step' must be an int >= 0, but got {step!r}.")
    if step < 0:
        raise ValueError(f"'step' must be an int >= 0, but got {step!r}.")


_INT, _INT_OR_NONE, _FLOAT = frozenset({int}), frozenset({int, type(None)}), frozenset({float})


def _column(column: tuple[Any, ...], kinds: frozenset[type], convert: Any) -> Iterable[Any]:
    """``column`` as it is when every entry's type is in ``kinds`` (checked in C), else each
    entry passed through ``convert``."""
    return column if kinds.issuperset(map(type, column)) else map(convert, column)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _number(value: Any) -> float | None:
    """A float for the database; None (stored as NULL) for anything that is not one number."""
    try:
        if hasattr(value, "item"):
            value = value.item()
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, default=_json_default)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item") and getattr(obj, "shape", None) in ((), None):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
