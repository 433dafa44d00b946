"""``LossMonitor``: print the loss every N global steps, as MindSpore does."""

from __future__ import annotations

import math
import warnings

from ..._validation import check_int
from ...monitor.schedule import Every
from ._callback import Callback, RunContext
from ._print import emit

__all__ = ["LossMonitor"]


def _nonfinite_error(epoch: int, step: int) -> ValueError:
    return ValueError(
        f"In epoch: {epoch} step: {step}, loss is NAN or INF, training process cannot continue, "
        "terminating training."
    )


class LossMonitor(Callback):
    """Print ``epoch: 1 step: 10, loss is 0.4273667335510254`` every ``per_print_times`` steps.

    The cadence counts global steps (with 16 steps per epoch and ``per_print_times=10`` it prints
    at epoch 1 step 10, epoch 2 step 4, epoch 2 step 14). The loss is read from the device only
    on the steps that print. A NaN or infinite loss stops training with a ValueError: on a
    printing step, or at the latest at the end of the epoch (the epoch's mean loss is then not
    finite), unless the run is already stopping for an anomaly (``AnomalyMonitor`` acted on
    it). At the end of a ``fit`` epoch with validation it prints
    ``Eval result: epoch 1, metrics: {...}``. Under ``torch.distributed`` only rank 0 prints;
    every rank still checks its loss.

    Args:
        per_print_times: steps between prints; ``0`` never prints.

    Raises:
        TypeError: ``per_print_times`` is not an int (a bool, float or None included).
        ValueError: ``per_print_times`` is negative.
    """

    def __init__(self, per_print_times: int = 1) -> None:
        check_int("per_print_times", per_print_times, minimum=0)
        self._per_print_times = per_print_times
        self._schedule = Every(steps=per_print_times)
        self._printing = True

    def on_train_begin(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        self._printing = cb_params.rank_id == 0
        self._schedule.reset(0)
        last_step = cb_params.initial_step + cb_params.epoch_num * cb_params.batch_num
        if self._per_print_times > last_step:
            warnings.warn(
                f"LossMonitor(per_print_times={self._per_print_times}) will print nothing: this "
                f"run ends at global step {last_step}. Pass a smaller per_print_times.",
                UserWarning,
                stacklevel=2,
            )

    def on_train_step_end(self, run_context: RunContext) -> None:
        cb_params = run_context.cb_params
        step = cb_params.cur_step_num
        if step < self._schedule.next_step or not self._schedule.due(step):
            return
        loss = cb_params.loss
        step_in_epoch = cb_params.step_in_epoch
        if not math.isfinite(loss):
            if run_context.stop_kind == "anomaly":
                return  # already stopping for it
            raise _nonfinite_error(cb_params.cur_epoch_num, step_in_epoch)
        if self._printing:
            emit(f"epoch: {cb_params.cur_epoch_num} step: {step_in_epoch}, loss is {loss}")

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        epoch_loss = cb_params.train_results.get("loss")
        handled = run_context.stop_kind == "anomaly"  # e.g. AnomalyMonitor stopped the run
        if epoch_loss is not None and not math.isfinite(epoch_loss) and not handled:
            raise _nonfinite_error(cb_params.cur_epoch_num, cb_params.step_in_epoch)
        eval_results = getattr(cb_params, "eval_results", None)
        if eval_results and self._printing:
            emit(f"Eval result: epoch {cb_params.cur_epoch_num}, metrics: {eval_results}")

    @property
    def state_key(self) -> str:
        return self._state_key_with(per_print_times=self._per_print_times)

    def state_dict(self) -> dict[str, int]:
        return {"last_print_step": self._schedule.last_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._schedule.reset(int(state["last_print_step"]))
