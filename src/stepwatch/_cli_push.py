"""``stepwatch push``: copy local runs into a team store on PostgreSQL (the command's side;
the copying is :func:`stepwatch.store.backends.postgres_push.push_runs`)."""

from __future__ import annotations

import argparse

from ._cli_checks import UsageError

__all__ = ["cmd_push"]


def cmd_push(args: argparse.Namespace) -> int:
    from .store.backends.postgres_push import push_runs
    from .store.base import hide_password

    try:
        pushed = push_runs(args.db, args.to, args.run)
    except (ValueError, OSError, ImportError) as exc:
        raise UsageError(str(exc)) from None
    except KeyError as exc:
        raise UsageError(f"{exc.args[0]}; see stepwatch runs --db ...") from None
    for item in pushed:
        run = item.run
        print(
            f"pushed run {run.id} ({run.name}, {run.status}) as run {item.team_id}: "
            f"{item.points} new points, {item.events} new events"
        )
    print(f"{len(pushed)} run(s) pushed to {hide_password(args.to)}")
    return 0
