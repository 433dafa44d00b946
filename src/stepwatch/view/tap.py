"""The loss tap: the one buffer of a run's step losses.

Whatever trains pushes each step's loss tensor (detached, on its device) into the tap; every
monitor that needs step losses (``History``, ``PlotMonitor``, ``RunRecorder``,
``AnomalyMonitor``, ``ProgressBar``) reads them from here instead of keeping its own list.

The tap cuts its buffer into :class:`Chunk` s at the shortest interval any subscriber asks for:
one ``torch.stack`` per chunk, folded into the epoch's loss sum on the device, and, when
somebody reads values, one copy to the host (non-blocking on CUDA, with an event that says when
it has landed). Chunks are cut at multiples of the interval (step 8, 16, ... for an interval of
8), so every rank of a distributed run cuts at the same steps even when one rank flushes early.
A step with no chunk due costs a list append.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .._tensor import stack_losses

__all__ = ["DEFAULT_INTERVAL", "Chunk", "LossTap"]

# With nobody reading step losses, the buffer is folded into the epoch sum every this many
# steps: one stack and one add on the device per 256 steps.
DEFAULT_INTERVAL = 256


class Chunk:
    """Consecutive steps' losses, cut from the tap in one piece.

    Attributes:
        steps: the global steps (a ``range``).
        epoch: the epoch they belong to.
        device: the losses as one 1-D float32 tensor on the training device.
        host: the same on the CPU, possibly still being copied (until ``ready`` completes).
        ready: the CUDA event recorded after the copy, or None (the copy is done).
        span: ``(start, end)`` wall times of the chunk's steps.
    """

    __slots__ = ("device", "epoch", "host", "ready", "span", "steps")

    def __init__(
        self,
        steps: range,
        epoch: int,
        device: torch.Tensor,
        host: torch.Tensor | None,
        ready: Any,
        span: tuple[float, float],
    ) -> None:
        self.steps, self.epoch, self.device, self.host = steps, epoch, device, host
        self.ready, self.span = ready, span

    def __len__(self) -> int:
        return len(self.steps)

    def values(self) -> list[float]:
        """The losses as Python floats (waits for the host copy if it is still on its way)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        host = self.host if self.host is not None else self.device.cpu()
        return host.tolist()

    def __repr__(self) -> str:
        return f"Chunk(steps={self.steps.start}..{self.steps.stop - 1}, epoch={self.epoch})"


Subscriber = Callable[[Chunk], Any]


class LossTap:
    """The run's step losses, in one device buffer.

    Args:
        interval: the chunk interval with no subscriber (default 256).

    The host side pushes with :meth:`push` (or a loop appends to :attr:`pending`, which stays
    the same list, and calls :meth:`tick` when ``step % interval == 0``); monitors
    :meth:`subscribe` with the interval they need and get every chunk handed to them as it is
    cut.
    """

    def __init__(self, interval: int = DEFAULT_INTERVAL) -> None:
        self._base = 1 << (interval.bit_length() - 1)
        self.interval = self._base  # the host calls tick() at the multiples of this
        self.every = self._base  # a chunk is cut at the multiples of this
        self.pending: list[Any] = []
        self.next_step = 1  # the global step of pending[0]
        self.epoch = 0
        self.total: torch.Tensor | None = None  # the epoch's loss sum so far, on the device
        # Chunks not summed into total yet: folded together every DEFAULT_INTERVAL steps, so a
        # small chunk costs one stack, not a stack, a sum and an add.
        self._unsummed: list[torch.Tensor] = []
        self._unsummed_steps = 0
        self.last: Any = None  # the newest loss cut into a chunk
        self._subscribers: list[tuple[int, int, Subscriber, Callable[[], bool] | None]] = []
        self._dues: list[Callable[[], bool]] = []
        self._span_start = time.time()

    # -- subscribing ----------------------------------------------------------------------------
    def subscribe(
        self,
        every: int,
        fn: Subscriber,
        *,
        due: Callable[[], bool] | None = None,
        look_every: int | None = None,
    ) -> None:
        """Hand every chunk to ``fn``; chunks are cut at least every ``every`` steps (at the
        multiples of ``every`` rounded down to a power of two) and at each epoch's end.

        ``due``, asked every ``look_every`` steps (a power of two too), may ask for a chunk
        early (a recorder whose flush period has passed on slow steps): a look costs a call,
        a chunk costs a stack and a sum on the device.
        """
        if every < 1:
            raise ValueError(f"'every' must be an int >= 1, but got {every!r}.")
        # Rounded down to a power of two, so the shortest interval divides every other one:
        # the tap cuts at each subscriber's multiples, the same steps on every rank.
        every = _power_of_two(every)
        look = _power_of_two(look_every) if due is not None and look_every else every
        self._subscribers.append((every, look, fn, due))
        self._retune()

    def unsubscribe(self, fn: Subscriber) -> None:
        self._subscribers = [entry for entry in self._subscribers if entry[2] != fn]
        self._retune()

    def _retune(self) -> None:
        subs = self._subscribers
        self.every = min([self._base, *(e for e, _, _, _ in subs)])
        self.interval = min([self.every, *(look for _, look, _, _ in subs)])
        self._dues = [due for _, _, _, due in subs if due is not None]

    # -- the host side ----------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, next_step: int) -> None:
        """A new epoch starts; its first step is ``next_step``."""
        self.cut()
        self.epoch, self.next_step, self.total = epoch, next_step, None
        self._unsummed, self._unsummed_steps = [], 0

    def push(self, loss: Any) -> None:
        """Add the next step's loss (a detached tensor); cut a chunk when one is due."""
        pending = self.pending
        pending.append(loss)
        if (self.next_step + len(pending) - 1) % self.interval == 0:
            self.tick()

    def tick(self) -> None:
        """Called by the host at the multiples of :attr:`interval`: cut a chunk at the
        multiples of :attr:`every`, or when a subscriber's ``due`` asks for one."""
        if self.pushed_step % self.every == 0 or any(due() for due in self._dues):
            self.cut()

    @property
    def latest(self) -> Any:
        """The newest step loss (a device tensor), or None before the first step."""
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
        device = stack_losses(pending)
        pending.clear()  # the same list: a loop may hold it
        self._unsummed.append(device)
        self._unsummed_steps += len(device)
        if self._unsummed_steps >= DEFAULT_INTERVAL:
            self._fold()
        if not self._subscribers:
            return None
        host, ready = device, None
        if device.is_cuda:
            host = device.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        now = time.time()
        chunk = Chunk(range(first, self.next_step), self.epoch, device, host, ready,
                      (self._span_start, now))  # fmt: skip
        self._span_start = now
        for _, _, fn, _ in self._subscribers:
            fn(chunk)
        return chunk

    def _fold(self) -> None:
        parts = self._unsummed
        if not parts:
            return
        part = (torch.cat(parts) if len(parts) > 1 else parts[0]).sum()
        self.total = part if self.total is None else self.total + part
        self._unsummed, self._unsummed_steps = [], 0

    def end_epoch(self) -> torch.Tensor | None:
        """Cut what waits and return the epoch's loss sum (a device tensor), or None."""
        self.cut()
        self._fold()
        total, self.total = self.total, None
        return total


def _power_of_two(n: int) -> int:
    """``n`` rounded down to a power of two."""
    return 1 << (n.bit_length() - 1)
