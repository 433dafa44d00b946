"""``ModelCheckpoint``: save resumable checkpoints as training runs (when and what:
:class:`~stepwatch.train.callback.checkpoint_config.CheckpointConfig`)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ..._validation import TypeAndValueError, nearest_existing
from ...distributed import broadcast_int
from ...monitor.schedule import Every
from ...view.run import view_of
from ..resume import build_checkpoint
from ..serialization import (
    remove_checkpoint,
    remove_stale_temporaries,
    weights_finite,
    write_atomic,
    write_checkpoint,
    writes_here,
)
from ..sharded import is_sharded
from ._callback import ORDER_SAVE, CallbackParams, RunContext
from ._monitor import MonitorCallback
from .checkpoint_config import CheckpointConfig

__all__ = ["CheckpointConfig", "ModelCheckpoint"]

logger = logging.getLogger("stepwatch")


class _AsyncWriter:
    """One background thread writing checkpoint files, at most one waiting behind it."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="stepwatch-ckpt", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            state, path, after = job
            try:
                write_atomic(state, path)
                after(path)
            except BaseException as exc:  # reported on the training thread
                self._error = exc

    def submit(self, state: dict[str, Any], path: Path, after: Any) -> None:
        self.raise_error()
        self._queue.put((state, path, after))

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"saving a checkpoint in the background failed: {error}") from error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.raise_error()


