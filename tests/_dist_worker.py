"""One rank of the two-process runs of tests/test_distributed.py (gloo on the CPU).

Run as ``python tests/_dist_worker.py SCENARIO OUT_DIR`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set; each rank writes what it saw to ``OUT_DIR/rank<r>.json`` (and
its final weights to ``OUT_DIR/<name>-rank<r>.pt``). The data and network builders are shared
with the test, which runs the single-process reference runs itself.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Short enough that a test never waits long on a collective that cannot complete.
PG_TIMEOUT = datetime.timedelta(seconds=30)


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def make_data(rows: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=gen)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()).clamp(max=2)
    return x, y


def make_model(seed: int = 0, lr: float = 0.1, **kwargs: Any) -> Any:
    from stepwatch import Model

    net = make_net(seed)
    return Model(
        net,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(net.parameters(), lr=lr),
        metrics={"accuracy", "loss"},
        device="cpu",
        **kwargs,
    )


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.train_network.state_dict().items()}


def _alerts(monitor: Any) -> list[list[Any]]:
    return [[a.step, a.kind, a.message] for a in monitor.alerts]


def scenario_main(out: Path, rank: int) -> dict[str, Any]:
    from stepwatch import (
        Callback,
        CheckpointConfig,
        DistributedMonitor,
        EarlyStopping,
        LossMonitor,
        ModelCheckpoint,
        NumpySlicesDataset,
        RunRecorder,
        TimeMonitor,
    )

    result: dict[str, Any] = {}

    # 1. Training: 64 rows, 4 per rank and step (a global batch of 8): 8 steps per epoch.
    class Seen(Callback):
        def __init__(self) -> None:
            self.rows: list[float] = []
            self.fields: dict[str, Any] = {}

        def on_train_step_begin(self, run_context: Any) -> None:
            p = run_context.cb_params
            self.rows.extend(p.train_dataset_element[0][:, 0].tolist())
            self.fields = {
                "batch_num": p.batch_num,
                "local_rank": p.local_rank,
                "parallel_mode": p.parallel_mode,
                "device_number": p.device_number,
            }

    x, y = make_data()
    model = make_model()
    seen = Seen()
    monitor = DistributedMonitor(every_n_steps=4)
    recorder = RunRecorder(db=out / "runs.db", run_name="dist")
    train = NumpySlicesDataset((x, y), shuffle=False).batch(4)
    every_rank = [LossMonitor(8, all_ranks=True), TimeMonitor(all_ranks=True)]
    history = model.train(
        2, train, callbacks=[LossMonitor(4), recorder, monitor, seen, *every_rank]
    )
    xv, yv = make_data(30, seed=1)
    result["main"] = {
        "history": history.history,
        "rows": seen.rows,
        "fields": seen.fields,
        "alerts": _alerts(monitor),
        "last": monitor.last,
        "eval": model.eval(NumpySlicesDataset((xv, yv)).batch(5)),
        "run_id": recorder.run_id,
    }
    torch.save(_weights(model), out / f"main-rank{rank}.pt")

    # Gradient accumulation: the batches that do not step skip the all-reduce (no_sync).
    accumulating = make_model(accumulate_grad_batches=2)
    accumulating.train(1, train)
    torch.save(_weights(accumulating), out / f"accumulate-rank{rank}.pt")

    # 2. A DataLoader without a DistributedSampler: one warning per process.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_model().train(1, loader)
        make_model().train(1, loader)
    result["loader_warnings"] = sum("DistributedSampler" in str(w.message) for w in caught)

    # 3. EarlyStopping decides on the cross-rank epoch loss: the same epoch on every rank.
    torch.manual_seed(rank)  # the ranks' own generators differ; the shuffle must not care
    stopper = EarlyStopping(monitor="loss", min_delta=0.02, patience=1)
    shuffled = NumpySlicesDataset((x, y), shuffle=True).batch(4)
    history = make_model(lr=0.05).train(30, shuffled, callbacks=[stopper])
    result["early"] = {"stopped_epoch": stopper.stopped_epoch, "history": history.history}

    # 4. Rank 0 saves checkpoints; both ranks resume from its file.
    ckpt = out / "ckpt"
    saver = ModelCheckpoint("ck", ckpt, CheckpointConfig(save_checkpoint_steps=8))
    full = make_model()
    torch.manual_seed(0)
    full.train(4, shuffled, callbacks=[saver])
    torch.save(_weights(full), out / f"full-rank{rank}.pt")
    resumed = make_model(seed=5)
    again = ModelCheckpoint("ck", ckpt, CheckpointConfig(save_checkpoint_steps=8))
    resumed.train(4, shuffled, callbacks=[again], resume_from=ckpt / "ck-2_8.pt")
    torch.save(_weights(resumed), out / f"resumed-rank{rank}.pt")
    result["ckpt"] = {"latest": saver.latest_ckpt_file_name}

    # 5. A straggler (rank 1 sleeps before each step) and a replica knocked out of step.
    class Slow(Callback):
        def on_train_step_begin(self, run_context: Any) -> None:
            if rank == 1:
                time.sleep(0.04)

        def on_train_step_end(self, run_context: Any) -> None:
            p = run_context.cb_params
            if rank == 1 and p.cur_step_num == 2:
                with torch.no_grad():
                    next(p.network.parameters()).add_(0.5)

    monitor = DistributedMonitor(every_n_steps=4)
    recorder = RunRecorder(db=out / "alerts.db", run_name="alerts")
    make_model().train(1, train, callbacks=[Slow(), monitor, recorder])
    result["alerts"] = _alerts(monitor)
    result["alerts_run_id"] = recorder.run_id
    return result


def scenario_raise(out: Path, rank: int) -> dict[str, Any]:
    from stepwatch import Callback, NumpySlicesDataset

    class Boom(Callback):
        def on_train_step_begin(self, run_context: Any) -> None:
            if rank == 1 and run_context.cb_params.cur_step_num == 3:
                (out / "raised").write_text(str(time.time()))
                raise RuntimeError("rank 1 fails on purpose")

    x, y = make_data()
    make_model().train(1000, NumpySlicesDataset((x, y)).batch(4), callbacks=[Boom()])
    return {}


def scenario_anomaly(out: Path, rank: int) -> dict[str, Any]:
    """A NaN on rank 1 only: AnomalyMonitor sees the cross-rank mean and stops every rank."""
    from stepwatch import AnomalyMonitor, Callback, NumpySlicesDataset

    ended: dict[str, Any] = {}

    class Poison(Callback):
        def on_train_step_begin(self, run_context: Any) -> None:
            p = run_context.cb_params
            if rank == 1 and p.cur_step_num == 30:
                net = getattr(p.train_network, "module", p.train_network)
                with torch.no_grad():
                    net[0].weight[0, 0] = float("nan")

    class End(Callback):
        def on_train_end(self, run_context: Any) -> None:
            ended.update(kind=run_context.stop_kind, step=run_context.cb_params.cur_step_num)

    x, y = make_data(256)
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the epoch's NaN loss warns
        make_model().train(
            20, NumpySlicesDataset((x, y)).batch(4), callbacks=[Poison(), monitor, End()]
        )
    return {"alerts": _alerts(monitor), **ended}


def scenario_frozen(out: Path, rank: int) -> dict[str, Any]:
    """Rank 1 stops itself (SIGSTOP) at step 5; the test resumes it once rank 0 has said so."""
    import signal

    from stepwatch import Callback, DistributedMonitor, NumpySlicesDataset, RunRecorder

    class Freeze(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if rank == 1 and run_context.cb_params.cur_step_num == 5:
                os.kill(os.getpid(), signal.SIGSTOP)

    x, y = make_data(64)
    monitor = DistributedMonitor(every_n_steps=1000, frozen_seconds=1.0)
    recorder = RunRecorder(db=out / "frozen.db", flush_seconds=0.1)
    make_model().train(
        1, NumpySlicesDataset((x, y)).batch(4), callbacks=[Freeze(), monitor, recorder]
    )
    return {"alerts": _alerts(monitor)}


def make_sharded(mesh: Any = None, seed: int = 0) -> nn.Module:
    """A 16 -> 64 -> 1 MLP sharded per layer with FSDP2 (``mesh``: a 2-D mesh for HSDP)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _sharded_loop(
    net: nn.Module, rank: int, callbacks: list[Any], steps: int, hook: Any, fetch: Any = None
) -> None:
    """``steps`` SGD steps of ``net`` on this rank's batches, watched by ``callbacks``;
    ``fetch(step)`` runs as each batch is made, ``hook(step)`` after each optimizer step."""
    import stepwatch

    gen = torch.Generator().manual_seed(100 + rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with stepwatch.watch(net, opt, callbacks, steps_per_epoch=steps) as run:
        for step in range(1, steps + 1):
            if fetch is not None:
                fetch(step)
            x = torch.randn(8, 16, generator=gen)
            y = x[:, :1] * 0.5
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            hook(step)
            run.step(loss)


def scenario_sharded(out: Path, rank: int) -> dict[str, Any]:
    """DistributedMonitor on FSDP2-sharded networks: a healthy run (no alert: the shards
    differ by nature), then HSDP (replicate x shard) with rank 1's copy knocked out of step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    from stepwatch import DistributedMonitor, FlopsUtilizationCollector, RunRecorder

    result: dict[str, Any] = {}
    # (Stragglers are not what this is about: a loaded machine's timings make none.)
    monitor = DistributedMonitor(every_n_steps=4, straggler_seconds=60, frozen_seconds=None)
    recorder = RunRecorder(db=out / "sharded.db", run_name="sharded")
    flops = FlopsUtilizationCollector(4, computility=1e12)
    net = make_sharded()
    _sharded_loop(net, rank, [monitor, recorder, flops], 16, lambda step: None)
    # The same step, counted by hand: one more step of the sharded network.
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x = torch.randn(8, 16)
    with FlopCounterMode(display=False) as counter:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(x), x[:, :1] * 0.5).backward()
        opt.step()
    result["fsdp"] = {
        "alerts": _alerts(monitor),
        "last": monitor.last,
        "flops": [flops.shard_flops, flops.full_model_flops, counter.get_total_flops()],
        "mfu": flops.mfu,
    }

    def knock(step: int) -> None:
        if rank == 1 and step == 2:
            with torch.no_grad():
                next(net.parameters()).to_local().add_(0.5)

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    net = make_sharded(mesh)
    healthy = DistributedMonitor(every_n_steps=4, straggler_seconds=60, frozen_seconds=None)
    _sharded_loop(make_sharded(mesh), rank, [healthy], 8, lambda step: None)
    knocked = DistributedMonitor(every_n_steps=4, straggler_seconds=60, frozen_seconds=None)
    _sharded_loop(net, rank, [knocked], 8, knock)
    result["hsdp"] = {"healthy": _alerts(healthy), "knocked": _alerts(knocked)}

    # A hand loop whose rank 1 waits 40 ms for each batch: its data wait is told from its
    # step's, and it is the straggler, although the collectives make every rank's step as long
    # (rank 0 waits for it in its forward's all-gather: not work of its own).
    def slow_data(step: int) -> None:
        if rank == 1:
            time.sleep(0.04)

    slow = DistributedMonitor(every_n_steps=4, frozen_seconds=None)
    _sharded_loop(make_sharded(), rank, [slow], 8, lambda step: None, fetch=slow_data)
    result["slow_data"] = {"alerts": _alerts(slow), "last": slow.last}

    # Model on a network sharded as one unit over an HSDP mesh that shards (1 x 2): Model's
    # first-batch check runs a forward, after which FSDP2 leaves the root's parameters gathered
    # (and frees them at the next forward): the callbacks must see the sharded ones.
    from torch.distributed.fsdp import fully_shard

    from stepwatch import Callback, Model, NumpySlicesDataset

    class Kinds(Callback):
        def on_train_begin(self, run_context: Any) -> None:
            params = run_context.cb_params.network.parameters()
            self.kinds = sorted({type(p).__name__ for p in params})

    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    fully_shard(whole, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    model = Model(whole, nn.CrossEntropyLoss(), torch.optim.SGD(whole.parameters(), lr=0.1))
    kinds, unit = Kinds(), DistributedMonitor(every_n_steps=2, frozen_seconds=None)
    model.train(1, NumpySlicesDataset(make_data(), shuffle=False).batch(8), callbacks=[kinds, unit])
    result["one_unit"] = {"kinds": kinds.kinds, "alerts": _alerts(unit), "last": unit.last}
    return result


def main() -> int:
    from stepwatch.distributed import shutdown

    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    try:
        scenarios = {
            "main": scenario_main,
            "raise": scenario_raise,
            "anomaly": scenario_anomaly,
            "frozen": scenario_frozen,
            "sharded": scenario_sharded,
        }
        result = scenarios[scenario](out, rank)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        shutdown()  # every rank leaves together (a barrier, then the teardown)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
