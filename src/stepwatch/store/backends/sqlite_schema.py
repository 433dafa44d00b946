"""The SQLite run store's schema, its version, and how its connections are opened."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._validation import nearest_existing

__all__: list[str] = []


# 1: runs, keys, points, events. 2: adds the min/max rollups (``_rollup``): only tables are
# added, so every version reads every file; a run written without rollups (not listed in
# ``rollup_runs``) is read from its points.
SCHEMA_VERSION = 2
BUSY_TIMEOUT_MS = 30_000
# Opening a store for writing waits this long per try for a lock, and gives up after this many
# seconds with a clear error (a warning says so after the first try).
_OPEN_WAIT_MS = 2_000
_OPEN_GIVE_UP = 120.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    started REAL NOT NULL,
    ended REAL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    config TEXT NOT NULL DEFAULT '{}',
    heartbeat REAL NOT NULL,
    dropped INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS keys (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS points (
    run INTEGER NOT NULL,
    key INTEGER NOT NULL,
    step INTEGER NOT NULL,
    epoch INTEGER,
    time REAL NOT NULL,
    value REAL
);
CREATE INDEX IF NOT EXISTS points_by_run_key_step ON points (run, key, step);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run INTEGER NOT NULL,
    step INTEGER,
    epoch INTEGER,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run, id);
CREATE TABLE IF NOT EXISTS rollup_runs (run INTEGER PRIMARY KEY, widths TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rollups (
    run INTEGER NOT NULL,
    key INTEGER NOT NULL,
    width INTEGER NOT NULL,
    bucket INTEGER NOT NULL,
    n INTEGER NOT NULL,
    min_step INTEGER,
    min_value REAL,
    max_step INTEGER,
    max_value REAL,
    nan_step INTEGER,
    PRIMARY KEY (run, key, width, bucket)
) WITHOUT ROWID;
"""


def is_a_folder(path: Path) -> str:
    """What every place that opens a store says of a folder given as the store: the writer
    (``RunRecorder(db=...)``, ``RunWriter``) and the reader (``Store``, the CLI's ``--db``)."""
    return (
        f"{str(path)!r} is a folder; pass a database file such as {str(path / 'stepwatch.db')!r}."
    )


def check_writable_db(path: Path, argname: str = "db") -> None:
    """Raise ValueError now for a path that cannot hold a run store: a folder, a file that is
    not SQLite, an SQLite file of another program, a place that cannot be written, or a file
    whose folder's folder does not exist (the store's own folder is made, not a whole tree)."""
    if path.is_dir():
        raise ValueError(f"'{argname}' {is_a_folder(path)}")
    if path.is_file():
        folder = path.resolve().parent
        if not os.access(path, os.W_OK) or not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(
                f"'{argname}' {str(path)!r} cannot be written: the file or its folder is "
                "read-only (a run store also writes its -wal file beside it). Record into a "
                "store you can write; reading this one works (stepwatch runs --db ...)."
            )
        try:
            with open(path, "rb") as f:
                header = f.read(16)
        except OSError as exc:
            raise ValueError(f"'{argname}' {str(path)!r} cannot be read: {exc.strerror}") from None
        if header and header != b"SQLite format 3\x00":
            raise ValueError(
                f"'{argname}' {str(path)!r} is not an SQLite database (a stepwatch run store); "
                "pass a new file name or an existing run store."
            )
        if header:
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
            try:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            except sqlite3.DatabaseError as exc:
                raise ValueError(f"'{argname}' {str(path)!r} is not readable: {exc}") from None
            finally:
                conn.close()
            if tables and "meta" not in tables:
                raise ValueError(
                    f"'{argname}' {str(path)!r} is an SQLite database of something else (tables "
                    f"{sorted(tables)[:5]}); pass a file of its own for the run store."
                )
            if tables:
                reader = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
                try:
                    check_store(reader, path)  # newer, changed or cut off: refused before training
                finally:
                    reader.close()
        return
    probe = nearest_existing(path.parent)
    if not probe.is_dir():
        raise ValueError(f"'{argname}' {str(path)!r} cannot be created: {str(probe)!r} is a file.")
    _check_folders(path, probe, argname)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"'{argname}' {str(path)!r} cannot be created: no permission.")


