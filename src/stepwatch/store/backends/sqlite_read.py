"""The SQLite store's reader (:class:`SQLiteStore`, what ``Store(path)`` returns for a file):
runs, metrics and events, and deleting runs.

Nothing here imports PyTorch, and NumPy is loaded only by :meth:`SQLiteStore.metrics`: the
CLI's read commands and a dashboard start in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..._validation import check_int
from ...monitor import values
from .._runs import (
    LEGACY_EPOCH_LOSS,
    LossStats,
    RunInfo,
    _loss_stats,
    _nan,
    effective_status,
    keep_runs,
    run_filters,
    run_reference,
)
from ..base import Store, parse_location
from . import sqlite_rollup as _rollup
from .sqlite_schema import BUSY_TIMEOUT_MS, connect_for_reading, sqlite_uri

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SQLiteStore"]

# Columns of a run; ``steps`` is the largest step of any key, found with one index lookup per
# key rather than a scan of the run's points.
_RUN_COLUMNS = (
    "r.id, r.name, r.status, r.started, r.ended, r.host, r.pid, r.config, r.heartbeat, "
    "r.dropped, (SELECT MAX((SELECT MAX(p.step) FROM points p WHERE p.run = r.id "
    "AND p.key = k.id)) FROM keys k)"
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


class SQLiteStore(Store):
    """Read access to a stepwatch SQLite database (``Store(path)`` for a file).

    Opening a store never creates the file and never changes it. A writable database is
    opened read-write with ``PRAGMA query_only`` (writes are refused), so that SQLite removes
    the ``-wal``/``-shm`` files it needs on close, as it does for its writers: reading leaves
    no files behind. A file you cannot write is opened with ``mode=ro`` (``immutable`` when no
    ``-wal`` file shows a writer). A run being recorded is read live: every call sees the
    data committed so far.

    Threads: one ``Store`` may be shared by several threads. Each call holds the store's lock
    while it runs and reads from one snapshot (one read transaction), so calls from different
    threads take turns and a call never mixes two states of a live database. For reads that
    run in parallel, open one ``Store`` per thread.

    Args:
        path: the database file, or ``sqlite:///path`` (default ``$STEPWATCH_DB`` or
            ``./stepwatch.db``).

    Raises:
        FileNotFoundError: no file at ``path`` (nothing is created).
        ValueError: the file is not a stepwatch database.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        location = parse_location(path, "path")
        self.path = location.target
        self.location = location.shown
        self._conn = connect_for_reading(self.path)
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """The connection, locked, inside one read transaction (nested calls share it)."""
        with self._lock:
            conn = self._conn
            if conn.in_transaction:
                yield conn
                return
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")

    # -- runs -------------------------------------------------------------------------------
    def _info(self, row: Sequence[Any]) -> RunInfo:
        rid, name, status, started, ended, host, pid, config, heartbeat, dropped, steps = row
        try:
            cfg = json.loads(config)
        except ValueError:
            cfg = {}
        return RunInfo(
            id=rid,
            name=name,
            status=effective_status(status, host, pid, heartbeat),
            stored_status=status,
            started=started,
            ended=ended,
            host=host,
            pid=pid,
            heartbeat=heartbeat,
            dropped=dropped,
            config=cfg if isinstance(cfg, dict) else {},
            steps=int(steps or 0),
        )

    def _filters(
        self,
        name: str | None,
        status: str | None,
        last: int | None,
        host: str | None = None,
        user: str | None = None,
    ) -> tuple[str, list[Any], str]:
        """``(where, params, limit)`` SQL for the run filters (on a table called ``runs``)."""
        if user is not None:
            raise ValueError(f"'user' {user!r}: a local store records no users (a team store on "
                             "PostgreSQL does); filter by name or host instead.")  # fmt: skip
        return run_filters(
            status,
            last,
            (("name", "name", name), ("host", "host", host)),
            mark="?",
            glob=lambda column, pattern: (f"runs.{column} GLOB ?", pattern),
            contains=lambda column: f"instr(runs.{column}, ?) > 0",
        )

    def runs(
        self,
        name: str | None = None,
        status: str | None = None,
        last: int | None = None,
        host: str | None = None,
        user: str | None = None,
    ) -> list[RunInfo]:
        """The runs, oldest first, optionally filtered.

        Args:
            name: keep runs whose name contains this text, or matches it as a glob pattern
                when it holds ``*``, ``?`` or ``[`` (case-sensitive; ``'lr=*'``).
            status: keep runs with this status (``running``, ``finished``, ``failed``,
                ``interrupted``, ``crashed``; a dead ``running`` run counts as crashed).
            last: keep only the newest ``last`` runs (after the other filters).
            host: keep runs recorded on a host whose name contains this text (or matches it as
                a glob). user: a team store's filter by who ran it (a local file records no
                users: ValueError).
        """
        where, params, limit = self._filters(name, status, last, host, user)
        with self._snapshot() as conn:
            rows = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM (SELECT * FROM runs WHERE {where} "
                f"ORDER BY id DESC {limit}) r ORDER BY r.id",
                params,
            ).fetchall()
        return keep_runs([self._info(row) for row in rows], status, last, lambda r: r)

    def runs_summary(
        self,
        name: str | None = None,
        status: str | None = None,
        last: int | None = None,
        host: str | None = None,
        user: str | None = None,
    ) -> list[tuple[RunInfo, LossStats | None]]:
        """Each run (filtered as in :meth:`runs`) with its training loss summarised, in one
        query: ``[(run, LossStats or None), ...]``, oldest first. See :class:`LossStats` for
        which loss key a run is summarised by."""
        where, params, limit = self._filters(name, status, last, host, user)
        sql = _LOSS_SQL.format(where=where, limit=limit)
        with self._snapshot() as conn:
            rows = conn.execute(sql, params).fetchall()
        pairs = [(self._info(row[:11]), _loss_stats(row[11:])) for row in rows]
        return keep_runs(pairs, status, last, lambda pair: pair[0])

    def loss_stats(self, run: int | str) -> LossStats | None:
        """The run's training loss summarised as in :meth:`runs_summary` (None if it has none).

        Raises:
            KeyError: no such run.
        """
        with self._snapshot() as conn:
            rid = self.run(run).id
            row = conn.execute(_LOSS_SQL.format(where="runs.id = ?", limit=""), (rid,)).fetchone()
        return _loss_stats(row[11:])

    def run(self, run: int | str) -> RunInfo:
        """A run by id (an int or a string of digits) or by name (the newest with that name).

        Raises:
            KeyError: no such run.
        """
        by_id, arg = run_reference(run)
        where = "r.id = ?" if by_id else "r.name = ? ORDER BY r.id DESC"
        with self._snapshot() as conn:
            row = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs r WHERE {where}", (arg,)
            ).fetchone()
        if row is None:
            raise KeyError(f"no run {run!r} in {str(self.path)!r}")
        return self._info(row)

    # -- metrics ----------------------------------------------------------------------------
    def keys(self, run: int | str) -> list[str]:
        """The metric names recorded for ``run``."""
        with self._snapshot() as conn:
            rid = self.run(run).id
            rows = conn.execute(
                "SELECT k.name FROM keys k WHERE EXISTS "
                "(SELECT 1 FROM points p WHERE p.run = ? AND p.key = k.id) ORDER BY k.name",
                (rid,),
            ).fetchall()
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
        """``(steps, values)`` of one metric as NumPy arrays, ordered by step.

        Args:
            run: run id or name.
            key: the metric's store key (see :meth:`keys`).
            max_points: downsample to about this many points: the selected step range is cut
                into ``max_points // 2`` buckets and each bucket keeps its minimum and its
                maximum, so a one-step spike survives any downsampling (a bucket holding NaNs
                keeps one NaN too). A run written with min/max rollups (every run this version
                writes) is read from them, not point by point: the bucket edges then move up to
                the next multiple of the rollup block (64 steps or more).
            start, end: only steps with ``start <= step <= end`` (either may be None).
            after: only steps ``> after``. To follow a live run, pass the last step you
                have: ``metrics(run, key, after=steps[-1])`` returns just the new points
                (empty arrays when there are none yet).

        Raises:
            KeyError: no such run, or the run never recorded ``key``.
        """
        import numpy as np

        check_int("max_points", max_points, minimum=2, allow_none=True)
        check_int("start", start, allow_none=True)
        check_int("end", end, allow_none=True)
        check_int("after", after, allow_none=True)
        if not isinstance(key, str):
            raise TypeError(f"'key' must be a str, but got {key!r}.")
        where, params = "run = ? AND key = ?", []
        for op, bound in ((">=", start), ("<=", end), (">", after)):
            if bound is not None:
                where += f" AND step {op} ?"
                params.append(bound)
        with self._snapshot() as conn:
            rid = self.run(run).id
            key_row = conn.execute("SELECT id FROM keys WHERE name = ?", (key,)).fetchone()
            args = (rid, -1 if key_row is None else key_row[0], *params)
            everything = f"SELECT step, value FROM points WHERE {where} ORDER BY step, rowid"
            if max_points is None:
                rows = conn.execute(everything, args).fetchall()
            else:
                # Counted only up to max_points + 1: a long range is never scanned to decide.
                (count,) = conn.execute(
                    f"SELECT COUNT(*) FROM (SELECT 1 FROM points WHERE {where} LIMIT ?)",
                    (*args, max_points + 1),
                ).fetchone()
                if count <= max_points:
                    rows = conn.execute(everything, args).fetchall()
                else:
                    rows = self._downsample(conn, where, args, max_points)
            if not rows and (
                key_row is None
                or conn.execute(
                    "SELECT 1 FROM points WHERE run = ? AND key = ? LIMIT 1", args[:2]
                ).fetchone()
                is None
            ):
                raise KeyError(f"run {rid} has no metric {key!r}; see Store.keys({rid})")
        steps = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        values = np.fromiter((_nan(r[1]) for r in rows), dtype=np.float64, count=len(rows))
        return steps, values

    @classmethod
    def _downsample(
        cls, conn: sqlite3.Connection, where: str, args: tuple[Any, ...], max_points: int
    ) -> list[Any]:
        """Min/max per bucket: from the run's rollups when it has them and a bucket holds at
        least one rollup block, else from every point (:meth:`_buckets`)."""
        # Two single MIN/MAX queries: each is one index seek (together, one scan).
        lo, hi = conn.execute(
            f"SELECT (SELECT MIN(step) FROM points WHERE {where}), "
            f"(SELECT MAX(step) FROM points WHERE {where})",
            args * 2,
        ).fetchone()
        width = _rollup.pick_width(_rollup.widths_of(conn, args[0]), lo, hi, max_points)
        if width is None:
            return cls._buckets(conn, where, args, max_points, lo, hi)
        return _rollup.downsample(conn, args[0], args[1], width, lo, hi, max_points)

    @staticmethod
    def _buckets(
        conn: sqlite3.Connection,
        where: str,
        args: tuple[Any, ...],
        max_points: int,
        lo: int,
        hi: int,
        align: int = 1,
    ) -> list[Any]:
        """The min/max rows of each bucket of ``_rollup.bounds`` read from the points: one
        small index-range query per bucket, which reads each point once and needs no temporary
        B-tree (a GROUP BY over the whole range is several times slower on a long run)."""
        edges = _rollup.bounds(lo, hi, max_points, align)
        # Numbered parameters, so that the range condition can appear twice.
        parts = where.split("?")
        numbered = "".join(f"{part}?{i + 1}" for i, part in enumerate(parts[:-1])) + parts[-1]
        n = len(args)
        in_bucket = f"{numbered} AND step BETWEEN ?{n + 1} AND ?{n + 2} AND value IS NOT NULL"
        # SQLite returns the row holding the MIN/MAX for the bare 'step' column (the first
        # such row in (step, rowid) order: the smaller step wins a tie).
        sql = (
            f"SELECT step, MIN(value) FROM points WHERE {in_bucket} "
            f"UNION ALL SELECT step, MAX(value) FROM points WHERE {in_bucket}"
        )
        rows: set[tuple[Any, ...]] = set()
        for first, stop in itertools.pairwise(edges):
            found = conn.execute(sql, (*args, first, stop - 1)).fetchall()
            rows.update(r for r in found if r[0] is not None)
        if conn.execute(
            f"SELECT 1 FROM points WHERE {where} AND value IS NULL LIMIT 1", args
        ).fetchone():
            # The bucket of a step: how many inner edges its block start has reached.
            base = lo // align * align
            width = (hi - lo) // max(1, max_points // 2) + 1
            block = f"((step - {int(base)}) / {int(align)} * {int(align)} + {int(base - lo)})"
            rows.update(
                conn.execute(
                    f"SELECT MIN(step), NULL FROM points WHERE {where} AND value IS NULL "
                    f"GROUP BY {block} / {int(width)}",
                    args,
                ).fetchall()
            )
        return sorted(rows, key=lambda r: (r[0], r[1] is not None, r[1] or 0.0))

    def summary(self, run: int | str) -> dict[str, dict[str, float]]:
        """Per metric: ``last``, ``min``, ``max``, ``count`` and the ``last_step``."""
        with self._snapshot() as conn:
            rid = self.run(run).id
            rows = conn.execute(
                "SELECT k.name, COUNT(*), MIN(p.value), MAX(p.value), MAX(p.step), "
                "(SELECT q.value FROM points q WHERE q.run = p.run AND q.key = p.key "
                "ORDER BY q.step DESC, q.rowid DESC LIMIT 1) "
                "FROM points p JOIN keys k ON k.id = p.key WHERE p.run = ? GROUP BY p.key "
                "ORDER BY k.name",
                (rid,),
            ).fetchall()
        return {
            name: {
                "last": _nan(last),
                "min": _nan(vmin),
                "max": _nan(vmax),
                "count": count,
                "last_step": last_step,
            }
            for name, count, vmin, vmax, last_step, last in rows
        }

    def points(self, run: int | str) -> list[tuple[str, int, int | None, float, float]]:
        """Every point of a run as ``(key, step, epoch, time, value)``, ordered by key, step."""
        with self._snapshot() as conn:
            rid = self.run(run).id
            rows = conn.execute(
                "SELECT k.name, p.step, p.epoch, p.time, p.value FROM points p "
                "JOIN keys k ON k.id = p.key WHERE p.run = ? ORDER BY k.name, p.step, p.rowid",
                (rid,),
            ).fetchall()
        return [(k, s, e, t, _nan(v)) for k, s, e, t, v in rows]

    # -- events -----------------------------------------------------------------------------
    def events(self, run: int | str) -> list[dict[str, Any]]:
        """The run's events (alerts, notes, checkpoints, stop reasons), oldest first."""
        with self._snapshot() as conn:
            rid = self.run(run).id
            rows = conn.execute(
                "SELECT step, epoch, time, kind, level, message, data FROM events WHERE run = ? "
                "ORDER BY id",
                (rid,),
            ).fetchall()
        return [
            {
                "step": step,
                "epoch": epoch,
                "time": stamp,
                "kind": kind,
                "level": level,
                "message": message,
                "data": json.loads(data or "{}"),
            }
            for step, epoch, stamp, kind, level, message, data in rows
        ]

    def delete_runs(self, runs: Sequence[int | str]) -> list[RunInfo]:
        """Delete runs (their points, rollups, events and run rows), all or nothing: if any run
        is unknown or still running (its process alive), nothing is deleted. The file does not
        shrink (SQLite reuses the space for new runs).

        Raises:
            KeyError: an unknown run. ValueError: a run that is still running.
            sqlite3.Error: the database cannot be written.
        """
        targets = {info.id: info for info in (self.run(ref) for ref in runs)}
        db_path = self.path
        if not targets:
            return []
        conn = sqlite3.connect(
            sqlite_uri(db_path, "rw"),
            uri=True,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            conn.execute("BEGIN IMMEDIATE")
            try:
                ids = sorted(targets)
                marks = ", ".join("?" * len(ids))
                # Checked again inside the write transaction: a run cannot start or end unseen.
                rows = conn.execute(
                    "SELECT id, name, status, host, pid, heartbeat FROM runs "
                    f"WHERE id IN ({marks})",
                    ids,
                ).fetchall()
                live = [
                    f"{rid} ({name})"
                    for rid, name, status, host, pid, heartbeat in rows
                    if effective_status(status, host, pid, heartbeat) == "running"
                ]
                if live:
                    raise ValueError(
                        f"run {', '.join(live)} is still running; stop it first (a run whose "
                        "process is gone shows as crashed and can be deleted)"
                    )
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
                for table, column in (
                    ("points", "run"),
                    ("rollups", "run"),  # absent in a file written before rollups
                    ("rollup_runs", "run"),
                    ("events", "run"),
                    ("runs", "id"),
                ):
                    if table in tables:
                        conn.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", ids)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        finally:
            conn.close()
        return [targets[rid] for rid in sorted(targets)]
