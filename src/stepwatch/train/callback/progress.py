"""``ProgressBar``: a tqdm bar with epoch, step, loss, steps/s and the time left."""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import IO, Any

from tqdm import tqdm

from ..._validation import check_number
from ...monitor import values as names
from ...monitor.schedule import Every, Pace
from ...view.run import RunView, view_of
from ._callback import Callback, RunContext
from ._print import set_line_writer

__all__ = ["ProgressBar"]


class _Bar(tqdm):
    """A tqdm bar whose postfix is computed when the bar is drawn, and only then."""

    # No monitor thread: the postfix reads the loss, which must happen on the training thread.
    monitor_interval = 0

    def __init__(self, *args: Any, describe: Any = None, **kwargs: Any) -> None:
        self._describe = describe
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        found = super().format_dict
        if self._describe is not None:
            found["postfix"] = _fit(self._describe(), found)
        return found


_MIN_BAR = 10  # cells the bar keeps, however long the postfix


def _fit(postfix: str, meter: dict[str, Any]) -> str:
    """``postfix`` cut to what the line has room for beside a bar of at least ``_MIN_BAR``
    cells: whole ``name=value`` items are left out from the end, so the line is never cut
    mid-number and the bar never shrinks to a sliver."""
    ncols = meter.get("ncols")
    if not ncols or not postfix:
        return postfix
    fixed = tqdm.format_meter(
        **{**meter, "ncols": None, "postfix": None, "bar_format": "{l_bar}{r_bar}"}
    )
    room = ncols - len(fixed) - _MIN_BAR - 2  # ", " before the postfix
    kept: list[str] = []
    for item in postfix.split(", "):
        if len(", ".join([*kept, item])) > room:
            break
        kept.append(item)
    return ", ".join(kept)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _width(stream: Any) -> dict[str, Any]:
    """Follow the terminal's width; a terminal that reports none (0 columns) gets 100."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        columns = 100
    return {"dynamic_ncols": True} if columns > 0 else {"ncols": 100}


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class ProgressBar(Callback):
    """A progress bar over the run: epoch and step, loss, steps/s and the time left (ETA).

    On a terminal it is a tqdm bar that redraws at most every ``refresh_seconds`` (tqdm's
    count-and-time throttling); the loss is read from the device only when the bar redraws,
    never on the other steps. It has no step hook: it looks at the run on the loss tap's step
    clock, about four times per redraw period, as far apart in steps as the step rate allows,
    so the steps in between cost it nothing. ``fit`` shows a second bar while it validates.
    Lines printed by ``LossMonitor``, ``TimeMonitor``, ``EarlyStopping`` and
    ``ReduceLROnPlateau`` appear above the bar without breaking it.

    When the stream is not a terminal (a pipe, a log file, a CI job) there is no bar: one plain
    line per epoch, and within a long epoch one line every ``plain_every_seconds``. Under
    ``torch.distributed`` only rank 0 shows progress.

    Args:
        file: where the bar goes; default ``sys.stdout`` (where the monitors print).
        refresh_seconds: least time between two redraws of the bar.
        plain_every_seconds: without a terminal, least time between two progress lines inside
            an epoch; 0 prints only at the end of each epoch.

    Raises:
        TypeError: ``file`` has no ``write``; a setting is not a number.
        ValueError: ``refresh_seconds`` not positive; ``plain_every_seconds`` negative.

    Example:
        >>> model.fit(10, train, valid, callbacks=[ProgressBar(), LossMonitor(100)])
    """

    rank_zero_only = True

    def __init__(
        self,
        file: IO[str] | None = None,
        refresh_seconds: float = 0.2,
        plain_every_seconds: float = 30.0,
    ) -> None:
        if file is not None and not callable(getattr(file, "write", None)):
            raise TypeError(
                f"'file' must be a text stream such as sys.stderr or None, but got {file!r}."
            )
        if file is not None and getattr(file, "closed", False):
            raise ValueError(f"'file' {file!r} is closed; pass an open stream such as sys.stderr.")
        self.file = file
        self.refresh_seconds = check_number("refresh_seconds", refresh_seconds, minimum=0.0)
        if not self.refresh_seconds > 0:
            raise ValueError(
                f"'refresh_seconds' must be positive, but got {refresh_seconds!r}; pass e.g. 0.2."
            )
        self.plain_every_seconds = check_number(
            "plain_every_seconds", plain_every_seconds, minimum=0.0
        )
        self._bar: _Bar | None = None
        self._eval_bar: _Bar | None = None
        self._view: RunView | None = None
        self._eval: dict[str, float] = {}
        self._stream: Any = None
        self._previous_writer: Any = None
        self._plain = Every(seconds=self.plain_every_seconds or None)
        self._pace = Pace(self.refresh_seconds)
        self._epochs = 0
        self._batches = 0
        self._start = (0.0, 0)
        self._total = 0

    # -- what the bar says -------------------------------------------------------------------
    def _describe(self) -> str:
        parts = []
        step = self._bar.n if self._bar is not None else 0
        if self._batches and step:
            parts.append(f"step {(step - 1) % self._batches + 1}/{self._batches}")
        loss = self._view.tap.latest if self._view is not None else None
        if loss is not None:
            parts.append(f"loss={_fmt(float(loss))}")  # the one host read, on redraw
        parts += [f"{k}={_fmt(v)}" for k, v in self._eval.items()]
        return ", ".join(parts)

    def _write_line(self, line: str) -> None:
        _Bar.write(line, file=sys.stdout)

    def _plain_line(self, cb_params: Any, step: int, loss: float | None) -> None:
        started, first = self._start
        elapsed = time.perf_counter() - started
        rate = (step - first) / elapsed if elapsed > 0 else 0.0
        line = f"epoch {cb_params.cur_epoch_num}/{self._epochs}"
        if self._batches:
            line += f" step {cb_params.step_in_epoch}/{self._batches}"
        if loss is not None:
            line += f", loss {_fmt(loss)}"
        line += "".join(f", {k} {_fmt(v)}" for k, v in self._eval.items())
        line += f", {rate:.1f} steps/s"
        if rate > 0 and self._total:
            line += f", ETA {tqdm.format_interval(max(self._total - step, 0) / rate)}"
        print(line, file=self._stream, flush=True)

    # -- training -----------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        bars = [cb for cb in cb_params.get("list_callback") or () if isinstance(cb, ProgressBar)]
        if len(bars) > 1 and bars[0] is self:
            warnings.warn(
                f"{len(bars)} ProgressBars in one run: every progress line is printed "
                f"{len(bars)} times. Pass one.",
                UserWarning,
                stacklevel=2,
            )
        self._stream = self.file if self.file is not None else sys.stdout
        self._epochs = cb_params.initial_epoch + cb_params.epoch_num
        self._batches = int(cb_params.batch_num or 0)
        first = int(cb_params.cur_step_num)
        self._total = cb_params.initial_step + cb_params.epoch_num * self._batches
        self._start = (time.perf_counter(), first)
        self._eval = {}
        self._view = view_of(cb_params)
        self._plain.reset(first)
        terminal = _is_terminal(self._stream)
        # Looks about four times a redraw period (or a plain line's), paced by the step rate.
        self._pace = Pace(self.refresh_seconds if terminal else self.plain_every_seconds)
        self._pace.reset(first)
        if terminal or self._plain.seconds:
            self._view.tap.call_at(first + 1, self._look)
        if terminal:
            self._bar = _Bar(
                total=self._total or None,
                initial=first,
                desc=f"epoch {cb_params.cur_epoch_num + 1}/{self._epochs}",
                unit="step",
                file=self._stream,
                mininterval=self.refresh_seconds,
                **_width(self._stream),
                leave=True,
                describe=self._describe,
            )
            self._previous_writer = set_line_writer(self._write_line)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        if self._bar is not None:
            epoch = run_context.cb_params.cur_epoch_num
            self._bar.set_description_str(f"epoch {epoch}/{self._epochs}", refresh=False)

    def _look(self, step: int) -> None:
        """A look on the run's step clock (no step hook: the steps between cost nothing)."""
        view = self._view
        if view is None:
            return
        bar = self._bar
        if bar is not None:
            bar.update(step - bar.n)  # tqdm redraws when refresh_seconds have passed
        else:
            cb_params = view.params
            if self._plain.due(step) and not cb_params.last_step_of_epoch:
                latest = view.tap.latest
                if latest is not None:
                    self._plain_line(cb_params, step, float(latest))
        view.tap.call_at(step + self._pace.ahead(step), self._look)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        eval_results = cb_params.get("eval_results") or {}
        self._eval = {
            names.eval_name(k): float(v)
            for k, v in eval_results.items()
            if isinstance(v, (int, float))
        }
        if self._bar is not None:
            self._bar.update(cb_params.cur_step_num - self._bar.n)
            self._bar.refresh()
        else:
            loss = cb_params.train_results.get("loss")
            self._plain_line(cb_params, cb_params.cur_step_num, loss)
            self._plain.reset(cb_params.cur_step_num)

    def on_train_end(self, run_context: RunContext) -> None:
        self._close()

    # -- validation ---------------------------------------------------------------------------
    def on_eval_begin(self, run_context: RunContext) -> None:
        stream = self._stream if self._stream is not None else (self.file or sys.stdout)
        if not _is_terminal(stream):
            return
        self._eval_bar = _Bar(
            total=run_context.cb_params.batch_num or None,
            desc="validate",
            unit="step",
            file=stream,
            mininterval=self.refresh_seconds,
            **_width(stream),
            leave=self._bar is None,
            position=1 if self._bar is not None else None,
        )

    def on_eval_step_end(self, run_context: RunContext) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)

    def on_eval_end(self, run_context: RunContext) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None

    # -- closing ------------------------------------------------------------------------------
    def _close(self) -> None:
        for bar in (self._eval_bar, self._bar):
            if bar is not None:
                bar.close()
        if self._bar is not None:
            set_line_writer(self._previous_writer)
        self._bar = self._eval_bar = None
        if self._view is not None:
            self._view.tap.unsubscribe(self)
        self._view = None  # no device tensor kept alive after the run

    def __exit__(self, *err: Any) -> None:
        self._close()
