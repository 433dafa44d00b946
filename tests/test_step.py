"""The training step: mixed precision and loss scaling, clipping, accumulation, LR schedules
and torch.compile."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stepwatch import (
    CheckpointConfig,
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LambdaCallback,
    LearningRateScheduler,
    Model,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TimeMonitor,
)
from stepwatch.train.step import resolve_precision

from .conftest import make_batches, make_model

# These tests drive the loss-scaling machinery on the CPU, whose mixed precision is bfloat16:
# the warning that bfloat16 needs no scaling is expected there.
pytestmark = pytest.mark.filterwarnings("ignore:'loss_scale_manager' with bfloat16")


class _Net(nn.Module):
    """A small classifier that remembers the dtype its hidden layer computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 3)
        self.hidden_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        self.hidden_dtype = hidden.dtype
        return self.fc2(torch.relu(hidden))


def _model(seed: int = 0, lr: float = 0.1, opt: str = "sgd", **kwargs: Any) -> Model:
    torch.manual_seed(seed)
    net = _Net()
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD(net.parameters(), lr=lr)
        if opt == "sgd"
        else torch.optim.Adam(net.parameters(), lr=lr)
    )
    if callable(kwargs.get("lr_scheduler")):
        kwargs["lr_scheduler"] = kwargs["lr_scheduler"](optimizer)
    return Model(net, nn.CrossEntropyLoss(), optimizer, device="cpu", **kwargs)


def _weights(model: Model) -> list[torch.Tensor]:
    return [p.detach().clone().float() for p in model.train_network.parameters()]


# -- precision -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"amp_level": "O2"}, {"precision": "bf16-mixed"}])
def test_mixed_precision_runs_the_forward_in_bfloat16_on_cpu(kwargs: dict[str, Any]) -> None:
    model = _model(**kwargs)
    assert model.precision == "bf16-mixed" and model.loss_scaler is None  # bf16: no scaling
    model.train(1, make_batches(2))
    net = model.train_network
    assert net.hidden_dtype == torch.bfloat16 and net.fc1.weight.dtype == torch.float32


def test_o3_casts_the_network_and_its_inputs() -> None:
    model = _model(amp_level="O3", metrics={"accuracy"})
    assert model.precision == "bf16-true"
    model.fit(1, make_batches(2), make_batches(1))
    assert model.train_network.fc1.weight.dtype == torch.bfloat16
    assert model.train_network.hidden_dtype == torch.bfloat16


def test_o0_is_float32() -> None:
    model = _model()
    model.train(1, make_batches(1))
    assert model.precision == "32" and model.train_network.hidden_dtype == torch.float32


@pytest.mark.parametrize(
    ("amp_level", "name", "scaled"),
    [
        ("O0", "32", False),
        ("O1", "16-mixed", False),
        ("O2", "16-mixed", True),
        ("O3", "16-true", False),
    ],
)
def test_amp_levels_map_to_precisions_on_cuda(amp_level: str, name: str, scaled: bool) -> None:
    resolved = resolve_precision(amp_level, None, torch.device("cuda"))
    assert resolved.name == name and resolved.dynamic_scaling == scaled
    assert resolve_precision(None, name, torch.device("cuda")).name == name


# -- loss scaling ----------------------------------------------------------------------------
class _PoisonGrad(LambdaCallback):
    """Makes one step's gradient infinite, and records what each step did to the weights."""

    def __init__(self, at_step: int) -> None:
        super().__init__(on_train_step_end=self._end, on_train_begin=self._begin)
        self.at_step = at_step
        self.changed: list[bool] = []
        self.scales: list[float] = []
        self.skipped: list[int] = []

    def _begin(self, rc: Any) -> None:
        first = next(rc.cb_params.network.parameters())
        self._before = _snapshot(rc.cb_params.network)
        first.register_hook(self._hook)
        self._cb_params = rc.cb_params

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self._cb_params.cur_step_num == self.at_step:
            return grad * math.inf
        return grad

    def _end(self, rc: Any) -> None:
        p = rc.cb_params
        now = _snapshot(p.network)
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(now, self._before)))
        self._before = now
        self.scales.append(p.loss_scale)
        self.skipped.append(p.skipped_steps)


