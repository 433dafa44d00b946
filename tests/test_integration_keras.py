"""stepwatch.integrations.keras: stepwatch's callbacks inside Keras 3's model.fit (torch
backend), against the real Keras."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ["KERAS_BACKEND"] = "torch"  # before keras is first imported

import keras
import numpy as np
import pytest
import torch

from stepwatch import (
    AnomalyMonitor,
    LossMonitor,
    ProgressBar,
    RunRecorder,
    Store,
)
from stepwatch.integrations.keras import ScaledSchedule, StepwatchCallback
from stepwatch.monitor import values

from .bridge_support import SeedStyle, assert_loss_monitor_lines, assert_stopped_for_anomaly

BATCH = 4
STEPS = 16  # batches per epoch: 64 samples, 4 a batch


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(64, 4).astype("float32")
    y = (x.sum(1, keepdims=True) > 0).astype("float32")
    return x, y


def _layers() -> list[Any]:
    return [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]


class RecordingModel(keras.Sequential):
    """A Sequential whose own compute_loss keeps what the trainer computed at each training
    step: the loss, and the global norm of the kernels' gradients (by autograd, apart from the
    ``.grad`` the trainer's backward fills). ``poison`` scales the loss at some steps (a NaN or
    a spike, as a bad batch would); ``fail`` raises at a step."""

    def __init__(
        self, poison: dict[int, float] | None = None, fail: dict[int, BaseException] | None = None
    ) -> None:
        super().__init__(_layers())
        self.poison = poison or {}
        self.fail = fail or {}
        self.computed: list[float] = []
        self.grad_norms: list[float] = []

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        if not training:  # building, or validation
            return loss
        step = len(self.computed) + 1
        if step in self.fail:
            raise self.fail[step]
        loss = loss * self.poison.get(step, 1.0)
        kernels = [w.value for w in self.trainable_weights if len(w.shape) >= 2]
        grads = torch.autograd.grad(loss, kernels, retain_graph=True)
        self.grad_norms.append(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))))
        self.computed.append(float(loss.detach()))
        return loss


def _compiled(model: Any, lr: Any = 0.05) -> Any:
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss="mse")
    return model


def _fit(model: Any, callbacks: list[Any], epochs: int = 3, **kwargs: Any) -> Any:
    x, y = _data()
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks, **kwargs)  # fmt: skip


class GradReader(SeedStyle):
    """The seed-style callback, also reading the gradients on cb_params.network when a step
    ends."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_norms: list[float] = []

    def step_end(self, run_context: Any) -> None:
        super().step_end(run_context)
        p = run_context.original_args()
        grads = [w.grad for _, w in p.network.named_parameters() if w.dim() >= 2]
        self.grad_norms.append(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))))


