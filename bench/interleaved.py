"""Per-step overhead of stepwatch in one long run, with raw-loop blocks interleaved inside it.

``bench/overhead.py`` pairs whole epochs (about half a second each) of a configuration with
epochs of the raw loop. On a machine whose speed wanders by tens of percent from one second
to the next, that pairing leaves the median ratio a few percent wide even over 40 rounds.
This benchmark pairs at a finer grain: inside one run, every ``--block`` steps (default 100,
about 25 ms) the run stops for a block of the same number of raw-loop steps on the same
network and optimizer, and each configuration block is compared with the raw block next to
it. A round is ``--steps`` steps of the configuration and as many raw ones; its ratio is
``(raw seconds) / (configuration seconds)`` over its blocks; the table gives the median over
the rounds after the first (the run's start-up: the detectors' warm-up, the first reads) and
the median extra time per step.

The workload is ``bench/overhead.py``'s: the tiny MLP (Linear(32, 64) - ReLU - Linear(64,
10)), SGD and CrossEntropyLoss on random batches of 32, one CPU thread.

Configurations (each one run of ``rounds x steps`` steps):

* ``a raw`` - the raw loop with raw blocks interleaved: the noise floor (ratio ~1).
* ``b stepwatch`` - ``Model.train`` without callbacks. The raw blocks run from a call on the
  run's step clock (``LossTap.call_at``, as stepwatch's own monitors look at a run), so the
  configuration's time includes one clock wake per block.
* ``j rec+anom+prog`` - ``Model.train`` with ``RunRecorder(every_n_steps=1)``,
  ``AnomalyMonitor()`` and ``ProgressBar`` (to ``os.devnull``), as ``overhead.py``'s row j.
* ``k watch`` - the raw loop with ``stepwatch.watch`` and the callbacks of ``j``
  (``run.step(loss)`` after each step); the raw blocks are the same loop without it.

What it leaves out, by design: the start of a run (``overhead.py`` times 2000-step runs from
their start, and shows it), and the time the writer thread takes on the other core except as
it slows the training thread. Standard output goes to ``os.devnull`` during the runs.

Usage::

    python bench/interleaved.py                  # 20 rounds of 2000 steps, blocks of 100
    python bench/interleaved.py --quick          # 3 rounds of 400 steps: a smoke check
    python bench/interleaved.py --rounds 40 --only a,j,k
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
from overhead import LR, Batch, make_mlp, make_workload
from torch import nn

import stepwatch

GOALS = {"b stepwatch": 0.97, "j rec+anom+prog": 0.95, "k watch": 0.95}


class Pairs:
    """The blocks' times, summed per round."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.rounds: list[tuple[float, float]] = []  # (configuration seconds, raw seconds)
        self._config = self._raw = 0.0
        self._blocks = 0

    def add(self, config: float, raw: float, block: int) -> None:
        self._config += config
        self._raw += raw
        self._blocks += block
        if self._blocks >= self.steps:
            self.rounds.append((self._config, self._raw))
            self._config = self._raw = 0.0
            self._blocks = 0


class RawBlocks:
    """Raw-loop steps on a network and optimizer, ``block`` at a time, over its own batches."""

    def __init__(self, net: nn.Module, opt: Any, batches: list[Batch], block: int) -> None:
        self.net, self.opt, self.block = net, opt, block
        self.loss_fn = nn.CrossEntropyLoss()
        self._batches = itertools.cycle(batches)

    def __call__(self) -> float:
        net, opt, loss_fn = self.net, self.opt, self.loss_fn
        start = time.perf_counter()
        for x, y in itertools.islice(self._batches, self.block):
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
        return time.perf_counter() - start


class Interleave(stepwatch.Callback):
    """Runs a raw block every ``block`` steps of a ``Model`` run, from the run's step clock."""

    def __init__(self, raw: RawBlocks, pairs: Pairs) -> None:
        self.raw, self.pairs = raw, pairs
        self._last = 0.0

    def on_train_begin(self, run_context: stepwatch.RunContext) -> None:
        self._tap = run_context.original_args().run_view.tap
        self._tap.call_at(self.raw.block, self._wake)
        self._last = time.perf_counter()

    def _wake(self, step: int) -> None:
        config = time.perf_counter() - self._last
        raw = self.raw()
        self.pairs.add(config, raw, self.raw.block)
        self._tap.call_at(step + self.raw.block, self._wake)
        self._last = time.perf_counter()


