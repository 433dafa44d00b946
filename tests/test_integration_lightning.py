"""stepwatch.integrations.lightning: stepwatch's callbacks inside a real Lightning Trainer.fit."""

from __future__ import annotations

import io
import logging
import math
import re
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from stepwatch import AnomalyMonitor, Callback, LossMonitor, ProgressBar, RunRecorder, Store
from stepwatch.integrations.lightning import StepwatchCallback
from stepwatch.monitor import values

from .bridge_support import assert_saw_every_step, assert_stopped_for_anomaly

pytestmark = [
    # Lightning's own tree helper still builds torch's deprecated LeafSpec.
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
    # The tiny in-memory loaders need no worker processes.
    pytest.mark.filterwarnings(
        "ignore:The '(train|val)_dataloader' does not have many workers"
        ":lightning.fabric.utilities.warnings.PossibleUserWarning"
    ),
]


class Net(pl.LightningModule):
    """A tiny MLP; it keeps every loss its training_step computed, as the test's own record.

    ``poison`` scales the loss of some batches (1-based, counted over the fit), as a bad batch
    would; ``fail_at`` raises ``fail_with`` in that batch."""

    def __init__(
        self,
        lr: float = 0.05,
        poison: dict[int, float] | None = None,
        fail_at: int | None = None,
        fail_with: type[BaseException] = RuntimeError,
    ) -> None:
        super().__init__()
        self.save_hyperparameters("lr")
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.poison = poison or {}
        self.fail_at, self.fail_with = fail_at, fail_with
        self.computed: list[float] = []
        self.val_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        n = len(self.computed) + 1
        if n == self.fail_at:
            raise self.fail_with("the data loader broke")
        loss = F.mse_loss(self.net(x), y) * self.poison.get(n, 1.0)
        self.computed.append(loss.item())  # the test's record; the bridge reads no .item()
        self.log("train_mae", F.l1_loss(self.net(x), y), on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_steps += 1
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class SeedStyle(Callback):
    """A MindSpore-style user callback, as the seed writes them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, float]] = []
        self.epochs: list[int] = []
        self.grads: list[bool] = []

    def step_end(self, run_context: Any) -> None:
        cb_params = run_context.original_args()
        loss = float(cb_params.net_outputs.asnumpy())
        self.seen.append((cb_params.cur_step_num, cb_params.cur_epoch_num, loss))
        params = list(cb_params.train_network.parameters())
        self.grads.append(all(p.grad is not None and bool(p.grad.abs().sum()) for p in params))

    def epoch_end(self, run_context: Any) -> None:
        self.epochs.append(run_context.original_args().cur_epoch_num)


class ValLog(pl.Callback):
    """Lightning's own view of the validation values, for comparison."""

    def __init__(self) -> None:
        self.val_losses: list[float] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def _loaders(n: int = 64) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x.sum(1, keepdim=True) > 0).float()
    train = DataLoader(TensorDataset(x, y), batch_size=4)  # 16 batches, in order
    return train, DataLoader(TensorDataset(x[:16], y[:16]), batch_size=4)


def _trainer(callbacks: list[Any], epochs: int = 3, **options: Any) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **options,
    )


def _fit(
    callbacks: list[Any],
    epochs: int = 3,
    val: bool = True,
    model: type[Net] | None = None,
    **options: Any,
) -> tuple[pl.Trainer, Net]:
    """Fit a fresh Net (seeded as the hand-loop tests seed theirs) with the given callbacks;
    ``val=False`` turns validation off (``limit_val_batches=0``)."""
    net_options = {k: options.pop(k) for k in ("poison", "fail_at", "fail_with") if k in options}
    torch.manual_seed(0)
    net = (model or Net)(**net_options)
    if not val:
        options["limit_val_batches"] = 0
    trainer = _trainer(callbacks, epochs, **options)
    trainer.fit(net, *_loaders())
    return trainer, net


