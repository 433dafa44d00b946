"""When :class:`~.anomaly.AnomalyMonitor` looks: its calls on the run's step clock (the loss
tap's :meth:`~stepwatch.view.tap.LossTap.call_at`) instead of a step hook, so a step with
nothing due runs none of its code.

It looks at a chunk of step losses at the chunk's last step (and, while a copy to the host is
still on its way, at each next step), at the gradients at the multiples of
``grad_every_n_steps`` (arming the activation hooks one step before; sooner while a gradient
detector confirms a sign or warms up), at the training state every ``rollback_every`` steps
(the copies rollback goes back to), and once at the first step's outputs (the number of
classes, for the detectors that judge against chance)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...monitor.detectors import DETECTORS, Detector
from ...view.run import RunView
from ...view.tap import Chunk

__all__ = [
    "CONFIRM_EVERY",
    "READ_EVERY",
    "READ_EVERY_HOST",
    "WARM_EVERY",
    "Clock",
    "Looks",
    "says_alarm",
]

# Step losses move to the host in one transfer per this many sampled steps (and at each epoch's
# end): an alert is read at most this many steps after its step.
READ_EVERY = 8
# Losses the host reads as they come (a CPU run of one process) are read in batches of this
# many steps; a value that could fire a detector (the tap's alarm) is handed over at once.
READ_EVERY_HOST = 128
# Gradient measurements come this many steps apart (not grad_every_n_steps) while a gradient
# detector has seen its condition but not for its whole patience yet, so an alert comes within
# patience x this many steps of the first sign ...
CONFIRM_EVERY = 5
# ... and this many apart while the explosion detector gathers its first norms.
WARM_EVERY = 10


@dataclass(frozen=True)
class Looks:
    """What the monitor does when the clock says it is time (each gets the step)."""

    take: Callable[[Chunk], None]  # a chunk of step losses was cut
    look: Callable[[int], None]  # read what waits
    measure: Callable[[int], None]  # measure the gradients
    arm: Callable[[], None]  # hook the activations of the next forward pass
    keep: Callable[[int], None]  # copy the training state (for rollback)
    classes: Callable[[int], bool]  # the first outputs are there: False to be asked again


class Clock:
    """The steps at which AnomalyMonitor looks, on the run's loss tap: every call it asks for
    is one of this object's, so :meth:`stop` takes them all off.

    Args:
        grad_every: the steps between gradient measurements while nothing is to confirm.
    """

    def __init__(self, grad_every: int) -> None:
        self.grad_every = grad_every
        self._view: RunView | None = None
        self._looks: Looks | None = None
        self.reset()

    def reset(self) -> None:
        self._view = None
        self._looks = None
        self._looking = False  # a look at the waiting values is asked for
        self.grad_due = 0  # the step of the next gradient measurement
        self._keep_every = 0
        self._arms = False  # activation hooks are armed before a measurement
        self._batched = False  # reading READ_EVERY_HOST at a time, with the tap's alarm
        self._host_losses = False  # the tap's chunks hold floats (losses read on the host)
        self._may_alarm = False
        self.level = math.inf  # the alarm level set on the tap

    def start(
        self,
        view: RunView,
        looks: Looks,
        *,
        grads: bool,
        arms: bool,
        keep_every: int,
        classes: bool,
        may_alarm: bool,
    ) -> None:
        """Ask for the first looks of a run: the losses; the first step's gradients when
        ``grads`` (with the activation hooks armed the step before when ``arms``); the state
        copies every ``keep_every`` steps (0: none); the first outputs when ``classes``.
        ``may_alarm``: every detector fed each batch says what it must see at once, so losses
        read on the host may be read in batches."""
        self._view, self._looks = view, looks
        self._may_alarm = may_alarm
        self._keep_every = keep_every
        self._arms = arms
        tap, start = view.tap, view.step
        tap.subscribe(READ_EVERY, self._take)
        if view.world == 1:
            tap.set_alarm(self, math.inf)  # a non-finite host loss, on its step from step 1
        if grads:
            self.grads_at(start + 1)  # the first step's gradients
        if keep_every:  # a copy after the first step, so a spike at step 50 has one before it
            tap.call_at(start + 1, self._keep)
        if classes:
            tap.call_at(start + 1, self._classes)

    def stop(self) -> None:
        """Take every call and the alarm off the tap."""
        if self._view is not None:
            self._view.tap.unsubscribe(self)

    # -- the losses -----------------------------------------------------------------------------
    def _take(self, chunk: Chunk) -> None:
        self._host_losses = type(chunk.host) is list
        assert self._looks is not None
        self._looks.take(chunk)

    def look_at(self, step: int) -> None:
        """Read what waits at ``step`` (one call asked for at a time)."""
        if not self._looking and self._view is not None:
            self._looking = True
            self._view.tap.call_at(step, self._look)

    def _look(self, step: int) -> None:
        self._looking = False
        assert self._looks is not None
        self._looks.look(step)

    def retune(self, level: Callable[[], tuple[float, bool]]) -> None:
        """Losses read on the host as they come (a CPU run of one process): ``level()`` is
        the smallest value that could fire a detector fed each batch, among those that can
        say, and whether all can. The tap's alarm hands such a value over on its step (a
        spike at step 50 is read at step 50 while a slower detector still warms up); once all
        can say, the losses are read in batches of READ_EVERY_HOST steps."""
        view = self._view
        if view is None or not (self._may_alarm and self._host_losses) or view.world > 1:
            return
        now, batched = level()
        if batched != self._batched:
            self._batched = batched
            view.tap.unsubscribe(self._take)
            view.tap.subscribe(READ_EVERY_HOST if batched else READ_EVERY, self._take)
        self.level = now
        view.tap.set_alarm(self, self.level)

    # -- the gradients --------------------------------------------------------------------------
    def grads_at(self, step: int) -> None:
        """Measure the gradients at ``step`` (an earlier measurement moves the later one), and
        arm the activation hooks for the forward pass of that step."""
        assert self._view is not None
        self.grad_due = step
        tap = self._view.tap
        tap.call_at(step, self._measure)
        if not self._arms:
            return
        if step - 1 <= self._view.step:
            self._arm(step - 1)  # hooks for the next forward pass only
        else:
            tap.call_at(step - 1, self._arm)

    def _arm(self, step: int) -> None:
        if step + 1 >= self.grad_due and self._looks is not None:
            self._looks.arm()

    def _measure(self, step: int) -> None:
        if step >= self.grad_due and self._looks is not None:  # else moved to an earlier step
            self._looks.measure(step)

    def next_grads(self, step: int, confirming: bool, warming_up: bool) -> int:
        """The step of the measurement after the one at ``step``: the next multiple of
        ``grad_every``, where the losses are read too (one wake of the clock for both), or
        sooner while a detector confirms a sign or warms up."""
        every = self.grad_every
        if confirming:
            return step + min(every, CONFIRM_EVERY)
        if warming_up:
            return step + min(every, WARM_EVERY)
        return (step // every + 1) * every

    def sooner(self, step: int, confirming: bool, warming_up: bool) -> None:
        """A measurement at ``step`` was judged after the next one was set: bring the next one
        forward when the judgement asks for it (a sign to confirm)."""
        if self._view is not None and self.grad_due > step:
            at = max(self.next_grads(step, confirming, warming_up), self._view.step + 1)
            if at < self.grad_due:
                self.grads_at(at)

    def grads_now(self) -> None:
        """Trouble in the loss: measure the gradients at the next step."""
        if self._view is not None:
            self.grads_at(self._view.step + 1)

    # -- the training state and the first outputs -----------------------------------------------
    def _keep(self, step: int) -> None:
        if self._looks is None or self._view is None:
            return
        self._looks.keep(step)
        every = self._keep_every
        self._view.tap.call_at((step // every + 1) * every, self._keep)

    def _classes(self, step: int) -> None:
        if self._looks is not None and self._view is not None and not self._looks.classes(step):
            self._view.tap.call_at(step + 1, self._classes)


def says_alarm(detector: Any) -> bool:
    """A built-in detector, or one of one's own that defines ``alarm()``."""
    own = getattr(type(detector), "alarm", None)
    return detector.kind in DETECTORS or (own is not None and own is not Detector.alarm)
