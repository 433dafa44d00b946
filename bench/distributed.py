"""Steps/s of data-parallel training on 2 CPU processes (gloo): stepwatch against a raw DDP loop.

Workload: the MLP of ``bench/overhead.py`` (Linear(32, 64) - ReLU - Linear(64, 10)), SGD and
CrossEntropyLoss, ``--steps`` batches of 32 rows per rank and epoch (each rank its own rows),
one intra-op thread per process. Every step all-reduces the gradients over gloo, which costs far
more than the step itself: what stepwatch adds per step is measured against a loop that already
pays for one collective per step.

Configurations (both ranks run them in the same order, in lockstep):

* ``a raw DDP`` - ``DistributedDataParallel(model)``; ``opt.zero_grad(); loss_fn(ddp(x),
  y).backward(); opt.step()``; paired with another raw DDP loop on another model instance, its
  ratio is the noise floor.
* ``b stepwatch`` - ``Model(...).train(1, batches, callbacks=[LossMonitor(100), TimeMonitor(),
  History(), RunRecorder(), DistributedMonitor(100)])`` on its own model instance (the Model
  wraps it in DDP itself), timed from the first epoch-begin hook to the last epoch-end hook, so
  the per-call setup (opening a run in the store) is left out. LossMonitor reduces its loss
  across the ranks every 100 steps, DistributedMonitor gathers its row every 100 steps, and
  RunRecorder records every step's loss on rank 0.

Method: in every round each configuration runs one epoch paired with a raw epoch (raw first in
even rounds, second in odd ones); the round's score is ``(its steps/s) / (the paired raw
steps/s)``. Round 0 is a warm-up. Rank 0 prints medians over the rounds (min..max too);
standard output is sent to ``os.devnull`` during the timed epochs.

Usage::

    python bench/distributed.py                 # 15 rounds of 1000 steps
    python bench/distributed.py --quick         # 2 rounds of 200 steps: a smoke check
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stepwatch
from _ranks import run_ranks  # bench/_ranks.py (the script's folder)
from stepwatch.distributed import shutdown

BATCH_SIZE = 32
IN_FEATURES = 32
HIDDEN = 64
CLASSES = 10
LR = 0.01
GOAL = 0.95

Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(steps: int, rank: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(100 + rank)
    n = steps * BATCH_SIZE
    x = torch.randn(n, IN_FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    return [(x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]) for i in range(0, n, BATCH_SIZE)]


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def raw_runner(batches: list[Batch], seed: int) -> Callable[[], float]:
    model = make_mlp(seed)
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def run() -> float:
        ddp.train()
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
        return time.perf_counter() - start

    return run


class _Clock(stepwatch.Callback):
    """Times the epoch: started before every other callback's epoch-begin hook (order -1000)
    and stopped by ``_Stop`` after every other callback's epoch-end hook."""

    order = -1000

    def __init__(self) -> None:
        self.start = self.stopped = 0.0

    def on_train_epoch_begin(self, run_context: Any) -> None:
        self.start = time.perf_counter()


class _Stop(stepwatch.Callback):
    order = 1000

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def on_train_epoch_end(self, run_context: Any) -> None:
        self.clock.stopped = time.perf_counter()


def stepwatch_runner(batches: list[Batch], db: Path) -> Callable[[], float]:
    net = make_mlp(1)
    model = stepwatch.Model(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=LR), device="cpu"
    )

    def run() -> float:
        clock = _Clock()
        callbacks = [
            clock,
            stepwatch.LossMonitor(100),
            stepwatch.TimeMonitor(),
            stepwatch.History(),
            stepwatch.RunRecorder(db=db),
            stepwatch.DistributedMonitor(every_n_steps=100),
            _Stop(clock),
        ]
        model.train(1, batches, callbacks=callbacks)
        return clock.stopped - clock.start

    return run


def quiet(run: Callable[[], float]) -> float:
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        return run()


def worker(rounds: int, steps: int, db: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        batches = make_batches(steps, rank)
        raw = raw_runner(batches, 0)
        configs = {
            "a raw DDP": raw_runner(batches, 2),
            "b stepwatch": stepwatch_runner(batches, db),
        }
        ratios: dict[str, list[float]] = {name: [] for name in configs}
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for round_index in range(rounds + 1):
            for name, run in configs.items():
                gc.collect()
                if round_index % 2:
                    t_config, t_raw = quiet(run), quiet(raw)
                else:
                    t_raw = quiet(raw)
                    t_config = quiet(run)
                if round_index:
                    ratios[name].append(t_raw / t_config)
                    rates[name].append(steps / t_config)
            if rank == 0:
                label = "warm-up" if round_index == 0 else f"round {round_index}/{rounds}"
                print(f"  {label} done", file=sys.stderr, flush=True)
        if rank == 0:
            report(ratios, rates)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    shutdown()  # every rank leaves together


def report(ratios: dict[str, list[float]], rates: dict[str, list[float]]) -> None:
    header = f"{'config':<14} {'steps/s':>9} {'ratio to raw DDP (min..max)':>30}"
    print(header)
    print("-" * len(header))
    for name, values in ratios.items():
        ratio = statistics.median(values)
        spread = f"{ratio:.3f} ({min(values):.3f}..{max(values):.3f})"
        print(f"{name:<14} {statistics.median(rates[name]):>9.0f} {spread:>30}")
    print()
    floor = statistics.median(ratios["a raw DDP"])
    ratio = statistics.median(ratios["b stepwatch"])
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(f"goal b/a >= {GOAL:.2f}: median {ratio:.3f} (noise floor a/a {floor:.3f}) -> {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds (default 15)")
    parser.add_argument("--steps", type=int, default=1000, help="steps per epoch (default 1000)")
    parser.add_argument("--quick", action="store_true", help="rounds=2, steps=200: smoke check")
    parser.add_argument("--db", help=argparse.SUPPRESS)  # set for the two worker processes
    args = parser.parse_args(argv)
    rounds, steps = (2, 200) if args.quick else (args.rounds, args.steps)
    if rounds < 1 or steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.db:
        worker(rounds, steps, Path(args.db))
        return 0
    print(
        f"distributed: 2 processes (gloo, CPU), {rounds} rounds (+1 warm-up) x {steps} steps "
        f"of batch {BATCH_SIZE} per rank, torch {torch.__version__}, 1 thread per process, "
        f"python {sys.version.split()[0]}",
        flush=True,
    )
    return run_ranks(__file__, ["--rounds", str(rounds), "--steps", str(steps)])


if __name__ == "__main__":
    sys.exit(main())
