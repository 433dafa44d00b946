"""The shared base of callbacks that watch one value: EarlyStopping, ReduceLROnPlateau and
best-only ModelCheckpoint."""

from __future__ import annotations

import difflib
import math
import warnings
from typing import Any

from ..._validation import check_choice, check_number
from ...monitor import values as names
from ...view.run import view_of
from ._callback import Callback, CallbackParams

__all__ = ["MonitorCallback", "epoch_values"]


def epoch_values(cb_params: CallbackParams) -> dict[str, float]:
    """Every number a monitor can name at the end of an epoch (see
    :mod:`stepwatch.monitor.values`): ``loss``, ``train_<metric>``, ``eval_loss``,
    ``eval_<metric>``, and the bare ``<metric>`` (the validation value in a run that
    validates, else the training value).

    As in MindSpore, a bare name that this epoch's ``eval_results`` holds is read from there,
    whether or not the run has a ``valid_dataset`` (a cb_params built by hand, a callback
    that evaluates)."""
    values = view_of(cb_params).numbers()
    results = cb_params.get("eval_results")
    if isinstance(results, dict):
        values.update(names.numeric({k: v for k, v in results.items() if k != names.LOSS}))
    return values


class MonitorCallback(Callback):
    """A callback that watches one named value and knows when it improved.

    Args:
        monitor: the value's name (see :mod:`stepwatch.monitor.values`): ``'loss'``,
            ``'eval_loss'``, ``'accuracy'``, ``'eval_accuracy'``, ``'train_accuracy'``, ...
        mode: ``'min'``, ``'max'``, or ``'auto'``: the direction the metric declares
            (``Metric.direction``), else the name rule (min for loss/error-like names, max
            otherwise).
        min_delta: the smallest change that counts as an improvement (>= 0).

    Raises:
        TypeError: ``monitor`` not a str, ``min_delta`` not a number.
        ValueError: empty ``monitor``, unknown ``mode``, negative ``min_delta``, or
            ``mode='auto'`` for a value without a better direction (``'lr'``).
    """

    def __init__(self, monitor: str, mode: str = "auto", min_delta: float = 0.0) -> None:
        if not isinstance(monitor, str):
            raise TypeError(
                f"'monitor' must be a str such as 'eval_loss', but got {monitor!r} with type "
                f"'{type(monitor).__name__}'."
            )
        if not monitor:
            raise ValueError("'monitor' must name a value such as 'eval_loss', but got ''.")
        self.monitor = monitor
        self.mode = check_choice("mode", mode, ("auto", "min", "max"))
        self.min_delta = abs(check_number("min_delta", min_delta) or 0.0)
        self._minimize = self._resolve_minimize(None)
        self.best: float = math.inf if self._minimize else -math.inf
        self._warned_missing = False

    def _resolve_minimize(self, metrics: Any) -> bool:
        if self.mode != "auto":
            return self.mode == "min"
        declared = names.metric_directions(metrics) if metrics else None
        direction = names.direction(self.monitor, declared)
        if direction is None:
            raise ValueError(
                f"{type(self).__name__}: {self.monitor!r} has no better direction; pass "
                "mode='min' or mode='max'."
            )
        return direction == "min"

    @property
    def state_key(self) -> str:
        # Two watchers of different values may run together; of the same value, not.
        return self._state_key_with(monitor=self.monitor, mode=self.mode)

    @property
    def minimize(self) -> bool:
        return self._minimize

    def is_improvement(self, value: float, reference: float | None = None) -> bool:
        """True if ``value`` beats ``reference`` (default the best so far) by ``min_delta``."""
        ref = self.best if reference is None else reference
        if math.isnan(value):
            return False
        if self._minimize:
            return value < ref - self.min_delta
        return value > ref + self.min_delta

    def monitor_value(self, cb_params: CallbackParams) -> float | None:
        """The monitored value this epoch, or None (with one warning per run) if absent."""
        values = epoch_values(cb_params)
        value = values.get(self.monitor)
        # Between validation epochs a validation value is expected to be absent: stay quiet.
        validated = getattr(cb_params, "eval_results", None) is not None
        expects_eval = view_of(cb_params).validates
        if value is None and not self._warned_missing and (validated or not expects_eval):
            self._warned_missing = True
            bare = self.monitor.removeprefix("epoch_").removeprefix("val_")
            close = [bare] if bare in values else []
            if self.monitor.startswith("val_") and f"eval_{bare}" in values:
                close = [f"eval_{bare}"]  # Keras' name for a validation value
            close = close or difflib.get_close_matches(self.monitor, list(values), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            warnings.warn(
                f"{type(self).__name__}: monitor {self.monitor!r} is not available at the end "
                f"of epoch {cb_params.cur_epoch_num}; available: {names.available(values)}.{hint} "
                "It is skipped on epochs without it.",
                UserWarning,
                stacklevel=2,
            )
        return value

    def _reset_monitor(self, cb_params: CallbackParams | None = None) -> None:
        """Start watching afresh; with cb_params, take the direction the metrics declare."""
        if cb_params is not None:
            objects = view_of(cb_params).metrics or getattr(cb_params, "metrics", None)
            self._minimize = self._resolve_minimize(objects)
        self.best = math.inf if self._minimize else -math.inf
        self._warned_missing = False
