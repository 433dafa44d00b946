"""The callback mechanism: ``Callback``, ``RunContext``, cb_params and the dispatch table."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..._tensor import as_stepwatch_tensor

__all__ = ["Callback", "CallbackParams", "RunContext"]

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
    object whose fields are listed in the README.

    A callback is a context manager: the loop enters every callback before the run and exits them
    in reverse order afterwards, also when an exception escapes (``__exit__`` then sees it).

    Class attributes:
        order: callbacks run sorted by ``order`` (stable, default 0), so a callback that must see
            the others' results (a recorder) can set a larger value.

    Example:
        >>> class PrintEvery50(Callback):
        ...     def step_end(self, run_context):
        ...         cb_params = run_context.original_args()
        ...         if cb_params.cur_step_num % 50 == 0:
        ...             print(cb_params.cur_step_num, cb_params.loss)
    """

    order: int = 0

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

    # MindSpore 1.x names.
    def begin(self, run_context: RunContext) -> None:
        """Called once before the first epoch (train) or before evaluation (eval)."""

    def epoch_begin(self, run_context: RunContext) -> None:
        """Called at the start of every epoch."""

    def step_begin(self, run_context: RunContext) -> None:
        """Called before every step."""

    def step_end(self, run_context: RunContext) -> None:
        """Called after every step."""

    def epoch_end(self, run_context: RunContext) -> None:
        """Called at the end of every epoch."""

    def end(self, run_context: RunContext) -> None:
        """Called once when the run ends normally."""

    # MindSpore 2.x names; each defaults to its 1.x name.
    def on_train_begin(self, run_context: RunContext) -> None:
        """Called once before the first training epoch."""
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        """Called at the start of each training epoch."""
        self.epoch_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        """Called before each training step; ``cb_params.train_dataset_element`` is the batch."""
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        """Called after each training step; gradients are still on the parameters."""
        self.step_end(run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        """Called after each training epoch (after the epoch's validation in ``fit``)."""
        self.epoch_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        """Called once when training ends (not when an exception escapes)."""
        self.end(run_context)

    def on_eval_begin(self, run_context: RunContext) -> None:
        """Called once before evaluation."""
        self.begin(run_context)

    def on_eval_epoch_begin(self, run_context: RunContext) -> None:
        """Called at the start of the evaluation pass."""
        self.epoch_begin(run_context)

    def on_eval_step_begin(self, run_context: RunContext) -> None:
        """Called before each evaluation step."""
        self.step_begin(run_context)

    def on_eval_step_end(self, run_context: RunContext) -> None:
        """Called after each evaluation step."""
        self.step_end(run_context)

    def on_eval_epoch_end(self, run_context: RunContext) -> None:
        """Called at the end of the evaluation pass."""
        self.epoch_end(run_context)

    def on_eval_end(self, run_context: RunContext) -> None:
        """Called once after evaluation; in ``fit`` ``cb_params.eval_results`` is set."""
        self.end(run_context)


_UNSET: Any = object()


class CallbackParams:
    """The cb_params object returned by ``run_context.original_args()``.

    Fields are attributes (``cb_params.cur_step_num``); dict-style access (``cb_params["x"]``,
    ``cb_params.get("x")``, ``"x" in cb_params``) works too. A missing field raises
    ``AttributeError``, so ``getattr(cb_params, "accuracy", None)`` returns ``None``.

    Two fields are computed when read, so that nothing syncs with the device unless a callback
    asks:

    * ``net_outputs`` - the step's loss as a detached :class:`stepwatch.Tensor` (no host copy);
    * ``loss`` - at step hooks the step's loss as a float (reading it waits for the device);
      at ``on_train_epoch_end`` the epoch's mean training loss;
    * ``outputs`` - the network's output for the batch, detached;
    * ``lr`` - the first parameter group's learning rate.

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
    _epoch_start_rng: Any
    _trained_step: int  # the last step whose optimizer update is done

    def __init__(self, **fields: Any) -> None:
        self._raw_net_outputs: Any = _UNSET
        self._raw_outputs: Any = None
        self._wrapped: tuple[Any, Any] | None = None
        self._epoch_loss: float | None = None
        self.__dict__.update(fields)

    # -- computed fields ---------------------------------------------------------------------
    @property
    def net_outputs(self) -> Any:
        raw = self._raw_net_outputs
        if raw is _UNSET:
            raise AttributeError("'net_outputs' is not set before the first step has run")
        wrapped = self._wrapped
        if wrapped is not None and wrapped[0] is raw:
            return wrapped[1]
        value = as_stepwatch_tensor(raw)
        self._wrapped = (raw, value)
        return value

    @net_outputs.setter
    def net_outputs(self, value: Any) -> None:
        self._raw_net_outputs = value

    @property
    def loss(self) -> float:
        if self._epoch_loss is not None:
            return self._epoch_loss
        raw = self._raw_net_outputs
        if raw is _UNSET:
            raise AttributeError("'loss' is not set before the first step has run")
        if isinstance(raw, (tuple, list)):
            raw = raw[0]
        return float(raw.detach()) if hasattr(raw, "detach") else float(raw)

    @loss.setter
    def loss(self, value: float | None) -> None:
        self._epoch_loss = value

    @property
    def outputs(self) -> Any:
        """The network's output for the step's batch, detached (None before the first step)."""
        out = self._raw_outputs
        return out.detach() if hasattr(out, "detach") else out

    @outputs.setter
    def outputs(self, value: Any) -> None:
        self._raw_outputs = value

    @property
    def lr(self) -> float:
        """The first parameter group's learning rate, read from the optimizer."""
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError("'lr' needs an optimizer; this run has none")
        return float(optimizer.param_groups[0]["lr"])

    def __getattr__(self, name: str) -> Any:
        # Reached only for a field that is not set: an AttributeError, so that
        # getattr(cb_params, "accuracy", None) and hasattr() work (MindSpore raises KeyError).
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
        names.append("outputs")
        if self._raw_net_outputs is not _UNSET:
            names += ["net_outputs", "loss"]
        return names

    def items(self) -> Iterator[tuple[str, Any]]:
        for key in self.keys():
            yield key, getattr(self, key)

    def __repr__(self) -> str:
        return f"CallbackParams({', '.join(sorted(self.keys()))})"


class RunContext:
    """What every hook receives: the run's cb_params and a way to stop it.

    Args:
        original_args: the cb_params object (or a dict of fields, which is wrapped).

    Raises:
        TypeError: ``original_args`` is neither a dict nor a :class:`CallbackParams`.
    """

    def __init__(self, original_args: CallbackParams | dict[str, Any]) -> None:
        if isinstance(original_args, CallbackParams):
            self._original_args = original_args
        elif isinstance(original_args, dict):
            self._original_args = CallbackParams(**original_args)
        else:
            raise TypeError(
                "RunContext's 'original_args' must be a dict or CallbackParams, but got "
                f"{original_args!r} with type '{type(original_args).__name__}'."
            )
        self._stop_requested = False
        self.stop_reason: str | None = None
        # True when the stop comes from outside (a signal): the run is interrupted, not done.
        self.interrupted = False

    def original_args(self) -> CallbackParams:
        """Return the cb_params object."""
        return self._original_args

    def request_stop(self, reason: str | None = None, interrupted: bool = False) -> None:
        """Ask the loop to stop after the current step.

        The rest of the epoch is skipped; validation (in ``fit``), ``on_train_epoch_end`` and
        ``on_train_end`` still run. ``reason`` is logged once when the run stops.
        ``interrupted=True`` says the run was cut short from outside (a signal) and should be
        resumed later: backups are kept and the run store marks it ``interrupted``.
        """
        self._stop_requested = True
        self.interrupted = self.interrupted or interrupted
        if reason is not None and self.stop_reason is None:
            self.stop_reason = reason

    def get_stop_requested(self) -> bool:
        """Return True once a stop was requested."""
        return self._stop_requested


def _overrides(callback: Callback, hook: str) -> bool:
    """True when calling ``hook`` on ``callback`` can do anything."""
    old = OLD_NAME[hook]
    if hook in callback.__dict__ or old in callback.__dict__:
        return True
    cls = type(callback)
    return getattr(cls, hook) is not getattr(Callback, hook) or (
        getattr(cls, old) is not getattr(Callback, old)
    )


def _describe_bad_callback(index: int | None, item: Any) -> str:
    where = "'callbacks'" if index is None else f"callbacks[{index}]"
    if inspect.isclass(item) and issubclass(item, Callback):
        return (
            f"{where} is the class {item.__name__}, not an instance: pass {item.__name__}() "
            "instead."
        )
    return (
        f"{where} must be a Callback instance, but got {item!r} with type "
        f"'{type(item).__name__}'. When the 'callbacks' is a list, the elements in 'callbacks' "
        "must be Callback functions."
    )


def normalize_callbacks(callbacks: Any) -> list[Callback]:
    """Turn the ``callbacks`` argument into a list, with MindSpore's rules and clearer errors."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    if isinstance(callbacks, (list, tuple)):
        for i, item in enumerate(callbacks):
            if not isinstance(item, Callback):
                raise TypeError(_describe_bad_callback(i, item))
        return list(callbacks)
    raise TypeError(_describe_bad_callback(None, callbacks))


class CallbackList:
    """The callbacks of one run, sorted once, with a per-hook table of those that override it.

    Calling a hook costs nothing for callbacks that do not implement it. An exception raised by a
    callback keeps its type and gains a note naming the callback and the hook.
    """

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks: list[Callback] = sorted(callbacks, key=lambda c: getattr(c, "order", 0))
        self.table: dict[str, list[tuple[Callback, Callable[[RunContext], Any]]]] = {
            hook: [(cb, getattr(cb, hook)) for cb in self.callbacks if _overrides(cb, hook)]
            for hook in HOOKS
        }
        # What the loops call: per hook, the bound functions only.
        self.fns: dict[str, list[Callable[[RunContext], Any]]] = {
            hook: [fn for _, fn in entries] for hook, entries in self.table.items()
        }
        # For naming the culprit of an exception from its traceback.
        self._ids = {id(cb): cb for cb in self.callbacks}
        self._codes: dict[Any, tuple[Callback, str]] = {}
        for hook, entries in self.table.items():
            for cb, fn in entries:
                code = getattr(getattr(fn, "__func__", fn), "__code__", None)
                if code is not None:
                    self._codes.setdefault(code, (cb, hook))

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
