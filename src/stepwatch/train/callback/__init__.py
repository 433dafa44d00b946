"""MindSpore-style callbacks: ``from stepwatch.train.callback import Callback, LossMonitor``."""

from ._callback import Callback, CallbackList, CallbackParams, RunContext
from .history import History
from .lambda_callback import LambdaCallback
from .loss_monitor import LossMonitor
from .time_monitor import TimeMonitor

__all__ = [
    "Callback",
    "CallbackList",
    "CallbackParams",
    "History",
    "LambdaCallback",
    "LossMonitor",
    "RunContext",
    "TimeMonitor",
]
