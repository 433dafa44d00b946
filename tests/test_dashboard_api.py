"""The dashboard's JSON API, against the real server on a free loopback port."""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepwatch.dashboard.server import (
    DashboardServer,
    check_assets,
    make_server,
    serve_in_thread,
)
from stepwatch.store import RunWriter

SPIKE_STEP = 61_234
N_POINTS = 100_000


def _make_store(db: Path) -> None:
    first = RunWriter(db, name="spiky", config={"lr": 0.1})
    values = np.linspace(2.0, 0.5, N_POINTS)
    values[SPIKE_STEP - 1] = 50.0
    first.log_batch("step_loss", range(1, N_POINTS + 1), values)
    first.log("eval_precision/3", 0.5, 100, 1)
    first.log("eval_accuracy", float("nan"), 200, 2)
    first.event("checkpoint", "saved digits-1.ckpt", step=500, epoch=1, data={"file": "x"})
    first.close()
    second = RunWriter(db, name="short")
    for step in range(1, 11):
        second.log("step_loss", 1.0 / step, step, 1)
    second.close("failed")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DashboardServer, Path]]:
    db = tmp_path_factory.mktemp("dash") / "runs.db"
    _make_store(db)
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        yield server, db
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _get(server: DashboardServer, path: str) -> tuple[int, Any, str]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
    try:
        conn.request("GET", path)  # sent as written: no client-side normalisation
        answer = conn.getresponse()
        body = answer.read()
        kind = answer.getheader("Content-Type") or ""
        return answer.status, json.loads(body) if "json" in kind else body, kind
    finally:
        conn.close()


