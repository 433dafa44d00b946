"""A hand-written PyTorch loop watched by stepwatch, a NaN injected (docs/training/own-loop.md).

Run it: ``python examples/hand_loop.py [runs.db]``. The loss of step 25 is made NaN (as a
corrupted batch would); ``AnomalyMonitor`` sees it on that step (a CPU loss is read as it
comes, and a NaN is handed to the monitor at once), stops the run, and the run store marks
the run ``anomaly``. Then ``stepwatch show hand-loop-nan --db
runs.db`` shows the alert, and ``stepwatch serve --db runs.db`` marks it on the chart.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import stepwatch
from stepwatch import AnomalyMonitor, Callback, LossMonitor, RunRecorder, Store


class SeedLossLogger(Callback):
    """A MindSpore-style callback, as the seed writes them."""

    def step_end(self, run_context):  # type: ignore[no-untyped-def]
        cb_params = run_context.original_args()
        if cb_params.cur_step_num % 20 == 0:
            loss = float(cb_params.net_outputs)
            print(f"seed callback: step {cb_params.cur_step_num}, loss {loss:.4f}")


def main(db: str = "runs.db") -> int:
    torch.manual_seed(0)
    x = torch.randn(640, 8)
    y = (x[:, 0] > 0).long()
    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    recorder = RunRecorder(db=db, run_name="hand-loop-nan")
    callbacks = [
        LossMonitor(10),
        AnomalyMonitor(action={"nonfinite": "stop", "spike": "rollback"}),
        recorder,
        SeedLossLogger(),
    ]
    run = stepwatch.watch(net, opt, callbacks, epochs=3, steps_per_epoch=len(loader))
    step = 0
    with run:
        for _epoch in range(3):
            for xb, yb in loader:
                step += 1
                opt.zero_grad()
                loss = loss_fn(net(xb), yb)
                if step == 25:
                    loss = loss * float("nan")  # a corrupted batch
                loss.backward()
                opt.step()
                run.step(loss)
                if run.should_stop:
                    break
            with torch.no_grad():
                val_loss = loss_fn(net(x), y).item()
            run.epoch_end(eval_loss=val_loss)
            if run.should_stop:
                break
    print(f"stopped: {run.stop_reason} ({run.stop_kind}) after {run.step_num} steps")
    with Store(db) as store:
        info = store.run(recorder.run_id)
        print(f"stored as run {info.id} ({info.name}): {info.status}, {info.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
