"""``EarlyStopping``: stop when the monitored value stops improving."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..._validation import check_bool, check_int, check_number
from ..serialization import to_cpu
from ._callback import ORDER_STEER, RunContext
from ._monitor import MonitorCallback
from ._print import emit

__all__ = ["EarlyStopping"]

logger = logging.getLogger("stepwatch")


class EarlyStopping(MonitorCallback):
    """Stop training when ``monitor`` has not improved for ``patience`` epochs.

    Checked at the end of every training epoch. An epoch improves when its value beats the best
    so far by more than ``min_delta`` and, when ``baseline`` is set, beats the baseline too.
    After ``patience`` epochs in a row without improvement (at least one), training stops after
    the epoch, with the reason logged once. A value of 0 is a value; epochs where the monitor is
    absent (no validation that epoch) are skipped. In a distributed run every rank decides on
    the same (cross-rank) epoch values, so all ranks stop after the same epoch; only rank 0
    prints.

    Args:
        monitor: the watched value: ``'eval_loss'`` (default), ``'loss'``, ``'accuracy'``, ...
        min_delta: smallest change that counts as an improvement.
        patience: epochs without improvement before stopping (0 behaves as 1).
        verbose: print ``Epoch 00003: early stopping`` at the end of training.
        mode: ``'auto'``, ``'min'`` or ``'max'``.
        baseline: a value the monitor must beat for an epoch to count as an improvement.
        restore_best_weights: when stopping, load the network weights of the best epoch.

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value.
    """

    order = ORDER_STEER

    def __init__(
        self,
        monitor: str = "eval_loss",
        min_delta: float = 0,
        patience: int = 0,
        verbose: bool = False,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        self.patience = check_int("patience", patience, minimum=0)
        self.verbose = check_bool("verbose", verbose)
        self.baseline = check_number("baseline", baseline, allow_none=True)
        self.restore_best_weights = check_bool("restore_best_weights", restore_best_weights)
        self._reset()

    def _reset(self, cb_params: Any = None) -> None:
        self._reset_monitor(cb_params)
        if self.baseline is not None:
            self.best = self.baseline
        self.wait = 0
        self.best_epoch = 0
        self.stopped_epoch = 0
        self.best_weights: dict[str, Any] | None = None

    def on_train_begin(self, run_context: RunContext) -> None:
        self._reset(run_context.cb_params)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        current = self.monitor_value(cb_params)
        if current is None:
            return
        epoch = cb_params.cur_epoch_num
        if self.is_improvement(current):
            self.best = current
            self.best_epoch = epoch
            self.wait = 0
            if self.restore_best_weights:
                self.best_weights = to_cpu(cb_params.network.state_dict())
            return
        self.wait += 1
        if self.wait >= max(self.patience, 1):
            self.stopped_epoch = epoch
            best = (
                "no improvement on the baseline"
                if math.isinf(self.best) or (self.best_epoch == 0)
                else f"best {self.best:.6g} at epoch {self.best_epoch}"
            )
            run_context.request_stop(
                f"EarlyStopping: {self.monitor} did not improve for {self.wait} epochs ({best})"
            )
            if self.restore_best_weights:
                if self.best_weights is not None:
                    cb_params.network.load_state_dict(self.best_weights)
                    logger.info("EarlyStopping: restored the weights of epoch %d", self.best_epoch)
                else:
                    logger.info(
                        "EarlyStopping: no epoch improved; the weights are left as they are"
                    )

    def on_train_end(self, run_context: RunContext) -> None:
        if self.stopped_epoch > 0 and self.verbose and run_context.cb_params.rank_id == 0:
            emit(f"Epoch {self.stopped_epoch:05d}: early stopping")

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait": self.wait,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "stopped_epoch": self.stopped_epoch,
            "best_weights": self.best_weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait = int(state["wait"])
        self.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_weights = state.get("best_weights")
