"""The PostgreSQL store's reader (:class:`PostgresStore`, what ``Store("postgresql://...")``
returns): the same reading interface as the SQLite reader, over a team store on a server.

Listing runs reads one row per run and per key (``series``), never their points; a
downsampled curve reads the min/max rollups and only the raw points at the range's two edges.
A run is shown ``crashed`` when it is stored as ``running`` and its writer's heartbeat (the
server's clock at its last write) is older than :data:`STALE_SECONDS`: no pid is checked,
since the run may be on another machine. A run pushed from a local store keeps the status it
was pushed with.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..._validation import check_int
from ...monitor import values
from .._runs import (
    LEGACY_EPOCH_LOSS,
    LossStats,
    RunInfo,
    _loss_stats,
    _nan,
    keep_runs,
    run_filters,
    run_reference,
)
from ..base import Store, StoreUnreachable, parse_location
from .postgres_schema import check_version, connect, psycopg, scrub, stored_version
from .sqlite_rollup import WIDTHS, merge_downsample, pick_width

if TYPE_CHECKING:
    import numpy as np

__all__ = ["STALE_SECONDS", "PostgresStore"]

# A 'running' run whose writer has not written for this long is shown as crashed (the writer
# writes at least every flush period, 1 s by default).
STALE_SECONDS = 20.0

_T = TypeVar("_T")

_RUN_COLUMNS = (
    "r.id, r.name, r.status, r.started, r.ended, r.host, r.pid, r.config, r.heartbeat, "
    'r.dropped, r.steps, r."user", r.pushed, '
    "extract(epoch FROM clock_timestamp() - r.seen)::float8"
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


class PostgresStore(Store):
    """Read access to a stepwatch store on PostgreSQL (``Store("postgresql://...")``).

    One connection, shared by threads under a lock (as the SQLite reader); each call reads
    one snapshot (a read-only, repeatable-read transaction). A connection lost to a server
    restart is opened again on the next call.

    Raises:
        FileNotFoundError: the database holds no stepwatch store yet (nothing is created).
        ConnectionError: the server cannot be reached.
        ValueError: the server refused the credentials, or the store is of a newer version.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        location = parse_location(path, "path")
        self._url = str(location.target)
        self.location = location.shown
        self._pg = psycopg()
        self._lock = threading.RLock()
        self._depth = 0
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

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[Any]:
        """The connection, locked, inside one read-only transaction (nested calls share it)."""
        with self._lock:
            if self._depth:
                yield self._conn
                return
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                conn = self._connect()
            self._depth += 1
            try:
                with conn.transaction():
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    yield conn
            except self._pg.OperationalError as exc:
                if conn.broken or conn.closed:  # the next call connects again
                    message = scrub(" ".join(str(exc).split()), self._url)
                    raise ConnectionError(f"lost the store {self.location}: {message}") from None
                raise
            finally:
                self._depth -= 1

    def _read(self, fn: Callable[[Any], _T]) -> _T:
        """``fn(conn)`` in a snapshot, tried once more on a fresh connection when the first
        one turns out to be lost (a server restarted since the last call)."""
        try:
            with self._snapshot() as conn:
                return fn(conn)
        except ConnectionError:
            if self._depth:
                raise
        with self._snapshot() as conn:
            return fn(conn)

    # -- runs -------------------------------------------------------------------------------
    @staticmethod
    def _info(row: Sequence[Any]) -> RunInfo:
        rid, name, status, started, ended, host, pid, config, heartbeat, dropped = row[:10]
        steps, user, pushed, age = row[10:14]
        try:
            cfg = json.loads(config)
        except ValueError:
            cfg = {}
        shown = status
        if status == "running" and not pushed and age > STALE_SECONDS:
            shown = "crashed"
        return RunInfo(
            id=int(rid), name=name, status=shown, stored_status=status, started=started,
            ended=ended, host=host, pid=pid, heartbeat=heartbeat, dropped=int(dropped),
            config=cfg if isinstance(cfg, dict) else {}, steps=int(steps or 0), user=user,
        )  # fmt: skip

    @staticmethod
    def _filters(
        name: str | None,
        status: str | None,
        last: int | None,
        host: str | None = None,
        user: str | None = None,
    ) -> tuple[str, list[Any], str]:
        return run_filters(
            status,
            last,
            (("name", "name", name), ("host", "host", host), ("user", '"user"', user)),
            mark="%s",
            glob=lambda column, pattern: (f"runs.{column} ~ %s", _glob_regex(pattern)),
            contains=lambda column: f"strpos(runs.{column}, %s) > 0",
        )

    def runs(
        self,
        name: str | None = None,
        status: str | None = None,
        last: int | None = None,
        host: str | None = None,
        user: str | None = None,
    ) -> list[RunInfo]:
        """The runs, oldest first; ``name``, ``host`` and ``user`` keep those whose field
        contains the text, or matches it as a glob (``*``, ``?``, ``[``). See
        :meth:`stepwatch.store.backends.sqlite_read.SQLiteStore.runs`."""
        where, params, limit = self._filters(name, status, last, host, user)
        sql = (
            f"SELECT {_RUN_COLUMNS} FROM (SELECT * FROM runs WHERE {where} ORDER BY id DESC "
            f"{limit}) r ORDER BY r.id"
        )
        rows = self._read(lambda conn: conn.execute(sql, params).fetchall())
        return keep_runs([self._info(row) for row in rows], status, last, lambda r: r)

    def runs_summary(
        self,
        name: str | None = None,
        status: str | None = None,
        last: int | None = None,
        host: str | None = None,
        user: str | None = None,
    ) -> list[tuple[RunInfo, LossStats | None]]:
        """Each run (filtered as in :meth:`runs`) with its training loss summarised, from the
        per-key series (one row per run and key: no point is read)."""
        where, params, limit = self._filters(name, status, last, host, user)
        sql = _LOSS_SQL.format(where=where, limit=limit)
        rows = self._read(lambda conn: conn.execute(sql, params).fetchall())
        pairs = [(self._info(row[:14]), _loss_stats(row[14:])) for row in rows]
        return keep_runs(pairs, status, last, lambda pair: pair[0])

    def loss_stats(self, run: int | str) -> LossStats | None:
        rid = self.run(run).id
        sql = _LOSS_SQL.format(where="runs.id = %s", limit="")
        row = self._read(lambda conn: conn.execute(sql, (rid,)).fetchone())
        return _loss_stats(row[14:])

    def run(self, run: int | str) -> RunInfo:
        """A run by id (an int or a string of digits) or by name (the newest with that name).

        Raises:
            KeyError: no such run.
        """
        by_id, arg = run_reference(run)
        where = "r.id = %s" if by_id else "r.name = %s ORDER BY r.id DESC LIMIT 1"
        sql = f"SELECT {_RUN_COLUMNS} FROM runs r WHERE {where}"
        row = self._read(lambda conn: conn.execute(sql, (arg,)).fetchone())
        if row is None:
            raise KeyError(f"no run {run!r} in {self.location!r}")
        return self._info(row)

    # -- metrics ----------------------------------------------------------------------------
    def keys(self, run: int | str) -> list[str]:
        rid = self.run(run).id
        sql = "SELECT k.name FROM series s JOIN keys k ON k.id = s.key WHERE s.run = %s"
        rows = self._read(lambda conn: conn.execute(sql + " ORDER BY k.name", (rid,)).fetchall())
        return [r[0] for r in rows]

    def metrics(
        self,
        run: int | str,
        key: str,
        max_points: int | None = None,
        start: int | None = None,
        end: int | None = None,
        after: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one metric, as
        :meth:`stepwatch.store.backends.sqlite_read.SQLiteStore.metrics` (min/max
        downsampling from the rollups, ``after=`` for the new points of a live run)."""
        import numpy as np

        check_int("max_points", max_points, minimum=2, allow_none=True)
        check_int("start", start, allow_none=True)
        check_int("end", end, allow_none=True)
        check_int("after", after, allow_none=True)
        if not isinstance(key, str):
            raise TypeError(f"'key' must be a str, but got {key!r}.")
        rid = self.run(run).id
        where, params = "run = %s AND key = %s", []
        for op, bound in ((">=", start), ("<=", end), (">", after)):
            if bound is not None:
                where += f" AND step {op} %s"
                params.append(bound)

        def read(conn: Any) -> list[Any] | None:
            found = conn.execute(
                "SELECT k.id FROM series s JOIN keys k ON k.id = s.key "
                "WHERE s.run = %s AND k.name = %s",
                (rid, key),
            ).fetchone()
            if found is None:
                return None
            args = (rid, found[0], *params)
            everything = (
                f"SELECT step, NULLIF(value, 'NaN') FROM points WHERE {where} ORDER BY step"
            )
            if max_points is not None:
                (count,) = conn.execute(
                    f"SELECT count(*) FROM (SELECT 1 FROM points WHERE {where} LIMIT %s) c",
                    (*args, max_points + 1),
                ).fetchone()
                if count > max_points:
                    return self._downsample(conn, where, args, max_points)
            return list(conn.execute(everything, args).fetchall())

        rows = self._read(read)
        if rows is None:
            raise KeyError(f"run {rid} has no metric {key!r}; see Store.keys({rid})")
        steps = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        vals = np.fromiter((_nan(r[1]) for r in rows), dtype=np.float64, count=len(rows))
        return steps, vals

    @staticmethod
    def _downsample(
        conn: Any, where: str, args: tuple[Any, ...], max_points: int
    ) -> list[tuple[Any, ...]]:
        """Min/max (and first NaN) per bucket: whole rollup blocks of the coarsest width that
        fits a bucket, and the raw points of the partial blocks at the two edges."""
        lo, hi = conn.execute(
            f"SELECT (SELECT min(step) FROM points WHERE {where}), "
            f"(SELECT max(step) FROM points WHERE {where})",
            args * 2,
        ).fetchone()
        run, key = args[0], args[1]
        align = pick_width(WIDTHS, lo, hi, max_points)
        return merge_downsample(
            lambda first, last: conn.execute(
                "SELECT bucket * %s, min_step, min_value, max_step, max_value, nan_step "
                "FROM rollups WHERE run = %s AND key = %s AND width = %s "
                "AND bucket BETWEEN %s AND %s",
                (align, run, key, align, first, last),
            ).fetchall(),
            lambda a, b: conn.execute(
                "SELECT step, NULLIF(value, 'NaN') FROM points WHERE run = %s "
                "AND key = %s AND step BETWEEN %s AND %s",
                (run, key, a, b),
            ),
            align,
            lo,
            hi,
            max_points,
        )

    def summary(self, run: int | str) -> dict[str, dict[str, float]]:
        """Per metric: ``last``, ``min``, ``max``, ``count`` and the ``last_step``."""
        rid = self.run(run).id
        rows = self._read(
            lambda conn: conn.execute(
                "SELECT k.name, s.n, s.vmin, s.vmax, s.last_step, s.last_value FROM series s "
                "JOIN keys k ON k.id = s.key WHERE s.run = %s ORDER BY k.name",
                (rid,),
            ).fetchall()
        )
        return {
            name: {"last": _nan(last), "min": _nan(vmin), "max": _nan(vmax), "count": int(n),
                   "last_step": last_step}
            for name, n, vmin, vmax, last_step, last in rows
        }  # fmt: skip

    def points(self, run: int | str) -> list[tuple[str, int, int | None, float, float]]:
        """Every point of a run as ``(key, step, epoch, time, value)``, ordered by key, step."""
        rid = self.run(run).id
        rows = self._read(
            lambda conn: conn.execute(
                "SELECT k.name, p.step, p.epoch, p.time, NULLIF(p.value, 'NaN') FROM points p "
                "JOIN keys k ON k.id = p.key WHERE p.run = %s ORDER BY k.name, p.step",
                (rid,),
            ).fetchall()
        )
        return [(k, s, e, t, _nan(v)) for k, s, e, t, v in rows]

    # -- events -----------------------------------------------------------------------------
    def events(self, run: int | str) -> list[dict[str, Any]]:
        """The run's events, oldest first."""
        rid = self.run(run).id
        rows = self._read(
            lambda conn: conn.execute(
                "SELECT step, epoch, time, kind, level, message, data FROM events "
                "WHERE run = %s ORDER BY seq",
                (rid,),
            ).fetchall()
        )
        return [
            {"step": step, "epoch": epoch, "time": stamp, "kind": kind, "level": level,
             "message": message, "data": json.loads(data or "{}")}
            for step, epoch, stamp, kind, level, message, data in rows
        ]  # fmt: skip

    def delete_runs(self, runs: Sequence[int | str]) -> list[RunInfo]:
        """Delete runs and all they recorded, all or nothing: nothing is deleted if one is
        unknown or still running (its heartbeat fresh).

        Raises:
            KeyError: an unknown run. ValueError: a run that is still running.
        """
        targets = {info.id: info for info in (self.run(ref) for ref in runs)}
        if not targets:
            return []
        ids = sorted(targets)
        with self._lock:
            conn = self._conn if self._conn is not None and not self._conn.broken else None
            conn = conn or self._connect()
            with conn.transaction():
                rows = conn.execute(
                    f"SELECT {_RUN_COLUMNS} FROM runs r WHERE r.id = ANY(%s) FOR UPDATE", (ids,)
                ).fetchall()
                infos = map(self._info, rows)
                live = [f"{i.id} ({i.name})" for i in infos if i.status == "running"]
                if live:
                    raise ValueError(
                        f"run {', '.join(live)} is still running; stop it first (a run whose "
                        "writer stopped shows as crashed and can be deleted)"
                    )
                for table, column in (("points", "run"), ("rollups", "run"), ("series", "run"),
                                      ("events", "run"), ("runs", "id")):  # fmt: skip
                    conn.execute(f"DELETE FROM {table} WHERE {column} = ANY(%s)", (ids,))
        return [targets[rid] for rid in ids]
