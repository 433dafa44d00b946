"""The callback mechanism: ``Callback``, ``RunContext``, cb_params and the dispatch table."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from ._callback_args import (
    check_hook_names,
    check_hooks,
    describe_bad_callback,
    is_host_hook,
    missing_attribute,
)
from ._params import CallbackParams, Progress

__all__ = [
    "ORDER_DEFAULT",
    "ORDER_RECORD",
    "ORDER_SAVE",
    "ORDER_STEER",
    "Callback",
    "CallbackParams",
    "Progress",
    "RunContext",
    "StopKind",
]

# The bands of ``Callback.order``: callbacks run sorted by it, so each band sees what the
# bands before it did in the same hook.
ORDER_DEFAULT = 0  # user callbacks and printing monitors
ORDER_STEER = 50  # callbacks that change training: EarlyStopping, ReduceLROnPlateau
ORDER_SAVE = 100  # callbacks that save state, after the steering decisions are made
ORDER_RECORD = 200  # recorders, which record what every other callback did

# Why a run was asked to stop. Saving callbacks tell them apart:
#   "requested"   - a callback decided training is done (early stopping): save as usual;
#   "interrupted" - the process was asked to stop from outside (a signal): save, keep backups,
#                   the run is meant to be resumed;
#   "anomaly"     - training went wrong (a non-finite loss): do not overwrite good checkpoints.
StopKind = Literal["requested", "interrupted", "anomaly"]
_F = TypeVar("_F", bound=Callable[..., Any])
STOP_KINDS: tuple[str, ...] = ("requested", "interrupted", "anomaly")
# A stop of a graver kind wins over a milder one requested earlier.
_GRAVITY = {kind: i for i, kind in enumerate(STOP_KINDS)}

# The hooks the loops call, and the MindSpore 1.x name each one delegates to by default.
TRAIN_HOOKS = (
    "on_train_begin",
    "on_train_epoch_begin",
    "on_train_step_begin",
    "on_train_step_end",
    "on_train_epoch_end",
    "on_train_end",
)
EVAL_HOOKS = (
    "on_eval_begin",
    "on_eval_epoch_begin",
    "on_eval_step_begin",
    "on_eval_step_end",
    "on_eval_epoch_end",
    "on_eval_end",
)
HOOKS = TRAIN_HOOKS + EVAL_HOOKS
OLD_NAME = {hook: hook.split("_", 2)[2] for hook in HOOKS}  # on_train_epoch_end -> epoch_end


class Callback:
    """Base class of every callback, with MindSpore's hook names and delegation rule.

    Override any of the new hook names (``on_train_step_end``, ``on_eval_end``, ...) or the old
    ones (``begin``, ``epoch_begin``, ``step_begin``, ``step_end``, ``epoch_end``, ``end``). The
    loops call only the new names; the default body of each new hook calls its old name, so an
    old-name override runs in both training and evaluation.

    Each hook receives a :class:`RunContext`; ``run_context.original_args()`` is the cb_params
    object whose fields are listed in the documentation (docs/callbacks.md).

    A callback is a context manager: entered before the run, exited (in reverse order) after it,
    also when an exception escapes.

    Class attributes:
        order: callbacks run sorted by ``order`` (stable, default ``ORDER_DEFAULT`` = 0), so a
            callback that must see the others' results can set a larger value: the bands are
            ``ORDER_STEER`` (50), ``ORDER_SAVE`` (100) and ``ORDER_RECORD`` (200).
        rank_zero_only: when True, the callback takes part only on rank 0 of a distributed run;
            on other ranks it is left out of the run entirely (not entered, no hook called).

    Example:
        >>> class PrintEvery50(Callback):
        ...     def step_end(self, run_context):
        ...         cb_params = run_context.original_args()
        ...         if cb_params.cur_step_num % 50 == 0:
        ...             print(cb_params.cur_step_num, cb_params.loss)
    """

    order: int = ORDER_DEFAULT
    rank_zero_only: bool = False

    def __getattr__(self, name: str) -> Any:  # only for names that are missing
        if is_host_hook(name):  # another trainer calling its hook: say where this belongs
            raise missing_attribute(type(self).__name__, name)
        parent = getattr(super(), "__getattr__", None)  # a mixin's own (nn.Module's)
        if parent is not None:
            return parent(name)
        return object.__getattribute__(self, name)  # the plain error (a property's own)

    # -- state saved in checkpoints ---------------------------------------------------------
    @property
    def state_key(self) -> str:
        """The key under which this callback's state is saved in checkpoints.

        Unique per run: two stateful callbacks with the same key are rejected. Callbacks that
        may appear twice with different settings include those settings in the key.
        """
        return type(self).__qualname__

    def _state_key_with(self, **settings: Any) -> str:
        return f"{type(self).__qualname__}{settings!r}"

    def state_dict(self) -> dict[str, Any]:
        """Return the state to save in checkpoints (override to make a callback stateful).

        Values must be numbers, strings, lists, dicts or tensors (checkpoints load with
        ``weights_only=True``).
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""

    def __enter__(self) -> Callback:
        return self

    def __exit__(self, *err: Any) -> None:
        return None

    # MindSpore 1.x names. Each reaches the 2.x hook that the class overrides for the run's
    # mode (``cb_params.mode``), so ``LossMonitor().step_end(rc)`` prints as MindSpore's does,
    # and a subclass's ``step_end`` can call ``super().step_end(rc)``.
    def begin(self, run_context: RunContext) -> None:
        """Called once before the first epoch (train) or before evaluation (eval)."""
        self._forward("begin", run_context)

    def epoch_begin(self, run_context: RunContext) -> None:
        """Called at the start of every epoch."""
        self._forward("epoch_begin", run_context)

    def step_begin(self, run_context: RunContext) -> None:
        """Called before every step."""
        self._forward("step_begin", run_context)

    def step_end(self, run_context: RunContext) -> None:
        """Called after every step."""
        self._forward("step_end", run_context)

    def epoch_end(self, run_context: RunContext) -> None:
        """Called at the end of every epoch."""
        self._forward("epoch_end", run_context)

    def end(self, run_context: RunContext) -> None:
        """Called once when the run ends normally."""
        self._forward("end", run_context)

    # MindSpore 2.x names; each defaults to its 1.x name.
    def on_train_begin(self, run_context: RunContext) -> None:
        """Called once before the first training epoch."""
        self._delegate("begin", run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        """Called at the start of each training epoch."""
        self._delegate("epoch_begin", run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        """Called before each training step; ``cb_params.train_dataset_element`` is the batch."""
        self._delegate("step_begin", run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        """Called after each training step; gradients are still on the parameters."""
        self._delegate("step_end", run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        """Called after each training epoch (after the epoch's validation in ``fit``)."""
        self._delegate("epoch_end", run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        """Called once when training ends (not when an exception escapes)."""
        self._delegate("end", run_context)

    def on_eval_begin(self, run_context: RunContext) -> None:
        """Called once before evaluation."""
        self._delegate("begin", run_context)

    def on_eval_epoch_begin(self, run_context: RunContext) -> None:
        """Called at the start of the evaluation pass."""
        self._delegate("epoch_begin", run_context)

    def on_eval_step_begin(self, run_context: RunContext) -> None:
        """Called before each evaluation step."""
        self._delegate("step_begin", run_context)

    def on_eval_step_end(self, run_context: RunContext) -> None:
        """Called after each evaluation step."""
        self._delegate("step_end", run_context)

    def on_eval_epoch_end(self, run_context: RunContext) -> None:
        """Called at the end of the evaluation pass."""
        self._delegate("epoch_end", run_context)

    def on_eval_end(self, run_context: RunContext) -> None:
        """Called once after evaluation; in ``fit`` ``cb_params.eval_results`` is set."""
        self._delegate("end", run_context)

    # -- how the two sets of names reach each other ----------------------------------------------
    def _delegate(self, old: str, run_context: RunContext) -> None:
        """A 2.x hook the class does not override: call its 1.x name (MindSpore's rule)."""
        active = self.__dict__.setdefault("_sw_delegating", set())
        active.add(old)
        try:
            getattr(self, old)(run_context)
        finally:
            active.discard(old)

    def _forward(self, old: str, run_context: RunContext) -> None:
        """A 1.x name the class does not override: run the 2.x hook it does override for the
        run's mode (nothing when it came from that very hook's default)."""
        if old in self.__dict__.get("_sw_delegating", ()):
            return
        params = getattr(run_context, "cb_params", None)
        mode = getattr(params, "mode", "train") if params is not None else "train"
        hook = ("on_eval_" if mode == "eval" else "on_train_") + old
        if _owner(type(self), hook) is not Callback:
            getattr(self, hook)(run_context)


def _owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name``."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass
    return None


class RunContext:
    """What every hook receives: the run's cb_params and a way to stop it.

    Args:
        original_args: the cb_params object (or a dict of fields, which is wrapped).

    Attributes:
        cb_params: the cb_params object; the same as ``original_args()``, read without a call
            (for step hooks that run on every step).
        stop_requested: True once a stop was requested (``get_stop_requested()``).
        stop_reason: the first reason given to :meth:`request_stop`, or None.
        stop_kind: why the run stops: ``'requested'``, ``'interrupted'`` or ``'anomaly'``
            (see :meth:`request_stop`); None while no stop is requested.

    Raises:
        TypeError: ``original_args`` is neither a dict nor a :class:`CallbackParams`.
    """

    def __init__(self, original_args: CallbackParams | dict[str, Any]) -> None:
        if isinstance(original_args, CallbackParams):
            self.cb_params = original_args
        elif isinstance(original_args, dict):
            self.cb_params = CallbackParams(**original_args)
        else:
            raise TypeError(
                "RunContext's 'original_args' must be a dict or CallbackParams, but got "
                f"{original_args!r} with type '{type(original_args).__name__}'."
            )
        self.stop_requested = False
        self.stop_reason: str | None = None
        self.stop_kind: StopKind | None = None

    def original_args(self) -> CallbackParams:
        """Return the cb_params object."""
        return self.cb_params

    def request_stop(
        self, reason: str | None = None, interrupted: bool = False, kind: StopKind | None = None
    ) -> None:
        """Ask the loop to stop after the current step.

        The rest of the epoch is skipped; validation (in ``fit``), ``on_train_epoch_end`` and
        ``on_train_end`` still run. ``reason`` is logged once when the run stops.

        Args:
            reason: why, in words (logged, and recorded by ``RunRecorder``).
            interrupted: shorthand for ``kind='interrupted'``.
            kind: ``'requested'`` (default: training is done, e.g. early stopping),
                ``'interrupted'`` (cut short from outside, e.g. a signal: backups are kept and
                the run store marks the run ``interrupted``) or ``'anomaly'`` (training went
                wrong, e.g. a non-finite loss: saving callbacks do not save the weights).

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind is None:
            kind = "interrupted" if interrupted else "requested"
        elif kind not in _GRAVITY:
            raise ValueError(f"'kind' must be one of {STOP_KINDS}, but got {kind!r}.")
        self.stop_requested = True
        graver = self.stop_kind is None or _GRAVITY[kind] > _GRAVITY[self.stop_kind]
        if graver:
            self.stop_kind = kind  # a graver kind wins, and so does its reason
        if reason is not None and (self.stop_reason is None or graver):
            self.stop_reason = reason

    def get_stop_requested(self) -> bool:
        """Return True once a stop was requested."""
        return self.stop_requested

    # MindSpore's own attribute names, which its FAQ teaches and users' callbacks write to
    # (``run_context._stop_requested = True``) or read (``run_context._original_args``).
    @property
    def _stop_requested(self) -> bool:
        return self.stop_requested

    @_stop_requested.setter
    def _stop_requested(self, value: bool) -> None:
        if value:
            self.request_stop()
        else:  # MindSpore takes the request back
            self.stop_requested = False
            self.stop_kind = None
            self.stop_reason = None

    @property
    def _original_args(self) -> CallbackParams:
        return self.cb_params

    @property
    def interrupted(self) -> bool:
        """True when the stop came from outside (a signal): the run should be resumed later."""
        return self.stop_kind == "interrupted"


def is_stateful(callback: Any) -> bool:
    """True when ``callback`` overrides ``state_dict`` (its state goes into checkpoints)."""
    return isinstance(callback, Callback) and type(callback).state_dict is not Callback.state_dict


def on_clock(fn: _F) -> _F:
    """Mark a built-in's ``on_train_step_end`` as needed only at the steps it asks the run's
    step clock for (:meth:`~stepwatch.view.tap.LossTap.call_at`): a run whose step-end hooks
    are all marked runs the hookless loop, and calls them, in their order, at the steps the
    clock wakes. A subclass's override (or its 1.x ``step_end``) is called every step."""
    fn._on_clock = True  # type: ignore[attr-defined]
    return fn


def _hook_function(callback: Callback, hook: str) -> Callable[[RunContext], Any] | None:
    """What the loop calls for ``hook`` on ``callback``, or None when nothing would run: the
    more derived of the hook and its 1.x name (as in MindSpore: a subclass's ``step_end`` over
    a built-in's ``on_train_step_end``); a function set on the instance first."""
    old = OLD_NAME[hook]
    inst = callback.__dict__
    if hook in inst:
        return inst[hook]
    if old in inst:
        return inst[old]
    cls = type(callback)
    new_owner, old_owner = _owner(cls, hook) or Callback, _owner(cls, old) or Callback
    if new_owner is Callback and old_owner is Callback:
        return None
    if old_owner is not Callback and (
        new_owner is Callback or (old_owner is not new_owner and issubclass(old_owner, new_owner))
    ):
        return getattr(callback, old)
    return getattr(callback, hook)


def _check_unique(callbacks: Sequence[Callback]) -> None:
    seen_ids: set[int] = set()
    keys: dict[str, Callback] = {}
    for cb in callbacks:
        if id(cb) in seen_ids:
            raise ValueError(
                f"the same {type(cb).__name__} instance is passed twice in 'callbacks'; pass it "
                "once (or two separate instances)."
            )
        seen_ids.add(id(cb))
        if not is_stateful(cb):
            continue
        key = cb.state_key
        if key in keys:
            raise ValueError(
                f"two callbacks share the state_key {key!r} ({type(keys[key]).__name__} and "
                f"{type(cb).__name__}); their saved states would overwrite each other. Give one "
                "of them different arguments or override its state_key."
            )
        keys[key] = cb


def normalize_callbacks(callbacks: Any) -> list[Callback]:
    """Turn the ``callbacks`` argument into a list, with MindSpore's rules and clearer errors."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    if isinstance(callbacks, (list, tuple)):
        for i, item in enumerate(callbacks):
            if not isinstance(item, Callback):
                raise TypeError(describe_bad_callback(i, item, Callback))
        return list(callbacks)
    raise TypeError(describe_bad_callback(None, callbacks, Callback))


class CallbackList:
    """The callbacks of one run, sorted once, with a per-hook table of those that override it.

    Calling a hook costs nothing for callbacks that do not implement it. An exception raised by a
    callback keeps its type and gains a note naming the callback and the hook. Callbacks with
    ``rank_zero_only`` are left out on ranks other than 0, so those ranks pay nothing for them.
    The list also gathers and restores the callbacks' checkpoint state.

    Args:
        callbacks: the run's callbacks.
        rank: this process's rank in a distributed run (0 otherwise).

    Raises:
        ValueError: the same callback instance appears twice, or two stateful callbacks share
            a ``state_key``.
    """

    def __init__(self, callbacks: Sequence[Callback], rank: int = 0) -> None:
        callbacks = normalize_callbacks(
            list(callbacks) if isinstance(callbacks, tuple) else callbacks
        )
        _check_unique(callbacks)
        kept = [cb for cb in callbacks if rank == 0 or not getattr(cb, "rank_zero_only", False)]
        self.callbacks: list[Callback] = sorted(kept, key=lambda c: getattr(c, "order", 0))
        self.table: dict[str, list[tuple[Callback, Callable[[RunContext], Any]]]] = {
            hook: [
                (cb, fn) for cb in self.callbacks if (fn := _hook_function(cb, hook)) is not None
            ]
            for hook in HOOKS
        }
        check_hooks(self.table)  # each can take the run context: before the run, not in it
        check_hook_names(self.callbacks, HOOKS, Callback)
        # What the loops call: per hook, the bound functions only.
        self.fns: dict[str, list[Callable[[RunContext], Any]]] = {
            hook: [fn for _, fn in entries] for hook, entries in self.table.items()
        }
        # Some training step hook must run at every step (else only where the clock wakes).
        self.every_step = bool(self.fns["on_train_step_begin"]) or any(
            not getattr(fn, "_on_clock", False) for fn in self.fns["on_train_step_end"]
        )
        # For naming the culprit of an exception from its traceback.
        self._ids = {id(cb): cb for cb in self.callbacks}
        self._codes: dict[Any, tuple[Callback, str]] = {}
        for hook, entries in self.table.items():
            for cb, fn in entries:
                code = getattr(getattr(fn, "__func__", fn), "__code__", None)
                if code is not None:
                    self._codes.setdefault(code, (cb, hook))

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dicts(self) -> dict[str, dict[str, Any]]:
        """``{state_key: state_dict()}`` of every stateful callback of the run."""
        return {cb.state_key: cb.state_dict() for cb in self.callbacks if is_stateful(cb)}

    def load_state_dicts(self, saved: Mapping[str, Any], source: str = "the checkpoint") -> None:
        """Give each stateful callback its saved state, matched by ``state_key``.

        State saved for a callback that is not in this run is ignored, with a warning naming
        it (a resumed run without its EarlyStopping would otherwise silently lose patience).
        """
        used = set()
        for cb in self.callbacks:
            if is_stateful(cb) and cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])
                used.add(cb.state_key)
        left = sorted(set(saved) - used)
        if left:
            warnings.warn(
                f"{source} holds state for callbacks that are not in this run: {left}; that "
                "state is not restored. Pass the same callbacks (with the same arguments) to "
                "resume them.",
                UserWarning,
                stacklevel=3,
            )

    def __len__(self) -> int:
        return len(self.callbacks)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def call(self, hook: str, run_context: RunContext) -> None:
        """Call ``hook`` on every callback that implements it, in order."""
        try:
            for fn in self.fns[hook]:
                fn(run_context)
        except BaseException as exc:
            self.annotate(exc)
            raise

    def annotate(self, exc: BaseException) -> None:
        """Add a note naming the callback and hook an exception came from (once).

        Found from the traceback, so the loops can call hooks without a try block per call.
        """
        if getattr(exc, "_stepwatch_noted", False):
            return
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            found = self._codes.get(frame.f_code)
            owner = self._ids.get(id(frame.f_locals.get("self")))
            if found is not None or owner is not None:
                cb, hook = found if found is not None else (owner, frame.f_code.co_name)
                exc.add_note(f"(raised in callback {type(cb).__name__}.{hook})")
                try:
                    exc._stepwatch_noted = True  # type: ignore[attr-defined]
                except AttributeError:  # pragma: no cover - exceptions with __slots__
                    pass
                return
            tb = tb.tb_next

    @contextlib.contextmanager
    def entered(self) -> Iterator[CallbackList]:
        """Enter every callback as a context manager; exit them in reverse order."""
        with contextlib.ExitStack() as stack:
            for cb in self.callbacks:
                stack.enter_context(cb)
            yield self

    def describe(self) -> str:
        """A printable view of which callbacks run at which hook."""
        lines = []
        for hook in HOOKS:
            names = [type(cb).__name__ for cb, _ in self.table[hook]]
            if names:
                lines.append(f"{hook}: {', '.join(names)}")
        return "\n".join(lines) if lines else "(no callback implements any hook)"
