"""Min/max rollups: per run, key and block of steps, the extremes of the points, kept beside them.

A downsampled read (``Store.metrics(..., max_points=N)``) needs each bucket's minimum and
maximum. Read from the points, that visits every point of the range: as slow as reading them
all. The writer therefore keeps, in the same transaction as the points it inserts, one row per
``(run, key, width, bucket)`` for a few fixed block widths: the number of points, the minimum
and the maximum with their steps, and the first step whose value is NaN (SQLite stores NaN as
NULL). A read then takes each bucket's extremes from a few rollup rows and reads raw points only
at the two edges of the range.

Widths: 64, 512, 4096 and 32768 steps (a factor of 8). A read uses the coarsest width no wider
than its bucket, so it reads fewer than 8 rollup rows per bucket (about ``4 * max_points`` rows
at most). When a bucket is narrower than 64 steps, the range spans fewer than
``32 * max_points`` steps, which the exact path reads quickly. The finest width adds one row
per 64 points (about 1.5% more rows); the coarser ones add an eighth of that each.

Merging is order-free: a batch's aggregates are merged into the stored rows with min/max logic
(the smaller step wins a tie, as in the exact path), so points may arrive in any order and from
several writers. A run is read through its rollups only if ``rollup_runs`` lists it: its writer
kept them from its first point. Runs written before rollups existed (or by an older version)
are not listed and are read by the exact path.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from typing import Any

__all__: list[str] = []

WIDTHS = (64, 512, 4096, 32768)  # powers of two, each a multiple of the one before

# UPSERT (ON CONFLICT DO UPDATE) needs SQLite 3.24; an older library keeps no rollups.
SUPPORTED = sqlite3.sqlite_version_info >= (3, 24, 0)

_BIG = (1 << 63) - 1

_MIN_WINS = (
    "excluded.min_value IS NOT NULL AND (min_value IS NULL OR excluded.min_value < min_value "
    "OR (excluded.min_value = min_value AND excluded.min_step < min_step))"
)
_MAX_WINS = (
    "excluded.max_value IS NOT NULL AND (max_value IS NULL OR excluded.max_value > max_value "
    "OR (excluded.max_value = max_value AND excluded.max_step < max_step))"
)
_COLUMNS = "run, key, width, bucket, n, min_step, min_value, max_step, max_value, nan_step"
_ON_CONFLICT = f"""
ON CONFLICT (run, key, width, bucket) DO UPDATE SET
    n = n + excluded.n,
    min_step = CASE WHEN {_MIN_WINS} THEN excluded.min_step ELSE min_step END,
    min_value = CASE WHEN {_MIN_WINS} THEN excluded.min_value ELSE min_value END,
    max_step = CASE WHEN {_MAX_WINS} THEN excluded.max_step ELSE max_step END,
    max_value = CASE WHEN {_MAX_WINS} THEN excluded.max_value ELSE max_value END,
    nan_step = CASE WHEN excluded.nan_step IS NOT NULL AND (nan_step IS NULL
        OR excluded.nan_step < nan_step) THEN excluded.nan_step ELSE nan_step END
"""
_ROW_VALUES = 10


@functools.cache
def _upsert_sql(rows: int) -> str:
    """The merge of ``rows`` rows in one statement (SQLite binds them all at once)."""
    values = ", ".join(["(" + ", ".join("?" * _ROW_VALUES) + ")"] * rows)
    return f"INSERT INTO rollups ({_COLUMNS}) VALUES {values}{_ON_CONFLICT}"


def _upsert(conn: sqlite3.Connection, values: list[Any]) -> None:
    """Merge rows given as one flat list, up to 64 per statement (a power of two)."""
    limit = 999
    if hasattr(conn, "getlimit"):
        limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    most = max(1, min(64, limit // _ROW_VALUES))
    at, end = 0, len(values)
    while at < end:
        rows = min(most, (end - at) // _ROW_VALUES)
        rows = 1 << (rows.bit_length() - 1)
        stop = at + rows * _ROW_VALUES
        conn.execute(_upsert_sql(rows), values[at:stop])
        at = stop


def mark_run(conn: sqlite3.Connection, run: int) -> None:
    """Record that ``run``'s rollups are kept from its first point (inside its creation)."""
    if SUPPORTED:
        conn.execute(
            "INSERT OR REPLACE INTO rollup_runs (run, widths) VALUES (?, ?)",
            (run, ",".join(map(str, WIDTHS))),
        )


