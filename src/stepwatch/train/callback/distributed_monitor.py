"""``DistributedMonitor``: compare the ranks of a data-parallel run every N steps, in one
collective: loss, step time, data wait, and whether the replicas are still in step."""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any

import torch

from ..._validation import check_int, check_number
from ...distributed import RankWatch, all_gather_rows
from ...monitor.detectors import Alert
from ...view.run import view_of
from ._callback import Callback, RunContext

__all__ = ["DistributedMonitor"]

logger = logging.getLogger("stepwatch")

# The columns each rank contributes to the interval's all_gather.
_LOSS, _STEP, _DATA, _BUSY, _SUM = range(5)


class DistributedMonitor(Callback):
    """Every ``every_n_steps`` global steps, gather one row from every rank - its step loss,
    its mean step time and data-wait time over the interval, the time it was busy before the
    gradient all-reduce, and a checksum of its weights - in ONE all_gather (nothing on the other
    steps), then:

    * log (``logging``, on rank 0) and record the mean/min/max over the ranks of the loss, the
      step time and the data-wait time: with a ``RunRecorder`` in the run, under the keys
      ``dist/loss_mean``, ``dist/loss_min``, ``dist/loss_max``, ``dist/step_time_*``,
      ``dist/data_time_*``; ``last`` holds the latest summary on every rank;
    * raise a ``straggler`` alert when a rank's busy time (data wait, step-begin hooks and
      forward: what a rank does before it waits for the others in the gradient all-reduce,
      where synchronous training evens out the step times) exceeds the median of the other
      ranks' by ``straggler_factor`` and by at least ``straggler_seconds`` (so that the
      scheduling noise of sub-millisecond steps is not a straggler);
    * raise a ``desync`` alert when the replicas' weight checksums differ by more than
      ``desync_tolerance`` (relative): DistributedDataParallel keeps replicas identical, so a
      difference means one is out of step; and, when ``loss_tolerance`` is set, when the
      ranks' losses spread by more than that (relative to their mean).

    Alerts (:class:`stepwatch.monitor.detectors.Alert`) are appended to ``alerts`` on every
    rank, logged as warnings on rank 0, and written to the run store as events of kind
    ``"alert"``. A single process gathers from itself: the summary still works, no alert fires.
    Pass it on every rank (the gather needs them all).

    Args:
        every_n_steps: global steps between gathers.
        straggler_factor: how many times the others' median busy time makes a straggler (> 1).
        straggler_seconds: the least excess per step, in seconds, that makes a straggler.
        desync_tolerance: the largest relative checksum difference between replicas (>= 0).
        loss_tolerance: the largest relative loss spread, or None (default) not to compare
            losses (ranks see different batches, so their losses differ by nature).
        frozen_seconds: raise a ``frozen`` alert naming a rank whose process has not run for
            this long (SIGSTOP, a frozen machine), seen by a background thread on every rank
            through the process group's store - long before the collective it blocks would
            time out; None turns the watch off.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range, naming it.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        straggler_factor: float = 1.5,
        straggler_seconds: float = 0.01,
        desync_tolerance: float = 1e-6,
        loss_tolerance: float | None = None,
        frozen_seconds: float | None = 60.0,
    ) -> None:
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.straggler_factor = float(check_number("straggler_factor", straggler_factor) or 0.0)
        if not self.straggler_factor > 1:
            raise ValueError(
                f"'straggler_factor' must be a number > 1, but got {straggler_factor!r}."
            )
        self.straggler_seconds = check_number("straggler_seconds", straggler_seconds, minimum=0.0)
        self.desync_tolerance = check_number("desync_tolerance", desync_tolerance, minimum=0.0)
        self.loss_tolerance = check_number(
            "loss_tolerance", loss_tolerance, minimum=0.0, allow_none=True
        )
        self.frozen_seconds = check_number(
            "frozen_seconds", frozen_seconds, minimum=0.0, allow_none=True
        )
        if self.frozen_seconds is not None and not self.frozen_seconds > 0:
            raise ValueError(
                f"'frozen_seconds' must be a number > 0 or None, but got {frozen_seconds!r}."
            )
        self._watch: Any = None
        self._view: Any = None
        self.alerts: list[Alert] = []
        self._active: set[tuple[str, int]] = set()  # the conditions at the last check
        self.last: dict[str, float] = {}
        self._rank = 0
        self._params: list[torch.Tensor] = []
        self._hook: Any = None
        self._sums = [0.0, 0.0, 0.0]  # step time, data wait, busy time over the interval
        self._steps = 0
        self._prev_end = 0.0
        self._forward_end = 0.0

    # -- hooks ----------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        if p.device_number < 2:
            warnings.warn(
                "DistributedMonitor is in a run of one process: it summarises that process "
                "only and can raise no straggler or desync alert. Launch with torchrun "
                "--nproc_per_node=N to compare ranks.",
                UserWarning,
                stacklevel=2,
            )
        self._rank = p.rank_id
        self._active = set()
        self._view = view_of(p)
        self._stop_watch()
        if self.frozen_seconds is not None and p.device_number > 1:
            self._watch = RankWatch(
                p.rank_id, p.device_number, self.frozen_seconds, self._frozen
            ).start()
        self._params = [t for t in p.network.parameters()]
        self._remove_hook()
        self._hook = p.network.register_forward_hook(self._forward_done)
        self._reset_interval()

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self._prev_end = time.perf_counter()

    def _forward_done(self, *args: Any) -> None:
        self._forward_end = time.perf_counter()

    def on_train_step_begin(self, run_context: RunContext) -> None:
        now = time.perf_counter()
        self._sums[1] += now - self._prev_end
        self._forward_end = now

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        sums = self._sums
        sums[0] += p.step_time
        sums[2] += self._forward_end - self._prev_end
        self._steps += 1
        if self._watch is not None:
            self._watch.step = p.cur_step_num
        if p.cur_step_num % self.every_n_steps == 0:
            self._gather(p)
        self._prev_end = time.perf_counter()

    def on_train_end(self, run_context: RunContext) -> None:
        self._remove_hook()
        self._stop_watch()

    def __exit__(self, *err: Any) -> None:
        self._remove_hook()
        self._stop_watch()

    # -- a rank whose process stopped (on the watch thread) --------------------------------------
    def _frozen(self, rank: int, step: int, silent: float) -> None:
        view = self._view
        at = view.step if view is not None else step
        alert = Alert(
            at,
            view.epoch if view is not None else None,
            "frozen",
            f"step {at}: rank {rank} has not run for {silent:.0f} s (last heard of at step "
            f"{step}); the other ranks wait for it in a collective. Its process may be stopped "
            "(SIGSTOP, a debugger), its machine frozen or swapping: look at that machine.",
            silent,
        )
        self.alerts.append(alert)
        if view is not None and self._rank == 0:
            view.alerts.emit(alert, source=type(self).__name__)
        else:  # rank 0 itself is the one that stopped: another rank says so
            logger.warning("%s", alert.message)

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    # -- the interval's gather --------------------------------------------------------------
    def _reset_interval(self) -> None:
        self._sums = [0.0, 0.0, 0.0]
        self._steps = 0

    def _gather(self, p: Any) -> None:
        n = max(self._steps, 1)
        with torch.no_grad():
            checksum = torch.stack([t.detach().sum(dtype=torch.float64) for t in self._params])
        loss = p.loss_tensor if p.loss_tensor is not None else math.nan
        row = [loss, self._sums[0] / n, self._sums[1] / n, self._sums[2] / n, checksum.sum()]
        table = all_gather_rows(row).tolist()  # one collective; one host read
        self._reset_interval()
        step, epoch = p.cur_step_num, p.cur_epoch_num
        summary: dict[str, float] = {}
        for name, col in (("loss", _LOSS), ("step_time", _STEP), ("data_time", _DATA)):
            column = [r[col] for r in table]
            summary[f"{name}_mean"] = sum(column) / len(column)
            summary[f"{name}_min"] = min(column)
            summary[f"{name}_max"] = max(column)
        self.last = summary
        view = view_of(p)
        writer = view.sink
        if self._rank == 0:
            logger.info(
                "step %d: loss %.6g (min %.6g, max %.6g), step time %.3f ms (max %.3f ms), "
                "data wait %.3f ms (max %.3f ms) over %d ranks",
                step,
                summary["loss_mean"],
                summary["loss_min"],
                summary["loss_max"],
                summary["step_time_mean"] * 1000,
                summary["step_time_max"] * 1000,
                summary["data_time_mean"] * 1000,
                summary["data_time_max"] * 1000,
                len(table),
            )
            if writer is not None:
                for key, value in summary.items():
                    writer.log(f"dist/{key}", value, step, epoch)
        found = self._check(table, step, epoch)
        # Once per episode: an alert fires when its condition starts, not at every check.
        for cond, alert in found.items():
            if cond not in self._active:
                self.alerts.append(alert)
                view.alerts.emit(alert, source=type(self).__name__)
        self._active = set(found)

    def _check(
        self, table: list[list[float]], step: int, epoch: int
    ) -> dict[tuple[str, int], Alert]:
        """The conditions that hold at this check, each with its alert."""
        alerts: dict[tuple[str, int], Alert] = {}
        world = len(table)
        if world < 2:
            return alerts
        busy = [r[_BUSY] for r in table]
        for rank, mine in enumerate(busy):
            others = sorted(busy[:rank] + busy[rank + 1 :])
            mid = len(others) // 2
            median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
            slow = mine > self.straggler_factor * median
            if median > 0 and slow and mine - median >= self.straggler_seconds:
                alerts["straggler", rank] = Alert(
                    step,
                    epoch,
                    "straggler",
                    f"step {step}: rank {rank} is a straggler: {mine * 1000:.3f} ms of work "
                    f"per step before the gradient all-reduce, {mine / median:.1f}x the other "
                    f"ranks' median ({median * 1000:.3f} ms); the others wait for it. Look at its "
                    "data loading, its machine's load, or its device.",
                    mine / median,
                )
        sums = [r[_SUM] for r in table]
        reference = sums[0]
        scale = max(abs(reference), 1.0)
        worst = max(range(world), key=lambda r: abs(sums[r] - reference))
        gap = abs(sums[worst] - reference) / scale
        if not math.isfinite(gap) or gap > self.desync_tolerance:
            alerts["desync", -1] = Alert(
                step,
                epoch,
                "desync",
                f"step {step}: rank {worst}'s weights are out of step with rank 0's (checksum "
                f"{sums[worst]:.9g} vs {reference:.9g}, relative gap {gap:.3g}): the "
                "replicas no longer train the same model. Check for code that changes "
                "weights on one rank only, or a network that was not wrapped in "
                "DistributedDataParallel.",
                gap,
            )
        if self.loss_tolerance is not None:
            losses = [r[_LOSS] for r in table]
            mean = sum(losses) / world
            spread = (max(losses) - min(losses)) / max(abs(mean), 1e-12)
            if not math.isfinite(spread) or spread > self.loss_tolerance:
                alerts["desync", -2] = Alert(
                    step,
                    epoch,
                    "desync",
                    f"step {step}: the ranks' losses disagree: from {min(losses):.6g} to "
                    f"{max(losses):.6g} (relative spread {spread:.3g} > "
                    f"{self.loss_tolerance:g}).",
                    spread,
                )
        return alerts

    def _remove_hook(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
