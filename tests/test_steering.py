"""EarlyStopping and ReduceLROnPlateau: argument checks and table-driven behaviour."""

from __future__ import annotations

import math
from typing import Any

import pytest

from stepwatch import (
    Callback,
    CheckpointConfig,
    EarlyStopping,
    ModelCheckpoint,
    ReduceLROnPlateau,
    RunContext,
)

from .conftest import make_batches, make_model


class Inject(Callback):
    """Sets the epoch's results to given values before the steering callbacks read them."""

    order = -1

    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values = name, values

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        p.train_results = {self.name: self.values[p.cur_epoch_num - 1]}


def _epochs_run(values: list[float], callback: Callback, name: str = "loss") -> int:
    seen: list[int] = []

    class Count(Callback):
        def on_train_epoch_end(self, run_context: RunContext) -> None:
            seen.append(run_context.original_args().cur_epoch_num)

    make_model().train(
        len(values), make_batches(1), callbacks=[Inject(name, values), callback, Count()]
    )
    return seen[-1]


# (values, patience, min_delta, baseline, expected last epoch)
EARLY_STOPPING_TABLE = [
    ([1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6], 2, 0.0, None, 5),
    ([1.0, 0.9, 0.95, 0.8], 0, 0.0, None, 3),
    ([1.0, 0.9, 0.8, 0.7], 0, 0.0, None, 4),  # improving every epoch never stops
    ([1.0, 0.9, 0.8, 0.7], 1, 0.15, None, 2),  # 0.1 steps are below min_delta
    ([1.0, 0.9, 0.8, 0.4, 0.3], 2, 0.0, 0.5, 2),  # never beats the baseline in time
    ([1.0, 0.4, 0.45, 0.46, 0.3], 2, 0.0, 0.5, 4),  # beats it at epoch 2, then stalls
    ([1.0, 0.0, 0.5, 0.6, 0.7], 2, 0.0, None, 4),  # 0 is a value, and the best
    ([float("nan"), 1.0, 0.9], 1, 0.0, None, 1),  # NaN is no improvement
]


@pytest.mark.parametrize(
    ("values", "patience", "min_delta", "baseline", "expected"), EARLY_STOPPING_TABLE
)
def test_early_stopping_table(
    values: list[float], patience: int, min_delta: float, baseline: float | None, expected: int
) -> None:
    es = EarlyStopping(monitor="loss", patience=patience, min_delta=min_delta, baseline=baseline)
    assert _epochs_run(values, es) == expected
    assert es.stopped_epoch == (expected if expected < len(values) else 0)


def test_early_stopping_max_mode_for_accuracy_and_verbose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    es = EarlyStopping(monitor="accuracy", patience=2, verbose=True)
    assert _epochs_run([0.5, 0.6, 0.6, 0.55, 0.9], es, name="accuracy") == 4
    assert es.best == 0.6 and es.best_epoch == 2
    assert capsys.readouterr().out.strip() == "Epoch 00004: early stopping"


def test_early_stopping_logs_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="stepwatch"):
        _epochs_run([1.0, 1.0, 1.0], EarlyStopping(monitor="loss", patience=1))
    stops = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert stops == [
        "training stopped at epoch 2, step 2: EarlyStopping: loss did not improve for 1 epochs "
        "(best 1 at epoch 1)"
    ]


def test_early_stopping_restores_best_weights() -> None:
    model = make_model()
    snapshots: dict[int, Any] = {}

    class Snap(Callback):
        order = 10

        def on_train_epoch_end(self, run_context: RunContext) -> None:
            p = run_context.original_args()
            snapshots[p.cur_epoch_num] = {k: v.clone() for k, v in p.network.state_dict().items()}

    es = EarlyStopping(monitor="loss", patience=2, restore_best_weights=True)
    model.train(6, make_batches(2), callbacks=[Inject("loss", [3, 1, 2, 2, 2, 2]), Snap(), es])
    assert es.best_epoch == 2 and es.stopped_epoch == 4
    for key, value in model.train_network.state_dict().items():
        assert value.equal(snapshots[2][key])


def test_missing_monitor_warns_once_listing_names() -> None:
    es = EarlyStopping(monitor="eval_accuracy", patience=0)
    with pytest.warns(
        UserWarning, match=r"'eval_accuracy' is not available.*available: loss"
    ) as rec:
        make_model().train(3, make_batches(1), callbacks=[es])
    assert len(rec) == 1 and es.stopped_epoch == 0


def test_monitor_names_in_fit_include_eval_prefixed_and_train_prefixed() -> None:
    seen: dict[str, float] = {}

    class Probe(EarlyStopping):
        def on_train_epoch_end(self, run_context: RunContext) -> None:
            from stepwatch.train.callback._monitor import epoch_values

            seen.update(epoch_values(run_context.original_args()))

    make_model(metrics={"accuracy"}).fit(1, make_batches(2), make_batches(1), callbacks=[Probe()])
    assert set(seen) == {"loss", "accuracy", "train_accuracy", "eval_accuracy", "eval_loss"}
    assert seen["accuracy"] == seen["eval_accuracy"]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"monitor": 3}, TypeError, "'monitor' must be a str"),
        ({"monitor": ""}, ValueError, "'monitor' must name a value"),
        ({"mode": "up"}, ValueError, "'mode' must be one of"),
        ({"patience": -1}, ValueError, "'patience' must be an int >= 0"),
        ({"patience": 1.5}, TypeError, "'patience' must be an int"),
        ({"min_delta": "0"}, TypeError, "'min_delta' must be a number"),
        ({"baseline": "1"}, TypeError, "'baseline' must be a number or None"),
        ({"verbose": 1}, TypeError, "'verbose' must be a bool"),
        ({"restore_best_weights": None}, TypeError, "'restore_best_weights' must be a bool"),
    ],
)
def test_early_stopping_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        EarlyStopping(**kwargs)


