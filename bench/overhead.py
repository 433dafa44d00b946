"""Per-step overhead of stepwatch's training loop against a hand-written PyTorch loop.

Workload: a tiny MLP (Linear(32, 64) - ReLU - Linear(64, 10)), SGD(lr=0.01) and
CrossEntropyLoss on random data, pre-sliced into ``--steps`` batches of 32 (tensor views), on
the CPU with one intra-op and one inter-op thread. The model is so small that a step costs
tens of microseconds, so whatever a framework adds per step shows up in full.

Method: all configurations run interleaved in one process. In every round, each configuration
runs one epoch of the raw loop and one epoch of its own back to back (raw first in even
rounds, second in odd ones), and its score for the round is
``ratio = (its steps/s) / (the paired raw steps/s)``; pairing cancels most of the drift of a
noisy machine. Round 0 is a warm-up and is discarded. The table gives medians over
the remaining rounds (the ratio also as min..max) and the median extra time per step,
``(t_config - t_raw) / steps``.

The stepwatch configurations pair with a raw loop over the same network and optimizer (both
train the one model in turn), so the ratio measures the loop and callbacks alone; Lightning and
Keras build their own models and pair with a separate raw loop, as ``a raw`` does.

Configurations:

* ``a raw`` - ``opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()``;
  paired with another raw loop on another model instance, its ratio shows the noise floor.
* ``b stepwatch`` - ``Model(...).train(1, batches)`` without callbacks, timed as the whole
  ``train`` call (its fixed cost is well under a millisecond per call).
* ``c stepwatch+cb`` - the same with ``[LossMonitor(100), TimeMonitor(), History()]``, the
  epoch timed by one more callback that only implements the epoch hooks.
* ``d stepwatch+rec`` - ``c`` plus ``RunRecorder(every_n_steps=1)`` recording every step's
  loss into a temporary SQLite run store (the database write happens on its own thread). With
  the default 1 s flush period and an epoch shorter than that, the writer thread writes mostly
  after the timed epoch.
* ``d2 rec,flush0.1`` - ``d`` with ``flush_seconds=0.1``: the writer thread commits about ten
  times a second, during the timed epoch, as it does in a long run; its cost shows here.
* ``g rec+anomaly`` - ``d`` plus ``AnomalyMonitor()`` at its defaults: every step's loss
  read in batches of 128 once the detectors are warm (8 before; a loss over the tap's alarm
  on its own step) and run through the detectors, gradient statistics every 128 steps (every
  10 for the first 10, and every 5 while a gradient detector confirms a sign).
* ``h rec+progress`` - ``d`` plus ``ProgressBar`` writing to ``os.devnull`` (not a terminal:
  its plain-line mode; the bar itself needs a terminal).
* ``i rec+plot`` - ``d`` plus ``PlotMonitor`` (every 30 s: within a timed epoch it only
  gathers values; the picture is drawn on its own thread).
* ``j rec+anom+prog`` - ``Model.train`` with ``RunRecorder(every_n_steps=1)``,
  ``AnomalyMonitor()`` and ``ProgressBar`` (to ``os.devnull``) only.
* ``j2 ...,grads/256`` - ``j`` with ``AnomalyMonitor(grad_every_n_steps=256)``: what fewer
  gradient measurements would save, as ``j2 - j``.
* ``j0 ...,no grads`` - ``j`` with every detector but those that read the gradients
  (explosion, vanishing, dying ReLU, saturation): all the gradient statistics cost, as
  ``j0 - j``.
* ``k watch`` - the raw loop of ``a`` with ``stepwatch.watch`` and the callbacks of ``j``
  (``run.step(loss)`` after each step), timed around the loop; paired with the same loop over
  the same network and optimizer without ``watch``.
* ``e lightning`` - a ``lightning.pytorch.Trainer`` fitting one epoch of a LightningModule
  whose ``training_step`` calls ``self.log('loss', loss)``; timed from a Lightning callback
  (``on_train_epoch_start`` / ``on_train_epoch_end``), so ``fit`` setup is left out.
* ``f keras`` - Keras 3 on the torch backend, ``fit`` on the same arrays as NumPy, timed from
  a Keras callback (``on_epoch_begin`` / ``on_epoch_end``).

Lightning and Keras are optional (``make bench`` installs them); a missing one is skipped with
a note. Standard output goes to ``os.devnull`` during every timed epoch, for every
configuration, so the terminal's speed does not count.

Usage::

    python bench/overhead.py               # 10 rounds of 2000 steps (plus a warm-up round)
    python bench/overhead.py --quick       # 2 rounds of 300 steps: a smoke check
    python bench/overhead.py --rounds 9 --steps 4000
    python bench/overhead.py --only a,b,d,j,k   # some configurations only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import stepwatch

# Keras reads its backend when first imported (lazily, in keras_runner and available).
os.environ["KERAS_BACKEND"] = "torch"

BATCH_SIZE = 32
IN_FEATURES = 32
HIDDEN = 64
CLASSES = 10
LR = 0.01
SEED = 0

# Goals: minimum median ratio to raw, per configuration.
GOALS = {
    "b stepwatch": 0.97,
    "c stepwatch+cb": 0.95,
    "d stepwatch+rec": 0.95,
    "j rec+anom+prog": 0.95,
    "k watch": 0.95,
}

Batch = tuple[torch.Tensor, torch.Tensor]
EpochRunner = Callable[[], float]  # runs one epoch, returns its seconds


# -- workload ---------------------------------------------------------------------------------
@dataclass
class Workload:
    x: torch.Tensor
    y: torch.Tensor
    batches: list[Batch]

    @property
    def steps(self) -> int:
        return len(self.batches)


def make_workload(steps: int) -> Workload:
    generator = torch.Generator().manual_seed(SEED)
    n = steps * BATCH_SIZE
    x = torch.randn(n, IN_FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    batches = [(x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]) for i in range(0, n, BATCH_SIZE)]
    return Workload(x, y, batches)


def make_mlp() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


# -- configurations ---------------------------------------------------------------------------
def raw_runner(work: Workload, model: nn.Module | None = None, opt: Any = None) -> EpochRunner:
    """The hand-written loop; on ``model``/``opt`` when given (to share a stepwatch config's)."""
    model = model if model is not None else make_mlp()
    loss_fn = nn.CrossEntropyLoss()
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=LR)
    batches = work.batches

    def run() -> float:
        model.train()
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        return time.perf_counter() - start

    return run


