"""How the one reader (:class:`stepwatch.store.Store`) reads a team store on PostgreSQL: its
connection and the SQL that is PostgreSQL's own (:class:`PostgresDialect`).

Listing runs reads one row per run and per key (``series``), never their points; a
downsampled curve reads the min/max rollups and only the raw points at the range's two edges.
A run is shown ``crashed`` when it is stored as ``running`` and its writer's heartbeat (the
server's clock at its last write) is older than :data:`STALE_SECONDS`: no pid is checked,
since the run may be on another machine. A run pushed from a local store keeps the status it
was pushed with. PostgreSQL stores a NaN as NaN; the reader reads it as NULL.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ...monitor import values
from .._runs import LEGACY_EPOCH_LOSS
from ..base import Location, ReadDialect, StoreUnreachable
from .postgres_schema import check_version, connect, psycopg, scrub, stored_version
from .rollup import WIDTHS

__all__ = ["STALE_SECONDS", "PostgresDialect"]

# A 'running' run whose writer has not written for this long is shown as crashed (the writer
# writes at least every flush period, 1 s by default).
STALE_SECONDS = 20.0

_T = TypeVar("_T")

# The age is NULL for a pushed run: its status is the one it was pushed with.
_RUN_COLUMNS = (
    "r.id, r.name, r.status, r.started, r.ended, r.host, r.pid, r.config, r.heartbeat, "
    'r.dropped, r.steps, r."user", CASE WHEN r.pushed THEN NULL '
    "ELSE extract(epoch FROM clock_timestamp() - r.seen)::float8 END"
)
_RANK = f"CASE k.name WHEN '{LEGACY_EPOCH_LOSS}' THEN 0 WHEN '{values.LOSS}' THEN 1 ELSE 2 END"
_LOSS_SQL = f"""
SELECT {_RUN_COLUMNS}, l.name, l.n, CASE WHEN l.per_epoch THEN l.n ELSE 0 END, l.lmin,
    l.last_value, l.last_step, EXISTS (SELECT 1 FROM series s JOIN keys k ON k.id = s.key
        WHERE s.run = r.id AND k.name = '{values.STEP_LOSS}')
FROM (SELECT * FROM runs WHERE {{where}} ORDER BY id DESC {{limit}}) r
LEFT JOIN LATERAL (SELECT k.name, s.* FROM series s JOIN keys k ON k.id = s.key
    WHERE s.run = r.id AND k.name IN ('{LEGACY_EPOCH_LOSS}', '{values.LOSS}',
    '{values.STEP_LOSS}') ORDER BY s.lmin IS NULL, {_RANK} LIMIT 1) l ON true
