"""Tell a rank whose process stopped running from one that is only slow, while the others wait
for it in a collective; and end the whole job when asked to.

Every rank runs a :class:`RankWatch`: a background thread that publishes a heartbeat and the
rank's last finished step through the job's key-value store
(:func:`stepwatch.distributed.side_channel`, never a collective), and watches the other ranks'
heartbeats. A rank whose heartbeat stands still for ``frozen_seconds`` is reported (SIGSTOP, a
frozen machine, a swap storm): a collective it blocks would only time out much later (30
minutes by default).

:func:`end_job` is what a rank does when the job must end because a peer is frozen: the
training thread is blocked in that collective and cannot be interrupted from Python, so the
process leaves with :func:`os._exit` after flushing what it has to say; torchrun then tears the
job down. A frozen peer on the same machine is killed first (SIGKILL: a stopped process does
not act on torchrun's SIGTERM, which it would otherwise wait 30 s on).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .job import env_int, process_started

__all__ = ["ABORT_EXIT_CODE", "Peer", "RankWatch", "end_job", "this_rank"]

logger = logging.getLogger("stepwatch")

# The exit status of a process that ended its job because a peer was frozen.
ABORT_EXIT_CODE = 3

_HEARTBEAT = "stepwatch/heartbeat/{}"
_PEER = "stepwatch/rank/{}"


@dataclass(frozen=True)
class Peer:
    """Where a rank runs: its machine, its node rank under torchrun (``GROUP_RANK``), its
    index there, its process id and that process's start time (to make sure a process id
    still names it)."""

    rank: int
    host: str
    node: int
    local_rank: int
    pid: int
    started: int | None

    def describe(self) -> str:
        """``'rank 3 (host gpu-7, node 1)'``."""
        return f"rank {self.rank} (host {self.host}, node {self.node})"


def _state(pid: int) -> str:
    """The process's state letter from ``/proc`` ('T' stopped, 'R' running, ...), or ''."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def this_rank(rank: int) -> Peer:
    """This process as a :class:`Peer` (node and local rank as torchrun sets them)."""
    pid = os.getpid()
    return Peer(
        rank,
        socket.gethostname(),
        env_int("GROUP_RANK", 0),
        env_int("LOCAL_RANK", rank),
        pid,
        process_started(pid),
    )


# Called with (peer, last step it finished, seconds it has been silent).
Report = Callable[[Peer, int, float], Any]


class RankWatch:
    """The background thread on every rank that publishes this rank's heartbeat and step and
    reports another rank whose heartbeat stood still for ``frozen_seconds``.

    Each episode is reported once; a rank that beats again starts a new one. Nothing here
    touches the training thread but :attr:`step`, set once a step.

    Args:
        rank / world: this rank and the number of ranks.
        frozen_seconds: how long a heartbeat may stand still.
        report: ``fn(peer, step, silent)``, called on this thread.
        store: the job's key-value store (:func:`stepwatch.distributed.side_channel`).
        period: seconds between heartbeats (default an eighth of ``frozen_seconds``).
    """

    def __init__(
        self,
        rank: int,
        world: int,
        frozen_seconds: float,
        report: Report,
        store: Any,
        period: float | None = None,
    ) -> None:
        self.rank, self.world = rank, world
        self.frozen_seconds = frozen_seconds
        self.period = period if period is not None else max(0.05, frozen_seconds / 8)
        self.step = 0
        self.me = this_rank(rank)
        self._report = report
        self._store = store
        self._peers: dict[int, Peer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stepwatch-rank-watch", daemon=True)

    def start(self) -> RankWatch:
        me = self.me
        self._store.set(_PEER.format(self.rank), json.dumps(me.__dict__))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def peer(self, rank: int) -> Peer:
        """Where ``rank`` runs, as it published it (its host 'unknown' if it never did)."""
        found = self._peers.get(rank)
        if found is not None:
            return found
        try:
            key = _PEER.format(rank)
            if self._store.check([key]):
                found = Peer(**json.loads(self._store.get(key)))
                self._peers[rank] = found
                return found
        except Exception:  # the store went away, or a value from another version
            pass
        return Peer(rank, "unknown", -1, -1, 0, None)

    def _run(self) -> None:
        store, beat = self._store, 0
        seen: dict[int, tuple[bytes | None, float]] = {}
        reported: set[int] = set()
        first = True
        while first or not self._stop.wait(self.period):
            first = False  # the first heartbeat goes out at once
            beat += 1
            now = time.monotonic()
            try:
                store.set(_HEARTBEAT.format(self.rank), f"{beat} {self.step}")
                for other in range(self.world):
                    if other == self.rank:
                        continue
                    key = _HEARTBEAT.format(other)
                    value = store.get(key) if store.check([key]) else None
                    last, since = seen.setdefault(other, (None, now))
                    if value != last:
                        seen[other] = (value, now)
                        reported.discard(other)
                        continue
                    # A rank that never beat at all is as silent as one that stopped beating.
                    silent = now - since
                    if silent >= self.frozen_seconds and other not in reported:
                        reported.add(other)
                        step = int(value.split()[1]) if value else 0
                        self._report(self.peer(other), step, silent)
            except Exception:  # the store went away (teardown): nothing left to watch
                if self._stop.is_set():
                    return
                logger.debug("stepwatch: the rank watch stopped", exc_info=True)
                return


def kill_if_stopped_here(peer: Peer) -> bool:
    """SIGKILL ``peer``'s process when it runs on this machine and is stopped (SIGSTOP, a
    debugger's stop): torchrun's SIGTERM would wait on it for 30 s. True if it was killed."""
    if peer.host != socket.gethostname() or peer.pid <= 0 or peer.started is None:
        return False
    if process_started(peer.pid) != peer.started or _state(peer.pid) not in ("T", "t"):
        return False  # another process has that id now, or it is not stopped
    try:
        os.kill(peer.pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def end_job(message: str, peer: Peer | None = None) -> None:
    """End this process because the job cannot go on: log ``message`` (CRITICAL, logger
    ``'stepwatch'``), kill ``peer`` when it is a stopped process on this
    machine, flush, and leave with :data:`ABORT_EXIT_CODE`. Called on a background thread
    while the training thread waits in a collective that will never complete; never returns.
    """
    try:
        if peer is not None and kill_if_stopped_here(peer):
            message += f" (its process {peer.pid} on this machine was killed)"
        logger.critical("%s", message)  # on stderr too when logging is not configured
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(ABORT_EXIT_CODE)
