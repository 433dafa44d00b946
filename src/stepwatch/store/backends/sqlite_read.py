"""How the one reader (:class:`stepwatch.store.Store`) reads an SQLite file: its connection and
the SQL that is SQLite's own (:class:`SQLiteDialect`).

An SQLite store keeps no per-key totals: a run's steps, keys, summary and loss are read from
the points through their index (one index lookup per key, never a scan of the run's points
where a seek does). SQLite stores a NaN as NULL.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ...monitor import values
from .._runs import LEGACY_EPOCH_LOSS, effective_status
from ..base import Location, ReadDialect
from .sqlite_rollup import widths_of
from .sqlite_schema import BUSY_TIMEOUT_MS, connect_for_reading, sqlite_uri

__all__ = ["SQLiteDialect"]

_T = TypeVar("_T")

# Columns of a run; ``steps`` is the largest step of any key, found with one index lookup per
# key rather than a scan of the run's points. A local store records no user, and a run's
# liveness is its process's (checked in Python), not an age.
_RUN_COLUMNS = (
    "r.id, r.name, r.status, r.started, r.ended, r.host, r.pid, r.config, r.heartbeat, "
    "r.dropped, (SELECT MAX((SELECT MAX(p.step) FROM points p WHERE p.run = r.id "
    "AND p.key = k.id)) FROM keys k), '', NULL"
)

# Which loss a run is summarised by, per run, in SQL: the legacy epoch mean, else ``loss``,
# else ``step_loss``. ``loss`` alone (no ``step_loss`` beside it) holds epoch means only if it
# has at most one point per epoch; otherwise it is a legacy per-step loss.
# A point of the run that holds a number (NaN is stored as NULL; -inf is no best either).
_NUMBER = "SELECT 1 FROM points WHERE run = runs.id AND value > -1e308"
_LOSS_SQL = f"""
WITH ids AS (SELECT
    (SELECT id FROM keys WHERE name = '{values.LOSS}') AS loss,
    (SELECT id FROM keys WHERE name = '{values.STEP_LOSS}') AS step_loss,
    (SELECT id FROM keys WHERE name = '{LEGACY_EPOCH_LOSS}') AS legacy),
r AS (SELECT runs.*, ids.step_loss AS step_loss_key, CASE  -- the first key holding a number
        WHEN EXISTS ({_NUMBER} AND key = ids.legacy) THEN ids.legacy
        WHEN EXISTS ({_NUMBER} AND key = ids.loss) THEN ids.loss
        WHEN EXISTS ({_NUMBER} AND key = ids.step_loss) THEN ids.step_loss
        WHEN EXISTS (SELECT 1 FROM points WHERE run = runs.id AND key = ids.legacy)
            THEN ids.legacy
        WHEN EXISTS (SELECT 1 FROM points WHERE run = runs.id AND key = ids.loss) THEN ids.loss
        ELSE ids.step_loss END AS lk
    FROM runs, ids WHERE {{where}} ORDER BY runs.id DESC {{limit}})
SELECT {_RUN_COLUMNS},
    (SELECT name FROM keys WHERE id = r.lk),
    (SELECT COUNT(*) FROM points WHERE run = r.id AND key = r.lk),
    (SELECT COUNT(DISTINCT epoch) FROM points WHERE run = r.id AND key = r.lk),
    (SELECT MIN(value) FROM points WHERE run = r.id AND key = r.lk AND value > -1e308),  -- no -inf
    (SELECT value FROM points WHERE run = r.id AND key = r.lk ORDER BY step DESC, rowid DESC
        LIMIT 1),
    (SELECT MAX(step) FROM points WHERE run = r.id AND key = r.lk),
    EXISTS (SELECT 1 FROM points WHERE run = r.id AND key = r.step_loss_key)
FROM r ORDER BY r.id
"""

_RUN_TABLES = (
    ("points", "run"),
    ("rollups", "run"),  # absent in a file written before rollups
    ("rollup_runs", "run"),
    ("events", "run"),
    ("runs", "id"),
)


class SQLiteDialect(ReadDialect):
    """An SQLite file read by :class:`stepwatch.store.Store` (a path or ``sqlite:///...``).

    Raises:
        FileNotFoundError: no file at the location (nothing is created).
        ValueError: the file is not a stepwatch database.
    """

    run_columns = _RUN_COLUMNS
    loss_sql = _LOSS_SQL
    keys_sql = (
        "SELECT k.name FROM keys k WHERE EXISTS "
        "(SELECT 1 FROM points p WHERE p.run = ? AND p.key = k.id) ORDER BY k.name"
    )
    key_sql = (
        "SELECT k.id FROM keys k WHERE k.name = ? AND EXISTS "
        "(SELECT 1 FROM points p WHERE p.run = ? AND p.key = k.id)"
    )
    summary_sql = (
        "SELECT k.name, COUNT(*), MIN(p.value), MAX(p.value), MAX(p.step), "
        "(SELECT q.value FROM points q WHERE q.run = p.run AND q.key = p.key "
        "ORDER BY q.step DESC, q.rowid DESC LIMIT 1) "
        "FROM points p JOIN keys k ON k.id = p.key WHERE p.run = ? GROUP BY p.key "
        "ORDER BY k.name"
    )
    tie = "rowid"  # a step may hold several points: the order they were written in

    def __init__(self, location: Location) -> None:
        self.path = location.target
        self.location = location.shown
        self.conn = connect_for_reading(self.path)
        self._lock = threading.RLock()

    def status(self, status: str, host: str, pid: int, heartbeat: float, age: Any) -> str:
        return effective_status(status, host, pid, heartbeat)

    def glob(self, column: str, pattern: str) -> tuple[str, Any]:
        return f"runs.{column} GLOB ?", pattern

    def contains(self, column: str) -> str:
        return f"instr(runs.{column}, ?) > 0"

    def widths(self, query: Any, run: int) -> Sequence[int]:
        return widths_of(query, run)

    def run_tables(self, query: Any) -> list[tuple[str, str]]:
        tables = {r[0] for r in query.execute("SELECT name FROM sqlite_master")}
        return [(table, column) for table, column in _RUN_TABLES if table in tables]

    def read(self, fn: Callable[[Any], _T]) -> _T:
        with self._lock:
            conn = self.conn
            if conn.in_transaction:  # a read inside a read: the same snapshot
                return fn(conn)
            conn.execute("BEGIN")
            try:
                return fn(conn)
            finally:
                conn.execute("COMMIT")

    def write(self, fn: Callable[[Any], _T]) -> _T:
        """On a connection of its own (the reading one refuses writes), holding the file's
        write lock from the start (``BEGIN IMMEDIATE``)."""
        conn = sqlite3.connect(
            sqlite_uri(self.path, "rw"),
            uri=True,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("BEGIN IMMEDIATE")
            try:
                done = fn(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()
        return done

    def close(self) -> None:
        with self._lock:
            self.conn.close()