def test_a_lightning_fit_is_watched_like_model_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    recorder, user, val_log = RunRecorder(db=db, run_name="lit"), SeedStyle(), ValLog()
    bar = io.StringIO()  # not a terminal: the bar writes plain lines
    watch = StepwatchCallback(
        [recorder, AnomalyMonitor(), LossMonitor(10), user, ProgressBar(file=bar)]
    )
    trainer, model = _fit([watch, val_log], num_sanity_val_steps=2)
    computed = model.computed
    assert len(computed) == 48 and trainer.global_step == 48
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch:")]
    # MindSpore's lines on the global-step cadence (16 steps an epoch), then the eval line.
    steps = [re.match(r"epoch: (\d+) step: (\d+), loss is", line) for line in lines]
    assert [m.groups() for m in steps if m] == [("1", "10"), ("2", "4"), ("2", "14"), ("3", "8")]
    assert float(lines[0].rsplit(" ", 1)[1]) == pytest.approx(computed[9], rel=1e-6)
    # The user's callback saw every optimizer step, numbered as Model.train numbers them, with
    # the gradients of the step still on the module.
    assert_saw_every_step(user, computed)
    assert all(user.grads)
    assert [line.split(", loss")[0] for line in bar.getvalue().splitlines()] == [
        "epoch 1/3 step 16/16", "epoch 2/3 step 16/16", "epoch 3/3 step 16/16",
    ]  # fmt: skip
    # The sanity check ran 2 validation steps; they are not training and not an epoch's values.
    assert model.val_steps == 2 + 3 * 4
    assert watch.stop_reason is None and watch.run is not None and not watch.run.stop_kind
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert (info.name, info.status) == ("lit", "finished")
        assert info.config["host"] == "lightning"
        host_config = info.config["host_config"]
        assert host_config["model"] == "Net" and host_config["hparams"] == {"lr": 0.05}
        assert host_config["trainer"]["max_epochs"] == 3
        assert host_config["trainer"]["precision"] == "32-true"
        assert host_config["trainer"]["accumulate_grad_batches"] == 1
        steps_, losses = store.metrics(info.id, values.STEP_LOSS)
        assert steps_.tolist() == list(range(1, 49))
        np.testing.assert_allclose(losses, computed, rtol=1e-6)  # the losses Lightning computed
        epoch_steps, epoch_losses = store.metrics(info.id, values.LOSS)
        assert epoch_steps.tolist() == [16, 32, 48]
        np.testing.assert_allclose(epoch_losses[0], np.mean(computed[:16]), rtol=1e-5)
        # val_loss is stepwatch's eval_loss: once per epoch, as Lightning computed it.
        eval_steps, eval_losses = store.metrics(info.id, values.EVAL_LOSS)
        assert eval_steps.tolist() == [16, 32, 48]
        np.testing.assert_allclose(eval_losses, val_log.val_losses, rtol=1e-6)
        assert len(store.metrics(info.id, "train_mae")[0]) == 3  # the epoch's, not per step
        assert "train_mae_step" not in store.keys(info.id)
        assert store.metrics(info.id, values.LR)[1][-1] == pytest.approx(0.05)


def test_accumulated_batches_make_one_step_with_their_mean_loss(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder, user = RunRecorder(db=db), SeedStyle()
    watch = StepwatchCallback([recorder, user])
    trainer, model = _fit([watch], epochs=2, val=False, accumulate_grad_batches=3)
    # 16 batches an epoch in windows of 3: 5 full windows and one of a single batch.
    assert trainer.global_step == 12 and len(model.computed) == 32
    windows = [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 16)]
    expected = [
        np.mean(model.computed[e * 16 + a : e * 16 + b]) for e in (0, 1) for a, b in windows
    ]
    assert [s for s, _, _ in user.seen] == list(range(1, 13))
    assert [e for _, e, _ in user.seen] == [1] * 6 + [2] * 6
    assert all(user.grads)  # the accumulated gradients, after the optimizer step
    with Store(db) as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 13))
        np.testing.assert_allclose(losses, expected, rtol=1e-6)
        trainer_config = store.run(recorder.run_id).config["host_config"]["trainer"]
        assert trainer_config["accumulate_grad_batches"] == 3


class EpochLogged(Net):
    """Logs a value in its own on_train_epoch_end, which Lightning runs after the callbacks'."""

    def on_train_epoch_end(self) -> None:
        self.log("late", float(self.current_epoch))


def test_epoch_values_are_this_epochs_only(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    _fit([StepwatchCallback([recorder])], model=EpochLogged, check_val_every_n_epoch=2)
    with Store(db) as store:
        # Validation ran after epoch 2 only: epochs 1 and 3 repeat no old val_loss.
        assert store.metrics(recorder.run_id, values.EVAL_LOSS)[0].tolist() == [32]
        assert store.metrics(recorder.run_id, "train_mae")[0].tolist() == [16, 32, 48]
        keys = store.keys(recorder.run_id)
        assert not [k for k in keys if "late" in k]  # logged after the bridge's hook


def test_a_nan_stops_the_fit_and_the_run_is_an_anomaly_in_the_store_and_dashboard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db, run_name="lit-nan")
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    watch = StepwatchCallback([LossMonitor(10), monitor, recorder])
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        trainer, model = _fit([watch], poison={20: math.nan})
    assert "epoch: 2 step: 4, loss is nan" in capsys.readouterr().out
    # A CPU loss is read as it comes and a NaN is handed over at once: the NaN of step 20
    # stops the Trainer at step 20.
    assert trainer.global_step == 20 and len(model.computed) == 20
    assert trainer.should_stop and trainer.current_epoch == 2
    assert watch.stop_reason == "nonfinite at step 20"
    assert watch.run is not None and watch.run.stop_kind == "anomaly"
    assert [(a.kind, a.step) for a in monitor.alerts] == [("nonfinite", 20)]
    assert "stopping training" in caplog.text
    assert_stopped_for_anomaly(db, recorder.run_id, alert_step=20, last_step=20)
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert (info.name, info.config["host"]) == ("lit-nan", "lightning")


