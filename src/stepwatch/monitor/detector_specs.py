"""Building AnomalyMonitor's detectors from what the user passes: kind names, options, or
detectors of one's own (:func:`make_detectors`, :func:`is_detector`). No PyTorch."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from .._validation import _got
from ._detector import Detector
from .detectors import DETECTORS

__all__ = ["is_detector", "make_detectors"]

_KNOWN = ", ".join(map(repr, DETECTORS))


def _build(kind: Any, options: Any = None) -> Detector:
    if not isinstance(kind, str):
        raise TypeError(f"detector kinds must be str, but got {_got(kind)}; known: {_KNOWN}.")
    if kind not in DETECTORS:
        raise ValueError(f"unknown detector kind {kind!r}; known: {_KNOWN}.")
    cls = DETECTORS[kind]
    if isinstance(options, cls) or options is None:
        return options or cls()
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options for {kind!r} must be a dict or a {cls.__name__}, got {_got(options)}"
        )
    known = [n for n in inspect.signature(cls).parameters if n != "self"]
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(
                f"unknown option {name!r} for detector {kind!r}: it takes "
                f"{', '.join(map(repr, known))}{hint}"
            )
    return cls(**options)


def is_detector(obj: Any) -> bool:
    """True for a detector of one's own: an object with a non-empty str ``kind``, ``reset()``
    and ``update_many(steps, values, epoch)`` returning a list of :class:`Alert`."""
    kind = getattr(obj, "kind", None)
    return (
        isinstance(kind, str)
        and bool(kind)
        and callable(getattr(obj, "reset", None))
        and callable(getattr(obj, "update_many", None))
        and not isinstance(obj, type)
    )


def make_detectors(spec: Any = None) -> list[Detector]:
    """Build detectors from ``spec``: None (every kind but 'threshold', with defaults), a list
    of kind names or detector instances, or a dict of kind -> options dict (or a ready detector
    instance).

    A detector of one's own (see :func:`is_detector`, e.g. a :class:`Detector` subclass with a
    new ``kind``) is fed every step loss like the built-in loss detectors; its alerts take the
    same path (log, store, action) as theirs.

    Raises:
        ValueError: an unknown kind (the message lists the known ones).
        TypeError: a spec, kind or options of the wrong type.
    """
    if spec is None:
        return [cls() for kind, cls in DETECTORS.items() if kind != "threshold"]
    if isinstance(spec, (list, tuple, Mapping)) and not spec:
        raise ValueError(
            "'detectors' is empty, so nothing would be watched; pass None for every detector "
            f"at its defaults, or name some: {_KNOWN}."
        )
    if isinstance(spec, Mapping):
        return [
            options if kind not in DETECTORS and is_detector(options) else _build(kind, options)
            for kind, options in spec.items()
        ]
    if isinstance(spec, (list, tuple)):
        return [item if is_detector(item) else _build(item) for item in spec]
    raise TypeError(
        "'detectors' must be None, a list of detector kinds or a dict of kind -> options, "
        f"but got {_got(spec)}; known kinds: {_KNOWN}."
    )
