"""Metrics with MindSpore's ``clear()`` / ``update(*inputs)`` / ``eval()`` API.

Every built-in metric accumulates on the device the predictions live on: ``update`` only queues
tensor operations, and the one copy to the host happens in ``eval()``. Pass a name
(``'accuracy'``) or an instance to ``Model(metrics=...)``; any object with ``clear``, ``update``
and ``eval`` methods works as a custom metric.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from .._validation import UnknownNameError, check_choice, check_int

__all__ = [
    "MAE",
    "MSE",
    "Accuracy",
    "Loss",
    "Metric",
    "Precision",
    "Recall",
    "Top1CategoricalAccuracy",
    "Top5CategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "get_metric_fn",
    "names",
]


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple, int, float)):
        return torch.as_tensor(value)
    raise TypeError(
        f"metric input '{name}' must be a torch.Tensor or numpy array, but got "
        f"{type(value).__name__}."
    )


def _two_inputs(metric: Metric, inputs: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(inputs) != 2:
        raise ValueError(
            f"{type(metric).__name__}.update() needs 2 inputs (y_pred, y), but got {len(inputs)}."
        )
    y_pred, y = inputs
    if isinstance(y_pred, (tuple, list)) and y_pred and isinstance(y_pred[0], torch.Tensor):
        y_pred = y_pred[0]
    return _as_tensor(y_pred, "y_pred"), _as_tensor(y, "y")


def _class_predictions(y_pred: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted and true class indices for scores (N, C) and labels (N,) or one-hot (N, C).

    Scores of shape (N,) or (N, 1) with labels of the same shape are binary: a score above
    0.5 predicts class 1.
    """
    if y_pred.ndim == y.ndim + 1 and y_pred.shape[:-1] == y.shape:
        return y_pred.argmax(dim=-1), y
    if y_pred.shape == y.shape and y_pred.ndim >= 2 and y_pred.shape[-1] > 1:
        return y_pred.argmax(dim=-1), y.argmax(dim=-1)
    if y_pred.numel() == y.numel():
        return (y_pred.reshape(y.shape) > 0.5).long(), y.long()
    raise ValueError(
        "classification metrics expect y_pred of shape (N, C) with labels (N,) or one-hot "
        f"(N, C), or binary scores and labels of the same shape; got y_pred {tuple(y_pred.shape)} "
        f"and y {tuple(y.shape)}."
    )


class Metric:
    """Base class of metrics: ``clear()``, ``update(*inputs)``, ``eval()``.

    As in MindSpore, the base constructor does not call ``clear()`` (so a subclass may call
    ``super().__init__()`` before setting what its ``clear`` uses); the loops call ``clear()``
    before every pass. Built-in metrics also clear themselves when constructed.

    In a distributed run, a metric with ``reduce_state()`` (a list of tensors or numbers to sum
    over the ranks) and ``load_reduced_state(values)`` (the sums, float64 tensors of the same
    shapes) is reduced before ``eval()``, in the one collective of the epoch: every built-in
    metric has them, so its value is the global one on every rank. A metric without them
    reports its own rank's value (with a warning).

    Attributes:
        uses_loss: when True, the loop passes the batch loss to ``update`` instead of
            ``(y_pred, y)``.
        direction: ``'max'`` when larger values are better, ``'min'`` when smaller are, None
            when not declared (the value's name then decides; see
            :mod:`stepwatch.monitor.values`).
    """

    uses_loss = False
    direction: str | None = None

    def __init__(self) -> None:
        pass

    def clear(self) -> None:
        """Reset the accumulated state."""
        raise NotImplementedError

    def update(self, *inputs: Any) -> None:
        """Accumulate one batch."""
        raise NotImplementedError

    def eval(self) -> Any:
        """Return the metric over everything accumulated since ``clear()``."""
        raise NotImplementedError

    def _need_updates(self, count: int) -> None:
        if count == 0:
            raise RuntimeError(
                f"{type(self).__name__}.eval() needs at least one update() since clear()."
            )


class _Mean(Metric):
    """A sum over a count: both accumulate on the device the inputs live on (the sum a
    tensor, the count a host-side int), and one copy to the host happens in ``eval()``."""

    def __init__(self) -> None:
        super().__init__()
        self.clear()

    def clear(self) -> None:
        self._sum: torch.Tensor | int = 0
        self._count = 0

    def _add(self, total: torch.Tensor, count: int) -> None:
        self._sum = total + self._sum
        self._count += count

    def eval(self) -> float:
        self._need_updates(self._count)
        return float(self._sum) / self._count

    def reduce_state(self) -> list[Any]:
        return [self._sum, self._count]

    def load_reduced_state(self, values: list[torch.Tensor]) -> None:
        self._sum, self._count = values[0], int(values[1])


