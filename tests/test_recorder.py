"""RunRecorder and RunWriter: the store's value names, and what recording costs the training
thread (the store's crash, back-pressure and concurrency tests are in test_store.py)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stepwatch import Callback, EarlyStopping, History, RunContext, RunRecorder, Store
from stepwatch.monitor import values
from stepwatch.train.callback import ORDER_RECORD
from stepwatch.train.metrics import Metric

from .conftest import make_batches, make_model

STEP_KEYS = {values.STEP_LOSS, values.STEP_TIME, values.LR}


def _fit_one_epoch(db: Path, metrics: Any, monitors: list[str]) -> tuple[History, RunRecorder]:
    history = History()
    recorder = RunRecorder(db=db)
    watchers = [EarlyStopping(monitor=name, patience=5) for name in monitors]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is not available.*")
        make_model(metrics=metrics).fit(
            1, make_batches(4), make_batches(2), callbacks=[history, *watchers, recorder]
        )
    for watcher in watchers:
        assert watcher.best == pytest.approx(history.history[watcher.monitor][0], abs=1e-12)
    return history, recorder


def test_store_epoch_keys_are_history_names_that_early_stopping_accepts(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    _, recorder = _fit_one_epoch(db, {"accuracy"}, [])
    with Store(db) as store:
        epoch_keys = set(store.keys(recorder.run_id)) - STEP_KEYS
    assert epoch_keys == {"loss", "train_accuracy", "eval_loss", "eval_accuracy"}

    # The same names, watched by EarlyStopping in another run: no "not available" warning,
    # and each watcher sees what History and the store hold.
    history, recorder = _fit_one_epoch(tmp_path / "t.db", {"accuracy"}, sorted(epoch_keys))
    assert epoch_keys <= set(history.history)
    with Store(tmp_path / "t.db") as store:
        for key in sorted(epoch_keys):
            steps, stored = store.metrics(recorder.run_id, key)
            assert steps.tolist() == [4]
            assert stored[0] == pytest.approx(history.history[key][0], abs=1e-6), key


def test_step_loss_is_per_step_and_loss_is_the_epoch_mean(tmp_path: Path) -> None:
    history, recorder = _fit_one_epoch(tmp_path / "s.db", {"accuracy"}, [])
    with Store(tmp_path / "s.db") as store:
        steps, step_losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        _, epoch_loss = store.metrics(recorder.run_id, values.LOSS)
    assert steps.tolist() == [1, 2, 3, 4]
    assert epoch_loss[0] == pytest.approx(step_losses.mean(), rel=1e-5)
    assert epoch_loss[0] == pytest.approx(history.history["loss"][0], abs=1e-6)


class _Score(Metric):
    """A metric that declares smaller is better, under a name the name rule would maximise."""

    direction = "min"

    def clear(self) -> None:
        self.total = 0.0

    def update(self, outputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.total += float(outputs.detach().abs().mean())

    def eval(self) -> float:
        return self.total


def test_config_holds_the_direction_of_every_epoch_key(tmp_path: Path) -> None:
    recorder = RunRecorder(db=tmp_path / "s.db")
    make_model(metrics={"accuracy": "accuracy", "score": _Score()}).fit(
        1, make_batches(2), make_batches(1), callbacks=[recorder]
    )
    with Store(tmp_path / "s.db") as store:
        run = store.run(recorder.run_id)
        epoch_keys = set(store.keys(run.id)) - STEP_KEYS
    assert run.config["directions"] == {
        "loss": "min",
        "train_accuracy": "max",
        "train_score": "min",
        "eval_loss": "min",
        "eval_accuracy": "max",
        "eval_score": "min",
    }
    assert epoch_keys == set(run.config["directions"])


def test_train_without_validation_has_no_eval_keys(tmp_path: Path) -> None:
    recorder = RunRecorder(db=tmp_path / "s.db")
    make_model(metrics={"accuracy"}).train(1, make_batches(2), callbacks=[recorder])
    with Store(tmp_path / "s.db") as store:
        run = store.run(recorder.run_id)
        assert set(store.keys(run.id)) - STEP_KEYS == {"loss", "train_accuracy"}
    assert run.config["directions"] == {"loss": "min", "train_accuracy": "max"}


# -- the writer's bulk rows ------------------------------------------------------------------
def test_log_batch_takes_a_range_an_array_or_a_list_of_steps(tmp_path: Path) -> None:
    from stepwatch import RunWriter

    writer = RunWriter(tmp_path / "s.db", flush_seconds=30)
    writer.log_batch(
        "a", range(10, 14), torch.tensor([1.0, 2.0, 3.0, 4.0]), epoch=1, span=(100, 104)
    )
    writer.log_batch("b", np.array([3, 7, 9]), np.array([0.5, np.nan, np.inf]), times=[1, 2, 3])
    steps = [1, 2]
    writer.log_batch("c", steps, [5.0, 6.0])
    steps.append(3)  # the writer copied the list: this changes nothing
    writer.close()
    assert writer.written == 9 and writer.dropped == 0
    with Store(tmp_path / "s.db") as store:
        rows = {(k, s): (e, t, v) for k, s, e, t, v in store.points(writer.run_id)}
    # Times are spread evenly over (start, end]: the last point gets the end.
    assert [rows[("a", s)] for s in range(10, 14)] == [(1, 101.0 + i, 1.0 + i) for i in range(4)]
    assert rows[("b", 3)] == (None, 1.0, 0.5) and math.isnan(rows[("b", 7)][2])
    assert rows[("b", 9)][2] == math.inf
    assert {s for k, s in rows if k == "c"} == {1, 2}


def test_log_converts_odd_values_on_the_writer_thread(tmp_path: Path) -> None:
    from stepwatch import RunWriter

    writer = RunWriter(tmp_path / "s.db", flush_seconds=30)
    logged = [1.5, 2, np.float32(0.25), torch.tensor(4.0), True, float("nan")]
    for step, value in enumerate(logged):
        writer.log("v", value, np.int64(step), epoch=np.int64(1) if step % 2 else None)
    writer.log("w", 7.0, 0)
    # What is not one number, a key that is not one, a step that is not a count: refused.
    for key, value, step, error in (
        ("v", None, 9, TypeError),
        ("v", "abc", 9, TypeError),
        ("v", [1.0], 9, TypeError),
        ("v", 1j, 9, TypeError),
        ("", 1.0, 9, TypeError),
        ("v", 1.0, -1, ValueError),
        ("v", 1.0, 2.5, TypeError),
    ):
        with pytest.raises(error):
            writer.log(key, value, step)  # type: ignore[arg-type]
    writer.close()
    assert writer.written == len(logged) + 1 and writer.dropped == 0
    with Store(tmp_path / "s.db") as store:
        steps, stored = store.metrics(writer.run_id, "v")
        points = store.points(writer.run_id)
    assert steps.tolist() == list(range(len(logged)))
    assert stored[:5].tolist() == [1.5, 2.0, 0.25, 4.0, 1.0] and np.isnan(stored[5])
    assert [e for k, _, e, _, _ in points if k == "v"] == [None, 1, None, 1, None, 1]
    assert ("w", 0) in {(k, s) for k, s, *_ in points}


# -- recording every step: a bare append per step ------------------------------------------
class _Seen(Callback):
    """Keeps every step's loss, at a given order relative to the recorder."""

    def __init__(self, order: int, fail_at: int | None = None) -> None:
        self.order = order
        self.fail_at = fail_at
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        if p.cur_step_num == self.fail_at:
            raise RuntimeError("boom")
        self.steps.append(p.cur_step_num)
        self.losses.append(p.loss)


