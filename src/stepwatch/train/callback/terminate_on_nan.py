"""``TerminateOnNaN``: Keras' name for stopping on a non-finite loss."""

from __future__ import annotations

from .anomaly import AnomalyMonitor

__all__ = ["TerminateOnNaN"]


class TerminateOnNaN(AnomalyMonitor):
    """Stop training when the loss becomes NaN or infinite (Keras' ``TerminateOnNaN``).

    The run stops with kind ``'anomaly'`` (ModelCheckpoint does not save NaN weights) a few
    steps after the first non-finite loss at most: losses are read in batches, so that the
    check costs no device sync per step.
    """

    def __init__(self) -> None:
        super().__init__(detectors=["nonfinite"], action="stop")
