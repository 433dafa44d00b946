"""``DistributedMonitor``: compare the ranks of a data-parallel or sharded run every N steps, in
one collective: loss, step time, data wait, and whether the copies of what is meant to be equal
(replicated parameters, shards held by several ranks) are still in step; and, on a thread of its
own, name a rank whose process stopped and, when asked, end the whole job."""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from typing import Any

import torch

from ..._validation import _got, check_int, check_number
from ...distributed import all_gather_rows, side_channel
from ...monitor.detectors import Alert
from ...rank_watch import Peer, RankWatch, end_job
from ...view.run import view_of
from ._callback import Callback, RunContext

__all__ = ["DistributedMonitor"]

logger = logging.getLogger("stepwatch")

# The columns each rank contributes to the interval's all_gather: the loss, the step time, the
# data wait, the busy time, the checksum of the replicated parameters, the checksum of this
# rank's shards and which shards those are (ranks with the same code hold the same shards).
_LOSS, _STEP, _DATA, _BUSY, _SUM, _SHARD_SUM, _SHARDS = range(7)

KINDS = ("straggler", "desync", "frozen")
# What each kind's alert may do besides warning.
_ACTIONS = {"straggler": ("warn",), "desync": ("warn",), "frozen": ("warn", "abort")}
# The key rank 0 sets once it has stored why the job ends; the other ranks wait for it (a
# bounded wait) before they leave, so that their leaving does not cut rank 0's writing short.
_ENDED_KEY = "stepwatch/job-ended"


