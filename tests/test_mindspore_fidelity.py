"""MindSpore's callback behaviours that code written for MindSpore relies on, by import swap."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stepwatch import (
    Callback,
    CheckpointConfig,
    EarlyStopping,
    History,
    LossMonitor,
    ModelCheckpoint,
    ReduceLROnPlateau,
    RunContext,
)
from stepwatch.train.callback._callback import CallbackList
from stepwatch.train.metrics import get_metric_fn

from .conftest import make_batches, make_model


def _hand_made(**fields: Any) -> RunContext:
    """A RunContext over a cb_params built by hand with MindSpore's few fields."""
    return RunContext(fields)


# -- 1. old and new hook names reach each other ---------------------------------------------
class LoudLoss(LossMonitor):
    def __init__(self) -> None:
        super().__init__(1)
        self.steps: list[int] = []

    def step_end(self, run_context: Any) -> None:
        self.steps.append(run_context.original_args().cur_step_num)
        super().step_end(run_context)  # LossMonitor's own line


def test_a_subclass_overriding_a_1x_hook_of_a_builtin_is_called(
    capsys: pytest.CaptureFixture[str],
) -> None:
    loud = LoudLoss()
    make_model().train(2, make_batches(3), callbacks=[loud])
    assert loud.steps == [1, 2, 3, 4, 5, 6]
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss is" in line]
    assert len(lines) == 6 and lines[0].startswith("epoch: 1 step: 1, loss is")


def test_calling_a_builtins_1x_hook_directly_acts(capsys: pytest.CaptureFixture[str]) -> None:
    rc = _hand_made(cur_epoch_num=1, cur_step_num=3, batch_num=4, net_outputs=torch.tensor(0.25))
    LossMonitor(1).step_end(rc)
    assert capsys.readouterr().out == "epoch: 1 step: 3, loss is 0.25\n"
    history = History()
    history.begin(rc)
    rc.cb_params.train_results = {"loss": 0.5}
    history.epoch_end(rc)
    assert history.history["loss"] == [0.5] and history.epoch == {"epoch": [1]}


# -- 2. built-ins on a cb_params built by hand -----------------------------------------------
def test_builtins_run_on_a_hand_made_cb_params(capsys: pytest.CaptureFixture[str]) -> None:
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    rlr = ReduceLROnPlateau("loss", factor=0.1, patience=1, verbose=True)
    stop = EarlyStopping("loss", patience=1, verbose=True)
    for epoch in (1, 2):
        rc = _hand_made(cur_epoch_num=epoch, cur_step_num=epoch, batch_num=1, optimizer=opt,
                        train_results={"loss": 1.0}, net_outputs=torch.tensor(1.0))  # fmt: skip
        for cb in (rlr, stop):
            cb.epoch_end(rc)
    stop.end(rc)  # the 1.x name: EarlyStopping's on_train_end prints its line
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert stop.stopped_epoch == 2
    assert capsys.readouterr().out.splitlines() == [
        "Epoch 00002: ReduceLROnPlateau reducing learning rate to 0.1.",
        "Epoch 00002: early stopping",
    ]


# -- 4. a monitor other than 'loss' reads eval_results -------------------------------------
def test_a_monitor_reads_eval_results_without_a_valid_dataset() -> None:
    stop = EarlyStopping("accuracy", patience=1)
    for epoch, acc in ((1, 0.5), (2, 0.5), (3, 0.5)):
        rc = _hand_made(cur_epoch_num=epoch, cur_step_num=epoch, batch_num=1,
                        train_results={"loss": 1.0}, eval_results={"accuracy": acc})  # fmt: skip
        stop.on_train_epoch_end(rc)
        if rc.stop_requested:
            break
    assert stop.stopped_epoch == 2 and stop.best == 0.5