def stepwatch_model(work: Workload) -> stepwatch.Model:
    net = make_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    return stepwatch.Model(net, nn.CrossEntropyLoss(), opt, device="cpu")


def paired_raw(model: stepwatch.Model, work: Workload) -> EpochRunner:
    """A raw loop over the very network and optimizer ``model`` trains."""
    return raw_runner(work, model.train_network, model.optimizer)


def stepwatch_runner(work: Workload) -> EpochRunner:
    model = stepwatch_model(work)

    def run() -> float:
        start = time.perf_counter()
        model.train(1, work.batches)
        return time.perf_counter() - start

    run.raw = paired_raw(model, work)  # type: ignore[attr-defined]
    return run


class _StepwatchEpochTimer(stepwatch.Callback):
    """Times the epoch; it implements no step hook, so it adds nothing per step."""

    order = -1_000  # its epoch begin runs first; its epoch end too, before the others print

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = 0.0

    def on_train_epoch_begin(self, run_context: stepwatch.RunContext) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, run_context: stepwatch.RunContext) -> None:
        self.seconds = time.perf_counter() - self.start


def stepwatch_callbacks_runner(work: Workload) -> EpochRunner:
    model = stepwatch_model(work)

    def run() -> float:
        timer = _StepwatchEpochTimer()
        callbacks = [stepwatch.LossMonitor(100), stepwatch.TimeMonitor(), stepwatch.History()]
        model.train(1, work.batches, callbacks=[*callbacks, timer])
        return timer.seconds

    run.raw = paired_raw(model, work)  # type: ignore[attr-defined]
    return run


def stepwatch_recorder_runner(
    work: Workload, flush_seconds: float = 1.0, extra: str | None = None
) -> EpochRunner:
    model = stepwatch_model(work)
    # Removed when the runner is dropped.
    folder = tempfile.TemporaryDirectory(prefix="stepwatch-bench-")
    sink = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the runner

    def run() -> float:
        db = os.path.join(folder.name, "bench.db")
        timer = _StepwatchEpochTimer()
        callbacks = [
            stepwatch.LossMonitor(100),
            stepwatch.TimeMonitor(),
            stepwatch.History(),
            stepwatch.RunRecorder(db=db, every_n_steps=1, flush_seconds=flush_seconds),
        ]
        if extra == "anomaly":
            callbacks.append(stepwatch.AnomalyMonitor())
        elif extra == "progress":
            callbacks.append(stepwatch.ProgressBar(file=sink))
        elif extra == "plot":
            callbacks.append(stepwatch.PlotMonitor(os.path.join(folder.name, "curves.png")))
        elif extra == "watchers":
            callbacks = _watchers(db, sink)
        elif extra == "watchers, grads/256":
            callbacks = _watchers(db, sink, grad_every=256)
        elif extra == "watchers, no grads":
            callbacks = _watchers(db, sink, grads=False)
        model.train(1, work.batches, callbacks=[*callbacks, timer])
        return timer.seconds

    run.raw = paired_raw(model, work)  # type: ignore[attr-defined]
    return run


