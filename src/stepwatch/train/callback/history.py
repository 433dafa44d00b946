"""``History``: per-epoch values of a run, as plain Python numbers."""

from __future__ import annotations

import math
from typing import Any

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
    * ``loss`` - the epoch's mean training loss;
    * ``train_<metric>`` - each model metric on the training batches;
    * in ``fit``, the validation results (``accuracy``, ``eval_loss``, ...) on the epochs that
      validate (``NaN`` on the others, so all lists have one entry per epoch).

    Values are Python floats; the record starts afresh at each ``train``/``fit`` call.
    """

    def __init__(self) -> None:
        self.epoch: dict[str, list[int]] = {"epoch": []}
        self.history: dict[str, list[Any]] = {}

    def on_train_begin(self, run_context: RunContext) -> None:
        self.epoch = {"epoch": []}
        self.history = {}

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        row: dict[str, Any] = {"net_output": _number(cb_params.net_outputs)}
        for name, value in cb_params.train_results.items():
            row[name if name == "loss" else f"train_{name}"] = _number(value)
        eval_results = getattr(cb_params, "eval_results", None) or {}
        for name, value in eval_results.items():
            if name == "loss":
                # A 'loss' metric is the validation loss; 'loss' here is the training loss.
                if "eval_loss" in eval_results:
                    continue
                name = "eval_loss"
            row[name] = _number(value)
        done = len(self.epoch["epoch"])
        for name, value in row.items():
            self.history.setdefault(name, [math.nan] * done).append(value)
        for name, values in self.history.items():
            if name not in row:
                values.append(math.nan)
        self.epoch["epoch"].append(cb_params.cur_epoch_num)
