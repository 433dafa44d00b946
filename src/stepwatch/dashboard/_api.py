"""The dashboard's JSON answers, each from one :class:`stepwatch.store.Store` call, and the
checks of the requests' paths and parameters (the HTTP side is :mod:`.server`)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

from .._validation import check_int
from ..monitor import values as names
from ..store.reader import Store

__all__ = ["SYSTEM", "Api", "HTTPError", "clean", "int_params", "run_id"]

_METRIC_PARAMS = ("max_points", "after", "start", "end", "band")
SYSTEM = "system/"  # the prefix of the recorder's system metrics: a group of their own
_CLOCK_POINTS = 2000


class HTTPError(Exception):
    def __init__(
        self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


class Api:
    """The JSON answers, each from one :class:`Store` call."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._clocks: dict[int, tuple[Any, dict[str, Any]]] = {}

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for run, loss in self.store.runs_summary():
            out.append(
                {
                    "id": run.id,
                    "name": run.name,
                    "status": run.status,
                    "started": run.started,
                    "ended": run.ended,
                    "duration": run.duration,
                    "steps": run.steps,
                    "loss_key": loss.key if loss else None,
                    "last_loss": loss.last if loss else None,
                    "best_loss": loss.min if loss else None,
                    "config": run.config,
                    "host": run.host,
                    "user": run.user,
                }
            )
        return out

    def keys(self, run: int) -> list[str]:
        return self.store.keys(run)

    def panels(self, run: int) -> dict[str, Any]:
        """Which chart each key of the run goes in, and the charts' order (the one rule,
        :func:`stepwatch.monitor.values.panel_of`, that the PNG plots use too)."""
        keys = self.store.keys(run)
        panels = {key: key if key.startswith(SYSTEM) else names.panel_of(key) for key in keys}
        groups = {p: "system" for p in panels.values() if p.startswith(SYSTEM)}
        order = sorted(set(panels.values()), key=lambda p: (p in groups, names.panel_order(p)))
        return {"panels": panels, "order": order, "groups": groups}

    def clock(self, run: int) -> dict[str, Any]:
        """Step -> wall time and fractional epoch, from the points' own columns; cached for
        a run that has ended (a live run's clock is read again: it grows)."""
        info = self.store.run(run)
        mark = (info.steps, info.status, info.ended)
        with self._lock:
            held = self._clocks.get(run)
        if held is not None and held[0] == mark:
            return held[1]
        answer = _clock(self.store.points(run))
        with self._lock:
            if len(self._clocks) >= 64:
                self._clocks.pop(next(iter(self._clocks)))
            if info.ended is not None:
                self._clocks[run] = (mark, answer)
        return answer

    def events(self, run: int) -> list[dict[str, Any]]:
        return self.store.events(run)

    def summary(self, run: int) -> dict[str, Any]:
        return self.store.summary(run)

    def metrics(self, run: int, key: str, params: dict[str, int | None]) -> dict[str, Any]:
        start, end = params.get("start"), params.get("end")
        if start is not None and end is not None and start > end:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"'start' {start} is after 'end' {end}")
        band = params.pop("band", None)
        steps, values = self.store.metrics(run, key, **params)
        if band is not None:
            return _band(steps.tolist(), _finite(values.tolist()), band)
        return {"steps": steps.tolist(), "values": _finite(values.tolist())}


def _band(steps: list[int], values: list[float | None], buckets: int) -> dict[str, Any]:
    """Consecutive points grouped into at most ``buckets``: the median (at the middle point's
    step) with the smallest and largest value of each group; a group of NaNs keeps a NaN."""
    size = -(-len(steps) // buckets) if steps else 1
    if size <= 1:
        return {"steps": steps, "values": values, "lo": values, "hi": values}
    out: dict[str, list[Any]] = {"steps": [], "values": [], "lo": [], "hi": []}
    for first in range(0, len(steps), size):
        group = sorted(v for v in values[first : first + size] if v is not None)
        n = len(group)
        out["steps"].append(steps[first + (min(size, len(steps) - first) - 1) // 2])
        out["values"].append((group[(n - 1) // 2] + group[n // 2]) / 2 if n else None)
        out["lo"].append(group[0] if n else None)
        out["hi"].append(group[-1] if n else None)
    return out


def _clock(points: list[tuple[str, int, int | None, float, float]]) -> dict[str, Any]:
    """The anchors of :meth:`Api.clock`: per step its first wall time and its epoch as a
    fraction (the epoch's first and last steps bound it), thinned to ``_CLOCK_POINTS``."""
    at: dict[int, list[Any]] = {}
    for _, step, epoch, stamp, _ in points:
        held = at.get(step)
        if held is None:
            at[step] = [stamp, epoch]
        elif stamp < held[0]:
            held[0] = stamp
        if held is not None and held[1] is None:
            held[1] = epoch
    steps = sorted(at)
    spans: dict[int, list[int]] = {}
    for step in steps:
        epoch = at[step][1]
        if epoch is not None:
            spans.setdefault(epoch, [step, step])[1] = step
    keep: Sequence[int] = range(len(steps))
    if len(steps) > _CLOCK_POINTS:
        every = len(steps) / (_CLOCK_POINTS - 1)
        keep = sorted({min(len(steps) - 1, round(i * every)) for i in range(_CLOCK_POINTS)})
    out: dict[str, list[Any]] = {"steps": [], "time": [], "epoch": []}
    for i in keep:
        step = steps[i]
        stamp, epoch = at[step]
        out["steps"].append(step)
        out["time"].append(stamp)
        if epoch is None:
            out["epoch"].append(None)
        else:
            first, last = spans[epoch]
            out["epoch"].append(epoch - 1 + (step - first + 1) / (last - first + 1))
    return out


def int_params(query: str) -> dict[str, int | None]:
    parsed = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(parsed) - set(_METRIC_PARAMS))
    if unknown:
        raise HTTPError(
            HTTPStatus.BAD_REQUEST,
            f"unknown parameter {unknown[0]!r}; pass any of {', '.join(_METRIC_PARAMS)}",
        )
    params: dict[str, int | None] = {}
    for name in _METRIC_PARAMS:
        given = parsed.get(name)
        if not given:
            continue
        if len(given) > 1:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"{name!r} given {len(given)} times")
        text = given[0].strip()
        try:
            number = int(text)
        except ValueError:
            raise HTTPError(
                HTTPStatus.BAD_REQUEST, f"{name!r} must be an integer, but got {text!r}"
            ) from None
        try:
            check_int(name, number, minimum=2 if name in ("max_points", "band") else None)
        except ValueError as exc:
            raise HTTPError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        if not -_INT64 <= number <= _INT64:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"{name!r} is out of range (a 64-bit integer)")
        params[name] = number
    return params


_INT64 = 2**63 - 1


def run_id(text: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"a run id is an integer, but got {text!r}")
    if len(text) > 19 or int(text) > _INT64:
        raise HTTPError(HTTPStatus.BAD_REQUEST, "a run id is a 64-bit integer; this one is larger")
    return int(text)
