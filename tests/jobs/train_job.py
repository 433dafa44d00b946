"""A training job run as a subprocess by the kill, resume and signal tests.

python -m tests.jobs.train_job MODE DIR [ARG]

MODE:
  kill-after-epoch N   train 6 epochs with checkpoints; SIGKILL itself at the end of epoch N
  kill-after-step N    the same, SIGKILL right after global step N (mid-epoch)
  save-forever         save a checkpoint every step until killed
  wait-for-sigterm     train with OnRequestExit until a signal arrives
  crash-at-epoch N     train with BackupAndRestore; raise at the end of epoch N
  sigterm-at-step N    record into DIR/runs.db (nothing written for 60 s); SIGTERM itself at
                       global step N, with no handler of its own
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stepwatch import (
    BackupAndRestore,
    Callback,
    CheckpointConfig,
    EarlyStopping,
    Model,
    ModelCheckpoint,
    NumpySlicesDataset,
    OnRequestExit,
    ReduceLROnPlateau,
    RunContext,
    RunRecorder,
)

EPOCHS = 6


def build(width: int = 16) -> tuple[Model, Any, Any]:
    """The same model, data and optimizer every time (shuffling and dropout included)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = ((x[:, 0] + 0.5 * rng.normal(size=256)) > 0).astype(np.int64)
    train = NumpySlicesDataset((x, y), shuffle=True).batch(32)
    valid = NumpySlicesDataset((x[:64], y[:64])).batch(32)
    net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 2))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.02)
    model = Model(net, nn.CrossEntropyLoss(), optimizer, metrics={"accuracy"}, device="cpu")
    return model, train, valid


def steering() -> list[Callback]:
    """Stateful callbacks whose state a resumed run must keep."""
    return [
        EarlyStopping(monitor="eval_loss", patience=20, min_delta=0.05),
        ReduceLROnPlateau(monitor="eval_loss", patience=1, factor=0.5, min_delta=0.05),
    ]


class KillSelf(Callback):
    order = 1000  # after ModelCheckpoint has written the epoch's file

    def __init__(self, epoch: int = 0, step: int = 0) -> None:
        self.epoch, self.step = epoch, step

    def on_train_step_end(self, run_context: RunContext) -> None:
        if run_context.original_args().cur_step_num == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        if run_context.original_args().cur_epoch_num == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


class TermSelf(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, run_context: RunContext) -> None:
        if run_context.original_args().cur_step_num == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Crash(Callback):
    order = 1000

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        if run_context.original_args().cur_epoch_num == self.epoch:
            raise RuntimeError(f"simulated crash at epoch {self.epoch}")


class Announce(Callback):
    """Prints 'ready' once training is under way, for the parent to time its signal."""

    def on_train_step_end(self, run_context: RunContext) -> None:
        if run_context.original_args().cur_step_num == 2:
            print("ready", flush=True)


def main(argv: list[str]) -> None:
    mode, directory = argv[0], Path(argv[1])
    arg = int(argv[2]) if len(argv) > 2 else 0
    if mode == "kill-after-epoch" or mode == "kill-after-step":
        model, train, valid = build()
        config = CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=100)
        killer = KillSelf(epoch=arg) if mode == "kill-after-epoch" else KillSelf(step=arg)
        callbacks = [*steering(), ModelCheckpoint(directory=directory, config=config), killer]
        model.fit(EPOCHS, train, valid, callbacks=callbacks)
    elif mode == "save-forever":
        model, train, valid = build(width=1024)
        config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=3)
        model.train(10_000, train, callbacks=[ModelCheckpoint(directory=directory, config=config)])
    elif mode == "wait-for-sigterm":
        model, train, valid = build()
        callbacks = [Announce(), OnRequestExit(directory=directory, file_name="exit")]
        model.fit(100_000, train, valid, callbacks=callbacks)
        print("clean exit", flush=True)
    elif mode == "sigterm-at-step":
        model, train, _ = build()
        recorder = RunRecorder(db=directory / "runs.db", flush_seconds=60, transfer_every=256)
        model.train(EPOCHS, train, callbacks=[recorder, TermSelf(arg)])
    elif mode == "crash-at-epoch":
        model, train, valid = build()
        callbacks = [*steering(), BackupAndRestore(directory), Crash(arg)]
        model.fit(EPOCHS, train, valid, callbacks=callbacks)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
