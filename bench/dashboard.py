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

Then the daily-tool figures (issue 21), each beside its baseline:

* ``/api/runs`` on a store of 1,000 runs (each 100 steps of ``step_loss``, an epoch ``loss``
  and a config), median over the rounds; baseline: a plain ``sqlite3`` ``SELECT * FROM runs``
  on its own connection (every run row, nothing summarised), and that read again (noise floor).
  Goal <= 200 ms.
* a 20-run overlay (``/?runs=1,...,20`` of that store) in a fresh headless Chromium: the page's
  ``performance.now()`` when every run's series are drawn (``__stepwatch.interactive``);
  baseline: the same page's ``DOMContentLoaded``. Goal <= 2 s.
* the page of a run with 3,000 keys (100 steps each): interactive (its first page of charts
  drawn, the controls live) against the same baseline. Goal <= 2 s.

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


RUNS = 1000
WIDE_KEYS = 3000


def build_many_runs(db: Path) -> None:
    rng = np.random.default_rng(1)
    for i in range(RUNS):
        config = {"lr": float(rng.choice([0.1, 0.03, 0.01])), "batch_size": 32 << (i % 3)}
        writer = RunWriter(db, name=f"sweep-{i:04d}", config=config, flush_seconds=60)
        writer.log_batch("step_loss", range(1, 101), 2.0 / np.arange(1, 101) ** 0.5, 1)
        writer.log("loss", float(rng.random()), 100, 1)
        writer.close()


def build_wide_run(db: Path) -> None:
    writer = RunWriter(db, name="wide", max_pending=1_000_000, flush_seconds=60)
    steps = np.arange(1, 101)
    for k in range(WIDE_KEYS):
        writer.log_batch(f"probe_{k:04d}/value", steps, np.sin(steps / 7 + k), 1)
    writer.close()


def timed_get(host: str, port: int, path: str) -> tuple[float, object]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("GET", path)
    answer = json.loads(conn.getresponse().read())
    conn.close()
    return time.perf_counter() - start, answer


def plain_runs(db: Path) -> float:
    start = time.perf_counter()
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    rows = conn.execute("SELECT * FROM runs ORDER BY id").fetchall()
    conn.close()
    elapsed = time.perf_counter() - start
    assert len(rows) == RUNS
    return elapsed


def page_ready(url: str, mark: str) -> tuple[float, float]:
    """``(mark, DOMContentLoaded)`` in seconds from the start of navigation, fresh browser."""
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
        driver.get(url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = driver.execute_script(
                f"return window.__stepwatch && window.__stepwatch.{mark} !== null && "
                "!document.getElementById('db-status').textContent.startsWith('error') ? "
                f"[window.__stepwatch.{mark}, performance.getEntriesByType('navigation')[0]"
                ".domContentLoadedEventEnd] : null;"
            )
            if got is not None:
                return float(got[0]) / 1000, float(got[1]) / 1000
            time.sleep(0.01)
        raise TimeoutError(f"{mark} not reached within 60 s")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def daily_tool(folder: Path, rounds: int, browser_rounds: int) -> None:
    many, wide = folder / "many.db", folder / "wide.db"
    started = time.perf_counter()
    build_many_runs(many)
    build_wide_run(wide)
    print(f"\nstores: {RUNS:,} runs and one run of {WIDE_KEYS:,} keys, written in "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    server = make_server(many, port=0)
    thread = serve_in_thread(server)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    try:
        api: list[float] = []
        plain: list[float] = []
        again: list[float] = []
        for round_index in range(rounds + 1):
            seconds, answer = timed_get(host, port, "/api/runs")
            assert isinstance(answer, list) and len(answer) == RUNS
            floor = [plain_runs(many), plain_runs(many)]
            if round_index:
                api.append(seconds)
                plain.append(floor[0])
                again.append(floor[1])
        print(f"/api/runs, {RUNS:,} runs: median {statistics.median(api) * 1000:.1f} ms over "
              f"{rounds} rounds (min {min(api) * 1000:.1f}, max {max(api) * 1000:.1f}); "
              f"plain SELECT * FROM runs {statistics.median(plain) * 1000:.2f} ms, again "
              f"{statistics.median(again) * 1000:.2f} ms")  # fmt: skip
        if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
            print("pages: skipped (no /usr/bin/chromium or /usr/bin/chromedriver)")
            return
        overlay = f"{server.url}?runs={','.join(str(i) for i in range(1, 21))}"
        got = [page_ready(overlay, "interactive") for _ in range(browser_rounds)]
        _page_line("20-run overlay drawn", got)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    server = make_server(wide, port=0)
    thread = serve_in_thread(server)
    try:
        got = [page_ready(server.url + "?runs=1", "interactive") for _ in range(browser_rounds)]
        _page_line(f"{WIDE_KEYS:,}-key run interactive", got)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _page_line(what: str, got: list[tuple[float, float]]) -> None:
    marks = [g[0] for g in got]
    loaded = statistics.median(g[1] for g in got)
    print(
        f"{what}: median {statistics.median(marks):.3f} s over {len(got)} fresh browsers "
        f"(min {min(marks):.3f}, max {max(marks):.3f}); DOMContentLoaded {loaded:.3f} s"
    )


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
    parser.add_argument("--only-daily", action="store_true", help="skip the 1M-step run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.browser_rounds = 3, 1
    folder = Path(tempfile.mkdtemp(prefix="stepwatch-bench-dashboard-"))
    try:
        if args.only_daily:
            daily_tool(folder, args.rounds, args.browser_rounds)
            return 0
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
            else:
                draws = [first_chart(server.url) for _ in range(args.browser_rounds)]
                median = statistics.median(draws)
                print(
                    f"\nfirst chart drawn in headless Chromium: median {median:.3f} s over "
                    f"{len(draws)} fresh browsers (min {min(draws):.3f}, max {max(draws):.3f})"
                )
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)
        daily_tool(folder, args.rounds, args.browser_rounds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
