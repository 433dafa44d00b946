"""The dashboard in real headless Chromium (Debian's ``chromium`` and ``chromium-driver``).

Where Chromium cannot be had the test skips with the reason; with
``STEPWATCH_REQUIRE_BROWSER=1`` (``.ci/run`` sets it) that skip is a failure instead.
The screenshot is saved as ``artifacts/dashboard-browser-test.png``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwatch.dashboard.headless import CHROMEDRIVER, CHROMIUM, chromium_flags
from stepwatch.dashboard.server import make_server, serve_in_thread
from stepwatch.store import RunWriter

from .conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "artifacts" / "dashboard-browser-test.png"


def _unavailable(reason: str) -> None:
    if os.environ.get("STEPWATCH_REQUIRE_BROWSER") == "1":
        pytest.fail(f"STEPWATCH_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
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
            "if (!d) return {points: 0, series: '', last: -1, inked: 0};"
            "const c = d.querySelector('canvas'); let inked = 0;"
            "if (c) { const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "  for (let i = 3; i < px.length; i += 4) if (px[i] > 0) inked++; }"
            "return {points: Number(d.dataset.points || 0), series: d.dataset.series || '',"
            "        last: Number(d.dataset.lastStep || -1), inked};",
            panel,
        )
    )


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
        names = [
            e.text for e in browser.find_elements("css selector", "#runs tbody td:nth-child(3)")
        ]
        assert names == ["live", "baseline"]
        statuses = browser.find_elements("css selector", "#runs tbody .status")
        assert [e.text for e in statuses] == ["running", "finished"]

        # The newest run is shown first: its loss chart has drawn its points.
        wait_until(lambda: _chart(browser, "loss")["points"] == 100)
        assert _chart(browser, "loss")["inked"] > 500

        # Selecting both runs overlays them on the same charts.
        browser.find_element("css selector", "#select-all").click()
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
        browser.find_element("css selector", "#log-y").click()
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
        name = browser.find_element("css selector", "#runs tbody td:nth-child(3)")
        assert name.text == "<b>bold</b>"
        assert browser.find_elements("css selector", "#runs img, #runs b") == []
        assert browser.execute_script("return window.__pwned === undefined;")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
