"""stepwatch's build backend: setuptools', after it has put the dashboard's chart library in
the package.

The dashboard draws with uPlot, a JavaScript library published on npm; it is not kept in
git. Every build (a wheel, an sdist, an editable install: ``pip install .``, ``pip wheel .``,
``pip install -e .``, ``python -m build``) first places uPlot's files in
``src/stepwatch/dashboard/static/vendor/``, from where package data carries them, so a built
stepwatch always has a working dashboard. The npm tarball is taken, in this order, from
``$STEPWATCH_UPLOT_TGZ`` (a downloaded ``uplot-<version>.tgz``: builds without a network), from
``npm pack`` (which follows the npm configuration: a mirror, a proxy), or straight from the
npm registry (``$npm_config_registry``, by default registry.npmjs.org), and is checked against
the pinned SHA-512 before anything is taken from it. Files already in place with the pinned
SHA-256 (an sdist carries them) are kept as they are. When uPlot cannot be had the build stops,
saying why and what to do.

Run as a script (``python build_support/stepwatch_build.py``) it only places the files.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - the hooks not overridden here

UPLOT_VERSION = "1.6.32"
# npm's "integrity" of uplot-1.6.32.tgz (npm view uplot@1.6.32 dist.integrity).
UPLOT_INTEGRITY = (
    "sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+"
    "jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw=="
)
# What the package needs from the tarball: its member -> (file in vendor/, SHA-256).
UPLOT_FILES = {
    "package/dist/uPlot.iife.min.js": (
        "uPlot.iife.min.js",
        "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
    ),
    "package/dist/uPlot.min.css": (
        "uPlot.min.css",
        "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
    ),
    "package/LICENSE": (
        "LICENSE",
        "8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd",
    ),
}
TARBALL_ENV = "STEPWATCH_UPLOT_TGZ"
VENDOR = (
    Path(__file__).resolve().parents[1] / "src" / "stepwatch" / "dashboard" / "static" / "vendor"
)
TARBALL = f"uplot-{UPLOT_VERSION}.tgz"


class UPlotUnavailable(RuntimeError):
    """uPlot could not be placed in the package: the build stops with this message."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _in_place(vendor: Path) -> bool:
    return all(
        (vendor / name).is_file() and _sha256((vendor / name).read_bytes()) == digest
        for name, digest in UPLOT_FILES.values()
    )


def _check_tarball(data: bytes, origin: str) -> bytes:
    algorithm, _, expected = UPLOT_INTEGRITY.partition("-")
    got = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if got != expected:
        raise UPlotUnavailable(
            f"{origin} is not uplot {UPLOT_VERSION} as published on npm (its {algorithm} is "
            f"{got}, not {expected})"
        )
    return data


def _from_npm() -> bytes:
    npm = shutil.which("npm")
    if npm is None:
        raise UPlotUnavailable("npm is not installed")
    with tempfile.TemporaryDirectory(prefix="stepwatch-uplot-") as folder:
        done = subprocess.run(
            [npm, "pack", "--silent", f"uplot@{UPLOT_VERSION}"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        packed = Path(folder) / TARBALL
        if done.returncode != 0 or not packed.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no tarball"]
            raise UPlotUnavailable(f"npm pack uplot@{UPLOT_VERSION} failed: {tail[0]}")
        return _check_tarball(packed.read_bytes(), f"npm pack's {TARBALL}")


def _from_registry() -> bytes:
    # npm's own setting, which npm spells in lower case.
    registry = os.environ.get("npm_config_registry") or "https://registry.npmjs.org/"  # noqa: SIM112
    url = f"{registry.rstrip('/')}/uplot/-/{TARBALL}"
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            data = answer.read()
    except OSError as exc:
        raise UPlotUnavailable(f"cannot download {url}: {exc}") from None
    return _check_tarball(data, url)


def _tarball() -> bytes:
    given = os.environ.get(TARBALL_ENV)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise UPlotUnavailable(f"${TARBALL_ENV} names {given}, which is not a file")
        return _check_tarball(path.read_bytes(), str(path))
    reasons = []
    for fetch in (_from_npm, _from_registry):
        try:
            return fetch()
        except UPlotUnavailable as exc:
            reasons.append(str(exc))
    raise UPlotUnavailable("; ".join(reasons))


def place_uplot(vendor: Path = VENDOR) -> Path:
    """Put uPlot's files in ``vendor`` (kept when already there); returns ``vendor``.

    Raises:
        UPlotUnavailable: the tarball could not be had or is not the pinned one.
    """
    if _in_place(vendor):
        return vendor
    try:
        data = _tarball()
        vendor.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            for member, (name, digest) in UPLOT_FILES.items():
                source = archive.extractfile(member)
                content = source.read() if source is not None else b""
                if _sha256(content) != digest:
                    raise UPlotUnavailable(f"{member} in {TARBALL} is not the expected file")
                part = vendor / f".{name}.part"
                part.write_bytes(content)
                part.replace(vendor / name)
    except UPlotUnavailable as exc:
        raise UPlotUnavailable(
            f"stepwatch's build needs uPlot {UPLOT_VERSION}, the dashboard's chart library, "
            f"from npm, and could not get it: {exc}. Build where the npm registry can be "
            f"reached, or download {TARBALL} (https://registry.npmjs.org/uplot/-/{TARBALL}) "
            f"and set {TARBALL_ENV} to its path"
        ) from None
    return vendor


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    place_uplot()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    place_uplot()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    place_uplot()
    return _setuptools.build_sdist(sdist_directory, config_settings)


if __name__ == "__main__":
    try:
        print(f"uPlot {UPLOT_VERSION} in {place_uplot()}")
    except UPlotUnavailable as exc:
        sys.exit(str(exc))
