"""stepwatch.watch: the callbacks of Model.train in a training loop written by hand."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stepwatch
from stepwatch import AnomalyMonitor, LossMonitor, RunRecorder, Store
from stepwatch.monitor import values

from .bridge_support import LossAbove, SeedStyle, assert_loss_monitor_lines, assert_saw_every_step


def _data(n: int = 64, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x.sum(1, keepdim=True) > 0).float()
    return [(x[i : i + 4], y[i : i + 4]) for i in range(0, n, 4)]


def _train(
    tmp_path: Path, callbacks: list[Any], poison: dict[int, float], epochs: int = 3
) -> tuple[Any, list[float], nn.Module, torch.optim.Optimizer, list[int]]:
    """The hand-written loop: 16 batches an epoch; ``poison`` scales the loss at some steps
    (a NaN or a spike), the way a bad batch would."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    loader = _data()
    computed: list[float] = []
    stopped_in: list[int] = []
    run = stepwatch.watch(net, opt, callbacks=callbacks, epochs=epochs,
                          steps_per_epoch=len(loader))  # fmt: skip
    with run:
        for epoch in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                loss = loss_fn(net(x), y) * poison.get(len(computed) + 1, 1.0)
                loss.backward()
                opt.step()
                computed.append(loss.item())
                run.step(loss)
                if run.should_stop:
                    break
            with torch.no_grad():
                val = float(sum(loss_fn(net(x), y) for x, y in loader) / len(loader))
            run.epoch_end(eval_loss=val)
            if run.should_stop:
                stopped_in.append(epoch + 1)
                break
    return run, computed, net, opt, stopped_in


def test_a_hand_written_loop_is_watched_like_model_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    user = SeedStyle()
    recorder = RunRecorder(db=db, run_name="hand")
    run, computed, *_ = _train(tmp_path, [LossMonitor(10), AnomalyMonitor(), recorder, user], {})
    out = capsys.readouterr().out
    assert_loss_monitor_lines(out, computed)  # MindSpore's lines, 16 steps an epoch
    # The user's callback saw every step, numbered as Model.train numbers them.
    assert_saw_every_step(user, computed)
    assert not run.should_stop and run.stop_reason is None
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "finished" and info.config["host"] == "loop"
        steps, losses = store.metrics(info.id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 49))
        np.testing.assert_allclose(losses, computed, rtol=1e-6)  # the losses the loop computed
        epoch_steps, epoch_losses = store.metrics(info.id, values.LOSS)
        assert epoch_steps.tolist() == [16, 32, 48]
        np.testing.assert_allclose(epoch_losses[0], np.mean(computed[:16]), rtol=1e-5)
        assert len(store.metrics(info.id, values.EVAL_LOSS)[0]) == 3
        assert store.metrics(info.id, values.LR)[1][-1] == pytest.approx(0.05)


def test_a_nan_stops_the_loop_and_the_run_is_stored_as_an_anomaly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        # LossMonitor prints the NaN step (step 20) and leaves the decision to AnomalyMonitor.
        run, computed, *_ = _train(tmp_path, [LossMonitor(10), monitor, recorder],
                                   {20: math.nan})  # fmt: skip
    assert "epoch: 2 step: 4, loss is nan" in capsys.readouterr().out
    assert run.should_stop is True  # after the run too, as Keras's stop_training stays set
    assert run.stop_kind == "anomaly" and run.stop_reason == "nonfinite at step 20"
    # A CPU loss is read as it comes, and a NaN wakes the monitor on its step: the stop comes
    # at step 20 itself.
    assert len(computed) == 20
    assert [a.kind for a in monitor.alerts] == ["nonfinite"]
    assert "stopping training" in caplog.text
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "anomaly"
        alerts = [e for e in store.events(info.id) if e["kind"] == "alert"]
        assert [(e["step"], e["data"]["kind"], e["data"]["actions"]) for e in alerts] == [
            (20, "nonfinite", ["stopping training"])
        ]
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == list(range(1, 21))


