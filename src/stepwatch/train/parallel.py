"""Data-parallel training: what ``Model`` does when a process group of more than one process is
up (``torchrun``, or any launcher that calls ``torch.distributed.init_process_group``).

* The network is wrapped in ``DistributedDataParallel`` once (left as it is when the user
  wrapped it); the wrapper does the forward and backward, the bare module is what callbacks
  and checkpoints see.
* A network the user sharded with FSDP2's ``fully_shard`` (whole or per layer, over a mesh of
  every rank: ``init_device_mesh(device, (world,))``, or HSDP's ``(replicas, shards)``) is
  left as it is: FSDP2 gathers its parameters and averages its gradients, as DDP would. Its
  checkpoints are written shard by shard (:mod:`stepwatch.train.sharded`); every evaluation
  pass runs as many forwards on every rank (FSDP2 gathers the parameters in each).
* A ``NumpySlicesDataset`` is split into disjoint per-rank shares (see
  :meth:`~stepwatch.NumpySlicesDataset.for_rank`); a ``DataLoader`` without a
  ``DistributedSampler`` gets one warning (every rank would train on every batch).
* At an epoch's end (and an evaluation's), the loss sum, the step count and every built-in
  metric's state are summed across the ranks in one collective, so the epoch loss and the
  metrics are the global values, the same on every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..dataset import NumpySlicesDataset
from ..distributed import all_gather_rows, broadcast_int, rank_and_world, sum_across, wrap
from .parts import Parts, evaluate_metric
from .sharded import is_sharded, reshard

__all__ = ["check_sharding", "epoch_results", "extra_forwards", "prepare", "reduce_epoch", "shard"]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=4)


def prepare(parts: Parts, train_dataset: Any, valid_dataset: Any) -> tuple[Any, Any]:
    """Wrap the network (once; a sharded network is not wrapped) and give this rank its
    share of the datasets."""
    if parts.ddp is None and not is_sharded(parts.network):  # FSDP2 reduces the gradients
        compiled = parts.step.forward_network
        parts.ddp = wrap(compiled if compiled is not None else parts.network, parts.device)
    train = shard(train_dataset, "train_dataset", pad=True)
    valid = shard(valid_dataset, "valid_dataset", pad=False) if valid_dataset is not None else None
    return train, valid


def check_sharding(network: Any, world: int) -> bool:
    """True when ``network`` is sharded with FSDP2 in a layout ``Model`` trains data-parallel
    (each rank a share of the data): every DTensor parameter under ``fully_shard``, on a mesh
    of all ``world`` ranks, sharded on it (or replicated, then sharded: HSDP). False when no
    parameter is a DTensor.

    Raises:
        ValueError: DTensor parameters in another layout (tensor parallelism, a mesh of some
            of the ranks), which ``Model`` cannot split the data for.
    """
    if not is_sharded(network):
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate, Shard

    reshard(network)  # the sharded parameters registered (not gathered ones)
    fsdp = [m for m in network.modules() if isinstance(m, FSDPModule)]
    managed = {id(p) for m in fsdp if isinstance(m, torch.nn.Module) for p in m.parameters()}
    plain = []
    for name, param in network.named_parameters():
        if not isinstance(param, DTensor):
            if param.requires_grad:
                plain.append(name)
            continue
        placements = tuple(param.placements)
        data_parallel = (len(placements) == 1 and isinstance(placements[0], Shard)) or (
            len(placements) == 2
            and isinstance(placements[0], Replicate)
            and isinstance(placements[1], Shard)
        )
        if id(param) not in managed or not data_parallel or param.device_mesh.size() != world:
            raise ValueError(
                f"'network' parameter {name!r} is a DTensor laid out as {placements} on a mesh "
                f"of {param.device_mesh.size()} of the {world} ranks: Model trains networks "
                "sharded with fully_shard over every rank (mesh = init_device_mesh(device, "
                "(world_size,)), or HSDP's (replicas, shards)), each rank a share of the data. "
                "Train other layouts (tensor parallelism) in your own loop with stepwatch.watch."
            )
    if plain:
        _warn_once(
            "sharding",
            f"'network' is sharded with fully_shard, but its parameters {plain[:3]} are not: "
            "their gradients are not averaged across the ranks. Shard the whole network "
            "(fully_shard on the root module too).",
        )
    return True


def extra_forwards(network: Any, batch_num: int) -> int:
    """How many forwards past its own ``batch_num`` batches this rank must run in an
    evaluation pass so that every rank runs as many (one all_gather): a sharded network
    gathers its parameters in every forward, a collective each rank must join. 0 for a
    network that is not sharded (and no collective)."""
    if rank_and_world()[1] == 1 or not is_sharded(network):
        return 0
    return int(all_gather_rows([batch_num]).max()) - batch_num


def shard(dataset: Any, argname: str, *, pad: bool) -> Any:
    """This rank's share of ``dataset`` (itself when it cannot or need not be split)."""
    rank, world = rank_and_world()
    if world == 1:
        return dataset
    if isinstance(dataset, NumpySlicesDataset):
        if getattr(dataset, "user_sharded", False) or dataset._rank_view is not None:
            return dataset
        if not pad and dataset.num_rows < world:
            return dataset  # too small to give every rank a row: each evaluates all of it
        seed = 0
        if dataset.shuffle:
            # Drawn on every rank (the same generator use everywhere), rank 0's is kept.
            seed = broadcast_int(int(torch.randint(0, 2**62, ()).item()))
        return dataset.for_rank(rank, world, seed, pad=pad)
    if isinstance(dataset, torch.utils.data.DataLoader):
        sampler = getattr(dataset, "sampler", None)
        inner = getattr(getattr(dataset, "batch_sampler", None), "sampler", None)
        samplers = (sampler, inner)
        if not any(isinstance(s, torch.utils.data.DistributedSampler) for s in samplers):
            _warn_once(
                argname,
                f"'{argname}' is a DataLoader without a DistributedSampler in a run of {world} "
                "processes: every rank goes through all of its batches. Build it with "
                "sampler=torch.utils.data.DistributedSampler(dataset) (stepwatch calls its "
                "set_epoch every epoch), or pass a NumpySlicesDataset, which is split for you.",
            )
    return dataset


