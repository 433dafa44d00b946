"""The SQLite store's writing side: every statement :class:`~stepwatch.store.RunWriter` needs,
for one run, behind :class:`~stepwatch.store.base.WriteBackend`."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..base import StoreBusy, WriteBackend
from . import sqlite_rollup as _rollup
from .sqlite_schema import connect_for_writing

__all__ = ["SQLiteWriteBackend"]

# A point row is (key, step, epoch, time, value); the run is the statement's first parameter.
_COLUMNS = WriteBackend.COLUMNS


class SQLiteWriteBackend(WriteBackend):
    """Writes runs into an SQLite file (created with its tables when missing), in WAL mode
    so that readers and other writers work beside it.

    Raises:
        sqlite3.Error: the database cannot be opened or created at all.
    """

    def __init__(self, path: Path, wait: float | None = None, argname: str = "db") -> None:
        self.path = path
        self.location = str(path)
        try:
            self._conn = connect_for_writing(path, give_up=wait)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreBusy(str(exc)) from None
            raise
        # A short wait per try during training: a lock another process holds is reported
        # within seconds, and the writer tries again rather than dropping the batch.
        self._conn.execute(f"PRAGMA busy_timeout = {_WRITE_WAIT_MS}")
        self._rows_per_insert = _rows_per_insert(self._conn)
        self._key_ids: dict[str, int] = {}

    def create_run(self, name: str, config_json: str, host: str, pid: int, now: float) -> int:
        with _busy_as_store_busy(), self._conn:
            cur = self._conn.execute(
                "INSERT INTO runs (name, status, started, host, pid, config, heartbeat) "
                "VALUES (?, 'running', ?, ?, ?, ?, ?)",
                (name, now, host, pid, config_json, now),
            )
            run = int(cur.lastrowid or 0)
            if not name:
                self._conn.execute("UPDATE runs SET name = ? WHERE id = ?", (f"run-{run}", run))
            _rollup.mark_run(self._conn, run)
        return run

    def continue_run(self, run: int, host: str, pid: int, now: float) -> str:
        with _busy_as_store_busy(), self._conn:
            found = self._conn.execute("SELECT name FROM runs WHERE id = ?", (run,)).fetchone()
            if found is None:
                raise ValueError(f"the store {self.location} has no run {run} to continue")
            self._conn.execute(
                "UPDATE runs SET status = 'running', ended = NULL, host = ?, pid = ?, "
                "heartbeat = ? WHERE id = ?",
                (host, pid, now, run),
            )
        return str(found[0])

    def key_id(self, name: str) -> int:
        key_id = self._key_ids.get(name)
        if key_id is None:
            with _busy_as_store_busy():
                self._conn.execute("INSERT OR IGNORE INTO keys (name) VALUES (?)", (name,))
                row = self._conn.execute("SELECT id FROM keys WHERE name = ?", (name,))
                key_id = self._key_ids[name] = int(row.fetchone()[0])
        return key_id

    def write(
        self, run: int, flat: list[Any], events: Sequence[tuple[Any, ...]], now: float
    ) -> None:
        conn = self._conn
        with _busy_as_store_busy():
            conn.execute("BEGIN IMMEDIATE")  # takes the write lock: nothing written before
        try:
            if flat:
                self._insert_points(run, flat)
                _rollup.update(conn, run, flat, _COLUMNS)
            if events:
                conn.executemany(_INSERT_EVENTS, [(run, *event) for event in events])
            conn.execute("UPDATE runs SET heartbeat = ? WHERE id = ?", (now, run))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _insert_points(self, run: int, flat: list[Any]) -> None:
        """Insert the rows (``_COLUMNS`` values each, one after another in ``flat``), up to 256
        per statement: the interpreter lock is taken once to bind them and released while
        SQLite inserts them all. ``executemany`` releases and retakes it around every row;
        written during training, that cost the training thread about 4x the CPU time per
        point (bench/logging_throughput.py)."""
        execute, at, end = self._conn.execute, 0, len(flat)
        while at < end:
            rows = min(self._rows_per_insert, (end - at) // _COLUMNS)
            rows = 1 << (rows.bit_length() - 1)  # a power of two: a handful of cached statements
            stop = at + rows * _COLUMNS
            execute(_insert_sql(rows), [run, *flat[at:stop]])
            at = stop

    def finish(self, run: int, status: str, ended: float, dropped: int) -> None:
        with self._conn:
            self._conn.execute(
                "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, dropped = ? WHERE id = ?",
                (status, ended, ended, dropped, run),
            )

    def close(self) -> None:
        # The run into the database file itself, not only its -wal (where it stays while
        # another connection is open, or after checkpoints failed on a full disk): a copy of
        # the .db alone then holds it. PASSIVE: never waits for a reader.
        with contextlib.suppress(sqlite3.Error):  # a failing disk: the -wal still holds it
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self._conn.close()


_WRITE_WAIT_MS = 2_000


@contextlib.contextmanager
def _busy_as_store_busy() -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise StoreBusy(str(exc)) from None
        raise


def _rows_per_insert(conn: sqlite3.Connection) -> int:
    """The most rows per INSERT (a power of two, at most 256) that SQLite's limit on bound
    parameters allows (999 before SQLite 3.32, 32766 since, unless built otherwise)."""
    if hasattr(conn, "getlimit"):  # Python 3.11+
        limit = int(conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    else:  # pragma: no cover - Python 3.10
        limit = 32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999
    rows = max(1, min(256, (limit - 1) // _COLUMNS))
    return 1 << (rows.bit_length() - 1)


@functools.cache
def _insert_sql(rows: int) -> str:
    """``INSERT`` of ``rows`` rows: ``?1`` is the run, each row takes the next five."""
    return "INSERT INTO points (run, key, step, epoch, time, value) VALUES " + ", ".join(
        ["(?1, ?, ?, ?, ?, ?)"] * rows
    )


_INSERT_EVENTS = (
    "INSERT INTO events (run, step, epoch, time, kind, level, message, data) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