class Weights(Callback):
    """Keeps a copy of the module's weights at one step (a stepwatch callback)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state: dict[str, torch.Tensor] = {}

    def step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        if p.cur_step_num == self.step:
            self.state = {k: v.clone() for k, v in p.train_network.state_dict().items()}


def test_reduce_lr_and_snapshot_act_on_the_trainer(tmp_path: Path) -> None:
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 20}}, action={"spike": ["reduce_lr", "snapshot"]},
        snapshot_dir=tmp_path / "snap", lr_factor=0.5,
    )  # fmt: skip
    at_30 = Weights(30)
    trainer, _ = _fit([StepwatchCallback([monitor, at_30])], val=False, poison={30: 1e4})
    assert [(a.kind, a.step) for a in monitor.alerts] == [("spike", 30)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)
    # The snapshot is Lightning's own checkpoint of step 30 (the spike was read on its step:
    # a CPU loss over the spike detector's alarm is handed over at once).
    (path,) = (tmp_path / "snap").glob("*.ckpt")
    assert (
        path.name == "anomaly-spike-step30.ckpt" and (path.parent / f"{path.stem}.json").is_file()
    )
    assert not list((tmp_path / "snap").glob(".tmp-*"))
    loaded = Net.load_from_checkpoint(path)
    assert loaded.hparams.lr == pytest.approx(0.05)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, at_30.state[key])
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 30 and checkpoint["optimizer_states"]


def test_a_spike_rolls_the_module_and_optimizer_back_in_place() -> None:
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 20}}, action={"spike": "rollback"}, rollback_every=8
    )
    watch = StepwatchCallback([monitor])
    trainer, model = _fit([watch], val=False, poison={30: 1e4})
    assert monitor.rollbacks == 1 and "rolled back to step 24" in monitor.outcomes[0]
    assert watch.run is not None and watch.run.rollbacks == [(24, 30)]
    assert trainer.global_step == 48 and not watch.run.stop_kind
    # Replaying steps 1-24 and 31-48 without the spike by hand gives the same weights.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    train, _ = _loaders()
    step = 0
    for _ in range(3):
        for x, y in train:
            step += 1
            if 24 < step <= 30:
                continue
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            opt.step()
    for a, b in zip(model.net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


class TwoOptimizers(Net):
    """Manual optimization with one optimizer per layer: stepwatch cannot roll it back."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        first, second = self.optimizers()  # type: ignore[misc]
        first.zero_grad()
        second.zero_grad()
        loss = F.mse_loss(self.net(x), y) * self.poison.get(len(self.computed) + 1, 1.0)
        self.computed.append(loss.item())
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.05),
            torch.optim.SGD(self.net[2].parameters(), lr=0.05),
        ]


def test_rollback_stops_where_lightning_cannot_be_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    monitor = AnomalyMonitor(
        detectors={"spike": {"window": 20}, "grad_explosion": {}}, action={"spike": "rollback"}
    )
    watch = StepwatchCallback([monitor, recorder])
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        trainer, model = _fit([watch], val=False, model=TwoOptimizers, poison={30: 1e4})
    # Manual optimization: the gradients are the module's business, the detectors say so.
    assert "lightning gives no gradients, so the grad_explosion detectors are off" in caplog.text
    # One stepwatch step per batch (Lightning's global_step counts both optimizers' steps).
    assert len(model.computed) == 30 and trainer.global_step == 60
    assert monitor.outcomes == [
        "lightning cannot restore weights and optimizer mid-run, stopping training"
    ]
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "anomaly"
        assert info.config["host_config"]["trainer"]["optimizers"] == ["SGD", "SGD"]
        np.testing.assert_allclose(
            store.metrics(info.id, values.STEP_LOSS)[1], model.computed, rtol=1e-6
        )


def test_a_training_step_without_a_loss_is_left_out_with_a_warning() -> None:
    class Silent(TwoOptimizers):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 3 else loss

    user = SeedStyle()
    with pytest.warns(UserWarning, match="training_step returned no loss for optimizer step 8"):
        _fit([StepwatchCallback([user])], epochs=1, val=False, model=Silent)
    assert [s for s, _, _ in user.seen] == list(range(1, 16))