def test_a_keras_fit_is_watched_recorded_and_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    keras.utils.set_random_seed(0)
    db = tmp_path / "runs.db"
    recorder, user = RunRecorder(db=db, run_name="keras"), GradReader()
    model = _compiled(RecordingModel())
    bridge = StepwatchCallback([recorder, AnomalyMonitor(), LossMonitor(10), user])
    x, y = _data()
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        history = _fit(model, [bridge], validation_data=(x[:16], y[:16]))
    computed = model.computed
    assert len(computed) == 3 * STEPS
    out = capsys.readouterr().out
    assert_loss_monitor_lines(out, computed)  # MindSpore's lines, 16 steps an epoch
    # The user's callback saw every step, numbered as Model.train numbers them, with the loss
    # the trainer computed and the gradients its backward left on the network.
    assert [s for s, _, _ in user.seen] == list(range(1, 3 * STEPS + 1))
    assert [e for _, e, _ in user.seen] == [1] * STEPS + [2] * STEPS + [3] * STEPS
    np.testing.assert_allclose([v for _, _, v in user.seen], computed, rtol=1e-6)
    np.testing.assert_allclose(user.grad_norms, model.grad_norms, rtol=1e-5)
    assert user.epochs == [1, 2, 3]
    assert "gives no gradients" not in caplog.text  # the gradient detectors are on
    assert bridge.stop_reason is None and bridge.run is not None and not bridge.run.stop_kind
    # fit's own methods are back as they were.
    assert "compute_loss" not in model.__dict__
    assert not hasattr(model.train_function, "_stepwatch_wrapped")
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "finished" and info.config["host"] == "keras"
        host = info.config["host_config"]
        assert host["keras"] == keras.__version__ and host["backend"] == "torch"
        assert host["model"] == model.name and host["model_class"] == "RecordingModel"
        assert (host["epochs"], host["steps"], host["optimizer"]) == (3, STEPS, "SGD")
        assert host["optimizer_config"]["learning_rate"] == pytest.approx(0.05)
        steps, losses = store.metrics(info.id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 3 * STEPS + 1))
        np.testing.assert_allclose(losses, computed, rtol=1e-6)  # the losses Keras computed
        # The epoch values are Keras's own: its epoch mean and its validation loss.
        epoch_steps, epoch_losses = store.metrics(info.id, values.LOSS)
        assert epoch_steps.tolist() == [STEPS, 2 * STEPS, 3 * STEPS]
        np.testing.assert_allclose(epoch_losses, history.history["loss"], rtol=1e-6)
        np.testing.assert_allclose(epoch_losses[0], np.mean(computed[:STEPS]), rtol=1e-5)
        _, eval_losses = store.metrics(info.id, values.EVAL_LOSS)
        np.testing.assert_allclose(eval_losses, history.history["val_loss"], rtol=1e-6)
        assert store.metrics(info.id, values.LR)[1][-1] == pytest.approx(0.05)


def test_a_nan_stops_fit_and_the_run_is_an_anomaly_in_the_store_and_dashboard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keras.utils.set_random_seed(0)
    db = tmp_path / "runs.db"
    recorder, monitor = RunRecorder(db=db), AnomalyMonitor(action={"nonfinite": "stop"})
    model = _compiled(RecordingModel(poison={5: math.nan}))
    bridge = StepwatchCallback([LossMonitor(4), monitor, recorder])
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        history = _fit(model, [bridge], epochs=5)
    # A CPU loss is read as it comes, and a NaN wakes the monitor on its step: the NaN of step
    # 5 stops fit at step 5, mid-epoch 1.
    assert len(model.computed) == 5 and len(history.epoch) == 1
    assert math.isnan(model.computed[4]) and model.stop_training
    assert bridge.stop_reason == "nonfinite at step 5"
    assert [a.kind for a in monitor.alerts] == ["nonfinite"]
    assert "stopping training" in caplog.text
    assert_stopped_for_anomaly(db, recorder.run_id, alert_step=5, last_step=5)


def _spike_weights() -> np.ndarray:
    """Sample weights that make the 14th batch's loss 10^4 times the others (a spike at step
    14 of a one-epoch fit)."""
    weights = np.ones(64, dtype="float32")
    weights[13 * BATCH : 14 * BATCH] = 1e4
    return weights


