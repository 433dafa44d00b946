"""``from stepwatch.train import Model`` mirrors ``mindspore.train``."""

from . import metrics
from .callback import (
    Callback,
    History,
    LambdaCallback,
    LossMonitor,
    RunContext,
    TimeMonitor,
)
from .metrics import (
    MAE,
    MSE,
    Accuracy,
    Loss,
    Metric,
    Precision,
    Recall,
    Top1CategoricalAccuracy,
    Top5CategoricalAccuracy,
    TopKCategoricalAccuracy,
)
from .model import Model

__all__ = [
    "MAE",
    "MSE",
    "Accuracy",
    "Callback",
    "History",
    "LambdaCallback",
    "Loss",
    "LossMonitor",
    "Metric",
    "Model",
    "Precision",
    "Recall",
    "RunContext",
    "TimeMonitor",
    "Top1CategoricalAccuracy",
    "Top5CategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "metrics",
]
