"""``stepwatch.Tensor``: the type of ``cb_params.net_outputs``.

A ``torch.Tensor`` subclass that adds MindSpore's ``asnumpy()`` so callback code written for
MindSpore (``if isinstance(loss, Tensor): loss = loss.asnumpy()``) runs unchanged. Operations on it
return plain ``torch.Tensor`` objects, so it adds no cost to the arithmetic users do with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ._validation import _got

__all__ = ["Tensor", "check_loss", "cpu_copy", "detached", "map_nested", "stack_losses"]


# Tensor dtypes NumPy has no type for (shown through float32).
_NOT_IN_NUMPY = frozenset({torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2})


class Tensor(torch.Tensor):
    """A ``torch.Tensor`` with MindSpore's ``asnumpy()``.

    ``float(t)``, comparisons with numbers and f-string formatting behave as for a number when
    the tensor holds one value; ``str(t)``, ``print(t)`` and ``f"{t}"`` show its NumPy value
    and ``repr(t)`` MindSpore's ``Tensor(shape=[], dtype=Float32, value= 0.5)``, as a
    MindSpore tensor prints. Reading the value of a tensor that lives on a GPU copies it to
    the host; stepwatch only hands you such a tensor, it never reads it for you on a quiet step.

    Example:
        >>> import torch, stepwatch
        >>> t = torch.tensor(0.5).as_subclass(stepwatch.Tensor)
        >>> t.asnumpy()
        array(0.5, dtype=float32)
        >>> f"{t:.2f}", f"{t}", t
        ('0.50', '0.5', Tensor(shape=[], dtype=Float32, value= 0.5))
    """

    # Results of operations are plain tensors: no per-op subclass dispatch cost.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, input_data: Any = None, dtype: Any = None) -> Tensor:
        """``Tensor(2.0)``, ``Tensor(np.ones(3))``, ``Tensor([1, 2], dtype=torch.int32)``: a
        tensor of the data, as MindSpore's ``Tensor(input_data, dtype=None)`` builds it (a
        Python float becomes float32, an int int64, an array keeps its dtype).

        Raises:
            TypeError: ``input_data`` None, or ``dtype`` neither a torch nor a NumPy dtype.
        """
        if input_data is None:
            raise TypeError(
                "Tensor() needs its data: Tensor(2.0), Tensor(np.ones(3)), Tensor([1, 2])."
            )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            try:
                dtype = torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
            except TypeError:
                raise TypeError(
                    f"Tensor's 'dtype' must be a torch or NumPy dtype (torch.float32, "
                    f"np.float32, 'float32'), but got {dtype!r}."
                ) from None
        data = torch.as_tensor(input_data, dtype=dtype)
        if data.requires_grad or data is input_data:
            data = data.detach()
        return data.as_subclass(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # __new__ built it

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        copied = torch.Tensor.clone(torch.Tensor.detach(self)).as_subclass(type(self))
        memo[id(self)] = copied
        return copied

    def asnumpy(self) -> np.ndarray:
        """Return the value as a NumPy array (copied to the host if needed)."""
        return torch.Tensor.detach(self).cpu().numpy()

    def __format__(self, format_spec: str) -> str:
        if not format_spec:
            return str(self)  # f"{loss}" prints as MindSpore's does: 0.29028413 for float32
        if self.dim() == 0:
            return format(self.item(), format_spec)
        return torch.Tensor.__format__(torch.Tensor.as_subclass(self, torch.Tensor), format_spec)

    def __str__(self) -> str:
        # As MindSpore's str(Tensor): the NumPy value's (a dtype NumPy lacks shown as float32)
        value = torch.Tensor.detach(self).cpu()
        if value.dtype in _NOT_IN_NUMPY:
            value = value.float()
        return str(value.numpy())

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]
        name = str(self.dtype).removeprefix("torch.")
        name = "BFloat16" if name == "bfloat16" else name[:1].upper() + name[1:]
        return f"Tensor(shape={list(self.shape)}, dtype={name}, value= {self})"  # MindSpore's


def as_stepwatch_tensor(value: Any) -> Any:
    """Wrap a torch tensor as a detached :class:`Tensor`; leave anything else as it is."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().as_subclass(Tensor)
    return value


def detached(value: Any) -> Any:
    """``value`` with its tensors detached: a tensor, or a dict (a model output) or tuple/list
    of them one level deep; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(v.detach() if isinstance(v, torch.Tensor) else v for v in value)
    return value


def map_nested(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj``'s nested dicts, lists and tuples rebuilt, with ``fn`` applied to every value in
    them that is none of the three (to ``obj`` itself when it is none of them)."""
    if isinstance(obj, dict):
        return {k: map_nested(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_nested(v, fn) for v in obj)
    return fn(obj)


def cpu_copy(value: Any) -> Any:
    """A tensor's copy on the CPU that shares nothing with it (detached); anything else as it
    is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def stack_losses(losses: list[Any]) -> torch.Tensor:
    """Step losses as one 1-D float32 tensor on their device (no host copy, no sync). The
    loop's losses (detached float32 scalars) are only stacked; anything else is read one by
    one (NaN where it is not a number)."""
    try:
        stacked = torch.stack(losses)
    except (TypeError, RuntimeError):  # not all tensors, or of different shapes or devices
        return torch.tensor([_loss_as_float(loss) for loss in losses], dtype=torch.float32)
    if stacked.dim() != 1 or stacked.dtype != torch.float32 or stacked.requires_grad:
        stacked = stacked.detach().float().reshape(-1)
    return stacked


def _loss_as_float(loss: Any) -> float:
    if isinstance(loss, (tuple, list)) and loss:
        loss = loss[0]
    try:
        if isinstance(loss, torch.Tensor):
            return float(loss.detach().reshape(-1)[0])
        return float(loss)
    except (TypeError, ValueError, RuntimeError, IndexError):
        return math.nan


def check_loss(call: str, loss: Any, what: str) -> None:
    """Refuse anything but a one-value loss tensor handed to ``call`` (``'run.step()'``).

    Raises:
        TypeError: ``loss`` is not a torch tensor (``loss.item()`` passed, say); ``what``
            names what to pass. ValueError: it holds more than one value.
    """
    if not isinstance(loss, torch.Tensor):
        hint = (
            "pass the tensor, not loss.item()"
            if isinstance(loss, (int, float)) or type(loss).__module__ == "numpy"
            else "pass the loss tensor itself (e.g. outputs['loss'] of a dict, or loss of a list)"
        )
        raise TypeError(f"{call}'s 'loss' must be {what}, but got {_got(loss)}; {hint}.")
    if loss.numel() != 1:
        raise ValueError(
            f"{call}'s 'loss' must hold one value, but got a tensor of shape "
            f"{tuple(loss.shape)}; pass the reduced loss (e.g. loss.mean())."
        )
