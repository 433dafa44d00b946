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
from collections.abc import Sequence

import numpy as np

from .._validation import _got, check_int, check_number
from ._detector import Alert, Detector, _check_fraction, _check_name
from .epoch_detectors import Overfitting, Threshold
from .layer_detectors import DyingReLU, GradVanishing, Saturation
from .learning_detectors import LrNegligible, NotLearning, RecurringBatch, WorseThanChance

__all__ = [
    "DETECTORS", "Alert", "Detector", "Divergence", "DyingReLU", "GradExplosion", "GradVanishing",
    "LrNegligible", "NonFinite", "NotLearning", "Overfitting", "Plateau", "RecurringBatch",
    "Saturation", "Spike", "Threshold", "WorseThanChance",
]  # fmt: skip


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


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
    """Fires when one value is far above its recent robust level and above anything seen
    lately.

    The limit is the larger of ``median + max(z * 1.4826 * MAD, (min_ratio - 1) * |median|)``
    of the last ``window`` values, and ``peak_ratio`` x the recent peak ratio (the largest
    value / median seen after warm-up and not alerted on, decaying by half every
    ``peak_halflife`` values) x the median; the jump over the median must also be over
    ``min_jump`` x the run's scale (the highest median seen). The robust z-score shrugs off
    Gaussian noise, the relative floor keeps flat, low-noise losses from alarming on tiny
    wiggles, the scale floor keeps a loss that reached 0 (a separable task) from alarming on
    each 1e-8 it still shows, and the peak
    guard keeps heavy-tailed losses (small batches, outliers in the targets), whose rare large
    values are part of the stream, from alarming on each. Silent
    until ``warmup`` values are in. The episode clears on the first value back under the limit.

    Args:
        window: values in the rolling median/MAD (default 100).
        z: robust z-score to exceed (default 20: far outside Gaussian noise; the MAD
            understates the spread of heavy-tailed losses).
        min_ratio: the value must also exceed ``min_ratio`` x the median (default 1.5).
        warmup: values needed before it can fire (default: half the window).
        name: what the values are, for the message.
        peak_ratio: x the recent peak ratio that counts (default 3; None for no peak guard).
        peak_halflife: values over which the peak halves (default 1000).
        min_jump: the smallest jump that counts, as a fraction of the highest median seen
            (default 0.01).
    """

    kind = "spike"
    _advice = "check the input batch at this step, lower the learning rate or clip gradients"

    def __init__(
        self, window: int = 100, z: float = 20.0, min_ratio: float = 1.5,
        warmup: int | None = None, name: str = "loss", peak_ratio: float | None = 3.0,
        peak_halflife: int = 1000, min_jump: float = 0.01,
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
        self.peak_ratio = check_number("peak_ratio", peak_ratio, minimum=1.0, allow_none=True)
        halflife = check_int("peak_halflife", peak_halflife, minimum=1)
        self._decay = 0.5 ** (1.0 / halflife)
        self.min_jump = check_number("min_jump", min_jump, minimum=0.0)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._level: deque[float] = deque(maxlen=self.window)
        self._median = self._mad = math.nan
        self._floor = 1e-12  # min_jump x the highest |median| seen
        self._since = 0
        self._peak = 0.0  # the recent peak of value / median

    def _limit(self) -> float:
        if len(self._level) < self.warmup:
            return math.inf
        spread = max(self.z * 1.4826 * self._mad, (self.min_ratio - 1) * abs(self._median))
        limit = self._median + max(spread, self._floor)
        if self.peak_ratio is not None and self._median > 0:
            limit = max(limit, self.peak_ratio * self._peak * self._median)
        return limit

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        limit = self._limit()
        self._level.append(value)
        self._since += 1
        spike = value > limit
        self._peak *= self._decay
        if not spike and self._median > 0:
            self._peak = max(self._peak, value / self._median)
        # the median/MAD are refreshed every window/2 values: O(1) amortised per value
        if self._since >= self.window // 2 or len(self._level) <= self.warmup:
            self._refresh()
        if not self._edge(spike):
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
        self._peak *= self._decay ** len(values)
        if self._median > 0:
            self._peak = max(self._peak, top / self._median)
        if self._since >= self.window // 2:
            self._refresh()
        return []

    def restart_level(self) -> None:
        """A rollback undid the steps behind the episode: end it, so the restored state is
        judged afresh (the same anomaly coming back fires again)."""
        self._active = False

    def alarm(self) -> float | None:
        """The limit a value must pass to fire (in an episode too: a value over it keeps
        the episode going); None while warming up."""
        return None if len(self._level) < self.warmup else self._limit()

    @property
    def warming_up(self) -> bool:
        """True until ``warmup`` values are in: the relative rule cannot fire yet."""
        return len(self._level) < self.warmup

    def _refresh(self) -> None:
        # sorted() on ~100 floats is several times faster than numpy's median at this size
        self._since = 0
        median = self._median = _median(sorted(self._level))
        self._mad = _median(sorted([abs(v - median) for v in self._level]))
        self._floor = max(self._floor, self.min_jump * abs(median))


class GradExplosion(Spike):
    """Fires when the global gradient norm goes over ``factor`` x the median of the last
    ``window`` norms (after ``warmup``) and over ``peak_ratio`` x the recent peak, or over
    ``max_norm`` when given (from the first step). Clears on the first norm back under the
    limit.

    Args:
        window: norms in the rolling median (default 100).
        factor: x median that counts (default 10: healthy norms swing 2-3x between batches).
        warmup: norms needed before the relative rule applies (default 10, at most window).
        max_norm: an absolute bound; None for none.
        peak_ratio / peak_halflife: the peak guard, as for :class:`Spike` (default 3 and 100
            norms: they are sampled every few steps).
    """

    kind = "grad_explosion"
    _advice = "clip gradients (clip_grad_norm), lower the learning rate or check the input batch"

    def __init__(
        self, window: int = 100, factor: float = 10.0, warmup: int | None = None,
        max_norm: float | None = None, peak_ratio: float | None = 3.0, peak_halflife: int = 100,
    ) -> None:  # fmt: skip
        self.factor = check_number("factor", factor, minimum=1.0)
        self.max_norm = check_number("max_norm", max_norm, minimum=0.0, allow_none=True)
        window = check_int("window", window, minimum=3)
        warmup = min(10, window) if warmup is None else warmup
        super().__init__(
            window=window, z=0.0, min_ratio=self.factor, warmup=warmup,
            peak_ratio=peak_ratio, peak_halflife=peak_halflife,
        )  # fmt: skip
        self.name = "gradient norm"

    def _limit(self) -> float:
        limit = super()._limit()
        return limit if self.max_norm is None else min(limit, self.max_norm)


class Divergence(Detector):
    """Fires when the loss level (the median of the last ``level_window`` values) stays above
    ``factor`` x its best level, and above the high tail of the values at that best, for
    ``patience`` steps in a row. The best level is the lowest median of the last ``window``
    values seen after ``warmup`` steps, and the high tail is that window's 95th percentile:
    on a noisy loss (tiny batches, heavy-tailed targets) the limit rises with the noise,
    while a real run-away, which moves every value, crosses it within a few steps. The
    alert names the step where the level first went over; the episode clears when it is back
    under the limit.

    Args:
        factor: level over best that counts (default 2; schedule bumps are tens of percent).
        patience: consecutive steps over the limit (default 3).
        warmup: steps before the best is tracked (default 100; covers warm-up transients).
        level_window: values in the current level's median (default 9: one outlier, even
            four, does not move it).
        window: values behind the best level (default 100).
    """

    kind = "divergence"
    _advice = "lower the learning rate, clip gradients, or roll back to the last good checkpoint"

    def __init__(
        self, factor: float = 2.0, patience: int = 3, warmup: int = 100, level_window: int = 9,
        window: int = 100,
    ) -> None:  # fmt: skip
        super().__init__()
        self.factor = check_number("factor", factor, minimum=1.0)
        self.patience = check_int("patience", patience, minimum=1)
        self.warmup = check_int("warmup", warmup, minimum=0)
        self.level_window = check_int("level_window", level_window, minimum=1)
        self.window = check_int("window", window, minimum=10)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._recent: deque[float] = deque(maxlen=self.level_window)
        self._values: deque[float] = deque(maxlen=self.window)
        self._seen = self._since = self._over = 0
        self._best = self._tail = math.inf
        self._first_over = 0

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        # The common case, a quiet batch once warm: every step's level in one numpy call.
        k, n = self.level_window, len(values)
        warm = self._seen > self.warmup and len(self._values) == self.window
        if not warm and n and math.isfinite(sum(values)):
            seen = self._seen + n
            if seen <= self.warmup or len(self._values) + n < self.window:
                # warming up to its last value: update() would only take them in
                self._recent.extend(values)
                self._values.extend(values)
                self._seen, self._since = seen, self._since + n
                return []
        if not (warm and n and not self._over and math.isfinite(sum(values))):
            return super().update_many(steps, values, epoch)
        best = self._best
        limit = max(best + (self.factor - 1.0) * abs(best), self._tail) + 1e-12
        # no value over the limit: no median over it (cheap); else every step's median
        if max(values) > limit or (self._recent and max(self._recent) > limit):
            tail = np.fromiter(itertools.chain(self._recent, values), dtype=np.float64)
            if tail.size < k + n - 1:
                return super().update_many(steps, values, epoch)
            windows = np.lib.stride_tricks.sliding_window_view(tail[-(k + n - 1) :], k)
            if float(np.median(windows, 1).max()) > limit:
                return super().update_many(steps, values, epoch)
        self._recent.extend(values)
        self._values.extend(values)
        self._seen += n
        self._since += n
        if self._since >= self.window // 4:
            self._refresh()
        return []

    def _refresh(self) -> None:
        self._since = 0
        ordered = sorted(self._values)
        median = _median(ordered)
        if median < self._best:
            self._best, self._tail = median, ordered[min(len(ordered) - 1, len(ordered) * 19 // 20)]

    def alarm(self) -> float | None:
        """The limit once warm (None before); every value (``-inf``) while the level is over
        it and the alert may come within ``patience`` steps."""
        if self._seen <= self.warmup or len(self._values) < self.window:
            return None
        if self._over and not self._active:
            return -math.inf
        best = self._best
        return max(best + (self.factor - 1.0) * abs(best), self._tail) + 1e-12

    def restart_level(self) -> None:
        """Forget the current level (after a rollback undid the steps it came from); the best
        level and its window are kept. The episode ends: the restored state is judged afresh."""
        self._recent.clear()
        self._over = 0
        self._active = False

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        self._recent.append(value)
        self._values.append(value)
        self._seen += 1
        self._since += 1
        if self._seen <= self.warmup or len(self._values) < self.window:
            return None
        if self._since >= self.window // 4:
            self._refresh()
        level = sorted(self._recent)[len(self._recent) // 2]
        best = self._best
        limit = max(best + (self.factor - 1.0) * abs(best), self._tail) + 1e-12
        if level > limit:
            self._over += 1
            if self._over == 1:
                self._first_over = step
        else:
            self._over = 0
        if not self._edge(self._over >= self.patience):
            return None
        seen = f"loss diverges: its level {level:.6g} is over {self.factor:g}x its best {best:.6g}"
        at = self._first_over
        return self._alert(at, epoch, f"{seen} since step {at}", level)


class Plateau(Detector):
    """Fires when training cannot progress: the learning rate has been 0 for ``lr_patience``
    steps (give it through :attr:`lr`), or the smoothed loss has not improved by
    ``min_rel_improvement`` over the last ``patience`` steps while it is still within
    ``min_progress`` of where it started (slow convergence). A run that learned and then
    levelled off has converged: that is not an alert.

    The loss episode ends on real progress, the EMA falling ``2 * min_rel_improvement`` below
    its value at the alert; the learning-rate one when the rate is above 0 again.

    Args:
        patience: steps over which progress is measured (default 500).
        min_rel_improvement: relative EMA drop that counts as progress (default 0.01).
        min_progress: how far (relative) below its starting level the loss must have come
            for a stall to count as convergence rather than slow convergence (default 0.1).
        lr_patience: steps at a learning rate of 0 (default 100).
        alpha: EMA weight of each new value (default 0.01, about a 200-step span; the first
            ~70 values only settle the EMA).
    """

    kind = "plateau"
    _advice = "raise the learning rate or check the schedule, the initialisation and the data"

    def __init__(
        self, patience: int = 500, min_rel_improvement: float = 0.01, min_progress: float = 0.1,
        lr_patience: int = 100, alpha: float = 0.01,
    ) -> None:  # fmt: skip
        super().__init__()
        self.patience = check_int("patience", patience, minimum=1)
        self.min_rel_improvement = _check_fraction("min_rel_improvement", min_rel_improvement)
        self.min_progress = _check_fraction("min_progress", min_progress)
        self.lr_patience = check_int("lr_patience", lr_patience, minimum=1)
        self.alpha = _check_fraction("alpha", alpha, one=True)
        self.lr: float | None = None  # the current learning rate, when known
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._sum = 0.0  # EMA before bias correction
        self._weight = 0.0  # 1 - (1 - alpha) ** n, so the first values do not anchor the EMA
        self._history: deque[float] = deque(maxlen=self.patience + 1)
        self._fired_at = math.nan
        self._start = math.nan
        self._zero_lr = 0
        self._lr_episode = False

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        lr = self.lr
        if lr is not None:
            self._zero_lr = self._zero_lr + 1 if lr <= 0.0 else 0
            if self._lr_episode and self._zero_lr == 0:
                self._lr_episode = False
            elif not self._lr_episode and self._zero_lr >= self.lr_patience:
                self._lr_episode = True
                at = step - self._zero_lr + 1
                seen = f"learning rate is 0 (seen from step {at} on): the loss cannot improve"
                return self._alert(at, epoch, seen, 0.0)
        if not math.isfinite(value):
            return None
        self._sum += self.alpha * (value - self._sum)
        self._weight += self.alpha * (1.0 - self._weight)
        smooth = self._sum / self._weight
        rel = self.min_rel_improvement
        if self._weight < 0.5:  # the first ~0.7/alpha values: the EMA is not settled yet
            return None
        if math.isnan(self._start):
            self._start = smooth
        if self._active:
            if smooth >= self._fired_at - 2 * rel * abs(self._fired_at):
                return None
            self._active = False
            self._history.clear()
        self._history.append(smooth)
        return self._check(step, epoch, smooth)

    def update_many(
        self,
        steps: Sequence[int],
        values: Sequence[float],
        epoch: int | None = None,
        lrs: Sequence[float] | None = None,
    ) -> list[Alert]:
        """As :meth:`Detector.update_many`; ``lrs``: the learning rate at each step, if known
        (else :attr:`lr` holds for all)."""
        if lrs is not None and lrs and min(lrs) <= 0.0:
            found = []
            for step, value, rate in zip(steps, values, lrs):
                self.lr = rate
                found.append(self.update(step, value, epoch))
            return [alert for alert in found if alert is not None]
        if lrs:
            self.lr = lrs[-1]
        # The common case: a settled EMA, a learning rate above 0, finite values; the stall
        # is checked once, at the batch's end.
        lr = self.lr
        quiet = not (self._lr_episode or math.isnan(self._start))
        if not (quiet and values and (lr is None or lr > 0) and math.isfinite(sum(values))):
            return super().update_many(steps, values, epoch)
        alpha, total, weight, history = self.alpha, self._sum, self._weight, self._history
        if self._active:
            # In an episode: only the EMA moves, until it falls far enough below the alert's.
            end = self._fired_at - 2 * self.min_rel_improvement * abs(self._fired_at)
            for i, value in enumerate(values):
                total += alpha * (value - total)
                weight += alpha * (1.0 - weight)
                if total / weight < end:  # the episode ends here, as update() would see it
                    self._sum, self._weight, self._zero_lr = total, weight, 0
                    self._active = False
                    history.clear()
                    history.append(total / weight)
                    first = self._check(steps[i], epoch, history[-1])
                    rest = (
                        self.update_many(steps[i + 1 :], values[i + 1 :], epoch)
                        if i + 1 < len(values)
                        else []
                    )
                    return [first, *rest] if first is not None else rest
            self._sum, self._weight, self._zero_lr = total, weight, 0
            return []
        for value in values:
            total += alpha * (value - total)
            weight += alpha * (1.0 - weight)
            history.append(total / weight)
        self._sum, self._weight, self._zero_lr = total, weight, 0
        alert = self._check(steps[-1], epoch, history[-1])
        return [alert] if alert is not None else []

    def _check(self, step: int, epoch: int | None, smooth: float) -> Alert | None:
        history, rel = self._history, self.min_rel_improvement
        old = history[0]
        if len(history) <= self.patience or old - smooth >= rel * abs(old):
            return None
        start = self._start
        if smooth < start - self.min_progress * abs(start):
            return None  # it learned, then levelled off: converged
        self._active = True
        self._fired_at = smooth
        seen = (
            f"loss plateaued: its moving average went from {old:.6g} to {smooth:.6g} in "
            f"{self.patience} steps, and is still within {self.min_progress:.0%} of where it "
            f"started ({start:.6g})"
        )
        return self._alert(step, epoch, seen, smooth)


_ALL = (
    NonFinite, Spike, Divergence, Plateau, NotLearning, LrNegligible, RecurringBatch,
    GradExplosion, GradVanishing, DyingReLU, Saturation, WorseThanChance,
)  # fmt: skip
DETECTORS: dict[str, type[Detector]] = {c.kind: c for c in (*_ALL, Overfitting, Threshold)}
