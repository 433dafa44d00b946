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

Second table, the writer's cost to a training thread that runs while it writes: the tiny MLP of
``bench/overhead.py`` (CPU, one thread) trains 2000-step epochs and queues ``--keys`` points a
step (one ``log_batch`` per key every 256 steps, as ``RunRecorder`` does) into a writer that
commits every 0.1 s. Configurations, interleaved and each paired with an epoch of the bare loop:

* ``none`` - a bare loop paired with a bare loop: the noise floor;
* ``stepwatch`` - ``RunWriter``: up to 256 rows per ``INSERT`` statement;
* ``executemany`` - the same writer inserting with ``executemany`` (SQLite runs once per row,
  and the writer takes and releases the interpreter lock once per row).

Reported: the median extra wall time and extra training-thread CPU time per step (CPU time is
less sensitive to other processes on the machine).

Usage::

    python bench/logging_throughput.py            # 100k points, 3 rounds; 15 training rounds
    python bench/logging_throughput.py --points 20000 --rounds 1 --training-rounds 0
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepwatch.store import RunWriter
from stepwatch.store.backends.sqlite_schema import connect_for_writing

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


class _ExecutemanyWriter(RunWriter):
    """``RunWriter`` inserting one row per SQLite call, as ``executemany`` does."""

    def _insert_points(self, run: int, flat: list[Any]) -> None:
        self._conn.executemany(
            "INSERT INTO points (run, key, step, epoch, time, value) VALUES (?, ?, ?, ?, ?, ?)",
            ((run, *row) for row in zip(*[iter(flat)] * 5)),
        )


def training_cost(keys: int, rounds: int) -> None:
    """The second table: what a writer that writes during training costs the training loop."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overhead import make_mlp, make_workload

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    steps = 2000
    batches = make_workload(steps).batches
    net = make_mlp()
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    folder = tempfile.TemporaryDirectory(prefix="stepwatch-logbench-")
    writers: dict[str, type[RunWriter] | None] = {
        "none": None,
        "stepwatch": RunWriter,
        "executemany": _ExecutemanyWriter,
    }

    def epoch(kind: type[RunWriter] | None) -> tuple[float, float]:
        writer = None if kind is None else kind(Path(folder.name) / "t.db", flush_seconds=0.1)
        pending: list[torch.Tensor] = []
        first = 1
        cpu, start = time.thread_time(), time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            if writer is not None:
                pending.append(loss.detach())
                if len(pending) == 256:
                    values, now = torch.stack(pending).float(), time.time()
                    for k in range(keys):
                        writer.log_batch(
                            f"k{k}", range(first, first + 256), values, span=(now, now)
                        )
                    first, pending = first + 256, []
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        if writer is not None:
            writer.close()
        return wall, cpu

    extra: dict[str, list[tuple[float, float]]] = {name: [] for name in writers}
    for round_index in range(rounds + 1):  # round 0 is the warm-up
        for name, kind in writers.items():
            gc.collect()
            if round_index % 2:
                (wall, cpu), (raw_wall, raw_cpu) = epoch(kind), epoch(None)
            else:
                (raw_wall, raw_cpu), (wall, cpu) = epoch(None), epoch(kind)
            if round_index:
                extra[name].append(((wall - raw_wall) / steps * 1e6, (cpu - raw_cpu) / steps * 1e6))
    print()
    print(
        f"writing during training: {keys} points a step, flush every 0.1 s, {rounds} rounds x "
        f"{steps} steps of the tiny MLP (bare loop ~{1e6 * raw_wall / steps:.0f} us a step)"
    )
    print()
    header = (
        f"{'writer':<16} {'extra wall us/step':>19} {'extra CPU us/step':>18} {'per point':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, samples in extra.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(f"{name:<16} {wall:>19.1f} {cpu:>18.1f} {cpu / keys:>10.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=100_000, help="points per run (100k)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--training-rounds", type=int, default=15, help="rounds of the second table (15; 0: skip)"
    )
    parser.add_argument("--keys", type=int, default=10, help="points a step, second table (10)")
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
    if args.training_rounds > 0:
        training_cost(args.keys, args.training_rounds)


if __name__ == "__main__":
    main()
