"""``RunRecorder``: the callback that records a run into the store."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import node_metrics
from .._validation import check_int, check_number
from ..job import current_job, next_run_number, run_to_continue, several_nodes
from ..monitor import values as names
from ..monitor.schedule import Every, Pace
from ..train.callback._callback import ORDER_RECORD, Callback, CallbackParams, RunContext
from ..train.step import scale_tensor
from ..view.run import RunView, view_of
from ..view.tap import Chunk
from .base import check_writable
from .notify import Notifier, check_notify_url
from .writer import RunWriter, flush_period, run_config

__all__ = ["RunRecorder"]


def _scalars(key: str, value: Any) -> list[tuple[str, Any]]:
    """One point per number: a per-class metric (an array) becomes ``key/0``, ``key/1``, ..."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy() if value.numel() > 1 else value
    size = getattr(value, "size", None)
    if isinstance(value, (list, tuple)) or (isinstance(size, int) and size > 1):
        return [(f"{key}/{i}", v) for i, v in enumerate(np.asarray(value).ravel().tolist())]
    return [(key, value)]


def _directions(metrics: Mapping[str, Any], validates: bool) -> dict[str, str]:
    """``{epoch key: 'min' | 'max'}`` for the epoch keys a run with these metrics records."""
    declared = names.metric_directions(metrics)
    train = {names.LOSS: 0.0}
    train.update(
        {m: 0.0 for m, metric in metrics.items() if not getattr(metric, "uses_loss", False)}
    )
    valid = {**dict.fromkeys(metrics, 0.0), names.EVAL_LOSS: 0.0} if validates else None
    keys = names.epoch_values(train, valid, validates=validates, aliases=False)
    found = {key: names.direction(key, declared) for key in keys}
    return {key: d for key, d in sorted(found.items()) if d is not None}