def stepwatch_recorder_flushing_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, flush_seconds=0.1)


def stepwatch_anomaly_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, extra="anomaly")


def stepwatch_progress_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, extra="progress")


def stepwatch_plot_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, extra="plot")


# AnomalyMonitor's kinds that read the gradients (and the activations on the same steps).
_GRAD_KINDS = ("grad_explosion", "grad_vanishing", "dying_relu", "saturation")


def _watchers(
    db: str, sink: Any, grad_every: int | None = None, grads: bool = True
) -> list[stepwatch.Callback]:
    """The monitors of the issue's goal: the store, the detectors and a progress display
    (AnomalyMonitor at its defaults, unless ``grad_every`` is given)."""
    from stepwatch.monitor.detectors import DETECTORS

    kinds = None if grads else [k for k in DETECTORS if k not in (*_GRAD_KINDS, "threshold")]
    return [
        stepwatch.RunRecorder(db=db, every_n_steps=1),
        stepwatch.AnomalyMonitor(detectors=kinds)
        if grad_every is None
        else stepwatch.AnomalyMonitor(detectors=kinds, grad_every_n_steps=grad_every),
        stepwatch.ProgressBar(file=sink),
    ]


def stepwatch_watchers_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, extra="watchers")


def stepwatch_watchers_sparse_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, extra="watchers, grads/256")


def stepwatch_watchers_no_grads_runner(work: Workload) -> EpochRunner:
    return stepwatch_recorder_runner(work, extra="watchers, no grads")


def watch_runner(work: Workload) -> EpochRunner:
    """The raw loop with ``stepwatch.watch`` and the monitors of ``j``, paired with the same
    loop (same network and optimizer) without them."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    batches = work.batches
    folder = tempfile.TemporaryDirectory(prefix="stepwatch-bench-")
    sink = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the runner

    def run() -> float:
        db = os.path.join(folder.name, "bench.db")
        watched = stepwatch.watch(
            model, opt, _watchers(db, sink), epochs=1, steps_per_epoch=len(batches)
        )
        with watched:
            model.train()
            start = time.perf_counter()
            for x, y in batches:
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                watched.step(loss)
            seconds = time.perf_counter() - start
            watched.epoch_end()
        return seconds

    run.raw = raw_runner(work, model, opt)  # type: ignore[attr-defined]
    run.keep = (folder, sink)  # type: ignore[attr-defined]
    return run


class _Batches:
    """The pre-sliced batches as one iterable loader (Lightning reads a bare list as many)."""

    def __init__(self, batches: list[Batch]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


def lightning_runner(work: Workload) -> EpochRunner:
    import lightning.pytorch as pl

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning(\.|$)")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()
            self.loss_fn = nn.CrossEntropyLoss()

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class EpochTimer(pl.Callback):
        def __init__(self) -> None:
            self.start = 0.0
            self.seconds = 0.0

        def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            self.seconds = time.perf_counter() - self.start

    module = Module()
    loader = _Batches(work.batches)
    # Removed when the runner is dropped; with logger and checkpoints off it stays empty.
    root = tempfile.TemporaryDirectory(prefix="stepwatch-bench-")

    def run() -> float:
        timer = EpochTimer()
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[timer],
            default_root_dir=root.name,
        )
        trainer.fit(module, train_dataloaders=loader)
        return timer.seconds

    return run


def keras_runner(work: Workload) -> EpochRunner:
    import keras

    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((IN_FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.start = 0.0
            self.seconds = 0.0

        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            self.seconds = time.perf_counter() - self.start

    x, y = work.x.numpy(), work.y.numpy()

    def run() -> float:
        timer = EpochTimer()
        model.fit(
            x,
            y,
            batch_size=BATCH_SIZE,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
        return timer.seconds

    return run


@dataclass
class Config:
    name: str
    timing: str
    make: Callable[[Workload], EpochRunner]
    optional: str | None = None  # the module to import first, for an optional peer


CONFIGS = [
    Config("a raw", "hand-written loop", raw_runner),
    Config("b stepwatch", "whole train() call", stepwatch_runner),
    Config("c stepwatch+cb", "epoch hooks (callback)", stepwatch_callbacks_runner),
    Config("d stepwatch+rec", "epoch hooks (callback)", stepwatch_recorder_runner),
    Config("d2 rec,flush0.1", "epoch hooks (callback)", stepwatch_recorder_flushing_runner),
    Config("g rec+anomaly", "epoch hooks (callback)", stepwatch_anomaly_runner),
    Config("h rec+progress", "epoch hooks (callback)", stepwatch_progress_runner),
    Config("i rec+plot", "epoch hooks (callback)", stepwatch_plot_runner),
    Config("j rec+anom+prog", "epoch hooks (callback)", stepwatch_watchers_runner),
    Config("j2 ...,grads/256", "epoch hooks (callback)", stepwatch_watchers_sparse_runner),
    Config("j0 ...,no grads", "epoch hooks (callback)", stepwatch_watchers_no_grads_runner),
    Config("k watch", "the loop itself", watch_runner),
    Config("e lightning", "epoch hooks (callback)", lightning_runner, "lightning.pytorch"),
    Config("f keras", "epoch hooks (callback)", keras_runner, "keras"),
]


# -- measurement ------------------------------------------------------------------------------
@dataclass
class Samples:
    config: Config
    seconds: list[float] = field(default_factory=list)
    raw_seconds: list[float] = field(default_factory=list)


def quiet_epoch(run: EpochRunner) -> float:
    """Run one epoch with stdout sent to os.devnull; return its seconds."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return run()


