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

from stepwatch import EarlyStopping, History, RunRecorder, Store
from stepwatch.monitor import values
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
    logged = [1.5, 2, np.float32(0.25), torch.tensor(4.0), None, "x", True]
    for step, value in enumerate(logged):
        writer.log("v", value, np.int64(step), epoch=np.int64(1) if step % 2 else None)
    writer.log("w", 7.0, 0)
    writer.close()
    assert writer.written == len(logged) + 1 and writer.dropped == 0
    with Store(tmp_path / "s.db") as store:
        steps, stored = store.metrics(writer.run_id, "v")
        points = store.points(writer.run_id)
    assert steps.tolist() == list(range(len(logged)))
    assert stored[:4].tolist() == [1.5, 2.0, 0.25, 4.0] and stored[6] == 1.0
    assert np.isnan(stored[4]) and np.isnan(stored[5])  # not numbers: stored as NULL
    assert [e for k, _, e, _, _ in points if k == "v"] == [None, 1, None, 1, None, 1, None]
    assert ("w", 0) in {(k, s) for k, s, *_ in points}