class RunRecorder(Callback):
    """Record the run into the SQLite store: step losses, epoch values, validation results,
    learning rate, step time and events.

    The step losses come from the run's loss tap (a CPU loss as a float, any other stays on
    the device): the recorder takes the tap's chunks and, once per interval
    (``transfer_every`` recorded steps, the writer's flush period, or an epoch end), hands them
    to the writer, a batch a chunk; a device chunk's host copy was queued by the tap without
    waiting, and the writer thread waits for it. It has no step hook: it looks at the run's
    step clock about four times a flush period, so slow steps are still written within it.
    The rows are built in bulk on the writer thread. Only rank 0 records (``rank_zero_only``);
    in a torchrun job on several machines, the first worker of each other machine publishes its
    machine's system metrics for rank 0 to record (:mod:`stepwatch.node_metrics`), and a job
    that torchrun starts again (``--max-restarts``) goes on recording the run its first
    attempt began (:mod:`stepwatch.job`), with a ``restart`` event where it resumed.

    Keys written (named as :mod:`stepwatch.monitor.values` names them, so the store, ``History``
    and ``EarlyStopping(monitor=...)`` agree):

    * per recorded step, ``step_loss``: the step's training loss (the wall times of the steps
      inside one transfer interval are spread evenly over it);
    * once per interval, ``lr`` (the first parameter group's learning rate) and ``step_time``
      (mean seconds per step);
    * per epoch, ``loss`` (the epoch's mean training loss), ``train_<metric>``, and in a
      ``fit`` that validates ``eval_loss`` and ``eval_<metric>``; a per-class metric (an array)
      becomes ``<key>/0``, ``<key>/1``, ...

    The run's config holds ``"directions"``: ``{key: "min" | "max"}`` for the epoch keys
    (the metric's declared ``direction``, else the name rule). Events: checkpoints saved, the
    stop reason, an exception. Every ``system_every`` seconds the writer's thread adds the
    process's CPU and memory use (and each GPU's, with NVML) under ``system/``
    (:mod:`stepwatch.store.system`); with ``notify`` every alert and the run's end are posted
    to a webhook (:mod:`stepwatch.store.notify`).

    Args:
        db: the database file (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).
        run_name: the run's name (default ``run-<id>``).
        config: a JSON-serialisable dict stored with the run (hyperparameters).
        every_n_steps: record the loss every N global steps (1: every step).
        every_n_seconds: also, or instead, record when this many seconds passed.
        transfer_every: copy the pending step losses to the host every this many recorded
            steps (also at each flush period and epoch end).
        flush_seconds: the longest a record waits before it is written to the database.
        system_every: seconds between system samples (``system/cpu_percent``,
            ``system/rss_mb``, ...), taken on the writer's thread; None: none.
        notify: a webhook URL (Slack- and Discord-compatible JSON) that every alert and the
            run's end are posted to, off the training thread; never stored or logged.

    Attributes:
        run_id: the run's id (after training started); ``writer``: its :class:`RunWriter`.

    Raises:
        TypeError / ValueError: bad arguments or a config that is not JSON-serialisable.

    Example:
        >>> recorder = RunRecorder(db="runs.db", run_name="baseline", config={"lr": 0.1})
        >>> model.fit(10, train_ds, valid_ds, callbacks=[recorder])
        >>> Store("runs.db").metrics(recorder.run_id, "eval_loss")
    """

    order = ORDER_RECORD  # after the callbacks whose effects it records
    rank_zero_only = True

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        every_n_steps: int | None = 1,
        every_n_seconds: float | None = None,
        transfer_every: int = 256,
        flush_seconds: float = 1.0,
        system_every: float | None = 10.0,
        notify: str | None = None,
    ) -> None:
        # A path, a store URL or None, parsed once and checked now, not at step 1; the writer
        # opens the location parsed here.
        self._where = check_writable(db)
        run_config(run_name, config, "run_name", strict=True)  # refused now, not at step 1
        self.db = db
        self.run_name = run_name
        self.config = dict(config or {})
        self._sample = Every(steps=every_n_steps, seconds=every_n_seconds)
        if not self._sample.enabled:
            raise ValueError(
                "RunRecorder needs 'every_n_steps' >= 1 or 'every_n_seconds' > 0 to record steps."
            )
        self.transfer_every = check_int("transfer_every", transfer_every, minimum=1)
        self.flush_seconds = flush_period(flush_seconds)
        self.system_every = (
            None
            if system_every is None
            else check_number("system_every", system_every, minimum=0.01)
        )
        self.notify = check_notify_url(notify)
        if self.system_every is not None and several_nodes():
            self.rank_zero_only = False  # the other machines publish their system metrics
        self._publisher: Any = None
        self.writer: RunWriter | None = None
        self._run_id: int | None = None
        # The chunks of step losses (from the run's loss tap) not handed to the writer yet.
        self._chunks: list[Chunk] = []
        self._waiting = 0  # steps in those chunks
        self._last_transfer = 0.0
        self._transfer_step = 0
        self._first_sampled = 0  # the sampling schedule counts from this step
        self._last_ckpt: str | None = None
        self._cb_params: CallbackParams | None = None
        self._view: RunView | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        if p.rank_id != 0:
            self.writer = None
            self._stop_publishing()
            if self.system_every is not None:
                self._publisher = node_metrics.publisher(self.system_every, p.rank_id)
            return
        view = view_of(p)
        config = {
            "network": type(p.network).__name__,
            "optimizer": _optimizer_name(p.optimizer),
            "lr": p.lr if p.optimizer is not None else None,
            "epochs": p.initial_epoch + p.epoch_num,
            "initial_epoch": p.initial_epoch,
            "steps_per_epoch": p.batch_num,
            "device": str(p.device),
            "metrics": sorted(view.metrics),
            "directions": _directions(view.metrics, view.validates),
            "callbacks": [type(cb).__name__ for cb in p.list_callback],
            "torch": torch.__version__,
            **self.config,
        }
        if view.host != "stepwatch":
            config["host"] = view.host
        if view.config:
            config["host_config"] = view.config
        job, continued = current_job(), None
        if job is not None:  # a torchrun worker: the run a restarted job continues
            number = next_run_number()
            config["job"] = {**job.config(), "run": number}
            continued = run_to_continue(self._where, job, number)
        writer = RunWriter(
            self._where,
            self.run_name,
            config,
            flush_seconds=self.flush_seconds,
            continue_run=continued,
        )
        if continued is not None:
            writer.event(
                "restart",
                f"the job was started again by torchrun; training goes on from step "
                f"{p.cur_step_num}",
                p.cur_step_num,
                p.cur_epoch_num,
                data={"restart": job.restart if job is not None else None},
            )
        if self.system_every is not None:
            writer.system = node_metrics.sampler(self.system_every)
        if self.notify is not None:
            writer.notifier = Notifier(self.notify, self.run_name or writer.name)
            writer.notifier.run_id = writer.run_id
        self.writer = writer
        self._run_id = self.writer.run_id
        view.attach_sink(self.writer)  # the run's store: alerts and other monitors write here too
        self._view = view
        self._sample.reset(p.cur_step_num)
        self._first_sampled = p.cur_step_num
        self._chunks, self._waiting = [], 0
        self._last_transfer = time.monotonic()
        self._transfer_step = p.cur_step_num
        self._last_ckpt = p.latest_ckpt_file
        self._cb_params = p
        self._catch_sigterm()
        # A chunk per transfer; looks on the step clock about four times a flush period,
        # whatever the steps' speed, so that slow steps are still written within it.
        view.tap.subscribe(self.transfer_every, self._take)
        self._pace = Pace(self.flush_seconds)
        self._pace.reset(p.cur_step_num)
        view.tap.call_at(p.cur_step_num + 1, self._look)

    def _look(self, step: int) -> None:
        """A flush period has passed since the last transfer: transfer what waits now."""
        view = self._view
        if view is None:
            return
        if time.monotonic() - self._last_transfer >= self.flush_seconds:
            view.tap.cut()  # this step's chunk goes to _take, which transfers
            if self._chunks:  # nothing was pending: the kept chunks go on their own
                last = self._chunks[-1]
                self._transfer(last.steps[-1], last.epoch)
        view.tap.call_at(step + self._pace.ahead(step), self._look)

    def _take(self, chunk: Chunk) -> None:
        """A chunk of step losses from the tap: keep it; hand the kept ones to the writer when
        ``transfer_every`` steps wait or the flush period has passed."""
        self._chunks.append(chunk)
        self._waiting += len(chunk)
        if (
            self._waiting >= self.transfer_every
            or time.monotonic() - self._last_transfer >= self.flush_seconds
        ):
            self._transfer(chunk.steps[-1], chunk.epoch)

    def _transfer(self, step: int, epoch: int) -> None:
        """Hand the waiting step losses to the writer (it reads them on its own thread, after
        their host copy landed) with the interval's step time, learning rate and loss scale."""
        writer, p = self.writer, self._cb_params
        now = time.monotonic()
        elapsed = now - self._last_transfer
        self._last_transfer = now
        chunks, self._chunks, self._waiting = self._chunks, [], 0
        if writer is None or p is None:
            return
        if step > self._transfer_step:
            writer.log(names.STEP_TIME, elapsed / (step - self._transfer_step), step, epoch)
            if p.optimizer is not None:
                writer.log(names.LR, p.lr, step, epoch)
            scaler = p.get("loss_scaler")
            if scaler is not None:
                # Device tensors, read on the writer thread: no sync here.
                writer.log(names.LOSS_SCALE, scale_tensor(scaler), step, epoch)
                skipped = p.progress.skipped_steps
                if isinstance(skipped, torch.Tensor):
                    skipped = skipped.detach().clone()
                writer.log(names.SKIPPED_STEPS, skipped, step, epoch)
            self._transfer_step = step
        sample = self._sample
        every = sample.steps if not sample.seconds else 1
        for chunk in chunks:
            steps, values = chunk.steps, chunk.host
            if sample.seconds:
                # Sampling by time: the last step of each chunk that is due.
                last = steps[-1]
                if not sample.due(last):
                    continue
                steps, values = range(last, last + 1), values[-1:]
            elif every > 1:
                skip = (self._first_sampled - steps.start) % every
                steps, values = steps[skip::every], values[skip::every]
                if not steps:
                    continue
            writer.log_batch(
                names.STEP_LOSS, steps, values, chunk.epoch, ready=chunk.ready, span=chunk.span
            )

    def _flush(self, p: CallbackParams) -> None:
        """Hand over every step loss the tap holds (an epoch's end, the run's end)."""
        view = self._view
        if view is not None:
            view.tap.cut()
        self._transfer(p.cur_step_num, p.cur_epoch_num)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        writer = self.writer
        if writer is None:
            return
        p = run_context.cb_params
        self._flush(p)
        step, epoch = p.cur_step_num, p.cur_epoch_num
        assert self._view is not None
        for key, value in self._view.epoch_values(aliases=False).items():
            for sub, number in _scalars(key, value):
                writer.log(sub, number, step, epoch)
        if p.latest_ckpt_file and p.latest_ckpt_file != self._last_ckpt:
            self._last_ckpt = p.latest_ckpt_file
            writer.event(
                "checkpoint",
                f"saved {p.latest_ckpt_file}",
                step,
                epoch,
                data={"path": p.latest_ckpt_file},
            )

    def on_train_end(self, run_context: RunContext) -> None:
        self._stop_publishing()
        writer = self.writer
        if writer is None:
            return
        p = run_context.cb_params
        self._flush(p)
        self._detach()
        if run_context.get_stop_requested():
            reason = run_context.stop_reason or "a callback requested a stop"
            writer.event("stop", f"training stopped: {reason}", p.cur_step_num, p.cur_epoch_num)
        writer.close(_final_status(run_context))

    # -- SIGTERM (torchrun tearing a job down, a scheduler's kill): write what is queued first --
    def _catch_sigterm(self) -> None:
        """With nobody else handling SIGTERM (OnRequestExit would), the default action kills
        the process before the writer's queue is written: flush it and mark the run
        ``interrupted`` first, then die of the signal as before."""
        self._sigterm_installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        writer = self.writer
        try:
            if writer is not None and not writer.closed and self._cb_params is not None:
                self._flush(self._cb_params)
                writer.event("stop", "training killed by SIGTERM", level="error")
                writer.close("interrupted", timeout=10.0)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _release_sigterm(self) -> None:
        if getattr(self, "_sigterm_installed", False):
            self._sigterm_installed = False
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _detach(self) -> None:
        self._release_sigterm()
        view, self._view = self._view, None
        if view is not None:
            view.tap.unsubscribe(self)  # its chunks and its looks
            if self.writer is not None:
                view.detach_sink(self.writer)

    def _stop_publishing(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._stop_publishing()
        writer = self.writer
        if writer is None or writer.closed:
            return
        if self._cb_params is not None:
            try:
                self._flush(self._cb_params)  # the steps recorded before the failure
            except Exception:  # the device may be what failed; keep what was written
                pass
        self._detach()
        if exc_type is None:
            writer.close("finished")
            return
        interrupted = issubclass(exc_type, KeyboardInterrupt)
        writer.event(
            "error",
            f"{exc_type.__name__}: {exc}",
            level="error",
            data={"type": exc_type.__name__},
        )
        writer.close("interrupted" if interrupted else "failed")

    @property
    def run_id(self) -> int | None:
        """The run's id in the store (None before training, or while a store another process
        locked at the start has not let the run be created yet)."""
        writer = self.writer
        if writer is not None and writer.run_id is not None:
            return writer.run_id
        return self._run_id

    @property
    def dropped(self) -> int:
        """Records dropped by the writer (full queue or failing disk)."""
        return self.writer.dropped if self.writer is not None else 0


def _optimizer_name(optimizer: Any) -> str | None:
    """The optimizer's class, seen through the wrappers trainers put around it (a bridge's
    host optimizer, accelerate's ``AcceleratedOptimizer``)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "optimizer", None)
    return type(inner if inner is not None else optimizer).__name__


def _final_status(run_context: RunContext) -> str:
    """The stored status of a run that ended normally: ``interrupted`` (stopped from outside,
    to be resumed), ``anomaly`` (stopped because training went wrong) or ``finished``."""
    if run_context.interrupted:
        return "interrupted"
    if run_context.stop_kind == "anomaly":
        return "anomaly"
    return "finished"
