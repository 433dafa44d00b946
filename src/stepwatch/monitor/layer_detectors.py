"""Detectors over per-layer statistics, sampled every few steps: vanishing gradients, dying
ReLUs and saturated tanh/sigmoid units. No PyTorch: they take a sequence of numbers, one per
layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._validation import _got, check_int
from ._detector import Alert, Detector, _check_fraction

__all__ = ["DyingReLU", "GradVanishing", "Saturation"]


def _per_layer(name: str, values: Any) -> list[float]:
    # plain floats: a network has tens of layers, where numpy's per-call cost dominates
    if type(values) is list:
        return [float(v) for v in values]
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"'{name}' must be a sequence of floats, one per layer, got {_got(values)}")
    if isinstance(values, np.ndarray):
        return values.astype(np.float64).ravel().tolist()
    return [float(v) for v in values]


class _PerLayer(Detector):
    def __init__(self, patience: int) -> None:
        super().__init__()
        self.patience = check_int("patience", patience, minimum=1)
        self._streak = self._first = 0
        self.names: Sequence[str] | None = None  # the layers' names, for messages

    @property
    def confirming(self) -> bool:
        """True when the condition was seen on the last sample but not yet on ``patience`` in
        a row: a host that samples every few steps can take the next samples sooner."""
        return 0 < self._streak < self.patience

    def _layer(self, index: int) -> str:
        names = self.names
        return (
            f"layer {index} ({names[index]})" if names and index < len(names) else f"layer {index}"
        )

    def _count(self, condition: bool, step: int) -> bool:
        # the episode also needs `patience` in a row; the alert names the streak's first step
        self._streak = self._streak + 1 if condition else 0
        if self._streak == 1:
            self._first = step
        return self._edge(self._streak >= self.patience)


class GradVanishing(_PerLayer):
    """Fires when a layer's gradient norm is under ``ratio`` x the largest layer's for
    ``patience`` samples in a row; clears on a sample with none that small. A norm of exactly
    zero is left out: that is a dead layer (:class:`DyingReLU`) or one that took no part in
    the step, not a vanishing gradient.

    Args:
        ratio: smallest healthy norm relative to the largest (default 1e-6: healthy networks
            spread 10-1000x; 12 sigmoid layers shrink by 0.25^11, about 2e-7).
        patience: consecutive samples (default 3), so one odd batch does not fire.
    """

    kind = "grad_vanishing"
    _advice = (
        "try ReLU-family activations, normalisation layers, residual connections "
        "or He/Xavier initialisation"
    )

    def __init__(self, ratio: float = 1e-6, patience: int = 3) -> None:
        super().__init__(patience)
        self.ratio = _check_fraction("ratio", ratio)

    def update(self, step: int, norms: Sequence[float], epoch: int | None = None) -> Alert | None:
        arr = _per_layer("norms", norms)
        top = max(arr) if arr else 0.0
        if not (math.isfinite(top) and top > 0.0):
            return None  # nothing to compare against; NonFinite covers NaN/Inf
        floor = self.ratio * top
        small = [i for i, v in enumerate(arr) if 0.0 < v < floor]
        if not self._count(bool(small), step):
            return None
        first = small[0]
        seen = (
            f"gradients vanish: {len(small)} layer(s) from {self._layer(first)} have norms under "
            f"{self.ratio:g}x the largest ({arr[first]:.3g} vs {top:.3g})"
        )
        return self._alert(self._first, epoch, seen, float(arr[first] / top))


class _LayerFraction(_PerLayer):
    """A detector of a fraction per layer (of units dead, of outputs at the rails) that a
    layer at or over ``threshold`` reaches."""

    def __init__(self, threshold: float, patience: int) -> None:
        super().__init__(patience)
        self.threshold = _check_fraction("threshold", threshold, one=True)

    def _layers_over(self, what: str, frac: list[float], step: int) -> list[int]:
        """The layers whose ``what`` fraction is at or over ``threshold``, on the sample that
        makes ``patience`` samples in a row with such a layer (the alert's turn); else []."""
        if frac and not (min(frac) >= 0.0 and max(frac) <= 1.0):
            raise ValueError(f"{what} fractions must be within [0, 1], but got {frac}.")
        layers = [i for i, v in enumerate(frac) if v >= self.threshold]
        return layers if self._count(bool(layers), step) else []


class DyingReLU(_LayerFraction):
    """Fires when some layer has (nearly) all of its units dead, i.e. their gradient is exactly
    zero, for ``patience`` consecutive samples. Clears on a sample where no layer is that dead.

    Args:
        threshold: dead fraction of a dead layer (default 0.99; healthy ReLU: 30-60% zeros).
        patience: consecutive samples (default 3).
    """

    kind = "dying_relu"
    _advice = "lower the learning rate, use LeakyReLU/GELU, or check initialisation and input scale"

    def __init__(self, threshold: float = 0.99, patience: int = 3) -> None:
        super().__init__(threshold, patience)

    def update(
        self, step: int, dead: Sequence[float], total: Sequence[float] | None = None,
        epoch: int | None = None,
    ) -> Alert | None:  # fmt: skip
        """``dead`` is a per-layer fraction in [0, 1], or a per-layer count with ``total``."""
        frac = _per_layer("dead", dead)
        if total is not None:
            frac = [d / max(t, 1.0) for d, t in zip(frac, _per_layer("total", total))]
        layers = self._layers_over("dead", frac, step)
        if not layers:
            return None
        first = layers[0]
        at = self._layer(first)
        seen = f"dying ReLU: {len(layers)} layer(s) from {at} have {frac[first]:.1%} dead"
        return self._alert(self._first, epoch, seen, float(frac[first]))


class Saturation(_LayerFraction):
    """Fires when some tanh or sigmoid layer has at least ``threshold`` of its outputs at the
    rails (|tanh| > 0.99; a sigmoid under 0.005 or over 0.995), where their gradient is all
    but 0, for ``patience`` consecutive samples: the tanh/sigmoid counterpart of a dying ReLU,
    typically from inputs that are not normalised or too large an initialisation. Clears on
    a sample where no layer is that saturated.

    Args:
        threshold: saturated fraction of a saturated layer (default 0.9).
        patience: consecutive samples (default 3).
    """

    kind = "saturation"
    _advice = (
        "normalise the inputs (zero mean, unit variance), use a smaller initialisation or "
        "learning rate, or put a normalisation layer before the activation"
    )

    def __init__(self, threshold: float = 0.9, patience: int = 3) -> None:
        super().__init__(threshold, patience)

    def update(
        self, step: int, saturated: Sequence[float], epoch: int | None = None
    ) -> Alert | None:
        """``saturated``: the fraction of each tanh/sigmoid layer's outputs at the rails."""
        frac = _per_layer("saturated", saturated)
        layers = self._layers_over("saturated", frac, step)
        if not layers:
            return None
        first = layers[0]
        seen = (
            f"saturated units: {len(layers)} activation layer(s) from {self._layer(first)} "
            f"have {frac[first]:.1%} of their outputs at the rails"
        )
        return self._alert(self._first, epoch, seen, float(frac[first]))
