"""Where this process stands in a distributed run, and the few collectives stepwatch issues.

Everything here works without ``torch.distributed`` being initialized (a single process is
rank 0 of 1, and every reduction returns its input).

The collectives are packed: one call moves every number a caller needs (an epoch's loss sum,
step count and metric states; an interval's loss, step time, data wait and weight checksum),
never one call per value. They run on the process group's device: the current CUDA device
under NCCL, the CPU otherwise.

When training raises on one rank, :func:`abort` tears the process group down, so that the other
ranks' pending collectives fail at once (``Connection closed by peer`` under gloo) instead of
waiting for the process group's timeout.

Beside the collectives, :func:`side_channel` gives the job's key-value store (the TCPStore that
torchrun, or ``init_process_group``, set up for the ranks to meet): what must travel while a
rank may be stuck in a collective - heartbeats (:mod:`stepwatch.rank_watch`) and the other
machines' system metrics (:mod:`stepwatch.node_metrics`) - goes through it, never through a
collective.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "abort",
    "all_gather_rows",
    "broadcast_int",
    "check_launched_together",
    "collective_device",
    "is_distributed",
    "local_rank",
    "rank_and_world",
    "shutdown",
    "side_channel",
    "sum_across",
    "wrap",
]

logger = logging.getLogger("stepwatch")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialized process group, else ``(0, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_launched_together() -> None:
    """Warn when a launcher started this process as one of several (``WORLD_SIZE`` > 1, as
    torchrun sets it) but no process group is initialized: each process would train alone on
    all the data, print, and record a run of its own."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    dist = torch.distributed
    if not world.isdigit() or int(world) < 2 or (dist.is_available() and dist.is_initialized()):
        return
    warnings.warn(
        f"this process was started as one of WORLD_SIZE={world} (by torchrun or another "
        "launcher), but torch.distributed is not initialized: it trains alone, on all the "
        "data, and records a run of its own. Call torch.distributed.init_process_group("
        "'nccl' if torch.cuda.is_available() else 'gloo') before the run starts.",
        UserWarning,
        stacklevel=3,
    )


def is_distributed() -> bool:
    """True inside an initialized process group of more than one process."""
    return rank_and_world()[1] > 1


def local_rank() -> int:
    """This process's index on its machine: ``LOCAL_RANK`` as torchrun sets it; else the
    global rank in a distributed run (one machine), else 0."""
    value = os.environ.get("LOCAL_RANK")
    if value is not None and value.strip().isdigit():
        return int(value)
    return rank_and_world()[0]


def collective_device() -> torch.device:
    """Where collective tensors must live: the current CUDA device under NCCL, else the CPU."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap(network: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``network`` in DistributedDataParallel (returned as is when it already is one).

    On CUDA ``device_ids`` is the model's device (``cuda:LOCAL_RANK`` by default). Wrapping
    broadcasts rank 0's weights and buffers, so every replica starts from the same state.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(network, DistributedDataParallel):
        return network
    if device.type == "cuda":
        index = device.index if device.index is not None else local_rank()
        return DistributedDataParallel(network, device_ids=[index], output_device=index)
    return DistributedDataParallel(network)


def _flat(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).to(device=device, dtype=torch.float64)
    return torch.tensor([float(value)], dtype=torch.float64, device=device)


def sum_across(values: Sequence[Any]) -> list[torch.Tensor]:
    """Sum every value over the ranks in ONE all_reduce; each result keeps its value's shape
    (float64, on :func:`collective_device`). Values are tensors or numbers. A single process
    gets its own values back."""
    device = collective_device()
    flats = [_flat(v, device) for v in values]
    if not flats:
        return []
    packed = torch.cat(flats)
    if is_distributed():
        torch.distributed.all_reduce(packed)
    out: list[torch.Tensor] = []
    start = 0
    for value, flat in zip(values, flats):
        n = flat.numel()
        piece = packed[start : start + n]
        shape = value.shape if isinstance(value, torch.Tensor) else ()
        out.append(piece.reshape(shape))
        start += n
    return out


def all_gather_rows(row: Sequence[Any]) -> torch.Tensor:
    """Every rank's ``row`` of numbers in ONE all_gather: a ``(world, len(row))`` float64 CPU
    tensor, row ``r`` from rank ``r``."""
    device = collective_device()
    mine = torch.cat([_flat(v, device) for v in row])
    _, world = rank_and_world()
    if world == 1:
        return mine.reshape(1, -1).cpu()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(gathered, mine)
    return torch.stack(gathered).cpu()


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (one broadcast)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    torch.distributed.broadcast(t, src=0)
    return int(t.item())


def shutdown() -> None:
    """Leave the process group at the end of a run that went well: wait for every rank (one
    barrier), then destroy the group. Ranks that tear gloo down while a peer is still
    connected can abort at exit ('terminate called without an active exception'); leaving
    together avoids it. Does nothing when no group is initialized."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abort() -> None:
    """Tear down the process group after a failure on this rank, so that the other ranks'
    pending and next collectives fail now instead of waiting for the timeout. Never raises."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        from torch.distributed import distributed_c10d

        hard = getattr(distributed_c10d, "_abort_process_group", None)
        if callable(hard):
            hard()  # NCCL too: does not wait for in-flight collectives
        else:  # pragma: no cover - older PyTorch
            dist.destroy_process_group()
        logger.error("training failed on this rank; the process group was torn down")
    except Exception as exc:  # pragma: no cover - best effort on the way out
        logger.warning("could not tear down the process group: %s", exc)


def side_channel() -> Any:
    """The job's key-value store (a ``torch.distributed.Store``), or None outside a process
    group of more than one process.

    It is the store under the default process group's prefixes: the same one on every rank and
    machine, reachable from any thread while the training thread waits in a collective. Keys
    stepwatch writes there start with ``stepwatch/``.
    """
    if not is_distributed():
        return None
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    while True:  # PrefixStore("default_pg", PrefixStore(..., TCPStore)): the shared root
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            return store
        store = inner