# -- 5. CheckpointConfig as MindSpore stores it ----------------------------------------------
def test_checkpoint_config_defaults_and_policy() -> None:
    config = CheckpointConfig()
    assert config.save_checkpoint_seconds is None and config.keep_checkpoint_per_n_minutes is None
    assert config.get_checkpoint_policy() == {
        "save_checkpoint_steps": 1,
        "save_checkpoint_seconds": None,
        "keep_checkpoint_max": 5,
        "keep_checkpoint_per_n_minutes": None,
        "saved_network": None,
    }
    by_time = CheckpointConfig(save_checkpoint_steps=None, save_checkpoint_seconds=30)
    assert by_time.get_checkpoint_policy()["save_checkpoint_seconds"] == 30


# -- 6. errors of both kinds where MindSpore's type differs ---------------------------------
def test_errors_are_instances_of_mindsporess_type_and_stepwatchs() -> None:
    with pytest.raises(ValueError, match="'prefix' must be a str") as info:
        ModelCheckpoint(123)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    for bad in ([None], ["x"]):
        with pytest.raises(TypeError, match=r"callbacks\[0\] must be a Callback instance"):
            CallbackList(bad)  # type: ignore[arg-type]
    with pytest.raises(KeyError) as missing:
        get_metric_fn("nope")
    assert isinstance(missing.value, ValueError)
    assert str(missing.value).startswith("unknown metric name 'nope'")


# -- 7. prefix and directory as functions of cb_params ---------------------------------------
def test_checkpoint_prefix_and_directory_may_be_functions(tmp_path: Path) -> None:
    # As in MindSpore, a prefix function names the whole file, at each save.
    saver = ModelCheckpoint(
        prefix=lambda p: f"net_rank{p.rank_id}-{p.cur_epoch_num}_{p.step_in_epoch}",
        directory=lambda p: tmp_path / f"rank_{p.rank_id}",
        config=CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10),
    )
    make_model().train(1, make_batches(4), callbacks=[saver])
    names = sorted(p.name for p in (tmp_path / "rank_0").iterdir())
    assert names == ["net_rank0-1_2.pt", "net_rank0-1_4.pt"]
    assert saver.latest_ckpt_file_name == str(tmp_path / "rank_0" / "net_rank0-1_4.pt")
    # The same name each time: one file, the newest.
    same = ModelCheckpoint(lambda p: "net", tmp_path / "one", CheckpointConfig(2))
    make_model().train(1, make_batches(4), callbacks=[same])
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["net.pt"]
    with pytest.raises(ValueError, match="without '/'"):
        make_model().train(
            1,
            make_batches(2),
            callbacks=[ModelCheckpoint(prefix=lambda p: "a/b", directory=tmp_path)],
        )


# -- 8. lines printed as MindSpore prints them -----------------------------------------------
class _FlushClears:
    """A stdout replacement of the kind MindSpore's own tests use: flush() hands the text on
    (here: drops it), so a line printed with flush=True is lost."""

    def __init__(self) -> None:
        self.content = ""

    def write(self, text: str) -> int:
        self.content += text
        return len(text)

    def flush(self) -> None:
        self.content = ""


def test_fit_lines_survive_a_stdout_that_acts_on_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = _FlushClears()
    monkeypatch.setattr(sys, "stdout", sink)
    model = make_model(metrics={"accuracy"})
    model.fit(1, make_batches(2), make_batches(2), callbacks=[LossMonitor(1)])
    assert "epoch: 1 step: 2, loss is" in sink.content
    assert "Eval result: epoch 1, metrics: {" in sink.content


# -- wrong usages that now fail at the door -------------------------------------------------
def test_wrong_usages_are_refused_at_construction(tmp_path: Path) -> None:
    import io

    from stepwatch import AnomalyMonitor, PlotMonitor, ProgressBar

    closed = io.StringIO()
    closed.close()
    with pytest.raises(ValueError, match=r"'file' .* is closed"):
        ProgressBar(file=closed)
    with pytest.raises(TypeError, match=r"must take two arguments, fn\(alert, run_context\)"):
        AnomalyMonitor(action=lambda alert: None)
    AnomalyMonitor(action=lambda alert, run_context: None)  # the right shape
    with pytest.raises(ValueError, match="'detectors' is empty"):
        AnomalyMonitor(detectors=[])
    with pytest.raises(ValueError, match="must name a PNG file"):
        PlotMonitor(tmp_path / "curves.jpg")


