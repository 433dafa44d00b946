"""Where this process stands in a distributed run: its rank and the number of processes.

Everything here works without ``torch.distributed`` being initialized (a single process is
rank 0 of 1).
"""

from __future__ import annotations

import torch

__all__ = ["rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialized process group, else ``(0, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
