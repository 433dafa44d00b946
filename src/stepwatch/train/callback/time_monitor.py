"""``TimeMonitor``: time per epoch and per step, printed at each epoch end."""

from __future__ import annotations

import time

from ..._validation import check_bool, check_int
from ._callback import Callback, RunContext
from ._print import emit

__all__ = ["TimeMonitor"]


class TimeMonitor(Callback):
    """Print ``Train epoch time: 455.595 ms, per step time: 113.899 ms`` after each epoch.

    The training epoch time counts the training steps only: in ``fit`` the validation pass is
    timed on its own (``Eval epoch time: ...``) and left out of the training figure. The epoch
    ends after the loop has read the epoch's loss from the device, so on a GPU the figure
    includes the queued work. Under ``torch.distributed`` only rank 0 prints (its own times; no
    collective is issued), unless ``all_ranks=True``: then every rank prints its own, the line
    prefixed with ``[rank N]`` (``DistributedMonitor`` compares the ranks' times).

    Args:
        data_size: steps per epoch to divide by; default the dataset's number of batches.
        data_time: also print the mean time per step spent waiting for the next batch,
            `` (data time: 0.120 ms)``.
        all_ranks: in a distributed run, print on every rank (prefixed) instead of rank 0 only.

    Raises:
        TypeError: ``data_size`` not an int or None; ``data_time`` or ``all_ranks`` not a bool.
        ValueError: ``data_size`` < 1.
    """

    rank_zero_only = True

    def __init__(
        self, data_size: int | None = None, data_time: bool = False, all_ranks: bool = False
    ) -> None:
        self.data_size = check_int("data_size", data_size, minimum=1, allow_none=True)
        self.data_time = check_bool("data_time", data_time)
        self.all_ranks = check_bool("all_ranks", all_ranks)
        self.rank_zero_only = not all_ranks
        self._prefix = ""
        self._train_start = 0.0
        self._eval_start = 0.0
        self._eval_outer_start = 0.0
        self._eval_seconds = 0.0
        if data_time:
            # Bound only when asked for, so the default monitor adds nothing to each step.
            self.on_train_step_begin = self._data_step_begin  # type: ignore[method-assign]
            self.on_train_step_end = self._data_step_end  # type: ignore[method-assign]
            self.on_eval_step_begin = self._data_step_begin  # type: ignore[method-assign]
            self.on_eval_step_end = self._data_step_end  # type: ignore[method-assign]
        # Per mode ("train" / "eval"): seconds waiting for data, steps, end of the last step.
        self._data: dict[str, list[float]] = {"train": [0.0, 0, 0.0], "eval": [0.0, 0, 0.0]}
        self._compile_shown = False

    def on_train_begin(self, run_context: RunContext) -> None:
        self._compile_shown = False
        p = run_context.cb_params
        self._prefix = f"[rank {p.rank_id}] " if self.all_ranks and p.device_number > 1 else ""

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self._eval_seconds = 0.0
        self._train_start = time.perf_counter()
        self._data["train"] = [0.0, 0, self._train_start]

    def _data_step_begin(self, run_context: RunContext) -> None:
        counts = self._data[run_context.cb_params.mode]
        counts[0] += time.perf_counter() - counts[2]
        counts[1] += 1

    def _data_step_end(self, run_context: RunContext) -> None:
        self._data[run_context.cb_params.mode][2] = time.perf_counter()

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        seconds = time.perf_counter() - self._train_start - self._eval_seconds
        steps = self.data_size or cb_params.batch_num
        compile_seconds = cb_params.get("compile_seconds")
        suffix = ""
        if compile_seconds is not None and not self._compile_shown:
            # A compiled network's first step compiles it: shown apart, so the step time is
            # the steady state's.
            self._compile_shown = True
            seconds -= compile_seconds
            steps = max(steps - 1, 1)
            suffix = f" (first step, with compile: {compile_seconds * 1000:5.3f} ms)"
        self._print("Train", seconds, steps, "train", suffix)

    def on_eval_begin(self, run_context: RunContext) -> None:
        self._eval_outer_start = time.perf_counter()

    def on_eval_epoch_begin(self, run_context: RunContext) -> None:
        self._eval_start = time.perf_counter()
        self._data["eval"] = [0.0, 0, self._eval_start]

    def on_eval_epoch_end(self, run_context: RunContext) -> None:
        cb_params = run_context.original_args()
        seconds = time.perf_counter() - self._eval_start
        self._print("Eval", seconds, cb_params.batch_num, "eval")

    def on_eval_end(self, run_context: RunContext) -> None:
        # Everything between the validation's begin and end is left out of the training time.
        self._eval_seconds += time.perf_counter() - self._eval_outer_start

    def _print(self, kind: str, seconds: float, steps: int, mode: str, suffix: str = "") -> None:
        epoch_ms = seconds * 1000
        line = f"{kind} epoch time: {epoch_ms:5.3f} ms"
        if steps:
            line += f", per step time: {epoch_ms / steps:5.3f} ms"
        waited, counted, _ = self._data[mode]
        if self.data_time and counted:
            line += f" (data time: {waited * 1000 / counted:5.3f} ms)"
        emit(self._prefix + line + suffix)
