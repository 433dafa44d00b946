"""Export a run to CSV, JSON or TensorBoard event files."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from .reader import RunInfo, Store

__all__ = ["FORMATS", "export_run", "run_label"]

FORMATS = ("csv", "json", "tensorboard")


def run_label(info: RunInfo) -> str:
    """``<id>-<name>``, safe as a file or folder name: letters and digits of any script stay
    (``训练`` is kept), path separators and other marks become ``_``."""
    return f"{info.id}-" + re.sub(r"[^\w.=+-]+", "_", info.name).strip("_.")


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats made JSON: NaN -> null, +-inf -> "Infinity"/"-Infinity"
    (the spellings JavaScript's ``Number()`` and Python's ``float()`` read back)."""
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return None
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def export_run(store: Store, run: int | str, fmt: str, out: str | os.PathLike[str]) -> Path:
    """Write run ``run`` to ``out`` in format ``fmt`` and return the path written.

    * ``csv``: one row per point: ``key,step,epoch,time,value``.
    * ``json``: ``{"run": {...}, "metrics": {key: {"steps", "epochs", "times", "values"}},
      "events": [...]}``. Strict JSON: NaN becomes null, +-infinity the strings
      ``"Infinity"`` / ``"-Infinity"`` (anywhere: values, config, event data).
    * ``tensorboard``: event files in the folder ``out/<id>-<name>`` (see :func:`run_label`),
      so runs exported to one ``out`` stay apart in TensorBoard (written with
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
            m["values"].append(value)
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
        path.write_text(json.dumps(_json_safe(document), indent=1, allow_nan=False))
        return path
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "exporting to TensorBoard needs the tensorboard package: "
            "pip install 'stepwatch[export]'"
        ) from exc
    path = path / run_label(info)
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
