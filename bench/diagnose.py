"""The labelled scenario suite for ``AnomalyMonitor()`` at its defaults.

Seeded CPU runs with known ground truth: healthy runs that must raise no alert, and one run
per fault kind with the step where the fault starts. The healthy runs come in three sets: a
tuning set; a held-out set that the defaults were not adjusted on until the loss detectors
were rebuilt on the loss's own scale (their recorded losses were among those that rebuild
was checked on); and a fresh set, written after those defaults were fixed (its first run
raised one false ``grad_explosion``, a 6.4x norm of a batch of 8, after which that detector's
``factor`` went from 3 to 10; bench/RESULTS.md has both runs).

For each run it prints the expected kind, the alerts seen and the detection delay (steps
from the fault's onset to the step at which the alert was raised; for overfitting,
evaluations from the validation loss's clear rise); then recall, the median delay and the
false alarms of each healthy set; then, per detector, its false alarms over all healthy runs
(and per 100,000 healthy steps) and its median and worst delay over the faults it is for, as
a Markdown table.

    python bench/diagnose.py            # the whole suite, with its tables
    python bench/diagnose.py --only nan spike

``tests/test_diagnose.py`` runs it in ``make test`` and checks the goals in ``GOALS``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import stepwatch as sw
from stepwatch.monitor.detectors import DETECTORS, Alert

# Goals at default settings: (max delay, unit) per expected kind.
GOALS: dict[str, tuple[int, str]] = {
    "nonfinite": (10, "steps"),
    "spike": (10, "steps"),
    "divergence": (10, "steps"),
    "grad_explosion": (10, "steps"),
    "dying_relu": (100, "steps"),
    "grad_vanishing": (100, "steps"),
    "plateau": (700, "steps"),
    "overfitting": (4, "evals"),
    "not_learning": (400, "steps"),
    "lr_negligible": (400, "steps"),
    "saturation": (100, "steps"),
    "worse_than_chance": (600, "steps"),
    "recurring_batch": (400, "steps"),
}


@dataclass
class Scenario:
    name: str
    expected: str | None  # None: healthy
    held_out: bool = False  # healthy runs the defaults were not adjusted on (see above)
    onset: int = 0  # the fault's first step (1 for a fault present from the start)
    build: Callable[[], dict[str, Any]] = field(default=lambda: {})
    fresh: bool = False  # held out, and written after the defaults were fixed


@dataclass
class Result:
    scenario: Scenario
    alerts: list[tuple[Alert, int]]  # (alert, the step at which it was raised)
    steps: int
    seconds: float
    delay: float | None = None
    evals: list[float] = field(default_factory=list)

    @property
    def caught(self) -> bool:
        return self.delay is not None


# -- data and networks ------------------------------------------------------------------------
def _classes(
    n: int, dim: int, seed: int, noise: float = 0.0, classes: int = 4, sample: int = 0
) -> Any:
    """``n`` samples of the task ``seed`` (its teacher network); ``sample`` picks the draw, so
    a validation set is ``sample=1`` of the same task."""
    teacher = np.random.default_rng(seed)
    w1 = teacher.standard_normal((dim, 16))
    w2 = teacher.standard_normal((16, classes))
    gen = np.random.default_rng([seed, sample])
    x = gen.standard_normal((n, dim)).astype(np.float32)
    y = (np.tanh(x @ w1) @ w2).argmax(1)
    flip = gen.random(n) < noise
    y[flip] = gen.integers(0, classes, flip.sum())
    return x, y.astype(np.int64)


def _separable(n: int, dim: int, seed: int) -> Any:
    """``n`` samples of two classes split by a plane with a margin, the inputs x10: a linear
    model trained with SGD at lr 0.1 fits them within a few steps, after which most batch
    losses are exactly 0 (the rest tiny)."""
    gen = np.random.default_rng(seed)
    w = gen.standard_normal(dim)
    x = gen.standard_normal((n * 4, dim))
    x = x[np.abs(x @ w) / np.linalg.norm(w) > 0.2][:n]
    return (x * 10).astype(np.float32), (x @ w > 0).astype(np.int64)


def _images(n: int, seed: int, sample: int = 0) -> Any:
    w = np.random.default_rng(seed).standard_normal((64, 4))
    gen = np.random.default_rng([seed, sample])
    x = gen.standard_normal((n, 1, 8, 8)).astype(np.float32)
    y = (x.reshape(n, 64) @ w).argmax(1).astype(np.int64)
    return x, y


def _regression(
    n: int, dim: int, seed: int, noise: Callable[[Any, int], Any], sample: int = 0
) -> Any:
    w = np.random.default_rng(seed).standard_normal((dim, 1))
    gen = np.random.default_rng([seed, sample])
    x = gen.standard_normal((n, dim)).astype(np.float32)
    y = x @ w + noise(gen, n).reshape(n, 1)
    return x, y.astype(np.float32)


def _mlp(dim: int, out: int, act: type[nn.Module], hidden: int = 32, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = []
    width = dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), act()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, out))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 4),
    )  # fmt: skip


def _ds(data: Any, batch: int, shuffle: bool = True) -> Any:
    return sw.NumpySlicesDataset(data, shuffle=shuffle).batch(batch)


def _warmup_cosine(optimizer: Any, warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _At(sw.Callback):
    """Run ``fn(cb_params)`` at the start of step ``step``."""

    def __init__(self, step: int, fn: Callable[[Any], None]) -> None:
        self.step, self.fn = step, fn

    def on_train_step_begin(self, run_context: Any) -> None:
        p = run_context.original_args()
        if p.cur_step_num == self.step:
            with torch.no_grad():
                self.fn(p)


class _BadBatch:
    """Batches of ``dataset``; the ``at``-th batch of every epoch has its labels scrambled (the
    same bad shard each epoch): its loss is a few times its neighbours'."""

    def __init__(self, dataset: Any, at: int, seed: int) -> None:
        self.dataset, self.at = dataset, at
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Any:
        for i, (x, y) in enumerate(self.dataset, 1):
            yield (x, (y + 1 + i % 3) % 4) if i == self.at else (x, y)


