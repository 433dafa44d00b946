"""Start the ranks of a process group as real processes for a test, and end every one of them
by its PID at a deadline (the distributed tests' one launcher)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    script: Path, *args: str, world: int = 2, env: dict[str, str] | None = None, **popen: Any
) -> list[subprocess.Popen[str]]:
    """Start ``python script *args`` once per rank of a ``world``-process group (the
    environment torch.distributed's ``env://`` reads, this checkout's code first on the path)."""
    port = free_port()
    procs = []
    for rank in range(world):
        environ = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SRC), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                **popen,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every rank, each ended by its own PID once ``timeout`` seconds have passed;
    ``(returncode, stdout, stderr)`` of each."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def torchrun(
    script: Path, *args: str, cwd: Path, timeout: float, nproc: int = 2
) -> tuple[int, str, str]:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` workers; its launcher's
    ``(returncode, stdout, stderr)``. Past ``timeout`` seconds every worker is ended by its
    PID (torchrun starts them in process groups of their own), then the launcher."""
    import psutil

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(nproc), str(script), *args],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            for worker in psutil.Process(launcher.pid).children(recursive=True):
                worker.kill()
            launcher.kill()
            launcher.communicate()
    return launcher.returncode, out, err
