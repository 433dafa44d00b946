"""``from stepwatch.train import Model`` mirrors ``mindspore.train``."""

from . import metrics
from .callback import (
    BackupAndRestore,
    Callback,
    CheckpointConfig,
    DistributedMonitor,
    EarlyStopping,
    History,
    LambdaCallback,
    LearningRateScheduler,
    LossMonitor,
    ModelCheckpoint,
    OnRequestExit,
    ReduceLROnPlateau,
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
from .serialization import load_checkpoint, save_checkpoint
from .step import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager

__all__ = [
    "MAE",
    "MSE",
    "Accuracy",
    "BackupAndRestore",
    "Callback",
    "CheckpointConfig",
    "DistributedMonitor",
    "DynamicLossScaleManager",
    "EarlyStopping",
    "FixedLossScaleManager",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "Loss",
    "LossMonitor",
    "LossScaleManager",
    "Metric",
    "Model",
    "ModelCheckpoint",
    "OnRequestExit",
    "Precision",
    "Recall",
    "ReduceLROnPlateau",
    "RunContext",
    "TimeMonitor",
    "Top1CategoricalAccuracy",
    "Top5CategoricalAccuracy",
    "TopKCategoricalAccuracy",
    "load_checkpoint",
    "metrics",
    "save_checkpoint",
]
