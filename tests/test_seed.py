"""The seed article's code runs on stepwatch with only its imports changed."""

from __future__ import annotations

import importlib.util
import queue
import re
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from stepwatch import Callback, RunContext

from .conftest import make_batches, make_model, wait_until

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "seed_callbacks.py"


@pytest.fixture(scope="module")
def seed() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seed_callbacks", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["seed_callbacks"] = module
    spec.loader.exec_module(module)
    return module


def test_seed_monitors_all_work_in_one_run(
    seed: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    monitors = seed.main(epoch_size=3)
    out = capsys.readouterr().out
    # §2.2 LossMonitor(per_print_times=10): MindSpore-format lines every 10 global steps.
    assert re.search(r"^epoch: 1 step: 10, loss is [\d.]+", out, re.M)
    # §3.1 every step's loss kept, and the 50-step print.
    assert len(monitors["custom"].losses) == 300
    assert re.search(r"^Step 50, loss: [\d.]+$", out, re.M)
    # §3.2 loss and accuracy every epoch (MindSpore itself crashes here with KeyError).
    assert len(monitors["multi_metric"].metrics["loss"]) == 3
    assert monitors["multi_metric"].metrics["accuracy"][-1] > 0.9
    assert re.search(r"^Epoch 3, accuracy: [\d.]+$", out, re.M)
    # §4.2 rank 0 prints every 100 steps (MindSpore has no rank_id).
    assert re.search(r"^Step 100, loss: [\d.]+$", out, re.M)
    # §5.1 the sync check turns net_outputs into NumPy.
    assert type(monitors["sync_check"].last_loss).__module__ == "numpy"
    # §6.2 one sample every 10 steps.
    assert monitors["sampling"].samples == list(range(10, 301, 10))
    # §6.3 alerts fire while the loss is high.
    assert "Alert! High loss detected:" in out


def test_seed_visual_monitor_draws_headless(seed: ModuleType) -> None:
    visual = seed.VisualMonitor()
    with warnings.catch_warnings():
        # Agg cannot open a window; plt.pause says so, which is the point of running headless.
        warnings.filterwarnings("ignore", message=".*non-interactive.*")
        make_model().train(1, make_batches(3), callbacks=[visual])
    seed.plt.close(visual.fig)


def test_seed_memory_safe_monitor_keeps_at_most_max_records(seed: ModuleType) -> None:
    monitor = seed.MemorySafeMonitor(max_records=5)
    for i in range(12):
        monitor.add_data(i)
    assert monitor._data == [7, 8, 9, 10, 11]


def test_callback_not_registered_and_class_mistakes_are_clear(seed: ModuleType) -> None:
    with pytest.raises(TypeError, match="class CustomMonitor, not an instance"):
        make_model().train(1, make_batches(1), callbacks=[seed.CustomMonitor])


class QueueLogger(Callback):
    """The intent of the seed's AsyncMonitor, done right: a bounded queue, a worker that
    blocks instead of spinning, and a sentinel so the process can exit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.queue: queue.Queue[str | None] = queue.Queue(maxsize=1000)
        self.worker = threading.Thread(target=self._work, daemon=True)

    def __enter__(self) -> QueueLogger:
        self.worker.start()
        return self

    def __exit__(self, *err: Any) -> None:
        self.queue.put(None)
        self.worker.join(timeout=5)

    def _work(self) -> None:
        with open(self.path, "a") as f:
            while (line := self.queue.get()) is not None:
                f.write(line)

    def step_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        self.queue.put(f"{p.cur_step_num}\n")


def test_async_logging_intent_writes_every_step_and_exits(tmp_path: Path) -> None:
    logger = QueueLogger(tmp_path / "log.txt")
    make_model().train(2, make_batches(5), callbacks=[logger])
    wait_until(lambda: not logger.worker.is_alive())
    assert (tmp_path / "log.txt").read_text().split() == [str(i) for i in range(1, 11)]
