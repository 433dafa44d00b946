"""The dashboard in real headless Chromium (Debian's ``chromium`` and ``chromium-driver``).

Where Chromium cannot be had the test skips with the reason; with
``STEPWATCH_REQUIRE_BROWSER=1`` (``.ci/run`` sets it) that skip is a failure instead.
The screenshot is saved as ``artifacts/dashboard-browser-test.png``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from stepwatch.dashboard.headless import CHROMEDRIVER, CHROMIUM, chromium_flags
from stepwatch.dashboard.server import DashboardServer, make_server, serve_in_thread
from stepwatch.store import RunWriter

from .conftest import wait_until
from .pg_cluster import pg_cluster_fixture  # noqa: F401 - the fixture, for the PostgreSQL page test

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "dashboard-browser-test.png"


def _unavailable(reason: str) -> None:
    if os.environ.get("STEPWATCH_REQUIRE_BROWSER") == "1":
        pytest.fail(f"STEPWATCH_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install 'stepwatch[dev]')")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            _unavailable(f"{path} is missing (apt-get install chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="stepwatch-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in chromium_flags(profile, "1400,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _chart(driver: Any, panel: str) -> dict[str, Any]:
    return dict(
        driver.execute_script(
            "const d = document.querySelector(`.chart[data-panel='${arguments[0]}']`);"
            "if (!d) return {points: 0, series: '', last: -1, inked: 0, colors: '', log: '',"
            "                markers: '', bands: 0};"
            "const c = d.querySelector('canvas'); let inked = 0;"
            "if (c) { const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "  for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++; }"
            "return {points: Number(d.dataset.points || 0), series: d.dataset.series || '',"
            "        last: Number(d.dataset.lastStep || -1), inked, colors: d.dataset.colors || '',"
            "        log: d.dataset.log || '', markers: d.dataset.markers || '',"
            "        bands: Number(d.dataset.bands || 0)};",
            panel,
        )
    )


def _choose(driver: Any, css: str, value: str) -> None:
    """Set a form control as a user does (its value, then the event it fires)."""
    driver.execute_script(
        "const e = document.querySelector(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event(e.tagName === 'SELECT' ? 'change' : 'input'));",
        css,
        value,
    )


@contextlib.contextmanager
def _served(db: Path) -> Iterator[DashboardServer]:
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _shot(driver: Any, name: str) -> Path:
    """A screenshot for a person to look at: ``artifacts/dashboard-<name>.png``."""
    path = ROOT / "artifacts" / f"dashboard-{name}.png"
    path.parent.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(path))
    return path


def test_dashboard_in_headless_chromium(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    done = RunWriter(db, name="baseline")
    for step in range(1, 201):
        done.log("step_loss", 2.0 / step**0.5, step, 1 + step // 100)
    done.log("eval_loss", 0.4, 100, 1)
    done.log("eval_loss", 0.3, 200, 2)
    done.event("checkpoint", "saved baseline-2.ckpt", step=200, epoch=2)
    done.close()
    live = RunWriter(db, name="live", flush_seconds=0.05)
    for step in range(1, 101):
        live.log("step_loss", 1.5 / step**0.5, step, 1)
    assert live.flush()
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        browser.get(server.url)
        wait_until(lambda: len(browser.find_elements("css selector", "#runs tbody tr")) == 2)
        names = _rows(browser)
        assert names == ["live", "baseline"]
        assert _texts(browser, "#runs tbody .status") == ["running", "finished"]

        # The newest run is shown first: its loss chart has drawn its points.
        wait_until(lambda: _chart(browser, "loss")["points"] == 100)
        assert _chart(browser, "loss")["inked"] > 500

        # Selecting both runs overlays them on the same charts.
        _click(browser, "#select-all")
        wait_until(lambda: _chart(browser, "loss")["series"].count("|") == 2)
        series = _chart(browser, "loss")["series"].split("|")
        assert series == ["1:baseline eval_loss", "1:baseline step_loss", "2:live step_loss"]
        wait_until(lambda: _chart(browser, "loss")["points"] == 200 + 2 + 100)

        # A run that keeps logging shows its new points without a reload, fetched with after=.
        browser.execute_script("window.__notReloaded = true;")
        for step in range(101, 151):
            live.log("step_loss", 1.5 / step**0.5, step, 1)
        assert live.flush()
        wait_until(lambda: _chart(browser, "loss")["points"] == 200 + 2 + 150, timeout=10)
        assert browser.execute_script("return window.__notReloaded === true;")
        asked = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
            ".filter(n => n.includes('/api/runs/2/metrics/step_loss'));"
        )
        assert any("after=100" in url for url in asked), asked

        # A log y axis redraws every chart without a script error.
        browser.execute_script(
            "window.__errors = []; window.addEventListener('error', e => __errors.push(e.message));"
        )
        _choose(browser, "#y-scale", "log")
        wait_until(lambda: _chart(browser, "loss")["log"] == "1")
        wait_until(lambda: _chart(browser, "loss")["inked"] > 500)
        assert browser.execute_script("return window.__errors;") == []
        ARTIFACT.parent.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACT))
        print(f"screenshot: {ARTIFACT}")
        assert ARTIFACT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        live.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_markup_from_a_crafted_store_is_shown_as_text(browser: Any, tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "crafted.db"
    writer = RunWriter(db, name="<b>bold</b>")
    writer.log("step_loss", 1.0, 1)
    writer.close()
    evil = '<img src=x onerror="window.__pwned=1">'
    with sqlite3.connect(db) as conn:  # a file crafted by someone else
        conn.execute("UPDATE runs SET status = ?", (evil,))
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    try:
        browser.get(server.url)
        wait_until(lambda: len(browser.find_elements("css selector", "#runs tbody tr")) == 1)
        status = browser.find_element("css selector", "#runs tbody .status")
        assert status.text == evil
        name = browser.find_element("css selector", "#runs tbody td.name")
        assert name.text == "<b>bold</b>"
        assert browser.find_elements("css selector", "#runs img, #runs b") == []
        assert browser.execute_script("return window.__pwned === undefined;")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _sweep(db: Path) -> None:
    """Six runs of a small sweep: configs that differ, one stopped by a monitor."""
    rng = np.random.default_rng(3)
    for i, (lr, batch) in enumerate([(0.1, 32), (0.05, 32), (0.1, 64), (0.02, 64), (0.3, 32)]):
        writer = RunWriter(db, name=f"sweep-{i}", config={"lr": lr, "batch_size": batch, "seed": 0})
        steps = np.arange(1, 201 + 40 * i)
        loss = 2.0 * np.exp(-steps * lr / 20) + 0.05 * rng.random(len(steps))
        times = 1_700_000_000.0 + steps * (0.5 + 0.25 * i)  # runs of different speeds
        half = len(steps) // 2
        for epoch, part in ((1, slice(0, half)), (2, slice(half, None))):
            writer.log_batch("step_loss", steps[part], loss[part], epoch=epoch, times=times[part])
        for epoch in (1, 2):
            last = int(steps[half - 1] if epoch == 1 else steps[-1])
            writer.log("eval_accuracy", 0.5 + 0.1 * epoch + 0.01 * i, last, epoch)
        writer.close()
    bad = RunWriter(db, name="diverged", config={"lr": 3.0, "batch_size": 32, "seed": 0})
    for step in range(1, 61):
        bad.log("step_loss", 1.0 + step * (0.02 if step < 50 else 20.0), step, 1)
    bad.event(
        "alert",
        "loss 21.0 is 8.2x its recent median",
        step=55,
        epoch=1,
        level="warning",
        data={
            "kind": "divergence",
            "value": 21.0,
            "actions": ["rolled back to step 50 (1 of 3)", "learning rate reduced to 1.5"],
            "source": "AnomalyMonitor",
        },
    )
    bad.event("stop", "training stopped: divergence", step=60, epoch=1, level="error")
    for step in range(10, 61, 10):
        bad.log("system/cpu_percent", 40.0 + step / 10, step)
        bad.log("system/rss_mb", 900.0 + step, step)
    bad.close("anomaly")


def _actions(driver: Any) -> Any:
    from selenium.webdriver.common.action_chains import ActionChains

    return ActionChains(driver)


def _texts(driver: Any, css: str) -> list[str]:
    """The text of every element ``css`` finds, read in one go (the table is redrawn by the
    live poll, so elements found earlier go stale)."""
    found = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent);", css
    )
    return [str(t) for t in found]


def _click(driver: Any, css: str) -> None:
    driver.execute_script("document.querySelector(arguments[0]).click();", css)


def _rows(driver: Any) -> list[str]:
    return _texts(driver, "#runs tbody td.name")


def test_find_runs_by_name_status_host_and_config(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "sweep.db"
    _sweep(db)
    with _served(db) as server:
        browser.get(server.url)
        wait_until(lambda: len(_rows(browser)) == 6)
        # The config keys that differ are columns; the anomaly-stopped run says so.
        heads = _texts(browser, "#runs thead th.config")
        assert heads == ["batch_size", "lr"]
        assert _texts(browser, "#runs tbody tr[data-run='6'] .status") == ["anomaly"]
        for query, want in [
            ("status:anomaly", ["diverged"]),
            ("lr=0.1", ["sweep-2", "sweep-0"]),
            ("batch_size>32 lr<0.1", ["sweep-3"]),
            ("sweep-1", ["sweep-1"]),
            (f"host:{socket.gethostname()} lr>=0.3", ["diverged", "sweep-4"]),
            ("host:no-such-machine", []),
        ]:
            _choose(browser, "#search", query)
            wait_until(lambda want=want: _rows(browser) == want)
            assert parse_qs(urlsplit(browser.current_url).query)["q"] == [query]
        _choose(browser, "#search", "")
        wait_until(lambda: len(_rows(browser)) == 6)
        # A column sorts by a click, descending first, then ascending.
        _click(browser, "#runs th[data-sort='steps']")
        wait_until(lambda: _rows(browser)[:2] == ["sweep-4", "sweep-3"])
        _click(browser, "#runs th[data-sort='steps']")
        wait_until(lambda: _rows(browser)[0] == "diverged")
        _click(browser, "#runs th[data-sort='config:lr']")
        wait_until(lambda: _rows(browser)[0] == "diverged")
        # Chosen config columns replace the automatic ones.
        browser.execute_script(
            "const e = document.getElementById('columns'); e.value = 'seed, lr';"
            "e.dispatchEvent(new Event('change'));"
        )
        wait_until(lambda: _texts(browser, "#runs th.config") == ["seed", "lr"])
        print(f"screenshot: {_shot(browser, 'find')}")


def test_runs_compared_url_state_round_trip(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "sweep.db"
    _sweep(db)
    with _served(db) as server:
        browser.get(server.url + "?runs=1,2,3")
        wait_until(lambda: _chart(browser, "accuracy")["points"] == 6)
        wait_until(lambda: _chart(browser, "loss")["series"].count("|") == 2)
        loss, accuracy = _chart(browser, "loss"), _chart(browser, "accuracy")
        # One colour per run, the same in every chart; one legend entry per run.
        assert loss["colors"] == accuracy["colors"]
        assert len(set(loss["colors"].split("|"))) == 3
        assert loss["log"] == "0"  # a curve within three decades stays on a linear y
        legend = browser.find_elements("css selector", "#legend .run")
        assert [e.get_attribute("data-run") for e in legend] == ["1", "2", "3"]
        # Hovering shows every run's value at that step.
        plot = browser.find_element("css selector", ".chart[data-panel='loss'] .u-over")
        _actions(browser).move_to_element_with_offset(plot, 0, 0).perform()
        wait_until(lambda: browser.execute_script("return !document.getElementById('tip').hidden"))
        tip = browser.find_element("css selector", "#tip")
        assert len(tip.find_elements("css selector", "tr")) == 3
        assert "sweep-0" in tip.text and "sweep-2" in tip.text

        # A view: epoch axis, smoothing, keys filter, a chart on log y, a zoom by a drag.
        _choose(browser, "#x-axis", "epoch")
        wait_until(lambda: 0 < _chart(browser, "loss")["last"] <= 2.0001)
        _choose(browser, "#smoothing", "0.6")
        browser.find_element("css selector", ".chart[data-panel='accuracy'] .yscale").click()
        wait_until(lambda: _chart(browser, "accuracy")["log"] == "1")
        plot = browser.find_element("css selector", ".chart[data-panel='loss'] .u-over")
        _actions(browser).move_to_element_with_offset(
            plot, -100, 0
        ).click_and_hold().move_by_offset(150, 0).release().perform()
        wait_until(lambda: "zoom=" in browser.current_url)
        _choose(browser, "#key-filter", "loss")
        wait_until(lambda: _chart(browser, "accuracy")["points"] == 0)
        view = browser.execute_script(_VIEW)
        url = browser.current_url
        for part in ("runs=1,2,3", "x=epoch", "smooth=0.6", "keys=loss", "zoom="):
            assert part in url, url
        # The link alone gives the same view in a fresh page.
        browser.get("about:blank")
        browser.get(url)
        wait_until(lambda: _chart(browser, "loss")["points"] > 0)
        wait_until(lambda: browser.execute_script(_VIEW)["charts"] == view["charts"])
        assert browser.execute_script(_VIEW) == view
        assert browser.execute_script("return document.getElementById('x-axis').value") == "epoch"
        # (the accuracy chart is filtered out; its log y stays in the link)
        assert "log=accuracy" in browser.current_url
        print(f"screenshot: {_shot(browser, 'compare')}")


_VIEW = (
    "const s = window.__stepwatch.state; const c = s.charts.get('loss');"
    "return {runs: [...s.selected].sort(), axis: s.axis, smoothing: s.smoothing,"
    "  keys: s.keyFilter, zoom: s.zoom, log: [...s.ylog], charts: [...s.charts.keys()],"
    "  scale: c ? [c.plot.scales.x.min, c.plot.scales.x.max].map(v => v.toFixed(6)) : null};"
)


def test_a_run_of_3000_keys(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "wide.db"
    writer = RunWriter(db, name="wide", max_pending=1_000_000)
    steps = np.arange(1, 21)
    for k in range(3000):
        writer.log_batch(f"probe_{k:04d}", steps, np.sin(steps / 3 + k))
    writer.log_batch("step_loss", steps, 1.0 / steps)
    writer.close()
    with _served(db) as server:
        browser.get(server.url)
        wait_until(lambda: len(browser.find_elements("css selector", "#charts .chart")) == 24, 30)
        assert "error" not in browser.find_element("css selector", "#db-status").text
        wait_until(lambda: _chart(browser, "loss")["points"] == 20)
        assert "3001 keys" in browser.find_element("css selector", "#key-count").text
        browser.find_element("css selector", "#more-panels").click()
        wait_until(lambda: len(browser.find_elements("css selector", "#charts .chart")) == 48)
        _choose(browser, "#key-filter", "probe_2999")
        wait_until(lambda: len(browser.find_elements("css selector", "#charts .chart")) == 1)
        wait_until(lambda: _chart(browser, "probe_2999")["points"] == 20)
        # Never more than a page of charts' series asked for.
        asked = browser.execute_script(
            "return performance.getEntriesByType('resource')"
            ".filter(e => e.name.includes('/metrics/')).length;"
        )
        assert asked <= 24 + 24 + 1 + 4, asked
        assert "error" not in browser.find_element("css selector", "#db-status").text


def test_alert_with_its_actions_and_the_system_panel(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "sweep.db"
    _sweep(db)
    with _served(db) as server:
        browser.get(server.url + "?runs=6")
        wait_until(lambda: _chart(browser, "loss")["points"] == 60)
        # The alert and the stop are marked on the chart at their steps.
        assert _chart(browser, "loss")["markers"].split("|") == ["6:55:alert", "6:60:stop"]
        # A spike that spans decades: log y chosen by itself.
        assert _chart(browser, "loss")["log"] == "1"
        events = browser.find_element("css selector", "#events").text
        assert "step 55 [alert divergence] loss 21.0 is 8.2x its recent median" in events
        assert "→ rolled back to step 50 (1 of 3)" in events
        assert "→ learning rate reduced to 1.5" in events
        # Hovering the marker tells what the monitor did.
        x = browser.execute_script(
            "const c = window.__stepwatch.state.charts.get('loss').plot;"
            "return c.valToPos(55, 'x') - c.over.clientWidth / 2;"
        )
        plot = browser.find_element("css selector", ".chart[data-panel='loss'] .u-over")
        _actions(browser).move_to_element_with_offset(plot, int(x), 0).perform()
        wait_until(lambda: "rolled back to step 50" in browser.find_element("id", "tip").text)
        # System metrics are a group of their own, one chart per key.
        assert browser.find_element("id", "system-box").is_displayed()
        system = browser.find_elements("css selector", "#system-charts .chart")
        assert [e.get_attribute("data-panel") for e in system] == [
            "system/cpu_percent",
            "system/rss_mb",
        ]
        wait_until(lambda: _chart(browser, "system/rss_mb")["points"] == 6)
        print(f"screenshot: {_shot(browser, 'alert')}")


def test_the_page_over_a_postgresql_team_store(
    browser: Any, request: pytest.FixtureRequest
) -> None:
    """Two machines' runs in one PostgreSQL store, on the page as from a local file: the list,
    the live run's chart, and the finished run's alert on its chart."""
    from .pg_cluster import PgCluster

    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    url = cluster.new_database()
    done = RunWriter(url, name="team-baseline")
    for step in range(1, 121):
        done.log("step_loss", 2.0 / step**0.5 if step != 90 else 40.0, step, 1 + step // 60)
    done.event("alert", "loss jumped to 40", 90, 2, level="warning",
               data={"kind": "spike", "actions": ["rolled back to step 50 (1 of 3)"]})  # fmt: skip
    done.close("finished")
    live = RunWriter(url, name="team-live", flush_seconds=0.05)
    for step in range(1, 61):
        live.log("step_loss", 1.0 / step**0.5, step, 1)
    assert live.flush()
    try:
        with _served(url) as server:  # type: ignore[arg-type]
            browser.get(server.url)
            wait_until(lambda: _rows(browser) == ["team-live", "team-baseline"])
            assert _texts(browser, "#runs tbody .status") == ["running", "finished"]
            wait_until(lambda: _chart(browser, "loss")["points"] == 60)
            assert _chart(browser, "loss")["inked"] > 500
            for step in range(61, 81):  # the live run goes on: the page follows it
                live.log("step_loss", 1.0 / step**0.5, step, 1)
            assert live.flush()
            wait_until(lambda: _chart(browser, "loss")["last"] == 80, timeout=15)
            browser.get(f"{server.url}?runs=1")
            wait_until(lambda: _chart(browser, "loss")["points"] > 0)
            wait_until(lambda: "1:90:alert" in _chart(browser, "loss")["markers"].split("|"))
            assert cluster.password not in browser.page_source
            _shot(browser, "postgres")
    finally:
        live.close()


def test_a_team_dashboard_opens_from_its_login_link(
    browser: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On every address the page asks for the token; the printed link logs the browser in
    (a cookie), the token leaves the address bar, and the page works as on loopback."""
    monkeypatch.delenv("STEPWATCH_TOKEN", raising=False)
    db = tmp_path / "team.db"
    _sweep(db)
    server = make_server(db, host="0.0.0.0", port=0)
    thread = serve_in_thread(server)
    try:
        assert server.token is not None
        port = server.server_address[1]
        local = f"http://127.0.0.1:{port}/"
        browser.get(local + "?runs=6")
        assert "asks for its token" in browser.find_element("css selector", "body").text
        browser.get(f"{local}?runs=6&token={server.token}")
        wait_until(lambda: _chart(browser, "loss")["points"] == 60)
        assert browser.current_url == local + "?runs=6"
        assert len(_rows(browser)) == 6
        assert "error" not in browser.find_element("id", "db-status").text
        browser.get(local + "?runs=1")  # the cookie stays: no token needed any more
        wait_until(lambda: _chart(browser, "loss")["points"] > 0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_machine_and_trainer_host_are_apart_and_host_finds_the_bridge(
    browser: Any, tmp_path: Path
) -> None:
    db = tmp_path / "bridges.db"
    for host in ("lightning", "keras", "transformers"):
        writer = RunWriter(db, name=f"{host}-fit", config={"host": host, "lr": 0.1})
        writer.log("step_loss", 1.0, 1)
        writer.close()
    plain = RunWriter(db, name="plain", config={"lr": 0.1})
    plain.log("step_loss", 1.0, 1)
    plain.close()
    with _served(db) as server:
        browser.get(server.url)
        wait_until(lambda: len(_rows(browser)) == 4)
        heads = _texts(browser, "#runs thead th")
        assert "machine" in heads and heads.count("host") == 1  # the config column only
        assert _texts(browser, "#runs thead th.config") == ["host"]
        machine = socket.gethostname()
        for query, want in [
            ("host:lightning", ["lightning-fit"]),
            ("host:keras", ["keras-fit"]),
            ("host!=keras", ["plain", "transformers-fit", "lightning-fit"]),
            (f"machine:{machine}", ["plain", "transformers-fit", "keras-fit", "lightning-fit"]),
            ("machine:lightning", []),
            (f"host:{machine}", ["plain", "transformers-fit", "keras-fit", "lightning-fit"]),
        ]:
            _choose(browser, "#search", query)
            wait_until(lambda want=want: _rows(browser) == want)


_Y_LABELS = (
    "const u = window.__stepwatch.state.charts.get('loss').plot; const ax = u.axes[1];"
    "const ctx = document.createElement('canvas').getContext('2d'); ctx.font = ax.font[0];"
    "const labels = (ax._values || []).filter(Boolean);"
    "const widest = Math.max(...labels.map(v => ctx.measureText(v).width)) / devicePixelRatio;"
    "return {labels, widest, room: ax._size - ax.ticks.size - ax.gap};"
)


def test_y_tick_labels_fit_their_axis(browser: Any, tmp_path: Path) -> None:
    # Labels such as 0.00175 are wider than a fixed axis allows: they were cut to ").00175".
    db = tmp_path / "small.db"
    writer = RunWriter(db, name="small")
    for step in range(1, 101):
        writer.log("step_loss", 0.0016 + 0.0002 * (step % 10) / 10, step, 1)
    writer.close()
    with _served(db) as server:
        browser.get(server.url)
        wait_until(lambda: _chart(browser, "loss")["points"] == 100)
        found = browser.execute_script(_Y_LABELS)
        assert any(len(label) >= 7 for label in found["labels"]), found  # e.g. 0.00175
        assert found["widest"] <= found["room"], found


def test_checkpoints_fold_so_that_alerts_stand_out(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "events.db"
    writer = RunWriter(db, name="busy")
    for step in range(1, 201):
        writer.log("step_loss", 1.0 / step, step, 1 + step // 50)
        if step % 10 == 0 and step not in (50, 130):
            writer.event("checkpoint", f"saved busy-{step}.ckpt", step=step, epoch=1)
        if step in (55, 135):
            writer.event("alert", f"loss spike at {step}", step=step, epoch=1, level="warning",
                         data={"kind": "spike", "actions": ["rolled back"]})  # fmt: skip
    writer.close()
    with _served(db) as server:
        browser.get(server.url)
        wait_until(lambda: _chart(browser, "loss")["points"] == 200)
        wait_until(lambda: len(_texts(browser, "#events > li")) == 5)
        assert _texts(browser, "#events > li.folded") == [
            "run 1: 4 checkpoints, steps 10–40",
            "run 1: 7 checkpoints, steps 60–120",
            "run 1: 7 checkpoints, steps 140–200",
        ]
        alerts = _texts(browser, "#events > li.kind-alert")
        assert [a.split(" [")[0] for a in alerts] == ["run 1 busy step 55", "run 1 busy step 135"]
        assert _texts(browser, "#event-kinds label") == ["alert (2)", "checkpoint (18)"]
        assert _chart(browser, "loss")["markers"].split("|") == ["1:55:alert", "1:135:alert"]
        # Checkpoints shown again: listed (the last 20 of the rest) and marked, in the link.
        _click(browser, "#event-kinds input[value='checkpoint']")
        wait_until(lambda: len(_texts(browser, "#events > li")) == 20)
        assert _texts(browser, "#events > li.folded") == []
        assert len(_chart(browser, "loss")["markers"].split("|")) == 20
        assert "hide=none" in browser.current_url
        browser.get(browser.current_url)
        wait_until(lambda: len(_texts(browser, "#events > li")) == 20)
        # Alerts hidden too: they fold like the rest.
        _click(browser, "#event-kinds input[value='alert']")
        wait_until(lambda: _texts(browser, "#events > li.kind-alert") == [])
        assert "hide=alert" in browser.current_url


def test_a_search_matching_nothing_clears_the_charts(browser: Any, tmp_path: Path) -> None:
    db = tmp_path / "sweep.db"
    _sweep(db)
    with _served(db) as server:
        browser.get(server.url + "?runs=1,6")
        wait_until(lambda: _chart(browser, "loss")["series"].count("|") == 1)
        assert _texts(browser, "#events > li.kind-alert") != []
        note = "#charts-note"
        assert browser.find_element("css selector", note).is_displayed() is False
        _choose(browser, "#search", "no-such-run")
        wait_until(lambda: _rows(browser) == [])
        wait_until(lambda: browser.find_elements("css selector", "#charts .chart") == [])
        assert browser.find_elements("css selector", "#system-charts .chart") == []
        assert _texts(browser, "#legend .run") == [] and _texts(browser, "#events > li") == []
        assert (
            "finds none of the 2 selected runs" in browser.find_element("css selector", note).text
        )
        # A search that finds one of them draws that one only.
        _choose(browser, "#search", "status:anomaly")
        wait_until(lambda: _rows(browser) == ["diverged"])
        wait_until(lambda: _chart(browser, "loss")["series"] == "step_loss")
        assert [
            e.get_attribute("data-run")
            for e in browser.find_elements("css selector", "#legend .run")
        ] == ["6"]
        _choose(browser, "#search", "")
        wait_until(lambda: _chart(browser, "loss")["series"].count("|") == 1)
        assert not browser.find_element("css selector", note).is_displayed()
