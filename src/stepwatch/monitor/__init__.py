"""Building blocks shared by monitors: the scheduling rule, bounded in-memory history, the
names and directions of a run's values (``stepwatch.monitor.values``) and the anomaly
detectors (``stepwatch.monitor.detectors``). None needs PyTorch."""

from typing import TYPE_CHECKING

from .._lazy import lazy_face

if TYPE_CHECKING:
    from .detectors import Alert
    from .ring import RingBuffer
    from .schedule import Every

__all__ = ["Alert", "Every", "RingBuffer"]

__getattr__, __dir__ = lazy_face(
    __name__,
    globals(),
    {"Alert": ".detectors", "Every": ".schedule", "RingBuffer": ".ring"},
    submodules=(
        "detectors",
        "epoch_detectors",
        "layer_detectors",
        "learning_detectors",
        "ring",
        "schedule",
        "values",
    ),
)
del TYPE_CHECKING, lazy_face
