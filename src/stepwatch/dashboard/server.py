"""The local web dashboard: a page and a JSON API over a run store, on the standard library's
threading HTTP server.

It reads only through :class:`stepwatch.store.Store` (whose connection refuses writes), so it
never changes the database and keeps working while a training process records into it. It
binds to ``127.0.0.1`` unless told otherwise and serves nothing outside its own static folder.

API (every answer is JSON; non-finite numbers are ``null``):

* ``GET /api/runs`` - the runs, oldest first: ``id``, ``name``, ``status`` (a dead
  ``running`` run is ``crashed``), ``started``, ``ended``, ``duration``, ``steps``,
  ``loss_key``, ``last_loss``, ``best_loss``, ``config``, ``host``, ``user``.
* ``GET /api/runs/{id}/keys`` - the metric keys of a run.
* ``GET /api/runs/{id}/panels`` - ``{"panels": {key: chart}, "order": [chart, ...],
  "groups": {chart: group}}``: which chart each key is drawn in, the charts' order, and the
  charts drawn apart (every ``system/*`` key is a chart of the ``system`` group).
* ``GET /api/runs/{id}/metrics/{key}?max_points=N&after=STEP&start=S&end=E&band=B`` -
  ``{"steps": [...], "values": [...]}``, min/max-downsampled to at most ``max_points``. With
  ``band=B`` and more than ``B`` points, consecutive points are grouped into ``B`` buckets:
  ``values`` is each bucket's median, and ``lo``/``hi`` (always there with ``band``) its
  smallest and largest value, so a one-step spike stays visible around a calm line.
* ``GET /api/runs/{id}/clock`` - ``{"steps", "time", "epoch"}``: up to 2,000 anchors read
  from the points' own wall times and epochs (``epoch`` is fractional: ``e`` at the last step
  of epoch ``e``), for drawing against time or epoch.
* ``GET /api/runs/{id}/events`` - checkpoints, stop reasons, alerts.
* ``GET /api/runs/{id}/summary`` - per key: ``last``, ``min``, ``max``, ``count``,
  ``last_step``.

An unknown run, key or path answers 404, a malformed parameter 400, each with
``{"error": "..."}``.
"""

from __future__ import annotations

import json
import math
import mimetypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .._validation import check_int
from ..monitor import values as names
from ..store.reader import Store

__all__ = [
    "STATIC",
    "DashboardServer",
    "check_assets",
    "make_server",
    "serve",
    "serve_in_thread",
]

STATIC = Path(__file__).resolve().parent / "static"
VENDOR_FILES = ("vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")
_METRIC_PARAMS = ("max_points", "after", "start", "end", "band")
SYSTEM = "system/"  # the prefix of the recorder's system metrics: a group of their own
_CLOCK_POINTS = 2000


