"""One rank of Lightning fits sharded with FSDP2 on two CPU processes (ModelParallelStrategy,
gloo), with the stepwatch bridge. Run by tests/test_sharded_bridges.py, each rank started by
the test with LOCAL_RANK, NODE_RANK, MASTER_ADDR and MASTER_PORT set (Lightning then starts no
process of its own).

    python lightning_fsdp_job.py OUT_DIR

Three fits, each rank writing what it saw to ``OUT_DIR/rank<r>.json``: a healthy one whose
gradient norms are checked against ``clip_grad_norm_`` over the shards; one where rank 1's
loss turns NaN (the run stops); one where it does and AnomalyMonitor rolls back.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stepwatch import AnomalyMonitor, Callback, LossMonitor, RunRecorder
from stepwatch.integrations.lightning import StepwatchCallback

OUT = Path(sys.argv[1])
RANK = int(os.environ["LOCAL_RANK"])


class Net(pl.LightningModule):
    """A small regression net, sharded per layer and as a whole in configure_model.
    ``nan_step``: the Lightning step at which rank 1's loss turns NaN (-1: never)."""

    def __init__(self, nan_step: int = -1) -> None:
        super().__init__()
        self.nan_step = nan_step
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.nan_step and self.global_rank == 1:
            loss = loss * math.nan  # rank 1 alone: every rank must act at the same step
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


class Seen(Callback):
    """The run view's controls, and at each step the gradient norm of the full model as
    clip_grad_norm_ computes it over this rank's shards (with its collective)."""

    def __init__(self) -> None:
        self.grads = self.restores = None
        self.steps: list[int] = []
        self.norms: dict[int, float] = {}

    def on_train_begin(self, run_context: Any) -> None:
        view = run_context.original_args().run_view
        self.grads, self.restores = view.grads, view.state is not None

    def on_train_step_end(self, run_context: Any) -> None:
        p = run_context.original_args()
        self.steps.append(p.cur_step_num)
        grads = [q for q in p.train_network.parameters() if q.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(grads, math.inf)
        self.norms[p.cur_step_num] = float(
            total.full_tensor() if hasattr(total, "full_tensor") else total
        )


class Shards(pl.Callback):
    """This rank's parameter and optimizer-state shards as each batch starts, by the number of
    optimizer steps done."""

    def __init__(self) -> None:
        self.at: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        opt = trainer.optimizers[0]
        state = [_local(v) for s in opt.state.values() for v in s.values() if v.dim()]
        self.at[trainer.global_step] = [_local(q) for q in module.parameters()] + state


def _fit(name: str, nan_step: int, callbacks: list[Any], extra: Any = ()) -> Any:
    torch.manual_seed(0)
    net = Net(nan_step)
    x = torch.randn(256, 4)
    y = x.sum(1, keepdim=True)
    watch = StepwatchCallback([RunRecorder(db=OUT / f"{name}.db", run_name=name), *callbacks])
    # Both processes shard one model (the default would give them one tensor-parallel group).
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=2, strategy=strategy,
        callbacks=[watch, *extra], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(net, DataLoader(TensorDataset(x, y), batch_size=8))
    return watch, trainer


def main() -> None:
    warnings.simplefilter("ignore")
    result: dict[str, Any] = {}
    # 1. Healthy: the gradients are measured, and their norm is the full model's.
    seen = Seen()
    monitor = AnomalyMonitor(grad_every_n_steps=4)
    watch, trainer = _fit("healthy", -1, [monitor, seen])
    result["healthy"] = {
        "grads": seen.grads, "restores": seen.restores, "steps": seen.steps,
        "reference": seen.norms, "alerts": [[a.step, a.kind] for a in monitor.alerts],
        "measured": dict(zip(monitor._history["grad_step"], monitor._history["grad_norm"])),
        "param_type": type(next(trainer.lightning_module.parameters())).__name__,
    }  # fmt: skip
    # 2. A NaN on rank 1 at Lightning's step 20 (stepwatch's step 21): every rank stops.
    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    seen = Seen()
    watch, trainer = _fit("nan", 20, [monitor, LossMonitor(8), seen])
    result["nan"] = {
        "steps": seen.steps, "stop_reason": watch.stop_reason, "global_step": trainer.global_step,
        "alerts": [[a.step, a.kind] for a in monitor.alerts],
    }  # fmt: skip
    # 3. The same NaN, rolled back: each rank restores its own shards.
    monitor = AnomalyMonitor(action={"nonfinite": "rollback"}, rollback_every=4)
    shards = Shards()
    watch, trainer = _fit("rollback", 20, [monitor], extra=[shards])
    run = watch.run
    rollbacks = list(run.view.rollbacks) if run is not None else []
    params = list(trainer.lightning_module.parameters())
    same = None
    if rollbacks:
        ((at, now),) = rollbacks
        kept, restored = shards.at[at], shards.at[now]
        same = len(kept) == len(restored) and all(torch.equal(a, b) for a, b in zip(kept, restored))
    result["rollback"] = {
        "rollbacks": rollbacks, "restored_equal_kept": same, "outcomes": monitor.outcomes,
        "global_step": trainer.global_step, "stop_reason": watch.stop_reason,
        "final_finite": all(bool(torch.isfinite(_local(q)).all()) for q in params),
        "shard_sizes": [int(_local(q).numel()) for q in params],
    }  # fmt: skip
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