def update(conn: sqlite3.Connection, run: int, flat: list[Any], columns: int) -> None:
    """Merge the points in ``flat`` (rows of ``columns`` values: key, step, epoch, time, value,
    one after another) into the run's rollups. Call inside the transaction that inserts them."""
    if not SUPPORTED or not flat:
        return
    if (
        hasattr(conn, "getlimit")
        and conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) < _ROW_VALUES
    ):
        # An SQLite built to bind fewer than 10 parameters: this run is read from its points.
        conn.execute("DELETE FROM rollup_runs WHERE run = ?", (run,))
        conn.execute("DELETE FROM rollups WHERE run = ?", (run,))
        return
    import numpy as np

    key_column = flat[0::columns]
    if key_column.count(key_column[0]) == len(key_column):  # one key: no conversion
        keys = np.full(len(key_column), key_column[0], dtype=np.int64)
    else:
        keys = np.array(key_column, dtype=np.int64)
    steps = np.array(flat[1::columns], dtype=np.int64)
    values = np.array(flat[4::columns], dtype=np.float64)  # None (NULL) becomes NaN
    if (
        len(steps) > 1
        and not (
            (keys[1:] > keys[:-1]) | ((keys[1:] == keys[:-1]) & (steps[1:] >= steps[:-1]))
        ).all()
    ):
        order = np.lexsort((steps, keys))
        keys, steps, values = keys[order], steps[order], values[order]
    # The points are blocks of one step; each width's blocks are merged from the previous one's
    # (they nest), so only the finest width reads every point.
    nan_steps = np.where(np.isnan(values), steps, _BIG)
    level: tuple[Any, ...] = (keys, steps, np.ones(len(steps), np.int64))
    level += (steps, values, steps, values, nan_steps)
    rows: list[Any] = []
    for width in WIDTHS:
        level = _merge(np, level, width)
        key, first, n, min_step, vmin, max_step, vmax, nan_step = level
        rows.extend(
            chain.from_iterable(
                zip(
                    repeat(run),
                    key.tolist(),
                    repeat(width),
                    (first >> (width.bit_length() - 1)).tolist(),
                    n.tolist(),
                    _steps(min_step),
                    vmin.tolist(),
                    _steps(max_step),
                    vmax.tolist(),
                    _steps(nan_step),
                )
            )
        )
    _upsert(conn, rows)


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
    hit_min = np.where(vmin == np.repeat(new_min, sizes), min_step, _BIG)
    hit_max = np.where(vmax == np.repeat(new_max, sizes), max_step, _BIG)
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


def _steps(steps: Any) -> list[int | None]:
    return [None if s == _BIG else s for s in steps.tolist()]


def widths_of(conn: sqlite3.Connection, run: int) -> tuple[int, ...]:
    """The rollup widths kept for ``run`` (empty: read it by the exact path)."""
    if not conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'rollup_runs'"
    ).fetchone():
        return ()
    row = conn.execute("SELECT widths FROM rollup_runs WHERE run = ?", (run,)).fetchone()
    if row is None:
        return ()
    return tuple(int(w) for w in str(row[0]).split(",") if w.strip().isdigit())


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


def downsample(
    conn: sqlite3.Connection, run: int, key: int, align: int, lo: int, hi: int, max_points: int
) -> list[tuple[Any, ...]]:
    """The min/max (and first NaN) rows of each bucket of :func:`bounds` over ``[lo, hi]``, for
    a range whose points all lie in ``[lo, hi]``: whole blocks from the rollups of width
    ``align``, the partial blocks at the two edges from the points."""
    return merge_downsample(
        lambda first, last: conn.execute(
            "SELECT bucket * ?3, min_step, min_value, max_step, max_value, nan_step FROM rollups "
            "WHERE run = ?1 AND key = ?2 AND width = ?3 AND bucket BETWEEN ?4 AND ?5",
            (run, key, align, first, last),
        ).fetchall(),
        lambda a, b: conn.execute(
            "SELECT step, value FROM points WHERE run = ? AND key = ? AND step BETWEEN ? AND ?",
            (run, key, a, b),
        ),
        align,
        lo,
        hi,
        max_points,
    )


def merge_downsample(
    rollups: Callable[[int, int], Sequence[tuple[Any, ...]]],
    points: Callable[[int, int], Iterable[tuple[int, float | None]]],
    align: int | None,
    lo: int,
    hi: int,
    max_points: int,
) -> list[tuple[Any, ...]]:
    """:func:`downsample` over any backend: ``rollups(first, last)`` gives the rollup rows of
    the whole blocks ``first..last`` of width ``align`` (``(step, min step, min value, max
    step, max value, first NaN step)``), ``points(a, b)`` the ``(step, value or None for
    NaN)`` of the points in ``[a, b]``; with ``align`` None every point is read."""
    # (step where it lies, min step, min value, max step, max value, first NaN step)
    found: list[tuple[Any, ...]] = []
    raw = [(lo, hi)]
    if align is not None:
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
    return extremes(found, bounds(lo, hi, max_points, align or 1))


def extremes(found: Sequence[tuple[Any, ...]], edges: list[int]) -> list[tuple[Any, ...]]:
    """Per bucket of ``edges``, ``(step, value)`` of its minimum, its maximum (the smaller step
    wins a tie) and its first NaN (value None), sorted by step."""
    from bisect import bisect_right

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
    return sorted(rows, key=lambda r: (r[0], r[1] is not None, r[1] or 0.0))
