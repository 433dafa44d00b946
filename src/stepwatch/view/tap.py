"""The loss tap: the one buffer of a run's step losses, and the run's step clock.

Whatever trains pushes each step's loss into the tap; every monitor that needs step losses
(``History``, ``PlotMonitor``, ``RunRecorder``, ``AnomalyMonitor``, ``ProgressBar``) reads them
from here instead of keeping its own list. A loss on the CPU is pushed as a Python float
(reading a CPU tensor waits for nothing, and a float keeps no tensor alive); a loss on an
accelerator as the detached tensor, never read on the step that made it.

The tap cuts its buffer into :class:`Chunk` s at the shortest interval any subscriber asks for.
Chunks are cut at multiples of the interval (step 8, 16, ... for an interval of 8), so every
rank of a distributed run cuts at the same steps even when one rank flushes early. A chunk of
floats costs a list copy; a chunk of device tensors one ``torch.stack``, folded into the
epoch's loss sum on the device, and, when somebody reads values, one copy to the host
(non-blocking on CUDA, with an event that says when it has landed).

The tap is also the run's step clock: a monitor that must look at the training state at some
step (the gradients every 128 steps, a copy of the weights every 50, a progress line once a
second) asks for it with :meth:`LossTap.call_at` instead of a step hook. The host compares its
step with :attr:`LossTap.wake` once per step and calls :meth:`LossTap.tick` when it is reached,
with ``cb_params`` filled for that step; a step with nothing due costs a list append and that
comparison.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .._tensor import stack_losses
from .._validation import check_callable, check_int, check_number

__all__ = ["DEFAULT_INTERVAL", "Chunk", "LossTap"]

# With nobody reading step losses, the buffer is cut (and folded into the epoch sum) every
# this many steps.
DEFAULT_INTERVAL = 256
# Rounds of calls made at one tick (a call asking for another at the same step); the rest
# wait for the next step.
_ROUNDS = 4
_NEVER = 1 << 62


class Chunk:
    """Consecutive steps' losses, cut from the tap in one piece.

    Attributes:
        steps: the global steps (a ``range``).
        epoch: the epoch they belong to.
        host: the losses on the host: a list of floats, or a 1-D float32 CPU tensor possibly
            still being copied (until ``ready`` completes). Read, never modify: every
            subscriber gets the same chunk.
        ready: the CUDA event recorded after the copy, or None (the copy is done).
        span: ``(start, end)`` wall times of the chunk's steps.
    """

    __slots__ = ("_device", "epoch", "host", "ready", "span", "steps")

    def __init__(
        self,
        steps: range,
        epoch: int,
        device: torch.Tensor | None,
        host: Any,
        ready: Any,
        span: tuple[float, float],
    ) -> None:
        self.steps, self.epoch, self._device, self.host = steps, epoch, device, host
        self.ready, self.span = ready, span

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def device(self) -> torch.Tensor:
        """The losses as one 1-D float32 tensor on the training device (a CPU tensor for a
        chunk of floats, built on first use)."""
        if self._device is None:
            self._device = torch.tensor(self.host, dtype=torch.float32)
        return self._device

    def values(self) -> list[float]:
        """The losses as Python floats (waits for the host copy if it is still on its way)."""
        host = self.host
        if type(host) is list:
            return host
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        if host is None:
            host = self.host = self.device.cpu()
        return host.tolist()

    def __repr__(self) -> str:
        return f"Chunk(steps={self.steps.start}..{self.steps.stop - 1}, epoch={self.epoch})"


Subscriber = Callable[[Chunk], Any]


class LossTap:
    """The run's step losses, in one buffer, and its step clock.

    Args:
        interval: the chunk interval with no subscriber (default 256).

    The host side pushes with :meth:`push` (or a loop appends to :attr:`pending`, which stays
    the same list, and calls :meth:`tick` once its step reaches :attr:`wake`); monitors
    :meth:`subscribe` with the interval they need and get every chunk handed to them as it is
    cut, and ask for a call at a step with :meth:`call_at`.
    """

    def __init__(self, interval: int = DEFAULT_INTERVAL) -> None:
        self._base = _power_of_two(interval)
        self.every = self._base  # a chunk is cut at the multiples of this
        self.pending: list[Any] = []
        self.next_step = 1  # the global step of pending[0]
        self.epoch = 0
        self.wake = self._base  # the host calls tick() once its step reaches this
        self._sum = 0.0  # the epoch's sum of float losses
        self._epoch_first = 1  # the epoch's first step
        self.total: torch.Tensor | None = None  # the epoch's sum of device losses so far
        # Device chunks not summed into total yet: folded together every DEFAULT_INTERVAL
        # steps, so a small chunk costs one stack, not a stack, a sum and an add.
        self._unsummed: list[torch.Tensor] = []
        self._unsummed_steps = 0
        self.last: Any = None  # the newest loss cut into a chunk
        self._subscribers: list[tuple[int, Subscriber]] = []
        self._timers: list[tuple[int, Callable[[int], Any]]] = []
        # A float loss not <= alarm (NaN included) wakes the tap on its step: see set_alarm.
        self.alarm = math.inf
        self._alarms: dict[int, float] = {}
        self._alarmed = False
        self._soonest = _NEVER  # the earliest step in _timers
        self._span_start = time.time()

    # -- subscribing ----------------------------------------------------------------------------
    def subscribe(self, every: int, fn: Subscriber) -> None:
        """Hand every chunk to ``fn``; chunks are cut at least every ``every`` steps (at the
        multiples of ``every`` rounded down to a power of two), at each epoch's end, and when
        a monitor calls :meth:`cut` (a recorder whose flush period has passed on slow steps,
        from a call on the clock)."""
        if every < 1:
            raise ValueError(f"'every' must be an int >= 1, but got {every!r}.")
        # Rounded down to a power of two, so the shortest interval divides every other one:
        # the tap cuts at each subscriber's multiples, the same steps on every rank.
        self._subscribers.append((_power_of_two(every), fn))
        self._retune()

    def unsubscribe(self, fn: Any) -> None:
        """Stop handing chunks to ``fn``, and drop the calls asked for of ``fn``, or of any
        method of ``fn`` when it is the object that subscribed (``tap.unsubscribe(self)``)."""

        def gone(each: Callable[..., Any]) -> bool:
            return each == fn or getattr(each, "__self__", None) is fn

        self._subscribers = [entry for entry in self._subscribers if not gone(entry[1])]
        self._timers = [entry for entry in self._timers if not gone(entry[1])]
        if self._alarms.pop(id(fn), None) is not None:
            self.alarm = min(self._alarms.values(), default=math.inf)
        self._retune()

    def set_alarm(self, owner: Any, level: float) -> None:
        """Wake the tap at once (cut a chunk that ends there) when a float loss is above
        ``level`` or not a number, instead of at the next interval: ``owner`` reads batches
        seldom but must see such a value on its step. The tap's :attr:`alarm` is the lowest
        level asked for; :meth:`unsubscribe` with ``owner`` drops it.

        Raises:
            TypeError: ``level`` is not a number. ValueError: it is NaN.
        """
        level = check_number("level", level)
        if math.isnan(level):
            raise ValueError(
                "'level' must be a number or +/-inf, not NaN; pass math.inf to be "
                "woken by non-finite losses only."
            )
        self._alarms[id(owner)] = level
        self.alarm = min(self._alarms.values())

    def alarmed(self) -> None:
        """A loss just pushed is not <= :attr:`alarm`: cut it into a chunk at this step (when
        somebody set an alarm)."""
        if self._alarms:
            self._alarmed = True
            self.wake = self.pushed_step

    def call_at(self, step: int, fn: Callable[[int], Any]) -> None:
        """Call ``fn(step)`` once, at the end of global step ``step`` (the next step when that
        one has passed): after its loss was pushed, with ``cb_params`` filled for it and the
        step's gradients still on the parameters. ``fn`` may ask again from there.

        Raises:
            TypeError: ``step`` is not an int, ``fn`` not callable. ValueError: ``step`` < 0.
        """
        if type(step) is not int or step < 0 or not callable(fn):  # (monitors re-arm often)
            check_int("step", step, minimum=0)
            check_callable("fn", fn, allow_none=False)
        self._timers.append((step, fn))
        self._soonest = min(self._soonest, step)
        if step < self.wake:
            self.wake = max(step, self.pushed_step + 1)

    def _retune(self) -> None:
        self.every = min([self._base, *(e for e, _ in self._subscribers)])
        self._rewake()

    def _rewake(self) -> None:
        step = self.pushed_step
        wake = (step // self.every + 1) * self.every
        soonest = min([at for at, _ in self._timers], default=_NEVER)
        self._soonest = soonest
        self.wake = max(min(wake, soonest), step + 1)

    # -- the host side ----------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, next_step: int) -> None:
        """A new epoch starts; its first step is ``next_step``."""
        self.cut()
        self.epoch, self.next_step, self.total = epoch, next_step, None
        self._epoch_first, self._sum = next_step, 0.0
        self._unsummed, self._unsummed_steps = [], 0
        self._rewake()

    def push(self, loss: Any) -> None:
        """Add the next step's loss (a float, or a detached tensor); :meth:`tick` when due."""
        pending = self.pending
        pending.append(loss)
        if type(loss) is float and not loss <= self.alarm:
            self.alarmed()
        if self.next_step + len(pending) - 1 >= self.wake:
            self.tick()

    def tick(self) -> None:
        """Called by the host once its step reaches :attr:`wake`: cut a chunk at the multiples
        of :attr:`every` (or at once after an alarm), then make the calls asked for up to this
        step."""
        step = self.pushed_step
        if self._alarmed or step % self.every == 0:
            self._alarmed = False
            self.cut()
        for _ in range(_ROUNDS):  # a call may ask for another at this step: make it too
            timers = self._timers
            if not timers or self._soonest > step:
                break
            self._timers = [entry for entry in timers if entry[0] > step]
            self._soonest = min([at for at, _ in self._timers], default=_NEVER)
            for at, fn in timers:
                if at <= step:
                    fn(step)
        self._rewake()

    @property
    def latest(self) -> Any:
        """The newest step loss (a float or a device tensor), or None before the first."""
        return self.pending[-1] if self.pending else self.last

    @property
    def pushed_step(self) -> int:
        """The global step of the newest loss pushed (0 before the first)."""
        return self.next_step + len(self.pending) - 1

    def cut(self) -> Chunk | None:
        """Cut the waiting losses into a chunk now (an epoch's end, a subscriber's flush)."""
        pending = self.pending
        if not pending:
            return None
        first = self.next_step
        self.next_step = first + len(pending)
        self.last = pending[-1]
        values = pending[:]
        pending.clear()  # the same list: a loop may hold it
        device: torch.Tensor | None = None
        host: Any = values
        ready = None
        # A float when every loss is one (a tensor among them makes it a tensor).
        total = sum(values) if type(values[0]) is float and type(values[-1]) is float else None
        if type(total) is float:
            self._sum += total
        else:
            device = stack_losses(values)
            self._unsummed.append(device)
            self._unsummed_steps += len(device)
            if self._unsummed_steps >= DEFAULT_INTERVAL:
                self._fold()
            host = device
            if device.is_cuda and self._subscribers:
                host = device.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
        if not self._subscribers:
            return None
        now = time.time()
        chunk = Chunk(
            range(first, self.next_step), self.epoch, device, host, ready, (self._span_start, now)
        )
        self._span_start = now
        for _, fn in self._subscribers:
            fn(chunk)
        return chunk

    def _fold(self) -> None:
        parts = self._unsummed
        if not parts:
            return
        part = (torch.cat(parts) if len(parts) > 1 else parts[0]).sum()
        self.total = part if self.total is None else self.total + part
        self._unsummed, self._unsummed_steps = [], 0

    def end_epoch(self) -> Any:
        """Cut what waits and return the epoch's loss sum (a float, or a device tensor when
        the losses were), or None when no step ran."""
        self.cut()
        self._fold()
        total, self.total = self.total, None
        host, self._sum = self._sum, 0.0
        if total is None:
            return host if self.next_step > self._epoch_first else None
        return total + host if host else total


def _power_of_two(n: int) -> int:
    """``n`` rounded down to a power of two."""
    return 1 << (n.bit_length() - 1)
