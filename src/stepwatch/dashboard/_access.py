"""Who may read the dashboard: the host names a request may use, and the token asked of it.

On loopback (the default) nothing is asked: only this machine's users reach the port, and
the ``Host`` check keeps other web sites out (DNS rebinding). Beyond loopback a token is
asked of every request, as an ``Authorization: Bearer <token>`` header (scripts) or as the
cookie a browser gets by opening the login link once (``/?token=<token>``, printed at start;
the page then drops the token from its address). The cookie holds a keyed digest of the
token, never the token itself, and a request naming another host is refused before its
token is looked at.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from collections.abc import Iterable
from http.cookies import CookieError, SimpleCookie

__all__ = ["LOCAL_NAMES", "TOKEN_ENV", "Access", "host_name", "is_loopback"]

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
TOKEN_ENV = "STEPWATCH_TOKEN"
_MIN_TOKEN = 16
_ALL_ADDRESSES = ("", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    """True when an address to listen on serves this machine only."""
    name = host.strip("[]").lower()
    return name in LOCAL_NAMES or name.startswith("127.")


def host_name(header: str) -> str:
    """The name in a Host header, without its port (``[::1]:8765`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _check_token(token: str) -> str:
    if not isinstance(token, str):
        raise TypeError(f"'token' must be a string, but got {type(token).__name__}.")
    if len(token) < _MIN_TOKEN or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"'token' must be at least {_MIN_TOKEN} printable ASCII characters without spaces, "
            f"but got one of {len(token)} characters (leave it out: beyond loopback stepwatch "
            "makes one up)"
        )
    return token


def _machine_names() -> set[str]:
    """This machine's own names and addresses: the Host names a team uses to reach it."""
    names = {socket.gethostname().lower()}
    names.add(next(iter(names)).split(".", 1)[0])
    try:
        import psutil

        for addresses in psutil.net_if_addrs().values():
            for address in addresses:
                if address.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(address.address.split("%", 1)[0].lower())
    except Exception:  # pragma: no cover - no interface list: the given names still work
        pass
    return names


class Access:
    """The access rule of one dashboard server.

    Args:
        host: the address the server listens on.
        token: the token to ask for; ``None``: none on loopback, a random one beyond it.
        allowed_hosts: more names a request's ``Host`` header may use (a reverse proxy's).
        cookie_name: the login cookie's name (one per port: browsers share cookies across
            ports of one host).
    """

    def __init__(
        self, host: str, token: str | None, allowed_hosts: Iterable[str], cookie_name: str
    ) -> None:
        if isinstance(allowed_hosts, str) or not all(isinstance(h, str) for h in allowed_hosts):
            raise TypeError(
                f"'allowed_hosts' must be a list of host names, but got {allowed_hosts!r}."
            )
        extra = {host_name(h) for h in allowed_hosts if h.strip()}
        bound = host.strip("[]").lower()
        self.loopback = is_loopback(host)
        if token is None and not self.loopback:
            token = secrets.token_urlsafe(24)
        self.token = None if token is None else _check_token(token)
        names = set(LOCAL_NAMES) | extra
        if bound in _ALL_ADDRESSES:
            names |= _machine_names()
        else:
            names.add(bound)
        self.host_names = frozenset(names)
        self.cookie_name = cookie_name
        self._cookie = (
            None
            if self.token is None
            else hmac.new(
                self.token.encode(), b"stepwatch dashboard login", hashlib.sha256
            ).hexdigest()
        )

    def host_allowed(self, header: str | None) -> tuple[bool, str]:
        """Whether a request's Host header names this server, and the name it gave."""
        name = host_name(header or "")
        return name in self.host_names, name

    def token_matches(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def admits(self, authorization: str | None, cookie: str | None) -> bool:
        """Whether a request carries the token (bearer header) or the login cookie."""
        if self.token is None:
            return True
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() == "bearer" and self.token_matches(given.strip()):
            return True
        if not cookie or self._cookie is None:
            return False
        try:
            jar = SimpleCookie(cookie)
        except CookieError:
            return False
        held = jar.get(self.cookie_name)
        return held is not None and hmac.compare_digest(held.value.encode(), self._cookie.encode())

    def login_cookie(self) -> str:
        """The Set-Cookie value a browser gets for the login link."""
        assert self._cookie is not None
        return f"{self.cookie_name}={self._cookie}; Path=/; HttpOnly; SameSite=Lax"
