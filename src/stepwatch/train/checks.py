"""Checks made before training starts, so a mistake is a clear error at the door rather than a
raw torch error at step 1 (or, worse, silent garbage).

* :func:`check_optimizer`: the optimizer must update the network's own parameters.
* :func:`check_first_forward`: one forward pass on the first batch (no gradients, the random
  generators untouched; torch's own loss modules are called once, a loss function of the
  user's is not) checks the labels against the outputs for the loss and the metrics:
  a regression label ``(N,)`` against an output ``(N, 1)`` broadcasts to an ``(N, N)`` loss
  and trains to garbage; class labels of the wrong shape, type or range fail deep in torch.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import torch
from torch import nn

from ..context import default_device as context_device
from ..dataset import NumpySlicesDataset, check_batch, feed, move
from ..distributed import is_distributed, local_rank
from .sharded import reshard
from .state import rng_state, set_rng_state
from .step import StepOptions, cast_floats

__all__ = [
    "RESERVED",
    "check_first_forward",
    "check_optimizer",
    "class_hint",
    "resolve_device",
]

_CLASS_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)
_SAME_SHAPE_LOSSES = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
)


def check_optimizer(network: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError when ``optimizer`` updates none of ``network``'s parameters."""
    own = {id(p) for p in network.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params and own and not any(id(p) in own for p in params):
        raise ValueError(
            "'optimizer' updates none of the network's parameters, so training would change "
            "nothing: build it from this network, e.g. torch.optim.SGD(network.parameters(), "
            "lr=0.1) (was it made for another network, or for a copy of this one?)."
        )


def sample_batch(dataset: Any) -> Any:
    """The first batch of ``dataset`` when it can be had without side effects, else None."""
    if isinstance(dataset, (list, tuple)):
        return dataset[0] if dataset else None
    if isinstance(dataset, NumpySlicesDataset):
        return next(iter(dataset), None)  # a shuffle draws from the generators: restored after
    inner = getattr(dataset, "dataset", None)
    collate = getattr(dataset, "collate_fn", None)
    batch_size = getattr(dataset, "batch_size", None)
    if (
        isinstance(dataset, torch.utils.data.DataLoader)
        and isinstance(inner, torch.utils.data.Dataset)
        and not isinstance(inner, torch.utils.data.IterableDataset)
        and callable(collate)
        and batch_size
    ):
        try:
            n = min(int(batch_size), len(inner))  # type: ignore[arg-type]
            return collate([inner[i] for i in range(n)])
        except Exception:  # a dataset that cannot be indexed this way: skip the check
            return None
    return None


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return str(tuple(shape)) if shape is not None else type(value).__name__


def _check_class_labels(outputs: torch.Tensor, label: torch.Tensor, loss_fn: Any) -> None:
    name = type(loss_fn).__name__
    if label.is_floating_point() and label.shape == outputs.shape:
        return  # class probabilities: allowed by CrossEntropyLoss
    expected = (outputs.shape[0], *outputs.shape[2:])
    if label.shape != expected:
        hint = (
            "squeeze the label column: labels.squeeze(1)"
            if label.ndim == outputs.ndim and label.shape[-1:] == (1,)
            else f"give one class index per sample, shape {tuple(expected)}"
        )
        raise ValueError(
            f"labels {_shape(label)} vs outputs {_shape(outputs)}: {name} wants class indices "
            f"of shape {tuple(expected)}; {hint}."
        )
    if label.is_floating_point():
        raise ValueError(
            f"labels {_shape(label)} are {label.dtype}, but {name} wants integer class indices: "
            "convert them with labels.long() (or pass class probabilities of the outputs' "
            "shape)."
        )
    classes = outputs.shape[1] if outputs.ndim > 1 else 0
    ignore = getattr(loss_fn, "ignore_index", None)
    valid = label[label != ignore] if ignore is not None else label
    if classes and valid.numel():
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or high >= classes:
            bad = high if high >= classes else low
            raise ValueError(
                f"label {bad} is out of range for outputs {_shape(outputs)} with {classes} "
                f"classes: labels must be in 0..{classes - 1} (does the last layer have one "
                "output per class?)."
            )


def _check_loss(outputs: Any, label: Any, loss_fn: Any) -> None:
    if not isinstance(outputs, torch.Tensor) or not isinstance(label, torch.Tensor):
        return
    if isinstance(loss_fn, _CLASS_LOSSES):
        _check_class_labels(outputs, label, loss_fn)
    elif isinstance(loss_fn, _SAME_SHAPE_LOSSES) and label.shape != outputs.shape:
        raise ValueError(
            f"labels {_shape(label)} vs outputs {_shape(outputs)}: {type(loss_fn).__name__} "
            "needs the same shape (it would broadcast and train on the wrong pairs); reshape "
            f"the labels to {tuple(outputs.shape)} (e.g. labels.reshape(-1, 1)) or squeeze "
            "the output."
        )


def _is_torch_loss(loss_fn: Any) -> bool:
    """One of torch's own loss modules: a pure function of its inputs, safe to call once more."""
    return isinstance(loss_fn, nn.Module) and type(loss_fn).__module__.startswith("torch.nn.")


def _check_metrics(outputs: Any, label: Any, loss: Any, metrics: dict[str, Any]) -> None:
    for name, metric in metrics.items():
        if loss is None and getattr(metric, "uses_loss", False):
            continue
        trial = copy.deepcopy(metric)
        try:
            trial.clear()
            if getattr(trial, "uses_loss", False):
                trial.update(loss)
            else:
                trial.update(outputs, label)
        except Exception as exc:
            raise ValueError(
                f"metric {name!r} ({type(metric).__name__}) cannot use outputs {_shape(outputs)} "
                f"with labels {_shape(label)}: {exc}. Pick metrics that fit the task "
                "('accuracy' for class scores, 'mae'/'mse' for outputs shaped like the labels)."
            ) from exc


def check_first_forward(
    network: nn.Module,
    loss_fn: Any,
    metrics: dict[str, Any],
    dataset: Any,
    device: Any,
    step: StepOptions | None = None,
    argname: str = "train_dataset",
) -> None:
    """Run the first batch through ``network`` and ``loss_fn`` and check labels and outputs.

    Nothing is trained: no gradients, the network in eval mode, and every random generator
    restored afterwards, so the run is the same as without the check.

    Raises:
        ValueError: labels that do not fit the outputs for the loss or a metric, naming the
            shapes and the fix; a batch that is not ``(data, label)`` with a loss function;
            with none, a training batch the network's ``forward`` cannot take.
    """
    state = rng_state()
    try:
        batch = sample_batch(dataset)
        if loss_fn is None:
            if batch is not None and argname == "train_dataset":
                _check_takes_batch(network, batch)
            return
        if batch is not None:
            check_batch(batch, argname, True)  # a dict (as a Hugging Face loader's) or 3 columns
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            return
        data, label = move(batch[0], device), move(batch[1], device)
        step = step if step is not None else StepOptions()
        if step.precision.cast_network and step.precision.dtype is not None:
            data = cast_floats(data, step.precision.dtype)
        amp = step.autocast(torch.device(device))
        was_training = network.training
        network.eval()
        try:
            with torch.no_grad(), amp:
                outputs = feed(network, data)
                _check_loss(outputs, label, loss_fn)
                if not _is_torch_loss(loss_fn):
                    # A loss of the user's own may count its calls or log: not called here.
                    _check_metrics(outputs, label, None, metrics)
                    return
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)
                    try:
                        loss = loss_fn(outputs, label)
                    except UserWarning as warning:  # torch's "target size ... broadcasting"
                        raise ValueError(
                            f"labels {_shape(label)} vs outputs {_shape(outputs)}: {warning}"
                        ) from None
                    except (RuntimeError, IndexError, ValueError) as exc:
                        raise ValueError(
                            f"the loss cannot take labels {_shape(label)} with outputs "
                            f"{_shape(outputs)}: {exc}"
                        ) from exc
                _check_metrics(outputs, label, loss, metrics)
        finally:
            network.train(was_training)
            reshard(network)  # FSDP2 leaves a root module's parameters gathered after it
    finally:
        set_rng_state(state)


