"""Checkpoint files: what they hold, how they are written safely, and how a run resumes.

A checkpoint is one ``torch.save`` file holding the network, the optimizer, the loop counters,
every random generator's state and the state of each stateful callback. Files are written to a
temporary name in the same directory, flushed to disk and renamed over the target, so a process
killed mid-save leaves the previous file intact. Files load with ``weights_only=True``.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "stepwatch-checkpoint"
VERSION = 1
TMP_PREFIX = ".tmp-"


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": [version, list(internal), py_gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live on the CPU and share nothing with training."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


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


def write_atomic(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically: the file is either the old one or the new one."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX + target.name, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
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


def save_checkpoint(save_obj: Any, ckpt_file_name: str | os.PathLike[str]) -> Path:
    """Save a network's weights (and a Model's optimizer) to a checkpoint file, atomically.

    Args:
        save_obj: a :class:`stepwatch.Model`, an ``nn.Module`` or a ``state_dict``.
        ckpt_file_name: the file to write (its folder is created).

    Returns:
        The path written. ``load_checkpoint(path, model)`` reads it back. Checkpoints written
        by ``ModelCheckpoint`` also hold the loop state needed to resume training.
    """
    from torch import nn

    if isinstance(save_obj, nn.Module):
        network, optimizer = save_obj.state_dict(), None
    elif isinstance(save_obj, dict):
        network, optimizer = save_obj, None
    elif hasattr(save_obj, "train_network"):
        network = save_obj.train_network.state_dict()
        opt = getattr(save_obj, "_optimizer", None)
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
    return write_atomic(
        {"format": FORMAT, "version": VERSION, "network": network, "optimizer": optimizer},
        ckpt_file_name,
    )


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
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {str(p)!r}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{str(p)!r} is not a readable stepwatch checkpoint (truncated or corrupt?): {exc}"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{str(p)!r} is not a stepwatch checkpoint (no '{FORMAT}' marker).")
    return state


def callback_states(callbacks: Iterable[Any]) -> dict[str, Any]:
    """``{state_key: state_dict()}`` for every stateful callback."""
    return {cb.state_key: to_cpu(cb.state_dict()) for cb in callbacks if is_stateful(cb)}


def is_stateful(callback: Any) -> bool:
    from .callback._callback import Callback

    return type(callback).state_dict is not Callback.state_dict


def check_state_keys(callbacks: Iterable[Any]) -> None:
    seen: dict[str, Any] = {}
    for cb in callbacks:
        if not is_stateful(cb):
            continue
        key = cb.state_key
        if key in seen:
            raise ValueError(
                f"two callbacks share the state_key {key!r} ({type(seen[key]).__name__} and "
                f"{type(cb).__name__}); their saved states would overwrite each other. Give one "
                "of them different arguments or override its state_key."
            )
        seen[key] = cb


def load_checkpoint(
    path: str | os.PathLike[str],
    model: Any = None,
    callbacks: Iterable[Any] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint; restore ``model``'s network and optimizer and the callbacks' state.

    Args:
        path: a file written by ``ModelCheckpoint``, ``BackupAndRestore`` or ``OnRequestExit``.
        model: a :class:`stepwatch.Model` (its network and optimizer are restored) or an
            ``nn.Module`` (its weights are restored), or None to only read the file.
        callbacks: callbacks whose state to restore, matched by ``state_key``.
        strict: passed to ``load_state_dict`` of the network.

    Returns:
        The checkpoint dict: ``network``, ``optimizer``, ``epoch``, ``step``,
        ``step_in_epoch``, ``epoch_complete``, ``callbacks``, ``append_info``, ...

    To resume training, pass the path to ``Model.train/fit(..., resume_from=path)`` instead:
    that also restores the random generators and continues at the saved epoch and step.
    """
    from torch import nn

    state = read_checkpoint(path)
    if model is not None:
        network = model if isinstance(model, nn.Module) else model.train_network
        network.load_state_dict(state["network"], strict=strict)
        optimizer = None if isinstance(model, nn.Module) else model._optimizer
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
    if callbacks is not None:
        load_checkpoint_states(state, callbacks)
    return state


def load_checkpoint_states(state: dict[str, Any], callbacks: Iterable[Any]) -> None:
    """Give each stateful callback its saved state, matched by ``state_key``."""
    saved = state.get("callbacks", {})
    for cb in callbacks:
        if is_stateful(cb) and cb.state_key in saved:
            cb.load_state_dict(saved[cb.state_key])


def build_checkpoint(
    cb_params: Any,
    *,
    epoch_complete: bool,
    network: Any = None,
    append_info: dict[str, Any] | None = None,
    copy: bool = False,
) -> dict[str, Any]:
    """The checkpoint of the run described by ``cb_params``, as of now.

    ``epoch_complete``: True when saving at an epoch's end (after its validation and epoch-end
    hooks); it is recorded only if the epoch's last step was trained. ``copy=True`` copies
    every tensor to the CPU, so the result can be written from another thread while training
    goes on changing the originals.
    """
    import time

    net = network if network is not None else cb_params.network
    optimizer = cb_params.optimizer
    batch_num = int(cb_params.batch_num)
    # The last step whose update is done: a step that failed half-way is not counted.
    step = int(cb_params.__dict__.get("_trained_step", cb_params.cur_step_num))
    step_in_epoch = (step - 1) % batch_num + 1 if step else 0
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "network": net.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        # The epoch the step belongs to: a failure at an epoch's first step leaves the
        # previous epoch's last step as the last one done.
        "epoch": (step - 1) // batch_num + 1 if step else int(cb_params.cur_epoch_num),
        "step": step,
        "step_in_epoch": step_in_epoch,
        "batch_num": batch_num,
        # Saved at an epoch end after a stop part-way through, the epoch is not complete: a
        # resumed run trains the rest of it.
        "epoch_complete": bool(epoch_complete) and step_in_epoch == batch_num,
        "rng": rng_state(),
        "epoch_rng": getattr(cb_params, "_epoch_start_rng", None),
        "callbacks": callback_states(cb_params.list_callback),
        "append_info": dict(append_info or {}),
        "saved_at": time.time(),
    }
    return to_cpu(state) if copy else state