def _snapshot(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def test_dynamic_loss_scaling_skips_exactly_the_overflowing_step() -> None:
    manager = DynamicLossScaleManager(init_loss_scale=2**10, scale_factor=2, scale_window=3)
    model = _model(amp_level="O2", loss_scale_manager=manager)
    spy = _PoisonGrad(at_step=2)
    model.train(1, make_batches(6), callbacks=[spy])
    assert spy.changed == [True, False, True, True, True, True]
    assert spy.skipped == [0, 1, 1, 1, 1, 1]
    # Backed off at the overflow, grown again after scale_window good steps.
    assert spy.scales == [2**10, 2**9, 2**9, 2**9, 2**10, 2**10]


def test_fixed_loss_scale_keeps_its_scale_and_can_step_through_overflow() -> None:
    spy = _PoisonGrad(at_step=2)
    model = _model(amp_level="O2", loss_scale_manager=FixedLossScaleManager(128.0))
    model.train(1, make_batches(3), callbacks=[spy])
    assert spy.changed == [True, False, True] and spy.scales == [128.0] * 3
    always = _PoisonGrad(at_step=99)
    _model(
        amp_level="O2",
        loss_scale_manager=FixedLossScaleManager(128.0, drop_overflow_update=False),
    ).train(1, make_batches(3), callbacks=[always])
    assert always.changed == [True] * 3 and always.skipped == [0] * 3


def test_loss_scaling_leaves_the_update_unchanged() -> None:
    plain, scaled = (
        _model(amp_level="O2"),
        _model(amp_level="O2", loss_scale_manager=FixedLossScaleManager(2.0**7, False)),
    )
    plain.train(1, make_batches(3))
    scaled.train(1, make_batches(3))
    for a, b in zip(_weights(plain), _weights(scaled)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- clipping --------------------------------------------------------------------------------
def test_clip_grad_norm_bounds_the_update_and_reports_the_pre_clip_norm() -> None:
    norms: list[torch.Tensor] = []
    model = _model(lr=1.0, clip_grad_norm=0.01)
    before = _weights(model)
    spy = LambdaCallback(on_train_step_end=lambda rc: norms.append(rc.cb_params.grad_norm))
    model.train(1, make_batches(1), callbacks=[spy])
    update = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(_weights(model), before)))
    assert float(update) <= 0.01 * (1 + 1e-4)
    assert isinstance(norms[0], torch.Tensor) and float(norms[0]) > 0.01


def test_anomaly_monitor_judges_the_norm_before_clipping() -> None:
    """Under clip_grad_norm the gradients left are clipped; AnomalyMonitor's gradient
    detectors judge the loop's own global norm before clipping (cb_params.grad_norm)."""
    from stepwatch import AnomalyMonitor

    norms: dict[int, float] = {}
    monitor = AnomalyMonitor(grad_every_n_steps=2)
    spy = LambdaCallback(
        on_train_step_end=lambda rc: norms.update(
            {rc.cb_params.cur_step_num: float(rc.cb_params.grad_norm)}
        )
    )
    _model(lr=0.1, clip_grad_norm=0.01).train(1, make_batches(8), callbacks=[monitor, spy])
    judged = dict(zip(monitor._history["grad_step"], monitor._history["grad_norm"]))
    assert len(judged) >= 3 and min(judged.values()) > 0.01  # not the clipped gradients' norm
    for step, norm in judged.items():
        assert norm == pytest.approx(norms[step], rel=1e-6)


def test_clip_grad_value_clamps_each_gradient() -> None:
    largest: list[float] = []

    def grab(rc: Any) -> None:
        largest.append(max(float(p.grad.abs().max()) for p in rc.cb_params.network.parameters()))

    _model(clip_grad_value=1e-3).train(
        1, make_batches(2), callbacks=[LambdaCallback(on_train_step_end=grab)]
    )
    assert max(largest) <= 1e-3 * (1 + 1e-6)  # 1e-3 as a float32


