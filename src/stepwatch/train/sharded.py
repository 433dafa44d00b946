"""Sharded training state: a network sharded with FSDP2's ``fully_shard``, whose parameters
(and the optimizer's state that follows them) are DTensors, each rank holding its shard.

The training state of such a run is never gathered onto one rank:

* In memory (a rollback copy), each rank copies its own shards (:func:`stash`) and puts them
  back in place (:func:`unstash`, then the usual ``load_state_dict``), with no collective.
* On disk, a checkpoint is two parts. Rank 0 writes the ``.pt`` file as for any run (the loop's
  place, the random generators, the callbacks' state, the LR schedule), in which every tensor
  of the network and the optimizer is replaced by a reference (:func:`split`); those tensors are
  written beside it by every rank, each its own shards, with ``torch.distributed.checkpoint``
  into the folder ``<file>.shards-<token>`` (:func:`save_shards`). The ``.pt`` file is written
  last and names its folder, so a checkpoint is either complete or not there at all. Loading
  (:func:`load_shards`) reads each rank's shards back into the network in place (the same world
  size, or another one: ``torch.distributed.checkpoint`` reshards), and into a network that is
  not sharded at all (a single process reading a sharded run's weights).

The optimizer's state is kept as ``optimizer.state_dict()`` keeps it (by parameter index), so a
sharded checkpoint restores through the same ``load_state_dict`` calls as any other.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._tensor import cpu_copy, map_nested
from ..distributed import is_distributed, sum_across

__all__ = [
    "SHARDS_SUFFIX",
    "LocalShard",
    "all_finite",
    "full_value",
    "is_sharded",
    "load_shards",
    "remove_shard_folders",
    "save_shards",
    "shard_full",
    "split",
    "stash",
    "unstash",
]

# The parts of a checkpoint whose tensors are written as shards.
SHARDED_PARTS = ("network", "optimizer")
SHARDS_SUFFIX = ".shards-"
_REF = "__shard__"


def _dtensor_type() -> type | None:
    """DTensor, or None while nobody imported it (then no tensor is one, and a run that
    shards nothing does not pay for the import)."""
    if "torch.distributed.tensor" not in sys.modules or not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(value: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(value, kind)


def is_sharded(module: Any) -> bool:
    """True when ``module`` or one of its submodules is sharded with ``fully_shard``, or some
    parameter is a DTensor (another DTensor layout).

    Parameters alone do not tell: between a forward and the next reshard (the root module's
    after a forward without gradients), FSDP2 registers the gathered, plain parameters."""
    kind = _dtensor_type()
    if kind is None or not isinstance(module, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, kind) for p in module.parameters()
    )


def reshard(module: Any) -> None:
    """Register the sharded parameters of every ``fully_shard``-ed module in ``module`` again
    (nothing for a network that shards nothing). FSDP2 leaves the root module's parameters
    gathered after a forward with no backward after it (a check, an evaluation), and frees them
    at the next forward: whoever read the network's parameters in between would hold tensors
    about to be freed."""
    if _dtensor_type() is None or not isinstance(module, torch.nn.Module):
        return
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def full_value(value: Any) -> Any:
    """A DTensor that every rank holds whole (a reduced norm) as a plain tensor; anything else
    as it is."""
    if is_dtensor(value):
        return value.full_tensor()
    return value


def all_finite(module: torch.nn.Module) -> bool:
    """True when every floating-point tensor of every rank's shards of ``module``'s state is
    finite: each rank checks its own shards, then one all_reduce makes the answer the same
    on every rank (every rank must call it)."""
    bad = torch.zeros((), dtype=torch.float64)
    for tensor in module.state_dict().values():
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            bad += (~torch.isfinite(local.detach())).any().to("cpu", torch.float64)
    return float(sum_across([bad])[0]) == 0


# -- copies in memory ---------------------------------------------------------------------------
@dataclass
class LocalShard:
    """A copy of this rank's shard of a DTensor, on the CPU, and where it belongs."""

    local: torch.Tensor
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def stash(obj: Any) -> Any:
    """A copy of ``obj`` (nested dicts, lists, tuples) that shares nothing with training: each
    DTensor as a :class:`LocalShard` of this rank's shard, every other tensor copied to the
    CPU. No collective."""
    return map_nested(obj, _stash_one)


def _stash_one(value: Any) -> Any:
    if is_dtensor(value):
        return LocalShard(
            cpu_copy(value.to_local()),
            value.device_mesh,
            tuple(value.placements),
            value.shape,
            tuple(value.stride()),
        )
    return cpu_copy(value)


def unstash(obj: Any) -> Any:
    """``obj`` with each :class:`LocalShard` made a DTensor again, on its mesh's device, from a
    fresh copy of the shard, and every other tensor copied too (an optimizer's
    ``load_state_dict`` keeps the tensors it is given, and updates them in place): the copy
    can be restored more than once. No collective."""
    return map_nested(obj, _unstash_one)