def test_lightning_calls_only_the_batch_hooks_the_bridge_uses() -> None:
    # Lightning's SimpleProfiler names every callback hook it calls: the bridge's unused
    # per-batch hooks are skipped (none of them), and a subclass can still define one.
    calls: list[int] = []

    class Mine(StepwatchCallback):
        def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
            calls.append(trainer.global_step)

    user = SeedStyle()
    trainer, _ = _fit([StepwatchCallback([user]), Mine([])], epochs=1, profiler="simple")
    called = {
        name.split(".", 1)[1]
        for name in trainer.profiler.recorded_durations
        if name.startswith("[Callback]StepwatchCallback.")
    }
    assert "on_train_batch_end" in called and "on_train_epoch_end" in called
    batch_hooks = {"on_train_batch_start", "on_before_backward", "on_after_backward",
                   "on_before_optimizer_step", "on_before_zero_grad",
                   "on_validation_batch_start", "on_validation_batch_end"}  # fmt: skip
    assert not called & batch_hooks
    assert any(n.endswith("Mine.on_after_backward") for n in trainer.profiler.recorded_durations)
    assert calls == list(range(16))
    assert [s for s, _, _ in user.seen] == list(range(1, 17))  # the bridge still saw each step


def test_an_exception_in_training_marks_the_run_failed(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    with pytest.raises(RuntimeError, match="the data loader broke"):
        _fit([StepwatchCallback([recorder])], fail_at=10)
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "failed"
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == list(range(1, 10))


def test_ctrl_c_marks_the_run_interrupted(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning shuts down on KeyboardInterrupt once the callbacks ran: SystemExit(1).
        with pytest.raises(SystemExit):
            _fit([StepwatchCallback([recorder])], fail_at=5, fail_with=KeyboardInterrupt)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl-C from then on
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "interrupted"
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == [1, 2, 3, 4]


def test_wrong_use_gets_a_clear_error() -> None:
    with pytest.raises(TypeError, match="callbacks"):
        StepwatchCallback(callbacks=42)
    with pytest.raises(TypeError, match="not an instance"):
        StepwatchCallback(callbacks=[RunRecorder])
    with pytest.raises(TypeError):
        StepwatchCallback(callbacks=[pl.Callback()])  # a Lightning callback goes in the Trainer
    watch = StepwatchCallback(LossMonitor(5))
    assert [type(cb).__name__ for cb in watch.callbacks] == ["LossMonitor"]
    assert repr(watch) == "StepwatchCallback([LossMonitor])"
    assert watch.run is None and watch.stop_reason is None


def test_a_fit_resumed_from_a_checkpoint_counts_on_from_it(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    trainer, net = _fit([StepwatchCallback([RunRecorder(db=db)])], epochs=1, val=False)
    ckpt = tmp_path / "after-epoch-1.ckpt"
    trainer.save_checkpoint(ckpt)
    recorder, user = RunRecorder(db=db), SeedStyle()
    resumed = _trainer([StepwatchCallback([recorder, user])], 3, limit_val_batches=0)
    resumed.fit(net, *_loaders(), ckpt_path=ckpt)
    # 16 steps an epoch: the resumed fit trains steps 17-48, epochs 2 and 3.
    assert [s for s, _, _ in user.seen] == list(range(17, 49))
    assert sorted({e for _, e, _ in user.seen}) == [2, 3]
    with Store(db) as store:
        assert store.metrics(recorder.run_id, values.STEP_LOSS)[0].tolist() == list(range(17, 49))
        assert store.metrics(recorder.run_id, values.LOSS)[0].tolist() == [32, 48]
        assert store.run(recorder.run_id).config["epochs"] == 3


def test_two_processes_record_one_run_and_stop_together(tmp_path: Path) -> None:
    """Lightning's DDP on two CPU processes: rank 0 records the one run and prints; rank 1's
    NaN is seen through the ranks' mean loss and stops every rank at the same step."""
    import subprocess
    import sys

    job = Path(__file__).resolve().parent / "jobs" / "lightning_ddp_job.py"
    db = tmp_path / "runs.db"
    done = subprocess.run(
        [sys.executable, str(job), str(db), "20"], capture_output=True, text=True,
        timeout=240, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # One set of MindSpore lines (rank 0's), up to the stop.
    assert done.stdout.count("epoch: 1 step: 8, loss is") == 1
    with Store(db) as store:
        (run,) = store.runs()
        assert (run.name, run.status) == ("ddp", "anomaly")
        assert run.config["host"] == "lightning"
        alerts = [e for e in store.events(run.id) if e["kind"] == "alert"]
        # Lightning's global_step 20 is stepwatch's step 21. The losses are read every 8 steps
        # (the stop at step 24), unless the gradients are measured at step 21 (every 10 steps
        # while the explosion detector warms up): the stop on that step. One alert either way.
        assert [(e["step"], e["data"]["kind"]) for e in alerts] == [(21, "nonfinite")]
        steps = store.metrics(run.id, values.STEP_LOSS)[0].tolist()
        assert steps[-1] in (21, 24) and steps == list(range(1, steps[-1] + 1))
