"""The shared base of callbacks that watch one value: EarlyStopping, ReduceLROnPlateau and
best-only ModelCheckpoint."""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..._validation import check_choice, check_number
from ._callback import Callback, CallbackParams

__all__ = ["MonitorCallback", "epoch_values"]

# Names for which smaller is better when mode='auto'.
_LOSS_LIKE = ("loss", "mae", "mse", "error", "perplexity", "ppl", "rmse")


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number


def epoch_values(cb_params: CallbackParams) -> dict[str, float]:
    """Every value a monitor can name at the end of an epoch.

    ``loss`` and the training metrics (``accuracy``, also as ``train_accuracy``), and after
    validation in ``fit`` its results under MindSpore's ``eval_results`` keys (``accuracy``,
    ``eval_loss``) and as ``eval_<metric>``. A bare metric name means the validation value when
    there is one, as in MindSpore.
    """
    values: dict[str, float] = {}
    for name, value in (getattr(cb_params, "train_results", None) or {}).items():
        number = _number(value)
        if number is None:
            continue
        values[name] = number
        if name != "loss":
            values[f"train_{name}"] = number
    for name, value in (getattr(cb_params, "eval_results", None) or {}).items():
        number = _number(value)
        if number is None:
            continue
        if name == "eval_loss":
            values[name] = number
            continue
        values[f"eval_{name}"] = number
        if name != "loss":
            values[name] = number
    return values


class MonitorCallback(Callback):
    """A callback that watches one named value and knows when it improved.

    Args:
        monitor: the value's name (see :func:`epoch_values`): ``'loss'``, ``'eval_loss'``,
            ``'accuracy'``, ``'eval_accuracy'``, ``'train_accuracy'``, ...
        mode: ``'min'``, ``'max'``, or ``'auto'`` (min for loss-like names, else max).
        min_delta: the smallest change that counts as an improvement (>= 0).

    Raises:
        TypeError: ``monitor`` not a str, ``min_delta`` not a number.
        ValueError: empty ``monitor``, unknown ``mode``, negative ``min_delta``.
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
        if mode == "auto":
            lowered = monitor.lower()
            self._minimize = any(word in lowered for word in _LOSS_LIKE)
        else:
            self._minimize = mode == "min"
        self.best: float = math.inf if self._minimize else -math.inf
        self._warned_missing = False

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
        expects_eval = getattr(cb_params, "valid_dataset", None) is not None
        if value is None and not self._warned_missing and (validated or not expects_eval):
            self._warned_missing = True
            available = ", ".join(sorted(values)) or "none"
            warnings.warn(
                f"{type(self).__name__}: monitor {self.monitor!r} is not available at the end "
                f"of epoch {cb_params.cur_epoch_num}; available: {available}. It is skipped "
                "on epochs without it.",
                UserWarning,
                stacklevel=2,
            )
        return value

    def _reset_monitor(self) -> None:
        self.best = math.inf if self._minimize else -math.inf
        self._warned_missing = False
