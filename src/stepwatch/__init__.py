"""stepwatch: watch and steer PyTorch training with MindSpore's Model and callbacks.

Quick start::

    from stepwatch import Model, LossMonitor, TimeMonitor
    model = Model(net, loss_fn, optimizer, metrics={"accuracy"})
    model.fit(10, train_ds, valid_ds, callbacks=[LossMonitor(100), TimeMonitor()])
"""

from ._tensor import Tensor
from .dataset import NumpySlicesDataset
from .monitor import Every, RingBuffer
from .store import RunRecorder, RunWriter, Store
from .train import (
    MAE,
    MSE,
    Accuracy,
    BackupAndRestore,
    Callback,
    CheckpointConfig,
    EarlyStopping,
    History,
    LambdaCallback,
    Loss,
    LossMonitor,
    Metric,
    Model,
    ModelCheckpoint,
    OnRequestExit,
    Precision,
    Recall,
    ReduceLROnPlateau,
    RunContext,
    TimeMonitor,
    TopKCategoricalAccuracy,
    load_checkpoint,
    save_checkpoint,
)
from .train.callback import CallbackParams

__version__ = "0.1.0"

__all__ = [
    "MAE",
    "MSE",
    "Accuracy",
    "BackupAndRestore",
    "Callback",
    "CallbackParams",
    "CheckpointConfig",
    "EarlyStopping",
    "Every",
    "History",
    "LambdaCallback",
    "Loss",
    "LossMonitor",
    "Metric",
    "Model",
    "ModelCheckpoint",
    "NumpySlicesDataset",
    "OnRequestExit",
    "Precision",
    "Recall",
    "ReduceLROnPlateau",
    "RingBuffer",
    "RunContext",
    "RunRecorder",
    "RunWriter",
    "Store",
    "Tensor",
    "TimeMonitor",
    "TopKCategoricalAccuracy",
    "__version__",
    "load_checkpoint",
    "save_checkpoint",
]
