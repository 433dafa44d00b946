"""``AnomalyMonitor``: diagnose training as it runs (NaN, loss spikes, divergence, plateaus,
exploding or vanishing gradients, dying ReLUs, overfitting) and act on what it finds
(``TerminateOnNaN``, for Keras users, is in :mod:`.terminate_on_nan`)."""

from __future__ import annotations

import bisect
import math
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ..._validation import check_int, check_number
from ...distributed import sum_across
from ...monitor import values as names
from ...monitor.detector_specs import make_detectors
from ...monitor.detectors import (
    DETECTORS,
    Alert,
    Detector,
    LrNegligible,
    NonFinite,
    Overfitting,
    Plateau,
    Saturation,
    Threshold,
    WorseThanChance,
)
from ...view.run import RunView, view_of
from ...view.tap import Chunk
from ..serialization import remove_stale_temporaries
from ._anomaly_actions import Actions, check_snapshot_dir
from ._anomaly_clock import READ_EVERY, Clock, Looks, says_alarm
from ._anomaly_grads import GradientWatch
from ._callback import ORDER_STEER, Callback, RunContext

__all__ = ["AnomalyMonitor"]

_D = TypeVar("_D", bound=Detector)

_STEP_NAMES = frozenset({names.LOSS, names.STEP_LOSS})
# The trend detectors are fed every this many steps (and at each epoch's end, and with a value
# over the tap's alarm).
SLOW_EVERY = 128
_SLOW_KINDS = frozenset({"plateau", "not_learning", "lr_negligible", "recurring_batch"})
_LOSS_KINDS = frozenset(
    {
        "nonfinite",
        "spike",
        "divergence",
        "plateau",
        "not_learning",
        "lr_negligible",
        "recurring_batch",
    }
)


