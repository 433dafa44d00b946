"""``Store``: read runs, metrics and events back from the database (read-only)."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._validation import check_int
from ._schema import connect_for_reading, resolve_path

__all__ = ["RunInfo", "Store"]

# A 'running' run whose heartbeat is older than this is shown as crashed.
STALE_SECONDS = 300.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone
    except OSError:
        return True


@dataclass
class RunInfo:
    """One run, as the store knows it; ``status`` shows a dead ``running`` run as crashed."""

    id: int
    name: str
    status: str
    stored_status: str
    started: float
    ended: float | None
    host: str
    pid: int
    heartbeat: float
    dropped: int
    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 0

    @property
    def duration(self) -> float:
        end = self.ended if self.ended is not None else self.heartbeat
        return max(0.0, end - self.started)


def effective_status(status: str, host: str, pid: int, heartbeat: float) -> str:
    if status != "running":
        return status
    stale = time.time() - heartbeat > STALE_SECONDS
    if host == socket.gethostname():
        return "crashed" if stale or not _pid_alive(pid) else "running"
    return "crashed" if stale else "running"


class Store:
    """Read access to a stepwatch database.

    Args:
        path: the database file (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).

    Raises:
        FileNotFoundError: no file at ``path`` (nothing is created).
        ValueError: the file is not a stepwatch database.

    Example:
        >>> store = Store("stepwatch.db")
        >>> run = store.runs()[-1]
        >>> steps, losses = store.metrics(run.id, "loss", max_points=500)
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = resolve_path(path)
        self._conn = connect_for_reading(self.path)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *err: Any) -> None:
        self.close()

    # -- runs -------------------------------------------------------------------------------
    def _info(self, row: tuple[Any, ...]) -> RunInfo:
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
            config=cfg,
            steps=int(steps or 0),
        )

    _RUN_COLUMNS = (
        "r.id, r.name, r.status, r.started, r.ended, r.host, r.pid, r.config, r.heartbeat, "
        "r.dropped, (SELECT MAX(step) FROM points p WHERE p.run = r.id)"
    )

    def runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        rows = self._conn.execute(f"SELECT {self._RUN_COLUMNS} FROM runs r ORDER BY r.id")
        return [self._info(row) for row in rows]

    def run(self, run: int | str) -> RunInfo:
        """A run by id (an int or a string of digits) or by name (the newest with that name).

        Raises:
            KeyError: no such run.
        """
        if isinstance(run, bool) or not isinstance(run, (int, str)):
            raise TypeError(f"'run' must be a run id or name, but got {run!r}.")
        if isinstance(run, int) or run.isdigit():
            row = self._conn.execute(
                f"SELECT {self._RUN_COLUMNS} FROM runs r WHERE r.id = ?", (int(run),)
            ).fetchone()
        else:
            row = self._conn.execute(
                f"SELECT {self._RUN_COLUMNS} FROM runs r WHERE r.name = ? ORDER BY r.id DESC",
                (run,),
            ).fetchone()
        if row is None:
            raise KeyError(f"no run {run!r} in {str(self.path)!r}")
        return self._info(row)

    # -- metrics ----------------------------------------------------------------------------
    def keys(self, run: int | str) -> list[str]:
        """The metric names recorded for ``run``."""
        rid = self.run(run).id
        rows = self._conn.execute(
            "SELECT k.name FROM keys k WHERE EXISTS "
            "(SELECT 1 FROM points p WHERE p.run = ? AND p.key = k.id) ORDER BY k.name",
            (rid,),
        )
        return [r[0] for r in rows]

    def _key_id(self, key: str) -> int | None:
        row = self._conn.execute("SELECT id FROM keys WHERE name = ?", (key,)).fetchone()
        return None if row is None else int(row[0])

    def metrics(
        self, run: int | str, key: str, max_points: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one metric as NumPy arrays, ordered by step.

        With ``max_points``, the step range is cut into ``max_points // 2`` buckets and each
        bucket keeps its minimum and its maximum, so a one-step spike survives any
        downsampling (a bucket holding NaNs keeps one NaN too).

        Raises:
            KeyError: no such run or key.
        """
        rid = self.run(run).id
        check_int("max_points", max_points, minimum=2, allow_none=True)
        key_id = self._key_id(key)
        if key_id is None:
            raise KeyError(f"run {rid} has no metric {key!r}; see Store.keys({rid})")
        where = "run = ? AND key = ?"
        count, lo, hi = self._conn.execute(
            f"SELECT COUNT(*), MIN(step), MAX(step) FROM points WHERE {where}", (rid, key_id)
        ).fetchone()
        if count == 0:
            raise KeyError(f"run {rid} has no metric {key!r}; see Store.keys({rid})")
        if max_points is None or count <= max_points:
            rows = self._conn.execute(
                f"SELECT step, value FROM points WHERE {where} ORDER BY step, rowid", (rid, key_id)
            ).fetchall()
        else:
            buckets = max(1, max_points // 2)
            width = (hi - lo) // buckets + 1
            bucket = f"(step - {int(lo)}) / {int(width)}"
            # SQLite returns the row holding the MIN/MAX for the bare 'step' column.
            rows = self._conn.execute(
                f"SELECT step, MIN(value) FROM points WHERE {where} AND value IS NOT NULL "
                f"GROUP BY {bucket} "
                f"UNION SELECT step, MAX(value) FROM points WHERE {where} AND value IS NOT NULL "
                f"GROUP BY {bucket} "
                f"UNION SELECT MIN(step), NULL FROM points WHERE {where} AND value IS NULL "
                f"GROUP BY {bucket} ORDER BY 1",
                (rid, key_id, rid, key_id, rid, key_id),
            ).fetchall()
        steps = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        values = np.fromiter(
            (math.nan if r[1] is None else r[1] for r in rows), dtype=np.float64, count=len(rows)
        )
        return steps, values

    def summary(self, run: int | str) -> dict[str, dict[str, float]]:
        """Per metric: ``last``, ``min``, ``max``, ``count`` and the ``last_step``."""
        rid = self.run(run).id
        rows = self._conn.execute(
            "SELECT k.name, COUNT(*), MIN(p.value), MAX(p.value), MAX(p.step) "
            "FROM points p JOIN keys k ON k.id = p.key WHERE p.run = ? GROUP BY k.name "
            "ORDER BY k.name",
            (rid,),
        ).fetchall()
        result: dict[str, dict[str, float]] = {}
        for name, count, vmin, vmax, last_step in rows:
            last = self._conn.execute(
                "SELECT value FROM points WHERE run = ? AND key = (SELECT id FROM keys WHERE "
                "name = ?) ORDER BY step DESC, rowid DESC LIMIT 1",
                (rid, name),
            ).fetchone()[0]
            result[name] = {
                "last": math.nan if last is None else last,
                "min": math.nan if vmin is None else vmin,
                "max": math.nan if vmax is None else vmax,
                "count": count,
                "last_step": last_step,
            }
        return result

    def points(self, run: int | str) -> list[tuple[str, int, int | None, float, float]]:
        """Every point of a run as ``(key, step, epoch, time, value)``, ordered by key, step."""
        rid = self.run(run).id
        rows = self._conn.execute(
            "SELECT k.name, p.step, p.epoch, p.time, p.value FROM points p "
            "JOIN keys k ON k.id = p.key WHERE p.run = ? ORDER BY k.name, p.step, p.rowid",
            (rid,),
        ).fetchall()
        return [(k, s, e, t, math.nan if v is None else v) for k, s, e, t, v in rows]

    # -- events -----------------------------------------------------------------------------
    def events(self, run: int | str) -> list[dict[str, Any]]:
        """The run's events (alerts, notes, checkpoints, stop reasons), oldest first."""
        rid = self.run(run).id
        rows = self._conn.execute(
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
