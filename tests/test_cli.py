"""The stepwatch command, run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import stepwatch


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepwatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_trains_digits_past_ninety_percent() -> None:
    result = _run("demo", "--epochs", "6", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^epoch: 1 step: 22, loss is [\d.]+$", out, re.M)
    assert re.search(r"^Train epoch time: [\d.]+ ms, per step time: [\d.]+ ms$", out, re.M)
    accuracy = float(re.search(r"^validation accuracy: ([\d.]+)", out, re.M).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9


def test_version_and_bad_arguments() -> None:
    assert _run("--version").stdout.strip() == f"stepwatch {stepwatch.__version__}"
    bad = _run("demo", "--epochs", "0")
    assert bad.returncode == 2 and "expected a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr
