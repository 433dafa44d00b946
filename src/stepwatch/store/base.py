"""The run store's interface: where a store is (a location string), what a store reads
(:class:`Store`), and what a backend writes for :class:`~stepwatch.store.RunWriter`
(:class:`WriteBackend`).

A location is a file path (an SQLite store, as ``RunRecorder(db="runs.db")`` has always taken)
or a URL whose scheme names the backend (``sqlite:///runs.db``; ``postgresql://user@host/db``
for a team store on a PostgreSQL server, :mod:`stepwatch.store.backends.postgres_write`).
Every place that names a store - ``RunRecorder(db=...)``, ``RunWriter``, ``Store``, the
CLI's ``--db``, ``stepwatch serve --db`` - takes one. The writer
keeps its queue policy (bounded queue, batches, drop-and-count) and hands batches to a
backend; every SQL statement lives in the backend (:mod:`stepwatch.store.backends`).

No PyTorch here, and no backend is imported before a location names it.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ._schema import resolve_path

if TYPE_CHECKING:
    import numpy as np

    from ._runs import LossStats, RunInfo

__all__ = [
    "Location",
    "Store",
    "StoreBusy",
    "StoreUnreachable",
    "WriteBackend",
    "hide_password",
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


# backend kind -> (module, reader class, writer class, location check): imported on first use.
_BACKENDS: dict[str, tuple[str, str, str, str]] = {
    "sqlite": (
        "stepwatch.store.backends.sqlite_read",
        "SQLiteStore",
        "stepwatch.store.backends.sqlite_write:SQLiteWriteBackend",
        "stepwatch.store.backends.sqlite_schema:check_writable_db",
    ),
    "postgresql": (
        "stepwatch.store.backends.postgres_read",
        "PostgresStore",
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


def parse_location(location: str | os.PathLike[str] | None, argname: str = "db") -> Location:
    """The store named by ``location``: None for the default file (``$STEPWATCH_DB`` or
    ``./stepwatch.db``), a path, or a URL (``sqlite:///runs.db``, ``postgresql://...``).

    Raises:
        TypeError: not a str, a path or None. ValueError: a URL of an unknown kind.
    """
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


def _backend(location: Location, argname: str) -> tuple[str, str, str, str]:
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


def check_writable(location: str | os.PathLike[str] | None, argname: str = "db") -> Location:
    """Parse ``location`` and check now that a run can be written there (before training)."""
    found = parse_location(location, argname)
    _load(_backend(found, argname)[3])(found.target, argname)
    return found


def open_write_backend(
    location: str | os.PathLike[str] | None, wait: float | None = None
) -> WriteBackend:
    """The backend that writes runs into the store at ``location``. ``wait``: the seconds to
    wait for a store another process holds (the backend's default when None); then
    :class:`StoreBusy`."""
    found = parse_location(location)
    backend: WriteBackend = _load(_backend(found, "db")[2])(found.target, wait)
    return backend


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


class Store:
    """Read access to a run store: runs, metrics and events, never changing the store.

    ``Store(location)`` opens the store a location names (a file path: the SQLite store;
    see :func:`parse_location`) and returns the backend's reader, e.g.
    :class:`~stepwatch.store.backends.sqlite_read.SQLiteStore`; every reader has the methods
    below.

    Args:
        path: the store's location (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).

    Raises:
        FileNotFoundError: no store at ``path`` (nothing is created).
        ValueError: not a stepwatch store, or a location of an unknown kind.

    Example:
        >>> store = Store("stepwatch.db")
        >>> run = store.runs()[-1]
        >>> steps, losses = store.metrics(run.id, "step_loss", max_points=500)
        >>> new_steps, new_losses = store.metrics(run.id, "step_loss", after=steps[-1])
    """

    location: str  # how messages name the store

    def __new__(cls, path: str | os.PathLike[str] | None = None) -> Store:
        if cls is Store:
            found = parse_location(path)
            module, name, _, _ = _backend(found, "path")
            cls = getattr(importlib.import_module(module), name)
        return super().__new__(cls)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *err: Any) -> None:
        self.close()

    # The reading interface: each backend's reader implements all of these.
    def runs(
        self,
        name: str | None = None,
        status: str | None = None,
        last: int | None = None,
        host: str | None = None,
        user: str | None = None,
    ) -> list[RunInfo]:
        raise NotImplementedError

    def runs_summary(
        self,
        name: str | None = None,
        status: str | None = None,
        last: int | None = None,
        host: str | None = None,
        user: str | None = None,
    ) -> list[tuple[RunInfo, LossStats | None]]:
        raise NotImplementedError

    def loss_stats(self, run: int | str) -> LossStats | None:
        raise NotImplementedError

    def run(self, run: int | str) -> RunInfo:
        raise NotImplementedError

    def keys(self, run: int | str) -> list[str]:
        raise NotImplementedError

    def metrics(
        self,
        run: int | str,
        key: str,
        max_points: int | None = None,
        start: int | None = None,
        end: int | None = None,
        after: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def summary(self, run: int | str) -> dict[str, dict[str, float]]:
        raise NotImplementedError

    def points(self, run: int | str) -> list[tuple[str, int, int | None, float, float]]:
        raise NotImplementedError

    def events(self, run: int | str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def delete_runs(self, runs: Sequence[int | str]) -> list[RunInfo]:
        """Delete runs and everything recorded for them (the one writing call of a reader;
        see :func:`stepwatch.store.reader.delete_runs`)."""
        raise NotImplementedError