class AnomalyMonitor(Callback):
    """Watch the loss and the gradients for signs of trouble, tell the user what was seen and
    what to try, and act on it.

    The detectors (:mod:`stepwatch.monitor.detectors`) read values the loop already holds:
    every step's loss, from the run's loss tap, and gradient statistics measured on the device
    every ``grad_every_n_steps`` steps, on a CPU run at the steps where the losses are read
    (every 5 while a gradient detector confirms what it saw), and at the next step after the
    loss raised an alert (per-row norms with one op a layer, dead-unit fractions), read in the same
    transfer. The monitor has no step hook: it looks at the run on the tap's step clock, so
    a step with nothing due runs none of its code. Losses on an accelerator are moved to the
    host in one transfer every 8 steps (a step never waits for the device); losses that the
    host reads as they come (a CPU run of one process) are read every 128 steps once the
    detectors are warm, and a value that could fire the NaN, spike, divergence or threshold
    detectors is handed over on its own step (the tap's alarm: one comparison a step). The
    trend detectors (plateau, not learning, negligible learning rate, recurring batch) read
    every 128 steps, and at once when a batch that was an outlier at the same place in the
    last epochs could fire the recurring batch. Memory is bounded: every detector keeps a
    fixed window. Each detector fires **once per episode** of its condition. The kinds:
    ``nonfinite``, ``spike``, ``divergence``, ``plateau``, ``not_learning``, ``lr_negligible``,
    ``recurring_batch`` (on the step losses), ``grad_explosion``, ``grad_vanishing``,
    ``dying_relu``, ``saturation`` (on the sampled steps' gradients and activations),
    ``worse_than_chance``, ``overfitting`` and ``threshold`` (on the epoch values).

    In a distributed run every rank watches the mean loss over the ranks and the gradient
    statistics of the full model: under DDP, and under FSDP2 (``fully_shard``, where each
    rank holds shards of the gradients) the per-layer norms are those of the full tensors and
    the global norm is ``clip_grad_norm_``'s. Both are summed over the ranks in ONE all_reduce
    per look (every 8 steps, and at a gradient measurement between them); a step with nothing
    to read issues none. A NaN or inf on any rank is one in the sum, so every rank sees the
    same numbers, raises the same alerts at the same step and takes the same action (a
    rollback restores each rank's own state, shards included); rank 0 alone logs, records
    and writes snapshots.

    Where the trainer computes the step's global gradient norm before clipping
    (``cb_params.grad_norm``: ``Model`` with ``clip_grad_norm``, the Hugging Face Trainer
    through its bridge), the explosion and non-finite gradient detectors judge that norm,
    packed with the measurement (no collective of its own), rather than the norm of the
    clipped gradients, which never exceeds the clipping bound.

    Each alert is an :class:`~stepwatch.monitor.detectors.Alert` (``step`` is the step where
    the anomaly happened, even when it is read a few steps later). It is appended to
    :attr:`alerts`, logged once (logger ``'stepwatch'``, level WARNING) with what was seen,
    what to try and what the action did, written as an ``alert`` event when a
    :class:`~stepwatch.store.RunRecorder` is in the run, and handed to its action(s):

    - ``'warn'``: nothing more.
    - ``'stop'``: stop training after the current step (for a NaN, spike, divergence or bad
      gradients the stop kind is ``'anomaly'``: ModelCheckpoint does not save the weights).
    - ``'snapshot'``: write a resumable checkpoint of the run as it is, plus the alert and the
      recent window of step losses and gradient statistics as JSON, into ``snapshot_dir``.
    - ``'reduce_lr'``: multiply every learning rate by ``lr_factor``.
    - ``'rollback'``: restore the network, optimizer, LR schedule and loss scale to the newest
      copy taken before the anomaly's step (copies are kept in memory after the first step
      and every ``rollback_every`` steps, the newest ``min(max_rollbacks, 3) + 1``), and go on
      with the next batches: the batches between the copy and the alert are skipped. When
      the same kind of alert comes back, the copy was already bad: the next rollback goes to
      an older one. At most ``max_rollbacks`` per run; after that, or with no copy left to
      try, the action stops the run. An alert read as the run ends (its last steps are
      judged before its status is written) is not rolled back: no step is left to go on
      from, and the outcome says so.
    - a callable ``fn(alert, run_context)``.

    Args:
        detectors: None for every detector but ``'threshold'`` at its defaults (right for most
            runs), a list of kinds, or a dict of kind -> options dict (or a detector
            instance): ``{'spike': {'z': 8}, 'plateau': {'patience': 2000}}``. A detector of
            your own (an object with a ``kind``, ``reset()`` and ``update_many(steps, losses,
            epoch)`` returning alerts, e.g. a :class:`~stepwatch.monitor.detectors.Detector`
            subclass) goes in the list; it is fed every step loss, every 8 steps (or, when it
            defines ``alarm()``, the smallest value that could fire it now, as the built-in
            ones read them), and its alerts are logged, stored and acted on like the built-in
            ones (its kind can key ``action``).
        action: one action for every kind, a list of actions run in order, or a dict of kind
            -> action(s) (kinds left out warn): ``{'nonfinite': 'stop', 'spike': 'rollback'}``.
        every_n_steps: look at every n-th step's loss (1: every step; a one-step spike between
            samples is not seen).
        snapshot_dir: the folder for ``'snapshot'`` (default ``./anomaly_snapshots``).
        grad_every_n_steps: the gradients are measured at the multiples of this step
            (default 128: on a CPU run, the steps where the losses are read, so one wake of
            the run's clock does both). The gradient detectors' patience counts
            measurements; while one of them has seen its condition but not yet for its whole
            patience, they come every 5 steps, and every 10 until the explosion detector has
            its first 5 norms.
        max_rollbacks: rollbacks allowed in one run (default 3).
        rollback_every: steps between the in-memory copies kept for ``'rollback'`` (default
            50; kept only when some kind's action is ``'rollback'``).
        lr_factor: the factor of ``'reduce_lr'`` (default 0.5).
        window: steps of losses and measurements kept for snapshots (default 200).
        max_alerts: alerts (and outcomes) kept in :attr:`alerts` / :attr:`outcomes`, the
            newest (default 1000; the run store keeps every one).

    Raises:
        ValueError: an unknown detector kind or action name, a negative or zero window or
            interval, ``lr_factor`` outside (0, 1), ``snapshot_dir`` naming a file.
        TypeError: an argument of the wrong type (a non-callable, non-str action, ...).
    """

    order = ORDER_STEER

    def __init__(
        self,
        detectors: Any = None,
        action: Any = "warn",
        every_n_steps: int = 1,
        snapshot_dir: str | Path | None = None,
        *,
        grad_every_n_steps: int = 128,
        max_rollbacks: int = 3,
        rollback_every: int = 50,
        lr_factor: float = 0.5,
        window: int = 200,
        max_alerts: int = 1000,
    ) -> None:
        self.detectors: list[Detector] = make_detectors(detectors)
        own = [d.kind for d in self.detectors if d.kind not in DETECTORS]
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.snapshot_dir = check_snapshot_dir(snapshot_dir) or Path("anomaly_snapshots")
        self.grad_every_n_steps = check_int("grad_every_n_steps", grad_every_n_steps, minimum=1)
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, minimum=0)
        self.rollback_every = check_int("rollback_every", rollback_every, minimum=1)
        self.lr_factor = check_number("lr_factor", lr_factor, minimum=0.0)
        if not 0.0 < self.lr_factor < 1.0:
            raise ValueError(f"'lr_factor' must be a number with 0 < x < 1, but got {lr_factor!r}.")
        self.window = check_int("window", window, minimum=1)
        self.max_alerts = check_int("max_alerts", max_alerts, minimum=1)
        kinds = {d.kind for d in self.detectors}
        # The loss detectors, a user's own detectors among them: fed every step loss.
        self._step_detectors = [
            d
            for d in self.detectors
            if d.kind in _LOSS_KINDS
            or d.kind not in DETECTORS
            or (isinstance(d, Threshold) and d.name in _STEP_NAMES)
        ]
        # Read every chunk (the sudden kinds, a user's own); the trend kinds every SLOW_EVERY
        # steps, in one call: a plateau or a run that does not learn shows over hundreds.
        self._slow = [d for d in self._step_detectors if d.kind in _SLOW_KINDS]
        self._fast = [d for d in self._step_detectors if d.kind not in _SLOW_KINDS]
        # the trend detectors that may ask to see a value on its step (the recurring batch's
        # next time)
        self._slow_alarms = [d for d in self._slow if type(d).alarm is not Detector.alarm]
        self._epoch_thresholds = [
            d for d in self.detectors if isinstance(d, Threshold) and d.name not in _STEP_NAMES
        ]
        self._overfitting = _first(self.detectors, Overfitting)
        self._plateau = _first(self.detectors, Plateau)
        self._lr_low = _first(self.detectors, LrNegligible)
        self._saturation = _first(self.detectors, Saturation)
        self._chance = _first(self.detectors, WorseThanChance)
        self._nonfinite = _first(self.detectors, NonFinite)  # the loss's
        # the detectors that judge a loss against ln(classes), with no classes given
        self._classes_for: list[Any] = [
            d for d in self.detectors if getattr(d, "classes", 0) is None
        ]
        # The collaborators: when it looks, what it measures of the gradients, what it does.
        self._clock = Clock(self.grad_every_n_steps)
        self._grads = GradientWatch(self.detectors, self.window, "nonfinite" in kinds)
        self._actions = Actions(
            action,
            [*DETECTORS, *own],
            lr_factor=self.lr_factor,
            snapshot_dir=self.snapshot_dir,
            max_alerts=self.max_alerts,
            max_rollbacks=self.max_rollbacks,
            rollback_every=self.rollback_every,
            source=type(self).__name__,
        )
        self._warned_eval = False
        self._reset()

    @property
    def measures_gradients(self) -> bool:
        """True when a gradient detector is on (the run must give the network)."""
        return self._grads.wanted

    @property
    def needs_optimizer(self) -> str:
        """Why a run must give the optimizer ('' when it need not): its actions that change it."""
        acts = self._actions.changes_optimizer
        return f"its {' and '.join(map(repr, acts))} action{'s' * (len(acts) > 1)}" if acts else ""

    @property
    def handles_nonfinite(self) -> bool:
        """True when a non-finite loss is this monitor's to act on (LossMonitor leaves it)."""
        return any(d.kind == "nonfinite" for d in self.detectors)

    @property
    def alerts(self) -> list[Alert]:
        """The newest ``max_alerts`` alerts of the run, oldest first."""
        return self._actions.alerts

    @property
    def outcomes(self) -> list[str]:
        """What the actions did, one entry per alert in :attr:`alerts`."""
        return self._actions.outcomes

    @property
    def rollbacks(self) -> int:
        """Rollbacks done in the run (the run's record: ``run.rollbacks``)."""
        return self._actions.rollback.count

    @property
    def _history(self) -> dict[str, deque[Any]]:
        """The recent gradient measurements (``grad_step``, ``grad_norm``)."""
        return self._grads.history

    def _reset(self) -> None:
        for detector in self.detectors:
            detector.reset()
        self._clock.reset()
        self._grads.reset()
        self._actions.reset()
        self._view: RunView | None = None
        self._run_context: RunContext | None = None
        self._thresholds_seen: set[str] = set()
        self._last_values: set[str] = set()
        self._warned_names: set[str] = set()
        self._lr_handle: Any = None
        self._lr_changes: list[tuple[int, float]] = []  # (first step, rate), for plateau
        # What waits to be read, in order: ("loss", chunk) and ("grad", step, epoch, host,
        # ready); in a distributed run, the chunks of the block not yet reduced across ranks
        # and this rank's share of a gradient measurement not yet summed over them.
        self._inflight: deque[tuple[Any, ...]] = deque()
        self._block: list[Chunk] = []
        self._shares: tuple[int, int, torch.Tensor] | None = None
        # [steps, losses, epoch] not yet shown to the trend detectors, and how many steps
        self._slow_wait: list[list[Any]] = []
        self._slow_count = 0
        self._slow_now = False  # a value over the alarm came: the trend detectors see it now
        self._undone = 0  # steps up to here were rolled back: their values are not read
        self._want_classes = False
        self._world = 1
        # the last chunks' (steps, losses), at least `window` values (a snapshot's window)
        self._loss_window: deque[tuple[Sequence[int], Sequence[float]]] = deque(maxlen=self.window)

    # -- hooks ------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        self._reset()
        p = run_context.original_args()
        view = self._view = view_of(p)
        self._world = view.world
        # under loss scaling an overflowing gradient is expected: the scaler skips that step
        self._grads.begin(p.get("train_network"), view, scaled=p.get("loss_scaler") is not None)
        total = view.epochs * view.steps_per_epoch
        for each in self.detectors:
            if hasattr(each, "total_steps"):
                each.total_steps = total or None
            if hasattr(each, "steps_per_epoch"):
                each.steps_per_epoch = view.steps_per_epoch or None
        self._want_classes = bool(self._classes_for)
        self._actions.begin(view, self._snapshot_window, self._rolled_back)
        if (self._plateau or self._lr_low) is not None:
            self._lr_handle = view.rates
        if view.rank == 0 and self.snapshot_dir.is_dir():
            remove_stale_temporaries(self.snapshot_dir, "anomaly-")  # a killed snapshot write
        self._run_context = run_context
        keeper = self._actions.rollback.keeper
        self._clock.start(
            view,
            Looks(
                self._take, self._look, self._measure, self._grads.arm, self._keep, self._classes
            ),
            grads=self._grads.measuring,
            arms=self._grads.acts is not None,
            keep_every=keeper.every if keeper is not None else 0,
            classes=self._want_classes,
            may_alarm=all(map(says_alarm, self._fast)),
        )
        evals = [d.name for d in self._epoch_thresholds if d.name.startswith("eval_")]
        self._warned_names = set(evals) if not view.validates else set()
        if evals and not view.validates and view.rank == 0:
            warnings.warn(
                f"AnomalyMonitor: a threshold on {', '.join(map(repr, evals))} in a run that "
                "does not validate never fires; use fit(..., valid_dataset) or watch a "
                "training value.",
                UserWarning,
                stacklevel=2,
            )

    def on_eval_begin(self, run_context: RunContext) -> None:
        if self._view is None and not self._warned_eval:
            self._warned_eval = True  # Model.eval on its own: nothing trains
            warnings.warn(
                "AnomalyMonitor watches training; passed to Model.eval it does nothing. Pass "
                "it to train/fit.",
                UserWarning,
                stacklevel=2,
            )

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        planned = self._view.epochs if self._view is not None else 0
        self._actions.ending = bool(planned) and p.cur_epoch_num >= planned  # the last epoch
        self._read_all(run_context)
        if self._overfitting is None and self._chance is None and not self._epoch_thresholds:
            return
        assert self._view is not None
        values = self._view.numbers()
        self._last_values = set(values)
        step, epoch = p.cur_step_num, p.cur_epoch_num
        found: list[Alert | None] = []
        train, valid = values.get(names.LOSS), values.get(names.EVAL_LOSS)
        if self._chance is not None and train is not None:
            found.append(self._chance.update(step, train, epoch=epoch))
        if self._overfitting is not None and train is not None and valid is not None:
            found.append(self._overfitting.update(step, train, valid, epoch=epoch))
        for detector in self._epoch_thresholds:
            if isinstance(values.get(detector.name), float):
                self._thresholds_seen.add(detector.name)
                found.append(detector.update(step, values[detector.name], epoch=epoch))
        for alert in found:
            if alert is not None:
                self._actions.raise_(alert, run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        # every step is judged before the run's status is written (the recorders come after
        # this monitor): the last partial batch of steps too, its alerts acted on - but no
        # step is left to go on from, so a rollback says it cannot be done
        self._actions.ending = True
        self._read_all(run_context)
        never = sorted(
            {d.name for d in self._epoch_thresholds} - self._thresholds_seen - self._warned_names
        )
        first = self._view is not None and self._view.rank == 0
        if never and run_context.cb_params.cur_epoch_num > 0 and first:
            warnings.warn(
                f"AnomalyMonitor: the threshold on {', '.join(map(repr, never))} never saw its "
                f"value (this run's epoch values: {', '.join(sorted(self._last_values)) or 'none'}"
                "); check the name.",
                UserWarning,
                stacklevel=2,
            )
        self._clock.stop()  # its chunks and its calls
        self._grads.disarm()  # no hook left on the network

    def __exit__(self, *err: Any) -> None:
        self._clock.stop()
        self._view = None
        self._run_context = None
        self._actions.end()
        self._grads.disarm()
        self._inflight.clear()  # no device tensors kept alive after the run
        self._block = []
        self._shares = None

    # -- what the clock asks for ------------------------------------------------------------
    def _take(self, chunk: Chunk) -> None:
        """A chunk of step losses from the tap: queue it, and look at it at its last step."""
        self._note_lr(chunk.steps[-1])
        if self._world > 1:
            self._block.append(chunk)  # reduced across ranks at the block's end
        else:
            self._inflight.append(("loss", chunk))
        self._clock.look_at(chunk.steps[-1])

    def _look(self, step: int) -> None:
        """Read what waits at ``step``."""
        if self._world > 1:
            self._reduce(self._block_due())  # every rank reduces the same values at this step
        if self._inflight and self._run_context is not None:
            self._drain(self._run_context, block=False)
            if self._inflight:  # a copy still on its way (CUDA): look again at the next step
                self._clock.look_at(step + 1)

    def _measure(self, step: int) -> None:
        """Measure the gradients at ``step``, and judge them (in one process on the CPU) or
        queue them to be judged at this step's look."""
        if self._run_context is None or not self._grads.measuring:
            return
        p = self._run_context.cb_params
        measured = None
        if p.get("optimizer_stepped", True):
            measured = self._grads.measure(p.get("grad_norm"))
        if measured is None:  # mid accumulation window, or no gradient yet: the next step
            self._clock.grads_at(step + 1)
            return
        self._note_lr(step)
        if self._world > 1:
            # this rank's share, summed over the ranks at this step's look (one all_reduce)
            self._clock.grads_at(self._next_grads(step))
            self._shares = (step, p.cur_epoch_num, measured)
            self._clock.look_at(step)
            return
        if not measured.is_cpu:
            self._clock.grads_at(self._next_grads(step))  # sooner once judged, if it shows a sign
            self._ship_grads(step, p.cur_epoch_num, measured)
            self._clock.look_at(step)
            return
        # On the host in one process: judged now, after the losses queued before it (the
        # chunk cut at this step), without a look of its own.
        if self._inflight:
            self._drain(self._run_context, block=False)
        alerts = self._detect_grads(step, p.cur_epoch_num, measured, None)
        self._clock.grads_at(self._next_grads(step))
        if alerts:
            self._raise_all(alerts, self._run_context)
            self._set_alarm()

    def _next_grads(self, step: int) -> int:
        return self._clock.next_grads(step, self._grads.confirming, self._grads.warming_up)

    def _keep(self, step: int) -> None:
        self._actions.rollback.keep(step)

    def _classes(self, step: int) -> bool:
        """Once the first step's outputs are there: the number of classes of a
        CrossEntropyLoss/NLLLoss classifier, for the detectors that judge against chance
        (False: ask again at the next step)."""
        if not self._want_classes or self._run_context is None:
            return True
        p = self._run_context.cb_params
        outputs = p.get("outputs")
        if outputs is None and p.cur_step_num < 2:
            return False  # a loop may give outputs from its first step on; else none are given
        self._want_classes = False
        classes = classes_of(p.get("loss_fn"), outputs)
        for detector in self._classes_for:
            detector.classes = classes
        return True

    # -- reading values ---------------------------------------------------------------------
    def _read_all(self, run_context: RunContext) -> None:
        """Read everything the tap holds (an epoch's end, the run's end), waiting for it."""
        assert self._view is not None
        self._view.tap.cut()
        if self._world > 1:
            self._reduce(True)
        self._drain(run_context, block=True)

    def _block_due(self) -> bool:
        return bool(self._block) and self._block[-1].steps[-1] % READ_EVERY == 0

    def _reduce(self, losses: bool) -> None:
        """Distributed: sum what waits over the ranks in ONE all_reduce: the block's losses
        (when ``losses``; averaged over the ranks) and this rank's share of a gradient
        measurement (made whole: the full model's norms). Every rank cuts the same chunks
        and measures at the same steps, so every rank reduces the same values at the same
        step, and every detector sees the same numbers on every rank: every decision is the
        same on every rank. A NaN or inf on one rank is one in the sum."""
        block = self._block if losses else []
        shares, self._shares = self._shares, None
        if not block and shares is None:
            return
        if losses:
            self._block = []
        values: list[torch.Tensor] = []
        if block:
            values.append(
                torch.cat([c.device for c in block]) if len(block) > 1 else block[0].device
            )
        if shares is not None:
            values.append(shares[2])
        summed = sum_across(values)
        if shares is not None:
            step, epoch, _ = shares
            assert self._grads.stats is not None
            self._inflight.append(("grad", step, epoch, self._grads.stats.finish(summed[-1]), None))
        if block:
            mean = summed[0].float().to(values[0].device) / self._world
            steps = range(block[0].steps.start, block[-1].steps.stop)
            self._inflight.append(("loss", Chunk(steps, block[-1].epoch, mean, None, None, (0, 0))))

    def _drain(self, run_context: RunContext, block: bool) -> None:
        inflight = self._inflight
        changed = False  # what the loss detectors must see at once may have moved
        while inflight:
            item = inflight[0]
            ready = item[1].ready if item[0] == "loss" else item[4]
            # ranks must act at the same step: in a distributed run, wait for the values
            if ready is not None and not block and self._world == 1 and not ready.query():
                return
            inflight.popleft()
            if item[0] == "loss":
                alerts = self._detect_losses(item[1])
                changed = True
            else:
                alerts = self._detect_grads(item[1], item[2], item[3], item[4])
            self._raise_all(alerts, run_context)
            changed = changed or bool(alerts)
        if self._slow_count >= SLOW_EVERY or ((block or self._slow_now) and self._slow_count):
            self._raise_all(self._feed_slow(), run_context)
        if changed:
            self._set_alarm()  # after the actions: a rollback restarts what detectors watch

    def _raise_all(self, alerts: list[Alert], run_context: RunContext) -> None:
        rollbacks = self.rollbacks
        for alert in sorted(alerts, key=lambda a: a.step):
            # after a rollback, what the same batch still holds came from the undone steps
            self._actions.raise_(alert, run_context, act=self.rollbacks == rollbacks)

    def _rolled_back(self, step: int) -> None:
        """A rollback at ``step``: what is still waiting to be read came from the undone
        steps, and the restored state is judged afresh (the same kind may fire again)."""
        self._undone = step
        self._inflight.clear()
        self._block = []
        self._shares = None
        self._slow_wait, self._slow_count = [], 0
        for detector in self.detectors:
            restart = getattr(detector, "restart_level", None)
            if restart is not None:
                restart()

    def _snapshot_window(self) -> dict[str, list[Any]]:
        """The recent values a snapshot keeps: the last ``window`` step losses and gradient
        norms, with their steps."""
        steps: list[int] = []
        losses: list[float] = []
        for chunk_steps, chunk_losses in self._loss_window:
            steps.extend(chunk_steps)
            losses.extend(chunk_losses)
        window: dict[str, list[Any]] = {"step": steps[-self.window :]}
        window["loss"] = losses[-self.window :]
        return window | {k: list(v) for k, v in self._grads.history.items()}

    # -- the losses -------------------------------------------------------------------------
    def _note_lr(self, step: int) -> None:
        """The rate as of ``step`` (read at each chunk and each gradient measurement), for the
        detectors that judge the learning rate."""
        rates = self._lr_handle
        if rates is not None:
            lr = rates.get()[0]
            changes = self._lr_changes
            if not changes or changes[-1][1] != lr:
                changes.append((step, lr))

    def _rates(self, steps: Sequence[int]) -> list[float] | None:
        """The learning rate at each of ``steps`` (from the recorded change points)."""
        changes = self._lr_changes
        if not changes:
            return None
        if len(changes) == 1:
            return [changes[0][1]] * len(steps)
        starts = [s for s, _ in changes]
        return [changes[max(0, bisect.bisect_right(starts, s) - 1)][1] for s in steps]

    def _set_alarm(self) -> None:
        self._clock.retune(self._alarm_level)

    def _alarm_level(self) -> tuple[float, bool]:
        """The smallest loss that could fire a detector fed each batch (or a trend detector
        waiting for a value) among those that can say, and whether all of them can."""
        levels = [getattr(d, "alarm", _no_alarm)() for d in self._fast]
        known = [level for level in levels if level is not None]
        level = min(known, default=math.inf)
        for detector in self._slow_alarms:  # a trend detector waiting for a value
            wants = detector.alarm()
            if wants is not None and wants < level:
                level = wants
        return level, len(known) == len(levels)

    def _feed_slow(self) -> list[Alert]:
        """The trend detectors' share: every step loss since they last looked, in one call
        per epoch."""
        waiting, self._slow_wait, self._slow_count = self._slow_wait, [], 0
        self._slow_now = False
        alerts: list[Alert] = []
        for steps, losses, epoch in waiting:
            lrs = self._rates(steps) if self._lr_handle is not None else None
            for detector in self._slow:
                if detector is self._plateau or detector is self._lr_low:
                    alerts.extend(detector.update_many(steps, losses, epoch, lrs))
                else:
                    alerts.extend(detector.update_many(steps, losses, epoch))
        return alerts

    def _detect_losses(self, chunk: Chunk) -> list[Alert]:
        steps, losses = chunk.steps, chunk.values()
        if steps.start <= self._undone:  # rolled back: only the steps after it count
            keep = max(0, self._undone + 1 - steps.start)
            steps, losses = steps[keep:], losses[keep:]
        if self.every_n_steps > 1:
            skip = -steps.start % self.every_n_steps
            steps, losses = steps[skip :: self.every_n_steps], losses[skip :: self.every_n_steps]
        if not steps:
            return []
        epoch = chunk.epoch
        self._loss_window.append((steps, losses))  # (shared, never modified: see Chunk)
        alerts: list[Alert] = []
        if self._chance is not None and self._chance.start is None:
            self._chance.see_start(losses)
        grads_said = self._grads.in_nonfinite_episode
        for detector in self._fast:
            found = detector.update_many(steps, losses, epoch)
            if found and detector is self._nonfinite and grads_said:
                found = [a for a in found if a.kind != "nonfinite"]  # the gradients' said it
            alerts.extend(found)
        if self._slow:
            if not losses[-1] <= self._clock.level:
                self._slow_now = True  # the tap's alarm cut this chunk
            waiting = self._slow_wait
            last = waiting[-1] if waiting else None
            if last is not None and last[2] == epoch:
                before, by = last[0], steps.step
                if type(before) is range and before.step == by and before.stop == steps.start:
                    last[0] = range(before.start, steps.stop, by)  # (no int objects made)
                else:
                    last[0] = [*before, *steps]
                last[1].extend(losses)
            else:
                waiting.append([steps, [*losses], epoch])
            self._slow_count += len(steps)
        if alerts and self._grads.measuring:
            self._clock.grads_now()  # trouble in the loss: look at the gradients at once
        return alerts

    # -- the gradients ----------------------------------------------------------------------
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
        if step <= self._undone or not self._grads.measuring:
            return []
        if not host.is_cpu:
            host = host.cpu()
        alerts = self._grads.judge(step, epoch, host, self._nonfinite)
        # judged after the next measurement was set: sooner if it shows a sign to confirm
        self._clock.sooner(step, self._grads.confirming, self._grads.warming_up)
        return alerts


def _first(detectors: list[Detector], cls: type[_D]) -> _D | None:
    return next((d for d in detectors if isinstance(d, cls) and d.kind == cls.kind), None)


def classes_of(loss_fn: Any, outputs: Any) -> int | None:
    """The number of classes of a CrossEntropyLoss/NLLLoss classifier (the outputs' width),
    or None for another loss or unknown outputs."""
    if not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return None
    if not isinstance(outputs, torch.Tensor) or outputs.ndim < 2:
        return None
    classes = int(outputs.shape[1])
    return classes if classes >= 2 else None


def _no_alarm() -> float:
    return math.inf  # a detector of one's own without alarm(): only non-finite values