def _monitors(db: str, sink: Any) -> list[stepwatch.Callback]:
    return [
        stepwatch.RunRecorder(db=db, every_n_steps=1),
        stepwatch.AnomalyMonitor(),
        stepwatch.ProgressBar(file=sink),
    ]


def run_model(batches: list[Batch], total: int, block: int, steps: int, watchers: bool,
              folder: str, sink: Any) -> Pairs:  # fmt: skip
    net = make_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    pairs = Pairs(steps)
    callbacks = _monitors(os.path.join(folder, "j.db"), sink) if watchers else []
    callbacks.append(Interleave(RawBlocks(net, opt, batches[::-1], block), pairs))
    model = stepwatch.Model(net, nn.CrossEntropyLoss(), opt, device="cpu")
    model.train(1, list(itertools.islice(itertools.cycle(batches), total)), callbacks=callbacks)
    return pairs


def run_loop(batches: list[Batch], total: int, block: int, steps: int, watched: bool,
             folder: str, sink: Any) -> Pairs:  # fmt: skip
    net = make_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    raw = RawBlocks(net, opt, batches[::-1], block)
    pairs = Pairs(steps)
    run = None
    if watched:
        db = os.path.join(folder, "k.db")
        run = stepwatch.watch(net, opt, _monitors(db, sink), epochs=1, steps_per_epoch=total)
    with run if run is not None else contextlib.nullcontext():
        last = time.perf_counter()
        for i, (x, y) in enumerate(itertools.islice(itertools.cycle(batches), total)):
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            if run is not None:
                run.step(loss)
            if (i + 1) % block == 0:
                config = time.perf_counter() - last
                pairs.add(config, raw(), block)
                last = time.perf_counter()
        if run is not None:
            run.epoch_end()
    return pairs


Runner = Callable[[list[Batch], int, int, int, bool, str, Any], Pairs]
CONFIGS: dict[str, tuple[Runner, bool]] = {
    "a raw": (run_loop, False),
    "b stepwatch": (run_model, False),
    "j rec+anom+prog": (run_model, True),
    "k watch": (run_loop, True),
}


def report(results: dict[str, Pairs]) -> None:
    print(f"{'config':<18} {'rounds':>6}  {'ratio to raw (min..max)':<26} {'extra us/step':>13}")
    print("-" * 68)
    for name, pairs in results.items():
        kept = pairs.rounds[1:]  # the first round holds the run's start
        ratios = [raw / config for config, raw in kept]
        extra = [(config - raw) / pairs.steps * 1e6 for config, raw in kept]
        span = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        print(f"{name:<18} {len(kept):>6}  {span:<26} {statistics.median(extra):>13.1f}")
    print()
    for name, goal in GOALS.items():
        if name in results:
            kept = results[name].rounds[1:]
            median = statistics.median(raw / config for config, raw in kept)
            verdict = "met" if median >= goal else "NOT met"
            print(f"goal {name.split()[0]} >= {goal}: median {median:.3f} -> {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds (default 20)")
    parser.add_argument("--steps", type=int, default=2000, help="steps a round (default 2000)")
    parser.add_argument("--block", type=int, default=100, help="steps a block (default 100)")
    parser.add_argument("--only", default="", help="configurations, e.g. a,j,k")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 400 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 400
    for name, value in (("rounds", args.rounds), ("steps", args.steps), ("block", args.block)):
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if args.steps % args.block:
        parser.error(f"--steps ({args.steps}) must be a multiple of --block ({args.block})")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {name.split()[0] for name in CONFIGS}
    if unknown:
        parser.error(f"unknown configuration(s) {sorted(unknown)}; pick from a, b, j, k")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    total = (args.rounds + 1) * args.steps  # the first round is the run's start
    batches = make_workload(args.steps).batches
    print(f"interleaved: {args.rounds} rounds (+1 at the start) x {args.steps} steps, blocks of "
          f"{args.block}, torch {torch.__version__}, 1 thread", flush=True)  # fmt: skip
    logging.getLogger("stepwatch").setLevel(logging.ERROR)  # the random labels do not learn
    results: dict[str, Pairs] = {}
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as folder:
        for name, (runner, watchers) in CONFIGS.items():
            if only and name.split()[0] not in only:
                continue
            with (
                open(os.devnull, "w") as sink,
                contextlib.redirect_stdout(sink),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")
                results[name] = runner(batches, total, args.block, args.steps, watchers,
                                       folder, sink)  # fmt: skip
            print(f"  {name} done", file=sys.stderr, flush=True)
    report(results)


if __name__ == "__main__":
    main()
