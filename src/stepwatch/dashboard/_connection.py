"""A bound on the time a client may take to send a request's head (its request line and
headers), so that idle or half-sent requests do not hold a server thread each forever.

The standard library's handler waits on a socket with no timeout; a socket timeout alone
bounds each wait but not a client that trickles a byte at a time. :class:`HeadReader` wraps
the connection's reader and gives the whole head one deadline, counted from the moment the
server starts waiting for the request; the socket's own timeout (the same number of seconds)
still bounds every read and write after that.
"""

from __future__ import annotations

import io
import math
import socket
import time
from typing import Any

__all__ = ["HeadReader"]


class HeadReader:
    """``rfile`` for a request handler: ``readline`` gives up with :class:`TimeoutError`
    once ``deadline`` (``time.monotonic()``) has passed; everything else is the reader's."""

    def __init__(self, reader: io.BufferedReader, sock: socket.socket, seconds: float) -> None:
        self._reader = reader
        self._sock = sock
        self._seconds = seconds
        self.deadline = math.inf

    def start(self) -> None:
        """The server starts waiting for a request: its head must be in within the bound."""
        self.deadline = time.monotonic() + self._seconds

    def readline(self, limit: int = -1) -> bytes:
        out = bytearray()
        while limit < 0 or len(out) < limit:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's head did not arrive in time")
            self._sock.settimeout(min(self._seconds, left))
            try:
                held = self._reader.peek(1)  # what is buffered, or one read from the socket
            finally:
                self._sock.settimeout(self._seconds)
            if not held:  # the client closed the connection
                break
            want = len(held) if limit < 0 else min(len(held), limit - len(out))
            end = held.find(b"\n", 0, want)
            out += self._reader.read(end + 1 if end >= 0 else want)
            if end >= 0:
                break
        return bytes(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)