class _HitRate(_Mean):
    """The fraction of samples that hit: a device-side count of hits over a host-side total."""

    direction = "max"

    def _hits(self, hits: torch.Tensor) -> None:
        self._add(hits.sum(), hits.numel())


class Accuracy(_HitRate):
    """Fraction of samples whose predicted class matches the label.

    Args:
        eval_type: ``'classification'`` (argmax of the scores) or ``'multilabel'`` (each score
            above 0.5 must match its 0/1 label).
    """

    def __init__(self, eval_type: str = "classification") -> None:
        self.eval_type = check_choice("eval_type", eval_type, ("classification", "multilabel"))
        super().__init__()

    def update(self, *inputs: Any) -> None:
        y_pred, y = _two_inputs(self, inputs)
        with torch.no_grad():
            if self.eval_type == "multilabel":
                hits = ((y_pred > 0.5).long() == y.long()).all(dim=-1)
            else:
                pred, label = _class_predictions(y_pred, y)
                hits = pred == label
            self._hits(hits)


class TopKCategoricalAccuracy(_HitRate):
    """Fraction of samples whose label is among the ``k`` highest scores."""

    def __init__(self, k: int = 5) -> None:
        self.k = check_int("k", k, minimum=1)
        super().__init__()

    def update(self, *inputs: Any) -> None:
        y_pred, y = _two_inputs(self, inputs)
        if y_pred.ndim != 2:
            raise ValueError(f"top-k accuracy expects y_pred of shape (N, C), got {y_pred.shape}.")
        with torch.no_grad():
            if y.shape == y_pred.shape:
                y = y.argmax(dim=-1)
            k = min(self.k, y_pred.shape[-1])
            top = y_pred.topk(k, dim=-1).indices
            self._hits((top == y.reshape(-1, 1)).any(dim=-1))


class Top1CategoricalAccuracy(TopKCategoricalAccuracy):
    """Top-1 categorical accuracy."""

    def __init__(self) -> None:
        super().__init__(1)


class Top5CategoricalAccuracy(TopKCategoricalAccuracy):
    """Top-5 categorical accuracy."""

    def __init__(self) -> None:
        super().__init__(5)


