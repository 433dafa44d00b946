"""``Model``: MindSpore's ``train`` / ``fit`` / ``eval`` on PyTorch, driving the callbacks."""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .._validation import check_bool, check_int
from ..dataset import dataset_size, first_batch, set_epoch
from .callback._callback import CallbackList, CallbackParams, RunContext, normalize_callbacks
from .metrics import build_metrics
from .serialization import (
    check_state_keys,
    load_checkpoint,
    load_checkpoint_states,
    rng_state,
    set_rng_state,
)

__all__ = ["Model"]

logger = logging.getLogger("stepwatch")

# Step losses are folded into the epoch sum in chunks: one stack+sum per chunk keeps the
# per-step cost to a list append and never waits for the device.
_LOSS_CHUNK = 256

# Names a metric may not take, because cb_params already uses them.
_RESERVED = frozenset(
    {
        "cur_step_num",
        "cur_epoch_num",
        "epoch_num",
        "batch_num",
        "net_outputs",
        "train_network",
        "network",
        "loss_fn",
        "optimizer",
        "mode",
        "parallel_mode",
        "device_number",
        "rank_id",
        "train_dataset",
        "train_dataset_element",
        "dataset_sink_mode",
        "list_callback",
        "last_save_ckpt_step",
        "latest_ckpt_file",
        "initial_step",
        "initial_epoch",
        "eval_network",
        "valid_dataset",
        "eval_dataset_element",
        "metrics",
        "eval_results",
        "train_results",
        "outputs",
        "step_time",
        "lr",
        "device",
        "get",
        "keys",
        "items",
    }
)


