"""Every machine's system metrics in the one stored run of a job on several machines.

Only rank 0 writes the store. On each other machine (node), the worker with local rank 0 runs a
:class:`NodePublisher`: a background thread that takes a system sample
(:class:`stepwatch.store.system.SystemSampler`) every few seconds and puts it in the job's
key-value store (:func:`stepwatch.distributed.side_channel`; never a collective, so a sample
never waits for training). Rank 0's run writer samples through a :class:`NodeSampler`, which
adds its own machine's sample to the latest one each other node published. Every key is
stored under the node rank and the machine's name::

    system/node0@gpu-a/cpu_percent   system/node1@gpu-b/cpu_percent   system/node1@gpu-b/gpu0_util

A job on one machine keeps the plain ``system/<metric>`` keys.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Any

from .distributed import side_channel
from .job import current_job
from .store.system import PREFIX, SystemSampler

__all__ = ["NodePublisher", "NodeSampler", "node_key", "publisher", "sampler"]

logger = logging.getLogger("stepwatch")

_KEY = "stepwatch/system/node{}"


def node_key(node: int, host: str, key: str) -> str:
    """``system/cpu_percent`` of node 1 on ``gpu-b``: ``system/node1@gpu-b/cpu_percent``."""
    return f"{PREFIX}node{node}@{host}/{key.removeprefix(PREFIX)}"


class NodePublisher:
    """A thread that publishes this machine's system sample every ``every`` seconds.

    Args:
        every: seconds between samples.
        node: this machine's node rank.
        store: the job's key-value store.
    """

    def __init__(self, every: float, node: int, store: Any) -> None:
        self.every, self.node = every, node
        self._store = store
        self._sampler = SystemSampler(every)
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="stepwatch-node-metrics", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        seq = 0
        while not self._stop.wait(self.every):
            seq += 1
            sample = self._sampler.sample()
            value = json.dumps({"host": self._host, "seq": seq, "sample": sample})
            try:
                self._store.set(_KEY.format(self.node), value)
            except Exception:  # the job is ending (its store went away)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sampler.close()


class NodeSampler(SystemSampler):
    """Rank 0's system sampler in a job on several machines: its own machine's sample and the
    latest sample of each other node, each under its node rank and host (:func:`node_key`).
    Called on the run writer's thread, as :class:`SystemSampler` is.

    Args:
        every: seconds between samples.
        node / nodes: this machine's node rank and the number of nodes.
        store: the job's key-value store.
    """

    def __init__(self, every: float, node: int, nodes: int, store: Any) -> None:
        super().__init__(every)
        self._node, self._nodes = node, nodes
        self._hostname = socket.gethostname()
        self._store = store
        self._seen: dict[int, int] = {}  # the last sample taken from each node

    def sample(self) -> dict[str, float]:
        own = super().sample()
        found = {node_key(self._node, self._hostname, k): v for k, v in own.items()}
        for node in range(self._nodes):
            if node == self._node:
                continue
            key = _KEY.format(node)
            try:
                if not self._store.check([key]):
                    continue
                published = json.loads(self._store.get(key))
            except Exception:  # the job is ending, or a node wrote something else
                continue
            seq = published.get("seq", 0)
            if seq == self._seen.get(node):
                continue  # nothing new from that node since the last sample
            self._seen[node] = seq
            host = str(published.get("host", "unknown"))
            for k, v in published.get("sample", {}).items():
                found[node_key(node, host, k)] = float(v)
        return found


def sampler(every: float) -> SystemSampler:
    """The system sampler for rank 0's run writer: a :class:`NodeSampler` in a job on several
    machines, else a :class:`SystemSampler`."""
    job, store = current_job(), side_channel()
    if job is None or job.nodes < 2 or store is None:
        return SystemSampler(every)
    return NodeSampler(every, job.node, job.nodes, store)


def publisher(every: float, rank: int) -> NodePublisher | None:
    """A :class:`NodePublisher` for this process when it is the first worker of a machine
    that rank 0 does not run on, in a job on several machines; else None."""
    job, store = current_job(), side_channel()
    if job is None or job.nodes < 2 or store is None or job.local_rank != 0 or rank == 0:
        return None
    return NodePublisher(every, job.node, store)
