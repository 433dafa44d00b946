"""The seam's controls: what whoever trains lets the monitors do, as small typed interfaces.

A trainer - ``stepwatch.Model``, a hand-written loop under :func:`stepwatch.watch`, or a bridge
into another trainer - fills one :class:`HostControls` per run; the run view
(:class:`~stepwatch.view.run.RunView`) carries it. Monitors read typed objects from it, never
attributes probed by name:

- :class:`StateControl`: an in-memory copy of the training state and putting one back
  (AnomalyMonitor's rollback). stepwatch's own loops give :class:`TorchState` (the network,
  optimizer, LR schedule and loss scaler, through :class:`~stepwatch.train.state.TrainingState`);
  a host whose state is not torch ``state_dict``s (Keras, MindSpore) gives its own.
- :class:`LearningRates`: the learning rate of each parameter group, read and written
  (``cb_params.lr``, the recorded ``lr``, ``reduce_lr``, ``ReduceLROnPlateau``,
  ``LearningRateScheduler``). A torch optimizer gives :class:`OptimizerRates`.
- ``save``: writes a checkpoint the trainer can load (the ``'snapshot'`` action).
- :class:`Sink`: the run store a run writes to (``RunRecorder`` attaches its writer).

Stopping is the driver's: :meth:`stepwatch.train.engine.RunEngine.step` and ``end_epoch``
return whether a callback asked to stop, and the driver sets its trainer's own flag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..train.state import TrainingState

__all__ = [
    "HostControls",
    "LearningRates",
    "OptimizerRates",
    "Sink",
    "StateControl",
    "TorchState",
]


@runtime_checkable
class StateControl(Protocol):
    """A trainer's training state, copied and put back in place (rollback)."""

    def capture(self) -> Any:
        """A copy of the weights and optimizer state (and what else the trainer keeps with
        them: LR schedule, loss scale) that stays as it is while training goes on."""
        ...

    def restore(self, saved: Any) -> None:
        """Put a :meth:`capture` copy back, in place."""
        ...


@runtime_checkable
class LearningRates(Protocol):
    """The learning rate of each of a trainer's parameter groups."""

    def get(self) -> list[float]:
        """The current rates, one per parameter group (at least one)."""
        ...

    def set(self, rates: Sequence[float]) -> None:
        """Set the rates, one per parameter group.

        Raises:
            ValueError: the trainer cannot set them (a rate it computes from a schedule).
        """
        ...


class Sink(Protocol):
    """The run store a run writes its points and events to
    (:class:`stepwatch.store.writer.RunWriter`)."""

    def log(self, key: str, value: Any, step: int, epoch: int | None = None) -> None:
        """Queue one point (a number or a one-value tensor, read later)."""
        ...

    def event(
        self,
        kind: str,
        message: str,
        step: int | None = None,
        epoch: int | None = None,
        level: str = "info",
        data: dict[str, Any] | None = None,
    ) -> None:
        """Queue one event (an alert, a note, a checkpoint saved)."""
        ...


Save = Callable[[Path], Path]


@dataclass
class HostControls:
    """What a trainer lets the monitors do, and what it tells about itself.

    Attributes:
        name: what trains: ``'stepwatch'`` (``Model``), ``'loop'`` (a hand-written loop), or a
            host's name (``'lightning'``), stored with the run as ``host``.
        state: copies and restores the training state in place, or None where the trainer
            cannot be restored mid-run (``'rollback'`` then stops instead).
        rates: the learning rates, or None (no optimizer).
        save: writes a checkpoint the trainer loads, to the given path stem, and returns the
            file's path (the ``'snapshot'`` action); None: stepwatch's own checkpoint.
        grads: gradients are on the network's torch parameters when a step ends (the gradient
            detectors need it).
        loss_scaler: the trainer's loss scaler (a ``torch.amp.GradScaler``) under mixed
            precision, or None: AnomalyMonitor then expects overflow steps.
        config: the trainer's own settings, stored with the run (JSON-clean).
    """

    name: str = "stepwatch"
    state: StateControl | None = None
    rates: LearningRates | None = None
    save: Save | None = None
    grads: bool = True
    loss_scaler: Any = None
    config: dict[str, Any] = field(default_factory=dict)


class OptimizerRates:
    """:class:`LearningRates` of a torch optimizer: its parameter groups' ``'lr'``."""

    __slots__ = ("optimizer",)

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def get(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def set(self, rates: Sequence[float]) -> None:
        groups = self.optimizer.param_groups
        if len(rates) != len(groups):
            raise ValueError(
                f"got {len(rates)} learning rates for an optimizer of {len(groups)} parameter "
                "groups; pass one rate per group."
            )
        for group, rate in zip(groups, rates):
            group["lr"] = rate


class TorchState:
    """:class:`StateControl` of torch training objects: rollback copies of the network, the
    optimizer, the LR schedule and the loss scaler, on the CPU (through
    :class:`~stepwatch.train.state.TrainingState`, which checkpoints use too)."""

    __slots__ = ("training",)

    def __init__(self, training: TrainingState) -> None:
        self.training = training

    def capture(self) -> Any:
        return self.training.capture(rng=False, callbacks=False, copy=True)

    def restore(self, saved: Any) -> None:
        self.training.restore(saved, copy=True)  # the copy stays as it was, for a later rollback


def params_state(params: Any) -> TorchState | None:
    """The :class:`TorchState` of a cb_params whose train network is a torch module (one
    built by hand, with no trainer to say), else None."""
    from torch import nn

    from ..train.state import TrainingState  # here: the training package imports the view

    if not isinstance(params.get("train_network"), nn.Module):
        return None
    return TorchState(TrainingState.of(params))
