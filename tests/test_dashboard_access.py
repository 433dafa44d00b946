"""Who the dashboard answers: real HTTP requests to a real server, on loopback (no login) and
on every address (a token, and this machine's names only), and ``stepwatch serve`` itself."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from stepwatch.dashboard.server import DashboardServer, make_server, serve_in_thread
from stepwatch.store import RunWriter

TOKEN = "team-token-0123456789abcdef"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("access") / "runs.db"
    writer = RunWriter(path, name="shared")
    for step in range(1, 11):
        writer.log("step_loss", 1.0 / step, step, 1)
    writer.close()
    return path


@pytest.fixture
def team(db: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DashboardServer]:
    """A server on every address with a token and one extra allowed name."""
    monkeypatch.delenv("STEPWATCH_TOKEN", raising=False)
    server = make_server(db, host="0.0.0.0", port=0, token=TOKEN, allowed_hosts=["dash.example"])
    thread = serve_in_thread(server)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _request(
    server: DashboardServer, path: str, host: str | None = None, **headers: str
) -> tuple[int, dict[str, str], Any]:
    """GET ``path`` from 127.0.0.1 with the given Host and headers (``_`` for ``-`` in names)."""
    port = int(server.server_address[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host or f"127.0.0.1:{port}")
        for name, value in headers.items():
            conn.putheader(name.replace("_", "-"), value)
        conn.endheaders()
        answer = conn.getresponse()
        body = answer.read()
        kind = answer.getheader("Content-Type") or ""
        got = {k.lower(): v for k, v in answer.getheaders()}
        return answer.status, got, json.loads(body) if "json" in kind else body
    finally:
        conn.close()


def test_loopback_asks_for_no_token(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPWATCH_TOKEN", raising=False)
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        assert server.token is None and server.login_url == server.url
        status, _, runs = _request(server, "/api/runs")
        assert status == 200 and [r["name"] for r in runs] == ["shared"]
        assert _request(server, "/")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_beyond_loopback_every_request_needs_the_token(team: DashboardServer) -> None:
    for path in ("/api/runs", "/api/runs/1/metrics/step_loss", "/", "/app.js"):
        status, headers, body = _request(team, path)
        assert status == 401, path
        assert headers["www-authenticate"] == 'Bearer realm="stepwatch"'
        assert "asks for its token" in body["error"]
        assert "shared" not in json.dumps(body)
    assert _request(team, "/api/runs", Authorization="Bearer wrong-token-0123456789")[0] == 401
    assert _request(team, "/api/runs", Authorization=f"Basic {TOKEN}")[0] == 401
    status, _, runs = _request(team, "/api/runs", Authorization=f"Bearer {TOKEN}")
    assert status == 200 and runs[0]["name"] == "shared"
    status, _, page = _request(team, "/", Authorization=f"Bearer {TOKEN}")
    assert status == 200 and b"app.js" in page


def test_the_login_link_sets_a_cookie_and_drops_the_token(team: DashboardServer) -> None:
    port = team.server_address[1]
    assert team.login_url == f"http://{socket.gethostname().lower()}:{port}/?token={TOKEN}"
    status, headers, _ = _request(team, f"/?runs=1&token={TOKEN}&x=epoch")
    assert status == 303
    assert headers["location"] == "./?runs=1&x=epoch"  # the view kept, the token gone
    cookie = headers["set-cookie"]
    name, _, rest = cookie.partition("=")
    value = rest.split(";", 1)[0]
    assert name == f"stepwatch-{port}" and TOKEN not in cookie
    assert {"HttpOnly", "SameSite=Lax", "Path=/"} <= {p.strip() for p in cookie.split(";")}
    status, _, runs = _request(team, "/api/runs", Cookie=f"other=1; {name}={value}")
    assert status == 200 and runs[0]["name"] == "shared"
    forged = value[:-1] + ("1" if value.endswith("0") else "0")
    assert _request(team, "/api/runs", Cookie=f"{name}={forged}")[0] == 401
    assert _request(team, "/api/runs", Cookie=f"{name}={TOKEN}")[0] == 401
    assert _request(team, "/api/runs", Cookie='bad"cookie')[0] == 401
    status, headers, body = _request(team, "/?token=not-the-token-0123456789")
    assert status == 401 and "set-cookie" not in headers
    assert "not this dashboard's" in body["error"]


def test_host_names_are_checked_beyond_loopback(team: DashboardServer) -> None:
    bearer = f"Bearer {TOKEN}"
    port = team.server_address[1]
    # DNS rebinding: a page on evil.example pointing its name at this machine reads nothing,
    # token or not.
    status, _, body = _request(team, "/api/runs", f"evil.example:{port}", Authorization=bearer)
    assert status == 403 and "'evil.example'" in body["error"] and "--allow-host" in body["error"]
    assert _request(team, "/api/runs", f"evil.example:{port}")[0] == 403
    for name in (socket.gethostname(), "dash.example", "localhost", "127.0.0.1"):
        assert _request(team, "/api/runs", f"{name}:{port}", Authorization=bearer)[0] == 200


def test_a_token_is_made_up_when_none_is_given(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPWATCH_TOKEN", raising=False)
    first = make_server(db, host="0.0.0.0", port=0)
    second = make_server(db, host="0.0.0.0", port=0)
    try:
        assert first.token is not None and len(first.token) >= 16
        assert first.token != second.token
        assert first.login_url.endswith(f"/?token={first.token}")
    finally:
        first.server_close()
        second.server_close()
    monkeypatch.setenv("STEPWATCH_TOKEN", TOKEN)
    for host in ("0.0.0.0", "127.0.0.1"):  # a token given is asked for, on loopback too
        server = make_server(db, host=host, port=0)
        try:
            assert server.token == TOKEN
        finally:
            server.server_close()


def test_bad_access_arguments(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPWATCH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="'token' must be at least 16 printable ASCII"):
        make_server(db, host="0.0.0.0", port=0, token="short")
    with pytest.raises(ValueError, match="'token' must be"):
        make_server(db, port=0, token="with a space in it, long enough")
    with pytest.raises(TypeError, match="'token' must be a string"):
        make_server(db, port=0, token=12345678901234567890)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'allowed_hosts' must be a list of host names"):
        make_server(db, port=0, allowed_hosts="dash.example")


@contextlib.contextmanager
def _serve_command(*args: str, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "stepwatch", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the CLI prints its link once it listens
        assert line.startswith("stepwatch dashboard on http://"), (line, process.stderr)
        yield process, line.split()[3]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hung server
            process.kill()
            process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
        if process.stderr is not None:
            process.stderr.close()


def _fetch(url: str, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection("127.0.0.1", parts.port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": f"{parts.hostname}:{parts.port}", **headers})
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def test_stepwatch_serve_takes_the_store_as_written_and_prints_a_login_link(db: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STEPWATCH_TOKEN"}
    # `stepwatch serve runs.db`, as the README and the bridges' docstrings write it.
    with _serve_command(str(db), env=env) as (process, url):
        assert url.startswith("http://127.0.0.1:") and "token" not in url
        status, _, body = _fetch(url, "/api/runs")
        assert status == 200 and json.loads(body)[0]["name"] == "shared"
        assert process.poll() is None
    # On every address: a link with a made-up token, the cookie it sets opens the API.
    with _serve_command(str(db), "--host", "0.0.0.0", env=env) as (process, url):
        parts = urlsplit(url)
        assert parts.hostname == socket.gethostname().lower() and parts.query.startswith("token=")
        assert _fetch(url, "/api/runs")[0] == 401
        status, headers, _ = _fetch(url, f"/?{parts.query}")
        assert status == 303
        cookie = headers["set-cookie"].split(";", 1)[0]
        status, _, body = _fetch(url, "/api/runs", Cookie=cookie)
        assert status == 200 and json.loads(body)[0]["name"] == "shared"
        assert process.poll() is None
    # A token from the environment, asked for with a bearer header.
    with _serve_command(str(db), "--host", "0.0.0.0", env={**env, "STEPWATCH_TOKEN": TOKEN}) as (
        _,
        url,
    ):
        assert url.endswith(f"?token={TOKEN}")
        assert _fetch(url, "/api/runs", Authorization=f"Bearer {TOKEN}")[0] == 200


def test_stepwatch_serve_refuses_two_stores_and_a_short_token(db: Path, tmp_path: Path) -> None:
    from .conftest import run_cli

    done = run_cli("serve", str(db), "--db", str(tmp_path / "other.db"), "--port", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"stepwatch serve: two stores given: {db} and --db {tmp_path / 'other.db'}; pass one"
    )
    done = run_cli("serve", str(db), "--host", "0.0.0.0", "--token", "abc", "--port", "0")
    assert done.returncode == 2
    assert done.stderr.startswith("stepwatch serve: --token must be at least 16 printable")