class _HTTPError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_assets(static: Path = STATIC) -> None:
    """Raise FileNotFoundError, saying how to get it, when the chart library is missing."""
    missing = [name for name in VENDOR_FILES if not (static / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the dashboard's chart library is missing ({', '.join(missing)} in {static}): "
            "it is fetched from npm by the install step; run `make install` in a source "
            "checkout, or reinstall stepwatch from a built package"
        )


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def _clean(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class _Api:
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
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"'start' {start} is after 'end' {end}")
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
    """The anchors of :meth:`_Api.clock`: per step its first wall time and its epoch as a
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


def _int_params(query: str) -> dict[str, int | None]:
    parsed = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(parsed) - set(_METRIC_PARAMS))
    if unknown:
        raise _HTTPError(
            HTTPStatus.BAD_REQUEST,
            f"unknown parameter {unknown[0]!r}; pass any of {', '.join(_METRIC_PARAMS)}",
        )
    params: dict[str, int | None] = {}
    for name in _METRIC_PARAMS:
        given = parsed.get(name)
        if not given:
            continue
        if len(given) > 1:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"{name!r} given {len(given)} times")
        text = given[0].strip()
        try:
            number = int(text)
        except ValueError:
            raise _HTTPError(
                HTTPStatus.BAD_REQUEST, f"{name!r} must be an integer, but got {text!r}"
            ) from None
        try:
            check_int(name, number, minimum=2 if name in ("max_points", "band") else None)
        except ValueError as exc:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        if not -_INT64 <= number <= _INT64:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"{name!r} is out of range (a 64-bit integer)")
        params[name] = number
    return params


_INT64 = 2**63 - 1


def _run_id(text: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise _HTTPError(HTTPStatus.BAD_REQUEST, f"a run id is an integer, but got {text!r}")
    if len(text) > 19 or int(text) > _INT64:
        raise _HTTPError(HTTPStatus.BAD_REQUEST, "a run id is a 64-bit integer; this one is larger")
    return int(text)


_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_name(header: str) -> str:
    """The name in a Host header, without its port (``[::1]:8765`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"
    server_version = "stepwatch-dashboard"

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _read_only(self) -> None:
        """Any method but GET and HEAD: the dashboard only reads (405, with the JSON error)."""
        body = json.dumps({"error": f"{self.command} is not allowed: the dashboard only reads; "
                           "use GET"}).encode()  # fmt: skip
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT = do_DELETE = do_PATCH = _read_only

    def _answer(self, head: bool) -> None:
        parts = urlsplit(self.path)
        try:
            self._check_host()
            if parts.path.startswith("/api/"):
                body = json.dumps(_clean(self._api(parts.path, parts.query))).encode()
                self._send(HTTPStatus.OK, "application/json", body, head)
            else:
                body, kind = self._static(parts.path)
                self._send(HTTPStatus.OK, kind, body, head)
        except _HTTPError as exc:
            body = json.dumps({"error": str(exc)}).encode()
            self._send(exc.status, "application/json", body, head)
        except KeyError as exc:
            message = exc.args[0] if exc.args else "not found"
            body = json.dumps({"error": str(message)}).encode()
            self._send(HTTPStatus.NOT_FOUND, "application/json", body, head)
        except (BrokenPipeError, ConnectionResetError):  # the page went away
            pass
        except Exception as exc:  # a failing read is an answer, not a dead server
            body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", body, head)

    def _send(self, status: HTTPStatus, kind: str, body: bytes, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _api(self, path: str, query: str) -> Any:
        # Split before decoding, so a key holding '/' (eval_precision%2F3) stays one segment.
        segments = [unquote(s) for s in path.split("/")[2:]]
        api = self.server.api
        if segments == ["runs"]:
            return api.runs()
        if len(segments) == 3 and segments[0] == "runs":
            handlers: dict[str, Callable[[int], Any]] = {
                "keys": api.keys,
                "panels": api.panels,
                "events": api.events,
                "summary": api.summary,
                "clock": api.clock,
            }
            handler = handlers.get(segments[2])
            if handler is not None:
                return handler(_run_id(segments[1]))
        if len(segments) == 4 and segments[0] == "runs" and segments[2] == "metrics":
            run = _run_id(segments[1])
            return api.metrics(run, segments[3], _int_params(query))
        raise _HTTPError(HTTPStatus.NOT_FOUND, f"no API at {path!r}; see GET /api/runs")

    def _check_host(self) -> None:
        """Refuse a request whose Host header names another machine: a web page the user
        visits could otherwise point its own name at 127.0.0.1 (DNS rebinding) and read every
        run. A server bound to every address (``--host 0.0.0.0``) takes any name."""
        allowed = self.server.host_names
        if allowed is None:
            return
        name = _host_name(self.headers.get("Host") or "")
        if name not in allowed:
            raise _HTTPError(
                HTTPStatus.FORBIDDEN,
                f"this dashboard answers requests for {', '.join(sorted(allowed))} only; "
                f"the request named {name or 'no host'!r}",
            )

    def _static(self, path: str) -> tuple[bytes, str]:
        root = self.server.static
        name = unquote(path).lstrip("/") or "index.html"
        # Only regular files inside the static folder: no '..', no absolute paths, no links out.
        if "\\" in name or "\x00" in name:
            raise _HTTPError(HTTPStatus.NOT_FOUND, f"no file {path!r}")
        target = (root / name).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise _HTTPError(HTTPStatus.NOT_FOUND, f"no file {path!r}")
        kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        return target.read_bytes(), kind


class DashboardServer(ThreadingHTTPServer):
    """The dashboard's HTTP server; ``url`` is where it listens. Close it with
    :meth:`server_close` (this also closes the store)."""

    daemon_threads = True
    # Many browser tabs and scripts at once: the standard library's default backlog is 5.
    request_queue_size = 128

    def __init__(
        self, store: Store, host: str, port: int, static: Path = STATIC, verbose: bool = False
    ) -> None:
        self.api = _Api(store)
        self.store = store
        self.static = static.resolve()
        self.verbose = verbose
        # The names a request may use in its Host header (None: any, when bound to every
        # address).
        self.host_names: frozenset[str] | None = (
            None if host in ("", "0.0.0.0", "::") else _LOCAL_NAMES | {host.strip("[]").lower()}
        )
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{text}]" if ":" in text else text
        return f"http://{shown}:{port!s}/"

    def server_close(self) -> None:
        super().server_close()
        self.store.close()


def make_server(
    db: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    verbose: bool = False,
) -> DashboardServer:
    """A dashboard server on ``db`` (not yet serving: call ``serve_forever``).

    Args:
        db: the run store's location: a file path or a store URL (default
            ``$STEPWATCH_DB`` or ``./stepwatch.db``).
        host: the address to listen on; the default serves this machine only.
        port: the TCP port; 0 picks a free one (see ``server.url``).
        verbose: log every request on stderr.

    Raises:
        FileNotFoundError: no database at ``db``, or the chart library was not installed.
        ValueError: ``db`` is not a stepwatch database, or a bad ``port``.
        OSError: the address cannot be bound (the port is taken).
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"'host' must be an address such as '127.0.0.1', but got {host!r}.")
    check_int("port", port, minimum=0)
    if port > 65535:
        raise ValueError(f"'port' must be at most 65535, but got {port}.")
    check_assets()
    store = Store(db)
    try:
        return DashboardServer(store, host, port, verbose=verbose)
    except BaseException:
        store.close()
        raise


def serve(
    db: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    verbose: bool = False,
    ready: Callable[[DashboardServer], None] | None = None,
) -> None:
    """Serve the dashboard until interrupted (Ctrl-C). ``ready`` is called with the server
    once it listens (``stepwatch serve`` prints its URL there)."""
    server = make_server(db, host, port, verbose)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends the server as Ctrl-C does: the store is closed, and SQLite removes its
        # -wal/-shm files.
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if server.host_names is None or not server.host_names <= _LOCAL_NAMES:
            print(
                f"warning: the dashboard has no login: anyone who can reach {server.url} can "
                "read every run in the store",
                file=sys.stderr,
            )
        if ready is not None:
            ready(server)
        else:
            print(f"stepwatch dashboard on {server.url} (Ctrl-C stops it)", file=sys.stderr)
        server.serve_forever(poll_interval=0.25)
    finally:
        server.server_close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_in_thread(server: DashboardServer) -> threading.Thread:
    """Serve on a daemon thread; stop with ``server.shutdown(); server.server_close()``."""
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    return thread
