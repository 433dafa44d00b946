"""The ``stepwatch`` command: ``demo``, and the run store's ``runs``, ``show``, ``compare`` and
``export``. Bad input (an unknown run, a missing or corrupt database) prints one line on stderr
and exits with status 2."""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from collections.abc import Sequence
from typing import Any

from ._version import __version__

__all__ = ["main"]


class _UsageError(Exception):
    """A user mistake reported as one line on stderr, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepwatch", description="Watch and steer PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"stepwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small digits classifier with the built-in monitors")
    demo.add_argument("--epochs", type=_positive_int, default=20, help="epochs (default 20)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    demo.add_argument(
        "--checkpoint-dir", default="checkpoints", help="where the best model is saved"
    )
    demo.add_argument(
        "--db", default=None, help="run store (default $STEPWATCH_DB or ./stepwatch.db)"
    )

    def with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--db", default=None, help="database (default $STEPWATCH_DB or ./stepwatch.db)"
        )
        return p

    with_db(sub.add_parser("runs", help="list the runs in the store"))
    show = with_db(sub.add_parser("show", help="a run's summary and final metrics"))
    show.add_argument("run", help="run id or name")
    compare = with_db(sub.add_parser("compare", help="final and best metrics side by side"))
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run ids or names")
    export = with_db(sub.add_parser("export", help="write a run as CSV, JSON or TensorBoard files"))
    export.add_argument("run", help="run id or name")
    export.add_argument("--format", required=True, choices=("csv", "json", "tensorboard"))
    export.add_argument("--out", required=True, help="output file (a folder for tensorboard)")
    return parser


def _fmt(value: Any, digits: int = 6) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


def _duration(seconds: float) -> str:
    total = round(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _open_store(db: str | None) -> Any:
    from .store import Store

    try:
        return Store(db)
    except FileNotFoundError as exc:
        raise _UsageError(f"{exc}; train with RunRecorder first or pass --db") from None
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _run(store: Any, ref: str) -> Any:
    try:
        return store.run(ref)
    except KeyError:
        known = ", ".join(str(r.id) for r in store.runs()[-10:]) or "none"
        raise _UsageError(f"no run {ref!r} in {store.path} (recent ids: {known})") from None


def _loss_stats(summary: dict[str, dict[str, float]]) -> tuple[Any, Any]:
    for key in ("epoch_loss", "loss"):
        if key in summary:
            return summary[key]["min"], summary[key]["last"]
    return None, None


def cmd_runs(args: argparse.Namespace) -> int:
    store = _open_store(args.db)
    rows = []
    for run in store.runs():
        best, last = _loss_stats(store.summary(run.id))
        rows.append(
            [
                str(run.id),
                run.name,
                run.status,
                str(run.steps),
                _fmt(best),
                _fmt(last),
                _duration(run.duration),
                datetime.datetime.fromtimestamp(run.started).strftime("%Y-%m-%d %H:%M"),
            ]
        )
    if not rows:
        print(f"no runs in {store.path}")
        return 0
    header = ["id", "name", "status", "steps", "best loss", "last loss", "duration", "started"]
    print(_table(header, rows))
    return 0


def _better(key: str) -> str:
    lowered = key.lower()
    return "min" if any(w in lowered for w in ("loss", "mae", "mse", "error", "time")) else "max"


def cmd_show(args: argparse.Namespace) -> int:
    store = _open_store(args.db)
    run = _run(store, args.run)
    print(f"run {run.id}: {run.name}")
    print(f"  status    {run.status}")
    print(f"  started   {datetime.datetime.fromtimestamp(run.started):%Y-%m-%d %H:%M:%S}")
    print(f"  duration  {_duration(run.duration)}")
    print(f"  host/pid  {run.host}/{run.pid}")
    print(f"  steps     {run.steps}")
    if run.dropped:
        print(f"  dropped   {run.dropped} records")
    if run.config:
        config = ", ".join(f"{k}={v}" for k, v in sorted(run.config.items()))
        print(f"  config    {config}")
    summary = store.summary(run.id)
    if summary:
        rows = [
            [key, _fmt(s["last"]), _fmt(s[_better(key)]), _better(key), str(s["count"])]
            for key, s in summary.items()
        ]
        print()
        print(_table(["metric", "final", "best", "", "points"], rows))
    events = store.events(run.id)
    if events:
        print()
        for event in events[-10:]:
            where = f"step {event['step']}" if event["step"] is not None else ""
            print(f"  [{event['kind']}] {where} {event['message']}".rstrip())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    store = _open_store(args.db)
    runs = [_run(store, ref) for ref in args.runs]
    summaries = [store.summary(r.id) for r in runs]
    keys = sorted(set().union(*summaries))
    header = ["metric"]
    for r in runs:
        header += [f"{r.id}:{r.name} final", "best"]
    rows = []
    for key in keys:
        row = [key]
        for s in summaries:
            stats = s.get(key)
            row += [_fmt(stats["last"]), _fmt(stats[_better(key)])] if stats else ["-", "-"]
        rows.append(row)
    rows.append(["status", *[x for r in runs for x in (r.status, "")]])
    rows.append(["duration", *[x for r in runs for x in (_duration(r.duration), "")]])
    print(_table(header, rows))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .store.export import export_run

    store = _open_store(args.db)
    run = _run(store, args.run)
    try:
        path = export_run(store, run.id, args.format, args.out)
    except ImportError as exc:
        raise _UsageError(str(exc)) from None
    except OSError as exc:
        raise _UsageError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(f"exported run {run.id} ({args.format}) to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "demo":
            from .demo import run_demo

            run_demo(
                epochs=args.epochs,
                seed=args.seed,
                device=args.device,
                checkpoint_dir=args.checkpoint_dir,
                db=args.db,
            )
            return 0
        command = {"runs": cmd_runs, "show": cmd_show, "compare": cmd_compare, "export": cmd_export}
        return command[args.command](args)
    except _UsageError as exc:
        print(f"stepwatch {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
