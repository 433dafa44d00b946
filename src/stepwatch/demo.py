"""The demo: a small network learns scikit-learn's bundled handwritten digits.

``stepwatch demo`` trains with ``fit`` + validation and the built-in monitors, prints
MindSpore-format lines and ends with the validation accuracy. The data (1,797 8x8 images) ships
inside scikit-learn; nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from .dataset import NumpySlicesDataset
from .distributed import rank_and_world, shutdown
from .store import RunRecorder
from .train import (
    AnomalyMonitor,
    Callback,
    CheckpointConfig,
    DistributedMonitor,
    EarlyStopping,
    History,
    LossMonitor,
    Model,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TimeMonitor,
)

__all__ = ["INJECTIONS", "load_digits_datasets", "run_demo", "run_demo_distributed"]

# What `--inject` breaks, at the start of the 10th step of the sixth epoch (past the detectors'
# warm-up), and the action the demo's AnomalyMonitor then takes on any alert.
INJECTIONS = {
    "nan": ("a NaN into the first layer's weights", "stop"),
    "spike": ("one corrupt batch: inputs x60, labels shuffled", "rollback"),
    "diverge": ("the learning rate x500", "rollback"),
    "explode": ("the last layer's weights x300", ["snapshot", "stop"]),
}


class _Inject(Callback):
    def __init__(self, what: str, step: int) -> None:
        self.what, self.step = what, step

    def on_train_step_begin(self, run_context: Any) -> None:
        p = run_context.original_args()
        if p.cur_step_num != self.step:
            return
        net = p.train_network
        if p.rank_id == 0:
            print(f"** injecting {INJECTIONS[self.what][0]} at step {self.step}", flush=True)
        with torch.no_grad():
            if self.what == "nan":
                net[0].weight[0, 0] = float("nan")
            elif self.what == "spike":
                data, label = p.train_dataset_element
                data.mul_(60)
                label.copy_(label[torch.randperm(len(label))])
            elif self.what == "diverge":
                for group in p.optimizer.param_groups:
                    group["lr"] *= 500
            else:
                net[2].weight.mul_(300)


def load_digits_datasets(
    batch_size: int = 32, seed: int = 0, valid_fraction: float = 0.2
) -> tuple[NumpySlicesDataset, NumpySlicesDataset]:
    """The digits as (train, validation) datasets of ``(image[64], label)`` batches."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise RuntimeError(
            "the demo needs scikit-learn for its bundled digits data: pip install 'stepwatch[demo]'"
        ) from exc
    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    labels = labels.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_valid = int(len(labels) * valid_fraction)
    valid_idx, train_idx = order[:n_valid], order[n_valid:]
    train = NumpySlicesDataset(
        (images[train_idx], labels[train_idx]), column_names=["image", "label"], shuffle=True
    ).batch(batch_size)
    valid = NumpySlicesDataset(
        (images[valid_idx], labels[valid_idx]), column_names=["image", "label"]
    ).batch(batch_size)
    return train, valid


class _Ending(Callback):
    kind: str | None = None
    step = 0

    def on_train_end(self, run_context: Any) -> None:
        self.kind, self.step = run_context.stop_kind, run_context.original_args().cur_step_num


