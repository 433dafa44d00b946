"""What one training step does besides forward, backward and ``optimizer.step()``: mixed
precision and loss scaling, gradient clipping, gradient accumulation and the LR schedule.

``Model`` turns its arguments into one :class:`StepOptions`; the loop reads it. MindSpore's
``amp_level`` and the PyTorch-style ``precision`` are two spellings of the same thing: each
resolves to a :class:`PrecisionConfig`, and nothing else in the loop knows which was used.

=============  ==================  ============================================================
amp_level      precision           what runs
=============  ==================  ============================================================
``"O0"``       ``"32"``            float32
``"O1"``       ``"bf16-mixed"`` /  autocast around forward and loss (float16 on CUDA, bfloat16
               ``"16-mixed"``      on CPU); no loss scaling
``"O2"``       ``"16-mixed"`` on   autocast plus dynamic loss scaling (float16 on CUDA);
               CUDA, else          on CPU bfloat16 autocast, which needs no scaling
               ``"bf16-mixed"``
``"O3"``       ``"bf16-true"`` /   the network cast to half precision (float16 on CUDA,
               ``"16-true"``       bfloat16 on CPU), float inputs cast with it
``"auto"``     (per device)        CUDA: ``"bf16-mixed"`` where supported, else ``"16-mixed"``;
                                   CPU: ``"32"``
=============  ==================  ============================================================
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .._validation import check_bool, check_int, check_number

__all__ = [
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
    "PrecisionConfig",
    "StepOptions",
    "resolve_precision",
]

AMP_LEVELS = ("O0", "O1", "O2", "O3", "auto")
PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


class LossScaleManager:
    """Base of the loss scale managers (MindSpore's names, on ``torch.amp.GradScaler``)."""

    def make_scaler(self, device: torch.device) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


class FixedLossScaleManager(LossScaleManager):
    """Scale the loss by a constant.

    Args:
        loss_scale: the constant (> 1 to be useful; MindSpore's default 128).
        drop_overflow_update: skip the optimizer step when a gradient overflowed (True, the
            default), or always step (the gradients are then divided by the scale unchecked).

    Raises:
        TypeError / ValueError: ``loss_scale`` not a number >= 1; ``drop_overflow_update`` not
            a bool.
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        value = check_number("loss_scale", loss_scale, minimum=1.0)
        assert value is not None
        self.loss_scale = float(value)
        self.drop_overflow_update = check_bool("drop_overflow_update", drop_overflow_update)

    def make_scaler(self, device: torch.device) -> Any:
        if not self.drop_overflow_update:
            return _ConstantScale(self.loss_scale)
        # A scale that never grows nor backs off; a step that overflows is skipped.
        return torch.amp.GradScaler(
            device.type,
            init_scale=self.loss_scale,
            growth_factor=1.0 + 1e-9,
            backoff_factor=1.0 - 1e-9,
            growth_interval=2**31 - 1,
        )

    def __repr__(self) -> str:
        return (
            f"FixedLossScaleManager(loss_scale={self.loss_scale}, "
            f"drop_overflow_update={self.drop_overflow_update})"
        )


class DynamicLossScaleManager(LossScaleManager):
    """Scale the loss dynamically: divide the scale by ``scale_factor`` on an overflow (the
    step is skipped), multiply it by ``scale_factor`` after ``scale_window`` good steps.

    Args:
        init_loss_scale: the starting scale (MindSpore's default 2**24).
        scale_factor: the factor (> 1).
        scale_window: good steps between increases (>= 1).

    Raises:
        TypeError / ValueError: for arguments of the wrong type or value.
    """

    def __init__(
        self, init_loss_scale: float = 2**24, scale_factor: float = 2, scale_window: int = 2000
    ) -> None:
        init = check_number("init_loss_scale", init_loss_scale, minimum=1.0)
        factor = check_number("scale_factor", scale_factor)
        assert init is not None and factor is not None
        if factor <= 1:
            raise ValueError(f"'scale_factor' must be a number > 1, but got {scale_factor!r}.")
        self.init_loss_scale = float(init)
        self.scale_factor = float(factor)
        self.scale_window = check_int("scale_window", scale_window, minimum=1)

    def make_scaler(self, device: torch.device) -> Any:
        return torch.amp.GradScaler(
            device.type,
            init_scale=self.init_loss_scale,
            growth_factor=self.scale_factor,
            backoff_factor=1.0 / self.scale_factor,
            growth_interval=self.scale_window,
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaleManager(init_loss_scale={self.init_loss_scale}, "
            f"scale_factor={self.scale_factor}, scale_window={self.scale_window})"
        )


class _ConstantScale:
    """A fixed scale that never skips a step (``drop_overflow_update=False``)."""

    def __init__(self, scale: float) -> None:
        self.scale_value = scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer: Any) -> None:
        inverse = 1.0 / self.scale_value
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inverse)

    def get_scale(self) -> float:
        return self.scale_value

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])


@dataclass(frozen=True)
class PrecisionConfig:
    """What ``amp_level`` / ``precision`` resolved to.

    Attributes:
        name: the PyTorch-style name (``'32'``, ``'bf16-mixed'``, ``'16-mixed'``,
            ``'bf16-true'``, ``'16-true'``).
        dtype: the half type used, or None for float32.
        autocast: run forward and loss under ``torch.autocast``.
        cast_network: the network (and float inputs) cast to ``dtype``.
        dynamic_scaling: dynamic loss scaling by default (float16 mixed precision).
    """

    name: str
    dtype: torch.dtype | None
    autocast: bool
    cast_network: bool
    dynamic_scaling: bool


def _did_you_mean(given: str, choices: tuple[str, ...]) -> str:
    for choice in choices:
        if choice.lower() == given.lower() or choice.startswith(given):
            return f"; did you mean {choice!r}?"
    return "."


def resolve_precision(amp_level: Any, precision: Any, device: torch.device) -> PrecisionConfig:
    """One :class:`PrecisionConfig` from MindSpore's ``amp_level`` or the PyTorch-style name.

    Raises:
        TypeError: not a str. ValueError: an unknown name, or both given and different.
    """
    if precision is not None:
        if not isinstance(precision, str):
            raise TypeError(
                f"'precision' must be a str, one of {PRECISIONS}, but got {precision!r} with "
                f"type '{type(precision).__name__}'."
            )
        name = "32" if precision in ("32", "32-true") else precision
        if name not in PRECISIONS:
            raise ValueError(
                f"'precision' must be one of {PRECISIONS}, but got "
                f"{precision!r}{_did_you_mean(precision, PRECISIONS)}"
            )
        if amp_level not in (None, "O0"):
            implied = resolve_precision(amp_level, None, device).name
            if implied != name:
                raise ValueError(
                    f"'amp_level'={amp_level!r} means precision={implied!r} on {device}, but "
                    f"'precision'={precision!r} was given too; pass one of them."
                )
    else:
        level = "O0" if amp_level is None else amp_level
        if not isinstance(level, str):
            raise TypeError(
                f"'amp_level' must be a str, one of {AMP_LEVELS}, but got {level!r} with type "
                f"'{type(level).__name__}'."
            )
        if level not in AMP_LEVELS:
            raise ValueError(
                f"'amp_level' must be one of {AMP_LEVELS}, but got "
                f"{level!r}{_did_you_mean(level, AMP_LEVELS)}"
            )
        cuda = device.type == "cuda"
        if level == "auto":
            if not cuda:
                name = "32"
            else:
                name = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
        elif level == "O0":
            name = "32"
        elif level in ("O1", "O2"):
            name = "16-mixed" if cuda else "bf16-mixed"
        else:
            name = "16-true" if cuda else "bf16-true"
    if name == "32":
        return FLOAT32
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16
    mixed = name.endswith("-mixed")
    # float16 mixed precision scales the loss unless told otherwise (O1 does not, as in
    # MindSpore: ``amp_level='O1'`` on CUDA is plain autocast).
    dynamic = dtype == torch.float16 and mixed and amp_level != "O1"
    return PrecisionConfig(name, dtype, mixed, not mixed, dynamic)


FLOAT32 = PrecisionConfig("32", None, False, False, False)


@dataclass
class StepOptions:
    """Everything the training step does beyond the plain fp32 step (from ``Model``)."""

    precision: PrecisionConfig = field(
        default_factory=lambda: PrecisionConfig("32", None, False, False, False)
    )
    scaler: Any = None
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    accumulate: int = 1
    lr_scheduler: Any = None
    lr_interval: str = "step"
    forward_network: Any = None  # the compiled network, when compile= is set

    @property
    def plain(self) -> bool:
        """True for the plain fp32 step (the loop then takes its fastest path)."""
        return (
            self.precision.dtype is None
            and self.scaler is None
            and self.clip_grad_norm is None
            and self.clip_grad_value is None
            and self.accumulate == 1
            and self.lr_scheduler is None
        )

    def autocast(self, device: torch.device) -> Any:
        """A context for forward and loss: autocast, or nothing."""
        if self.precision.autocast:
            return torch.autocast(device.type, dtype=self.precision.dtype)
        return contextlib.nullcontext()


def check_clip(name: str, value: Any) -> float | None:
    """A positive finite number or None."""
    number = check_number(name, value, allow_none=True)
    if number is None:
        return None
    if not number > 0 or math.isinf(number):
        raise ValueError(f"'{name}' must be a number > 0 (or None), but got {value!r}.")
    return float(number)


def found_inf(scaler: Any, optimizer: Any) -> torch.Tensor | None:
    """After ``scaler.unscale_(optimizer)``: a device tensor, non-zero if a gradient
    overflowed (no host read); None for a scale that never skips."""
    per_device = getattr(scaler, "_found_inf_per_device", None)
    if per_device is None:
        return None
    flags = list(per_device(optimizer).values())
    if not flags:
        return None
    return (
        flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()
    )


def scale_tensor(scaler: Any) -> Any:
    """The current loss scale without a host read: a copy of the scaler's device tensor (or a
    float for a constant scale)."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.detach().clone()
    return scaler.get_scale()


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors (in tuples, lists and dicts too) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floats(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def build_step_options(
    network: Any,
    optimizer: Any,
    device: torch.device,
    *,
    amp_level: Any = "O0",
    precision: Any = None,
    loss_scale_manager: Any = None,
    clip_grad_norm: Any = None,
    clip_grad_value: Any = None,
    accumulate_grad_batches: Any = 1,
    lr_scheduler: Any = None,
    lr_interval: Any = "step",
    compile: Any = False,
) -> StepOptions:
    """Check ``Model``'s step arguments and turn them into :class:`StepOptions`.

    Casts ``network`` in place for ``amp_level='O3'``; compiles it for ``compile``.

    Raises:
        TypeError / ValueError: an argument of the wrong type or value, naming it.
    """
    resolved = resolve_precision(amp_level, precision, device)
    if loss_scale_manager is not None and not isinstance(loss_scale_manager, LossScaleManager):
        if isinstance(loss_scale_manager, type) and issubclass(
            loss_scale_manager, LossScaleManager
        ):
            name = loss_scale_manager.__name__
            raise TypeError(
                f"'loss_scale_manager' is the class {name}, not an instance: pass {name}() instead."
            )
        raise TypeError(
            "'loss_scale_manager' must be a FixedLossScaleManager or DynamicLossScaleManager, "
            f"but got {loss_scale_manager!r} with type '{type(loss_scale_manager).__name__}'."
        )
    if loss_scale_manager is not None and resolved.dtype is None:
        how = (
            f"amp_level={amp_level!r} resolves to float32 on {device.type}"
            if amp_level not in (None, "O0")
            else "amp_level='O0'"
        )
        raise ValueError(
            "'loss_scale_manager' scales the loss of mixed-precision training, but this Model "
            f"trains in float32 ({how}); pass amp_level='O2' (or precision='16-mixed'), or "
            "drop the loss_scale_manager."
        )
    if loss_scale_manager is not None and resolved.dtype is torch.bfloat16:
        warnings.warn(
            "'loss_scale_manager' with bfloat16: bfloat16 has float32's range and needs no loss "
            "scaling, so the scaler only costs time here. Drop it, or train in float16 "
            "(precision='16-mixed', on CUDA) where scaling matters.",
            UserWarning,
            stacklevel=3,
        )
    if loss_scale_manager is None and resolved.dynamic_scaling:
        loss_scale_manager = DynamicLossScaleManager()
    scaler = loss_scale_manager.make_scaler(device) if loss_scale_manager is not None else None
    norm = check_clip("clip_grad_norm", clip_grad_norm)
    value = check_clip("clip_grad_value", clip_grad_value)
    if norm is not None and value is not None:
        raise ValueError(
            "pass one of 'clip_grad_norm' (scale all gradients down to this global norm) and "
            "'clip_grad_value' (clamp each gradient), not both."
        )
    accumulate = check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
    if lr_interval not in ("step", "epoch"):
        raise ValueError(f"'lr_interval' must be 'step' or 'epoch', but got {lr_interval!r}.")
    if lr_scheduler is not None:
        _check_scheduler(lr_scheduler, optimizer)
    if resolved.cast_network:
        assert resolved.dtype is not None
        network.to(resolved.dtype)
    forward = None
    if compile is not False:
        if compile is True:
            options: dict[str, Any] = {}
        elif isinstance(compile, dict):
            options = dict(compile)
        else:
            raise TypeError(
                "'compile' must be a bool or a dict of torch.compile options, but got "
                f"{compile!r} with type '{type(compile).__name__}'."
            )
        forward = _compile(network, options)
    return StepOptions(
        precision=resolved,
        scaler=scaler,
        clip_grad_norm=norm,
        clip_grad_value=value,
        accumulate=accumulate,
        lr_scheduler=lr_scheduler,
        lr_interval=lr_interval,
        forward_network=forward,
    )


def _check_scheduler(scheduler: Any, optimizer: Any) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "'lr_scheduler' is torch's ReduceLROnPlateau, which needs a metric at each step: "
            "use the callback stepwatch.ReduceLROnPlateau(monitor='eval_loss') instead."
        )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            "'lr_scheduler' must be a torch.optim.lr_scheduler scheduler (e.g. "
            f"StepLR(optimizer, 10)), but got {scheduler!r} with type "
            f"'{type(scheduler).__name__}'."
        )
    if optimizer is None or scheduler.optimizer is not optimizer:
        raise ValueError(
            "'lr_scheduler' is bound to another optimizer than the Model's: build it from the "
            "same optimizer, e.g. StepLR(optimizer, step_size=10)."
        )


def _compile(network: Any, options: dict[str, Any]) -> Any:
    """``torch.compile(network, **options)``, with an unknown option or mode named as the
    ``compile`` argument's (torch's own errors name neither the argument nor what it takes)."""
    import inspect

    known = [n for n in inspect.signature(torch.compile).parameters if n != "model"]
    unknown = [k for k in options if k not in known]
    if unknown:
        raise ValueError(
            f"'compile' has an unknown torch.compile option {unknown[0]!r}; it takes "
            f"{', '.join(known)}."
        )
    try:
        return torch.compile(network, **options)
    except RuntimeError as exc:
        raise ValueError(f"'compile' {options!r} is refused by torch.compile: {exc}") from None