def test_snapshot_and_reduce_lr_act_on_keras_and_the_snapshot_loads(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model = _compiled(keras.Sequential(_layers()))  # a Keras class: load_model needs no registry
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 10}},
        action={"spike": ["snapshot", "reduce_lr"]},
        snapshot_dir=tmp_path / "snaps",
    )
    _fit(model, [StepwatchCallback([monitor])], epochs=1, sample_weight=_spike_weights())
    assert [a.kind for a in monitor.alerts] == ["spike"] and monitor.alerts[0].step == 14
    written, reduced = monitor.outcomes[0].split("; ")
    path = tmp_path / "snaps" / "anomaly-spike-step14.keras"
    assert written == f"snapshot written to {path}" and reduced == "learning rate reduced to 0.025"
    assert float(model.optimizer.learning_rate) == pytest.approx(0.025)  # Keras's optimizer
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "anomaly-spike-step14.json", "anomaly-spike-step14.keras",
    ]  # fmt: skip
    assert json.loads(path.with_suffix(".json").read_text())["checkpoint"] == path.name
    loaded = keras.models.load_model(path)
    # Written on the spike's own step (a CPU loss over the spike detector's alarm is handed
    # over at once), before the rate was reduced; the fit went on to its 16th step.
    assert int(loaded.optimizer.iterations) == 14
    assert float(loaded.optimizer.learning_rate) == pytest.approx(0.05)
    assert int(model.optimizer.iterations) == 16
    assert any(
        not np.array_equal(saved, now)
        for saved, now in zip(loaded.get_weights(), model.get_weights())
    )  # steps 15-16 trained after the snapshot


def test_reduce_lr_scales_a_learning_rate_schedule() -> None:
    keras.utils.set_random_seed(0)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=16, decay_rate=0.9)
    model = _compiled(RecordingModel(poison={14: 1e4}), lr=schedule)
    monitor = AnomalyMonitor(detectors={"spike": {"window": 10}}, action={"spike": "reduce_lr"})
    _fit(model, [StepwatchCallback([monitor])], epochs=2)
    # The schedule cannot be assigned: the optimizer follows it times 0.5 from step 14 on (the
    # spike's own step: a CPU loss over the spike detector's alarm is handed over at once).
    scaled = model.optimizer._learning_rate
    assert isinstance(scaled, ScaledSchedule) and scaled.schedule is schedule
    assert scaled.factor == pytest.approx(0.5)
    assert monitor.outcomes == [f"learning rate reduced to {0.5 * 0.05 * 0.9 ** (14 / 16):g}"]
    now = 0.5 * 0.05 * 0.9**2  # after step 32
    assert float(model.optimizer.learning_rate) == pytest.approx(now, rel=1e-6)
    # The scaled schedule goes into the optimizer's config, and comes back from it.
    again = keras.optimizers.deserialize(keras.optimizers.serialize(model.optimizer))
    assert isinstance(again._learning_rate, ScaledSchedule)
    assert float(again._learning_rate(32)) == pytest.approx(now, rel=1e-6)


class Weights(keras.callbacks.Callback):
    """A Keras callback after the bridge: the model's weights and the optimizer's step count
    as each batch ends, once the bridge's callbacks (and a rollback) have acted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[list[np.ndarray], int]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        weights = [w.copy() for w in self.model.get_weights()]
        self.seen.append((weights, int(self.model.optimizer.iterations)))


def test_rollback_restores_the_keras_model_and_optimizer_in_place(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    model = _compiled(RecordingModel(poison={30: 1e4}))
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 20}}, action={"spike": "rollback"}, rollback_every=10
    )
    weights = Weights()
    bridge = StepwatchCallback([monitor, recorder])
    _fit(model, [bridge, weights], epochs=4)
    # The spike of step 30 is read on its step: back to the copy of step 20 (the one of step
    # 30 was taken after the bad update), then fit goes on to its end.
    assert [a.kind for a in monitor.alerts] == ["spike"] and monitor.rollbacks == 1
    assert monitor.outcomes[0].startswith("rolled back to step 20")
    assert bridge.run is not None and bridge.run.rollbacks == [(20, 30)]
    at_20, after_30 = weights.seen[19], weights.seen[29]
    for before, restored in zip(at_20[0], after_30[0]):
        np.testing.assert_array_equal(before, restored)
    assert (at_20[1], after_30[1]) == (20, 20)  # the optimizer's own step count came back
    assert len(model.computed) == 4 * STEPS
    assert all(math.isfinite(v) for v in model.computed[30:])
    with Store(db) as store:
        assert store.run(recorder.run_id).status == "finished"


def test_a_rate_a_keras_callback_sets_each_epoch_is_recorded(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.5**epoch)
    model = _compiled(RecordingModel())
    _fit(model, [StepwatchCallback([recorder]), halve], epochs=3)
    with Store(db) as store:
        steps, rates = store.metrics(recorder.run_id, values.LR)
    by_epoch = {(int(s) - 1) // STEPS + 1: set() for s in steps}
    for step, rate in zip(steps, rates):
        by_epoch[(int(step) - 1) // STEPS + 1].add(round(float(rate), 6))
    assert by_epoch == {1: {0.05}, 2: {0.025}, 3: {0.0125}}


class ManualStep(keras.Sequential):
    """A custom train_step that computes its loss by hand (no compute_loss) and returns the
    batch's loss in its logs."""

    def __init__(self) -> None:
        super().__init__(_layers())
        self.computed: list[float] = []

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        self.zero_grad()
        loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        loss.backward()
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([w.value.grad for w in weights], weights)
        self.computed.append(float(loss.detach()))
        return {"loss": loss}


