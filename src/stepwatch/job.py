"""The torchrun job this process belongs to: its machines (nodes), and the stored run a job
started again by torchrun continues.

torchrun tells each worker where it stands in environment variables: ``TORCHELASTIC_RUN_ID``
(the ``--rdzv-id``), ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (this machine's node rank and the
number of nodes), ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``. A
job whose workers fail is started again by the same launchers (``--max-restarts``); the
launcher process (each worker's parent) is what stays, so the run a worker's recorder created
is found again by the job's id, the machine and the launcher process that started it.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Job",
    "current_job",
    "env_int",
    "next_run_number",
    "process_started",
    "run_to_continue",
    "several_nodes",
]

# The runs this process recorded so far: the n-th run of a later attempt continues the n-th.
_RUNS = itertools.count()


def next_run_number() -> int:
    """0 for the first run this process records, then 1, 2, ..."""
    return next(_RUNS)


def env_int(name: str, default: int) -> int:
    """The whole number torchrun set in the environment variable ``name``, else ``default``."""
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def process_started(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Job:
    """This worker's place in a torchrun job.

    Attributes:
        id: the job's rendezvous id (``--rdzv-id``; ``'none'`` when not given).
        node / nodes: this machine's node rank and the number of nodes.
        local_rank / local_world: this worker's index on its machine, and their number.
        restart: how many times this machine's launcher started its workers again.
        host: this machine's name.
        launcher: the launcher's process id (the worker's parent), and ``launcher_started``
            its start time, so that a later attempt of the same job knows its runs.
    """

    id: str
    node: int
    nodes: int
    local_rank: int
    local_world: int
    restart: int
    host: str
    launcher: int
    launcher_started: int | None

    def identity(self) -> dict[str, Any]:
        """What is the same in every attempt of this job on this machine."""
        return {
            "id": self.id,
            "host": self.host,
            "launcher": self.launcher,
            "launcher_started": self.launcher_started,
        }

    def config(self) -> dict[str, Any]:
        """What a run's config records about the job."""
        return {**self.identity(), "nodes": self.nodes, "processes_per_node": self.local_world}


def current_job() -> Job | None:
    """The torchrun job this process is a worker of, or None when torchrun did not start it."""
    job_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if job_id is None:
        return None
    parent = os.getppid()
    return Job(
        id=job_id,
        node=env_int("GROUP_RANK", 0),
        nodes=env_int("GROUP_WORLD_SIZE", 1),
        local_rank=env_int("LOCAL_RANK", 0),
        local_world=env_int("LOCAL_WORLD_SIZE", 1),
        restart=env_int("TORCHELASTIC_RESTART_COUNT", 0),
        host=socket.gethostname(),
        launcher=parent,
        launcher_started=process_started(parent),
    )


def several_nodes() -> bool:
    """True in a torchrun job on more than one node."""
    return env_int("GROUP_WORLD_SIZE", 1) > 1


def run_to_continue(db: Any, job: Job, number: int) -> int | None:
    """The stored run an earlier attempt of ``job`` recorded as its ``number``-th run
    (:func:`next_run_number`) and did not finish: the newest run of the same job (same id,
    machine and launcher) with that number, made by another process. None when there is none
    (the first attempt), when that run finished, or when the store cannot be read."""
    from .store.reader import Store

    identity = job.identity()
    try:
        with Store(db) as store:
            runs = store.runs()
    except Exception:  # no store yet (the first attempt), or one that cannot be read
        return None
    pid = os.getpid()
    for run in sorted(runs, key=lambda r: r.id, reverse=True):
        recorded = run.config.get("job")
        if not isinstance(recorded, dict) or run.pid == pid or recorded.get("run") != number:
            continue
        if {k: recorded.get(k) for k in identity} == identity:
            return None if run.stored_status == "finished" else run.id
    return None