def test_silent_mistakes_now_warn_or_refuse(tmp_path: Path) -> None:
    from stepwatch import AnomalyMonitor, DistributedMonitor, PlotMonitor, ProgressBar

    with pytest.warns(UserWarning, match="2 ProgressBars in one run"):
        make_model().train(1, make_batches(2), callbacks=[ProgressBar(), ProgressBar()])
    same = tmp_path / "curves.png"
    with pytest.raises(ValueError, match="two PlotMonitors write"):
        make_model().train(1, make_batches(2), callbacks=[PlotMonitor(same), PlotMonitor(same)])
    with pytest.warns(UserWarning, match="DistributedMonitor is in a run of one process"):
        make_model().train(1, make_batches(2), callbacks=[DistributedMonitor()])
    with pytest.warns(UserWarning, match="passed to Model.eval it does nothing"):
        make_model(metrics={"accuracy"}).eval(make_batches(2), callbacks=[AnomalyMonitor()])
    never = AnomalyMonitor(detectors={"threshold": {"name": "train_acuracy", "above": 0.9}})
    with pytest.warns(UserWarning, match="the threshold on 'train_acuracy' never saw its value"):
        make_model().train(1, make_batches(2), callbacks=[never])
    no_eval = AnomalyMonitor(detectors={"threshold": {"name": "eval_loss", "above": 9.0}})
    with pytest.warns(UserWarning, match="in a run that does not validate never fires"):
        make_model().train(1, make_batches(2), callbacks=[no_eval])


def test_resume_errors_name_the_problem(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    saver = ModelCheckpoint("net", ckpt, CheckpointConfig(save_checkpoint_steps=2))
    make_model().train(1, make_batches(2), callbacks=[saver])
    with pytest.raises(
        IsADirectoryError, match=r"is a folder; pass a checkpoint file in it such as"
    ):
        make_model().train(2, make_batches(2), resume_from=ckpt)
    other = make_model()
    other.train_network[0] = torch.nn.Linear(4, 32)  # another architecture
    other.train_network[2] = torch.nn.Linear(32, 3)
    with pytest.raises(
        ValueError, match="holds the weights of another network than this Sequential"
    ):
        from stepwatch import load_checkpoint

        load_checkpoint(ckpt / "net-last.pt", other.train_network)


def test_learning_rate_functions_and_accumulation_are_checked() -> None:
    from stepwatch import LearningRateScheduler

    with pytest.raises(TypeError, match=r"must take two arguments, fn\(lr, cur_step_num\)"):
        LearningRateScheduler(lambda lr: lr)

    def forgot_return(lr: float, step: int) -> None:
        lr * 0.5

    with pytest.raises(TypeError, match=r"returned None at step 1; .* forget a 'return'"):
        make_model().train(1, make_batches(2), callbacks=[LearningRateScheduler(forgot_return)])
    with pytest.raises(ValueError, match=r"returned the learning rate -0\.1 at step 1"):
        make_model().train(
            1, make_batches(2), callbacks=[LearningRateScheduler(lambda lr, s: -0.1)]
        )
    with pytest.warns(UserWarning, match="accumulate_grad_batches=8 is larger than the epoch"):
        make_model(accumulate_grad_batches=8).train(1, make_batches(3))


def test_a_one_cycle_schedule_shorter_than_the_run_and_bad_compile_options_are_refused() -> None:
    from stepwatch import Model

    def with_schedule(total: int) -> Model:
        net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
        return Model(net, torch.nn.CrossEntropyLoss(), opt, lr_scheduler=sched, device="cpu")

    with pytest.raises(ValueError, match=r"lasts total_steps=10 steps \(10 left\), but this run"):
        with_schedule(10).train(2, make_batches(8))
    with_schedule(16).train(2, make_batches(8))  # 16 optimizer steps: exactly the schedule
    with pytest.raises(ValueError, match=r"unknown torch\.compile option 'bogus'"):
        make_model(compile={"bogus": 1})
    with pytest.raises(ValueError, match=r"'compile' .* is refused by torch\.compile"):
        make_model(compile={"mode": "bogus"})


def test_a_torch_schedule_that_sets_a_negative_rate_is_an_error() -> None:
    from stepwatch import Model

    net = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bad = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step)  # negative at step 2
    model = Model(net, torch.nn.CrossEntropyLoss(), opt, lr_scheduler=bad, device="cpu")
    with pytest.raises(ValueError, match="set parameter group 0's learning rate to -"):
        model.train(1, make_batches(4))


