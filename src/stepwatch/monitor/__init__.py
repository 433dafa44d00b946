"""Building blocks shared by monitors: the scheduling rule and bounded in-memory history."""

from .ring import RingBuffer
from .schedule import Every

__all__ = ["Every", "RingBuffer"]
