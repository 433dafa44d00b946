"""Checks on what is passed as callbacks: a hook that cannot take the run context, and another
trainer's callback where a stepwatch one belongs. (No import of the Callback class: its module
imports this one.)"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from ..._validation import _got, user_stacklevel

__all__ = [
    "check_hook_names",
    "check_hooks",
    "describe_bad_callback",
    "foreign_callback",
    "hook_signature_problem",
    "is_host_hook",
    "missing_attribute",
]

# The package another trainer's callbacks come from: what they are, and where they go.
_HOSTS = {
    "lightning": ("a Lightning callback", "the Trainer's callbacks=[...]", "lightning"),
    "pytorch_lightning": ("a Lightning callback", "the Trainer's callbacks=[...]", "lightning"),
    "transformers": ("a Hugging Face Trainer callback", "Trainer(callbacks=[...])", "transformers"),
    "keras": ("a Keras callback", "model.fit(callbacks=[...])", "keras"),
    "mindspore": ("a MindSpore callback", "MindSpore's Model.train(callbacks=[...])", "mindspore"),
}

# What other trainers call first on a callback of theirs (Lightning, the Hugging Face Trainer,
# Keras): on a stepwatch callback handed to them, the error says where it belongs.
_HOST_HOOKS = frozenset(
    {
        "setup",
        "teardown",
        "on_exception",
        "on_fit_start",
        "on_init_end",
        "set_model",
        "set_params",
        "on_batch_begin",
        "on_batch_end",
        "on_epoch_begin",
        "on_epoch_end",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_step_begin",
        "on_step_end",
    }
)

# Other trainers' hook names, and the stepwatch hook each one means.
_THEIR_NAMES = {
    "on_epoch_begin": "on_train_epoch_begin",
    "on_epoch_end": "on_train_epoch_end",
    "on_epoch_start": "on_train_epoch_begin",
    "on_batch_begin": "on_train_step_begin",
    "on_batch_end": "on_train_step_end",
    "on_train_batch_begin": "on_train_step_begin",
    "on_train_batch_start": "on_train_step_begin",
    "on_train_batch_end": "on_train_step_end",
    "on_step_begin": "on_train_step_begin",
    "on_step_end": "on_train_step_end",
    "on_train_start": "on_train_begin",
    "on_validation_end": "on_eval_end",
    "on_validation_epoch_end": "on_eval_epoch_end",
}
_warned_classes: set[type] = set()

# Functions already checked (a class's hooks are checked once, not at every run): as methods
# (the first argument bound) and as plain functions, apart.
_checked_methods: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()
_checked_plain: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def describe_bad_callback(index: int | None, item: Any, callback_type: type) -> str:
    """The error for ``item``, found in ``callbacks`` (at ``index``) and not a Callback."""
    where = "'callbacks'" if index is None else f"callbacks[{index}]"
    if inspect.isclass(item) and issubclass(item, callback_type):
        return (
            f"{where} is the class {item.__name__}, not an instance: pass {item.__name__}() "
            "instead."
        )
    foreign = foreign_callback(item)
    if foreign is not None:
        return f"{where} {foreign}."
    return (
        f"{where} must be a Callback instance, but got {_got(item)}. When the 'callbacks' is a "
        "list, the elements in 'callbacks' must be Callback functions."
        + (" Wrap a function: LambdaCallback(on_train_step_end=fn)." if callable(item) else "")
    )


def check_hooks(table: dict[str, list[tuple[Any, Any]]]) -> None:
    """Raise TypeError for a hook in ``table`` (hook -> [(callback, function)]) that cannot be
    called with the run context alone: before the run, not at its first call."""
    for hook, entries in table.items():
        for callback, fn in entries:
            shown = hook_signature_problem(fn)
            if shown is None:
                continue
            owner = type(callback).__name__
            if hasattr(fn, "__self__"):  # a method
                name = getattr(fn, "__name__", hook)
                raise TypeError(
                    f"{owner}.{name}{shown} cannot take the run context: define it as "
                    f"'def {name}(self, run_context)'."
                )
            raise TypeError(
                f"{owner}'s {hook} function{shown} cannot take the run context: give it one "
                "argument (lambda run_context: ...)."
            )


def check_hook_names(callbacks: Any, hooks: tuple[str, ...], base: type) -> None:
    """Warn once per class when a callback of one's own defines an ``on_...`` method that no
    loop calls (a misspelling, or another trainer's name for a hook), naming the hook meant."""
    import difflib
    import warnings

    for callback in callbacks:
        cls = type(callback)
        if cls in _warned_classes or cls.__module__.split(".")[0] == "stepwatch":
            continue
        _warned_classes.add(cls)
        mro = cls.__mro__
        mine = mro[: mro.index(base)] if base in mro else mro  # the classes above stepwatch's
        own = {
            name
            for klass in mine
            for name, value in vars(klass).items()
            if name.startswith("on_") and name not in hooks and callable(value)
        }
        for name in sorted(own):
            meant = _THEIR_NAMES.get(name) or next(
                iter(difflib.get_close_matches(name, hooks, n=1, cutoff=0.8)), None
            )
            if meant is None:
                continue  # a method of its own that only looks like a hook
            warnings.warn(
                f"{cls.__name__}.{name} is not a hook stepwatch calls, so it never runs; did "
                f"you mean {meant}?",
                UserWarning,
                stacklevel=user_stacklevel(),
            )


def is_host_hook(name: str) -> bool:
    """Whether another trainer calls ``name`` first on a callback of its own."""
    return name in _HOST_HOOKS


def missing_attribute(owner: str, name: str) -> AttributeError:
    """The AttributeError for a stepwatch callback's missing ``name`` that another trainer
    calls as its hook: where stepwatch callbacks go in that trainer."""
    return AttributeError(
        f"'{owner}' object has no attribute '{name}': {owner} is a stepwatch callback, and "
        "another trainer called its own hook on it. Pass stepwatch callbacks to that trainer "
        "through its bridge, StepwatchCallback([...]) from stepwatch.integrations.lightning, "
        ".transformers, .keras or .mindspore"
    )


def foreign_callback(item: Any) -> str | None:
    """What to say of another trainer's callback passed where stepwatch callbacks go, or
    None when ``item`` is not one."""
    host = _HOSTS.get(type(item).__module__.split(".")[0])
    if host is None:
        return None
    what, where, module = host
    return (
        f"is {what} ({type(item).__name__}), not a stepwatch Callback: pass it to {where} "
        f"next to stepwatch.integrations.{module}.StepwatchCallback([...stepwatch callbacks])"
    )


def hook_signature_problem(fn: Any) -> str | None:
    """The signature of a hook that cannot be called with the run context alone (shown in the
    error), or None when it can (or cannot be told)."""
    func = getattr(fn, "__func__", fn)
    checked = _checked_methods if func is not fn else _checked_plain
    try:
        return checked[func]
    except (KeyError, TypeError):
        pass
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(None)
        problem = None
    except TypeError:
        problem = str(signature.replace(return_annotation=inspect.Signature.empty))
    try:
        checked[func] = problem
    except TypeError:  # not weak-referable (a builtin)
        pass
    return problem
