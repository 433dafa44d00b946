"""What the tests of loops and bridges share: a seed-style user callback, LossMonitor's lines,
and a stored run read back through the store and the dashboard's JSON API."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stepwatch
from stepwatch import Callback
from stepwatch.dashboard.server import make_server, serve_in_thread
from stepwatch.monitor.detectors import Alert, Detector


class SeedStyle(Callback):
    """A MindSpore-style user callback, as the seed writes them (old hook names)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, float]] = []
        self.epochs: list[int] = []

    def step_end(self, run_context: Any) -> None:
        cb_params = run_context.original_args()
        loss = cb_params.net_outputs
        if isinstance(loss, stepwatch.Tensor):
            loss = loss.asnumpy()
        self.seen.append((cb_params.cur_step_num, cb_params.cur_epoch_num, float(loss)))

    def epoch_end(self, run_context: Any) -> None:
        self.epochs.append(run_context.original_args().cur_epoch_num)


class LossAbove(Detector):
    """A user's own detector: fires once per episode of the loss above a bound."""

    kind = "loss_above"
    _advice = "check the data"

    def __init__(self, bound: float) -> None:
        super().__init__()
        self.bound = bound

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if self._edge(value > self.bound):
            return self._alert(step, epoch, f"loss {value:.3g} above {self.bound}", value)
        return None


def assert_saw_every_step(user: SeedStyle, computed: list[float]) -> None:
    """The seed-style callback saw each of 3 epochs of 16 steps, numbered as ``Model.train``
    numbers them, with the losses the trainer computed."""
    assert [s for s, _, _ in user.seen] == list(range(1, 49))
    assert [e for _, e, _ in user.seen] == [1] * 16 + [2] * 16 + [3] * 16
    np.testing.assert_allclose([v for _, _, v in user.seen], computed, rtol=1e-6)
    assert user.epochs == [1, 2, 3]


def assert_loss_monitor_lines(out: str, computed: list[float]) -> None:
    """``LossMonitor(10)``'s MindSpore lines over 3 epochs of 16 steps: on the global-step
    cadence, the first with the loss computed at step 10."""
    lines = [line for line in out.splitlines() if line.startswith("epoch:")]
    found = [re.match(r"epoch: (\d+) step: (\d+), loss is", line) for line in lines]
    assert [m.groups() if m else line for m, line in zip(found, lines)] == [
        ("1", "10"), ("2", "4"), ("2", "14"), ("3", "8"),
    ]  # fmt: skip
    assert float(lines[0].rsplit(" ", 1)[1]) == pytest.approx(computed[9], rel=1e-6)


def api_runs_and_events(db: Path, run_id: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's entry in ``GET /api/runs`` and its ``GET /api/runs/{id}/events``, from a real
    dashboard server on a free loopback port (shut down before returning)."""
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        host, port = server.server_address[:2]

        def get(path: str) -> Any:
            conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
            try:
                conn.request("GET", path)
                answer = conn.getresponse()
                assert answer.status == 200, (path, answer.status)
                return json.loads(answer.read())
            finally:
                conn.close()

        runs = get("/api/runs")
        events = get(f"/api/runs/{run_id}/events")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    entries = runs["runs"] if isinstance(runs, dict) else runs
    (entry,) = [r for r in entries if r["id"] == run_id]
    return entry, events["events"] if isinstance(events, dict) else events


def assert_stopped_for_anomaly(
    db: Path, run_id: int | None, alert_step: int, last_step: int
) -> None:
    """The stored run was stopped by AnomalyMonitor: status ``anomaly``, one ``nonfinite``
    alert at ``alert_step`` whose action stopped training, a stop event naming it, step losses
    for steps 1..``last_step`` - and the dashboard's JSON API shows the same."""
    from stepwatch import Store
    from stepwatch.monitor import values

    assert run_id is not None
    with Store(db) as store:
        info = store.run(run_id)
        assert info.status == "anomaly"
        alerts = [e for e in store.events(info.id) if e["kind"] == "alert"]
        assert [(e["step"], e["data"]["kind"], e["data"]["actions"]) for e in alerts] == [
            (alert_step, "nonfinite", ["stopping training"])
        ]
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == list(range(1, last_step + 1))
    entry, events = api_runs_and_events(db, run_id)
    assert entry["status"] == "anomaly" and entry["steps"] == last_step
    assert [(e["step"], e["data"]["kind"]) for e in events if e["kind"] == "alert"] == [
        (alert_step, "nonfinite")
    ]
    assert any(
        e["kind"] == "stop" and f"nonfinite at step {alert_step}" in e["message"] for e in events
    )
