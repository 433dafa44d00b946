"""The Hugging Face Trainer bridge, against the real ``transformers.Trainer``."""

from __future__ import annotations

import importlib.metadata
import inspect
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from stepwatch import AnomalyMonitor, Callback, LossMonitor, ProgressBar, RunRecorder, Store
from stepwatch.integrations.transformers import StepwatchCallback
from stepwatch.monitor import values
from stepwatch.train.callback._callback import on_clock

from .bridge_support import (
    LossAbove,
    SeedStyle,
    assert_loss_monitor_lines,
    assert_saw_every_step,
    assert_stopped_for_anomaly,
)

ROOT = Path(__file__).resolve().parents[1]
N, BATCH = 64, 4  # 16 optimizer steps an epoch


class TinyConfig(PretrainedConfig):
    model_type = "stepwatch-tiny"

    def __init__(self, n_in: int = 4, hidden: int = 8, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_in, self.hidden = n_in, hidden


class TinyModel(PreTrainedModel):
    """A Trainer model: it returns its loss, and notes every training loss it computes.

    ``poison`` maps a training forward (1-based) to a factor for its loss (a NaN, a spike) or
    an exception to raise there, the way a bad batch would."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = nn.Sequential(
            nn.Linear(config.n_in, config.hidden), nn.Tanh(), nn.Linear(config.hidden, 1)
        )
        self.post_init()
        self.computed: list[float] = []
        self.poison: dict[int, Any] = {}

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        loss = nn.functional.mse_loss(out, labels)
        if self.training and torch.is_grad_enabled():
            bad = self.poison.get(len(self.computed) + 1)
            if isinstance(bad, BaseException):
                raise bad
            if bad is not None:
                loss = loss * bad
            self.computed.append(loss.item())
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = N, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Weights(TrainerCallback):
    """The Trainer's state as each step ends: weights, optimizer step count, schedule."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[list[torch.Tensor], float, int]] = {}
        self.first_step: int | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        opt_state = kw["optimizer"].state_dict()["state"]
        count = float(next(iter(opt_state.values()))["step"])
        params = [p.detach().clone() for p in kw["model"].parameters()]
        self.at[state.global_step] = (params, count, kw["lr_scheduler"].last_epoch)
        if self.first_step is None:
            self.first_step = state.global_step


def _args(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=N,
        num_train_epochs=3,
        learning_rate=0.05,
        dataloader_num_workers=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def _trainer(
    tmp_path: Path,
    callbacks: list[Any],
    poison: dict[int, Any] | None = None,
    eval_dataset: Any = None,
    **args: Any,
) -> Trainer:
    torch.manual_seed(0)
    model = TinyModel(TinyConfig())
    model.poison = dict(poison or {})
    if eval_dataset is None and args.get("eval_strategy", "no") != "no":
        eval_dataset = Data(seed=1)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, **args),
        train_dataset=Data(),
        eval_dataset=eval_dataset,
        callbacks=callbacks,
    )
    for callback in callbacks:  # as the docs show: the bridge reads the Trainer's own loss
        if isinstance(callback, StepwatchCallback):
            callback.attach(trainer)
    return trainer


def _computed(trainer: Trainer) -> list[float]:
    model = trainer.model
    assert isinstance(model, TinyModel)
    return model.computed


