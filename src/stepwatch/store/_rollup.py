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

import sqlite3
from collections.abc import Sequence
from typing import Any

__all__: list[str] = []

WIDTHS = (64, 512, 4096, 32768)

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
_UPSERT = f"""
INSERT INTO rollups (run, key, width, bucket, n, min_step, min_value, max_step, max_value,
    nan_step) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)
ON CONFLICT (run, key, width, bucket) DO UPDATE SET
    n = n + excluded.n,
    min_step = CASE WHEN {_MIN_WINS} THEN excluded.min_step ELSE min_step END,
    min_value = CASE WHEN {_MIN_WINS} THEN excluded.min_value ELSE min_value END,
    max_step = CASE WHEN {_MAX_WINS} THEN excluded.max_step ELSE max_step END,
    max_value = CASE WHEN {_MAX_WINS} THEN excluded.max_value ELSE max_value END,
    nan_step = CASE WHEN excluded.nan_step IS NOT NULL AND (nan_step IS NULL
        OR excluded.nan_step < nan_step) THEN excluded.nan_step ELSE nan_step END
"""


def mark_run(conn: sqlite3.Connection, run: int) -> None:
    """Record that ``run``'s rollups are kept from its first point (inside its creation)."""
    if SUPPORTED:
        conn.execute(
            "INSERT OR REPLACE INTO rollup_runs (run, widths) VALUES (?, ?)",
            (run, ",".join(map(str, WIDTHS))),
        )


def update(conn: sqlite3.Connection, run: int, flat: Sequence[Any], columns: int) -> None:
    """Merge the points in ``flat`` (rows of ``columns`` values: key, step, epoch, time, value,
    one after another) into the run's rollups. Call inside the transaction that inserts them."""
    if not SUPPORTED or not flat:
        return
    if hasattr(conn, "getlimit") and conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) < 10:
        # An SQLite built to bind fewer than 10 parameters: this run is read from its points.
        conn.execute("DELETE FROM rollup_runs WHERE run = ?", (run,))
        conn.execute("DELETE FROM rollups WHERE run = ?", (run,))
        return
    import numpy as np

    keys = np.array(flat[0::columns], dtype=np.int64)
    steps = np.array(flat[1::columns], dtype=np.int64)
    values = np.array(flat[4::columns], dtype=np.float64)  # None (NULL) becomes NaN
    order = np.lexsort((steps, keys))
    keys, steps, values = keys[order], steps[order], values[order]
    nan = np.isnan(values)
    nan_steps = np.where(nan, steps, _BIG)
    new_key = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    rows: list[tuple[Any, ...]] = []
    for width in WIDTHS:
        buckets = steps // width
        change = np.union1d(new_key, np.flatnonzero(buckets[1:] != buckets[:-1]) + 1)
        starts = np.concatenate(([0], change)).astype(np.intp)
        counts = np.diff(np.append(starts, len(steps)))
        vmin = np.fmin.reduceat(values, starts)  # NaN only where every value is NaN
        vmax = np.fmax.reduceat(values, starts)
        min_steps = np.minimum.reduceat(
            np.where(values == np.repeat(vmin, counts), steps, _BIG), starts
        )
        max_steps = np.minimum.reduceat(
            np.where(values == np.repeat(vmax, counts), steps, _BIG), starts
        )
        first_nan = np.minimum.reduceat(nan_steps, starts)
        rows.extend(
            (run, key, width, bucket, n, lo_step, lo, hi_step, hi, nan_step)
            for key, bucket, n, lo_step, lo, hi_step, hi, nan_step in zip(
                keys[starts].tolist(),
                buckets[starts].tolist(),
                counts.tolist(),
                _steps(min_steps),
                vmin.tolist(),
                _steps(max_steps),
                vmax.tolist(),
                _steps(first_nan),
            )
        )
    conn.executemany(_UPSERT, rows)


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
    first = -(-lo // align)  # the first block that starts at or after lo
    last = (hi + 1) // align - 1  # the last block that ends at or before hi
    # (step where it lies, min step, min value, max step, max value, first NaN step)
    found: list[tuple[Any, ...]] = []
    raw = [(lo, hi)]
    if first <= last:
        found = conn.execute(
            "SELECT bucket * ?3, min_step, min_value, max_step, max_value, nan_step FROM rollups "
            "WHERE run = ?1 AND key = ?2 AND width = ?3 AND bucket BETWEEN ?4 AND ?5",
            (run, key, align, first, last),
        ).fetchall()
        raw = [(lo, first * align - 1), ((last + 1) * align, hi)]
    for a, b in raw:
        if a <= b:
            found.extend(
                (s, s, v, s, v, None) if v is not None else (s, None, None, None, None, s)
                for s, v in conn.execute(
                    "SELECT step, value FROM points WHERE run = ? AND key = ? "
                    "AND step BETWEEN ? AND ?",
                    (run, key, a, b),
                )
            )
    return extremes(found, bounds(lo, hi, max_points, align))


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
