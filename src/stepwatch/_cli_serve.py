"""``stepwatch serve``: the web dashboard on a run store (the command's side; the server is
:mod:`stepwatch.dashboard.server`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ._cli_checks import UsageError

__all__ = ["add_serve_arguments", "serve_store"]


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The command's arguments besides ``--db``."""
    serve.add_argument(
        "store", nargs="?", metavar="DB", help="the store, as --db (stepwatch serve runs.db)"
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address (default 127.0.0.1: this machine only; 0.0.0.0: the network, with a token)",
    )
    serve.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any)")
    serve.add_argument(
        "--token",
        default=None,
        help="the token every request must carry (default $STEPWATCH_TOKEN; beyond 127.0.0.1 a "
        "random one when neither is given; printed in the login link)",
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another name the page may be reached by (a DNS alias, a reverse proxy; repeat)",
    )
    serve.add_argument("--verbose", action="store_true", help="log every request")


def serve_store(
    db: str | None,
    host: str,
    port: int,
    verbose: bool = False,
    token: str | None = None,
    allowed_hosts: Sequence[str] = (),
) -> int:
    """Serve until Ctrl-C or SIGTERM, printing the link to open once it listens."""
    from .dashboard.server import DashboardServer, serve

    def ready(server: DashboardServer) -> None:
        print(f"stepwatch dashboard on {server.login_url}  (Ctrl-C stops it)", flush=True)

    try:
        serve(
            db, host, port, verbose=verbose, ready=ready, token=token, allowed_hosts=allowed_hosts
        )
    except FileNotFoundError as exc:
        raise UsageError(f"{exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        print("stepwatch dashboard stopped")
    return 0
