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
    "RunAlerts",
    "RunCurves",
    "alerts_from_store",
    "all_panels",
    "curves_from_store",
    "draw",
    "panel_of",
    "render_png",
    "replace_file",
    "write_png",
    "y_scale",
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


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "drawing curves needs matplotlib: pip install 'stepwatch[plot]'"
        ) from None


# Alerts per run, as ``(step, kind)``: marked on the loss chart.
RunAlerts = Sequence[tuple[int, str]]
_MAX_MARKS = 20  # alert marks per run and chart; more would hide the curve


def y_scale(series: Sequence[Sequence[float]]) -> str:
    """``'log'`` for a chart whose values are all positive and span three decades or more
    (one spike then does not flatten the rest), else ``'linear'``."""
    low, high = math.inf, 0.0
    for values in series:
        for value in values:
            if value is None or not math.isfinite(value):
                continue
            if value <= 0:
                return "linear"
            low, high = min(low, value), max(high, value)
    return "log" if high > 0 and low < math.inf and high / low >= 1e3 else "linear"


def draw(
    runs: Sequence[RunCurves],
    title: str | None = None,
    alerts: Sequence[RunAlerts] | None = None,
) -> Any:
    """The curves of ``runs`` as a matplotlib ``Figure`` (Agg): one chart per panel (the
    first ``MAX_PANELS``, with a note naming the rest), one colour per run, one line style per
    key, the legend beside the chart, a log y axis where the values span decades, and each
    run's ``alerts`` marked on the loss chart."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    every = all_panels(runs)
    panels = every[:MAX_PANELS]
    cols = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    figure = Figure(figsize=(6.2 * cols, 3.6 * rows), dpi=100, layout="constrained")
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
        drawn: list[Sequence[float]] = []
        keys: dict[str, dict[str, Any]] = {}
        for run_index, (label, curves) in enumerate(runs):
            color = _COLORS[run_index % len(_COLORS)]
            for key in sorted(curves):
                if key in _LEFT_OUT or panel_of(key) != panel:
                    continue
                steps, values = curves[key]
                if not len(steps):
                    continue
                style = _style(key)
                keys.setdefault(key, style)
                name = label if several else key
                axes.plot(steps, values, color=color, label=name, **style)
                drawn.append(values)
        if panel == names.panel_of(names.LOSS) and alerts:
            _mark_alerts(axes, alerts)
        axes.set_yscale(y_scale(drawn))
        if not axes.has_data():
            continue
        if several:  # one entry per run (its colour), then one per key (its line style)
            handles = [
                Line2D([], [], color=_COLORS[i % len(_COLORS)], linewidth=2, label=label)
                for i, (label, _) in enumerate(runs)
            ]
            if len(keys) > 1:
                handles += [
                    Line2D([], [], color="#57606a", label=k, **st) for k, st in keys.items()
                ]
            axes.legend(handles=handles, **_LEGEND)
        else:
            axes.legend(**_LEGEND)
    left = every[MAX_PANELS:]
    if left:
        shown = ", ".join(left[:6]) + (", ..." if len(left) > 6 else "")
        figure.text(
            0.01,
            0.002,
            f"{len(left)} more charts not drawn: {shown} (stepwatch serve shows them all)",
            fontsize="small",
            color="#57606a",
        )
    return figure


_LEGEND: dict[str, Any] = {
    "loc": "upper left",
    "bbox_to_anchor": (1.01, 1.0),
    "fontsize": "small",
    "frameon": False,
    "borderaxespad": 0.0,
}


def _style(key: str) -> dict[str, Any]:
    """The line style of a key: thin for step values, markers for epoch values, dashed for
    validation values."""
    if key == names.STEP_LOSS or key.startswith("system/"):
        style: dict[str, Any] = {"linewidth": 0.8, "alpha": 0.7}
    else:
        style = {"linewidth": 1.6, "marker": "o", "markersize": 3}
    if key.startswith("eval_"):
        style["linestyle"] = "--"
    return style


def _mark_alerts(axes: Any, alerts: Sequence[RunAlerts]) -> None:
    """A dotted vertical line at each alert's step, its kind written at the top (where it
    does not run into the previous one's)."""
    low, high = axes.dataLim.intervalx
    gap = (high - low) / 40 if high > low else 0.0
    for run_index, marks in enumerate(alerts):
        color = _COLORS[run_index % len(_COLORS)]
        named = -math.inf
        for step, kind in list(marks)[:_MAX_MARKS]:
            axes.axvline(step, color=color, linestyle=":", linewidth=1.2, alpha=0.9)
            if step - named < gap:
                continue
            named = step
            axes.text(
                step,
                1.0,
                f" {kind}",
                transform=axes.get_xaxis_transform(),
                rotation=90,
                va="top",
                ha="left",
                fontsize="x-small",
                color=color,
            )


def render_png(
    runs: Sequence[RunCurves],
    title: str | None = None,
    alerts: Sequence[RunAlerts] | None = None,
) -> bytes:
    """The curves of ``runs`` as PNG bytes (:func:`draw`; an empty frame saying so when there
    are none)."""
    import io

    buffer = io.BytesIO()
    draw(runs, title, alerts).savefig(buffer, format="png")
    return buffer.getvalue()


def write_png(
    runs: Sequence[RunCurves],
    path: str | os.PathLike[str],
    title: str | None = None,
    alerts: Sequence[RunAlerts] | None = None,
) -> Path:
    """Draw ``runs`` (and their ``alerts``) into the PNG file ``path``, replaced whole (a
    viewer never sees half a file). Returns the path."""
    _require_matplotlib()
    return replace_file(path, render_png(runs, title, alerts))


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


def alerts_from_store(store: Store, refs: Sequence[int | str]) -> list[list[tuple[int, str]]]:
    """Each run's alerts in ``store`` as ``(step, kind)``, for :func:`draw`'s marks."""
    out = []
    for ref in refs:
        run = store.run(ref)
        marks = []
        for event in store.events(run.id):
            if event.get("kind") == "alert" and event.get("step") is not None:
                data = event.get("data") or {}
                marks.append((int(event["step"]), str(data.get("kind", "alert"))))
        out.append(marks)
    return out
