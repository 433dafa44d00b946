"""The training step's options against hand-written loops doing the same thing.

Workload and method as ``bench/overhead.py``: a tiny MLP (Linear(32, 64) - ReLU -
Linear(64, 10)), SGD(lr=0.01), CrossEntropyLoss, batches of 32 on the CPU with one thread, so
whatever the loop adds per step shows in full. Each configuration pairs one epoch of
stepwatch's ``Model.train`` with one epoch of a hand-written loop doing the same work on the
very same network and optimizer, interleaved (which runs first alternates per round); its
score per round is ``(stepwatch steps/s) / (hand-written steps/s)``. Round 0 is a warm-up.
The table gives medians (and min..max) over the other rounds.

Configurations (stepwatch | the hand-written loop):

* ``noise floor`` - a hand-written plain loop | another one: the ratio the machine's noise
  alone gives.
* ``amp bf16`` - ``Model(amp_level="O2")`` (on the CPU: bfloat16 autocast) |
  ``with torch.autocast("cpu", dtype=torch.bfloat16)`` around forward and loss.
* ``clip norm`` - ``Model(clip_grad_norm=1.0)`` | ``clip_grad_norm_(params, 1.0,
  foreach=True)`` before each step.
* ``accumulate 4`` - ``Model(accumulate_grad_batches=4)`` | the loss divided by 4, gradients
  zeroed and the optimizer stepped every 4 batches.

Goal: ratio >= 0.95 for each.

Usage::

    python bench/step_overhead.py              # 10 rounds of 2000 steps (plus a warm-up)
    python bench/step_overhead.py --quick      # 2 rounds of 300 steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import stepwatch

BATCH_SIZE, IN_FEATURES, HIDDEN, CLASSES, LR, SEED = 32, 32, 64, 10, 0.01, 0
GOAL = 0.95
Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(steps: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(SEED)
    n = steps * BATCH_SIZE
    x = torch.randn(n, IN_FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    return [(x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]) for i in range(0, n, BATCH_SIZE)]


def make_model(**options: Any) -> stepwatch.Model:
    torch.manual_seed(SEED)
    net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    return stepwatch.Model(net, nn.CrossEntropyLoss(), opt, device="cpu", **options)


def hand_written(model: stepwatch.Model, batches: list[Batch], kind: str) -> Callable[[], float]:
    """One epoch of the hand-written equivalent of ``kind`` on ``model``'s network/optimizer."""
    net, opt = model.train_network, model.optimizer
    assert opt is not None
    loss_fn = nn.CrossEntropyLoss()
    params = list(net.parameters())

    def plain() -> float:
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            opt.step()
        return time.perf_counter() - start

    def amp() -> float:
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
        return time.perf_counter() - start

    def clip() -> float:
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
        return time.perf_counter() - start

    def accumulate() -> float:
        start = time.perf_counter()
        for i, (x, y) in enumerate(batches):
            if i % 4 == 0:
                opt.zero_grad(set_to_none=True)
            (loss_fn(net(x), y) / 4).backward()
            if i % 4 == 3 or i == len(batches) - 1:
                opt.step()
        return time.perf_counter() - start

    runners = {"plain": plain, "amp": amp, "clip": clip, "accumulate": accumulate}
    return runners[kind]


def stepwatch_epoch(model: stepwatch.Model, batches: list[Batch]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        model.train(1, batches)
        return time.perf_counter() - start

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 300 steps")
    args = parser.parse_args(argv)
    rounds, steps = (2, 300) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    batches = make_batches(steps)

    floor_a, floor_b = make_model(), make_model()
    configs: dict[str, tuple[Callable[[], float], Callable[[], float]]] = {
        "noise floor": (
            hand_written(floor_a, batches, "plain"),
            hand_written(floor_b, batches, "plain"),
        ),
    }
    for name, options, kind in (
        ("amp bf16", {"amp_level": "O2"}, "amp"),
        ("clip norm", {"clip_grad_norm": 1.0}, "clip"),
        ("accumulate 4", {"accumulate_grad_batches": 4}, "accumulate"),
    ):
        model = make_model(**options)
        configs[name] = (stepwatch_epoch(model, batches), hand_written(model, batches, kind))

    ratios: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(rounds + 1):
        for name, (ours, theirs) in configs.items():
            if r % 2 == 0:
                t_ours, t_theirs = ours(), theirs()
            else:
                t_theirs, t_ours = theirs(), ours()
            if r:  # round 0 warms up
                ratios[name].append(t_theirs / t_ours)

    print(f"step options vs hand-written loops: {rounds} rounds of {steps} steps, 1 thread")
    print(f"{'configuration':<14} {'median ratio':>12}  {'min..max':>13}  goal")
    for name, values in ratios.items():
        median = statistics.median(values)
        goal = "-" if name == "noise floor" else ("met" if median >= GOAL else "NOT met")
        print(f"{name:<14} {median:>12.3f}  {min(values):.3f}..{max(values):.3f}  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
