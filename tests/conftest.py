"""Shared fixtures: small seeded data and models, a hook recorder, and wait_until()."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stepwatch import Callback, Model
from stepwatch.train.callback._callback import HOOKS


def make_batches(
    n_batches: int = 4, batch_size: int = 8, features: int = 4, classes: int = 3, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A list of (x, y) batches of a learnable classification problem."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch_size, features, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    y = y.clamp(max=classes - 1)
    return [
        (x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size])
        for i in range(n_batches)
    ]


def make_model(metrics: Any = None, lr: float = 0.1, seed: int = 0, **kwargs: Any) -> Model:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    kwargs.setdefault("device", "cpu")
    return Model(net, nn.CrossEntropyLoss(), opt, metrics=metrics, **kwargs)


class Recorder(Callback):
    """Records every hook call as (hook, mode, epoch, step), plus enter/exit."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __enter__(self) -> Recorder:
        self.calls.append(("enter",))
        return self

    def __exit__(self, *err: Any) -> None:
        self.calls.append(("exit", err[0]))

    def hooks(self) -> list[str]:
        return [c[0] for c in self.calls]


def _recording_hook(hook: str) -> Callable[[Recorder, Any], None]:
    def record(self: Recorder, run_context: Any) -> None:
        p = run_context.original_args()
        self.calls.append((hook, p.mode, p.cur_epoch_num, p.cur_step_num))

    return record


for _hook in HOOKS:
    setattr(Recorder, _hook, _recording_hook(_hook))


@pytest.fixture(autouse=True, scope="session")
def _spool_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A run whose team store is away as it starts is recorded into a local spool file
    (``$STEPWATCH_SPOOL``): in the tests, never into the checkout."""
    patch = pytest.MonkeyPatch()
    patch.setenv("STEPWATCH_SPOOL", str(tmp_path_factory.mktemp("spool") / "spool.db"))
    yield
    patch.undo()


def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01
) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(interval)


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m stepwatch ARGS`` as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "stepwatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )
