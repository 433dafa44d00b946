"""``emit``: how the printing callbacks print a line, so that a progress bar stays whole."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["emit", "set_line_writer"]

# Set by an active ProgressBar (tqdm.write) and reset when it closes; None prints plainly.
_writer: Callable[[str], None] | None = None


def emit(line: str) -> None:
    """Print ``line`` on stdout: above the progress bar while one is showing."""
    writer = _writer
    if writer is None:
        print(line)  # as MindSpore prints: no flush (a stdout replacement may act on it)
    else:
        writer(line)


def set_line_writer(writer: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Route :func:`emit` through ``writer`` (None: plain ``print``); returns the previous one."""
    global _writer
    previous, _writer = _writer, writer
    return previous