def test_calling_model_checkpoint_step_end_by_hand_writes_a_file(tmp_path: Path) -> None:
    net = torch.nn.Linear(2, 2)
    saver = ModelCheckpoint("ckpt", tmp_path, CheckpointConfig(save_checkpoint_steps=1))
    rc = _hand_made(train_network=net, cur_epoch_num=1, cur_step_num=1, batch_num=2,
                    epoch_num=1, net_outputs=torch.tensor(0.5))  # fmt: skip
    saver.step_end(rc)  # as MindSpore's tests call it: no begin, a cb_params of a few fields
    assert (tmp_path / "ckpt-1_1.pt").is_file()
    from stepwatch import load_checkpoint

    load_checkpoint(tmp_path / "ckpt-1_1.pt", torch.nn.Linear(2, 2))


def test_cb_params_metrics_hold_values_from_eval_end_to_the_epoch_end_only() -> None:
    seen: list[tuple[str, Any]] = []

    class EvalPrinter(Callback):  # MindSpore's LossMonitor idiom
        def on_train_epoch_begin(self, run_context: RunContext) -> None:
            seen.append(("begin", run_context.original_args().get("metrics")))

        def on_train_epoch_end(self, run_context: RunContext) -> None:
            seen.append(("end", run_context.original_args().get("metrics")))

    model = make_model(metrics={"accuracy"})
    model.train(1, make_batches(2), callbacks=[EvalPrinter()])
    assert seen == [("begin", None), ("end", None)]  # train: no metrics field at all
    seen.clear()
    model.fit(2, make_batches(2), make_batches(2), callbacks=[EvalPrinter()])
    assert [kind for kind, _ in seen] == ["begin", "end", "begin", "end"]
    assert seen[0][1] is None and seen[2][1] is None  # removed after each epoch
    assert set(seen[1][1]) == {"accuracy"} and isinstance(seen[1][1]["accuracy"], float)


def test_net_outputs_prints_as_a_mindspore_tensor_does() -> None:
    seen: list[tuple[str, str, str, str]] = []

    class Printer(Callback):  # the seed's f"Step {n}, loss: {loss}"
        def on_train_step_end(self, run_context: RunContext) -> None:
            loss = run_context.original_args().net_outputs
            seen.append((f"{loss}", str(loss), repr(loss), f"{loss:.3f}"))

    make_model().train(1, make_batches(1), callbacks=[Printer()])
    formatted, text, shown, fixed = seen[0]
    value = float(formatted)
    assert formatted == text == str(np.float32(value))  # NumPy's float32 digits: 0.29028413
    assert shown == f"Tensor(shape=[], dtype=Float32, value= {text})"
    assert fixed == f"{value:.3f}"


