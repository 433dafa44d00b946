"""FlopsUtilizationCollector: one step's FLOPs as torch's FlopCounterMode counts them, the MFU
printed as MindSpore prints it, and FLOPs, MFU and throughput in the run store."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import stepwatch
from stepwatch import FlopsUtilizationCollector, Model, NumpySlicesDataset, RunRecorder, Store
from stepwatch.train.callback.flops_utilization_collector import peak_flops

CPU_PEAK = 1e12  # far above what these tiny networks do on a CPU: an MFU in (0, 1)


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return net, torch.optim.SGD(net.parameters(), lr=0.05)


def _data(rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(rows, 32, generator=gen), torch.randint(0, 10, (rows,), generator=gen)


def _counted_step(batch: int) -> int:
    """FlopCounterMode's count of one training step of the MLP on ``batch`` rows."""
    net, opt = _mlp()
    x, y = _data(batch)
    with FlopCounterMode(display=False) as counter:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return int(counter.get_total_flops())


def test_the_step_is_counted_once_and_the_mfu_printed_and_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net, opt = _mlp()
    model = Model(net, nn.CrossEntropyLoss(), opt, device="cpu")
    collector = FlopsUtilizationCollector(4, computility=CPU_PEAK)
    recorder = RunRecorder(db=tmp_path / "runs.db", system_every=None)
    model.train(2, NumpySlicesDataset(_data()).batch(16), callbacks=[collector, recorder])
    expected = _counted_step(16)
    assert expected > 0
    assert collector.shard_flops == pytest.approx(expected, rel=0.02)
    assert collector.full_model_flops == collector.shard_flops  # one process
    lines = capsys.readouterr().out.splitlines()
    flops = collector.shard_flops
    assert lines[0] == (
        f"Full model flops is {flops}, Full hardware flops is {flops}, "
        f"Shard model flops is {flops}, Shard hardware flops is {flops}."
    )
    steps = [line for line in lines[1:] if line.startswith("Train per step time:")]
    assert len(steps) == 4  # steps 4, 8, 12 and 16 (8 steps an epoch)
    pattern = r"Train per step time: +\d+\.\d{3} ms mfu:(\d+\.\d\d)% hfu:(\d+\.\d\d)%"
    for line in steps:
        mfu, hfu = re.fullmatch(pattern, line).groups()  # type: ignore[union-attr]
        assert mfu == hfu
    assert collector.mfu is not None and 0 < collector.mfu <= 1
    with Store(tmp_path / "runs.db") as store:
        [run] = store.runs()
        at, stored = store.metrics(run.id, "flops_per_step")
        assert at.tolist() == [4, 8, 12, 16] and set(stored.tolist()) == {float(flops)}
        _, mfus = store.metrics(run.id, "mfu")
        assert all(0 < m <= 1 for m in mfus.tolist())
        assert mfus.tolist()[-1] == pytest.approx(collector.mfu)
        _, rates = store.metrics(run.id, "samples_per_second")
        assert len(rates) == 4 and all(r > 0 for r in rates.tolist())
        assert "tokens_per_second" not in store.keys(run.id)


def test_a_validation_pass_is_left_out_of_the_count(capsys: pytest.CaptureFixture[str]) -> None:
    # One step an epoch: the counted step's window holds the first epoch's validation.
    net, opt = _mlp()
    model = Model(net, nn.CrossEntropyLoss(), opt, metrics={"accuracy"}, device="cpu")
    collector = FlopsUtilizationCollector(1, computility=CPU_PEAK)
    train = NumpySlicesDataset(_data(16)).batch(16)
    valid = NumpySlicesDataset(_data(64)).batch(16)
    model.fit(3, train, valid, callbacks=[collector])
    assert collector.shard_flops == pytest.approx(_counted_step(16), rel=0.02)
    printed = capsys.readouterr().out
    assert printed.count("Train per step time:") == 1  # step 3; steps 1-2 were counted


def test_a_hand_loop_of_token_ids_stores_tokens_per_second(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(100, 16), nn.Flatten(), nn.Linear(16 * 12, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    collector = FlopsUtilizationCollector(2, computility=CPU_PEAK, full_flops=False)
    recorder = RunRecorder(db=tmp_path / "runs.db", system_every=None)
    gen = torch.Generator().manual_seed(0)
    with stepwatch.watch(net, opt, [collector, recorder], steps_per_epoch=6) as run:
        for _ in range(6):
            ids = torch.randint(0, 100, (4, 12), generator=gen)
            y = torch.randint(0, 2, (4,), generator=gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(ids), y)
            loss.backward()
            opt.step()
            run.step(loss, batch=(ids, y))
    assert collector.shard_flops > 0
    with Store(tmp_path / "runs.db") as store:
        [info] = store.runs()
        keys = set(store.keys(info.id))
        assert {"flops_per_step", "mfu", "tokens_per_second"} <= keys
        assert "samples_per_second" not in keys
        steps, rates = store.metrics(info.id, "tokens_per_second")
        assert steps.tolist() == [4, 6] and all(r > 0 for r in rates.tolist())


def test_a_hand_loop_that_passes_no_batch_is_told_how_to_get_the_throughput(
    tmp_path: Path,
) -> None:
    net, opt = _mlp()
    collector = FlopsUtilizationCollector(2, computility=CPU_PEAK)
    recorder = RunRecorder(db=tmp_path / "runs.db", system_every=None)
    x, y = _data(16)
    told = pytest.warns(UserWarning, match=r"run.step\(loss, batch=\(x, y\)\)")
    with told as seen, stepwatch.watch(net, opt, [collector, recorder], steps_per_epoch=6) as run:
        for _ in range(6):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            run.step(loss)
    assert sum("samples or tokens" in str(w.message) for w in seen) == 1  # once a run
    assert collector.mfu is not None and collector.throughput is None


def test_on_a_cpu_the_peak_must_be_given() -> None:
    assert peak_flops(torch.device("cpu")) is None
    net, opt = _mlp()
    model = Model(net, nn.CrossEntropyLoss(), opt, device="cpu")
    with pytest.raises(ValueError, match=r"needs 'computility'.*'cpu'"):
        model.train(1, NumpySlicesDataset(_data(32)).batch(16), [FlopsUtilizationCollector(1)])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"data_size": 0}, ValueError, "data_size"),
        ({"data_size": "10"}, TypeError, "data_size"),
        ({"data_size": 1, "computility": 0}, ValueError, "computility"),
        ({"data_size": 1, "computility": float("inf")}, ValueError, "a finite number"),
        ({"data_size": 1, "computility": "fast"}, TypeError, "computility"),
        ({"data_size": 1, "full_flops": 1}, TypeError, "full_flops"),
        ({"data_size": 1, "enable_ma_collector": True}, ValueError, "enable_ma_collector"),
    ],
)
def test_flops_collector_checks_its_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        FlopsUtilizationCollector(**kwargs)


def test_it_is_exported_as_the_other_callbacks_are() -> None:
    from stepwatch.train import FlopsUtilizationCollector as from_train
    from stepwatch.train.callback import FlopsUtilizationCollector as from_callback

    assert from_train is from_callback is stepwatch.FlopsUtilizationCollector
