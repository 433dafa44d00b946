"""A job on several machines: two torchrun launchers side by side (``--nnodes 2``, c10d
rendezvous on 127.0.0.1), two workers each, gloo on the CPU.

Every worker writes its pid first; whatever happens, the test ends every worker by its pid
(torchrun starts them in process groups of their own) and every launcher, and bounds each job
in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepwatch import Store

from ._ranks import SRC, free_port

JOB = Path(__file__).with_name("jobs") / "torchrun_job.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun jobs on Linux")


def _job(
    scenario: str, out: Path, timeout: float, restarts: int = 0, nproc: int = 2, **env: str
) -> list[tuple[int | None, str, str]]:
    """Run the job with two launchers; ``(returncode, stdout, stderr)`` of each launcher
    (returncode None: it was still running at the deadline and was killed)."""
    port = free_port()
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    args = [
        *TORCHRUN,
        "--nnodes", "2", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--monitor-interval", "0.2", str(JOB), scenario, str(out),
    ]  # fmt: skip
    launchers = [
        subprocess.Popen(args, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    deadline = time.monotonic() + timeout
    results: list[tuple[int | None, str, str]] = []
    try:
        for launcher in launchers:
            try:
                stdout, stderr = launcher.communicate(timeout=max(deadline - time.monotonic(), 1))
                results.append((launcher.returncode, stdout, stderr))
            except subprocess.TimeoutExpired:
                launcher.kill()
                stdout, stderr = launcher.communicate()
                results.append((None, stdout, stderr))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
        _end_workers(out)
    return results


def _end_workers(out: Path) -> None:
    """Kill every worker the job started that is still alive (a stopped one too)."""
    for pid_file in (out / "pids").glob("*") if (out / "pids").exists() else []:
        pid = int(pid_file.name)
        try:
            os.kill(pid, signal.SIGKILL)  # ends a stopped process as well
        except ProcessLookupError:
            continue
        for _ in range(100):  # reaped by its launcher, or gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job of two launchers: a run of 2 epochs, then a run where rank 3 stops."""
    out = tmp_path_factory.mktemp("nodes")
    launchers = _job("nodes", out, timeout=150)
    ended = time.time()
    with Store(out / "runs.db") as store:
        runs = store.runs()
        events = [store.events(run.id) for run in runs]
        keys = [set(store.keys(run.id)) for run in runs]
        step_losses = [store.metrics(run.id, "step_loss")[0].tolist() for run in runs]
    return {
        "out": out, "launchers": launchers, "ended": ended, "runs": runs, "events": events,
        "keys": keys, "step_losses": step_losses,
    }  # fmt: skip


def test_two_machines_record_one_run_print_once_and_keep_each_machines_metrics(
    nodes: dict[str, Any],
) -> None:
    # Rank 0 prints, once: its launcher shows every line, the other none.
    printed = [
        [line for line in out.splitlines() if line.startswith("epoch:")]
        for _, out, _ in nodes["launchers"]
    ]
    assert sorted(len(lines) for lines in printed) == [0, 4]
    lines = max(printed, key=len)
    assert [line.split(",")[0] for line in lines] == [
        "epoch: 1 step: 2", "epoch: 1 step: 4", "epoch: 2 step: 2", "epoch: 2 step: 4",
    ]  # fmt: skip
    run, keys = nodes["runs"][0], nodes["keys"][0]
    assert run.status == "finished" and run.name == "nodes"
    job = run.config["job"]
    assert job["nodes"] == 2 and job["processes_per_node"] == 2 and job["run"] == 0
    host = socket.gethostname()
    for node in (0, 1):
        assert f"system/node{node}@{host}/rss_mb" in keys
    assert not any(k.startswith("system/") and "@" not in k for k in keys)
    # 2 epochs of 4 global steps (16 rows a step over 4 ranks), each stored once.
    assert nodes["step_losses"][0] == list(range(1, 9))
    assert {"dist/loss_mean", "dist/step_time_max"} <= keys


def test_a_stopped_rank_ends_the_whole_job_with_its_name_and_the_run_says_why(
    nodes: dict[str, Any],
) -> None:
    launchers = nodes["launchers"]
    stopped_at = float((nodes["out"] / "stopped").read_text())
    assert all(code is not None for code, _, _ in launchers), "the job did not end by itself"
    assert all(code != 0 for code, _, _ in launchers)
    # Well under the 90 s bound: frozen_seconds (2 s) and a teardown, not a collective's
    # timeout (300 s in this job).
    assert nodes["ended"] - stopped_at < 90
    host = socket.gethostname()
    who = f"rank 3 (host {host}, node 1)"
    errors = "".join(err for _, _, err in launchers)
    assert f"{who} has not run for" in errors and "ends the job" in errors
    run, events = nodes["runs"][1], nodes["events"][1]
    assert run.name == "frozen" and run.stored_status == "failed"
    assert run.config["job"]["run"] == 1  # the second run this job recorded
    [alert] = [e for e in events if e["kind"] == "alert"]
    assert alert["data"]["kind"] == "frozen" and alert["data"]["source"] == "DistributedMonitor"
    assert alert["message"].startswith(f"{who} has not run for")
    assert "the last step it finished is 12," in alert["message"]
    assert alert["data"]["actions"] == ["ending the job (rank 0 leaves with exit status 3)"]
    [stop] = [e for e in events if e["kind"] == "stop"]
    assert stop["level"] == "error" and stop["message"].startswith(f"training aborted: {who}")
    assert stop["data"] == {"kind": "frozen", "rank": 3, "host": host, "node": 1, "last_step": 12}


def test_a_job_torchrun_starts_again_continues_its_stored_run(tmp_path: Path) -> None:
    # torch shares the rendezvous store with the workers by default, and a restarted gloo
    # group then reads the first attempt's addresses (pytorch/pytorch#135712).
    # One worker per launcher: two attempts of the job's start-up are the test's cost.
    launchers = _job(
        "restart", tmp_path, 180, restarts=1, nproc=1, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )
    for code, _, err in launchers:
        assert code == 0, err[-3000:]
    assert (tmp_path / "failed-once").exists()
    with Store(tmp_path / "runs.db") as store:
        [run] = store.runs()
        events = store.events(run.id)
        steps, _ = store.metrics(run.id, "step_loss")
    assert run.status == "finished" and run.name == "restart"
    [restart] = [e for e in events if e["kind"] == "restart"]
    assert restart["step"] == 8  # the latest checkpoint before rank 1 failed at step 10
    assert restart["message"].endswith("training goes on from step 8")
    # Steps 1-10 of the first attempt (9 and 10 trained again after the restart), then on to
    # 24 (3 epochs of 8 steps).
    assert steps.tolist()[-1] == 24
    assert set(steps.tolist()) == set(range(1, 25))
