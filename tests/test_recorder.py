"""RunRecorder and RunWriter: the store's value names, and what recording costs the training
thread (the store's crash, back-pressure and concurrency tests are in test_store.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

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