ORDER BY r.id
"""
_RUN_TABLES = [("points", "run"), ("rollups", "run"), ("series", "run"), ("events", "run"),
               ("runs", "id")]  # fmt: skip


class PostgresDialect(ReadDialect):
    """A team store on PostgreSQL read by :class:`stepwatch.store.Store`
    (``postgresql://...``).

    One connection, shared by threads under a lock; each read is one snapshot (a read-only,
    repeatable-read transaction). A connection lost to a server restart is opened again on the
    next call.

    Raises:
        FileNotFoundError: the database holds no stepwatch store yet (nothing is created).
        ConnectionError: the server cannot be reached.
        ValueError: the server refused the credentials, or the store is of a newer version.
    """

    run_columns = _RUN_COLUMNS
    loss_sql = _LOSS_SQL
    keys_sql = (
        "SELECT k.name FROM series s JOIN keys k ON k.id = s.key WHERE s.run = ? ORDER BY k.name"
    )
    key_sql = "SELECT k.id FROM series s JOIN keys k ON k.id = s.key WHERE k.name = ? AND s.run = ?"
    summary_sql = (
        "SELECT k.name, s.n, s.vmin, s.vmax, s.last_step, s.last_value FROM series s "
        "JOIN keys k ON k.id = s.key WHERE s.run = ? ORDER BY k.name"
    )
    value = "NULLIF({}, 'NaN')"
    nan = "value IS NULL OR value = 'NaN'"
    event_order = "seq"
    lock_rows = " FOR UPDATE"
    users = True

    def __init__(self, location: Location) -> None:
        self._url = str(location.target)
        self.location = location.shown
        self._pg = psycopg()
        self._lock = threading.RLock()
        self._conn: Any = None
        self._connect()

    def _connect(self) -> Any:
        try:
            conn = connect(self._url, "path")
        except StoreUnreachable as exc:
            raise ConnectionError(f"cannot reach the store {self.location}: {exc}") from None
        try:
            version = stored_version(conn)
            if version is None:
                raise FileNotFoundError(
                    f"no stepwatch store in {self.location!r} (the database has no stepwatch "
                    "tables yet: record a run into it first)"
                )
            check_version(version, self.location)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def status(self, status: str, host: str, pid: int, heartbeat: float, age: Any) -> str:
        if status == "running" and age is not None and age > STALE_SECONDS:
            return "crashed"
        return status

    def glob(self, column: str, pattern: str) -> tuple[str, Any]:
        return f"runs.{column} ~ ?", _glob_regex(pattern)

    def contains(self, column: str) -> str:
        return f"strpos(runs.{column}, ?) > 0"

    def widths(self, query: Any, run: int) -> Sequence[int]:
        return WIDTHS  # every run's writer (and every push) keeps them

    def run_tables(self, query: Any) -> list[tuple[str, str]]:
        return _RUN_TABLES

    def _transaction(self, fn: Callable[[Any], _T], read_only: bool) -> _T:
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                conn = self._connect()
            try:
                with conn.transaction():
                    if read_only:
                        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    return fn(_Marks(conn))
            except self._pg.OperationalError as exc:
                if conn.broken or conn.closed:  # the next call connects again
                    message = scrub(" ".join(str(exc).split()), self._url)
                    raise ConnectionError(f"lost the store {self.location}: {message}") from None
                raise

    def read(self, fn: Callable[[Any], _T]) -> _T:
        """``fn`` in a snapshot, tried once more on a fresh connection when the first one
        turns out to be lost (a server restarted since the last call)."""
        try:
            return self._transaction(fn, read_only=True)
        except ConnectionError:
            pass
        return self._transaction(fn, read_only=True)

    def write(self, fn: Callable[[Any], _T]) -> _T:
        return self._transaction(fn, read_only=False)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()


class _Marks:
    """A connection that takes the reader's ``?`` marks (psycopg's are ``%s``)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(_marks(sql), params)


@functools.lru_cache(maxsize=256)
def _marks(sql: str) -> str:
    return sql.replace("%", "%%").replace("?", "%s")


_NEVER = "^(?!)"  # a regex that matches nothing


def _glob_regex(pattern: str) -> str:
    """A glob as SQLite's GLOB reads it (``*``, ``?``, ``[...]`` with ``[^...]`` negating,
    a ``]`` first in a set taken as a member, a backwards range matching nothing, an unclosed
    set matching nothing) as an anchored PostgreSQL regex, so both stores pick the same runs."""
    out, i, n = ["^"], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i + 1
            negate = j < n and pattern[j] == "^"
            j += negate
            end = pattern.find("]", j + 1 if j < n and pattern[j] == "]" else j)
            if end < 0:
                return _NEVER
            out.append(_glob_set(pattern[j:end], negate))
            i = end
        else:
            out.append("\\" + c if not c.isalnum() else c)
        i += 1
    return "".join(out) + "$"


def _glob_set(body: str, negate: bool) -> str:
    """One ``[...]`` of a glob as a bracket expression (every member escaped)."""

    def esc(ch: str) -> str:
        return "\\" + ch if not ch.isalnum() else ch

    members, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            low, high = body[k], body[k + 2]
            if low <= high:
                members.append(f"{esc(low)}-{esc(high)}")
            k += 3
        else:
            members.append(esc(body[k]))
            k += 1
    if not members:
        return "." if negate else "(?!)"
    return "[" + ("^" if negate else "") + "".join(members) + "]"
