"""The loss and gradient norm of each optimizer step of a ``transformers.Trainer``, for its
bridge.

The Trainer hands callbacks no loss. This module is the one place the bridge reaches inside
the Trainer: while a Trainer the callback was attached to
(:meth:`~stepwatch.integrations.transformers.StepwatchCallback.attach`) trains,
:class:`StepLoss` wraps its ``training_step`` (on that Trainer object only) and keeps the
detached loss it returns for each micro-batch: the step's loss is their sum, as the Trainer
adds them for its own log. It relies on ``training_step(model, inputs, ...)`` returning that
loss, as the Trainer versions in :data:`WRITTEN_FOR` do (a test pins them). Without an attached
Trainer, a forward hook reads the ``loss`` the model returns instead. A forward hook gathers
the model's outputs only for the steps the callbacks look at.

The Trainer computes the step's global gradient norm before clipping with its accelerator's
``clip_grad_norm_`` (under FSDP2, over all the ranks' shards) and hands callbacks only its
logged value. The same wrapping keeps what that call returns, on the attached Trainer's
accelerator object only: the step's ``cb_params.grad_norm``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._bridge import Bridge

__all__ = ["WRITTEN_FOR", "StepLoss"]

# The transformers releases whose Trainer.training_step this module was written and tested for
# (lowest included, highest excluded); pyproject's 'transformers' extra asks for the same.
WRITTEN_FOR = ("4.46", "6")

# What a Trainer's instance held under "training_step" when it had nothing of its own.
_ABSENT = object()


class StepLoss:
    """The current optimizer step's loss, and its last micro-batch's outputs and inputs.

    Args:
        bridge: the bridge whose run is fed (nothing is kept while it has none).
    """

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        self.model: nn.Module | None = None
        self.trainer: Any = None  # the Trainer whose training_step is wrapped, or None
        self.wrapper: Any = None
        self.hook: Any = None  # the forward hook, while it is on the model
        self.outputs_hook = False  # ... on for this step's outputs only
        self.most = 1  # the micro-batches of a step: at most as many losses are kept
        # From training_step: each micro-batch's loss as the Trainer adds it up; and the
        # losses handed over with record_loss.
        self.taken: list[torch.Tensor] = []
        self.handed: list[torch.Tensor] = []
        # Without a Trainer: each micro-batch's loss, from the model's forward.
        self.losses: list[torch.Tensor] = []
        self.missing = False  # a micro-batch gave no loss
        self.summed = False  # the micro-batches' losses add up (num_items_in_batch)
        self.current: torch.Tensor | None = None  # the loss the model returned
        self.recorded: torch.Tensor | None = None  # the loss record_loss handed over
        self.outputs: Any = None
        self.inputs: Any = None
        self.norm: Any = None  # the global gradient norm the Trainer computed in this step
        self.accelerator: Any = None  # the attached Trainer's, whose clip_grad_norm_ is wrapped
        self.clip_wrapper: Any = None

    # -- the run's start and end ----------------------------------------------------------------
    def attach(self, trainer: Any, model: Any, accumulation: int = 1) -> None:
        """Read the losses from ``trainer``'s training_step, or, with no Trainer, from
        ``model``'s forward; ``accumulation``: the micro-batches of a step."""
        self.release()  # what a run that ended without letting go still held
        self.model = model if isinstance(model, nn.Module) else None
        self.most = max(1, int(accumulation))
        self.reset()
        if trainer is not None:
            self.wrap(trainer)
        elif self.model is not None:
            self.hook = self.model.register_forward_hook(self.forward_hook, with_kwargs=True)

    def release(self) -> None:
        self.unhook()
        self.outputs_hook = False
        self.unwrap()

    def wrap(self, trainer: Any) -> None:
        """Keep what the running Trainer's ``training_step`` returns, micro-batch by
        micro-batch, and the gradient norm its accelerator's ``clip_grad_norm_`` returns
        (before clipping), until :meth:`unwrap` puts its own back."""
        inner = trainer.training_step  # the class's, or what the instance already holds
        keep = self.keep

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = inner(model, inputs, *args, **kwargs)
            if self.wrapper is training_step:  # else a wrapper let go, left below another
                keep(loss, inputs)
            return loss

        _put_on(trainer, "training_step", training_step, self)
        self.trainer, self.wrapper = trainer, training_step
        accelerator = getattr(trainer, "accelerator", None)
        clip = getattr(accelerator, "clip_grad_norm_", None)
        if not callable(clip):
            return

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            if self.clip_wrapper is clip_grad_norm_:
                self.norm = norm
            return norm

        _put_on(accelerator, "clip_grad_norm_", clip_grad_norm_, self)
        self.accelerator, self.clip_wrapper = accelerator, clip_grad_norm_

    def unwrap(self) -> None:
        """Put back what the Trainer held as its ``training_step`` before :meth:`wrap` (and
        its accelerator as its ``clip_grad_norm_``). With several bridges on one Trainer,
        the wrappers on top whose bridges let go all come off (one below a live wrapper
        stays, passing the calls through, until that one goes)."""
        trainer, self.trainer, self.wrapper = self.trainer, None, None
        accelerator, self.accelerator, self.clip_wrapper = self.accelerator, None, None
        if trainer is not None:
            _take_off(trainer, "training_step")
        if accelerator is not None:
            _take_off(accelerator, "clip_grad_norm_")

    def hook_outputs(self) -> None:
        """Put the forward hook on the model (under a Trainer: for the outputs of a step the
        callbacks look at, from the bridge's on_step_begin; end_step takes it off)."""
        if self.model is not None and self.hook is None:
            self.hook = self.model.register_forward_hook(self.forward_hook, with_kwargs=True)

    def unhook(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook.remove()

    # -- each step --------------------------------------------------------------------------------
    def end_step(self, run: Any) -> None:
        """The step's hooks ran: the forward hook put on for this step comes off, unless the
        callbacks look at the next one too (every step, when one of them runs every step)."""
        if self.outputs_hook and not run.looks_next:
            self.outputs_hook = False
            self.unhook()

    def keep(self, loss: Any, inputs: Any) -> None:
        """A micro-batch's loss, as the Trainer's training_step returned it (detached)."""
        if self._bridge.run is not None and isinstance(loss, torch.Tensor):
            taken = self.taken
            if len(taken) >= self.most:  # steps go by unseen: the callback left the Trainer
                del taken[0]
            taken.append(loss)
            self.inputs = inputs

    def record(self, loss: torch.Tensor) -> None:
        """A loss handed over with ``record_loss`` for the current micro-batch."""
        if self.trainer is not None:
            self.handed.append(loss.detach())
        else:
            self.recorded = loss.detach()

    def forward_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not module.training or self._bridge.run is None or not torch.is_grad_enabled():
            return  # evaluation, prediction, or outside training
        if self.trainer is not None:  # the loss comes from training_step
            self.outputs = output
            return
        self.current = _loss_of(output)  # read (or detached) by run.step
        # The Trainer's rule: a model given num_items_in_batch normalised the loss over the
        # whole accumulated batch, so the micro-batches' losses add up to the step's.
        self.summed = kwargs.get("num_items_in_batch") is not None
        self.outputs = output  # detached when the run looks at the step (run.step)
        if "num_items_in_batch" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        self.inputs = kwargs or args

    def close_micro_batch(self) -> None:
        """A micro-batch ended (without a Trainer: its loss came from the forward)."""
        if self.trainer is not None:
            return
        loss = self.recorded if self.recorded is not None else self.current
        if self.recorded is not None:
            self.summed = False  # record_loss takes per-batch means
        if loss is None:
            self.missing = True
        else:
            if loss.dim():
                loss = loss.mean() if loss.numel() != 1 else loss.reshape(())
            self.losses.append(loss)
        self.current = self.recorded = None

    def take(self, step: int) -> tuple[torch.Tensor, Any, Any]:
        """The optimizer step's loss (over its micro-batches), outputs and inputs.

        Raises:
            RuntimeError: no loss came for step ``step``, naming how to hand it over.
        """
        if self.trainer is not None:
            handed, taken = self.handed, self.taken
            losses = handed or [t.reshape(()) if t.numel() == 1 else t.mean() for t in taken]
            summed = not handed  # the Trainer's losses add up; record_loss's are means
            if not losses:  # a Trainer whose loop does not call training_step
                raise RuntimeError(
                    f"transformers.StepwatchCallback: the Trainer's training_step gave no "
                    f"loss in step {step}: call this callback's record_loss(loss) where this "
                    "Trainer computes its loss."
                )
        else:
            self.close_micro_batch()
            losses, summed = self.losses, self.summed
            if self.missing or not losses:
                raise RuntimeError(
                    f"transformers.StepwatchCallback: the model returned no loss in step "
                    f"{step} (its output holds no 'loss'): this trainer computes the loss "
                    "outside the model (compute_loss_func, label_smoothing_factor or a "
                    "compute_loss of your own). Attach this callback to its Trainer "
                    "(StepwatchCallback([...]).attach(trainer)) to record the Trainer's loss, "
                    "call its record_loss(loss) in compute_loss, or have the model return "
                    "{'loss': ...}."
                )
        if len(losses) == 1:
            loss = losses[0]
        else:
            stacked = torch.stack([t.detach() for t in losses])
            loss = stacked.sum() if summed else stacked.mean()
        outputs, inputs = self.outputs, self.inputs
        self.reset()
        return loss, outputs, inputs

    def reset(self) -> None:
        self.taken = []
        self.handed = []
        self.losses = []
        self.missing = False
        self.summed = False
        self.current = None
        self.recorded = None
        self.outputs = None
        self.inputs = None
        self.norm = None


def _put_on(obj: Any, name: str, wrapper: Any, owner: StepLoss) -> None:
    """Set ``wrapper`` as ``obj``'s attribute ``name``, marked with whose it is and what the
    instance held before (:func:`_take_off` reads the marks)."""
    wrapper._stepwatch_owner = owner
    wrapper._stepwatch_held = vars(obj).get(name, _ABSENT)
    setattr(obj, name, wrapper)


def _live(wrapper: Any) -> bool:
    """Whether a wrapper's bridge still holds it (its StepLoss's wrapper or clip_wrapper)."""
    owner = getattr(wrapper, "_stepwatch_owner", None)
    return owner is not None and wrapper in (owner.wrapper, owner.clip_wrapper)


def _take_off(obj: Any, name: str) -> None:
    """Take the wrappers whose bridges let go off the top of ``obj``'s attribute ``name``."""
    top = vars(obj).get(name, _ABSENT)
    while hasattr(top, "_stepwatch_held"):
        if _live(top):  # a bridge still on: its wrapper and those below stay
            break
        top = top._stepwatch_held  # a wrapper whose bridge let go: what it wrapped
    if top is _ABSENT:
        vars(obj).pop(name, None)
    else:
        setattr(obj, name, top)


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output, as the Trainer finds it: ``output['loss']`` of a dict
    (a ``ModelOutput``), else the first item of a tuple."""
    if type(output) is dict or isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = None
    return loss if isinstance(loss, torch.Tensor) else None
