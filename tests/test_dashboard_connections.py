"""Connections the dashboard server does not hold forever: real sockets that send half a
request, trickle one, or stay idle, against a server with a short ``request_timeout``."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwatch.dashboard.server import DashboardServer, make_server, serve_in_thread
from stepwatch.store import RunWriter

from .conftest import wait_until

TIMEOUT = 0.5  # the server's bound; every wait below allows many times it
HALF_SENT = b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n"  # no blank line


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DashboardServer]:
    db = tmp_path / "runs.db"
    writer = RunWriter(db, name="one")
    writer.log("step_loss", 1.0, 1)
    writer.close()
    server = make_server(db, port=0, request_timeout=TIMEOUT)
    thread = serve_in_thread(server)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _connect(server: DashboardServer) -> socket.socket:
    host, port = server.server_address[:2]
    return socket.create_connection((str(host), int(port)), timeout=30)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """True once the server closes ``sock`` (EOF or reset), reading whatever it sent first."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if not readable:
            continue
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionError:
            return True
    return False


def _answer(server: DashboardServer) -> bytes:
    with _connect(server) as sock:
        sock.sendall(b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_half_sent_requests_are_dropped_with_their_threads(server: DashboardServer) -> None:
    before = threading.active_count()
    socks = [_connect(server) for _ in range(30)]
    try:
        for sock in socks:
            sock.sendall(HALF_SENT)
        # Meanwhile a whole request is answered.
        assert _answer(server).startswith(b"HTTP/1.1 200 ")
        for sock in socks:
            assert _closed_by_server(sock, within=30), "a half-sent request was held"
        wait_until(lambda: threading.active_count() <= before, timeout=30)
    finally:
        for sock in socks:
            sock.close()


def test_a_request_trickled_a_byte_at_a_time_is_dropped(server: DashboardServer) -> None:
    # Every byte arrives well within the bound, but the head as a whole never ends.
    with _connect(server) as sock:
        sock.sendall(b"GET /api/runs HTTP/1.1\r\nX-Slow: ")
        closed = False
        for _ in range(300):  # up to 30 s of trickling
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_by_server(sock, within=0.1):
                closed = True
                break
        assert closed, "a trickled request was held for 30 s"


def test_an_idle_connection_after_an_answer_is_closed(server: DashboardServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # keep-alive
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        assert _closed_by_server(sock, within=30)
    assert _answer(server).startswith(b"HTTP/1.1 200 ")


def test_request_timeout_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'request_timeout' must be a number of seconds above 0"):
        make_server(tmp_path / "none.db", port=0, request_timeout=0)
    with pytest.raises(TypeError, match="'request_timeout' must be a number"):
        make_server(tmp_path / "none.db", port=0, request_timeout="5")  # type: ignore[arg-type]
