"""Training curves as a PNG: loss, metric and learning-rate panels, train and validation
overlaid, several runs overlaid. Drawn with matplotlib's Agg canvas (no display, no pyplot
state, safe off the main thread); used by ``PlotMonitor`` and ``stepwatch plot``.

Nothing here imports PyTorch; matplotlib is loaded only when a picture is drawn.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .monitor import values as names

if TYPE_CHECKING:
    from .store.reader import Store

__all__ = [
    "RunCurves",
    "all_panels",
    "curves_from_store",
    "panel_of",
    "render_png",
    "replace_file",
    "write_png",
]

# (label, {key: (steps, values)}): one run's curves.
RunCurves = tuple[str, dict[str, tuple[Sequence[int], Sequence[float]]]]

# Keys about the machinery rather than the model: left out of the picture.
_LEFT_OUT = frozenset({names.STEP_TIME, names.LOSS_SCALE, names.SKIPPED_STEPS})
_COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#0a7b83", "#57606a")
MAX_PANELS = 9


panel_of = names.panel_of


def all_panels(runs: Sequence[RunCurves]) -> list[str]:
    """Every chart ``runs`` would fill, in drawing order (only the first ``MAX_PANELS`` are
    drawn)."""
    found = {panel_of(key) for _, curves in runs for key in curves if key not in _LEFT_OUT}
    return sorted(found, key=names.panel_order)


def _panels(runs: Sequence[RunCurves]) -> list[str]:
    return all_panels(runs)[:MAX_PANELS]


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "drawing curves needs matplotlib: pip install 'stepwatch[plot]'"
        ) from None


def render_png(runs: Sequence[RunCurves], title: str | None = None) -> bytes:
    """The curves of ``runs`` as PNG bytes (an empty frame saying so when there are none)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = _panels(runs)
    cols = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    figure = Figure(figsize=(5.2 * cols, 3.6 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    if title:
        figure.suptitle(title)
    if not panels:
        axes = figure.add_subplot(1, 1, 1)
        axes.text(0.5, 0.5, "no values recorded yet", ha="center", va="center")
        axes.set_axis_off()
    several = len(runs) > 1
    for index, panel in enumerate(panels):
        axes = figure.add_subplot(rows, cols, index + 1)
        axes.set_title(panel)
        axes.set_xlabel("step")
        axes.grid(True, alpha=0.3)
        for run_index, (label, curves) in enumerate(runs):
            color = _COLORS[run_index % len(_COLORS)]
            for key in sorted(curves):
                if key in _LEFT_OUT or panel_of(key) != panel:
                    continue
                steps, values = curves[key]
                if not len(steps):
                    continue
                style: dict[str, Any] = {
                    "color": color,
                    "label": f"{label} {key}" if several else key,
                }
                if key == names.STEP_LOSS:
                    style.update(linewidth=0.8, alpha=0.6)
                else:
                    style.update(linewidth=1.6, marker="o", markersize=3)
                if key.startswith("eval_"):
                    style["linestyle"] = "--"
                axes.plot(steps, values, **style)
        if axes.has_data():
            axes.legend(fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write_png(
    runs: Sequence[RunCurves], path: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Draw ``runs`` into the PNG file ``path``, replaced whole (a viewer never sees half a
    file). Returns the path."""
    _require_matplotlib()
    return replace_file(path, render_png(runs, title))


def replace_file(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


def curves_from_store(
    store: Store, refs: Sequence[int | str], max_points: int = 2000
) -> list[RunCurves]:
    """The curves of runs in ``store`` (by id or name), min/max-downsampled per key."""
    out: list[RunCurves] = []
    for ref in refs:
        run = store.run(ref)
        curves: dict[str, tuple[Sequence[int], Sequence[float]]] = {}
        for key in store.keys(run.id):
            if key in _LEFT_OUT:
                continue
            steps, values = store.metrics(run.id, key, max_points=max_points)
            curves[key] = (steps.tolist(), values.tolist())
        out.append((f"{run.id}:{run.name}", curves))
    return out
