"""stepwatch's callbacks inside Lightning's ``Trainer.fit``.

:class:`StepwatchCallback` is a ``lightning.pytorch.Callback``. Give it stepwatch callbacks
(LossMonitor, AnomalyMonitor, RunRecorder, ProgressBar, your own MindSpore-style ``Callback``)
and put it in the Trainer's callbacks: they see the cb_params and run view they see under
``stepwatch.Model``, and their actions reach the Trainer::

    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from stepwatch import AnomalyMonitor, LossMonitor, RunRecorder
    from stepwatch.integrations.lightning import StepwatchCallback


    class Net(pl.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


    x = torch.randn(640, 8)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    watch = StepwatchCallback([LossMonitor(10), AnomalyMonitor(), RunRecorder(db="runs.db")])
    trainer = pl.Trainer(max_epochs=3, callbacks=[watch], accelerator="cpu", logger=False)
    trainer.fit(Net(), loader, loader)
    print(watch.stop_reason)  # None: nothing stopped this run

What the bridge reads from Lightning:

- **The loss**, as the Trainer holds it: the training_step's loss that Lightning hands to
  ``on_train_batch_end`` (a detached copy, on the device). It goes into the run's loss tap as
  it is, so nothing waits for the device on quiet steps; the monitors read it in batches.
  With ``accumulate_grad_batches=n`` a stepwatch step is an optimizer step: its loss is the
  mean of the batches' losses since the last step (Lightning divides each by ``n``; the bridge
  undoes that), computed on the device. A step whose training_step returned no loss is left out
  (a warning says so once).
- **Step, epoch, steps per epoch, rank and world**: stepwatch's step counts the optimizer
  steps (``trainer.global_step`` advancing) from 1; the steps per epoch are
  ``ceil(num_training_batches / accumulate_grad_batches)``; the epochs come from
  ``max_epochs`` / ``max_steps``; rank and world are ``trainer.global_rank`` /
  ``trainer.world_size``. A fit resumed from a checkpoint (``ckpt_path=``) is a new run
  that counts on from the checkpoint's step and epoch.
  Sanity-check validation is not training: its steps and values are not counted.
- **The learning rate** from the Trainer's (first) optimizer, a torch optimizer; the first LR
  scheduler is the run's ``lr_scheduler``.
- **Epoch values**: at ``on_train_epoch_end``, the epoch's validation values (taken when
  Lightning's validation ends, which is before the training epoch ends) and the training values
  logged during the epoch, from ``trainer.callback_metrics``, under stepwatch's names
  (``val_loss`` -> ``eval_loss``, ``val_acc`` -> ``eval_acc``, ``acc`` -> ``train_acc``). The
  epoch's ``loss`` is the mean of its step losses, as under ``stepwatch.Model``; the per-step
  copies Lightning keeps (``*_step``) are left out, and a value logged per step only is its
  last step's. Values from an earlier epoch (a ``val_loss`` of an epoch that did not validate)
  are not repeated. Lightning calls a LightningModule's own ``on_train_epoch_end`` after the
  callbacks', so values logged there are not in the run: log them in ``training_step`` with
  ``on_epoch=True``, or in validation.
- **Gradients**: with automatic optimization they are on the module's parameters when
  ``on_train_batch_end`` runs (after the optimizer step, before the next ``zero_grad``), so the
  gradient detectors work. With manual optimization the bridge cannot know where the
  gradients are: the gradient detectors are off, with one note.
- **Sharding**: under ``ModelParallelStrategy`` (FSDP2: the module applies ``fully_shard`` in
  its ``configure_model`` with ``self.device_mesh["data_parallel"]``) the parameters are
  DTensors and each rank holds shards of them; the gradient detectors stay on and read the
  full model's gradients (the global norm is ``clip_grad_norm_``'s over all the shards), and
  every rank takes the same decisions. It runs on the CPU too (gloo):
  ``Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
  tensor_parallel_size=1))`` (the default sizes make the two processes one tensor-parallel
  group, which ``fully_shard`` over ``"data_parallel"`` does not shard). ``FSDPStrategy``
  (FSDP1) needs GPUs (on the CPU Lightning refuses it: "requires a GPU accelerator"); there,
  as under DeepSpeed, the gradients are flattened shards that are not the model's, so the
  gradient detectors are off, with a warning.
- **Config**: the module's ``hparams`` and the Trainer's settings (``max_epochs``,
  ``accumulate_grad_batches``, ``precision``, ``strategy``, ...), stored with the run.

How the actions reach Lightning:

- ``stop``: ``trainer.should_stop = True``. Lightning ends the epoch (it validates first, as
  for early stopping) and the fit; ``min_epochs`` / ``min_steps`` can make it go on.
- ``reduce_lr``: the torch optimizer's ``param_groups`` (and the LR scheduler's base rates).
- ``snapshot``: ``trainer.save_checkpoint`` writes ``anomaly-<kind>-step<n>.ckpt``, which
  ``YourModule.load_from_checkpoint`` loads and ``Trainer.fit(ckpt_path=...)`` resumes from.
  In a distributed run Lightning's checkpoint is written by every rank together while the snapshot
  action runs on rank 0 alone, so there the snapshot is stepwatch's own ``.pt`` file (the
  module and optimizer state, loadable with ``stepwatch.load_checkpoint(path, module)``).
- ``rollback``: the module, optimizer and LR scheduler are torch objects, restored in place
  through their ``state_dict`` on one device, under DDP, and under ``ModelParallelStrategy``
  (each rank copies and restores its own shards, all ranks at the same step). Where that is
  not so (several optimizers, ``FSDPStrategy`` or DeepSpeed, whose flattened state is split
  over the ranks) a rollback stops the run instead, and its outcome says so.

When ``Trainer.fit`` fails, Lightning calls ``on_exception``: the run ends with the error and
RunRecorder stores it ``failed`` (``interrupted`` for Ctrl-C, which Lightning turns into
``SystemExit`` once the callbacks have run). A failure before training starts (in ``setup``
or the sanity check) comes before the run and is not recorded.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch import nn

from ..monitor import values as names
from ..train.engine import torch_controls
from ..train.serialization import TMP_PREFIX
from ._bridge import Bridge, BridgeFace, Host, clean_config, host_values

__all__ = ["StepwatchCallback"]

_OWNER = "lightning.StepwatchCallback"
_EVAL = "eval_"  # stepwatch's validation values: eval_loss, eval_<metric>
_UNKNOWN_EPOCH = 2**31 - 1  # steps per epoch of a loader without a length and no max_steps
_TRAINER_SETTINGS = (
    "max_epochs",
    "min_epochs",
    "max_steps",
    "min_steps",
    "accumulate_grad_batches",
    "precision",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "num_training_batches",
    "limit_train_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
    "num_sanity_val_steps",
    "num_devices",
    "num_nodes",
    "world_size",
)


class StepwatchCallback(BridgeFace, pl.Callback):
    """stepwatch's callbacks in a Lightning ``Trainer``: ``Trainer(callbacks=[StepwatchCallback(
    [LossMonitor(10), AnomalyMonitor(), RunRecorder()])])``.

    Each ``Trainer.fit`` is one stepwatch run: it opens when training starts (after the sanity
    check) and ends with the fit, ``failed`` when the fit raises.

    The per-batch hooks it does not use (``on_train_batch_start``, ``on_before_backward``, ...)
    are None, so Lightning skips them rather than calling a no-op several times a batch; a
    subclass may still define any of them (without calling ``super()``).

    Args:
        callbacks: a stepwatch ``Callback`` or a list of them (built-in ones or your own),
            instances, not classes.

    Raises:
        TypeError: ``callbacks`` is not a stepwatch Callback or a list of them (a class where
            an instance belongs, a Lightning callback, a number, ...).

    Attributes:
        run: the stepwatch run of the latest fit (a ``RunEngine``), in progress or ended, or
            None before the first fit trains.
        stop_reason: why a stepwatch callback stopped it, or None.
    """

    host = "lightning"

    def __init__(self, callbacks: Any = None) -> None:
        super().__init__()
        self._bridge = Bridge(callbacks, "lightning.StepwatchCallback")
        self._pending: list[torch.Tensor] = []
        self._seen_step = 0
        self._accumulate = 1
        self._automatic = True
        self._unscaled = True  # Lightning did not divide each batch's loss (no accumulation)
        self._evals: dict[str, float] = {}
        self._before: dict[str, Any] = {}
        self._warned_no_loss = False

    # -- Lightning's hooks -----------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending, self._evals = [], {}
        self._before = dict(trainer.callback_metrics)
        self._seen_step = int(trainer.global_step)
        self._accumulate = max(1, int(trainer.accumulate_grad_batches))
        self._automatic = bool(pl_module.automatic_optimization)
        self._unscaled = not self._automatic or self._accumulate == 1
        self._warned_no_loss = False
        optimizers = list(trainer.optimizers)
        optimizer = optimizers[0] if optimizers else None
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        steps_per_epoch = _steps_per_epoch(trainer, self._accumulate)
        world = int(trainer.world_size)
        layout = _layout(trainer)
        if layout == "flat" and self._automatic and trainer.global_rank == 0:
            warnings.warn(_FLAT.format(type(trainer.strategy).__name__), UserWarning, stacklevel=2)
        loader = trainer.train_dataloader
        dataset = loader if isinstance(loader, torch.utils.data.DataLoader) else None
        controls = torch_controls(
            "lightning",
            pl_module,
            optimizer,
            lr_scheduler=scheduler,
            loss_scaler=getattr(trainer.precision_plugin, "scaler", None),
            dataset=dataset,
            restores=_restores(layout, pl_module, optimizers),
            grads=self._automatic and optimizer is not None and layout != "flat",
            save=_saver(trainer) if world == 1 else None,
            config=clean_config(_config(trainer, pl_module, scheduler)),
        )
        host = Host(controls, pl_module, optimizer, rank=int(trainer.global_rank), world=world)
        self._bridge.begin(
            host,
            epochs=_epochs(trainer, steps_per_epoch),
            steps_per_epoch=steps_per_epoch,
            dataset=dataset,
            lr_scheduler=scheduler,
            initial_step=self._seen_step,  # a fit resumed from a checkpoint goes on from it
            initial_epoch=int(trainer.current_epoch),
        )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # What callback_metrics holds now is from before this epoch (the values a module logs in
        # its own on_train_epoch_end land after this callback's hook): none of it is this epoch's.
        self._before = dict(trainer.callback_metrics)
        self._evals = {}

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        run = self._bridge.run
        if run is None:
            return
        loss = _loss_of(outputs)
        if loss is not None:
            self._pending.append(loss)
        step = trainer.global_step
        if step == self._seen_step:
            return  # accumulating: no optimizer step yet
        self._seen_step = step
        pending, self._pending = self._pending, []
        if not pending:
            self._warn_no_loss(step)
            return
        loss = pending[0] if len(pending) == 1 and self._unscaled else self._step_loss(pending)
        try:
            run.step(loss, outputs, batch)  # (Bridge.step, inlined: this runs every step)
        except BaseException as exc:
            self._bridge.end(exc)
            raise
        if run.should_stop:
            self._stop(trainer)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self._bridge.running:
            return
        values = host_values(_epoch_metrics(trainer.callback_metrics))
        self._evals = {k: v for k, v in values.items() if k.startswith(_EVAL)}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._bridge.running:
            return
        before = self._before
        metrics = trainer.callback_metrics
        fresh = {k: v for k, v in metrics.items() if before.get(k) is not v}
        values = {
            k: v
            for k, v in host_values(_epoch_metrics(fresh)).items()
            if k != names.LOSS and not k.startswith(_EVAL)
        }
        values.update(self._evals)
        self._evals = {}
        if self._bridge.epoch_end(values):
            self._stop(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(None)  # a fit whose training loop never ran its end hook

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._end(exception)

    # -- the parts -------------------------------------------------------------------------------
    def _step_loss(self, pending: list[torch.Tensor]) -> torch.Tensor:
        """The optimizer step's loss: the mean of its batches' losses, on the device."""
        scale = self._accumulate if self._automatic else 1  # Lightning divided each by it
        if len(pending) == 1 and scale == 1:
            return pending[0]
        total = torch.stack([t.reshape(()) for t in pending]).sum()
        return total * (scale / len(pending))

    @staticmethod
    def _stop(trainer: pl.Trainer) -> None:
        trainer.should_stop = True

    def _end(self, exc: BaseException | None) -> None:
        if not self._bridge.running:
            return
        self._pending = []
        self._bridge.end(exc)

    def _warn_no_loss(self, step: int) -> None:
        if self._warned_no_loss:
            return
        self._warned_no_loss = True
        warnings.warn(
            f"{_OWNER}: training_step returned no loss for optimizer step {step}, so stepwatch "
            "leaves that step out; return the loss tensor (or {'loss': tensor}) from "
            "training_step to have every step watched.",
            UserWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        inner = ", ".join(type(cb).__name__ for cb in self._bridge.callbacks)
        return f"StepwatchCallback([{inner}])"


# Lightning calls a callback's hook only where it is callable, and each call goes through its
# profiler with a name formatted for it: a no-op hook costs a callback about a microsecond, on
# every batch. The per-batch hooks the bridge does not use are None, so Lightning skips them.
_UNUSED_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
for _hook in _UNUSED_BATCH_HOOKS:
    setattr(StepwatchCallback, _hook, None)
del _hook


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (Lightning's copy of it): a tensor, or the
    ``'loss'`` of a dict; None when there is none."""
    loss = outputs.get("loss") if type(outputs) is dict or isinstance(outputs, Mapping) else outputs
    if type(loss) is torch.Tensor and not loss.requires_grad and loss.numel() == 1:
        return loss  # Lightning's detached copy (the common case)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach()
    return None


