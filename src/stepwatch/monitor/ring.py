"""A fixed-size ring of (step, value) pairs: O(1) append, bounded memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, overload

import numpy as np

from .._validation import check_int

__all__ = ["RingBuffer"]


class RingBuffer:
    """The newest ``capacity`` (step, value) pairs, in two preallocated NumPy arrays.

    Appending never allocates; when full, the oldest pair is overwritten. Reading returns
    copies in order, oldest first: :meth:`steps` and :meth:`values` as arrays; iterating or
    indexing (``ring[-1]``, ``ring[:10]``) gives ``(step, value)`` pairs of Python numbers.

    Args:
        capacity: how many pairs to keep (>= 1).

    Example:
        >>> ring = RingBuffer(3)
        >>> for step in range(1, 6):
        ...     ring.append(step, step * 0.5)
        >>> ring.steps().tolist(), ring.values().tolist()
        ([3, 4, 5], [1.5, 2.0, 2.5])
        >>> list(ring), ring[-1]
        ([(3, 1.5), (4, 2.0), (5, 2.5)], (5, 2.5))
    """

    __slots__ = ("_next", "_size", "_steps", "_values", "capacity", "total")

    def __init__(self, capacity: int) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self._steps = np.zeros(capacity, dtype=np.int64)
        self._values = np.zeros(capacity, dtype=np.float64)
        self._next = 0
        self._size = 0
        self.total = 0  # pairs ever appended

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return iter(zip(self.steps().tolist(), self.values().tolist()))

    @overload
    def __getitem__(self, index: int) -> tuple[int, float]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[int, float]]: ...

    def __getitem__(self, index: int | slice) -> tuple[int, float] | list[tuple[int, float]]:
        """The ``(step, value)`` pair at ``index`` (0 = the oldest kept), or a list of them."""
        if isinstance(index, slice):
            return list(self)[index]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"a RingBuffer index must be an int or a slice, not {index!r}.")
        i = int(index) + self._size if index < 0 else int(index)
        if not 0 <= i < self._size:
            raise IndexError(f"RingBuffer index {index} out of range (it holds {self._size}).")
        j = int(self._order()[i])
        return int(self._steps[j]), float(self._values[j])

    def append(self, step: int, value: float) -> None:
        i = self._next
        self._steps[i] = step
        self._values[i] = value
        self._next = (i + 1) % self.capacity
        if self._size < self.capacity:
            self._size += 1
        self.total += 1

    def extend(self, steps: Any, values: Any) -> None:
        """Append many pairs at once (vectorised)."""
        s = np.asarray(steps, dtype=np.int64).ravel()
        v = np.asarray(values, dtype=np.float64).ravel()
        if s.shape != v.shape:
            raise ValueError(f"steps and values differ in length: {s.size} vs {v.size}")
        n = s.size
        if n == 0:
            return
        self.total += n
        if n >= self.capacity:
            self._steps[:] = s[-self.capacity :]
            self._values[:] = v[-self.capacity :]
            self._next = 0
            self._size = self.capacity
            return
        idx = (self._next + np.arange(n)) % self.capacity
        self._steps[idx] = s
        self._values[idx] = v
        self._next = (self._next + n) % self.capacity
        self._size = min(self.capacity, self._size + n)

    def _order(self) -> np.ndarray:
        if self._size < self.capacity:
            return np.arange(self._size)
        return (self._next + np.arange(self.capacity)) % self.capacity

    def steps(self) -> np.ndarray:
        return self._steps[self._order()]

    def values(self) -> np.ndarray:
        return self._values[self._order()]

    def last(self) -> tuple[int, float] | None:
        if not self._size:
            return None
        i = (self._next - 1) % self.capacity
        return int(self._steps[i]), float(self._values[i])

    def clear(self) -> None:
        self._next = 0
        self._size = 0
        self.total = 0

    def __repr__(self) -> str:
        return f"RingBuffer(capacity={self.capacity}, len={self._size}, total={self.total})"
