"""``LossMonitor``: print the loss every N global steps, as MindSpore does."""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..._validation import check_bool, check_int
from ...distributed import sum_across
from ...monitor.schedule import Every
from ...view.run import RunView, view_of
from ._callback import Callback, RunContext, on_clock
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
    on the steps that print. Its step hook is called only at those steps: it asks the run's
    step clock (the loss tap's :meth:`~stepwatch.view.tap.LossTap.call_at`) to wake the loop
    there, so a run without other step hooks runs the hookless loop on the other steps (a
    subclass that overrides the step hook is called at every step, as in MindSpore).

    A NaN or infinite loss stops training with a ValueError: on a printing step, or at the
    latest at the end of the epoch (the epoch's mean loss is then not finite), unless the run
    is already stopping for an anomaly, or an ``AnomalyMonitor`` that watches for non-finite
    losses is in the run: then the line is printed and the decision is the AnomalyMonitor's
    action. At the end of a ``fit`` epoch with validation it prints
    ``Eval result: epoch 1, metrics: {...}``.

    Under ``torch.distributed`` (pass it on every rank) the loss of a printing step is the mean
    over the ranks, reduced on that step only (one all_reduce per print, none on the other
    steps); every rank checks that mean, so a NaN on one rank stops all of them at the same step.
    Only rank 0 prints, unless ``all_ranks=True``: then every rank prints its own loss, the
    line prefixed with ``[rank N]``.

    Args:
        per_print_times: steps between prints; ``0`` never prints.
        all_ranks: in a distributed run, print on every rank (prefixed) instead of rank 0 only.

    Raises:
        TypeError: ``per_print_times`` is not an int (a bool, float or None included), or
            ``all_ranks`` not a bool.
        ValueError: ``per_print_times`` is negative.
    """

    def __init__(self, per_print_times: int = 1, all_ranks: bool = False) -> None:
        check_int("per_print_times", per_print_times, minimum=0)
        self.all_ranks = check_bool("all_ranks", all_ranks)
        self._prefix = ""
        self._world = 1
        self._per_print_times = per_print_times
        self._schedule = Every(steps=per_print_times)
        self._printing = True
        self._deferred = False
        self._view: RunView | None = None
        self._armed = 0  # the step the clock wakes the loop at for it (0: none)

    def on_train_begin(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        self._world = cb_params.device_number
        self._printing = cb_params.rank_id == 0 or self.all_ranks
        self._prefix = f"[rank {cb_params.rank_id}] " if self.all_ranks and self._world > 1 else ""
        self._schedule.reset(0)
        self._view, self._armed = view_of(cb_params), 0
        self._arm()
        # A monitor that acts on non-finite losses (AnomalyMonitor) decides: print, not raise.
        others = cb_params.get("list_callback") or ()
        self._deferred = any(getattr(cb, "handles_nonfinite", False) for cb in others)
        last_step = cb_params.initial_step + cb_params.epoch_num * cb_params.batch_num
        if self._per_print_times > last_step:
            warnings.warn(
                f"LossMonitor(per_print_times={self._per_print_times}) will print nothing: this "
                f"run ends at global step {last_step}. Pass a smaller per_print_times.",
                UserWarning,
                stacklevel=2,
            )

    def _arm(self) -> None:
        """Have the run's clock wake the loop at the next printing step (its step-end hooks,
        this one among them, run there in their order)."""
        nxt = self._schedule.next_step
        if self._view is not None and nxt != self._armed and nxt != float("inf"):
            self._armed = int(nxt)
            self._view.tap.call_at(self._armed, self._wake)

    def _wake(self, step: int) -> None:
        if step >= self._armed:
            self._armed = 0  # the step hook prints at this step and asks for the next

    @on_clock
    def on_train_step_end(self, run_context: RunContext) -> None:
        step = run_context.cb_params.cur_step_num
        if step < self._schedule.next_step or not self._schedule.due(step):
            return
        self._print(run_context, step)
        self._arm()

    def _print(self, run_context: RunContext, step: int) -> None:
        cb_params = run_context.cb_params
        loss = cb_params.loss
        step_in_epoch = cb_params.step_in_epoch
        checked = loss
        if self._world > 1:
            checked = float(sum_across([loss])[0]) / self._world  # the cross-rank mean
            if not self.all_ranks:
                loss = checked
        if not math.isfinite(checked) and not self._deferred:
            if run_context.stop_kind == "anomaly":
                return  # already stopping for it
            raise _nonfinite_error(cb_params.cur_epoch_num, step_in_epoch)
        if self._printing:
            epoch = cb_params.cur_epoch_num
            emit(f"{self._prefix}epoch: {epoch} step: {step_in_epoch}, loss is {loss}")

    def on_train_end(self, run_context: RunContext) -> None:
        self.__exit__()

    def __exit__(self, *err: Any) -> None:
        if self._view is not None:
            self._view.tap.unsubscribe(self)
        self._view = None

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        epoch_loss = cb_params.train_results.get("loss")
        # e.g. AnomalyMonitor stopped the run, or it is in the run to act on non-finite losses
        handled = run_context.stop_kind == "anomaly" or self._deferred
        if epoch_loss is not None and not math.isfinite(epoch_loss) and not handled:
            raise _nonfinite_error(cb_params.cur_epoch_num, cb_params.step_in_epoch)
        # MindSpore prints the metrics' values; with none (a run that validates only its
        # loss), the validation results
        shown = getattr(cb_params, "metrics", None) or getattr(cb_params, "eval_results", None)
        if shown and self._printing:
            epoch = cb_params.cur_epoch_num
            emit(f"{self._prefix}Eval result: epoch {epoch}, metrics: {shown}")

    @property
    def state_key(self) -> str:
        return self._state_key_with(per_print_times=self._per_print_times)

    def state_dict(self) -> dict[str, int]:
        return {"last_print_step": self._schedule.last_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._schedule.reset(int(state["last_print_step"]))
        self._arm()  # after on_train_begin (a resume): the next print moved
