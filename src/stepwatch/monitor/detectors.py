"""Training-anomaly detectors: small state machines over a stream of values, no PyTorch.

``update(step, ...)`` takes one sample and answers an :class:`Alert` or None, in O(1) amortised
work and a fixed-size window. Each detector fires **once per episode**: after an alert it stays
quiet until its condition clears (each class says how), then may fire again. Non-finite values
are left to :class:`NonFinite`; the others skip them.

Example:
    >>> detectors = make_detectors(["nonfinite", "spike"])
    >>> [a.kind for a in (d.update(1, float("nan")) for d in detectors) if a]
    ['nonfinite']
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._validation import _got, check_int, check_number
from ._detector import Alert, Detector, _check_fraction, _check_name
from .layer_detectors import DyingReLU, GradVanishing

__all__ = [
    "DETECTORS", "Alert", "Detector", "Divergence", "DyingReLU", "GradExplosion", "GradVanishing",
    "NonFinite", "Overfitting", "Plateau", "Spike", "Threshold", "make_detectors",
]  # fmt: skip


class NonFinite(Detector):
    """Fires on a NaN or infinite value; clears when a finite value arrives.

    Args:
        name: what the values are, for the message ('loss', 'grad_norm', ...).
    """

    kind = "nonfinite"
    _advice = (
        "lower the learning rate, clip gradients, use loss scaling under mixed precision, "
        "and check the input batch for NaN/Inf"
    )

    def __init__(self, name: str = "loss") -> None:
        super().__init__()
        self.name = _check_name(name)

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not self._edge(not math.isfinite(value)):
            return None
        return self._alert(step, epoch, f"{self.name} is {value}", value)

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        if not self._active and math.isfinite(sum(values)):
            return []  # the common case, in one pass
        return super().update_many(steps, values, epoch)


class Spike(Detector):
    """Fires when one value is far above its recent robust level.

    The limit is ``median + max(z * 1.4826 * MAD, (min_ratio - 1) * |median|)`` of the last
    ``window`` values: the robust z-score shrugs off heavy-tailed noise and the relative floor
    keeps flat, low-noise losses from alarming on tiny wiggles. Silent until ``warmup`` values
    are in. The episode clears on the first value back under the limit.

    Args:
        window: values in the rolling median/MAD (default 100).
        z: robust z-score to exceed (default 10: far outside any Gaussian noise).
        min_ratio: the value must also exceed ``min_ratio`` x the median (default 1.5).
        warmup: values needed before it can fire (default: half the window).
        name: what the values are, for the message.
    """

    kind = "spike"
    _advice = "check the input batch at this step, lower the learning rate or clip gradients"

    def __init__(
        self, window: int = 100, z: float = 10.0, min_ratio: float = 1.5,
        warmup: int | None = None, name: str = "loss",
    ) -> None:  # fmt: skip
        super().__init__()
        self.window = check_int("window", window, minimum=3)
        self.z = check_number("z", z, minimum=0.0)
        self.min_ratio = check_number("min_ratio", min_ratio, minimum=1.0)
        warmup = check_int("warmup", warmup, minimum=3, allow_none=True)
        self.warmup = max(3, self.window // 2) if warmup is None else warmup
        if self.warmup > self.window:
            raise ValueError(f"'warmup' must be <= window ({window}), but got {_got(warmup)}.")
        self.name = _check_name(name)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._level: deque[float] = deque(maxlen=self.window)
        self._median = self._mad = math.nan
        self._since = 0

    def _limit(self) -> float:
        if len(self._level) < self.warmup:
            return math.inf
        spread = max(self.z * 1.4826 * self._mad, (self.min_ratio - 1) * abs(self._median))
        return self._median + spread + 1e-12

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        limit = self._limit()
        self._level.append(value)
        self._since += 1
        # the median/MAD are refreshed every window/10 values: O(1) amortised per value
        if self._since >= self.window // 10 or len(self._level) <= self.warmup:
            self._refresh()
        if not self._edge(value > limit):
            return None
        seen = f"{self.name} jumped to {value:.6g} (recent median {self._median:.6g})"
        return self._alert(step, epoch, seen, value)

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        # The common case, a quiet batch: append it, and refresh the median/MAD once at its end.
        if self._active or not values or len(self._level) < self.warmup:
            return super().update_many(steps, values, epoch)
        top = max(values)
        if not (top <= self._limit() and math.isfinite(sum(values))):
            return super().update_many(steps, values, epoch)
        self._level.extend(values)
        self._since += len(values)
        if self._since >= self.window // 10:
            self._refresh()
        return []

    def _refresh(self) -> None:
        self._since = 0
        arr = np.fromiter(self._level, dtype=np.float64, count=len(self._level))
        self._median = float(np.median(arr))
        self._mad = float(np.median(np.abs(arr - self._median)))


class GradExplosion(Spike):
    """Fires when the global gradient norm goes over ``factor`` x the median of the last
    ``window`` norms (after ``warmup``), or over ``max_norm`` when given (from the first step).
    Clears on the first norm back under the limit.

    Args:
        window: norms in the rolling median (default 100).
        factor: x median that counts (default 10: healthy norms swing 2-3x between batches).
        warmup: norms needed before the relative rule applies (default 20, at most window).
        max_norm: an absolute bound; None for none.
    """

    kind = "grad_explosion"
    _advice = "clip gradients (clip_grad_norm), lower the learning rate or check the input batch"

    def __init__(
        self, window: int = 100, factor: float = 10.0, warmup: int | None = None,
        max_norm: float | None = None,
    ) -> None:  # fmt: skip
        self.factor = check_number("factor", factor, minimum=1.0)
        self.max_norm = check_number("max_norm", max_norm, minimum=0.0, allow_none=True)
        window = check_int("window", window, minimum=3)
        warmup = min(20, window) if warmup is None else warmup
        super().__init__(window=window, z=0.0, min_ratio=self.factor, warmup=warmup)
        self.name = "gradient norm"

    def _limit(self) -> float:
        limit = super()._limit()
        return limit if self.max_norm is None else min(limit, self.max_norm)


class Divergence(Detector):
    """Fires when the loss EMA stays above ``best + (factor - 1) * |best|`` for ``patience``
    steps in a row, ``best`` being the lowest EMA after ``warmup`` steps. Values enter the EMA
    clipped to 4x it, so one outlier cannot fake a run-away while a real one crosses within a
    few steps. The episode clears when the EMA is back under the limit.

    Args:
        factor: EMA over best that counts (default 2; schedule bumps are tens of percent).
        patience: consecutive steps above the limit (default 5).
        warmup: steps before ``best`` is tracked (default 100; covers warm-up transients).
        alpha: EMA weight of each new value (default 0.1, about a 20-step span).
    """

    kind = "divergence"
    _advice = "lower the learning rate, clip gradients, or roll back to the last good checkpoint"

    def __init__(
        self, factor: float = 2.0, patience: int = 5, warmup: int = 100, alpha: float = 0.1
    ) -> None:
        super().__init__()
        self.factor = check_number("factor", factor, minimum=1.0)
        self.patience = check_int("patience", patience, minimum=1)
        self.warmup = check_int("warmup", warmup, minimum=0)
        self.alpha = _check_fraction("alpha", alpha, one=True)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._ema = math.nan
        self._seen = 0
        self._best = math.inf
        self._over = 0

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        ema = value if math.isnan(self._ema) else self._ema
        # one outlier moves the EMA by at most alpha * 3 * |EMA|
        smooth = self._ema = ema + self.alpha * (min(value, ema + 3.0 * abs(ema)) - ema)
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        best = self._best = min(self._best, smooth)
        over = smooth > best + (self.factor - 1.0) * abs(best) + 1e-12
        self._over = self._over + 1 if over else 0
        if not self._edge(self._over >= self.patience):
            return None
        seen = f"loss diverges: its moving average {smooth:.6g} is over {self.factor:g}x its best"
        return self._alert(step, epoch, f"{seen} {best:.6g} for {self.patience} steps", smooth)


class Plateau(Detector):
    """Fires when the smoothed loss has not improved by ``min_rel_improvement`` (relative) over
    the last ``patience`` steps: its EMA now against its EMA ``patience`` steps ago. The
    episode ends on real progress, the EMA falling ``2 * min_rel_improvement`` below its value
    at the alert (twice, so EMA noise on a flat loss does not end it); the wait then restarts.

    Args:
        patience: steps over which progress is measured (default 500).
        min_rel_improvement: relative EMA drop that counts as progress (default 0.01: twice
            the EMA's wander under 5% batch noise; a slow learner gaining ~5% per 500 steps
            is left alone).
        alpha: EMA weight of each new value (default 0.01, about a 200-step span; the first
            ~70 values only settle the EMA).
    """

    kind = "plateau"
    _advice = "lower the learning rate (ReduceLROnPlateau), or stop if the model is done"

    def __init__(
        self, patience: int = 500, min_rel_improvement: float = 0.01, alpha: float = 0.01
    ) -> None:
        super().__init__()
        self.patience = check_int("patience", patience, minimum=1)
        self.min_rel_improvement = _check_fraction("min_rel_improvement", min_rel_improvement)
        self.alpha = _check_fraction("alpha", alpha, one=True)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._sum = 0.0  # EMA before bias correction
        self._weight = 0.0  # 1 - (1 - alpha) ** n, so the first values do not anchor the EMA
        self._history: deque[float] = deque(maxlen=self.patience + 1)
        self._fired_at = math.nan

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        self._sum += self.alpha * (value - self._sum)
        self._weight += self.alpha * (1.0 - self._weight)
        smooth = self._sum / self._weight
        rel = self.min_rel_improvement
        if self._weight < 0.5:  # the first ~0.7/alpha values: the EMA is not settled yet
            return None
        if self._active:
            if smooth >= self._fired_at - 2 * rel * abs(self._fired_at):
                return None
            self._active = False
            self._history.clear()
        history = self._history
        history.append(smooth)
        old = history[0]
        if len(history) <= self.patience or old - smooth >= rel * abs(old):
            return None
        self._active = True
        self._fired_at = smooth
        seen = f"loss plateaued: its moving average went from {old:.6g} to {smooth:.6g}"
        return self._alert(step, epoch, f"{seen} in {self.patience} steps", smooth)


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

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        high = self.above is not None and value > self.above
        low = self.below is not None and value < self.below
        if not self._edge(high or low):
            return None
        side, bound = ("above", self.above) if high else ("below", self.below)
        return self._alert(step, epoch, f"{self.name} = {value:.6g} went {side} {bound:g}", value)


_ALL = (NonFinite, Spike, Divergence, Plateau, GradExplosion, GradVanishing, DyingReLU)
DETECTORS: dict[str, type[Detector]] = {c.kind: c for c in (*_ALL, Overfitting, Threshold)}


_KNOWN = ", ".join(map(repr, DETECTORS))


def _build(kind: Any, options: Any = None) -> Detector:
    if not isinstance(kind, str):
        raise TypeError(f"detector kinds must be str, but got {_got(kind)}; known: {_KNOWN}.")
    if kind not in DETECTORS:
        raise ValueError(f"unknown detector kind {kind!r}; known: {_KNOWN}.")
    cls = DETECTORS[kind]
    if isinstance(options, cls) or options is None:
        return options or cls()
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options for {kind!r} must be a dict or a {cls.__name__}, got {_got(options)}"
        )
    return cls(**options)


def make_detectors(spec: Any = None) -> list[Detector]:
    """Build detectors from ``spec``: None (every kind but 'threshold', with defaults), a list
    of kind names, or a dict of kind -> options dict (or a ready detector instance).

    Raises:
        ValueError: an unknown kind (the message lists the known ones).
        TypeError: a spec, kind or options of the wrong type.
    """
    if spec is None:
        return [cls() for kind, cls in DETECTORS.items() if kind != "threshold"]
    if isinstance(spec, Mapping):
        return [_build(kind, options) for kind, options in spec.items()]
    if isinstance(spec, (list, tuple)):
        return [_build(kind) for kind in spec]
    raise TypeError(
        "'spec' must be None, a list of detector kinds or a dict of kind -> options, "
        f"but got {_got(spec)}; known kinds: {_KNOWN}."
    )
