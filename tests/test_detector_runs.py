"""AnomalyMonitor's detectors on real short runs of a hand loop (``stepwatch.watch``): the
spike of one bad batch at step 50 alerted and rolled back in a 90- and a 300-step run; a
separable task with batches of 4 whose losses reach exactly 0 quiet over 6,000 steps; a
blow-up seen at the gradient a step before the loss shows it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import stepwatch
from stepwatch import AnomalyMonitor
from stepwatch.monitor.detectors import Alert, Detector


@pytest.fixture(autouse=True)
def _quiet_and_fast() -> Iterator[None]:
    logging.getLogger("stepwatch").disabled = True
    # a loss that reached 0 leaves gradients in the subnormal range, which the CPU handles
    # many times slower; flushing them to 0 keeps these runs fast (and changes no alert); one
    # thread, as the bench runs them: tiny networks gain nothing from two, and on a busy
    # machine a second one waits for a core at every op
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
        logging.getLogger("stepwatch").disabled = False


def _bad_batch_run(
    steps: int, monitor: AnomalyMonitor, seed: int = 0, at: int = 50
) -> tuple[list[float], Any]:
    """A linear classifier, 30 batches of 16 an epoch, SGD at lr 0.1; the inputs of the batch
    of step ``at`` are x100."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(480, 8, generator=gen)
    y = (x @ torch.randn(8, 2, generator=gen)).argmax(1)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 480, 16)]
    net = nn.Linear(8, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    epochs = steps // len(batches)
    with stepwatch.watch(net, opt, [monitor], epochs=epochs, steps_per_epoch=30) as run:
        for _ in range(epochs):
            for bx, by in batches:
                if len(losses) + 1 == at:
                    bx = bx * 100.0
                opt.zero_grad()
                loss = loss_fn(net(bx), by)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                run.step(loss)
            run.epoch_end()
    return losses, run


@pytest.mark.parametrize("steps", [90, 300])
def test_a_spike_at_step_50_is_alerted_and_rolled_back(steps: int) -> None:
    monitor = AnomalyMonitor(action={"spike": "rollback"})
    losses, _ = _bad_batch_run(steps, monitor)
    assert losses[48] < 0.35 and losses[49] > 3 * losses[48]  # about 0.3 to 1.0
    seen = [(a.kind, a.step, outcome) for a, outcome in zip(monitor.alerts, monitor.outcomes)]
    _kind, step, outcome = next(s for s in seen if s[0] == "spike")
    assert step == 50, seen
    assert outcome.startswith("rolled back to step 1 "), seen  # the copy after step 1
    assert monitor.rollbacks == 1
    assert len(losses) == steps  # the run went on from the restored state


@pytest.mark.timeout(600)  # 6,000 real steps: seconds alone, minutes on a loaded machine
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_separable_run_whose_losses_reach_zero_raises_nothing_in_6000_steps(seed: int) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(8, generator=gen)
    x = torch.randn(480, 8, generator=gen)
    x = x[(x @ w).abs() / w.norm() > 0.2][:120]  # two classes a plane apart, with a margin
    y = (x @ w > 0).long()
    x = x * 10.0
    net = nn.Linear(8, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    monitor = AnomalyMonitor()
    losses: list[float] = []
    with stepwatch.watch(net, opt, [monitor], epochs=200, steps_per_epoch=30) as run:
        for _ in range(200):
            order = torch.randperm(120, generator=gen)
            for i in range(0, 120, 4):
                opt.zero_grad()
                loss = loss_fn(net(x[order[i : i + 4]]), y[order[i : i + 4]])
                loss.backward()
                opt.step()
                losses.append(loss.item())
                run.step(loss)
            run.epoch_end()
    assert len(losses) == 6000
    assert sum(v == 0.0 for v in losses[1000:]) > 0.4 * 5000  # many exactly 0, the rest tiny
    assert max(losses[1000:]) < 0.05
    assert monitor.alerts == [], [a.message for a in monitor.alerts]


def test_a_blow_up_is_seen_at_the_gradient_a_step_before_the_loss() -> None:
    # Here the bad batch's own loss is unremarkable (under 1.5x): its gradient is 70x, and the
    # loss of the next step, after the update it made, is 3.7x. Measured at every step, the
    # gradient says so at step 50; the loss cannot before step 51.
    monitor = AnomalyMonitor(detectors=["spike", "grad_explosion"], grad_every_n_steps=1)
    losses, _ = _bad_batch_run(90, monitor, seed=2)
    assert losses[49] < 1.5 * losses[48] and losses[50] > 3 * losses[48]
    assert [(a.kind, a.step) for a in monitor.alerts][:1] == [("grad_explosion", 50)]
    assert all(a.step > 50 for a in monitor.alerts if a.kind == "spike")


class _Quiet(Detector):
    """A detector of one's own without ``alarm()``: the monitor then reads the losses every 8
    steps, as it reads a GPU's, so the last ones are read as the run ends."""

    kind = "quiet"

    def update_many(self, steps: Any, values: Any, epoch: int | None = None) -> list[Alert]:
        return []


def _spike_at_the_end(
    tmp_path: Any, steps: int, detectors: Any = None
) -> tuple[AnomalyMonitor, Any]:
    """One epoch of ``steps`` steps whose last batch has its labels flipped and its inputs
    x10, with a recorder."""
    recorder = stepwatch.RunRecorder(db=tmp_path / "runs.db")
    monitor = AnomalyMonitor(detectors, action={"spike": "rollback"})
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 16, 8, generator=gen)
    y = (x @ torch.randn(8, 2, generator=gen)).argmax(1)
    net = nn.Linear(8, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    with stepwatch.watch(net, opt, [monitor, recorder], epochs=1, steps_per_epoch=steps) as run:
        for i in range(steps):
            bx, by = x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]
            if i == steps - 1:
                bx, by = bx * 10.0, 1 - by
            opt.zero_grad()
            loss = loss_fn(net(bx), by)
            loss.backward()
            opt.step()
            run.step(loss)
        run.epoch_end()
    return monitor, recorder


@pytest.mark.parametrize(
    ("steps", "detectors"), [(45, None), (100, None), (45, ["spike", _Quiet()])]
)
def test_a_spike_in_the_last_steps_is_acted_on_and_not_rolled_back(
    tmp_path: Any, steps: int, detectors: Any
) -> None:
    # read on its step (the last one), or with the last partial batch of steps as the run
    # ends (no alarm): either way judged and acted on before the run's status is stored
    monitor, recorder = _spike_at_the_end(tmp_path, steps, detectors)
    spikes = [(a.step, o) for a, o in zip(monitor.alerts, monitor.outcomes) if a.kind == "spike"]
    assert spikes == [
        (
            steps,
            f"not rolled back: the run ended at step {steps}, no step is left to go on from "
            f"(the weights are step {steps}'s)",
        )
    ]
    assert monitor.rollbacks == 0
    with stepwatch.Store(tmp_path / "runs.db") as store:
        info = store.run(recorder.run_id)
        alerts = [e for e in store.events(info.id) if e["kind"] == "alert"]
        assert [e["step"] for e in alerts if e["data"]["kind"] == "spike"] == [steps]
        assert info.status == "finished"
