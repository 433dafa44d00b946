"""AnomalyMonitor and TerminateOnNaN in real training runs: what each action does, the store
event, the log line, and bad arguments."""

from __future__ import annotations

import json
import logging
import math
import sys
from typing import Any

import pytest
import torch

import stepwatch as sw
from stepwatch import AnomalyMonitor, TerminateOnNaN
from stepwatch.store import Store
from stepwatch.train.serialization import read_checkpoint

from .conftest import make_batches, make_model

BATCHES = make_batches(n_batches=32, batch_size=8)  # 32 steps per epoch


class At(sw.Callback):
    """Run ``fn(network, optimizer)`` at the start of ``step``."""

    def __init__(self, step: int, fn: Any) -> None:
        self.step, self.fn = step, fn

    def on_train_step_begin(self, run_context: Any) -> None:
        p = run_context.original_args()
        if p.cur_step_num == self.step:
            with torch.no_grad():
                self.fn(p.train_network, p.optimizer)


def nan_weight(net: Any, opt: Any) -> None:
    net[0].weight[0, 0] = math.nan


def blow_up(net: Any, opt: Any) -> None:
    net[2].weight.mul_(300)


class Stops(sw.Callback):
    def on_train_end(self, run_context: Any) -> None:
        self.kind = run_context.stop_kind
        self.step = run_context.original_args().cur_step_num


def test_bad_arguments_fail_at_construction(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="unknown detector kind 'spikes'"):
        AnomalyMonitor(detectors=["spikes"])
    with pytest.raises(ValueError, match=r"'action' must be one of 'warn'.*but got 'explode'"):
        AnomalyMonitor(action="explode")
    with pytest.raises(ValueError, match="'action' names an unknown detector kind 'nan'"):
        AnomalyMonitor(action={"nan": "stop"})
    with pytest.raises(TypeError, match="'action' must be an action name"):
        AnomalyMonitor(action=5)
    with pytest.raises(ValueError, match="'every_n_steps' must be an int >= 1"):
        AnomalyMonitor(every_n_steps=-1)
    with pytest.raises(ValueError, match="'window' must be an int >= 3"):
        AnomalyMonitor(detectors={"spike": {"window": -5}})
    with pytest.raises(ValueError, match=r"unknown option 'windw' for detector 'spike'.*'window'"):
        AnomalyMonitor(detectors={"spike": {"windw": 50}})
    with pytest.raises(TypeError, match="'detectors' must be None, a list of detector kinds"):
        AnomalyMonitor(detectors="spike")
    with pytest.raises(ValueError, match="'lr_factor' must be a number with 0 < x < 1"):
        AnomalyMonitor(lr_factor=2.0)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="'snapshot_dir' must be a folder"):
        AnomalyMonitor(snapshot_dir=a_file)
    with pytest.raises(ValueError, match="'snapshot_dir' must be a folder"):
        AnomalyMonitor(snapshot_dir=a_file / "below")
    if sys.platform == "linux":  # no folder can be made in /proc, not even by root
        with pytest.raises(ValueError, match=r"'snapshot_dir' '/proc/nope' cannot be written"):
            AnomalyMonitor(action="snapshot", snapshot_dir="/proc/nope")
    AnomalyMonitor(action="snapshot", snapshot_dir=tmp_path / "snaps" / "deeper")
    assert sorted(tmp_path.iterdir()) == [a_file]  # the check leaves nothing behind


