"""stepwatch: watch and steer PyTorch training with MindSpore's Model and callbacks.

Quick start::

    from stepwatch import Model, LossMonitor, TimeMonitor
    model = Model(net, loss_fn, optimizer, metrics={"accuracy"})
    model.fit(10, train_ds, valid_ds, callbacks=[LossMonitor(100), TimeMonitor()])
"""

from ._tensor import Tensor
from .dataset import NumpySlicesDataset
from .train import (
    MAE,
    MSE,
    Accuracy,
    Callback,
    History,
    LambdaCallback,
    Loss,
    LossMonitor,
    Metric,
    Model,
    Precision,
    Recall,
    RunContext,
    TimeMonitor,
    TopKCategoricalAccuracy,
)
from .train.callback import CallbackParams

__version__ = "0.1.0"

__all__ = [
    "MAE",
    "MSE",
    "Accuracy",
    "Callback",
    "CallbackParams",
    "History",
    "LambdaCallback",
    "Loss",
    "LossMonitor",
    "Metric",
    "Model",
    "NumpySlicesDataset",
    "Precision",
    "Recall",
    "RunContext",
    "Tensor",
    "TimeMonitor",
    "TopKCategoricalAccuracy",
    "__version__",
]
