"""``LearningRateScheduler``: change the learning rate from a function of the step, as
MindSpore's callback does."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable

from ..._validation import check_arity, check_callable
from ...view.run import view_of
from ._callback import ORDER_STEER, Callback, RunContext

__all__ = ["LearningRateScheduler"]

logger = logging.getLogger("stepwatch")


class LearningRateScheduler(Callback):
    """After every training step, set the learning rate to
    ``learning_rate_function(lr, cur_step_num)``.

    ``lr`` is the first parameter group's current learning rate and ``cur_step_num`` the global
    step (batches, as MindSpore counts them, also under gradient accumulation). When the new
    value differs, every parameter group's rate is scaled by ``new / lr`` (with one group, as
    in MindSpore, it is simply set), and the change is logged.

    For PyTorch's schedulers (``StepLR``, ``OneCycleLR``, ...), pass the scheduler to
    ``Model(lr_scheduler=...)`` instead: it is stepped after the optimizer and saved in
    checkpoints.

    Args:
        learning_rate_function: ``fn(lr: float, cur_step_num: int) -> float``.

    Raises:
        TypeError: ``learning_rate_function`` is not callable.

    Example:
        >>> def halve_every_100(lr, step):
        ...     return lr * 0.5 if step % 100 == 0 else lr
        >>> model.train(10, ds, callbacks=[LearningRateScheduler(halve_every_100)])
    """

    needs_optimizer = "it sets the learning rate"  # watch() refuses a run without one

    order = ORDER_STEER

    def __init__(self, learning_rate_function: Callable[[float, int], float]) -> None:
        self.learning_rate_function = check_callable(
            "learning_rate_function", learning_rate_function, allow_none=False
        )
        check_arity(
            "learning_rate_function", learning_rate_function, "fn(lr, cur_step_num)", (0.1, 1)
        )

    def on_train_begin(self, run_context: RunContext) -> None:
        if run_context.cb_params.get("lr_scheduler") is not None:
            warnings.warn(
                "LearningRateScheduler runs beside the Model's torch lr_scheduler: both set the "
                "learning rate, and the one that runs last wins. Use one of them.",
                UserWarning,
                stacklevel=2,
            )

    def on_train_step_end(self, run_context: RunContext) -> None:
        cb_params = run_context.cb_params
        rates = view_of(cb_params).rates
        if rates is None:
            return  # no optimizer (on_train_begin said so)
        current = rates.get()
        lr = current[0]
        found = self.learning_rate_function(lr, cb_params.cur_step_num)
        try:
            new_lr = float(found)
        except (TypeError, ValueError):
            raise TypeError(
                f"LearningRateScheduler's function returned {found!r} at step "
                f"{cb_params.cur_step_num}; it must return the new learning rate (a number): "
                "did it forget a 'return'?"
            ) from None
        if not (new_lr >= 0 and math.isfinite(new_lr)):
            raise ValueError(
                f"LearningRateScheduler's function returned the learning rate {new_lr} at step "
                f"{cb_params.cur_step_num}; it must be a finite number >= 0."
            )
        if math.isclose(lr, new_lr, rel_tol=1e-10):
            return
        if len(current) == 1 or lr == 0:
            rates.set([new_lr] * len(current))
        else:
            rates.set([rate * (new_lr / lr) for rate in current])
        logger.info("At step %d, learning_rate change to %g", cb_params.cur_step_num, new_lr)
