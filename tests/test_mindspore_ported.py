"""MindSpore's own callback tests, ported by changing the imports.

From MindSpore's ``tests/ut/python/utils/test_callback.py``, its OnRequestExit test
(``test_on_request_exit.py``) and its Model test of ``eval_indexes``. What changes besides
the import lines:

* MindSpore's test-only helpers get their stepwatch counterparts below:
  ``_InternalCallbackParam`` is ``CallbackParams``; ``_CallbackManager`` calls each
  callback's hook in turn inside ``CallbackList.entered()``, as MindSpore's does.
* The networks are torch modules of the same layers, on 3x16x16 images instead of 3x224x224
  (a 9-million-weight Dense layer would make each checkpoint 38 MB); checkpoints end in ``.pt``.
* Files go to a temporary folder (``monkeypatch.chdir``), not the repository.
* OnRequestExit's test sends its SIGTERM from a callback at a given step instead of from a
  process that sleeps 1, 0.5 and 0.14 s: the same signal, at a step known in advance.

Left out: the tests of MindSpore's internals (``_checkpoint_cb_for_save_op``,
``_chg_ckpt_file_name_if_same_exist``, the graph file ``-graph.meta``, Ascend's graceful exit,
MindIO/TFT/taskd adapters) and checkpoint encryption (``enc_key``/``enc_mode``), which
stepwatch does not have.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from stepwatch import Tensor, context
from stepwatch.dataset import NumpySlicesDataset
from stepwatch.train import (
    Callback,
    CheckpointConfig,
    History,
    LambdaCallback,
    LossMonitor,
    Model,
    ModelCheckpoint,
    OnRequestExit,
    RunContext,
)
from stepwatch.train.callback import CallbackParams
from stepwatch.train.callback._callback import CallbackList

# -- MindSpore's test-only helpers ---------------------------------------------------------
_InternalCallbackParam = CallbackParams


class _CallbackManager:
    """MindSpore's callback manager: each hook called on every callback, in order."""

    def __init__(self, callbacks: Any) -> None:
        self._list = CallbackList(callbacks)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> _CallbackManager:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._list.entered())
        return self

    def __exit__(self, *err: Any) -> Any:
        assert self._stack is not None
        return self._stack.__exit__(*err)

    def __getattr__(self, hook: str) -> Any:
        def call(run_context: Any) -> None:
            for cb in self._list.callbacks:
                getattr(cb, hook)(run_context)

        return call


def Momentum(params: Any, learning_rate: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=learning_rate, momentum=momentum)


