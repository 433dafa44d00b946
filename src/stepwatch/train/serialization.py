"""Checkpoint files: how they are written safely and read back.

A checkpoint is one ``torch.save`` file holding the network, the optimizer and, when written
by a callback, the loop's place and the callbacks' state (see :mod:`stepwatch.train.resume`).
Files are written to a temporary name in the same directory, flushed to disk and renamed over
the target, so a process killed mid-save leaves the previous file intact. Files load with
``weights_only=True``.

The checkpoint of a sharded run (FSDP2) keeps the network's and optimizer's tensors in a
folder beside the file, each rank writing its own shards (:mod:`stepwatch.train.sharded`);
:func:`write_checkpoint` and :func:`read_checkpoint` handle both kinds, and
:func:`writes_here` says which ranks take part in a save.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch

from .._tensor import cpu_copy, map_nested
from ..distributed import rank_and_world
from . import sharded

__all__ = [
    "read_checkpoint",
    "remove_checkpoint",
    "save_checkpoint",
    "write_atomic",
    "write_checkpoint",
    "writes_here",
]

FORMAT = "stepwatch-checkpoint"
VERSION = 1
TMP_PREFIX = ".tmp-"


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live on the CPU and share nothing with training."""
    return map_nested(obj, cpu_copy)


def weights_finite(module: Any) -> bool:
    """True when every floating-point tensor of ``module``'s state is finite (one host read).
    For a sharded network, every rank's shards are checked and every rank gets the same
    answer (one all_reduce: every rank calls it)."""
    if sharded.is_sharded(module):
        return sharded.all_finite(module)
    checks = [
        torch.isfinite(t).all()
        for t in module.state_dict().values()
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return bool(torch.stack(checks).all()) if checks else True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask: from /proc on Linux (no change to it, so no race with other
    threads), else read by setting it and putting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


CHECKSUM = "checksum"


def checksum(state: Any) -> int:
    """A CRC-32 over everything in ``state``: every tensor's dtype, shape and bytes, every
    other value's text, in order. Written into each checkpoint and checked when it is read, so
    flipped bytes on disk are found, not loaded into a network."""
    crc = 0

    def feed(obj: Any) -> None:
        nonlocal crc
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            t = (t.cpu() if t.device.type != "cpu" else t).contiguous().reshape(-1)
            crc = zlib.crc32(f"{t.dtype}{tuple(obj.shape)}".encode(), crc)
            if t.numel():
                crc = zlib.crc32(t.view(torch.uint8).numpy().data, crc)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                crc = zlib.crc32(repr(key).encode(), crc)
                feed(value)
        elif isinstance(obj, (list, tuple)):
            crc = zlib.crc32(b"[%d" % len(obj), crc)
            for item in obj:
                feed(item)
        else:
            crc = zlib.crc32(repr(obj).encode(), crc)

    feed(state)
    return crc


def write_atomic(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically: the file is either the old one or the new one.
    A checksum of the contents goes in with it (see :func:`checksum`)."""
    target = Path(path)
    state = {**state, CHECKSUM: checksum(state)}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX + target.name, dir=target.parent)
    except OSError as exc:
        # Name the file the user asked for, not the hidden temporary one.
        raise type(exc)(exc.errno, f"cannot write {str(target)!r}: {exc.strerror}") from None
    try:
        # mkstemp makes the file 0600; a checkpoint gets the mode any new file would (umask).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            try:
                torch.save(state, f)
            except RuntimeError as exc:  # torch's own words for a failed write (a full disk)
                text = str(exc).strip()
                reason = text.splitlines()[-1] if text else "error"
                free = shutil.disk_usage(target.parent).free
                raise OSError(
                    errno.ENOSPC if free < 1 << 20 else errno.EIO,
                    f"cannot write checkpoint {str(target)!r} ({free // 1024} KiB free on its "
                    f"disk): {reason}",
                ) from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise
    _fsync_dir(target.parent)
    return target


def writes_here(cb_params: Any) -> bool:
    """Whether this process takes part in writing the run's checkpoints: rank 0 alone (the
    replicas hold the same state), or, in a sharded run, every rank (each writes its shards)."""
    return int(cb_params.rank_id) == 0 or sharded.is_sharded(cb_params.get("train_network"))


def write_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the checkpoint ``state`` to ``path``: one file (:func:`write_atomic`), or for the
    state of a sharded network (``state['sharded']``), every rank's shards into a new folder
    beside it and then rank 0's file naming that folder; the folders of the file it replaced
    are deleted. A sharded save is a collective: every rank calls it, with rank 0's ``path``
    the one used (a folder every rank can reach), and it returns once the file is written."""
    target = Path(path)
    if not state.get("sharded"):
        return write_atomic(state, target)
    skeleton, tensors = sharded.split(state)
    folder = sharded.save_shards(tensors, target)
    rank, world = rank_and_world()
    if rank == 0:
        write_atomic({**skeleton, "shards": folder}, target)
        sharded.remove_shard_folders(target, keep=folder)
    if world > 1:
        torch.distributed.barrier()  # on every rank, the file is there once this returns
    return target


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the checkpoint file ``path`` and its shards folder, if any (one process)."""
    target = Path(path)
    try:
        target.unlink()
    except FileNotFoundError:
        pass
    sharded.remove_shard_folders(target)


def save_checkpoint(save_obj: Any, ckpt_file_name: str | os.PathLike[str]) -> Path:
    """Save a network's weights (and a Model's optimizer) to a checkpoint file, atomically.

    Args:
        save_obj: a :class:`stepwatch.Model`, an ``nn.Module`` or a ``state_dict``.
        ckpt_file_name: the file to write (its folder is created).

    Returns:
        The path written. ``load_checkpoint(path, model)`` reads it back. Checkpoints written
        by ``ModelCheckpoint`` also hold the loop state needed to resume training.

    A sharded network (FSDP2) is saved by every rank at once, each writing its shards into a
    folder beside the file: call it on every rank.
    """
    from torch import nn

    module = None
    if isinstance(save_obj, nn.Module):
        module, network, optimizer = save_obj, save_obj.state_dict(), None
    elif isinstance(save_obj, dict):
        network, optimizer = save_obj, None
    elif hasattr(save_obj, "train_network"):
        module, network = save_obj.train_network, save_obj.train_network.state_dict()
        opt = getattr(save_obj, "optimizer", None)
        optimizer = opt.state_dict() if opt is not None else None
    else:
        raise TypeError(
            "'save_obj' must be a Model, an nn.Module or a state_dict, but got "
            f"{type(save_obj).__name__}."
        )
    if not isinstance(ckpt_file_name, (str, os.PathLike)):
        raise TypeError(
            f"'ckpt_file_name' must be a str or path, but got {type(ckpt_file_name).__name__}."
        )
    state = {"format": FORMAT, "version": VERSION, "network": network, "optimizer": optimizer}
    if sharded.is_sharded(module):
        state["sharded"] = True  # every rank writes its shards (every rank calls this)
    return write_checkpoint(state, ckpt_file_name)


def remove_stale_temporaries(directory: Path, name_prefix: str) -> None:
    """Delete temporary files a killed process left behind."""
    for leftover in directory.glob(f"{TMP_PREFIX}{name_prefix}*"):
        try:
            leftover.unlink()
        except OSError:
            pass


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint file written by stepwatch, with a clear error for anything else."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*-last.pt")) or sorted(p.glob("*.pt"))
        hint = f" such as {str(found[0])!r}" if found else ""
        raise IsADirectoryError(f"{str(p)!r} is a folder; pass a checkpoint file in it{hint}.")
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {str(p)!r}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text:
            reason = "it holds Python objects that a safe load refuses (not written by stepwatch)"
        else:
            reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        # torch's own message goes on to suggest weights_only=False: unsafe advice for a file
        # that failed to load, so it is not passed on.
        raise ValueError(
            f"{str(p)!r} is not a readable stepwatch checkpoint (truncated or corrupt?): {reason}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{str(p)!r} is not a stepwatch checkpoint (no '{FORMAT}' marker).")
    saved = state.pop(CHECKSUM, None)  # files written before checksums have none
    if saved is not None and saved != checksum(state):
        raise ValueError(
            f"{str(p)!r} is damaged: its contents do not match the checksum written with them "
            "(bytes changed on disk). Use another checkpoint, or restore a copy of this one."
        )
    if isinstance(state.get("shards"), str):
        state["shards"] = str(p.parent / state["shards"])  # the folder beside the file
    return state


def check_optimizer_matches(path: Any, saved: dict[str, Any], optimizer: Any) -> None:
    """Raise ValueError when ``saved`` (an optimizer state_dict) is not of ``optimizer``'s kind.

    Loading another optimizer's state succeeds in torch and fails only at the next step (a
    bare ``KeyError: 'betas'``); the settings each parameter group holds tell them apart.
    """
    groups = saved.get("param_groups") or []
    current = optimizer.param_groups
    where = f"checkpoint {str(path)!r}"
    if len(groups) != len(current):
        raise ValueError(
            f"{where} holds an optimizer with {len(groups)} parameter groups, but this Model's "
            f"{type(optimizer).__name__} has {len(current)}; build the optimizer as it was when "
            "the checkpoint was saved."
        )
    for i, (old, new) in enumerate(zip(groups, current)):
        old_keys, new_keys = set(old) - {"params"}, set(new) - {"params"}
        if not old_keys >= new_keys - _OPTIONAL_GROUP_KEYS:
            missing = sorted(new_keys - old_keys - _OPTIONAL_GROUP_KEYS)
            raise ValueError(
                f"{where} was saved with another kind of optimizer than this Model's "
                f"{type(optimizer).__name__}: its parameter group {i} lacks {missing}. Resume "
                "with the optimizer class the run was trained with, or load only the weights "
                "with load_checkpoint(path, model.train_network)."
            )
        if len(old["params"]) != len(new["params"]):
            raise ValueError(
                f"{where}: parameter group {i} had {len(old['params'])} parameters, this "
                f"Model's optimizer has {len(new['params'])}; is it the same network?"
            )


# Group settings that newer torch versions add with defaults: absent from older files.
_OPTIONAL_GROUP_KEYS = frozenset(
    {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}
)