def test_nan_stops_as_an_anomaly_names_its_step_logs_once_and_is_recorded(
    tmp_path: Any, caplog: Any
) -> None:
    db = tmp_path / "runs.db"
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    stops = Stops()
    model = make_model()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        model.train(
            4,
            BATCHES,
            callbacks=[At(40, nan_weight), monitor, stops, sw.RunRecorder(db=db)],
        )
    first = monitor.alerts[0]
    assert (first.kind, first.step, first.epoch) == ("nonfinite", 40, 2)
    assert "loss is nan" in first.message and "check the input batch" in first.message
    assert stops.kind == "anomaly"
    assert 40 <= stops.step <= 40 + 8  # read in a batch, a few steps later at most
    lines = [r.getMessage() for r in caplog.records if "step 40: loss is nan" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("[stopping training]")
    store = Store(db)
    events = store.events(store.runs()[-1].id)
    alerts = [e for e in events if e["kind"] == "alert"]
    assert alerts and alerts[0]["step"] == 40 and "loss is nan" in alerts[0]["message"]


@pytest.mark.parametrize("nan_at", [1, 3])
def test_a_nan_in_the_first_steps_stops_the_run_on_its_own_step(nan_at: int) -> None:
    # Before the first batch of losses reaches the monitor (8 steps), a non-finite CPU loss
    # already wakes it on its step.
    stops, monitor = Stops(), AnomalyMonitor(action="stop")
    make_model().train(1, BATCHES, callbacks=[At(nan_at, nan_weight), monitor, stops])
    assert (monitor.alerts[0].kind, monitor.alerts[0].step) == ("nonfinite", nan_at)
    assert (stops.kind, stops.step) == ("anomaly", nan_at)


def test_a_nan_seen_in_the_loss_and_the_gradients_at_once_is_one_alert() -> None:
    # Step 21 is a gradient measurement (every 10 steps while the explosion detector warms
    # up): the NaN weight makes the loss and the gradient norm NaN on the same step, and on
    # every step after; one episode, one alert.
    monitor = AnomalyMonitor()
    with pytest.warns(RuntimeWarning, match="loss of epoch 1 is nan"):
        make_model().train(1, BATCHES, callbacks=[At(21, nan_weight), monitor])
    assert [(a.kind, a.step) for a in monitor.alerts] == [("nonfinite", 21)]
    assert "loss is nan" in monitor.alerts[0].message
    assert 21 in monitor._history["grad_step"]


def test_terminate_on_nan_stops_the_run() -> None:
    stops = Stops()
    monitor = TerminateOnNaN()
    make_model().train(4, BATCHES, callbacks=[At(10, nan_weight), monitor, stops])
    assert [a.kind for a in monitor.alerts] == ["nonfinite"]
    assert stops.kind == "anomaly" and stops.step < 32


def test_snapshot_writes_a_resumable_checkpoint_and_the_recent_window(tmp_path: Any) -> None:
    monitor = AnomalyMonitor(action={"spike": "snapshot"}, snapshot_dir=tmp_path / "snaps")
    make_model(lr=0.05).train(4, BATCHES, callbacks=[At(70, blow_up), monitor])
    spike = next(a for a in monitor.alerts if a.kind == "spike")
    assert spike.step == 70
    saved = tmp_path / "snaps" / "anomaly-spike-step70.pt"
    state = read_checkpoint(saved)
    assert state["step"] >= 70 and "network" in state and "optimizer" in state
    record = json.loads(saved.with_suffix(".json").read_text())
    assert record["alert"]["kind"] == "spike" and record["checkpoint"] == saved.name
    assert record["window"]["step"][-1] >= 70 and len(record["window"]["loss"]) >= 70
    steps = record["window"]["step"]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # every step, in order


def test_a_snapshot_keeps_the_last_window_losses_only(tmp_path: Any) -> None:
    monitor = AnomalyMonitor(action={"spike": "snapshot"}, snapshot_dir=tmp_path, window=30)
    make_model(lr=0.05).train(4, BATCHES, callbacks=[At(70, blow_up), monitor])
    record = json.loads((tmp_path / "anomaly-spike-step70.json").read_text())
    window = record["window"]
    assert len(window["step"]) == len(window["loss"]) == 30
    assert window["step"] == list(range(window["step"][-1] - 29, window["step"][-1] + 1))
    assert window["step"][-1] >= 70


def test_reduce_lr_and_a_callable_action() -> None:
    seen: list[tuple[Any, Any]] = []
    monitor = AnomalyMonitor(
        action={"spike": ["reduce_lr", lambda alert, rc: seen.append((alert, rc))]}
    )
    model = make_model(lr=0.05)
    model.train(4, BATCHES, callbacks=[At(70, blow_up), monitor])
    spikes = [a for a in monitor.alerts if a.kind == "spike"]
    assert spikes and [a for a, _ in seen] == spikes  # the callable saw each alert
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** len(spikes))
    assert isinstance(seen[0][1], sw.RunContext)


def test_rollback_restores_the_last_state_before_the_spike_and_goes_on() -> None:
    kept: dict[str, Any] = {}

    class Keep(sw.Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            p = run_context.original_args()
            if p.cur_step_num == 50:
                kept["weight"] = p.train_network[2].weight.detach().clone()

    restored: dict[str, Any] = {}

    def look(alert: Any, run_context: Any) -> None:
        restored["weight"] = run_context.original_args().train_network[2].weight.clone()

    monitor = AnomalyMonitor(action={"spike": ["rollback", look]}, rollback_every=25)
    stops = Stops()
    make_model(lr=0.05).train(4, BATCHES, callbacks=[Keep(), At(70, blow_up), monitor, stops])
    assert monitor.rollbacks == 1
    assert torch.equal(restored["weight"], kept["weight"])  # the copy of step 50, before 70
    assert stops.kind is None and stops.step == 128  # it went on to the end


def test_rollback_is_bounded_then_stops() -> None:
    monitor = AnomalyMonitor(action={"spike": "rollback"}, max_rollbacks=0)
    stops = Stops()
    make_model(lr=0.05).train(4, BATCHES, callbacks=[At(70, blow_up), monitor, stops])
    assert monitor.rollbacks == 0 and stops.kind == "anomaly"


def test_gradient_detectors_see_a_dead_relu_layer() -> None:
    def kill(net: Any, opt: Any) -> None:
        net[0].bias.fill_(-100.0)

    monitor = AnomalyMonitor()
    make_model(lr=0.05).train(4, BATCHES, callbacks=[At(20, kill), monitor])
    dying = [a for a in monitor.alerts if a.kind == "dying_relu"]
    assert dying and 20 <= dying[0].step <= 40
    assert "(0.weight)" in dying[0].message or "(2.weight)" in dying[0].message
    assert not [a for a in monitor.alerts if a.kind == "grad_vanishing"]  # zeros are not tiny


def test_a_loss_that_reaches_exactly_zero_raises_no_spike_on_its_tiny_remainders() -> None:
    # A separable task: most batch losses become exactly 0, the rest 1e-8..1e-6.
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = (x[:, 0] > 0).long()
    x[:, 0] += torch.where(y == 1, 6.0, -6.0)
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 256, 8)]
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    losses: list[float] = []
    keep = sw.LambdaCallback(
        on_train_step_end=lambda rc: losses.append(float(rc.original_args().net_outputs))
    )
    monitor = AnomalyMonitor()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    sw.Model(net, torch.nn.CrossEntropyLoss(), opt).train(20, data, callbacks=[monitor, keep])
    assert sum(v == 0.0 for v in losses) > len(losses) / 2 and max(losses[-100:]) > 0.0
    assert [a for a in monitor.alerts if a.kind == "spike"] == []


