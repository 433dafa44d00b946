"""No host sync on quiet steps, checked by CUDA itself, and the cost of the monitors on a GPU.

A GPU-bound MLP (4 x Linear(4096, 4096), batch 1024, data already on the device) trains with the
full monitor set - ``LossMonitor(100)``, ``TimeMonitor()``, ``History()`` and
``RunRecorder(every_n_steps=1)`` - under ``torch.cuda.set_sync_debug_mode("error")`` on every
step except LossMonitor's print steps and each epoch's last step (where the loop reads the
epoch's mean loss). Any hidden ``.item()``, ``float()`` or blocking copy on a quiet step raises.

Then it times epochs of the monitored ``Model.train`` against a raw loop without ``.item()``,
interleaved in one process, and prints the median ratio of steps/s (goal >= 0.99).

Where there is no CUDA device it says so and exits 0.

Usage::

    python bench/gpu_sync.py               # 300 steps per epoch, 5 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import stepwatch

WIDTH, DEPTH, BATCH, CLASSES = 4096, 4, 1024, 10


def make_net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers).to(device)


class SyncGuard(stepwatch.Callback):
    """Turns CUDA's sync check to "error" for each quiet step, off for the others."""

    order = -10_000  # its step-begin runs before every other callback's

    def __init__(self, print_every: int) -> None:
        self.print_every = print_every
        self.checked = 0

    def on_train_step_begin(self, run_context: stepwatch.RunContext) -> None:
        p = run_context.original_args()
        step_in_epoch = p.step_in_epoch
        loud = p.cur_step_num % self.print_every == 0 or step_in_epoch == p.batch_num
        torch.cuda.set_sync_debug_mode("default" if loud else "error")
        self.checked += not loud

    def on_train_epoch_end(self, run_context: stepwatch.RunContext) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def __exit__(self, *err: object) -> None:
        torch.cuda.set_sync_debug_mode("default")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per epoch (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_sync: skipped - no CUDA device here (torch.cuda.is_available() is False).")
        return 0
    device = torch.device("cuda")
    x = torch.randn(args.steps * BATCH, WIDTH, device=device)
    y = torch.randint(0, CLASSES, (args.steps * BATCH,), device=device)
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    folder = tempfile.TemporaryDirectory(prefix="stepwatch-gpubench-")
    db = os.path.join(folder.name, "gpu.db")

    def monitors() -> list[stepwatch.Callback]:
        return [
            stepwatch.LossMonitor(100),
            stepwatch.TimeMonitor(),
            stepwatch.History(),
            stepwatch.RunRecorder(db=db, every_n_steps=1),
        ]

    # 1. The sync check.
    net = make_net(device)
    model = stepwatch.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), 0.01))
    guard = SyncGuard(print_every=100)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        model.train(2, batches, callbacks=[guard, *monitors()])
    print(
        f"sync check: {guard.checked} quiet steps ran under set_sync_debug_mode('error'): "
        "no sync error"
    )

    # 2. Speed against a raw loop without .item().
    raw_net = make_net(device)
    raw_opt = torch.optim.SGD(raw_net.parameters(), 0.01)
    loss_fn = nn.CrossEntropyLoss()

    def raw_epoch() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for xb, yb in batches:
            raw_opt.zero_grad(set_to_none=True)
            loss_fn(raw_net(xb), yb).backward()
            raw_opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def monitored_epoch() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            model.train(1, batches, callbacks=monitors())
        torch.cuda.synchronize()
        return time.perf_counter() - start

    raw_epoch()
    monitored_epoch()
    ratios = []
    for i in range(args.rounds):
        if i % 2 == 0:
            t_raw = raw_epoch()
            t_monitored = monitored_epoch()
        else:
            t_monitored = monitored_epoch()
            t_raw = raw_epoch()
        ratios.append(t_raw / t_monitored)
    ratio = statistics.median(ratios)
    print(
        f"speed: monitored Model.train / raw loop (no .item()) steps/s = {ratio:.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {args.rounds} rounds "
        f"on {torch.cuda.get_device_name()}"
    )
    print(f"goal: ratio >= 0.99 -> {'met' if ratio >= 0.99 else 'NOT met'}")
    folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
