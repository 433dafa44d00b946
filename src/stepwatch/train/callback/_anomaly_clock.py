"""When :class:`~.anomaly.AnomalyMonitor` looks: its calls on the run's step clock (the loss
tap's :meth:`~stepwatch.view.tap.LossTap.call_at`) instead of a step hook, so a step with
nothing due runs none of its code.

It looks at a chunk of step losses at the chunk's last step (and, while a copy to the host is
still on its way, at each next step), at the gradients at the multiples of
``grad_every_n_steps`` (arming the activation hooks one step before; sooner while a gradient
detector confirms a sign or warms up), at the training state every
``rollback_every`` steps (the copies rollback goes back to), and once at the first step's
outputs (the number of classes, for the detectors that judge against chance)."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ...monitor.detectors import (
    DETECTORS,
    Alert,
    Detector,
    DyingReLU,
    GradExplosion,
    GradVanishing,
    NonFinite,
    Saturation,
)
from ...view.run import RunView
from ._anomaly_actions import ActivationStats, GradStats, StateKeeper, classes_of
from ._callback import RunContext

__all__ = ["READ_EVERY", "READ_EVERY_HOST", "Clock", "says_alarm"]

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


class Clock:
    """The sampling half of AnomalyMonitor (a mixin: the monitor holds the state named here)."""

    grad_every_n_steps: int
    _view: RunView | None
    _run_context: RunContext | None
    _stats: GradStats | None
    _acts: ActivationStats | None
    _keeper: StateKeeper | None
    _explosion: GradExplosion | None
    _vanishing: GradVanishing | None
    _dying: DyingReLU | None
    _saturation: Saturation | None
    _grad_nonfinite: NonFinite | None
    _nonfinite: NonFinite | None
    _scaled: bool
    _undone: int
    _grad_due: int
    _looking: bool
    _want_classes: bool
    _classes_for: list[Any]
    _inflight: deque[tuple[Any, ...]]
    _history: dict[str, deque[Any]]
    _world: int
    _lr_handle: Any
    _lr_changes: list[tuple[int, float]]
    _fast: list[Any]
    _slow_alarms: list[Any]
    _level: float
    _may_alarm: bool
    _host_losses: bool
    _alarming: bool

    def _drain(self, run_context: RunContext, block: bool) -> None:
        raise NotImplementedError

    def _reduce_block(self) -> None:
        raise NotImplementedError

    def _raise_all(self, alerts: list[Alert], run_context: RunContext) -> None:
        raise NotImplementedError

    def _block_due(self) -> bool:
        raise NotImplementedError

    def _take(self, chunk: Any) -> None:
        raise NotImplementedError

    def _start_clock(self) -> None:
        """Ask for the first looks of a run (``on_train_begin``)."""
        assert self._view is not None
        tap, start = self._view.tap, self._view.step
        if self._stats is not None:
            self._grads_at(start + 1)  # the first step's gradients
        if self._keeper is not None:
            every = self._keeper.every
            tap.call_at((start // every + 1) * every, self._keep)
        if self._want_classes:
            tap.call_at(start + 1, self._find_classes)

    # -- the loss chunks ----------------------------------------------------------------------
    def _note_lr(self, step: int) -> None:
        """The rate as of ``step`` (read at each chunk and each gradient measurement), for the
        detectors that judge the learning rate."""
        rates = self._lr_handle
        if rates is not None:
            lr = rates.get()[0]
            changes = self._lr_changes
            if not changes or changes[-1][1] != lr:
                changes.append((step, lr))

    def _set_alarm(self) -> None:
        """Losses read on the host as they come (a CPU run of one process): once every
        detector fed each batch says what it must see at once, read batches of
        READ_EVERY_HOST steps, and let the tap's alarm hand such a value over on its step."""
        view = self._view
        if view is None or not (self._may_alarm and self._host_losses) or self._world > 1:
            return
        levels = [getattr(d, "alarm", _no_alarm)() for d in self._fast]
        ready = None not in levels
        if ready != self._alarming:
            self._alarming = ready
            view.tap.unsubscribe(self._take)
            view.tap.subscribe(READ_EVERY_HOST if ready else READ_EVERY, self._take)
        level = min(levels, default=math.inf) if ready else math.inf  # else non-finite only
        if ready:
            for detector in self._slow_alarms:  # a trend detector waiting for a value
                wants = detector.alarm()
                if wants is not None and wants < level:
                    level = wants
        self._level = level
        view.tap.set_alarm(self, level)

    def _rates(self, steps: Sequence[int]) -> list[float] | None:
        """The learning rate at each of ``steps`` (from the recorded change points)."""
        changes = self._lr_changes
        if not changes:
            return None
        if len(changes) == 1:
            return [changes[0][1]] * len(steps)
        starts = [s for s, _ in changes]
        return [changes[max(0, bisect.bisect_right(starts, s) - 1)][1] for s in steps]

    def _look_at(self, step: int) -> None:
        """Read what waits at ``step`` (one call asked for at a time)."""
        if not self._looking and self._view is not None:
            self._looking = True
            self._view.tap.call_at(step, self._look)

    def _look(self, step: int) -> None:
        self._looking = False
        if self._block_due():
            self._reduce_block()  # every rank reduces the same block at the same step
        if self._inflight and self._run_context is not None:
            self._drain(self._run_context, block=False)
            if self._inflight:  # a copy still on its way (CUDA): look again at the next step
                self._look_at(step + 1)

    # -- the gradients -----------------------------------------------------------------------
    def _grads_at(self, step: int) -> None:
        """Measure the gradients at ``step`` (an earlier measurement moves the later one)."""
        assert self._view is not None
        self._grad_due = step
        self._view.tap.call_at(step, self._measure)
        if self._acts is not None:
            if step - 1 <= self._view.step:
                self._acts.arm()  # hooks for the next forward pass only
            else:
                self._view.tap.call_at(step - 1, self._arm)

    def _arm(self, step: int) -> None:
        if self._acts is not None and step + 1 >= self._grad_due:
            self._acts.arm()

    def _measure(self, step: int) -> None:
        stats = self._stats
        if step < self._grad_due or stats is None or self._run_context is None:
            return  # asked for before an earlier measurement moved the next one
        p = self._run_context.cb_params
        measured = None
        if p.get("optimizer_stepped", True):
            # the saturated fractions of this step's forward pass, packed with the gradients'
            acts = self._acts.take() if self._acts is not None else ()
            measured = stats.measure(acts)
        if measured is None:  # mid accumulation window, or no gradient yet: the next step
            self._grads_at(step + 1)
            return
        self._note_lr(step)
        if not measured.is_cpu or self._world > 1:
            self._grads_at(self._next_grads(step))  # sooner once judged, if it shows a sign
            self._ship_grads(step, p.cur_epoch_num, measured)
            self._look_at(step)
            return
        # On the host in one process: judged now, after the losses queued before it (the
        # chunk cut at this step), without a look of its own.
        if self._inflight:
            self._drain(self._run_context, block=False)
        alerts = self._detect_grads(step, p.cur_epoch_num, measured, None)
        self._grads_at(self._next_grads(step))
        if alerts:
            self._raise_all(alerts, self._run_context)
            self._set_alarm()

    def _next_grads(self, step: int) -> int:
        """The step of the measurement after the one at ``step`` (just judged): the next
        multiple of ``grad_every_n_steps``, where the losses are read too (one wake of the
        clock for both), or sooner while a detector confirms a sign or warms up."""
        every = self.grad_every_n_steps
        for detector in (self._vanishing, self._dying, self._saturation):
            if detector is not None and detector.confirming:
                return step + min(every, CONFIRM_EVERY)
        explosion = self._explosion
        if explosion is not None and explosion.warming_up:
            return step + min(every, WARM_EVERY)
        return (step // every + 1) * every

    def _grads_now(self) -> None:
        """Trouble in the loss: look at the gradients at the next step."""
        if self._stats is not None and self._view is not None:
            self._grads_at(self._view.step + 1)

    def _ship_grads(self, step: int, epoch: int, measured: torch.Tensor) -> None:
        """Queue one host transfer of a gradient measurement (non-blocking on CUDA)."""
        ready = None
        if measured.is_cuda:
            measured = measured.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        elif measured.is_cpu:
            measured = measured.clone()  # GradStats writes the next one into the same buffer
        self._inflight.append(("grad", step, epoch, measured, ready))

    def _detect_grads(self, step: int, epoch: int, host: torch.Tensor, ready: Any) -> list[Alert]:
        if ready is not None:
            ready.synchronize()
        if step <= self._undone or self._stats is None:
            return []
        total, norms, dead, saturated = self._stats.split(host)
        history = self._history
        history["grad_step"].append(step)
        history["grad_norm"].append(total)
        nonfinite = None
        if self._grad_nonfinite is not None and not self._scaled:
            nonfinite = self._grad_nonfinite.update(step, total, epoch)
            if self._nonfinite is not None and self._nonfinite.in_episode:
                nonfinite = None  # the same episode, raised from the loss already
        found = [nonfinite, self._explosion.update(step, total, epoch) if self._explosion else None]
        if math.isfinite(total):
            if self._vanishing is not None:
                found.append(self._vanishing.update(step, norms, epoch))
            if self._dying is not None:
                found.append(self._dying.update(step, dead, epoch=epoch))
            if self._saturation is not None and saturated:
                found.append(self._saturation.update(step, saturated, epoch))
        if self._view is not None and self._grad_due > step:  # judged after the next was set
            sooner = max(self._next_grads(step), self._view.step + 1)
            if sooner < self._grad_due:  # a sign to confirm
                self._grads_at(sooner)
        return [a for a in found if a is not None]

    # -- the training state and the first outputs ---------------------------------------------
    def _keep(self, step: int) -> None:
        keeper = self._keeper
        if keeper is None or self._view is None or self._run_context is None:
            return
        keeper.maybe_keep(step, self._run_context.cb_params)
        self._view.tap.call_at((step // keeper.every + 1) * keeper.every, self._keep)

    def _find_classes(self, step: int) -> None:
        """Once the first step's outputs are there: the number of classes of a
        CrossEntropyLoss/NLLLoss classifier, for the detectors that judge against chance."""
        if not self._want_classes or self._run_context is None or self._view is None:
            return
        p = self._run_context.cb_params
        outputs = p.get("outputs")
        if outputs is None and p.cur_step_num < 2:
            self._view.tap.call_at(step + 1, self._find_classes)
            return  # a loop may give outputs from its first step on; else none are given
        self._want_classes = False
        classes = classes_of(p.get("loss_fn"), outputs)
        for detector in self._classes_for:
            detector.classes = classes


def says_alarm(detector: Any) -> bool:
    """A built-in detector, or one of one's own that defines ``alarm()``."""
    own = getattr(type(detector), "alarm", None)
    return detector.kind in DETECTORS or (own is not None and own is not Detector.alarm)


def _no_alarm() -> float:
    return math.inf  # a detector of one's own without alarm(): only non-finite values
