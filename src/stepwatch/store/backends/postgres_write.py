"""The PostgreSQL store's writing side: every statement :class:`~stepwatch.store.RunWriter`
needs for one run, behind :class:`~stepwatch.store.base.WriteBackend`.

A batch is one transaction: the points (a binary ``COPY`` built with NumPy), their min/max
rollups and per-key series totals (computed here from the rows this transaction stores), the
events and the run's heartbeat. Writes are idempotent: points are keyed by ``(run, key,
step)`` and events by ``(run, seq)``. When a connection is lost mid-batch (the commit may or
may not have happened), the writer sends the batch again; that write inserts with ``ON
CONFLICT DO NOTHING`` and aggregates only the rows it actually stored, so nothing is stored or
counted twice. A point whose ``(run, key, step)`` is already stored is ignored: the store keeps
the first value of each step.

A server that cannot be reached raises :class:`~stepwatch.store.base.StoreUnreachable`: the
writer keeps the records (bounded, then drop-and-count) and the next tries back off from
0.25 s to 2 s. Nothing here blocks the training thread: all of it runs on the writer's.
"""

from __future__ import annotations

import getpass
import hashlib
import os
from collections.abc import Sequence
from typing import Any

from ..base import StoreUnreachable, WriteBackend, hide_password
from . import rollup
from .postgres_schema import Backoff, connect, ensure_schema, psycopg, scrub

__all__ = ["PostgresWriteBackend", "current_user"]

_COLUMNS = WriteBackend.COLUMNS
_COPY = "COPY points (run, key, step, epoch, time, value) FROM STDIN (FORMAT BINARY)"
_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_TRAILER = b"\xff\xff"


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return str(os.getuid()) if hasattr(os, "getuid") else ""