def test_a_trainer_run_is_watched_like_model_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    user, bar = SeedStyle(), io.StringIO()
    recorder = RunRecorder(db=db, run_name="hf")
    watch = StepwatchCallback(
        [recorder, AnomalyMonitor(), LossMonitor(10), user, ProgressBar(file=bar)]
    )
    trainer = _trainer(
        tmp_path, [watch], eval_strategy="epoch", logging_strategy="steps", logging_steps=8
    )
    trainer.train()
    computed = _computed(trainer)
    assert len(computed) == 48 and not watch.running
    out = capsys.readouterr().out
    assert_loss_monitor_lines(out, computed)  # MindSpore's lines, 16 steps an epoch
    # The user's callback saw every optimizer step, numbered as Model.train numbers them.
    assert_saw_every_step(user, computed)
    progress = [line for line in bar.getvalue().splitlines() if line.startswith("epoch ")]
    assert len(progress) == 3 and progress[-1].startswith("epoch 3/3 step 16/16, loss ")
    logged = [e for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == "finished"
        assert info.config["host"] == "transformers"
        host_config = info.config["host_config"]
        assert host_config["learning_rate"] == 0.05 and host_config["num_train_epochs"] == 3
        assert host_config["model_config"]["hidden"] == 8
        assert info.config["optimizer"] == "AdamW" and info.config["steps_per_epoch"] == 16
        steps, losses = store.metrics(info.id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 49))
        np.testing.assert_allclose(losses, computed, rtol=1e-6)  # the model's own losses
        # ... and the Trainer's: its logged loss is the mean of the step losses since its
        # last log, with the learning rate it stepped with.
        assert [e["step"] for e in logged] == [8, 16, 24, 32, 40, 48]
        for entry in logged:
            window = losses[entry["step"] - 8 : entry["step"]]
            assert float(np.mean(window)) == pytest.approx(entry["loss"], rel=1e-5)
        # The optimizer's rate, read when the losses are handed to the store (here at each
        # epoch's end, after the Trainer stepped its linear schedule past that step).
        lr_steps, lrs = store.metrics(info.id, values.LR)
        assert lr_steps.tolist() == [16, 32, 48]
        np.testing.assert_allclose(lrs, [0.05 * (48 - s) / 48 for s in (16, 32, 48)])
        eval_steps, eval_losses = store.metrics(info.id, values.EVAL_LOSS)
        assert eval_steps.tolist() == [16, 32, 48]
        np.testing.assert_allclose(eval_losses, evals, rtol=1e-6)
        assert "eval_runtime" not in store.keys(info.id)
        epoch_steps, epoch_losses = store.metrics(info.id, values.LOSS)
        assert epoch_steps.tolist() == [16, 32, 48]
        np.testing.assert_allclose(epoch_losses[0], np.mean(computed[:16]), rtol=1e-5)


