"""What the system sampler costs the training loop: RunRecorder with and without it.

Workload: ``bench/overhead.py``'s tiny MLP under ``Model.train`` with
``RunRecorder(every_n_steps=1)``, one thread. Each round runs one epoch of every pair back to
back (the order alternates): the recorder with ``system_every=None`` (no sampler) against

* ``no sampler'`` - the same again: its ratio is the noise floor;
* ``sampler at 10 s`` - the default (an epoch here is shorter than 10 s, so it shows what
  merely having the sampler costs);
* ``sampler at 0.02 s`` - 500 times the default rate, so that 20+ samples land inside every
  timed epoch and their cost, if any, shows.

Each epoch is timed from stepwatch's own epoch hooks (set-up and the writer's close left
out). Round 0 is a warm-up; the table gives the median ratio ``t_off / t_on`` (min..max) and
the median extra time per step.

Usage::

    python bench/system_sampler.py              # 12 rounds of 2000 steps
    python bench/system_sampler.py --quick      # 2 rounds of 300 steps
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead

import stepwatch

Variant = tuple[str, float | None]
VARIANTS: list[Variant] = [
    ("no sampler'", None),
    ("sampler at 10 s", 10.0),
    ("sampler at 0.02 s", 0.02),
]


def runner(work: overhead.Workload, folder: str, every: float | None) -> Callable[[], float]:
    model = overhead.stepwatch_model(work)

    def run() -> float:
        timer = overhead._StepwatchEpochTimer()
        db = os.path.join(folder, f"bench-{time.perf_counter_ns()}.db")
        recorder = stepwatch.RunRecorder(db=db, every_n_steps=1, system_every=every)
        model.train(1, work.batches, callbacks=[recorder, timer])
        return timer.seconds

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 300 steps")
    args = parser.parse_args(argv)
    rounds, steps = (2, 300) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    work = overhead.make_workload(steps)
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as folder:
        off = runner(work, folder, None)
        runs = {name: runner(work, folder, every) for name, every in VARIANTS}
        ratios: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
        extra: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
        for index in range(rounds + 1):
            for name, _ in VARIANTS:
                gc.collect()
                if index % 2:
                    t_on, t_off = runs[name](), off()
                else:
                    t_off, t_on = off(), runs[name]()
                if index:
                    ratios[name].append(t_off / t_on)
                    extra[name].append((t_on - t_off) / steps * 1e6)
            print(f"  round {index}/{rounds} done", file=sys.stderr, flush=True)
    print(f"\n{steps} steps per epoch, {rounds} rounds (+1 warm-up), torch {torch.__version__}")
    print(f"{'variant':<20} {'ratio to no sampler (min..max)':>32} {'extra us/step':>14}")
    for name, _ in VARIANTS:
        r = ratios[name]
        spread = f"{statistics.median(r):.3f} ({min(r):.3f}..{max(r):.3f})"
        print(f"{name:<20} {spread:>32} {statistics.median(extra[name]):>14.2f}")


if __name__ == "__main__":
    main()
