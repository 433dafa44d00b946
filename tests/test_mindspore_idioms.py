"""Idioms of MindSpore users' own callbacks, beyond the API reference, ported by import swap."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stepwatch
from stepwatch import context

from .conftest import make_batches, make_model


@pytest.fixture(autouse=True)
def fresh_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from MindSpore's defaults and leaves no setting behind."""
    monkeypatch.setattr(context, "_settings", {})
    monkeypatch.setattr(context, "_parallel", {})
    monkeypatch.setattr(context, "_noted", set())


# -- run_context._stop_requested = True: MindSpore's FAQ ------------------------------------
class EarlyStop(stepwatch.Callback):  # the FAQ's class as it stands, imports swapped
    def __init__(self, control_loss: float = 1) -> None:
        super(EarlyStop, self).__init__()  # noqa: UP008 - as the FAQ writes it
        self._control_loss = control_loss

    def step_end(self, run_context: Any) -> None:
        loss = run_context.original_args().net_outputs
        if loss.asnumpy() < self._control_loss:
            # Stop training
            run_context._stop_requested = True


def test_the_faqs_stop_requested_assignment_stops_as_request_stop_does() -> None:
    def steps_with(stopper: stepwatch.Callback) -> list[tuple[str, int]]:
        calls: list[tuple[str, int]] = []
        record = stepwatch.LambdaCallback(
            on_train_step_end=lambda rc: calls.append(("step", rc.cb_params.cur_step_num)),
            on_train_epoch_end=lambda rc: calls.append(("epoch_end", rc.cb_params.cur_step_num)),
            on_train_end=lambda rc: calls.append(("end", rc.cb_params.cur_step_num)),
        )
        make_model().train(5, make_batches(8), callbacks=[stopper, record])
        return calls

    class RequestStop(stepwatch.Callback):
        def step_end(self, run_context: Any) -> None:
            if run_context.original_args().net_outputs.asnumpy() < 0.9:
                run_context.request_stop()

    faq = steps_with(EarlyStop(control_loss=0.9))
    assert faq == steps_with(RequestStop())
    assert faq[-2:] == [("epoch_end", 8), ("end", 8)]  # it stopped after step 8 of 40
    assert len(faq) == 10


def test_stop_requested_reads_and_takes_back_as_in_mindspore() -> None:
    rc = stepwatch.RunContext({"cur_step_num": 1})
    assert rc._stop_requested is False and rc._original_args is rc.original_args()
    rc._stop_requested = True
    assert rc.get_stop_requested() and rc.stop_kind == "requested"
    rc._stop_requested = False  # MindSpore's attribute: False takes the request back
    assert not rc.get_stop_requested() and rc.stop_kind is None and not rc._stop_requested


# -- a callback file whose import line names context ---------------------------------------
CALLBACK_FILE = '''
import time

import stepwatch as ms
from stepwatch import Callback, context

context.set_context(mode=context.GRAPH_MODE, device_target="CPU")


class StepTimer(Callback):
    """Times steps; in PyNative mode each step syncs, so its time is the step's own."""

    def __init__(self):
        self.times = []
        self.modes = []

    def on_train_step_begin(self, run_context):
        self.start = time.perf_counter()

    def on_train_step_end(self, run_context):
        mode = context.get_context("mode")
        self.modes.append("pynative" if mode == ms.PYNATIVE_MODE else "graph")
        self.times.append(time.perf_counter() - self.start)
        if context.get_context("device_target") == "CPU":
            assert str(run_context.original_args().device) == "cpu"
'''


