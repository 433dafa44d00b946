"""What AnomalyMonitor's looks at the run cost a hand-written loop, measured inside each run.

AnomalyMonitor has no step hook: it wakes on the run's step clock (the loss tap) every 128
steps on a CPU run, to read the batch of losses and measure the gradients. Whole-run timings
on this machine drift by more than that cost, so this script measures it within one run:
every step of ``watch`` + the monitor is timed, the steps are grouped by their position in
the 128-step cycle, and the cost is the sum over the positions of (the position's median step
time - the median over all positions), i.e. the wake and the slower steps after it, spread
over the cycle. A run's drift moves every position alike and cancels. What it leaves out: the
per-step ``run.step()`` (it moves every position alike; ``bench/interleaved.py`` row k has
it) and anything that slows every step.

Workload: ``bench/overhead.py``'s tiny MLP, SGD and CrossEntropyLoss on batches of 32, one CPU
thread. Configurations, run in turn, ``--rounds`` times each:

* ``raw`` - the loop alone: the floor (the positions' scatter, ~0).
* ``anomaly`` - ``watch`` with ``AnomalyMonitor()`` at its defaults (gradients every 128 steps).
* ``anomaly, grads/64`` - ``AnomalyMonitor(grad_every_n_steps=64)``, the default before it.
* ``j's monitors`` - ``RunRecorder(every_n_steps=1)``, ``AnomalyMonitor()`` and ``ProgressBar``.

Usage::

    python bench/wake_cost.py                # 3 rounds of 25,600 steps each
    python bench/wake_cost.py --rounds 5 --cycles 100
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from overhead import LR, make_mlp, make_workload
from torch import nn

import stepwatch

PERIOD = 128  # the monitor's cycle on a CPU run
Maker = Callable[[str, Any], list[Any]] | None


def configurations() -> dict[str, Maker]:
    def recorder(folder: str) -> Any:
        return stepwatch.RunRecorder(
            db=os.path.join(folder, f"{time.perf_counter_ns()}.db"), every_n_steps=1
        )

    return {
        "raw": None,
        "anomaly": lambda folder, sink: [stepwatch.AnomalyMonitor()],
        "anomaly, grads/64": lambda folder, sink: [stepwatch.AnomalyMonitor(grad_every_n_steps=64)],
        "j's monitors": lambda folder, sink: [
            recorder(folder),
            stepwatch.AnomalyMonitor(),
            stepwatch.ProgressBar(file=sink),
        ],
    }


def one_run(make: Maker, cycles: int, folder: str, sink: Any) -> tuple[float, float]:
    """(the quiet median step in us, the wake's cost in us per cycle) of one run; the first
    20 cycles (the detectors' warm-up) are left out."""
    steps = cycles * PERIOD
    batches = make_workload(2000).batches
    net = make_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    run = None
    if make is not None:
        run = stepwatch.watch(net, opt, make(folder, sink), epochs=1, steps_per_epoch=steps)
    marks = [0] * (steps + 1)
    clock = time.perf_counter_ns
    with run if run is not None else contextlib.nullcontext():
        marks[0] = clock()
        for i, (x, y) in enumerate(itertools.islice(itertools.cycle(batches), steps)):
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            if run is not None:
                run.step(loss)
            marks[i + 1] = clock()
        if run is not None:
            run.epoch_end()
    skip = 20 * PERIOD
    by_position: list[list[int]] = [[] for _ in range(PERIOD)]
    for i in range(skip, steps):
        by_position[(i + 1) % PERIOD].append(marks[i + 1] - marks[i])  # step i + 1
    medians = [statistics.median(p) / 1e3 for p in by_position]
    quiet = statistics.median(medians)
    return quiet, sum(m - quiet for m in medians)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("--cycles", type=int, default=200, help="128-step cycles a run (200)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.cycles < 30:
        parser.error("--rounds must be >= 1 and --cycles >= 30 (the first 20 are left out)")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    logging.getLogger("stepwatch").setLevel(logging.ERROR)  # the random labels do not learn
    configs = configurations()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    print(f"wake_cost: {args.rounds} rounds x {args.cycles} cycles of {PERIOD} steps, torch "
          f"{torch.__version__}, 1 thread", flush=True)  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as folder,
        open(os.devnull, "w") as sink,
        contextlib.redirect_stdout(sink),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        for index in range(args.rounds):
            for name, make in configs.items():
                results[name].append(one_run(make, args.cycles, folder, sink))
            print(f"  round {index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'config':<20} {'quiet step us':>15} {'wake us/cycle (each round)':>30} "
          f"{'us/step':>8}")  # fmt: skip
    print("-" * 77)
    for name, runs in results.items():
        quiet = statistics.median(q for q, _ in runs)
        each = " ".join(f"{c:.0f}" for _, c in runs)
        per_step = statistics.median(c for _, c in runs) / PERIOD
        print(f"{name:<20} {quiet:>15.1f} {each:>30} {per_step:>8.2f}")


if __name__ == "__main__":
    main()
