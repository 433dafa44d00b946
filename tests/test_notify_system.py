"""RunRecorder's webhook notifications (against a real HTTP server on 127.0.0.1) and its
system metrics (written by the writer's thread under ``system/``)."""

from __future__ import annotations

import http.server
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stepwatch
from stepwatch import AnomalyMonitor, Callback, RunRecorder, Store
from stepwatch.store import notify
from stepwatch.store.system import SystemSampler

from .conftest import wait_until

SECRET = "T000/B000/XXXXsecretXXXX"


class Hook:
    """A webhook endpoint on a free loopback port: answers ``status`` and keeps the bodies."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length", 0))
                hook.bodies.append(json.loads(self.rfile.read(size)))
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/{SECRET}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def hook() -> Iterator[Hook]:
    served = Hook()
    try:
        yield served
    finally:
        served.stop()


def _train_with_nan(callbacks: list[Any], nan_step: int = 12, steps: int = 32) -> list[float]:
    """A hand-written loop of ``steps`` steps whose loss is NaN from ``nan_step`` on."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y = torch.randn(steps, 8, 4), torch.randn(steps, 8, 1)
    seen: list[float] = []
    with stepwatch.watch(net, opt, callbacks, epochs=1, steps_per_epoch=steps) as run:
        for i in range(steps):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x[i]), y[i])
            if i + 1 >= nan_step:
                loss = loss * math.nan
            loss.backward()
            opt.step()
            run.step(loss)
            seen.append(float(loss.detach()))
            if run.should_stop:
                break
    return seen


def test_alerts_and_the_end_reach_the_webhook_and_its_secret_stays_out(
    tmp_path: Path, hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db, run_name="night", notify=hook.url)
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        _train_with_nan([monitor, recorder])
    # The run's end was posted before RunRecorder returned (the notifier drains on close).
    events = [b["event"] for b in hook.bodies]
    assert events == ["alert", "end"]
    alert, end = hook.bodies
    assert alert["run"] == "night" and alert["run_id"] == recorder.run_id
    assert (alert["step"], alert["kind"], alert["actions"]) == (
        12,
        "nonfinite",
        ["stopping training"],
    )
    assert alert["text"].startswith(
        f"stepwatch run 'night' ({recorder.run_id}): step 12: nonfinite"
    )
    assert alert["text"].endswith("[stopping training]") and alert["content"] == alert["text"]
    assert end["status"] == "anomaly" and "ended: anomaly" in end["text"]
    # The URL's token is nowhere: not in the store, not in a log line.
    with Store(db) as store:
        info = store.run(recorder.run_id)
        stored = json.dumps(info.config) + json.dumps(store.events(info.id), default=str)
    assert SECRET not in stored and SECRET not in caplog.text
    assert recorder.writer is not None and recorder.writer.notifier is not None
    assert (recorder.writer.notifier.sent, recorder.writer.notifier.failed) == (2, 0)


def test_a_failing_endpoint_is_retried_counted_and_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(notify, "_RETRY_PAUSES", (0.01, 0.01, 0.01))
    failing = Hook(status=503)
    try:
        recorder = RunRecorder(db=tmp_path / "runs.db", notify=failing.url)
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            seen = _train_with_nan([AnomalyMonitor(action="stop"), recorder])
    finally:
        failing.stop()
    assert len(seen) == 12  # training went on to the stop (the NaN's own step), unaffected
    # Two messages (the alert, the end), each tried four times, both given up on.
    assert len(failing.bodies) == 8
    assert recorder.writer is not None and recorder.writer.notifier is not None
    assert (recorder.writer.notifier.sent, recorder.writer.notifier.failed) == (0, 2)
    warnings = [r.getMessage() for r in caplog.records if "could not post" in r.getMessage()]
    assert len(warnings) == 1 and "HTTP 503" in warnings[0]
    assert SECRET not in caplog.text and "http://127.0.0.1:" in warnings[0]

    # An endpoint that is not there at all: refused connections, counted the same way.
    caplog.clear()
    gone = Hook()
    url = gone.url
    gone.stop()
    recorder = RunRecorder(db=tmp_path / "gone.db", notify=url)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        _train_with_nan([AnomalyMonitor(action="stop"), recorder])
    assert recorder.writer is not None and recorder.writer.notifier is not None
    assert recorder.writer.notifier.failed == 2 and SECRET not in caplog.text