def run_demo(
    epochs: int = 20,
    seed: int = 0,
    device: str | None = None,
    checkpoint_dir: str = "checkpoints",
    db: str | None = None,
    amp_level: str = "O0",
    inject: str | None = None,
) -> dict[str, Any]:
    """Train the digits classifier; return what it produced.

    Returns:
        ``{"metrics": final validation metrics, "history": the History callback,
        "best_checkpoint": its file name, "run_id": the run's id in the store, "db": the
        store's path}``. ``stepwatch demo`` prints the store's runs table from these.

    Early stopping ends the run when the validation loss stalls, the learning rate halves on a
    plateau, and the best model (by validation accuracy) is kept in ``checkpoint_dir``. The
    run is recorded in the run store ``db`` (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).
    An AnomalyMonitor watches the run; ``inject`` (a key of :data:`INJECTIONS`) breaks it on
    purpose, to show an alert and what its action does.
    """
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"'inject' must be one of {sorted(INJECTIONS)}, but got {inject!r}.")
    torch.manual_seed(seed)
    train, valid = load_digits_datasets(seed=seed)
    network = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(network.parameters(), lr=2e-3)
    model = Model(
        network,
        nn.CrossEntropyLoss(),
        optimizer,
        metrics={"accuracy"},
        device=device,
        amp_level=amp_level,
    )
    history = History()
    best = ModelCheckpoint(
        prefix="digits",
        directory=checkpoint_dir,
        config=CheckpointConfig(
            save_best_only=True, monitor="eval_accuracy", keep_checkpoint_max=1, save_last=False
        ),
    )
    recorder = RunRecorder(
        db=db,
        run_name="digits-demo",
        config={
            "seed": seed,
            "batch_size": 32,
            "hidden": 128,
            "precision": model.precision,
            "inject": inject,  # so that compare tells a broken run from a healthy one
        },
    )
    rank, world = rank_and_world()
    say = print if rank == 0 else _quiet
    steps = -(-train.get_dataset_size() // world)  # per rank: each trains its share
    actions: Any = "warn"
    extra: list[Callback] = []
    if inject is not None:
        actions = INJECTIONS[inject][1]
        extra.append(_Inject(inject, min(5, epochs - 1) * steps + 10))
    anomaly = AnomalyMonitor(action=actions, snapshot_dir=f"{checkpoint_dir}/anomaly")
    ending = _Ending()
    say(
        f"stepwatch demo: {train.num_rows} training and {valid.num_rows} validation digits, "
        f"{steps} steps per epoch, {epochs} epochs on {model.device}"
        + (f", precision {model.precision}" if model.precision != "32" else "")
        + (f", {world} processes" if world > 1 else ""),
        flush=True,
    )
    watch_ranks = [DistributedMonitor(every_n_steps=max(steps // 2, 1))] if world > 1 else []
    model.fit(
        epochs,
        train,
        valid,
        callbacks=[
            *extra,
            anomaly,
            ending,
            LossMonitor(per_print_times=steps // 2),
            TimeMonitor(),
            history,
            EarlyStopping(monitor="eval_loss", patience=3, min_delta=1e-3, verbose=True),
            ReduceLROnPlateau(monitor="eval_loss", factor=0.5, patience=1, verbose=True),
            best,
            recorder,
            *watch_ranks,
        ],
    )
    for alert, outcome in zip(anomaly.alerts, anomaly.outcomes):
        say(f"** alert at step {alert.step}: {alert.kind} -> {outcome or 'warned'}", flush=True)
    if inject is not None:
        ended = (
            f"stopped ({ending.kind}) at step {ending.step}" if ending.kind else "ran to the end"
        )
        say(f"** the run {ended}", flush=True)
    final = model.eval(valid)
    accuracies = history.history["accuracy"]
    best_index = int(np.nanargmax(accuracies))
    say(
        f"validation accuracy: {final['accuracy']:.4f} "
        f"(best {accuracies[best_index]:.4f} at epoch {history.epoch['epoch'][best_index]})",
        flush=True,
    )
    say(f"best checkpoint: {best.best_ckpt_file_name}", flush=True)
    return {
        "metrics": final,
        "history": history,
        "best_checkpoint": best.best_ckpt_file_name,
        "run_id": recorder.run_id,
        "alerts": anomaly.alerts,
        "db": recorder.writer.path if recorder.writer is not None else None,
    }


def _quiet(*args: Any, **kwargs: Any) -> None:
    """``print`` on the ranks that do not print."""


def _demo_rank(kwargs: dict[str, Any]) -> dict[str, Any]:
    """One process of ``run_demo_distributed``: join the process group, run the demo, leave."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = kwargs.get("device") != "cpu" and torch.cuda.device_count() >= world
    if not cuda:
        kwargs = {**kwargs, "device": "cpu"}
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        result = run_demo(**kwargs)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    shutdown()  # every rank leaves together
    metrics = {k: float(v) for k, v in result["metrics"].items()}
    db = result["db"]
    return {**result, "metrics": metrics, "history": None, "db": str(db) if db else None}


def run_demo_distributed(nproc: int = 2, **kwargs: Any) -> dict[str, Any]:
    """:func:`run_demo` on ``nproc`` local processes, data-parallel (gloo on the CPU; NCCL when
    there is a GPU per process), started with torchrun's launcher API - the same path as
    ``torchrun --nproc-per-node N``. Returns rank 0's result (``history`` is None: it stays
    in its process); the run store holds the one run, recorded by rank 0.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id="stepwatch-demo",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    results = elastic_launch(config, _demo_rank)(kwargs)
    return dict(results[0])