def _epoch_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's logged values as epoch values: a value logged both per step and per epoch
    appears as ``name`` (the epoch's), ``name_step`` and ``name_epoch``; keep ``name``."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if key.endswith("_step") and key[: -len("_step")] in metrics:
            continue
        if key.endswith("_epoch"):
            base = key[: -len("_epoch")]
            if base in metrics:
                continue
            key = base
        out[key] = value
    return out


def _steps_per_epoch(trainer: pl.Trainer, accumulate: int) -> int:
    batches = trainer.num_training_batches
    if isinstance(batches, float) and not math.isfinite(batches):
        max_steps = int(trainer.max_steps)
        return max_steps if max_steps > 0 else _UNKNOWN_EPOCH
    return max(1, math.ceil(int(batches) / accumulate))


def _epochs(trainer: pl.Trainer, steps_per_epoch: int) -> int:
    max_epochs = trainer.max_epochs
    epochs = int(max_epochs) if max_epochs is not None and max_epochs > 0 else None
    max_steps = int(trainer.max_steps)
    if max_steps > 0:
        by_steps = math.ceil(max_steps / steps_per_epoch)
        epochs = min(epochs, by_steps) if epochs is not None else by_steps
    return max(1, epochs or 1)


# FSDPStrategy (FSDP1, for GPUs) and DeepSpeed keep gradients and optimizer state in flattened
# partitions: each rank's gradients are not the model's, so the gradient detectors are off.
_FLAT = (
    "lightning.StepwatchCallback: Lightning's {} keeps the gradients in flattened shards that "
    "stepwatch does not read as the full model's, so AnomalyMonitor's gradient detectors are "
    "off and a rollback stops the run instead. ModelParallelStrategy (FSDP2: fully_shard in "
    "the module's configure_model) keeps them on, on GPUs and on the CPU."
)


def _layout(trainer: pl.Trainer) -> str:
    """How the strategy lays the module out over the ranks: ``'whole'`` (one device, DDP),
    ``'sharded'`` (ModelParallelStrategy: FSDP2's DTensor shards), ``'flat'`` (FSDPStrategy,
    DeepSpeed: flattened partitions) or ``'other'``."""
    strategy = trainer.strategy
    if isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy)):
        return "flat"
    if isinstance(strategy, ModelParallelStrategy):
        return "sharded"
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return "whole"
    return "other"


