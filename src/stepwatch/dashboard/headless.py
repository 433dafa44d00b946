"""The command-line flags for opening the dashboard in a headless Chromium (the browser test,
the dashboard benchmark and the README's screenshot script share them)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHROMEDRIVER", "CHROMIUM", "chromium_flags"]

CHROMIUM = Path("/usr/bin/chromium")  # Debian's chromium package
CHROMEDRIVER = Path("/usr/bin/chromedriver")  # Debian's chromium-driver package


def chromium_flags(profile: str, window: str = "1400,1100") -> list[str]:
    """Headless, sandbox-free flags that keep Chromium off the network (a closed machine
    refuses its background connections) and in a fresh profile folder ``profile``."""
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--window-size={window}",
        f"--user-data-dir={profile}",
    ]
