"""A throwaway PostgreSQL cluster for the team store's tests and benchmark.

``PgCluster.start()`` runs ``initdb`` and ``pg_ctl`` (as the ``postgres`` system user when we
are root; PostgreSQL refuses to run as root) in a temporary folder, on a free TCP port of
127.0.0.1 with its unix socket in that folder. TCP connections need the role's password
(scram-sha-256), so the tests see a password travel in a URL. ``stop()`` stops the server
(``pg_ctl stop -m immediate``) and removes the folder; it also runs at interpreter exit.

Pytest: the session fixture ``pg_cluster`` and the per-test ``pg_url`` (a fresh database per
test). Where PostgreSQL cannot be started the tests skip with the reason; with
``STEPWATCH_REQUIRE_POSTGRES=1`` (``.ci/run`` sets it) that is a failure instead.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Import the two fixtures into a test module to use ``pg_cluster`` and ``pg_url`` there.
__all__ = ["PgCluster", "pg_cluster_fixture", "pg_url_fixture", "unavailable"]

ROLE = "stepwatch"
_TIMEOUT = 60  # seconds for any one initdb / pg_ctl call


def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail when STEPWATCH_REQUIRE_POSTGRES=1."""
    if os.environ.get("STEPWATCH_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"STEPWATCH_REQUIRE_POSTGRES=1 but {reason}")
    pytest.skip(reason)


def _bindir() -> Path | None:
    found = shutil.which("pg_config")
    if found:
        try:
            out = subprocess.run(
                [found, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if (Path(out) / "initdb").is_file():
                return Path(out)
        except (OSError, subprocess.SubprocessError):
            pass
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").is_file():
            return candidate
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """One running throwaway server. ``url(db)``: a URL with the password; ``admin_url``: the
    maintenance database."""

    def __init__(self, bindir: Path, root: Path, port: int, password: str) -> None:
        self.bindir, self.root, self.port, self.password = bindir, root, port, password
        self.data = root / "data"
        self._as_postgres = os.geteuid() == 0
        self._count = itertools.count(1)

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    def start(cls) -> PgCluster:
        """initdb + pg_ctl start; raises RuntimeError with the reason when it cannot."""
        bindir = _bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (no pg_config/initdb; `make install`)")
        root = Path(tempfile.mkdtemp(prefix="stepwatch-pg-"))
        cluster = cls(bindir, root, _free_port(), secrets.token_hex(8))
        try:
            if cluster._as_postgres:
                try:
                    shutil.chown(root, "postgres", "postgres")
                except (LookupError, PermissionError) as exc:
                    raise RuntimeError(f"no 'postgres' user to run the server: {exc}") from None
            pwfile = root / "pw"
            pwfile.write_text(cluster.password + "\n")
            if cluster._as_postgres:
                shutil.chown(pwfile, "postgres", "postgres")
            cluster._call(
                "initdb", "-D", str(cluster.data), "-U", ROLE, f"--pwfile={pwfile}",
                "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                "--no-instructions", "--locale=C.UTF-8",
            )  # fmt: skip
            pwfile.unlink()
            cluster._start_server()
        except BaseException:
            cluster.stop()
            raise
        atexit.register(cluster.stop)
        return cluster

    def _call(self, tool: str, *args: str) -> None:
        cmd = [str(self.bindir / tool), *args]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{tool} failed: {exc}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{tool} failed ({done.returncode}): {' | '.join(tail)}")

    def _start_server(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c max_connections=100"
        )
        self._call(
            "pg_ctl", "start", "-D", str(self.data), "-w", "-t", str(_TIMEOUT - 5),
            "-l", str(self.root / "server.log"), "-o", options,
        )  # fmt: skip

    def stop_server(self) -> None:
        """Stop the server (as a crash would: immediate), keeping its files."""
        if self.data.is_dir():
            try:
                self._call("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
            except RuntimeError:
                pass

    def restart(self, down_seconds: float = 0.0) -> None:
        """Stop the server, stay down ``down_seconds``, start it again on the same port."""
        self.stop_server()
        time.sleep(down_seconds)
        self._start_server()

    def stop(self) -> None:
        self.stop_server()
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.stop)

    # -- databases ------------------------------------------------------------------------------
    def url(self, db: str = "postgres", password: bool = True) -> str:
        auth = f"{ROLE}:{self.password}" if password else ROLE
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._count)}"
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


@pytest.fixture(scope="session", name="pg_cluster")
def pg_cluster_fixture() -> Iterator[PgCluster]:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("psycopg is not installed (pip install 'stepwatch[postgres]')")
    try:
        cluster = PgCluster.start()
    except RuntimeError as exc:
        unavailable(f"cannot start a PostgreSQL server: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(name="pg_url")
def pg_url_fixture(pg_cluster: PgCluster) -> str:
    return pg_cluster.new_database()
