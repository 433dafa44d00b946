"""One rank of the two-process FSDP2 runs of tests/test_sharded.py (gloo on the CPU).

Run as ``python tests/_fsdp_model_worker.py SCENARIO OUT_DIR`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set; each rank writes what it saw to ``OUT_DIR/<scenario>-rank<r>.json``
and weights to ``OUT_DIR/<name>-rank<r>.pt``:

* ``train``: the same 16-64-1 MLP trained by ``Model`` unsharded (DDP), sharded whole and
  sharded per layer (plain steps and clipped ones), evaluated on an uneven split; a run with
  Adam trained without a break; the same run with ModelCheckpoint, BackupAndRestore,
  OnRequestExit (a SIGTERM every rank sends itself) and a snapshot; rollback copies restored.
* ``resume``: new processes resume that run three ways (``resume_from`` a mid-epoch
  checkpoint, BackupAndRestore's backup, OnRequestExit's file) and load a DDP run's
  checkpoint into a sharded network.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PG_TIMEOUT = datetime.timedelta(seconds=30)
EPOCHS = 4  # the resumed runs' length
STOP_AT = 11  # the step OnRequestExit stops the checkpointed run at (epoch 2 of 8-step epochs)


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def make_data(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen)
    return x, x @ w * 0.3


def shard(net: nn.Module, per_layer: bool, hybrid: bool = False) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    # HSDP: replicated over the first dimension, sharded over the second.
    if hybrid:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if per_layer:
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def local_shards(net: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards (a DTensor's local tensor), copied."""
    out = {}
    for k, v in net.state_dict().items():
        local = v.to_local() if hasattr(v, "to_local") else v
        out[k] = local.detach().clone()
    return out


def full_weights(net: nn.Module) -> dict[str, torch.Tensor]:
    """The whole tensors (a collective for a sharded network: every rank calls it)."""
    out = {}
    for k, v in net.state_dict().items():
        whole = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = whole.detach().clone()
    return out


