"""The team store on PostgreSQL: logging end to end against a plain psycopg COPY, the training
thread's cost per scalar, and the dashboard's run list with 1,000 runs.

    .venv/bin/python bench/postgres.py [--url postgresql://...] [--points 1000000]

Without ``--url`` it starts a throwaway local cluster (tests/pg_cluster.py: initdb + pg_ctl,
as the ``postgres`` user when root) and removes it afterwards.

* end to end: ``RunWriter.log_batch`` of 256-step chunks (what ``RunRecorder`` hands the
  writer), from the first call until ``close()`` returns with every point committed (points,
  rollups, series and heartbeat, one transaction per batch), in points per second;
* COPY: the same rows (run, key, step, epoch, time, value) written by psycopg's ``COPY ...
  FROM STDIN`` with ``write_row``, one transaction per 50,000 rows (the writer's batch), into
  the same ``points`` table; run twice, so that COPY/COPY shows the noise floor;
* training thread: CPU time of the logging thread (``time.thread_time``) per scalar, for
  ``log_batch`` chunks and for single ``log`` calls, while the writer thread writes;
* ``/api/runs``: a dashboard on a store of 1,000 runs (each 200 step losses and 5 epoch
  losses), the median of 7 requests;
* the overlay: 20 runs of 100,000 step losses each, written once into PostgreSQL and once
  into a SQLite file, and ``/?runs=1,...,20`` opened in a fresh headless Chromium for each
  (``bench/dashboard.py``'s page timer): the time until every chart is drawn, the SQLite
  store as the baseline.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.pg_cluster

from stepwatch.store.writer import RunWriter


def end_to_end(url: str, points: int, chunk: int = 256) -> tuple[float, float]:
    """(points per second end to end, µs of training-thread CPU per scalar)."""
    values = np.random.default_rng(0).standard_normal(points)
    writer = RunWriter(url, name="bench-e2e", max_pending=1_000_000)
    start, cpu = time.perf_counter(), time.thread_time()
    for at in range(0, points, chunk):
        writer.log_batch("step_loss", range(at, at + chunk), values[at : at + chunk], epoch=1)
    cpu = time.thread_time() - cpu
    writer.close()
    wall = time.perf_counter() - start
    assert writer.dropped == 0 and writer.written == points, (writer.dropped, writer.written)
    return points / wall, cpu / points * 1e6


def singles(url: str, points: int) -> float:
    """µs of training-thread CPU per ``log`` call."""
    writer = RunWriter(url, name="bench-singles", max_pending=1_000_000)
    cpu = time.thread_time()
    for step in range(points):
        writer.log("step_loss", 0.5, step, 1)
    cpu = time.thread_time() - cpu
    writer.close()
    assert writer.dropped == 0
    return cpu / points * 1e6


def plain_copy(url: str, points: int, run: int, batch: int = 50_000) -> float:
    """Points per second of psycopg COPY ... write_row of the same rows."""
    import psycopg

    values = np.random.default_rng(0).standard_normal(points).tolist()
    now = time.time()
    with psycopg.connect(url, autocommit=True) as conn:
        key = conn.execute("SELECT id FROM keys WHERE name = 'step_loss'").fetchone()[0]
        start = time.perf_counter()
        for at in range(0, points, batch):
            with conn.transaction(), conn.cursor() as cur:
                sql = "COPY points (run, key, step, epoch, time, value) FROM STDIN"
                with cur.copy(sql) as copy:
                    for step in range(at, min(points, at + batch)):
                        copy.write_row((run, key, step, 1, now, values[step]))
        return points / (time.perf_counter() - start)


def api_runs(url: str, runs: int = 1_000) -> float:
    """Median ms of GET /api/runs on a store of ``runs`` runs."""
    from stepwatch.dashboard.server import make_server, serve_in_thread
    from stepwatch.store.base import open_write_backend

    backend = open_write_backend(url)
    try:
        step_loss, loss = backend.key_id("step_loss"), backend.key_id("loss")
        for i in range(runs):
            run = backend.create_run(f"run-{i}", '{"lr": 0.1}', "bench-host", 1, time.time())
            flat = [v for s in range(200) for v in (step_loss, s, s // 40, 1.0, 1.0 / (s + 1))]
            flat += [v for e in range(5) for v in (loss, 40 * e + 39, e, 1.0, 1.0 / (e + 1))]
            backend.write(run, flat, [], time.time())
            backend.finish(run, "finished", time.time(), 0)
    finally:
        backend.close()
    server = make_server(url, port=0)
    thread = serve_in_thread(server)
    try:
        host, port = server.server_address[:2]
        times = []
        for _ in range(7):
            conn = http.client.HTTPConnection(str(host), int(port), timeout=60)
            start = time.perf_counter()
            conn.request("GET", "/api/runs")
            body = conn.getresponse().read()
            times.append((time.perf_counter() - start) * 1000)
            conn.close()
        assert body.count(b'"name"') >= runs
        return statistics.median(times)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def overlay(url: str, runs: int = 20, points: int = 100_000) -> float:
    """Median seconds (3 fresh browsers) until the page overlaying ``runs`` runs of ``points``
    step losses each is interactive, on the store at ``url``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dashboard import page_ready

    from stepwatch.dashboard.server import make_server, serve_in_thread

    rng = np.random.default_rng(2)
    steps = np.arange(1, points + 1)
    for i in range(runs):
        writer = RunWriter(url, name=f"overlay-{i:02d}", max_pending=1_000_000)
        values = 2.0 * np.exp(-steps / (20_000 + 1000 * i)) + 0.05 * rng.standard_normal(points)
        for at in range(0, points, 10_000):
            writer.log_batch("step_loss", range(at + 1, at + 10_001), values[at : at + 10_000])
        writer.close()
    server = make_server(url, port=0)
    thread = serve_in_thread(server)
    try:
        page = f"{server.url}?runs={','.join(str(i) for i in range(1, runs + 1))}"
        return statistics.median(page_ready(page, "interactive")[0] for _ in range(3))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a postgresql:// store (default: a throwaway cluster)")
    parser.add_argument("--points", type=int, default=1_000_000)
    args = parser.parse_args()
    cluster = None
    if args.url is None:
        from tests.pg_cluster import PgCluster

        cluster = PgCluster.start()
    try:
        url = args.url or cluster.new_database()  # type: ignore[union-attr]
        rate, per_scalar = end_to_end(url, args.points)
        copy_a = plain_copy(url, args.points, run=1_000_001)
        copy_b = plain_copy(url, args.points, run=1_000_002)
        single = singles(url, min(args.points, 200_000))
        print(f"end to end (RunWriter.log_batch -> committed): {rate:,.0f} points/s")
        print(f"plain psycopg COPY write_row, twice: {copy_a:,.0f} and {copy_b:,.0f} points/s")
        print(f"ratio end to end / COPY: {rate / copy_a:.2f} (noise floor COPY/COPY: "
              f"{copy_b / copy_a:.2f})")  # fmt: skip
        print(f"training thread: {per_scalar:.3f} us/scalar (log_batch of 256), "
              f"{single:.3f} us/scalar (log)")  # fmt: skip
        api_url = url if args.url else cluster.new_database()  # type: ignore[union-attr]
        print(f"/api/runs with 1,000 runs: {api_runs(api_url):.0f} ms (median of 7)")
        over_url = url if args.url else cluster.new_database()  # type: ignore[union-attr]
        with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as folder:
            local = overlay(str(Path(folder) / "overlay.db"))
        team = overlay(over_url)
        print(f"20-run overlay (100k points each) drawn: PostgreSQL {team:.2f} s, "
              f"SQLite {local:.2f} s (median of 3 fresh browsers)")  # fmt: skip
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
