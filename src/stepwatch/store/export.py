"""Export a run to CSV, JSON or TensorBoard event files."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

from .reader import Store

__all__ = ["FORMATS", "export_run"]

FORMATS = ("csv", "json", "tensorboard")


def _json_value(value: float) -> float | None:
    return None if math.isnan(value) else value


def export_run(store: Store, run: int | str, fmt: str, out: str | os.PathLike[str]) -> Path:
    """Write run ``run`` to ``out`` in format ``fmt`` and return the path written.

    * ``csv``: one row per point: ``key,step,epoch,time,value``.
    * ``json``: ``{"run": {...}, "metrics": {key: {"steps", "epochs", "times", "values"}},
      "events": [...]}`` (NaN becomes null).
    * ``tensorboard``: event files in the folder ``out``, readable by TensorBoard (written with
      ``torch.utils.tensorboard``, which needs the ``tensorboard`` package).

    Raises:
        ValueError: unknown format. KeyError: unknown run. ImportError: tensorboard missing.
    """
    if fmt not in FORMATS:
        raise ValueError(f"'format' must be one of {FORMATS}, but got {fmt!r}.")
    info = store.run(run)
    points = store.points(info.id)
    path = Path(out)
    if fmt == "csv":
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["key", "step", "epoch", "time", "value"])
            for key, step, epoch, stamp, value in points:
                writer.writerow(
                    [key, step, "" if epoch is None else epoch, repr(stamp), repr(value)]
                )
        return path
    if fmt == "json":
        metrics: dict[str, dict[str, list[Any]]] = {}
        for key, step, epoch, stamp, value in points:
            m = metrics.setdefault(key, {"steps": [], "epochs": [], "times": [], "values": []})
            m["steps"].append(step)
            m["epochs"].append(epoch)
            m["times"].append(stamp)
            m["values"].append(_json_value(value))
        document = {
            "run": {
                "id": info.id,
                "name": info.name,
                "status": info.status,
                "started": info.started,
                "ended": info.ended,
                "host": info.host,
                "config": info.config,
                "dropped": info.dropped,
            },
            "metrics": metrics,
            "events": store.events(info.id),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1, allow_nan=False))
        return path
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "exporting to TensorBoard needs the tensorboard package: "
            "pip install 'stepwatch[export]'"
        ) from exc
    path.mkdir(parents=True, exist_ok=True)
    tb = SummaryWriter(log_dir=str(path))
    try:
        for key, step, _epoch, stamp, value in points:
            tb.add_scalar(key, value, global_step=step, walltime=stamp)
        for event in store.events(info.id):
            tb.add_text(
                f"events/{event['kind']}",
                event["message"],
                event["step"] or 0,
                walltime=event["time"],
            )
    finally:
        tb.close()
    return path