def reduce_epoch(
    total: torch.Tensor | None, steps: int, metrics: Iterable[Any]
) -> tuple[float, int]:
    """Sum the loss, the step count and every reducible metric's state over the ranks in one
    collective; the metrics then hold the global state. Returns ``(loss_sum, steps)``."""
    reducible = []
    for metric in metrics:
        if callable(getattr(metric, "reduce_state", None)):
            reducible.append(metric)
        else:
            _warn_once(
                f"metric:{type(metric).__name__}",
                f"metric {type(metric).__name__} has no reduce_state()/load_reduced_state(): "
                "its value is this rank's own, not the global one.",
            )
    states = [list(m.reduce_state()) for m in reducible]
    values: list[Any] = [total if total is not None else 0.0, steps]
    for state in states:
        values.extend(state)
    summed = sum_across(values)
    at = 2
    for metric, state in zip(reducible, states):
        metric.load_reduced_state(summed[at : at + len(state)])
        at += len(state)
    return float(summed[0]), int(summed[1])


def epoch_results(parts: Parts, total: torch.Tensor | None, steps: int) -> dict[str, Any]:
    """The training epoch's results over all ranks: the mean loss and the training metrics."""
    with_metrics = parts.loss_fn is not None
    metrics = parts.train_metrics if with_metrics else {}
    loss_sum, all_steps = reduce_epoch(total, steps, metrics.values())
    results: dict[str, Any] = {}
    if all_steps:
        results["loss"] = loss_sum / all_steps
        for name, metric in metrics.items():
            results[name] = evaluate_metric(name, metric)
    return results
