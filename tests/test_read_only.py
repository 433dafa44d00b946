"""Read-only places: refused at construction with a clear error, before any training.

A read-only filesystem is mounted for real (tmpfs, ro); where mounting is not permitted (not
root, a container without the capability) the tests skip with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwatch import AnomalyMonitor, PlotMonitor, RunRecorder, RunWriter, Store


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A folder on a read-only filesystem, holding a run store written before it was frozen."""
    folder = tmp_path / "ro"
    folder.mkdir()
    seed = tmp_path / "seed.db"
    writer = RunWriter(seed, name="kept")
    writer.log("loss", 1.0, 1)
    writer.close()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "none", str(folder)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a test filesystem here: {made.stderr.strip()}")
    try:
        shutil.copy(seed, folder / "runs.db")
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], timeout=30, check=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], timeout=30, check=False)


def test_read_only_places_are_refused_at_construction(read_only: Path) -> None:
    with pytest.raises(ValueError, match="cannot be written: the file or its folder is read-only"):
        RunRecorder(db=read_only / "runs.db")
    with pytest.raises(ValueError, match=r"'snapshot_dir' .* cannot be written"):
        AnomalyMonitor(action="snapshot", snapshot_dir=read_only / "snaps")
    with pytest.raises(ValueError, match=r"'path' .* cannot be written"):
        PlotMonitor(read_only / "curves.png")
    with Store(read_only / "runs.db") as store:  # reading still works
        assert [r.name for r in store.runs()] == ["kept"]
