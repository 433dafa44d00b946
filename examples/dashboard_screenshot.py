"""Take the README's dashboard screenshot: ``stepwatch demo`` twice, then headless Chromium.

    python examples/dashboard_screenshot.py STORE.db docs/dashboard.png

STORE.db holds the demo runs (``stepwatch demo --db STORE.db --seed 0``, then
``--seed 1 --inject spike``, whose alert is marked on the charts); every run in it is selected,
so the charts overlay them, on a log y axis.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

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
        driver.find_element("css selector", "#select-all").click()
        driver.find_element("css selector", "#log-y").click()  # a spike would flatten the rest
        time.sleep(3.0)  # the charts redraw and the runs' summaries arrive
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
