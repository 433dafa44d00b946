"""``FlopsUtilizationCollector``: a training step's FLOPs, counted once, and the model FLOPs
utilization (MFU) and throughput every ``data_size`` steps, as MindSpore names them."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch

from ..._validation import check_bool, check_int, check_number
from ...monitor import values as names
from ...view.run import view_of
from ._callback import Callback, RunContext
from ._print import emit

__all__ = ["PEAK_FLOPS", "FlopsUtilizationCollector", "peak_flops"]

# Dense bf16/fp16 tensor-core peaks, FLOP/s per device, by a part of the device's name (the
# first that matches wins: the more specific names come first).
PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989.4e12),
    (("H100", "NVL"), 835.5e12),
    (("H100", "PCIe"), 756.0e12),
    (("H100",), 989.4e12),  # SXM (HBM3)
    (("A100",), 312.0e12),
    (("L40S",), 362.05e12),
    (("L4",), 121.0e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of ``device`` from :data:`PEAK_FLOPS`, or None (a CPU, or a
    GPU the table does not know)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for parts, peak in PEAK_FLOPS:
        if all(part in name for part in parts):
            return peak
    return None


def _rows(batch: Any) -> tuple[int, bool] | None:
    """``(count, tokens)`` of a batch: its token count when its inputs are token ids (an
    integer tensor of at least two dimensions: batch x sequence; ``input_ids`` in a dict),
    else its number of samples (the first tensor's first dimension); None for no tensor."""
    if isinstance(batch, dict):
        first = batch.get("input_ids")
        items = [first] if first is not None else list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        items = [batch]
    for item in items:
        if isinstance(item, torch.Tensor) and item.ndim >= 1:
            if item.ndim >= 2 and not item.is_floating_point() and not item.is_complex():
                return item.numel(), True
            return int(item.shape[0]), False
        if isinstance(item, (dict, list, tuple)):
            found = _rows(item)
            if found is not None:
                return found
    return None


def _floored_percent(fraction: float) -> str:
    """``0.4859`` -> ``'48.59%'`` (floored to two decimals, as MindSpore prints it)."""
    return f"{math.floor(fraction * 10_000) / 100:.2f}%"


class FlopsUtilizationCollector(Callback):
    """Count the FLOPs of one training step once, then every ``data_size`` steps print the
    step time and the model FLOPs utilization (MFU), and record it with the throughput.

    The count runs PyTorch's own counter (:class:`torch.utils.flop_counter.FlopCounterMode`)
    over one whole training step - forward, backward and optimizer step, from the end of the
    run's first step to the end of its second (a validation pass in between is left out) - so
    later steps pay nothing for it. It counts matrix products, convolutions and attention:
    what a step's FLOPs are made of. A network that recomputes activations in its backward
    pass (activation checkpointing) counts the recomputed forward too, so its model and
    hardware FLOPs are the same number here.

    Printed on rank 0, as MindSpore prints it: once, ``Full model flops is F, Full hardware
    flops is F, Shard model flops is f, Shard hardware flops is f.`` (without ``full_flops``
    only the shard part), then every ``data_size`` steps
    ``Train per step time: 12.345 ms mfu:48.59% hfu:48.59%``. The shard figures are this
    rank's; the full ones every rank's together (this rank's times the number of ranks: data
    parallel and FSDP ranks run the same step on batches of the same size).

    MFU is FLOPs per second over the peak: with ``full_flops`` the whole job's FLOPs per step
    over the step time and ``computility`` times the number of ranks; without it, this rank's
    over ``computility``. The step time is the mean over the ``data_size`` steps (validation
    left out). With a ``RunRecorder`` in the run, each print also stores, at its step:
    ``flops_per_step`` (the FLOPs the MFU counts), ``mfu`` (a fraction) and the throughput of
    the whole job: ``tokens_per_second`` when the batch holds token ids (an integer tensor of
    batch x sequence, or a dict's ``input_ids``), else ``samples_per_second`` (the batch's
    first dimension, times the number of ranks). The dashboard draws each of them.

    Args:
        data_size: steps between prints (MindSpore's name for it).
        computility: the peak FLOP/s of one device. None (the default): a CUDA device's dense
            bf16 peak from :data:`PEAK_FLOPS` (A100, H100, H200, L4, L40S); elsewhere it must
            be given (a CPU has no known peak).
        full_flops: the MFU of the whole job (True, MindSpore's default) or of this rank.
        enable_ma_collector: MindSpore's ModelArts log files; only False is supported (the
            values go to the run store instead).

    Raises:
        TypeError / ValueError: an argument of the wrong type or value, naming it.
        ValueError: at the run's start, no ``computility`` and none known for the device.

    Example:
        >>> model.train(3, dataset, callbacks=[FlopsUtilizationCollector(100,
        ...             computility=989e12), RunRecorder()])
        Full model flops is 1.2e+12, ...
        Train per step time: 52.101 ms mfu:46.43% hfu:46.43%
    """

    def __init__(
        self,
        data_size: int,
        computility: float | None = None,
        full_flops: bool = True,
        enable_ma_collector: bool = False,
    ) -> None:
        self.data_size = check_int("data_size", data_size, minimum=1)
        self.computility = check_number("computility", computility, allow_none=True)
        if self.computility is not None and not 0 < self.computility < math.inf:
            raise ValueError(
                f"'computility' must be the peak FLOP/s of one device (a finite number > 0, "
                f"e.g. 989e12 for an H100's bf16), or None, but got {computility!r}."
            )
        self.full_flops = check_bool("full_flops", full_flops)
        if check_bool("enable_ma_collector", enable_ma_collector):
            raise ValueError(
                "'enable_ma_collector' must be False: ModelArts' log files are not written; "
                "the FLOPs, MFU and throughput go to the run store with a RunRecorder."
            )
        self.shard_flops = 0  # this rank's FLOPs of one step (0 until counted)
        self.full_model_flops = 0  # every rank's
        self.mfu: float | None = None  # at the last print
        self.throughput: float | None = None
        self._peak = 0.0
        self._world = 1
        self._counter: Any = None
        self._counted = 0  # FLOPs of the counting window before a validation pass
        self._since = 0.0  # when the timed interval began
        self._since_step = 0
        self._eval_start = 0.0
        self._eval_seconds = 0.0
        self._warned = False
        self._told_batch = False
        self._view: Any = None

    # -- the run ---------------------------------------------------------------------------------
    def on_train_begin(self, run_context: RunContext) -> None:
        p = run_context.cb_params
        device = p.get("device") or torch.device("cpu")
        peak = self.computility if self.computility is not None else peak_flops(device)
        if peak is None:
            what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            raise ValueError(
                f"FlopsUtilizationCollector needs 'computility', the peak FLOP/s of one device: "
                f"none is known for {what!r}. Pass it: the device's peak FLOP/s for the "
                "dtype it trains in, e.g. computility=989e12 for an H100's dense bf16, or for "
                "a CPU its cores x clock x FLOPs per cycle (about 1e11 to 1e12 for fp32)."
            )
        self._peak = float(peak)
        self._world = max(int(p.device_number), 1)
        self.shard_flops = self.full_model_flops = 0
        self.mfu = self.throughput = None
        self._counter, self._counted, self._eval_seconds = None, 0, 0.0
        self._view = view = view_of(p)
        view.tap.call_at(p.cur_step_num + 1, self._count_from)

    def _count_from(self, step: int) -> None:
        """The end of the first step: count everything up to the end of the next one."""
        from torch.utils.flop_counter import FlopCounterMode

        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        self._view.tap.call_at(step + 1, self._count_to)

    def _count_to(self, step: int) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        shard = self._counted + int(counter.get_total_flops())
        self._counted = 0
        # Every rank runs the same step on a batch of the same size (data parallel, FSDP):
        # the job's FLOPs are this rank's times the ranks, with no collective to wait for.
        self.shard_flops, self.full_model_flops = shard, shard * self._world
        p = self._view.params
        if p.rank_id == 0:
            shard_line = f"Shard model flops is {shard}, Shard hardware flops is {shard}."
            if self.full_flops:
                full = self.full_model_flops
                emit(f"Full model flops is {full}, Full hardware flops is {full}, {shard_line}")
            else:
                emit(shard_line)
        self._start_interval(step)
        self._view.tap.call_at(self._next_print(step), self._report)

    def _next_print(self, step: int) -> int:
        return (step // self.data_size + 1) * self.data_size

    def _start_interval(self, step: int) -> None:
        self._since, self._since_step, self._eval_seconds = time.perf_counter(), step, 0.0

    def _report(self, step: int) -> None:
        view = self._view
        steps = step - self._since_step
        seconds = (time.perf_counter() - self._since - self._eval_seconds) / max(steps, 1)
        flops = self.full_model_flops if self.full_flops else self.shard_flops
        devices = self._world if self.full_flops else 1
        mfu = flops / (seconds * self._peak * devices) if seconds > 0 else math.nan
        self.mfu = mfu
        p = view.params
        rows = _rows(p.get("train_dataset_element"))
        if p.rank_id == 0:
            emit(
                f"{p.mode.title()} per step time: {seconds * 1000:5.3f} ms "
                f"mfu:{_floored_percent(mfu)} hfu:{_floored_percent(mfu)}"
            )
            if mfu > 1 and not self._warned:
                self._warned = True
                warnings.warn(
                    f"FlopsUtilizationCollector: the MFU is {mfu:.3g} (over 1): 'computility' "
                    f"({self._peak:g} FLOP/s) is below what one device does; pass its peak.",
                    UserWarning,
                    stacklevel=2,
                )
        sink = view.sink
        if sink is not None:
            epoch = p.cur_epoch_num
            sink.log(names.FLOPS_PER_STEP, float(flops), step, epoch)
            sink.log(names.MFU, mfu, step, epoch)
            if rows is not None and seconds > 0:
                count, tokens = rows
                self.throughput = count * self._world / seconds
                key = names.TOKENS_PER_SECOND if tokens else names.SAMPLES_PER_SECOND
                sink.log(key, self.throughput, step, epoch)
            elif rows is None and not self._told_batch and p.rank_id == 0:
                self._told_batch = True
                warnings.warn(
                    "FlopsUtilizationCollector records no samples or tokens per second: the "
                    "run holds no batch. In a hand loop pass it: run.step(loss, batch=(x, y)) "
                    "(token ids as an integer tensor, or a dict's 'input_ids').",
                    UserWarning,
                    stacklevel=2,
                )
        self._start_interval(step)
        view.tap.call_at(self._next_print(step), self._report)

    # -- a validation pass is not training: out of the count and of the step time --------------
    def on_eval_begin(self, run_context: RunContext) -> None:
        self._eval_start = time.perf_counter()
        counter = self._counter
        if counter is not None:  # keep what was counted so far; count again after it
            counter.__exit__(None, None, None)
            self._counted += int(counter.get_total_flops())

    def on_eval_end(self, run_context: RunContext) -> None:
        self._eval_seconds += time.perf_counter() - self._eval_start
        if self._counter is not None:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_train_end(self, run_context: RunContext) -> None:
        self._release()

    def __exit__(self, *err: Any) -> None:
        self._release()

    def _release(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:  # a run that ended inside the counted step
            counter.__exit__(None, None, None)

    def __repr__(self) -> str:
        return (
            f"FlopsUtilizationCollector(data_size={self.data_size}, "
            f"computility={self.computility!r}, full_flops={self.full_flops})"
        )
