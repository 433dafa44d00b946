"""Reading the run store: ranges and live polling, the runs summary, filters, threads, leaving
no files behind, deleting runs and exporting non-finite numbers."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from stepwatch import RunWriter, Store
from stepwatch.store.export import export_run
from stepwatch.store.reader import LossStats, delete_runs


def _sidecars(db: Path) -> list[str]:
    return sorted(p.name for p in db.parent.iterdir() if p.name.startswith(db.name + "-"))


def write_run(
    db: Path,
    name: str,
    step_losses: list[float] | None = None,
    epoch_losses: list[float] | None = None,
    steps_per_epoch: int = 10,
    config: dict[str, object] | None = None,
    extra: dict[str, list[float]] | None = None,
    status: str = "finished",
) -> int:
    """A finished run with today's key names: ``step_loss`` per step, ``loss`` per epoch."""
    writer = RunWriter(db, name=name, config=config)
    for step, value in enumerate(step_losses or [], start=1):
        writer.log("step_loss", value, step, (step - 1) // steps_per_epoch + 1)
    for epoch, value in enumerate(epoch_losses or [], start=1):
        writer.log("loss", value, epoch * steps_per_epoch, epoch)
    for key, values in (extra or {}).items():
        for epoch, value in enumerate(values, start=1):
            writer.log(key, value, epoch * steps_per_epoch, epoch)
    writer.close(status)
    return writer.run_id


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "s.db"
    write_run(path, "full", [3.0 - 0.1 * i for i in range(20)], [2.5, 1.5])
    write_run(path, "steps-only", [4.0, 2.0, 3.0])
    write_run(path, "lr=0.1", [1.0] * 10, [0.9], status="failed")
    return path


# -- metrics: ranges and polling ------------------------------------------------------------
def test_metrics_start_end_and_after_select_steps(db: Path) -> None:
    with Store(db) as store:
        steps, values = store.metrics("full", "step_loss", start=5, end=8)
        assert steps.tolist() == [5, 6, 7, 8]
        np.testing.assert_allclose(values, [2.6, 2.5, 2.4, 2.3])
        assert store.metrics("full", "step_loss", after=17)[0].tolist() == [18, 19, 20]
        assert store.metrics("full", "step_loss", start=3, after=17, end=19)[0].tolist() == [
            18,
            19,
        ]
        steps, values = store.metrics("full", "step_loss", after=20)
        assert steps.dtype == np.int64 and values.dtype == np.float64
        assert steps.tolist() == [] and values.tolist() == []
        # Downsampling applies inside the range.
        steps, _ = store.metrics("full", "step_loss", start=11, max_points=4)
        assert len(steps) <= 4 and steps.min() >= 11
        with pytest.raises(KeyError, match="has no metric 'nope'"):
            store.metrics("full", "nope", after=0)
        with pytest.raises(KeyError, match="has no metric 'loss'"):
            store.metrics("steps-only", "loss", start=0)
        with pytest.raises(TypeError, match="'after' must be an int or None"):
            store.metrics("full", "step_loss", after=1.5)  # type: ignore[arg-type]


def test_metrics_after_follows_a_live_run(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    writer = RunWriter(db, name="live", flush_seconds=60)
    try:
        for step in range(1, 4):
            writer.log("step_loss", float(step), step)
        assert writer.flush()
        with Store(db) as store:
            steps, _ = store.metrics("live", "step_loss")
            assert steps.tolist() == [1, 2, 3] and store.run("live").status == "running"
            for step in range(4, 6):
                writer.log("step_loss", float(step), step)
            assert writer.flush()
            assert store.metrics("live", "step_loss", after=int(steps[-1]))[0].tolist() == [4, 5]
            assert store.run("live").steps == 5
    finally:
        writer.close()


# -- the runs summary -----------------------------------------------------------------------
def test_runs_summary_uses_epoch_mean_loss_else_step_loss(db: Path) -> None:
    with Store(db) as store:
        pairs = store.runs_summary()
        assert [(run.name, run.steps) for run, _ in pairs] == [
            ("full", 20),
            ("steps-only", 3),
            ("lr=0.1", 10),
        ]
        full, steps_only, last = (loss for _, loss in pairs)
        assert full == LossStats("loss", True, last=1.5, min=1.5, count=2, last_step=20)
        assert steps_only == LossStats("step_loss", False, last=3.0, min=2.0, count=3, last_step=3)
        assert last is not None and last.key == "loss" and last.min == 0.9
        assert store.loss_stats("full") == full


def test_runs_summary_reads_stores_from_before_the_step_loss_name(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    # Older stores: 'loss' per step, 'epoch_loss' per epoch.
    writer = RunWriter(db, name="old")
    for step in range(1, 21):
        writer.log("loss", 5.0 - 0.1 * step, step, (step - 1) // 10 + 1)
    writer.log("epoch_loss", 4.0, 10, 1)
    writer.log("epoch_loss", 3.5, 20, 2)
    writer.close()
    writer = RunWriter(db, name="old-no-epoch")
    for step in range(1, 6):
        writer.log("loss", float(step), step, 1)
    writer.close()
    with Store(db) as store:
        old, no_epoch = (loss for _, loss in store.runs_summary())
    assert old is not None and (old.key, old.epoch_mean, old.min) == ("epoch_loss", True, 3.5)
    assert no_epoch is not None and (no_epoch.key, no_epoch.epoch_mean) == ("loss", False)
    assert no_epoch.min == 1.0 and no_epoch.last == 5.0


def test_runs_summary_is_one_query_for_all_runs(db: Path) -> None:
    for i in range(5):
        write_run(db, f"more-{i}", [1.0, 2.0], [1.5])
    with Store(db) as store:
        statements: list[str] = []
        store._sql.conn.set_trace_callback(statements.append)
        pairs = store.runs_summary()
        store._sql.conn.set_trace_callback(None)
    assert len(pairs) == 8
    queries = [s for s in statements if s.strip().upper().startswith(("SELECT", "WITH"))]
    assert len(queries) == 1


def test_runs_filters_by_name_status_and_last(db: Path) -> None:
    with Store(db) as store:

        def names(**kwargs: object) -> list[str]:
            return [r.name for r in store.runs(**kwargs)]  # type: ignore[arg-type]

        assert names(name="only") == ["steps-only"]
        assert names(name="lr=*") == ["lr=0.1"]
        assert names(name="*l*") == ["full", "steps-only", "lr=0.1"]
        assert names(name="LR") == []  # case-sensitive
        assert names(status="failed") == ["lr=0.1"]
        assert names(status="finished") == ["full", "steps-only"]
        assert names(status="finished", last=1) == ["steps-only"]
        assert names(last=2) == ["steps-only", "lr=0.1"]
        assert [r.name for r, _ in store.runs_summary(name="f", last=1)] == ["full"]
        assert [r.name for r, _ in store.runs_summary(status="crashed")] == []
        with pytest.raises(ValueError, match="'status' must be one of"):
            store.runs(status="done")
        with pytest.raises(ValueError, match="'last' must be an int >= 1"):
            store.runs(last=0)


def test_runs_status_filter_sees_a_dead_running_run_as_crashed(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    write_run(db, "ok", [1.0])
    writer = RunWriter(db, name="dead")
    writer.close()
    conn = sqlite3.connect(db)
    with conn:  # a run whose process is gone: stored as running, pid of no process
        conn.execute("UPDATE runs SET status = 'running', pid = 2147483646 WHERE name = 'dead'")
    conn.close()
    with Store(db) as store:
        assert [r.name for r in store.runs(status="crashed")] == ["dead"]
        assert [r.name for r in store.runs(status="running")] == []


# -- threads --------------------------------------------------------------------------------
def test_one_store_shared_by_threads_while_a_run_is_written(db: Path) -> None:
    writer = RunWriter(db, name="growing", flush_seconds=0.01)
    stop = threading.Event()

    def write() -> None:
        step = 0
        while not stop.is_set() and step < 100_000:
            step += 1
            writer.log("step_loss", 1.0 / step, step)
            if step % 50 == 0:
                writer.flush()

    with Store(db) as store:
        expected = store.metrics("full", "step_loss")[1].tolist()

        def read(i: int) -> int:
            for _ in range(30):
                assert [r.name for r in store.runs()][:3] == ["full", "steps-only", "lr=0.1"]
                assert store.metrics("full", "step_loss")[1].tolist() == expected
                assert store.summary("full")["loss"]["count"] == 2
                if "step_loss" in store.keys("growing"):
                    steps, _ = store.metrics("growing", "step_loss", after=i)
                    assert np.all(np.diff(steps) == 1)  # one consistent snapshot per call
            return i

        thread = threading.Thread(target=write)
        thread.start()
        try:
            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(read, i) for i in range(6)]
                assert [f.result(timeout=60) for f in futures] == list(range(6))
        finally:
            stop.set()
            thread.join(30)
            writer.close()


# -- files beside the database --------------------------------------------------------------
def test_reading_leaves_no_wal_or_shm_files(db: Path) -> None:
    assert _sidecars(db) == []
    with Store(db) as store:
        store.runs_summary()
        store.metrics("full", "step_loss", max_points=4)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store._sql.conn.execute("DELETE FROM runs")  # reading never writes
    assert _sidecars(db) == []
    with Store(db) as store:
        assert len(store.runs()) == 3


def test_a_reader_open_while_the_writer_closes_cleans_up(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    writer = RunWriter(db, name="live")
    writer.log("step_loss", 1.0, 1)
    assert writer.flush()
    store = Store(db)
    assert store.metrics("live", "step_loss")[0].tolist() == [1]
    writer.close()
    assert store.run("live").status == "finished"
    store.close()
    assert _sidecars(db) == []


def test_a_file_we_may_not_write_is_read_in_place(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests may run as root, who can write anything: pretend the file is read-only.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with Store(db) as store:
        assert [r.name for r in store.runs()] == ["full", "steps-only", "lr=0.1"]
        assert store.metrics("full", "loss")[0].tolist() == [10, 20]
    assert _sidecars(db) == []


# -- deleting -------------------------------------------------------------------------------
def test_delete_runs_removes_points_events_and_the_run(db: Path) -> None:
    with Store(db) as store:
        before = len(store.points("full"))
    writer = RunWriter(db, name="with-event")
    writer.event("note", "hello", step=1)
    writer.close()
    deleted = delete_runs(db, ["full", "4"])
    assert [(r.id, r.name) for r in deleted] == [(1, "full"), (4, "with-event")]
    with Store(db) as store:
        assert [r.name for r in store.runs()] == ["steps-only", "lr=0.1"]
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM points WHERE run IN (1, 4)").fetchone() == (0,)
    assert conn.execute("SELECT COUNT(*) FROM events WHERE run IN (1, 4)").fetchone() == (0,)
    conn.close()
    assert before == 22
    assert delete_runs(db, []) == []


def test_delete_runs_is_all_or_nothing(db: Path) -> None:
    writer = RunWriter(db, name="live")
    try:
        with pytest.raises(ValueError, match=r"run 4 \(live\) is still running"):
            delete_runs(db, ["full", "live"])
        with pytest.raises(KeyError, match="no run 'nope'"):
            delete_runs(db, ["full", "nope"])
        with Store(db) as store:
            assert [r.name for r in store.runs()] == ["full", "steps-only", "lr=0.1", "live"]
    finally:
        writer.close()
    assert [r.name for r in delete_runs(db, ["live"])] == ["live"]


# -- export ---------------------------------------------------------------------------------
def test_json_export_writes_infinities_as_strings_and_nan_as_null(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    writer = RunWriter(db, name="inf", config={"clip": math.inf, "floor": -math.inf})
    for step, value in enumerate([1.0, math.inf, -math.inf, math.nan], start=1):
        writer.log("step_loss", value, step)
    writer.event("alert", "diverged", step=2, data={"value": math.inf})
    writer.close()
    with Store(db) as store:
        path = export_run(store, "inf", "json", tmp_path / "r.json")

    def strict(token: str) -> float:
        raise AssertionError(f"non-standard JSON token {token}")

    doc = json.loads(path.read_text(), parse_constant=strict)
    assert doc["metrics"]["step_loss"]["values"] == [1.0, "Infinity", "-Infinity", None]
    assert doc["run"]["config"] == {"clip": "Infinity", "floor": "-Infinity"}
    assert doc["events"][0]["data"] == {"value": "Infinity"}
    assert [float(v) for v in doc["metrics"]["step_loss"]["values"][:3]] == [1, math.inf, -math.inf]
