"""The Keras bridge's rollback copies: a model's weights and its optimizer's variables."""

from __future__ import annotations

from typing import Any

__all__ = ["capture", "restore"]


def _variables(model: Any) -> list[Any]:
    """The model's weights (trainable or not) and its optimizer's variables, in order."""
    optimizer = getattr(model, "optimizer", None)
    return [*model.weights, *(optimizer.variables if optimizer is not None else [])]


def capture(model: Any) -> list[Any]:
    """A copy of every weight and optimizer variable (slots, ``iterations``, the rate)."""
    return [v.numpy().copy() for v in _variables(model)]


def restore(model: Any, saved: list[Any]) -> None:
    """Assign a :func:`capture` copy back, in place.

    Raises:
        RuntimeError: the model or its optimizer has other variables than when it was taken.
    """
    variables = _variables(model)
    if len(variables) != len(saved):
        raise RuntimeError(
            f"keras.StepwatchCallback: the model has {len(variables)} weights and optimizer "
            f"variables now and had {len(saved)} when the copy was taken; cannot roll back"
        )
    for variable, value in zip(variables, saved):
        variable.assign(value)
