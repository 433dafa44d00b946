"""LossMonitor, TimeMonitor, History and LambdaCallback: arguments, formats, cadence."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stepwatch import History, LambdaCallback, LossMonitor, Model, TimeMonitor

from .conftest import make_batches, make_model


# -- LossMonitor ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (-1, ValueError, r"'per_print_times' must be an int >= 0, but got -1 with type 'int'"),
        ("10", TypeError, "'per_print_times' must be an int"),
        (1.0, TypeError, "'per_print_times' must be an int"),
        (None, TypeError, "'per_print_times' must be an int"),
        (True, TypeError, "'per_print_times' must be an int"),
    ],
)
def test_loss_monitor_args_validation(value: Any, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        LossMonitor(value)


def test_loss_monitor_prints_on_global_step_cadence(capsys: pytest.CaptureFixture[str]) -> None:
    make_model().train(2, make_batches(16), callbacks=[LossMonitor(10)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "epoch: 1 step: 10",
        "epoch: 2 step: 4",
        "epoch: 2 step: 14",
    ]
    for line in lines:
        assert re.fullmatch(r"epoch: \d+ step: \d+, loss is \d+\.\d+(e-?\d+)?", line)


def test_loss_monitor_step_hook_runs_only_at_its_printing_steps(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stepwatch.train.callback import CallbackList

    assert not CallbackList([LossMonitor(10)]).every_step  # called where the clock wakes

    class Counted(LossMonitor):  # a subclass's step hook runs, and super() prints once
        def on_train_step_end(self, run_context: Any) -> None:
            self.seen = getattr(self, "seen", 0) + 1
            super().on_train_step_end(run_context)

    class Old(LossMonitor):  # the MindSpore 1.x name, with super()
        def step_end(self, run_context: Any) -> None:
            super().step_end(run_context)

    expected = ["epoch: 1 step: 10", "epoch: 2 step: 4", "epoch: 2 step: 14"]
    counted = Counted(10)
    for monitor in (LossMonitor(10), counted, Old(10)):
        make_model().train(2, make_batches(16), callbacks=[monitor])
        lines = capsys.readouterr().out.splitlines()
        assert [line.split(",")[0] for line in lines] == expected, type(monitor).__name__
    assert counted.seen == 32  # every step
    assert CallbackList([counted]).every_step and CallbackList([Old(10)]).every_step


def test_loss_monitor_zero_never_prints(capsys: pytest.CaptureFixture[str]) -> None:
    make_model().train(1, make_batches(4), callbacks=[LossMonitor(0)])
    assert capsys.readouterr().out == ""


def test_loss_monitor_prints_eval_result_in_fit(capsys: pytest.CaptureFixture[str]) -> None:
    make_model(metrics={"accuracy"}).fit(
        1, make_batches(2), make_batches(2), callbacks=[LossMonitor(0)]
    )
    out = capsys.readouterr().out
    # The metrics' values, as MindSpore's LossMonitor prints cb_params.metrics
    assert re.search(r"^Eval result: epoch 1, metrics: \{'accuracy': [\d.]+\}$", out, re.M)


def test_loss_monitor_warns_once_when_nothing_will_print() -> None:
    with pytest.warns(UserWarning, match=r"per_print_times=50\) will print nothing") as record:
        make_model().train(2, make_batches(4), callbacks=[LossMonitor(50)])
    assert len(record) == 1


def _nan_after(step: int) -> Any:
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = nn.functional.cross_entropy(out, label)
        return loss * float("nan") if calls["n"] >= step else loss

    return loss_fn


def test_loss_monitor_raises_on_nan_at_print_step(capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    model = Model(net, _nan_after(2), torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    with pytest.raises(ValueError, match=r"In epoch: 1 step: 2, loss is NAN or INF"):
        model.train(1, make_batches(4), callbacks=[LossMonitor(1)])


def test_loss_monitor_catches_nan_by_epoch_end_between_prints() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    model = Model(net, _nan_after(3), torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    with pytest.raises(ValueError, match="loss is NAN or INF"):
        model.train(1, make_batches(8), callbacks=[LossMonitor(5)])


def test_two_loss_monitors_with_different_cadence_are_allowed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    make_model().train(1, make_batches(4), callbacks=[LossMonitor(2), LossMonitor(4)])
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_step_time_leaves_out_the_step_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    # A clock that moves only when told: each reading is 1 ms after the last, and the slow
    # hook moves it by 10 s. No wall-clock time is measured, so a loaded machine cannot fail it.
    clock = [0.0]

    def now() -> float:
        clock[0] += 0.001
        return clock[0]

    times: list[float] = []

    def slow(rc: Any) -> None:
        times.append(rc.original_args().step_time)
        clock[0] += 10.0

    monkeypatch.setattr(time, "perf_counter", now)
    make_model().train(1, make_batches(4), callbacks=[LambdaCallback(on_train_step_end=slow)])
    assert len(times) == 4 and all(0 < t < 1.0 for t in times[1:])


# -- TimeMonitor ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"data_size": 0}, ValueError, "'data_size' must be an int >= 1"),
        ({"data_size": "3"}, TypeError, "'data_size' must be an int or None"),
        ({"data_time": 1}, TypeError, "'data_time' must be a bool"),
    ],
)
def test_time_monitor_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        TimeMonitor(**kwargs)


_TIME_LINE = r"Train epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms"


def test_time_monitor_prints_train_and_eval_lines(capsys: pytest.CaptureFixture[str]) -> None:
    make_model(metrics={"accuracy"}).fit(
        2, make_batches(3), make_batches(2), callbacks=[TimeMonitor()]
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"Eval epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms", lines[0])
    assert re.fullmatch(_TIME_LINE, lines[1])


def test_time_monitor_train_time_excludes_validation(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    slow_eval = LambdaCallback(on_eval_step_end=lambda rc: time.sleep(0.05))
    make_model(metrics={"accuracy"}).fit(
        1, make_batches(2), make_batches(4), callbacks=[TimeMonitor(), slow_eval]
    )
    out = capsys.readouterr().out
    eval_ms = float(re.search(r"Eval epoch time: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    train_ms = float(re.search(r"Train epoch time: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert eval_ms >= 200
    assert train_ms < eval_ms


def test_time_monitor_data_time_and_data_size(capsys: pytest.CaptureFixture[str]) -> None:
    make_model().train(1, make_batches(4), callbacks=[TimeMonitor(data_size=2, data_time=True)])
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(_TIME_LINE + r" \(data time: \d+\.\d{3} ms\)", line)
    total, per_step = (float(v) for v in re.findall(r"([\d.]+) ms", line)[:2])
    assert per_step == pytest.approx(total / 2, abs=0.002)


def test_time_monitor_default_adds_no_step_hooks() -> None:
    from stepwatch.train.callback import CallbackList

    table = CallbackList([TimeMonitor()]).table
    assert not table["on_train_step_begin"] and not table["on_train_step_end"]
    assert CallbackList([TimeMonitor(data_time=True)]).table["on_train_step_end"]


# -- History -------------------------------------------------------------------------------
def test_history_records_plain_floats_per_epoch_and_resets() -> None:
    history = History()
    model = make_model(metrics={"accuracy"})
    model.fit(3, make_batches(3), make_batches(2), valid_frequency=2, callbacks=[history])
    assert history.epoch == {"epoch": [1, 2, 3]}
    h = history.history
    assert set(h) == {
        "net_output",
        "loss",
        "train_accuracy",
        "accuracy",
        "eval_accuracy",
        "eval_loss",
    }
    assert all(len(v) == 3 for v in h.values())
    assert all(type(v) is float for values in h.values() for v in values)
    # In a fit that validates, the bare name is the validation value, never a training one.
    assert math.isnan(h["accuracy"][0]) and not math.isnan(h["accuracy"][1])
    assert h["accuracy"][1] == h["eval_accuracy"][1] and math.isnan(h["accuracy"][2])
    model.train(1, make_batches(1), callbacks=[history])
    assert history.epoch == {"epoch": [1]} and set(history.history) == {
        "net_output",
        "loss",
        "train_accuracy",
        "accuracy",
    }
    assert history.history["accuracy"] == history.history["train_accuracy"]


def test_history_step_ring_keeps_the_last_step_losses() -> None:
    losses: list[float] = []
    history = History(step_history=5)
    spy = LambdaCallback(on_train_step_end=lambda rc: losses.append(rc.original_args().loss))
    make_model().train(3, make_batches(4), callbacks=[spy, history])
    assert history.steps is not None and len(history.steps) == 5
    assert history.steps.steps().tolist() == list(range(8, 13))
    np.testing.assert_allclose(history.steps.values(), losses[-5:], rtol=1e-6)
    pairs = list(history.steps)  # (step, loss) pairs of Python numbers, oldest first
    assert [s for s, _ in pairs] == list(range(8, 13)) and type(pairs[0][1]) is float
    assert history.steps[-1] == pairs[-1] and history.steps[0] == pairs[0]
    assert history.steps[1:3] == pairs[1:3]
    with pytest.raises(IndexError, match="out of range"):
        history.steps[5]
    assert History().steps is None
    with pytest.raises(ValueError, match="'step_history' must be an int >= 0"):
        History(step_history=-1)
    with pytest.raises(TypeError, match="'step_history' must be an int"):
        History(step_history=2.5)  # type: ignore[arg-type]


# -- LambdaCallback ------------------------------------------------------------------------
def test_lambda_callback_validation_and_calls() -> None:
    with pytest.raises(TypeError, match="'on_train_step_end' must be a callable or None"):
        LambdaCallback(on_train_step_end=3)  # type: ignore[arg-type]
    events: list[str] = []
    cb = LambdaCallback(
        on_train_begin=lambda rc: events.append("begin"),
        on_train_epoch_end=lambda rc: events.append(f"epoch{rc.original_args().cur_epoch_num}"),
        on_eval_end=lambda rc: events.append("eval"),
    )
    make_model(metrics={"accuracy"}).fit(2, make_batches(1), make_batches(1), callbacks=cb)
    assert events == ["begin", "eval", "epoch1", "eval", "epoch2"]
