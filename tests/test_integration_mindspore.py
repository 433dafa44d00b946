"""stepwatch's callbacks inside real MindSpore 2.10 ``Model.train`` / ``Model.fit`` (CPU)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
import pytest
from mindspore import nn

from stepwatch import AnomalyMonitor, Callback, LossMonitor, ProgressBar, RunRecorder, Store
from stepwatch.integrations.mindspore import StepwatchCallback
from stepwatch.monitor import values

from .bridge_support import assert_stopped_for_anomaly

STEPS = 8  # batches per epoch


class HostLosses(ms.train.Callback):
    """A plain MindSpore callback: the loss MindSpore computed at each step, as it holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_step_end(self, run_context: Any) -> None:
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))


class SeedStyle(Callback):
    """A user's MindSpore-style stepwatch callback, reading cb_params as the seed's code does."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, float]] = []

    def step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.seen.append((p.cur_epoch_num, p.cur_step_num, float(p.net_outputs.asnumpy())))


def _data(nan_row: int | None = None, seed: int = 0) -> Any:
    rs = np.random.RandomState(seed)
    x = rs.randn(STEPS * 8, 4).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)).astype(np.float32)
    if nan_row is not None:
        x[nan_row] = np.nan
    return ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(8)


def _model(lr: float = 0.05) -> tuple[Any, Any]:
    ms.set_seed(0)
    net = nn.Dense(4, 1)
    optimizer = nn.SGD(net.trainable_params(), learning_rate=lr)
    return ms.train.Model(net, nn.MSELoss(), optimizer, metrics={"mae"}), optimizer


def test_a_mindspore_fit_is_recorded_printed_and_seen_by_a_user_callback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "runs.db"
    recorder, user, host = RunRecorder(db=db), SeedStyle(), HostLosses()
    bridge = StepwatchCallback([recorder, AnomalyMonitor(), LossMonitor(4), user])
    model, _ = _model()
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        model.fit(3, _data(), _data(seed=1), callbacks=[host, bridge])
    assert bridge.run is not None and bridge.run.stop_reason is None  # ended, not stopped
    assert len(host.losses) == 3 * STEPS
    assert (
        "AnomalyMonitor: mindspore gives no gradients, so the grad_explosion/grad_vanishing/"
        "dying_relu detectors are off" in caplog.text
    )
    printed = capsys.readouterr().out
    assert f"epoch: 1 step: 4, loss is {host.losses[3]}\n" in printed  # MindSpore's line
    assert "epoch: 3 step: 8, loss is" in printed
    # The user's callback saw MindSpore's step and epoch numbers and losses.
    assert [(e, s) for e, s, _ in user.seen] == [
        (1 + (s - 1) // STEPS, s) for s in range(1, 3 * STEPS + 1)
    ]
    np.testing.assert_allclose([v for *_, v in user.seen], host.losses, rtol=1e-6)
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "finished"
        assert info.config["host"] == "mindspore"
        assert info.config["optimizer"] == "SGD" and info.config["lr"] == pytest.approx(0.05)
        assert info.config["host_config"]["train_network"] == "TrainOneStepCell"
        steps, losses = store.metrics(info.id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 3 * STEPS + 1))
        np.testing.assert_allclose(losses, host.losses, rtol=1e-6)  # MindSpore's own losses
        epoch_steps, epoch_loss = store.metrics(info.id, values.LOSS)
        assert epoch_steps.tolist() == [8, 16, 24]
        np.testing.assert_allclose(epoch_loss[0], np.mean(host.losses[:STEPS]), rtol=1e-5)
        # fit's validation results, under stepwatch's names
        assert len(store.metrics(info.id, values.EVAL_LOSS)[0]) == 3
        assert len(store.metrics(info.id, "eval_mae")[0]) == 3
        assert store.metrics(info.id, values.LR)[1][-1] == pytest.approx(0.05)


def test_a_nan_stops_mindspore_within_ten_steps_and_shows_on_the_dashboard(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    recorder, host, monitor = RunRecorder(db=db), HostLosses(), AnomalyMonitor(action="stop")
    model, _ = _model()
    # Row 20 is in the third batch: step 3 is the first NaN step.
    model.train(3, _data(nan_row=20), callbacks=[host, StepwatchCallback([recorder, monitor])])
    assert math.isnan(host.losses[2]) and not math.isnan(host.losses[1])
    assert len(host.losses) <= 3 + 10  # MindSpore left its loop within ten steps
    assert [a.kind for a in monitor.alerts] == ["nonfinite"]
    assert_stopped_for_anomaly(db, recorder.run_id, alert_step=3, last_step=len(host.losses))


def test_actions_reach_mindspores_optimizer_and_checkpoints(tmp_path: Path) -> None:
    model, optimizer = _model(lr=0.05)
    snapshots = tmp_path / "snaps"
    monitor = AnomalyMonitor(action=["reduce_lr", "snapshot"], snapshot_dir=snapshots)
    model.train(1, _data(nan_row=20), callbacks=[StepwatchCallback([monitor])])
    assert float(optimizer.learning_rate.asnumpy()) == pytest.approx(0.025)
    assert monitor.outcomes[0].startswith("learning rate reduced to 0.025; snapshot written")
    (ckpt,) = snapshots.glob("anomaly-nonfinite-step3.ckpt")
    saved = ms.load_checkpoint(str(ckpt))  # a checkpoint MindSpore reads
    assert {"weight", "bias"} <= {name.rsplit(".", 1)[-1] for name in saved}
    assert (snapshots / "anomaly-nonfinite-step3.json").is_file()


class Corrupt(ms.train.Callback):
    """Blows the weights up at the start of one step, as a bad update would."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_step_begin(self, run_context: Any) -> None:
        p = run_context.original_args()
        if p.cur_step_num == self.step:  # MindSpore counts the step before this hook
            weight = p.network.weight
            weight.set_data(ms.Tensor(weight.asnumpy() * 1e3))


