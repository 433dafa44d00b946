"""The run store's seam with its backends: where a store is (a location string), how a
backend is read (:class:`ReadDialect`, under the one reader :class:`~stepwatch.store.Store`)
and what a backend writes for :class:`~stepwatch.store.RunWriter` (:class:`WriteBackend`).

A location is a file path (an SQLite store, as ``RunRecorder(db="runs.db")`` has always taken)
or a URL whose scheme names the backend (``sqlite:///runs.db``; ``postgresql://user@host/db``
for a team store on a PostgreSQL server, :mod:`stepwatch.store.backends.postgres_write`).
Every place that names a store - ``RunRecorder(db=...)``, ``RunWriter``, ``Store``, the
CLI's ``--db``, ``stepwatch serve --db`` - takes one. The writer
keeps its queue policy (bounded queue, batches, drop-and-count) and hands batches to a
backend; every SQL statement of writing lives in the backend (:mod:`stepwatch.store.backends`),
and reading is one SQL reader over each backend's dialect.

No PyTorch here, and no backend is imported before a location names it.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from ._schema import resolve_path

__all__ = [
    "Location",
    "ReadDialect",
    "StoreBusy",
    "StoreUnreachable",
    "WriteBackend",
    "hide_password",
    "open_read_dialect",
    "open_write_backend",
    "parse_location",
]


class StoreBusy(Exception):
    """Raised by a backend when another process holds the store for now: the writer keeps
    the records and tries again, instead of dropping them."""

    reason = "is locked by another process"


class StoreUnreachable(StoreBusy):
    """Raised by a server backend when the server cannot be reached for now (down, restarting,
    the network gone): the writer keeps the records and tries again, as for a locked store."""

    reason = "cannot be reached"


# backend kind -> (read dialect, write backend, location check): imported on first use.
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "sqlite": (
        "stepwatch.store.backends.sqlite_read:SQLiteDialect",
        "stepwatch.store.backends.sqlite_write:SQLiteWriteBackend",
        "stepwatch.store.backends.sqlite_schema:check_writable_db",
    ),
    "postgresql": (
        "stepwatch.store.backends.postgres_read:PostgresDialect",
        "stepwatch.store.backends.postgres_write:PostgresWriteBackend",
        "stepwatch.store.backends.postgres_schema:check_writable_url",
    ),
}
_SCHEMES = {"sqlite": "sqlite", "postgresql": "postgresql", "postgres": "postgresql"}


class Location(NamedTuple):
    """Where a store is.

    Attributes:
        kind: the backend (``'sqlite'``, ``'postgresql'``).
        target: what the backend opens (a ``Path`` for SQLite, the URL for a server).
        shown: how messages name it: the path, or the URL without its password.
    """

    kind: str
    target: Any
    shown: str


# What names a store: a path, a URL, None (the default) or a location parsed already.
Where = str | os.PathLike[str] | Location | None


def parse_location(location: Where, argname: str = "db") -> Location:
    """The store named by ``location``: None for the default file (``$STEPWATCH_DB`` or
    ``./stepwatch.db``), a path, or a URL (``sqlite:///runs.db``, ``postgresql://...``); a
    :class:`Location` is returned as it is (a store is parsed once, where it is first named).

    Raises:
        TypeError: not a str, a path or None. ValueError: a URL of an unknown kind.
    """
    if isinstance(location, Location):
        return location
    if location is None and "://" in os.environ.get("STEPWATCH_DB", ""):
        location = os.environ["STEPWATCH_DB"]  # $STEPWATCH_DB may name a team store too
    if location is None or isinstance(location, os.PathLike) or "://" not in str(location):
        if location is not None and not isinstance(location, (str, os.PathLike)):
            raise TypeError(
                f"'{argname}' must be a path, a store URL or None, but got {location!r} with "
                f"type '{type(location).__name__}'."
            )
        path = resolve_path(location)
        return Location("sqlite", path, str(path))
    from urllib.parse import urlsplit  # only for a URL: the CLI starts faster without it

    text = str(location)
    parts = urlsplit(text)
    kind = _SCHEMES.get(parts.scheme.lower())
    shown = hide_password(text)
    if kind is None:
        known = ", ".join(f"{s}://" for s in _SCHEMES)
        raise ValueError(
            f"'{argname}' {shown!r} names an unknown kind of store ({parts.scheme}://); pass a "
            f"file path for a local store, or one of {known}."
        )
    if kind == "sqlite":
        # sqlite:///relative/path.db and sqlite:////absolute/path.db, as SQLAlchemy has them
        path = Path(text.split("://", 1)[1].removeprefix("/"))
        return Location("sqlite", path, str(path))
    return Location(kind, text, shown)


def _userinfo_span(url: str) -> tuple[int, int] | None:
    """Where the password of ``url`` sits (``user:PASSWORD@``), or None. The userinfo runs
    from ``://`` to the last ``@``: a password may hold ``/``, ``?``, ``#`` or ``@`` unencoded,
    where a URL parser would stop early (and libpq splits at the first ``@``), so this errs
    on the side of hiding more."""
    start = url.find("://")
    if start < 0:
        return None
    start += 3
    at = url.rfind("@")
    if at < start:
        return None
    colon = url.find(":", start, at)
    return (colon + 1, at) if colon >= 0 else None


def secrets_of(url: str) -> set[str]:
    """The passwords ``url`` holds (in its userinfo or as ``?password=``), raw and decoded."""
    from urllib.parse import unquote

    found: set[str] = set()
    span = _userinfo_span(url)
    if span is not None:
        found.add(url[span[0] : span[1]])
    for match in _QUERY_PASSWORD.finditer(url):
        found.add(match.group(2))
    # libpq ends the userinfo at the first '@': what follows one in a password lands in its
    # messages as part of the host name.
    found |= {part for secret in list(found) for part in secret.split("@")[1:]}
    return {v for secret in found for v in (secret, unquote(secret)) if v}


_QUERY_PASSWORD = re.compile(r"([?&]password=)([^&#]*)", re.IGNORECASE)


def hide_password(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``: how a store URL appears in every
    message, log line and page."""
    span = _userinfo_span(url)
    if span is not None:
        url = f"{url[: span[0]]}***{url[span[1] :]}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


def _backend(location: Location, argname: str) -> tuple[str, str, str]:
    found = _BACKENDS.get(location.kind)
    if found is None:
        raise ValueError(
            f"'{argname}' {location.shown!r} names a {location.kind} store, which this "
            "version of stepwatch cannot open yet; pass a file path for a local SQLite store."
        )
    return found


def _load(dotted: str) -> Any:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def check_writable(location: Where, argname: str = "db") -> Location:
    """Parse ``location`` and check now that a run can be written there (before training);
    the location, for the writer to open later."""
    found = parse_location(location, argname)
    _load(_backend(found, argname)[2])(found.target, argname)
    return found


def open_write_backend(
    location: Where, wait: float | None = None, argname: str = "db"
) -> WriteBackend:
    """The backend that writes runs into the store at ``location``. ``wait``: the seconds to
    wait for a store another process holds (the backend's default when None); then
    :class:`StoreBusy`. ``argname``: how errors name the location (``db``, push's ``to``)."""
    found = parse_location(location, argname)
    backend: WriteBackend = _load(_backend(found, argname)[1])(found.target, wait, argname)
    return backend


def open_read_dialect(location: Location, argname: str = "path") -> ReadDialect:
    """The dialect that reads the store at ``location`` (opened: its connection is made)."""
    dialect: ReadDialect = _load(_backend(location, argname)[0])(location)
    return dialect


class WriteBackend:
    """What :class:`~stepwatch.store.RunWriter` writes through: one run's rows, in batches.

    The writer calls these from its own thread only (``create_run`` from the thread that makes
    the writer). A point row is ``(key_id, step, epoch, time, value)``; ``write`` gets them
    flat, ``COLUMNS`` values per point, one after another, so a backend can bind them in bulk.
    Everything in one ``write`` is one transaction: all of it is stored, or none.
    """

    COLUMNS = 5
    location: str  # how messages name the store

    def create_run(self, name: str, config_json: str, host: str, pid: int, now: float) -> int:
        """Add a run with status ``running``; return its id (``name`` '' is ``run-<id>``)."""
        raise NotImplementedError

    def continue_run(self, run: int, host: str, pid: int, now: float) -> str:
        """Mark the stored run ``run`` ``running`` again, written by process ``pid`` on
        ``host`` (a job started again continues its run); return its name. Raises
        ValueError when the store has no such run."""
        raise NotImplementedError

    def key_id(self, name: str) -> int:
        """The id of the metric key ``name`` (created on first use)."""
        raise NotImplementedError

    def write(
        self, run: int, flat: list[Any], events: Sequence[tuple[Any, ...]], now: float
    ) -> None:
        """Store the points (``flat``), the events (``(step, epoch, time, kind, level,
        message, data_json)`` each) and the run's heartbeat, in one transaction. Raises
        :class:`StoreBusy` when another process holds the store (nothing was written)."""
        raise NotImplementedError

    def finish(self, run: int, status: str, ended: float, dropped: int) -> None:
        """Record the run's final status."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


_T = TypeVar("_T")


class ReadDialect:
    """How one kind of database is read by the one SQL reader, :class:`~stepwatch.store.Store`:
    its connection (how a query runs) and the few pieces of SQL that differ.

    Every query the reader writes marks its parameters with ``?``; ``read`` and ``write`` hand
    ``fn`` an object whose ``execute(sql, params)`` runs it in the backend's own marks and
    returns a cursor (``fetchone``, ``fetchall``, iteration), as ``sqlite3`` and psycopg do.
    Where a backend keeps per-key totals (``series`` on PostgreSQL), its SQL reads them instead
    of the points.
    """

    location: str  # how messages name the store
    # The run's columns of ``runs r``, in this order: id, name, status, started, ended, host,
    # pid, config, heartbeat, dropped, steps (the largest step of any key), user ('' if the
    # store records none) and age (seconds since a live writer last wrote; NULL if unknown).
    run_columns: str
    # The run columns (over ``r``) then the loss summary: key name, count, epochs, min, last,
    # last step, has step_loss; for the runs ``runs`` filtered by ``{where}`` and ``{limit}``.
    loss_sql: str
    keys_sql: str  # the run's key names, sorted; one parameter: the run
    key_sql: str  # the id of a key the run recorded; parameters: the key's name, the run
    # Per key of the run: name, count, min, max, last step, last value; one parameter: the run.
    summary_sql: str
    value: str = "{}"  # the value column (``{}``) as read: a NaN as NULL
    nan: str = "value IS NULL"  # the condition of a point whose value is NaN
    tie: str = ""  # how points of one step are ordered, after the step ('' for never twice)
    event_order: str = "id"  # the events' column in the order they were recorded
    lock_rows: str = ""  # what a write transaction adds to a SELECT to lock its rows
    users = False  # whether the store records who ran each run

    def status(self, status: str, host: str, pid: int, heartbeat: float, age: Any) -> str:
        """The run's status as shown: a stored ``running`` whose writer is gone is crashed."""
        raise NotImplementedError

    def glob(self, column: str, pattern: str) -> tuple[str, Any]:
        """``(condition, parameter)``: ``runs.<column>`` matches the glob ``pattern``."""
        raise NotImplementedError

    def contains(self, column: str) -> str:
        """The condition that ``runs.<column>`` contains the parameter (a text)."""
        raise NotImplementedError

    def widths(self, query: Any, run: int) -> Sequence[int]:
        """The rollup widths kept for ``run`` (empty: it is read by the exact path)."""
        raise NotImplementedError

    def run_tables(self, query: Any) -> list[tuple[str, str]]:
        """``(table, column naming the run)`` of every table holding a run's rows, the runs
        table last."""
        raise NotImplementedError

    def read(self, fn: Callable[[Any], _T]) -> _T:
        """``fn(query)`` inside one read-only snapshot, under the dialect's lock (threads take
        turns)."""
        raise NotImplementedError

    def write(self, fn: Callable[[Any], _T]) -> _T:
        """``fn(query)`` inside one write transaction: all of it is stored, or none."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