def _move(obj: Any, device: torch.device) -> Any:
    """Move tensors (in tuples, lists and dicts too) to ``device`` without blocking."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        moved = [_move(x, device) for x in obj]
        return type(obj)(moved) if type(obj) in (tuple, list) else type(obj)(*moved)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return torch.from_numpy(obj).to(device, non_blocking=True)
    return obj


def _call(network: Any, inputs: Any) -> Any:
    if isinstance(inputs, (tuple, list)):
        return network(*inputs)
    if isinstance(inputs, dict):
        return network(**inputs)
    return network(inputs)


def _split_loss(result: Any) -> tuple[torch.Tensor, Any]:
    """(loss, outputs) from a network that computes its own loss."""
    if isinstance(result, torch.Tensor):
        return result, None
    if isinstance(result, dict) and "loss" in result:
        return result["loss"], result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0], result[1:] if len(result) > 1 else None
    raise TypeError(
        "with loss_fn=None the network must return the loss (a tensor, a tuple starting with "
        f"it, or a dict with a 'loss' key), but it returned {type(result).__name__}."
    )


def _fold(total: torch.Tensor | None, pending: list[torch.Tensor]) -> torch.Tensor | None:
    if not pending:
        return total
    chunk = torch.stack(pending).float().sum()
    pending.clear()
    return chunk if total is None else total + chunk


def _to_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"'device' must name a torch device such as 'cpu' or 'cuda:0', but got {device!r}."
            ) from exc
    raise TypeError(
        f"'device' must be None, a str or a torch.device, but got {device!r} with type "
        f"'{type(device).__name__}'."
    )


def _class_hint(name: str, value: Any, what: str) -> None:
    if inspect.isclass(value):
        raise TypeError(
            f"'{name}' must be {what} instance, but got the class {value.__name__}: pass "
            f"{value.__name__}(...) instead."
        )


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
        device: where to train; ``None`` picks CUDA when available, else the CPU. The networks
            are moved there and each batch is copied there with ``non_blocking=True``.

    Raises:
        TypeError: an argument has the wrong type (a class instead of an instance too).
        ValueError: an unknown metric name or a metric named like a cb_params field.

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
        device: str | torch.device | None = None,
    ) -> None:
        _class_hint("network", network, "an nn.Module")
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"'network' must be a torch.nn.Module, but got {network!r} with type "
                f"'{type(network).__name__}'."
            )
        _class_hint("loss_fn", loss_fn, "a loss function or nn.Module")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"'loss_fn' must be a callable loss_fn(output, label) or None, but got "
                f"{loss_fn!r} with type '{type(loss_fn).__name__}'."
            )
        _class_hint("optimizer", optimizer, "a torch.optim.Optimizer")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"'optimizer' must be a torch.optim.Optimizer or None, but got {optimizer!r} "
                f"with type '{type(optimizer).__name__}'."
            )
        _class_hint("eval_network", eval_network, "an nn.Module")
        if eval_network is not None and not isinstance(eval_network, nn.Module):
            raise TypeError(
                f"'eval_network' must be a torch.nn.Module or None, but got {eval_network!r} "
                f"with type '{type(eval_network).__name__}'."
            )
        self._device = _resolve_device(device)
        self._metric_fns = build_metrics(metrics)
        clash = sorted(set(self._metric_fns) & _RESERVED)
        if clash:
            raise ValueError(
                f"'metrics' names {clash} clash with cb_params fields; use other names, e.g. "
                f"{{'my_{clash[0]}': ...}}."
            )
        self._network = network.to(self._device)
        self._loss_fn = loss_fn.to(self._device) if isinstance(loss_fn, nn.Module) else loss_fn
        self._optimizer = optimizer
        self._eval_network = eval_network.to(self._device) if eval_network is not None else None
        # Training-batch metrics accumulate in their own copies so validation never mixes in.
        self._train_metric_fns = {
            name: copy.deepcopy(m)
            for name, m in self._metric_fns.items()
            if not getattr(m, "uses_loss", False)
        }

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
    def metrics(self) -> dict[str, Any]:
        return dict(self._metric_fns)

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

    def _check_batch(self, batch: Any, argname: str) -> None:
        if self._loss_fn is None and argname == "train_dataset":
            return
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            got = (
                f"{len(batch)} columns"
                if isinstance(batch, (tuple, list))
                else (f"a {type(batch).__name__}")
            )
            raise ValueError(
                f"each batch of '{argname}' must be (data, label) when loss_fn is set, but got "
                f"{got}. Make the dataset yield (data, label) pairs, or use loss_fn=None with a "
                "network that computes its own loss."
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
    ) -> None:
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

        Raises:
            TypeError / ValueError: bad arguments, an empty dataset, a batch that is not
                ``(data, label)`` when ``loss_fn`` is set, or no optimizer.
        """
        self._run(
            epoch,
            train_dataset,
            callbacks,
            None,
            1,
            dataset_sink_mode,
            sink_size,
            initial_epoch,
            resume_from,
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
    ) -> None:
        """Train, validating on ``valid_dataset`` after every ``valid_frequency`` epochs.

        Validation runs after the epoch's last step and before ``on_train_epoch_end``; its
        results are ``cb_params.eval_results`` (the metrics plus ``eval_loss``) from
        ``on_eval_end`` through ``on_train_epoch_end``.

        Args:
            valid_frequency: an int k (validate every k epochs) or a list of epoch numbers.
            Others (``resume_from`` too) as in :meth:`train`.
        """
        check_bool("valid_dataset_sink_mode", valid_dataset_sink_mode)
        self._check_valid_frequency(valid_frequency)
        if valid_dataset is not None:
            self._check_eval_ready("fit")
            dataset_size(valid_dataset, "valid_dataset")
        self._run(
            epoch,
            train_dataset,
            callbacks,
            valid_dataset,
            valid_frequency,
            dataset_sink_mode,
            sink_size,
            initial_epoch,
            resume_from,
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
        cb_list = CallbackList(normalize_callbacks(callbacks))
        self._check_eval_ready("eval")
        batch_num = dataset_size(valid_dataset, "valid_dataset")
        self._check_first_batch(valid_dataset, "valid_dataset")
        rank, world = _dist_info()
        cb_params = self._new_cb_params(cb_list, rank, world)
        cb_params.cur_epoch_num = 1
        cb_params.epoch_num = 1
        cb_params.batch_num = batch_num
        run_context = RunContext(cb_params)
        with cb_list.entered():
            metrics, _ = self._eval_pass(valid_dataset, batch_num, cb_list, cb_params, run_context)
        return metrics

    def predict(self, *inputs: Any) -> Any:
        """Run the eval network on ``inputs`` without gradients and return its output."""
        net = self.eval_network
        was_training = net.training
        net.eval()
        try:
            with torch.no_grad():
                return _call(net, _move(tuple(inputs), self._device))
        finally:
            net.train(was_training)

    # -- internals ------------------------------------------------------------------------
    def _check_first_batch(self, dataset: Any, argname: str) -> None:
        batch = first_batch(dataset)
        if batch is not None:
            self._check_batch(batch, argname)

    def _new_cb_params(self, cb_list: CallbackList, rank: int, world: int) -> CallbackParams:
        return CallbackParams(
            train_network=self._network,
            network=self._network,
            eval_network=self.eval_network,
            loss_fn=self._loss_fn,
            optimizer=self._optimizer,
            metrics=self._metric_fns,
            device=self._device,
            rank_id=rank,
            device_number=world,
            parallel_mode="data_parallel" if world > 1 else "stand_alone",
            list_callback=cb_list,
            mode="eval",
            cur_step_num=0,
            cur_epoch_num=0,
            last_save_ckpt_step=None,
            latest_ckpt_file=None,
            step_time=0.0,
        )

    def _run(
        self,
        epoch: int,
        train_dataset: Iterable[Any],
        callbacks: Any,
        valid_dataset: Iterable[Any] | None,
        valid_frequency: int | list[int],
        dataset_sink_mode: bool,
        sink_size: int,
        initial_epoch: int,
        resume_from: str | os.PathLike[str] | None,
    ) -> None:
        self._check_epochs(epoch, initial_epoch)
        self._check_sink(dataset_sink_mode, sink_size)
        cb_list = CallbackList(normalize_callbacks(callbacks))
        check_state_keys(cb_list)
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
        batch_num = dataset_size(train_dataset, "train_dataset")
        self._check_first_batch(train_dataset, "train_dataset")
        sinking = dataset_sink_mode and sink_size > 0
        steps_per_epoch = sink_size if sinking else batch_num
        rank, world = _dist_info()

        cb_params = self._new_cb_params(cb_list, rank, world)
        cb_params.mode = "train"
        cb_params.epoch_num = epoch - initial_epoch
        cb_params.initial_epoch = initial_epoch
        cb_params.batch_num = steps_per_epoch
        cb_params.initial_step = initial_epoch * steps_per_epoch
        cb_params.cur_step_num = cb_params.initial_step
        cb_params.cur_epoch_num = initial_epoch
        cb_params.train_dataset = train_dataset
        cb_params.dataset_sink_mode = dataset_sink_mode
        if valid_dataset is not None:
            cb_params.valid_dataset = valid_dataset
        run_context = RunContext(cb_params)
        source = _ContinuingBatches(train_dataset) if sinking else None

        resume = self._load_resume_point(resume_from, cb_list, epoch)
        skip = 0
        if resume is not None:
            initial_epoch, skip = resume["initial_epoch"], resume["skip"]
            if initial_epoch >= epoch:
                logger.info(
                    "nothing to train: the checkpoint is at epoch %d of %d", initial_epoch, epoch
                )
                return
            cb_params.epoch_num = epoch - initial_epoch
            cb_params.initial_epoch = initial_epoch
            cb_params.initial_step = resume["step"] - skip
            # Steps continue from the checkpoint; the skipped batches were trained before it.
            cb_params.cur_step_num = resume["step"]
            cb_params.cur_epoch_num = initial_epoch

        cb_params._trained_step = cb_params.cur_step_num
        with cb_list.entered():
            cb_list.call("on_train_begin", run_context)
            if resume is not None:
                # After on_train_begin, which resets callbacks: the saved state wins.
                load_checkpoint_states(resume["state"], cb_list)
            for epoch_index in range(initial_epoch, epoch):
                cb_params.cur_epoch_num = epoch_index + 1
                cb_params.loss = None
                if skip:
                    assert resume is not None
                    set_rng_state(resume["state"]["epoch_rng"])
                cb_params._epoch_start_rng = rng_state()
                set_epoch(train_dataset, epoch_index)
                cb_list.call("on_train_epoch_begin", run_context)
                batches: Iterable[Any] = (
                    itertools.islice(source, steps_per_epoch)
                    if source is not None
                    else train_dataset
                )
                if skip:
                    assert resume is not None
                    batches = _skip_then_restore(batches, skip, resume["state"]["rng"])
                    skip = 0
                train_results = self._train_epoch(batches, cb_list, cb_params, run_context)
                cb_params.train_results = train_results
                cb_params.loss = train_results.get("loss")
                for name, value in train_results.items():
                    if name != "loss":
                        setattr(cb_params, name, value)
                if valid_dataset is not None and self._should_eval(
                    epoch_index + 1, valid_frequency
                ):
                    self._eval_in_fit(valid_dataset, cb_list, cb_params, run_context)
                cb_list.call("on_train_epoch_end", run_context)
                for name in train_results:
                    if name != "loss":
                        cb_params.__dict__.pop(name, None)
                cb_params.__dict__.pop("eval_results", None)
                if run_context.get_stop_requested():
                    break
            cb_list.call("on_train_end", run_context)
        if run_context.get_stop_requested():
            reason = run_context.stop_reason or "a callback requested a stop"
            logger.info(
                "training stopped at epoch %d, step %d: %s",
                cb_params.cur_epoch_num,
                cb_params.cur_step_num,
                reason,
            )

    def _load_resume_point(
        self, resume_from: Any, cb_list: CallbackList, epoch: int
    ) -> dict[str, Any] | None:
        """Restore the network, optimizer and RNG from a checkpoint; say where to continue."""
        explicit = resume_from is not None
        if not explicit:
            for cb in cb_list:
                finder = getattr(cb, "resume_checkpoint", None)
                if callable(finder) and (found := finder()) is not None:
                    resume_from = found
                    break
        if resume_from is None:
            return None
        state = load_checkpoint(resume_from, self)
        if "epoch" not in state:
            raise ValueError(
                f"{str(resume_from)!r} holds weights only (written by save_checkpoint); resuming "
                "needs a checkpoint from ModelCheckpoint, BackupAndRestore or OnRequestExit."
            )
        if state["epoch_complete"] or state["step_in_epoch"] >= state["batch_num"]:
            initial_epoch, skip = state["epoch"], 0
        else:
            initial_epoch, skip = state["epoch"] - 1, state["step_in_epoch"]
        if explicit and initial_epoch >= epoch:
            raise ValueError(
                f"'resume_from' checkpoint {str(resume_from)!r} is at epoch {state['epoch']}; "
                f"'epoch' must be larger than that to train more, but got {epoch}."
            )
        if not skip or state.get("epoch_rng") is None:
            set_rng_state(state["rng"])
            skip = 0 if state.get("epoch_rng") is None else skip
        logger.info(
            "resuming from %s at epoch %d, step %d", resume_from, state["epoch"], state["step"]
        )
        return {"state": state, "initial_epoch": initial_epoch, "skip": skip, "step": state["step"]}

    @staticmethod
    def _should_eval(epoch_number: int, valid_frequency: int | list[int]) -> bool:
        if isinstance(valid_frequency, list):
            return epoch_number in valid_frequency
        return epoch_number % valid_frequency == 0

    def _train_epoch(
        self,
        batches: Iterable[Any],
        cb_list: CallbackList,
        cb_params: CallbackParams,
        run_context: RunContext,
    ) -> dict[str, Any]:
        network, loss_fn, optimizer, device = (
            self._network,
            self._loss_fn,
            self._optimizer,
            self._device,
        )
        assert optimizer is not None
        step_begin = cb_list.fns["on_train_step_begin"]
        step_end = cb_list.fns["on_train_step_end"]
        train_metrics = list(self._train_metric_fns.values()) if loss_fn is not None else []
        for metric in train_metrics:
            metric.clear()
        pending: list[torch.Tensor] = []
        total: torch.Tensor | None = None
        first_step = step = cb_params.cur_step_num
        perf_counter = time.perf_counter
        network.train()
        on_cpu = device.type == "cpu"
        tensor = torch.Tensor
        # With no step hooks nobody can look at cb_params during the epoch: its per-step
        # fields are then set once, after the loop, and the loop does only the training.
        hooked = bool(step_begin or step_end)
        epoch_start = last_step_end = perf_counter()
        batch: Any = None
        detached: Any = None
        outputs: Any = None
        try:
            for batch in batches:
                step += 1
                if hooked:
                    cb_params.cur_step_num = step
                    cb_params.train_dataset_element = batch
                    for fn in step_begin:
                        fn(run_context)
                # Zero at the start of the step so step-end hooks can still read the gradients.
                optimizer.zero_grad(set_to_none=True)
                if loss_fn is not None:
                    try:
                        data, label = batch
                    except (TypeError, ValueError):
                        self._check_batch(batch, "train_dataset")
                        raise
                    # Plain CPU tensors on a CPU run need no copy: skip the .to() calls.
                    if not (on_cpu and type(data) is tensor and data.is_cpu):
                        data = _move(data, device)
                    if not (on_cpu and type(label) is tensor and label.is_cpu):
                        label = _move(label, device)
                    outputs = network(data) if type(data) is tensor else _call(network, data)
                    loss = loss_fn(outputs, label)
                else:
                    loss, outputs = _split_loss(_call(network, _move(batch, device)))
                loss.backward()
                optimizer.step()
                detached = loss.detach()
                pending.append(detached)
                if len(pending) == _LOSS_CHUNK:
                    total = _fold(total, pending)
                if train_metrics:
                    for metric in train_metrics:
                        metric.update(outputs, label)
                if hooked:
                    cb_params.step_time = perf_counter() - last_step_end
                    cb_params._trained_step = step
                    cb_params._raw_net_outputs = detached
                    cb_params._raw_outputs = (
                        outputs.detach() if type(outputs) is tensor else outputs
                    )
                    for fn in step_end:
                        fn(run_context)
                    last_step_end = perf_counter()  # the hooks' time is not the next step's
                    if run_context._stop_requested:
                        break
        except BaseException as exc:
            cb_list.annotate(exc)  # names the callback, if one raised it
            raise
        steps = step - first_step
        if steps and not hooked:
            cb_params.cur_step_num = cb_params._trained_step = step
            cb_params.train_dataset_element = batch
            cb_params.step_time = (perf_counter() - epoch_start) / steps
            cb_params._raw_net_outputs = detached
            cb_params._raw_outputs = outputs.detach() if type(outputs) is tensor else outputs
        total = _fold(total, pending)
        results: dict[str, Any] = {}
        if total is not None and steps:
            results["loss"] = float(total) / steps
        for name, metric in self._train_metric_fns.items():
            if loss_fn is not None and steps:
                results[name] = _to_python(metric.eval())
        return results

    def _eval_in_fit(
        self,
        valid_dataset: Iterable[Any],
        cb_list: CallbackList,
        cb_params: CallbackParams,
        run_context: RunContext,
    ) -> None:
        # Validation shares cb_params with training; the training counters come back after.
        saved = {
            k: cb_params.__dict__[k]
            for k in ("mode", "cur_step_num", "batch_num", "_raw_net_outputs", "_raw_outputs")
        }
        saved_loss = cb_params._epoch_loss
        cb_params.loss = None
        batch_num = dataset_size(valid_dataset, "valid_dataset")
        cb_params.batch_num = batch_num
        cb_params.cur_step_num = 0
        try:
            self._eval_pass(valid_dataset, batch_num, cb_list, cb_params, run_context)
        finally:
            cb_params.__dict__.update(saved)
            cb_params.loss = saved_loss
            cb_params.mode = "train"

    def _eval_pass(
        self,
        dataset: Iterable[Any],
        batch_num: int,
        cb_list: CallbackList,
        cb_params: CallbackParams,
        run_context: RunContext,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        network = self.eval_network
        loss_fn, device = self._loss_fn, self._device
        cb_params.mode = "eval"
        cb_params.valid_dataset = dataset
        cb_params.batch_num = batch_num
        step_begin = cb_list.table["on_eval_step_begin"]
        step_end = cb_list.table["on_eval_step_end"]
        call = cb_list.call
        metric_items = list(self._metric_fns.values())
        for metric in metric_items:
            metric.clear()
        pending: list[torch.Tensor] = []
        total: torch.Tensor | None = None
        steps = 0
        was_training = network.training
        network.eval()
        try:
            call("on_eval_begin", run_context)
            call("on_eval_epoch_begin", run_context)
            with torch.no_grad():
                for batch in dataset:
                    steps += 1
                    cb_params.cur_step_num = steps
                    cb_params.eval_dataset_element = batch
                    if step_begin:
                        call("on_eval_step_begin", run_context)
                    try:
                        data, label = batch
                    except (TypeError, ValueError):
                        self._check_batch(batch, "valid_dataset")
                        raise
                    data, label = _move(data, device), _move(label, device)
                    outputs = _call(network, data)
                    loss = loss_fn(outputs, label) if loss_fn is not None else None
                    for metric in metric_items:
                        if getattr(metric, "uses_loss", False):
                            if loss is not None:
                                metric.update(loss)
                        else:
                            metric.update(outputs, label)
                    if loss is not None:
                        pending.append(loss)
                        if len(pending) == _LOSS_CHUNK:
                            total = _fold(total, pending)
                    cb_params._raw_net_outputs = loss if loss is not None else outputs
                    cb_params._raw_outputs = outputs  # computed under no_grad: no graph
                    if step_end:
                        call("on_eval_step_end", run_context)
            call("on_eval_epoch_end", run_context)
            metrics = {name: _to_python(m.eval()) for name, m in self._metric_fns.items()}
            results = dict(metrics)
            total = _fold(total, pending)
            if total is not None and steps:
                results["eval_loss"] = float(total) / steps
            cb_params.eval_results = results
            call("on_eval_end", run_context)
        finally:
            network.train(was_training)
        return metrics, results


def _skip_then_restore(batches: Iterable[Any], skip: int, rng: dict[str, Any]) -> Iterator[Any]:
    """Drop the first ``skip`` batches (done before the checkpoint), then restore the RNG."""
    iterator = iter(batches)
    for _ in range(skip):
        next(iterator, None)
    set_rng_state(rng)
    yield from iterator


class _ContinuingBatches:
    """Batches that continue across epochs, restarting the dataset when it runs out."""

    def __init__(self, dataset: Iterable[Any]) -> None:
        self._dataset = dataset
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._it is not None:
            try:
                return next(self._it)
            except StopIteration:
                pass
        self._it = iter(self._dataset)
        return next(self._it)
