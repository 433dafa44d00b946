"""``AnomalyMonitor``: diagnose training as it runs (NaN, loss spikes, divergence, plateaus,
exploding or vanishing gradients, dying ReLUs, overfitting) and act on what it finds; and
``TerminateOnNaN`` for Keras users."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..._tensor import stack_losses
from ..._validation import check_int, check_number
from ...distributed import rank_and_world, sum_across
from ...monitor import values as names
from ...monitor.detectors import (
    Alert,
    Detector,
    Divergence,
    DyingReLU,
    GradExplosion,
    GradVanishing,
    NonFinite,
    Overfitting,
    Plateau,
    Threshold,
    make_detectors,
)
from ._anomaly_actions import (
    GradStats,
    StateKeeper,
    check_actions,
    check_snapshot_dir,
    reduce_lr,
    write_snapshot,
)
from ._callback import ORDER_STEER, Callback, RunContext
from ._monitor import epoch_values

__all__ = ["AnomalyMonitor", "TerminateOnNaN"]

logger = logging.getLogger("stepwatch")
_D = TypeVar("_D", bound=Detector)

# Step losses move to the host in one transfer per this many sampled steps (and at each epoch's
# end): an alert is read at most this many steps after its step.
READ_EVERY = 8
# Kinds whose "stop" marks the run as gone wrong (saving callbacks keep the weights out);
# a plateau or overfitting stops a healthy model that is done.
_DONE_KINDS = frozenset({"plateau", "overfitting", "threshold"})
_STEP_NAMES = frozenset({names.LOSS, names.STEP_LOSS})


class AnomalyMonitor(Callback):
    """Watch the loss and the gradients for signs of trouble, tell the user what was seen and
    what to try, and act on it.

    The detectors (:mod:`stepwatch.monitor.detectors`) read values the loop already holds:
    every step's loss tensor, moved to the host in one transfer every few steps (so a
    non-sampled step never waits for the device), and gradient statistics measured on the
    device every ``grad_every_n_steps`` optimizer steps, and at the next step after the loss
    raised an alert (per-layer norms with one fused op, dead-unit fractions), read in the same
    transfer. Memory is bounded: every detector keeps
    a fixed window. Each detector fires **once per episode** of its condition.

    In a distributed run every rank watches the mean loss over the ranks (one all_reduce per
    transfer, every 8 steps) and the gradients (the same on every rank after DDP's
    all-reduce), so every rank raises the same alerts at the same step and takes the same
    action; rank 0 alone logs, records and writes snapshots.

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
      copy taken before the anomaly's step (copies are kept in memory every
      ``rollback_every`` steps, the newest two), and go on with the next batches: the batches
      between the copy and the alert are skipped. At most ``max_rollbacks`` per run; after
      that, or with no copy from before the anomaly, the action stops the run.
    - a callable ``fn(alert, run_context)``.

    Args:
        detectors: None for every detector but ``'threshold'`` at its defaults (right for most
            runs), a list of kinds, or a dict of kind -> options dict (or a detector
            instance): ``{'spike': {'z': 8}, 'plateau': {'patience': 2000}}``.
        action: one action for every kind, a list of actions run in order, or a dict of kind
            -> action(s) (kinds left out warn): ``{'nonfinite': 'stop', 'spike': 'rollback'}``.
        every_n_steps: look at every n-th step's loss (1: every step; a one-step spike between
            samples is not seen).
        snapshot_dir: the folder for ``'snapshot'`` (default ``./anomaly_snapshots``).
        grad_every_n_steps: optimizer steps between gradient measurements (default 25; the
            gradient detectors' patience counts measurements).
        max_rollbacks: rollbacks allowed in one run (default 3).
        rollback_every: steps between the in-memory copies kept for ``'rollback'`` (default
            50; kept only when some kind's action is ``'rollback'``).
        lr_factor: the factor of ``'reduce_lr'`` (default 0.5).
        window: steps of losses and measurements kept for snapshots (default 200).

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
        grad_every_n_steps: int = 25,
        max_rollbacks: int = 3,
        rollback_every: int = 50,
        lr_factor: float = 0.5,
        window: int = 200,
    ) -> None:
        self.detectors: list[Detector] = make_detectors(detectors)
        self._default_actions, self._kind_actions = check_actions(action)
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.snapshot_dir = check_snapshot_dir(snapshot_dir) or Path("anomaly_snapshots")
        self.grad_every_n_steps = check_int("grad_every_n_steps", grad_every_n_steps, minimum=1)
        self.max_rollbacks = check_int("max_rollbacks", max_rollbacks, minimum=0)
        self.rollback_every = check_int("rollback_every", rollback_every, minimum=1)
        self.lr_factor = check_number("lr_factor", lr_factor, minimum=0.0)
        if not 0.0 < self.lr_factor < 1.0:
            raise ValueError(f"'lr_factor' must be a number with 0 < x < 1, but got {lr_factor!r}.")
        self.window = check_int("window", window, minimum=1)
        self.alerts: list[Alert] = []
        self.outcomes: list[str] = []  # what the actions did, one entry per alert
        self.rollbacks = 0
        kinds = {d.kind for d in self.detectors}
        self._step_detectors = [
            d
            for d in self.detectors
            if d.kind in ("nonfinite", "spike", "divergence", "plateau")
            or (isinstance(d, Threshold) and d.name in _STEP_NAMES)
        ]
        self._epoch_thresholds = [
            d for d in self.detectors if isinstance(d, Threshold) and d.name not in _STEP_NAMES
        ]
        self._explosion = _first(self.detectors, GradExplosion)
        self._vanishing = _first(self.detectors, GradVanishing)
        self._dying = _first(self.detectors, DyingReLU)
        self._overfitting = _first(self.detectors, Overfitting)
        self._plateau = _first(self.detectors, Plateau)
        self._measures_grads = any((self._explosion, self._vanishing, self._dying))
        self._grad_nonfinite = NonFinite("gradient norm") if "nonfinite" in kinds else None
        every_action = [self._default_actions, *self._kind_actions.values()]
        self._keeps_state = any("rollback" in actions for actions in every_action)
        self._reset()

    def _reset(self) -> None:
        for detector in self.detectors:
            detector.reset()
        if self._grad_nonfinite is not None:
            self._grad_nonfinite.reset()
        self.alerts = []
        self.outcomes = []
        self.rollbacks = 0
        self._losses: list[Any] = []
        self._steps: list[int] = []
        self._lrs: list[float] = []  # the learning rate at each sampled step (for plateau)
        self._groups: Any = None
        self._grad: tuple[int, torch.Tensor] | None = None
        self._grad_due = 0
        self._inflight: deque[tuple[Any, ...]] = deque()
        self._stats: GradStats | None = None
        self._keeper = StateKeeper(self.rollback_every) if self._keeps_state else None
        self._scaled = False
        self._rank, self._world = 0, 1
        self._history: dict[str, deque[Any]] = {
            key: deque(maxlen=self.window) for key in ("step", "loss", "grad_step", "grad_norm")
        }

    # -- hooks ------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        self._reset()
        p = run_context.original_args()
        self._rank, self._world = rank_and_world()
        if self._measures_grads and p.get("train_network") is not None:
            self._stats = GradStats(p.train_network)
            for detector in (self._vanishing, self._dying):
                if detector is not None:
                    detector.names = self._stats.names
        optimizer = p.get("optimizer")
        if self._plateau is not None and optimizer is not None:
            self._groups = optimizer.param_groups
        # Under loss scaling an overflowing gradient is expected: the scaler skips that step.
        self._scaled = p.get("loss_scaler") is not None

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        step = p.cur_step_num
        if step % self.every_n_steps == 0:
            self._losses.append(p.loss_tensor)
            self._steps.append(step)
            if self._groups is not None:
                self._lrs.append(self._groups[0]["lr"])
        stats = self._stats
        if stats is not None and step >= self._grad_due and p.get("optimizer_stepped", True):
            measured = stats.measure()
            if measured is not None:
                self._grad = (step, measured)
                self._grad_due = step + self.grad_every_n_steps
        if self._keeper is not None:
            self._keeper.maybe_keep(step, p)
        if len(self._losses) >= READ_EVERY or self._grad is not None:
            self._ship(p)
        if self._inflight:
            self._drain(run_context, block=False)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        self._ship(p)
        self._drain(run_context, block=True)
        if self._overfitting is None and not self._epoch_thresholds:
            return
        values = epoch_values(p)
        step, epoch = p.cur_step_num, p.cur_epoch_num
        found: list[Alert | None] = []
        train, valid = values.get(names.LOSS), values.get(names.EVAL_LOSS)
        if self._overfitting is not None and train is not None and valid is not None:
            found.append(self._overfitting.update(step, train, valid, epoch=epoch))
        for detector in self._epoch_thresholds:
            if isinstance(values.get(detector.name), float):
                found.append(detector.update(step, values[detector.name], epoch=epoch))
        for alert in found:
            if alert is not None:
                self._raise(alert, run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        self._ship(run_context.original_args())
        self._drain(run_context, block=True)

    # -- reading values ---------------------------------------------------------------------
    def _ship(self, p: Any) -> None:
        """Queue one host transfer of the waiting losses and gradient measurement."""
        losses, steps, grad, lrs = self._losses, self._steps, self._grad, self._lrs
        if not losses and grad is None:
            return
        self._losses, self._steps, self._grad, self._lrs = [], [], None, []
        parts = []
        if losses:
            part = stack_losses(losses)
            if self._world > 1:  # every rank decides on the same numbers: the mean over ranks
                part = sum_across([part])[0].float().to(part.device) / self._world
            parts.append(part)
        if grad is not None:
            parts.append(grad[1].to(parts[0].device) if parts else grad[1])
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        ready = None
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        self._inflight.append(
            (p.cur_epoch_num, lrs, steps, grad[0] if grad else None, packed, ready)
        )

    def _drain(self, run_context: RunContext, block: bool) -> None:
        while self._inflight:
            epoch, lrs, steps, grad_step, packed, ready = self._inflight[0]
            # ranks must act at the same step: in a distributed run, wait for the values
            if ready is not None and not block and self._world == 1 and not ready.query():
                return
            self._inflight.popleft()
            if ready is not None:
                ready.synchronize()
            values = packed.tolist()
            alerts = self._detect(epoch, steps, grad_step, values, lrs)
            rollbacks = self.rollbacks
            for alert in sorted(alerts, key=lambda a: a.step):
                # after a rollback, what the same batch still holds came from the undone steps
                self._raise(alert, run_context, act=self.rollbacks == rollbacks)

    def _detect(
        self, epoch: int, steps: list[int], grad_step: int | None, values: list[float],
        lrs: list[float],
    ) -> list[Alert]:  # fmt: skip
        n = len(steps)
        losses = values[:n]
        alerts: list[Alert] = []
        history = self._history
        if n:
            history["step"].extend(steps)
            history["loss"].extend(losses)
            for detector in self._step_detectors:
                if detector is self._plateau:
                    alerts.extend(self._plateau.update_many(steps, losses, epoch, lrs or None))
                else:
                    alerts.extend(detector.update_many(steps, losses, epoch))
            if alerts:
                self._grad_due = 0  # trouble in the loss: look at the gradients at once
        if grad_step is not None and self._stats is not None:
            total, norms, dead = self._stats.split(values[n:])
            history["grad_step"].append(grad_step)
            history["grad_norm"].append(total)
            found = [
                self._grad_nonfinite.update(grad_step, total, epoch)
                if self._grad_nonfinite is not None and not self._scaled
                else None,
                self._explosion.update(grad_step, total, epoch) if self._explosion else None,
            ]
            if math.isfinite(total):
                if self._vanishing is not None:
                    found.append(self._vanishing.update(grad_step, norms, epoch))
                if self._dying is not None:
                    found.append(self._dying.update(grad_step, dead, epoch=epoch))
            alerts.extend(a for a in found if a is not None)
        return alerts

    # -- acting -----------------------------------------------------------------------------
    def _raise(self, alert: Alert, run_context: RunContext, act: bool = True) -> None:
        self.alerts.append(alert)
        actions = self._kind_actions.get(alert.kind, self._default_actions)
        if act:
            done = [self._act(action, alert, run_context) for action in actions]
        else:
            done = ["no action: its steps were rolled back"]
        did = "; ".join(d for d in done if d)
        self.outcomes.append(did)
        p = run_context.original_args()
        if p.get("rank_id", 0) == 0:
            logger.warning("%s%s", alert.message, f" [{did}]" if did else "")
        writer = _recorder_writer(p)
        if writer is not None:
            data = {"kind": alert.kind, "value": alert.value, "actions": done}
            text = alert.message.removeprefix(f"step {alert.step}: ")  # the event has the step
            writer.event("alert", text, alert.step, alert.epoch, "warning", data)

    def _act(self, action: str | Callable[..., Any], alert: Alert, run_context: RunContext) -> str:
        p = run_context.original_args()
        if callable(action):
            action(alert, run_context)
            return f"called {getattr(action, '__name__', type(action).__name__)}"
        if action == "warn":
            return ""
        if action == "stop":
            return self._stop(alert, run_context)
        if action == "reduce_lr":
            rates = reduce_lr(p, self.lr_factor)
            return f"learning rate reduced to {rates[0]:g}" if rates else "no optimizer"
        if action == "snapshot":
            if self._rank != 0:
                return "snapshot written by rank 0"
            window = {k: list(v) for k, v in self._history.items()}
            try:
                path = write_snapshot(self.snapshot_dir, alert, p, window)
            except OSError as exc:
                return f"snapshot failed: {exc}"
            return f"snapshot written to {path}"
        return self._rollback(alert, run_context)

    def _stop(self, alert: Alert, run_context: RunContext) -> str:
        if alert.kind in _DONE_KINDS:
            run_context.request_stop(f"{alert.kind} at step {alert.step}")
        else:
            run_context.request_stop(f"{alert.kind} at step {alert.step}", kind="anomaly")
        return "stopping training"

    def _rollback(self, alert: Alert, run_context: RunContext) -> str:
        if self.rollbacks >= self.max_rollbacks:
            return (
                f"rollback limit ({self.max_rollbacks}) reached, {self._stop(alert, run_context)}"
            )
        p = run_context.original_args()
        assert self._keeper is not None
        at = self._keeper.restore_before(alert.step, p)
        if at is None:
            stopping = self._stop(alert, run_context)
            return f"no state from before step {alert.step} to roll back to, {stopping}"
        self.rollbacks += 1
        # What is still waiting to be read came from the undone steps.
        self._losses, self._steps, self._grad, self._lrs = [], [], None, []
        self._inflight.clear()
        for detector in self._step_detectors:
            if isinstance(detector, Divergence):
                detector.restart_level()
        now = p.cur_step_num
        return (
            f"rolled back to step {at} ({self.rollbacks} of {self.max_rollbacks}); "
            f"the batches of steps {at + 1}-{now} are skipped"
        )


def _first(detectors: list[Detector], cls: type[_D]) -> _D | None:
    return next((d for d in detectors if isinstance(d, cls) and d.kind == cls.kind), None)


def _recorder_writer(p: Any) -> Any:
    """The run store writer of a RunRecorder in this run, if any."""
    callbacks = getattr(p.get("list_callback"), "callbacks", ())
    for callback in callbacks:
        writer = getattr(callback, "writer", None)
        if writer is not None and hasattr(writer, "event"):
            return writer
    return None


class TerminateOnNaN(AnomalyMonitor):
    """Stop training when the loss becomes NaN or infinite (Keras' ``TerminateOnNaN``).

    The run stops with kind ``'anomaly'`` (ModelCheckpoint does not save NaN weights) a few
    steps after the first non-finite loss at most: losses are read in batches, so that the
    check costs no device sync per step.
    """

    def __init__(self) -> None:
        super().__init__(detectors=["nonfinite"], action="stop")