class _ErrorMetric(_Mean):
    """A per-sample error (summed over a sample's outputs), averaged over samples."""

    direction = "min"

    def _error(self, diff: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def update(self, *inputs: Any) -> None:
        y_pred, y = _two_inputs(self, inputs)
        with torch.no_grad():
            diff = y_pred.float() - y.reshape(y_pred.shape).to(y_pred.device).float()
            self._add(self._error(diff).sum(), y_pred.shape[0] if y_pred.ndim else 1)


class MAE(_ErrorMetric):
    """Mean absolute error (summed over a sample's outputs, averaged over samples)."""

    def _error(self, diff: torch.Tensor) -> torch.Tensor:
        return diff.abs()


class MSE(_ErrorMetric):
    """Mean squared error (summed over a sample's outputs, averaged over samples)."""

    def _error(self, diff: torch.Tensor) -> torch.Tensor:
        return diff * diff


class Loss(_Mean):
    """Mean of the batch losses."""

    uses_loss = True
    direction = "min"

    def update(self, *inputs: Any) -> None:
        if len(inputs) != 1:
            raise ValueError(f"Loss.update() needs 1 input (the loss), but got {len(inputs)}.")
        loss = _as_tensor(inputs[0], "loss")
        with torch.no_grad():
            self._add(loss.float().mean(), 1)


class _ClassCounts(Metric):
    """Per-class true positives, predicted positives and actual positives, on the device."""

    direction = "max"

    def __init__(self, eval_type: str = "classification", average: str | None = "macro") -> None:
        self.eval_type = check_choice("eval_type", eval_type, ("classification", "multilabel"))
        if average is not None:
            check_choice("average", average, ("macro",))
        self.average = average
        super().__init__()
        self.clear()

    def clear(self) -> None:
        self._tp: torch.Tensor | None = None
        self._pred: torch.Tensor | None = None
        self._true: torch.Tensor | None = None
        self._updates = 0

    def update(self, *inputs: Any) -> None:
        y_pred, y = _two_inputs(self, inputs)
        with torch.no_grad():
            if self.eval_type == "multilabel":
                pred_hot = (y_pred > 0.5).float()
                true_hot = y.float().reshape(pred_hot.shape)
                tp = (pred_hot * true_hot).sum(0)
                pred_n, true_n = pred_hot.sum(0), true_hot.sum(0)
            else:
                classes = y_pred.shape[-1] if y_pred.ndim == y.ndim + 1 else 0
                pred, label = _class_predictions(y_pred, y)
                classes = max(classes, 2)
                pred, label = pred.reshape(-1).long(), label.reshape(-1).long().to(pred.device)
                ones = torch.ones_like(pred, dtype=torch.float32)
                zeros = torch.zeros(classes, device=pred.device)
                pred_n = zeros.index_add(0, pred, ones)
                true_n = zeros.index_add(0, label, ones)
                tp = zeros.index_add(0, label, (pred == label).float())
            if self._tp is None:
                self._tp, self._pred, self._true = tp, pred_n, true_n
            else:
                assert self._pred is not None and self._true is not None
                self._tp, self._pred, self._true = (
                    self._tp + tp,
                    self._pred + pred_n,
                    self._true + true_n,
                )
        self._updates += 1

    def _denominator(self) -> torch.Tensor:
        raise NotImplementedError

    def reduce_state(self) -> list[Any]:
        self._need_updates(self._updates)  # the class count is known from the first update
        return [self._tp, self._pred, self._true, self._updates]

    def load_reduced_state(self, values: list[torch.Tensor]) -> None:
        assert self._tp is not None
        device = self._tp.device
        self._tp, self._pred, self._true = (v.to(device, torch.float32) for v in values[:3])
        self._updates = int(values[3])

    def eval(self) -> float | np.ndarray:
        self._need_updates(self._updates)
        assert self._tp is not None
        per_class = (self._tp / (self._denominator() + 1e-12)).cpu().numpy()
        if self.average is None:
            return per_class
        return float(per_class.mean())


class Precision(_ClassCounts):
    """Precision: of the samples predicted as a class, the fraction that belong to it.

    Args:
        eval_type: ``'classification'`` or ``'multilabel'``.
        average: ``'macro'`` (default: a float, the mean over classes) or ``None`` (a NumPy
            array with one value per class, as MindSpore's ``eval()`` returns).
    """

    def _denominator(self) -> torch.Tensor:
        assert self._pred is not None
        return self._pred


class Recall(_ClassCounts):
    """Recall: of the samples of a class, the fraction predicted as that class.

    Args:
        eval_type: ``'classification'`` or ``'multilabel'``.
        average: ``'macro'`` (default, a float) or ``None`` (one value per class).
    """

    def _denominator(self) -> torch.Tensor:
        assert self._true is not None
        return self._true


_FACTORY: dict[str, Any] = {
    "accuracy": Accuracy,
    "acc": Accuracy,
    "loss": Loss,
    "mae": MAE,
    "mse": MSE,
    "precision": Precision,
    "recall": Recall,
    "top_1_categorical_accuracy": Top1CategoricalAccuracy,
    "top_5_categorical_accuracy": Top5CategoricalAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
}


def names() -> list[str]:
    """The metric names ``Model(metrics=...)`` accepts."""
    return sorted(_FACTORY)


def get_metric_fn(name: str) -> Metric:
    """Build a metric from its name (``'accuracy'``, ``'mae'``, ...)."""
    if not isinstance(name, str):
        raise TypeError(f"a metric name must be a str, but got {name!r}.")
    if name not in _FACTORY:
        raise UnknownNameError(f"unknown metric name {name!r}; known names: {', '.join(names())}.")
    return _FACTORY[name]()


def _is_metric(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("clear", "update", "eval"))


def _default_name(metric: Any) -> str:
    name = getattr(metric, "name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(metric).__name__
    if cls.isupper():
        return cls.lower()
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls).lower()


def build_metrics(metrics: Any) -> dict[str, Any]:
    """Turn ``Model``'s ``metrics`` argument into ``{name: metric object}``."""
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        items = list(metrics.items())
    elif isinstance(metrics, (set, frozenset, list, tuple)):
        items = [(m if isinstance(m, str) else _default_name(m), m) for m in metrics]
        if isinstance(metrics, (set, frozenset)):
            items.sort(key=lambda kv: kv[0])  # a set has no order; make the result's stable
    elif isinstance(metrics, str):
        raise TypeError(
            f"'metrics' must be a set, list or dict of metric names or Metric objects, but got the "
            f"string {metrics!r}; pass {{{metrics!r}}}."
        )
    else:
        raise TypeError(
            "'metrics' must be a set, list or dict of metric names or Metric objects, but got "
            f"{metrics!r} with type '{type(metrics).__name__}'."
        )
    result: dict[str, Any] = {}
    for name, value in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"'metrics' names must be non-empty strings, but got {name!r}.")
        if isinstance(value, str):
            metric = get_metric_fn(value)
        elif _is_metric(value):
            metric = value
        else:
            raise TypeError(
                f"'metrics'[{name!r}] must be a metric name or an object with clear(), update() "
                f"and eval() methods, but got {value!r} with type '{type(value).__name__}'."
            )
        if name in result:
            raise ValueError(f"'metrics' has two metrics named {name!r}; give them distinct names.")
        result[name] = metric
    return result
