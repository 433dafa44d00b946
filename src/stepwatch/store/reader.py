"""Reading runs back: :class:`Store`, the one SQL reader of every kind of store, the run
records (:class:`RunInfo`, :class:`LossStats`) and :func:`delete_runs`.

The reader's queries are written once; what differs between databases (how a query runs, the
parameter marks, a few pieces of SQL) is the backend's :class:`~stepwatch.store.base.ReadDialect`
(:mod:`~stepwatch.store.backends.sqlite_read`, :mod:`~stepwatch.store.backends.postgres_read`).

Nothing here imports PyTorch, and NumPy is loaded only by :meth:`Store.metrics`: the CLI's
read commands and a dashboard start in a fraction of a second.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._validation import check_int
from ._runs import (
    LossStats,
    RunInfo,
    _loss_stats,
    _nan,
    effective_status,
    keep_runs,
    run_filters,
    run_reference,
)
from .backends import rollup
from .base import ReadDialect, open_read_dialect, parse_location

if TYPE_CHECKING:
    import numpy as np

__all__ = ["LossStats", "RunInfo", "Store", "delete_runs", "effective_status"]

_RUN_WIDTH = 13  # the columns of ReadDialect.run_columns


class Store:
    """Read access to a run store: runs, metrics and events, never changing the store (but
    for :meth:`delete_runs`).

    ``Store(location)`` opens the store a location names: a file path (or ``sqlite:///...``)
    for a local SQLite file, ``postgresql://...`` for a team store on a server.

    A local file is never created or changed by opening it. A writable database is opened
    read-write with ``PRAGMA query_only`` (writes are refused), so that SQLite removes the
    ``-wal``/``-shm`` files it needs on close, as it does for its writers: reading leaves no
    files behind. A file you cannot write is opened with ``mode=ro`` (``immutable`` when no
    ``-wal`` file shows a writer). A team store is read over one connection, opened again on
    the next call after a server restart.

    A run being recorded is read live: every call sees the data committed so far.

    Threads: one ``Store`` may be shared by several threads. Each call holds the store's lock
    while it runs and reads from one snapshot (one read transaction), so calls from different
    threads take turns and a call never mixes two states of a live database. For reads that
    run in parallel, open one ``Store`` per thread.

    Args:
        path: the store's location (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).

    Raises:
        FileNotFoundError: no store at ``path`` (nothing is created).
        ValueError: not a stepwatch store, a location of an unknown kind, or a server that
            refused the credentials.
        ConnectionError: a server that cannot be reached.

    Example:
        >>> store = Store("stepwatch.db")
        >>> run = store.runs()[-1]
        >>> steps, losses = store.metrics(run.id, "step_loss", max_points=500)
        >>> new_steps, new_losses = store.metrics(run.id, "step_loss", after=steps[-1])
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._sql: ReadDialect = open_read_dialect(parse_location(path, "path"))
        self.location = self._sql.location  # how messages name the store

    def close(self) -> None:
        self._sql.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *err: Any) -> None:
        self.close()

    # -- runs -------------------------------------------------------------------------------
    def _info(self, row: Sequence[Any]) -> RunInfo:
        rid, name, status, started, ended, host, pid, config, heartbeat, dropped = row[:10]
        steps, user, age = row[10:_RUN_WIDTH]
        try:
            cfg = json.loads(config)
        except ValueError:
            cfg = {}
        return RunInfo(
            id=int(rid),
            name=name,
            status=self._sql.status(status, host, pid, heartbeat, age),
            stored_status=status,
            started=started,
            ended=ended,
            host=host,
            pid=pid,
            heartbeat=heartbeat,
            dropped=int(dropped),
            config=cfg if isinstance(cfg, dict) else {},
            steps=int(steps or 0),
            user=user or "",
        )

    def _filters(
        self,
        name: str | None,
        status: str | None,
        last: int | None,
        host: str | None,
        user: str | None,
    ) -> tuple[str, list[Any], str]:
        """``(where, params, limit)`` SQL for the run filters (on a table called ``runs``)."""
        texts = [("name", "name", name), ("host", "host", host)]
        if self._sql.users:
            texts.append(("user", '"user"', user))
        elif user is not None:
            raise ValueError(
                f"'user' {user!r}: a local store records no users (a team store on "
                "PostgreSQL does); filter by name or host instead."
            )
        return run_filters(
            status, last, texts, mark="?", glob=self._sql.glob, contains=self._sql.contains
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
        sql = (
            f"SELECT {self._sql.run_columns} FROM (SELECT * FROM runs WHERE {where} "
            f"ORDER BY id DESC {limit}) r ORDER BY r.id"
        )
        rows = self._sql.read(lambda q: q.execute(sql, params).fetchall())
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
        sql = self._sql.loss_sql.format(where=where, limit=limit)
        rows = self._sql.read(lambda q: q.execute(sql, params).fetchall())
        pairs = [(self._info(row), _loss_stats(row[_RUN_WIDTH:])) for row in rows]
        return keep_runs(pairs, status, last, lambda pair: pair[0])

    def loss_stats(self, run: int | str) -> LossStats | None:
        """The run's training loss summarised as in :meth:`runs_summary` (None if it has none).

        Raises:
            KeyError: no such run.
        """
        sql = self._sql.loss_sql.format(where="runs.id = ?", limit="")

        def read(q: Any) -> Any:
            return q.execute(sql, (self._run(q, run).id,)).fetchone()

        return _loss_stats(self._sql.read(read)[_RUN_WIDTH:])

    def run(self, run: int | str) -> RunInfo:
        """A run by id (an int or a string of digits) or by name (the newest with that name).

        Raises:
            KeyError: no such run.
        """
        return self._sql.read(lambda q: self._run(q, run))

    def _run(self, q: Any, run: int | str) -> RunInfo:
        by_id, arg = run_reference(run)
        where = "r.id = ?" if by_id else "r.name = ? ORDER BY r.id DESC LIMIT 1"
        row = q.execute(f"SELECT {self._sql.run_columns} FROM runs r WHERE {where}", (arg,))
        found = row.fetchone()
        if found is None:
            raise KeyError(f"no run {run!r} in {self.location!r}")
        return self._info(found)

    # -- metrics ----------------------------------------------------------------------------
    def keys(self, run: int | str) -> list[str]:
        """The metric names recorded for ``run``."""

        def read(q: Any) -> list[str]:
            rows = q.execute(self._sql.keys_sql, (self._run(q, run).id,)).fetchall()
            return [r[0] for r in rows]

        return self._sql.read(read)

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
        tie = f", {self._sql.tie}" if self._sql.tie else ""
        everything = (
            f"SELECT step, {self._sql.value.format('value')} FROM points WHERE {where} "
            f"ORDER BY step{tie}"
        )

        def read(q: Any) -> list[Any]:
            rid = self._run(q, run).id
            found = q.execute(self._sql.key_sql, (key, rid)).fetchone()
            if found is None:
                raise KeyError(f"run {rid} has no metric {key!r}; see Store.keys({rid})")
            args = (rid, found[0], *params)
            if max_points is not None:
                # Counted only up to max_points + 1: a long range is never scanned to decide.
                (count,) = q.execute(
                    f"SELECT COUNT(*) FROM (SELECT 1 FROM points WHERE {where} LIMIT ?) c",
                    (*args, max_points + 1),
                ).fetchone()
                if count > max_points:
                    return self._downsample(q, where, args, max_points)
            return list(q.execute(everything, args).fetchall())

        rows = self._sql.read(read)
        steps = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        values = np.fromiter((_nan(r[1]) for r in rows), dtype=np.float64, count=len(rows))
        return steps, values

    def _downsample(
        self, q: Any, where: str, args: tuple[Any, ...], max_points: int
    ) -> list[tuple[Any, ...]]:
        """Min/max (and first NaN) per bucket: whole rollup blocks of the coarsest width that
        fits a bucket and the raw points of the partial blocks at the two edges, when the run
        has rollups and a bucket holds a block; else from every point (:meth:`_buckets`)."""
        # Two single MIN/MAX queries: each is one index seek.
        lo, hi = q.execute(
            f"SELECT (SELECT MIN(step) FROM points WHERE {where}), "
            f"(SELECT MAX(step) FROM points WHERE {where})",
            args * 2,
        ).fetchone()
        run, key = args[0], args[1]
        align = rollup.pick_width(self._sql.widths(q, run), lo, hi, max_points)
        if align is None:
            return self._buckets(q, where, args, max_points, lo, hi)
        value = self._sql.value.format("value")
        return rollup.merge_downsample(
            lambda first, last: q.execute(
                "SELECT bucket * ?, min_step, min_value, max_step, max_value, nan_step "
                "FROM rollups WHERE run = ? AND key = ? AND width = ? "
                "AND bucket BETWEEN ? AND ?",
                (align, run, key, align, first, last),
            ).fetchall(),
            lambda a, b: q.execute(
                f"SELECT step, {value} FROM points WHERE run = ? AND key = ? "
                "AND step BETWEEN ? AND ?",
                (run, key, a, b),
            ),
            align,
            lo,
            hi,
            max_points,
        )

    def _buckets(
        self,
        q: Any,
        where: str,
        args: tuple[Any, ...],
        max_points: int,
        lo: int,
        hi: int,
        align: int = 1,
    ) -> list[tuple[Any, ...]]:
        """The min/max rows of each bucket of :func:`~.backends.rollup.bounds` read from the
        points (the exact path): one small index-range query per bucket, which reads each point
        once and needs no sort of the whole range (a GROUP BY over a long run is several times
        slower)."""
        edges = rollup.bounds(lo, hi, max_points, align)
        nan = self._sql.nan
        in_bucket = f"{where} AND step BETWEEN ? AND ?"
        # The smallest and the largest number of the bucket, each at its smallest step.
        sql = (
            f"SELECT * FROM (SELECT step, value FROM points WHERE {in_bucket} AND NOT ({nan}) "
            "ORDER BY value, step LIMIT 1) a UNION ALL "
            f"SELECT * FROM (SELECT step, value FROM points WHERE {in_bucket} AND NOT ({nan}) "
            "ORDER BY value DESC, step LIMIT 1) b"
        )
        rows: set[tuple[Any, ...]] = set()
        pairs = list(itertools.pairwise(edges))
        for first, stop in pairs:
            bucket = (first, stop - 1)
            rows.update(map(tuple, q.execute(sql, (*args, *bucket, *args, *bucket)).fetchall()))
        if q.execute(f"SELECT 1 FROM points WHERE {where} AND ({nan}) LIMIT 1", args).fetchone():
            first_nan = f"SELECT MIN(step) FROM points WHERE {in_bucket} AND ({nan})"
            for first, stop in pairs:
                (step,) = q.execute(first_nan, (*args, first, stop - 1)).fetchone()
                if step is not None:
                    rows.add((step, None))
        return rollup.by_step(rows)

    def summary(self, run: int | str) -> dict[str, dict[str, float]]:
        """Per metric: ``last``, ``min``, ``max``, ``count`` and the ``last_step``."""
        rows = self._sql.read(
            lambda q: q.execute(self._sql.summary_sql, (self._run(q, run).id,)).fetchall()
        )
        return {
            name: {
                "last": _nan(last),
                "min": _nan(vmin),
                "max": _nan(vmax),
                "count": int(count),
                "last_step": last_step,
            }
            for name, count, vmin, vmax, last_step, last in rows
        }

    def points(self, run: int | str) -> list[tuple[str, int, int | None, float, float]]:
        """Every point of a run as ``(key, step, epoch, time, value)``, ordered by key, step."""
        tie = f", p.{self._sql.tie}" if self._sql.tie else ""
        sql = (
            f"SELECT k.name, p.step, p.epoch, p.time, {self._sql.value.format('p.value')} "
            f"FROM points p JOIN keys k ON k.id = p.key WHERE p.run = ? "
            f"ORDER BY k.name, p.step{tie}"
        )
        rows = self._sql.read(lambda q: q.execute(sql, (self._run(q, run).id,)).fetchall())
        return [(k, s, e, t, _nan(v)) for k, s, e, t, v in rows]

    # -- events -----------------------------------------------------------------------------
    def events(self, run: int | str) -> list[dict[str, Any]]:
        """The run's events (alerts, notes, checkpoints, stop reasons), oldest first."""
        sql = (
            "SELECT step, epoch, time, kind, level, message, data FROM events WHERE run = ? "
            f"ORDER BY {self._sql.event_order}"
        )
        rows = self._sql.read(lambda q: q.execute(sql, (self._run(q, run).id,)).fetchall())
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
        is unknown or still running (its process alive, or on a server its writer still
        writing), nothing is deleted. A file does not shrink (SQLite reuses the space for new
        runs).

        Raises:
            KeyError: an unknown run. ValueError: a run that is still running.
            sqlite3.Error: the database cannot be written.
        """
        if not runs:
            return []

        def delete(q: Any) -> list[RunInfo]:
            # Found and checked inside the write transaction: a run cannot start or end unseen.
            ids = sorted({self._run(q, ref).id for ref in runs})
            marks = ", ".join("?" * len(ids))
            rows = q.execute(
                f"SELECT {self._sql.run_columns} FROM runs r WHERE r.id IN ({marks}) "
                f"ORDER BY r.id{self._sql.lock_rows}",
                ids,
            ).fetchall()
            infos = [self._info(row) for row in rows]
            live = [f"{i.id} ({i.name})" for i in infos if i.status == "running"]
            if live:
                raise ValueError(
                    f"run {', '.join(live)} is still running; stop it first (a run whose "
                    "writer is gone shows as crashed and can be deleted)"
                )
            for table, column in self._sql.run_tables(q):
                q.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", ids)
            return infos

        return self._sql.write(delete)


def delete_runs(path: str | os.PathLike[str] | None, runs: Sequence[int | str]) -> list[RunInfo]:
    """Delete runs (their points, rollups, events and run rows) from the store at ``path``.

    All or nothing: if any run is unknown or still running (its process alive), nothing is
    deleted. A file store does not shrink (SQLite reuses the space for new runs).

    Args:
        path: the store's location (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).
        runs: run ids or names.

    Returns:
        The runs deleted.

    Raises:
        KeyError: an unknown run. ValueError: a run that is still running.
        FileNotFoundError / sqlite3.Error: the database cannot be opened or written.
    """
    with Store(path) as store:
        return store.delete_runs(runs)
