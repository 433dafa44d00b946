"""Take the README's dashboard screenshot: ``stepwatch demo`` twice, then headless Chromium.

    python examples/dashboard_screenshot.py STORE.db docs/dashboard.png

STORE.db holds the demo runs (``stepwatch demo --db STORE.db --seed 0``, then
``--seed 1 --inject spike``, whose alert is marked on the charts); every run in it is selected,
so the charts overlay them (log y where a chart spans decades), with the cursor on the alert.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains

from stepwatch.dashboard.headless import CHROMEDRIVER, CHROMIUM, chromium_flags
from stepwatch.dashboard.server import make_server, serve_in_thread


def main(db: str, out: str) -> None:
    server = make_server(db, port=0)
    thread = serve_in_thread(server)
    profile = tempfile.mkdtemp(prefix="stepwatch-shot-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in chromium_flags(profile, "1500,1250"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(server.url)
        time.sleep(1.0)
        # Every run overlaid (the y scale is chosen per chart: log where a spike spans decades).
        driver.execute_script("document.getElementById('select-all').click();")
        time.sleep(3.0)  # the charts redraw and the runs' summaries arrive
        # The cursor on the alert's marker: the hover lists each run's value and what the
        # monitor did.
        alert = driver.execute_script(
            "const s = window.__stepwatch.state; for (const [run, evs] of s.events)"
            "  for (const e of evs) if (e.kind === 'alert' && e.step !== null) return e.step;"
            "return null;"
        )
        if alert is not None:
            over = driver.find_element("css selector", ".chart[data-panel='loss'] .u-over")
            x = driver.execute_script(
                "const c = window.__stepwatch.state.charts.get('loss').plot;"
                "return c.valToPos(arguments[0], 'x') - c.over.clientWidth / 2;",
                alert,
            )
            ActionChains(driver).move_to_element_with_offset(over, int(x), -40).perform()
            time.sleep(0.5)
        driver.save_screenshot(out)
        print(f"wrote {out}")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