class EveryStep(sw.monitor.detectors.Detector):
    kind = "every_step"

    def update(self, step: int, value: float, epoch: Any = None) -> Any:
        return self._alert(step, epoch, f"saw {value:.3g}", value)


def test_alerts_kept_in_memory_are_the_newest_max_alerts(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="'max_alerts' must be an int >= 1"):
        AnomalyMonitor(max_alerts=0)
    monitor = AnomalyMonitor(detectors=[EveryStep()], max_alerts=5)
    db = tmp_path / "runs.db"
    make_model().train(2, BATCHES, callbacks=[monitor, sw.RunRecorder(db=db)])
    assert [a.step for a in monitor.alerts] == [60, 61, 62, 63, 64]
    assert monitor.outcomes == [""] * 5
    with Store(db) as store:
        events = store.events(store.runs()[-1].id)
    assert sum(e["kind"] == "alert" for e in events) == 64  # the store has every one


def test_rollback_goes_to_an_older_copy_when_the_same_alert_returns() -> None:
    # A bad update: the weights are blown up by step 60's optimizer step, so the copy of step
    # 60 (taken at its end) holds them: the spike shows at step 61, and the first rollback, to
    # the copy of step 60, brings it back. The second must go to an older copy, and training
    # goes on from there.
    model = make_model(lr=0.05)
    steps = [0]

    def blow_up_at_60(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps[0] += 1
        if steps[0] == 60:
            with torch.no_grad():
                model.train_network[2].weight.mul_(300)

    model.optimizer.register_step_post_hook(blow_up_at_60)
    monitor = AnomalyMonitor(action={"spike": "rollback"}, rollback_every=10)
    stops = Stops()
    model.train(4, BATCHES, callbacks=[monitor, stops])
    spikes = [(a.step, o) for a, o in zip(monitor.alerts, monitor.outcomes) if a.kind == "spike"]
    assert [s for s, _ in spikes] == [61, 62]  # each read on its step
    assert spikes[0][1].startswith("rolled back to step 60 (1 of 3)")
    came_back = "(2 of 3; the spike came back after the rollback to 60)"
    assert spikes[1][1].startswith(f"rolled back to step 50 {came_back}")
    assert monitor.rollbacks == 2 and stops.kind is None and stops.step == 128
    assert max(a.step for a in monitor.alerts) < 70  # healthy from the older copy on


def test_rollback_never_returns_to_a_copy_taken_at_or_after_the_onset() -> None:
    monitor = AnomalyMonitor(action={"spike": "rollback"}, rollback_every=10)
    make_model(lr=0.05).train(4, BATCHES, callbacks=[At(70, blow_up), monitor])
    first = next(o for a, o in zip(monitor.alerts, monitor.outcomes) if a.kind == "spike")
    step = next(a.step for a in monitor.alerts if a.kind == "spike")
    at = int(first.split("rolled back to step ")[1].split()[0])
    assert at < step


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gradients_of_a_double_or_bfloat16_network_are_measured(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    net = net.to(dtype)
    data = [(torch.randn(8, 4, dtype=dtype), torch.randint(0, 2, (8,))) for _ in range(40)]
    monitor = AnomalyMonitor()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sw.Model(net, torch.nn.CrossEntropyLoss(), opt).train(1, data, callbacks=[monitor])
    norms = list(monitor._history["grad_norm"])
    assert monitor.alerts == [] and len(norms) >= 4  # steps 1, 11, 21, 31 while warming up
    assert all(math.isfinite(n) and n > 0 for n in norms)
