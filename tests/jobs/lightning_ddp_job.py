"""A Lightning fit on two CPU processes (``ddp_spawn``, gloo) with the stepwatch bridge; rank 1's
loss turns NaN at one step. Run by tests/test_integration_lightning.py as a subprocess.

    python lightning_ddp_job.py DB NAN_STEP
"""

from __future__ import annotations

import math
import sys
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stepwatch import AnomalyMonitor, LossMonitor, RunRecorder
from stepwatch.integrations.lightning import StepwatchCallback

NAN_STEP = int(sys.argv[2]) if len(sys.argv) > 2 else 20


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == NAN_STEP and self.global_rank == 1:
            loss = loss * math.nan  # rank 1 alone: every rank must stop at the same step
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x.sum(1, keepdim=True)
    watch = StepwatchCallback(
        [RunRecorder(db=sys.argv[1], run_name="ddp"),
         AnomalyMonitor(action={"nonfinite": "stop"}), LossMonitor(8)]
    )  # fmt: skip
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        callbacks=[watch],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=8))


if __name__ == "__main__":
    main()
