"""``PlotMonitor``: training curves drawn into a PNG on a background thread."""

from __future__ import annotations

import logging
import math
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any

from ..._validation import check_int, check_number, nearest_existing
from ...monitor import values as names
from ...monitor.schedule import Every
from ...plotting import RunCurves, render_png, replace_file
from ...view.run import RunView, view_of
from ...view.tap import Chunk
from ._callback import Callback, RunContext

__all__ = ["PlotMonitor"]

logger = logging.getLogger(__name__)

# Loss tensors held on the device before one transfer to the host.
_TRANSFER_EVERY = 512


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class _Series:
    """One curve, kept to at most ``2 * limit`` points: when full, each group of four
    neighbours keeps its lowest and highest point, so a one-step spike survives."""

    __slots__ = ("limit", "steps", "values")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.steps: list[int] = []
        self.values: list[float] = []

    def extend(self, steps: list[int], values: list[float]) -> None:
        self.steps += steps
        self.values += values
        if len(self.steps) > 2 * self.limit:
            self._compact()

    def _compact(self) -> None:
        steps, values = self.steps, self.values
        kept_steps: list[int] = []
        kept_values: list[float] = []
        for start in range(0, len(steps), 4):
            group = range(start, min(start + 4, len(steps)))
            finite = [i for i in group if not math.isnan(values[i])]
            pick = (
                sorted({min(finite, key=values.__getitem__), max(finite, key=values.__getitem__)})
                if finite
                else [group[0]]
            )
            kept_steps += [steps[i] for i in pick]
            kept_values += [values[i] for i in pick]
        self.steps, self.values = kept_steps, kept_values


