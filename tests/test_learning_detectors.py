"""The detectors of runs that crash nothing but do not learn (not_learning, lr_negligible,
worse_than_chance, recurring_batch, saturation): argument checks and seeded synthetic series,
then small real training runs. The bench suite (tests/test_diagnose.py) runs each bug and its
healthy look-alikes at full size."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import stepwatch as sw
from stepwatch.monitor.detectors import (
    LrNegligible,
    NotLearning,
    RecurringBatch,
    Saturation,
    WorseThanChance,
)


def test_arguments_are_checked_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="'patience' must be an int >= 1"):
        NotLearning(patience=0)
    with pytest.raises(ValueError, match="'classes' must be an int >= 2"):
        NotLearning(classes=1)
    with pytest.raises(ValueError, match="'fraction' must be a number with 0 < x < 1"):
        LrNegligible(fraction=2.0)
    with pytest.raises(ValueError, match="'factor' must be >= 1"):
        WorseThanChance(factor=0.5)
    with pytest.raises(ValueError, match="'patience' must be an int >= 2"):
        RecurringBatch(patience=1)
    with pytest.raises(ValueError, match="'threshold' must be a number with 0 < x <= 1"):
        Saturation(threshold=0.0)


def test_not_learning_fires_at_chance_and_on_a_flat_loss_once() -> None:
    rng = np.random.default_rng(0)
    chance = math.log(4) + 0.01 * rng.standard_normal(1000)
    alerts = chunked(NotLearning(classes=4), chance)
    assert [a.step for a in alerts] == [304] and "at chance, ln(4)" in alerts[0].message
    flat = 5000.0 + rng.standard_normal(1000)  # a regression loss that never moves
    alerts = chunked(NotLearning(), flat)
    assert len(alerts) == 1 and "within 5% of its start" in alerts[0].message
    learns = math.log(4) * np.exp(-np.arange(1000) / 150.0) + 0.05
    assert chunked(NotLearning(classes=4), learns) == []


def chunked(detector: Any, values: Any, every: int = 8) -> list[Any]:
    values, found = list(values), []
    for i in range(0, len(values), every):
        found += detector.update_many(range(i + 1, i + every + 1), values[i : i + every])
    return found


def test_lr_negligible_early_decay_fires_a_cosine_to_zero_does_not() -> None:
    steps = range(1, 1001)
    loss = [1.0] * 1000
    early = LrNegligible()
    early.total_steps = 1000
    decayed = [0.1 * 0.1 ** (s // 30) for s in steps]  # StepLR(30, 0.1) stepped per batch
    alerts = early.update_many(steps, loss, None, decayed)
    assert len(alerts) == 1 and alerts[0].step == 120 and "negligible" in alerts[0].message
    cosine = LrNegligible()
    cosine.total_steps = 1000
    rates = [0.05 * (1 + math.cos(math.pi * s / 1000)) for s in steps]
    learned = [2.0 * math.exp(-s / 100) + 0.1 for s in steps]
    assert cosine.update_many(steps, learned, None, rates) == []
    warm = LrNegligible()  # a warm-up from 0 is never under its peak
    assert warm.update_many(steps, loss, None, [s / 1000 for s in steps]) == []


def test_worse_than_chance_needs_patience_epochs_in_a_row() -> None:
    detector = WorseThanChance(classes=4)
    detector.see_start([1.4] * 8)
    assert detector.start is None  # the mean of the first 16 losses
    detector.see_start([1.4] * 8)
    found = [detector.update(e * 100, loss, epoch=e) for e, loss in enumerate([5, 1, 5, 5, 5], 1)]
    assert [a.epoch for a in found if a] == [5]
    assert (
        "over 1.25x its starting loss 1.4, 3 epochs in a row" in next(a for a in found if a).message
    )


def test_recurring_batch_names_the_position_and_ignores_random_outliers() -> None:
    rng = np.random.default_rng(1)
    spe = 100
    detector = RecurringBatch()
    detector.steps_per_epoch = spe
    found = []
    for epoch in range(1, 6):
        values = (1.0 + 0.05 * rng.standard_normal(spe)).tolist()
        values[41] = 4.5  # batch 42 of every epoch
        values[int(rng.integers(0, spe))] *= 5  # and one random outlier each epoch
        steps = range((epoch - 1) * spe + 1, epoch * spe + 1)
        for i in range(0, spe, 8):
            found += detector.update_many(steps[i : i + 8], values[i : i + 8], epoch)
    assert len(found) == 1 and "batch 42 of the epoch" in found[0].message
    assert found[0].epoch == 3


def test_saturation_fires_after_patience_samples() -> None:
    detector = Saturation()
    detector.names = ["1", "3"]
    got = [detector.update(s, [0.97, 0.2]) for s in (25, 50, 75, 100)]
    assert [a.step for a in got if a] == [25] and "layer 0 (1)" in got[2].message  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="saturated fractions must be within"):
        detector.update(1, [1.5])


def _classifier(scale: float, act: type[nn.Module]) -> tuple[sw.Model, Any]:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    data = [(x[i : i + 16] * scale, y[i : i + 16]) for i in range(0, 512, 16)]
    net = nn.Sequential(nn.Linear(8, 32), act(), nn.Linear(32, 3))
    return sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.01)), data


def test_saturation_in_a_real_run_and_no_hook_left_on_the_network() -> None:
    model, data = _classifier(400.0, nn.Tanh)  # inputs not normalised, into a tanh network
    monitor = sw.AnomalyMonitor()
    model.train(4, data, callbacks=[monitor])
    sat = [a for a in monitor.alerts if a.kind == "saturation"]
    assert sat and "layer 0 (1)" in sat[0].message and sat[0].step <= 75
    assert not model.train_network[1]._forward_hooks
    healthy, data = _classifier(1.0, nn.Tanh)
    quiet = sw.AnomalyMonitor()
    healthy.train(4, data, callbacks=[quiet])
    assert [a for a in quiet.alerts if a.kind == "saturation"] == []


def test_a_sign_in_the_gradients_is_confirmed_on_the_next_steps_not_the_next_interval() -> None:
    # Saturated from step 1: measured at step 1, then every 5 steps while the detector has
    # seen it fewer than `patience` (3) times, so the run stops at step 11, not at 129.
    model, data = _classifier(400.0, nn.Tanh)
    monitor = sw.AnomalyMonitor(detectors=["saturation"], action="stop")
    ended: list[int] = []
    end = sw.LambdaCallback(on_train_end=lambda rc: ended.append(rc.cb_params.cur_step_num))
    model.train(4, data, callbacks=[monitor, end])
    assert [(a.kind, a.step) for a in monitor.alerts] == [("saturation", 1)]
    assert list(monitor._history["grad_step"]) == [1, 6, 11] and ended == [11]
    assert monitor.grad_every_n_steps == 128 and not monitor._saturation.confirming


def test_gradients_are_measured_every_10_steps_until_the_explosion_detector_is_warm() -> None:
    model, data = _classifier(1.0, nn.Tanh)
    monitor = sw.AnomalyMonitor(detectors=["grad_explosion"], grad_every_n_steps=40)
    model.train(12, data, callbacks=[monitor])
    measured = list(monitor._history["grad_step"])
    # 5 norms, then at the multiples of 40
    assert measured[:8] == [1, 11, 21, 31, 41, 80, 120, 160]
    assert all(b - a == 40 for a, b in itertools.pairwise(measured[5:]))


def test_not_learning_in_a_real_run_reads_the_classes_from_the_loss_and_outputs() -> None:
    model, data = _classifier(1.0, nn.ReLU)
    gen = torch.Generator().manual_seed(0)
    shuffled = [(x, y[torch.randperm(len(y), generator=gen)]) for x, y in data]
    monitor = sw.AnomalyMonitor(detectors=["not_learning"])
    model.train(12, shuffled, callbacks=[monitor])
    assert [a.kind for a in monitor.alerts] == ["not_learning"]
    # read every 64 steps (the trend detectors' cadence): the first look after its warm-up
    assert "not learning: after 320 steps" in monitor.alerts[0].message


def test_recurring_batch_asks_for_its_next_time_on_its_step() -> None:
    detector = RecurringBatch()
    detector.steps_per_epoch = 100
    rng = np.random.default_rng(2)
    alarms, found = [], []
    for epoch in range(1, 5):
        values = (1.0 + 0.05 * rng.standard_normal(100)).tolist()
        values[41] = 4.5
        steps = range((epoch - 1) * 100 + 1, epoch * 100 + 1)
        alarms.append(detector.alarm())
        found += chunked_epoch(detector, steps, values, epoch)
    # nothing to ask for until batch 42 was an outlier twice in a row; then its limit (3x the
    # median), so a host reading batches of losses hands the third one over on its step
    assert alarms[:2] == [math.inf, math.inf]
    assert alarms[2] == pytest.approx(3.0, rel=0.05)
    assert [a.step for a in found] == [242] and detector.alarm() == math.inf  # nothing left


def chunked_epoch(detector: Any, steps: range, values: list[float], epoch: int) -> list[Any]:
    found = []
    for i in range(0, len(values), 8):
        found += detector.update_many(steps[i : i + 8], values[i : i + 8], epoch)
    return found


def test_a_recurring_bad_batch_is_acted_on_at_its_own_step_in_a_real_run() -> None:
    torch.manual_seed(0)
    x = torch.randn(1024, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 1024, 16)]  # 64 batches
    data[40] = (data[40][0], (data[40][1] + 1) % 3)  # the same wrong labels every epoch
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    seen: list[tuple[str, int, int]] = []

    def keep(alert: Any, run_context: Any) -> None:
        seen.append((alert.kind, alert.step, run_context.original_args().cur_step_num))

    model = sw.Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.2))
    model.train(6, data, callbacks=[sw.AnomalyMonitor(action=keep)])
    # its third epoch in a row: step 3 x 64 + 41, acted on there, not at the next batch read
    # (one batch up, gone the next step, is no spike)
    assert seen == [("recurring_batch", 233, 233)]