def test_a_spike_rolls_the_network_and_optimizer_back(tmp_path: Path) -> None:
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 20}}, action={"spike": "rollback"}, rollback_every=8
    )
    run, computed, net, _, _ = _train(tmp_path, [monitor], {30: 1e4})
    assert [a.kind for a in monitor.alerts] == ["spike"] and monitor.rollbacks == 1
    # The spike at step 30 was handed over on its step (it is above the spike detector's
    # alarm); the copy of step 24 (the newest before 30) was restored and the run went on
    # with the next batches.
    assert run.rollbacks == [(24, 30)]
    assert "rolled back to step 24" in monitor.outcomes[0]
    assert len(computed) == 48 and not run.stop_kind
    # The state really is the restored one followed by the steps after it: replaying steps
    # 1-24 and 31-48 without the spike gives the same weights.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    loader = _data()
    step = 0
    for _ in range(3):
        for x, y in loader:
            step += 1
            if 24 < step <= 30:
                continue
            ref_opt.zero_grad()
            nn.MSELoss()(ref(x), y).backward()
            ref_opt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_reduce_lr_changes_the_loops_optimizer_and_snapshot_writes_a_loadable_file(
    tmp_path: Path,
) -> None:
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 20}}, action={"spike": ["reduce_lr", "snapshot"]},
        snapshot_dir=tmp_path / "snap", lr_factor=0.5,
    )  # fmt: skip
    _, _, _, opt, _ = _train(tmp_path, [monitor], {30: 1e4})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    (path,) = (tmp_path / "snap").glob("*.pt")
    state = stepwatch.load_checkpoint(
        path, nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    )
    assert state["step"] == 30  # written on the spike's step