class _Scaled:
    """The batches of a list, the run's ``step``-th one with its inputs x ``by``."""

    def __init__(self, batches: list[Any], step: int, by: float) -> None:
        self.batches, self.step, self.by, self.seen = batches, step, by, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for x, y in self.batches:
            self.seen += 1
            yield (x * self.by, y) if self.seen == self.step else (x, y)


class _Corrupt:
    """Batches of ``dataset``; from the second epoch on, the ``at``-th batch of each epoch has
    its inputs x60 and its labels scrambled."""

    def __init__(self, dataset: Any, at: int, seed: int) -> None:
        self.dataset, self.at, self.epoch = dataset, at, 0
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Any:
        self.epoch += 1
        for i, (x, y) in enumerate(self.dataset, 1):
            if self.epoch > 1 and i == self.at:
                x, y = x * 60, y[torch.randperm(len(y), generator=self.gen)]
            yield x, y


def _run(
    net: nn.Module, data: Any, epochs: int, *, lr: float, adam: bool = False,
    loss: nn.Module | None = None, valid: Any = None, schedule: Any = None,
    inject: list[sw.Callback] | None = None, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    opt_cls = torch.optim.Adam if adam else torch.optim.SGD
    kwargs = {} if adam else {"momentum": 0.9}
    optimizer = opt_cls(net.parameters(), lr=lr, **kwargs)
    steps = epochs * len(data)
    sched = schedule(optimizer, steps) if schedule is not None else None
    return {
        "network": net, "loss": loss or nn.CrossEntropyLoss(), "optimizer": optimizer,
        "data": data, "valid": valid, "epochs": epochs, "schedule": sched,
        "inject": inject or [], "seed": seed, "interval": "step",
    }  # fmt: skip


def _step_lr(every: int) -> Callable[[Any, int], Any]:
    return lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, every, gamma=0.3)


def _cosine(warmup: int) -> Callable[[Any, int], Any]:
    return lambda opt, total: _warmup_cosine(opt, warmup, total)


