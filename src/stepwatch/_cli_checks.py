"""Checks the ``stepwatch demo`` command makes before it trains: the paths it writes and the
device. Each failure is a :class:`UsageError`: one line on stderr, exit status 2
(:func:`one_line` words every command's failure)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["UsageError", "check_demo_paths", "check_device", "one_line"]


class UsageError(Exception):
    """A user mistake reported as one line on stderr, exit status 2."""


def _check_can_create_in(folder: Path, what: str) -> None:
    """The nearest existing folder at or above ``folder`` is one we can create files in."""
    import tempfile

    from ._validation import nearest_existing

    base = nearest_existing(folder)
    if not base.is_dir():
        raise UsageError(f"{what}: {base} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        raise UsageError(f"{what}: cannot create files in {base} ({exc.strerror})") from None


def check_demo_paths(args: argparse.Namespace) -> None:
    from .store._schema import resolve_path

    checkpoints = Path(args.checkpoint_dir)
    url = args.db is not None and "://" in str(args.db)  # a store URL: the recorder checks it
    db = None if url else resolve_path(args.db)
    if db is not None and db.exists() and not db.is_file():
        raise UsageError(f"--db {db} is not a file")
    if db is not None:
        _check_can_create_in(db.parent, f"--db {db}")
    if checkpoints.exists() and not checkpoints.is_dir():
        raise UsageError(f"--checkpoint-dir {checkpoints} is a file; pass a folder")
    _check_can_create_in(checkpoints, f"--checkpoint-dir {checkpoints}")


def check_device(text: str) -> None:
    """The device string parses and that device is present (this imports torch)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--device {text!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)"
        ) from None
    if device.type == "cpu":
        return
    if device.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    else:
        backend = getattr(torch, device.type, None)
        is_available = getattr(backend, "is_available", None)
        if is_available is None:
            raise UsageError(f"--device {text!r}: stepwatch cannot train on {device.type!r}")
        available = bool(is_available())
        count = int(getattr(backend, "device_count", lambda: 1)()) if available else 0
    if not available:
        raise UsageError(f"--device {text!r}: no {device.type} device on this machine")
    if device.index is not None and device.index >= count:
        raise UsageError(f"--device {text!r}: this machine has {count} {device.type} device(s)")


# An argument's name in an error from the library, as the command's flag.
_FLAGS = {
    "'db'": "--db",
    "'path'": "--db",
    "'to'": "--to",
    "'port'": "--port",
    "'host'": "--host",
    "'token'": "--token",
    "'allowed_hosts'": "--allow-host",
}


def one_line(exc: BaseException) -> str:
    """A command's failure in one line: a bad argument named as its flag, a surprise with its
    exception class."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    text = " ".join(str(text).split())
    name, _, rest = text.partition(" ")
    if name in _FLAGS:  # a bad argument, named as the command's flag
        return f"{_FLAGS[name]} {rest}"
    bad_argument = isinstance(exc, (UsageError, ValueError, TypeError))
    return text if bad_argument else f"{type(exc).__name__}: {text}"
