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

Access: on loopback (the default) any local request is answered; beyond it every request
needs the server's token (``Authorization: Bearer <token>``, or the cookie the login link
``/?token=<token>`` sets), and a ``Host`` header that names this machine (401 and 403
otherwise; see :mod:`stepwatch.dashboard._access`). A request whose head does not arrive
within ``request_timeout`` seconds is dropped, and so is a connection idle that long.
"""

from __future__ import annotations

import json
import math
import mimetypes
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from .._validation import check_int, check_number
from ..store.reader import Store
from ._access import TOKEN_ENV, Access
from ._api import Api, HTTPError, clean, int_params, run_id
from ._connection import HeadReader

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
# Seconds a client may take to send a request's head, and a connection may stay idle.
REQUEST_TIMEOUT = 10.0


def check_assets(static: Path = STATIC) -> None:
    """Raise FileNotFoundError, saying how to get it, when the chart library is missing."""
    missing = [name for name in VENDOR_FILES if not (static / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the dashboard's chart library is missing ({', '.join(missing)} in {static}): "
            "every build of stepwatch fetches it from npm; in a source checkout run `make "
            "install`, `pip install -e .` or `python build_support/stepwatch_build.py`"
        )


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"
    server_version = "stepwatch-dashboard"
    rfile: Any  # a HeadReader over the connection's reader

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout)  # every read and write
        self.rfile = HeadReader(self.rfile, self.connection, self.server.request_timeout)

    def handle_one_request(self) -> None:
        self.rfile.start()  # this request's head must arrive within the bound
        super().handle_one_request()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _read_only(self) -> None:
        """Any method but GET and HEAD: the dashboard only reads (405, with the JSON error)."""
        body = json.dumps(
            {"error": f"{self.command} is not allowed: the dashboard only reads; use GET"}
        ).encode()
        self.close_connection = True  # a body it may have sent is not read
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
            if not self._admitted(parts.path, parts.query, head):
                return
            if parts.path.startswith("/api/"):
                body = json.dumps(clean(self._api(parts.path, parts.query))).encode()
                self._send(HTTPStatus.OK, "application/json", body, head)
            else:
                body, kind = self._static(parts.path)
                self._send(HTTPStatus.OK, kind, body, head)
        except HTTPError as exc:
            body = json.dumps({"error": str(exc)}).encode()
            self._send(exc.status, "application/json", body, head, exc.headers)
        except KeyError as exc:
            message = exc.args[0] if exc.args else "not found"
            body = json.dumps({"error": str(message)}).encode()
            self._send(HTTPStatus.NOT_FOUND, "application/json", body, head)
        except (BrokenPipeError, ConnectionResetError):  # the page went away
            pass
        except Exception as exc:  # a failing read is an answer, not a dead server
            body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", body, head)

    def _send(
        self,
        status: HTTPStatus,
        kind: str,
        body: bytes,
        head: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
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
                return handler(run_id(segments[1]))
        if len(segments) == 4 and segments[0] == "runs" and segments[2] == "metrics":
            run = run_id(segments[1])
            return api.metrics(run, segments[3], int_params(query))
        raise HTTPError(HTTPStatus.NOT_FOUND, f"no API at {path!r}; see GET /api/runs")

    def _check_host(self) -> None:
        """Refuse a request whose Host header names another machine: a web page the user
        visits could otherwise point its own name at this server's address (DNS rebinding)
        and read every run."""
        allowed, name = self.server.access.host_allowed(self.headers.get("Host"))
        if not allowed:
            shown = sorted(self.server.access.host_names)
            raise HTTPError(
                HTTPStatus.FORBIDDEN,
                f"this dashboard answers requests for {', '.join(shown)} only; the request "
                f"named {name or 'no host'!r} (to serve it under another name, pass "
                "--allow-host NAME to stepwatch serve)",
            )

    def _admitted(self, path: str, query: str, head: bool) -> bool:
        """True when the request may be answered; the login link answers with a redirect
        that sets the login cookie (False: answered already)."""
        access = self.server.access
        if access.token is None:
            return True
        fields = parse_qs(query, keep_blank_values=True)
        given = fields.get("token")
        if given is not None and not path.startswith("/api/"):
            if len(given) != 1 or not access.token_matches(given[0]):
                raise HTTPError(
                    HTTPStatus.UNAUTHORIZED,
                    "the token in this link is not this dashboard's: open the link "
                    "`stepwatch serve` printed",
                )
            # The page again, without the token in its address (history, shared links).
            kept = urlencode([(k, x) for k, xs in fields.items() if k != "token" for x in xs])
            headers = {
                "Location": "./" + (f"?{kept}" if kept else ""),
                "Set-Cookie": access.login_cookie(),
            }
            self._send(HTTPStatus.SEE_OTHER, "text/plain; charset=utf-8", b"", head, headers)
            return False
        if access.admits(self.headers.get("Authorization"), self.headers.get("Cookie")):
            return True
        raise HTTPError(
            HTTPStatus.UNAUTHORIZED,
            "this dashboard asks for its token: open the link `stepwatch serve` printed "
            "(it ends in ?token=...), or send the header 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": 'Bearer realm="stepwatch"'},
        )

    def _static(self, path: str) -> tuple[bytes, str]:
        root = self.server.static
        name = unquote(path).lstrip("/") or "index.html"
        # Only regular files inside the static folder: no '..', no absolute paths, no links out.
        if "\\" in name or "\x00" in name:
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no file {path!r}")
        target = (root / name).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no file {path!r}")
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
        self,
        store: Store,
        host: str,
        port: int,
        static: Path = STATIC,
        verbose: bool = False,
        *,
        token: str | None = None,
        allowed_hosts: Iterable[str] = (),
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.api = Api(store)
        self.store = store
        self.static = static.resolve()
        self.verbose = verbose
        self.request_timeout = request_timeout
        if ":" in host:  # an IPv6 address ('::', '::1', '[::1]')
            self.address_family = socket.AF_INET6
        super().__init__((host.strip("[]"), port), _Handler)
        try:
            self.access = Access(host, token, allowed_hosts, f"stepwatch-{self.server_address[1]}")
        except BaseException:
            super().server_close()
            raise

    @property
    def token(self) -> str | None:
        """The token every request must carry (None: none is asked, on loopback)."""
        return self.access.token

    @property
    def host_names(self) -> frozenset[str]:
        """The names a request may use in its Host header."""
        return self.access.host_names

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{text}]" if ":" in text else text
        return f"http://{shown}:{port!s}/"

    @property
    def login_url(self) -> str:
        """Where to open the page: ``url`` (under this machine's name when it listens on
        every address), with ``?token=...`` when a token is asked."""
        url = self.url
        host, port = self.server_address[:2]
        if str(host) in ("0.0.0.0", "::"):
            url = f"http://{socket.gethostname().lower()}:{port!s}/"
        return url if self.token is None else f"{url}?token={quote(self.token, safe='')}"

    def server_close(self) -> None:
        super().server_close()
        self.store.close()


def make_server(
    db: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    verbose: bool = False,
    *,
    token: str | None = None,
    allowed_hosts: Iterable[str] = (),
    request_timeout: float = REQUEST_TIMEOUT,
) -> DashboardServer:
    """A dashboard server on ``db`` (not yet serving: call ``serve_forever``).

    Args:
        db: the run store's location: a file path or a store URL (default
            ``$STEPWATCH_DB`` or ``./stepwatch.db``).
        host: the address to listen on; the default serves this machine only.
        port: the TCP port; 0 picks a free one (see ``server.url``).
        verbose: log every request on stderr.
        token: the token every request must carry (at least 16 characters). Default
            ``$STEPWATCH_TOKEN``; without either, none on loopback and a random one
            beyond it (``server.token``; ``server.login_url`` is the link to open).
        allowed_hosts: more names a request's ``Host`` header may use besides this
            machine's own (a reverse proxy's or a DNS alias's).
        request_timeout: seconds a client may take to send a request's head, and a
            connection may stay idle, before it is dropped.

    Raises:
        FileNotFoundError: no database at ``db``, or the chart library was not installed.
        ValueError: ``db`` is not a stepwatch database, or a bad ``port``, ``token`` or
            ``request_timeout``.
        OSError: the address cannot be bound (the port is taken).
    """
    if not isinstance(host, str) or not host:
        raise TypeError(f"'host' must be an address such as '127.0.0.1', but got {host!r}.")
    check_int("port", port, minimum=0)
    if port > 65535:
        raise ValueError(f"'port' must be at most 65535, but got {port}.")
    check_number("request_timeout", request_timeout)
    if not 0 < request_timeout < math.inf:
        raise ValueError(
            f"'request_timeout' must be a number of seconds above 0, but got {request_timeout}."
        )
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    check_assets()
    store = Store(db)
    try:
        return DashboardServer(
            store,
            host,
            port,
            verbose=verbose,
            token=token,
            allowed_hosts=allowed_hosts,
            request_timeout=request_timeout,
        )
    except BaseException:
        store.close()
        raise


def serve(
    db: str | os.PathLike[str] | None = None,
    host: str = "127.0.0.1",
    port: int = 8765,
    verbose: bool = False,
    ready: Callable[[DashboardServer], None] | None = None,
    *,
    token: str | None = None,
    allowed_hosts: Iterable[str] = (),
) -> None:
    """Serve the dashboard until interrupted (Ctrl-C). ``ready`` is called with the server
    once it listens (``stepwatch serve`` prints its login link there); the other arguments
    are :func:`make_server`'s."""
    server = make_server(db, host, port, verbose, token=token, allowed_hosts=allowed_hosts)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends the server as Ctrl-C does: the store is closed, and SQLite removes its
        # -wal/-shm files.
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if not server.access.loopback:
            print(
                "note: the dashboard asks every request for its token (in the link below); "
                "it goes over plain HTTP: on a network you do not trust, put HTTPS in front",
                file=sys.stderr,
            )
        if ready is not None:
            ready(server)
        else:
            print(f"stepwatch dashboard on {server.login_url} (Ctrl-C stops it)", file=sys.stderr)
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
