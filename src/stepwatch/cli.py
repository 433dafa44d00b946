"""The ``stepwatch`` command: ``demo``, and the run store's ``runs``, ``show``, ``compare``,
``export``, ``plot``, ``serve`` (the web dashboard), ``rm`` and ``push`` (local runs into a
team store on PostgreSQL). Every ``--db`` takes a file or a store URL (``postgresql://...``).

The read commands import only the store reader (no PyTorch), so they start in a fraction of a
second; ``demo`` loads the trainer. Any failure prints one line on stderr and exits with
status 2 (``STEPWATCH_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _format as fmt
from ._cli_checks import UsageError as _UsageError
from ._cli_checks import check_demo_paths, check_device
from ._cli_checks import one_line as _one_line
from ._cli_push import cmd_push
from ._cli_serve import add_serve_arguments, serve_store
from ._version import __version__
from .monitor.values import direction
from .store._schema import STATUSES

if TYPE_CHECKING:
    from .store.reader import LossStats, RunInfo, Store

__all__ = ["main"]

LOSS_NOTE = (
    "best/last loss: the epoch-mean training loss (key 'loss'); marked '*', the per-step "
    "loss (key 'step_loss') of a run with no epoch mean (that is a number) yet"
)
STEP_LOSS_NOTE = "* per-step loss: the run has no epoch-mean loss (yet)"


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
        "--amp",
        default="O0",
        choices=("O0", "O1", "O2", "O3", "auto"),
        help="mixed precision level, as MindSpore's amp_level (default O0: float32; O2 on "
        "CUDA: float16 with loss scaling, on CPU: bfloat16)",
    )
    demo.add_argument(
        "--checkpoint-dir", default="checkpoints", help="where the best model is saved"
    )
    demo.add_argument(
        "--nproc",
        type=_positive_int,
        default=1,
        help="train data-parallel on this many local processes (default 1)",
    )
    demo.add_argument(
        "--db", default=None, help="run store (default $STEPWATCH_DB or ./stepwatch.db)"
    )
    demo.add_argument(
        "--serve", action="store_true", help="then open the web dashboard on the run store"
    )
    demo.add_argument("--port", type=int, default=8765, help="the dashboard's port (--serve)")
    demo.add_argument(
        "--inject",
        choices=("nan", "spike", "diverge", "explode"),
        default=None,
        help="break the run on purpose in its sixth epoch, to see AnomalyMonitor's alert and "
        "action (nan: stop; spike, diverge: roll back; explode: snapshot, then stop)",
    )

    def with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--db",
            default=None,
            help="the store: a file or postgresql://user@host/db (default $STEPWATCH_DB or "
            "./stepwatch.db)",
        )
        return p

    runs = with_db(sub.add_parser("runs", help="list the runs in the store", epilog=LOSS_NOTE))
    runs.add_argument(
        "--name", help="runs whose name contains this text, or matches it as a glob ('lr=*')"
    )
    runs.add_argument("--status", choices=STATUSES, help="runs with this status")
    runs.add_argument("--last", type=_positive_int, metavar="N", help="the newest N runs")
    runs.add_argument("--host", help="runs recorded on a host whose name contains this (or glob)")
    runs.add_argument("--user", help="runs of a user whose name contains this (a team store)")
    show = with_db(sub.add_parser("show", help="a run's summary and final metrics"))
    show.add_argument("run", help="run id or name")
    compare = with_db(
        sub.add_parser("compare", help="final and best metrics and config differences")
    )
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run ids or names")
    export = with_db(sub.add_parser("export", help="write runs as CSV, JSON or TensorBoard files"))
    export.add_argument("runs", nargs="+", metavar="RUN", help="run ids or names")
    export.add_argument("--format", required=True, choices=("csv", "json", "tensorboard"))
    export.add_argument(
        "--out",
        required=True,
        help="output file; a folder for tensorboard (one subfolder <id>-<name> per run) "
        "and for several csv/json runs (one file <id>-<name>.<format> per run)",
    )
    plot = with_db(sub.add_parser("plot", help="draw runs' curves into a PNG (runs overlaid)"))
    plot.add_argument("runs", nargs="+", metavar="RUN", help="run ids or names")
    plot.add_argument("--out", default="curves.png", help="the PNG file (default curves.png)")
    plot.add_argument(
        "--max-points", type=_positive_int, default=2000, help="points per curve (min/max kept)"
    )
    serve = with_db(sub.add_parser("serve", help="the live web dashboard on the run store"))
    add_serve_arguments(serve)
    rm = with_db(sub.add_parser("rm", help="delete runs (asks first)"))
    rm.add_argument("runs", nargs="+", metavar="RUN", help="run ids or names")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask")
    push = with_db(sub.add_parser("push", help="copy local runs into a team store (PostgreSQL)"))
    push.add_argument("--to", required=True, metavar="URL", help="postgresql://user@host/db")
    push.add_argument(
        "--run", action="append", metavar="RUN", help="a run id or name (repeat; default: all)"
    )
    return parser


# -- reading ---------------------------------------------------------------------------------
def _open_store(db: str | None) -> Store:
    from .store.reader import Store

    try:
        return Store(db)
    except FileNotFoundError as exc:
        raise _UsageError(f"{exc}; train with RunRecorder first or pass --db") from None
    except (ValueError, OSError) as exc:  # OSError: a server store cannot be reached
        raise _UsageError(str(exc)) from None


def _run(store: Store, ref: str) -> RunInfo:
    try:
        return store.run(ref)
    except KeyError:
        known = ", ".join(str(r.id) for r in store.runs(last=10)) or "none"
        raise _UsageError(f"no run {ref!r} in {store.location} (recent ids: {known})") from None


def _loss_cells(loss: LossStats | None) -> tuple[str, str]:
    if loss is None:
        return "-", "-"
    mark = "" if loss.epoch_mean else "*"
    return fmt.number(loss.min) + mark, fmt.number(loss.last) + mark


def _runs_table(pairs: list[tuple[RunInfo, LossStats | None]]) -> str:
    header = ["id", "name", "status", "steps", "best loss", "last loss", "duration", "started"]
    team = any(run.user for run, _ in pairs)  # a team store: who ran it, and where
    header += ["user@host"] if team else []
    rows = []
    for run, loss in pairs:
        best, last = _loss_cells(loss)
        rows.append(
            [
                str(run.id),
                run.name,
                run.status,
                str(run.steps),
                best,
                last,
                fmt.duration(run.duration),
                fmt.timestamp(run.started),
                *([f"{run.user}@{run.host}"] if team else []),
            ]
        )
    text = fmt.table(header, rows)
    if any(loss is not None and not loss.epoch_mean for _, loss in pairs):
        text += "\n" + STEP_LOSS_NOTE
    return text


def cmd_runs(args: argparse.Namespace) -> int:
    with _open_store(args.db) as store:
        try:
            pairs = store.runs_summary(args.name, args.status, args.last, args.host, args.user)
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
        if not pairs:
            filtered = any(x is not None for x in (args.name, args.status, args.host, args.user))
            print(f"no runs{' match' if filtered else ''} in {store.location}")
            return 0
        print(_runs_table(pairs))
    return 0


def _direction(key: str, run: RunInfo) -> str | None:
    declared = run.config.get("directions")
    return direction(key, declared if isinstance(declared, dict) else None)


def _best(stats: dict[str, float], better: str | None) -> str:
    return "-" if better is None else fmt.number(stats[better])


def cmd_show(args: argparse.Namespace) -> int:
    with _open_store(args.db) as store:
        run = _run(store, args.run)
        if not str(args.run).isdigit():
            same = [r.id for r in store.runs(name=args.run) if r.name == args.run]
            if len(same) > 1:
                others = ", ".join(str(i) for i in same if i != run.id)
                print(
                    f"note: {len(same)} runs are named {args.run!r}; showing the newest, "
                    f"{run.id} (the others: {others}; pass an id to pick one)",
                    file=sys.stderr,
                )
        summary = store.summary(run.id)
        loss = store.loss_stats(run.id)
        events = store.events(run.id)
    print(f"run {run.id}: {run.name}")
    print(f"  status    {run.status}")
    print(f"  started   {fmt.timestamp(run.started, with_seconds=True)}")
    print(f"  duration  {fmt.duration(run.duration)}")
    print(f"  host/pid  {run.host}/{run.pid}" + (f" (user {run.user})" if run.user else ""))
    print(f"  steps     {run.steps}")
    if loss is not None:
        kind = "epoch mean" if loss.epoch_mean else "per step"
        print(
            f"  loss      best {fmt.number(loss.min)}, last {fmt.number(loss.last)} "
            f"({kind}, key {loss.key!r})"
        )
    if run.dropped:
        print(f"  dropped   {run.dropped} records")
    if run.config:
        print("  config")
        for key, value in _flat(run.config):  # one setting a line: a host's are many
            print(f"    {key} = {fmt.value(value)}")
    if summary:
        rows = []
        for key, stats in summary.items():
            better = _direction(key, run)
            rows.append(
                [
                    key,
                    fmt.number(stats["last"]),
                    _best(stats, better),
                    better or "-",
                    str(stats["count"]),
                ]
            )
        print()
        print(fmt.table(["metric", "final", "best", "better", "points"], rows))
    if events:
        print()
        for event in events[-10:]:
            where = f"step {event['step']}" if event["step"] is not None else ""
            data = event.get("data")
            acts = data.get("actions") if isinstance(data, dict) else None  # an alert's actions
            done = f" [{'; '.join(map(str, acts))}]" if isinstance(acts, list) and acts else ""
            print(f"  [{event['kind']}] {where} {event['message']}{done}".rstrip())
    return 0


def _flat(config: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A config's settings, nested ones under dotted names, sorted."""
    out: list[tuple[str, Any]] = []
    for key, value in sorted(config.items()):
        if isinstance(value, dict) and value:
            out.extend(_flat(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _config_differences(runs: list[RunInfo]) -> list[list[str]]:
    missing = object()
    keys = sorted(set().union(*(r.config for r in runs)))
    rows = []
    for key in keys:
        found = [r.config.get(key, missing) for r in runs]
        if all(v == found[0] and type(v) is type(found[0]) for v in found):
            continue
        rows.append([key, *("-" if v is missing else fmt.value(v) for v in found)])
    return rows


def cmd_compare(args: argparse.Namespace) -> int:
    with _open_store(args.db) as store:
        runs = [_run(store, ref) for ref in args.runs]
        summaries = [store.summary(r.id) for r in runs]
    keys = sorted(set().union(*summaries))
    header = ["metric"]
    for r in runs:
        header += [f"{r.id}:{r.name} final", "best"]
    rows = []
    for key in keys:
        row = [key]
        for run, summary in zip(runs, summaries):
            stats = summary.get(key)
            if stats is None:
                row += ["-", "-"]
            else:
                row += [fmt.number(stats["last"]), _best(stats, _direction(key, run))]
        rows.append(row)
    rows.append(["status", *[x for r in runs for x in (r.status, "")]])
    rows.append(["duration", *[x for r in runs for x in (fmt.duration(r.duration), "")]])
    print(fmt.table(header, rows))
    differences = _config_differences(runs)
    print()
    if differences:
        names = [f"{r.id}:{r.name}" for r in runs]
        print(fmt.table(["config", *names], differences))
    else:
        print("config: the same in every run")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .store.export import export_run, run_label

    with _open_store(args.db) as store:
        runs = [_run(store, ref) for ref in dict.fromkeys(args.runs)]
        out = Path(args.out)
        if out.exists() and not out.is_dir() and (len(runs) > 1 or args.format == "tensorboard"):
            raise _UsageError(f"--out {args.out} is a file; pass a folder")
        if not out.exists() and not out.parent.is_dir():  # a typo makes no folders
            raise _UsageError(f"--out {args.out}: the folder {out.parent} does not exist")
        for run in runs:
            target = out
            if len(runs) > 1 and args.format != "tensorboard":
                target = out / f"{run_label(run)}.{args.format}"
            try:
                path = export_run(store, run.id, args.format, target)
            except ImportError as exc:
                raise _UsageError(str(exc)) from None
            except OSError as exc:
                raise _UsageError(f"cannot write {target}: {exc.strerror or exc}") from None
            print(f"exported run {run.id} ({args.format}) to {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .plotting import MAX_PANELS, alerts_from_store, all_panels, curves_from_store, write_png

    if args.max_points < 2:
        raise _UsageError("--max-points must be at least 2")
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise _UsageError(f"--out {args.out} must name a PNG file (ending in .png)")
    if not out.parent.is_dir():
        raise _UsageError(f"--out {args.out}: the folder {out.parent} does not exist")
    with _open_store(args.db) as store:
        runs = [_run(store, ref).id for ref in dict.fromkeys(args.runs)]
        curves = curves_from_store(store, runs, max_points=args.max_points)
        alerts = alerts_from_store(store, runs)
    try:
        path = write_png(curves, args.out, alerts=alerts)
    except ImportError as exc:
        raise _UsageError(str(exc)) from None
    except OSError as exc:
        raise _UsageError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {path} ({', '.join(label for label, _ in curves)})")
    charts = all_panels(curves)
    if len(charts) > MAX_PANELS:
        left = charts[MAX_PANELS:]
        shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
        print(
            f"note: drew {MAX_PANELS} of {len(charts)} charts (the loss first, then by name); "
            f"left out: {shown}. The dashboard (stepwatch serve) shows them all.",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    db = args.db
    if args.store is not None:
        if db is not None and db != args.store:
            raise _UsageError(f"two stores given: {args.store} and --db {db}; pass one")
        db = args.store
    _open_store(db).close()  # a missing or foreign file: one clear line
    return serve_store(db, args.host, args.port, args.verbose, args.token, args.allow_host)


# -- deleting --------------------------------------------------------------------------------
def _confirm(question: str) -> bool:
    """Ask on stderr, read one line of stdin; no stdin at all is a usage error."""
    print(question, end=" ", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except (OSError, ValueError):
        answer = ""
    if not answer:
        print(file=sys.stderr)
        raise _UsageError("no answer on stdin: nothing deleted; pass --yes to delete unasked")
    return answer.strip().lower() in ("y", "yes")


def cmd_rm(args: argparse.Namespace) -> int:
    from .store.reader import delete_runs

    with _open_store(args.db) as store:
        runs = {r.id: r for r in (_run(store, ref) for ref in args.runs)}
        where = store.location
    live = [f"{r.id} ({r.name})" for r in runs.values() if r.status == "running"]
    if live:
        raise _UsageError(f"run {', '.join(live)} is still running; nothing deleted")
    listed = ", ".join(f"{r.id} ({r.name}, {r.status}, {r.steps} steps)" for r in runs.values())
    if not args.yes and not _confirm(f"delete run {listed} from {where}? [y/N]"):
        print("nothing deleted")
        return 1
    try:
        deleted = delete_runs(args.db, list(runs))
    except ValueError as exc:  # started running since we looked
        raise _UsageError(f"{exc}; nothing deleted") from None
    for run in deleted:
        print(f"deleted run {run.id} ({run.name})")
    return 0


# -- the demo --------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    check_demo_paths(args)
    if args.device is not None:
        check_device(args.device)
    from .demo import run_demo, run_demo_distributed

    launch = functools.partial(run_demo_distributed, args.nproc) if args.nproc > 1 else run_demo
    result = launch(
        epochs=args.epochs,
        seed=args.seed,
        device=args.device,
        checkpoint_dir=args.checkpoint_dir,
        db=args.db,
        amp_level=args.amp,
        inject=args.inject,
    )
    db, run_id = result.get("db"), result.get("run_id")
    if db is None or run_id is None:
        return 0
    print(f"\nrecorded as run {run_id} in {db}:")
    with _open_store(str(db)) as store:
        print(_runs_table(store.runs_summary(last=5)))
    db_arg = f" --db {args.db}" if args.db else ""
    print(
        f"\nlook at it: stepwatch show {run_id}{db_arg}"
        f"  |  stepwatch export {run_id} --format csv --out run.csv{db_arg}"
    )
    if args.serve:
        return serve_store(args.db, "127.0.0.1", args.port)
    print(
        f"see its curves: stepwatch serve{db_arg}, then open "
        f"http://127.0.0.1:8765/?runs={run_id}  (or: stepwatch demo --serve)"
    )
    return 0


COMMANDS = {
    "demo": cmd_demo,
    "runs": cmd_runs,
    "show": cmd_show,
    "compare": cmd_compare,
    "export": cmd_export,
    "plot": cmd_plot,
    "serve": cmd_serve,
    "rm": cmd_rm,
    "push": cmd_push,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return 0
    except KeyboardInterrupt:
        print(f"stepwatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("STEPWATCH_DEBUG") and not isinstance(exc, _UsageError):
            raise
        print(f"stepwatch {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