def _t_noise(df: float) -> Callable[[Any, int], Any]:
    return lambda gen, n: gen.standard_t(df, n)


# -- the scenarios ----------------------------------------------------------------------------
def _healthy() -> list[Scenario]:
    def relu_sgd_step() -> dict[str, Any]:
        torch.manual_seed(0)
        valid = _ds(_classes(128, 20, 0, sample=1), 32)
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(4096, 20, 0), 16), 12, lr=0.05,
                    valid=valid, schedule=_step_lr(1200))  # fmt: skip

    def tanh_adam_cosine() -> dict[str, Any]:
        torch.manual_seed(1)
        return _run(_mlp(20, 4, nn.Tanh), _ds(_classes(2048, 20, 1), 16), 20, lr=3e-3,
                    adam=True, schedule=_cosine(200))  # fmt: skip

    def label_noise() -> dict[str, Any]:
        torch.manual_seed(2)
        valid = _ds(_classes(256, 20, 2, noise=0.3, sample=1), 64)
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(8192, 20, 2, noise=0.3), 32), 8,
                    lr=1e-3, adam=True, valid=valid)  # fmt: skip

    def cnn() -> dict[str, Any]:
        torch.manual_seed(3)
        return _run(_cnn(), _ds(_images(2048, 3), 16), 10, lr=0.02,
                    valid=_ds(_images(256, 3, sample=1), 64))  # fmt: skip

    def heavy_tails() -> dict[str, Any]:
        torch.manual_seed(4)
        data = _ds(_regression(4096, 10, 4, _t_noise(3.0)), 8)
        return _run(_mlp(10, 1, nn.ReLU), data, 6, lr=2e-3, loss=nn.MSELoss())

    def tiny_batches() -> dict[str, Any]:
        torch.manual_seed(5)
        valid = _ds(_classes(64, 20, 5, sample=1), 16)
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(4096, 20, 5), 4), 3, lr=0.01,
                    valid=valid, schedule=_cosine(300))  # fmt: skip

    def held_gelu_adam() -> dict[str, Any]:
        torch.manual_seed(10)
        return _run(_mlp(24, 5, nn.GELU, hidden=64), _ds(_classes(4096, 24, 10, classes=5), 16),
                    12, lr=2e-3, adam=True, schedule=_step_lr(1000),
                    valid=_ds(_classes(200, 24, 10, classes=5, sample=1), 50))  # fmt: skip

    def held_laplace() -> dict[str, Any]:
        torch.manual_seed(11)
        data = _ds(_regression(4096, 16, 11, lambda g, n: g.laplace(0, 2.0, n)), 16)
        return _run(_mlp(16, 1, nn.Tanh), data, 10, lr=3e-3, adam=True, loss=nn.MSELoss(),
                    schedule=_cosine(100))  # fmt: skip

    def held_cnn_noise() -> dict[str, Any]:
        torch.manual_seed(12)
        return _run(_cnn(), _ds(_images(4096, 12), 32), 8, lr=1e-3, adam=True,
                    valid=_ds(_images(128, 12, sample=1), 32))  # fmt: skip

    def held_deep_tanh() -> dict[str, Any]:
        torch.manual_seed(13)
        return _run(_mlp(20, 4, nn.Tanh, depth=6), _ds(_classes(2048, 20, 13, noise=0.1), 8), 8,
                    lr=0.02)  # fmt: skip

    def held_batch2() -> dict[str, Any]:
        torch.manual_seed(14)
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(768, 20, 14), 2), 8, lr=1e-3, adam=True)

    def held_t25() -> dict[str, Any]:
        torch.manual_seed(15)
        data = _ds(_regression(2048, 8, 15, _t_noise(2.5)), 16)
        return _run(_mlp(8, 1, nn.ReLU), data, 12, lr=3e-3, adam=True, loss=nn.MSELoss(),
                    valid=_ds(_regression(256, 8, 15, _t_noise(2.5), sample=1), 64))  # fmt: skip

    def label_smoothing() -> dict[str, Any]:
        torch.manual_seed(16)
        loss = nn.CrossEntropyLoss(label_smoothing=0.4)  # a loss floor high above 0
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(2048, 20, 16), 16), 6, lr=0.05, loss=loss)

    def warmup_from_zero() -> dict[str, Any]:
        torch.manual_seed(17)
        warm = lambda opt, total: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
            opt, lambda step: min(1.0, step / 400)
        )
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(2048, 20, 17), 16), 6, lr=0.05,
                    schedule=warm)  # fmt: skip

    def cosine_to_zero() -> dict[str, Any]:
        torch.manual_seed(18)
        cosine = lambda opt, total: torch.optim.lr_scheduler.CosineAnnealingLR(  # noqa: E731
            opt, total, eta_min=0.0
        )
        return _run(_mlp(20, 4, nn.Tanh), _ds(_classes(2048, 20, 18), 16), 6, lr=0.05,
                    schedule=cosine)  # fmt: skip

    def step_decay_valid() -> dict[str, Any]:
        torch.manual_seed(19)
        decay = lambda opt, total: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.1)  # noqa: E731
        run = _run(_mlp(20, 4, nn.ReLU), _ds(_classes(2048, 20, 19), 16), 8, lr=0.05,
                   schedule=decay, valid=_ds(_classes(256, 20, 19, sample=1), 64))  # fmt: skip
        run["interval"] = "epoch"  # decays x0.1 every 2 epochs: 1e-3 of its start by epoch 7
        return run

    def dropout_batch8() -> dict[str, Any]:
        torch.manual_seed(28)
        net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
        return _run(net, _ds(_classes(2048, 20, 28, noise=0.1), 8), 4, lr=0.02)

    def regression_thousands() -> dict[str, Any]:
        torch.manual_seed(29)
        x, y = _regression(2048, 10, 29, lambda g, n: g.standard_normal(n))
        data = _ds((x, y * 60.0 + 40.0), 16)  # MSE in the thousands at the start
        return _run(_mlp(10, 1, nn.ReLU), data, 6, lr=1e-2, adam=True, loss=nn.MSELoss())

    def slow_then_sudden() -> dict[str, Any]:
        torch.manual_seed(30)
        gen = np.random.default_rng(30)
        x = gen.standard_normal((2048, 2)).astype(np.float32)
        y = ((x[:, 0] * x[:, 1]) > 0).astype(np.int64)  # XOR: flat at ln 2, then it clicks
        net = _mlp(2, 2, nn.Tanh, hidden=16)
        for layer in net:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.1)  # small: ~100 steps at chance
        return _run(net, _ds((x, y), 16), 6, lr=0.2)

    def loss_to_zero(seed: int) -> Callable[[], dict[str, Any]]:
        def separable() -> dict[str, Any]:
            torch.manual_seed(40 + seed)
            run = _run(nn.Linear(8, 2), _ds(_separable(120, 8, 40 + seed), 4), 100, lr=0.1)
            run["optimizer"] = torch.optim.SGD(run["network"].parameters(), lr=0.1)
            return run

        separable.__name__ = f"loss_to_zero_{seed}"
        return separable

    # -- the fresh set: written after the defaults were fixed, not adjusted on --
    def fresh_adamw_six_classes() -> dict[str, Any]:
        torch.manual_seed(50)
        run = _run(_mlp(16, 6, nn.GELU, hidden=48), _ds(_classes(3072, 16, 50, classes=6), 8),
                   4, lr=2e-3, adam=True, schedule=_cosine(150))  # fmt: skip
        run["optimizer"] = torch.optim.AdamW(run["network"].parameters(), lr=2e-3)
        run["schedule"] = _warmup_cosine(run["optimizer"], 150, 4 * 384)
        return run

    def fresh_regression_batch4() -> dict[str, Any]:
        torch.manual_seed(51)
        data = _ds(_regression(2048, 6, 51, _t_noise(4.0)), 4)
        return _run(_mlp(6, 1, nn.ReLU), data, 4, lr=1e-3, adam=True, loss=nn.MSELoss())

    def fresh_cnn_sgd_batch8() -> dict[str, Any]:
        torch.manual_seed(52)
        return _run(_cnn(), _ds(_images(2048, 52), 8), 4, lr=0.01)

    def fresh_noisy_labels_batch4() -> dict[str, Any]:
        torch.manual_seed(53)
        data = _ds(_classes(2048, 20, 53, noise=0.2), 4)
        return _run(_mlp(20, 4, nn.ReLU), data, 3, lr=0.01, schedule=_step_lr(600))

    def fresh_separable_adam() -> dict[str, Any]:
        torch.manual_seed(54)
        x, y = _separable(240, 6, 54)
        return _run(_mlp(6, 2, nn.ReLU, hidden=16), _ds((x / 10, y), 4), 50, lr=0.05,
                    adam=True)  # fmt: skip

    tuning = [relu_sgd_step, tanh_adam_cosine, label_noise, cnn, heavy_tails, tiny_batches,
              loss_to_zero(0), loss_to_zero(1), loss_to_zero(2)]  # fmt: skip
    held = [held_gelu_adam, held_laplace, held_cnn_noise, held_deep_tanh, held_batch2, held_t25,
            label_smoothing, warmup_from_zero, cosine_to_zero, step_decay_valid, dropout_batch8,
            regression_thousands, slow_then_sudden]  # fmt: skip
    fresh = [fresh_adamw_six_classes, fresh_regression_batch4, fresh_cnn_sgd_batch8,
             fresh_noisy_labels_batch4, fresh_separable_adam]  # fmt: skip
    return [
        *(Scenario(f.__name__.replace("_", "-"), None, False, 0, f) for f in tuning),
        *(Scenario(f.__name__.replace("_", "-"), None, True, 0, f) for f in held),
        *(Scenario(f.__name__.replace("_", "-"), None, True, 0, f, fresh=True) for f in fresh),
    ]