def test_wrong_notify_urls_get_clear_errors_without_the_token() -> None:
    with pytest.raises(TypeError, match="'notify' must be a webhook URL"):
        RunRecorder(notify=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="http:// or https://") as info:
        RunRecorder(notify=f"ftp://hooks.example/{SECRET}")
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError, match="with a host"):
        RunRecorder(notify="https:///no-host")


class Slow(Callback):
    """Makes each step take a few milliseconds, so that system samples fall inside the run."""

    def on_train_step_end(self, run_context: Any) -> None:
        time.sleep(0.005)


def test_system_metrics_are_written_by_the_writer_under_their_prefix(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db, system_every=0.05)
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with stepwatch.watch(net, opt, [recorder, Slow()], steps_per_epoch=60) as run:
        for _ in range(60):
            opt.zero_grad()
            loss = net(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            run.step(loss)
    with Store(db) as store:
        keys = store.keys(recorder.run_id)
        assert {"system/cpu_percent", "system/rss_mb", "system/host_cpu_percent"} <= set(keys)
        assert not [k for k in keys if k.startswith("system/gpu")]  # no GPU on this machine
        steps, rss = store.metrics(recorder.run_id, "system/rss_mb")
        assert len(rss) >= 2 and np.all(rss > 10)  # MiB of a process that imported torch
        assert np.all(np.diff(steps) >= 0) and steps[-1] <= 60  # at the run's steps
        _, cpu = store.metrics(recorder.run_id, "system/cpu_percent")
        assert np.all(cpu >= 0)
        _, host = store.metrics(recorder.run_id, "system/host_cpu_percent")
        assert np.all((host >= 0) & (host <= 100))
    # The machine's share is read on the writer's thread, where psutil's own reading would
    # start from nothing (its first value there is always 0): a busy core shows.
    sampler = SystemSampler(0.05)
    start = time.monotonic()
    while time.monotonic() - start < 0.3:
        pass  # one core busy
    seen: list[dict[str, float]] = []
    reader = threading.Thread(target=lambda: seen.append(sampler.sample()))
    reader.start()
    reader.join(timeout=10)
    assert seen and seen[0]["system/host_cpu_percent"] > 10
    # Off: no system keys at all.
    off = RunRecorder(db=db, system_every=None)
    with stepwatch.watch(net, opt, [off, Slow()], steps_per_epoch=20) as run:
        for _ in range(20):
            run.step(net(torch.randn(8, 4)).pow(2).mean().detach())
    with Store(db) as store:
        assert not [k for k in store.keys(off.run_id) if k.startswith("system/")]


def test_a_malformed_answer_or_a_hanging_endpoint_never_stops_the_notifier_or_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    monkeypatch.setattr(notify, "_RETRY_PAUSES", (0.01, 0.01, 0.01))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve(mode: list[str]) -> None:  # answers garbage, or holds the connection open
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            if mode[0] == "garbage":
                conn.recv(65536)
                conn.sendall(b"GARBAGE\r\n\r\n")
                conn.close()
            else:
                held.append(conn)

    mode = ["garbage"]
    thread = threading.Thread(target=serve, args=(mode,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}/services/{SECRET}"
        recorder = RunRecorder(db=tmp_path / "runs.db", notify=url)
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            _train_with_nan([AnomalyMonitor(action="stop"), recorder])
        notifier = recorder.writer.notifier  # type: ignore[union-attr]
        assert notifier is not None
        wait_until(lambda: notifier.failed == 2)  # both messages counted, the thread alive
        assert SECRET not in caplog.text and "BadStatusLine" in caplog.text

        # An endpoint that never answers: the run's status is stored without waiting for it.
        mode[0] = "hang"
        monkeypatch.setattr(notify, "_TIMEOUT", 30.0)
        recorder = RunRecorder(db=tmp_path / "hang.db", notify=url)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            _train_with_nan([AnomalyMonitor(action="stop"), recorder])
        # ... and says that what it could not post yet is lost if the process exits now
        assert "not posted within 2 s of the run's end" in caplog.text
        assert SECRET not in caplog.text
        with Store(tmp_path / "hang.db") as store:
            assert store.run(recorder.run_id).status == "anomaly"
        notifier = recorder.writer.notifier  # type: ignore[union-attr]
        assert notifier is not None and notifier.sent == 0  # still waiting on the endpoint
    finally:
        stop.set()
        thread.join(timeout=10)
        for conn in held:
            conn.close()
        listener.close()


def test_a_url_with_spaces_is_refused_without_showing_its_token() -> None:
    with pytest.raises(ValueError, match="without spaces") as info:
        RunRecorder(notify=f"https://hooks.example/services/{SECRET} X")
    assert SECRET not in str(info.value)