def test_an_exception_in_the_loop_marks_the_run_failed_with_its_steps(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    run = stepwatch.watch(net, opt, [recorder], steps_per_epoch=10)
    with pytest.raises(RuntimeError, match="data loader broke"), run:
        for i in range(5):
            loss = net(torch.ones(1, 2)).pow(2).mean().detach() * (i + 1)
            run.step(loss)
        raise RuntimeError("data loader broke")
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "failed"
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == [1, 2, 3, 4, 5]


def test_wrong_use_gets_a_clear_error() -> None:
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"'network' must be a torch\.nn\.Module"):
        stepwatch.watch("net", opt, steps_per_epoch=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'optimizer' must be a torch\.optim\.Optimizer"):
        stepwatch.watch(net, 0.1, steps_per_epoch=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'steps_per_epoch' must be an int"):
        stepwatch.watch(net, opt, steps_per_epoch=None)  # type: ignore[arg-type]
    other = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'optimizer' updates none of the network's parameters"):
        stepwatch.watch(net, other, steps_per_epoch=4)
    with pytest.raises(ValueError, match="'epochs' must be an int >= 1"):
        stepwatch.watch(net, opt, epochs=0, steps_per_epoch=4)
    with pytest.raises(TypeError, match="not an instance"):
        stepwatch.watch(net, opt, [LossMonitor], steps_per_epoch=4)
    with pytest.raises(ValueError, match="measures gradients, which needs the network"):
        stepwatch.watch(None, opt, [AnomalyMonitor()], steps_per_epoch=4)
    stepwatch.watch(None, opt, [AnomalyMonitor(detectors=["nonfinite"])], steps_per_epoch=4)
    with pytest.raises(ValueError, match=r"AnomalyMonitor needs the optimizer \(its 'rollback'"):
        stepwatch.watch(net, None, [AnomalyMonitor(action="rollback")], steps_per_epoch=4)
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs the optimizer"):
        stepwatch.watch(net, None, [stepwatch.ReduceLROnPlateau()], steps_per_epoch=4)
    stepwatch.watch(net, None, [AnomalyMonitor(action="stop")], steps_per_epoch=4)

    run = stepwatch.watch(net, opt, epochs=2, steps_per_epoch=1)
    loss = net(torch.ones(1, 2)).sum()
    with pytest.raises(RuntimeError, match="before the run started"):
        run.step(loss)
    with run:
        with pytest.raises(TypeError, match=r"pass the tensor, not loss.item\(\)"):
            run.step(loss.item())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="must hold one value"):
            run.step(torch.ones(3))
        with pytest.raises(TypeError, match="'eval_loss' must be a number"):
            run.epoch_end(eval_loss="low")  # type: ignore[arg-type]
        run.step(loss)
        # A bad value is refused before the epoch ends: the retry still has the epoch's loss.
        with pytest.raises(TypeError, match=r"'eval_acc' must be .* got a tensor of 2 values"):
            run.epoch_end(eval_acc=torch.tensor([0.5, 0.6]))
        run.epoch_end(eval_acc=torch.tensor(0.5))
        assert run.cb_params.loss == pytest.approx(loss.item())
        run.step(loss)
    with pytest.raises(RuntimeError, match="outside the run"):
        run.step(loss)
    with pytest.raises(RuntimeError, match="already started"):
        run.__enter__()


def test_the_hand_loop_example_stops_on_its_nan_and_stores_an_anomaly(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    db = tmp_path / "runs.db"
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "hand_loop.py"), str(db)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "stopped: nonfinite at step 25 (anomaly) after 25 steps" in result.stdout
    assert "stored as run 1 (hand-loop-nan): anomaly, 25 steps" in result.stdout


def test_a_users_own_detector_is_fed_stored_and_acted_on_like_a_builtin(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    monitor = AnomalyMonitor(
        detectors=["nonfinite", LossAbove(50.0)], action={"loss_above": "stop"}
    )
    run, computed, *_ = _train(tmp_path, [monitor, recorder], {21: 1e3})
    assert (monitor.alerts[0].kind, monitor.alerts[0].step) == ("loss_above", 21)
    assert {a.kind for a in monitor.alerts} == {"loss_above"}
    assert run.stop_kind == "anomaly" and len(computed) == 24
    with Store(db) as store:
        event = next(e for e in store.events(recorder.run_id) if e["kind"] == "alert")
        assert event["step"] == 21 and event["data"]["kind"] == "loss_above"
        assert event["data"]["actions"] == ["stopping training"]
        assert event["message"].endswith("above 50.0: check the data.")
    with pytest.raises(ValueError, match="unknown detector kind 'loss_abov'"):
        AnomalyMonitor(detectors=[LossAbove(1.0)], action={"loss_abov": "stop"})


def test_a_loop_that_disagrees_with_what_it_told_watch_is_warned_once_each() -> None:
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(run: Any) -> None:
        opt.zero_grad()
        loss = net(torch.ones(4, 2)).pow(2).mean()
        loss.backward()
        opt.step()
        run.step(loss)

    # steps_per_epoch counted in samples, not batches: the epochs are shorter
    warned = pytest.warns(UserWarning, match=r"epoch 1 had 4 steps, not steps_per_epoch=64")
    with warned as seen, stepwatch.watch(net, opt, epochs=2, steps_per_epoch=64) as run:
        for _ in range(2):
            for _ in range(4):
                step(run)
            run.epoch_end()
    assert len(seen) == 1
    # a Keras-style name for a validation value, and an epoch_end twice, past the epochs told
    with pytest.warns(UserWarning) as seen, stepwatch.watch(net, opt, steps_per_epoch=2) as run:
        step(run)
        step(run)
        run.epoch_end(val_loss=0.5)
        run.epoch_end(val_loss=0.5)
    shown = [str(w.message) for w in seen]
    assert len(shown) == 3, shown
    assert "'val_loss' is recorded as a training value (train_val_loss)" in shown[0]
    assert "with no run.step() since the last epoch's end" in shown[1]
    assert "epoch 2 is past watch(epochs=1)" in shown[2]
    assert run.cb_params.cur_epoch_num == 2
    # an epoch longer than told (no epoch_end at all): warned once, at its first extra step
    with pytest.warns(UserWarning) as seen, stepwatch.watch(net, opt, steps_per_epoch=3) as run:
        for _ in range(7):
            step(run)
        assert run.step_num == 7
    shown = [str(w.message) for w in seen]
    assert len(shown) == 1 and "epoch 1 has more steps than steps_per_epoch=3" in shown[0]
    assert run.cb_params.cur_step_num == 7  # the run's end sets it


def test_the_run_says_ahead_which_steps_its_callbacks_look_at() -> None:
    """``looks_next`` foresees the steps the step clock wakes the callbacks for (LossMonitor's
    every 5th), so that a host can gather outputs for those steps only; a callback with a
    per-step hook makes every step one."""

    class Outputs(stepwatch.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, Any]] = []

        def on_train_step_end(self, run_context: Any) -> None:
            p = run_context.original_args()
            self.seen.append((p.cur_step_num, p.outputs))

    net = nn.Linear(4, 1)
    for callbacks, every in (([LossMonitor(5)], False), ([Outputs()], True)):
        ahead, looked = [], []
        with stepwatch.watch(net, callbacks=callbacks, epochs=1, steps_per_epoch=12) as run:
            for step in range(1, 13):
                ahead.append(run.looks_next)
                run.step(torch.tensor(0.5), outputs=torch.full((1,), float(step)))
                looked.append(run.cb_params.outputs is not None and
                              int(run.cb_params.outputs) == step)  # fmt: skip
        if every:
            assert ahead == [True] * 12 and looked == [True] * 12
            assert [s for s, _ in callbacks[0].seen] == list(range(1, 13))
        else:
            assert [i + 1 for i, a in enumerate(ahead) if a] == [5, 10]
            assert [i + 1 for i, seen in enumerate(looked) if seen] == [5, 10]
