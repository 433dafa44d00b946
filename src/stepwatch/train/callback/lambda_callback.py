"""``LambdaCallback``: a callback made of plain functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._validation import check_callable
from ._callback import HOOKS, Callback

__all__ = ["LambdaCallback"]


class LambdaCallback(Callback):
    """Build a callback from functions of ``run_context``, one per hook.

    Only the hooks given are dispatched; the others cost nothing.

    Args:
        on_train_begin, on_train_epoch_begin, on_train_step_begin, on_train_step_end,
        on_train_epoch_end, on_train_end, on_eval_begin, on_eval_epoch_begin,
        on_eval_step_begin, on_eval_step_end, on_eval_epoch_end, on_eval_end: each a function
        ``f(run_context)`` or None.

    Raises:
        TypeError: an argument is neither callable nor None.

    Example:
        >>> stop_at_100 = LambdaCallback(on_train_step_end=lambda rc: (
        ...     rc.request_stop() if rc.original_args().cur_step_num >= 100 else None))
    """

    def __init__(
        self,
        on_train_epoch_begin: Callable[[Any], Any] | None = None,
        on_train_epoch_end: Callable[[Any], Any] | None = None,
        on_train_step_begin: Callable[[Any], Any] | None = None,
        on_train_step_end: Callable[[Any], Any] | None = None,
        on_train_begin: Callable[[Any], Any] | None = None,
        on_train_end: Callable[[Any], Any] | None = None,
        on_eval_epoch_begin: Callable[[Any], Any] | None = None,
        on_eval_epoch_end: Callable[[Any], Any] | None = None,
        on_eval_step_begin: Callable[[Any], Any] | None = None,
        on_eval_step_end: Callable[[Any], Any] | None = None,
        on_eval_begin: Callable[[Any], Any] | None = None,
        on_eval_end: Callable[[Any], Any] | None = None,
    ) -> None:
        given = locals()
        for hook in HOOKS:
            fn = check_callable(hook, given[hook])
            if fn is not None:
                setattr(self, hook, fn)
