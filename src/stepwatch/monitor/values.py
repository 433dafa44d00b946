"""What the values of a run are called, where the store keeps them, and which way is better.

One name means one thing everywhere: in ``History.history``, in the run store, in
``EarlyStopping(monitor=...)`` / ``ReduceLROnPlateau`` / best-only ``ModelCheckpoint``, in the
CLI and in anything built on them. This module is the single place that decides it, and it
imports nothing heavier than the standard library.

Epoch values (one per epoch; the store key is the name):

=====================  ======================================================  =========
name                   meaning                                                 better
=====================  ======================================================  =========
``loss``               mean training loss of the epoch                         min
``train_<metric>``     a model metric on the epoch's training batches          metric's
``eval_loss``          mean validation loss (``fit`` with validation)          min
``eval_<metric>``      a model metric on the validation set                    metric's
``<metric>``           alias: ``eval_<metric>`` in a ``fit`` that validates,   metric's
                       ``train_<metric>`` otherwise (never stored)
=====================  ======================================================  =========

Step values (recorded every few steps): ``step_loss`` (the step's training loss),
``step_time`` (seconds per step), ``lr`` (first parameter group's learning rate), and with loss
scaling ``loss_scale`` and ``skipped_steps`` (optimizer steps skipped on an overflow, so far);
with ``FlopsUtilizationCollector`` ``flops_per_step``, ``mfu`` (model FLOPs utilization, a
fraction) and ``samples_per_second`` or ``tokens_per_second`` (the whole job's throughput).

"Better" comes from the metric when it declares it (``Metric.direction``, ``'min'`` or
``'max'``), otherwise from the name: names holding a loss/error word are minimised, ``lr``
and other settings have no direction, everything else is maximised.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

__all__ = [
    "EVAL_LOSS",
    "FLOPS_PER_STEP",
    "LOSS",
    "LOSS_SCALE",
    "LR",
    "MFU",
    "SAMPLES_PER_SECOND",
    "SKIPPED_STEPS",
    "STEP_LOSS",
    "STEP_TIME",
    "TOKENS_PER_SECOND",
    "Direction",
    "direction",
    "epoch_values",
    "eval_name",
    "from_host",
    "metric_directions",
    "panel_of",
    "panel_order",
    "train_name",
]

Direction = Literal["min", "max"]

LOSS = "loss"
EVAL_LOSS = "eval_loss"
STEP_LOSS = "step_loss"
STEP_TIME = "step_time"
LR = "lr"
LOSS_SCALE = "loss_scale"
SKIPPED_STEPS = "skipped_steps"
FLOPS_PER_STEP = "flops_per_step"
MFU = "mfu"
SAMPLES_PER_SECOND = "samples_per_second"
TOKENS_PER_SECOND = "tokens_per_second"

# Substrings of a name for which smaller is better.
_SMALLER_IS_BETTER = (
    "loss",
    "error",
    "mae",
    "mse",
    "rmse",
    "perplexity",
    "ppl",
    "time",
    "seconds",
    "latency",
    "skipped",
)
# Whole words for which smaller is better: error rates by their initials (word, character,
# translation error rate), error counts, negative log-likelihood, KL divergence.
_ERROR_RATES = frozenset({"wer", "cer", "ter", "err", "errs", "nll", "kl", "kld"})
# Names that are settings or counters, not results: no "better" direction.
_NO_DIRECTION = frozenset({"lr", "loss_scale", "epoch", "step", "grad_norm"})
_PREFIXES = ("train_", "eval_")


def train_name(metric: str) -> str:
    """The epoch value name of a model metric measured on the training batches."""
    return f"train_{metric}"


def eval_name(metric: str) -> str:
    """The epoch value name of a validation result (``'loss'`` and ``'eval_loss'`` give
    ``'eval_loss'``)."""
    return metric if metric.startswith("eval_") else f"eval_{metric}"


_HOST_EVAL = ("val_", "valid_", "validation_", "eval_", "test_")
_HOST_TRAIN = ("train_",)
# Short names hosts' users log for the same value: one name each, so that runs from different
# hosts land on one chart (Lightning's ``val_acc`` beside Keras's ``val_accuracy``).
_HOST_SHORT = {"acc": "accuracy"}


def from_host(name: str) -> str:
    """The stepwatch name of a value another trainer logged: ``val_loss``, ``valid_loss``,
    ``val/loss`` and ``eval_loss`` are ``eval_loss``; ``val_acc`` and ``val_accuracy`` are
    ``eval_accuracy``; ``train_loss`` and ``train/loss`` are ``loss``; ``train_acc`` is
    ``train_accuracy``; any other name is taken as a training value (``acc`` ->
    ``train_accuracy``; ``loss`` stays)."""
    flat = name.replace("/", "_").replace(".", "_")
    for prefix in _HOST_EVAL:
        if flat.startswith(prefix) and len(flat) > len(prefix):
            return eval_name(_HOST_SHORT.get(flat[len(prefix) :], flat[len(prefix) :]))
    for prefix in _HOST_TRAIN:
        if flat.startswith(prefix) and len(flat) > len(prefix):
            flat = flat[len(prefix) :]
            break
    return flat if flat == LOSS else train_name(_HOST_SHORT.get(flat, flat))


def _base(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def direction(name: str, declared: Mapping[str, Any] | None = None) -> Direction | None:
    """``'min'``, ``'max'`` or None (no better direction) for the value called ``name``.

    Args:
        name: an epoch or step value name (``'eval_accuracy'``, ``'loss'``, ``'lr'``, ...).
        declared: metric name → direction as the metrics declare it (see
            :func:`metric_directions`); it wins over the name rule.
    """
    if name.startswith("system/"):
        return None  # the machine's readings (CPU, memory, GPU): no better direction
    head, _, tail = name.rpartition("/")
    if head and tail.isdigit():
        name = head  # a per-class key (eval_precision/3) has its metric's direction
    name = name.replace("/", "_")  # a host's grouped name: train/loss, dist/step_time_max
    base = _base(name)
    if declared:
        for key in (name, base):
            found = declared.get(key)
            if found in ("min", "max"):
                return found
    lowered = base.lower()
    if lowered in _NO_DIRECTION:
        return None
    if any(word in lowered for word in _SMALLER_IS_BETTER):
        return "min"
    if _ERROR_RATES.intersection(re.split(r"[_.\-]", lowered)):
        return "min"
    return "max"


def metric_directions(metrics: Mapping[str, Any]) -> dict[str, Direction]:
    """``{name: 'min'|'max'}`` for the metrics that declare a ``direction`` attribute."""
    found: dict[str, Direction] = {}
    for name, metric in metrics.items():
        value = getattr(metric, "direction", None)
        if value in ("min", "max"):
            found[name] = value
    return found


_LOSS_KEYS = frozenset({STEP_LOSS, LOSS, EVAL_LOSS, "epoch_loss"})
LR_PANEL = "learning rate"


def panel_of(key: str) -> str:
    """The chart a value is drawn in (PNG plots and the dashboard alike): ``loss`` for every
    loss, ``learning rate``, else the metric's base name (``eval_accuracy`` and
    ``train_accuracy`` share ``accuracy``; ``eval_precision/3`` is ``precision``)."""
    if key in _LOSS_KEYS:
        return "loss"
    if key == LR:
        return LR_PANEL
    return _base(key.split("/", 1)[0])


def panel_order(panel: str) -> tuple[int, str]:
    """Sort key of the charts: the loss first, the learning rate last, the rest by name."""
    return (0 if panel == "loss" else 2 if panel == LR_PANEL else 1, panel)


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def epoch_values(
    train_results: Mapping[str, Any] | None,
    eval_results: Mapping[str, Any] | None,
    *,
    validates: bool,
    aliases: bool = True,
) -> dict[str, Any]:
    """The named values of one epoch.

    Args:
        train_results: the training results (``{'loss': ..., 'accuracy': ...}``: the epoch's
            mean loss and the model metrics on the training batches).
        eval_results: the validation results of this epoch, if it validated (MindSpore's
            ``eval_results``: the metrics, plus ``eval_loss``).
        validates: the run validates (a ``fit`` with a validation set); decides what a bare
            metric name means, for the whole run.
        aliases: include the bare metric names (for monitors and History); the store keeps
            only the full names.

    Values are returned as they are (floats, or arrays for per-class metrics).
    """
    values: dict[str, Any] = {}
    train_metrics: list[str] = []
    for name, value in (train_results or {}).items():
        if name == LOSS:
            values[LOSS] = value
        else:
            values[train_name(name)] = value
            train_metrics.append(name)
    eval_metrics: list[str] = []
    results = eval_results or {}
    for name, value in results.items():
        if name == LOSS and EVAL_LOSS in results:
            continue  # a 'loss' metric and the loop's eval_loss are the same quantity
        values[eval_name(name)] = value
        if name not in (LOSS, EVAL_LOSS):
            eval_metrics.append(name)
    if aliases:
        for name in eval_metrics if validates else train_metrics:
            values[name] = values[eval_name(name) if validates else train_name(name)]
    return values


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``values`` that are single numbers, as floats."""
    out: dict[str, float] = {}
    for name, value in values.items():
        number = _number(value)
        if number is not None:
            out[name] = number
    return out


def available(names: Iterable[str]) -> str:
    """A sorted, comma-separated list for error messages."""
    listed = sorted(names)
    return ", ".join(listed) if listed else "none"
