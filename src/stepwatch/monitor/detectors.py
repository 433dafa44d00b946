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
from ._detector import Alert, Detector, _check_fraction, _check_name, _RunScale
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
    """Fires when the loss jumps far above its recent level and stays there (two steps in a
    row), or jumps very far in one step. It judges in log space, so that a 3x jump is the
    same event at 0.3 and at 300, with a floor tied to the run's loss scale, so that a loss
    that reached 0 does not alarm on each 1e-8 it still shows.

    Each value ``v`` is read as ``u = log(v + f)``, where the floor ``f`` is ``floor`` x the
    run's scale (the mean of its first ``warmup`` values, or a higher level seen since): far
    above ``f`` this is the log of the loss, near 0 it is flat. A value is *over the limit*
    when ``u`` is over the level (the median of the last ``level_window`` values, which keeps
    up with a falling loss) by the largest of

    - ``log(min_ratio)``: a real jump, not a wiggle of a flat, low-noise loss;
    - ``z`` x the spread: the 90th percentile of the last ``window`` values' step-to-step
      changes in ``u``, scaled to a standard deviation (a falling trend does not widen it,
      and a loss that jumps about - tiny batches, heavy-tailed targets - widens it);
    - ``log(peak_ratio)`` over the recent peak: the largest excursion above the level seen
      without an alert (decaying by half every ``peak_halflife`` values), so that a
      heavy-tailed loss, whose rare large values are part of the stream, does not alarm on
      each;

    and the jump ``v - level`` is also over ``min_jump`` x the run's scale (a jump from 1e-7 to
    1e-5 in a run that started at 1 is no spike). Two values over the limit in a row fire,
    naming the first one's step; one value alone fires when it is ``lone_ratio`` x further
    out and its jump is over the run's whole scale. A value over the limit that the next one
    does not follow joins the peak: one batch up and gone the next step is the stream's tail.

    It can fire from the ``warmup``-th value on (16 by default: a spike at step 50 of a short
    run is seen). The episode clears on the first value back under the limit; while it lasts
    (up to ``window`` values) the level is held where it was, so a loss that stays high for
    a while is one episode. A value over the limit at the batch position (in the epoch) of
    the last epoch's spike is left to
    :class:`~stepwatch.monitor.learning_detectors.RecurringBatch`: a batch that is bad
    every epoch fires once here (``steps_per_epoch``, which AnomalyMonitor fills, tells the
    positions).

    Args:
        window: values behind the spread (default 64).
        z: the spread multiple to exceed (default 8).
        min_ratio: the floored value must exceed ``min_ratio`` x the floored level (default 2).
        warmup: values needed before it can fire (default 16, or half a smaller window;
            at most ``window``).
        name: what the values are, for the message.
        peak_ratio: x the recent peak excursion that counts (default 2; None for no peak
            guard).
        peak_halflife: values over which the peak halves (default 1000).
        min_jump: the smallest jump that counts, as a fraction of the run's scale (default
            0.1).
        floor: the floor of the log, as a fraction of the run's scale (default 0.01).
        level_window: values in the level's median (default 16; refreshed every half of it).
        lone_ratio: how much further out than the limit one value alone must be (default 2).
    """

    kind = "spike"
    _advice = "check the input batch at this step, lower the learning rate or clip gradients"
    _SPREAD_K = 2.3262  # the 90th percentile of |x - y| for x, y ~ N(0, 1): 1.6449 * sqrt(2)

    def __init__(
        self, window: int = 64, z: float = 8.0, min_ratio: float = 2.0,
        warmup: int | None = None, name: str = "loss", peak_ratio: float | None = 2.0,
        peak_halflife: int = 1000, min_jump: float = 0.1, floor: float = 0.01,
        level_window: int = 16, lone_ratio: float = 2.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.window = check_int("window", window, minimum=3)
        self.z = check_number("z", z, minimum=0.0)
        self.min_ratio = check_number("min_ratio", min_ratio, minimum=1.0)
        warmup = check_int("warmup", warmup, minimum=3, allow_none=True)
        self.warmup = max(3, min(16, self.window // 2)) if warmup is None else warmup
        if self.warmup > self.window:
            raise ValueError(f"'warmup' must be <= window ({window}), but got {_got(warmup)}.")
        self.name = _check_name(name)
        self.peak_ratio = check_number("peak_ratio", peak_ratio, minimum=1.0, allow_none=True)
        halflife = check_int("peak_halflife", peak_halflife, minimum=1)
        self._decay = 0.5 ** (1.0 / halflife)
        self.min_jump = check_number("min_jump", min_jump, minimum=0.0)
        self.floor = check_number("floor", floor, minimum=0.0)
        self.level_window = check_int("level_window", level_window, minimum=1)
        self._every = max(1, self.level_window // 2)
        self.lone_ratio = check_number("lone_ratio", lone_ratio, minimum=1.0)
        self.steps_per_epoch: int | None = None  # when known, a recurring batch is told apart
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._values: deque[float] = deque(maxlen=self.window)
        self._scale = _RunScale(self.warmup)
        self._f = 1e-12  # the floor of the log
        self._median = math.nan  # the level
        self._spread = 0.0  # in log units
        self._peak = 0.0  # the recent peak excursion, in log units
        self._limit = math.inf
        self._since = 0  # values since the level was refreshed
        self._since_spread = 0
        self._held = 0  # values of the current episode
        self._pending: tuple[int, float] | None = None  # a lone value over the limit
        self._lone = math.inf  # the limit for one value alone
        self._positions: dict[int, int] = {}  # batch position of a spike -> its last epoch

    # -- one value at a time (warming up, in an episode, or a batch with a value over the limit)
    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        values = self._values
        over = len(values) >= self.warmup and value > self._limit
        recurs = over and self._recurs(step, epoch)
        over = over and not recurs
        first, fire = self._pending, None
        if over and not self._active:
            if first is not None or value > self._lone:  # high for two steps, or far up
                fire, self._pending, self._active = first or (step, value), None, True
            else:
                self._pending = (step, value)  # one value over: a spike if the next is too
        elif not over:
            self._active = False
            if first is not None:  # it came alone: a value of the stream's tail after all
                self._pending = None
                self._peak = max(self._peak, self._excursion(first[1]))
        self._held = self._held + 1 if self._active else 0
        self._peak *= self._decay
        if not (over or recurs) and values:
            self._peak = max(self._peak, self._excursion(value))
        if not self._scale.started:
            self._scale.add((value,))
        values.append(value)
        self._since += 1
        self._since_spread += 1
        due = len(values) <= self.warmup or self._since >= self._every
        if due and (not over or self._held >= self.window):  # held while the loss is high
            self._refresh()
        if fire is None:
            return None
        at, jumped = fire
        self._mark(at, epoch)
        stayed = f", and {value:.6g} at step {step}" if at != step else ""
        seen = f"{self.name} jumped to {jumped:.6g}{stayed} (recent level {self._median:.6g})"
        return self._alert(at, epoch, seen, jumped)

    def _excursion(self, value: float) -> float:
        f = self._f
        return math.log((value + f) / (self._median + f))

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        # The common case, a quiet batch: its values taken in runs up to the next refresh of
        # the level, each run checked against the limit with one max().
        found: list[Alert] = []
        i, n = 0, len(values)
        while i < n:
            if self._active or self._pending is not None or len(self._values) < self.warmup:
                alert = self.update(steps[i], values[i], epoch)
                if alert is not None:
                    found.append(alert)
                i += 1
                continue
            if self._since >= self._every:  # due since an episode held the level
                self._refresh()
            end = min(n, i + self._every - self._since)
            run = values[i:end]
            top = max(run)
            if not (top <= self._limit and math.isfinite(sum(run))):
                for j in range(i, end):
                    alert = self.update(steps[j], values[j], epoch)
                    if alert is not None:
                        found.append(alert)
                i = end
                continue
            self._take_quiet(run, top)
            i = end
        return found

    def _take_quiet(self, run: Sequence[float], top: float) -> None:
        """Values all under the limit: as update() would take them, without a look at each."""
        k = len(run)
        decayed = self._peak * self._decay**k
        f, level = self._f, self._median
        if math.log((top + f) / (level + f)) > decayed:  # a new peak among them: value by value
            peak = self._peak
            for value in run:
                peak = max(peak * self._decay, math.log((value + f) / (level + f)))
            self._peak = peak
        else:
            self._peak = decayed
        self._values.extend(run)
        self._since += k
        self._since_spread += k
        if self._since >= self._every:
            self._refresh()

    def _refresh(self) -> None:
        # the level: sorted() on 16 floats is several times faster than numpy's median
        self._since = 0
        values = self._values
        recent = list(itertools.islice(values, max(0, len(values) - self.level_window), None))
        median = self._median = _median(sorted(recent))
        scale = self._scale
        if not self._active:  # a level inside an episode is not the run's scale
            scale.raise_to(median)
        f = self._f = max(self.floor * scale.value, 1e-12)
        n = len(values)
        if n < self.warmup:
            return
        if n < self.window or self._since_spread >= self.window:  # (it moves slowly)
            self._since_spread = 0
            changes = np.abs(np.diff(np.log(np.fromiter(values, np.float64, n) + f)))
            k = (n - 2) * 9 // 10  # the 90th percentile of the n - 1 changes
            self._spread = float(np.partition(changes, k)[k]) / self._SPREAD_K
        excess = max(math.log(self.min_ratio), self.z * self._spread)
        if self.peak_ratio is not None:
            excess = max(excess, self._peak + math.log(self.peak_ratio))
        floor = median + self.min_jump * scale.value
        self._limit = max((median + f) * math.exp(min(excess, 700.0)) - f, floor)
        lone = min(excess + math.log(self.lone_ratio), 700.0)
        self._lone = max((median + f) * math.exp(lone) - f, median + scale.value)

    def _position(self, step: int, epoch: int | None) -> int | None:
        spe = self.steps_per_epoch
        return (step - 1) % spe if spe and epoch is not None else None

    def _recurs(self, step: int, epoch: int | None) -> bool:
        """Over the limit at the position of the last epoch's spike: a recurring batch."""
        at = self._position(step, epoch)
        if at is None or epoch is None or self._positions.get(at) != epoch - 1:
            return False
        self._positions[at] = epoch
        return True

    def _mark(self, step: int, epoch: int | None) -> None:
        at = self._position(step, epoch)
        if at is not None and epoch is not None:
            self._positions[at] = epoch
            if len(self._positions) > 16:  # the oldest forgotten
                del self._positions[next(iter(self._positions))]

    def restart_level(self) -> None:
        """A rollback undid the steps behind the episode: end it, so the restored state is
        judged afresh (the same anomaly coming back fires again)."""
        self._active = False
        self._held = 0
        self._pending = None

    def alarm(self) -> float | None:
        """The limit a value must pass to fire (in an episode too: a value over it keeps
        the episode going); None while warming up."""
        return None if len(self._values) < self.warmup else self._limit

    @property
    def warming_up(self) -> bool:
        """True until ``warmup`` values are in: it cannot fire yet."""
        return len(self._values) < self.warmup


class GradExplosion(Detector):
    """Fires when the global gradient norm is far out of its running distribution: its log
    over the running mean by more than ``z`` running standard deviations and ``factor`` x
    (or over ``max_norm``, when given, from the first norm on). The mean and variance are
    exponential moving averages of the log norm with weight ``alpha`` (the z-score that
    ZClip clips at), started from the first ``warmup`` norms; a norm that fires, and every
    norm of its episode, is kept out of them, so a blow-up does not teach the detector that
    it is normal. The log makes the score a ratio: healthy norms swing by a factor from
    batch to batch at any scale. Clears on the first norm back under the limit.

    Fed at every step (``grad_every_n_steps=1``) it sees a blow-up at the gradient of the
    step that causes it, before the loss of the next step shows it; fed sampled norms it
    judges each sample against the ones before.

    Args:
        z: standard deviations of the log norm to exceed (default 6).
        factor: x the running mean that the norm must also exceed (default 10: healthy
            norms of small batches swing several-fold from one batch to another, and a few
            read far apart say little of their tail).
        warmup: norms needed before the relative rule applies (default 5).
        alpha: the weight of each new norm in the moving averages (default 0.1).
        max_norm: an absolute bound; None for none.
        min_std: the smallest standard deviation of the log norm used (default 0.3: norms
            read 128 steps apart drift by more than the batch-to-batch noise of a few read
            close together at the run's start, so 6 deviations are at least 6x).
    """

    kind = "grad_explosion"
    _advice = "clip gradients (clip_grad_norm), lower the learning rate or check the input batch"

    def __init__(
        self, z: float = 6.0, factor: float = 10.0, warmup: int = 5, alpha: float = 0.1,
        max_norm: float | None = None, min_std: float = 0.3,
    ) -> None:  # fmt: skip
        super().__init__()
        self.z = check_number("z", z, minimum=0.0)
        self.factor = check_number("factor", factor, minimum=1.0)
        self.warmup = check_int("warmup", warmup, minimum=2)
        self.alpha = _check_fraction("alpha", alpha, one=True)
        self.max_norm = check_number("max_norm", max_norm, minimum=0.0, allow_none=True)
        self.min_std = check_number("min_std", min_std, minimum=0.0)
        self.name = "gradient norm"
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._first: list[float] = []  # the first log norms, until warmup
        self._mean = 0.0
        self._var = 0.0

    @property
    def warming_up(self) -> bool:
        """True until ``warmup`` norms are in: only ``max_norm`` can fire yet."""
        return len(self._first) < self.warmup

    def limit(self) -> float:
        """The norm over which the next one fires (``inf`` while warming up without
        ``max_norm``)."""
        limit = math.inf
        if not self.warming_up:
            std = max(math.sqrt(self._var), self.min_std)
            limit = math.exp(self._mean + max(self.z * std, math.log(self.factor)))
        return limit if self.max_norm is None else min(limit, self.max_norm)

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        limit = self.limit()
        explodes = value > limit
        if not explodes and value > 0.0:  # (a zero norm: nothing flowed, nothing to learn)
            x = math.log(value)
            first = self._first
            if len(first) < self.warmup:
                first.append(x)
                if len(first) == self.warmup:
                    self._mean = sum(first) / len(first)
                    self._var = sum((v - self._mean) ** 2 for v in first) / len(first)
            else:
                d = x - self._mean
                self._mean += self.alpha * d
                self._var = (1.0 - self.alpha) * (self._var + self.alpha * d * d)
        if not self._edge(explodes):
            return None
        if self.warming_up:
            seen = f"{self.name} is {value:.6g}, over max_norm {self.max_norm:g}"
        else:
            seen = f"{self.name} jumped to {value:.6g} (running mean {math.exp(self._mean):.6g})"
        return self._alert(step, epoch, seen, value)


class Divergence(Detector):
    """Fires when the loss level (the median of the last ``level_window`` values) stays above
    ``factor`` x its best level, and above the high tail of the values at that best, for
    ``patience`` steps in a row. The best level is the lowest median of the last ``window``
    values seen after ``warmup`` steps, and the high tail is that window's 95th percentile:
    on a noisy loss (tiny batches, heavy-tailed targets) the limit rises with the noise,
    while a real run-away, which moves every value, crosses it within a few steps. The level
    must also be over the best by ``min_jump`` x the run's loss scale (the mean of its first
    16 values, or a higher level since): a loss that reached 0 and shows 1e-6 now and then
    has not diverged. The alert names the step where the level first went over; the episode
    clears when it is back under the limit.

    Args:
        factor: level over best that counts (default 2; schedule bumps are tens of percent).
        patience: consecutive steps over the limit (default 3).
        warmup: steps before the best is tracked (default 100; covers warm-up transients).
        level_window: values in the current level's median (default 9: one outlier, even
            four, does not move it).
        window: values behind the best level (default 100).
        min_jump: the smallest rise over the best that counts, as a fraction of the run's
            loss scale (default 0.1).
    """

    kind = "divergence"
    _advice = "lower the learning rate, clip gradients, or roll back to the last good checkpoint"

    def __init__(
        self, factor: float = 2.0, patience: int = 3, warmup: int = 100, level_window: int = 9,
        window: int = 100, min_jump: float = 0.1,
    ) -> None:  # fmt: skip
        super().__init__()
        self.factor = check_number("factor", factor, minimum=1.0)
        self.patience = check_int("patience", patience, minimum=1)
        self.warmup = check_int("warmup", warmup, minimum=0)
        self.level_window = check_int("level_window", level_window, minimum=1)
        self.window = check_int("window", window, minimum=10)
        self.min_jump = check_number("min_jump", min_jump, minimum=0.0)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._recent: deque[float] = deque(maxlen=self.level_window)
        self._values: deque[float] = deque(maxlen=self.window)
        self._seen = self._since = self._over = 0
        self._best = self._tail = math.inf
        self._first_over = 0
        self._scale = _RunScale()

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        # The common case, a quiet batch once warm: every step's level in one numpy call.
        k, n = self.level_window, len(values)
        if not self._scale.started:
            self._scale.add(values)
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
        limit = self._limit()
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

    def _limit(self) -> float:
        best = self._best
        rise = max((self.factor - 1.0) * abs(best), self.min_jump * self._scale.value)
        return max(best + rise, self._tail) + 1e-12

    def _refresh(self) -> None:
        self._since = 0
        ordered = sorted(self._values)
        median = _median(ordered)
        if not (self._over or self._active):  # a level of a run-away is not the run's scale
            self._scale.raise_to(median)
        if median < self._best:
            self._best, self._tail = median, ordered[min(len(ordered) - 1, len(ordered) * 19 // 20)]

    def alarm(self) -> float | None:
        """The limit once warm (None before); every value (``-inf``) while the level is over
        it and the alert may come within ``patience`` steps."""
        if self._seen <= self.warmup or len(self._values) < self.window:
            return None
        if self._over and not self._active:
            return -math.inf
        return self._limit()

    def restart_level(self) -> None:
        """Forget the current level (after a rollback undid the steps it came from); the best
        level and its window are kept. The episode ends: the restored state is judged afresh."""
        self._recent.clear()
        self._over = 0
        self._active = False

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(value):
            return None
        if not self._scale.started:
            self._scale.add((value,))
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
        limit = self._limit()
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
        self._first = _RunScale(16)  # the mean of the first losses
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
        if not self._first.started:
            self._first.add((value,))
        self._sum += self.alpha * (value - self._sum)
        self._weight += self.alpha * (1.0 - self._weight)
        smooth = self._sum / self._weight
        rel = self.min_rel_improvement
        if self._weight < 0.5:  # the first ~0.7/alpha values: the EMA is not settled yet
            return None
        if math.isnan(self._start):  # (a loss that fell fast started higher than its EMA)
            self._start = max(smooth, self._first.value)
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