def _check_folders(path: Path, probe: Path, argname: str) -> None:
    """A ValueError when more than the store's own folder is missing (``probe``: the nearest
    folder that exists): a mistyped path never makes a tree of folders without a word."""
    folder = path.absolute().parent
    if probe not in (folder, folder.parent):
        missing = folder.relative_to(probe).parts[0]
        raise ValueError(
            f"'{argname}' {str(path)!r} cannot be created: {str(probe / missing)!r} does not "
            f"exist (a store's own folder is made, {str(folder)!r}, but not the folders "
            "above it); create them first, or pass a path in a folder that exists."
        )


def connect_for_writing(path: Path, give_up: float | None = None) -> sqlite3.Connection:
    """Open (creating if needed) the database in WAL mode, ready for concurrent writers.
    ``give_up``: the seconds to wait for a lock another process holds (default 2 minutes);
    then a ``sqlite3.OperationalError`` saying it stayed locked."""
    _check_folders(path, nearest_existing(path.parent), "db")
    path.parent.mkdir(exist_ok=True)  # the store's own folder only
    conn = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
    )
    # Short waits while opening, so that a lock another process holds is reported within
    # seconds (the long busy timeout is for the writes during training).
    conn.execute(f"PRAGMA busy_timeout = {_OPEN_WAIT_MS}")
    limit = _OPEN_GIVE_UP if give_up is None else give_up
    try:
        _retry(lambda: conn.execute("PRAGMA journal_mode = WAL"), path, limit)
    except BaseException:
        conn.close()
        raise
    # NORMAL in WAL mode: a killed process loses nothing committed; only a power cut can
    # lose the last transactions.
    conn.execute("PRAGMA synchronous = NORMAL")

    def create() -> None:
        try:
            conn.executescript(
                "BEGIN IMMEDIATE;"
                + SCHEMA
                + "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', "
                + f"'{SCHEMA_VERSION}'); UPDATE meta SET value = '{SCHEMA_VERSION}' "
                + "WHERE key = 'schema_version' AND CAST(value AS INTEGER) < "
                + f"{SCHEMA_VERSION}; COMMIT;"
            )
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    try:
        _retry(create, path, limit)
        _retry(lambda: check_store(conn, path, thorough=True), path, limit)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    except BaseException:
        conn.close()
        raise
    return conn


# The columns every version's tables have (a file whose tables lack one was changed by hand
# or by another program, and would fail everywhere with 'no such column').
_COLUMNS = {
    "runs": {"id", "name", "status", "started", "ended", "host", "pid", "config", "heartbeat"},
    "keys": {"id", "name"},
    "points": {"run", "key", "step", "epoch", "time", "value"},
    "events": {"id", "run", "step", "epoch", "time", "kind", "level", "message", "data"},
}


def check_store(conn: sqlite3.Connection, path: Path, thorough: bool = False) -> None:
    """Refuse a store this version cannot use, with a clear ValueError: one of a newer schema,
    one whose tables were changed, and one that is damaged (truncated; with ``thorough``, any
    page SQLite's ``quick_check`` finds broken - done before writing, so a new run never goes
    into a file it could not be read back from)."""
    where = repr(str(path))
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row is not None else None
        layout = {
            table: {r[1] for r in conn.execute(f"PRAGMA table_info({table})")} for table in _COLUMNS
        }
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        page_count = int(conn.execute("PRAGMA page_count").fetchone()[0])
        problems = conn.execute("PRAGMA quick_check(3)").fetchall() if thorough else [("ok",)]
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise  # another process is writing: the caller retries
        raise ValueError(f"{where} is not a readable stepwatch store: {exc}") from None
    except (sqlite3.DatabaseError, ValueError, TypeError) as exc:
        raise ValueError(f"{where} is not a readable stepwatch store: {exc}") from None
    if version is not None and version > SCHEMA_VERSION:
        raise ValueError(
            f"{where} was written by a newer stepwatch (store schema {version}; this version "
            f"reads schema {SCHEMA_VERSION} and older): upgrade stepwatch to use it."
        )
    for table, columns in _COLUMNS.items():
        missing = sorted(columns - layout[table])
        if missing:
            raise ValueError(
                f"{where} is not a stepwatch store this version can use: its table "
                f"{table!r} lacks {missing} (schema {version}, expected {SCHEMA_VERSION})."
            )
    # Only with no write-ahead log: while writers work, the file and its header may be
    # between two checkpoints.
    wal = Path(f"{path}-wal")
    quiet = not wal.exists() or wal.stat().st_size == 0
    # (The file is never opened here, only stat'ed: closing a second descriptor on a database
    # would drop this process's SQLite locks on it.)
    expected = page_count * page_size
    size = path.stat().st_size if path.is_file() else 0
    if quiet and expected > size:
        raise ValueError(
            f"{where} is damaged: it is truncated ({size} bytes of {expected}). Restore a "
            "copy, or record into a new file."
        )
    if [tuple(r) for r in problems] != [("ok",)]:
        first = str(problems[0][0]).splitlines()[0]
        raise ValueError(
            f"{where} is damaged (SQLite's quick_check: {first}). Restore a copy, or record "
            "into a new file; nothing was written to it."
        )


