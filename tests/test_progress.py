"""ProgressBar: a bar on a terminal (checked in a pseudo-terminal), plain lines in a pipe."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from stepwatch import LossMonitor, ProgressBar
from stepwatch.train.callback import _print

from .conftest import make_batches, make_model

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
from tests.conftest import make_batches, make_model
from stepwatch import LossMonitor, ProgressBar, TimeMonitor
model = make_model(metrics={"accuracy"})
batches = make_batches(n_batches=8)
model.fit(3, batches, make_batches(n_batches=2, seed=1),
          callbacks=[ProgressBar(refresh_seconds=0.01), LossMonitor(4), TimeMonitor()])
print("done", flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env["COLUMNS"] = "150"
    return env


def test_args_validation() -> None:
    with pytest.raises(TypeError, match="'file' must be a text stream"):
        ProgressBar(file="out.txt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'refresh_seconds' must be positive"):
        ProgressBar(refresh_seconds=0)
    with pytest.raises(ValueError, match="plain_every_seconds"):
        ProgressBar(plain_every_seconds=-1)
    with pytest.raises(TypeError, match="refresh_seconds"):
        ProgressBar(refresh_seconds="1")  # type: ignore[arg-type]


def test_bar_in_a_pseudo_terminal_keeps_monitor_lines_whole() -> None:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdout=slave,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 100
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        stderr = proc.communicate(timeout=30)[1].decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    out = b"".join(chunks).decode().replace("\r\n", "\n")
    assert "\r" in out  # redrawn in place
    assert re.search(r"epoch 3/3: 100%.*24/24 .*step/s.*step 8/8, loss=\d", out), out
    assert "validate" in out
    # Each monitor line is printed whole, on a line of its own, above the bar.
    lines = re.findall(r"(?:^|\r)(epoch: \d step: \d, loss is [0-9.e-]+)\n", out, re.M)
    assert len(lines) == 6, out
    assert len(re.findall(r"Train epoch time: [0-9.]+ ms, per step time", out)) == 3
    assert out.rstrip().endswith("done")


def test_plain_lines_in_a_pipe() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stdout and "\x1b" not in done.stdout
    progress = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(progress) == 3, done.stdout  # one per epoch, nothing more
    assert re.fullmatch(
        r"epoch 3/3 step 8/8, loss [0-9.]+, eval_accuracy [0-9.]+, eval_loss [0-9.]+, "
        r"[0-9.]+ steps/s, ETA 00:00",
        progress[-1],
    ), progress
    assert sum(line.startswith("epoch: ") for line in done.stdout.splitlines()) == 6


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loss_is_read_only_when_the_bar_redraws() -> None:
    screen = _Terminal()
    model = make_model()
    batches = make_batches(n_batches=500)
    model.train(2, batches, callbacks=[ProgressBar(file=screen, refresh_seconds=60)])
    drawn = screen.getvalue()
    # 1,000 steps, and the bar drawn only at its start, at each epoch end and when closing.
    assert 1 <= drawn.count("loss=") <= 5, drawn
    assert "1000/1000" in drawn
    assert _print._writer is None  # the print route is restored


def test_monitor_lines_go_through_the_active_bar(capsys: pytest.CaptureFixture[str]) -> None:
    screen = _Terminal()
    model = make_model()
    model.train(1, make_batches(n_batches=4), callbacks=[ProgressBar(file=screen), LossMonitor(2)])
    printed = capsys.readouterr().out
    assert re.findall(r"epoch: 1 step: \d, loss is", printed) == [
        "epoch: 1 step: 2, loss is",
        "epoch: 1 step: 4, loss is",
    ]
    assert "4/4" in screen.getvalue()


def test_plain_lines_inside_a_long_epoch_are_time_throttled() -> None:
    sink = io.StringIO()
    model = make_model()
    model.train(1, make_batches(n_batches=50), callbacks=[ProgressBar(file=sink)])
    lines = sink.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epoch 1/1 step 50/50, loss ")
    sink = io.StringIO()
    model.train(
        1, make_batches(n_batches=50), callbacks=[ProgressBar(file=sink, plain_every_seconds=1e-9)]
    )
    assert 2 <= len(sink.getvalue().splitlines()) <= 50


def test_a_long_postfix_leaves_the_bar_room_and_drops_whole_items() -> None:
    import io
    import re

    from stepwatch.train.callback.progress import _MIN_BAR, _Bar

    def describe() -> str:
        return "step 1000/1250, loss=0.1234, eval_loss=0.2345, eval_accuracy=0.9812"

    buf = io.StringIO()
    bar = _Bar(total=4000, initial=1000, desc="epoch 3/10", unit="step", file=buf, ncols=120,
               describe=describe)  # fmt: skip
    bar.update(5)
    bar.refresh()
    line = buf.getvalue().split("\r")[-1]
    bar.close()
    assert len(line) <= 120
    cells = re.search(r"\|(.*?)\|", line)
    assert cells is not None and len(cells.group(1)) >= _MIN_BAR
    assert line.rstrip("]").endswith(("loss=0.1234", "eval_loss=0.2345", "eval_accuracy=0.9812"))
