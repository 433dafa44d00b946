"""Steps/s of an FSDP2-sharded hand loop on 2 CPU processes (gloo): watched by stepwatch
(AnomalyMonitor + RunRecorder) against the same loop unwatched; and the collectives stepwatch
adds, counted.

Workload: a 4-layer MLP (Linear(256, 256) x 3 - ReLU between - Linear(256, 10)), each layer and
the root ``fully_shard``-ed over the 2 ranks, SGD and CrossEntropyLoss, ``--steps`` batches of
32 rows per rank, one intra-op thread per process. Every step all-gathers the parameters and
reduce-scatters the gradients (FSDP2's collectives).

Configurations (both ranks run them in the same order, in lockstep), each on its own sharded
network:

* ``a raw FSDP2`` - ``opt.zero_grad(); loss_fn(net(x), y).backward(); opt.step()``; paired with
  another raw loop on another network, its ratio is the noise floor.
* ``b watched`` - the same loop inside ``stepwatch.watch(net, opt, [AnomalyMonitor(),
  RunRecorder(db)])`` with ``run.step(loss)`` after each step: the loss detectors, the gradient
  statistics of the full model (shard-aware, one all_reduce per measurement) and every step's
  loss recorded on rank 0. Timed from the first step to the last (opening and closing the run
  left out).
* ``c watched, no gradient detectors`` - ``b`` with AnomalyMonitor's loss detectors only: the
  difference in collectives between ``b`` and ``c`` is what the gradient statistics add.

Method: in every round each configuration runs one epoch paired with a raw epoch (raw first in
even rounds, second in odd ones); the round's score is ``(its steps/s) / (the paired raw
steps/s)``. Round 0 is a warm-up. In the last round, rank 0 counts the collectives each
configuration issues through ``torch.distributed`` (all_reduce, all_gather, broadcast) over its
timed steps (FSDP2's own all-gathers and reduce-scatters go through other calls and are not
counted), the elements they carry and the wall time spent in them, and the training thread's
CPU time inside ``watched.step``: the in-process accounting of what stepwatch costs a step, which
a loaded machine hardly moves. Rank 0 prints medians over the rounds (min..max too).

Usage::

    python bench/distributed_fsdp.py              # 10 rounds of 500 steps
    python bench/distributed_fsdp.py --quick      # 2 rounds of 100 steps: a smoke check
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

import torch
import torch.distributed as dist
from torch import nn

import stepwatch
from _ranks import Counter, run_ranks  # bench/_ranks.py (the script's folder)
from stepwatch.distributed import shutdown

BATCH_SIZE = 32
WIDTH = 256
CLASSES = 10
LR = 0.1  # the labels are learnt within an epoch: a healthy run
GOAL = 0.95

Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(steps: int, rank: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(100 + rank)
    n = steps * BATCH_SIZE
    x = torch.randn(n, WIDTH, generator=generator)
    # Labels a network can learn (the same rule on every rank): a healthy run, with no alert.
    y = (x @ torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(0))).argmax(1)
    return [(x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]) for i in range(0, n, BATCH_SIZE)]


def make_sharded(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return net


def raw_runner(batches: list[Batch], seed: int) -> Callable[[], float]:
    net = make_sharded(seed)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def run() -> float:
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
        return time.perf_counter() - start

    return run


class Watched:
    """A watched epoch (callable: its wall seconds), with the training thread's CPU time spent
    inside ``watched.step`` and in the whole loop, of its last epoch."""

    def __init__(self, run: Callable[[], float]) -> None:
        self.run = run
        self.hook_cpu = self.loop_cpu = 0.0

    def __call__(self) -> float:
        return self.run()


def watched_runner(batches: list[Batch], db: Path, seed: int, grads: bool) -> Watched:
    net = make_sharded(seed)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    detectors = None if grads else ["nonfinite", "spike", "divergence", "plateau"]

    def run() -> float:
        monitor = (
            stepwatch.AnomalyMonitor()
            if detectors is None
            else stepwatch.AnomalyMonitor(detectors=detectors)
        )
        callbacks = [monitor, stepwatch.RunRecorder(db=db, system_every=None)]
        hook = 0.0
        with stepwatch.watch(net, opt, callbacks, steps_per_epoch=len(batches)) as watched:
            start, cpu = time.perf_counter(), time.thread_time()
            for x, y in batches:
                opt.zero_grad()
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()
                before = time.thread_time()
                watched.step(loss)
                hook += time.thread_time() - before
            seconds = time.perf_counter() - start
            measured.hook_cpu, measured.loop_cpu = hook, time.thread_time() - cpu
        return seconds

    measured = Watched(run)
    return measured


def quiet(run: Callable[[], float]) -> float:
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        return run()


def worker(rounds: int, steps: int, db: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    counter = Counter()
    try:
        batches = make_batches(steps, rank)
        raw = raw_runner(batches, 0)
        configs: dict[str, Callable[[], float]] = {
            "a raw FSDP2": raw_runner(batches, 2),
            "b watched": watched_runner(batches, db, 3, grads=True),
            "c no grad det.": watched_runner(batches, db, 4, grads=False),
        }
        ratios: dict[str, list[float]] = {name: [] for name in configs}
        rates: dict[str, list[float]] = {name: [] for name in configs}
        counts: dict[str, tuple[dict[str, int], int, float]] = {}
        for round_index in range(rounds + 1):
            last = round_index == rounds
            for name, run in configs.items():
                gc.collect()
                if round_index % 2:
                    with counter.counting():
                        t_config = quiet(run)
                    t_raw = quiet(raw)
                else:
                    t_raw = quiet(raw)
                    with counter.counting():
                        t_config = quiet(run)
                if last:
                    counts[name] = (dict(counter.calls), counter.elements, counter.seconds)
                if round_index:
                    ratios[name].append(t_raw / t_config)
                    rates[name].append(steps / t_config)
            if rank == 0:
                label = "warm-up" if round_index == 0 else f"round {round_index}/{rounds}"
                print(f"  {label} done", file=sys.stderr, flush=True)
        if rank == 0:
            report(ratios, rates, counts, steps)
            accounting(configs, counts, steps, statistics.median(rates["a raw FSDP2"]))
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    shutdown()  # every rank leaves together


def report(
    ratios: dict[str, list[float]],
    rates: dict[str, list[float]],
    counts: dict[str, tuple[dict[str, int], int, float]],
    steps: int,
) -> None:
    header = (
        f"{'config':<16} {'steps/s':>8} {'ratio to raw (min..max)':>26} "
        f"{'collectives':>12} {'elements':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, values in ratios.items():
        ratio = statistics.median(values)
        spread = f"{ratio:.3f} ({min(values):.3f}..{max(values):.3f})"
        calls, elements, _ = counts[name]
        print(
            f"{name:<16} {statistics.median(rates[name]):>8.0f} {spread:>26} "
            f"{sum(calls.values()):>12} {elements:>9}"
        )
    print()
    floor = statistics.median(ratios["a raw FSDP2"])
    ratio = statistics.median(ratios["b watched"])
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(f"goal b/a >= {GOAL:.2f}: median {ratio:.3f} (noise floor a/a {floor:.3f}) -> {verdict}")
    b_calls, b_elements, _ = counts["b watched"]
    c_calls, c_elements, _ = counts["c no grad det."]
    extra = sum(b_calls.values()) - sum(c_calls.values())
    print(
        f"collectives over {steps} steps (last round, rank 0): watched {sum(b_calls.values())} "
        f"({b_calls}), without the gradient detectors {sum(c_calls.values())}; the gradient "
        f"statistics add {extra} collectives and {b_elements - c_elements} elements"
    )


def accounting(
    configs: dict[str, Callable[[], float]],
    counts: dict[str, tuple[dict[str, int], int, float]],
    steps: int,
    raw_rate: float,
) -> None:
    """What stepwatch costs a step by in-process accounting (last round, rank 0), which a loaded
    machine hardly moves: the training thread's CPU time inside ``watched.step`` and the wall
    time inside the collectives stepwatch issues, against the raw step's wall time."""
    print("in-process accounting (last round, rank 0):")
    raw_step = 1e6 / raw_rate
    for name, run in configs.items():
        if not isinstance(run, Watched):
            continue
        hook = run.hook_cpu / steps * 1e6
        waits = counts[name][2] / steps * 1e6
        share = (hook + waits) / raw_step
        print(
            f"  {name}: {hook:.1f} us CPU a step in watched.step ({run.hook_cpu / run.loop_cpu:.2%}"
            f" of the loop's CPU) + {waits:.1f} us a step in its collectives = {share:.2%} of a "
            f"raw step ({raw_step:.0f} us): ratio {1 / (1 + share):.3f} by accounting"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10)")
    parser.add_argument("--steps", type=int, default=500, help="steps per epoch (default 500)")
    parser.add_argument("--quick", action="store_true", help="rounds=2, steps=100: smoke check")
    parser.add_argument("--db", help=argparse.SUPPRESS)  # set for the two worker processes
    args = parser.parse_args(argv)
    rounds, steps = (2, 100) if args.quick else (args.rounds, args.steps)
    if rounds < 1 or steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.db:
        worker(rounds, steps, Path(args.db))
        return 0
    print(
        f"distributed_fsdp: 2 processes (gloo, CPU, FSDP2), {rounds} rounds (+1 warm-up) x "
        f"{steps} steps of batch {BATCH_SIZE} per rank, torch {torch.__version__}, 1 thread "
        f"per process, python {sys.version.split()[0]}",
        flush=True,
    )
    return run_ranks(__file__, ["--rounds", str(rounds), "--steps", str(steps)])


if __name__ == "__main__":
    sys.exit(main())