# -- accumulation ----------------------------------------------------------------------------
def test_accumulating_four_batches_equals_one_big_batch() -> None:
    small = make_batches(4, batch_size=8)
    big = [(torch.cat([x for x, _ in small]), torch.cat([y for _, y in small]))]
    stepped: list[bool] = []
    spy = LambdaCallback(
        on_train_step_end=lambda rc: stepped.append(rc.cb_params.optimizer_stepped)
    )
    accumulated = _model(accumulate_grad_batches=4)
    accumulated.train(1, small, callbacks=[spy])
    one = _model()
    one.train(1, big)
    for a, b in zip(_weights(accumulated), _weights(one)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert stepped == [False, False, False, True]


def test_accumulation_steps_at_the_epoch_end_and_counts_batches() -> None:
    seen: list[tuple[int, bool]] = []
    spy = LambdaCallback(
        on_train_step_end=lambda rc: seen.append(
            (rc.cb_params.cur_step_num, rc.cb_params.optimizer_stepped)
        )
    )
    _model(accumulate_grad_batches=4).train(2, make_batches(6), callbacks=[spy])
    assert [s for s, stepped in seen if stepped] == [4, 6, 10, 12]
    assert [s for s, _ in seen] == list(range(1, 13))


# -- LR schedules ----------------------------------------------------------------------------
def _lrs_seen(model: Model, epochs: int, batches: int, **fit: Any) -> list[float]:
    lrs: list[float] = []
    spy = LambdaCallback(on_train_step_end=lambda rc: lrs.append(rc.cb_params.lr))
    model.train(epochs, make_batches(batches), callbacks=[spy, *fit.get("callbacks", [])])
    return lrs


def test_step_scheduler_steps_after_each_optimizer_step() -> None:
    def scheduler(opt: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    lrs = _lrs_seen(_model(lr=1.0, lr_scheduler=scheduler), 1, 6)
    # Read at step end, after that step's scheduler step.
    assert lrs == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    accumulated = _lrs_seen(_model(lr=1.0, lr_scheduler=scheduler, accumulate_grad_batches=2), 1, 6)
    assert accumulated == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


def test_epoch_scheduler_steps_after_each_epoch() -> None:
    def scheduler(opt: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)

    model = _model(lr=1.0, lr_scheduler=scheduler, lr_interval="epoch")
    lrs = _lrs_seen(model, 3, 2)
    assert lrs == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    assert model.train_network is not None and model.lr_scheduler.last_epoch == 3


def test_a_skipped_step_does_not_advance_the_schedule() -> None:
    def scheduler(opt: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    model = _model(
        lr=1.0,
        amp_level="O2",
        loss_scale_manager=DynamicLossScaleManager(2**10),
        lr_scheduler=scheduler,
    )
    lrs = _lrs_seen(model, 1, 4, callbacks=[_PoisonGrad(at_step=2)])
    assert lrs == [0.5, 0.5, 0.25, 0.125]


def test_reduce_lr_on_plateau_works_alongside_a_scheduler() -> None:
    def scheduler(opt: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    model = _model(lr=1.0, lr_scheduler=scheduler, lr_interval="epoch")
    plateau = ReduceLROnPlateau("loss", factor=0.1, patience=0, min_delta=10.0)
    lrs = _lrs_seen(model, 3, 1, callbacks=[plateau])
    # Epoch 1 sets the first best; at epoch 2's end the plateau cuts x0.1, then the schedule x0.5.
    assert lrs == pytest.approx([1.0, 0.5, 0.025])


@pytest.mark.filterwarnings("ignore:.*not in this run")
@pytest.mark.parametrize("name", ["CKP-1_4.pt", "CKP-2_2.pt"])
def test_resume_with_a_scheduler_and_loss_scaling_equals_a_straight_run(
    tmp_path: Path, name: str
) -> None:
    def build() -> Model:
        return _model(
            lr=0.1,
            opt="adam",
            amp_level="O2",
            loss_scale_manager=DynamicLossScaleManager(2**8, scale_window=3),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.7),
            clip_grad_norm=1.0,
        )

    straight = build()
    straight.train(3, make_batches(4))
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    build().train(
        2, make_batches(4), callbacks=[ModelCheckpoint(directory=tmp_path, config=config)]
    )
    resumed = build()
    resumed.train(3, make_batches(4), resume_from=tmp_path / name)
    for a, b in zip(_weights(straight), _weights(resumed)):
        assert torch.equal(a, b)
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()
    assert resumed.loss_scaler.get_scale() == straight.loss_scaler.get_scale()


def test_learning_rate_scheduler_callback() -> None:
    def halve_at_3(lr: float, step: int) -> float:
        return lr / 2 if step == 3 else lr

    lrs = _lrs_seen(_model(lr=0.4), 1, 5, callbacks=[LearningRateScheduler(halve_at_3)])
    assert lrs == [0.4, 0.4, 0.4, 0.2, 0.2]  # set at step 3's end, after the spy read it
    with pytest.raises(TypeError, match="'learning_rate_function' must be a callable"):
        LearningRateScheduler(0.1)  # type: ignore[arg-type]


# -- torch.compile ---------------------------------------------------------------------------
def test_compile_matches_eager_and_its_checkpoint_loads_uncompiled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def losses(model: Model) -> list[float]:
        seen: list[float] = []
        spy = LambdaCallback(on_train_step_end=lambda rc: seen.append(rc.cb_params.loss))
        ckpt = ModelCheckpoint(directory=tmp_path / str(id(model)))
        model.train(2, make_batches(3), callbacks=[spy, TimeMonitor(), ckpt])
        return seen

    eager = losses(_model())
    compiled_model = _model(compile={"backend": "aot_eager"})
    compiled = losses(compiled_model)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    out = capsys.readouterr().out
    assert out.count("first step, with compile") == 1
    state = torch.load(tmp_path / str(id(compiled_model)) / "CKP-last.pt", weights_only=True)[
        "network"
    ]
    fresh = _Net()
    fresh.load_state_dict(state)  # no _orig_mod. prefix: loads into an uncompiled network


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"amp_level": "O4"}, ValueError, "'amp_level' must be one of"),
        ({"amp_level": 2}, TypeError, "'amp_level' must be a str"),
        ({"precision": "fp8"}, ValueError, "'precision' must be one of"),
        ({"amp_level": "O3", "precision": "bf16-mixed"}, ValueError, "pass one of them"),
        ({"loss_scale_manager": DynamicLossScaleManager()}, ValueError, "trains in float32"),
        ({"amp_level": "O2", "loss_scale_manager": 128}, TypeError, "'loss_scale_manager' must"),
        ({"accumulate_grad_batches": 0}, ValueError, "'accumulate_grad_batches' must be an int"),
        ({"clip_grad_norm": 0}, ValueError, "'clip_grad_norm' must be a number > 0"),
        ({"clip_grad_value": -1.0}, ValueError, "'clip_grad_value' must be a number > 0"),
        ({"clip_grad_norm": 1.0, "clip_grad_value": 1.0}, ValueError, "not both"),
        ({"lr_interval": "batch"}, ValueError, "'lr_interval' must be 'step' or 'epoch'"),
        ({"lr_scheduler": "cosine"}, TypeError, "'lr_scheduler' must be a torch.optim"),
        ({"compile": "yes"}, TypeError, "'compile' must be a bool or a dict"),
    ],
)
def test_step_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        _model(**kwargs)