def test_a_train_step_without_compute_loss_gives_the_loss_its_logs_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keras.utils.set_random_seed(0)
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    model = ManualStep()
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05))
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        _fit(model, [StepwatchCallback([recorder])], epochs=2)
    assert "does not call compute_loss" in caplog.text
    with Store(db) as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
    assert steps.tolist() == list(range(1, 2 * STEPS + 1))
    np.testing.assert_allclose(losses, model.computed, rtol=1e-6)


@pytest.mark.parametrize(
    ("error", "status"),
    [(RuntimeError("bad batch"), "failed"), (KeyboardInterrupt(), "interrupted")],
)
def test_an_error_inside_fit_ends_the_run(
    tmp_path: Path, error: BaseException, status: str
) -> None:
    keras.utils.set_random_seed(0)
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    model = _compiled(RecordingModel(fail={6: error}))
    bridge = StepwatchCallback([recorder])
    with pytest.raises(type(error)):
        _fit(model, [bridge])
    assert bridge.run is not None and bridge.run.stop_kind is None
    assert "compute_loss" not in model.__dict__  # the bridge's wrappers are off again
    assert not hasattr(model.train_function, "_stepwatch_wrapped")
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == status
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == list(range(1, 6))
    # The same bridge watches the next fit as a new run.
    model.fail = {}
    _fit(model, [bridge], epochs=1)
    with Store(db) as store:
        assert store.run(recorder.run_id).status == "finished"
        assert len(store.runs()) == 2


def test_progress_bar_and_wrong_usage(capsys: pytest.CaptureFixture[str]) -> None:
    keras.utils.set_random_seed(0)
    _fit(_compiled(keras.Sequential(_layers())), [StepwatchCallback(ProgressBar())], epochs=1)
    assert f"epoch 1/1 step {STEPS}/{STEPS}, loss" in capsys.readouterr().out
    with pytest.raises(TypeError, match="callbacks"):
        StepwatchCallback(callbacks=42)
    with pytest.raises(TypeError, match=r"RunRecorder\(\)"):
        StepwatchCallback([RunRecorder])
    with pytest.raises(TypeError, match=r"callbacks\[1\] is a Keras callback \(EarlyStopping\)"):
        StepwatchCallback([LossMonitor(), keras.callbacks.EarlyStopping()])


