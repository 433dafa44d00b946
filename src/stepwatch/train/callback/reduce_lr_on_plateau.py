"""``ReduceLROnPlateau``: lower the learning rate when the monitored value stalls."""

from __future__ import annotations

import logging
from typing import Any

from ..._validation import check_bool, check_int, check_number
from ...view.host import LearningRates
from ...view.run import view_of
from ._callback import ORDER_STEER, RunContext
from ._monitor import MonitorCallback
from ._print import emit

__all__ = ["ReduceLROnPlateau"]

logger = logging.getLogger("stepwatch")


class ReduceLROnPlateau(MonitorCallback):
    """Multiply every parameter group's learning rate by ``factor`` after ``patience`` epochs
    without improvement of ``monitor``.

    Args:
        monitor: the watched value (default ``'eval_loss'``).
        factor: the multiplier, a number in (0, 1).
        patience: epochs without improvement before reducing.
        verbose: print ``Epoch 00005: ReduceLROnPlateau reducing learning rate to 0.3.``
        mode: ``'auto'``, ``'min'`` or ``'max'``.
        min_delta: smallest change that counts as an improvement.
        cooldown: epochs to wait after a reduction before counting again.
        min_lr: the learning rate never goes below this (a number, or one per parameter group).

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value.
    """

    needs_optimizer = "it changes the learning rate"  # watch() refuses a run without one

    order = ORDER_STEER

    def __init__(
        self,
        monitor: str = "eval_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: bool = False,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float | list[float] = 0,
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        factor_value = check_number("factor", factor)
        assert factor_value is not None
        if not 0.0 < factor_value < 1.0:
            raise ValueError(f"'factor' must be a number in (0, 1), but got {factor!r}.")
        self.factor = factor_value
        self.patience = check_int("patience", patience, minimum=0)
        self.verbose = check_bool("verbose", verbose)
        self.cooldown = check_int("cooldown", cooldown, minimum=0)
        if isinstance(min_lr, (list, tuple)):
            self.min_lr: float | list[float] = [
                check_number(f"min_lr[{i}]", v, minimum=0.0) or 0.0 for i, v in enumerate(min_lr)
            ]
        else:
            self.min_lr = check_number("min_lr", min_lr, minimum=0.0) or 0.0
        self._reset()

    def _reset(self, cb_params: Any = None) -> None:
        self._reset_monitor(cb_params)
        self.wait = 0
        self.cooldown_counter = 0

    def on_train_begin(self, run_context: RunContext) -> None:
        self._reset(run_context.cb_params)
        rates = view_of(run_context.original_args()).rates
        groups = len(rates.get()) if rates is not None else 0
        if isinstance(self.min_lr, list) and len(self.min_lr) != groups:
            raise ValueError(
                f"'min_lr' has {len(self.min_lr)} values but the optimizer has {groups} "
                "parameter groups."
            )

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        current = self.monitor_value(cb_params)
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.is_improvement(current):
            self.best = current
            self.wait = 0
            return
        # Read after the count-down, as MindSpore and Keras do: the epoch on which the
        # cooldown ends already counts towards the patience.
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait >= self.patience:
            self._reduce(view_of(cb_params).rates, cb_params.cur_epoch_num, cb_params.rank_id == 0)
            self.cooldown_counter = self.cooldown
            self.wait = 0

    def _reduce(self, rates: LearningRates | None, epoch: int, printing: bool = True) -> None:
        if rates is None:
            return  # no optimizer: nothing to reduce
        olds = rates.get()
        floors = self.min_lr if isinstance(self.min_lr, list) else [self.min_lr] * len(olds)
        news = []
        for old, floor in zip(olds, floors):
            new = max(old * self.factor, floor)
            news.append(new if old - new > 1e-12 * max(old, 1.0) else old)
        if news != olds:
            rates.set(news)
            new_lr = rates.get()[0]
            logger.info(
                "epoch %d: ReduceLROnPlateau reduced the learning rate to %g", epoch, new_lr
            )
            if self.verbose and printing:
                emit(f"Epoch {epoch:05d}: ReduceLROnPlateau reducing learning rate to {new_lr:g}.")

    def state_dict(self) -> dict[str, Any]:
        return {"wait": self.wait, "best": self.best, "cooldown_counter": self.cooldown_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait = int(state["wait"])
        self.best = float(state["best"])
        self.cooldown_counter = int(state["cooldown_counter"])