def test_every_step_is_recorded_across_transfers_and_epochs(tmp_path: Path) -> None:
    seen = _Seen(order=0)
    recorder = RunRecorder(db=tmp_path / "s.db", transfer_every=3)
    make_model().train(3, make_batches(5), callbacks=[seen, recorder])
    with Store(tmp_path / "s.db") as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        points = [p for p in store.points(recorder.run_id) if p[0] == values.STEP_LOSS]
    assert steps.tolist() == seen.steps == list(range(1, 16))
    np.testing.assert_allclose(losses, seen.losses, rtol=1e-6)
    assert [p[2] for p in points] == [1] * 5 + [2] * 5 + [3] * 5  # each step's epoch
    times = [p[3] for p in points]
    assert times == sorted(times)


@pytest.mark.parametrize("order", [0, ORDER_RECORD + 1])
def test_a_failing_step_hook_keeps_every_trained_step(tmp_path: Path, order: int) -> None:
    # A callback fails at step 7's end, before or after the recorder's turn: step 7 was
    # trained (its update is done) and its loss is in the run's loss tap before any hook runs,
    # so it is recorded either way.
    recorder = RunRecorder(db=tmp_path / "s.db", transfer_every=4)
    with pytest.raises(RuntimeError, match="boom"):
        make_model().train(2, make_batches(5), callbacks=[recorder, _Seen(order, fail_at=7)])
    with Store(tmp_path / "s.db") as store:
        run = store.run(recorder.run_id)
        assert run.status == "failed"
        assert store.metrics(run.id, values.STEP_LOSS)[0].tolist() == list(range(1, 8))


