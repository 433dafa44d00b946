"""Model: argument checks, datasets, cb_params fields, metrics and the no-sync promise."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import stepwatch
from stepwatch import Callback, LambdaCallback, Model, NumpySlicesDataset, RunContext

from .conftest import make_batches, make_model


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


# -- constructor checks --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"network": "net"}, TypeError, "'network' must be a torch.nn.Module"),
        ({"network": nn.Linear}, TypeError, "class Linear: pass Linear"),
        ({"loss_fn": 3}, TypeError, "'loss_fn' must be a callable"),
        ({"loss_fn": nn.CrossEntropyLoss}, TypeError, "class CrossEntropyLoss"),
        ({"optimizer": "sgd"}, TypeError, "'optimizer' must be a torch.optim.Optimizer"),
        ({"optimizer": torch.optim.SGD}, TypeError, "class SGD"),
        ({"metrics": "accuracy"}, TypeError, r"pass \{'accuracy'\}"),
        ({"metrics": 5}, TypeError, "'metrics' must be a set"),
        ({"metrics": {"acuracy"}}, ValueError, "unknown metric name 'acuracy'"),
        ({"metrics": {"mode": "accuracy"}}, ValueError, "clash with cb_params"),
        ({"metrics": {"x": object()}}, TypeError, r"clear\(\), update\(\)"),
        ({"eval_network": 1}, TypeError, "'eval_network' must be"),
        ({"device": 3}, TypeError, "'device' must be None, a str"),
        ({"device": "gpu7"}, ValueError, "'device' must name a torch device"),
    ],
)
def test_model_constructor_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    net = _net()
    args: dict[str, Any] = {
        "network": net,
        "loss_fn": nn.CrossEntropyLoss(),
        "optimizer": torch.optim.SGD(net.parameters(), lr=0.1),
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        Model(**args)


def test_device_none_picks_cpu_without_cuda() -> None:
    net = _net()
    model = Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.device.type == expected


# -- train / fit / eval argument checks ----------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"epoch": 0}, ValueError, "'epoch' must be an int >= 1"),
        ({"epoch": 1.5}, TypeError, "'epoch' must be an int"),
        ({"epoch": True}, TypeError, "'epoch' must be an int"),
        ({"initial_epoch": -1}, ValueError, "'initial_epoch' must be an int >= 0"),
        ({"initial_epoch": 2}, ValueError, "'initial_epoch' must be smaller than 'epoch'"),
        ({"dataset_sink_mode": 1}, TypeError, "'dataset_sink_mode' must be a bool"),
        ({"sink_size": 0}, ValueError, "'sink_size' must be -1 or a positive int"),
        ({"sink_size": "4"}, TypeError, "'sink_size' must be an int"),
        ({"train_dataset": []}, ValueError, "There is no valid data in dataset"),
        ({"train_dataset": None}, TypeError, "'train_dataset' must be a dataset"),
        ({"train_dataset": iter(make_batches(2))}, TypeError, "one-shot iterator"),
        ({"train_dataset": 5}, TypeError, "'train_dataset' must be a DataLoader"),
        ({"train_dataset": [torch.zeros(8, 4)]}, ValueError, r"must be \(data, label\)"),
        ({"train_dataset": [(1, 2, 3)]}, ValueError, "got 3 columns"),
    ],
)
def test_train_argument_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    args: dict[str, Any] = {"epoch": 2, "train_dataset": make_batches(1)}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        make_model().train(**args)


def test_train_without_optimizer_is_value_error() -> None:
    model = Model(_net(), nn.CrossEntropyLoss(), device="cpu")
    with pytest.raises(ValueError, match="needs an optimizer"):
        model.train(1, make_batches(1))


def test_dataset_without_length_is_type_error() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            yield from make_batches(2)

    with pytest.raises(TypeError, match="has no length"):
        make_model().train(1, DataLoader(Stream(), batch_size=None))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"valid_frequency": 0}, ValueError, "'valid_frequency' must be an int >= 1"),
        ({"valid_frequency": "2"}, TypeError, "'valid_frequency' must be an int"),
        ({"valid_frequency": [1, 0]}, ValueError, r"valid_frequency\[i\]"),
        ({"valid_dataset_sink_mode": None}, TypeError, "'valid_dataset_sink_mode'"),
        ({"valid_dataset": []}, ValueError, "There is no valid data"),
    ],
)
def test_fit_argument_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    args: dict[str, Any] = {"valid_dataset": make_batches(1)}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        make_model(metrics={"accuracy"}).fit(1, make_batches(1), **args)


def test_fit_and_eval_without_metrics_are_value_errors() -> None:
    with pytest.raises(ValueError, match="needs metrics"):
        make_model().fit(1, make_batches(1), make_batches(1))
    with pytest.raises(ValueError, match="needs metrics"):
        make_model().eval(make_batches(1))
    with pytest.raises(TypeError, match="'dataset_sink_mode'"):
        make_model(metrics={"accuracy"}).eval(make_batches(1), dataset_sink_mode="no")
    make_model().fit(1, make_batches(1))  # no validation set: no metrics needed


# -- datasets ------------------------------------------------------------------------------
def test_dataloader_list_and_numpy_slices_train_the_same() -> None:
    batches = make_batches(4)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    results = []
    for ds in (
        batches,
        DataLoader(TensorDataset(x, y), batch_size=8),
        NumpySlicesDataset((x.numpy(), y.numpy())).batch(8),
    ):
        model = make_model()
        model.train(2, ds)
        results.append(torch.cat([p.detach().flatten() for p in model.train_network.parameters()]))
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], results[2])


def test_sink_size_sets_steps_per_epoch_and_continues_data() -> None:
    seen: list[int] = []
    batches = make_batches(5)
    ids = {id(b): i for i, b in enumerate(batches)}
    cb = LambdaCallback(
        on_train_step_begin=lambda rc: seen.append(
            ids[id(rc.original_args().train_dataset_element)]
        )
    )
    make_model().train(3, batches, callbacks=[cb], dataset_sink_mode=True, sink_size=2)
    assert seen == [0, 1, 2, 3, 4, 0]


def test_loss_fn_none_network_returns_loss() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}

    torch.manual_seed(0)
    net = WithLoss()
    model = Model(net, None, torch.optim.SGD(net.parameters(), lr=0.5), device="cpu")
    losses: list[float] = []
    cb = LambdaCallback(on_train_epoch_end=lambda rc: losses.append(rc.original_args().loss))
    model.train(5, make_batches(4), callbacks=[cb])
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="eval_network"):
        Model(net, None, metrics={"accuracy"}).eval(make_batches(1))
    evaluated = Model(net, None, metrics={"accuracy"}, eval_network=net.net, device="cpu")
    assert 0.0 <= evaluated.eval(make_batches(2))["accuracy"] <= 1.0


def test_training_reduces_loss_and_eval_returns_metric_floats() -> None:
    model = make_model(metrics={"accuracy", "loss", "mae"} - {"mae"})
    before = model.eval(make_batches(4))
    model.train(20, make_batches(4))
    after = model.eval(make_batches(4))
    assert set(after) == {"accuracy", "loss"}
    assert all(isinstance(v, float) for v in after.values())
    assert after["loss"] < before["loss"]
    assert after["accuracy"] > 0.8


# -- cb_params -----------------------------------------------------------------------------
class Snapshot(Callback):
    def __init__(self) -> None:
        self.step: dict[str, Any] = {}
        self.epoch: dict[str, Any] = {}

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        grads = [q.grad for q in p.network.parameters()]
        self.step = {
            "net_outputs": p.net_outputs,
            "loss": p.loss,
            "rank_id": p.rank_id,
            "device_number": p.device_number,
            "lr": p.lr,
            "step_time": p.step_time,
            "grads_present": all(g is not None for g in grads),
            "accuracy": getattr(p, "accuracy", None),
            "batch": p.train_dataset_element,
        }

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        self.epoch = {
            "loss": p.loss,
            "accuracy": getattr(p, "accuracy", None),
            "eval_results": dict(p.eval_results),
            "train_results": dict(p.train_results),
            "mode": p.mode,
            "batch_num": p.batch_num,
            "cur_step_num": p.cur_step_num,
        }


def test_cb_params_fields_at_step_end_and_epoch_end() -> None:
    snap = Snapshot()
    batches = make_batches(3)
    make_model(metrics={"accuracy"}).fit(1, batches, make_batches(2), callbacks=[snap])
    s = snap.step
    assert isinstance(s["net_outputs"], stepwatch.Tensor)
    assert isinstance(s["net_outputs"].asnumpy(), np.ndarray)
    assert float(s["net_outputs"]) == s["loss"]
    assert s["net_outputs"] > 0 and not s["net_outputs"].requires_grad
    assert f"{s['net_outputs']}" == str(np.float32(s["loss"]))  # as a MindSpore tensor prints
    assert (s["rank_id"], s["device_number"], s["lr"]) == (0, 1, 0.1)
    assert s["step_time"] > 0 and s["grads_present"] and s["accuracy"] is None
    assert s["batch"] is batches[-1]
    e = snap.epoch
    assert e["mode"] == "train" and e["batch_num"] == 3 and e["cur_step_num"] == 3
    assert e["loss"] == pytest.approx(e["train_results"]["loss"])
    assert e["accuracy"] == e["train_results"]["accuracy"]
    assert set(e["eval_results"]) == {"accuracy", "eval_loss"}


def test_epoch_loss_is_mean_of_step_losses() -> None:
    step_losses: list[float] = []
    epoch_losses: list[float] = []
    cb = LambdaCallback(
        on_train_step_end=lambda rc: step_losses.append(rc.original_args().loss),
        on_train_epoch_end=lambda rc: epoch_losses.append(rc.original_args().loss),
    )
    make_model().train(1, make_batches(300, batch_size=2), callbacks=[cb])  # > one 256 chunk
    assert epoch_losses[0] == pytest.approx(sum(step_losses) / len(step_losses), rel=1e-5)


def test_train_metrics_accumulate_on_training_batches() -> None:
    acc: list[float] = []
    cb = LambdaCallback(on_train_epoch_end=lambda rc: acc.append(rc.original_args().accuracy))
    make_model(metrics={"accuracy"}, lr=0.5).train(15, make_batches(4), callbacks=[cb])
    assert len(acc) == 15 and acc[-1] > acc[0]


# -- no host sync on quiet steps -----------------------------------------------------------
class SyncCountingTensor(torch.Tensor):
    """A tensor that counts every read of its value on the host."""

    reads = 0

    def item(self) -> Any:  # type: ignore[override]
        SyncCountingTensor.reads += 1
        return super().item()

    def __float__(self) -> float:
        SyncCountingTensor.reads += 1
        return super().__float__()

    def __bool__(self) -> bool:
        SyncCountingTensor.reads += 1
        return super().__bool__()

    def tolist(self) -> Any:  # type: ignore[override]
        SyncCountingTensor.reads += 1
        return super().tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        SyncCountingTensor.reads += 1
        return super().numpy(*args, **kwargs)


def _counting_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, label).as_subclass(SyncCountingTensor)


@pytest.mark.parametrize("per_print_times", [0, 10])
def test_loop_reads_the_loss_only_at_epoch_end_and_print_steps(
    per_print_times: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # net_outputs hands callbacks a stepwatch.Tensor view of the loss: count its reads too.
    for name in ("item", "__float__", "__bool__", "tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            SyncCountingTensor.reads += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(stepwatch.Tensor, name, counted, raising=False)
    torch.manual_seed(0)
    net = _net()
    model = Model(net, _counting_loss, torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    callbacks = [
        stepwatch.LossMonitor(per_print_times),
        stepwatch.TimeMonitor(),
        stepwatch.History(),
    ]
    SyncCountingTensor.reads = 0
    model.train(2, make_batches(30, batch_size=2), callbacks=callbacks)
    prints = 60 // per_print_times if per_print_times else 0
    # One read per epoch for the epoch's mean loss, one for History's net_output, one per print.
    assert SyncCountingTensor.reads == 2 * 2 + prints
