"""stepwatch's callbacks inside Keras 3's ``model.fit``, on the torch backend.

Keep training with Keras; hand stepwatch's monitors to it through one Keras callback::

    import os
    os.environ["KERAS_BACKEND"] = "torch"  # before keras is first imported

    import keras
    import numpy as np
    from stepwatch import AnomalyMonitor, LossMonitor, RunRecorder
    from stepwatch.integrations.keras import StepwatchCallback

    x = np.random.randn(64, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=3, validation_data=(x, y), verbose=0, callbacks=[
        StepwatchCallback([RunRecorder(db="runs.db"), AnomalyMonitor(), LossMonitor(4)])])

then ``stepwatch serve runs.db`` shows the run. Your own Keras callbacks go to ``fit`` as
before, next to the bridge. Keras must run on the torch backend: importing this module sets
``KERAS_BACKEND=torch`` when Keras is not imported yet (and the variable is not set); a Keras
already running on another backend makes ``StepwatchCallback(...)`` raise a RuntimeError.

What the bridge reads from Keras:

- the step and the epoch (counted from ``fit``'s hooks, on from the optimizer's own
  ``iterations`` and ``fit(initial_epoch=...)``, so a model trained before counts on),
  ``steps`` and ``epochs`` from the callback's ``params``; the rank and the world size from
  torch's process group, if any.
- **the loss**: Keras hands ``on_train_batch_end`` its logs, where ``logs['loss']`` is the
  epoch's running mean (a ``Mean`` tracker), already turned into a Python float. So the
  bridge takes each batch's loss where the trainer computes it: while ``fit`` runs, the
  model's ``compute_loss`` is wrapped on the instance (and put back at the end), and the loss
  tensor it returns during training is kept, detached - the tensor ``backward`` runs on
  (before a ``LossScaleOptimizer`` scales it). Nothing reads it from the device: the monitors
  read losses in batches, as under ``stepwatch.Model``. The wrapped call also gives
  ``cb_params.outputs`` (``y_pred``) and ``cb_params.train_dataset_element`` (``(x, y)``).
  A custom ``train_step`` that never calls ``self.compute_loss`` leaves the bridge only the
  value its logs hold under ``'loss'`` (one log note says so).
- **gradients**: a Keras model on the torch backend is a ``torch.nn.Module`` whose
  ``parameters()`` are the variables' torch tensors; Keras clears their ``.grad`` at the start
  of ``train_step`` and leaves them set after the optimizer's update, so the gradient
  detectors read them when a batch ends. Under a ``LossScaleOptimizer`` they hold scaled
  gradients: the gradient detectors are off then, with one log note.
- **the learning rate**: the optimizer's ``learning_rate``. A plain rate is a variable on
  the device, read once per epoch (at the first read after the epoch begins) and after
  stepwatch sets it, so recording it never waits for the device on a quiet step; a rate a
  Keras callback changes mid-epoch is seen from the next epoch. A ``LearningRateSchedule``
  is evaluated at every read.
- the epoch's values from ``on_epoch_end``'s logs: ``loss`` (Keras's epoch mean),
  ``val_loss`` as ``eval_loss``, ``val_<metric>`` as ``eval_<metric>``, ``<metric>`` as
  ``train_<metric>``.
- the run's config: Keras's version and backend, the model's name, class and size, the loss,
  the optimizer's config, ``epochs`` and ``steps``.

Keras also converts each batch's logs to Python floats before calling a batch-end callback
that is not marked async-safe (the bridge cannot be: its callbacks act on the training
loop). That is Keras's own read of its running mean; the bridge adds none.

The actions, on Keras's controls:

- ``'stop'``: ``model.stop_training = True``; ``fit`` leaves its loop after the batch.
- ``'reduce_lr'`` (and ``ReduceLROnPlateau``): ``optimizer.learning_rate`` is assigned. A
  ``LearningRateSchedule`` cannot be assigned, so the bridge puts the schedule times the
  factor in its place (:class:`ScaledSchedule`): the schedule goes on, lower.
- ``'snapshot'``: ``model.save(...)``, a ``.keras`` file (weights and optimizer state) that
  ``keras.models.load_model`` reads. A model whose class is your own loads once that class
  is registered (``keras.saving.register_keras_serializable``); a reduced schedule needs
  this module imported (it registers :class:`ScaledSchedule`).
- ``'rollback'``: the model's weights (trainable or not) and the optimizer's variables
  (its slots, ``iterations`` and learning rate) are copied every ``rollback_every`` steps
  and assigned back in place; fit goes on with the next batches.

Failures: Keras's ``fit`` has no hook for an exception (no callback runs, and
``on_train_end`` is skipped). So the bridge also wraps the model's ``train_function`` while
``fit`` runs: an exception or Ctrl-C inside a training step ends the run as ``failed`` (or
``interrupted``) before it propagates, and a stepwatch callback that raises ends it the same
way. An exception elsewhere in ``fit`` (the data pipeline, another Keras callback,
validation) leaves the run open: the store shows it as ``crashed`` once the process is gone,
and the next ``fit`` with the same ``StepwatchCallback`` stores it as ``failed`` first.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch

from .._validation import _got
from ..distributed import rank_and_world
from ..view.host import HostControls
from ._bridge import Bridge, BridgeFace, Host, RateFunctions, clean_config, host_values
from ._keras_state import capture, restore

__all__ = ["ScaledSchedule", "StepwatchCallback"]

logger = logging.getLogger("stepwatch")

_OWNER = "keras.StepwatchCallback"
_MARK = "_stepwatch_wrapped"  # on the bridge's wrappers: (had an instance attribute, it)
_LOSS_ARGS = ("x", "y", "y_pred", "sample_weight")


def _check_backend() -> None:
    backend = keras.backend.backend()
    if backend != "torch":
        raise RuntimeError(
            f"stepwatch.integrations.keras needs Keras on the torch backend, but Keras runs on "
            f"{backend!r}: set the environment variable KERAS_BACKEND=torch before keras is "
            "first imported (or import stepwatch.integrations.keras first)."
        )


@keras.saving.register_keras_serializable(package="stepwatch")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule times a factor: how ``reduce_lr`` lowers a scheduled rate.

    Args:
        schedule: the optimizer's ``LearningRateSchedule``.
        factor: what its rate is multiplied by.

    Raises:
        TypeError: ``schedule`` is not a ``LearningRateSchedule``, or ``factor`` not a number.
    """

    def __init__(self, schedule: Any, factor: float) -> None:
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(
                f"ScaledSchedule's 'schedule' must be a keras LearningRateSchedule, but got "
                f"{_got(schedule)}."
            )
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"ScaledSchedule's 'factor' must be a number, but got {_got(factor)}.")
        self.schedule = schedule
        self.factor = float(factor)

    def __call__(self, step: Any) -> Any:
        return self.schedule(step) * self.factor

    def get_config(self) -> dict[str, Any]:
        return {
            "schedule": keras.optimizers.schedules.serialize(self.schedule),
            "factor": self.factor,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ScaledSchedule:
        schedule = keras.optimizers.schedules.deserialize(config["schedule"])
        return cls(schedule, config["factor"])


class _Rate:
    """The Keras optimizer's learning rate, read without waiting for the device on every
    step (see the module's notes), and set the way Keras lets it be set."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        # A LossScaleOptimizer's rate is its inner optimizer's.
        self.target = getattr(optimizer, "inner_optimizer", None) or optimizer
        self._cached: float | None = None

    def stale(self) -> None:
        """An epoch begins: the next read asks the optimizer again."""
        self._cached = None

    def _raw(self) -> Any:
        return getattr(self.target, "_learning_rate", None)

    def get(self) -> float:
        raw = self._raw()
        if isinstance(raw, keras.Variable):
            if self._cached is None:
                self._cached = float(keras.ops.convert_to_numpy(raw))
            return self._cached
        return float(keras.ops.convert_to_numpy(self.target.learning_rate))

    def set(self, value: float) -> None:
        raw = self._raw()
        self._cached = None
        if isinstance(raw, keras.Variable) or not callable(raw):
            self.target.learning_rate = value
            return
        current = self.get()
        if current == value:
            return
        if current == 0:
            raise ValueError(
                f"the optimizer's learning-rate schedule gives 0 now, so it cannot be scaled to "
                f"{value:g}; give the optimizer a float learning_rate to set it mid-run."
            )
        ratio = value / current
        if isinstance(raw, ScaledSchedule):
            self.target.learning_rate = ScaledSchedule(raw.schedule, raw.factor * ratio)
        elif isinstance(raw, keras.optimizers.schedules.LearningRateSchedule):
            self.target.learning_rate = ScaledSchedule(raw, ratio)
        else:  # a function of no arguments
            self.target.learning_rate = _scaled_function(raw, ratio)
        logger.info(
            "stepwatch: the optimizer's learning rate follows %s, which cannot be assigned; "
            "its rate is multiplied by %g from now on",
            type(raw).__name__,
            ratio,
        )


def _scaled_function(fn: Callable[[], Any], ratio: float) -> Callable[[], Any]:
    def rate() -> Any:
        return fn() * ratio

    return rate


# -- wrapping a model's method on the instance while fit runs ----------------------------------
def _put_back(model: Any, name: str, had: bool, previous: Any) -> None:
    if had:
        setattr(model, name, previous)
    elif name in model.__dict__:
        delattr(model, name)


def _wrap(model: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> Any:
    """Put ``make(model.<name>)`` on the instance; a wrapper a fit that never ended left
    there is taken off first."""
    current = model.__dict__.get(name)
    while current is not None and hasattr(current, _MARK):
        _put_back(model, name, *getattr(current, _MARK))
        current = model.__dict__.get(name)
    had = name in model.__dict__
    wrapper = make(getattr(model, name))
    setattr(wrapper, _MARK, (had, model.__dict__.get(name)))
    setattr(model, name, wrapper)
    return wrapper


def _unwrap(model: Any, name: str, wrapper: Any) -> None:
    if wrapper is not None and model.__dict__.get(name) is wrapper:
        _put_back(model, name, *getattr(wrapper, _MARK))


class _LossCapture:
    """The loss tensor (and ``y_pred``, ``(x, y)``) of the training step's ``compute_loss``."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None
        self.outputs: Any = None
        self.batch: Any = None

    def make(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = inner(*args, **kwargs)
            # Validation (test_step) computes its loss too: with training=False, no grad.
            if (
                isinstance(loss, torch.Tensor)
                and kwargs.get("training", True) is not False
                and torch.is_grad_enabled()
            ):
                named = dict(zip(_LOSS_ARGS, args))
                named.update(kwargs)
                self.loss = loss.detach()
                self.outputs = named.get("y_pred")
                self.batch = (named.get("x"), named.get("y"))
            return loss

        return compute_loss

    def take(self) -> tuple[torch.Tensor | None, Any, Any]:
        taken = self.loss, self.outputs, self.batch
        self.loss = self.outputs = self.batch = None
        return taken


class StepwatchCallback(BridgeFace, keras.callbacks.Callback):
    """Run stepwatch callbacks inside Keras's ``model.fit`` (torch backend).

    Args:
        callbacks: a stepwatch ``Callback`` or a list of them (``RunRecorder``,
            ``AnomalyMonitor``, ``LossMonitor``, ``ProgressBar``, your own stepwatch
            ``Callback`` subclasses, ...). They get stepwatch's cb_params: ``cur_step_num``,
            ``cur_epoch_num``, ``net_outputs`` (the batch's loss) and the rest, with
            ``cb_params.network`` the Keras model. Keras callbacks go to ``fit`` itself.

    Raises:
        RuntimeError: Keras runs on a backend other than torch.
        TypeError: ``callbacks`` is not a stepwatch Callback or a list of them (a Keras
            callback among them, or a callback class instead of an instance).

    Attributes:
        run: the stepwatch run of the latest ``fit`` (a ``RunEngine``), in progress or
            ended, or None before the first.
        stop_reason: why a stepwatch callback stopped it, or None.
    """

    host = "keras"

    def __init__(self, callbacks: Any = None) -> None:
        _check_backend()
        items = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
        for i, item in enumerate(items):
            if isinstance(item, keras.callbacks.Callback):
                where = "'callbacks'" if items is not callbacks else f"callbacks[{i}]"
                raise TypeError(
                    f"{where} is a Keras callback ({type(item).__name__}); StepwatchCallback "
                    "takes stepwatch callbacks: pass Keras callbacks to model.fit(callbacks="
                    "[...]) next to StepwatchCallback."
                )
        super().__init__()
        self._bridge = Bridge(callbacks, "keras.StepwatchCallback")
        self._capture = _LossCapture()
        self._rate: _Rate | None = None
        self._wrapped: dict[str, Any] = {}
        self._noted_logs_loss = False

    # -- Keras's hooks -------------------------------------------------------------------------
    def set_params(self, params: Any) -> None:
        # fit's callback list hands every callback in it the same params: handed twice in a
        # row, this callback is in the list twice.
        self._listed = getattr(self, "_listed", 0) + 1 if params and params is self.params else 1
        super().set_params(params)

    def on_train_begin(self, logs: Any = None) -> None:
        if getattr(self, "_listed", 1) > 1:
            raise ValueError(
                f"this {_OWNER} is in model.fit's callbacks {self._listed} times: it would "
                "record every step that many times. List it once."
            )
        model = self.model
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"{_OWNER} needs a Keras model on the torch backend (a torch.nn.Module), but "
                f"the callback's model is {_got(model)}."
            )
        params = self.params or {}
        steps = params.get("steps")
        if steps is None:
            raise ValueError(
                f"{_OWNER} needs the number of batches per epoch, which Keras does not know "
                "for this input (a generator without a length): pass "
                "model.fit(..., steps_per_epoch=N)."
            )
        epochs = int(params.get("epochs") or 1)
        self._install(model)
        optimizer = model.optimizer
        self._rate = _Rate(optimizer) if optimizer is not None else None
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if scaled:
            logger.info(
                "stepwatch: under Keras's LossScaleOptimizer the parameters' .grad hold scaled "
                "gradients; the gradient detectors are off"
            )
        rank, world = rank_and_world()
        rate = self._rate
        controls = HostControls(
            "keras",
            state=_KerasState(self, model),
            rates=RateFunctions(rate.get, rate.set) if rate is not None else None,
            save=self._save,
            grads=not scaled,
            config=clean_config(_config(model, params)),
        )
        host = Host(controls, network=model, optimizer=optimizer, rank=rank, world=world)
        try:
            self._bridge.begin(
                host,
                epochs=epochs,
                steps_per_epoch=int(steps),
                loss_fn=getattr(model, "loss", None),
                initial_step=_iterations(model),  # a model trained before counts on
            )
        except BaseException:
            self._uninstall()
            raise

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._rate is not None:
            self._rate.stale()
        self._bridge.epoch_begins(epoch + 1, total=True)  # fit(initial_epoch=k): epoch k+1

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._bridge.running:
            return
        loss, outputs, data = self._capture.take()
        if loss is None:
            loss = self._logged_loss(logs)
        try:
            stop = self._bridge.step(loss, outputs, data)
        except BaseException:
            self._uninstall()  # the bridge has ended the run
            raise
        if stop:
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not self._bridge.running:
            return
        try:
            stop = self._bridge.epoch_end(host_values(logs or {}))
        except BaseException:
            self._uninstall()
            raise
        if stop:
            self.model.stop_training = True

    def on_train_end(self, logs: Any = None) -> None:
        try:
            self._bridge.end()
        finally:
            self._uninstall()

    # -- what fit does not hand callbacks --------------------------------------------------------
    def _install(self, model: Any) -> None:
        """Wrap ``compute_loss`` (the batch's loss) and ``train_function`` (a failing step)."""
        self._uninstall()
        self._capture.take()
        self._wrapped["compute_loss"] = _wrap(model, "compute_loss", self._capture.make)
        if model.__dict__.get("train_function") is not None:
            self._wrapped["train_function"] = _wrap(model, "train_function", self._guard)
        self._wrapped["model"] = model

    def _uninstall(self) -> None:
        model = self._wrapped.pop("model", None)
        if model is not None:
            for name in ("compute_loss", "train_function"):
                _unwrap(model, name, self._wrapped.pop(name, None))
        self._wrapped.clear()

    def _restore(self, model: Any, saved: list[Any]) -> None:
        """Put a :func:`capture` copy back in place (rollback)."""
        restore(model, saved)
        if self._rate is not None:
            self._rate.stale()  # the optimizer's rate came back with it

    def _guard(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def train_function(data: Any) -> Any:
            try:
                return inner(data)
            except BaseException as exc:
                self._uninstall()
                if self._bridge.running:
                    try:
                        self._bridge.end(exc)
                    except Exception:  # the host's error is the one to see
                        logger.exception("stepwatch: the run could not be ended after the failure")
                raise

        return train_function

    def _logged_loss(self, logs: Any) -> torch.Tensor:
        value = (logs or {}).get("loss")
        if value is None:
            raise RuntimeError(
                f"{_OWNER}: this training step computed no loss through the model's "
                "compute_loss and its logs hold no 'loss'; call self.compute_loss(...) in a "
                "custom train_step (or return {'loss': loss})."
            )
        if not self._noted_logs_loss:
            self._noted_logs_loss = True
            logger.info(
                "stepwatch: the model's train_step does not call compute_loss; the step loss "
                "is the 'loss' its logs hold (for Keras's own tracker, the epoch's running mean)"
            )
        if isinstance(value, torch.Tensor):
            return value.detach().reshape(())
        return torch.tensor(float(value))

    def _save(self, stem: Path) -> Path:
        """The 'snapshot' action: ``model.save`` to ``<stem>.keras``, written beside and
        moved into place."""
        final = stem.parent / f"{stem.name}.keras"
        partial = stem.parent / f".{stem.name}.partial.keras"
        try:
            self.model.save(partial)
            os.replace(partial, final)
        finally:
            if partial.exists():
                partial.unlink()
        return final


class _KerasState:
    """The Keras model's state for rollback (:class:`~stepwatch.view.host.StateControl`):
    its weights and optimizer variables, copied and assigned back in place."""

    def __init__(self, bridge: StepwatchCallback, model: Any) -> None:
        self._bridge, self._model = bridge, model

    def capture(self) -> list[Any]:
        return capture(self._model)

    def restore(self, saved: list[Any]) -> None:
        self._bridge._restore(self._model, saved)


def _config(model: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    optimizer = model.optimizer
    try:
        optimizer_config = optimizer.get_config() if optimizer is not None else None
    except Exception:  # an optimizer whose config cannot be built is not worth failing for
        optimizer_config = None
    try:
        size = int(model.count_params())
    except Exception:  # an unbuilt model
        size = None
    return {
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "model": getattr(model, "name", None),
        "model_class": type(model).__name__,
        "parameters": size,
        "loss": getattr(model, "loss", None),
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "optimizer_config": optimizer_config,
        "epochs": params.get("epochs"),
        "steps": params.get("steps"),
        "jit_compile": getattr(model, "jit_compile", None),
    }


def _iterations(model: Any) -> int:
    """The optimizer steps the model has taken (Keras's own global step), read once."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    try:
        return int(iterations) if iterations is not None else 0
    except (TypeError, ValueError):  # an optimizer not built yet
        return 0
