"""What a bridge costs inside its host trainer: Lightning, the Hugging Face Trainer, Keras.

Workload: the tiny MLP of ``bench/overhead.py`` (Linear(32, 64) - ReLU - Linear(64, 10)),
SGD(lr=0.01), cross-entropy, ``--steps`` batches of 32 on the CPU with one thread. The step is
so cheap that whatever a callback adds per step shows in full.

Per host, each round runs one epoch of every variant, each paired with an epoch of the host
alone (the pair's order alternates from round to round):

* ``alone'`` - the host alone again: paired with the host alone, its ratio is the noise floor;
* ``no-op callback`` - the host with one more callback of its own kind that does nothing:
  what the host's callback machinery charges any callback, the bridge included. For Keras it
  has a batch-end hook: Keras hands batch-end hooks to a thread pool only while no callback
  has one, and runs them in line otherwise (on this machine the pool is the slower way);
  the bridge has one, so this is its fair floor;
* ``empty bridge`` - the host with ``StepwatchCallback([])``: the bridge's own machinery
  (its hooks and the run's step) with no stepwatch callback in it;
* ``stepwatch`` - the host with ``StepwatchCallback([RunRecorder(every_n_steps=1),
  AnomalyMonitor()])``, recording every step's loss into a temporary SQLite run store;
* the host's own logger, recording every step where it can: Lightning's ``CSVLogger`` and
  ``TensorBoardLogger`` (``log_every_n_steps=1``), the Trainer's ``report_to="tensorboard"``
  (``logging_steps=1``), Keras's ``TensorBoard`` callback (``update_freq=1``; it writes
  through TensorFlow, which ``make bench`` installs, and is left out without it), its
  ``CSVLogger`` (it writes once per epoch) and its default progress bar (``verbose=1``).

Every epoch is timed from the host's own hooks by a callback (the same in every variant),
so trainer set-up is left out, and from its ``--skip``-th step on (default 128): each epoch is
a fit of its own, a new run, and a run's first steps are a one-off that a long run does not
pay per step (AnomalyMonitor warms up over them: it reads the losses every 8 steps and
measures the gradients every 10 until step 104); ``--skip 0`` times them too. Standard
output goes to ``os.devnull``. Every ``--block`` timed host steps that callback runs as many
steps of the hand-written loop on a network of its own, and an epoch's score is its host
time over those raw blocks' time, so the machine's drift between two epochs cancels
(``--block 0``: wall time alone). Round 0 is a warm-up. The first table gives, per variant,
the median of ``score_alone / score_variant`` (with min..max) and the median extra time per
step, also as a share of the host's own step; and the median over rounds of the epoch's
median step time over its paired epoch's alone (the timing of the bridge's hooks included),
which leaves out rare pauses and the wakes.

Fits of different variants still differ by more than the goal on this machine (the host
alone against itself spreads over tens of percent), so a second table measures the bridge
within its own runs (the no-op callback's run too, its per-step hooks timed the same way):
the time inside the bridge's own hooks per step (each hook timed; the first timed step,
which holds the epoch-begin hook under ``--skip 0``, left out; per position of a step in
AnomalyMonitor's 128-step cycle its median, averaged over the cycle, so a wake counts at its
position and a rare pause that hits any code alike does not; the plain mean beside it), plus
the slower host steps after its wakes (per position, the host's median step time without the
bridge's hooks over the quiet positions', summed; the same measure for the host alone, whose
raw blocks slow their own next steps, subtracted). Under the bridge's row comes the bridge
over the no-op callback: what the timing itself and the host's call of a hook cost (the
host calls every hook on every callback, the bridge's or not) taken out. Keras's TensorBoard
callback, timed the same way, has a row too and is set against the bridge. What it leaves
out: the recorder's writer thread, which holds the interpreter lock while it builds rows (in a host
whose step is mostly Python, that time is taken from the training thread) except as it slows
the positions it lands on, and garbage collections the bridge's allocations bring forward.

A third measurement takes the bridge out of the host's own callback list and puts it back
every ``--switch`` steps (default 10) within each fit: blocks of steps without it and with it,
off, on, on, off, off, on, ..., a few milliseconds apart, so the machine's drift cancels
without raw blocks. A step with the bridge in, against one with it out, holds everything the
bridge costs the host in that step: the host's call of its hooks, the hooks, the Trainer
bridge's wrapper of the Trainer's ``training_step`` (it comes off with the bridge), and any
host code that runs slower after them. Each block's first step holds the switch and is left
out. The CPU time of the process's other threads (the recorder's writer) is added: where the
timing starts and where it ends, the recorder hands over every loss it holds and the bench
waits for the writer to write them, so the time between is the writer's work for the timed
steps' rows, per timed step the bridge saw, over the same in fits that switch nothing. Each
fit times ``--switch-steps`` steps (default 1200, over a second), so the writer writes within
them about as often as in a long run (once a second), plus the one write at the end (so it
leans high). The writer's work once per run (its first write, which prepares its statements,
and its close) is shown beside in milliseconds, not counted per step. Variants, interleaved for
``--switch-rounds`` rounds (default 20): ``nothing switched`` (the two kinds of block are the
same: the method's floor), ``no-op callback``, ``empty bridge`` and ``stepwatch``; per
variant, the median over fits of each fit's mean (and median) step with the callback in minus
out. What it leaves out: costs that stay for the whole fit once a bridge is in it (the run's
start, which ``--skip`` leaves out too, and memory it holds).

Goal (issue 18): the bridge costs at most 3 % of the host's step time, and less than the
host's own logger.

Usage::

    python bench/bridges.py                 # 9 rounds of 400 steps (after 128) per host,
                                            # then 20 rounds of 1200 steps with the
                                            # bridge switched
    python bench/bridges.py --quick         # 2 rounds of 100 steps: a smoke check
    python bench/bridges.py --hosts keras --rounds 15
    python bench/bridges.py --rounds 0      # the third measurement only
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is first imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up notices, if loaded

import torch
from torch import nn

from stepwatch import AnomalyMonitor, RunRecorder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead

# The workload of bench/overhead.py: the same data, network and settings.
BATCH_SIZE, IN_FEATURES, HIDDEN, CLASSES = (
    overhead.BATCH_SIZE,
    overhead.IN_FEATURES,
    overhead.HIDDEN,
    overhead.CLASSES,
)
LR, SEED = overhead.LR, overhead.SEED
GOAL = 0.03  # the bridge's extra time, as a share of the host's own step

# runs one epoch; returns its score (Clock.score) and the host's seconds
EpochRunner = Callable[[], tuple[float, float]]
Data = overhead.Workload
make_data = overhead.make_workload
make_mlp = overhead.make_mlp


class Inside:
    """The time spent inside a bridge's own hooks, and each epoch's step times, per variant:
    the bridge's cost measured within the run (see :func:`direct_report`)."""

    ns = 0  # nanoseconds inside the bridges' hooks so far
    current: ClassVar[str | None] = None  # the variant now running
    # variant -> [(step's nanoseconds, of them inside the bridge), ...] per epoch
    steps: ClassVar[dict[str, list[list[tuple[int, int]]]]] = {}


