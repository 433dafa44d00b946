"""The run view: what whatever trains tells the monitors, in one typed object.

A trainer (``stepwatch.Model``'s loop, a hand-written loop through :func:`stepwatch.watch`, or
a bridge into another trainer) builds one :class:`RunView` per run and fills it once per step
and epoch. Monitors read the run from it: where training is, whether the run validates, the
epoch values under their one name each, the step losses (the :class:`~.tap.LossTap`), the
training state a rollback or snapshot works on, the run store they write to (the sink) and the
one alert path. ``cb_params`` stays MindSpore's face of the same run: ``cb_params.run_view``
is this object, and the per-step fields (``cur_step_num``, ``cur_epoch_num``, ...) are read
from cb_params, the one place they are set.
"""

from __future__ import annotations

from typing import Any

from ..monitor import values as names
from .alerts import AlertPath
from .host import HostControls, LearningRates, OptimizerRates, Sink, StateControl, params_state
from .tap import LossTap

__all__ = ["RunView", "view_of"]


class RunView:
    """One run, as the monitors see it.

    Args:
        params: the run's cb_params (where the per-step fields live).
        controls: what the trainer lets the monitors do (:class:`~.host.HostControls`: its
            name, state copies, learning rates, checkpoint writer, whether gradients are on
            the parameters); None: a cb_params built by hand, whose torch network and
            optimizer are used where there are any.
        rank / world: this process's rank and the number of processes.
        validates: the run validates (decides what a bare metric name means).
        fed: the host pushes every step's loss into :attr:`tap` (False for a cb_params built
            by hand, where nobody does).

    Attributes:
        tap: the step losses (:class:`~stepwatch.view.tap.LossTap`).
        alerts: the alert path (:class:`~stepwatch.view.alerts.AlertPath`).
        sink: the run store (a :class:`~.host.Sink`) while one is attached
            (:meth:`attach_sink`: ``RunRecorder`` on rank 0), or None.
        rollbacks: ``(restored_step, at_step)`` for each rollback an action did: the state is
            as after ``restored_step``; the steps after it up to ``at_step`` were undone. The
            one count of a run's rollbacks.
        controls: the trainer's :class:`~.host.HostControls`.
        metrics: the run's metric objects by name (``Model(metrics=...)``), for their names
            and the directions they declare; ``cb_params.metrics`` holds their values, as in
            MindSpore, from the end of an evaluation to the end of its epoch.
    """

    def __init__(
        self,
        params: Any,
        controls: HostControls | None = None,
        *,
        rank: int = 0,
        world: int = 1,
        validates: bool = False,
        fed: bool = True,
    ) -> None:
        self.params = params
        if controls is None:
            controls = HostControls("none", state=params_state(params))
        self.controls = controls
        self.rank, self.world = rank, world
        self.validates = validates
        self.fed = fed
        self.metrics: dict[str, Any] = {}
        self.tap = LossTap()
        self.alerts = AlertPath(self)
        self.sink: Sink | None = None
        self._rates: tuple[Any, OptimizerRates | None] = (None, None)
        # (restored_step, at_step) for each rollback an action did, in order.
        self.rollbacks: list[tuple[int, int]] = []

    # -- what the trainer lets monitors do (its controls) --------------------------------------
    @property
    def host(self) -> str:
        """What trains: ``'stepwatch'``, ``'loop'`` or a bridge's host name."""
        return self.controls.name

    @property
    def grads(self) -> bool:
        """Gradients are on the parameters when a step ends (gradient detectors need it)."""
        return self.controls.grads

    @property
    def config(self) -> dict[str, Any]:
        """The host trainer's own settings, stored with the run."""
        return self.controls.config

    @property
    def state(self) -> StateControl | None:
        """Copies and restores the training state (rollback), or None where the trainer
        cannot be restored mid-run."""
        return self.controls.state

    @property
    def rates(self) -> LearningRates | None:
        """The learning rates: the trainer's, else those of cb_params' torch optimizer, or
        None without an optimizer."""
        rates = self.controls.rates
        if rates is not None:
            return rates
        optimizer = self.params.get("optimizer")
        if optimizer is None or not hasattr(optimizer, "param_groups"):
            return None
        seen, made = self._rates
        if seen is not optimizer or made is None:
            made = OptimizerRates(optimizer)
            self._rates = (optimizer, made)
        return made

    def attach_sink(self, sink: Sink) -> None:
        """Write the run's alerts and other monitors' points to ``sink`` (a run store)."""
        self.sink = sink

    def detach_sink(self, sink: Sink) -> None:
        """Stop writing to ``sink``, if it is the one attached."""
        if self.sink is sink:
            self.sink = None

    # -- where training is (read from cb_params, where the host sets it) ------------------------
    @property
    def step(self) -> int:
        """The global step of the last step done (0 before the first)."""
        return int(self.params.cur_step_num)

    @property
    def epoch(self) -> int:
        """The current epoch, 1-based (0 before the first)."""
        return int(self.params.cur_epoch_num)

    @property
    def steps_per_epoch(self) -> int:
        return int(self.params.get("batch_num", 0) or 0)

    @property
    def epochs(self) -> int:
        """The run's last epoch number."""
        p = self.params
        return int(p.get("initial_epoch", 0) or 0) + int(p.get("epoch_num", 0) or 0)

    # -- epoch values ----------------------------------------------------------------------------
    def epoch_values(self, *, aliases: bool = True) -> dict[str, Any]:
        """This epoch's values under their names (:mod:`stepwatch.monitor.values`): ``loss``,
        ``train_<metric>``, ``eval_loss``, ``eval_<metric>`` and, with ``aliases``, the bare
        metric names. Values are as the host gave them (floats, or arrays per class)."""
        p = self.params
        return names.epoch_values(
            p.get("train_results"),
            p.get("eval_results"),
            validates=self.validates,
            aliases=aliases,
        )

    def numbers(self, *, aliases: bool = True) -> dict[str, float]:
        """:meth:`epoch_values` that are single numbers, as floats."""
        return names.numeric(self.epoch_values(aliases=aliases))

    def __repr__(self) -> str:
        return (
            f"RunView(host={self.host!r}, step={self.step}, epoch={self.epoch}, "
            f"rank={self.rank}/{self.world}, validates={self.validates})"
        )


def view_of(params: Any) -> RunView:
    """The run view of ``params`` (cb_params). A cb_params built by hand (no trainer) gets a
    view of its own on first use, with a tap nobody feeds."""
    view = params.__dict__.get("run_view")
    if view is None:
        view = RunView(
            params,
            rank=int(params.get("rank_id", 0) or 0),
            world=int(params.get("device_number", 1) or 1),
            validates=params.get("valid_dataset") is not None,
            fed=False,
        )
        params.run_view = view
    return view
