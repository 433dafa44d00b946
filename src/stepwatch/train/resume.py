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
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .serialization import FORMAT, VERSION, read_checkpoint, to_cpu
from .state import TrainingState, rng_state, set_rng_state

__all__ = ["ResumePoint", "build_checkpoint", "find_resume_point", "rng_state", "set_rng_state"]

logger = logging.getLogger("stepwatch")


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
    # After the checks: a refused resume changes nothing.
    TrainingState.of(parts).restore(state, path=resume_from)
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
    training = TrainingState.of(cb_params)
    if network is not None:
        training.network = network
    batch_num = int(cb_params.batch_num)
    progress = cb_params.progress
    # The last step whose update is done: a step that failed half-way is not counted.
    step = int(progress.trained_step)
    step_in_epoch = (step - 1) % batch_num + 1 if step else 0
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        **training.capture(),
        # The epoch the step belongs to: a failure at an epoch's first step leaves the
        # previous epoch's last step as the last one done.
        "epoch": (step - 1) // batch_num + 1 if step else int(cb_params.cur_epoch_num),
        "step": step,
        "step_in_epoch": step_in_epoch,
        "batch_num": batch_num,
        # Saved at an epoch end after a stop part-way through, the epoch is not complete: a
        # resumed run trains the rest of it.
        "epoch_complete": bool(epoch_complete) and step_in_epoch == batch_num,
        "epoch_rng": progress.epoch_start_rng,
        "skipped_steps": int(progress.skipped_steps),
        "append_info": dict(append_info or {}),
        "saved_at": time.time(),
    }
    return to_cpu(state) if copy else state
