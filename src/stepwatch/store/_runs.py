"""What the store knows of a run: ``RunInfo``, its effective status, and its training loss
summarised (``LossStats``) for the runs table. The SQL that reads them is the backend's."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from .._validation import check_choice, check_int
from ..monitor import values
from ._schema import STATUSES

__all__ = ["LossStats", "RunInfo", "effective_status"]

# A 'running' run whose heartbeat is older than this is shown as crashed (in a local store,
# where a dead process of this machine shows at once; a team store on a server uses its own,
# shorter staleness: stepwatch.store.backends.postgres_read.STALE_SECONDS).
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
    user: str = ""  # who ran it (recorded by a team store; '' in a local SQLite file)

    @property
    def duration(self) -> float:
        end = self.ended if self.ended is not None else self.heartbeat
        return max(0.0, end - self.started)


class LossStats(NamedTuple):
    """The training loss of one run, summarised: what ``stepwatch runs`` shows.

    Attributes:
        key: the store key summarised: ``loss`` (the epoch-mean training loss) when the run
            has one that is a number, else the per-step loss (``step_loss``, or ``loss`` in
            stores written before the epoch mean took that name; ``epoch_loss`` is their
            epoch mean).
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


_T = TypeVar("_T")


def keep_runs(
    items: list[_T], status: str | None, last: int | None, info: Callable[[_T], RunInfo]
) -> list[_T]:
    """The run filters SQL cannot apply: the effective status, then the newest ``last``."""
    if status is not None:
        items = [item for item in items if info(item).status == status]
    return items[-last:] if last is not None else items


def run_reference(run: Any) -> tuple[bool, int | str]:
    """``(by_id, value)`` for a run given by id (an int or a string of digits) or by name.

    Raises:
        TypeError: ``run`` is neither.
    """
    if isinstance(run, bool) or not isinstance(run, (int, str)):
        raise TypeError(f"'run' must be a run id or name, but got {run!r}.")
    by_id = isinstance(run, int) or run.isdigit()
    return by_id, int(run) if by_id else run


def run_filters(
    status: str | None,
    last: int | None,
    texts: Sequence[tuple[str, str, str | None]],
    *,
    mark: str,
    glob: Callable[[str, str], tuple[str, Any]],
    contains: Callable[[str], str],
) -> tuple[str, list[Any], str]:
    """``(where, params, limit)`` SQL for the run filters (on a table called ``runs``), in
    one backend's dialect.

    Args:
        status / last: the status and newest-``last`` filters (checked here).
        texts: ``(argname, column, text or None)`` for each text filter: the runs whose column
            contains the text, or matches it as a glob when it holds ``*``, ``?`` or ``[``.
        mark: the dialect's parameter mark (``?``, ``%s``).
        glob: ``(column, pattern) -> (condition, its parameter)``.
        contains: ``column -> condition`` with one parameter, the text.

    Raises:
        TypeError: a text filter that is not a str. ValueError: a bad status or ``last``.
    """
    if status is not None:
        check_choice("status", status, STATUSES)
    check_int("last", last, minimum=1, allow_none=True)
    where: list[str] = []
    params: list[Any] = []
    for argname, column, text in texts:
        if text is None:
            continue
        if not isinstance(text, str):
            raise TypeError(f"'{argname}' must be a str or None, but got {text!r}.")
        if any(c in text for c in "*?["):
            condition, param = glob(column, text)
        else:
            condition, param = contains(column), text
        where.append(condition)
        params.append(param)
    if status in ("running", "crashed"):
        # A crashed run is stored as 'running'; its effective status is decided in Python.
        where.append("runs.status IN ('running', 'crashed')")
    elif status is not None:
        where.append(f"runs.status = {mark}")
        params.append(status)
    # With a status filter, 'last' applies after the effective status is known.
    limit = f"LIMIT {int(last)}" if last is not None and status is None else ""
    return " AND ".join(where) or "1 = 1", params, limit
