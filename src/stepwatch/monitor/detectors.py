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
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .._validation import _got, check_int, check_number

__all__ = [
    "DETECTORS", "Alert", "Detector", "Divergence", "DyingReLU", "GradExplosion", "GradVanishing",
    "NonFinite", "Overfitting", "Plateau", "Spike", "Threshold", "make_detectors",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Alert:
    """What a detector saw: the step (and epoch, when known), its kind, a message saying what
    was seen and what to try, and the value that triggered it."""

    step: int
    epoch: int | None
    kind: str
    message: str
    value: float


class Detector:
    """Base: holds the once-per-episode latch. Subclasses set ``kind`` and define ``update``."""

    kind: ClassVar[str] = ""
    _advice: ClassVar[str] = ""  # what to try, appended to each message

    def __init__(self) -> None:
        self._active = False

    def reset(self) -> None:
        """Forget everything seen so far, as if freshly built."""
        self._active = False
        self._streak = 0

    def _edge(self, condition: bool) -> bool:
        # True only when the condition starts; a False condition ends the episode.
        fire = condition and not self._active
        self._active = condition
        return fire

    def _alert(self, step: int, epoch: int | None, seen: str, value: float) -> Alert:
        message = f"step {step}: {seen}" + (f": {self._advice}." if self._advice else ".")
        return Alert(step, epoch, self.kind, message, float(value))


def _check_fraction(name: str, value: Any, *, one: bool = False) -> float:
    value = check_number(name, value)
    if not (0.0 < value < 1.0 or (one and value == 1.0)):
        bounds = "0 < x <= 1" if one else "0 < x < 1"
        raise ValueError(f"'{name}' must be a number with {bounds}, but got {_got(value)}.")
    return value


def _check_name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError(f"'name' must be a non-empty str such as 'loss', but got {_got(value)}.")
    return value


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
            self._since = 0
            arr = np.fromiter(self._level, dtype=np.float64, count=len(self._level))
            self._median = float(np.median(arr))
            self._mad = float(np.median(np.abs(arr - self._median)))
        if not self._edge(value > limit):
            return None
        seen = f"{self.name} jumped to {value:.6g} (recent median {self._median:.6g})"
        return self._alert(step, epoch, seen, value)


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


def _per_layer(name: str, values: Any) -> np.ndarray:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"'{name}' must be a sequence of floats, one per layer, got {_got(values)}")
    return np.asarray(values, dtype=np.float64).ravel()


class _PerLayer(Detector):
    def __init__(self, patience: int) -> None:
        super().__init__()
        self.patience = check_int("patience", patience, minimum=1)
        self._streak = 0

    def _count(self, condition: bool) -> bool:  # the episode also needs `patience` in a row
        self._streak = self._streak + 1 if condition else 0
        return self._edge(self._streak >= self.patience)


class GradVanishing(_PerLayer):
    """Fires when a layer's gradient norm is under ``ratio`` x the largest layer's for
    ``patience`` samples in a row; clears on a sample with none that small. Pass only
    trainable layers: a frozen layer's zero norm would count as vanished.

    Args:
        ratio: smallest healthy norm relative to the largest (default 1e-6: healthy networks
            spread 10-1000x; 12 sigmoid layers shrink by 0.25^11, about 2e-7).
        patience: consecutive samples (default 5), so one odd batch does not fire.
    """

    kind = "grad_vanishing"
    _advice = (
        "try ReLU-family activations, normalisation layers, residual connections "
        "or He/Xavier initialisation"
    )

    def __init__(self, ratio: float = 1e-6, patience: int = 5) -> None:
        super().__init__(patience)
        self.ratio = _check_fraction("ratio", ratio)

    def update(self, step: int, norms: Sequence[float], epoch: int | None = None) -> Alert | None:
        arr = _per_layer("norms", norms)
        top = float(arr.max()) if arr.size else 0.0
        if not (math.isfinite(top) and top > 0.0):
            return None  # nothing to compare against; NonFinite covers NaN/Inf
        small = np.flatnonzero(arr < self.ratio * top)
        if not self._count(small.size > 0):
            return None
        first = int(small[0])
        seen = (
            f"gradients vanish: {small.size} layer(s) from layer {first} have norms under "
            f"{self.ratio:g}x the largest ({arr[first]:.3g} vs {top:.3g})"
        )
        return self._alert(step, epoch, seen, float(arr[first] / top))


class DyingReLU(_PerLayer):
    """Fires when some layer has (nearly) all of its units dead, i.e. their gradient is exactly
    zero, for ``patience`` consecutive samples. Clears on a sample where no layer is that dead.

    Args:
        threshold: dead fraction of a dead layer (default 0.99; healthy ReLU: 30-60% zeros).
        patience: consecutive samples (default 5).
    """

    kind = "dying_relu"
    _advice = "lower the learning rate, use LeakyReLU/GELU, or check initialisation and input scale"

    def __init__(self, threshold: float = 0.99, patience: int = 5) -> None:
        super().__init__(patience)
        self.threshold = _check_fraction("threshold", threshold, one=True)

    def update(
        self, step: int, dead: Sequence[float], total: Sequence[float] | None = None,
        epoch: int | None = None,
    ) -> Alert | None:  # fmt: skip
        """``dead`` is a per-layer fraction in [0, 1], or a per-layer count with ``total``."""
        frac = _per_layer("dead", dead)
        if total is not None:
            frac = frac / np.maximum(_per_layer("total", total), 1.0)
        if frac.size and not (frac.min() >= 0.0 and frac.max() <= 1.0):
            raise ValueError(f"dead fractions must be within [0, 1], but got {frac.tolist()}.")
        layers = np.flatnonzero(frac >= self.threshold)
        if not self._count(layers.size > 0):
            return None
        first = int(layers[0])
        seen = f"dying ReLU: {layers.size} layer(s) from layer {first} have {frac[first]:.1%} dead"
        return self._alert(step, epoch, seen, float(frac[first]))


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