class DistributedMonitor(Callback):
    """Every ``every_n_steps`` global steps, gather one row from every rank - its step loss,
    its mean step time and data-wait time over the interval, the time it was busy before the
    gradient all-reduce, and checksums of its weights - in ONE all_gather (nothing on the other
    steps), then:

    * log (``logging``, on rank 0) and record the mean/min/max over the ranks of the loss, the
      step time and the data-wait time: with a ``RunRecorder`` in the run, under the keys
      ``dist/loss_mean``, ``dist/loss_min``, ``dist/loss_max``, ``dist/step_time_*``,
      ``dist/data_time_*``; ``last`` holds the latest summary on every rank;
    * raise a ``straggler`` alert when a rank's busy time (data wait, step-begin hooks and
      forward: what a rank does before it waits for the others in the gradient all-reduce,
      where synchronous training evens out the step times; under FSDP2, whose forward waits
      for every rank as it gathers the parameters, the data wait and hooks) exceeds the
      median of the other ranks' by ``straggler_factor`` and by at least
      ``straggler_seconds`` (so that the scheduling noise of sub-millisecond steps is not a
      straggler);
    * raise a ``desync`` alert when copies of what is meant to be equal differ by more than
      ``desync_tolerance`` (relative): the replicated parameters (all of them under
      DistributedDataParallel; those not sharded in a ``fully_shard``-ed network), and the
      shards that several ranks hold (FSDP2 over a 2-D mesh, HSDP: the ranks along the
      replicate dimension hold the same shards). A shard no other rank holds is compared with
      nothing, so FSDP2 sharding raises no false alarm. And, when ``loss_tolerance`` is set,
      when the ranks' losses spread by more than that (relative to their mean).

    A background thread on every rank publishes a heartbeat and the rank's last step through
    the job's key-value store (not a collective) and watches the others': a rank whose process
    has not run for ``frozen_seconds`` (SIGSTOP, a frozen machine, a swap storm) raises a
    ``frozen`` alert naming it, its host and node, and the last step it finished - while the
    others wait for it in a collective that would only time out after the process group's
    timeout (30 minutes by default). With ``action={"frozen": "abort"}`` the job then ends:
    rank 0 stores the alert and why the run ended (status ``failed``), every rank that saw it
    logs the error and leaves with exit status 3, and a frozen process on the same machine is
    killed, so torchrun tears the whole job down within seconds (and restarts it, with
    ``--max-restarts``).

    Alerts (:class:`stepwatch.monitor.detectors.Alert`) are appended to ``alerts`` on every
    rank, logged as warnings on rank 0, and written to the run store as events of kind
    ``"alert"``. A single process gathers from itself: the summary still works, no alert fires.
    Pass it on every rank (the gather needs them all).

    Args:
        every_n_steps: global steps between gathers.
        straggler_factor: how many times the others' median busy time makes a straggler (> 1).
        straggler_seconds: the least excess per step, in seconds, that makes a straggler.
        desync_tolerance: the largest relative checksum difference between copies (>= 0).
        loss_tolerance: the largest relative loss spread, or None (default) not to compare
            losses (ranks see different batches, so their losses differ by nature).
        frozen_seconds: raise a ``frozen`` alert naming a rank whose process has not run for
            this long; None turns the watch off.
        action: what an alert does besides warning: ``'warn'`` (default) or a dict of kind ->
            action, where ``'frozen'`` may be ``'abort'`` (end the whole job, see above).

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range, naming it.

    Example:
        >>> monitor = DistributedMonitor(every_n_steps=100, frozen_seconds=60,
        ...                              action={"frozen": "abort"})
        >>> model.train(10, dataset, callbacks=[monitor, RunRecorder()])
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        straggler_factor: float = 1.5,
        straggler_seconds: float = 0.01,
        desync_tolerance: float = 1e-6,
        loss_tolerance: float | None = None,
        frozen_seconds: float | None = 60.0,
        action: str | dict[str, str] = "warn",
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
        self.action = _check_action(action)
        if self.action["frozen"] == "abort" and self.frozen_seconds is None:
            raise ValueError(
                "action={'frozen': 'abort'} needs the frozen watch: pass 'frozen_seconds' (a "
                "number of seconds), not None."
            )
        self._watch: RankWatch | None = None
        self._view: Any = None
        self.alerts: list[Alert] = []
        self._active: set[tuple[str, int]] = set()  # the conditions at the last check
        self.last: dict[str, float] = {}
        self._rank = 0
        self._sharded = False  # FSDP2: the network holds shards (its forward gathers them)
        self._hooks: list[Any] = []
        self._sums = [0.0, 0.0, 0.0]  # step time, data wait, busy time over the interval
        self._steps = 0
        self._prev_end = 0.0
        # This step's first forward start and last forward end (None: no forward yet); a hand
        # loop calls the step hooks after its forward and backward, a trainer before them.
        self._forward_start: float | None = None
        self._forward_end: float | None = None
        self._step_begin = 0.0
        self._ending = threading.Lock()  # one ending of the job, whichever peer froze

    # -- hooks ----------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        if p.device_number < 2:
            warnings.warn(
                "DistributedMonitor is in a run of one process: it summarises that process "
                "only and can raise no straggler or desync alert. Launch with torchrun "
                "--nproc-per-node N to compare ranks.",
                UserWarning,
                stacklevel=2,
            )
        self._rank = p.rank_id
        self._active = set()
        self._view = view_of(p)
        self._stop_watch()
        store = side_channel() if self.frozen_seconds is not None else None
        if store is not None and self.frozen_seconds is not None and p.device_number > 1:
            self._watch = RankWatch(
                p.rank_id, p.device_number, self.frozen_seconds, self._frozen, store
            ).start()
        self._sharded = bool(_split_parameters(p.network)[1])
        self._remove_hook()
        self._hooks = [
            p.network.register_forward_pre_hook(self._forward_begins),
            p.network.register_forward_hook(self._forward_done),
        ]
        self._reset_interval()

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self._prev_end = time.perf_counter()
        self._forward_start = self._forward_end = None  # a validation pass's forwards

    def _forward_begins(self, *args: Any) -> None:
        if self._forward_start is None:
            self._forward_start = time.perf_counter()

    def _forward_done(self, *args: Any) -> None:
        self._forward_end = time.perf_counter()

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self._step_begin = time.perf_counter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        # The step's work begins at its step hook or its first forward, whichever came first
        # (a trainer's hook comes before the batch is moved; a hand loop's after backward);
        # before it the rank waited for data. It is busy until its forward ends (then it
        # waits for the others in the gradient reduction); without a forward seen, until then.
        # A sharded network's forward gathers the parameters from every rank, waiting for
        # the slowest: there the rank is busy until its forward begins.
        begun, start, end = self._step_begin, self._forward_start, self._forward_end
        if start is not None and self._prev_end <= start < begun:
            begun = start
        busy_until = end if end is not None and end >= begun and not self._sharded else begun
        self._forward_start = self._forward_end = None
        sums = self._sums
        sums[0] += p.step_time
        sums[1] += begun - self._prev_end
        sums[2] += busy_until - self._prev_end
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
    def _frozen(self, peer: Peer, step: int, silent: float) -> None:
        view = self._view
        at = view.step if view is not None else step
        # Its heartbeat tells the step it had finished when it last beat; steps faster than
        # the heartbeat may have come after. In synchronous training it took part in the
        # collectives of every step this rank finished, so it ran those steps too.
        watch = self._watch
        step = max(step, watch.step if watch is not None else 0)
        abort = self.action["frozen"] == "abort"
        alert = Alert(
            at,
            view.epoch if view is not None else None,
            "frozen",
            f"step {at}: {peer.describe()} has not run for {silent:.0f} s; the last step it "
            f"finished is {step}, and the other ranks wait for it in a collective. Its process "
            "may be stopped (SIGSTOP, a debugger), its machine frozen or swapping: look at "
            "that machine.",
            silent,
        )
        self.alerts.append(alert)
        ending = f"ending the job (rank {self._rank} leaves with exit status 3)"
        if view is not None and self._rank == 0:
            view.alerts.emit(
                alert, [lambda _: ending] if abort else (), source="DistributedMonitor"
            )
        else:  # rank 0 stores and logs; when it is the one that stopped, another rank says so
            logger.warning("%s", alert.message)
        if abort:
            self._end_job(peer, step, silent)

    def _end_job(self, peer: Peer, step: int, silent: float) -> None:
        """The job cannot go on (the training thread waits for ``peer`` in a collective):
        rank 0 stores why the run ended; every rank then leaves (never returns)."""
        if not self._ending.acquire(blocking=False):
            return  # another frozen peer is already ending it
        reason = (
            f"{peer.describe()} has not run for {silent:.0f} s (the last step it finished is "
            f"{step}); DistributedMonitor(action={{'frozen': 'abort'}}) ends the job"
        )
        watch, view = self._watch, self._view
        store = getattr(watch, "_store", None)
        try:
            if self._rank == 0:
                sink = view.sink if view is not None else None
                if sink is not None:
                    data = {"kind": "frozen", "rank": peer.rank, "host": peer.host,
                            "node": peer.node, "last_step": step}  # fmt: skip
                    where = (view.step, view.epoch) if view is not None else (None, None)
                    sink.event("stop", f"training aborted: {reason}", *where, "error", data)
                    close = getattr(sink, "close", None)
                    if callable(close):
                        close("failed", timeout=10.0)
                if store is not None:
                    store.set(_ENDED_KEY, "1")
            elif store is not None and peer.rank != 0:
                _wait_for(store, _ENDED_KEY, 10.0)  # rank 0 stores it first
        except Exception:  # the store or the sink is gone: leave all the same
            logger.debug("stepwatch: could not record the job's end", exc_info=True)
        end_job(f"rank {self._rank}: {reason}", peer)

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
        loss = p.loss_tensor if p.loss_tensor is not None else math.nan
        sums = self._sums
        row = [loss, sums[0] / n, sums[1] / n, sums[2] / n]
        # The network's parameters as they are now: FSDP2 swaps the module's parameters
        # between their sharded and unsharded forms, and frees the unsharded ones' storage, so
        # tensors held from an earlier step may be gone.
        replicated, sharded, shards = _split_parameters(p.network)
        row += [_checksum(replicated), _checksum(sharded), shards]
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
        found = _out_of_step(table, self.desync_tolerance)
        if found is not None:
            worst, reference, gap, sharded = found
            col = _SHARD_SUM if sharded else _SUM
            what = "shards" if sharded else "replicated weights"
            held = " (they hold the same shards)" if sharded else ""
            alerts["desync", -1] = Alert(
                step,
                epoch,
                "desync",
                f"step {step}: rank {worst}'s {what} are out of step with rank {reference}'s"
                f"{held} (checksum {table[worst][col]:.9g} vs {table[reference][col]:.9g}, "
                f"relative gap {gap:.3g}): the copies no longer train the same model. Check "
                "for code that changes weights on one rank only, or a network that was not "
                "wrapped in DistributedDataParallel or fully_shard.",
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
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()


def _check_action(action: Any) -> dict[str, str]:
    """``{kind: action}`` for every kind, from ``'warn'`` or a dict of kind -> action."""
    if isinstance(action, str):
        if action != "warn":
            raise ValueError(
                f"'action' must be 'warn' or a dict of kind -> action such as "
                f"{{'frozen': 'abort'}}, but got {action!r}."
            )
        return dict.fromkeys(KINDS, "warn")
    if not isinstance(action, dict):
        raise TypeError(
            f"'action' must be 'warn' or a dict such as {{'frozen': 'abort'}}, but got "
            f"{_got(action)}."
        )
    found = dict.fromkeys(KINDS, "warn")
    for kind, what in action.items():
        if kind not in _ACTIONS:
            raise ValueError(
                f"'action' names the kind {kind!r}; DistributedMonitor's kinds are "
                f"{', '.join(map(repr, KINDS))}."
            )
        if what not in _ACTIONS[kind]:
            raise ValueError(
                f"'action' for {kind!r} must be one of {', '.join(map(repr, _ACTIONS[kind]))}, "
                f"but got {what!r}."
            )
        found[kind] = what
    return found


def _split_parameters(
    network: torch.nn.Module,
) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """The network's parameters as local tensors: ``(replicated, sharded, shards)``.

    A plain tensor, or a DTensor placed ``Replicate`` on every mesh dimension, is the same on
    every rank. A DTensor sharded (or partial) on some dimension holds a shard; ``shards``
    numbers which ones: the rank's coordinates on those dimensions, so that ranks with the same
    number hold the same shards (HSDP's replicas) and ranks with different ones differ by
    nature (FSDP2's shards)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return [t.detach() for t in network.parameters()], [], 0.0
    replicated: list[torch.Tensor] = []
    sharded: list[torch.Tensor] = []
    layouts: dict[tuple[Any, ...], int] = {}
    for param in network.parameters():
        if not isinstance(param, DTensor):
            replicated.append(param)
            continue
        placements = tuple(param.placements)
        if all(isinstance(pl, Replicate) for pl in placements):
            replicated.append(param)
            continue
        sharded.append(param)
        mesh = param.device_mesh
        coordinate: list[int] = list(mesh.get_coordinate() or [])
        code, scale = 0, 1
        for dim, pl in enumerate(placements):
            if not isinstance(pl, Replicate):  # the coordinate along a sharded dimension
                code += coordinate[dim] * scale
                scale *= mesh.size(dim)
        layouts.setdefault((tuple(mesh.mesh.flatten().tolist()), placements), code)
    # One number for all layouts, computed alike on every rank (exact below 2**52).
    shards = 0
    for _, code in sorted(layouts.items(), key=repr):
        shards = (shards * 1_000_003 + code + 1) % (1 << 52)
    return replicated, sharded, float(shards)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's part
    return to_local() if callable(to_local) else t


def _checksum(params: list[torch.Tensor]) -> torch.Tensor | float:
    """The sum of the parameters' local values (float64), or 0.0 for none."""
    if not params:
        return 0.0
    with torch.no_grad():
        return torch.stack([_local(t).detach().sum(dtype=torch.float64) for t in params]).sum()


def _out_of_step(table: list[list[float]], tolerance: float) -> tuple[int, int, float, bool] | None:
    """``(rank, reference rank, relative gap, sharded)`` of the copy furthest from the one it
    should equal, when that gap passes ``tolerance`` (or is not finite); else None.
    Replicated weights are compared with rank 0's; shards with the first rank holding the same
    ones."""
    worst: tuple[int, int, float, bool] | None = None
    first_holder: dict[float, int] = {}
    for rank, row in enumerate(table):
        for col, reference in (
            (_SUM, 0),
            (_SHARD_SUM, first_holder.setdefault(row[_SHARDS], rank)),
        ):
            if reference == rank:
                continue
            expected = table[reference][col]
            gap = abs(row[col] - expected) / max(abs(expected), 1.0)
            if not math.isfinite(gap):
                gap = math.inf
            if gap > tolerance and (worst is None or gap > worst[2]):
                worst = (rank, reference, gap, col == _SHARD_SUM)
    return worst


def _wait_for(store: Any, key: str, seconds: float) -> None:
    """Wait until ``key`` is in ``store``, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.05)