def test_an_input_without_a_length_asks_for_steps_per_epoch() -> None:
    x, y = _data()

    def batches() -> Any:
        for i in range(0, 64, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    model = _compiled(keras.Sequential(_layers()))
    with pytest.raises(ValueError, match=r"steps_per_epoch=N"):
        model.fit(
            batches(),
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[StepwatchCallback(LossMonitor())],
        )


def test_the_module_puts_keras_on_torch_and_refuses_another_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = subprocess.run(
        [sys.executable, "-c",
         "import stepwatch.integrations.keras, keras; print(keras.backend.backend())"],
        env={k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "torch"  # importing the bridge first put Keras on torch
    # No other Keras backend is installed here (numpy's needs jax): Keras is made to report
    # one, as it does when it was imported with KERAS_BACKEND=jax.
    monkeypatch.setattr(keras.src.backend.config, "_BACKEND", "jax")
    with pytest.raises(RuntimeError, match="needs Keras on the torch backend, but Keras runs on"):
        StepwatchCallback([])


def test_a_second_fit_counts_on_from_kerass_own_step_and_initial_epoch(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    model = _compiled(RecordingModel())
    _fit(model, [StepwatchCallback([RunRecorder(db=db)])], epochs=1)
    recorder, user = RunRecorder(db=db), SeedStyle()
    bridge = StepwatchCallback([recorder, user])
    _fit(model, [bridge], epochs=3, initial_epoch=1)
    assert bridge.run is not None
    p = bridge.run.cb_params
    assert (p.initial_epoch, p.epoch_num, bridge.run.view.epochs) == (1, 2, 3)
    # Keras's optimizer had taken 16 steps; fit(initial_epoch=1) trains epochs 2 and 3.
    assert [s for s, _, _ in user.seen] == list(range(STEPS + 1, 3 * STEPS + 1))
    assert sorted({e for _, e, _ in user.seen}) == [2, 3]
    with Store(db) as store:
        steps, _ = store.metrics(recorder.run_id, values.STEP_LOSS)
        assert steps.tolist() == list(range(STEPS + 1, 3 * STEPS + 1))
        assert store.metrics(recorder.run_id, values.LOSS)[0].tolist() == [2 * STEPS, 3 * STEPS]


def test_a_stepwatch_callback_handed_to_fit_itself_says_where_it_belongs() -> None:
    model = _compiled(keras.Sequential(_layers()))
    where = r"'on_batch_end': LossMonitor is a stepwatch callback.*StepwatchCallback"
    with pytest.raises(AttributeError, match=where):
        _fit(model, [LossMonitor(1)], epochs=1)
    assert getattr(LossMonitor(1), "not_a_field", None) is None  # getattr's default still works


def test_misuse_is_refused_before_training_and_stores_nothing(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with pytest.raises(TypeError, match=r"keras.StepwatchCallback\(\) got no callbacks"):
        StepwatchCallback()
    bridge = StepwatchCallback([RunRecorder(db=db)])
    model = _compiled(RecordingModel())
    with pytest.raises(ValueError, match=r"in model\.fit's callbacks 2 times"):
        _fit(model, [bridge, bridge], epochs=1)
    assert not db.exists() and not model.computed  # refused before the first step
    _fit(model, [bridge], epochs=1)  # listed once, the same bridge records
    with Store(db) as store:
        (run,) = store.runs()
        assert run.status == "finished" and run.steps == STEPS

    from stepwatch.integrations.lightning import StepwatchCallback as LightningBridge

    with pytest.raises(AttributeError, match=r"use stepwatch.integrations.keras.StepwatchCall"):
        _fit(_compiled(RecordingModel()), [LightningBridge([LossMonitor()])], epochs=1)


def test_the_stored_config_names_functions_without_memory_addresses(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"

    def my_loss(y_true: Any, y_pred: Any) -> Any:
        return keras.ops.mean(keras.ops.square(y_true - y_pred))

    for _ in range(2):
        model = keras.Sequential(_layers())
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=my_loss)
        _fit(model, [StepwatchCallback([RunRecorder(db=db)])], epochs=1)
    with Store(db) as store:
        first, second = (run.config["host_config"] for run in store.runs())
    for config in (first, second):  # Keras numbers the names of the objects it makes
        config.pop("model")
        config["optimizer_config"].pop("name")
    assert first == second  # two identical runs do not differ
    assert first["loss"].endswith("my_loss") and " at 0x" not in json.dumps(first)
