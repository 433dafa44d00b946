"""``OnRequestExit``: end the run cleanly, with a checkpoint, when the process is asked to stop."""

from __future__ import annotations

import logging
import os
import signal
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..._validation import check_bool
from ..resume import build_checkpoint
from ..serialization import save_checkpoint, write_checkpoint, writes_here
from ._callback import ORDER_SAVE, Callback, RunContext

__all__ = ["OnRequestExit"]

logger = logging.getLogger("stepwatch")


class OnRequestExit(Callback):
    """On SIGTERM or SIGINT, finish the current step, save a checkpoint and end the run.

    The signal only sets a flag; the step in flight completes, a resumable checkpoint
    ``{directory}/{file_name}.pt`` is written, and the run ends through the normal path
    (validation, ``on_train_epoch_end``, ``on_train_end`` and every ``__exit__`` run), so the
    process can exit 0. A second SIGINT while stopping interrupts at once (KeyboardInterrupt).
    Resume with ``model.fit(..., resume_from=f"{directory}/{file_name}.pt")``.

    In ``Model.eval`` the signal ends the pass after the step in flight and the evaluated
    network's weights are saved to ``{directory}/{file_name}_eval.pt``. As in MindSpore, the
    handler stays installed when the run ends, so a signal between two runs (or while the
    next one is being set up, before its callbacks begin) does not kill the process; it is
    kept, and the next run with an OnRequestExit (this one or another) stops after its first
    step and saves. Outside a run, SIGINT still interrupts at once.

    Args:
        save_ckpt: write the checkpoint before stopping.
        file_name: the checkpoint's file name, without ``.pt``.
        directory: where to write it (created if missing).
        sig: the signal or signals to handle (default SIGTERM and SIGINT).

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value.
    """

    order = ORDER_SAVE

    def __init__(
        self,
        save_ckpt: bool = True,
        file_name: str = "Net",
        directory: str | os.PathLike[str] = "./",
        sig: int | Iterable[int] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self.save_ckpt = check_bool("save_ckpt", save_ckpt)
        if not isinstance(file_name, str):
            raise TypeError(
                f"'file_name' must be a str (a file name without '/'), but got {file_name!r} with "
                f"type '{type(file_name).__name__}'."
            )
        if not file_name or "/" in file_name:
            raise ValueError(f"'file_name' must be a file name without '/', but got {file_name!r}.")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"'directory' must be a str or path, but got {type(directory).__name__}."
            )
        signals = [sig] if isinstance(sig, int) else list(sig)
        valid = set(signal.valid_signals())
        uncatchable = {signal.SIGKILL, signal.SIGSTOP}
        for s in signals:
            if isinstance(s, bool) or not isinstance(s, int) or s not in valid:
                raise ValueError(f"'sig' must be signal numbers such as signal.SIGTERM, got {s!r}.")
            if s in uncatchable:
                raise ValueError(
                    f"'sig' {signal.Signals(s).name} cannot be caught by a process; use "
                    "signal.SIGTERM or signal.SIGINT."
                )
        if not signals:
            raise ValueError("'sig' must name at least one signal.")
        self.file_name = file_name
        self.directory = Path(directory)
        self.signals = [signal.Signals(s) for s in signals]
        self.received: signal.Signals | None = None
        self.checkpoint_path: Path | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._running = False  # a run (training, or Model.eval on its own) is in progress
        self._pending = False  # self.received came outside a run: the next run acts on it
        self._evaluating = False

    @property
    def path(self) -> Path:
        return self.directory / f"{self.file_name}.pt"

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and (self.received is not None or not self._running):
            raise KeyboardInterrupt
        self.received = signal.Signals(signum)
        # Outside a run (between two, or as the next is being set up): kept for that run.
        self._pending = not self._running

    def _begin(self) -> None:
        """A run starts: act on a signal that came before it (to this callback, or to the
        OnRequestExit whose handler was installed until now), else start clean."""
        pending = self.received if self._pending else None
        self._pending = False
        self.checkpoint_path = None
        self._running = True
        self.received = self._install() or pending

    def _install(self) -> signal.Signals | None:
        """Install the handlers; return a signal another OnRequestExit's handler took outside
        a run (it was meant for the run starting now), which that callback then forgets."""
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "OnRequestExit only works when training runs on the main thread; signals are "
                "not handled.",
                UserWarning,
                stacklevel=4,
            )
            return None
        taken = None
        for s in self.signals:
            current = signal.getsignal(s)
            if current != self._handle:
                other = getattr(current, "__self__", None)
                if isinstance(other, OnRequestExit) and other._pending:
                    taken, other.received, other._pending = other.received, None, False
                self._previous.setdefault(s, current)
                signal.signal(s, self._handle)
        return taken

    def on_train_begin(self, run_context: RunContext) -> None:
        self._begin()

    def on_eval_begin(self, run_context: RunContext) -> None:
        if run_context.cb_params.get("mode") == "eval" and not self._running:
            # Model.eval on its own: its own run (inside fit, the training run's state holds).
            self._evaluating = True
            self._begin()

    def on_eval_step_end(self, run_context: RunContext) -> None:
        if self._evaluating and self.received is not None:
            run_context.request_stop(f"received {self.received.name}", interrupted=True)

    def on_eval_end(self, run_context: RunContext) -> None:
        if not self._evaluating:
            return
        self._evaluating = self._running = False
        if self.received is not None and self.save_ckpt and writes_here(run_context.cb_params):
            network = run_context.cb_params.get("eval_network") or run_context.cb_params.network
            self.checkpoint_path = save_checkpoint(network, self.eval_path)

    @property
    def eval_path(self) -> Path:
        return self.directory / f"{self.file_name}_eval.pt"

    def restore_handlers(self) -> None:
        """Put back the signal handlers that were installed before this callback's."""
        for s, handler in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, handler)
        self._previous.clear()

    def _stop(self, run_context: RunContext, epoch_complete: bool) -> None:
        assert self.received is not None
        reason = f"received {self.received.name}"
        cb_params = run_context.cb_params
        if self.save_ckpt and self.checkpoint_path is None and writes_here(cb_params):
            state = build_checkpoint(run_context.original_args(), epoch_complete=epoch_complete)
            self.checkpoint_path = write_checkpoint(state, self.path)  # sharded: every rank
            reason += f"; checkpoint saved to {self.checkpoint_path}"
        run_context.request_stop(reason, interrupted=True)

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self.received is None or run_context.get_stop_requested():
            return
        if run_context.cb_params.last_step_of_epoch:
            # The epoch's last step: stop, and save at the epoch end with the epoch's state.
            run_context.request_stop(f"received {self.received.name}", interrupted=True)
            return
        self._stop(run_context, epoch_complete=False)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        if self.received is not None and self.checkpoint_path is None:
            self._stop(run_context, epoch_complete=True)

    def on_train_end(self, run_context: RunContext) -> None:
        self._running = False

    def __exit__(self, *err: Any) -> None:
        self._running = self._evaluating = False
