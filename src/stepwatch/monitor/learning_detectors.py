"""Detectors of runs that crash nothing but do not learn: a loss at the task's chance level or
flat from its start, a learning rate decayed to nothing early, epoch losses worse than chance,
and one batch position that is an outlier epoch after epoch. No PyTorch.

Each takes what :class:`~stepwatch.train.callback.anomaly.AnomalyMonitor` already reads (the
step losses in chunks, the learning rate at each step, the epoch's mean loss) and fills in
what it knows of the run: the number of classes (``classes``, from a CrossEntropyLoss or
NLLLoss and the outputs' width), the run's planned steps (``total_steps``) and the steps per
epoch (``steps_per_epoch``)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from .._validation import check_int, check_number
from ._detector import Alert, Detector, _check_fraction, _RunScale

__all__ = ["LrNegligible", "NotLearning", "RecurringBatch", "WorseThanChance"]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def _chance(classes: int | None) -> float | None:
    return math.log(classes) if classes is not None and classes > 1 else None


class _Levels:
    """The loss's start (the mean of its first ``window`` values: a loss that falls to 0 within
    them still started where it started) and its current level (median of the last
    ``window``)."""

    def __init__(self, window: int) -> None:
        self.first: list[float] = []
        self.recent: deque[float] = deque(maxlen=window)
        self.seen = 0
        self._start = math.nan

    def add(self, values: Sequence[float]) -> None:
        finite = values if math.isfinite(sum(values)) else [v for v in values if math.isfinite(v)]
        if len(self.first) < (self.recent.maxlen or 0):
            self.first.extend(finite[: (self.recent.maxlen or 0) - len(self.first)])
        self.recent.extend(finite)
        self.seen += len(finite)

    def start(self) -> float:
        if not math.isnan(self._start):
            return self._start
        start = sum(self.first) / len(self.first) if self.first else math.nan
        if len(self.first) == self.recent.maxlen:
            self._start = start  # the first window is full: the start no longer moves
        return start

    def level(self) -> float:
        return _median(self.recent) if self.recent else math.nan


class _Chunked(Detector):
    """A detector that judges the losses a chunk at a time (:meth:`update_many`); one value is
    a chunk of one."""

    def update(self, step: int, value: float, epoch: int | None = None) -> Alert | None:
        found = self.update_many([step], [value], epoch)
        return found[0] if found else None


class NotLearning(_Chunked):
    """Fires when, ``patience`` steps in, the loss level (the median of the last ``window``
    losses) is still at the task's chance level - within ``tolerance`` of ln(classes), for a
    classifier - or has come down less than ``min_improvement`` (relative) from its start
    (the mean of the first ``window``). Clears when the level is below both.

    Args:
        patience: steps before it judges (default 300).
        window: losses in the start and the level (default 50).
        tolerance: how close to ln(classes) counts as chance (default 0.05, relative).
        min_improvement: how far below its start the level must come (default 0.05).
        classes: the number of classes (AnomalyMonitor reads it from a CrossEntropyLoss or
            NLLLoss and the outputs' width); None for none known.
    """

    kind = "not_learning"
    _advice = (
        "check that the labels match their inputs (shuffled together), the learning rate "
        "(a typo such as 1e-7), that the parameters train (requires_grad, in the optimizer) "
        "and that the loss gets raw scores (no softmax before CrossEntropyLoss)"
    )

    def __init__(
        self, patience: int = 300, window: int = 50, tolerance: float = 0.05,
        min_improvement: float = 0.05, classes: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.patience = check_int("patience", patience, minimum=1)
        self.window = check_int("window", window, minimum=3)
        self.tolerance = _check_fraction("tolerance", tolerance)
        self.min_improvement = _check_fraction("min_improvement", min_improvement)
        self.classes = check_int("classes", classes, minimum=2, allow_none=True)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._levels = _Levels(self.window)
        self._next = self.patience

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        levels = self._levels
        levels.add(values)
        if levels.seen < self._next or not steps:
            return []
        self._next = levels.seen + self.window // 2  # judged every window/2 steps
        level, start, chance = levels.level(), levels.start(), _chance(self.classes)
        at_chance = chance is not None and level >= (1.0 - self.tolerance) * chance
        flat = level > start - self.min_improvement * abs(start)
        if not self._edge(at_chance or flat):
            return []
        if at_chance:
            seen = (
                f"not learning: after {levels.seen} steps the loss level {level:.4g} is at "
                f"chance, ln({self.classes}) = {chance:.4g}"
            )
        else:
            seen = (
                f"not learning: after {levels.seen} steps the loss level {level:.4g} is within "
                f"{self.min_improvement:.0%} of its start {start:.4g}"
            )
        return [self._alert(steps[-1], epoch, seen, level)]


class LrNegligible(Detector):
    """Fires when the learning rate has been above 0 but under ``fraction`` x its peak for
    ``patience`` steps while the run is still young - in the first ``early`` of its planned
    steps - or its loss level is above ``1 - min_progress`` of where it started: how an epoch
    schedule (StepLR) stepped every batch looks. A warm-up from 0 never is under its peak; a
    cosine schedule reaches 0 at the run's end, after the loss came down. A rate of exactly 0
    is :class:`~stepwatch.monitor.detectors.Plateau`'s. Clears when the rate is back over the
    fraction.

    Args:
        fraction: the rate relative to its peak that counts as negligible (default 1e-3).
        patience: consecutive steps under it (default 100).
        early: the part of the planned steps that counts as young (default 0.5).
        min_progress: how far below its start the loss must have come (default 0.5).
        window: losses in the start and the level (default 50).
    """

    kind = "lr_negligible"
    _advice = (
        "check the schedule: an epoch schedule (StepLR, MultiStepLR, ExponentialLR) stepped "
        "every batch decays once per batch; step it per epoch (Model(lr_interval='epoch')) or "
        "count its steps in batches"
    )

    def __init__(
        self, fraction: float = 1e-3, patience: int = 100, early: float = 0.5,
        min_progress: float = 0.5, window: int = 50,
    ) -> None:  # fmt: skip
        super().__init__()
        self.fraction = _check_fraction("fraction", fraction)
        self.patience = check_int("patience", patience, minimum=1)
        self.early = _check_fraction("early", early, one=True)
        self.min_progress = _check_fraction("min_progress", min_progress)
        self.window = check_int("window", window, minimum=3)
        self.total_steps: int | None = None  # the run's planned steps, when known
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._levels = _Levels(self.window)
        self._peak = 0.0
        self._low = 0  # consecutive steps under fraction x peak
        self._since = 0

    def update_many(
        self,
        steps: Sequence[int],
        values: Sequence[float],
        epoch: int | None = None,
        lrs: Sequence[float] | None = None,
    ) -> list[Alert]:
        """``lrs``: the learning rate at each of ``steps`` (without them nothing is judged)."""
        self._levels.add(values)
        if not lrs or not steps:
            return []
        peak = self._peak = max(self._peak, max(lrs))
        floor = self.fraction * peak
        if min(lrs) >= floor and not self._active:
            self._low = 0  # the common case
            return []
        found = []
        for step, rate in zip(steps, lrs):
            low = 0.0 < rate < floor
            self._low = self._low + 1 if low else 0
            if self._low == 1:
                self._since = step
            alert = self._judge(step, epoch, rate) if low or self._active else None
            if alert is not None:
                found.append(alert)
        return found

    def _judge(self, step: int, epoch: int | None, rate: float) -> Alert | None:
        level, start = self._levels.level(), self._levels.start()
        total = self.total_steps
        young = total is not None and total > 0 and step <= self.early * total
        stuck = level > start - self.min_progress * abs(start)
        if not self._edge(self._low >= self.patience and (young or stuck)):
            return None
        when = f"{step / total:.0%} into the run" if total else "early in the run"
        why = f"the loss level {level:.4g} is still near its start {start:.4g}" if stuck else when
        seen = (
            f"learning rate negligible: under {self.fraction:g}x its peak {self._peak:.3g} since "
            f"step {self._since} (now {rate:.3g}), and {why}"
        )
        return self._alert(self._since, epoch, seen, rate)


class WorseThanChance(Detector):
    """Fed each epoch's mean training loss: fires when ``patience`` epochs in a row are over
    ``factor`` x the larger of the chance level (ln(classes), for a classifier) and the
    loss the run started at - a model that does worse than guessing, as one trained on data
    sorted by class (never shuffled) does. Clears on an epoch back under the limit.

    Args:
        factor: x the chance or starting level that counts (default 1.25).
        patience: consecutive epochs (default 3: a spike or two that straddle an epoch's end
            can lift two epoch means; a loader sorted by class lifts every one).
        classes: the number of classes, when known (AnomalyMonitor fills it).
    """

    kind = "worse_than_chance"
    _advice = (
        "shuffle the training data (a loader sorted by class makes each epoch a run of "
        "one-class tasks), check the labels, and lower the learning rate"
    )

    def __init__(self, factor: float = 1.25, patience: int = 3, classes: int | None = None):
        super().__init__()
        self.factor = check_number("factor", factor, minimum=1.0)
        self.patience = check_int("patience", patience, minimum=1)
        self.classes = check_int("classes", classes, minimum=2, allow_none=True)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.start: float | None = None
        self._first = _RunScale(16)
        self._over = 0

    def see_start(self, losses: Sequence[float]) -> None:
        """The run's first step losses, until 16 are in: their mean is the starting level (a
        loss that falls to 0 within them still started where it started)."""
        first = self._first
        if self.start is None:
            first.add(losses)
            if first.started:
                self.start = first.value

    def update(self, step: int, loss: float, epoch: int | None = None) -> Alert | None:
        if not math.isfinite(loss):
            return None
        bases = [b for b in (_chance(self.classes), self.start) if b is not None]
        if not bases:
            return None
        base = max(bases)
        self._over = self._over + 1 if loss > self.factor * base else 0
        if not self._edge(self._over >= self.patience):
            return None
        chance = _chance(self.classes)
        named = (
            f"chance, ln({self.classes}) = {chance:.4g}"
            if chance is not None and base == chance
            else f"its starting loss {base:.4g}"
        )
        seen = (
            f"worse than chance: the epoch loss {loss:.4g} is over {self.factor:g}x {named}, "
            f"{self._over} epochs in a row"
        )
        return self._alert(step, epoch, seen, loss)


class RecurringBatch(_Chunked):
    """Fires when the loss at the same position in the epoch (the k-th batch) is over
    ``factor`` x the median of the ``window`` losses before it, ``patience`` epochs in a row:
    a batch that is bad every epoch (the same corrupt shard), which a spike detector takes
    for a heavy tail. The alert names the position. A position's episode ends with an epoch
    in which it is not an outlier.

    Args:
        factor: x the recent median that counts as an outlier (default 3).
        patience: consecutive epochs (default 3).
        window: losses in the median (default 32).
        min_jump: the jump must also be over this fraction of the run's loss scale (the
            mean of its first 16 losses, or a higher median since; default 0.1), as for
            :class:`~stepwatch.monitor.detectors.Spike`.
        significance: on a heavy-tailed loss some position repeats by luck; the streak must
            also be unlikely by chance: (steps per epoch) x (outlier rate of the last epoch)
            ** (epochs in a row) under this (default 1e-3), so a run with many outliers needs
            a longer streak.
    """

    kind = "recurring_batch"
    _advice = (
        "look at that batch: with shuffle=False it holds the same samples every epoch "
        "(corrupt files, wrong labels, a scale error in one shard)"
    )
    _MAX_POSITIONS = 1000  # outlier positions tracked at once

    def __init__(
        self, factor: float = 3.0, patience: int = 3, window: int = 32, min_jump: float = 0.1,
        significance: float = 1e-3,
    ) -> None:  # fmt: skip
        super().__init__()
        self.significance = _check_fraction("significance", significance)
        self.factor = check_number("factor", factor, minimum=1.0)
        self.patience = check_int("patience", patience, minimum=2)
        self.window = check_int("window", window, minimum=3)
        self.min_jump = check_number("min_jump", min_jump, minimum=0.0)
        self.steps_per_epoch: int | None = None  # when known, positions come from it
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._recent: deque[float] = deque(maxlen=self.window)
        self._median = math.nan
        self._limit = math.inf
        self._scale = _RunScale(16)
        self._since = 0
        self._epoch: int | None = None
        self._epoch_start = 0
        self._count = self._steps = 0  # outliers and steps seen this epoch
        self._rate = 1.0  # the outlier rate of the last epoch
        # position -> (epochs in a row, last epoch, its steps, alerted)
        self._seen: dict[int, tuple[int, int, tuple[int, ...], bool]] = {}
        self._armed = False  # some position fires if it is an outlier once more

    def _position(self, step: int) -> int:
        spe = self.steps_per_epoch
        return (step - 1) % spe + 1 if spe else step - self._epoch_start

    def update_many(
        self, steps: Sequence[int], values: Sequence[float], epoch: int | None = None
    ) -> list[Alert]:
        if not steps:
            return []
        if epoch != self._epoch:
            self._new_epoch(epoch, steps[0])
        found: list[Alert] = []
        if max(values) > self._limit:  # rare: some value is an outlier
            for step, value in zip(steps, values):
                if value > self._limit and math.isfinite(value):
                    alert = self._outlier(step, value, epoch)
                    if alert is not None:
                        found.append(alert)
        n = len(values)
        if not self._scale.started:
            self._scale.add(values)
        self._steps += n
        self._since += n
        if math.isfinite(sum(values)):
            self._recent.extend(values)
        else:
            self._recent.extend(v for v in values if math.isfinite(v))
        recent = self._recent
        if self._since >= self.window // 2 and len(recent) == recent.maxlen:
            self._since = 0
            median = self._median = _median(recent)
            self._scale.raise_to(median)
            limit = max(self.factor * median, median + self.min_jump * self._scale.value)
            self._limit = limit if median > 0 else math.inf
        return found

    def _new_epoch(self, epoch: int | None, first: int) -> None:
        self._epoch, self._epoch_start = epoch, first - 1
        if self._steps:
            self._rate = self._count / self._steps
        self._count = self._steps = 0
        if epoch is not None:  # positions not an outlier last epoch: their episode ended
            self._seen = {p: v for p, v in self._seen.items() if v[1] >= epoch - 1}
        self._armed = any(self._could_fire(v[0], v[3]) for v in self._seen.values())

    def _could_fire(self, count: int, alerted: bool) -> bool:
        """A position seen ``count`` epochs in a row fires at its next time."""
        luck = self._luck(count + 1, self._steps or 1)
        return not alerted and count + 1 >= self.patience and luck < self.significance

    def _luck(self, count: int, steps: int) -> float:
        """How many positions would be outliers ``count`` epochs in a row by chance."""
        return (self.steps_per_epoch or steps) * self._rate**count

    def alarm(self) -> float | None:
        """The outlier limit while some position would fire at its next time (so a host
        that reads losses in batches hands that value over on its step), else +inf."""
        return self._limit if self._armed else math.inf

    def _outlier(self, step: int, value: float, epoch: int | None) -> Alert | None:
        if epoch is None:
            return None
        position = self._position(step)
        count, last, at, alerted = self._seen.get(position, (0, -1, (), False))
        self._count += 1
        if last == epoch:
            return None
        count = count + 1 if last == epoch - 1 else 1
        at = (*at, step)[-self.patience :]
        luck = self._luck(count, self._steps)
        fire = count >= self.patience and luck < self.significance and not alerted
        self._seen[position] = (count, epoch, at, alerted or fire)
        if fire:
            self._armed = any(self._could_fire(v[0], v[3]) for v in self._seen.values())
        elif self._could_fire(count, alerted):
            self._armed = True
        if len(self._seen) > self._MAX_POSITIONS:
            del self._seen[next(iter(self._seen))]
        if not fire:
            return None
        seen = (
            f"recurring outlier batch: batch {position} of the epoch has a loss over "
            f"{self.factor:g}x its neighbours' {count} epochs in a row (steps "
            f"{', '.join(map(str, at))}; now {value:.4g} against {self._median:.4g})"
        )
        return self._alert(step, epoch, seen, value)