def optimizer_shards(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, per_param in opt.state_dict()["state"].items():
        for k, v in per_param.items():
            local = v.to_local() if hasattr(v, "to_local") else v
            out[f"{i}.{k}"] = local.detach().clone()
    return out


def adam_model(per_layer: bool = True) -> Any:
    from stepwatch import Model

    net = shard(make_mlp(0), per_layer)
    return Model(net, nn.MSELoss(), torch.optim.Adam(net.parameters(), lr=0.01), device="cpu")


def adam_data() -> Any:
    from stepwatch import NumpySlicesDataset

    x, y = make_data(128)
    return NumpySlicesDataset((x, y), shuffle=True).batch(8)  # 8 steps per epoch on each rank


def scenario_train(out: Path, rank: int) -> dict[str, Any]:
    from stepwatch import (
        BackupAndRestore,
        Callback,
        CheckpointConfig,
        Model,
        ModelCheckpoint,
        NumpySlicesDataset,
        OnRequestExit,
        save_checkpoint,
    )
    from stepwatch.monitor._detector import Alert
    from stepwatch.train.callback._anomaly_actions import write_snapshot
    from stepwatch.train.state import TrainingState
    from stepwatch.view.host import TorchState

    result: dict[str, Any] = {}
    x, y = make_data(256)
    vx, vy = make_data(9, seed=2)  # 5 rows on rank 0 (2 batches of 4), 4 on rank 1 (1 batch)

    class Norms(Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_train_step_end(self, run_context: Any) -> None:
            norm = run_context.original_args().grad_norm
            if norm is not None:
                self.norms.append(float(norm))

    # 1. The same network and data: DDP, sharded whole, per layer, HSDP; plain steps, clipped
    # ones and accumulated ones.
    kinds = ("ddp", "whole", "layer", "hsdp", "ddp_clip", "layer_clip", "ddp_acc", "layer_acc")
    for kind in kinds:
        net = make_mlp(0)
        if not kind.startswith("ddp"):
            net = shard(net, per_layer=kind.startswith("layer"), hybrid=kind == "hsdp")
        options: dict[str, Any] = {}
        if kind.endswith("clip"):
            options["clip_grad_norm"] = 0.5
        if kind.endswith("acc"):
            options["accumulate_grad_batches"] = 2
        model = Model(
            net,
            nn.MSELoss(),
            torch.optim.SGD(net.parameters(), lr=0.05),
            metrics={"mae"},
            device="cpu",
            **options,
        )
        norms = Norms()
        history = model.train(2, NumpySlicesDataset((x, y)).batch(8), callbacks=[norms])
        result[kind] = {
            "loss": history.history["loss"],
            "eval": model.eval(NumpySlicesDataset((vx, vy)).batch(4)),
            "norms": norms.norms[:5],
            "ddp": model._parts.ddp is not None,
        }
        if kind == "ddp":
            ddp_weights = full_weights(net)
            if rank == 0:
                save_checkpoint(model, out / "ddp.pt")  # a plain checkpoint, one file
            torch.save(ddp_weights, out / f"ddp-rank{rank}.pt")
        if kind == "layer":
            # MindSpore's eval network (the whole batch in, (loss, prediction, label) out)
            # around the sharded one, on the same uneven shares.
            class EvalNet(nn.Module):
                def __init__(self, inner: nn.Module) -> None:
                    super().__init__()
                    self.inner = inner

                def forward(self, data: torch.Tensor, label: torch.Tensor) -> Any:
                    prediction = self.inner(data)
                    return nn.functional.mse_loss(prediction, label), prediction, label

            indexed = Model(
                net,
                nn.MSELoss(),
                model.optimizer,
                {"mae"},
                EvalNet(net),
                [0, 1, 2],
                device="cpu",
            )
            result["layer_indexed_eval"] = indexed.eval(NumpySlicesDataset((vx, vy)).batch(4))

    # A tensor-parallel layout: Model cannot split the data for it, and says so.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    net = make_mlp(0)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(net, init_device_mesh("cpu", (2,)), plan)
    model = Model(net, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.05), device="cpu")
    try:
        model.train(1, NumpySlicesDataset((x, y)).batch(8))
    except ValueError as exc:
        result["tp_error"] = str(exc)

    # 2. An Adam run without a break: the reference for every resume.
    model = adam_model()
    model.train(EPOCHS, adam_data())
    torch.save(
        {"local": local_shards(model.train_network), "full": full_weights(model.train_network)},
        out / f"uninterrupted-rank{rank}.pt",
    )

    # 3. Rollback copies: each rank copies its shards and puts them back, as many times.
    state = TorchState(TrainingState(model.train_network, model.optimizer))
    saved = state.capture()
    before = local_shards(model.train_network), optimizer_shards(model.optimizer)
    model.train(1, adam_data())
    changed = local_shards(model.train_network)
    state.restore(saved)
    after = local_shards(model.train_network), optimizer_shards(model.optimizer)
    torch.manual_seed(3)  # the same data order for both
    model.train(1, adam_data())
    first = local_shards(model.train_network)
    state.restore(saved)
    torch.manual_seed(3)
    model.train(1, adam_data())
    again = local_shards(model.train_network)
    result["rollback"] = {
        "changed": any(not torch.equal(changed[k], before[0][k]) for k in changed),
        "weights_back": all(torch.equal(after[0][k], before[0][k]) for k in before[0]),
        "optimizer_back": before[1].keys() == after[1].keys()
        and all(torch.equal(after[1][k], before[1][k]) for k in before[1]),
        "repeatable": all(torch.equal(first[k], again[k]) for k in first),
    }

    # 4. The same Adam run, checkpointed, stopped by a SIGTERM at step STOP_AT.
    class Signal(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            p = run_context.original_args()
            if p.cur_step_num == 7:
                result["snapshot_weights"] = {
                    k: v.tolist() for k, v in full_weights(p.train_network).items()
                }
                alert = Alert(7, 1, "spike", "a test snapshot", 1.0)
                write_snapshot(out / "snap", alert, p, {"step": [7]})
            if p.cur_step_num == STOP_AT:
                os.kill(os.getpid(), signal.SIGTERM)  # every rank, at the same step

    model = adam_model()
    checkpoint = ModelCheckpoint(
        "fsdp", out / "ck", CheckpointConfig(save_checkpoint_steps=5, keep_checkpoint_max=2)
    )
    exit_cb = OnRequestExit(directory=out / "exit")
    try:
        model.train(
            EPOCHS,
            adam_data(),
            callbacks=[Signal(), checkpoint, BackupAndRestore(out / "backup", 3), exit_cb],
        )
    finally:
        exit_cb.restore_handlers()
    result["exit_checkpoint"] = str(exit_cb.checkpoint_path)
    return result


def scenario_resume(out: Path, rank: int) -> dict[str, Any]:
    from stepwatch import BackupAndRestore, load_checkpoint

    result: dict[str, Any] = {}
    runs = {
        "checkpoint": {"resume_from": out / "ck" / "fsdp-2_2.pt"},  # step 10, mid-epoch
        "backup": {"callbacks": [BackupAndRestore(out / "backup")]},
        "exit": {"resume_from": out / "exit" / "Net.pt"},
    }
    for name, kwargs in runs.items():
        model = adam_model()
        model.train(EPOCHS, adam_data(), **kwargs)
        torch.save(
            {"local": local_shards(model.train_network), "full": full_weights(model.train_network)},
            out / f"resumed-{name}-rank{rank}.pt",
        )
    # A DDP run's checkpoint (one file of whole tensors) into a sharded network.
    model = adam_model(per_layer=False)
    load_checkpoint(out / "ddp.pt", model.train_network)
    torch.save(full_weights(model.train_network), out / f"ddp-into-sharded-rank{rank}.pt")
    return result


def main() -> int:
    from stepwatch.distributed import shutdown

    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    try:
        scenarios = {"train": scenario_train, "resume": scenario_resume}
        result = scenarios[scenario](out, rank)
        (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(result))
        shutdown()  # every rank leaves together (a barrier, then the teardown)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
