"""What the store knows of a run: ``RunInfo``, its effective status, and the SQL that
summarises its training loss (``LossStats``) for the runs table."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..monitor import values

__all__ = ["LossStats", "RunInfo", "effective_status"]

# A 'running' run whose heartbeat is older than this is shown as crashed.
STALE_SECONDS = 300.0

# The loss keys, newest naming first. ``loss`` is the epoch-mean training loss and
# ``step_loss`` the per-step loss; stores written before that naming kept the epoch mean as
# ``epoch_loss`` and the per-step loss as ``loss``.
LOSS = values.LOSS
STEP_LOSS = values.STEP_LOSS
LEGACY_EPOCH_LOSS = "epoch_loss"


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


class RunInfo(NamedTuple):
    """One run, as the store knows it; ``status`` shows a dead ``running`` run as crashed.

    (A named tuple, not a dataclass: the CLI's read commands start faster without importing
    ``dataclasses``.)
    """

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
    config: dict[str, Any]
    steps: int = 0

    @property
    def duration(self) -> float:
        end = self.ended if self.ended is not None else self.heartbeat
        return max(0.0, end - self.started)


class LossStats(NamedTuple):
    """The training loss of one run, summarised: what ``stepwatch runs`` shows.

    Attributes:
        key: the store key summarised: ``loss`` (the epoch-mean training loss) when the run
            has one, else the per-step loss (``step_loss``, or ``loss`` in stores written
            before the epoch mean took that name; ``epoch_loss`` is their epoch mean).
        epoch_mean: True when ``key`` holds one mean per epoch, False for per-step losses.
        last: the value at the highest step. min: the smallest value (NaN if none is a number).
        count: points recorded. last_step: the highest step.
    """

    key: str
    epoch_mean: bool
    last: float
    min: float
    count: int  # type: ignore[assignment]  # the field, not tuple.count
    last_step: int


def effective_status(status: str, host: str, pid: int, heartbeat: float) -> str:
    if status != "running":
        return status
    import socket  # only for live-looking runs: the CLI starts faster without it

    stale = time.time() - heartbeat > STALE_SECONDS
    if host == socket.gethostname():
        return "crashed" if stale or not _pid_alive(pid) else "running"
    return "crashed" if stale else "running"


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


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
_LOSS_SQL = f"""
WITH ids AS (SELECT
    (SELECT id FROM keys WHERE name = '{LOSS}') AS loss,
    (SELECT id FROM keys WHERE name = '{STEP_LOSS}') AS step_loss,
    (SELECT id FROM keys WHERE name = '{LEGACY_EPOCH_LOSS}') AS legacy),
r AS (SELECT runs.*, ids.step_loss AS step_loss_key, CASE
        WHEN EXISTS (SELECT 1 FROM points WHERE run = runs.id AND key = ids.legacy)
            THEN ids.legacy
        WHEN EXISTS (SELECT 1 FROM points WHERE run = runs.id AND key = ids.loss) THEN ids.loss
        ELSE ids.step_loss END AS lk
    FROM runs, ids WHERE {{where}} ORDER BY runs.id DESC {{limit}})
SELECT {_RUN_COLUMNS},
    (SELECT name FROM keys WHERE id = r.lk),
    (SELECT COUNT(*) FROM points WHERE run = r.id AND key = r.lk),
    (SELECT COUNT(DISTINCT epoch) FROM points WHERE run = r.id AND key = r.lk),
    (SELECT MIN(value) FROM points WHERE run = r.id AND key = r.lk),
    (SELECT value FROM points WHERE run = r.id AND key = r.lk ORDER BY step DESC, rowid DESC
        LIMIT 1),
    (SELECT MAX(step) FROM points WHERE run = r.id AND key = r.lk),
    EXISTS (SELECT 1 FROM points WHERE run = r.id AND key = r.step_loss_key)
FROM r ORDER BY r.id
"""


def _loss_stats(row: Sequence[Any]) -> LossStats | None:
    key, count, epochs, vmin, last, last_step, has_step_loss = row
    if not key or not count:
        return None
    if key == LEGACY_EPOCH_LOSS:
        epoch_mean = True
    elif key == LOSS:
        epoch_mean = bool(has_step_loss) or count <= epochs
    else:
        epoch_mean = False
    return LossStats(key, epoch_mean, _nan(last), _nan(vmin), int(count), int(last_step))
