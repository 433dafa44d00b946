"""Argument checks shared by every public constructor.

Each check raises TypeError for a wrong type and ValueError for a wrong value, and the message
names the argument, what it got and what to pass instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, overload

__all__: list[str] = []


class TypeAndValueError(TypeError, ValueError):
    """A wrong type where MindSpore raises ValueError: an instance of both, so code written
    for either (``except TypeError`` or ``except ValueError``) keeps working."""


class UnknownNameError(KeyError, ValueError):
    """An unknown name where MindSpore raises KeyError (and stepwatch's rule says
    ValueError): an instance of both. Its text is the message, not a quoted key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_PACKAGE = str(Path(__file__).resolve().parent)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller of this function that points at
    the first frame outside stepwatch: the user's line, however deep the call came from."""
    import sys

    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


def _got(value: Any) -> str:
    shown = repr(value)
    if "\n" in shown or len(shown) > 120:  # a network's or an optimizer's repr: its first line
        shown = shown.splitlines()[0][:100] + " ..."
    return f"{shown} with type '{type(value).__name__}'"


_N = TypeVar("_N", int, float)


class _NumberCheck(Generic[_N]):
    """A check of a number argument (``check_int``, ``check_number``): ``value`` if it is one
    of ``types`` (never a bool) and at least ``minimum``, as ``convert`` returns it; None for
    None when ``allow_none``. ``kind`` names the type in the TypeError (``'an int'``),
    ``at_least`` the bound in the ValueError (``'an int >= '``)."""

    def __init__(
        self, types: tuple[type[float], ...], convert: Callable[[Any], _N], kind: str, at_least: str
    ) -> None:
        self._types = types
        self._convert: Callable[[Any], _N] = convert
        self._kind = kind
        self._at_least = at_least

    @overload
    def __call__(
        self,
        name: str,
        value: Any,
        *,
        minimum: _N | None = None,
        allow_none: Literal[False] = False,
    ) -> _N: ...

    @overload
    def __call__(
        self, name: str, value: Any, *, minimum: _N | None = None, allow_none: bool
    ) -> _N | None: ...

    def __call__(
        self, name: str, value: Any, *, minimum: _N | None = None, allow_none: bool = False
    ) -> _N | None:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, self._types):
            expected = self._kind + (" or None" if allow_none else "")
            raise TypeError(f"'{name}' must be {expected}, but got {_got(value)}.")
        if minimum is not None and value < minimum:
            raise ValueError(f"'{name}' must be {self._at_least}{minimum}, but got {_got(value)}.")
        return self._convert(value)


def _same(value: Any) -> Any:
    return value


# check_int returns the int it was given; check_number returns a float.
check_int = _NumberCheck[int]((int,), _same, "an int", "an int >= ")
check_number = _NumberCheck[float]((int, float), float, "a number", ">= ")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"'{name}' must be a bool (True or False), but got {_got(value)}.")
    return value


def check_callable(name: str, value: Any, *, allow_none: bool = True) -> Any:
    if value is None and allow_none:
        return None
    if not callable(value):
        raise TypeError(f"'{name}' must be a callable or None, but got {_got(value)}.")
    return value


def check_arity(name: str, fn: Any, shape: str, example: tuple[Any, ...]) -> None:
    """Raise TypeError now when ``fn`` cannot be called with the arguments ``example`` stands
    for (``shape`` names them, e.g. ``'fn(alert, run_context)'``), rather than at the first
    call, deep in training. A callable with no signature to read (a builtin) passes."""
    import inspect

    try:
        inspect.signature(fn).bind(*example)
    except TypeError:
        count = {1: "one", 2: "two", 3: "three"}.get(len(example), str(len(example)))
        raise TypeError(f"'{name}' {fn!r} must take {count} arguments, {shape}.") from None
    except ValueError:
        pass


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"'{name}' must be one of {choices}, but got {_got(value)}.")
    if value not in choices:
        raise ValueError(f"'{name}' must be one of {choices}, but got {value!r}.")
    return value


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a file or folder at ``path`` would
    be created (checked before training, so a bad path fails at the door)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
