"""What :class:`~.anomaly.AnomalyMonitor` measures of the gradients and the activations, and
how it judges them.

:class:`GradStats` measures the per-row gradient norms of every layer on the device, packed in
one tensor (one transfer to the host). In a distributed run the measurement is a partial sum
of squares that one all_reduce completes (:meth:`GradStats.finish`): under FSDP2
(``fully_shard``: the parameters and their gradients are ``DTensor`` s) each rank holds some
rows of a layer, or some columns of every row, and writes its rows' sums of squares where the
rows sit in the full tensor; a replicated gradient (DDP) is written by every rank divided by
the number of copies. After the sum every rank holds the full model's row norms: the layer
norms of the full tensors, the global norm ``clip_grad_norm_`` computes, the same numbers on
every rank. A NaN or inf on any rank's shard survives the sum (a sum with a non-finite term is
non-finite), so it is seen on every rank.

:class:`ActivationStats` measures the fraction of tanh/sigmoid outputs at their rails, and
:class:`GradientWatch` owns both, the gradient detectors and the recent window of norms.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...monitor.detectors import (
    Alert,
    Detector,
    DyingReLU,
    GradExplosion,
    GradVanishing,
    NonFinite,
    Saturation,
)

__all__ = ["ActivationStats", "GradStats", "GradientWatch"]

logger = logging.getLogger("stepwatch")


class GradStats:
    """Per-layer gradient statistics, measured on the device in one op per layer and packed in
    one tensor, so they reach the host in one transfer.

    A *layer* is a trainable parameter with two or more dimensions (a weight matrix or a
    convolution kernel); a network without any is measured parameter by parameter. For each
    output unit (row) of each layer the device computes its gradient's norm; the host sums
    them into the layer's norm and counts the rows whose gradient is exactly zero, which is a
    dead ReLU unit's signature. The other trainable parameters (biases, normalisation scales)
    are measured whole, one norm each: they count in the global norm, which is the norm of
    every gradient (what ``torch.nn.utils.clip_grad_norm_`` computes), not in a layer's.

    Args:
        network: the network whose parameters' gradients are measured.
        world: the number of processes; above 1 a measurement holds partial sums of squares
            to be summed over the ranks (one all_reduce) and completed by :meth:`finish`.
    """

    def __init__(self, network: torch.nn.Module, world: int = 1) -> None:
        named = [(n, p) for n, p in network.named_parameters() if p.requires_grad]
        layers = [(n, p) for n, p in named if p.dim() >= 2] or named
        self.names = [n for n, _ in layers]
        self.params = [p for _, p in layers]
        self.world = world
        # rows of the full tensor (a DTensor's shape is the full one)
        self.rows = [max(1, p.shape[0]) if p.dim() else 1 for p in self.params]
        self._matrix = [p.dim() == 2 and p.shape[0] > 0 for p in self.params]  # no reshape op
        self._starts = [0, *itertools.accumulate(self.rows)][:-1]
        self._rows = sum(self.rows)
        # the other parameters, one norm each after the rows
        self.rest = [p for _, p in named if not any(p is q for q in self.params)]
        self._size = self._rows + len(self.rest)
        self._buffer: torch.Tensor | None = None  # the measurement, reused
        self._views: list[torch.Tensor] = []
        self._shape = (-2, 0)  # the buffer's device index and length
        self._rest_views: list[torch.Tensor] = []
        # Distributed: where each rank's rows go and what its sums count for, per layer, and
        # what the other parameters' sums count for (from the gradients' placements).
        self._parts: list[tuple[int, int, float]] | None = None
        self._rest_shares: list[float] | None = None

    @property
    def size(self) -> int:
        """The number of norms in a measurement (before the extra values)."""
        return self._size

    def measure(self, extra: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
        """``[row norms of each layer..., norms of the other parameters..., extra...]`` on
        the device in one 1-D float32 tensor, or None when some layer has no gradient yet.
        ``extra``: single values (0-d tensors on the same device) to pack with them. In a
        distributed run: this rank's share of the squared norms and of the extra values, to
        be summed over the ranks and given to :meth:`finish`.

        The tensor is the same buffer at each call (written in place, one op a parameter and
        no concatenation): read or copy it before the next measurement."""
        params = self.params
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or len(grads) < len(params):
            return None
        rest = [p.grad for p in self.rest]  # (one without a gradient counts 0)
        if self.world > 1:
            return self._measure_shares(grads, rest, extra)
        buffer, views = self._ready(grads[0], len(extra))
        norm = torch.linalg.vector_norm
        f32 = torch.float32
        for g, r, matrix, out in zip(grads, self.rows, self._matrix, views):
            g = g if matrix else g.reshape(r, -1)
            if g.dtype is torch.float64:  # (norm's dtype= does not narrow)
                out.copy_(norm(g, dim=1))
            else:
                norm(g, dim=1, dtype=f32, out=out)
        for other, out in zip(rest, self._rest_views):
            if other is None:
                out.zero_()
            elif other.dtype is torch.float64:
                out.copy_(norm(other))
            else:
                norm(other, dtype=f32, out=out)
        if extra:
            torch.stack(list(extra), out=buffer[self._size :])
        return buffer

    def _ready(self, grad: torch.Tensor, extra: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The measurement buffer for gradients on ``grad``'s device, and its per-layer views."""
        where, size = grad.get_device(), self._size + extra  # (-1: the CPU)
        if self._buffer is None or (where, size) != self._shape:
            self._shape = (where, size)
            self._buffer = torch.empty(size, dtype=torch.float32, device=grad.device)
            self._views = [self._buffer[s : s + r] for s, r in zip(self._starts, self.rows)]
            self._rest_views = [self._buffer[i] for i in range(self._rows, self._size)]
        return self._buffer, self._views

    def _measure_shares(
        self,
        grads: list[torch.Tensor],
        rest: list[torch.Tensor | None],
        extra: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """This rank's share of a distributed measurement: each layer's local rows' sums of
        squares at their rows in the full tensor (zero elsewhere), and each other parameter's
        local sum of squares, times the share of a replicated gradient; the extra values
        divided by the number of ranks (their mean after the sum)."""
        locals_ = [_local(g) for g in grads]
        if self._parts is None:
            self._parts = [_part(g, self.world) for g in grads]
        if self._rest_shares is None:
            self._rest_shares = [1.0 if g is None else _part(g, self.world)[2] for g in rest]
        buffer, views = self._ready(locals_[0], len(extra))
        buffer.zero_()
        norm = torch.linalg.vector_norm
        for g, (offset, rows, share), out in zip(locals_, self._parts, views):
            if not rows or not g.numel():
                continue
            squares = norm(g.reshape(rows, -1).float(), dim=1).square_()
            if share != 1.0:
                squares.mul_(share)
            out[offset : offset + rows].copy_(squares)
        for other, share, out in zip(rest, self._rest_shares, self._rest_views):
            if other is not None:
                local = _local(other)
                if local.numel():
                    out.copy_(norm(local.float()).square() * share)
        if extra:
            shares = buffer[self._size :]
            torch.stack(list(extra), out=shares)
            shares.div_(self.world)
        return buffer

    def finish(self, summed: torch.Tensor) -> torch.Tensor:
        """A distributed measurement summed over the ranks: the row norms (the square roots of
        the summed squares) and the extra values, as a measurement of one process."""
        out = summed.to(torch.float32)
        out[: self._size].sqrt_()
        return out

    def split(self, host: torch.Tensor) -> tuple[float, list[float], list[float], list[float]]:
        """``(global norm, norms, dead fractions, extra values)`` from a measurement on the
        host."""
        values = host.tolist()
        norms, dead = [], []
        for start, rows in zip(self._starts, self.rows):
            layer = values[start : start + rows]
            norms.append(math.hypot(*layer))
            dead.append(layer.count(0.0) / rows)
        others = values[self._rows : self._size]
        return math.hypot(*norms, *others), norms, dead, values[self._size :]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The part of ``grad`` this rank holds (a DTensor's local shard; a tensor itself)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _part(grad: torch.Tensor, world: int) -> tuple[int, int, float]:
    """``(first row, rows, share)`` of this rank's part of ``grad`` in the full tensor's rows:
    a DTensor's local shard starts at its global offset along dim 0 (a shard along another
    dim holds every row, partly); a replicated gradient counts ``1/copies`` on every rank, so
    that the sum over the ranks counts it once."""
    if not hasattr(grad, "placements"):  # a plain tensor: the same on every rank (DDP)
        return 0, max(1, grad.shape[0]) if grad.dim() else 1, 1.0 / world
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = grad.device_mesh, grad.placements  # type: ignore[attr-defined]
    shape, offset = compute_local_shape_and_global_offset(grad.shape, mesh, placements)
    copies = 1
    for size, placement in zip(mesh.shape, placements):
        if not isinstance(placement, Shard):
            copies *= size  # replicated over this mesh dimension
    # ranks outside the gradient's mesh hold none of it; those in it count 1/copies each
    copies *= world // max(1, mesh.size())
    if not shape:
        return 0, 1, 1.0 / copies
    return int(offset[0]), int(shape[0]), 1.0 / copies


class ActivationStats:
    """The fraction of each tanh/sigmoid module's outputs at the rails (|tanh| > 0.99, a
    sigmoid within 0.005 of 0 or 1), measured on the device in the forward pass after
    :meth:`arm` and taken with the gradient statistics: forward hooks exist only between the
    two, so a step that is not sampled runs no hook. A module used twice keeps its larger
    fraction. Not for a compiled network (a hook there would recompile it)."""

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self.names = [n for n, _ in modules]
        self.modules = [m for _, m in modules]
        self._handles: list[Any] = []
        self._seen: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, network: torch.nn.Module) -> ActivationStats | None:
        """The statistics of ``network``'s tanh/sigmoid modules; None when it has none."""
        if hasattr(network, "_orig_mod"):
            return None
        found = [(n, m) for n, m in network.named_modules() if isinstance(m, (nn.Tanh, nn.Sigmoid))]
        return cls(found) if found else None

    def arm(self) -> None:
        if not self._handles:
            self._handles = [
                m.register_forward_hook(functools.partial(self._hook, i))
                for i, m in enumerate(self.modules)
            ]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.numel():
            return
        with torch.no_grad():
            y = output.detach()
            if isinstance(module, nn.Sigmoid):
                y = y * 2.0 - 1.0
            frac = (y.abs() > 0.99).float().mean()
            prev = self._seen.get(index)
            self._seen[index] = frac if prev is None else torch.maximum(prev, frac)

    def take(self) -> list[torch.Tensor]:
        """The fractions (one 0-d tensor per module) when every module was seen, else none;
        the hooks are removed."""
        self.disarm()
        seen, self._seen = self._seen, {}
        if len(seen) < len(self.modules):
            return []
        return [seen[i] for i in range(len(self.modules))]


class GradientWatch:
    """The gradient half of AnomalyMonitor: the measurements (:class:`GradStats`, with
    :class:`ActivationStats` riding on them), the detectors that judge them (explosion,
    vanishing, dying ReLU, saturation, and a non-finite norm), and the recent norms a snapshot
    keeps.

    Args:
        detectors: the monitor's detectors (the gradient ones are taken from them).
        window: measurements kept for a snapshot.
        nonfinite: judge the global norm for NaN/inf (the ``nonfinite`` kind is on).
    """

    def __init__(self, detectors: Sequence[Detector], window: int, nonfinite: bool) -> None:
        self.explosion = _first(detectors, GradExplosion)
        self.vanishing = _first(detectors, GradVanishing)
        self.dying = _first(detectors, DyingReLU)
        self.saturation = _first(detectors, Saturation)
        self.nonfinite = NonFinite("gradient norm") if nonfinite else None
        self.wanted = any((self.explosion, self.vanishing, self.dying, self.saturation))
        self.window = window
        self.reset()

    def reset(self) -> None:
        """Forget the last run (the detectors are reset by the monitor, which owns them all)."""
        if self.nonfinite is not None:
            self.nonfinite.reset()
        self.stats: GradStats | None = None
        self.acts: ActivationStats | None = None
        self.scaled = False  # under loss scaling an overflowing gradient is expected
        self.history: dict[str, deque[Any]] = {
            key: deque(maxlen=self.window) for key in ("grad_step", "grad_norm")
        }

    @property
    def measuring(self) -> bool:
        """The gradients of this run are measured."""
        return self.stats is not None

    def begin(self, network: Any, view: Any, scaled: bool) -> None:
        """Measure ``network``'s gradients in this run, where its host gives them."""
        self.scaled = scaled
        if not self.wanted:
            return
        if network is None or not view.grads:
            _note_no_gradients(view, self._layer_detectors())
            return
        self.stats = GradStats(network, view.world)
        for detector in (self.vanishing, self.dying):
            if detector is not None:
                detector.names = self.stats.names
        if self.saturation is not None:
            self.acts = ActivationStats.of(network)
            self.saturation.names = self.acts.names if self.acts else None

    def _layer_detectors(self) -> list[Detector | None]:
        return [self.explosion, self.vanishing, self.dying, self.saturation]

    def measure(self, host_norm: Any = None) -> torch.Tensor | None:
        """This step's measurement on the device (the activations' fractions and the
        trainer's own global norm packed with the gradients'), or None when some layer has no
        gradient yet.

        ``host_norm``: the global gradient norm before clipping, where the trainer computes
        it (``cb_params.grad_norm``: ``Model`` with ``clip_grad_norm``, the Hugging Face
        Trainer); the explosion and non-finite detectors judge it instead of the measured
        norm, which is that of the gradients after clipping."""
        if self.stats is None:
            return None
        acts = self.acts.take() if self.acts is not None else ()
        where = self.stats.params[0].device  # (a DTensor's: its local shard's)
        return self.stats.measure([*acts, _norm_slot(host_norm, where)])

    def arm(self) -> None:
        """Hook the activations of the next forward pass."""
        if self.acts is not None:
            self.acts.arm()

    def disarm(self) -> None:
        """No hook left on the network."""
        if self.acts is not None:
            self.acts.disarm()

    @property
    def confirming(self) -> bool:
        """A layer detector has seen its condition, not yet for its whole patience."""
        return any(
            d is not None and d.confirming for d in (self.vanishing, self.dying, self.saturation)
        )

    @property
    def warming_up(self) -> bool:
        """The explosion detector gathers its first norms."""
        return self.explosion is not None and self.explosion.warming_up

    def judge(
        self, step: int, epoch: int, host: torch.Tensor, loss_nonfinite: NonFinite | None
    ) -> list[Alert]:
        """The alerts of a measurement on the host (``loss_nonfinite``: the loss's NaN
        detector, whose episode a non-finite norm belongs to when it is already in one)."""
        assert self.stats is not None
        total, norms, dead, extra = self.stats.split(host)
        saturated, fed = extra[:-1], extra[-1]
        if fed != _NO_NORM:  # the trainer's own norm, before clipping (NaN stays NaN)
            total = fed
        self.history["grad_step"].append(step)
        self.history["grad_norm"].append(total)
        nonfinite = None
        if self.nonfinite is not None and not self.scaled:
            nonfinite = self.nonfinite.update(step, total, epoch)
            if loss_nonfinite is not None and loss_nonfinite.in_episode:
                nonfinite = None  # the same episode, raised from the loss already
        explosion = self.explosion.update(step, total, epoch) if self.explosion else None
        found = [nonfinite, explosion]
        # a norm of exactly 0 (a loss of exactly 0: nothing flowed back) says nothing of dead
        # units or vanishing layers
        if math.isfinite(total) and total > 0.0:
            if self.vanishing is not None:
                found.append(self.vanishing.update(step, norms, epoch))
            if self.dying is not None:
                found.append(self.dying.update(step, dead, epoch=epoch))
            if self.saturation is not None and saturated:
                found.append(self.saturation.update(step, saturated, epoch))
        return [a for a in found if a is not None]

    @property
    def in_nonfinite_episode(self) -> bool:
        """A non-finite gradient norm was raised and has not cleared."""
        return self.nonfinite is not None and self.nonfinite.in_episode


# In a measurement's last slot: the trainer gave no norm of its own (a norm is >= 0 or NaN).
_NO_NORM = -1.0


def _norm_slot(norm: Any, device: torch.device) -> torch.Tensor:
    """The trainer's own global gradient norm as a measurement's extra value: a 0-d float32
    tensor on ``device`` (:data:`_NO_NORM` when it gave none). A DTensor norm is made whole
    first."""
    if norm is None:
        return torch.full((), _NO_NORM, device=device)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if isinstance(norm, torch.Tensor):
        return norm.detach().reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(norm), device=device)


def _first(detectors: Sequence[Detector], cls: type[Any]) -> Any:
    return next((d for d in detectors if isinstance(d, cls) and d.kind == cls.kind), None)


def _note_no_gradients(view: Any, detectors: Sequence[Any]) -> None:
    """Say once, on rank 0, that a host without gradients (nor the network) turns the
    gradient and activation detectors off."""
    if view.rank == 0:
        kinds = "/".join(d.kind for d in detectors if d is not None and d.kind != "saturation")
        also = any(d is not None and d.kind == "saturation" for d in detectors)
        logger.info(
            "AnomalyMonitor: %s gives no gradients, so the %s detectors are off%s",
            view.host,
            kinds,
            " (and saturation, which rides on their sampled steps)" if also else "",
        )