def sqlite_uri(path: Path, mode: str, immutable: bool = False) -> str:
    """A ``file:`` URI for ``path`` (any characters in the name are escaped)."""
    uri = f"{path.resolve().as_uri()}?mode={mode}"
    return uri + "&immutable=1" if immutable else uri


def connect_for_reading(path: Path) -> sqlite3.Connection:
    """Open an existing database for reading; never creates or changes a file.

    A database we may write is opened read-write with ``PRAGMA query_only``: SQLite then
    deletes the ``-wal``/``-shm`` files it creates for a WAL database when the last connection
    closes, as it does for writers (a ``mode=ro`` connection would leave them behind). A file
    we may not write is opened ``mode=ro``, and ``immutable`` when no ``-wal`` file exists:
    then no writer can be using it and SQLite needs no lock files.
    """
    if path.is_dir():
        raise ValueError(is_a_folder(path))
    if not path.is_file():
        raise FileNotFoundError(f"no stepwatch database at {str(path)!r}")
    folder = path.resolve().parent
    if os.access(path, os.W_OK) and os.access(folder, os.W_OK | os.X_OK):
        uri = sqlite_uri(path, "rw")
    else:
        uri = sqlite_uri(path, "ro", immutable=not Path(f"{path}-wal").exists())
    conn = sqlite3.connect(
        uri,
        uri=True,
        timeout=BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,
        check_same_thread=False,  # the Store's lock serialises threads
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise ValueError(f"{str(path)!r} is not a stepwatch database: {exc}") from exc
    if row is None:
        conn.close()
        raise ValueError(f"{str(path)!r} is not a stepwatch database (no schema version)")
    try:
        check_store(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def _retry(fn: Callable[[], Any], path: Path | None = None, give_up: float = 120.0) -> None:
    """Run ``fn``, retrying while another process holds the database: a warning after the
    first ~2 s of waiting, and a clear error after ``give_up`` seconds."""
    start = time.monotonic()
    warned = False
    long = give_up >= 4 * _OPEN_WAIT_MS / 1000
    attempt = 0
    while True:
        try:
            fn()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            waited = time.monotonic() - start
            if waited >= give_up:
                raise sqlite3.OperationalError(
                    f"the run store {str(path)!r} stayed locked by another process for "
                    f"{waited:.0f} s; close the program that holds it (a writer in a long "
                    "transaction, an open sqlite3 shell) and start again"
                ) from None
            # Said only by a caller that waits long (not the writer, which gives up within
            # seconds, lets training go on, and says so itself: one message, not two).
            if not warned and waited >= _OPEN_WAIT_MS / 1000 and path is not None and long:
                import logging  # only when waiting: the CLI starts faster without it

                warned = True
                logging.getLogger("stepwatch").warning(
                    "stepwatch store: %s is locked by another process; waiting for it (up to %d s)",
                    path,
                    give_up,
                )
            attempt += 1
            time.sleep(min(0.02 * attempt, 0.5))
