"""Cost of logging a scalar, on the training thread and end to end into the database.

Three writers get the same N scalars (one tag, steps 0..N-1), each into a fresh folder, in one
process, interleaved over several rounds:

* ``stepwatch`` - ``RunWriter.log(key, value, step)``; the writer thread batches the rows into
  the run store (SQLite, WAL). "loop" is the time the training thread spends in ``log``;
  "end to end" adds ``close()``, which returns once every point is committed.
* ``sqlite ceiling`` - plain ``sqlite3``: a list buffer of 1000 rows, ``executemany`` and a
  commit per buffer, into the same tables (same schema and settings as the run store). This
  is the best a Python program can do with SQLite; it does all the work on the caller's
  thread.
* ``tensorboard`` - ``torch.utils.tensorboard.SummaryWriter.add_scalar`` then ``close()``.

Goals: at most 2 us per scalar on the training thread, and end-to-end throughput at least 0.8
of the SQLite ceiling.

Usage::

    python bench/logging_throughput.py            # 100k points, 3 rounds
    python bench/logging_throughput.py --points 20000 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stepwatch.store import RunWriter
from stepwatch.store._schema import connect_for_writing

Result = tuple[float, float]  # (seconds in the loop, seconds end to end)


def run_stepwatch(folder: Path, n: int) -> Result:
    writer = RunWriter(folder / "store.db", name="bench")
    start = time.perf_counter()
    log = writer.log
    for i in range(n):
        log("loss", i * 0.001, i)
    loop = time.perf_counter() - start
    writer.close()
    total = time.perf_counter() - start
    assert writer.written == n and writer.dropped == 0, (writer.written, writer.dropped)
    return loop, total


def run_sqlite(folder: Path, n: int) -> Result:
    conn = connect_for_writing(folder / "plain.db")
    now = time.time()
    with conn:
        cur = conn.execute(
            "INSERT INTO runs (name, status, started, host, pid, config, heartbeat) "
            "VALUES ('bench', 'running', ?, ?, ?, '{}', ?)",
            (now, socket.gethostname(), os.getpid(), now),
        )
        run = cur.lastrowid
        conn.execute("INSERT OR IGNORE INTO keys (name) VALUES ('loss')")
        key = conn.execute("SELECT id FROM keys WHERE name = 'loss'").fetchone()[0]
    sql = "INSERT INTO points (run, key, step, epoch, time, value) VALUES (?, ?, ?, ?, ?, ?)"
    start = time.perf_counter()
    buffer: list[tuple[object, ...]] = []
    for i in range(n):
        buffer.append((run, key, i, None, time.time(), i * 0.001))
        if len(buffer) == 1000:
            conn.execute("BEGIN")
            conn.executemany(sql, buffer)
            conn.execute("COMMIT")
            buffer.clear()
    if buffer:
        conn.execute("BEGIN")
        conn.executemany(sql, buffer)
        conn.execute("COMMIT")
    loop = time.perf_counter() - start
    conn.close()
    total = time.perf_counter() - start
    return loop, total


def run_tensorboard(folder: Path, n: int) -> Result:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder / "tb"))
    start = time.perf_counter()
    for i in range(n):
        writer.add_scalar("loss", i * 0.001, i)
    loop = time.perf_counter() - start
    writer.close()
    total = time.perf_counter() - start
    return loop, total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=100_000, help="points per run (100k)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    args = parser.parse_args(argv)
    n = args.points
    runners: dict[str, Callable[[Path, int], Result]] = {
        "stepwatch": run_stepwatch,
        "sqlite ceiling": run_sqlite,
    }
    try:
        import tensorboard  # noqa: F401

        runners["tensorboard"] = run_tensorboard
    except ImportError:
        print("skipped tensorboard: the tensorboard package is not installed")
    results: dict[str, list[Result]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            with tempfile.TemporaryDirectory(prefix="stepwatch-logbench-") as folder:
                results[name].append(run(Path(folder), n))
    print(f"logging: {n} scalars per run, one tag, median of {args.rounds} rounds")
    print()
    header = f"{'writer':<16} {'loop us/scalar':>15} {'end-to-end points/s':>20} {'x ceiling':>10}"
    print(header)
    print("-" * len(header))
    ceiling = statistics.median(n / total for _, total in results["sqlite ceiling"])
    medians = {}
    for name, samples in results.items():
        per_scalar = statistics.median(loop / n * 1e6 for loop, _ in samples)
        rate = statistics.median(n / total for _, total in samples)
        medians[name] = (per_scalar, rate)
        print(f"{name:<16} {per_scalar:>15.2f} {rate:>20,.0f} {rate / ceiling:>10.2f}")
    per_scalar, rate = medians["stepwatch"]
    print()
    print(
        f"goal: <= 2 us per scalar on the training thread: {per_scalar:.2f} us -> "
        f"{'met' if per_scalar <= 2 else 'NOT met'}"
    )
    print(
        f"goal: end to end >= 0.8 x sqlite ceiling: {rate / ceiling:.2f} -> "
        f"{'met' if rate / ceiling >= 0.8 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