def _unstash_one(value: Any) -> Any:
    if isinstance(value, LocalShard):
        from torch.distributed.tensor import DTensor

        device = value.mesh.device_type
        return DTensor.from_local(
            value.local.to(device, copy=True),
            value.mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride,
        )
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def has_local_shards(obj: Any) -> bool:
    if isinstance(obj, LocalShard):
        return True
    if isinstance(obj, dict):
        return any(has_local_shards(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_local_shards(v) for v in obj)
    return False


# -- checkpoint files -------------------------------------------------------------------------
def _refs(obj: Any, prefix: str, tensors: dict[str, Any]) -> Any:
    """``obj`` with every tensor replaced by a reference to its key in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {_REF: prefix}
    if isinstance(obj, dict):
        return {k: _refs(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_refs(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj))
    return obj


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(skeleton, tensors)``: ``state`` with the network's and optimizer's tensors replaced
    by references, and those tensors by key (DTensors stay DTensors: each rank writes its
    shards). A :class:`LocalShard` is made a DTensor again first."""
    tensors: dict[str, Any] = {}
    skeleton = dict(state)
    for part in SHARDED_PARTS:
        value = state.get(part)
        if value is not None:
            if has_local_shards(value):
                value = unstash(value)
            skeleton[part] = _refs(value, part, tensors)
    return skeleton, tensors


def _ref_keys(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        if set(obj) == {_REF}:
            yield obj[_REF]
            return
        for value in obj.values():
            yield from _ref_keys(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _ref_keys(value)


def _fill(obj: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_REF}:
            return tensors[obj[_REF]]
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def save_shards(tensors: dict[str, Any], path: Path) -> str:
    """Write ``tensors`` (each rank its shards) into a new folder beside ``path`` - rank 0's
    ``path``, the same on every rank - and return the folder's name. Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    folder = [str(path.parent / f"{path.name}{SHARDS_SUFFIX}{secrets.token_hex(4)}")]
    if is_distributed():
        torch.distributed.broadcast_object_list(folder, src=0)
    with _one_process_quietly():
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(folder[0]),
            no_dist=not is_distributed(),
        )
    return Path(folder[0]).name


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """torch.distributed.checkpoint warns that it assumes one process when there is no
    process group, even when told so (``no_dist``): in one process that is what is meant."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def remove_shard_folders(path: Path, keep: str | None = None) -> None:
    """Delete the shard folders of the checkpoint file ``path`` (all but ``keep``): those of
    the files it replaced, and any a save that did not finish left behind."""
    for folder in path.parent.glob(f"{path.name}{SHARDS_SUFFIX}*"):
        if folder.name != keep and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def load_shards(
    state: dict[str, Any], network: torch.nn.Module, optimizer: Any, where: str
) -> dict[str, Any]:
    """``state`` (read from a checkpoint file whose ``shards`` names its folder) with its
    network and optimizer parts read back: each rank reads its shards of the network straight
    into the network's own tensors, and the optimizer's into tensors laid out as their
    parameters are. Every rank calls it.

    Raises:
        ValueError: the folder is missing or does not hold what the file refers to.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(state["shards"])
    if not (folder / ".metadata").is_file():
        raise ValueError(
            f"{where} is a sharded checkpoint whose shards folder {str(folder)!r} is missing "
            "or incomplete; copy the checkpoint file together with its folder."
        )
    reader = dcp.FileSystemReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    live = {f"network.{k}": v for k, v in network.state_dict().items()}
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    template: dict[str, Any] = {}
    for part in SHARDED_PARTS:
        for key in _ref_keys(state.get(part)):
            meta = saved.get(key)
            if not isinstance(meta, TensorStorageMetadata):
                raise ValueError(f"{where}: its shards folder holds no tensor {key!r}.")
            if key in live:
                template[key] = live[key]  # read in place, into the network's own shards
                continue
            like = _param_of(key, params)
            dtype = meta.properties.dtype
            if like is not None and is_dtensor(like) and tuple(like.shape) == tuple(meta.size):
                template[key] = torch.empty_like(like, dtype=dtype)  # laid out as its parameter
            else:
                device = like.device if like is not None else torch.device("cpu")
                template[key] = torch.empty(tuple(meta.size), dtype=dtype, device=device)
    try:
        with _one_process_quietly():
            dcp.load(template, storage_reader=reader, no_dist=not is_distributed())
    except Exception as exc:
        raise ValueError(f"{where}: its shards cannot be read into this network: {exc}") from exc
    loaded = dict(state)
    for part in SHARDED_PARTS:
        if state.get(part) is not None:
            loaded[part] = _fill(state[part], template)
    return loaded


def _param_of(key: str, params: list[Any]) -> Any:
    """The parameter an optimizer state key (``optimizer.state.<index>.<name>``) belongs to."""
    parts = key.split(".")
    if len(parts) >= 4 and parts[1] == "state" and parts[2].isdigit():
        index = int(parts[2])
        return params[index] if index < len(params) else None
    return None


def shard_full(state: dict[str, Any], network: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """``state`` of the same network unsharded (a checkpoint of a run on one process, or under
    DDP) cut into this rank's shards: each full tensor of the network and the optimizer is
    laid out as the tensor it is loaded into. No collective: every rank holds the full
    tensors (read from the file) and keeps its own slice."""
    live = network.state_dict()
    loaded = dict(state)
    if isinstance(state.get("network"), dict):
        loaded["network"] = {k: _laid_out(v, live.get(k)) for k, v in state["network"].items()}
    saved = state.get("optimizer")
    if isinstance(saved, dict) and isinstance(saved.get("state"), dict):
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
        loaded["optimizer"] = {
            **saved,
            "state": {
                i: {
                    k: _laid_out(v, params[i] if isinstance(i, int) and i < len(params) else None)
                    for k, v in per_param.items()
                }
                for i, per_param in saved["state"].items()
            },
        }
    return loaded


def _laid_out(value: Any, like: Any) -> Any:
    """``value`` (a full tensor) as a DTensor laid out as ``like``, when ``like`` is one of its
    shape; otherwise ``value`` as it is."""
    if (
        is_dtensor(like)
        and isinstance(value, torch.Tensor)
        and not is_dtensor(value)
        and tuple(value.shape) == tuple(like.shape)
    ):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            value.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
        )
    return value
