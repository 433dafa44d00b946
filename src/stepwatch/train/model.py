"""``Model``: MindSpore's ``train`` / ``fit`` / ``eval`` on PyTorch, driving the callbacks."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._validation import check_bool, check_int
from ..dataset import check_first_batch, dataset_size, feed, move
from ..distributed import abort, rank_and_world
from .callback._callback import CallbackList, RunContext, normalize_callbacks
from .callback.history import History
from .checks import (
    RESERVED,
    check_first_forward,
    check_optimizer,
    check_schedule,
    class_hint,
    data_of,
    is_dataset,
    resolve_device,
)
from .eval_indexes import check_eval_indexes
from .evaluate import eval_pass
from .loop import run
from .metrics import build_metrics
from .parallel import check_sharding, prepare, shard
from .parts import Parts, RunPlan, new_cb_params
from .step import LossScaleManager, build_step_options

__all__ = ["Model"]


class Model:
    """Train, validate and evaluate a PyTorch network with MindSpore's call shape.

    Args:
        network: the ``torch.nn.Module`` to train. With ``loss_fn=None`` it must return the loss
            itself (a tensor, a tuple starting with it, or a dict with a ``'loss'`` key).
        loss_fn: ``loss_fn(output, label)`` → scalar loss tensor, e.g. ``nn.CrossEntropyLoss()``.
        optimizer: a ``torch.optim.Optimizer`` over ``network``'s parameters (needed to train).
        metrics: names (``{'accuracy', 'loss'}``), Metric objects, or a dict of either; used by
            ``eval``, by validation in ``fit``, and reported per epoch on the training batches.
        eval_network: the module used for evaluation (default: ``network``); it must return
            predictions. Needed for evaluation when ``loss_fn`` is None.
        eval_indexes: MindSpore's ``[i_loss, i_pred, i_label]``: ``eval_network`` is then of
            MindSpore's kind - it takes the whole batch (``eval_network(*batch)``) and returns
            a tuple - and these are the positions of the loss, the prediction and the label
            in it. The loss feeds the ``'loss'`` metric and ``eval_loss``, the prediction and
            the label the other metrics; ``cb_params.net_outputs`` is the whole tuple.
        device: where to train; ``None`` picks CUDA when available, else the CPU. The networks
            are moved there and each batch is copied there with ``non_blocking=True``.
        amp_level: MindSpore's mixed precision level: ``'O0'`` (float32), ``'O1'`` (autocast),
            ``'O2'`` (autocast and, in float16, dynamic loss scaling), ``'O3'`` (the network
            in half precision), ``'auto'`` (per device). See :mod:`stepwatch.train.step`.
        precision: the same in PyTorch's words: ``'32'``, ``'bf16-mixed'``, ``'16-mixed'``,
            ``'bf16-true'``, ``'16-true'`` (an alias of ``amp_level``, not a second path).
        loss_scale_manager: ``FixedLossScaleManager`` or ``DynamicLossScaleManager`` (needs
            mixed precision). A step whose gradients overflow is skipped and counted.
        clip_grad_norm: scale the gradients down to this global norm (after unscaling).
        clip_grad_value: or clamp each gradient to ``[-value, value]``.
        accumulate_grad_batches: step the optimizer every N batches (and at the epoch's end),
            the loss divided by N.
        lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler of ``optimizer``, stepped after
            the optimizer every optimizer step (``lr_interval='step'``) or every epoch
            (``'epoch'``); its state is saved in checkpoints.
        compile: ``True`` or a dict of ``torch.compile`` options: the network is compiled once
            for training; checkpoints hold the uncompiled module's weights.

    Under ``torch.distributed`` (torchrun) the same calls train data-parallel: the network is
    wrapped in DistributedDataParallel, a NumpySlicesDataset is split across the ranks, and the
    epoch loss and metrics are reduced across them (see :mod:`stepwatch.train.parallel`). A
    network sharded with FSDP2's ``fully_shard`` (whole or per layer) is trained as it is,
    with no DDP wrapper; its checkpoints are written by every rank, each its own shards.

    Raises:
        TypeError: an argument has the wrong type (a class instead of an instance too).
        ValueError: an unknown metric name or a metric named like a cb_params field;
            ``eval_indexes`` not three ints, or given without ``eval_network`` (other than
            ``[0, 1, 2]``, what the evaluation built from ``network`` and ``loss_fn`` gives).

    Example:
        >>> model = Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.1),
        ...               metrics={"accuracy"})
        >>> model.fit(10, train_ds, valid_ds, callbacks=[LossMonitor(100), TimeMonitor()])
        >>> model.eval(valid_ds)
        {'accuracy': 0.97}
    """

    def __init__(
        self,
        network: nn.Module,
        loss_fn: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        metrics: Any = None,
        eval_network: nn.Module | None = None,
        eval_indexes: list[int] | None = None,
        device: str | torch.device | None = None,
        *,
        amp_level: str = "O0",
        precision: str | None = None,
        loss_scale_manager: LossScaleManager | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        accumulate_grad_batches: int = 1,
        lr_scheduler: Any = None,
        lr_interval: str = "step",
        compile: bool | dict[str, Any] = False,
    ) -> None:
        class_hint("network", network, "an nn.Module")
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"'network' must be a torch.nn.Module, but got {network!r} with type "
                f"'{type(network).__name__}'."
            )
        class_hint("loss_fn", loss_fn, "a loss function or nn.Module")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"'loss_fn' must be a callable loss_fn(output, label) or None, but got "
                f"{loss_fn!r} with type '{type(loss_fn).__name__}'."
            )
        class_hint("optimizer", optimizer, "a torch.optim.Optimizer")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"'optimizer' must be a torch.optim.Optimizer or None, but got {optimizer!r} "
                f"with type '{type(optimizer).__name__}'."
            )
        class_hint("eval_network", eval_network, "an nn.Module")
        if eval_network is not None and not isinstance(eval_network, nn.Module):
            raise TypeError(
                f"'eval_network' must be a torch.nn.Module or None, but got {eval_network!r} "
                f"with type '{type(eval_network).__name__}'."
            )
        self._eval_indexes = check_eval_indexes(eval_indexes, eval_network)
        self._device = resolve_device(device)
        self._metric_fns = build_metrics(metrics)
        clash = sorted(set(self._metric_fns) & RESERVED)
        if clash:
            raise ValueError(
                f"'metrics' names {clash} clash with cb_params fields; use other names, e.g. "
                f"{{'my_{clash[0]}': ...}}."
            )
        if optimizer is not None:
            check_optimizer(network, optimizer)
        self._network = network.to(self._device)
        self._loss_fn = loss_fn.to(self._device) if isinstance(loss_fn, nn.Module) else loss_fn
        self._optimizer = optimizer
        self._eval_network = eval_network.to(self._device) if eval_network is not None else None
        # Training-batch metrics accumulate in their own copies so validation never mixes in.
        train_metric_fns = {
            name: copy.deepcopy(m)
            for name, m in self._metric_fns.items()
            if not getattr(m, "uses_loss", False)
        }
        step = build_step_options(
            self._network,
            optimizer,
            self._device,
            amp_level=amp_level,
            precision=precision,
            loss_scale_manager=loss_scale_manager,
            clip_grad_norm=clip_grad_norm,
            clip_grad_value=clip_grad_value,
            accumulate_grad_batches=accumulate_grad_batches,
            lr_scheduler=lr_scheduler,
            lr_interval=lr_interval,
            compile=compile,
        )
        if step.precision.cast_network and self._eval_network is not None:
            self._eval_network.to(step.precision.dtype)  # O3: evaluated in half precision too
        self._parts = Parts(
            network=self._network,
            loss_fn=self._loss_fn,
            optimizer=self._optimizer,
            device=self._device,
            metrics=self._metric_fns,
            eval_network=self.eval_network,
            train_metrics=train_metric_fns,
            step=step,
            eval_indexes=self._eval_indexes,
        )

    # -- public properties ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def train_network(self) -> nn.Module:
        return self._network

    @property
    def eval_network(self) -> nn.Module:
        return self._eval_network if self._eval_network is not None else self._network

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self._metric_fns)

    @property
    def precision(self) -> str:
        """What ``amp_level`` / ``precision`` resolved to: ``'32'``, ``'bf16-mixed'``, ..."""
        return self._parts.step.precision.name

    @property
    def lr_scheduler(self) -> Any:
        return self._parts.step.lr_scheduler

    @property
    def loss_scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` of loss scaling, or None."""
        return self._parts.step.scaler

    # -- argument checks ------------------------------------------------------------------
    @staticmethod
    def _check_epochs(epoch: Any, initial_epoch: Any) -> None:
        check_int("epoch", epoch, minimum=1)
        check_int("initial_epoch", initial_epoch, minimum=0)
        if initial_epoch >= epoch:
            raise ValueError(
                f"'initial_epoch' must be smaller than 'epoch' (the final epoch number, "
                f"{epoch}), but got {initial_epoch}."
            )

    @staticmethod
    def _check_sink(dataset_sink_mode: Any, sink_size: Any) -> None:
        check_bool("dataset_sink_mode", dataset_sink_mode)
        check_int("sink_size", sink_size)
        if sink_size == 0 or sink_size < -1:
            raise ValueError(f"'sink_size' must be -1 or a positive int, but got {sink_size}.")

    def _check_eval_ready(self, caller: str) -> None:
        if not self._metric_fns:
            raise ValueError(
                f"Model.{caller}() with a validation dataset needs metrics: create the Model with "
                "metrics={'accuracy'} (or other metric names/objects)."
                if caller == "fit"
                else "Model.eval() needs metrics: create the Model with metrics={'accuracy'} "
                "(or other metric names/objects)."
            )
        if self._eval_indexes is not None:
            return  # the eval network gives the loss, the prediction and the label
        if self._loss_fn is None and any(
            getattr(m, "uses_loss", False) for m in self._metric_fns.values()
        ):
            raise ValueError(
                f"Model.{caller}() cannot compute the 'loss' metric without a loss_fn; drop "
                "it from 'metrics' or pass loss_fn."
            )
        if self._loss_fn is None and self._eval_network is None:
            raise ValueError(
                f"Model.{caller}() cannot evaluate: with loss_fn=None the network returns a loss, "
                "not predictions. Pass eval_network= (a module mapping data to predictions) or "
                "a loss_fn."
            )

    @staticmethod
    def _check_valid_frequency(valid_frequency: Any) -> None:
        if isinstance(valid_frequency, list):
            for v in valid_frequency:
                check_int("valid_frequency[i]", v, minimum=1)
            return
        if isinstance(valid_frequency, bool) or not isinstance(valid_frequency, int):
            raise TypeError(
                "'valid_frequency' must be an int (validate every k epochs) or a list of epoch "
                f"numbers, but got {valid_frequency!r} with type "
                f"'{type(valid_frequency).__name__}'."
            )
        check_int("valid_frequency", valid_frequency, minimum=1)

    # -- public API -------------------------------------------------------------------------
    def train(
        self,
        epoch: int,
        train_dataset: Iterable[Any],
        callbacks: Any = None,
        dataset_sink_mode: bool = False,
        sink_size: int = -1,
        initial_epoch: int = 0,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> History:
        """Train for epochs ``initial_epoch + 1`` .. ``epoch``.

        Args:
            epoch: the final epoch number (``train(3, ds, initial_epoch=1)`` runs epochs 2, 3).
            train_dataset: a DataLoader, a NumpySlicesDataset or a list of (data, label) batches.
            callbacks: a Callback, or a list of Callback instances.
            dataset_sink_mode: accepted for MindSpore compatibility. PyTorch has no graph sink:
                steps run one at a time and every step hook is called.
            sink_size: with ``dataset_sink_mode=True`` and ``sink_size > 0``, each epoch runs
                ``sink_size`` steps and the data continues where the last epoch stopped.
            initial_epoch: epochs already done (MindSpore's way to continue numbering).
            resume_from: a checkpoint file (from ModelCheckpoint, BackupAndRestore or
                OnRequestExit). Restores the network, optimizer, random generators and callback
                states, and continues at the saved epoch and step; ``initial_epoch`` is then
                taken from the checkpoint.

        Returns:
            The run's :class:`History` (the one in ``callbacks``, or a new one): per-epoch
            values under the names of :mod:`stepwatch.monitor.values`, as Keras' ``fit``
            returns it. (MindSpore returns None; code that ignores the result is unaffected.)

        Raises:
            TypeError / ValueError: bad arguments, an empty dataset, a batch that is not
                ``(data, label)`` when ``loss_fn`` is set, labels that do not fit the outputs
                (checked on the first batch before training), or no optimizer.
        """
        return self._run(
            epoch,
            train_dataset,
            callbacks,
            dataset_sink_mode=dataset_sink_mode,
            sink_size=sink_size,
            initial_epoch=initial_epoch,
            resume_from=resume_from,
        )

    def fit(
        self,
        epoch: int,
        train_dataset: Iterable[Any],
        valid_dataset: Iterable[Any] | None = None,
        valid_frequency: int | list[int] = 1,
        callbacks: Any = None,
        dataset_sink_mode: bool = False,
        valid_dataset_sink_mode: bool = False,
        sink_size: int = -1,
        initial_epoch: int = 0,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> History:
        """Train, validating on ``valid_dataset`` after every ``valid_frequency`` epochs.

        Validation runs after the epoch's last step and before ``on_train_epoch_end``; its
        results are ``cb_params.eval_results`` (the metrics plus ``eval_loss``) from
        ``on_eval_end`` through ``on_train_epoch_end``.

        Args:
            valid_frequency: an int k (validate every k epochs) or a list of epoch numbers.
            Others (``resume_from`` too) as in :meth:`train`.

        Returns:
            The run's :class:`History`, as :meth:`train`.
        """
        check_bool("valid_dataset_sink_mode", valid_dataset_sink_mode)
        self._check_valid_frequency(valid_frequency)
        if valid_dataset is not None:
            self._check_eval_ready("fit")
            dataset_size(valid_dataset, "valid_dataset")
            check_int("epoch", epoch, minimum=1)
            check_int("initial_epoch", initial_epoch, minimum=0)
            if isinstance(valid_frequency, list) and not any(
                initial_epoch < e <= epoch for e in valid_frequency
            ):
                warnings.warn(
                    f"'valid_frequency' {valid_frequency} names no epoch of this run (epochs "
                    f"{initial_epoch + 1}..{epoch}): it will never validate.",
                    UserWarning,
                    stacklevel=2,
                )
        return self._run(
            epoch,
            train_dataset,
            callbacks,
            valid_dataset=valid_dataset,
            valid_frequency=valid_frequency,
            dataset_sink_mode=dataset_sink_mode,
            sink_size=sink_size,
            initial_epoch=initial_epoch,
            resume_from=resume_from,
        )

    def eval(
        self, valid_dataset: Iterable[Any], callbacks: Any = None, dataset_sink_mode: bool = False
    ) -> dict[str, Any]:
        """Evaluate the metrics on ``valid_dataset`` and return ``{name: value}``.

        Raises:
            ValueError: the Model has no metrics, the dataset is empty, or a batch is not
                ``(data, label)``.
        """
        check_bool("dataset_sink_mode", dataset_sink_mode)
        rank, world = rank_and_world()
        cb_list = CallbackList(normalize_callbacks(callbacks), rank)
        self._check_eval_ready("eval")
        batch_num = dataset_size(valid_dataset, "valid_dataset")
        if self._eval_indexes is None:  # else the eval network takes batches of its own shape
            check_first_batch(valid_dataset, "valid_dataset", self._loss_fn is not None)
            check_first_forward(
                self.eval_network,
                self._loss_fn,
                self._metric_fns,
                valid_dataset,
                self._device,
                self._parts.step,
                "valid_dataset",
            )
        cb_params = new_cb_params(self._parts, cb_list, rank, world)
        cb_params.cur_epoch_num = 1
        cb_params.epoch_num = 1
        cb_params.batch_num = batch_num
        cb_params.dataset_sink_mode = dataset_sink_mode
        run_context = RunContext(cb_params)
        try:
            if world > 1:
                valid_dataset = shard(valid_dataset, "valid_dataset", pad=False)
                cb_params.batch_num = batch_num = dataset_size(valid_dataset, "valid_dataset")
            with cb_list.entered():
                metrics, _ = eval_pass(
                    self._parts,
                    valid_dataset,
                    batch_num,
                    cb_list,
                    cb_params,
                    run_context,
                    stoppable=True,
                )
        except BaseException:
            if world > 1:
                abort()
            raise
        return metrics

    def predict(self, *inputs: Any) -> Any:
        """Run the eval network without gradients and return its output.

        ``predict(x)`` / ``predict(x1, x2)`` feed tensors (or arrays) directly.
        ``predict(dataset)`` - a DataLoader, a NumpySlicesDataset or a list of batches -
        feeds every batch (the data column of ``(data, label)`` batches) and returns the
        outputs concatenated along the first dimension.
        """
        # With eval_indexes the eval network takes whole batches: predict with the network,
        # as MindSpore does.
        net = self._network if self._eval_indexes is not None else self.eval_network
        was_training = net.training
        net.eval()
        try:
            with torch.no_grad():
                if len(inputs) == 1 and is_dataset(inputs[0]):
                    outputs = [feed(net, move(data_of(batch), self._device)) for batch in inputs[0]]
                    if not outputs:
                        raise ValueError("'predict' got an empty dataset.")
                    if all(isinstance(o, torch.Tensor) for o in outputs):
                        return torch.cat(outputs)
                    return outputs
                return feed(net, move(tuple(inputs), self._device))
        finally:
            net.train(was_training)

    # -- internals ------------------------------------------------------------------------
    def _run(
        self,
        epoch: int,
        train_dataset: Iterable[Any],
        callbacks: Any,
        *,
        valid_dataset: Iterable[Any] | None = None,
        valid_frequency: int | list[int] = 1,
        dataset_sink_mode: bool,
        sink_size: int,
        initial_epoch: int,
        resume_from: str | os.PathLike[str] | None,
    ) -> History:
        self._check_epochs(epoch, initial_epoch)
        self._check_sink(dataset_sink_mode, sink_size)
        rank, world = rank_and_world()
        given = normalize_callbacks(callbacks)
        history = next((cb for cb in given if isinstance(cb, History)), None)
        if history is None:
            history = History()
            given.append(history)
        cb_list = CallbackList(given, rank)
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(
                f"'resume_from' must be a checkpoint path or None, but got {resume_from!r} with "
                f"type '{type(resume_from).__name__}'."
            )
        if self._optimizer is None:
            raise ValueError(
                "Model.train()/fit() needs an optimizer: create the Model with "
                "optimizer=torch.optim.SGD(network.parameters(), lr=...) or another optimizer."
            )
        if world > 1:
            check_sharding(self._network, world)  # a layout Model can split the data for
        batch_num = dataset_size(train_dataset, "train_dataset")
        check_schedule(self._parts.step, epoch - initial_epoch, batch_num)
        check_first_batch(train_dataset, "train_dataset", self._loss_fn is not None)
        check_first_forward(
            self._network,
            self._loss_fn,
            self._metric_fns,
            train_dataset,
            self._device,
            self._parts.step,
        )
        plan = RunPlan(
            epoch=epoch,
            train_dataset=train_dataset,
            callbacks=cb_list,
            batch_num=batch_num,
            valid_dataset=valid_dataset,
            valid_frequency=valid_frequency,
            dataset_sink_mode=dataset_sink_mode,
            sink_size=sink_size,
            initial_epoch=initial_epoch,
            resume_from=resume_from,
        )
        try:
            if world > 1:
                plan.train_dataset, plan.valid_dataset = prepare(
                    self._parts, train_dataset, valid_dataset
                )
                plan.batch_num = dataset_size(plan.train_dataset, "train_dataset")
            run(self._parts, plan)
        except BaseException:
            if world > 1:
                abort()  # the other ranks' collectives fail now instead of waiting forever
            raise
        return history
