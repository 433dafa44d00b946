"""The event contract: exact hook sequences, stopping, numbering, dispatch and errors."""

from __future__ import annotations

from typing import Any

import pytest

from stepwatch import Callback, LambdaCallback, RunContext
from stepwatch.train.callback import CallbackList, CallbackParams

from .conftest import Recorder, make_batches, make_model


def _train_epoch(epoch: int, first_step: int, steps: int) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = [("on_train_epoch_begin", "train", epoch, first_step - 1)]
    for s in range(first_step, first_step + steps):
        calls += [
            ("on_train_step_begin", "train", epoch, s),
            ("on_train_step_end", "train", epoch, s),
        ]
    return calls


def _eval_pass(epoch: int, steps: int) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = [
        ("on_eval_begin", "eval", epoch, 0),
        ("on_eval_epoch_begin", "eval", epoch, 0),
    ]
    for s in range(1, steps + 1):
        calls += [("on_eval_step_begin", "eval", epoch, s), ("on_eval_step_end", "eval", epoch, s)]
    calls += [("on_eval_epoch_end", "eval", epoch, steps), ("on_eval_end", "eval", epoch, steps)]
    return calls


def test_train_hook_sequence_is_exact() -> None:
    rec = Recorder()
    make_model().train(2, make_batches(3), callbacks=[rec])
    expected = [("enter",), ("on_train_begin", "train", 0, 0)]
    expected += [*_train_epoch(1, 1, 3), ("on_train_epoch_end", "train", 1, 3)]
    expected += [*_train_epoch(2, 4, 3), ("on_train_epoch_end", "train", 2, 6)]
    expected += [("on_train_end", "train", 2, 6), ("exit", None)]
    assert rec.calls == expected


def test_fit_runs_validation_between_last_step_and_epoch_end() -> None:
    rec = Recorder()
    model = make_model(metrics={"accuracy"})
    model.fit(2, make_batches(2), make_batches(2, seed=1), callbacks=[rec])
    expected = [("enter",), ("on_train_begin", "train", 0, 0)]
    for epoch, first in ((1, 1), (2, 3)):
        expected += [*_train_epoch(epoch, first, 2), *_eval_pass(epoch, 2)]
        expected += [("on_train_epoch_end", "train", epoch, first + 1)]
    expected += [("on_train_end", "train", 2, 4), ("exit", None)]
    assert rec.calls == expected


def test_fit_valid_frequency_int_and_list() -> None:
    for freq, expected_epochs in ((2, [2, 4]), ([1, 3], [1, 3])):
        rec = Recorder()
        make_model(metrics={"accuracy"}).fit(
            4, make_batches(1), make_batches(1), valid_frequency=freq, callbacks=[rec]
        )
        assert [c[2] for c in rec.calls if c[0] == "on_eval_begin"] == expected_epochs


def test_eval_hook_sequence_is_exact() -> None:
    rec = Recorder()
    result = make_model(metrics={"accuracy"}).eval(make_batches(3), callbacks=[rec])
    assert rec.calls == [("enter",), *_eval_pass(1, 3), ("exit", None)]
    assert set(result) == {"accuracy"}


def test_initial_epoch_numbers_epochs_and_global_steps() -> None:
    rec = Recorder()
    make_model().train(3, make_batches(2), callbacks=[rec], initial_epoch=1)
    begins = [c for c in rec.calls if c[0] == "on_train_epoch_begin"]
    assert begins == [
        ("on_train_epoch_begin", "train", 2, 2),
        ("on_train_epoch_begin", "train", 3, 4),
    ]
    assert [c[3] for c in rec.calls if c[0] == "on_train_step_end"] == [3, 4, 5, 6]


def test_request_stop_finishes_step_runs_eval_epoch_end_and_train_end() -> None:
    class StopAtStep2(Recorder):
        def on_train_step_end(self, run_context: RunContext) -> None:
            super().on_train_step_end(run_context)
            if run_context.original_args().cur_step_num == 2:
                run_context.request_stop("enough")

    rec = StopAtStep2()
    make_model(metrics={"accuracy"}).fit(3, make_batches(4), make_batches(1), callbacks=[rec])
    hooks = rec.hooks()
    assert hooks.count("on_train_step_end") == 2
    last_step = len(hooks) - 1 - hooks[::-1].index("on_train_step_end")
    assert hooks[last_step + 1 :] == [
        "on_eval_begin",
        "on_eval_epoch_begin",
        "on_eval_step_begin",
        "on_eval_step_end",
        "on_eval_epoch_end",
        "on_eval_end",
        "on_train_epoch_end",
        "on_train_end",
        "exit",
    ]


