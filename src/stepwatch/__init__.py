"""stepwatch: watch and steer PyTorch training with MindSpore's Model and callbacks.

Quick start::

    from stepwatch import Model, LossMonitor, TimeMonitor
    model = Model(net, loss_fn, optimizer, metrics={"accuracy"})
    model.fit(10, train_ds, valid_ds, callbacks=[LossMonitor(100), TimeMonitor()])

Importing ``stepwatch`` is cheap: a name is loaded on first use, so reading a run store never
loads PyTorch.
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_face
from ._version import __version__

if TYPE_CHECKING:
    from ._tensor import Tensor
    from .context import (
        GRAPH_MODE,
        PYNATIVE_MODE,
        ParallelMode,
        get_auto_parallel_context,
        get_context,
        reset_auto_parallel_context,
        set_auto_parallel_context,
        set_context,
    )
    from .dataset import NumpySlicesDataset
    from .monitor import Alert, Every, RingBuffer
    from .store import RunRecorder, RunWriter, Store
    from .train import (
        MAE,
        MSE,
        Accuracy,
        AnomalyMonitor,
        BackupAndRestore,
        Callback,
        CheckpointConfig,
        DistributedMonitor,
        DynamicLossScaleManager,
        EarlyStopping,
        FixedLossScaleManager,
        FlopsUtilizationCollector,
        History,
        LambdaCallback,
        LearningRateScheduler,
        Loss,
        LossMonitor,
        Metric,
        Model,
        ModelCheckpoint,
        OnRequestExit,
        PlotMonitor,
        Precision,
        ProgressBar,
        Recall,
        ReduceLROnPlateau,
        RunContext,
        TerminateOnNaN,
        TimeMonitor,
        TopKCategoricalAccuracy,
        WatchedRun,
        load_checkpoint,
        save_checkpoint,
        watch,
    )
    from .train.callback import CallbackParams

__all__ = [
    "GRAPH_MODE",
    "MAE",
    "MSE",
    "PYNATIVE_MODE",
    "Accuracy",
    "Alert",
    "AnomalyMonitor",
    "BackupAndRestore",
    "Callback",
    "CallbackParams",
    "CheckpointConfig",
    "DistributedMonitor",
    "DynamicLossScaleManager",
    "EarlyStopping",
    "Every",
    "FixedLossScaleManager",
    "FlopsUtilizationCollector",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "Loss",
    "LossMonitor",
    "Metric",
    "Model",
    "ModelCheckpoint",
    "NumpySlicesDataset",
    "OnRequestExit",
    "ParallelMode",
    "PlotMonitor",
    "Precision",
    "ProgressBar",
    "Recall",
    "ReduceLROnPlateau",
    "RingBuffer",
    "RunContext",
    "RunRecorder",
    "RunWriter",
    "Store",
    "Tensor",
    "TerminateOnNaN",
    "TimeMonitor",
    "TopKCategoricalAccuracy",
    "WatchedRun",
    "__version__",
    "get_auto_parallel_context",
    "get_context",
    "load_checkpoint",
    "reset_auto_parallel_context",
    "save_checkpoint",
    "set_auto_parallel_context",
    "set_context",
    "watch",
]

# Importing the package loads none of these (nor PyTorch): each comes on first use.
_ELSEWHERE = {
    "CallbackParams": ".train.callback",
    "Tensor": "._tensor",
    "NumpySlicesDataset": ".dataset",
    "Alert": ".monitor",
    "Every": ".monitor",
    "RingBuffer": ".monitor",
    "RunRecorder": ".store",
    "RunWriter": ".store",
    "Store": ".store",
    # MindSpore's context names (importing them loads no torch)
    **dict.fromkeys(
        (
            "GRAPH_MODE",
            "PYNATIVE_MODE",
            "ParallelMode",
            "get_auto_parallel_context",
            "get_context",
            "reset_auto_parallel_context",
            "set_auto_parallel_context",
            "set_context",
        ),
        ".context",
    ),
}
__getattr__, __dir__ = lazy_face(
    __name__,
    globals(),
    # the public names not listed elsewhere are stepwatch.train's
    {name: _ELSEWHERE.get(name, ".train") for name in __all__ if name != "__version__"},
    submodules=("amp", "context", "dataset", "distributed", "monitor", "store", "train", "view"),
)
del TYPE_CHECKING, lazy_face, _ELSEWHERE