def _restores(layout: str, pl_module: nn.Module, optimizers: list[Any]) -> bool:
    """Whether rollback may restore the module and optimizer in place: whole on each rank or
    sharded with FSDP2 (each rank restores its shards), one torch optimizer."""
    return (
        layout in ("whole", "sharded")
        and isinstance(pl_module, nn.Module)
        and len(optimizers) == 1
        and isinstance(optimizers[0], torch.optim.Optimizer)
    )


def _saver(trainer: pl.Trainer) -> Any:
    """``Host.save``: Lightning's own checkpoint, written under a temporary name and moved into
    place, so a killed write leaves no half file under the real name."""

    def save(stem: Path) -> Path:
        path = stem.parent / f"{stem.name}.ckpt"
        tmp = stem.parent / f"{TMP_PREFIX}{stem.name}.ckpt"
        trainer.save_checkpoint(tmp)
        os.replace(tmp, path)
        return path

    return save


def _config(trainer: pl.Trainer, pl_module: pl.LightningModule, scheduler: Any) -> dict[str, Any]:
    """The module's hparams and the Trainer's settings, stored with the run."""
    settings: dict[str, Any] = {}
    for name in _TRAINER_SETTINGS:
        try:
            settings[name] = getattr(trainer, name)
        except Exception:  # a setting this Lightning version does not have, or cannot give now
            continue
    settings["strategy"] = type(trainer.strategy).__name__
    settings["accelerator"] = type(trainer.accelerator).__name__
    settings["automatic_optimization"] = bool(pl_module.automatic_optimization)
    settings["optimizers"] = [type(o).__name__ for o in trainer.optimizers]
    if scheduler is not None:
        settings["lr_scheduler"] = type(scheduler).__name__
    hparams = getattr(pl_module, "hparams", None)
    return {
        "model": type(pl_module).__name__,
        "hparams": dict(hparams) if isinstance(hparams, Mapping) else {},
        "trainer": settings,
        "lightning_version": pl.__version__,
    }
