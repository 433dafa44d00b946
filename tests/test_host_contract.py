"""The contract for a host of one's own: a trainer that is not stepwatch's, with no torch
parameters, driving the run engine through its public API.

``TinyTrainer`` is a whole trainer (linear regression in NumPy, with its own hooks);
``TinyBridge`` is all it takes to run stepwatch's callbacks inside it - the example to follow
when adding the next host (docs: "Adding a host of your own"). The tests drive it with
LossMonitor, AnomalyMonitor (NaN -> stop, spike -> rollback), RunRecorder and a MindSpore-style
user callback, and check the printed lines, the stored points and the actions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stepwatch import AnomalyMonitor, Callback, LossMonitor, RunRecorder
from stepwatch.store import Store
from stepwatch.train.engine import RunEngine
from stepwatch.view.host import HostControls


class TinyTrainer:
    """A trainer of its own: y = x @ w by SGD on NumPy arrays, calling its hooks."""

    def __init__(self, lr: float = 0.1, seed: int = 0, bad: dict[int, float] | None = None):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(80, 4))
        self.y = self.x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=80)
        self.w, self.lr, self.step = np.zeros(4), lr, 0
        self.bad = bad or {}  # step -> factor on that step's inputs (a fault)
        self.stop = False

    def fit(self, epochs: int, hooks: Any) -> None:
        hooks.begin(self, epochs, steps_per_epoch=10)
        for _ in range(epochs):
            for b in range(10):
                x, y = self.x[b * 8 : b * 8 + 8], self.y[b * 8 : b * 8 + 8]
                self.step += 1
                x = x * self.bad.get(self.step, 1.0)
                err = x @ self.w - y
                self.w = self.w - self.lr * 2 * x.T @ err / len(y)
                hooks.step_end(self, float((err**2).mean()))
                if self.stop:
                    break
            hooks.epoch_end(self, {"eval_loss": float(((self.x @ self.w - self.y) ** 2).mean())})
            if self.stop:
                break
        hooks.end(self)


class _Weights:
    """The trainer's state for rollback: a copy of ``w``, put back in place."""

    def __init__(self, trainer: TinyTrainer) -> None:
        self.trainer = trainer
        self.restored: list[np.ndarray] = []  # (for the tests: what rollbacks put back)

    def capture(self) -> np.ndarray:
        return self.trainer.w.copy()

    def restore(self, saved: np.ndarray) -> None:
        self.trainer.w = saved.copy()
        self.restored.append(saved)


class _Rate:
    def __init__(self, trainer: TinyTrainer) -> None:
        self.trainer = trainer

    def get(self) -> list[float]:
        return [self.trainer.lr]

    def set(self, rates: Any) -> None:
        self.trainer.lr = float(rates[0])


class TinyBridge:
    """stepwatch inside TinyTrainer: its hooks drive one RunEngine per fit."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks, self.engine = callbacks, None

    def begin(self, trainer: TinyTrainer, epochs: int, steps_per_epoch: int) -> None:
        controls = HostControls(
            "tiny", state=_Weights(trainer), rates=_Rate(trainer), grads=False, config={"n": 80}
        )
        self.engine = RunEngine(
            self.callbacks,
            controls,
            network=trainer,
            optimizer=trainer,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
        )
        self.engine.open()

    def step_end(self, trainer: TinyTrainer, loss: float) -> None:
        trainer.stop = self._guard(self.engine.step, torch.tensor(loss))

    def epoch_end(self, trainer: TinyTrainer, values: dict[str, float]) -> None:
        trainer.stop = self._guard(self.engine.end_epoch, values) or trainer.stop

    def end(self, trainer: TinyTrainer) -> None:
        self.engine.close()

    def _guard(self, fn: Any, arg: Any) -> bool:
        try:
            return fn(arg)
        except BaseException as exc:  # a callback failed: the run ends 'failed', then raise
            self.engine.close(exc)
            raise


class SeenByUser(Callback):
    """A MindSpore-style user callback: the old hook names and original_args()."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.epochs: list[tuple[int, float]] = []

    def step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.steps.append(p.cur_step_num)
        assert p.network is not None and float(p.net_outputs) >= 0

    def epoch_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.epochs.append((p.cur_epoch_num, p.eval_results["eval_loss"]))


def _points(db: Path, key: str) -> list[tuple[int, float]]:
    with Store(db) as store:
        steps, values = store.metrics(store.runs()[-1].id, key)
    return list(zip(steps, values))


def _run(db: Path) -> Any:
    with Store(db) as store:
        return store.runs()[-1]


def _alerts(db: Path) -> list[dict[str, Any]]:
    with Store(db) as store:
        return [e for e in store.events(store.runs()[-1].id) if e["kind"] == "alert"]


def test_a_host_of_ones_own_prints_records_and_calls_user_callbacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    user = SeenByUser()
    trainer = TinyTrainer()
    trainer.fit(3, TinyBridge([LossMonitor(5), RunRecorder(db=str(db)), user]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch:")]
    assert [line.split(", loss is")[0] for line in lines] == [
        f"epoch: {e} step: {s}" for e in (1, 2, 3) for s in (5, 10)
    ]
    assert user.steps == list(range(1, 31))
    assert [e for e, _ in user.epochs] == [1, 2, 3]
    assert user.epochs[-1][1] < user.epochs[0][1]  # it learns
    run = _run(db)
    assert run.status == "finished" and run.config["host"] == "tiny"
    losses = _points(db, "step_loss")
    assert [s for s, _ in losses] == list(range(1, 31))
    assert [round(v, 4) for _, v in _points(db, "eval_loss")] == [
        round(v, 4) for _, v in user.epochs
    ]
    assert [v for _, v in _points(db, "lr")][-1] == pytest.approx(0.1)


def test_a_nan_stops_the_host_and_the_run_is_stored_as_an_anomaly(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    trainer = TinyTrainer(bad={13: float("nan")})
    bridge = TinyBridge([AnomalyMonitor(action={"nonfinite": "stop"}), RunRecorder(db=str(db))])
    trainer.fit(3, bridge)
    assert trainer.step == 13  # stopped after the step whose loss was NaN
    assert bridge.engine is not None and bridge.engine.stop_kind == "anomaly"
    assert "nonfinite at step 13" in (bridge.engine.stop_reason or "")
    assert _run(db).status == "anomaly"
    assert [a["step"] for a in _alerts(db)] == [13]


def test_a_spike_is_rolled_back_through_the_hosts_own_state(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    trainer = TinyTrainer(lr=0.05, bad={145: 30.0})  # one batch's inputs x30: a loss spike
    kept: list[np.ndarray] = []

    class Watch(Callback):  # the weights after step 140, where a copy is taken
        def on_train_step_end(self, run_context: Any) -> None:
            if run_context.cb_params.cur_step_num == 140:
                kept.append(trainer.w.copy())

    monitor = AnomalyMonitor(action={"spike": "rollback"}, rollback_every=20)
    bridge = TinyBridge([monitor, Watch(), RunRecorder(db=str(db))])
    trainer.fit(20, bridge)
    assert bridge.engine is not None
    assert bridge.engine.rollbacks == [(140, 145)]
    state = bridge.engine.view.state
    assert isinstance(state, _Weights) and len(state.restored) == 1
    np.testing.assert_array_equal(state.restored[0], kept[0])  # the host's own copy came back
    assert trainer.step == 200 and np.abs(trainer.w - [1.0, -2.0, 0.5, 3.0]).max() < 0.05
    (alert,) = _alerts(db)
    assert alert["step"] == 145 and "rolled back to step 140" in str(alert)
    assert _run(db).status == "finished"
