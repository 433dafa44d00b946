"""What every run store shares, whatever holds it: the run statuses and the default location.

The tables and connections of the SQLite store are in :mod:`stepwatch.store.backends.sqlite_schema`.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__: list[str] = []

# "anomaly": stopped by a monitor because training went wrong (a NaN loss, a divergence, ...).
STATUSES = ("running", "finished", "failed", "interrupted", "crashed", "anomaly")


def default_path() -> Path:
    """``$STEPWATCH_DB`` if set, else ``./stepwatch.db``."""
    return Path(os.environ.get("STEPWATCH_DB") or "stepwatch.db")


def spool_path() -> Path:
    """The local file a run is recorded into when its team store cannot be reached as the run
    starts: ``$STEPWATCH_SPOOL`` if set, else ``./stepwatch-spool.db`` (beside the default
    local store). ``stepwatch push --db <it> --to <the team store>`` uploads its runs later."""
    return Path(os.environ.get("STEPWATCH_SPOOL") or "stepwatch-spool.db")


def resolve_path(db: str | os.PathLike[str] | None) -> Path:
    if db is None:
        return default_path()
    if not isinstance(db, (str, os.PathLike)):
        raise TypeError(
            f"'db' must be a path or None, but got {db!r} with type '{type(db).__name__}'."
        )
    return Path(db)
