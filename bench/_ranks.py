"""What the multi-process benches share: starting this script once per rank of a process group
on this machine, and counting the collectives a rank calls through ``torch.distributed``.

A bench imports it as ``_ranks`` (``python bench/<name>.py`` puts ``bench/`` on the path)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

COUNTED = ("all_reduce", "all_gather", "broadcast")


def run_ranks(script: str, args: list[str], world: int = 2) -> int:
    """Run ``python script *args --db <a temporary store>`` as ranks 0 .. ``world - 1`` of one
    process group (the environment ``env://`` reads); the highest exit status. A rank still
    running when this returns (after an error, or Ctrl-C) is killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
            }
            cmd = [sys.executable, script, *args, "--db", str(Path(tmp) / "bench.db")]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return max(codes)


class Counter:
    """Counts the collectives called through ``torch.distributed`` while :meth:`counting`:
    the calls of each kind, the elements they carry and the wall time spent in them."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, int] = dict.fromkeys(COUNTED, 0)
        self.elements = 0
        self.seconds = 0.0
        for name in COUNTED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            self.calls[name] += 1
            tensor = args[1] if name == "all_gather" else args[0]
            self.elements += tensor.numel() if isinstance(tensor, torch.Tensor) else 0
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.calls = dict.fromkeys(COUNTED, 0)
        self.elements = 0
        self.seconds = 0.0
        self.on = True
        try:
            yield
        finally:
            self.on = False