class PostgresWriteBackend(WriteBackend):
    """Writes runs into a PostgreSQL database (its tables are created when missing).

    Args:
        url: ``postgresql://user[:password]@host:port/database``; the password may instead come
            from ``PGPASSWORD`` or ``~/.pgpass``, as libpq reads them.
        wait: unused (a server store has no lock to wait for).
        argname: how errors name the URL (``db``; ``to`` for ``stepwatch push``).

    Raises:
        StoreUnreachable: the server cannot be reached now (the writer keeps trying).
        ValueError: the server refused the credentials or the database, or the store is of a
            newer schema version.
        ImportError: psycopg is not installed.
    """

    def __init__(self, url: str, wait: float | None = None, argname: str = "db") -> None:
        self._url = url
        self.location = hide_password(url)
        self._pg = psycopg()
        self._conn: Any = connect(url, argname)
        try:
            ensure_schema(self._conn, self.location)
        except BaseException:
            self._conn.close()
            raise
        self._backoff = Backoff()
        self._resend = False  # the last batch may have been committed: insert idempotently
        self._key_ids: dict[str, int] = {}
        self._seq: dict[int, int] = {}  # per run: the next event's number

    # -- the connection ---------------------------------------------------------------------
    def _connection(self) -> Any:
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if not self._backoff.ready():
            raise StoreUnreachable("the connection was lost; trying again shortly")
        try:
            self._conn = connect(self._url)
        except StoreUnreachable:
            self._backoff.failed()
            raise
        self._backoff.succeeded()
        return self._conn

    def _lost(self, exc: BaseException) -> StoreUnreachable:
        """The connection failed mid-call: drop it, back off, and resend idempotently."""
        self._resend = True
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # pragma: no cover - closing a dead connection
                pass
            self._conn = None
        self._backoff.failed()
        return StoreUnreachable(scrub(" ".join(str(exc).split()), self._url))

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(conn, *args)``, with a lost connection raised as StoreUnreachable."""
        conn = self._connection()
        try:
            return fn(conn, *args)
        except (self._pg.OperationalError, self._pg.InterfaceError) as exc:
            if conn.closed or conn.broken or isinstance(exc, self._pg.errors.AdminShutdown):
                raise self._lost(exc) from None
            raise

    # -- the interface ------------------------------------------------------------------------
    def create_run(self, name: str, config_json: str, host: str, pid: int, now: float) -> int:
        # The same writer's create sent again (after a lost reply) names the same origin, so
        # it returns the run it made: the origin is fixed by what the writer fixed once.
        made = f"{host}|{pid}|{now!r}|{name}|{config_json}".encode()
        origin = f"live/{hashlib.sha1(made).hexdigest()}"
        row = (name, now, host, current_user(), pid, config_json, now, origin)
        return int(self._call(_create_run, row, "running", False))

    def continue_run(self, run: int, host: str, pid: int, now: float) -> str:
        name, events = self._call(_continue_run, run, host, pid, now)
        self._seq[run] = events  # the events it holds are numbered 0 .. events - 1
        return str(name)

    def key_id(self, name: str) -> int:
        key_id = self._key_ids.get(name)
        if key_id is None:
            key_id = self._key_ids[name] = int(self._call(_key_id, name))
        return key_id

    def write(
        self, run: int, flat: list[Any], events: Sequence[tuple[Any, ...]], now: float
    ) -> None:
        seq = self._seq.get(run, 0)
        numbered = [(run, seq + i, *event) for i, event in enumerate(events)]
        self._call(self._write, run, flat, numbered, now)
        self._seq[run] = seq + len(numbered)
        self._resend = False

    def _write(self, conn: Any, run: int, flat: list[Any], events: list[Any], now: float) -> None:
        columns = _columns(flat)
        if not self._resend:
            try:
                with conn.transaction():
                    if columns is not None:
                        with conn.cursor().copy(_COPY) as copy:
                            copy.write(_copy_buffer(run, columns))
                        _aggregate(conn, run, columns)
                    _finish_batch(conn, run, events, now)
                return
            except self._pg.errors.UniqueViolation:
                pass  # a step already stored: this batch is inserted row by row below
        with conn.transaction():
            if columns is not None:
                stored = _insert_new(conn, run, columns)
                if stored is not None:
                    _aggregate(conn, run, stored)
            _finish_batch(conn, run, events, now)

    def finish(self, run: int, status: str, ended: float, dropped: int) -> None:
        self._call(_finish, run, status, ended, dropped)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- pushing a local run ----------------------------------------------------------------
    def push_run(
        self,
        info: Any,
        points: Sequence[tuple[str, int, int | None, float, float]],
        events: Sequence[dict[str, Any]],
        origin: str,
    ) -> tuple[int, int, int]:
        """Copy a run read from another store (its :class:`RunInfo`, points and events); a
        run pushed before (the same ``origin``) gets only what it lacks. Returns ``(run id,
        points added, events added)``."""
        import json

        conn = self._connection()
        config = json.dumps(info.config, sort_keys=True)
        row = (info.name, info.started, info.host, info.user, info.pid, config, info.heartbeat)
        with conn.transaction():
            run = int(_create_run(conn, (*row, origin), info.status, True))
            added = 0
            if points:
                flat: list[Any] = []
                for key, step, epoch, stamp, value in points:
                    flat += (self.key_id(key), step, epoch, stamp, value)
                columns = _columns(flat)
                assert columns is not None
                stored = _insert_new(conn, run, columns)
                if stored is not None:
                    added = len(stored[0])
                    _aggregate(conn, run, stored)
            rows = [
                (run, i, e["step"], e["epoch"], e["time"], e["kind"], e["level"], e["message"],
                 json.dumps(e["data"]))
                for i, e in enumerate(events)
            ]  # fmt: skip
            before = conn.execute("SELECT count(*) FROM events WHERE run = %s", (run,)).fetchone()
            _finish_batch(conn, run, rows, info.heartbeat, pushed=True)
            after = conn.execute("SELECT count(*) FROM events WHERE run = %s", (run,)).fetchone()
            conn.execute(
                "UPDATE runs SET status = %s, ended = %s, dropped = %s, heartbeat = %s, "
                "name = %s WHERE id = %s",
                (info.stored_status if info.stored_status != "running" else info.status,
                 info.ended, info.dropped, info.heartbeat, info.name, run),
            )  # fmt: skip
        return run, added, int(after[0] - before[0])


# -- the statements ---------------------------------------------------------------------------
def _create_run(conn: Any, row: tuple[Any, ...], status: str, pushed: bool) -> int:
    name = row[0]
    # A run made before (a push again, a retry after a lost answer) is found first: an
    # INSERT that only meets the conflict would still use up a run id.
    found = conn.execute("SELECT id FROM runs WHERE origin = %s", (row[-1],)).fetchone()
    if found is None:
        found = conn.execute(
            'INSERT INTO runs (name, started, host, "user", pid, config, heartbeat, origin, '
            "status, pushed) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (origin) DO UPDATE SET origin = excluded.origin RETURNING id",
            (*row, status, pushed),
        ).fetchone()
    run = int(found[0])
    if not name:  # (again after a retry: the first try may have been cut off before this)
        conn.execute("UPDATE runs SET name = %s WHERE id = %s AND name = ''", (f"run-{run}", run))
    return run


def _continue_run(conn: Any, run: int, host: str, pid: int, now: float) -> tuple[str, int]:
    with conn.transaction():
        found = conn.execute(
            "UPDATE runs SET status = 'running', ended = NULL, host = %s, pid = %s, "
            "heartbeat = %s, seen = clock_timestamp() WHERE id = %s RETURNING name",
            (host, pid, now, run),
        ).fetchone()
        if found is None:
            raise ValueError(f"the store has no run {run} to continue")
        seq = conn.execute(
            "SELECT coalesce(max(seq) + 1, 0) FROM events WHERE run = %s", (run,)
        ).fetchone()
    return str(found[0]), int(seq[0])


def _key_id(conn: Any, name: str) -> int:
    conn.execute("INSERT INTO keys (name) VALUES (%s) ON CONFLICT (name) DO NOTHING", (name,))
    return int(conn.execute("SELECT id FROM keys WHERE name = %s", (name,)).fetchone()[0])


def _finish(conn: Any, run: int, status: str, ended: float, dropped: int) -> None:
    conn.execute(
        "UPDATE runs SET status = %s, ended = %s, heartbeat = %s, seen = clock_timestamp(), "
        "dropped = %s WHERE id = %s",
        (status, ended, ended, dropped, run),
    )


def _finish_batch(
    conn: Any, run: int, events: Sequence[tuple[Any, ...]], now: float, pushed: bool = False
) -> None:
    """The batch's events (numbered: stored once) and the run's heartbeat."""
    if events:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO events (run, seq, step, epoch, time, kind, level, message, data) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                events,
            )
    if not pushed:
        conn.execute(
            "UPDATE runs SET heartbeat = %s, seen = clock_timestamp() WHERE id = %s", (now, run)
        )


Columns = tuple[Any, Any, Any, Any, Any]  # keys, steps, epochs (NaN: none), times, values


def _columns(flat: list[Any]) -> Columns | None:
    """The points in ``flat`` as NumPy columns (None for no points)."""
    if not flat:
        return None
    import numpy as np

    return (
        np.array(flat[0::_COLUMNS], dtype=np.int64),
        np.array(flat[1::_COLUMNS], dtype=np.int64),
        np.array(flat[2::_COLUMNS], dtype=np.float64),  # None (no epoch) becomes NaN
        np.array(flat[3::_COLUMNS], dtype=np.float64),
        np.array(flat[4::_COLUMNS], dtype=np.float64),  # None (not a number) becomes NaN
    )


def _copy_buffer(run: int, columns: Columns) -> bytes:
    """The binary COPY stream of the points: one fixed layout for rows with an epoch and one
    for rows without (a NULL field has length -1 and no data)."""
    import numpy as np

    keys, steps, epochs, times, values = columns
    has_epoch = ~np.isnan(epochs)
    parts = [_HEADER]
    for with_epoch in (True, False):
        mask = has_epoch if with_epoch else ~has_epoch
        count = int(mask.sum())
        if not count:
            continue
        fields: list[tuple[str, str]] = [("nf", ">i2"), ("l1", ">i4"), ("run", ">i8")]
        fields += [("l2", ">i4"), ("key", ">i4"), ("l3", ">i4"), ("step", ">i8"), ("l4", ">i4")]
        fields += [("epoch", ">i4")] if with_epoch else []
        fields += [("l5", ">i4"), ("time", ">f8"), ("l6", ">i4"), ("value", ">f8")]
        rows = np.empty(count, dtype=np.dtype(fields))
        rows["nf"], rows["l1"], rows["run"] = 6, 8, run
        rows["l2"], rows["l3"], rows["l5"], rows["l6"] = 4, 8, 8, 8
        rows["l4"] = 4 if with_epoch else -1
        if with_epoch:
            rows["epoch"] = epochs[mask]
        rows["key"], rows["step"] = keys[mask], steps[mask]
        rows["time"], rows["value"] = times[mask], values[mask]
        parts.append(rows.tobytes())
    parts.append(_TRAILER)
    return b"".join(parts)


def _insert_new(conn: Any, run: int, columns: Columns) -> Columns | None:
    """Insert the points that are not stored yet; the columns of those it stored."""
    import numpy as np

    keys, steps, epochs, times, values = columns
    epoch_list = [None if e != e else int(e) for e in epochs.tolist()]
    found = conn.execute(
        "INSERT INTO points (run, key, step, epoch, time, value) SELECT %s, * FROM unnest("
        "%s::integer[], %s::bigint[], %s::integer[], %s::float8[], %s::float8[]) "
        "ON CONFLICT DO NOTHING RETURNING key, step, epoch, value",
        (run, keys.tolist(), steps.tolist(), epoch_list, times.tolist(), values.tolist()),
    ).fetchall()
    if not found:
        return None
    k, s, e, v = zip(*found)
    floats = np.float64
    epoch_column = np.array([np.nan if x is None else x for x in e], dtype=floats)
    return (np.array(k, np.int64), np.array(s, np.int64), epoch_column, None, np.array(v, floats))


def _nulls(array: Any) -> list[Any]:
    """A float column as a list, NaN as None (NULL: the store's rollups hold no NaN)."""
    return [None if x != x else x for x in array.tolist()]


def _aggregate(conn: Any, run: int, columns: Columns) -> None:
    """Merge stored points into the run's rollups (the blocks of :mod:`.rollup`) and its
    per-key series, and raise the run's step count: in the points' transaction."""
    import numpy as np

    keys, steps, epochs, _, values = columns
    keys, steps, values, epochs = rollup.sort_points(keys, steps, values, epochs)
    rollups: list[list[Any]] = [[] for _ in range(10)]
    for width, (key, bucket, n, min_step, vmin, max_step, vmax, nan_step) in rollup.blocks(
        keys, steps, values
    ):
        for column, part in zip(rollups, (
            [run] * len(key), key.tolist(), [width] * len(key), bucket.tolist(), n.tolist(),
            rollup.steps_of(min_step), _nulls(vmin), rollup.steps_of(max_step), _nulls(vmax),
            rollup.steps_of(nan_step),
        )):  # fmt: skip
            column.extend(part)
    conn.execute(_ROLLUP_SQL, rollups)
    # Per key: count, extremes, the last point, and whether each epoch holds one point.
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    ends = np.append(starts[1:], len(keys)) - 1
    finite_min = np.where(values > -1e308, values, np.nan)  # no NaN, no -inf
    with np.errstate(invalid="ignore"):
        per_epoch = [
            bool(not np.isnan(epochs[a : b + 1]).any())
            and len(np.unique(epochs[a : b + 1])) == b - a + 1
            for a, b in zip(starts.tolist(), ends.tolist())
        ]
        lo_epoch = np.fmin.reduceat(epochs, starts)
        hi_epoch = np.fmax.reduceat(epochs, starts)
    series = (
        [run] * len(starts), keys[starts].tolist(), (ends - starts + 1).tolist(),
        _nulls(np.fmin.reduceat(values, starts)), _nulls(np.fmax.reduceat(values, starts)),
        _nulls(np.fmin.reduceat(finite_min, starts)), steps[ends].tolist(),
        _nulls(values[ends]), _ints(lo_epoch), _ints(hi_epoch), per_epoch,
    )  # fmt: skip
    conn.execute(_SERIES_SQL, series)
    conn.execute(
        "UPDATE runs SET steps = GREATEST(steps, %s) WHERE id = %s", (int(steps.max()), run)
    )


def _ints(array: Any) -> list[int | None]:
    return [None if x != x else int(x) for x in array.tolist()]


_MIN_WINS = (
    "excluded.min_value IS NOT NULL AND (r.min_value IS NULL OR excluded.min_value < "
    "r.min_value OR (excluded.min_value = r.min_value AND excluded.min_step < r.min_step))"
)
_MAX_WINS = (
    "excluded.max_value IS NOT NULL AND (r.max_value IS NULL OR excluded.max_value > "
    "r.max_value OR (excluded.max_value = r.max_value AND excluded.max_step < r.max_step))"
)
_ROLLUP_SQL = f"""
INSERT INTO rollups AS r (run, key, width, bucket, n, min_step, min_value, max_step, max_value,
    nan_step)
SELECT * FROM unnest(%s::bigint[], %s::integer[], %s::integer[], %s::bigint[], %s::bigint[],
    %s::bigint[], %s::float8[], %s::bigint[], %s::float8[], %s::bigint[])
ON CONFLICT (run, key, width, bucket) DO UPDATE SET
    n = r.n + excluded.n,
    min_step = CASE WHEN {_MIN_WINS} THEN excluded.min_step ELSE r.min_step END,
    min_value = CASE WHEN {_MIN_WINS} THEN excluded.min_value ELSE r.min_value END,
    max_step = CASE WHEN {_MAX_WINS} THEN excluded.max_step ELSE r.max_step END,
    max_value = CASE WHEN {_MAX_WINS} THEN excluded.max_value ELSE r.max_value END,
    nan_step = LEAST(r.nan_step, excluded.nan_step)
"""
_SERIES_SQL = """
INSERT INTO series AS s (run, key, n, vmin, vmax, lmin, last_step, last_value, min_epoch,
    max_epoch, per_epoch)
SELECT * FROM unnest(%s::bigint[], %s::integer[], %s::bigint[], %s::float8[], %s::float8[],
    %s::float8[], %s::bigint[], %s::float8[], %s::integer[], %s::integer[], %s::boolean[])
ON CONFLICT (run, key) DO UPDATE SET
    n = s.n + excluded.n,
    vmin = LEAST(s.vmin, excluded.vmin),
    vmax = GREATEST(s.vmax, excluded.vmax),
    lmin = LEAST(s.lmin, excluded.lmin),
    last_value = CASE WHEN excluded.last_step > s.last_step THEN excluded.last_value
        ELSE s.last_value END,
    last_step = GREATEST(s.last_step, excluded.last_step),
    min_epoch = LEAST(s.min_epoch, excluded.min_epoch),
    max_epoch = GREATEST(s.max_epoch, excluded.max_epoch),
    per_epoch = s.per_epoch AND excluded.per_epoch
        AND COALESCE(excluded.min_epoch > s.max_epoch, false)
"""
