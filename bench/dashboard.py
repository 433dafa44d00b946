"""The dashboard on a long run: the metrics endpoint and the first chart in headless Chromium.

Workload: a run store holding one run of 1,000,000 steps of ``step_loss`` (a noisy decaying
curve with one spike), written with ``RunWriter.log_batch``.

Method, in one process, interleaved round by round (round 0 is a warm-up and discarded):

* ``endpoint`` - ``GET /api/runs/1/metrics/step_loss?max_points=2000`` on the real dashboard
  server over loopback HTTP, answer parsed from JSON: what the page asks for a chart.
* ``plain read`` - the baseline: every point of the series read with one plain ``sqlite3``
  query (``SELECT step, value ... ORDER BY step``, ``fetchall``) on its own connection.
* ``plain read'`` - the same query again: its ratio to ``plain read`` is the noise floor.

The table gives medians over the rounds and the median of the per-round ratios
``endpoint / plain read`` (the goal is <= 0.5, and <= 200 ms for the endpoint itself).

Then ``first chart``: a fresh headless Chromium (Debian's ``/usr/bin/chromium`` through
``chromedriver``) opens ``/?runs=1``; the time is the page's own ``performance.now()`` when
the first chart has drawn its points (counted from the start of navigation), median over
the rounds (goal <= 1.5 s). Skipped with a note where Chromium is missing.

Usage::

    python bench/dashboard.py            # 15 rounds, 5 browser rounds
    python bench/dashboard.py --quick    # 3 rounds, 1 browser round
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stepwatch.dashboard.headless import CHROMEDRIVER, CHROMIUM, chromium_flags
from stepwatch.dashboard.server import make_server, serve_in_thread
from stepwatch.store import RunWriter

STEPS = 1_000_000


def build_store(db: Path) -> None:
    rng = np.random.default_rng(0)
    steps = np.arange(1, STEPS + 1)
    values = 2.0 * np.exp(-steps / 200_000) + 0.05 * rng.standard_normal(STEPS)
    values[654_321] = 25.0
    writer = RunWriter(db, name="long", max_pending=10)
    for start in range(0, STEPS, 100_000):
        writer.log_batch(
            "step_loss", range(start + 1, start + 100_001), values[start : start + 100_000]
        )
        writer.flush(timeout=120)
    writer.close()


def endpoint(host: str, port: int) -> float:
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("GET", "/api/runs/1/metrics/step_loss?max_points=2000")
    answer = json.loads(conn.getresponse().read())
    conn.close()
    elapsed = time.perf_counter() - start
    assert len(answer["steps"]) <= 2000 and 654_322 in answer["steps"]
    return elapsed


def plain_read(db: Path) -> float:
    start = time.perf_counter()
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    key = conn.execute("SELECT id FROM keys WHERE name = 'step_loss'").fetchone()[0]
    rows = conn.execute(
        "SELECT step, value FROM points WHERE run = 1 AND key = ? ORDER BY step", (key,)
    ).fetchall()
    conn.close()
    elapsed = time.perf_counter() - start
    assert len(rows) == STEPS
    return elapsed


def first_chart(url: str) -> float:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="stepwatch-bench-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in chromium_flags(profile, "1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(url + "?runs=1")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            drawn = driver.execute_script(
                "return window.__stepwatch && window.__stepwatch.firstDraw;"
            )
            if drawn is not None:
                return float(drawn) / 1000
            time.sleep(0.01)
        raise TimeoutError("the chart was not drawn within 60 s")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--browser-rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.browser_rounds = 3, 1
    folder = Path(tempfile.mkdtemp(prefix="stepwatch-bench-dashboard-"))
    try:
        db = folder / "long.db"
        started = time.perf_counter()
        build_store(db)
        print(
            f"store: 1 run of {STEPS:,} steps, {db.stat().st_size / 1e6:.0f} MB, "
            f"written in {time.perf_counter() - started:.1f} s"
        )
        server = make_server(db, port=0)
        thread = serve_in_thread(server)
        host, port = str(server.server_address[0]), int(server.server_address[1])
        times: dict[str, list[float]] = {"endpoint": [], "plain read": [], "plain read'": []}
        ratios: dict[str, list[float]] = {"endpoint": [], "plain read'": []}
        try:
            for round_index in range(args.rounds + 1):
                order = ["endpoint", "plain read", "plain read'"]
                if round_index % 2:
                    order.reverse()
                got: dict[str, float] = {}
                for name in order:
                    got[name] = endpoint(host, port) if name == "endpoint" else plain_read(db)
                if round_index == 0:
                    continue
                for name, seconds in got.items():
                    times[name].append(seconds)
                for name in ratios:
                    ratios[name].append(got[name] / got["plain read"])
            print(f"\nmedian of {args.rounds} rounds (ratio: time / plain read, per round)")
            print(f"{'':14}{'time ms':>10}{'ratio':>10}{'min..max':>16}")
            for name, seconds in times.items():
                line = f"{name:14}{statistics.median(seconds) * 1000:10.1f}"
                if name in ratios:
                    r = ratios[name]
                    line += f"{statistics.median(r):10.3f}{min(r):8.3f}..{max(r):.3f}"
                print(line)
            print("noise floor: plain read' / plain read (raw vs raw)")
            if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
                print("\nfirst chart: skipped (no /usr/bin/chromium or /usr/bin/chromedriver)")
                return 0
            draws = [first_chart(server.url) for _ in range(args.browser_rounds)]
            median = statistics.median(draws)
            print(
                f"\nfirst chart drawn in headless Chromium: median {median:.3f} s "
                f"over {len(draws)} fresh browsers (min {min(draws):.3f}, max {max(draws):.3f})"
            )
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
