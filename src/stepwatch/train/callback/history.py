"""``History``: per-epoch values of a run, as plain Python numbers."""

from __future__ import annotations

import math
from typing import Any

from ..._validation import check_int
from ...monitor.ring import RingBuffer
from ...view.run import RunView, view_of
from ...view.tap import Chunk
from ._callback import Callback, RunContext

__all__ = ["History"]


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class History(Callback):
    """Record each epoch's results.

    After training, ``history.epoch == {"epoch": [1, 2, ...]}`` and ``history.history`` maps
    each name to one value per epoch:

    * ``net_output`` - the loss of the epoch's last step (MindSpore's field);
    * the epoch values under their names (:mod:`stepwatch.monitor.values`, the same names the
      run store and ``EarlyStopping(monitor=...)`` use): ``loss`` (mean training loss),
      ``train_<metric>``, and in ``fit`` ``eval_loss`` and ``eval_<metric>``;
    * each bare metric name (``accuracy``) as MindSpore's History has it: the validation
      value in a ``fit`` that validates, the training value otherwise.

    Epochs without a value (no validation that epoch) hold ``NaN``, so all lists have one
    entry per epoch.

    Values are Python floats; the record starts afresh at each ``train``/``fit`` call.

    Args:
        step_history: also keep the losses of the last this-many steps in ``history.steps``,
            a :class:`~stepwatch.RingBuffer` (bounded memory, O(1) per step). The losses stay
            on the device (the run's loss tap) and are read together, once per
            ``step_history`` steps (at most 1024) or epoch end. 0 (default) keeps none and
            adds no per-step work.

    Raises:
        TypeError / ValueError: ``step_history`` is not an int >= 0.

    Example:
        >>> history = History(step_history=1000)
        >>> model.train(3, ds, callbacks=[history])
        >>> history.steps.steps(), history.steps.values()   # the last 1000 step losses
    """

    def __init__(self, step_history: int = 0) -> None:
        capacity = check_int("step_history", step_history, minimum=0)
        self.epoch: dict[str, list[int]] = {"epoch": []}
        self.history: dict[str, list[Any]] = {}
        self.steps: RingBuffer | None = RingBuffer(capacity) if capacity else None
        self._chunks: list[Chunk] = []  # step losses from the run's tap, not read yet
        self._waiting = 0
        self._flush_every = min(capacity, 1024)
        self._view: RunView | None = None

    def _take(self, chunk: Chunk) -> None:
        self._chunks.append(chunk)
        self._waiting += len(chunk)
        if self._waiting >= self._flush_every:
            self._flush_steps()

    def _flush_steps(self) -> None:
        if self.steps is None or not self._chunks:
            return
        for chunk in self._chunks:
            self.steps.extend(list(chunk.steps), chunk.values())
        self._chunks, self._waiting = [], 0

    def on_train_begin(self, run_context: RunContext) -> None:
        self.epoch = {"epoch": []}
        self.history = {}
        self._view = view_of(run_context.cb_params)
        if self.steps is not None:
            self.steps.clear()
            self._chunks, self._waiting = [], 0
            # Subscribed only when asked for, so the default History adds nothing per step.
            self._view.tap.subscribe(self._flush_every, self._take)

    def on_train_end(self, run_context: RunContext) -> None:
        self._detach()

    def __exit__(self, *err: Any) -> None:
        self._detach()

    def _detach(self) -> None:
        view, self._view = self._view, None
        if view is not None and self.steps is not None:
            view.tap.cut()
            view.tap.unsubscribe(self._take)
            self._flush_steps()
        self._chunks = []

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        if self._view is not None and self.steps is not None:
            self._view.tap.cut()
        self._flush_steps()
        cb_params = run_context.cb_params
        net_output = cb_params.net_outputs
        if isinstance(net_output, (tuple, list)):  # (loss, overflow, scale): MindSpore's first
            net_output = net_output[0]
        row: dict[str, Any] = {"net_output": _number(net_output)}
        for name, value in view_of(cb_params).epoch_values().items():
            row[name] = _number(value)
        done = len(self.epoch["epoch"])
        for name, value in row.items():
            self.history.setdefault(name, [math.nan] * done).append(value)
        for name, values in self.history.items():
            if name not in row:
                values.append(math.nan)
        self.epoch["epoch"].append(cb_params.cur_epoch_num)
