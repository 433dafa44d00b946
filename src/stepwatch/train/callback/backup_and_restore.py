"""``BackupAndRestore``: a restarted job continues where the last one stopped."""

from __future__ import annotations

import os
from pathlib import Path

from ..._validation import check_bool, check_int
from ...monitor.schedule import Every
from ..resume import build_checkpoint
from ..serialization import remove_checkpoint, weights_finite, write_checkpoint, writes_here
from ._callback import ORDER_SAVE, Callback, RunContext

__all__ = ["BackupAndRestore"]


class BackupAndRestore(Callback):
    """Back the run up to ``backup_dir``; a job started again with the same callback resumes.

    At the start of ``train``/``fit``, if ``backup_dir`` holds a backup, the network, optimizer,
    random generators, counters and callback states are restored from it and training continues
    at the saved epoch and step. At a normal end (early stopping included) the backup is
    deleted (``delete_checkpoint``); when there is none, nothing happens. A run interrupted by
    a signal (``OnRequestExit``) keeps it, so the restarted job resumes.

    Args:
        backup_dir: the folder for the backup file (``backup.pt``); created if missing.
        save_freq: ``'epoch'`` (back up at each epoch end) or a number of steps.
        delete_checkpoint: delete the backup when training ends normally.

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value.
    """

    order = ORDER_SAVE

    def __init__(
        self,
        backup_dir: str | os.PathLike[str],
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
    ) -> None:
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(
                f"'backup_dir' must be a str or path, but got {backup_dir!r} with type "
                f"'{type(backup_dir).__name__}'."
            )
        if not str(backup_dir):
            raise ValueError("'backup_dir' must name a folder, but got an empty path.")
        if save_freq != "epoch":
            if isinstance(save_freq, str):
                raise ValueError(f"'save_freq' must be 'epoch' or an int >= 1, got {save_freq!r}.")
            check_int("save_freq", save_freq, minimum=1)
        self.backup_dir = Path(backup_dir)
        self.save_freq = save_freq
        self._schedule = Every(steps=save_freq if isinstance(save_freq, int) else None)
        self.delete_checkpoint = check_bool("delete_checkpoint", delete_checkpoint)

    @property
    def backup_path(self) -> Path:
        return self.backup_dir / "backup.pt"

    def resume_checkpoint(self) -> Path | None:
        """The backup to resume from, if there is one (the Model asks before training)."""
        return self.backup_path if self.backup_path.is_file() else None

    def resume_complete(self) -> None:
        """The backup offered has nothing left to train: the job is done, so delete it (with
        ``delete_checkpoint``), as at a normal end."""
        if self.delete_checkpoint:
            remove_checkpoint(self.backup_path)

    def _backup(self, run_context: RunContext, epoch_complete: bool) -> None:
        if not writes_here(run_context.cb_params):
            return  # distributed: rank 0 writes the one backup every rank resumes from
        if run_context.stop_kind == "anomaly" or not weights_finite(run_context.cb_params.network):
            return  # keep the last good backup rather than one of broken weights
        state = build_checkpoint(run_context.original_args(), epoch_complete=epoch_complete)
        write_checkpoint(state, self.backup_path)  # sharded: every rank writes its shards

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.save_freq == "epoch":
            return
        p = run_context.cb_params
        if self._schedule.due(p.cur_step_num) and not p.last_step_of_epoch:
            self._backup(run_context, epoch_complete=False)

    def on_train_begin(self, run_context: RunContext) -> None:
        self._schedule.reset(run_context.original_args().cur_step_num)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        self._backup(run_context, epoch_complete=True)

    def on_train_end(self, run_context: RunContext) -> None:
        # A run stopped from outside (OnRequestExit) is to be resumed, and one stopped by an
        # anomaly may be resumed from its last good state: keep the backup for both.
        done = run_context.stop_kind in (None, "requested")
        if self.delete_checkpoint and done and run_context.cb_params.rank_id == 0:
            remove_checkpoint(self.backup_path)
