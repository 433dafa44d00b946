"""How numbers, durations, times and tables are written for people: one rule for the CLI and
anything else that prints a run (a dashboard, a report)."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["SIGNIFICANT", "duration", "number", "table", "timestamp", "value"]

# Significant digits of every float shown in a table.
SIGNIFICANT = 4


def number(x: float | int | None) -> str:
    """A number rounded to :data:`SIGNIFICANT` digits (``'-'`` for None; ``nan``, ``inf``)."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == int(x) and abs(x) < 10**SIGNIFICANT:
        return str(int(x))
    return f"{x:.{SIGNIFICANT}g}"


def value(x: Any) -> str:
    """Any config or result value: numbers by :func:`number`, containers as compact JSON."""
    if x is None or isinstance(x, (int, float)):
        return number(x)
    if isinstance(x, (dict, list, tuple)):
        return json.dumps(x, sort_keys=True, separators=(",", ":"), default=str)
    return str(x)


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    total = round(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def timestamp(seconds: float, with_seconds: bool = False) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM`` (``:SS`` with ``with_seconds``)."""
    when = datetime.datetime.fromtimestamp(seconds)
    return when.strftime("%Y-%m-%d %H:%M:%S" if with_seconds else "%Y-%m-%d %H:%M")


def width(text: str) -> int:
    """The columns ``text`` takes in a terminal: wide (CJK) characters count two, combining
    marks none, so tables of unicode run names stay aligned."""
    if text.isascii():
        return len(text)
    import unicodedata

    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, header first; trailing spaces trimmed."""
    widths = [max([width(h), *(width(r[i]) for r in rows)]) for i, h in enumerate(header)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(c + " " * (w - width(c)) for c, w in zip(line, widths)).rstrip() for line in lines
    )