class Net(nn.Module):
    """Net definition."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3, bias=False)
        self.bn = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(64 * 14 * 14, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.relu(self.bn(self.conv(x)))))


def _train_network() -> nn.Module:
    net = Net()
    optim = Momentum(net.parameters(), learning_rate=0.1, momentum=0.9)
    net.optim = optim  # type: ignore[assignment]  # (TrainOneStepCell holds both)
    return net


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(context, "_settings", {})
    monkeypatch.setattr(context, "_noted", set())
    yield


# -- test_callback.py ----------------------------------------------------------------------
def test_model_checkpoint_prefix_invalid() -> None:
    with pytest.raises(ValueError):
        ModelCheckpoint(123)  # type: ignore[arg-type]
    ModelCheckpoint(directory="./")
    with pytest.raises(TypeError):
        ModelCheckpoint(config="type_error")  # type: ignore[arg-type]
    ModelCheckpoint(config=CheckpointConfig())
    ModelCheckpoint(prefix="ckpt_2", directory="./test_files")


def test_loss_monitor_sink_mode() -> None:
    cb_params = _InternalCallbackParam()
    cb_params.cur_epoch_num = 4
    cb_params.epoch_num = 4
    cb_params.cur_step_num = 2
    cb_params.batch_num = 2
    cb_params.net_outputs = Tensor(2.0)
    run_context = RunContext(cb_params)
    loss_cb = LossMonitor(1)
    callbacks = [loss_cb]
    with _CallbackManager(callbacks) as callbacklist:
        callbacklist.begin(run_context)
        callbacklist.epoch_begin(run_context)
        callbacklist.step_begin(run_context)
        callbacklist.step_end(run_context)
        callbacklist.epoch_end(run_context)
        callbacklist.end(run_context)


def test_loss_monitor_normal_mode() -> None:
    cb_params = _InternalCallbackParam()
    run_context = RunContext(cb_params)
    loss_cb = LossMonitor(1)
    cb_params.cur_epoch_num = 4
    cb_params.epoch_num = 4
    cb_params.cur_step_num = 1
    cb_params.batch_num = 1
    cb_params.net_outputs = Tensor(2.0)
    loss_cb.begin(run_context)
    loss_cb.epoch_begin(run_context)
    loss_cb.step_begin(run_context)
    loss_cb.step_end(run_context)
    loss_cb.epoch_end(run_context)
    loss_cb.end(run_context)


def test_loss_monitor_args() -> None:
    with pytest.raises(ValueError):
        LossMonitor(per_print_times=-1)


def test_internal_callback_param() -> None:
    cb_params = _InternalCallbackParam()
    cb_params.member1 = 1
    cb_params.member2 = "abc"
    assert cb_params.member1 == 1
    assert cb_params.member2 == "abc"


def test_checkpoint_save_ckpt_steps() -> None:
    train_config = CheckpointConfig(
        save_checkpoint_steps=16,
        save_checkpoint_seconds=0,
        keep_checkpoint_max=5,
        keep_checkpoint_per_n_minutes=0,
    )
    ckpt_cb = ModelCheckpoint(config=train_config)
    cb_params = _InternalCallbackParam()
    cb_params.train_network = _train_network()
    cb_params.epoch_num = 10
    cb_params.cur_epoch_num = 5
    cb_params.cur_step_num = 160
    cb_params.batch_num = 32
    run_context = RunContext(cb_params)
    ckpt_cb.begin(run_context)
    ckpt_cb.step_end(run_context)
    ckpt_cb2 = ModelCheckpoint(config=train_config)
    cb_params.cur_epoch_num = 1
    cb_params.cur_step_num = 15
    ckpt_cb2.begin(run_context)
    ckpt_cb2.step_end(run_context)
    # (MindSpore's test asserts nothing; what MindSpore writes here:)
    assert sorted(p.name for p in Path(".").glob("*.pt")) == ["CKP-5_32.pt", "CKP-last.pt"]


def test_checkpoint_save_ckpt_seconds() -> None:
    train_config = CheckpointConfig(
        save_checkpoint_steps=16,
        save_checkpoint_seconds=100,
        keep_checkpoint_max=0,
        keep_checkpoint_per_n_minutes=1,
    )
    ckpt_cb = ModelCheckpoint(config=train_config)
    cb_params = _InternalCallbackParam()
    cb_params.train_network = _train_network()
    cb_params.epoch_num = 10
    cb_params.cur_epoch_num = 4
    cb_params.cur_step_num = 128
    cb_params.batch_num = 32
    run_context = RunContext(cb_params)
    ckpt_cb.begin(run_context)
    ckpt_cb.step_end(run_context)
    ckpt_cb2 = ModelCheckpoint(config=train_config)
    cb_params.cur_epoch_num = 1
    cb_params.cur_step_num = 16
    ckpt_cb2.begin(run_context)
    ckpt_cb2.step_end(run_context)
    # MindSpore writes CKP-4_32 and, the prefix taken, CKP_1-1_16.
    assert sorted(p.name for p in Path(".").glob("*-[0-9]*.pt")) == ["CKP-4_32.pt", "CKP_1-1_16.pt"]


def test_callbackmanager() -> None:
    ck_obj = ModelCheckpoint()
    loss_cb_1 = LossMonitor(1)

    callbacks: list[Any] = [None]
    with pytest.raises(TypeError):
        _CallbackManager(callbacks)

    callbacks = ["Error"]
    with pytest.raises(TypeError):
        _CallbackManager(callbacks)

    callbacks = [ck_obj, loss_cb_1, "Error", None]
    with pytest.raises(TypeError):
        _CallbackManager(callbacks)


def test_callbackmanager_exit_called() -> None:
    with mock.patch.object(Callback, "__exit__", return_value=None) as mock_exit:
        cb1, cb2 = Callback(), Callback()
        with _CallbackManager([cb1, cb2]):
            pass
    for call_args in mock_exit.call_args_list:
        assert call_args == mock.call(mock.ANY, None, None, None)
    assert mock_exit.call_count == 2


def prefix_func(cb_params: Any) -> str:
    return str(cb_params.cur_step_num) + "_custom_file"


def directory_func(cb_params: Any) -> str:
    return "./custom_ckpt"


def custom_checkpoint_dir_and_prefix(prefix: Any, directory: Any, new_names: bool = False) -> None:
    train_config = CheckpointConfig(
        save_checkpoint_steps=16,
        save_checkpoint_seconds=100,
        keep_checkpoint_max=0,
        keep_checkpoint_per_n_minutes=1,
    )
    ckpt_cb = ModelCheckpoint(prefix=prefix, directory=directory, config=train_config)
    cb_params = _InternalCallbackParam()
    cb_params.train_network = _train_network()
    cb_params.epoch_num = 10
    cb_params.cur_epoch_num = 4
    cb_params.cur_step_num = 128
    cb_params.batch_num = 32
    run_context = RunContext(cb_params)
    if new_names:
        ckpt_cb.on_train_begin(run_context)
        ckpt_cb.on_train_step_end(run_context)
    else:
        ckpt_cb.begin(run_context)
        ckpt_cb.step_end(run_context)


@pytest.mark.parametrize("new_names", [False, True])
def test_checkpoint_custom_dir_and_prefix(new_names: bool) -> None:
    custom_checkpoint_dir_and_prefix(prefix_func, directory_func, new_names)
    ckpt_name = "./custom_ckpt/128_custom_file.pt"
    assert os.path.exists(ckpt_name)
    os.chmod(ckpt_name, stat.S_IWRITE)
    os.remove(ckpt_name)


@pytest.mark.parametrize("new_names", [False, True])
def test_checkpoint_custom_dir(new_names: bool) -> None:
    custom_checkpoint_dir_and_prefix("100", directory_func, new_names)
    ckpt_name = "./custom_ckpt/100-4_32.pt"
    assert os.path.exists(ckpt_name)
    os.chmod(ckpt_name, stat.S_IWRITE)
    os.remove(ckpt_name)


@pytest.mark.parametrize("new_names", [False, True])
def test_checkpoint_custom_prefix(new_names: bool) -> None:
    custom_checkpoint_dir_and_prefix(prefix_func, "./ckpt_path", new_names)
    ckpt_name = "./ckpt_path/128_custom_file.pt"
    assert os.path.exists(ckpt_name)
    os.chmod(ckpt_name, stat.S_IWRITE)
    os.remove(ckpt_name)


@pytest.mark.parametrize("new_names", [False, True])
def test_checkpoint_str_dir_and_prefix(new_names: bool) -> None:
    custom_checkpoint_dir_and_prefix("100", "./ckpt_path", new_names)
    ckpt_name = "./ckpt_path/100-4_32.pt"
    assert os.path.exists(ckpt_name)
    from stepwatch import load_checkpoint

    load_checkpoint(ckpt_name, Net())  # a checkpoint of the network, not an empty file


def test_callbackmanager_exit_called_when_raises() -> None:
    with mock.patch.object(Callback, "__exit__", return_value=None) as mock_exit:
        cb1, cb2 = Callback(), Callback()
        with pytest.raises(ValueError), _CallbackManager([cb1, cb2]):
            raise ValueError()
    for call_args in mock_exit.call_args_list:
        assert call_args == mock.call(*[mock.ANY] * 4)
    assert mock_exit.call_count == 2


def test_callbackmanager_begin_called() -> None:
    run_context: dict[str, Any] = dict()
    with mock.patch.object(Callback, "begin", return_value=None) as mock_begin:
        cb1, cb2 = Callback(), Callback()
        with _CallbackManager([cb1, cb2]) as cm:
            cm.begin(run_context)
    for call_args in mock_begin.call_args_list:
        assert call_args == mock.call(run_context)
    assert mock_begin.call_count == 2


def test_runcontext() -> None:
    context_err = 666
    with pytest.raises(TypeError):
        RunContext(context_err)  # type: ignore[arg-type]

    cb_params = _InternalCallbackParam()
    cb_params.member1 = 1
    cb_params.member2 = "abc"

    run_context = RunContext(cb_params)
    run_context.original_args()
    assert cb_params.member1 == 1
    assert cb_params.member2 == "abc"

    run_context.request_stop()
    should_stop = run_context.get_stop_requested()
    assert should_stop


def test_checkpoint_config() -> None:
    with pytest.raises(ValueError):
        CheckpointConfig(0, 0, 0, 0, True)

    with pytest.raises(ValueError):
        CheckpointConfig(0, None, 0, 0, True)


def test_history(capsys: pytest.CaptureFixture[str]) -> None:
    cb_params = _InternalCallbackParam()
    cb_params.cur_epoch_num = 4
    cb_params.epoch_num = 4
    cb_params.cur_step_num = 2
    cb_params.batch_num = 2
    cb_params.net_outputs = Tensor(2.0)
    cb_params.metrics = {"mae": 6.343789100646973, "mse": 59.03999710083008}

    run_context = RunContext(cb_params)
    history_cb = History()
    callbacks = [history_cb]
    with _CallbackManager(callbacks) as callbacklist:
        callbacklist.begin(run_context)
        callbacklist.epoch_begin(run_context)
        callbacklist.step_begin(run_context)
        callbacklist.step_end(run_context)
        callbacklist.epoch_end(run_context)
        callbacklist.end(run_context)
    print(history_cb.epoch)
    print(history_cb.history)
    assert history_cb.epoch == {"epoch": [4]} and history_cb.history["net_output"] == [2.0]


def test_lambda(capsys: pytest.CaptureFixture[str]) -> None:
    cb_params = _InternalCallbackParam()
    cb_params.cur_epoch_num = 4
    cb_params.epoch_num = 4
    cb_params.cur_step_num = 2
    cb_params.batch_num = 2
    cb_params.net_outputs = Tensor(2.0)

    run_context = RunContext(cb_params)
    lambda_cb = LambdaCallback(
        on_train_epoch_end=lambda run_context: print(
            "loss result: ", run_context.original_args().net_outputs
        )
    )

    callbacks = [lambda_cb]
    with _CallbackManager(callbacks) as callbacklist:
        callbacklist.on_train_begin(run_context)
        callbacklist.on_train_epoch_begin(run_context)
        callbacklist.on_train_step_begin(run_context)
        callbacklist.on_train_step_end(run_context)
        callbacklist.on_train_epoch_end(run_context)
        callbacklist.on_train_end(run_context)
    assert capsys.readouterr().out == "loss result:  2.0\n"


# -- test_on_request_exit.py ---------------------------------------------------------------
class LeNet5(nn.Module):
    """LeNet5 network"""

    def __init__(self, num_class: int = 10, channel: int = 1) -> None:
        super().__init__()
        self.num_class = num_class
        self.conv1 = nn.Conv2d(channel, 6, 5, bias=False)
        self.conv2 = nn.Conv2d(6, 16, 5, bias=False)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, self.num_class)
        self.relu = nn.ReLU()
        self.max_pool2d = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def construct_model() -> Model:
    torch.manual_seed(0)
    forward_net = LeNet5()
    loss = nn.CrossEntropyLoss()
    optim = Momentum(forward_net.parameters(), 0.01, 0.9)
    return Model(forward_net, loss_fn=loss, optimizer=optim, metrics={"accuracy"}, device="cpu")


def construct_dataset() -> NumpySlicesDataset:
    data = np.ones((1000, 1, 32, 32), dtype=np.float32) * 0.01
    label = np.ones(1000, dtype=np.int64)
    dataset = NumpySlicesDataset((data, label), column_names=["data", "label"])
    return dataset.batch(32, drop_remainder=True)


class EpochAndStepRecord(Callback):
    """Define EpochAndStepRecord Callback to record epoch and step"""

    def __init__(self) -> None:
        self.epoch = 0
        self.step = 0

    def on_train_end(self, run_context: Any) -> None:
        cb_params = run_context.original_args()
        self.epoch = cb_params.cur_epoch_num
        self.step = (cb_params.cur_step_num - 1) % cb_params.batch_num + 1

    def on_eval_end(self, run_context: Any) -> None:
        cb_params = run_context.original_args()
        self.step = cb_params.cur_step_num


class SendSignal(Callback):
    """Sends SIGTERM to this process at a given train or eval step (the original test's
    helper process sends it after a sleep)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_step_end(self, run_context: Any) -> None:
        if run_context.original_args().cur_step_num == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)

    on_eval_step_end = on_train_step_end


