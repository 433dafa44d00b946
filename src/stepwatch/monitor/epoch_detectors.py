"""Detectors fed once per evaluation or epoch: overfitting, and a threshold on any named
value. No PyTorch."""

from __future__ import annotations

import itertools
import math
from collections import deque

from .._validation import check_int, check_number
from ._detector import Alert, Detector, _check_fraction, _check_name

__all__ = ["Overfitting", "Threshold"]


class Overfitting(Detector):
    """Fed at evaluations: fires when the validation loss rose at each of the last ``patience``
    evaluations while the training loss fell over the span, by over ``min_rel_rise`` (relative
    to its best) across the span and above its best. Clears when the validation loss is back
    within ``min_rel_rise`` of its best.

    Args:
        patience: consecutive rising evaluations (default 3).
        min_rel_rise: material rise over the best validation loss (default 0.03).
    """

    kind = "overfitting"
    _advice = "add regularisation or augmentation, or stop early and keep the best checkpoint"

    def __init__(self, patience: int = 3, min_rel_rise: float = 0.03) -> None:
        super().__init__()
        self.patience = check_int("patience", patience, minimum=1)
        self.min_rel_rise = _check_fraction("min_rel_rise", min_rel_rise)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._pairs: deque[tuple[float, float]] = deque(maxlen=self.patience + 1)
        self._best = math.inf

    def update(
        self, step: int, train_loss: float, eval_loss: float, epoch: int | None = None
    ) -> Alert | None:
        if not (math.isfinite(train_loss) and math.isfinite(eval_loss)):
            return None
        pairs = self._pairs
        pairs.append((train_loss, eval_loss))
        best = self._best = min(self._best, eval_loss)
        material = eval_loss > best + self.min_rel_rise * abs(best)
        if self._active:
            self._active = material
            return None
        evals = [e for _, e in pairs]
        rising = len(pairs) > self.patience and all(b > a for a, b in itertools.pairwise(evals))
        grew = eval_loss - pairs[0][1] > self.min_rel_rise * abs(best)  # not just noise at best
        if not (material and rising and grew and pairs[-1][0] < pairs[0][0]):
            return None
        self._active = True
        seen = (
            f"overfitting: validation loss rose {self.patience} evaluations in a row to "
            f"{eval_loss:.6g} ({eval_loss / best - 1:.1%} above its best) as training loss fell"
        )
        return self._alert(step, epoch, seen, eval_loss)


class Threshold(Detector):
    """Fires when the named value goes above ``above`` or below ``below``; clears when it is
    back within bounds.

    Args:
        name: the value watched ('loss', 'eval_accuracy', ...).
        above / below: the bounds; at least one must be given.
    """

    kind = "threshold"

    def __init__(
        self, name: str = "loss", above: float | None = None, below: float | None = None
    ) -> None:
        super().__init__()
        self.name = _check_name(name)
        self.above = check_number("above", above, allow_none=True)
        self.below = check_number("below", below, allow_none=True)
        if self.above is None and self.below is None:
            raise ValueError("Threshold needs 'above' and/or 'below', but got neither.")

    def alarm(self) -> float:
        """``above`` (a value under ``below`` is not urgent: it waits for the batch's end)."""
        return math.inf if self.above is None else self.above

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        high = self.above is not None and value > self.above
        low = self.below is not None and value < self.below
        if not self._edge(high or low):
            return None
        side, bound = ("above", self.above) if high else ("below", self.below)
        return self._alert(step, epoch, f"{self.name} = {value:.6g} went {side} {bound:g}", value)
