"""Building blocks shared by monitors: the scheduling rule, bounded in-memory history, and the
names and directions of a run's values (``stepwatch.monitor.values``). None needs PyTorch."""

from typing import TYPE_CHECKING

from .._lazy import lazy_face

if TYPE_CHECKING:
    from .ring import RingBuffer
    from .schedule import Every

__all__ = ["Every", "RingBuffer"]

__getattr__, __dir__ = lazy_face(
    __name__,
    globals(),
    {"Every": ".schedule", "RingBuffer": ".ring"},
    submodules=("ring", "schedule", "values"),
)
del TYPE_CHECKING, lazy_face