class PlotMonitor(Callback):
    """Draw the loss, metric and learning-rate curves into ``path`` while training runs.

    Train and validation values share a panel (``loss`` with ``eval_loss``, ``train_accuracy``
    with ``eval_accuracy``). The picture is drawn with matplotlib's Agg canvas on a background
    thread, so it works without a display and a step never waits for it: the training thread
    only hands over a copy of the curves every ``every_n_seconds`` (when the thread is still
    drawing, the older copy is dropped). The step losses come from the run's loss tap and are
    read once per 512 steps or per picture. A last picture is drawn when
    training ends. In a Jupyter notebook the picture is also shown under the cell and
    updated in place.

    Drawing never stops training: a failure is logged once and the monitor goes quiet. Only
    rank 0 draws. Needs matplotlib (``pip install 'stepwatch[plot]'``).

    Args:
        path: the PNG file to write (replaced whole each time).
        every_n_seconds: least time between two pictures during training.
        max_points: points kept per curve (min/max-thinned beyond it): bounded memory.

    Raises:
        TypeError / ValueError: a bad argument. ImportError: matplotlib is missing.

    Example:
        >>> model.fit(10, train, valid, callbacks=[PlotMonitor("curves.png", 30)])
    """

    rank_zero_only = True

    def __init__(
        self,
        path: str | os.PathLike[str] = "curves.png",
        every_n_seconds: float = 30.0,
        max_points: int = 2000,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"'path' must be a file name such as 'curves.png', but got {path!r}.")
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"'path' {str(path)!r} is a folder; pass a file such as 'curves.png'.")
        if self.path.suffix.lower() != ".png":
            raise ValueError(
                f"'path' {str(path)!r} must name a PNG file (ending in .png): PlotMonitor "
                "writes PNG pictures."
            )
        folder = nearest_existing(self.path.parent)
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(
                f"'path' {str(path)!r} cannot be written ({str(folder)!r} is read-only, not "
                "yours, or a file); pass a file in a folder you can write."
            )
        self.every_n_seconds = check_number("every_n_seconds", every_n_seconds, minimum=0.0)
        self.max_points = check_int("max_points", max_points, minimum=10)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError(
                "PlotMonitor needs matplotlib: pip install 'stepwatch[plot]'"
            ) from None
        self._schedule = Every(seconds=self.every_n_seconds or None)
        self._series: dict[str, _Series] = {}
        self._chunks: list[Chunk] = []  # step losses from the run's tap, not read yet
        self._waiting = 0
        self._rates: Any = None  # the run's learning rates
        self._view: RunView | None = None
        self._jobs: queue.Queue[RunCurves | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._failed = False
        self._display: Any = None
        self.drawn = 0  # pictures written so far

    # -- the training thread -----------------------------------------------------------------
    def _add(self, key: str, steps: list[int], values: list[float]) -> None:
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(self.max_points)
        series.extend(steps, values)

    def _take(self, chunk: Chunk) -> None:
        """Step losses from the run's tap: kept until the next picture or 512 steps."""
        self._chunks.append(chunk)
        self._waiting += len(chunk)
        last = chunk.steps[-1]
        due = self._schedule.seconds and self._schedule.due(last)
        if due or self._waiting >= _TRANSFER_EVERY:
            self._transfer(last)
            if due and not self._failed:
                self._submit()

    def _transfer(self, step: int) -> None:
        for chunk in self._chunks:
            self._add(names.STEP_LOSS, list(chunk.steps), chunk.values())
        self._chunks, self._waiting = [], 0
        rates = self._rates
        if rates is not None:
            self._add(names.LR, [step], [rates.get()[0]])

    def _submit(self) -> None:
        snapshot: RunCurves = (
            "",
            {k: (list(s.steps), list(s.values)) for k, s in self._series.items()},
        )
        try:  # keep only the newest picture to draw
            self._jobs.get_nowait()
        except queue.Empty:
            pass
        try:
            self._jobs.put_nowait(snapshot)
        except queue.Full:  # pragma: no cover - only this thread puts
            pass

    def on_train_begin(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        for other in p.get("list_callback") or ():
            if isinstance(other, PlotMonitor) and other is not self and other.path == self.path:
                raise ValueError(
                    f"two PlotMonitors write {str(self.path)!r}: their pictures would overwrite "
                    "each other. Give each its own path."
                )
        self._series, self._chunks, self._waiting = {}, [], 0
        self._failed = False
        self._schedule.reset(p.cur_step_num)
        self._rates = view_of(p).rates
        self._view = view_of(p)
        # A look at the clock per chunk of 64 steps (the tap cuts one at least that often).
        self._view.tap.subscribe(64, self._take)
        if _in_notebook() and self._display is None:
            from IPython.display import display

            self._display = display("PlotMonitor: the first picture comes soon", display_id=True)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._draw_loop, name="stepwatch-plot", daemon=True
            )
            self._thread.start()

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        assert self._view is not None
        self._view.tap.cut()
        step = run_context.cb_params.cur_step_num
        self._transfer(step)
        for key, value in self._view.numbers(aliases=False).items():
            self._add(key, [step], [value])

    def on_train_end(self, run_context: RunContext) -> None:
        self._detach()
        self._transfer(run_context.cb_params.cur_step_num)
        if not self._failed:
            self._submit()
        self._finish(timeout=60.0)

    def __exit__(self, *err: Any) -> None:
        self._detach()
        self._finish(timeout=5.0)
        self._chunks = []  # no device tensors kept alive after the run

    def _detach(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            view.tap.cut()
            view.tap.unsubscribe(self._take)

    def _finish(self, timeout: float) -> None:
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        try:
            self._jobs.put(None, timeout=timeout)  # after any picture still queued
        except queue.Full:  # pragma: no cover - the thread is stuck drawing
            return
        thread.join(timeout)

    # -- the drawing thread ------------------------------------------------------------------
    def _draw_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._failed:
                continue
            try:
                data = render_png([job])
                replace_file(self.path, data)
                self.drawn += 1
                if self._display is not None:
                    from IPython.display import Image

                    self._display.update(Image(data=data))
            except Exception as exc:  # drawing never stops training
                self._failed = True
                logger.warning("PlotMonitor stopped drawing %s: %s", self.path, exc)
