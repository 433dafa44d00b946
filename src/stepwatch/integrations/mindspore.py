"""stepwatch's callbacks inside MindSpore's own ``Model.train`` / ``Model.fit``.

Keep training in MindSpore; hand stepwatch's monitors to it through one MindSpore callback::

    import mindspore as ms
    from stepwatch import AnomalyMonitor, LossMonitor, RunRecorder
    from stepwatch.integrations.mindspore import StepwatchCallback

    model = ms.train.Model(net, loss_fn, optimizer, metrics={"mae"})
    model.fit(3, train_ds, valid_ds, callbacks=[
        StepwatchCallback([RunRecorder(db="runs.db"), AnomalyMonitor(), LossMonitor(10)])])

then ``stepwatch serve runs.db`` shows the run in the dashboard (MindInsight's place). Your own
MindSpore callbacks go to ``model.fit`` as before, next to the bridge.

What the bridge reads from MindSpore's cb_params, at every ``on_train_step_end``:

- the step (``cur_step_num``), the epoch (``cur_epoch_num``: a run resumed with
  ``initial_epoch`` is numbered from there, as MindSpore numbers it), ``batch_num`` and
  ``epoch_num``;
- the loss: ``net_outputs`` (its first element when the train network returns a tuple, as
  under loss scaling). MindSpore hands callbacks a MindSpore tensor, and stepwatch's monitors
  read torch tensors, so each step's loss is copied to the host once (``asnumpy``). On CPU
  that costs nothing; on a device it is the one read MindSpore's own ``LossMonitor`` does too;
- the learning rate: the optimizer's ``learning_rate`` (``get_lr()`` for a dynamic rate);
- under ``fit``, ``eval_results`` after each epoch's validation, as ``eval_loss`` and
  ``eval_<metric>``;
- the rank and the number of devices (``device_number``; the rank from
  ``mindspore.communication.get_rank()`` when it is more than one).

What MindSpore does not give, and what follows:

- **No gradients.** MindSpore's cb_params holds no gradients, so AnomalyMonitor's gradient
  detectors (explosion, vanishing, dying) are off, with one log note. The loss detectors
  (nonfinite, spike, divergence, plateau) and epoch thresholds work.
- **Rollback** copies every parameter of the train network (the weights and the optimizer's
  moments, step and learning rate, all MindSpore parameters) every ``rollback_every`` steps
  and sets them back in place; ``Model.train`` goes on with the next batches.
- **Dataset sink mode** calls callbacks once per sink, not once per step: each call is
  recorded as one step, with the loss MindSpore hands over.

The actions, on MindSpore's controls:

- ``'stop'``: ``run_context.request_stop()``; ``Model.train`` leaves its loop after the step.
- ``'reduce_lr'`` (and ``ReduceLROnPlateau``): the optimizer's ``learning_rate`` parameter
  is set anew; a dynamic (per-step list or schedule) rate cannot be, and the alert says so.
- ``'snapshot'``: ``mindspore.save_checkpoint(train_network, ...)``, a ``.ckpt`` that
  ``mindspore.load_checkpoint`` reads.

A run that fails inside ``Model.train`` is stored as ``failed`` (``interrupted`` for
Ctrl-C): MindSpore's callback manager hands the error to the bridge on its way out.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mindspore
import numpy as np
import torch

from ..monitor import values as names
from ..view.host import HostControls
from ._bridge import Bridge, BridgeFace, Host, RateFunctions, clean_config

__all__ = ["StepwatchCallback"]

logger = logging.getLogger("stepwatch")


class StepwatchCallback(BridgeFace, mindspore.train.Callback):
    """Run stepwatch callbacks inside MindSpore's ``Model.train`` and ``Model.fit``.

    Args:
        callbacks: a stepwatch ``Callback`` or a list of them (``RunRecorder``,
            ``AnomalyMonitor``, ``LossMonitor``, ``ProgressBar``, your own stepwatch
            ``Callback`` subclasses, ...). They get stepwatch's cb_params: ``cur_step_num``,
            ``cur_epoch_num``, ``net_outputs`` (the step's loss) and the rest, with
            ``cb_params.network`` the MindSpore network.

    Raises:
        TypeError: ``callbacks`` is not a stepwatch Callback or a list of them.

    Attributes:
        run: the stepwatch run of the latest training (a ``RunEngine``), or None.
        stop_reason: why a stepwatch callback stopped it, or None.
    """

    host = "mindspore"

    def __init__(self, callbacks: Any = None) -> None:
        super().__init__()
        self._bridge = Bridge(callbacks, "mindspore.StepwatchCallback")
        self._context: Any = None

    # -- MindSpore's hooks ---------------------------------------------------------------------
    def on_train_begin(self, run_context: Any) -> None:
        p = run_context.original_args()
        world = int(p.get("device_number", 1) or 1)
        optimizer = p.get("optimizer")
        train_network = _first(p, "train_network", "network")
        controls = HostControls(
            "mindspore",
            state=_CellState(train_network),
            rates=_rates(optimizer) if optimizer is not None else None,
            save=self._saver(p),
            grads=False,  # MindSpore's gradients are not torch tensors
            config=clean_config(_config(p)),
        )
        host = Host(
            controls,
            network=_first(p, "network", "train_network"),
            optimizer=optimizer,
            rank=_rank() if world > 1 else 0,
            world=world,
        )
        self._context = run_context
        self._bridge.begin(
            host,
            # MindSpore's epoch_num is what this call trains (epoch - initial_epoch); a
            # resumed run's first epoch number is known when it begins.
            epochs=int(p.get("epoch_num", 1) or 1),
            steps_per_epoch=_steps_per_epoch(p),
            initial_step=int(p.get("cur_step_num", 0) or 0),
            dataset=p.get("train_dataset"),
            loss_fn=p.get("loss_fn"),
        )
        if p.get("dataset_sink_mode"):
            logger.info(
                "stepwatch: MindSpore calls callbacks once per sink in dataset sink mode; each "
                "call is recorded as one step"
            )

    def on_train_epoch_begin(self, run_context: Any) -> None:
        self._bridge.epoch_begins(int(run_context.original_args().cur_epoch_num))

    def on_train_step_end(self, run_context: Any) -> None:
        if not self._bridge.running:
            return
        p = run_context.original_args()
        loss = _torch_loss(p.get("net_outputs"))
        if self._bridge.step(loss, batch=p.get("train_dataset_element")):
            run_context.request_stop()

    def on_train_epoch_end(self, run_context: Any) -> None:
        if not self._bridge.running:
            return
        p = run_context.original_args()
        values: dict[str, float] = {}
        for key, value in (p.get("eval_results") or {}).items():
            number = _number(value)
            if number is not None:
                values[names.eval_name(str(key))] = number
        if self._bridge.epoch_end(values):
            run_context.request_stop()

    def on_train_end(self, run_context: Any) -> None:
        self._bridge.end()

    def __exit__(self, *err: Any) -> None:
        # MindSpore's callback manager exits every callback, after evaluation too; only an
        # error on the way out of training ends the run here (on_train_end ends it otherwise).
        exc = err[1] if len(err) > 1 else None
        if exc is not None and self._bridge.running:
            self._bridge.end(exc)

    # -- the host's controls -------------------------------------------------------------------
    @staticmethod
    def _saver(p: Any) -> Any:
        network = _first(p, "train_network", "network")

        def save(stem: Path) -> Path:
            path = stem.with_suffix(".ckpt")
            mindspore.save_checkpoint(network, str(path))
            return path

        return save


def _steps_per_epoch(p: Any) -> int:
    """The step calls an epoch brings. MindSpore's ``batch_num`` is the sink size when the
    training asked for dataset sink mode; the CPU does not sink (its cb_params then say
    ``dataset_sink_mode=False``), and every batch calls the step hooks."""
    batch_num = int(p.get("batch_num", 1) or 1)
    if mindspore.get_context("device_target") == "CPU":
        dataset = p.get("train_dataset")
        size = dataset.get_dataset_size() if dataset is not None else None
        if size:
            return int(size)
    return batch_num


def _first(p: Any, *keys: str) -> Any:
    return next((p.get(k) for k in keys if p.get(k) is not None), None)


def _torch_loss(outputs: Any) -> torch.Tensor:
    """MindSpore's step output as a one-value torch tensor (a tuple's first element)."""
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0] if outputs else None
    if outputs is None:
        raise RuntimeError(
            "stepwatch: MindSpore's cb_params has no net_outputs at the end of this step; "
            "the bridge needs the train network to return the loss."
        )
    array = outputs.asnumpy() if hasattr(outputs, "asnumpy") else np.asarray(outputs)
    return torch.from_numpy(np.asarray(array, dtype=np.float32).reshape(-1)[:1].reshape(()))


def _number(value: Any) -> float | None:
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    array = np.asarray(value)
    if array.size != 1 or not np.issubdtype(array.dtype, np.number):
        return None
    return float(array.reshape(-1)[0])


def _rates(optimizer: Any) -> RateFunctions:
    """The optimizer's learning rate, read and set."""

    def get_lr() -> float:
        if getattr(optimizer, "dynamic_lr", False):
            return float(np.asarray(optimizer.get_lr().asnumpy()).reshape(-1)[0])
        return float(np.asarray(optimizer.learning_rate.asnumpy()).reshape(-1)[0])

    def set_lr(value: float) -> None:
        if getattr(optimizer, "dynamic_lr", False):
            raise ValueError(
                "this MindSpore optimizer's learning rate is dynamic (a list or a schedule), "
                "which cannot be set during training"
            )
        rate = optimizer.learning_rate
        rate.set_data(mindspore.Tensor(np.asarray(value, dtype=np.float32)))

    return RateFunctions(get_lr, set_lr)