def test_stop_reason_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    stopper = LambdaCallback(on_train_step_end=lambda rc: rc.request_stop("loss is low enough"))
    with caplog.at_level("INFO", logger="stepwatch"):
        make_model().train(2, make_batches(3), callbacks=[stopper])
    lines = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert lines == ["training stopped at epoch 1, step 1: loss is low enough"]


def test_old_names_run_in_train_and_eval_new_names_hide_old() -> None:
    class Old(Callback):
        def __init__(self) -> None:
            self.modes: list[str] = []

        def step_end(self, run_context: RunContext) -> None:
            self.modes.append(run_context.original_args().mode)

    class NewHidesOld(Old):
        def on_train_step_end(self, run_context: RunContext) -> None:
            self.modes.append("new")

    old, new = Old(), NewHidesOld()
    make_model(metrics={"accuracy"}).fit(1, make_batches(2), make_batches(1), callbacks=[old, new])
    assert old.modes == ["train", "train", "eval"]
    assert new.modes == ["new", "new", "eval"]


def test_dispatch_table_holds_only_overriding_callbacks() -> None:
    class Nothing(Callback):
        pass

    class OnlyEpochEnd(Callback):
        def epoch_end(self, run_context: RunContext) -> None:
            pass

    lam = LambdaCallback(on_train_step_end=lambda rc: None)
    cbs = CallbackList([Nothing(), OnlyEpochEnd(), lam])
    assert all(
        not entries
        for hook, entries in cbs.table.items()
        if "step" in hook and hook != "on_train_step_end"
    )
    assert [type(cb) for cb, _ in cbs.table["on_train_step_end"]] == [LambdaCallback]
    assert [type(cb) for cb, _ in cbs.table["on_train_epoch_end"]] == [OnlyEpochEnd]
    assert [type(cb) for cb, _ in cbs.table["on_eval_epoch_end"]] == [OnlyEpochEnd]
    assert "on_train_step_end: LambdaCallback" in cbs.describe()


def test_callbacks_sorted_once_by_order_stably() -> None:
    seen: list[str] = []

    def make(name: str, order: int) -> Callback:
        cls = type(name, (Callback,), {"order": order})
        cls.on_train_begin = lambda self, rc: seen.append(name)  # type: ignore[attr-defined]
        return cls()

    make_model().train(1, make_batches(1), callbacks=[make("a", 5), make("b", 0), make("c", 0)])
    assert seen == ["b", "c", "a"]


def test_callback_exception_keeps_type_gains_note_and_all_exits_run() -> None:
    class Boom(Callback):
        def on_train_step_end(self, run_context: RunContext) -> None:
            raise KeyError("bad")

    first, last = Recorder(), Recorder()
    with pytest.raises(KeyError) as info:
        make_model().train(1, make_batches(2), callbacks=[first, Boom(), last])
    assert any("Boom.on_train_step_end" in note for note in info.value.__notes__)
    for rec in (first, last):
        assert rec.calls[-1] == ("exit", KeyError)
        assert "on_train_end" not in rec.hooks()


def test_exits_run_in_reverse_order() -> None:
    order: list[str] = []

    class Ctx(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def __exit__(self, *err: Any) -> None:
            order.append(self.name)

    make_model().train(1, make_batches(1), callbacks=[Ctx("a"), Ctx("b"), Ctx("c")])
    assert order == ["c", "b", "a"]


@pytest.mark.parametrize(
    "bad",
    [Recorder, "LossMonitor", [Recorder(), None], [Recorder, Recorder()], 3, {Recorder()}],
)
def test_bad_callbacks_argument_is_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="callbacks"):
        make_model().train(1, make_batches(1), callbacks=bad)


def test_class_instead_of_instance_says_so() -> None:
    with pytest.raises(TypeError, match=r"class Recorder, not an instance: pass Recorder\(\)"):
        make_model().train(1, make_batches(1), callbacks=[Recorder])


def test_run_context_rejects_non_dict_and_wraps_dict() -> None:
    with pytest.raises(TypeError, match="original_args"):
        RunContext([1, 2])  # type: ignore[arg-type]
    rc = RunContext({"cur_step_num": 3})
    assert rc.original_args().cur_step_num == 3
    assert rc.original_args()["cur_step_num"] == 3
    assert not rc.get_stop_requested()
    rc.request_stop()
    assert rc.get_stop_requested()


def test_cb_params_missing_attribute_is_attribute_error() -> None:
    p = CallbackParams(cur_step_num=1)
    with pytest.raises(AttributeError):
        _ = p.accuracy
    assert getattr(p, "accuracy", None) is None
    assert not hasattr(p, "net_outputs")
    assert "cur_step_num" in p and "accuracy" not in p
    assert p.get("accuracy", 7) == 7
    with pytest.raises(KeyError):
        _ = p["accuracy"]