def _check_takes_batch(network: nn.Module, batch: Any) -> None:
    """With no loss function, each batch goes to the network whole (spread, or by name):
    refuse one its ``forward`` cannot take."""
    try:
        signature = inspect.signature(network.forward)
    except (TypeError, ValueError):
        return
    try:
        if isinstance(batch, (tuple, list)):
            signature.bind(*batch)
        elif isinstance(batch, dict):
            signature.bind(**batch)
        else:
            signature.bind(batch)
    except TypeError as exc:
        columns = f"{len(batch)} columns" if isinstance(batch, (tuple, list, dict)) else "one"
        raise ValueError(
            f"the Model has no loss_fn, so each batch ({columns}) goes to the network, which "
            f"must return the loss; but {type(network).__name__}.forward cannot take it "
            f"({exc}). Pass Model(network, loss_fn, optimizer) (e.g. loss_fn="
            "nn.CrossEntropyLoss()), or a network that takes the batch and returns its loss."
        ) from None


# Names a metric may not take, because cb_params already uses them.
RESERVED = frozenset(
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
        "local_rank",
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


def check_schedule(step: Any, epochs: int, batch_num: int) -> None:
    """Refuse (or warn about) a plan the step options cannot follow, before training starts:
    an accumulation window longer than the epoch, and a per-step LR schedule with a fixed
    length (``OneCycleLR(total_steps=...)``) shorter than the run's optimizer steps (torch
    would fail mid-epoch with "Tried to step N times")."""
    accumulate = step.accumulate
    if accumulate > batch_num:
        warnings.warn(
            f"accumulate_grad_batches={accumulate} is larger than the epoch ({batch_num} "
            f"batches): the optimizer steps once an epoch, on {batch_num} batches' gradients "
            f"scaled by 1/{accumulate}. Pass accumulate_grad_batches <= the batches per epoch.",
            UserWarning,
            stacklevel=4,
        )
    scheduler = step.lr_scheduler
    total = getattr(scheduler, "total_steps", None)
    if scheduler is None or step.lr_interval != "step" or not isinstance(total, int):
        return
    per_epoch = -(-batch_num // accumulate)  # optimizer steps: a window's end and the epoch's
    needed = epochs * per_epoch
    done = int(getattr(scheduler, "last_epoch", 0) or 0)  # steps it has already taken
    if done + needed > total:
        raise ValueError(
            f"the lr_scheduler {type(scheduler).__name__} lasts total_steps={total} steps "
            f"({total - done} left), but this run takes {needed} optimizer steps ({epochs} "
            f"epochs x {per_epoch}); build it with total_steps={done + needed} (or "
            f"epochs={epochs}, steps_per_epoch={per_epoch})."
        )


def resolve_device(device: Any) -> torch.device:
    if device is None:
        chosen = context_device()  # set_context(device_target=...), as in MindSpore
        if chosen is not None:
            kind, index = chosen
            if kind == "cuda" and index is None and is_distributed():
                index = local_rank()
            return torch.device(kind, index) if index is not None else torch.device(kind)
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # One GPU per process in a distributed run: this machine's LOCAL_RANK-th.
        return torch.device("cuda", local_rank()) if is_distributed() else torch.device("cuda")
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"'device' must name a torch device such as 'cpu' or 'cuda:0', but got {device!r}."
            ) from exc
    if isinstance(device, torch.device):
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"'device' is {str(device)!r}, but this PyTorch sees no CUDA GPU (a CPU-only "
                "build, or no GPU on this machine); pass device='cpu', or None to pick what "
                "is there."
            )
        if device.type == "cuda" and device.index is not None:
            count = torch.cuda.device_count()
            if device.index >= count:
                raise ValueError(
                    f"'device' is {str(device)!r}, but there are {count} CUDA devices "
                    f"(cuda:0..cuda:{count - 1})."
                )
        return device
    raise TypeError(
        f"'device' must be None, a str or a torch.device, but got {device!r} with type "
        f"'{type(device).__name__}'."
    )


def is_dataset(value: Any) -> bool:
    """A dataset of batches, as ``predict`` accepts it (not a tensor or array of inputs)."""
    if isinstance(value, (torch.utils.data.DataLoader, NumpySlicesDataset)):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(b, tuple) for b in value)


def data_of(batch: Any) -> Any:
    """The input part of a batch: ``data`` of ``(data, label)``, else the batch."""
    if isinstance(batch, (tuple, list)) and len(batch) in (1, 2):
        return batch[0]
    return batch


def class_hint(name: str, value: Any, what: str) -> None:
    if inspect.isclass(value):
        raise TypeError(
            f"'{name}' must be {what} instance, but got the class {value.__name__}: pass "
            f"{value.__name__}(...) instead."
        )