class ModelCheckpoint(MonitorCallback):
    """Save checkpoints ``{prefix}-{epoch}_{step_in_epoch}.pt`` while training.

    Each file holds the network, the optimizer, the epoch and step, every random generator and
    the state of each stateful callback (EarlyStopping's patience, ...), so
    ``model.fit(..., resume_from=path)`` continues the run exactly. Files are written atomically.
    Checkpoints are saved on the step/seconds policy of ``config`` and once more at the end of
    training; a save that falls on an epoch's last step is made at the end of the epoch, after
    validation and the other callbacks' epoch-end work, so it resumes at the next epoch.

    A stop requested by a callback or a signal saves once more; a stop of kind ``'anomaly'``
    (training went wrong) does not, and weights that are not finite are never saved (a
    warning says so), so ``-last.pt`` always points at the last good checkpoint.

    In a distributed run only rank 0 writes (the replicas' weights are the same); every rank
    can resume from its files with ``resume_from=``. A network sharded with FSDP2 is saved by
    every rank, each writing its own shards into a folder beside the file (``<file>.shards-*``,
    in ``directory``, which every rank must reach), never gathered onto one rank; its saves are
    made on the training thread (``async_save`` does not apply) and a failed run writes no
    breakpoint file (the other ranks may not be there to write theirs).

    Args:
        prefix: file name prefix (no path separators). If files with this prefix already exist
            in ``directory``, ``prefix_1``, ``prefix_2``, ... is used, as MindSpore does; a run
            resumed from one of this callback's checkpoints continues that series instead
            (same prefix, ``-last.pt`` stays the newest, ``keep_checkpoint_max`` counts the
            series' earlier files).
        directory: where to save (default: the current directory); created if missing.
        config: a :class:`CheckpointConfig` (default ``CheckpointConfig()``).

    Attributes:
        latest_ckpt_file_name: path of the newest file.
        best_ckpt_file_name: with ``save_best_only``, path of the best file.

    ``prefix`` and ``directory`` may also be functions of cb_params, as in MindSpore: a
    ``directory`` function gives the folder, a ``prefix`` function the whole file name (without
    ``.pt``; MindSpore adds no ``-{epoch}_{step}`` to it either), e.g.
    ``prefix=lambda p: f"net_rank{p.rank_id}-{p.cur_epoch_num}_{p.step_in_epoch}"``. They are
    called when training starts and at each save; with a ``prefix`` function there is no
    ``-last.pt`` link (``latest_ckpt_file_name`` names the newest file).

    The hooks work on a cb_params built by hand too, as MindSpore's tests and users' own unit
    tests drive a callback (``begin(rc)`` then ``step_end(rc)``): the step policy counts from
    step 0, as in MindSpore, and a save due at an epoch's last step is written at once, since
    no loop will call the epoch's end.

    Raises:
        TypeError: ``directory`` not a path, ``config`` not a CheckpointConfig.
        ValueError: ``prefix`` contains a path separator or is empty.
        TypeAndValueError: ``prefix`` not a str (a ValueError in MindSpore: an instance of
            both).
    """

    order = ORDER_SAVE  # after the callbacks whose state it saves

    def __init__(
        self,
        prefix: str = "CKP",
        directory: str | os.PathLike[str] | None = None,
        config: CheckpointConfig | None = None,
    ) -> None:
        if not isinstance(prefix, str) and not callable(prefix):
            raise TypeAndValueError(  # MindSpore: ValueError
                f"'prefix' must be a str or a function of cb_params returning one, but got "
                f"{type(prefix).__name__}."
            )
        # A function of cb_params (MindSpore's per-rank names) is called when training starts.
        self._prefix_fn = prefix if callable(prefix) else None
        self._directory_fn = directory if callable(directory) else None
        if self._prefix_fn is None:
            _check_prefix(prefix)
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            if self._directory_fn is None:
                raise TypeError(
                    f"'directory' must be a str, a path, a function of cb_params returning one, "
                    f"or None, but got {type(directory).__name__}."
                )
            directory = None
        if directory is not None:
            _check_directory("directory", Path(directory))
        if config is None:
            config = CheckpointConfig()
        if not isinstance(config, CheckpointConfig):
            raise TypeError(
                f"'config' must be a CheckpointConfig or None, but got {type(config).__name__}."
            )
        super().__init__(config.monitor, config.mode, config.min_delta)
        self._prefix_requested = prefix if self._prefix_fn is None else "CKP"
        self.prefix = self._prefix_requested
        self.directory = Path(directory) if directory is not None else Path.cwd()
        # What the state key names: the prefix and the folder (absolute, so that a resumed run
        # naming it relatively where the first run named it absolutely is the same series),
        # or the functions that give them.
        named_dir = str(self.directory.resolve())
        if self._directory_fn is not None:
            named_dir = f"<{_qualname(self._directory_fn)}>"
        self._names = (prefix if self._prefix_fn is None else f"<{_qualname(prefix)}>", named_dir)
        self.config = config
        self.latest_ckpt_file_name: str | None = None
        self.best_ckpt_file_name: str | None = None
        self._saved: list[tuple[Path, float]] = []
        self._last_save_step = 0
        self._schedule = Every(config.save_checkpoint_steps, config.save_checkpoint_seconds)
        self._pending_epoch_save = False
        self._writer: _AsyncWriter | None = None
        self._writing: str | None = None
        self._lock = threading.Lock()

    @property
    def state_key(self) -> str:
        prefix, directory = self._names
        return self._state_key_with(directory=directory, prefix=prefix)

    # -- hooks --------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        cb_params = run_context.cb_params
        self._resolve_names(cb_params)
        # Distributed: rank 0 writes; the others keep the same state and write nothing (in a
        # sharded run every rank writes its shards, into the files rank 0 names).
        self._writes = writes_here(cb_params)
        self._sharded = is_sharded(cb_params.get("train_network"))  # None: built by hand
        if cb_params.rank_id == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.directory, self._prefix_requested)
        if self._prefix_fn is None:  # a function names each file itself (MindSpore)
            taken = self._prefixes_taken() if cb_params.rank_id == 0 else 0
            if self._sharded:  # every rank writes, and names the files: rank 0's choice
                taken = broadcast_int(taken)
            if cb_params.rank_id == 0 or self._sharded:
                self.prefix = self._prefix_requested + (f"_{taken}" if taken else "")
        self._saved = []
        self._reset_monitor(cb_params)
        # A trainer's run counts from its first step (a resumed run continues its grid); a
        # cb_params built by hand from step 0, as MindSpore counts.
        self._driven = view_of(cb_params).fed
        self._last_save_step = cb_params.cur_step_num if self._driven else 0
        self._schedule.reset(self._last_save_step)
        self._pending_epoch_save = False
        self._cb_params = cb_params
        if self.config.async_save and self._writer is None and not self._sharded:
            self._writer = _AsyncWriter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.config.save_best_only or run_context.stop_kind == "anomaly":
            return
        cb_params = run_context.original_args()
        step = cb_params.cur_step_num
        if not self._schedule.due(step):
            return
        last = cb_params.last_step_of_epoch
        if last and self._driven_run(cb_params):
            self._pending_epoch_save = True  # the epoch end saves it, with the epoch's state
            return
        self._save(cb_params, epoch_complete=last)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        if self.config.save_best_only:
            current = self.monitor_value(cb_params)
            if current is not None and self.is_improvement(current):
                self.best = current
                path = self._save(cb_params, epoch_complete=True)
                if path is not None:
                    self.best_ckpt_file_name = str(path)
            return
        if self._pending_epoch_save or (
            run_context.stop_requested and run_context.stop_kind != "anomaly"
        ):
            self._save(cb_params, epoch_complete=True)

    def on_train_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        if (
            not self.config.save_best_only
            and self._last_save_step != cb_params.cur_step_num
            and run_context.stop_kind != "anomaly"
        ):
            self._save(cb_params, epoch_complete=True)
        self._close_writer()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if (
                exc_type is not None
                and self.config.exception_save
                and self._cb_params is not None
                and self._writes
                and not self._sharded
            ):
                p = self._cb_params
                state = build_checkpoint(
                    p,
                    epoch_complete=False,
                    network=self.config.saved_network,
                    append_info=self._append_info(p),
                )
                name = f"{self.prefix}-{state['epoch']}_{state['step_in_epoch']}_breakpoint.pt"
                if self._prefix_fn is not None:
                    name = f"{self.prefix}_breakpoint.pt"
                path = write_atomic(state, self.directory / name)
                logger.warning("training failed; breakpoint checkpoint saved to %s", path)
        finally:
            self._close_writer(raise_errors=exc_type is None)

    _cb_params: CallbackParams | None = None
    _writes = True
    _driven: bool | None = None  # a trainer calls the hooks (None: not known before begin)
    _sharded = False

    def _driven_run(self, cb_params: CallbackParams) -> bool:
        """A trainer runs the hooks, so an epoch's end will come (not a cb_params built by
        hand and driven by a test, which calls only the hooks it names)."""
        if self._driven is None:
            self._driven = view_of(cb_params).fed
        return self._driven

    def _resolve_names(self, cb_params: CallbackParams) -> None:
        """Call the ``prefix`` / ``directory`` functions of cb_params, if given."""
        if self._prefix_fn is not None:
            self._prefix_requested = self.prefix = _check_prefix(self._prefix_fn(cb_params))
        if self._directory_fn is not None:
            found = self._directory_fn(cb_params)
            if not isinstance(found, (str, os.PathLike)):
                raise TypeError(
                    f"ModelCheckpoint's 'directory' function returned {found!r}; it must "
                    "return a folder path."
                )
            directory = Path(found)
            if directory != self.directory:
                _check_directory("directory", directory)
                self.directory = directory

    # -- saving -------------------------------------------------------------------------------
    def _prefixes_taken(self) -> int:
        """How many of ``prefix``, ``prefix_1``, ... name files in the directory already (the
        next free one is ``prefix_<n>``, as MindSpore names it)."""
        prefix, n = self._prefix_requested, 0
        while any(self.directory.glob(f"{prefix}-*.pt")):
            n += 1
            prefix = f"{self._prefix_requested}_{n}"
        return n

    def _append_info(self, cb_params: CallbackParams) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for item in self.config.append_info:
            if item == "epoch_num":
                info["epoch_num"] = cb_params.cur_epoch_num
            elif item == "step_num":
                info["step_num"] = cb_params.cur_step_num
            else:
                info.update(item)
        return info

    def _save(self, cb_params: CallbackParams, *, epoch_complete: bool) -> Path | None:
        self._pending_epoch_save = False
        self._last_save_step = cb_params.cur_step_num
        self._schedule.reset(cb_params.cur_step_num)
        if not self._writes:
            return None
        network = self.config.saved_network or cb_params.get("network") or cb_params.train_network
        if not weights_finite(network):
            # A NaN/Inf weight would make this the "newest" file and point -last.pt at it.
            warnings.warn(
                f"ModelCheckpoint: the weights at epoch {cb_params.cur_epoch_num}, step "
                f"{cb_params.cur_step_num} are not finite; not saved, the last good checkpoint "
                f"({self.latest_ckpt_file_name or 'none yet'}) is kept.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        if self._prefix_fn is not None or self._directory_fn is not None:
            self._resolve_names(cb_params)  # as MindSpore: names of this step's cb_params
            self.directory.mkdir(parents=True, exist_ok=True)
        if self._prefix_fn is not None:
            name = f"{self.prefix}.pt"
        else:
            name = f"{self.prefix}-{cb_params.cur_epoch_num}_{cb_params.step_in_epoch}.pt"
        path = self.directory / name
        self._writing = name
        try:
            state = build_checkpoint(
                cb_params,
                epoch_complete=epoch_complete,
                network=self.config.saved_network,
                append_info=self._append_info(cb_params),
                copy=self._writer is not None,
            )
        finally:
            self._writing = None
        cb_params.latest_ckpt_file = str(path)
        cb_params.last_save_ckpt_step = cb_params.cur_step_num
        self.latest_ckpt_file_name = str(path)
        if self._writer is not None:
            self._writer.submit(state, path, self._after_save)
        else:
            write_checkpoint(state, path)
            if cb_params.rank_id == 0:
                self._after_save(path)
        return path

    def _after_save(self, path: Path) -> None:
        with self._lock:
            self._saved = [(p, t) for p, t in self._saved if p != path]
            self._saved.append((path, time.monotonic()))
            self._prune()
            if self.config.save_last and self._prefix_fn is None:
                self._link_last(path)

    def _prune(self) -> None:
        cfg = self.config
        if cfg.keep_checkpoint_max:
            while len(self._saved) > cfg.keep_checkpoint_max:
                old, _ = self._saved.pop(0)
                remove_checkpoint(old)
        elif cfg.keep_checkpoint_per_n_minutes and len(self._saved) >= 3:
            # Keep the newest file and one per N minutes before it.
            (_, t_kept), (middle, t_mid), _ = self._saved[-3:]
            if t_mid - t_kept < cfg.keep_checkpoint_per_n_minutes * 60:
                remove_checkpoint(middle)
                del self._saved[-2]

    def _link_last(self, path: Path) -> None:
        last = self.directory / f"{self.prefix}-last.pt"
        # A unique temporary name: several processes may share the directory.
        tmp = self.directory / f".tmp-{self.prefix}-last-{os.getpid()}-{threading.get_ident()}.pt"
        _unlink(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            import shutil

            shutil.copyfile(path, tmp)
        os.replace(tmp, last)

    def _close_writer(self, raise_errors: bool = True) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except RuntimeError:
            if raise_errors:
                raise
            warnings.warn("a background checkpoint save failed", RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            saved = [p.name for p, _ in self._saved]
        if self._writing is not None and self._writing not in saved:
            saved.append(self._writing)  # the file this state is being written into
        return {
            "best": self.best,
            "best_ckpt_file_name": self.best_ckpt_file_name or "",
            # The series a resumed run continues: its prefix and files (oldest first).
            "prefix": self.prefix,
            "saved": saved,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.best_ckpt_file_name = state.get("best_ckpt_file_name") or None
        prefix = state.get("prefix")
        if prefix:
            # A resumed run continues the series it was saved in: same prefix, the older files
            # count against keep_checkpoint_max, and -last.pt keeps pointing at the newest.
            self.prefix = str(prefix)
            now = time.monotonic()
            with self._lock:
                self._saved = [
                    (self.directory / name, now)
                    for name in state.get("saved", [])
                    if (self.directory / name).is_file()
                ]


def _check_directory(argname: str, directory: Path) -> None:
    """A folder that exists or can be created: not a file, nor under one, and writable."""
    probe = nearest_existing(directory)
    if not probe.is_dir():
        raise ValueError(
            f"'{argname}' must be a folder, but {str(probe)!r} is a file; pass a folder path."
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"'{argname}' {str(directory)!r} is not writable (no permission).")


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _check_prefix(prefix: Any) -> str:
    if not isinstance(prefix, str):
        raise TypeAndValueError(  # MindSpore: ValueError
            f"'prefix' must be a str or a function of cb_params returning one, but got "
            f"{type(prefix).__name__}."
        )
    if not prefix or "/" in prefix or os.sep in prefix:
        raise ValueError(
            f"'prefix' must be a file name prefix without '/', but got {prefix!r}; put the "
            "folder in 'directory'."
        )
    return prefix


def _qualname(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", type(fn).__name__))
