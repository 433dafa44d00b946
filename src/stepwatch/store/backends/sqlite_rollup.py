"""The SQLite store's min/max rollups (:mod:`.rollup`): the statements that keep them, in the
transaction that inserts the points, and the list of runs that have them.

A run is read through its rollups only if ``rollup_runs`` lists it: its writer kept them from
its first point. Runs written before rollups existed (or by an older version) are not listed
and are read by the exact path. SQLite stores a NaN as NULL, in the points and the rollups.
"""

from __future__ import annotations

import functools
import sqlite3
from itertools import chain, repeat
from typing import Any

from . import rollup

__all__: list[str] = []

# UPSERT (ON CONFLICT DO UPDATE) needs SQLite 3.24; an older library keeps no rollups.
SUPPORTED = sqlite3.sqlite_version_info >= (3, 24, 0)

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
            (run, ",".join(map(str, rollup.WIDTHS))),
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
    rows: list[Any] = []
    for width, (key, bucket, n, min_step, vmin, max_step, vmax, nan_step) in rollup.blocks(
        *rollup.sort_points(keys, steps, values)
    ):
        rows.extend(
            chain.from_iterable(
                zip(
                    repeat(run),
                    key.tolist(),
                    repeat(width),
                    bucket.tolist(),
                    n.tolist(),
                    rollup.steps_of(min_step),
                    vmin.tolist(),  # NaN is stored as NULL
                    rollup.steps_of(max_step),
                    vmax.tolist(),
                    rollup.steps_of(nan_step),
                )
            )
        )
    _upsert(conn, rows)


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
