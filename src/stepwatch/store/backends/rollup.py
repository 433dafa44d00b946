"""Min/max rollups: per run, key and block of steps, the extremes of the points, kept beside them.

This module is the rollups' arithmetic, shared by every backend; the SQL that stores and reads
them is the backend's (:mod:`.sqlite_rollup`, :mod:`.postgres_write`, the one reader
:class:`stepwatch.store.Store`).

A downsampled read (``Store.metrics(..., max_points=N)``) needs each bucket's minimum and
maximum. Read from the points, that visits every point of the range: as slow as reading them
all. The writer therefore keeps, in the same transaction as the points it inserts, one row per
``(run, key, width, bucket)`` for a few fixed block widths: the number of points, the minimum
and the maximum with their steps, and the first step whose value is NaN. A read then takes
each bucket's extremes from a few rollup rows and reads raw points only at the two edges of the
range.

Widths: 64, 512, 4096 and 32768 steps (a factor of 8). A read uses the coarsest width no wider
than its bucket, so it reads fewer than 8 rollup rows per bucket (about ``4 * max_points`` rows
at most). When a bucket is narrower than 64 steps, the range spans fewer than
``32 * max_points`` steps, which the exact path reads quickly. The finest width adds one row
per 64 points (about 1.5% more rows); the coarser ones add an eighth of that each.

Merging is order-free: a batch's blocks are merged into the stored rows with min/max logic
(the smaller step wins a tie, as in the exact path), so points may arrive in any order and from
several writers.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

__all__ = ["WIDTHS", "blocks", "bounds", "merge_downsample", "pick_width", "sort_points"]

WIDTHS = (64, 512, 4096, 32768)  # powers of two, each a multiple of the one before

# Where a block has no such step (no number, no NaN): larger than any step, so min() skips it.
_NONE = (1 << 63) - 1

# The columns of a rollup row after (run, key, width): what blocks() yields per width.
Block = tuple[Any, Any, Any, Any, Any, Any, Any, Any]  # key, bucket, n, min step, min, ...


def sort_points(keys: Any, steps: Any, *columns: Any) -> tuple[Any, ...]:
    """``(keys, steps, *columns)`` ordered by key, then step (NumPy arrays; left as they are
    when already in that order, as a writer's batches usually are)."""
    import numpy as np

    if (
        len(steps) > 1
        and not (
            (keys[1:] > keys[:-1]) | ((keys[1:] == keys[:-1]) & (steps[1:] >= steps[:-1]))
        ).all()
    ):
        order = np.lexsort((steps, keys))
        return (keys[order], steps[order], *(column[order] for column in columns))
    return (keys, steps, *columns)


def blocks(keys: Any, steps: Any, values: Any) -> Iterator[tuple[int, Block]]:
    """Per width, the blocks of the points (NumPy arrays sorted by key and step, NaN for a
    value that is not a number): ``(width, (key, bucket, n, min step, min, max step, max,
    first NaN step))``, one array each; a step is None where the block has none, a min/max is
    NaN where every value of the block is NaN."""
    import numpy as np

    # The points are blocks of one step; each width's blocks are merged from the previous one's
    # (they nest), so only the finest width reads every point.
    nan_steps = np.where(np.isnan(values), steps, _NONE)
    level: tuple[Any, ...] = (keys, steps, np.ones(len(steps), np.int64))
    level += (steps, values, steps, values, nan_steps)
    for width in WIDTHS:
        level = _merge(np, level, width)
        key, first, n, min_step, vmin, max_step, vmax, nan_step = level
        shift = width.bit_length() - 1
        yield width, (key, first >> shift, n, min_step, vmin, max_step, vmax, nan_step)


def steps_of(steps: Any) -> list[int | None]:
    """A step column of :func:`blocks` as a list, None where a block has no such step."""
    return [None if s == _NONE else s for s in steps.tolist()]


def _merge(np: Any, level: tuple[Any, ...], width: int) -> tuple[Any, ...]:
    """Blocks ``(key, first step, n, min step, min, max step, max, first NaN step)``, sorted by
    key and first step, merged into blocks of ``width`` steps."""
    key, first, n, min_step, vmin, max_step, vmax, nan_step = level
    block = first >> (width.bit_length() - 1)  # widths are powers of two
    breaks = np.flatnonzero((key[1:] != key[:-1]) | (block[1:] != block[:-1])) + 1
    starts = np.concatenate(([0], breaks))
    sizes = np.diff(np.append(starts, len(first)))
    new_min = np.fmin.reduceat(vmin, starts)  # NaN only where every value is NaN
    new_max = np.fmax.reduceat(vmax, starts)
    hit_min = np.where(vmin == np.repeat(new_min, sizes), min_step, _NONE)
    hit_max = np.where(vmax == np.repeat(new_max, sizes), max_step, _NONE)
    return (
        key[starts],
        block[starts] * width,
        np.add.reduceat(n, starts),
        np.minimum.reduceat(hit_min, starts),  # the smaller step wins a tie
        new_min,
        np.minimum.reduceat(hit_max, starts),
        new_max,
        np.minimum.reduceat(nan_step, starts),
    )


def bounds(lo: int, hi: int, max_points: int, align: int) -> list[int]:
    """The first step of each bucket, then ``hi + 1``: ``max_points // 2`` buckets of equal
    width over ``[lo, hi]``, each inner boundary moved up to the next multiple of ``align``
    (so that no block of ``align`` steps is cut)."""
    buckets = max(1, max_points // 2)
    width = (hi - lo) // buckets + 1
    edges = [lo]
    for first in range(lo + width, hi + 1, width):
        edge = min(-(-first // align) * align, hi + 1)
        if edge > edges[-1]:
            edges.append(edge)
    if edges[-1] <= hi:
        edges.append(hi + 1)
    return edges


def pick_width(widths: Sequence[int], lo: int, hi: int, max_points: int) -> int | None:
    """The coarsest rollup width no wider than a bucket, or None if none is."""
    width = (hi - lo) // max(1, max_points // 2) + 1
    fits = [w for w in widths if w <= width]
    return max(fits) if fits else None


def merge_downsample(
    rollups: Callable[[int, int], Sequence[tuple[Any, ...]]],
    points: Callable[[int, int], Iterable[tuple[int, float | None]]],
    align: int,
    lo: int,
    hi: int,
    max_points: int,
) -> list[tuple[Any, ...]]:
    """The min/max (and first NaN) rows of each bucket of :func:`bounds` over ``[lo, hi]``, for
    a range whose points all lie in ``[lo, hi]``: ``rollups(first, last)`` gives the rollup
    rows of the whole blocks ``first..last`` of width ``align`` (``(step, min step, min value,
    max step, max value, first NaN step)``), ``points(a, b)`` the ``(step, value or None for
    NaN)`` of the points in ``[a, b]``, the partial blocks at the two edges."""
    # (step where it lies, min step, min value, max step, max value, first NaN step)
    found: list[tuple[Any, ...]] = []
    raw = [(lo, hi)]
    first = -(-lo // align)  # the first block that starts at or after lo
    last = (hi + 1) // align - 1  # the last block that ends at or before hi
    if first <= last:
        found = list(rollups(first, last))
        raw = [(lo, first * align - 1), ((last + 1) * align, hi)]
    for a, b in raw:
        if a <= b:
            found.extend(
                (s, s, v, s, v, None) if v is not None else (s, None, None, None, None, s)
                for s, v in points(a, b)
            )
    return _extremes(found, bounds(lo, hi, max_points, align))


def _extremes(found: Sequence[tuple[Any, ...]], edges: list[int]) -> list[tuple[Any, ...]]:
    """Per bucket of ``edges``, ``(step, value)`` of its minimum, its maximum (the smaller step
    wins a tie) and its first NaN (value None), sorted by step."""
    inner = edges[1:-1]
    best: dict[int, list[Any]] = {}
    for at, smin, vmin, smax, vmax, snan in found:
        i = bisect_right(inner, at)
        b = best.get(i)
        if b is None:
            best[i] = [smin, vmin, smax, vmax, snan]
            continue
        if vmin is not None and (b[1] is None or vmin < b[1] or (vmin == b[1] and smin < b[0])):
            b[0], b[1] = smin, vmin
        if vmax is not None and (b[3] is None or vmax > b[3] or (vmax == b[3] and smax < b[2])):
            b[2], b[3] = smax, vmax
        if snan is not None and (b[4] is None or snan < b[4]):
            b[4] = snan
    rows: set[tuple[Any, ...]] = set()
    for smin, vmin, smax, vmax, snan in best.values():
        if vmin is not None:
            rows.add((smin, vmin))
            rows.add((smax, vmax))
        if snan is not None:
            rows.add((snan, None))
    return by_step(rows)


def by_step(rows: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``(step, value or None)`` rows sorted by step, a NaN (None) first, then by value."""
    return sorted(rows, key=lambda r: (r[0], r[1] is not None, r[1] or 0.0))
