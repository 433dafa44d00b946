"""One rank of a two-process Hugging Face Trainer asked to shard with FSDP2 on the CPU, with
the stepwatch bridge. Run by tests/test_sharded_bridges.py, each rank started by the test with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.

    python transformers_fsdp_job.py OUT_DIR NAN_STEP

Accelerate shards only on GPUs: on the CPU it drops ``fsdp=...`` and the Trainer trains under
DDP. Rank 1's loss turns NaN at optimizer step NAN_STEP; each rank writes what it saw to
``OUT_DIR/rank<r>.json``. Then a model sharded beforehand (``fully_shard``) is handed to a
Trainer, and the bridge's ``attach`` is asked to run in it.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

from stepwatch import AnomalyMonitor, Callback, LossMonitor, RunRecorder
from stepwatch.integrations.transformers import StepwatchCallback

OUT = Path(sys.argv[1])
NAN_STEP = int(sys.argv[2])
RANK = int(os.environ["RANK"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.forwards = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.layers(x)
        loss = nn.functional.mse_loss(out, labels)
        if self.training:
            self.forwards += 1
            if self.forwards == NAN_STEP and RANK == 1:
                loss = loss * math.nan  # rank 1 alone: every rank must stop at the same step
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(128, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Seen(Callback):
    """What the stepwatch callbacks see: the steps, and the run view's controls."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.grads = self.restores = None

    def on_train_begin(self, run_context: Any) -> None:
        view = run_context.original_args().run_view
        self.grads, self.restores = view.grads, view.state is not None

    def on_train_step_end(self, run_context: Any) -> None:
        self.steps.append(run_context.original_args().cur_step_num)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _args(**more: Any) -> TrainingArguments:
    return TrainingArguments(
        str(OUT / "out"), per_device_train_batch_size=8, num_train_epochs=2, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        seed=0, learning_rate=0.01, dataloader_num_workers=0, ddp_timeout=60, **more,
    )  # fmt: skip


def main() -> None:
    warnings.simplefilter("ignore")
    caught = Warnings()
    logging.getLogger("stepwatch").addHandler(caught)
    result: dict[str, Any] = {}
    # 1. fsdp=... on the CPU: accelerate drops it, the Trainer trains under DDP.
    torch.manual_seed(0)
    seen, monitor = Seen(), AnomalyMonitor(action={"nonfinite": "stop"})
    watch = StepwatchCallback(
        [RunRecorder(db=OUT / "runs.db", run_name="fsdp-args"), monitor, LossMonitor(4), seen]
    )
    args = _args(fsdp=True, fsdp_config={"fsdp_version": 2})
    trainer = Trainer(model=Net(), args=args, train_dataset=Data())
    watch.attach(trainer)
    trainer.train()
    result["fsdp_args"] = {
        "fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "grads": seen.grads,
        "restores": seen.restores,
        "steps": seen.steps,
        "stop_reason": watch.stop_reason,
        "alerts": [[a.step, a.kind] for a in monitor.alerts],
        "global_step": trainer.state.global_step,
        "warnings": caught.messages,
    }
    # 2. A model sharded beforehand, handed to a Trainer that does not shard.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    for layer in net.layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    trainer = Trainer(model=net, args=_args(), train_dataset=Data())
    try:
        StepwatchCallback([]).attach(trainer)
        result["preshard"] = None
    except ValueError as exc:
        result["preshard"] = str(exc)
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))
    dist.barrier(timeout=datetime.timedelta(seconds=30))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
