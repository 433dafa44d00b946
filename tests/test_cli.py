"""The stepwatch command, run as a user runs it."""

from __future__ import annotations

import re
from pathlib import Path

import stepwatch
from stepwatch import load_checkpoint

from .conftest import run_cli


def test_demo_trains_digits_past_ninety_percent(tmp_path: Path) -> None:
    result = run_cli("demo", "--epochs", "6", "--device", "cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^epoch: 1 step: 22, loss is [\d.]+$", out, re.M)
    assert re.search(r"^Train epoch time: [\d.]+ ms, per step time: [\d.]+ ms$", out, re.M)
    accuracy = float(re.search(r"^validation accuracy: ([\d.]+)", out, re.M).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9
    best = re.search(r"^best checkpoint: (\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    assert load_checkpoint(tmp_path / best)["epoch_complete"]
    # The CLI prints the store's runs table from what the demo returns.
    tail = out[out.index("\nrecorded as run 1 in stepwatch.db:\n") :].splitlines()
    assert tail[2].split()[:4] == ["id", "name", "status", "steps"]
    assert tail[3].split()[:3] == ["1", "digits-demo", "finished"]
    assert tail[-2].startswith("look at it: stepwatch show 1  |  stepwatch export 1 ")
    assert tail[-1].startswith("see its curves: stepwatch serve, then open http://127.0.0.1")


def test_demo_inject_spike_shows_the_alert_and_the_rollback(tmp_path: Path) -> None:
    result = run_cli("demo", "--epochs", "6", "--inject", "spike", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "** injecting one corrupt batch: inputs x60, labels shuffled at step 235" in out
    assert re.search(
        r"^\*\* alert at step 235: spike -> rolled back to step 200 \(1 of 3\)", out, re.M
    )
    assert "** the run ran to the end" in out
    # the same alert reached the log (stderr) once, with what the action did
    assert result.stderr.count("step 235: loss jumped to") == 1
    show = run_cli("show", "1", cwd=tmp_path)  # and `show` lists it with its action
    assert show.returncode == 0, show.stderr
    assert re.search(r"\[alert\] step 235 loss jumped to .*\[rolled back to step 200 \(1 of 3\)",
                     show.stdout)  # fmt: skip


def test_demo_inject_nan_is_stopped_and_stored_as_an_anomaly(tmp_path: Path) -> None:
    # LossMonitor prints the NaN line and leaves the decision to AnomalyMonitor: exit 0.
    result = run_cli("demo", "--epochs", "6", "--inject", "nan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^1 +digits-demo +anomaly ", result.stdout, re.M)
    with stepwatch.Store(tmp_path / "stepwatch.db") as store:
        assert store.run(1).config["inject"] == "nan"


def test_version_and_bad_arguments() -> None:
    assert run_cli("--version").stdout.strip() == f"stepwatch {stepwatch.__version__}"
    bad = run_cli("demo", "--epochs", "0")
    assert bad.returncode == 2 and "expected a positive integer" in bad.stderr
    assert "Traceback" not in bad.stderr
