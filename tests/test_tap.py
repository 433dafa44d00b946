"""The loss tap as the run's buffer of step losses and as its step clock (call_at, alarm)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import stepwatch as sw
from stepwatch import AnomalyMonitor, ProgressBar, RunRecorder
from stepwatch.monitor.detectors import Detector
from stepwatch.train.callback._callback import CallbackList
from stepwatch.view.run import view_of
from stepwatch.view.tap import Chunk, LossTap

from .bridge_support import LossAbove
from .conftest import make_batches, make_model


class Looks(sw.Callback):
    """No step hook: asks the tap's clock for calls, and records what cb_params says then."""

    def __init__(self, at: list[int], again: bool = False) -> None:
        self.at, self.again = at, again
        self.seen: list[tuple[int, int, bool, float]] = []

    def on_train_begin(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.p, self.tap = p, view_of(p).tap
        for step in self.at:
            self.tap.call_at(step, self.look)

    def look(self, step: int) -> None:
        p = self.p
        self.seen.append((step, p.cur_step_num, p.loss_tensor is not None, p.step_time))
        if self.again:
            self.again = False
            self.tap.call_at(step, self.look)  # another call at the same step: made now


def test_a_cpu_run_pushes_floats_and_chunks_hold_them() -> None:
    chunks: list[Chunk] = []

    class Take(sw.Callback):
        def on_train_begin(self, run_context: Any) -> None:
            view_of(run_context.original_args()).tap.subscribe(4, chunks.append)

    history = sw.History()
    make_model().train(1, make_batches(10), callbacks=[Take(), history])
    assert [(c.steps.start, c.steps.stop) for c in chunks] == [(1, 5), (5, 9), (9, 11)]
    assert all(type(c.host) is list and type(c.host[0]) is float for c in chunks)
    values = [v for c in chunks for v in c.values()]
    device = chunks[0].device  # built on first use, float32
    assert device.dtype == torch.float32 and device.tolist() == pytest.approx(chunks[0].host)
    # The epoch mean is the floats' mean (no tensor kept per step).
    assert history.history["loss"][0] == pytest.approx(sum(values) / 10)


def test_tensors_are_stacked_and_summed_on_their_device() -> None:
    tap = LossTap(interval=4)
    got: list[Chunk] = []
    tap.subscribe(4, got.append)
    tap.begin_epoch(1, 1)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):
        tap.push(torch.tensor(value))
    total = tap.end_epoch()
    assert isinstance(total, torch.Tensor) and float(total) == 15.0
    assert [c.values() for c in got] == [[1.0, 2.0, 3.0, 4.0], [5.0]]
    assert isinstance(got[0].host, torch.Tensor)
    tap.begin_epoch(2, 6)
    assert tap.end_epoch() is None  # an epoch without a step has no sum


def test_calls_come_at_their_step_with_cb_params_filled_and_no_step_hook() -> None:
    looks = Looks([3, 7, 7])
    make_model().train(1, make_batches(10), callbacks=[looks])
    assert [s[:3] for s in looks.seen] == [(3, 3, True), (7, 7, True), (7, 7, True)]
    assert all(s[3] > 0 for s in looks.seen)  # the mean step time since the last step seen
    again = Looks([4], again=True)
    make_model().train(1, make_batches(6), callbacks=[again])
    assert [s[0] for s in again.seen] == [4, 4]