def available(config: Config) -> str | None:
    """None when the config can run, else why not."""
    if config.optional is None:
        return None
    try:
        __import__(config.optional)
    except Exception as exc:  # an ImportError, or a peer that fails while importing
        return f"{type(exc).__name__}: {exc}"
    return None


def measure(work: Workload, rounds: int) -> list[Samples]:
    shared_raw = raw_runner(work)
    runners: list[tuple[Samples, EpochRunner]] = []
    for config in CONFIGS:
        why = available(config)
        if why is not None:
            print(f"skipped {config.name}: {why} (install with `make bench`)")
            continue
        runners.append((Samples(config), config.make(work)))
    for round_index in range(rounds + 1):  # round 0 is the warm-up
        for samples, run in runners:
            # stepwatch configs pair with a raw loop over their own network and optimizer, so
            # that where a model's tensors happen to sit in memory does not count.
            raw = getattr(run, "raw", shared_raw)
            gc.collect()
            # Alternate which of the pair runs first, so neither always gets the warmer slot.
            if round_index % 2:
                t_config = quiet_epoch(run)
                t_raw = quiet_epoch(raw)
            else:
                t_raw = quiet_epoch(raw)
                t_config = quiet_epoch(run)
            if round_index > 0:
                samples.raw_seconds.append(t_raw)
                samples.seconds.append(t_config)
        label = "warm-up" if round_index == 0 else f"round {round_index}/{rounds}"
        print(f"  {label} done", file=sys.stderr, flush=True)
    return [samples for samples, _ in runners]


def report(results: list[Samples], steps: int) -> None:
    header = (
        f"{'config':<16} {'steps/s':>9} {'ratio to raw (min..max)':>26} "
        f"{'overhead us/step':>17}  timed as"
    )
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    for s in results:
        ratios = [t_raw / t for t, t_raw in zip(s.seconds, s.raw_seconds)]
        overheads = [(t - t_raw) / steps * 1e6 for t, t_raw in zip(s.seconds, s.raw_seconds)]
        rate = statistics.median(steps / t for t in s.seconds)
        ratio = statistics.median(ratios)
        medians[s.config.name] = ratio
        spread = f"{ratio:.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        print(
            f"{s.config.name:<16} {rate:>9.0f} {spread:>26} "
            f"{statistics.median(overheads):>17.1f}  {s.config.timing}"
        )
    print()
    print("b is timed as the whole train() call (setup included, well under 1 ms per call);")
    print("c to j are timed from their framework's epoch hooks; a and k around the loop.")
    print()
    for name, goal in GOALS.items():
        key = name.split()[0]
        if name not in medians:
            print(f"goal {key}/a >= {goal:.2f}: not measured")
            continue
        verdict = "met" if medians[name] >= goal else "NOT met"
        print(f"goal {key}/a >= {goal:.2f}: median {medians[name]:.3f} -> {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per epoch (default 2000)")
    parser.add_argument("--quick", action="store_true", help="rounds=2, steps=300: smoke check")
    parser.add_argument(
        "--only", help="comma-separated config letters to run (e.g. a,b,d,j,k); default all"
    )
    args = parser.parse_args(argv)
    if args.only:
        wanted = {part.strip() for part in args.only.split(",")}
        CONFIGS[:] = [c for c in CONFIGS if c.name.split()[0] in wanted]
    rounds, steps = (2, 300) if args.quick else (args.rounds, args.steps)
    if rounds < 1 or steps < 1:
        parser.error("--rounds and --steps must be at least 1")

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    work = make_workload(steps)
    print(
        f"overhead: {rounds} rounds (+1 warm-up) x {steps} steps, batch {BATCH_SIZE}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, python "
        f"{sys.version.split()[0]}",
        flush=True,  # before the progress lines on stderr
    )
    results = measure(work, rounds)
    print()
    report(results, steps)


if __name__ == "__main__":
    main()