def test_binds_to_loopback_by_default(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    assert server.server_address[0] == "127.0.0.1"
    assert server.url.startswith("http://127.0.0.1:")


def test_runs_lists_every_run_with_its_status(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    status, runs, kind = _get(server, "/api/runs")
    assert status == 200 and kind == "application/json"
    assert [(r["id"], r["name"], r["status"], r["steps"]) for r in runs] == [
        (1, "spiky", "finished", N_POINTS),
        (2, "short", "failed", 10),
    ]
    assert runs[0]["config"] == {"lr": 0.1}
    assert runs[0]["best_loss"] == pytest.approx(0.5)
    assert runs[1]["last_loss"] == pytest.approx(0.1)
    assert all(isinstance(r["started"], float) for r in runs)


def test_keys_and_events(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    assert _get(server, "/api/runs/1/keys")[1] == ["eval_accuracy", "eval_precision/3", "step_loss"]
    events = _get(server, "/api/runs/1/events")[1]
    assert [(e["kind"], e["step"], e["message"], e["data"]) for e in events] == [
        ("checkpoint", 500, "saved digits-1.ckpt", {"file": "x"})
    ]
    summary = _get(server, "/api/runs/2/summary")[1]
    assert summary["step_loss"]["count"] == 10


def test_panels_say_which_chart_each_key_goes_in(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    status, body = _get(server, "/api/runs/1/panels")[:2]
    assert status == 200
    # The same rule the PNG plots use (stepwatch.monitor.values.panel_of): a per-class key
    # goes in its metric's chart, every loss in 'loss', and 'loss' is the first chart.
    assert body == {
        "panels": {
            "eval_accuracy": "accuracy",
            "eval_precision/3": "precision",
            "step_loss": "loss",
        },
        "order": ["loss", "accuracy", "precision"],
        "groups": {},
    }


def test_metrics_downsampled_keep_a_one_step_spike(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    status, data, _ = _get(server, "/api/runs/1/metrics/step_loss?max_points=500")
    assert status == 200
    assert len(data["steps"]) == len(data["values"]) <= 500
    assert data["steps"] == sorted(data["steps"])
    spike = data["steps"].index(SPIKE_STEP)
    assert data["values"][spike] == 50.0
    full = _get(server, "/api/runs/1/metrics/step_loss")[1]
    assert len(full["steps"]) == N_POINTS


def test_metrics_after_returns_only_newer_points(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    data = _get(server, "/api/runs/1/metrics/step_loss?after=99990&max_points=2000")[1]
    assert data["steps"] == list(range(99_991, N_POINTS + 1))
    nothing = _get(server, f"/api/runs/1/metrics/step_loss?after={N_POINTS}")[1]
    assert nothing == {"steps": [], "values": []}
    window = _get(server, "/api/runs/1/metrics/step_loss?start=10&end=14")[1]
    assert window["steps"] == [10, 11, 12, 13, 14]


def test_metrics_keys_with_slash_and_nan(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    assert _get(server, "/api/runs/1/metrics/eval_precision%2F3")[1] == {
        "steps": [100],
        "values": [0.5],
    }
    status, data, _ = _get(server, "/api/runs/1/metrics/eval_accuracy")
    assert status == 200 and data == {"steps": [200], "values": [None]}


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/runs/9/keys", 404, "no run"),
        ("/api/runs/9/metrics/step_loss", 404, "no run"),
        ("/api/runs/1/metrics/nope", 404, "no metric 'nope'"),
        ("/api/runs/1/nothing", 404, "no API"),
        ("/api/elsewhere", 404, "no API"),
        ("/api/runs/x/keys", 400, "run id is an integer"),
        ("/api/runs/1/metrics/step_loss?max_points=abc", 400, "'max_points' must be an integer"),
        ("/api/runs/1/metrics/step_loss?max_points=1", 400, "max_points"),
        ("/api/runs/1/metrics/step_loss?after=1.5", 400, "'after' must be an integer"),
        ("/api/runs/1/metrics/step_loss?start=", 400, "'start' must be an integer"),
        ("/api/runs/1/metrics/step_loss?step=3", 400, "unknown parameter 'step'"),
        ("/api/runs/1/metrics/step_loss?end=1&end=2", 400, "'end' given 2 times"),
        ("/api/runs/1/metrics/step_loss?start=300&end=100", 400, "'start' 300 is after 'end'"),
    ],
)
def test_errors_are_json_with_a_message(
    served: tuple[DashboardServer, Path], path: str, status: int, message: str
) -> None:
    server, _ = served
    got, body, kind = _get(server, path)
    assert (got, kind) == (status, "application/json")
    assert message in body["error"]


def test_a_write_method_is_refused_with_json(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
    try:
        conn.request("POST", "/api/runs", body=b"{}")
        answer = conn.getresponse()
        body = json.loads(answer.read())
        assert (answer.status, answer.getheader("Allow")) == (405, "GET, HEAD")
        assert "POST is not allowed: the dashboard only reads" in body["error"]
    finally:
        conn.close()


@pytest.mark.parametrize(
    "path",
    [
        "/../server.py",
        "/static/../server.py",
        "/%2e%2e/server.py",
        "/..%2fserver.py",
        "/%2e%2e%2f%2e%2e%2fstore/reader.py",
        "/vendor/../../server.py",
        "//etc/passwd",
        "/%2fetc%2fpasswd",
        "/..\\server.py",
        "/app.js%00.png",
    ],
)
def test_path_traversal_is_refused(served: tuple[DashboardServer, Path], path: str) -> None:
    server, _ = served
    status, body, _ = _get(server, path)
    assert status == 404
    assert b"import" not in json.dumps(body).encode()


def test_serves_the_page_and_its_chart_library(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    status, page, kind = _get(server, "/")
    assert status == 200 and kind.startswith("text/html")
    assert b"vendor/uPlot.iife.min.js" in page and b"app.js" in page
    status, script, kind = _get(server, "/vendor/uPlot.iife.min.js")
    assert status == 200 and "javascript" in kind and b"uPlot" in script


def test_the_database_is_never_changed(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    writer = RunWriter(db, name="one")
    writer.log("step_loss", 1.0, 1)
    writer.close()
    before, files = _digest(db), sorted(p.name for p in tmp_path.iterdir())
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        for path in ("/api/runs", "/api/runs/1/keys", "/api/runs/1/metrics/step_loss"):
            assert _get(server, path)[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert _digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_keeps_answering_while_a_run_is_recorded(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    writer = RunWriter(db, name="live", flush_seconds=0.05)
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        last = 0
        for step in range(1, 6):
            writer.log("step_loss", math.exp(-step), step)
            assert writer.flush()
            status, data, _ = _get(server, f"/api/runs/1/metrics/step_loss?after={last}")
            assert status == 200 and data["steps"] == [step]
            last = step
        assert _get(server, "/api/runs")[1][0]["status"] == "running"
    finally:
        writer.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_missing_chart_library_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make install"):
        check_assets(tmp_path)


def test_server_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no stepwatch database"):
        make_server(tmp_path / "none.db", port=0)
    with pytest.raises(ValueError, match="'port'"):
        make_server(tmp_path / "none.db", port=70000)
    with pytest.raises(TypeError, match="'host'"):
        make_server(tmp_path / "none.db", host=None)  # type: ignore[arg-type]


def _get_with_host(server: DashboardServer, path: str, host_header: str) -> tuple[int, Any]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host_header)
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def test_a_foreign_host_header_is_refused(served: tuple[DashboardServer, Path]) -> None:
    # DNS rebinding: a page on evil.example resolving its name to 127.0.0.1 reads nothing.
    server, _ = served
    port = server.server_address[1]
    status, body = _get_with_host(server, "/api/runs", f"evil.example:{port}")
    assert status == 403 and "evil.example" in body["error"]
    for name in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert _get_with_host(server, "/api/runs", name)[0] == 200


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs/1/metrics/step_loss?after=99999999999999999999",
        "/api/runs/1/metrics/step_loss?max_points=" + "9" * 40,
        "/api/runs/" + "5" * 5000 + "/keys",
    ],
)
def test_integers_beyond_64_bits_are_a_400(served: tuple[DashboardServer, Path], path: str) -> None:
    server, _ = served
    status, body, _ = _get(server, path)
    assert status == 400 and "64-bit" in body["error"]


def test_the_listen_backlog_holds_many_clients(served: tuple[DashboardServer, Path]) -> None:
    assert served[0].request_queue_size >= 128


def test_runs_say_where_they_ran(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    runs = _get(server, "/api/runs")[1]
    assert {(r["host"], r["user"]) for r in runs} == {(socket.gethostname(), "")}


def test_band_keeps_a_spike_around_a_calm_line(served: tuple[DashboardServer, Path]) -> None:
    server, _ = served
    status, data, _ = _get(server, "/api/runs/1/metrics/step_loss?max_points=2000&band=500")
    assert status == 200
    n = len(data["steps"])
    assert 400 <= n <= 500 and len(data["values"]) == len(data["lo"]) == len(data["hi"]) == n
    assert data["steps"] == sorted(data["steps"])
    # The spike is the top of its bucket's band; the line (each bucket's median) stays calm.
    top = data["hi"].index(max(data["hi"]))
    assert data["hi"][top] == 50.0 and max(data["values"]) < 2.01
    assert abs(data["steps"][top] - SPIKE_STEP) < N_POINTS / 400
    assert all(lo <= v <= hi for lo, v, hi in zip(data["lo"], data["values"], data["hi"]))
    # Fewer points than buckets: every point as it is, its band of zero width.
    few = _get(server, "/api/runs/2/metrics/step_loss?band=500")[1]
    assert few["values"] == few["lo"] == few["hi"] == [1.0 / s for s in range(1, 11)]
    assert _get(server, "/api/runs/1/metrics/eval_accuracy?band=4")[1]["lo"] == [None]
    assert _get(server, "/api/runs/1/metrics/step_loss?band=1")[0] == 400


def test_clock_and_system_group_and_anomaly_status(tmp_path: Path) -> None:
    db = tmp_path / "clock.db"
    writer = RunWriter(db, name="timed")
    start = 1_700_000_000.0
    for epoch in (1, 2):
        steps = range(10 * epoch - 9, 10 * epoch + 1)
        writer.log_batch("step_loss", steps, [1.0] * 10, epoch, times=[start + s for s in steps])
    writer.log("system/cpu_percent", 40.0, 10)
    writer.log("system/gpu_mem_mb", 900.0, 10)
    writer.close("anomaly")
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        clock = _get(server, "/api/runs/1/clock")[1]
        assert clock["steps"] == list(range(1, 21))
        assert clock["time"] == [start + s for s in range(1, 21)]
        assert clock["epoch"][0] == pytest.approx(0.1)
        assert clock["epoch"][9] == 1.0 and clock["epoch"][19] == 2.0
        assert _get(server, "/api/runs/1/clock")[1] == clock  # cached: the run has ended
        panels = _get(server, "/api/runs/1/panels")[1]
        assert panels["order"] == ["loss", "system/cpu_percent", "system/gpu_mem_mb"]
        assert panels["groups"] == {
            "system/cpu_percent": "system",
            "system/gpu_mem_mb": "system",
        }
        assert _get(server, "/api/runs")[1][0]["status"] == "anomaly"
        assert _get(server, "/api/runs/9/clock")[0] == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
