"""Reading runs back: :class:`Store` (opens the store a location names), the run records
(:class:`RunInfo`, :class:`LossStats`) and :func:`delete_runs`.

Nothing here imports PyTorch: the CLI's read commands and a dashboard start in a fraction of a
second.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ._runs import LossStats, RunInfo, effective_status
from .base import Store

__all__ = ["LossStats", "RunInfo", "Store", "delete_runs", "effective_status"]


def delete_runs(path: str | os.PathLike[str] | None, runs: Sequence[int | str]) -> list[RunInfo]:
    """Delete runs (their points, rollups, events and run rows) from the store at ``path``.

    All or nothing: if any run is unknown or still running (its process alive), nothing is
    deleted. A file store does not shrink (SQLite reuses the space for new runs).

    Args:
        path: the store's location (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).
        runs: run ids or names.

    Returns:
        The runs deleted.

    Raises:
        KeyError: an unknown run. ValueError: a run that is still running.
        FileNotFoundError / sqlite3.Error: the database cannot be opened or written.
    """
    with Store(path) as store:
        return store.delete_runs(runs)