def _faults() -> list[Scenario]:
    def base(seed: int, epochs: int = 8, adam: bool = False) -> dict[str, Any]:
        torch.manual_seed(seed)
        data = _ds(_classes(2048, 20, seed), 16)
        return _run(_mlp(20, 4, nn.ReLU), data, epochs, lr=1e-3 if adam else 0.05, adam=adam)

    def nan() -> dict[str, Any]:
        run = base(20)
        net = run["network"]
        run["inject"] = [_At(300, lambda p: net[0].weight.view(-1)[7].fill_(math.nan))]
        return run

    def lr_x800() -> dict[str, Any]:
        run = base(21, adam=True)  # SGD at x800 turns NaN within 3 steps: that is 'nan' above
        opt = run["optimizer"]

        def raise_lr(p: Any) -> None:
            for group in opt.param_groups:
                group["lr"] *= 800

        run["inject"] = [_At(400, raise_lr)]
        return run

    def corrupt_batch() -> dict[str, Any]:
        run = base(22)
        run["data"] = _Corrupt(run["data"], at=40, seed=22)  # epoch 2's 40th: step 168
        return run

    def last_layer_x300() -> dict[str, Any]:
        # With SGD the first update after x300 kills every unit at once (the gradient is 0
        # from the next step on: only the loss spike shows); Adam's bounded steps keep the
        # gradient exploded for a while.
        run = base(23, adam=True)
        net = run["network"]
        run["inject"] = [_At(350, lambda p: net[-1].weight.mul_(300))]
        return run

    def lr_zero() -> dict[str, Any]:
        run = base(24, epochs=24)
        opt = run["optimizer"]

        def zero(p: Any) -> None:
            for group in opt.param_groups:
                group["lr"] = 0.0

        run["inject"] = [_At(300, zero)]
        return run

    def dead_relu() -> dict[str, Any]:
        run = base(25)
        net = run["network"]
        run["inject"] = [_At(400, lambda p: net[2].bias.fill_(-100.0))]
        return run

    def sigmoid_12() -> dict[str, Any]:
        torch.manual_seed(26)
        net = _mlp(20, 4, nn.Sigmoid, depth=12)
        return _run(net, _ds(_classes(1024, 20, 26), 16), 4, lr=0.05)

    def overfit() -> dict[str, Any]:
        torch.manual_seed(27)
        train = _ds(_classes(96, 20, 27, noise=0.4), 16)
        valid = _ds(_classes(512, 20, 27, noise=0.4, sample=1), 128)
        return _run(_mlp(20, 4, nn.ReLU, hidden=128), train, 150, lr=3e-3, adam=True,
                    valid=valid)  # fmt: skip

    def shuffled_labels() -> dict[str, Any]:
        torch.manual_seed(31)
        x, y = _classes(2048, 20, 31)
        y = np.random.default_rng(31).permutation(y)  # labels shuffled apart from the inputs
        return _run(_mlp(20, 4, nn.ReLU), _ds((x, y), 16), 4, lr=0.05)

    def lr_typo() -> dict[str, Any]:
        torch.manual_seed(32)
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(2048, 20, 32), 16), 4, lr=1e-7)

    def steplr_per_batch() -> dict[str, Any]:
        torch.manual_seed(33)
        epoch_schedule = lambda opt, total: torch.optim.lr_scheduler.StepLR(  # noqa: E731
            opt, 30, gamma=0.1
        )  # meant as "every 30 epochs", stepped every batch
        return _run(_mlp(20, 4, nn.ReLU), _ds(_classes(2048, 20, 33), 16), 4, lr=0.05,
                    schedule=epoch_schedule)  # fmt: skip

    def unnormalised_tanh() -> dict[str, Any]:
        torch.manual_seed(34)
        x, y = _classes(2048, 20, 34)
        return _run(_mlp(20, 4, nn.Tanh), _ds((x * 400.0, y), 16), 4, lr=0.01)

    def sorted_by_class() -> dict[str, Any]:
        torch.manual_seed(35)
        x, y = _classes(2048, 20, 35)
        order = np.argsort(y, kind="stable")  # sorted by class and never shuffled
        data = _ds((x[order], y[order]), 16, shuffle=False)
        return _run(_mlp(20, 4, nn.ReLU), data, 6, lr=0.1)

    def softmax_frozen() -> dict[str, Any]:
        torch.manual_seed(36)
        body = _mlp(20, 4, nn.ReLU)
        for param in list(body.parameters())[:-2]:
            param.requires_grad_(False)  # the body frozen; the head learns through softmax
        net = nn.Sequential(body, nn.Softmax(dim=1))  # softmax before CrossEntropyLoss
        run = _run(net, _ds(_classes(2048, 20, 36), 16), 4, lr=0.05)
        return run

    def spike_at_50() -> dict[str, Any]:
        # One batch's inputs x100 at step 50 of a 90-step run (30 steps an epoch, SGD lr 0.1):
        # the loss goes from about 0.3 to 1.0 and stays high for several steps.
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(480, 8, generator=gen)
        y = (x @ torch.randn(8, 2, generator=gen)).argmax(1)
        batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 480, 16)]
        run = _run(nn.Linear(8, 2), _Scaled(batches, step=50, by=100.0), 3, lr=0.1)
        run["optimizer"] = torch.optim.SGD(run["network"].parameters(), lr=0.1)
        return run

    def bad_batch_every_epoch() -> dict[str, Any]:
        run = base(37)
        run["data"] = _BadBatch(_ds(_classes(2048, 20, 37), 16, shuffle=False), at=50, seed=37)
        return run

    return [
        Scenario("shuffled-labels", "not_learning", onset=1, build=shuffled_labels),
        Scenario("lr-typo-1e-7", "not_learning", onset=1, build=lr_typo),
        Scenario("softmax-frozen", "not_learning", onset=1, build=softmax_frozen),
        Scenario("steplr-per-batch", "lr_negligible", onset=91, build=steplr_per_batch),
        Scenario("unnormalised-tanh", "saturation", onset=1, build=unnormalised_tanh),
        Scenario("sorted-by-class", "worse_than_chance", onset=1, build=sorted_by_class),
        Scenario("bad-batch", "recurring_batch", onset=50, build=bad_batch_every_epoch),
        Scenario("nan", "nonfinite", onset=300, build=nan),
        Scenario("lr-x800", "divergence", onset=400, build=lr_x800),
        Scenario("corrupt-batch", "spike", onset=128 + 40, build=corrupt_batch),
        Scenario("spike-at-50", "spike", onset=50, build=spike_at_50),
        Scenario("last-layer-x300", "grad_explosion", onset=350, build=last_layer_x300),
        Scenario("lr-zero", "plateau", onset=300, build=lr_zero),
        Scenario("dead-relu", "dying_relu", onset=400, build=dead_relu),
        Scenario("sigmoid-12", "grad_vanishing", onset=1, build=sigmoid_12),
        Scenario("overfit", "overfitting", onset=0, build=overfit),
    ]


