"""``stepwatch push``: copy runs of a local store into a team store on PostgreSQL.

Each run is copied with its points, events and status, in one transaction per run. A run
remembers where it came from (its host, pid, start time and local id), so pushing it again
updates the same team run: only the points and events it lacks are added (points are keyed by
``(run, key, step)``, events by their place in the run), and its status, end and drop count
are brought up to date. A run still recording locally is pushed up to its last written point
and shows there as ``running`` as of the push; push it again later for the rest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from .._runs import RunInfo
from ..base import StoreUnreachable, hide_password, open_write_backend, parse_location
from ..reader import Store
from .postgres_write import PostgresWriteBackend, current_user

__all__ = ["Pushed", "push_runs"]


class Pushed(NamedTuple):
    """One run pushed: the local run, its id in the team store, and what was new there."""

    run: RunInfo
    team_id: int
    points: int
    events: int


def push_runs(
    source: str | os.PathLike[str] | None,
    target: str,
    runs: Sequence[int | str] | None = None,
) -> list[Pushed]:
    """Copy the runs of the store at ``source`` (all, or those named by id or name) into the
    team store at ``target`` (a ``postgresql://`` URL). Pushing twice copies nothing twice.

    Raises:
        ValueError: ``target`` is not a PostgreSQL store, or the server refused us.
        KeyError: a run that ``source`` does not hold.
        ConnectionError: the server cannot be reached.
    """
    try:
        found = parse_location(target, "to")
    except ValueError:
        found = None
    if found is None or found.kind != "postgresql":
        shown = found.shown if found is not None else hide_password(str(target))
        raise ValueError(
            f"'to' {shown!r} is not a team store: pass a postgresql://user@host/db URL."
        )
    origin_store = parse_location(source, "db")
    if origin_store.kind == "postgresql" and _database(origin_store.target) == _database(target):
        raise ValueError(
            f"'db' and 'to' name the same store ({found.shown}): push copies runs from one store "
            "into another; pass --db the local store (a file) or another team store."
        )
    with Store(source) as local:
        picked = [local.run(ref) for ref in dict.fromkeys(runs)] if runs else local.runs()
        picked = list({info.id: info for info in picked}.values())  # by id and by name: once
        try:
            backend = open_write_backend(found, argname="to")
        except StoreUnreachable as exc:
            raise ConnectionError(f"cannot reach the store {found.shown}: {exc}") from None
        assert isinstance(backend, PostgresWriteBackend)
        user = current_user()
        done = []
        try:
            for info in picked:
                origin = f"push/{info.host}/{info.pid}/{info.started!r}/{info.id}"
                team_id, points, events = backend.push_run(
                    info._replace(user=info.user or user),
                    local.points(info.id),
                    local.events(info.id),
                    origin,
                )
                done.append(Pushed(info, team_id, points, events))
        except StoreUnreachable as exc:
            raise ConnectionError(f"lost the store {found.shown}: {exc}") from None
        finally:
            backend.close()
    return done


def _database(url: str) -> tuple[str, int, str]:
    """``(host, port, database)`` of a ``postgresql://`` URL, with the local spellings of the
    host (none, localhost, 127.0.0.1, ::1, a socket folder) as one."""
    from urllib.parse import parse_qs, unquote, urlsplit

    parts = urlsplit(url)
    query = parse_qs(parts.query)
    host = (parts.hostname or query.get("host", [""])[0]).lower()
    if host in ("", "localhost", "127.0.0.1", "::1") or host.startswith("/"):
        host = "local"
    try:
        port = parts.port or int(query.get("port", ["5432"])[0])
    except ValueError:
        port = 5432
    name = unquote(parts.path.lstrip("/")) or query.get("dbname", [""])[0] or parts.username or ""
    return host, port, name