def timed(bridge: Any) -> Any:
    """``bridge`` with its own hooks (those its class defines, and what the Trainer bridge runs
    inside the Trainer's ``training_step`` and in its forward hook) timed into
    :attr:`Inside.ns` (the call of the Trainer bridge's ``training_step`` wrapper itself is
    not: the switched fits count it)."""
    clock = time.perf_counter_ns
    names = [(bridge, n) for n in vars(type(bridge)) if n.startswith("on_")]
    step_loss = getattr(bridge, "_loss", None)  # the Trainer bridge's StepLoss
    if step_loss is not None:
        names += [(step_loss, "keep"), (step_loss, "forward_hook")]
    for owner, name in names:
        hook = getattr(owner, name, None)
        if not callable(hook):
            continue

        def wrapper(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            start = clock()
            try:
                return _hook(*args, **kwargs)
            finally:
                Inside.ns += clock() - start

        setattr(owner, name, wrapper)
    return bridge


class Switch:
    """One callback taken out of its host's callback list and put back, every
    :attr:`every` timed steps, so that within one fit the host runs blocks of steps without it
    and blocks with it (see :func:`switched`).

    The blocks go off, on, on, off, off, on, on, off, ... (a drift that runs steadily through
    the fit adds as much to the blocks with the callback as to those without). ``callback``
    None switches nothing: the two kinds of block are then the same, and their difference is
    the method's own floor. ``members`` returns the host's list, read at each switch (a host
    may replace it when training starts); the host calls its callbacks from that list on each
    hook, so a callback out of it costs nothing at all. ``on`` / ``off``, if given, run as the
    callback goes back in / comes out (the Trainer bridge's wrapper of ``training_step``).
    """

    every: ClassVar[int] = 0  # the block's length in steps, set by main()

    def __init__(
        self,
        members: Callable[[], list[Any]],
        callback: Any = None,
        on: Callable[[Any], None] | None = None,
        off: Callable[[Any], None] | None = None,
    ) -> None:
        self._members, self.callback = members, callback
        self._on, self._off = on, off
        self.state = True  # the callback is in its host's list
        self._index = 0  # where it was

    @staticmethod
    def wanted(block: int) -> bool:
        """Whether the callback is in during the ``block``-th block (0-based)."""
        return block % 4 in (1, 2)

    def settle(self) -> float:
        """Write every step loss the switched bridge's RunRecorder holds and wait for its writer
        (no-op without one); return the CPU seconds of the process's other threads so far.
        Called where the timing starts and ends, so the writer's time between the two calls is
        its work for the timed steps' rows, and its one-off work for the run (its first write,
        which prepares its statements, and its close) falls outside."""
        for callback in getattr(self.callback, "callbacks", ()):
            if isinstance(callback, RunRecorder) and callback.writer is not None:
                if callback._cb_params is not None:
                    callback._flush(callback._cb_params)
                callback.writer.flush()
        return time.process_time() - time.thread_time()

    def set(self, state: bool) -> None:
        if state == self.state:
            return
        self.state = state
        callback = self.callback
        if callback is None:
            return
        # The host is iterating over this list (the switch runs from its batch-end hook, the
        # timer's, which comes before the callback): taking it out skips it for this hook,
        # putting it back where it was calls it at this hook, with the step it follows.
        members = self._members()
        if state:
            members.insert(self._index, callback)
            if self._on is not None:
                self._on(callback)
        else:
            self._index = members.index(callback)
            del members[self._index]
            if self._off is not None:
                self._off(callback)


class Switched:
    """What :func:`switched` keeps: per variant, each fit's steps and its other threads' time."""

    # variant -> [[(step's nanoseconds, the callback was in), ...] per fit]
    steps: ClassVar[dict[str, list[list[tuple[int, bool]]]]] = {}
    # variant -> [CPU seconds of the process's other threads over each fit's timed steps, ...]
    others: ClassVar[dict[str, list[float]]] = {}
    # variant -> [the same over each whole fit, ...]
    whole: ClassVar[dict[str, list[float]]] = {}


class Clock:
    """An epoch's time, with blocks of raw-loop steps run inside it.

    Every ``block`` host steps (from the host's batch-end hook), ``block`` steps of the
    hand-written loop run on a network and optimizer of their own; their time is taken out of
    the host's. An epoch's score is its host time over its raw time: both are measured within
    the same fraction of a second, so the machine's drift (tens of percent here from one
    second to the next) cancels, as in ``bench/interleaved.py``. ``block=0``: no raw blocks,
    the host's wall time alone.
    """

    block: ClassVar[int] = 0  # set by main()
    batches: ClassVar[list[Any]] = []
    skip: ClassVar[int] = 0  # the fit's first steps, not timed (set by main())

    def __init__(self) -> None:
        self.seconds = self.raw = 0.0
        self._steps = 0
        self._start = 0.0
        self.switch: Switch | None = None  # set by a switched run
        self._others = 0.0  # the other threads' CPU seconds where the timing started
        if Clock.block:
            self._net = make_mlp()
            self._opt = torch.optim.SGD(self._net.parameters(), lr=LR)
            self._loss_fn = nn.CrossEntropyLoss()

    def begin(self) -> None:
        self._seen = 0
        self._restart()

    def _restart(self) -> None:
        self.raw, self._steps = 0.0, 0
        self._steps_ns: list[tuple[int, int]] = []  # each step's (ns, of them inside hooks)
        self._states: list[bool] = []  # each step's Switch.state
        if self.switch is not None and self._seen >= Clock.skip:  # the timing starts here
            self._others = self.switch.settle()
            self.switch.set(Switch.wanted(0))
        self._mark = (time.perf_counter_ns(), Inside.ns)
        self._start = time.perf_counter()

    def batch_end(self) -> None:
        self._seen += 1
        if self._seen <= Clock.skip:
            if self._seen == Clock.skip:
                self._restart()  # the run's start is over: time from here
            return
        self._steps += 1
        now, inside = time.perf_counter_ns(), Inside.ns
        self._steps_ns.append((now - self._mark[0], inside - self._mark[1]))
        self._mark = (now, inside)
        switch = self.switch
        if switch is not None:
            self._states.append(switch.state)
            if self._steps % Switch.every == 0:  # the next step starts a block
                switch.set(Switch.wanted(self._steps // Switch.every))
                self._mark = (time.perf_counter_ns(), Inside.ns)
            return
        if Clock.block and self._steps % Clock.block == 0:
            net, opt, loss_fn = self._net, self._opt, self._loss_fn
            start = time.perf_counter()
            for x, y in Clock.batches[: Clock.block]:
                opt.zero_grad()
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()
            self.raw += time.perf_counter() - start
            self._mark = (time.perf_counter_ns(), Inside.ns)  # the next step starts here

    def end(self) -> None:
        self.seconds = time.perf_counter() - self._start - self.raw
        label = Inside.current
        if label is None:
            return
        if self.switch is None:
            Inside.steps.setdefault(label, []).append(self._steps_ns)
            return
        steps = [(t, state) for (t, _), state in zip(self._steps_ns, self._states)]
        Switched.steps.setdefault(label, []).append(steps)
        others = self.switch.settle() - self._others
        Switched.others.setdefault(label, []).append(others)
        self.switch.set(True)

    def score(self) -> tuple[float, float]:
        """The host's seconds over the raw blocks' seconds (the seconds alone without raw
        blocks), and the host's seconds."""
        return (self.seconds / self.raw if self.raw else self.seconds), self.seconds


def stepwatch_callbacks(folder: str) -> list[Any]:
    """The bridge's load: every step's loss recorded, the detectors at their defaults."""
    db = os.path.join(folder, f"runs-{time.perf_counter_ns()}.db")
    return [RunRecorder(db=db, every_n_steps=1), AnomalyMonitor()]


# The variants of the third measurement (see :func:`switched`), in the order they run.
_SWITCHED = ("nothing switched", "no-op callback", "empty bridge", "stepwatch")


def switched_variants(
    runner: Callable[[Callable[[], list[Any]]], EpochRunner],
    noop: Callable[[], Any],
    bridge: Callable[[Any], Any],
    folder: str,
) -> dict[str, EpochRunner]:
    """A host's variants of :data:`_SWITCHED`: ``runner(callbacks)`` runs a switched fit with
    them, the last one the callback switched; ``noop`` makes the host's no-op callback and
    ``bridge`` its ``StepwatchCallback``."""
    made: tuple[Callable[[], list[Any]], ...] = (
        list,
        lambda: [noop()],
        lambda: [bridge([])],
        lambda: [bridge(stepwatch_callbacks(folder))],
    )
    return {name: runner(callbacks) for name, callbacks in zip(_SWITCHED, made)}


# -- Lightning --------------------------------------------------------------------------------
def lightning_variants(data: Data, folder: str, switched: bool = False) -> dict[str, EpochRunner]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from stepwatch.integrations.lightning import StepwatchCallback

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning(\.|$)")
    warnings.filterwarnings("ignore", module=r"torch\.utils\.tensorboard")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()
            self.loss_fn = nn.CrossEntropyLoss()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.clock = Clock()

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.clock.begin()

        def on_train_batch_end(self, *args: Any) -> None:
            self.clock.batch_end()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.clock.end()

    class Noop(pl.Callback):
        """Does nothing; defines the bridge's per-step hook, which Lightning calls on every
        callback anyway, so that it can be timed as the bridge's is."""

        def on_train_batch_end(self, *args: Any) -> None:
            pass

    module = Module()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data.x, data.y), batch_size=BATCH_SIZE
    )

    def runner(
        callbacks: Callable[[], list[Any]], logger: Callable[[], Any], switch: bool = False
    ) -> EpochRunner:
        def run() -> tuple[float, float]:
            timer = Timer()
            mine = callbacks()
            trainer = pl.Trainer(
                max_epochs=1,
                accelerator="cpu",
                devices=1,
                enable_progress_bar=False,
                enable_checkpointing=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                logger=logger(),
                log_every_n_steps=1,
                callbacks=[timer, *mine],
                default_root_dir=folder,
            )
            if switch:
                timer.clock.switch = Switch(lambda: trainer.callbacks, mine[-1] if mine else None)
            trainer.fit(module, train_dataloaders=loader)
            return timer.clock.score()

        return run

    if switched:
        return switched_variants(
            lambda made: runner(made, lambda: False, switch=True), Noop, StepwatchCallback, folder
        )
    return {
        "alone": runner(list, lambda: False),
        "alone'": runner(list, lambda: False),
        "no-op callback": runner(lambda: [timed(Noop())], lambda: False),
        "empty bridge": runner(lambda: [timed(StepwatchCallback([]))], lambda: False),
        "stepwatch": runner(
            lambda: [timed(StepwatchCallback(stepwatch_callbacks(folder)))], lambda: False
        ),
        "CSVLogger": runner(list, lambda: CSVLogger(folder)),
        "TensorBoardLogger": runner(list, lambda: TensorBoardLogger(folder)),
    }


# -- the Hugging Face Trainer -----------------------------------------------------------------
def transformers_variants(
    data: Data, folder: str, switched: bool = False
) -> dict[str, EpochRunner]:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stepwatch.integrations.transformers import StepwatchCallback

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module=r"torch\.utils\.tensorboard")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()
            self.loss_fn = nn.CrossEntropyLoss()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(x)
            return {"loss": self.loss_fn(logits, labels), "logits": logits}

    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(data.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": data.x[i], "labels": data.y[i]}

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.clock = Clock()

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.batch_end()

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.end()

    class Noop(TrainerCallback):
        """Does nothing; defines the bridge's per-step hooks, which the Trainer calls on every
        callback anyway, so that they can be timed as the bridge's are."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            pass

        def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            pass

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            pass

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            pass

    net, rows = Net(), Rows()

    wrapped: dict[int, Any] = {}  # a switched-out bridge's Trainer

    def hook_on(bridge: Any) -> None:
        # The bridge's wrapper of the Trainer's training_step, which reads the loss: on the
        # Trainer while the bridge is in.
        trainer = wrapped.pop(id(bridge), None)
        if trainer is not None:
            bridge._loss.wrap(trainer)

    def hook_off(bridge: Any) -> None:
        if isinstance(bridge, StepwatchCallback) and bridge._loss.trainer is not None:
            wrapped[id(bridge)] = bridge._loss.trainer
            bridge._loss.release()  # the wrapper, and the outputs hook if a step left it on

    def runner(
        callbacks: Callable[[], list[Any]], report_to: list[str], switch: bool = False
    ) -> EpochRunner:
        def run() -> tuple[float, float]:
            timer = Timer()
            mine = callbacks()
            args = TrainingArguments(
                output_dir=folder,
                per_device_train_batch_size=BATCH_SIZE,
                num_train_epochs=1,
                learning_rate=LR,
                optim="sgd",
                lr_scheduler_type="constant",
                use_cpu=True,
                save_strategy="no",
                logging_strategy="steps" if report_to else "no",
                logging_steps=1,
                report_to=report_to,
                disable_tqdm=True,
                dataloader_num_workers=0,
                remove_unused_columns=False,
                seed=SEED,
            )
            trainer = Trainer(model=net, args=args, train_dataset=rows, callbacks=[timer, *mine])
            for bridge in mine:  # as the docs show: the bridge reads the Trainer's own loss
                if isinstance(bridge, StepwatchCallback):
                    bridge.attach(trainer)
            if switch:
                timer.clock.switch = Switch(
                    lambda: trainer.callback_handler.callbacks,
                    mine[-1] if mine else None,
                    on=hook_on,
                    off=hook_off,
                )
            trainer.train()
            return timer.clock.score()

        return run

    if switched:
        return switched_variants(
            lambda made: runner(made, [], switch=True), Noop, StepwatchCallback, folder
        )
    return {
        "alone": runner(list, []),
        "alone'": runner(list, []),
        "no-op callback": runner(lambda: [timed(Noop())], []),
        "empty bridge": runner(lambda: [timed(StepwatchCallback([]))], []),
        "stepwatch": runner(lambda: [timed(StepwatchCallback(stepwatch_callbacks(folder)))], []),
        "tensorboard": runner(list, ["tensorboard"]),
    }


# -- Keras ------------------------------------------------------------------------------------
def keras_variants(data: Data, folder: str, switched: bool = False) -> dict[str, EpochRunner]:
    import keras

    from stepwatch.integrations.keras import StepwatchCallback

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

    class Timer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.clock = Clock()

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.clock.begin()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.clock.end()

    class BlockTimer(Timer):
        """The timer with raw blocks: it needs a batch-end hook, which makes Keras call
        every batch hook in line (see ``no-op callback``)."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.clock.batch_end()

    class BatchNoop(keras.callbacks.Callback):
        """A batch-end hook that does nothing: with one, Keras calls batch hooks in line
        rather than on its thread pool, as with the bridge."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            pass

    x, y = data.x.numpy(), data.y.numpy()

    def runner(
        callbacks: Callable[[], list[Any]], verbose: int = 0, switch: bool = False
    ) -> EpochRunner:
        def run() -> tuple[float, float]:
            timer = BlockTimer() if Clock.block or Clock.skip or switch else Timer()
            mine = callbacks()
            given: Any = [timer, *mine]
            if switch:  # the list that fit() would make, held here to take the callback out of
                given = keras.callbacks.CallbackList(
                    given,
                    add_history=True,
                    add_progbar=verbose != 0,
                    verbose=verbose,
                    epochs=1,
                    steps=-(-len(x) // BATCH_SIZE),
                    model=model,
                )
                timer.clock.switch = Switch(lambda: given.callbacks, mine[-1] if mine else None)
            model.fit(
                x,
                y,
                batch_size=BATCH_SIZE,
                epochs=1,
                shuffle=False,
                verbose=verbose,
                callbacks=given,
            )
            return timer.clock.score()

        return run

    if switched:
        return switched_variants(
            lambda made: runner(made, switch=True), BatchNoop, StepwatchCallback, folder
        )
    csv = os.path.join(folder, "keras.csv")
    variants = {
        "alone": runner(list),
        "alone'": runner(list),
        "no-op callback": runner(lambda: [timed(BatchNoop())]),
        "empty bridge": runner(lambda: [timed(StepwatchCallback([]))]),
        "stepwatch": runner(lambda: [timed(StepwatchCallback(stepwatch_callbacks(folder)))]),
        "CSVLogger": runner(lambda: [keras.callbacks.CSVLogger(csv)]),
        "progress bar": runner(list, verbose=1),
    }
    try:  # Keras's TensorBoard callback writes its events through TensorFlow's summary ops
        import tensorflow  # noqa: F401
    except ImportError:
        print(
            "  keras: its TensorBoard callback needs tensorflow (`make bench` installs it): "
            "left out",
            file=sys.stderr,
        )
    else:
        # Every step's loss as an event (update_freq=1), as the bridge records every step.
        # Its hooks are timed as the bridge's are, for the second table.
        events = os.path.join(folder, "keras-tensorboard")
        variants["TensorBoard"] = runner(
            lambda: [timed(keras.callbacks.TensorBoard(events, update_freq=1))]
        )
    return variants


HOSTS: dict[str, Callable[[Data, str, bool], dict[str, EpochRunner]]] = {
    "lightning": lightning_variants,
    "transformers": transformers_variants,
    "keras": keras_variants,
}


# -- measurement ------------------------------------------------------------------------------
@dataclass
class Pairs:
    host: str
    variant: str
    scores: list[float] = field(default_factory=list)  # Clock.score of each epoch
    alone: list[float] = field(default_factory=list)  # ... and of its paired epoch alone
    alone_seconds: list[float] = field(default_factory=list)
    # the epoch's median step over its paired epoch alone's, in microseconds
    median_extra: list[float] = field(default_factory=list)


def quiet(run: EpochRunner) -> tuple[float, float]:
    with (
        open(os.devnull, "w") as devnull,
        contextlib.redirect_stdout(devnull),
        contextlib.redirect_stderr(devnull),
    ):
        return run()


def one_epoch(label: str | None, run: EpochRunner) -> tuple[float, float]:
    """Run one epoch quietly, its step times kept under ``label`` (None: not kept)."""
    Inside.current = label
    return quiet(run)


def median_step(label: str) -> float:
    """The median step, in microseconds, of the newest epoch kept under ``label`` (its first
    timed step, which holds the epoch's start under ``--skip 0``, left out)."""
    return statistics.median(t for t, _ in Inside.steps[label][-1][1:]) / 1e3


def measure(host: str, data: Data, rounds: int) -> list[Pairs]:
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as folder:
        variants = HOSTS[host](data, folder, False)
        alone = variants.pop("alone")
        pairs = [Pairs(host, name) for name in variants]
        for index in range(rounds + 1):  # round 0: warm-up
            for p in pairs:
                gc.collect()
                mine = f"{host}/{p.variant}" if index else None  # (the warm-up is not kept)
                theirs = f"{host}/alone" if index else None
                if index % 2:
                    (t, _), (t_alone, s_alone) = (
                        one_epoch(mine, variants[p.variant]),
                        one_epoch(theirs, alone),
                    )
                else:
                    (t_alone, s_alone), (t, _) = (
                        one_epoch(theirs, alone),
                        one_epoch(mine, variants[p.variant]),
                    )
                if index:
                    p.scores.append(t)
                    p.alone.append(t_alone)
                    p.alone_seconds.append(s_alone)
                    p.median_extra.append(median_step(mine) - median_step(theirs))
            label = "warm-up" if index == 0 else f"round {index}/{rounds}"
            print(f"  {host}: {label} done", file=sys.stderr, flush=True)
    return pairs


# The variants that are not one of the host's own loggers.
_NOT_LOGGERS = ("stepwatch", "alone'", "no-op callback", "empty bridge")


def report(results: list[Pairs], steps: int) -> None:
    header = (
        f"{'host':<13} {'variant':<18} {'host us/step':>12} {'ratio to alone (min..max)':>27} "
        f"{'extra us/step':>14} {'extra %':>8} {'median step, extra':>19}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    by_host: dict[str, dict[str, float]] = {}
    for p in results:
        ratios = [a / t for t, a in zip(p.scores, p.alone)]
        step_us = statistics.median(p.alone_seconds) / steps * 1e6
        share = statistics.median(t / a - 1 for t, a in zip(p.scores, p.alone))
        by_host.setdefault(p.host, {})[p.variant] = share
        ratio = statistics.median(ratios)
        spread = f"{ratio:.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        extra = statistics.median(p.median_extra)
        by_median = f"{extra:+.1f} us {extra / step_us * 100:+.1f}%"
        print(
            f"{p.host:<13} {p.variant:<18} {step_us:>12.0f} {spread:>27} "
            f"{share * step_us:>14.1f} {share * 100:>7.1f}% {by_median:>19}"
        )
    print()
    for host, shares in by_host.items():
        bridge, noise = shares["stepwatch"], shares["alone'"]
        loggers = {k: v for k, v in shares.items() if k not in _NOT_LOGGERS}
        dispatch = shares["no-op callback"]
        # Judged by the larger of its cost over the host alone and over a no-op callback (a
        # host that runs faster with any callback, as Keras here, is judged by the second).
        judged = max(bridge, bridge - dispatch)
        cheaper = [k for k, v in loggers.items() if judged < v]
        verdicts.append(
            f"{host}: bridge {bridge * 100:+.1f}% of the host's step (goal <= {GOAL * 100:.0f}%: "
            f"{'met' if judged <= GOAL else 'NOT met'}); noise floor "
            f"{noise * 100:+.1f}%; a no-op callback {dispatch * 100:+.1f}% (the bridge over it: "
            f"{(bridge - dispatch) * 100:+.1f}%); the bridge with no callback in it "
            f"{shares['empty bridge'] * 100:+.1f}%; cheaper than "
            f"{', '.join(cheaper) if cheaper else 'none'} of {', '.join(loggers)}"
        )
    print("\n".join(verdicts))


# The host's loggers that are callbacks, their hooks timed as the bridge's are (the second
# table gives them a row): Keras's TensorBoard callback.
_TIMED_LOGGERS = ("TensorBoard",)

_PERIOD = 128  # AnomalyMonitor's clock: the losses and gradients are read every 128 steps


def after_steps(epochs: list[list[tuple[int, int]]]) -> float:
    """The host's extra microseconds a step, out of the bridge's hooks, at the steps that
    follow its wakes: per position of the step in its 128-step cycle, the median step time
    (the bridge's hooks taken out) over the quiet positions' median, summed and spread."""
    by_position: list[list[int]] = [[] for _ in range(_PERIOD)]
    for epoch in epochs:
        for index, (total, inside) in enumerate(epoch):
            by_position[(index + 1) % _PERIOD].append(total - inside)
    medians = [statistics.median(p) for p in by_position if p]
    quiet = statistics.median(medians)
    return sum(m - quiet for m in medians) / len(medians) / 1e3


def in_hooks(epochs: list[list[tuple[int, int]]]) -> tuple[float, float]:
    """The microseconds a step inside the bridge's hooks: (the mean over the positions in the
    128-step cycle of each position's median, the plain mean). The first counts a wake at its
    position and leaves out rare pauses that hit any code alike (a garbage collection, the
    OS); the second counts everything that happened inside the hooks. The first timed step
    (under ``--skip 0`` it also holds the bridge's epoch-begin hook) is left out of both."""
    by_position: list[list[int]] = [[] for _ in range(_PERIOD)]
    for epoch in epochs:
        for index, (_, inside) in enumerate(epoch):
            if index:
                by_position[(index + 1) % _PERIOD].append(inside)
    medians = [statistics.median(p) for p in by_position if p]
    every = [i for p in by_position for i in p]
    return statistics.fmean(medians) / 1e3, statistics.fmean(every) / 1e3


def direct_report(hosts: list[str]) -> None:
    """The bridge's cost within the run: the time inside its hooks, and the slower host steps
    after its wakes (over the same measure for the host alone, whose raw blocks leave their
    own)."""
    print()
    print(f"{'host':<13} {'variant':<14} {'host us/step':>12} {'in hooks':>9} {'after':>7} "
          f"{'total us':>9} {'share':>7}   {'(hooks: mean)':>13} {'share':>7}")  # fmt: skip
    print("-" * 101)
    for host in hosts:
        alone = Inside.steps.get(f"{host}/alone")
        if not alone:
            continue
        base = after_steps(alone)
        step_us = statistics.median(t for epoch in alone for t, _ in epoch) / 1e3
        noop = Inside.steps.get(f"{host}/no-op callback")
        calls = in_hooks(noop) if noop else (0.0, 0.0)
        totals: dict[str, float] = {}
        for variant in ("no-op callback", "empty bridge", "stepwatch", *_TIMED_LOGGERS):
            epochs = Inside.steps.get(f"{host}/{variant}")
            if not epochs:
                continue
            inside, mean = in_hooks(epochs)
            after = after_steps(epochs) - base
            total, total_mean = inside + after, mean + after
            totals[variant] = max(total, total_mean)
            print(f"{host:<13} {variant:<14} {step_us:>12.0f} {inside:>9.1f} {after:>7.1f} "
                  f"{total:>9.1f} {total / step_us * 100:>6.2f}%   {mean:>13.1f} "
                  f"{total_mean / step_us * 100:>6.2f}%")  # fmt: skip
            if variant == "stepwatch" and noop:
                over, over_mean = total - calls[0], total_mean - calls[1]
                verdict = "met" if max(over, over_mean) <= GOAL * step_us else "NOT met"
                print(f"{'':<13} {'  over no-op':<14} {'':>12} {inside - calls[0]:>9.1f} "
                      f"{'':>7} {over:>9.1f} {over / step_us * 100:>6.2f}%   "
                      f"{mean - calls[1]:>13.1f} {over_mean / step_us * 100:>6.2f}%   "
                      f"(goal <= {GOAL * 100:.0f}%: {verdict})")  # fmt: skip
        for logger in _TIMED_LOGGERS:
            if "stepwatch" in totals and logger in totals:
                bridge, theirs = totals["stepwatch"], totals[logger]
                print(f"{'':<13} the bridge {bridge:.1f} us/step against {logger}'s "
                      f"{theirs:.1f} (each the larger of its two totals): "
                      f"{'cheaper' if bridge < theirs else 'NOT cheaper'}")  # fmt: skip


# -- the callback switched on and off within each fit ----------------------------------------


def switched(host: str, data: Data, rounds: int) -> None:
    """Fits in which one callback is taken out of the host's list and put back every
    ``Switch.every`` steps (the variants of :data:`_SWITCHED`, interleaved, the order
    reversed every other round; round 0 a warm-up). No raw blocks: a block with the callback
    and the blocks either side of it without are a few milliseconds apart, so the machine's
    drift cancels at that scale."""
    block, Clock.block = Clock.block, 0
    try:
        with tempfile.TemporaryDirectory(prefix="stepwatch-bench-") as folder:
            variants = HOSTS[host](data, folder, True)
            for index in range(rounds + 1):
                order = list(_SWITCHED) if index % 2 else list(reversed(_SWITCHED))
                for name in order:
                    gc.collect()
                    label = f"{host}/{name}" if index else None
                    # The other threads' CPU over the whole fit, the run's one-off work in it.
                    others = time.process_time() - time.thread_time()
                    one_epoch(label, variants[name])
                    others = time.process_time() - time.thread_time() - others
                    if label is not None:
                        Switched.whole.setdefault(label, []).append(others)
                done = "warm-up" if index == 0 else f"round {index}/{rounds}"
                print(f"  {host}, switched: {done} done", file=sys.stderr, flush=True)
    finally:
        Clock.block = block


def on_minus_off(fit: list[tuple[int, bool]]) -> tuple[float, float, float, int]:
    """One switched fit: the mean step with the callback in minus the mean step without it,
    the same for the medians (both in microseconds), the median step without it, and the
    timed steps it saw (with it in). Each block's first step (it holds the switch) is left
    out of the step times."""
    on: list[int] = []
    off: list[int] = []
    for index, (ns, state) in enumerate(fit):
        if index % Switch.every:
            (on if state else off).append(ns)
    return (
        (statistics.fmean(on) - statistics.fmean(off)) / 1e3,
        (statistics.median(on) - statistics.median(off)) / 1e3,
        statistics.median(off) / 1e3,
        max(1, sum(state for _, state in fit)),
    )


def switched_report(hosts: list[str], rounds: int, steps: int) -> None:
    """Per variant, the median over fits of its with-minus-without steps, and the CPU time of
    the process's other threads (the recorder's writer) over the timed steps, per timed step
    the callback saw, over the same for the fits that switch nothing. The bridge is judged by
    its mean (AnomalyMonitor's wakes and any slower host code after its hooks included) plus
    that thread time. The ``run ms`` column is the other threads' CPU outside the timed steps
    (the writer's one-off work for a run: its first write and its close; the first ``--skip``
    steps' rows), per fit, over the same for the fits that switch nothing: a cost per run,
    not per step, shown beside."""
    print(
        f"\nThe callback taken out and put back every {Switch.every} steps within each fit of "
        f"{steps} timed steps (blocks off, on, on, off, ...; each block's first step left out), "
        f"{rounds} rounds (+1 warm-up), medians over the fits\n"
    )
    header = (
        f"{'host':<13} {'variant':<17} {'host us/step':>12} {'in-out mean':>16} "
        f"{'in-out median':>16} {'threads':>8} {'total':>16} {'run ms':>7}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    for host in hosts:
        floor_others = floor = floor_run = 0.0
        for name in _SWITCHED:
            fits = Switched.steps.get(f"{host}/{name}")
            if not fits:
                continue
            each = [on_minus_off(fit) for fit in fits]
            mean = statistics.median(e[0] for e in each)
            median = statistics.median(e[1] for e in each)
            step = statistics.median(e[2] for e in each)
            label = f"{host}/{name}"
            others = [seconds * 1e6 / e[3] for seconds, e in zip(Switched.others[label], each)]
            thread = statistics.median(others)
            pairs = zip(Switched.whole[label], Switched.others[label])
            run_ms = 1e3 * statistics.median(whole - window for whole, window in pairs)
            if name == "nothing switched":
                floor_others, floor_run = thread, run_ms
            thread = max(0.0, thread - floor_others) if name != "nothing switched" else 0.0
            run_ms = run_ms - floor_run if name != "nothing switched" else 0.0
            total = mean + thread

            def cell(us: float, step: float = step) -> str:
                return f"{us:+.1f} us {us / step * 100:+.2f}%"

            print(
                f"{host:<13} {name:<17} {step:>12.0f} {cell(mean):>16} {cell(median):>16} "
                f"{thread:>8.1f} {cell(total):>16} {run_ms:>7.2f}"
            )
            if name == "nothing switched":
                floor = mean / step
            if name == "stepwatch":
                share = total / step
                verdicts.append(
                    f"{host}: the bridge {share * 100:+.2f}% of the host's step, in against out "
                    f"of the host's callbacks (goal <= {GOAL * 100:.0f}%: "
                    f"{'met' if share <= GOAL else 'NOT met'}); the method's floor "
                    f"{floor * 100:+.2f}%; the writer's work once per run {run_ms:.1f} ms"
                )
    print()
    print("\n".join(verdicts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=9,
        help="measured rounds (default 9; 0: the third measurement only)",
    )
    parser.add_argument("--steps", type=int, default=400, help="steps per epoch (default 400)")
    parser.add_argument("--hosts", default=",".join(HOSTS), help="comma-separated hosts")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 100 steps")
    parser.add_argument(
        "--block",
        type=int,
        default=50,
        help="raw-loop steps run after every this many host steps, to score each epoch "
        "against (default 50; 0: the host's wall time alone)",
    )
    parser.add_argument(
        "--skip",
        type=int,
        default=128,
        help="steps at the start of each fit run before its timing starts (default 128: "
        "AnomalyMonitor's first 104 steps read the losses every 8 steps and the gradients "
        "every 10; 0: the fit's start timed too)",
    )
    parser.add_argument(
        "--switch",
        type=int,
        default=10,
        help="the third measurement: the callback taken out of the host's list and put back "
        "every this many steps within each fit (default 10; 0: left out)",
    )
    parser.add_argument(
        "--switch-rounds",
        type=int,
        default=20,
        help="rounds of the third measurement (default 20)",
    )
    parser.add_argument(
        "--switch-steps",
        type=int,
        default=1200,
        help="timed steps of each fit of the third measurement (default 1200: over a second, "
        "so that the recorder's writer writes within them as often as in a long run)",
    )
    args = parser.parse_args(argv)
    rounds, steps = (2, 100) if args.quick else (args.rounds, args.steps)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    unknown = [h for h in hosts if h not in HOSTS]
    if unknown:
        parser.error(f"--hosts: unknown {', '.join(unknown)}; choose from {', '.join(HOSTS)}")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    logging.getLogger("stepwatch").setLevel(logging.ERROR)
    if args.skip < 0:
        parser.error(f"--skip must be >= 0, got {args.skip}")
    data = make_data(args.skip + steps)
    if args.block < 0:
        parser.error(f"--block must be >= 0, got {args.block}")
    Clock.block, Clock.batches = args.block, list(reversed(data.batches))
    Clock.skip = args.skip
    for flag, value in (
        ("--rounds", args.rounds),
        ("--switch", args.switch),
        ("--switch-rounds", args.switch_rounds),
        ("--switch-steps", args.switch_steps),
    ):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value}")
    switch_rounds = 2 if args.quick else args.switch_rounds
    switch_steps = 100 if args.quick else args.switch_steps
    if args.switch and switch_steps < 4 * args.switch:
        parser.error(
            f"--switch-steps must be at least 4 blocks of --switch {args.switch}, "
            f"got {switch_steps}"
        )
    if not rounds and not (args.switch and switch_rounds):
        parser.error("nothing to measure: --rounds 0 with --switch 0 or --switch-rounds 0")
    Switch.every = args.switch
    switch_data = make_data(args.skip + switch_steps) if args.switch and switch_rounds else data
    results: list[Pairs] = []
    for host in hosts:
        if rounds:
            results += measure(host, data, rounds)
        if args.switch and switch_rounds:
            switched(host, switch_data, switch_rounds)
    print(
        f"\n{steps} steps of {BATCH_SIZE} per epoch timed after the first {args.skip}, "
        f"{rounds} rounds (+1 warm-up), "
        f"{f'raw blocks of {args.block} steps' if args.block else 'no raw blocks'}, torch "
        f"{torch.__version__}, 1 thread\n"
    )
    if rounds:
        report(results, steps)
        direct_report(hosts)
    if args.switch and switch_rounds:
        switched_report(hosts, switch_rounds, switch_steps)


if __name__ == "__main__":
    main()