SCENARIOS = [*_healthy(), *_faults()]


# -- running ----------------------------------------------------------------------------------
def run(scenario: Scenario) -> Result:
    spec = scenario.build()
    raised: list[tuple[Alert, int]] = []

    def keep(alert: Alert, run_context: Any) -> None:
        raised.append((alert, run_context.original_args().cur_step_num))

    monitor = sw.AnomalyMonitor(action=keep)

    class Evals(sw.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_epoch_end(self, run_context: Any) -> None:
            results = run_context.original_args().get("eval_results") or {}
            value = results.get("eval_loss", results.get("loss"))
            if value is not None:
                self.values.append(float(value))

    evals = Evals()
    model = sw.Model(
        spec["network"], spec["loss"], spec["optimizer"], metrics={"loss"},
        lr_scheduler=spec["schedule"],
        lr_interval=spec["interval"] if spec["schedule"] is not None else "epoch",
    )  # fmt: skip
    callbacks = [*spec["inject"], monitor, evals]
    start = time.perf_counter()
    if spec["valid"] is not None:
        model.fit(spec["epochs"], spec["data"], spec["valid"], callbacks=callbacks)
    else:
        model.train(spec["epochs"], spec["data"], callbacks=callbacks)
    seconds = time.perf_counter() - start
    steps = spec["epochs"] * len(spec["data"])
    result = Result(scenario, raised, steps, seconds, evals=evals.values)
    result.delay = _delay(result)
    return result


def _rise(evals: list[float], rel: float = 0.03) -> int | None:
    """The evaluation (1-based) where the validation loss first stands clearly (``rel``) above
    its best so far, and stays so."""
    best = math.inf
    for i, value in enumerate(evals):
        if value > best * (1 + rel) and all(v > best * (1 + rel) for v in evals[i:]):
            return i + 1
        best = min(best, value)
    return None


def _delay(result: Result) -> float | None:
    kind = result.scenario.expected
    if kind is None:
        return None
    found = [(a, at) for a, at in result.alerts if a.kind == kind]
    if kind == "overfitting":
        onset = _rise(result.evals)
        if onset is None or not found:
            return None
        epoch = found[0][0].epoch or 0
        return float(epoch - onset)
    found = [(a, at) for a, at in found if a.step >= result.scenario.onset]
    return float(found[0][1] - result.scenario.onset) if found else None


def _describe(result: Result) -> str:
    seen = [f"{a.kind}@{a.step}" for a, _ in result.alerts]
    return ", ".join(seen[:4]) + (f" (+{len(seen) - 4})" if len(seen) > 4 else "") or "-"


def report(results: list[Result], out: Any = sys.stdout) -> dict[str, Any]:
    print(f"{'scenario':<18} {'expected':<15} {'steps':>6} {'alerts seen':<44} {'delay':>10}",
          file=out)  # fmt: skip
    for r in results:
        kind = r.scenario.expected
        label = kind or (
            "healthy (fresh)"
            if r.scenario.fresh
            else "healthy (held)"
            if r.scenario.held_out
            else "healthy"
        )
        if kind is None:
            delay = "-"
        elif r.delay is None:
            delay = "MISSED"
        else:
            delay = f"{r.delay:g} {GOALS[kind][1]}"
        print(f"{r.scenario.name:<18} {label:<15} {r.steps:>6} {_describe(r):<44} {delay:>10}",
              file=out)  # fmt: skip
    faults = [r for r in results if r.scenario.expected is not None]
    caught = [r for r in faults if r.caught]
    tuning = [r for r in results if r.scenario.expected is None and not r.scenario.held_out]
    held = [r for r in results if r.scenario.expected is None and r.scenario.held_out]
    fresh = [r for r in held if r.scenario.fresh]
    held = [r for r in held if not r.scenario.fresh]
    step_delays = [r.delay for r in caught if GOALS[r.scenario.expected or ""][1] == "steps"]
    summary = {
        "recall": f"{len(caught)}/{len(faults)}",
        "median delay (steps)": statistics.median(step_delays) if step_delays else None,
        "false alarms, tuning set": f"{sum(len(r.alerts) for r in tuning)} in {len(tuning)} runs",
        "false alarms, held-out set": f"{sum(len(r.alerts) for r in held)} in {len(held)} runs",
        "false alarms, fresh set": f"{sum(len(r.alerts) for r in fresh)} in {len(fresh)} runs",
        "healthy steps": sum(r.steps for r in tuning + held + fresh),
        "seconds": round(sum(r.seconds for r in results), 1),
    }
    for key, value in summary.items():
        print(f"{key}: {value}", file=out)
    print(file=out)
    figures(results, out)
    return summary


def _upper(count: int, confidence: float = 0.95) -> float:
    """The Poisson rate whose chance of ``count`` or fewer events is ``1 - confidence``: a
    one-sided upper bound on the rate behind ``count`` events (3.0 for none)."""
    lo, hi = float(count), count + 10.0 * (count + 1) ** 0.5 + 10.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        cdf = sum(math.exp(-mid) * mid**i / math.factorial(i) for i in range(count + 1))
        lo, hi = (mid, hi) if cdf > 1.0 - confidence else (lo, mid)
    return hi


def figures(results: list[Result], out: Any = sys.stdout) -> list[dict[str, Any]]:
    """Per detector, at AnomalyMonitor's defaults: its false alarms over every healthy run
    (and per 100,000 healthy steps, with a 95% upper bound: the suite's healthy steps are too
    few to tell 0 from a few per 100,000), and the median and worst delay over the fault runs
    that expect it. Printed as a Markdown table."""
    healthy = [r for r in results if r.scenario.expected is None]
    steps = sum(r.steps for r in healthy)
    rows: list[dict[str, Any]] = []
    for kind in DETECTORS:
        false = sum(1 for r in healthy for a, _ in r.alerts if a.kind == kind)
        faults = [r for r in results if r.scenario.expected == kind]
        if kind == "threshold" or (not faults and not false):
            continue
        delays = [r.delay for r in faults if r.delay is not None]
        unit = GOALS[kind][1] if kind in GOALS else "steps"
        rows.append({
            "detector": kind, "false alarms": false,
            "per 100k healthy steps": 1e5 * false / steps if steps else math.nan,
            "95% upper bound": 1e5 * _upper(false) / steps if steps else math.nan,
            "faults caught": f"{len(delays)}/{len(faults)}",
            "median delay": f"{statistics.median(delays):g} {unit}" if delays else "-",
            "worst delay": f"{max(delays):g} {unit}" if delays else "-",
        })  # fmt: skip
    print(f"{len(healthy)} healthy runs, {steps:,} healthy steps; {len(results) - len(healthy)} "
          "fault runs", file=out)  # fmt: skip
    print("| detector | false alarms | per 100,000 healthy steps (95% upper bound) "
          "| faults caught | median delay | worst delay |", file=out)  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|", file=out)
    for row in rows:
        print(f"| `{row['detector']}` | {row['false alarms']} | "
              f"{row['per 100k healthy steps']:.1f} (≤ {row['95% upper bound']:.1f}) | "
              f"{row['faults caught']} | {row['median delay']} | {row['worst delay']} |",
              file=out)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="scenario names to run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    results = [run(s) for s in chosen]
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