def _rank() -> int:
    try:
        from mindspore.communication import get_rank

        return int(get_rank())
    except Exception:  # communication not initialised: one process
        return 0


def _config(p: Any) -> dict[str, Any]:
    def name(obj: Any) -> str | None:
        return type(obj).__name__ if obj is not None else None

    return {
        "mindspore": mindspore.__version__,
        "network": name(p.get("network")),
        "train_network": name(p.get("train_network")),
        "optimizer": name(p.get("optimizer")),
        "loss_fn": name(p.get("loss_fn")),
        "epoch_num": p.get("epoch_num"),
        "batch_num": p.get("batch_num"),
        "dataset_sink_mode": p.get("dataset_sink_mode"),
        "parallel_mode": p.get("parallel_mode"),
        "device_number": p.get("device_number"),
    }


class _CellState:
    """The train network's state for rollback (:class:`~stepwatch.view.host.StateControl`):
    every parameter of the train network - the weights and the optimizer's state (its
    moments, step and learning rate are parameters too)."""

    def __init__(self, network: Any) -> None:
        self._network = network

    def capture(self) -> dict[str, np.ndarray]:
        return {param.name: param.asnumpy().copy() for param in self._network.get_parameters()}

    def restore(self, saved: dict[str, np.ndarray]) -> None:
        for param in self._network.get_parameters():
            if param.name in saved:
                param.set_data(mindspore.Tensor(saved[param.name]))