def test_a_call_for_a_step_gone_by_comes_at_the_next_and_unsubscribe_drops_calls() -> None:
    tap = LossTap()
    calls: list[int] = []

    class Owner:
        def call(self, step: int) -> None:
            calls.append(step)

    owner = Owner()
    tap.begin_epoch(1, 1)
    for _ in range(5):
        tap.push(0.5)
    tap.call_at(2, owner.call)  # step 2 is past: step 6
    tap.call_at(9, owner.call)
    tap.push(0.5)
    assert calls == [6]
    tap.unsubscribe(owner)  # its calls go with it
    for _ in range(5):
        tap.push(0.5)
    assert calls == [6] and tap.wake == tap.every * (11 // tap.every + 1)


def test_an_alarm_cuts_a_chunk_on_the_step_of_a_value_above_it_or_not_a_number() -> None:
    tap = LossTap(interval=64)
    got: list[range] = []
    tap.subscribe(64, lambda chunk: got.append(chunk.steps))
    tap.begin_epoch(1, 1)
    for value in (1.0, 1.0, 5.0, math.nan):  # no alarm asked for: nothing early
        tap.push(value)
    assert got == []
    owner = object()
    tap.set_alarm(owner, 3.0)
    for value in (1.0, 2.5, 4.0, 1.0, math.nan, 1.0):  # steps 5-10
        tap.push(value)
    assert got == [range(1, 8), range(8, 10)]  # cut at 4.0 (step 7) and at the NaN (step 9)
    tap.unsubscribe(owner)
    assert tap.alarm == math.inf


def test_anomaly_monitor_and_progress_bar_run_no_step_hook(tmp_path: Any) -> None:
    callbacks = [AnomalyMonitor(), ProgressBar(), RunRecorder(db=tmp_path / "r.db")]
    assert CallbackList(callbacks).fns["on_train_step_end"] == []


class LastStep(sw.Callback):
    def on_train_end(self, run_context: Any) -> None:
        self.step = run_context.original_args().cur_step_num


def _poisoned(at: int, factor: float) -> sw.Model:
    """A model whose loss at step ``at`` is ``factor`` times what it is (a bad batch)."""
    model = make_model(lr=0.05)
    count = [0]

    def loss_fn(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        loss = torch.nn.functional.cross_entropy(outputs, labels)
        return loss * factor if count[0] == at else loss

    return sw.Model(model.train_network, loss_fn, model.optimizer, device="cpu")


def _stop_at(model: sw.Model, monitor: AnomalyMonitor) -> tuple[int, str, int]:
    """(the first alert's step and kind, the step training stopped at)."""
    last = LastStep()
    model.train(8, make_batches(32, batch_size=4), callbacks=[monitor, last])
    return monitor.alerts[0].step, monitor.alerts[0].kind, last.step


def test_on_cpu_a_nan_and_a_spike_are_handled_on_their_own_step() -> None:
    # A run of one process on the CPU reads losses in batches of 64 once the detectors are
    # warm; the tap's alarm hands a value that could fire one over on its step.
    assert _stop_at(_poisoned(151, 1e3), AnomalyMonitor(action="stop")) == (151, "spike", 151)
    nan = _poisoned(170, math.nan)
    assert _stop_at(nan, AnomalyMonitor(action="stop")) == (170, "nonfinite", 170)


class OwnAlarm(LossAbove):
    """A detector of one's own that says what it must see at once."""

    def alarm(self) -> float:
        return self.bound


def test_a_users_detector_with_alarm_is_read_on_its_step_and_one_without_within_8() -> None:
    def run(detector: Detector) -> tuple[int, str, int]:
        monitor = AnomalyMonitor(detectors=["nonfinite", detector], action="stop")
        return _stop_at(_poisoned(140, 1e3), monitor)

    assert run(OwnAlarm(50.0)) == (140, "loss_above", 140)
    # Without alarm() the monitor keeps reading every 8 steps: the next multiple of 8.
    assert run(LossAbove(50.0)) == (140, "loss_above", 144)


def test_wrong_calls_and_alarms_are_refused() -> None:
    tap = LossTap()
    with pytest.raises(TypeError, match="'step' must be an int"):
        tap.call_at(2.5, print)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'step' must be an int >= 0"):
        tap.call_at(-1, print)
    with pytest.raises(TypeError, match="'fn'"):
        tap.call_at(3, "look")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'level' must be a number"):
        tap.set_alarm(object(), "high")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not NaN"):
        tap.set_alarm(object(), math.nan)
    assert tap.alarm == math.inf and tap._timers == []