def test_eval_net_outputs_unpack_as_mindspores_eval_network_returns_them() -> None:
    seen: list[Any] = []

    class Unpack(Callback):
        def on_eval_step_end(self, run_context: RunContext) -> None:
            loss, logits, label = run_context.original_args().net_outputs  # (loss, outputs, label)
            seen.append((loss.dim(), tuple(logits.shape), tuple(label.shape)))

        def on_train_step_end(self, run_context: RunContext) -> None:
            seen.append(run_context.original_args().net_outputs.dim())  # the loss, in training

    model = make_model(metrics={"accuracy"})
    batches = make_batches(1)
    model.fit(1, batches, batches, callbacks=[Unpack()])
    size, width = len(batches[0][1]), model.eval_network(batches[0][0]).shape[1]
    assert seen == [0, (0, (size, width), (size,))]


def test_a_bfloat16_or_multi_value_net_outputs_prints_too() -> None:
    from stepwatch import Tensor

    half = torch.tensor(0.5).bfloat16().as_subclass(Tensor)  # NumPy has no bfloat16
    assert (str(half), f"{half}", f"{half:.2f}") == ("0.5", "0.5", "0.50")
    assert repr(half) == "Tensor(shape=[], dtype=BFloat16, value= 0.5)"
    grid = torch.arange(4.0).reshape(2, 2).as_subclass(Tensor)
    assert f"{grid}" == str(grid) == str(grid.asnumpy())  # NumPy's layout, as MindSpore's
    assert repr(grid) == f"Tensor(shape=[2, 2], dtype=Float32, value= {grid.asnumpy()})"