def test_recording_every_step_reads_the_clock_once_per_16_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import stepwatch.store.recorder as recorder_module

    reads: list[str] = []

    class Clock:
        def monotonic(self) -> float:
            reads.append("monotonic")
            return time.monotonic()

        def time(self) -> float:
            reads.append("time")
            return time.time()

    recorder = RunRecorder(db=tmp_path / "s.db", transfer_every=1000, flush_seconds=60)
    monkeypatch.setattr(recorder_module, "time", Clock())
    make_model().train(1, make_batches(64, batch_size=2), callbacks=[recorder])
    # Train begin (2), a look every 16 steps (4), the epoch-end transfer (2), train end (2).
    assert len(reads) <= 10
    with Store(tmp_path / "s.db") as store:
        assert len(store.metrics(recorder.run_id, values.STEP_LOSS)[0]) == 64


def test_every_n_seconds_records_a_subset_of_steps(tmp_path: Path) -> None:
    recorder = RunRecorder(db=tmp_path / "s.db", every_n_steps=None, every_n_seconds=1e-4)
    make_model().train(2, make_batches(20), callbacks=[recorder])
    with Store(tmp_path / "s.db") as store:
        steps = store.metrics(recorder.run_id, values.STEP_LOSS)[0].tolist()
    assert steps and steps == sorted(set(steps)) and set(steps) <= set(range(1, 41))


def test_losses_that_are_not_one_tensor_are_stacked_anyway() -> None:
    from stepwatch._tensor import stack_losses as _stack

    stacked = _stack([torch.tensor(1.0), 2.0, (torch.tensor([3.0]), "aux"), None, "x"])
    assert stacked.dtype == torch.float32
    np.testing.assert_array_equal(stacked.numpy()[:3], [1.0, 2.0, 3.0])
    assert stacked[3:].isnan().all()
    grad = torch.tensor(2.0, requires_grad=True) * 1.5
    assert not _stack([grad, grad]).requires_grad


@pytest.mark.parametrize(("limit", "rows"), [(250_000, 256), (32_766, 256), (999, 128), (7, 1)])
def test_inserts_stay_within_sqlites_parameter_limit(tmp_path: Path, limit: int, rows: int) -> None:
    import sqlite3

    from stepwatch import RunWriter
    from stepwatch.store.backends.sqlite_write import _rows_per_insert

    writer = RunWriter(tmp_path / "s.db", flush_seconds=30)
    backend = writer._backend  # the SQLite backend: it holds the connection
    backend._conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)
    backend._rows_per_insert = _rows_per_insert(backend._conn)
    assert backend._rows_per_insert == rows
    for step in range(301):  # 301 = 256 + 32 + 8 + 4 + 1 rows: statements of each size
        writer.log("x", step * 0.5, step)
    writer.log_batch("y", range(1000), np.arange(1000.0))
    writer.close()
    assert writer.written == 1301 and writer.dropped == 0
    with Store(tmp_path / "s.db") as store:
        steps, stored = store.metrics(writer.run_id, "x")
        assert steps.tolist() == list(range(301)) and stored.tolist() == [
            s * 0.5 for s in range(301)
        ]
        assert store.metrics(writer.run_id, "y")[1].tolist() == list(np.arange(1000.0))