# -- ReduceLROnPlateau ---------------------------------------------------------------------
def _lrs(values: list[float], rlr: ReduceLROnPlateau, lr: float = 1.0) -> list[float]:
    lrs: list[float] = []

    class Read(Callback):
        order = 60

        def on_train_epoch_end(self, run_context: RunContext) -> None:
            lrs.append(run_context.original_args().lr)

    make_model(lr=lr).train(
        len(values), make_batches(1), callbacks=[Inject("loss", values), rlr, Read()]
    )
    return lrs


def test_reduce_lr_after_patience_with_cooldown_and_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flat = [1.0] * 8
    assert _lrs(flat, ReduceLROnPlateau("loss", factor=0.5, patience=2)) == [
        1.0,
        1.0,
        0.5,
        0.5,
        0.25,
        0.25,
        0.125,
        0.125,
    ]
    # The epoch on which the cooldown ends counts towards the patience (MindSpore, Keras).
    assert _lrs(flat, ReduceLROnPlateau("loss", factor=0.5, patience=1, cooldown=2)) == [
        1.0,
        0.5,
        0.5,
        0.25,
        0.25,
        0.125,
        0.125,
        0.0625,
    ]
    assert _lrs(flat, ReduceLROnPlateau("loss", factor=0.1, patience=1, min_lr=0.05)) == [
        1.0,
        0.1,
        0.05,
        0.05,
        0.05,
        0.05,
        0.05,
        0.05,
    ]
    capsys.readouterr()
    _lrs([1.0, 1.0], ReduceLROnPlateau("loss", factor=0.3, patience=1, verbose=True))
    assert capsys.readouterr().out.strip() == (
        "Epoch 00002: ReduceLROnPlateau reducing learning rate to 0.3."
    )
    # A rate that is not a round float prints as %g does, not 0.30000000000000004.
    _lrs([1.0, 1.0], ReduceLROnPlateau("loss", factor=0.1, patience=1, verbose=True), lr=3.0)
    assert capsys.readouterr().out.strip() == (
        "Epoch 00002: ReduceLROnPlateau reducing learning rate to 0.3."
    )


def test_reduce_lr_improvements_reset_wait() -> None:
    values = [1.0, 0.9, 0.9, 0.8, 0.8, 0.8]
    assert _lrs(values, ReduceLROnPlateau("loss", factor=0.5, patience=2)) == [
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.5,
    ]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"factor": 1.0}, ValueError, r"'factor' must be a number in \(0, 1\)"),
        ({"factor": 0}, ValueError, r"'factor' must be a number in \(0, 1\)"),
        ({"factor": "0.5"}, TypeError, "'factor' must be a number"),
        ({"patience": -2}, ValueError, "'patience' must be an int >= 0"),
        ({"cooldown": 0.5}, TypeError, "'cooldown' must be an int"),
        ({"min_lr": -1}, ValueError, "'min_lr' must be >= 0"),
        ({"min_lr": [0.1, "x"]}, TypeError, r"'min_lr\[1\]' must be a number"),
        ({"mode": "lower"}, ValueError, "'mode' must be one of"),
    ],
)
def test_reduce_lr_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        ReduceLROnPlateau(**kwargs)


def test_reduce_lr_min_lr_list_must_match_groups() -> None:
    with pytest.raises(ValueError, match="'min_lr' has 2 values but the optimizer has 1"):
        make_model().train(1, make_batches(1), callbacks=[ReduceLROnPlateau(min_lr=[0.0, 0.0])])


def test_two_callbacks_with_the_same_state_key_are_rejected(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="share the state_key"):
        make_model().train(
            1, make_batches(1), callbacks=[EarlyStopping("loss"), EarlyStopping("loss", patience=3)]
        )
    config = CheckpointConfig()
    with pytest.raises(ValueError, match="share the state_key"):
        make_model().train(
            1,
            make_batches(1),
            callbacks=[ModelCheckpoint(directory=tmp_path, config=config) for _ in range(2)],
        )
    # The same instance twice is named as such, not as a key clash.
    checkpoint = ModelCheckpoint(directory=tmp_path, config=config)
    with pytest.raises(ValueError, match="same ModelCheckpoint instance is passed twice"):
        make_model().train(1, make_batches(1), callbacks=[checkpoint, checkpoint])
    # Different monitors are different keys.
    make_model(metrics={"accuracy"}).train(
        1, make_batches(1), callbacks=[EarlyStopping("loss"), EarlyStopping("train_accuracy")]
    )


def test_monitor_mode_auto() -> None:
    assert EarlyStopping("eval_loss").minimize and EarlyStopping("mae").minimize
    assert not EarlyStopping("accuracy").minimize and not EarlyStopping("eval_recall").minimize
    assert EarlyStopping("accuracy", mode="min").minimize
    assert math.isinf(EarlyStopping("loss").best)


@pytest.mark.parametrize(
    ("monitor", "suggested"), [("epoch_loss", "loss"), ("val_accuracy", "eval_accuracy")]
)
def test_a_missing_monitor_suggests_the_name_it_likely_means(monitor: str, suggested: str) -> None:
    model = make_model(metrics={"accuracy"})
    with pytest.warns(UserWarning, match=f"Did you mean {suggested!r}"):
        model.fit(1, make_batches(2), make_batches(1), callbacks=[EarlyStopping(monitor)])


def test_a_value_without_direction_needs_a_mode() -> None:
    with pytest.raises(ValueError, match="'lr' has no better direction; pass mode="):
        EarlyStopping("lr")
    assert EarlyStopping("lr", mode="min").minimize