# -- eval_indexes: an eval network of MindSpore's kind -------------------------------------
class WithEvalCell(torch.nn.Module):
    """MindSpore's nn.WithEvalCell: (data, label) -> (loss, outputs, label)."""

    def __init__(self, network: torch.nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self._network, self._loss_fn = network, loss_fn

    def forward(self, data: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self._network(data)
        return self._loss_fn(outputs, label), outputs, label


class LabelFirst(WithEvalCell):
    """Another order, and a fourth output: (label, outputs, per-sample loss, argmax)."""

    def forward(self, data: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self._network(data)
        losses = torch.nn.functional.cross_entropy(outputs, label, reduction="none")
        return label, outputs, losses, outputs.argmax(1)


def test_eval_indexes_pick_loss_prediction_and_label_of_the_eval_network() -> None:
    from stepwatch import Model

    trained = make_model(metrics={"accuracy", "loss"})
    trained.train(2, make_batches(4))
    net, loss_fn = trained.train_network, torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = make_batches(3, seed=1)
    expected = trained.eval(batches)
    metrics = {"accuracy", "loss"}
    as_mindspore = Model(net, loss_fn, opt, metrics, WithEvalCell(net, loss_fn), [0, 1, 2])
    assert as_mindspore.eval(batches) == pytest.approx(expected)
    seen: list[Any] = []
    record = Callback()
    record.on_eval_step_end = lambda rc: seen.append(rc.original_args().net_outputs)  # type: ignore[method-assign]
    other = Model(net, None, opt, metrics, LabelFirst(net, loss_fn), eval_indexes=[2, 1, 0])
    assert other.eval(batches, callbacks=[record]) == pytest.approx(expected)
    assert len(seen) == 3 and all(len(outputs) == 4 for outputs in seen)  # the whole output
    assert other.predict(batches[0][0]).shape == (8, 3)  # predict uses the network
    fitter = Model(net, loss_fn, opt, metrics, LabelFirst(net, loss_fn), eval_indexes=[2, 1, 0])
    history = fitter.fit(1, batches, batches)
    assert history.history["eval_loss"][0] == pytest.approx(
        fitter.eval(batches)["loss"]  # the eval network's loss, as the 'loss' metric has it
    )


@pytest.mark.parametrize(
    ("eval_indexes", "exc", "match"),
    [
        ((0, 1), ValueError, r"must have three items .* but got \[0, 1\]"),
        ("012", TypeError, r"must be a list of three ints .* but got '012' with type 'str'"),
        ([0, 1.0, 2], TypeError, r"'eval_indexes\[1\]' must be an int .* got 1.0"),
        ([0, True, 2], TypeError, r"'eval_indexes\[1\]' must be an int"),
    ],
)
def test_bad_eval_indexes_are_refused_at_the_door(
    eval_indexes: Any, exc: type[Exception], match: str
) -> None:
    net = torch.nn.Linear(4, 3)
    with pytest.raises(exc, match=match) as info:
        make_model(
            metrics={"accuracy"}, eval_network=WithEvalCell(net, None), eval_indexes=eval_indexes
        )
    assert isinstance(info.value, ValueError)  # MindSpore's type, for code that catches it


def test_eval_indexes_without_an_eval_network_and_outputs_that_do_not_fit() -> None:
    # [0, 1, 2] is what the evaluation built from network and loss_fn gives: accepted.
    model = make_model(metrics={"accuracy"}, eval_indexes=[0, 1, 2])
    assert set(model.eval(make_batches(2))) == {"accuracy"}
    with pytest.raises(ValueError, match=r"picks outputs of 'eval_network', but none was given"):
        make_model(metrics={"accuracy"}, eval_indexes=[2, 1, 0])
    net, loss_fn = torch.nn.Linear(4, 3), torch.nn.CrossEntropyLoss()
    short = make_model(metrics={"accuracy"}, eval_network=WithEvalCell(net, loss_fn),
                       eval_indexes=[0, 1, 5])  # fmt: skip
    with pytest.raises(ValueError, match=r"'eval_indexes\[2\]' is 5, but eval_network returns 3"):
        short.eval(make_batches(2))
    bare = make_model(metrics={"accuracy"}, eval_network=net, eval_indexes=[0, 1, 2])
    with pytest.raises(TypeError, match=r"called with the whole batch.*Linear\(2 columns\)"):
        bare.eval(make_batches(2))
    alone = torch.nn.Bilinear(4, 1, 1)  # takes (data, label), returns one tensor
    one = make_model(metrics={"mse"}, eval_network=alone, eval_indexes=[0, 1, 2])
    with pytest.raises(ValueError, match="must return a tuple of at least three outputs"):
        one.eval([(x, y[:, None].float()) for x, y in make_batches(2)])


def test_every_builtin_runs_its_hooks_on_a_bare_cb_params(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    import stepwatch as sw

    monkeypatch.chdir(tmp_path)
    builtins = [
        sw.LossMonitor(1),
        sw.TimeMonitor(),
        sw.History(),
        sw.ModelCheckpoint("m", tmp_path / "ck"),
        sw.EarlyStopping("loss"),
        sw.ReduceLROnPlateau("loss"),
        sw.OnRequestExit(directory=tmp_path / "exit"),
        sw.BackupAndRestore(tmp_path / "backup"),
        sw.TerminateOnNaN(),
        sw.LearningRateScheduler(lambda lr, step: lr),
        sw.ProgressBar(),
        sw.AnomalyMonitor(),
        sw.RunRecorder(db=tmp_path / "runs.db"),
        sw.PlotMonitor(tmp_path / "curves.png"),
    ]
    net = torch.nn.Linear(4, 3)
    try:
        for cb in builtins:  # MindSpore's unit-test fields only: no optimizer, no device
            rc = _hand_made(train_network=net, epoch_num=10, cur_epoch_num=4, cur_step_num=128,
                            batch_num=32, net_outputs=sw.Tensor(2.0))  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. ProgressBar's "no terminal"
                with cb:
                    for hook in ("begin", "epoch_begin", "step_begin", "step_end", "epoch_end"):
                        getattr(cb, hook)(rc)
                    cb.end(rc)
    finally:
        builtins[6].restore_handlers()  # type: ignore[attr-defined]
    assert "epoch: 4 step: 32, loss is 2.0" in capsys.readouterr().out
    assert (tmp_path / "ck" / "m-4_32.pt").is_file()
    assert builtins[2].epoch == {"epoch": [4]}  # type: ignore[attr-defined]
    assert [run.name for run in sw.Store(tmp_path / "runs.db").runs()] != []
