"""``RunWriter``: one run's points and events, written to the store on a background thread.

The writer is the queue policy; what writes is the store's backend
(:class:`~stepwatch.store.base.WriteBackend`; SQLite for a file), which holds every SQL
statement.

The training thread only appends to an in-memory queue (a ``collections.deque``: an append
takes well under a microsecond and no lock). One writer thread drains the queue in batches,
inside one transaction per batch, at least every ``flush_seconds``.

Rows are built in bulk, so the writer holds the interpreter lock as little as it can while
training runs: a ``log_batch`` stays arrays (steps as a ``range``, values as a tensor or array)
until the writer zips its columns, in C, straight into the one ``executemany`` of the flush;
points queued one by one with ``log`` are transposed with ``zip(*points)``.

Full-queue policy: when ``max_pending`` items wait, ``log`` waits up to ``block_seconds`` for
the writer to catch up; if it does not, the record is dropped and counted, and further records
are dropped at once until the queue is half empty again. A failing disk (an SQLite error on
write) is logged once as a warning and its records are counted as dropped; nothing is raised
into the training thread. ``close()`` writes everything still queued and the run's final
status.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._validation import check_int, check_number
from ._records import (
    _FLOAT,
    _INT,
    _INT_OR_NONE,
    _NUMBERS,
    _check_step,
    _column,
    _int_or_none,
    _json,
    _json_default,
    _number,
)
from ._records import Batch as _Batch
from ._records import Event as _Event
from ._schema import STATUSES, spool_path
from .base import (
    StoreBusy,
    StoreUnreachable,
    Where,
    WriteBackend,
    open_write_backend,
    parse_location,
)

if TYPE_CHECKING:
    import numpy as np

    from .notify import Notifier
    from .system import SystemSampler

__all__ = ["RunWriter"]

logger = logging.getLogger("stepwatch")

_OPEN_WRITERS: weakref.WeakSet[RunWriter] = weakref.WeakSet()


@atexit.register
def _close_open_writers() -> None:  # pragma: no cover - runs at interpreter exit
    # A run still open at exit was never ended; an uncaught error on the way out (the
    # interpreter keeps it as sys.last_value) means the run failed, not that it finished.
    failed = getattr(sys, "last_value", None) is not None
    for writer in list(_OPEN_WRITERS):
        writer.close("failed" if failed else "finished")


class RunWriter:
    """Create a run in the store and write its points and events without blocking training.

    A team store that cannot be reached as the run starts does not lose the run: it is
    recorded into a local file instead (``$STEPWATCH_SPOOL``, default
    ``./stepwatch-spool.db``), named in one warning with the ``stepwatch push`` line that
    uploads it when the server is back (offline first); :attr:`spool` is that file.

    Args:
        db: the store's location: a database file (default ``$STEPWATCH_DB`` or
            ``./stepwatch.db``) or a store URL (``sqlite:///runs.db``,
            ``postgresql://user@host:5432/runs``).
        name: the run's name (default ``run-<id>``).
        config: a JSON-serialisable dict stored with the run.
        flush_seconds: the longest a record waits before it is written (default 1 s).
        max_pending: queued items before the full-queue policy applies.
        block_seconds: how long ``log`` may wait for room before dropping.
        continue_run: the id of a stored run to continue (marked ``running`` again, its
            points and events kept; ``name`` and ``config`` are then not used) instead of
            creating one: a job started again by torchrun goes on recording its run.

    Attributes:
        run_id: the run's id in the store.
        dropped: records dropped (full queue or failing disk).
        written: points written.
        spool: the local file the run went to, its team store away at the start (or None).

    Raises:
        TypeError / ValueError: bad arguments; a config that is not JSON-serialisable.
        sqlite3.Error: the database cannot be opened or created at all (before training).
        ValueError: ``db`` names a kind of store this version cannot open.
    """

    def __init__(
        self,
        db: Where = None,
        name: str | None = None,
        config: dict[str, Any] | None = None,
        flush_seconds: float = 1.0,
        max_pending: int = 100_000,
        block_seconds: float = 0.5,
        continue_run: int | None = None,
    ) -> None:
        where = parse_location(db)  # once: every later open takes the parsed location
        self.path = where.target  # the file, for a local store
        config_json = run_config(name, config)
        self.flush_seconds = flush_period(flush_seconds)
        self.max_pending = check_int("max_pending", max_pending, minimum=1)
        self.block_seconds = check_number("block_seconds", block_seconds, minimum=0.0) or 0.0

        self.location = where.shown
        self._where = where
        self._create = (name or "", config_json, socket.gethostname(), os.getpid(), time.time())
        if continue_run is not None:
            check_int("continue_run", continue_run, minimum=1)
        self._continue = continue_run
        self._backend: WriteBackend | None = None
        self.run_id: int | None = None
        self.name = name or ""
        self.spool: Path | None = None
        self._unreachable = False  # a server store that cannot be reached now
        self._reached = False  # the store was reached once (a connection was made)
        try:
            self._open(_START_WAIT)
        except StoreBusy as exc:
            if isinstance(exc, StoreUnreachable) and not self._reached:
                self._spool(exc)  # the server is away: the run goes to a local file
            else:
                # Another process holds the store, or the server went away while the run was
                # being made: training goes on; the writer thread creates the run when the
                # store is free, and the records wait for it in the queue.
                self._unreachable = isinstance(exc, StoreUnreachable)
                logger.warning(
                    "stepwatch store: %s %s; training goes on and the run is recorded once "
                    "it is free",
                    self.location,
                    _why(exc),
                )
        self.dropped = 0
        self.written = 0
        self._pending: collections.deque[Any] = collections.deque()
        self._dropping = False
        self._key_ids: dict[str, int] = {}
        self._disk_error: str | None = None
        self._closed = False
        self._closing = False
        self._wake = threading.Event()
        self._busy = False
        self._busy_since: float | None = None  # when another process locked the store
        self._give_up = False
        # Set by RunRecorder: the system sampler (every few seconds, on this writer's thread)
        # and the webhook that alerts and the run's end are posted to.
        self.system: SystemSampler | None = None
        self.notifier: Notifier | None = None
        self.last_step = 0  # the latest step handed over, where system samples are put
        self._sampled = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="stepwatch-writer", daemon=True)
        self._thread.start()
        _OPEN_WRITERS.add(self)

    def _open(self, wait: float) -> None:
        """Open the backend and create the run; StoreBusy while another process holds it."""
        backend = open_write_backend(self._where, wait=wait)
        self._reached = True
        try:
            if self._continue is not None:
                _, _, host, pid, now = self._create
                self.name = backend.continue_run(self._continue, host, pid, now)
                self.run_id = self._continue
            else:
                self.run_id = backend.create_run(*self._create)
        except BaseException:
            backend.close()
            raise
        self._backend = backend
        self.name = self.name or f"run-{self.run_id}"

    def _spool(self, away: StoreUnreachable) -> None:
        """The team store cannot be reached as the run starts: record the run into the local
        spool file instead, and say once where it is and how to upload it. If that file
        cannot be written either, wait for the server (records past ``max_pending`` are
        dropped and counted)."""
        team, team_where, spool = self.location, self._where, spool_path()
        self._where = parse_location(spool)
        try:
            self._open(_START_WAIT)
        except Exception as exc:
            self._where, self._unreachable = team_where, True
            logger.warning(
                "stepwatch store: %s %s, and the local file %s cannot take the run either "
                "(%s); training goes on, the run is recorded once the server is back",
                team,
                _why(away),
                spool,
                exc,
            )
            return
        self.spool, self.location, self.path = spool, str(spool), spool
        logger.warning(
            "stepwatch store: %s %s; run %s is recorded into the local file %s instead "
            "(nothing is lost): when the server is back, upload it with "
            "`stepwatch push --db %s --to %s`",
            team,
            _why(away),
            self.run_id,
            spool,
            spool,
            team,
        )

    # -- training-thread side ---------------------------------------------------------------
    def _room(self) -> bool:
        """Apply the full-queue policy; True if the record may be queued."""
        pending = self._pending
        if self._unreachable:  # never wait on a server that is away: drop and count
            self._dropping = True
        if self._dropping:
            if len(pending) > self.max_pending // 2:
                return False
            self._dropping = False
            return True
        deadline = time.monotonic() + self.block_seconds
        self._wake.set()
        while len(pending) >= self.max_pending:
            if time.monotonic() >= deadline:
                self._dropping = True
                logger.warning(
                    "stepwatch store: the writer is behind (%d records queued); dropping records "
                    "until it catches up",
                    len(pending),
                )
                return False
            time.sleep(0.001)
        return True

    def log(self, key: str, value: Any, step: int, epoch: int | None = None) -> None:
        """Queue one point. ``value`` is a number or a one-element tensor (read later, on the
        writer thread)."""
        if type(key) is not str or not key:  # cheap checks: this runs for every point
            raise TypeError(f"'key' must be a non-empty str such as 'loss', but got {key!r}.")
        if type(step) is not int or step < 0:
            _check_step(step)
        if type(value) not in _NUMBERS and not hasattr(value, "item"):
            raise TypeError(
                f"'value' of {key!r} must be a number or a one-element tensor, but got "
                f"{value!r} with type '{type(value).__name__}'."
            )
        if self._closed or (len(self._pending) >= self.max_pending and not self._room()):
            self.dropped += 1
            return
        self._pending.append((key, step, epoch, time.time(), value))

    def log_batch(
        self,
        key: str,
        steps: range | Sequence[int] | np.ndarray,
        values: Any,
        epoch: int | None = None,
        times: Sequence[float] | np.ndarray | None = None,
        ready: Any = None,
        span: tuple[float, float] | None = None,
    ) -> None:
        """Queue many points of one key.

        Args:
            key: the metric's name.
            steps: the points' steps: a ``range`` for consecutive steps (the cheapest), or a
                sequence or 1-D array of ints.
            values: a 1-D tensor or array of one value per step, which may still be on its way
                to the host (see ``ready``); read on the writer thread.
            epoch: the epoch of every point.
            times: the points' wall times; without them the times are spread evenly over
                ``span``, or are all now.
            ready: a CUDA event the writer waits for before it reads ``values``.
            span: ``(start, end)`` wall times: the i-th of n points gets
                ``start + (end - start) * (i + 1) / n``.
        """
        n = len(steps)
        if self._closed or (len(self._pending) >= self.max_pending and not self._room()):
            self.dropped += n
            return
        import numpy as np  # here, not at the top: writing single points never needs it

        if not isinstance(steps, range):
            steps = np.array(steps, dtype=np.int64).reshape(-1)  # a copy: the caller may reuse it
        if n:
            self.last_step = int(steps[-1])
        if times is not None:
            times = np.array(times, dtype=np.float64)
        if span is None:
            now = time.time()
            span = (now, now)
        self._pending.append(_Batch(key, steps, values, epoch, times, span, ready))

    def event(
        self,
        kind: str,
        message: str,
        step: int | None = None,
        epoch: int | None = None,
        level: str = "info",
        data: dict[str, Any] | None = None,
    ) -> None:
        """Queue an event (an alert, a note, a checkpoint saved, ...); an alert also goes to
        the webhook, when there is one."""
        if self._closed:
            self.dropped += 1
            return
        self._pending.append(_Event(kind, message, step, epoch, level, data))
        if kind == "alert" and self.notifier is not None:
            self.notifier.alert(message, step, epoch, data)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        deadline = time.monotonic() + timeout
        while (self._pending or self._busy) and self._thread.is_alive():
            if time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.005)
        return True

    def close(self, status: str = "finished", timeout: float = 60.0) -> None:
        """Write everything queued, record ``status`` and stop the writer thread.

        Safe to call twice; the second call does nothing.
        """
        if status not in STATUSES:
            raise ValueError(f"'status' must be one of {STATUSES}, but got {status!r}.")
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        started = time.monotonic()
        deadline = started + timeout
        away = deadline
        while self._thread.is_alive() and time.monotonic() < min(deadline, away):
            self._thread.join(0.1)
            if not self._unreachable:
                away = deadline
            elif away == deadline:  # a server that is away gets a shorter wait
                away = time.monotonic() + _UNREACHABLE_CLOSE_WAIT
        if self._thread.is_alive():  # the store stayed locked: what still waits is lost
            waited = time.monotonic() - started  # a server that is away is waited for less
            self._give_up = True
            self._thread.join(5.0)
            lost = sum(len(i) if isinstance(i, _Batch) else 1 for i in list(self._pending))
            self._pending.clear()
            why = "away" if self._unreachable else "locked"
            # Counted, not said here: the run is ending, and _finish says so in one line.
            self.dropped += lost
            self._disk_error = self._disk_error or f"StoreBusy: still {why} after {waited:.0f} s"
        self._closed = True
        _OPEN_WRITERS.discard(self)
        try:
            self._finish(status)
        finally:
            self._close_extras(status)  # after the status is stored: a webhook may be slow

    def _finish(self, status: str) -> None:
        """Record ``status`` and close the backend (the writer thread has stopped)."""
        backend = self._backend
        if backend is None or self.run_id is None:  # the store stayed locked from the start
            logger.warning(
                "stepwatch store: %s stayed %s; this run was not recorded (%d records dropped)",
                self.location,
                "unreachable" if self._unreachable else "locked by another process",
                self.dropped,
            )
            return
        try:
            backend.finish(self.run_id, status, time.time(), self.dropped)
        except Exception as exc:  # a failing disk or server must not reach training
            self._report_disk_error(exc, 0)
        finally:
            backend.close()
        if self.dropped:
            logger.warning(
                "stepwatch store: run %s dropped %d records (%s)",
                self.run_id,
                self.dropped,
                self._disk_error or "the writer could not keep up",
            )

    def _close_extras(self, status: str) -> None:
        """The run's end reaches the webhook; the system sampler lets its libraries go."""
        if self.system is not None:
            self.system.close()
        if self.notifier is not None:
            self.notifier.finish(status, self.run_id, self.last_step or None)

    @property
    def closed(self) -> bool:
        return self._closed

    def _sample_system(self, now: float) -> None:
        """Queue a system sample when one is due (writer thread)."""
        sampler = self.system
        if sampler is None or now - self._sampled < sampler.every or self.run_id is None:
            return
        self._sampled = now
        wall, step = time.time(), self.last_step
        for key, value in sampler.sample().items():
            self._pending.append((key, step, None, wall, value))

    # -- writer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        last = time.monotonic()
        tick = min(self.flush_seconds, 0.25)
        # Write early once this much waits, so the queue never fills while the writer idles.
        early = max(1, min(4096, self.max_pending // 2))
        while True:
            woken = True
            if len(self._pending) < early and not self._closing:
                woken = self._wake.wait(tick)  # set by a full queue, flush() or close()
            self._wake.clear()
            now = time.monotonic()
            closing = self._closing
            if self._backend is None:
                try:
                    self._open(_OPEN_WAIT)  # the store was locked at the start: try again
                except StoreBusy as exc:
                    self._unreachable = isinstance(exc, StoreUnreachable)
                    if self._give_up:
                        break
                    self._wake.wait(1.0)
                    continue
                except Exception as exc:  # the store cannot be opened at all
                    self._report_disk_error(exc, 0)
                    break
                self._unreachable = False
                logger.info("stepwatch store: %s is free; run %s is recorded", self.location,
                            self.run_id)  # fmt: skip
            self._sample_system(now)
            if closing or woken or now - last >= self.flush_seconds:
                self._write_pending()
                last = now
            if (closing and not self._pending) or self._give_up:
                break
            if self._busy_since is not None and not closing:
                self._wake.wait(min(1.0, self.flush_seconds))  # not every tick while locked

    def _key_id(self, name: str) -> int:
        key_id = self._key_ids.get(name)
        if key_id is None:
            assert self._backend is not None  # written only once the store is open
            key_id = self._key_ids[name] = self._backend.key_id(name)
        return key_id

    def _write_pending(self) -> None:
        self._busy = True
        try:
            self._write_some()
        finally:
            self._busy = False

    def _write_some(self) -> None:
        pending = self._pending
        popleft = pending.popleft
        items = [popleft() for _ in range(min(len(pending), 50_000))]
        run = self.run_id
        try:
            singles = [item for item in items if type(item) is tuple]
            batches: list[_Batch] = []
            events: list[_Event] = []
            if len(singles) < len(items):
                batches = [item for item in items if type(item) is _Batch]
                events = [item for item in items if type(item) is _Event]
            # Rows are assembled column by column, in C; the device copies are waited for
            # here, before the transaction takes the database's write lock.
            parts: list[Iterable[tuple[Any, ...]]] = []
            count = 0
            if singles:
                parts.append(self._single_rows(singles))
                count += len(singles)
            for batch in batches:
                n, rows = batch.rows(self._key_id(batch.key))
                parts.append(rows)
                count += n
            event_rows = [
                (e.step, e.epoch, e.time, e.kind, e.level, e.message, _json(e.data)) for e in events
            ]
            flat = list(chain.from_iterable(chain.from_iterable(parts)))  # one list, built in C
            assert self._backend is not None and run is not None
            self._backend.write(run, flat, event_rows, time.time())
            self.written += count
            self._unreachable = False
            if self._busy_since is not None:
                logger.info("stepwatch store: %s is free again; the waiting records are written",
                            self.location)  # fmt: skip
                self._busy_since = None
        except StoreBusy as exc:
            # Another process holds the store (or its server is away): keep everything, in
            # order, and try again (the backend's writes are idempotent, so a batch whose
            # commit was lost with the connection is not stored twice). The full-queue policy
            # bounds what waits; close() gives up after its timeout.
            pending.extendleft(reversed(items))
            self._unreachable = isinstance(exc, StoreUnreachable)
            if self._busy_since is None:
                self._busy_since = time.monotonic()
                logger.warning(
                    "stepwatch store: %s %s; %d records wait and are written when it is free "
                    "(training goes on; past %d waiting, records are dropped and counted)",
                    self.location,
                    _why(exc),
                    len(pending),
                    self.max_pending,
                )
        except Exception as exc:  # a failing disk must not reach training
            lost = sum(len(i) if isinstance(i, _Batch) else 1 for i in items)
            self._report_disk_error(exc, lost)

    def _single_rows(self, singles: list[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        """Rows for points queued one by one with :meth:`log`, transposed in C."""
        key_ids = self._key_ids
        keys, steps, epochs, stamps, values = zip(*singles)
        for name in set(keys).difference(key_ids):
            self._key_id(name)
        return zip(
            map(key_ids.__getitem__, keys),
            _column(steps, _INT, int),
            _column(epochs, _INT_OR_NONE, _int_or_none),
            stamps,
            _column(values, _FLOAT, _number),
        )

    def _report_disk_error(self, exc: BaseException, lost: int) -> None:
        self.dropped += lost
        if self._disk_error is None:
            self._disk_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "stepwatch store: writing to %s failed (%s); records are being dropped and "
                "counted, training continues",
                self.location,
                self._disk_error,
            )


# How long the writer waits for a locked store when it is made (then training goes on and the
# writer thread keeps trying), and per later try.
_START_WAIT = 3.0
_OPEN_WAIT = 1.0
# How long close() waits for a server that cannot be reached before it counts what still
# waits as dropped.
_UNREACHABLE_CLOSE_WAIT = 5.0


def run_config(name: Any, config: Any, argname: str = "name", strict: bool = False) -> str:
    """Check a run's name (named ``argname``) and config; the config as stored (JSON).
    ``strict``: a value JSON cannot hold is refused (a user's hyperparameters, checked by
    ``RunRecorder``), else stored as its text (tensors and arrays as numbers).

    Raises:
        TypeError: a name that is not a str, a config that is not a JSON-serialisable dict.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"'{argname}' must be a str or None, but got {type(name).__name__}.")
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"'config' must be a dict or None, but got {type(config).__name__}.")
    try:
        return json.dumps(config or {}, sort_keys=True, default=None if strict else _json_default)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"'config' must be JSON-serialisable: {exc}") from exc


def flush_period(seconds: Any) -> float:
    """``flush_seconds`` checked: the longest a record waits before it is written (0: 1 s)."""
    return check_number("flush_seconds", seconds, minimum=0.0) or 1.0


def _why(exc: StoreBusy) -> str:
    """'is locked by another process', or for a server: 'cannot be reached (<reason>)'."""
    if isinstance(exc, StoreUnreachable):
        return f"{exc.reason} ({exc})"
    return exc.reason
