"""Resident memory of a long run with the full monitor set, against keeping every loss.

Each variant trains a tiny network (``Linear(8, 2)``, batch 4, in-memory batches) for
``--steps`` steps in a fresh process and reads the process's resident set size (RSS) at step
100k and at the last step:

* ``stepwatch`` - ``LossMonitor(100)``, ``TimeMonitor()``, ``History()`` and
  ``RunRecorder(every_n_steps=1)`` writing every step's loss to a run store on disk;
* ``keep-every-loss`` - the seed article's ``CustomMonitor``, which appends ``float(loss)``
  of every step to a list (the baseline the bounded design replaces).

Goal: the stepwatch variant grows by at most 5 MB between 100k and 1M steps.

Usage::

    python bench/memory.py                  # 1M steps per variant (a few minutes)
    python bench/memory.py --steps 200000   # a quicker look
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHECKPOINT = 100_000
STEPS_PER_EPOCH = 10_000


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(variant: str, steps: int, db: str) -> None:
    import torch
    from torch import nn

    import stepwatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * 4, 8)
    y = (x[:, 0] > 0).long()
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, len(x), 4)]
    net = nn.Linear(8, 2)
    model = stepwatch.Model(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.01), device="cpu"
    )
    marks: dict[int, float] = {}

    class Probe(stepwatch.Callback):
        def on_train_epoch_end(self, run_context: stepwatch.RunContext) -> None:
            step = run_context.original_args().cur_step_num
            if step in (CHECKPOINT, steps):
                marks[step] = rss_mb()

    class KeepEveryLoss(stepwatch.Callback):  # the seed's CustomMonitor
        def __init__(self) -> None:
            self.losses: list[float] = []

        def step_end(self, run_context: stepwatch.RunContext) -> None:
            self.losses.append(float(run_context.original_args().net_outputs))

    if variant == "stepwatch":
        callbacks: list[stepwatch.Callback] = [
            stepwatch.LossMonitor(100),
            stepwatch.TimeMonitor(),
            stepwatch.History(),
            stepwatch.RunRecorder(db=db, every_n_steps=1),
        ]
    else:
        callbacks = [KeepEveryLoss()]
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            model.train(steps // STEPS_PER_EPOCH, batches, callbacks=[*callbacks, Probe()])
        finally:
            sys.stdout = stdout
    print(f"{marks[CHECKPOINT]:.2f} {marks[steps]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps (default 1M)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "DB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps
    if steps <= CHECKPOINT or steps % STEPS_PER_EPOCH:
        parser.error(f"--steps must be a multiple of {STEPS_PER_EPOCH} above {CHECKPOINT}")
    if args.child:
        child(args.child[0], steps, args.child[1])
        return
    print(f"memory: RSS at step {CHECKPOINT:,} and at step {steps:,}, fresh process per variant")
    print()
    header = f"{'variant':<16} {'RSS@100k MB':>12} {'RSS@end MB':>11} {'growth MB':>10}"
    print(header)
    print("-" * len(header))
    growth = {}
    with tempfile.TemporaryDirectory(prefix="stepwatch-membench-") as folder:
        for variant in ("stepwatch", "keep-every-loss"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(steps),
                    "--child",
                    variant,
                    os.path.join(folder, "run.db"),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            start, end = float(out[0]), float(out[1])
            growth[variant] = end - start
            print(f"{variant:<16} {start:>12.2f} {end:>11.2f} {end - start:>10.2f}")
    print()
    verdict = "met" if growth["stepwatch"] <= 5 else "NOT met"
    print(
        f"goal: stepwatch grows <= 5 MB from step 100k to {steps:,}: "
        f"{growth['stepwatch']:.2f} MB -> {verdict}"
    )


if __name__ == "__main__":
    main()