class ParamLog(ms.train.Callback):
    """The train network's parameters (weights and optimizer state) as each step ends."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, np.ndarray]] = []

    def on_train_step_end(self, run_context: Any) -> None:
        network = run_context.original_args().train_network
        self.seen.append({p.name: p.asnumpy().copy() for p in network.get_parameters()})


def test_rollback_restores_the_mindspore_network_and_optimizer_in_place() -> None:
    ms.set_seed(0)
    net = nn.Dense(4, 1)
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    model = ms.train.Model(net, nn.MSELoss(), optimizer)
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 10}}, action={"spike": "rollback"}, rollback_every=10
    )
    log = ParamLog()
    bridge = StepwatchCallback([monitor])
    model.train(5, _data(), callbacks=[Corrupt(step=26), bridge, log])
    # The corrupted step 26 is read on its step (a CPU loss over the spike detector's alarm
    # is handed over at once): back to the copy of step 20, weights and momentum alike; then
    # training goes on to its end.
    assert [a.kind for a in monitor.alerts] == ["spike"] and monitor.rollbacks == 1
    assert monitor.outcomes[0].startswith("rolled back to step 20")
    assert monitor.alerts[0].step == 26
    assert bridge.run is not None and bridge.run.rollbacks == [(20, 26)]
    at_20, after_26 = log.seen[19], log.seen[25]
    assert set(at_20) == set(after_26) and any("moment" in name for name in at_20)
    for name, value in at_20.items():
        np.testing.assert_array_equal(after_26[name], value, err_msg=name)
    assert len(log.seen) == 5 * STEPS


class Boom(Callback):
    def step_end(self, run_context: Any) -> None:
        if run_context.original_args().cur_step_num == 5:
            raise RuntimeError("boom at step 5")


def test_an_error_inside_mindspore_training_marks_the_run_failed(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    model, _ = _model()
    with pytest.raises(RuntimeError, match="boom at step 5"):
        model.train(1, _data(), callbacks=[StepwatchCallback([recorder, Boom()])])
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "failed"
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == [1, 2, 3, 4, 5]
        errors = [e for e in store.events(info.id) if e["kind"] == "error"]
        assert "boom at step 5" in errors[0]["message"]


def test_progress_bar_draws_and_wrong_use_gets_clear_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, _ = _model()
    model.train(1, _data(), callbacks=[StepwatchCallback(ProgressBar())])
    assert f"epoch 1/1 step {STEPS}/{STEPS}, loss" in capsys.readouterr().out
    with pytest.raises(TypeError, match="callbacks"):
        StepwatchCallback(callbacks=42)
    with pytest.raises(TypeError, match=r"RunRecorder\(\)"):
        StepwatchCallback([RunRecorder])


def test_a_resumed_mindspore_run_numbers_its_epochs_as_mindspore_does(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder, user = RunRecorder(db=db), SeedStyle()
    model, _ = _model()
    model.train(3, _data(), callbacks=[StepwatchCallback([recorder, user])], initial_epoch=1)
    # MindSpore trains epochs 2 and 3, counting its steps from 1 again.
    assert sorted({epoch for epoch, _, _ in user.seen}) == [2, 3]
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert [(p[1], p[2]) for p in store.points(info.id) if p[0] == values.LOSS] == [
            (8, 2), (16, 3),
        ]  # fmt: skip


def test_sink_mode_on_the_cpu_numbers_steps_as_the_hooks_come(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MindSpore's batch_num is the sink size in dataset sink mode, but the CPU does not sink:
    every batch still calls the step hooks, so an epoch is the dataset's batches."""
    db = tmp_path / "runs.db"
    recorder, host = RunRecorder(db=db), HostLosses()
    model, _ = _model()
    bridge = StepwatchCallback([recorder, LossMonitor(STEPS)])
    model.train(2, _data(), callbacks=[host, bridge], dataset_sink_mode=True, sink_size=2)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert [line.split(", loss")[0] for line in printed] == [
        f"epoch: 1 step: {STEPS}",
        f"epoch: 2 step: {STEPS}",
    ]
    with Store(db) as store:
        steps, _ = store.metrics(recorder.run_id, values.STEP_LOSS)
    assert steps.tolist() == list(range(1, 2 * STEPS + 1)) == list(range(1, len(host.losses) + 1))


def test_stepwatch_callbacks_handed_straight_to_mindspore_get_its_error_as_documented(
    tmp_path: Path,
) -> None:
    """MindSpore checks each callback's class before it calls any hook, so its own TypeError
    is what a user sees (docs/training/mindspore.md says what it means); in the bridge the
    same callbacks run."""
    docs = Path(__file__).resolve().parents[1] / "docs" / "training" / "mindspore.md"
    text = " ".join(docs.read_text().split())
    model, _ = _model()
    said = "When the 'callbacks' is a list, the elements in 'callbacks' must be Callback functions."
    for handed in ([LossMonitor(1)], LossMonitor(1)):
        with pytest.raises(TypeError) as refused:
            model.train(1, _data(), callbacks=handed)
        assert str(refused.value) == said and f"`TypeError: {said}`" in text
    recorder = RunRecorder(db=tmp_path / "runs.db")
    model.train(1, _data(), callbacks=[StepwatchCallback([recorder, LossMonitor(1)])])
    assert recorder.run_id == 1 and recorder.dropped == 0