def test_gradient_accumulation_makes_one_step_of_its_micro_batches(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    recorder, user = RunRecorder(db=db), SeedStyle()
    # 16 batches an epoch, 3 a step: 5 steps of 3 and one of the last batch. Two evaluation
    # datasets: the first one's values end each epoch, the second's are stored beside them.
    trainer = _trainer(
        tmp_path, [StepwatchCallback([recorder, user])], gradient_accumulation_steps=3,
        num_train_epochs=2, eval_strategy="epoch",
        eval_dataset={"a": Data(seed=1), "b": Data(seed=2)},
    )  # fmt: skip
    trainer.train()
    computed = _computed(trainer)
    assert len(computed) == 32 and trainer.state.global_step == 12
    starts = [e * 16 + i for e in range(2) for i in range(0, 16, 3)]
    expected = [float(np.mean(computed[i : min(i + 3, (i // 16 + 1) * 16)])) for i in starts]
    assert [(s, e) for s, e, _ in user.seen] == [(s, 1 + (s - 1) // 6) for s in range(1, 13)]
    history = trainer.state.log_history
    with Store(db) as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 13))
        np.testing.assert_allclose(losses, expected, rtol=1e-6)
        assert store.run(recorder.run_id).config["steps_per_epoch"] == 6
        for name in ("a", "b"):
            key = f"eval_{name}_loss"
            at, stored = store.metrics(recorder.run_id, key)
            assert at.tolist() == [6, 12]
            np.testing.assert_allclose(stored, [e[key] for e in history if key in e], rtol=1e-6)


class Normalising(TinyModel):
    """A model that takes the Trainer's ``num_items_in_batch`` and normalises its loss over
    the whole accumulated batch, as the Trainer's language models do."""

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None, **kw: Any
    ) -> dict[str, torch.Tensor]:
        out = self.net(x)
        error = (out - labels).pow(2)
        loss = error.sum() / num_items_in_batch if num_items_in_batch is not None else error.mean()
        return {"loss": loss, "logits": out}


def test_micro_batch_losses_normalised_over_the_step_add_up_as_the_trainer_adds_them(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    torch.manual_seed(0)
    args = _args(
        tmp_path, gradient_accumulation_steps=4, num_train_epochs=1, logging_strategy="steps",
        logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(
        model=Normalising(TinyConfig()), args=args, train_dataset=Data(),
    )  # fmt: skip
    StepwatchCallback([recorder]).attach(trainer)
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    with Store(db) as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        assert steps.tolist() == [1, 2, 3, 4]
        np.testing.assert_allclose(losses, logged, rtol=1e-6)  # the Trainer's own step losses


def test_a_nan_stops_the_trainer_and_the_run_is_an_anomaly_in_store_and_dashboard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db, run_name="nan")
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    trainer = _trainer(
        tmp_path, [StepwatchCallback([recorder, monitor, LossMonitor(5)])], {20: math.nan}
    )
    trainer.train()
    assert "epoch: 2 step: 4, loss is nan" in capsys.readouterr().out
    # A CPU loss is read as it comes and a NaN is handed over at once: the NaN of step 20
    # stops the Trainer at step 20.
    assert trainer.state.global_step == 20 and len(_computed(trainer)) == 20
    assert trainer.control.should_training_stop
    assert [(a.kind, a.step) for a in monitor.alerts] == [("nonfinite", 20)]
    assert_stopped_for_anomaly(db, recorder.run_id, alert_step=20, last_step=20)
    with Store(db) as store:
        assert math.isnan(store.metrics(recorder.run_id, values.STEP_LOSS)[1][19])


def test_reduce_lr_and_snapshot_act_on_the_trainer(tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    monitor = AnomalyMonitor(
        detectors=["nonfinite", LossAbove(50.0)], action={"loss_above": ["reduce_lr", "snapshot"]},
        snapshot_dir=snap, lr_factor=0.5,
    )  # fmt: skip
    spy = Weights()
    trainer = _trainer(
        tmp_path, [StepwatchCallback([monitor]), spy], {6: 1e4}, lr_scheduler_type="constant",
        max_grad_norm=1.0,
    )  # fmt: skip
    trainer.train()
    assert [(a.kind, a.step) for a in monitor.alerts] == [("loss_above", 6)]
    assert monitor.outcomes[0].startswith("learning rate reduced to 0.025; snapshot written to")
    # The alert was read at step 8: from step 9 on, the Trainer's optimizer steps at half rate.
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [pytest.approx(0.025)] * 2
    assert trainer.lr_scheduler.get_last_lr() == [pytest.approx(0.025)] * 2
    # The snapshot is a Trainer checkpoint of step 8: from_pretrained loads its model ...
    folder = snap / "anomaly-loss_above-step6"
    assert json.loads((snap / "anomaly-loss_above-step6.json").read_text())["checkpoint"] == (
        folder.name
    )
    loaded = TinyModel.from_pretrained(folder)
    for a, b in zip(loaded.parameters(), spy.at[8][0]):
        torch.testing.assert_close(a, b)
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 8
    # ... and the Trainer resumes from it, at step 9, with its optimizer and schedule.
    db = tmp_path / "resumed.db"
    recorder, resumed_spy = RunRecorder(db=db), Weights()
    resumed = _trainer(
        tmp_path, [StepwatchCallback([recorder]), resumed_spy], lr_scheduler_type="constant",
        num_train_epochs=1,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed_spy.first_step == 9 and resumed.state.global_step == 16
    assert resumed_spy.at[9][1] == 9.0  # AdamW's step count went on from the snapshot's 8
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    with Store(db) as store:
        assert store.metrics(recorder.run_id, values.STEP_LOSS)[0].tolist() == list(range(9, 17))


def test_rollback_restores_the_trainers_model_optimizer_and_schedule(tmp_path: Path) -> None:
    monitor = AnomalyMonitor(
        detectors=["nonfinite", LossAbove(50.0)], action={"loss_above": "rollback"},
        rollback_every=4,
    )  # fmt: skip
    spy = Weights()
    trainer = _trainer(tmp_path, [StepwatchCallback([monitor]), spy], {6: 1e4})
    trainer.train()
    assert monitor.rollbacks == 1
    assert monitor.outcomes == [
        "rolled back to step 4 (1 of 3); the batches of steps 5-8 are skipped"
    ]
    # The spike of step 6 was read at step 8: the state after step 4 came back in place.
    params4, count4, sched4 = spy.at[4]
    params8, count8, sched8 = spy.at[8]
    for a, b in zip(params8, params4):
        torch.testing.assert_close(a, b)
    assert (count8, sched8) == (count4, sched4) == (4.0, 4)
    assert trainer.state.global_step == 48  # the Trainer went on with the next batches


def test_rollback_where_nothing_was_kept_yet_stops_with_a_clear_outcome(tmp_path: Path) -> None:
    monitor = AnomalyMonitor(
        detectors=["nonfinite", LossAbove(50.0)], action={"loss_above": "rollback"},
        rollback_every=50,
    )  # fmt: skip
    # the first copy is taken after step 1: an anomaly at step 1 has none before it
    trainer = _trainer(tmp_path, [StepwatchCallback([monitor])], {1: 1e4})
    trainer.train()
    assert monitor.outcomes == ["no state from before step 1 to roll back to, stopping training"]
    assert trainer.state.global_step == 8


@pytest.mark.parametrize(
    ("error", "status"),
    [(RuntimeError("bad batch"), "failed"), (KeyboardInterrupt(), "interrupted")],
)
def test_an_exception_inside_train_marks_the_run(
    tmp_path: Path, error: BaseException, status: str
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    watch = StepwatchCallback([recorder])
    trainer = _trainer(tmp_path, [watch], {7: error})
    with pytest.raises(type(error)), watch:
        trainer.train()
    assert not watch.running
    with Store(db) as store:
        info = store.run(recorder.run_id)
        assert info.status == status
        assert store.metrics(info.id, values.STEP_LOSS)[0].tolist() == [1, 2, 3, 4, 5, 6]
        if status == "failed":
            errors = [e for e in store.events(info.id) if e["kind"] == "error"]
            assert errors and "bad batch" in errors[0]["message"]


def test_a_failed_train_without_with_is_stored_failed_by_the_next_train(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    watch = StepwatchCallback([RunRecorder(db=db)])
    trainer = _trainer(tmp_path, [watch], {3: RuntimeError("bad batch")}, num_train_epochs=1)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.train()
    assert watch.running  # the Trainer has no hook for the error: the run is open
    trainer.model.poison.clear()  # type: ignore[union-attr]
    trainer.train()  # the next train() stores the first run failed, then records its own
    with Store(db) as store:
        assert [r.status for r in store.runs()] == ["failed", "finished"]


FAILING_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
import torch
from tests.test_integration_transformers import _trainer
from stepwatch import RunRecorder
from stepwatch.integrations.transformers import StepwatchCallback


tmp = Path({tmp!r})
watch = StepwatchCallback([RunRecorder(db=tmp / "runs.db")])
_trainer(tmp, [watch], {{3: RuntimeError("bad batch")}}, num_train_epochs=1).train()
"""


def test_a_script_that_dies_inside_train_stores_the_run_failed(tmp_path: Path) -> None:
    script = FAILING_SCRIPT.format(root=str(ROOT), tmp=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1 and "RuntimeError: bad batch" in done.stderr
    with Store(tmp_path / "runs.db") as store:
        (info,) = store.runs()
        assert info.status == "failed"
        assert [e["message"] for e in store.events(info.id) if e["kind"] == "error"] == [
            "RuntimeError: bad batch"
        ]


class OwnLoss(Trainer):
    """A Trainer with a loss of its own, computed outside the model; ``hand_over`` hands the
    model's own loss to the bridge instead."""

    watch: StepwatchCallback | None = None

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        outputs = model(**inputs)
        loss = outputs["loss"] * 2.0
        if self.watch is not None:
            self.watch.record_loss(outputs["loss"])
        return (loss, outputs) if return_outputs else loss


def _logged(trainer: Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_a_loss_computed_outside_the_model_is_the_one_recorded(tmp_path: Path) -> None:
    """The Trainer's own step loss is recorded however it was computed: a compute_loss of the
    user's, compute_loss_func. record_loss hands over a different one."""
    db = tmp_path / "runs.db"
    logging = {"num_train_epochs": 1, "logging_strategy": "steps", "logging_steps": 1}
    for handed in (False, True):
        recorder = RunRecorder(db=db)
        watch = StepwatchCallback([recorder])
        torch.manual_seed(0)
        model = TinyModel(TinyConfig())
        trainer = OwnLoss(model=model, args=_args(tmp_path, **logging), train_dataset=Data())
        watch.attach(trainer)
        trainer.watch = watch if handed else None
        trainer.train()
        assert "training_step" not in vars(trainer)  # the Trainer's own is back
        with Store(db) as store:
            losses = store.metrics(recorder.run_id, values.STEP_LOSS)[1]
        factor = 1.0 if handed else 2.0
        np.testing.assert_allclose(losses, np.asarray(model.computed) * factor, rtol=1e-6)
        if not handed:
            np.testing.assert_allclose(losses, _logged(trainer), rtol=1e-6)

    class NoLoss(TinyModel):
        def forward(self, x: torch.Tensor, labels: Any = None) -> Any:  # type: ignore[override]
            return {"logits": self.net(x)}

    def mse(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        return nn.functional.mse_loss(outputs["logits"], labels)

    recorder = RunRecorder(db=db)
    torch.manual_seed(0)
    trainer = Trainer(
        model=NoLoss(TinyConfig()), args=_args(tmp_path, gradient_accumulation_steps=2, **logging),
        train_dataset=Data(), compute_loss_func=mse,
    )  # fmt: skip
    StepwatchCallback([recorder]).attach(trainer)
    trainer.train()
    with Store(db) as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 9))
        np.testing.assert_allclose(losses, _logged(trainer), rtol=1e-6)
        assert store.run(recorder.run_id).status == "finished"


def test_two_bridges_on_one_trainer_both_record_and_both_come_off(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    first, second = RunRecorder(db=db), RunRecorder(db=db)
    trainer = _trainer(
        tmp_path, [StepwatchCallback([first]), StepwatchCallback([second])], num_train_epochs=1
    )
    trainer.train()
    assert "training_step" not in vars(trainer)  # the Trainer's own again
    assert "clip_grad_norm_" not in vars(trainer.accelerator)  # ... and the accelerator's
    with Store(db) as store:
        a, b = (store.metrics(r.run_id, values.STEP_LOSS)[1] for r in (first, second))
    np.testing.assert_allclose(a, _computed(trainer), rtol=1e-6)
    np.testing.assert_array_equal(a, b)


class GradNorms(Callback):
    """Notes cb_params.grad_norm at every step."""

    def __init__(self) -> None:
        self.norms: dict[int, Any] = {}

    def on_train_step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.norms[p.cur_step_num] = p.grad_norm


def test_the_trainers_gradient_norm_before_clipping_is_cb_params_grad_norm(
    tmp_path: Path,
) -> None:
    """The global norm the Trainer computes each step (before clipping to max_grad_norm) is
    the step's cb_params.grad_norm, equal to the grad_norm the Trainer logs."""
    norms = GradNorms()
    watch = StepwatchCallback([norms])
    trainer = _trainer(
        tmp_path, [watch], num_train_epochs=1, max_grad_norm=0.5,
        logging_strategy="steps", logging_steps=1,
    )  # fmt: skip
    trainer.train()
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert sorted(norms.norms) == list(range(1, 17)) and len(logged) == 16
    seen = [float(norms.norms[s]) for s in range(1, 17)]
    np.testing.assert_allclose(seen, logged, rtol=1e-5)
    assert max(seen) > 0.5  # before clipping: the gradients the optimizer used were clipped
    assert "clip_grad_norm_" not in vars(trainer.accelerator)
    # AnomalyMonitor's gradient detectors judge that norm, not the clipped gradients' norm.
    monitor = AnomalyMonitor(grad_every_n_steps=4)
    trainer = _trainer(
        tmp_path, [StepwatchCallback([monitor])], num_train_epochs=1, max_grad_norm=0.5,
        logging_strategy="steps", logging_steps=1,
    )  # fmt: skip
    trainer.train()
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    judged = dict(zip(monitor._history["grad_step"], monitor._history["grad_norm"]))
    assert len(judged) >= 4 and max(judged.values()) > 0.5  # above what the clipping leaves
    for step, norm in judged.items():
        assert norm == pytest.approx(logged[step - 1], rel=1e-5)
    # Given to a Trainer without attach, the bridge does not reach inside it: no norm.
    norms = GradNorms()
    trainer = _trainer(tmp_path, [], num_train_epochs=1, max_grad_norm=0.5)
    trainer.add_callback(StepwatchCallback([norms]))
    trainer.train()
    assert set(norms.norms.values()) == {None}


class FailsOnce(Callback):
    """Raises in its first epoch-end hook."""

    def __init__(self) -> None:
        self.armed = True

    def on_train_epoch_end(self, run_context: Any) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("epoch end failed")


class HoldsTrainingStep(TrainerCallback):
    """Another tool that wraps the Trainer's training_step while it trains and puts back what
    it found when training ends."""

    def __init__(self) -> None:
        self.trainer: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        trainer = self.trainer
        self.held, inner = vars(trainer).get("training_step"), trainer.training_step
        trainer.training_step = lambda *a, **k: inner(*a, **k)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.held is None:
            vars(self.trainer).pop("training_step", None)
        else:
            self.trainer.training_step = self.held


def test_each_loss_is_kept_once_after_a_failed_run_and_beside_another_wrapper(
    tmp_path: Path,
) -> None:
    """A run that a stepwatch callback failed (the bridge ended it) lets go of the Trainer; a
    wrapper of ours left under another tool's passes the calls through."""
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    trainer = _trainer(tmp_path, [StepwatchCallback([recorder, FailsOnce()])], num_train_epochs=1)
    with pytest.raises(RuntimeError, match="epoch end failed"):
        trainer.train()
    assert "training_step" not in vars(trainer) and not trainer.model._forward_hooks
    del _computed(trainer)[:]
    trainer.train()
    with Store(db) as store:
        losses = store.metrics(recorder.run_id, values.STEP_LOSS)[1]
    np.testing.assert_allclose(losses, _computed(trainer)[-16:], rtol=1e-6)

    other = HoldsTrainingStep()
    recorder = RunRecorder(db=db)
    trainer = _trainer(tmp_path, [StepwatchCallback([recorder]), other], num_train_epochs=1)
    other.trainer = trainer
    for _ in range(2):
        del _computed(trainer)[:]
        trainer.train()
    with Store(db) as store:
        losses = store.metrics(recorder.run_id, values.STEP_LOSS)[1]
    np.testing.assert_allclose(losses, _computed(trainer), rtol=1e-6)


class EveryStep(Callback):
    """A user callback with a per-step hook: it notes cb_params.outputs at every step."""

    def __init__(self) -> None:
        self.outputs: dict[int, Any] = {}

    def on_train_step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.outputs[p.cur_step_num] = p.outputs


class Printing(LossMonitor):
    """LossMonitor, which runs where the step clock wakes it, noting cb_params.outputs there."""

    def __init__(self, every: int) -> None:
        super().__init__(every)
        self.outputs: dict[int, Any] = {}

    @on_clock
    def on_train_step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.outputs[p.cur_step_num] = p.outputs
        super().on_train_step_end(run_context)


def test_outputs_are_gathered_only_for_the_steps_a_callback_looks_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A callback that runs every step sees every step's outputs. Without one, the forward
    hook that gathers them is on the model only for the steps the step clock wakes."""
    hooks: list[int] = []

    class Hooks(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            hooks.append(len(kw["model"]._forward_hooks))

    every = EveryStep()
    trainer = _trainer(tmp_path, [StepwatchCallback([every]), Hooks()], num_train_epochs=1)
    trainer.train()
    assert sorted(every.outputs) == list(range(1, 17)) and hooks == [1] * 16
    for out in every.outputs.values():
        assert out["logits"].shape == (BATCH, 1) and not out["logits"].requires_grad
    assert not trainer.model._forward_hooks  # taken off when training ended

    printing, hooks[:] = Printing(5), []
    trainer = _trainer(tmp_path, [StepwatchCallback([printing]), Hooks()], num_train_epochs=1)
    trainer.train()
    assert "epoch: 1 step: 15, loss is" in capsys.readouterr().out
    assert sorted(printing.outputs) == [5, 10, 15]
    assert all(o["logits"].shape == (BATCH, 1) for o in printing.outputs.values())
    assert hooks == [0] * 16  # on for those steps' forward only
    assert not trainer.model._forward_hooks


def _drive(watch: StepwatchCallback, model: nn.Module, args: TrainingArguments, steps: int) -> None:
    """Call ``watch``'s hooks as a Trainer would, from a loop that is not a Trainer (the loss
    is the model's, or computed here when the model gives none)."""
    state, control = TrainerState(), TrainerControl()
    state.num_train_epochs, state.max_steps = 1, steps
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = Data()
    batches = [{"x": data.x[i : i + BATCH], "labels": data.y[i : i + BATCH]}
               for i in range(0, steps * BATCH, BATCH)]  # fmt: skip
    kw = {"model": model, "optimizer": optimizer, "lr_scheduler": None}
    watch.on_train_begin(args, state, control, train_dataloader=batches, **kw)
    watch.on_epoch_begin(args, state, control, **kw)
    for batch in batches:
        watch.on_step_begin(args, state, control, **kw)
        out = model(**batch)
        loss = out.get("loss")
        if loss is None:
            loss = nn.functional.mse_loss(out["logits"], batch["labels"])
        loss.backward()
        optimizer.step()
        watch.on_optimizer_step(args, state, control, **kw)
        optimizer.zero_grad()
        state.global_step += 1
        watch.on_step_end(args, state, control, **kw)
    watch.on_epoch_end(args, state, control, **kw)
    watch.on_train_end(args, state, control, **kw)


def test_a_caller_that_is_not_a_trainer_gets_the_loss_off_the_models_forward(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    recorder = RunRecorder(db=db)
    torch.manual_seed(0)
    model = TinyModel(TinyConfig())
    _drive(StepwatchCallback([recorder]), model, _args(tmp_path), 6)
    assert not model._forward_hooks
    with Store(db) as store:
        steps, losses = store.metrics(recorder.run_id, values.STEP_LOSS)
        assert steps.tolist() == list(range(1, 7))
        np.testing.assert_allclose(losses, model.computed, rtol=1e-6)

    class Outside(TinyModel):  # the loss is computed by the loop, outside the model
        def forward(self, x: torch.Tensor, labels: Any = None) -> Any:  # type: ignore[override]
            return {"logits": self.net(x)}

    recorder = RunRecorder(db=db)
    model = Outside(TinyConfig())
    with pytest.raises(RuntimeError, match=r"no loss in step 1 .*record_loss\(loss\)"):
        _drive(StepwatchCallback([recorder]), model, _args(tmp_path), 2)
    assert not model._forward_hooks
    with Store(db) as store:
        assert store.run(recorder.run_id).status == "failed"


def test_wrong_use_gets_a_clear_error() -> None:
    with pytest.raises(TypeError, match="callbacks"):
        StepwatchCallback(callbacks=42)
    with pytest.raises(TypeError, match="not an instance"):
        StepwatchCallback(callbacks=[RunRecorder])
    watch = StepwatchCallback([LossMonitor()])
    with pytest.raises(TypeError, match=r"pass the tensor, not loss.item\(\)"):
        watch.record_loss(0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must hold one value"):
        watch.record_loss(torch.ones(3))
    assert watch.callbacks[0].__class__ is LossMonitor and watch.run is None


def test_the_reach_into_the_trainer_is_pinned_to_the_releases_it_was_written_for() -> None:
    """The bridge wraps Trainer.training_step (integrations/_transformers_loss.py): the
    installed release is one it was written for, and the method takes what the wrapper
    passes on (model, inputs, then the rest) and is the Trainer's own."""
    from packaging.version import Version

    from stepwatch.integrations._transformers_loss import WRITTEN_FOR

    low, high = (Version(v) for v in WRITTEN_FOR)
    assert low <= Version(importlib.metadata.version("transformers")) < high
    params = list(inspect.signature(Trainer.training_step).parameters)
    assert params[:3] == ["self", "model", "inputs"]


def test_attach_names_the_trainer_and_without_it_the_models_loss_is_read(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    watch = StepwatchCallback([RunRecorder(db=db)])
    with pytest.raises(TypeError, match=r"attach\(\) takes the transformers.Trainer"):
        watch.attach(object())  # type: ignore[arg-type]
    torch.manual_seed(0)
    trainer = OwnLoss(model=TinyModel(TinyConfig()), args=_args(tmp_path), train_dataset=Data())
    assert watch.attach(trainer) is watch and watch.attach(trainer) is watch
    assert [cb for cb in trainer.callback_handler.callbacks if cb is watch] == [watch]  # once

    class NoLoss(TinyModel):  # the loss is the Trainer's own, computed outside the model
        def forward(self, x: torch.Tensor, labels: Any = None) -> Any:  # type: ignore[override]
            return {"logits": self.net(x)}

    def mse(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        return nn.functional.mse_loss(outputs["logits"], labels)

    unattached = StepwatchCallback([RunRecorder(db=db)])
    trainer = Trainer(
        model=NoLoss(TinyConfig()), args=_args(tmp_path), train_dataset=Data(),
        callbacks=[unattached], compute_loss_func=mse,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"no loss in step 1 .*\.attach\(trainer\)"):
        trainer.train()


def test_the_class_handed_to_the_trainer_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"transformers.StepwatchCallback\(\) got no callbacks"):
        Trainer(
            model=TinyModel(TinyConfig()), args=_args(tmp_path), train_dataset=Data(),
            callbacks=[StepwatchCallback],
        )  # fmt: skip
