"""What the loop works with: the Model's parts (:class:`Parts`), one ``train``/``fit`` call
(:class:`RunPlan`), the cb_params a run starts from, and the loss and metric folding both the
training epoch and the evaluation pass use."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed import local_rank
from .callback._callback import CallbackList, CallbackParams
from .step import StepOptions

__all__ = [
    "LOSS_CHUNK",
    "Parts",
    "RunPlan",
    "evaluate_metric",
    "fold_losses",
    "new_cb_params",
    "to_python",
]

# Step losses are folded into the epoch sum in chunks: one stack+sum per chunk keeps the
# per-step cost to a list append and never waits for the device.
LOSS_CHUNK = 256


@dataclass
class Parts:
    """What the loop trains and evaluates with (a ``Model`` hands over its own; a run engine
    driven by another trainer, that trainer's network - a torch module, or the host's own
    network object - or None)."""

    network: Any
    loss_fn: Any
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    metrics: dict[str, Any]
    eval_network: Any
    # Training-batch metrics accumulate in their own copies so validation never mixes in.
    train_metrics: dict[str, Any] = field(default_factory=dict)
    step: StepOptions = field(default_factory=StepOptions)
    # In a distributed run: the DistributedDataParallel wrapper that does forward and backward.
    ddp: Any = None
    # MindSpore's eval_indexes: where the loss, prediction and label are in the eval network's
    # outputs (it then takes the whole batch); None: eval_network maps data to predictions.
    eval_indexes: tuple[int, int, int] | None = None

    @property
    def lr_scheduler(self) -> Any:
        return self.step.lr_scheduler

    @property
    def loss_scaler(self) -> Any:
        return self.step.scaler

    @property
    def train_network(self) -> Any:
        return self.network


@dataclass
class RunPlan:
    """One ``train``/``fit`` call, its arguments checked."""

    epoch: int
    train_dataset: Iterable[Any]
    callbacks: CallbackList
    batch_num: int
    valid_dataset: Iterable[Any] | None = None
    valid_frequency: int | list[int] = 1
    dataset_sink_mode: bool = False
    sink_size: int = -1
    initial_epoch: int = 0
    resume_from: Any = None


def fold_losses(total: torch.Tensor | None, pending: list[torch.Tensor]) -> torch.Tensor | None:
    if not pending:
        return total
    chunk = torch.stack(pending).float().sum()
    pending.clear()
    return chunk if total is None else total + chunk


def to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    return value


def evaluate_metric(name: str, metric: Any) -> Any:
    """``metric.eval()`` as a Python value; an error names the metric, as a callback's does."""
    try:
        return to_python(metric.eval())
    except BaseException as exc:
        exc.add_note(f"(raised in metric {name!r}, {type(metric).__name__}.eval)")
        raise


def new_cb_params(parts: Parts, cb_list: CallbackList, rank: int, world: int) -> CallbackParams:
    """The cb_params every run starts from (mode ``'eval'``; a training run switches it)."""
    return CallbackParams(
        train_network=parts.network,
        network=parts.network,
        eval_network=parts.eval_network,
        loss_fn=parts.loss_fn,
        optimizer=parts.optimizer,
        device=parts.device,
        rank_id=rank,
        local_rank=local_rank() if world > 1 else 0,
        device_number=world,
        parallel_mode="data_parallel" if world > 1 else "stand_alone",
        list_callback=cb_list,
        mode="eval",
        cur_step_num=0,
        cur_epoch_num=0,
        last_save_ckpt_step=None,
        latest_ckpt_file=None,
        step_time=0.0,
        optimizer_stepped=True,
        grad_norm=None,
        lr_scheduler=parts.lr_scheduler,
        loss_scaler=parts.loss_scaler,
    )