@pytest.mark.skipif(sys.platform != "linux", reason="as MindSpore's test: Linux signals")
def test_on_request_exit_callback(capsys: pytest.CaptureFixture[str]) -> None:
    context.set_context(mode=context.PYNATIVE_MODE)
    directory = "./data"
    os.makedirs(directory)
    exits: list[OnRequestExit] = []

    def on_request_exit() -> OnRequestExit:
        exits.append(OnRequestExit(save_ckpt=True, file_name="LeNet5", directory=directory))
        return exits[-1]

    try:
        dataset = construct_dataset()
        model = construct_model()
        loss_monitor = LossMonitor()
        epoch_and_step_record = EpochAndStepRecord()
        epoch_num = 100
        step_num = dataset.get_dataset_size()
        model.train(
            epoch_num,
            dataset,
            callbacks=[loss_monitor, epoch_and_step_record, on_request_exit(), SendSignal(40)],
        )
        train_ckpt_file = f"{directory}/LeNet5.pt"
        eval_ckpt_file = f"{directory}/LeNet5_eval.pt"
        assert epoch_and_step_record.epoch != epoch_num or epoch_and_step_record.step != step_num
        assert os.path.isfile(train_ckpt_file)
        ckpt_mtime = os.stat(train_ckpt_file).st_mtime_ns

        dataset = construct_dataset()
        model = construct_model()
        model.train(
            epoch_num,
            dataset,
            callbacks=[loss_monitor, epoch_and_step_record, on_request_exit(), SendSignal(20)],
        )
        assert epoch_and_step_record.epoch != epoch_num or epoch_and_step_record.step != step_num
        assert os.stat(train_ckpt_file).st_mtime_ns > ckpt_mtime

        # The evaluation: a pass of 31 steps, the signal at its 5th.
        model.eval(
            dataset,
            callbacks=[loss_monitor, epoch_and_step_record, on_request_exit(), SendSignal(5)],
        )
        assert epoch_and_step_record.step != step_num
        assert epoch_and_step_record.step == 5  # it stopped after the step the signal came in
        assert os.path.isfile(eval_ckpt_file)

        dataset = construct_dataset()
        model = construct_model()
        model.eval(dataset, callbacks=[loss_monitor, epoch_and_step_record, on_request_exit()])
        assert epoch_and_step_record.step == step_num
    finally:
        for exit_cb in reversed(exits):
            exit_cb.restore_handlers()


# -- Model's eval_indexes ------------------------------------------------------------------
class LossNet(nn.Module):
    """A network with its loss inside: (data, label) -> the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.fc(x), y)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=gen), torch.arange(8) % 3) for _ in range(2)]


def test_eval_indexes_on_an_eval_network_that_returns_the_loss_alone() -> None:
    net2 = LossNet()
    model2 = Model(net2, eval_network=net2, eval_indexes=[0, 1, 2], metrics={"loss"})
    with pytest.raises(ValueError):
        model2.eval(_batches())

    model3 = Model(net2, eval_network=net2, metrics={"loss"})
    with pytest.raises(ValueError):
        model3.eval(_batches())
