"""MindSpore-style callbacks: ``from stepwatch.train.callback import Callback, LossMonitor``."""

from ._callback import (
    ORDER_DEFAULT,
    ORDER_RECORD,
    ORDER_SAVE,
    ORDER_STEER,
    Callback,
    CallbackList,
    CallbackParams,
    Progress,
    RunContext,
    StopKind,
)
from ._monitor import MonitorCallback
from .anomaly import AnomalyMonitor
from .backup_and_restore import BackupAndRestore
from .checkpoint import ModelCheckpoint
from .checkpoint_config import CheckpointConfig
from .distributed_monitor import DistributedMonitor
from .early_stopping import EarlyStopping
from .flops_utilization_collector import FlopsUtilizationCollector
from .history import History
from .lambda_callback import LambdaCallback
from .loss_monitor import LossMonitor
from .lr_scheduler import LearningRateScheduler
from .on_request_exit import OnRequestExit
from .plot_monitor import PlotMonitor
from .progress import ProgressBar
from .reduce_lr_on_plateau import ReduceLROnPlateau
from .terminate_on_nan import TerminateOnNaN
from .time_monitor import TimeMonitor

__all__ = [
    "ORDER_DEFAULT",
    "ORDER_RECORD",
    "ORDER_SAVE",
    "ORDER_STEER",
    "AnomalyMonitor",
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "CallbackParams",
    "CheckpointConfig",
    "DistributedMonitor",
    "EarlyStopping",
    "FlopsUtilizationCollector",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "LossMonitor",
    "ModelCheckpoint",
    "MonitorCallback",
    "OnRequestExit",
    "PlotMonitor",
    "Progress",
    "ProgressBar",
    "ReduceLROnPlateau",
    "RunContext",
    "StopKind",
    "TerminateOnNaN",
    "TimeMonitor",
]
