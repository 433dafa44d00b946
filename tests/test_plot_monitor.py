"""PlotMonitor and ``stepwatch plot``: curves drawn into PNG files with no display."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from stepwatch import PlotMonitor, RunRecorder
from stepwatch.cli import main
from stepwatch.plotting import panel_of
from stepwatch.train.callback.plot_monitor import _Series

from .conftest import make_batches, make_model

PNG = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_args_validation(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'path' must be a file name"):
        PlotMonitor(path=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a folder"):
        PlotMonitor(path=tmp_path)
    with pytest.raises(ValueError, match="every_n_seconds"):
        PlotMonitor(every_n_seconds=-1)
    with pytest.raises(ValueError, match="max_points"):
        PlotMonitor(max_points=1)


def test_writes_a_png_headless_at_train_end(tmp_path: Path) -> None:
    out = tmp_path / "curves.png"
    model = make_model(metrics={"accuracy"})
    monitor = PlotMonitor(out, every_n_seconds=0)
    model.fit(3, make_batches(n_batches=6), make_batches(n_batches=2, seed=1), callbacks=[monitor])
    width, height = _png_size(out)
    assert width > 500 and height > 200
    assert monitor.drawn == 1
    assert monitor._thread is None  # the drawing thread has ended
    keys = set(monitor._series)
    assert {"step_loss", "loss", "eval_loss", "train_accuracy", "eval_accuracy", "lr"} <= keys
    assert monitor._series["step_loss"].steps == list(range(1, 19))


def test_draws_during_training_without_a_display(tmp_path: Path) -> None:
    # After the first epoch, training waits (up to 60 s) for the drawing thread: a picture
    # drawn while training runs, whatever the machine's load; then the last one at the end.
    out = tmp_path / "live.png"
    code = (
        "import time, matplotlib\n"
        "from tests.conftest import make_batches, make_model\n"
        "from stepwatch import Callback, PlotMonitor\n"
        f"monitor = PlotMonitor({str(out)!r}, every_n_seconds=1e-6)\n"
        "class Waiter(Callback):\n"
        "    during = -1\n"
        "    def on_train_epoch_end(self, run_context):\n"
        "        if run_context.cb_params.cur_epoch_num != 1:\n"
        "            return\n"
        "        deadline = time.monotonic() + 60\n"
        "        while monitor.drawn < 1 and time.monotonic() < deadline:\n"
        "            time.sleep(0.01)\n"
        "        Waiter.during = monitor.drawn\n"
        "make_model().train(2, make_batches(n_batches=20), callbacks=[monitor, Waiter()])\n"
        "print(Waiter.during, monitor.drawn, matplotlib.get_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    during, drawn, backend = done.stdout.split()
    assert int(during) >= 1  # a picture while training ran (in its second epoch)
    assert int(drawn) >= int(during) + 1  # and the last one, at the end
    assert backend.lower() == "agg"
    assert _png_size(out)[0] > 100


def test_a_drawing_failure_never_stops_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "pictures"
    folder.mkdir()
    monitor = PlotMonitor(folder / "curves.png", every_n_seconds=0)
    folder.rmdir()
    folder.write_text("")  # the folder became a file after the check: every write now fails
    with caplog.at_level(logging.WARNING):
        make_model().train(1, make_batches(n_batches=3), callbacks=[monitor])
    assert monitor.drawn == 0
    assert "PlotMonitor stopped drawing" in caplog.text


def test_series_stay_bounded_and_keep_a_spike() -> None:
    series = _Series(limit=100)
    for start in range(0, 10_000, 50):
        steps = list(range(start, start + 50))
        series.extend(steps, [1000.0 if s == 7_777 else 1.0 for s in steps])
    assert len(series.steps) <= 200
    assert series.steps == sorted(series.steps)
    assert 7_777 in series.steps


def test_panels_pair_train_and_validation() -> None:
    assert panel_of("eval_loss") == panel_of("step_loss") == panel_of("loss") == "loss"
    assert panel_of("eval_accuracy") == panel_of("train_accuracy") == "accuracy"
    assert panel_of("eval_precision/3") == "precision"
    assert panel_of("lr") == "learning rate"


def test_plot_command_overlays_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "runs.db"
    for seed in (0, 1):
        model = make_model(metrics={"accuracy"}, seed=seed)
        recorder = RunRecorder(db=db, run_name=f"seed{seed}")
        model.fit(2, make_batches(n_batches=4), make_batches(2, seed=3), callbacks=[recorder])
    out = tmp_path / "both.png"
    assert main(["plot", "1", "seed1", "--out", str(out), "--db", str(db)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert _png_size(out)[0] > 500
    assert main(["plot", "7", "--out", str(out), "--db", str(db)]) == 2
    assert "no run '7'" in capsys.readouterr().err


def test_plot_command_notes_charts_left_out_and_refuses_bad_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stepwatch import RunWriter

    db = tmp_path / "runs.db"
    writer = RunWriter(db, name="many")
    for i in range(12):
        writer.log(f"metric_{i:02d}", float(i), 1)
    writer.close()
    out = tmp_path / "many.png"
    assert main(["plot", "1", "--out", str(out), "--db", str(db)]) == 0
    err = capsys.readouterr().err
    assert "note: drew 9 of 12 charts" in err and "left out: metric_09, metric_10, metric_11" in err
    assert main(["plot", "1", "--out", str(tmp_path / "x.jpg"), "--db", str(db)]) == 2
    assert "must name a PNG file" in capsys.readouterr().err
    missing = tmp_path / "nowhere" / "x.png"
    assert main(["plot", "1", "--out", str(missing), "--db", str(db)]) == 2
    assert "does not exist" in capsys.readouterr().err and not missing.parent.exists()


def test_a_path_that_cannot_be_written_is_refused_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be written"):
        PlotMonitor(blocker / "curves.png")


def _bbox(artist: object, figure: object) -> object:
    return artist.get_window_extent(figure.canvas.get_renderer())  # type: ignore[attr-defined]


def test_pngs_pick_log_y_keep_the_legend_off_the_data_and_mark_alerts() -> None:
    from stepwatch.plotting import draw, y_scale

    steps = list(range(1, 201))
    spiky = [1.0 / s for s in steps]  # 1 .. 0.005: a loss that falls over decades
    spiky[120] = 400.0
    runs = [
        ("1:base", {"step_loss": (steps, spiky), "eval_loss": ([100, 200], [0.02, 0.01])}),
        ("2:other", {"step_loss": (steps, [0.5] * 200), "lr": ([1, 200], [0.1, 0.1])}),
    ]
    figure = draw(runs, alerts=[[(121, "spike")], []])
    loss, lr = figure.axes
    assert (loss.get_title(), lr.get_title()) == ("loss", "learning rate")
    # The loss spans five decades: log y; the flat learning rate stays linear.
    assert loss.get_yscale() == "log" and lr.get_yscale() == "linear"
    assert y_scale([[0.0, 5.0, 1e4]]) == "linear"  # a zero has no logarithm
    # One legend entry per run (its colour), then one per key (its line style): 4, not 2 x 2.
    legend = loss.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "1:base", "2:other", "eval_loss", "step_loss",
    ]  # fmt: skip
    figure.canvas.draw()
    # The legend sits beside the chart, not over its data.
    assert _bbox(legend, figure).x0 >= _bbox(loss, figure).x1  # type: ignore[attr-defined]
    # The alert is a dotted line at its step, named at the top of the chart.
    marks = [line for line in loss.get_lines() if line.get_linestyle() == ":"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [121, 121]
    assert "spike" in [t.get_text().strip() for t in loss.texts]


def test_pngs_name_the_charts_they_left_out() -> None:
    from stepwatch.plotting import MAX_PANELS, draw

    curves = {f"metric_{i:02d}": ([1, 2], [float(i), float(i) + 1]) for i in range(12)}
    figure = draw([("1:many", curves)])
    assert len(figure.axes) == MAX_PANELS
    (note,) = figure.texts
    assert note.get_text() == (
        "3 more charts not drawn: metric_09, metric_10, metric_11 (stepwatch serve shows them all)"
    )


def test_the_plot_command_marks_the_runs_alerts(tmp_path: Path) -> None:
    from stepwatch import RunWriter
    from stepwatch.plotting import alerts_from_store, curves_from_store
    from stepwatch.store import Store

    db = tmp_path / "runs.db"
    writer = RunWriter(db, name="alerted")
    for step in range(1, 40):
        writer.log("step_loss", 1.0 if step != 20 else 50.0, step)
    writer.event("alert", "loss jumped to 50", 20, 1, level="warning", data={"kind": "spike"})
    writer.close()
    with Store(db) as store:
        assert alerts_from_store(store, ["alerted"]) == [[(20, "spike")]]
        assert curves_from_store(store, ["alerted"])[0][1]["step_loss"][0][19] == 20
    out = tmp_path / "alerted.png"
    assert main(["plot", "alerted", "--out", str(out), "--db", str(db)]) == 0
    assert _png_size(out)[0] > 500
