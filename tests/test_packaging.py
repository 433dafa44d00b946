"""stepwatch built as a user builds it: a wheel from a clean clone carries the dashboard's chart
library (uPlot, fetched from npm by the build backend, build_support/stepwatch_build.py), and a
build that cannot get it stops, saying why."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENDOR = "stepwatch/dashboard/static/vendor"


def _backend() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "stepwatch_build", ROOT / "build_support" / "stepwatch_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_a_wheel_built_from_a_clean_clone_carries_the_chart_library(tmp_path: Path) -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no clean clone to build from")
    clone = tmp_path / "clone"
    subprocess.run([git, "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    assert not (clone / "src" / VENDOR).exists()  # git holds no copy of it
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", "dist", str(clone)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("stepwatch-*.whl")
    backend = _backend()
    with zipfile.ZipFile(wheel) as archive:
        for name, digest in backend.UPLOT_FILES.values():
            data = archive.read(f"{VENDOR}/{name}")
            assert backend._sha256(data) == digest, name
        assert b"uPlot" in archive.read(f"{VENDOR}/uPlot.iife.min.js")
        assert b"MIT" in archive.read(f"{VENDOR}/LICENSE")


def test_a_build_without_the_chart_library_stops_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend()
    junk = tmp_path / "uplot-1.6.32.tgz"
    junk.write_bytes(b"not the tarball")
    monkeypatch.setenv("STEPWATCH_UPLOT_TGZ", str(junk))
    with pytest.raises(
        backend.UPlotUnavailable, match=r"needs uPlot 1\.6\.32.*is not uplot 1\.6\.32"
    ):
        backend.place_uplot(tmp_path / "vendor")
    monkeypatch.setenv("STEPWATCH_UPLOT_TGZ", str(tmp_path / "missing.tgz"))
    with pytest.raises(backend.UPlotUnavailable, match=r"not a file.*set STEPWATCH_UPLOT_TGZ"):
        backend.place_uplot(tmp_path / "vendor")
    assert not (tmp_path / "vendor" / "uPlot.iife.min.js").exists()
