"""Where a resumed run continues: the loop's place and random state in a checkpoint, and how
a run picks up from it.

A checkpoint written by a callback (``ModelCheckpoint``, ``BackupAndRestore``,
``OnRequestExit``) holds, besides the weights, the last trained step, whether its epoch was
complete, every random generator's state now and at the start of the epoch, and each stateful
callback's state. Resuming mid-epoch replays the epoch's shuffle from the epoch-start state,
skips the batches already trained, then restores the generators to their state at the save,
so the run continues exactly as if it had not stopped.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .serialization import FORMAT, VERSION, read_checkpoint, restore, to_cpu

__all__ = ["ResumePoint", "build_checkpoint", "find_resume_point", "rng_state", "set_rng_state"]

logger = logging.getLogger("stepwatch")


def data_generators(dataset: Any) -> list[torch.Generator]:
    """The generators a DataLoader shuffles with: its own ``generator=`` and its sampler's."""
    found: list[torch.Generator] = []
    holders = (
        dataset,
        getattr(dataset, "sampler", None),
        getattr(getattr(dataset, "batch_sampler", None), "sampler", None),
    )
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def rng_state(dataset: Any = None) -> dict[str, Any]:
    """Every random generator a training step may draw from: torch's, NumPy's, Python's,
    CUDA's, and those of ``dataset`` (a DataLoader built with ``generator=``)."""
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
    if dataset is not None:
        generators = data_generators(dataset)
        if generators:
            state["data"] = [g.get_state() for g in generators]
    return state


def set_rng_state(state: dict[str, Any], dataset: Any = None) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("data")
    if dataset is not None and saved:
        generators = data_generators(dataset)
        if len(generators) != len(saved):
            raise ValueError(
                f"the checkpoint holds {len(saved)} data-loader generator states but this "
                f"run's dataset has {len(generators)} generators: resume with a DataLoader "
                "built the same way (the same generator= and sampler)."
            )
        for generator, generator_state in zip(generators, saved):
            generator.set_state(generator_state)


@dataclass
class ResumePoint:
    """Where a resumed run continues.

    Attributes:
        path: the checkpoint it comes from.
        state: the checkpoint's contents.
        initial_epoch: epochs already complete; training continues with the next one.
        skip: batches of that next epoch already trained (a mid-epoch checkpoint), else 0.
        step: the global step of the checkpoint.
        owner: the callback that offered the checkpoint (``BackupAndRestore``), or None when
            the user named it.
    """

    path: str
    state: dict[str, Any]
    initial_epoch: int
    skip: int
    step: int
    owner: Any = None

    @property
    def epoch_rng(self) -> dict[str, Any] | None:
        return self.state.get("epoch_rng")

    @property
    def rng(self) -> dict[str, Any]:
        return self.state["rng"]

    @property
    def callback_states(self) -> dict[str, Any]:
        return self.state.get("callbacks", {})


def _state_of(obj: Any) -> dict[str, Any] | None:
    return obj.state_dict() if obj is not None else None


def find_resume_point(
    resume_from: str | os.PathLike[str] | None,
    callbacks: Iterable[Any],
    parts: Any,
    epoch: int,
    steps_per_epoch: int,
    dataset: Any = None,
) -> ResumePoint | None:
    """Restore the network, optimizer and random generators from a checkpoint and say where
    the run continues; None when there is nothing to resume.

    Args:
        resume_from: the checkpoint the user named, or None to ask the callbacks
            (``BackupAndRestore.resume_checkpoint()``).
        callbacks: the run's callbacks.
        parts: what to restore: an object with ``train_network`` and ``optimizer``.
        epoch: the run's final epoch number.
        steps_per_epoch: this run's steps per epoch.
        dataset: the training dataset, whose own generators are restored too.

    Raises:
        ValueError: the file holds weights only; (named by the user) it is already at or past
            ``epoch``; it was saved mid-epoch with another number of steps per epoch (a
            different batch size would skip the wrong samples).
    """
    explicit = resume_from is not None
    owner = None
    if not explicit:
        for cb in callbacks:
            finder = getattr(cb, "resume_checkpoint", None)
            if callable(finder) and (found := finder()) is not None:
                resume_from, owner = found, cb
                break
    if resume_from is None:
        return None
    state = read_checkpoint(resume_from)
    if "epoch" not in state:
        raise ValueError(
            f"{str(resume_from)!r} holds weights only (written by save_checkpoint); resuming "
            "needs a checkpoint from ModelCheckpoint, BackupAndRestore or OnRequestExit."
        )
    step = int(state["step"])
    if state["epoch_complete"] or state["step_in_epoch"] >= state["batch_num"]:
        initial_epoch, skip = state["epoch"], 0
        if state["batch_num"] != steps_per_epoch:
            # Another batch size between runs: steps are numbered on this run's epochs.
            step = initial_epoch * steps_per_epoch
    else:
        initial_epoch, skip = state["epoch"] - 1, state["step_in_epoch"]
        if state["batch_num"] != steps_per_epoch:
            raise ValueError(
                f"{str(resume_from)!r} was saved in the middle of epoch {state['epoch']} (step "
                f"{state['step_in_epoch']} of {state['batch_num']}), but this run has "
                f"{steps_per_epoch} steps per epoch (another batch size or dataset?), so the "
                "batches to skip are not the ones trained. Resume with the same dataset and "
                "batch size, or from a checkpoint saved at an epoch's end."
            )
    if explicit and initial_epoch >= epoch:
        raise ValueError(
            f"'resume_from' checkpoint {str(resume_from)!r} is at epoch {state['epoch']}; "
            f"'epoch' must be larger than that to train more, but got {epoch}."
        )
    restore(state, parts, resume_from)  # after the checks: a refused resume changes nothing
    if not skip or state.get("epoch_rng") is None:
        set_rng_state(state["rng"], dataset)
        skip = 0 if state.get("epoch_rng") is None else skip
    logger.info("resuming from %s at epoch %d, step %d", resume_from, state["epoch"], state["step"])
    return ResumePoint(str(resume_from), state, initial_epoch, skip, step, owner)


def skip_then_restore(
    batches: Iterable[Any], skip: int, rng: dict[str, Any], dataset: Any = None
) -> Iterator[Any]:
    """Drop the first ``skip`` batches (trained before the checkpoint), then restore the RNG
    to its state at the save."""
    iterator = iter(batches)
    for _ in range(skip):
        next(iterator, None)
    set_rng_state(rng, dataset)
    yield from iterator


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
    net = network if network is not None else cb_params.network
    optimizer = cb_params.optimizer
    batch_num = int(cb_params.batch_num)
    progress = cb_params.progress
    # The last step whose update is done: a step that failed half-way is not counted.
    step = int(progress.trained_step)
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
        "rng": rng_state(getattr(cb_params, "train_dataset", None)),
        "epoch_rng": progress.epoch_start_rng,
        "callbacks": to_cpu(cb_params.list_callback.state_dicts()),
        "skipped_steps": int(progress.skipped_steps),
        "lr_scheduler": _state_of(getattr(cb_params, "lr_scheduler", None)),
        "loss_scaler": _state_of(getattr(cb_params, "loss_scaler", None)),
        "append_info": dict(append_info or {}),
        "saved_at": time.time(),
    }
    return to_cpu(state) if copy else state
