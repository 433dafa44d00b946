"""The public callback contract: cb_params members, RunContext, stop kinds, rank-0-only
callbacks, order bands, callback state, and the eval-within-fit switch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch import Callback, History, LambdaCallback, ModelCheckpoint, RunContext
from stepwatch.train import BackupAndRestore, CheckpointConfig, EarlyStopping
from stepwatch.train.callback import (
    ORDER_DEFAULT,
    ORDER_RECORD,
    ORDER_SAVE,
    ORDER_STEER,
    CallbackList,
    CallbackParams,
    LossMonitor,
    ReduceLROnPlateau,
    TimeMonitor,
)
from stepwatch.train.state import load_checkpoint

from .conftest import make_batches, make_model


def test_step_members_are_public_and_cheap() -> None:
    seen: list[tuple[Any, ...]] = []

    def grab(rc: RunContext) -> None:
        p = rc.cb_params
        assert p is rc.original_args()
        seen.append(
            (p.cur_step_num, p.step_in_epoch, p.last_step_of_epoch, p.progress.trained_step)
        )
        # The raw loss: a plain detached tensor, the very one net_outputs wraps.
        assert type(p.loss_tensor) is torch.Tensor and not p.loss_tensor.requires_grad
        assert float(p.net_outputs) == float(p.loss_tensor) == p.loss

    make_model().train(2, make_batches(3), callbacks=[LambdaCallback(on_train_step_end=grab)])
    assert seen == [
        (1, 1, False, 1),
        (2, 2, False, 2),
        (3, 3, True, 3),
        (4, 1, False, 4),
        (5, 2, False, 5),
        (6, 3, True, 6),
    ]


def test_step_in_epoch_before_the_first_step_is_zero() -> None:
    p = CallbackParams(cur_step_num=0, batch_num=4)
    assert p.step_in_epoch == 0 and not p.last_step_of_epoch and p.loss_tensor is None


def test_progress_records_epoch_start_rng() -> None:
    rngs: list[Any] = []
    make_model().train(
        2,
        make_batches(2),
        callbacks=[LambdaCallback(on_train_epoch_begin=lambda rc: rngs.append(rc.cb_params))],
    )
    assert rngs[0].progress.epoch_start_rng is not None


def test_evaluating_switches_and_restores_cb_params() -> None:
    p = CallbackParams(mode="train", cur_step_num=7, batch_num=4, accuracy=0.5)
    p.loss_tensor = torch.tensor(2.0)
    p.loss = 1.5
    with p.evaluating(3, hide=["accuracy"]) as q:
        assert q is p and p.mode == "eval" and p.cur_step_num == 0 and p.batch_num == 3
        assert not hasattr(p, "accuracy") and p.loss_tensor is None
        with pytest.raises(AttributeError):
            _ = p.loss
        p.accuracy = 0.9  # what the evaluation sets under a hidden name goes away
        p.eval_results = {"accuracy": 0.9}
    assert (p.mode, p.cur_step_num, p.batch_num, p.accuracy, p.loss) == ("train", 7, 4, 0.5, 1.5)
    assert float(p.loss_tensor) == 2.0 and p.eval_results == {"accuracy": 0.9}


def test_eval_pass_in_fit_shows_its_own_values() -> None:
    """A hook of the validation pass never reads a training value under a plain name."""
    during: list[dict[str, Any]] = []

    class Spy(Callback):
        def epoch_end(self, run_context: RunContext) -> None:  # runs in train and eval
            p = run_context.cb_params
            during.append({"mode": p.mode, "loss": p.loss, "accuracy": p.accuracy})

    model = make_model(metrics={"accuracy"})
    model.fit(1, make_batches(4), make_batches(2, seed=5), callbacks=[Spy()])
    evaluated = model.eval(make_batches(2, seed=5))
    eval_row, train_row = during
    assert eval_row["mode"] == "eval" and train_row["mode"] == "train"
    assert eval_row["accuracy"] == pytest.approx(evaluated["accuracy"])
    assert eval_row["loss"] != train_row["loss"]


def test_stop_kinds() -> None:
    rc = RunContext(CallbackParams())
    assert rc.stop_kind is None and not rc.stop_requested
    rc.request_stop("done")
    assert rc.stop_kind == "requested" and not rc.interrupted and rc.get_stop_requested()
    rc.request_stop(interrupted=True)
    assert rc.stop_kind == "interrupted" and rc.interrupted
    rc.request_stop("nan", kind="anomaly")
    assert rc.stop_kind == "anomaly" and rc.stop_reason == "nan"  # the graver kind's reason
    rc.request_stop("patience", kind="requested")  # a milder kind never overrides a graver one
    assert rc.stop_kind == "anomaly" and rc.stop_reason == "nan"
    with pytest.raises(ValueError, match="'kind' must be one of"):
        rc.request_stop(kind="oops")  # type: ignore[arg-type]


class _Poison(Callback):
    """At the given step, makes the weights NaN and stops the run as an anomaly."""

    def __init__(self, step: int, kind: str | None = "anomaly") -> None:
        self.step, self.kind = step, kind

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        if p.cur_step_num == self.step:
            with torch.no_grad():
                for param in p.network.parameters():
                    param.fill_(math.nan)
            if self.kind is not None:
                run_context.request_stop("loss is NaN", kind=self.kind)  # type: ignore[arg-type]


def test_anomaly_stop_never_overwrites_the_last_good_checkpoint(tmp_path: Path) -> None:
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    ckpt = ModelCheckpoint(directory=tmp_path, config=config)
    make_model().train(3, make_batches(4), callbacks=[_Poison(step=7), ckpt])
    last = load_checkpoint(tmp_path / "CKP-last.pt")
    assert last["step"] == 6 and ckpt.latest_ckpt_file_name == str(tmp_path / "CKP-2_2.pt")
    assert all(torch.isfinite(t).all() for t in last["network"].values())


def test_non_finite_weights_are_not_saved_even_without_a_stop(tmp_path: Path) -> None:
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    ckpt = ModelCheckpoint(directory=tmp_path, config=config)
    with pytest.warns(RuntimeWarning) as record:
        make_model().train(1, make_batches(4), callbacks=[_Poison(step=3, kind=None), ckpt])
    messages = [str(w.message) for w in record]
    assert any("not finite; not saved" in m for m in messages)
    assert any("diverged and goes on" in m for m in messages)  # no monitor acted on it
    assert load_checkpoint(tmp_path / "CKP-last.pt")["step"] == 2


def test_anomaly_stop_keeps_the_backup(tmp_path: Path) -> None:
    backup = BackupAndRestore(tmp_path)
    make_model().train(3, make_batches(2), callbacks=[_Poison(step=3), backup])
    state = load_checkpoint(backup.backup_path)
    assert state["epoch"] == 1  # the last good backup, not the poisoned epoch
    # A normal end deletes it.
    make_model().train(1, make_batches(2), callbacks=[BackupAndRestore(tmp_path / "b")])
    assert not (tmp_path / "b" / "backup.pt").exists()


def test_diverged_loss_without_a_monitor_warns_once() -> None:
    model = make_model(lr=1e6)
    with torch.no_grad():
        for param in model.train_network.parameters():
            param.fill_(math.inf)
    with pytest.warns(RuntimeWarning, match="training loss of epoch 1 is nan") as record:
        model.train(3, make_batches(2))
    assert len([w for w in record if "diverged" in str(w.message)]) == 1


def test_loss_monitor_acts_on_a_diverged_loss_so_nothing_warns() -> None:
    model = make_model()
    with torch.no_grad():
        for param in model.train_network.parameters():
            param.fill_(math.nan)
    with pytest.raises(ValueError, match="loss is NAN or INF"):
        model.train(1, make_batches(2), callbacks=[LossMonitor(0)])


def test_rank_zero_only_callbacks_are_left_out_on_other_ranks() -> None:
    class Everywhere(Callback):
        def on_train_begin(self, run_context: RunContext) -> None: ...

    class RankZero(Everywhere):
        rank_zero_only = True

    a, b = Everywhere(), RankZero()
    assert CallbackList([a, b], rank=0).callbacks == [a, b]
    other = CallbackList([a, b], rank=1)
    assert other.callbacks == [a] and [cb for cb, _ in other.table["on_train_begin"]] == [a]
    assert TimeMonitor.rank_zero_only and not LossMonitor.rank_zero_only


def test_order_bands() -> None:
    assert ORDER_DEFAULT < ORDER_STEER < ORDER_SAVE < ORDER_RECORD
    assert EarlyStopping.order == ReduceLROnPlateau.order == ORDER_STEER
    assert ModelCheckpoint.order == BackupAndRestore.order == ORDER_SAVE
    from stepwatch.store import RunRecorder

    assert RunRecorder.order == ORDER_RECORD


def test_callback_state_round_trip_and_orphans_warn() -> None:
    es = EarlyStopping("loss", patience=3)
    es.wait = 2
    saved = CallbackList([es, History()]).state_dicts()
    assert list(saved) == [es.state_key] and saved[es.state_key]["wait"] == 2
    fresh = EarlyStopping("loss", patience=3)
    CallbackList([fresh]).load_state_dicts(saved)
    assert fresh.wait == 2
    with pytest.warns(UserWarning, match="not in this run"):
        CallbackList([]).load_state_dicts(saved, "checkpoint 'x.pt'")


def test_a_wrong_callback_is_refused_before_training_with_what_to_do() -> None:
    import lightning.pytorch as pl

    model = make_model()
    batches = make_batches(2)
    before = [p.detach().clone() for p in model.train_network.parameters()]
    with pytest.raises(TypeError, match=r"callbacks\[0\] is a Lightning callback \(EarlyStopping\)"
                       r".*integrations\.lightning\.StepwatchCallback"):  # fmt: skip
        model.train(1, batches, callbacks=[pl.callbacks.EarlyStopping(monitor="loss")])
    with pytest.raises(TypeError, match=r"Wrap a function: LambdaCallback"):
        model.train(1, batches, callbacks=[lambda run_context: None])

    class NoArgument(Callback):
        def step_end(self) -> None:  # type: ignore[override]
            pass

    with pytest.raises(TypeError, match=r"NoArgument\.step_end\(\) cannot take the run context: "
                       r"define it as 'def step_end\(self, run_context\)'"):  # fmt: skip
        model.train(1, batches, callbacks=[NoArgument()])
    with pytest.raises(TypeError, match="LambdaCallback's on_train_epoch_end function"):
        model.train(1, batches, callbacks=[LambdaCallback(on_train_epoch_end=lambda: None)])
    after = list(model.train_network.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # refused before any step


def test_a_hook_under_another_name_is_warned_once_with_the_name_meant() -> None:
    class KerasStyle(Callback):
        def on_epoch_end(self, run_context: RunContext) -> None:  # Keras's name
            pass

        def on_train_step_ends(self, run_context: RunContext) -> None:  # a typo
            pass

        def on_my_own_event(self, run_context: RunContext) -> None:  # no hook looks like it
            pass

    model = make_model()
    with pytest.warns(UserWarning) as seen:
        model.train(1, make_batches(2), callbacks=[KerasStyle()])
    assert {w.filename for w in seen} == {__file__}  # pointing at the user's line
    shown = sorted(str(w.message) for w in seen)
    assert shown == [
        "KerasStyle.on_epoch_end is not a hook stepwatch calls, so it never runs; did you mean "
        "on_train_epoch_end?",
        "KerasStyle.on_train_step_ends is not a hook stepwatch calls, so it never runs; did you "
        "mean on_train_step_end?",
    ]
    model.train(1, make_batches(2), callbacks=[KerasStyle()])  # once per class: no warning now


def test_a_callback_mixin_and_a_failing_property_keep_their_own_attribute_errors() -> None:
    class Probe(Callback, torch.nn.Module):  # a callback that holds a module of its own
        def __init__(self) -> None:
            Callback.__init__(self)
            torch.nn.Module.__init__(self)
            self.lin = torch.nn.Linear(2, 2)

    assert isinstance(Probe().lin, torch.nn.Linear)  # found by nn.Module's __getattr__

    class Failing(Callback):
        @property
        def value(self) -> Any:
            return self._not_set_yet

    with pytest.raises(AttributeError, match="'_not_set_yet'"):  # the real cause, not 'value'
        _ = Failing().value
    with pytest.raises(AttributeError, match=r"^'Failing' object has no attribute 'other'$"):
        _ = Failing().other


def test_a_hook_function_is_checked_as_a_method_and_as_a_plain_function_apart() -> None:
    def hook(callback: Any, run_context: RunContext) -> None:
        pass

    class AsMethod(Callback):
        on_train_step_end = hook  # a method: (self, run_context)

    CallbackList([AsMethod()])  # fine, and cached as a method
    plain = Callback()
    plain.on_train_step_end = hook  # type: ignore[method-assign]  # on the instance: 2 arguments
    with pytest.raises(TypeError, match="Callback's on_train_step_end function"):
        CallbackList([plain])
    CallbackList([AsMethod()])  # still fine after the plain check