def test_scheduler_of_another_optimizer_is_refused() -> None:
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bound to another optimizer"):
        _model(lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(TypeError, match=r"use the callback stepwatch\.ReduceLROnPlateau"):
        _model(lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FixedLossScaleManager(0.5), "'loss_scale' must be"),
        (lambda: FixedLossScaleManager(drop_overflow_update=1), "'drop_overflow_update' must"),
        (lambda: DynamicLossScaleManager(scale_factor=1), "'scale_factor' must be a number > 1"),
        (lambda: DynamicLossScaleManager(scale_window=0), "'scale_window' must be an int"),
    ],
)
def test_loss_scale_manager_args_validation(make: Any, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_a_loss_scale_manager_class_is_refused_with_what_to_pass() -> None:
    net = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"is the class FixedLossScaleManager, not an instance: "
                       r"pass FixedLossScaleManager\(\) instead"):  # fmt: skip
        Model(net, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.1), amp_level="O2",
              loss_scale_manager=FixedLossScaleManager)  # type: ignore[arg-type]  # fmt: skip


def test_recorder_stores_the_loss_scale_and_skipped_steps(tmp_path: Path) -> None:
    from stepwatch import RunRecorder, Store

    recorder = RunRecorder(db=tmp_path / "s.db", transfer_every=2)
    model = _model(amp_level="O2", loss_scale_manager=DynamicLossScaleManager(2**10))
    model.train(1, make_batches(4), callbacks=[recorder, _PoisonGrad(at_step=2)])
    with Store(tmp_path / "s.db") as store:
        scales = store.metrics(recorder.run_id, "loss_scale")[1].tolist()
        skipped = store.metrics(recorder.run_id, "skipped_steps")[1].tolist()
    assert scales[0] == 2**9 and skipped[-1] == 1


def test_o3_casts_a_separate_eval_network_too() -> None:
    torch.manual_seed(0)
    net, scorer = _Net(), _Net()
    model = Model(
        net,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(net.parameters(), lr=0.1),
        metrics={"accuracy"},
        eval_network=scorer,
        device="cpu",
        amp_level="O3",
    )
    assert 0.0 <= model.eval(make_batches(2))["accuracy"] <= 1.0
    assert scorer.fc1.weight.dtype == torch.bfloat16


@pytest.mark.filterwarnings("default")
def test_a_loss_scale_manager_with_bfloat16_warns_that_it_is_not_needed() -> None:
    with pytest.warns(UserWarning, match="'loss_scale_manager' with bfloat16: bfloat16 has"):
        make_model(amp_level="O2", loss_scale_manager=DynamicLossScaleManager())
