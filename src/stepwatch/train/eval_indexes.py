"""``Model(..., eval_network=..., eval_indexes=[i_loss, i_pred, i_label])``, as in MindSpore.

An eval network of MindSpore's kind takes the whole batch (``eval_network(*batch)``: data and
label, and any other column) and returns a tuple; ``eval_indexes`` says where in it the loss,
the prediction and the label are. The loss goes to the ``'loss'`` metric and to ``eval_loss``,
the prediction and the label to every other metric, and ``cb_params.net_outputs`` during the
pass is the eval network's whole output, as MindSpore shows it.
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import TypeAndValueError

__all__ = ["called_with", "check_eval_indexes", "eval_inputs", "pick_outputs"]

_BUILT = (0, 1, 2)  # what the evaluation Model builds from network and loss_fn returns


def check_eval_indexes(eval_indexes: Any, eval_network: Any) -> tuple[int, int, int] | None:
    """The checked ``eval_indexes``, or None when the evaluation needs none.

    Raises:
        TypeAndValueError: not a list of ints (MindSpore raises ValueError for the list, a
            TypeError at evaluation for its items: an instance of both).
        ValueError: not three items; without ``eval_network``, anything but ``[0, 1, 2]``.
    """
    if eval_indexes is None:
        return None
    if not isinstance(eval_indexes, (list, tuple)):
        raise TypeAndValueError(
            "'eval_indexes' must be a list of three ints - where the loss, the prediction and "
            f"the label are in eval_network's outputs - but got {eval_indexes!r} with type "
            f"'{type(eval_indexes).__name__}'."
        )
    if len(eval_indexes) != 3:
        raise ValueError(
            "'eval_indexes' must have three items (the positions of the loss, the prediction "
            f"and the label in eval_network's outputs), but got {list(eval_indexes)!r}."
        )
    for i, item in enumerate(eval_indexes):
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeAndValueError(
                f"'eval_indexes[{i}]' must be an int (a position in eval_network's outputs), "
                f"but got {item!r} with type '{type(item).__name__}'."
            )
    picked = (int(eval_indexes[0]), int(eval_indexes[1]), int(eval_indexes[2]))
    if eval_network is None:
        if picked == _BUILT:
            return None  # what the evaluation built from network and loss_fn gives anyway
        raise ValueError(
            f"'eval_indexes' {list(eval_indexes)!r} picks outputs of 'eval_network', but none "
            "was given: the evaluation built from network and loss_fn returns (loss, outputs, "
            "label), [0, 1, 2]. Pass eval_network=... (a module taking the whole batch and "
            "returning a tuple), or drop eval_indexes."
        )
    return picked


def eval_inputs(batch: Any) -> tuple[Any, ...]:
    """What a MindSpore eval network is called with: every column of the batch."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def called_with(network: Any, inputs: tuple[Any, ...]) -> str:
    """The note for an eval network that cannot take the whole batch."""
    return (
        f"(with 'eval_indexes', eval_network is called with the whole batch, as MindSpore "
        f"calls it: {type(network).__name__}({len(inputs)} columns); it must take them and "
        "return a tuple with the loss, the prediction and the label)"
    )


def pick_outputs(returned: Any, indexes: tuple[int, int, int]) -> tuple[Any, Any, Any]:
    """``(loss, prediction, label)`` from the eval network's output; the loss a scalar (a
    per-sample loss is averaged, as MindSpore's ``Loss`` metric does).

    Raises:
        ValueError: the output is not a tuple of at least three, an index is out of range, or
            the loss is not a scalar or a vector.
    """
    if not isinstance(returned, (tuple, list)) or len(returned) < 3:
        got = (
            f"{type(returned).__name__} of {len(returned)}"
            if isinstance(returned, (tuple, list))
            else type(returned).__name__
        )
        raise ValueError(
            "with 'eval_indexes', eval_network must return a tuple of at least three outputs "
            f"(loss, prediction and label among them), but it returned a {got}."
        )
    n = len(returned)
    for i, index in enumerate(indexes):
        if not -n <= index < n:
            raise ValueError(
                f"'eval_indexes[{i}]' is {index}, but eval_network returns {n} outputs "
                f"(positions 0..{n - 1})."
            )
    loss, prediction, label = (returned[i] for i in indexes)
    if isinstance(loss, torch.Tensor) and loss.dim() > 0:
        if loss.dim() != 1:
            raise ValueError(
                f"the loss at eval_indexes[0]={indexes[0]} must be a scalar or one value per "
                f"sample, but has shape {tuple(loss.shape)}; check eval_indexes."
            )
        loss = loss.float().mean()
    return loss, prediction, label
