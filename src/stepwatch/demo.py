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
from .store import RunRecorder
from .train import (
    CheckpointConfig,
    EarlyStopping,
    History,
    LossMonitor,
    Model,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TimeMonitor,
)

__all__ = ["load_digits_datasets", "run_demo"]


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


def run_demo(
    epochs: int = 20,
    seed: int = 0,
    device: str | None = None,
    checkpoint_dir: str = "checkpoints",
    db: str | None = None,
    amp_level: str = "O0",
) -> dict[str, Any]:
    """Train the digits classifier; return what it produced.

    Returns:
        ``{"metrics": final validation metrics, "history": the History callback,
        "best_checkpoint": its file name, "run_id": the run's id in the store, "db": the
        store's path}``. ``stepwatch demo`` prints the store's runs table from these.

    Early stopping ends the run when the validation loss stalls, the learning rate halves on a
    plateau, and the best model (by validation accuracy) is kept in ``checkpoint_dir``. The
    run is recorded in the run store ``db`` (default ``$STEPWATCH_DB`` or ``./stepwatch.db``).
    """
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
        config={"seed": seed, "batch_size": 32, "hidden": 128, "precision": model.precision},
    )
    steps = train.get_dataset_size()
    print(
        f"stepwatch demo: {train.num_rows} training and {valid.num_rows} validation digits, "
        f"{steps} steps per epoch, {epochs} epochs on {model.device}"
        + (f", precision {model.precision}" if model.precision != "32" else ""),
        flush=True,
    )
    model.fit(
        epochs,
        train,
        valid,
        callbacks=[
            LossMonitor(per_print_times=steps // 2),
            TimeMonitor(),
            history,
            EarlyStopping(monitor="eval_loss", patience=3, min_delta=1e-3, verbose=True),
            ReduceLROnPlateau(monitor="eval_loss", factor=0.5, patience=1, verbose=True),
            best,
            recorder,
        ],
    )
    final = model.eval(valid)
    accuracies = history.history["accuracy"]
    best_index = int(np.nanargmax(accuracies))
    print(
        f"validation accuracy: {final['accuracy']:.4f} "
        f"(best {accuracies[best_index]:.4f} at epoch {history.epoch['epoch'][best_index]})",
        flush=True,
    )
    print(f"best checkpoint: {best.best_ckpt_file_name}", flush=True)
    return {
        "metrics": final,
        "history": history,
        "best_checkpoint": best.best_ckpt_file_name,
        "run_id": recorder.run_id,
        "db": recorder.writer.path if recorder.writer is not None else None,
    }
