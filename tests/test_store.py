"""The run store: recording, crash consistency, back-pressure, concurrency, reading, CLI."""

from __future__ import annotations

import json
import math
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stepwatch import (
    EarlyStopping,
    Every,
    LambdaCallback,
    ModelCheckpoint,
    RingBuffer,
    RunRecorder,
    RunWriter,
    Store,
)
from stepwatch.store.reader import effective_status

from .conftest import make_batches, make_model, run_cli

ROOT = Path(__file__).resolve().parents[1]


def _job(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.jobs.store_job", *args]


# -- recording -------------------------------------------------------------------------------
def test_recorder_writes_steps_epochs_eval_lr_and_events(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    model = make_model(metrics={"accuracy"})
    recorder = RunRecorder(db=db, run_name="fit", config={"lr": 0.1}, transfer_every=3)
    cbs = [EarlyStopping("loss", patience=1), ModelCheckpoint(directory=tmp_path / "ck"), recorder]
    step_losses: list[float] = []
    cbs.append(
        LambdaCallback(on_train_step_end=lambda rc: step_losses.append(rc.original_args().loss))
    )
    model.fit(3, make_batches(4), make_batches(2), callbacks=cbs)
    with Store(db) as store:
        run = store.run("fit")
        assert run.status == "finished" and run.config["lr"] == 0.1 and run.steps == 12
        assert set(store.keys(run.id)) == {
            "step_loss",
            "lr",
            "step_time",
            "loss",
            "train_accuracy",
            "eval_accuracy",
            "eval_loss",
        }
        steps, losses = store.metrics(run.id, "step_loss")
        assert steps.tolist() == list(range(1, 13))
        np.testing.assert_allclose(losses, step_losses, rtol=1e-6)
        assert store.metrics(run.id, "eval_loss")[0].tolist() == [4, 8, 12]
        kinds = [e["kind"] for e in store.events(run.id)]
        assert kinds.count("checkpoint") == 3


def test_recorder_every_n_steps_samples(tmp_path: Path) -> None:
    recorder = RunRecorder(db=tmp_path / "s.db", every_n_steps=5)
    make_model().train(2, make_batches(8), callbacks=[recorder])
    with Store(tmp_path / "s.db") as store:
        assert store.metrics(recorder.run_id, "step_loss")[0].tolist() == [5, 10, 15]


def test_recorder_reads_losses_once_per_interval(tmp_path: Path) -> None:
    """Step losses stay tensors; the host reads them in one stacked copy per interval."""
    from torch import nn

    from stepwatch import Model

    from .test_model import SyncCountingTensor, _counting_loss

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    model = Model(net, _counting_loss, torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    recorder = RunRecorder(db=tmp_path / "s.db", transfer_every=8, flush_seconds=60)
    SyncCountingTensor.reads = 0
    model.train(1, make_batches(32, batch_size=2), callbacks=[recorder])
    # One read for the epoch's mean loss, one per chunk of the loss tap (steps 8, ..., 32).
    assert SyncCountingTensor.reads == 1 + 4
    with Store(tmp_path / "s.db") as store:
        assert len(store.metrics(recorder.run_id, "step_loss")[0]) == 32


def test_exception_in_training_marks_run_failed_with_points(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    result = subprocess.run(
        _job("fail-at-step", str(db), "25"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1 and "simulated failure" in result.stderr
    with Store(db) as store:
        run = store.run("fails")
        assert run.status == "failed"
        # The failure is raised in step 25's step-end hook, after step 25 was trained: its loss
        # is recorded.
        assert store.metrics(run.id, "step_loss")[0].tolist() == list(range(1, 26))
        errors = [e for e in store.events(run.id) if e["kind"] == "error"]
        assert errors[0]["message"] == "RuntimeError: simulated failure"


def test_keyboard_interrupt_marks_run_interrupted(tmp_path: Path) -> None:
    def interrupt(rc: Any) -> None:
        if rc.original_args().cur_step_num == 3:
            raise KeyboardInterrupt

    recorder = RunRecorder(db=tmp_path / "s.db")
    with pytest.raises(KeyboardInterrupt):
        make_model().train(
            2, make_batches(4), callbacks=[recorder, LambdaCallback(on_train_step_end=interrupt)]
        )
    with Store(tmp_path / "s.db") as store:
        assert store.run(recorder.run_id).status == "interrupted"


def test_signal_stop_marks_run_interrupted(tmp_path: Path) -> None:
    import os

    from stepwatch import OnRequestExit

    def sigterm(rc: Any) -> None:
        if rc.original_args().cur_step_num == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    recorder = RunRecorder(db=tmp_path / "s.db")
    callbacks = [
        LambdaCallback(on_train_step_end=sigterm),
        OnRequestExit(directory=tmp_path),
        recorder,
    ]
    make_model().train(3, make_batches(4), callbacks=callbacks)
    with Store(tmp_path / "s.db") as store:
        assert store.run(recorder.run_id).status == "interrupted"
        stops = [e["message"] for e in store.events(recorder.run_id) if e["kind"] == "stop"]
        assert stops and "received SIGTERM" in stops[0]


def test_sigkill_keeps_points_up_to_the_last_flush_and_shows_crashed(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    proc = subprocess.Popen(
        _job("train-forever", str(db)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        flushed = [int(proc.stdout.readline()) for _ in range(4)]
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    with Store(db) as store:
        run = store.run("forever")
        assert run.stored_status == "running" and run.status == "crashed"
        steps, _ = store.metrics(run.id, "step_loss")
        # Everything flushed before the kill is there, in order, without gaps.
        assert steps[-1] >= flushed[-1]
        assert steps.tolist() == list(range(1, int(steps[-1]) + 1))


def test_failing_disk_never_raises_into_training(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    result = subprocess.run(
        _job("disk-fails", str(db)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    dropped = int(result.stdout.split("dropped=")[1])
    assert dropped > 0
    assert result.stderr.count("records are being dropped and counted") == 1
    assert f"dropped {dropped} records" in result.stderr
    with Store(db) as store:
        assert len(store.metrics(store.run("disk").id, "step_loss")[0]) >= 16  # sent before the cap


def test_full_queue_waits_then_drops_and_counts(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "s.db", max_pending=10, block_seconds=0.0, flush_seconds=30)
    for i in range(1000):
        writer.log("x", i, i)
    assert writer.dropped > 0
    dropped = writer.dropped
    writer.close()
    with Store(tmp_path / "s.db") as store:
        run = store.run(writer.run_id)
        assert run.dropped == dropped
        assert len(store.metrics(run.id, "x")[0]) == 1000 - dropped


def test_small_queue_wakes_the_writer_instead_of_dropping(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "s.db", max_pending=100, flush_seconds=30)
    for i in range(2000):
        writer.log("x", i, i)
    writer.close()
    assert writer.dropped == 0 and writer.written == 2000


def test_per_class_metrics_are_recorded_as_one_key_per_class(tmp_path: Path) -> None:
    from stepwatch import Precision

    model = make_model(metrics={"precision": Precision(average=None)})
    recorder = RunRecorder(db=tmp_path / "s.db")
    model.fit(1, make_batches(4), make_batches(2), callbacks=[recorder])
    assert recorder.dropped == 0
    with Store(tmp_path / "s.db") as store:
        keys = store.keys(recorder.run_id)
    assert {"train_precision/0", "eval_precision/2", "loss"} <= set(keys)


def test_four_processes_write_one_file_concurrently(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    procs = [
        subprocess.Popen(
            _job("write-points", str(db), "20000"),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        _run_id, written, dropped = map(int, out.split())
        assert (written, dropped) == (20000, 0)
    with Store(db) as store:
        runs = store.runs()
        assert len(runs) == 4 and all(r.status == "finished" for r in runs)
        for run in runs:
            steps, values = store.metrics(run.id, "value")
            assert steps.tolist() == list(range(20000)) and values[-1] == 19999.0


# -- reading ---------------------------------------------------------------------------------
@pytest.fixture
def spiky_store(tmp_path: Path) -> tuple[Path, int]:
    writer = RunWriter(tmp_path / "s.db", name="spiky")
    rng = np.random.default_rng(0)
    for step, value in enumerate(rng.normal(1.0, 0.01, 10_000)):
        writer.log("loss", 1e6 if step == 7_777 else (math.nan if step == 3_333 else value), step)
    writer.close()
    return tmp_path / "s.db", writer.run_id


@pytest.mark.parametrize("max_points", [2, 3, 10, 100, 1000, 5000, 20_000])
def test_downsampling_keeps_a_single_step_spike(spiky_store: Any, max_points: int) -> None:
    db, run = spiky_store
    with Store(db) as store:
        steps, values = store.metrics(run, "loss", max_points=max_points)
    finite = values[~np.isnan(values)]
    assert finite.max() == 1e6 and 7_777 in steps.tolist()
    assert np.isnan(values).any()  # the NaN step survives too
    assert (
        len(steps)
        <= max(max_points, 10_000 if max_points > 10_000 else max_points) + max_points // 2
    )
    assert (np.diff(steps) >= 0).all()


def test_store_errors(tmp_path: Path, spiky_store: Any) -> None:
    db, run = spiky_store
    with pytest.raises(FileNotFoundError, match="no stepwatch database"):
        Store(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "junk.db").write_text("not sqlite")
    with pytest.raises(ValueError, match="not a stepwatch database"):
        Store(tmp_path / "junk.db")
    sqlite3.connect(tmp_path / "other.db").execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ValueError, match="not a stepwatch database"):
        Store(tmp_path / "other.db")
    with Store(db) as store:
        with pytest.raises(KeyError, match="no run 99"):
            store.run(99)
        with pytest.raises(KeyError, match="has no metric 'acc'"):
            store.metrics(run, "acc")
        with pytest.raises(ValueError, match="'max_points' must be an int >= 2"):
            store.metrics(run, "loss", max_points=1)


def test_effective_status_for_dead_and_stale_runs() -> None:
    import os
    import socket

    host, now = socket.gethostname(), time.time()
    assert effective_status("running", host, os.getpid(), now) == "running"
    assert effective_status("running", host, 2**22 + 12345, now) == "crashed"
    assert effective_status("running", "elsewhere", 1, now) == "running"
    assert effective_status("running", "elsewhere", 1, now - 3600) == "crashed"
    assert effective_status("finished", host, 1, now - 3600) == "finished"


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"db": 3}, TypeError, "'db' must be a path"),
        ({"run_name": 3}, TypeError, "'run_name' must be a str"),
        ({"config": [1]}, TypeError, "'config' must be a dict"),
        ({"config": {"f": object()}}, TypeError, "JSON-serialisable"),
        ({"every_n_steps": 0}, ValueError, "needs 'every_n_steps' >= 1"),
        ({"every_n_steps": -1}, ValueError, "'steps' must be an int >= 0"),
        ({"transfer_every": 0}, ValueError, "'transfer_every' must be an int >= 1"),
        ({"flush_seconds": "1"}, TypeError, "'flush_seconds' must be a number"),
    ],
)
def test_run_recorder_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        RunRecorder(**kwargs)


def test_run_writer_args_validation(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'name' must be a str"):
        RunWriter(tmp_path / "s.db", name=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'max_pending' must be an int >= 1"):
        RunWriter(tmp_path / "s.db", max_pending=0)
    writer = RunWriter(tmp_path / "s.db")
    with pytest.raises(ValueError, match="'status' must be one of"):
        writer.close("done")
    writer.close()


def test_env_var_sets_default_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPWATCH_DB", str(tmp_path / "env.db"))
    recorder = RunRecorder()
    make_model().train(1, make_batches(2), callbacks=[recorder])
    assert (tmp_path / "env.db").is_file()


# -- shared building blocks ------------------------------------------------------------------
def test_every_steps_and_seconds() -> None:
    every = Every(steps=3)
    assert [s for s in range(1, 11) if every.due(s)] == [3, 6, 9]
    timed = Every(seconds=0.05)
    assert not timed.due(1)
    time.sleep(0.06)
    assert timed.due(2) and not timed.due(3)
    assert not Every().enabled and not Every().due(100)
    with pytest.raises(ValueError, match="'seconds' must be >= 0"):
        Every(seconds=-1)


def test_pace_ramps_up_from_one_step_ahead() -> None:
    from stepwatch.monitor.schedule import Pace

    pace = Pace(seconds=10.0, most=64)  # steps far faster than its 2.5 s: only the caps bind
    pace.reset(0)
    assert [pace.ahead(step) for step in range(1, 10)] == [2, 4, 8, 16, 32, 64, 64, 64, 64]


def test_ring_buffer_is_bounded_and_ordered() -> None:
    ring = RingBuffer(4)
    for i in range(10):
        ring.append(i, i * 2.0)
    assert ring.steps().tolist() == [6, 7, 8, 9] and ring.values().tolist() == [12, 14, 16, 18]
    assert ring.last() == (9, 18.0) and len(ring) == 4 and ring.total == 10
    ring.extend([10, 11], [1.0, 2.0])
    assert ring.steps().tolist() == [8, 9, 10, 11]
    ring.extend(range(100), np.arange(100.0))
    assert ring.steps().tolist() == [96, 97, 98, 99]
    before = ring._values.__array_interface__["data"][0]
    ring.extend(range(3), [1, 2, 3])
    assert ring._values.__array_interface__["data"][0] == before  # no reallocation
    with pytest.raises(ValueError, match="'capacity' must be an int >= 1"):
        RingBuffer(0)


# -- CLI ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("cli") / "s.db"
    for name, lr in (("slow", 0.01), ("fast", 0.2)):
        model = make_model(metrics={"accuracy"}, lr=lr)
        model.fit(
            3, make_batches(4), make_batches(2), callbacks=[RunRecorder(db=db, run_name=name)]
        )
    return db


def test_cli_runs_show_compare(two_runs: Path) -> None:
    runs = run_cli("runs", "--db", str(two_runs))
    assert runs.returncode == 0, runs.stderr
    lines = runs.stdout.splitlines()
    assert lines[0].split()[:4] == ["id", "name", "status", "steps"]
    assert lines[1].split()[:4] == ["1", "slow", "finished", "12"]
    show = run_cli("show", "fast", "--db", str(two_runs))
    assert show.returncode == 0 and "run 2: fast" in show.stdout and "eval_accuracy" in show.stdout
    compare = run_cli("compare", "1", "2", "--db", str(two_runs))
    assert compare.returncode == 0
    assert "1:slow final" in compare.stdout and "2:fast final" in compare.stdout


def test_cli_export_csv_json_tensorboard(two_runs: Path, tmp_path: Path) -> None:
    for fmt, out in (("csv", "r.csv"), ("json", "r.json"), ("tensorboard", "tb")):
        result = run_cli(
            "export", "1", "--format", fmt, "--out", str(tmp_path / out), "--db", str(two_runs)
        )
        assert result.returncode == 0, result.stderr
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert rows[0] == "key,step,epoch,time,value" and len(rows) > 12
    doc = json.loads((tmp_path / "r.json").read_text())
    # The per-step loss: 'step_loss', or 'loss' in stores written before that name.
    step_key = "step_loss" if "step_loss" in doc["metrics"] else "loss"
    assert doc["run"]["name"] == "slow" and doc["metrics"][step_key]["steps"] == list(range(1, 13))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "1-slow"))  # one subfolder per run
    acc.Reload()
    assert step_key in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars(step_key)] == list(range(1, 13))
    with Store(two_runs) as store:
        expected = store.metrics(1, step_key)[1]
    np.testing.assert_allclose([e.value for e in acc.Scalars(step_key)], expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("show", "42"), "no run '42'"),
        (("show", "nope"), "no run 'nope'"),
        (("compare", "1", "9"), "no run '9'"),
        (("export", "7", "--format", "csv", "--out", "x.csv"), "no run '7'"),
    ],
)
def test_cli_bad_run_is_one_line_exit_2(
    two_runs: Path, args: tuple[str, ...], message: str
) -> None:
    result = run_cli(*args, "--db", str(two_runs))
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_cli_missing_and_corrupt_database(tmp_path: Path) -> None:
    missing = run_cli("runs", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and "no stepwatch database" in missing.stderr
    assert not (tmp_path / "none.db").exists()
    (tmp_path / "bad.db").write_bytes(b"\x00" * 4096)
    corrupt = run_cli("show", "1", "--db", str(tmp_path / "bad.db"))
    assert corrupt.returncode == 2 and "not a stepwatch database" in corrupt.stderr
    assert len(corrupt.stderr.strip().splitlines()) == 1


def test_sigterm_flushes_the_recorder_before_the_process_dies(tmp_path: Path) -> None:
    # Nothing would be written for 60 s: the SIGTERM at step 13 must not lose steps 1-13.
    result = subprocess.run(
        [sys.executable, "-m", "tests.jobs.train_job", "sigterm-at-step", str(tmp_path), "13"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == -signal.SIGTERM, result.stderr  # still dies of the signal
    with Store(tmp_path / "runs.db") as store:
        run = store.runs()[0]
        assert run.status == "interrupted"
        assert store.metrics(run.id, "step_loss")[0].tolist() == list(range(1, 14))
        assert any("SIGTERM" in e["message"] for e in store.events(run.id))