def _import_file(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_a_callback_file_that_imports_context_imports_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "timing_callback.py"
    path.write_text(textwrap.dedent(CALLBACK_FILE))
    with pytest.warns(UserWarning, match=r"mode=GRAPH_MODE\): PyTorch runs eagerly") as notes:
        module = _import_file(path, "timing_callback")
        _import_file(path, "timing_callback_again")  # the note comes once per process
    assert len(notes) == 1
    assert context.get_context("mode") == stepwatch.GRAPH_MODE == context.GRAPH_MODE == 0
    timer = module.StepTimer()
    make_model(device=None).train(1, make_batches(3), callbacks=[timer])
    assert timer.modes == ["graph"] * 3 and len(timer.times) == 3
    assert stepwatch.context is context and stepwatch.set_context is context.set_context


def test_set_context_maps_the_device_and_notes_what_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert context.get_context("mode") == context.PYNATIVE_MODE  # PyTorch is eager
    expected = "GPU" if torch.cuda.is_available() else "CPU"
    assert context.get_context("device_target") == expected
    context.set_context(device_target="CPU")
    assert context.get_context("device_target") == "CPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine's default
    net = nn.Linear(4, 3)
    model = stepwatch.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1))
    assert model.device == torch.device("cpu")  # set_context chose it
    with pytest.warns(
        UserWarning, match=r"set_context\(max_call_depth=..., save_graphs=...\): no PyTorch meaning"
    ):
        context.set_context(save_graphs=True, max_call_depth=2000)
    assert context.get_context("save_graphs") is True
    with pytest.warns(UserWarning, match="set_auto_parallel_context.* is kept but not applied"):
        context.set_auto_parallel_context(
            parallel_mode=context.ParallelMode.DATA_PARALLEL, gradients_mean=True
        )
    assert context.get_auto_parallel_context("parallel_mode") == "stand_alone"  # one process
    assert context.get_auto_parallel_context("device_num") == 1
    assert context.get_auto_parallel_context("gradients_mean") is True
    context.reset_auto_parallel_context()
    assert context.get_auto_parallel_context("gradients_mean") is None


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"bogus": 1}, ValueError, "'bogus' is not a MindSpore context setting"),
        ({"mode": 5}, ValueError, r"GRAPH_MODE \(0\) or context.PYNATIVE_MODE \(1\), but got 5"),
        ({"mode": "graph"}, TypeError, "but got 'graph' with type 'str'"),
        ({"device_target": "TPU"}, ValueError, "'device_target' must be one of"),
        ({"device_target": "Ascend"}, RuntimeError, "no Ascend backend"),
        ({"device_id": -1}, ValueError, r"'device_id' must be in \[0, 4095\], but got -1"),
    ],
)
def test_set_context_refuses_what_mindspore_refuses(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        context.set_context(**kwargs)
    with pytest.raises(ValueError, match="'nope' is not a MindSpore context setting"):
        context.get_context("nope")
    with pytest.raises(ValueError, match="'parallel_mode' must be one of"):
        context.set_auto_parallel_context(parallel_mode="everything")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_target_without_a_gpu_is_an_error_as_in_mindspore() -> None:
    with pytest.raises(RuntimeError, match=r"sees no CUDA GPU .*; pass device_target='CPU'"):
        context.set_context(device_target="GPU")


# -- net_outputs under loss scaling --------------------------------------------------------
class LossScaleMonitor(stepwatch.Callback):  # as MindSpore users write it
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[float, bool, float]] = []

    def step_end(self, run_context: Any) -> None:
        cb_params = run_context.original_args()
        loss = cb_params.net_outputs[0].asnumpy()
        overflow = cb_params.net_outputs[1].asnumpy()
        scale = cb_params.net_outputs[2].asnumpy()
        self.rows.append((float(loss), bool(overflow), float(scale)))


def _regression(scale_manager: Any) -> tuple[stepwatch.Model, list[Any]]:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    batches = [(x[i : i + 8], x[i : i + 8].sum(1, keepdim=True) * 100) for i in range(0, 64, 8)]
    net = nn.Linear(4, 1)
    model = stepwatch.Model(
        net,
        nn.MSELoss(),
        torch.optim.SGD(net.parameters(), lr=1e-4),
        device="cpu",
        amp_level="O2",
        loss_scale_manager=scale_manager,
    )
    return model, batches


@pytest.mark.filterwarnings("ignore:.*needs no loss:UserWarning")
@pytest.mark.parametrize("dynamic", [False, True])
def test_net_outputs_under_loss_scaling_index_as_mindsporess_tuple(
    dynamic: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = (
        stepwatch.DynamicLossScaleManager(2.0**120, scale_factor=2, scale_window=3)
        if dynamic
        else stepwatch.FixedLossScaleManager(2.0**120)
    )
    model, batches = _regression(manager)
    watch = LossScaleMonitor()
    skipped: list[int] = []
    count = stepwatch.LambdaCallback(
        on_train_step_end=lambda rc: skipped.append(rc.cb_params.skipped_steps)
    )
    history = model.train(1, batches, callbacks=[watch, count, stepwatch.LossMonitor(1)])
    overflows = [row[1] for row in watch.rows]
    # The overflow flag is the step's own: the steps the loop counted as skipped.
    assert overflows == [b > a for a, b in zip([0, *skipped], skipped, strict=False)]
    assert any(overflows) and not all(overflows)
    scales = [2.0**120] + [row[2] for row in watch.rows]  # the scale after each step
    for before, after, overflow in zip(scales, scales[1:], overflows, strict=False):
        if not dynamic:
            assert after == before
        elif overflow:
            assert after == before / 2
        else:  # grows after scale_window=3 good steps
            assert after in (before, before * 2)
    # LossMonitor and History print and keep the loss, as without loss scaling.
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss is" in line]
    assert [float(line.rsplit(" ", 1)[1]) for line in lines] == [row[0] for row in watch.rows]
    assert history.history["net_output"] == [watch.rows[-1][0]]


@pytest.mark.filterwarnings("ignore:.*needs no loss:UserWarning")
def test_a_scale_that_never_skips_gives_the_loss_alone_as_mindspore() -> None:
    seen: list[Any] = []
    model, batches = _regression(stepwatch.FixedLossScaleManager(128, drop_overflow_update=False))
    keep = stepwatch.LambdaCallback(
        on_train_step_end=lambda rc: seen.append(rc.original_args().net_outputs)
    )
    model.train(1, batches, callbacks=[keep])
    assert all(isinstance(v, stepwatch.Tensor) and v.dim() == 0 for v in seen)
    assert np.isfinite([float(v) for v in seen]).all()


def test_net_outputs_stay_the_loss_in_another_trainers_run() -> None:
    # MindSpore's tuple is its Model's; through a bridge (Lightning's or the Trainer's scaler)
    # and on a cb_params built by hand the loss stays the loss.
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))  # the scaler's state, as after a step
    rc = stepwatch.RunContext(
        {"cur_step_num": 1, "net_outputs": torch.tensor(0.5), "loss_scaler": scaler}
    )
    assert isinstance(rc.cb_params.net_outputs, stepwatch.Tensor)
    assert float(rc.cb_params.net_outputs) == 0.5
