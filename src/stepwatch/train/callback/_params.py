"""cb_params: the fields a run shows its callbacks, and where training is (``Progress``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..._tensor import as_stepwatch_tensor
from ...view.run import view_of
from ..step import scale_tensor

__all__ = ["CallbackParams", "Progress"]


@dataclass
class Progress:
    """Where training is, as checkpoints need it (``cb_params.progress``).

    Attributes:
        trained_step: the last global step whose optimizer update is done. A step that failed
            half-way is not counted, so a checkpoint written after a failure resumes at it.
        epoch_start_rng: every random generator's state at the start of the current epoch
            (a mid-epoch resume replays the epoch's shuffle from it); None before training.
        skipped_steps: optimizer steps skipped on a gradient overflow under loss scaling.
    """

    trained_step: int = 0
    epoch_start_rng: dict[str, Any] | None = None
    # Optimizer steps skipped because a gradient overflowed (loss scaling); an int, or a device
    # tensor while training (read it through cb_params.skipped_steps).
    skipped_steps: Any = 0


# What a field every run has reads as when a cb_params built by hand lacks it.
_DEFAULTS: dict[str, Any] = {
    "rank_id": 0,
    "local_rank": 0,
    "device_number": 1,
    "parallel_mode": "stand_alone",
    "initial_step": 0,
    "initial_epoch": 0,
    "train_results": {},
    "mode": "train",
    "dataset_sink_mode": False,
    "last_save_ckpt_step": None,
    "latest_ckpt_file": None,
    "list_callback": (),
    "step_time": 0.0,
    "optimizer_stepped": True,
    "optimizer": None,
    "grad_norm": None,
}


class CallbackParams:
    """The cb_params object returned by ``run_context.original_args()`` (or the faster
    ``run_context.cb_params``).

    Fields are attributes (``cb_params.cur_step_num``); dict-style access (``cb_params["x"]``,
    ``cb_params.get("x")``, ``"x" in cb_params``) works too. A missing field raises
    ``AttributeError``, so ``getattr(cb_params, "accuracy", None)`` returns ``None``; the
    fields every run has read as MindSpore's defaults when a cb_params built by hand lacks them
    (``rank_id`` 0, ``device_number`` 1, ``initial_step`` 0, ``train_results`` ``{}``,
    ``mode`` ``'train'``, ``optimizer`` None, ``device`` where the network's weights are, ...).

    Fields computed when read, so that nothing syncs with the device unless a callback asks:

    * ``net_outputs`` - the step's loss as a detached :class:`stepwatch.Tensor` (no host copy);
      with a loss scale manager that skips overflowed steps, ``(loss, overflow, scale)`` as
      MindSpore's ``TrainOneStepWithLossScaleCell`` returns them (read when you index it);
      during evaluation ``(loss, outputs, label)``, as MindSpore's eval network returns them
      (with ``eval_indexes``, the eval network's whole output), and without a ``loss_fn`` the
      eval network's output;
    * ``loss`` - at step hooks the step's loss as a float (reading it waits for the device);
      at ``on_train_epoch_end`` the epoch's mean training loss, and at the end of an
      evaluation pass that pass's mean loss;
    * ``lr`` - the first parameter group's learning rate; ``lrs`` - every group's;
    * ``loss_scale`` - the current loss scale (1.0 without loss scaling) and
      ``skipped_steps`` - optimizer steps skipped on a gradient overflow (both read the device);
    * ``step_in_epoch`` - the step's number within its epoch (1-based; 0 before the first);
    * ``last_step_of_epoch`` - True at the epoch's last step.

    ``outputs`` is the network's output for the step's batch, detached (None before the first
    step). For callbacks that must stay cheap on every step, ``loss_tensor`` is the step's loss as
    the loop holds it: a detached ``torch.Tensor`` on the training device, no wrapping, no
    copy, no sync (None before the first step, and in an evaluation without a loss).

    ``optimizer_stepped`` is True when the step ended with an optimizer update (False on the
    other batches of a gradient-accumulation window); ``grad_norm`` is the global gradient
    norm before clipping, a device tensor, on the steps where it is computed (with
    ``clip_grad_norm``), else None.

    ``run_view`` is the run as the monitors read it (:class:`stepwatch.view.RunView`): the
    step-loss tap, whether the run validates, the epoch values by name, the store and the
    alert path.

    ``step_time`` is the wall time in seconds from the end of the previous step (or the start of
    the epoch) to the end of this one's optimizer step: loading the batch, the step-begin hooks
    and the step itself.
    """

    # The fields the loops set (declared for type checkers; unset ones raise AttributeError).
    cur_step_num: int
    cur_epoch_num: int
    epoch_num: int
    batch_num: int
    initial_epoch: int
    initial_step: int
    train_network: Any
    network: Any
    eval_network: Any
    loss_fn: Any
    optimizer: Any
    metrics: dict[str, Any]
    device: Any
    rank_id: int
    local_rank: int
    device_number: int
    parallel_mode: str
    list_callback: Any
    mode: str
    train_dataset: Any
    train_dataset_element: Any
    valid_dataset: Any
    eval_dataset_element: Any
    dataset_sink_mode: bool
    last_save_ckpt_step: int | None
    latest_ckpt_file: str | None
    step_time: float
    train_results: dict[str, Any]
    eval_results: dict[str, Any]
    loss_tensor: Any
    outputs: Any
    progress: Progress
    optimizer_stepped: bool
    grad_norm: Any
    compile_seconds: float
    lr_scheduler: Any
    loss_scaler: Any
    run_view: Any

    def __init__(self, **fields: Any) -> None:
        self.loss_tensor = None
        self.outputs: Any = None
        self._wrapped: tuple[Any, Any] | None = None
        self._epoch_loss: float | None = None
        self._eval_label: Any = None  # an evaluation step's label, for net_outputs
        self._eval_returned: Any = None  # an eval network's whole output (eval_indexes)
        self.progress = Progress()
        computed = {k: fields.pop(k) for k in ("net_outputs", "loss") if k in fields}
        self.__dict__.update(fields)
        for name, value in computed.items():
            setattr(self, name, value)  # through the properties: a loss given by hand reads back

    # -- computed fields ---------------------------------------------------------------------
    @property
    def net_outputs(self) -> Any:
        raw = self.loss_tensor
        if raw is None:
            raw = self.outputs
            if raw is None:
                raise AttributeError("'net_outputs' is not set before the first step has run")
        wrapped = self._wrapped
        if wrapped is not None and wrapped[0] is raw:
            return wrapped[1]
        value = as_stepwatch_tensor(raw)
        if self.mode == "eval":
            returned = self._eval_returned
            label = self._eval_label
            if returned is not None:
                # An eval network read through eval_indexes: its whole output, as MindSpore's
                value = tuple(as_stepwatch_tensor(v) for v in returned)
            elif label is not None and raw is self.loss_tensor:
                # MindSpore's eval network (WithEvalCell) returns (loss, outputs, label)
                value = (value, as_stepwatch_tensor(self.outputs), label)
        elif raw is self.loss_tensor and self.__dict__.get("loss_scaler") is not None:
            value = _loss_scale_outputs(self, value)
        self._wrapped = (raw, value)
        return value

    @net_outputs.setter
    def net_outputs(self, value: Any) -> None:
        self.loss_tensor = value

    @property
    def loss(self) -> float:
        if self._epoch_loss is not None:
            return self._epoch_loss
        raw = self.loss_tensor
        if raw is None:
            raise AttributeError(
                "'loss' is not set before the first step has run"
                if self.outputs is None
                else "'loss' is not available: this evaluation has no loss_fn"
            )
        if isinstance(raw, (tuple, list)):
            raw = raw[0]
        return float(raw.detach()) if hasattr(raw, "detach") else float(raw)

    @loss.setter
    def loss(self, value: float | None) -> None:
        self._epoch_loss = value

    @property
    def lr(self) -> float:
        """The first parameter group's learning rate, read from the optimizer."""
        return self.lrs[0]

    @property
    def lrs(self) -> list[float]:
        """The learning rate of every parameter group, read from the optimizer (through the
        run view's :attr:`~stepwatch.view.run.RunView.rates`)."""
        rates = view_of(self).rates if self.__dict__.get("optimizer") is not None else None
        if rates is None:
            raise AttributeError("'lr' needs an optimizer; this run has none")
        return rates.get()

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling); reading it waits for the device."""
        scaler = self.__dict__.get("loss_scaler")
        return float(scaler.get_scale()) if scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because a gradient overflowed (loss scaling);
        reading it waits for the device."""
        return int(self.progress.skipped_steps)

    @property
    def step_in_epoch(self) -> int:
        """The current step's number within its epoch, 1-based (0 before the first step)."""
        step = self.cur_step_num
        return (step - 1) % self.batch_num + 1 if step > 0 else 0

    @property
    def last_step_of_epoch(self) -> bool:
        """True when the current step is its epoch's last."""
        step = self.cur_step_num
        return step > 0 and step % self.batch_num == 0

    @contextlib.contextmanager
    def evaluating(self, batch_num: int, hide: Iterable[str] = ()) -> Iterator[CallbackParams]:
        """Switch these cb_params to an evaluation pass, and back to training afterwards.

        Inside, ``mode`` is ``'eval'``, ``cur_step_num`` counts the evaluation's steps from 0,
        ``batch_num`` is the evaluation's, and the training step's loss and outputs are out of
        sight; the names in ``hide`` (the training metric attributes) are removed, so a hook
        never reads a training value as if it were the evaluation's. On leaving, everything
        is as it was, and whatever the evaluation set under a hidden name is removed.
        ``metrics``, ``eval_results`` and ``valid_dataset`` stay (MindSpore keeps them until
        the epoch end).
        """
        fields = self.__dict__
        saved: dict[str, Any] = {
            k: fields[k]
            for k in ("mode", "cur_step_num", "batch_num", "loss_tensor", "outputs")
            if k in fields
        }
        saved_loss = self._epoch_loss
        names = list(hide)
        hidden = {k: fields.pop(k) for k in names if k in fields}
        self.mode = "eval"
        self.cur_step_num = 0
        self.batch_num = batch_num
        self.loss_tensor = None
        self.outputs = None
        self._epoch_loss = None
        try:
            yield self
        finally:
            for k in names:
                fields.pop(k, None)
            fields.update(saved)
            fields.update(hidden)
            self._epoch_loss = saved_loss

    def __getattr__(self, name: str) -> Any:
        # Reached only for a field that is not set. A field every run has gets MindSpore's
        # default (a cb_params built by hand, as tests and tools do, has only a few fields);
        # anything else is an AttributeError, so that getattr(cb_params, "accuracy", None) and
        # hasattr() work (MindSpore raises KeyError).
        if name in _DEFAULTS:
            default = _DEFAULTS[name]
            return dict(default) if isinstance(default, dict) else default
        if name == "network" and "train_network" in self.__dict__:
            return self.__dict__["train_network"]  # MindSpore's cb_params name it so
        if name == "device":  # where the network's weights are (MindSpore has no such field)
            net = self.__dict__.get("train_network", self.__dict__.get("network"))
            weights = net.parameters() if isinstance(net, torch.nn.Module) else iter(())
            first = next(weights, None)
            return first.device if first is not None else torch.device("cpu")
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"cb_params has no field {name!r} at this point of the run; set fields: "
            f"{', '.join(sorted(self.keys()))}"
        )

    # -- dict-style access ---------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self, key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.keys()

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def keys(self) -> list[str]:
        names = [k for k in self.__dict__ if not k.startswith("_")]
        if self.loss_tensor is not None:
            names += ["net_outputs", "loss"]
        elif self.outputs is not None:
            names.append("net_outputs")
        if self._epoch_loss is not None and "loss" not in names:
            names.append("loss")
        return names

    def items(self) -> Iterator[tuple[str, Any]]:
        for key in self.keys():
            yield key, getattr(self, key)

    def __repr__(self) -> str:
        return f"CallbackParams({', '.join(sorted(self.keys()))})"


def _loss_scale_outputs(cb_params: Any, loss: Any) -> Any:
    """``cb_params.net_outputs`` of ``Model`` under loss scaling: ``(loss, overflow, scale)``
    where MindSpore's train network is ``TrainOneStepWithLossScaleCell`` (a scale manager that
    skips overflowed steps: ``DynamicLossScaleManager``,
    ``FixedLossScaleManager(drop_overflow_update=True)``), else the loss alone
    (``drop_overflow_update=False``: MindSpore's ``TrainOneStepCell``; and in another
    trainer's run, through a bridge).

    Computed when a callback reads ``net_outputs``, from what the step left: ``overflow`` (a
    bool tensor) is True when this step's optimizer update was skipped because a gradient
    overflowed, ``scale`` (a float32 tensor) the loss scale after the step. Reading them waits
    for the device, as indexing MindSpore's tuple does.
    """
    scaler = cb_params.__dict__.get("loss_scaler")
    tracker = getattr(scaler, "_growth_tracker", None)
    if not isinstance(scaler, torch.amp.GradScaler) or not isinstance(tracker, torch.Tensor):
        return loss
    if view_of(cb_params).host != "stepwatch":
        return loss  # MindSpore's shape is its Model's; another trainer's loss stays the loss
    overflow = torch.zeros((), dtype=torch.bool, device=tracker.device)
    # The tracker counts good steps since the scale last changed: 0 after an overflow (and,
    # for a scale that grows, right after it grew, when the gradients are finite).
    if cb_params.get("optimizer_stepped", True) and int(tracker) == 0:
        if scaler.get_growth_interval() >= 2**31 - 1:  # a fixed scale never grows
            overflow = torch.ones((), dtype=torch.bool, device=tracker.device)
        else:
            grads = [
                p.grad
                for group in getattr(cb_params.get("optimizer"), "param_groups", ())
                for p in group["params"]
                if p.grad is not None
            ]
            if grads:
                norms = torch._foreach_norm(grads)
                overflow = ~torch.isfinite(torch.stack([n.float() for n in norms])).all()
    scale = scale_tensor(scaler)
    scale = (
        scale.reshape(()).float()
        if isinstance(scale, torch.Tensor)
        else torch.tensor(float(scale), dtype=torch.float32)
    )
    return (loss, as_stepwatch_tensor(overflow), as_stepwatch_tensor(scale))
