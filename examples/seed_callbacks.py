"""The seed article's callback code, ported to stepwatch by changing only the import lines.

Run it: ``python examples/seed_callbacks.py``. Each class below is the article's code as written;
only the imports differ (``mindspore`` → ``stepwatch``). Two notes where the article's code
cannot run as printed:

* ``SamplingMonitor.step_end`` ends in a comment with no statement, which Python rejects; a
  ``self.samples.append(...)`` line stands where the comment says "record data".
* ``AsyncMonitor``'s writer thread spins forever and keeps the process alive; it is defined here
  but not started. stepwatch's run store does this job properly.
"""

# --- imports: the only lines changed from the article -------------------------------------
import os

os.environ.setdefault("MPLBACKEND", "Agg")  # headless: the article's live plot draws off-screen

from threading import Thread

import matplotlib.pyplot as plt

from stepwatch import Tensor  # was: from mindspore import Tensor
from stepwatch.train.callback import Callback  # was: from mindspore.train.callback ...
from stepwatch.train.callback import LossMonitor

# --- §2.2 ------------------------------------------------------------------------------------
loss_monitor = LossMonitor(per_print_times=10)  # 每10个step打印一次loss


# --- §3.1 ------------------------------------------------------------------------------------
class CustomMonitor(Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def step_end(self, run_context):
        cb_params = run_context.original_args()
        loss = cb_params.net_outputs
        self.losses.append(float(loss))

        if cb_params.cur_step_num % 50 == 0:
            print(f"Step {cb_params.cur_step_num}, loss: {loss}")


# --- §3.2 ------------------------------------------------------------------------------------
class MultiMetricMonitor(Callback):
    def __init__(self, metrics=["loss", "accuracy"]):
        self.metrics = {m: [] for m in metrics}

    def epoch_end(self, run_context):
        cb_params = run_context.original_args()
        for metric in self.metrics:
            value = getattr(cb_params, metric, None)
            if value is not None:
                self.metrics[metric].append(float(value))
                print(f"Epoch {cb_params.cur_epoch_num}, {metric}: {value}")


# --- §4.1 ------------------------------------------------------------------------------------
class VisualMonitor(Callback):
    def __init__(self, figsize=(10, 6)):
        self.fig, self.ax = plt.subplots(figsize=figsize)
        self.lines = {}

    def step_end(self, run_context):
        cb_params = run_context.original_args()  # noqa: F841
        # 更新曲线数据...
        plt.draw()
        plt.pause(0.01)


# --- §4.2 ------------------------------------------------------------------------------------
class DistributedMonitor(Callback):
    def __init__(self, rank_size):
        self.rank_size = rank_size

    def step_end(self, run_context):
        cb_params = run_context.original_args()
        if cb_params.cur_step_num % 100 == 0:
            # 只由rank 0设备打印
            if cb_params.rank_id == 0:
                print(f"Step {cb_params.cur_step_num}, loss: {cb_params.net_outputs}")


# --- §5.1: the article's sync check, inside the step hook it belongs to ----------------------
class SyncCheckMonitor(Callback):
    def step_end(self, run_context):
        cb_params = run_context.original_args()
        # 检查设备数据同步
        loss = cb_params.net_outputs
        if isinstance(loss, Tensor):
            loss = loss.asnumpy()
        self.last_loss = loss


# --- §5.2 ------------------------------------------------------------------------------------
class MemorySafeMonitor(Callback):
    def __init__(self, max_records=1000):
        self.max_records = max_records
        self._data = []

    def add_data(self, value):
        if len(self._data) >= self.max_records:
            self._data.pop(0)
        self._data.append(value)


# --- §6.1 (defined, never started: its worker never exits) ------------------------------------
class AsyncMonitor(Callback):
    def __init__(self, log_file):
        self.log_file = log_file
        self._queue = []
        self._writer = Thread(target=self._write_worker)
        self._writer.start()

    def _write_worker(self):
        while True:
            if self._queue:
                with open(self.log_file, "a") as f:
                    f.write(self._queue.pop(0))


# --- §6.2 ------------------------------------------------------------------------------------
class SamplingMonitor(Callback):
    def __init__(self, sample_interval=10):
        self.interval = sample_interval
        self.samples = []

    def step_end(self, run_context):
        if run_context.original_args().cur_step_num % self.interval == 0:
            # 记录数据...
            self.samples.append(run_context.original_args().cur_step_num)


# --- §6.3 ------------------------------------------------------------------------------------
class ConditionalMonitor(Callback):
    def __init__(self, threshold=1.0):
        self.threshold = threshold

    def step_end(self, run_context):
        loss = run_context.original_args().net_outputs
        if loss > self.threshold:
            print(f"Alert! High loss detected: {loss}")
            # 保存模型快照等...


def main(epoch_size: int = 3) -> dict:
    """Train a small classifier with every monitor above; return them for inspection."""
    import numpy as np
    import torch
    from torch import nn

    from stepwatch.dataset import NumpySlicesDataset
    from stepwatch.train import Model

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    features = rng.normal(size=(1600, 8)).astype(np.float32)
    labels = (features[:, 0] + features[:, 1] > 0).astype(np.int64)
    dataset = NumpySlicesDataset((features, labels), shuffle=True).batch(16)

    network = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)

    model = Model(network, loss_fn, optimizer, metrics={"accuracy"})
    monitors = {
        "loss_monitor": loss_monitor,
        "custom": CustomMonitor(),
        "multi_metric": MultiMetricMonitor(),
        "distributed": DistributedMonitor(rank_size=1),
        "sync_check": SyncCheckMonitor(),
        "sampling": SamplingMonitor(),
        "conditional": ConditionalMonitor(threshold=0.5),
    }
    model.train(epoch_size, dataset, callbacks=list(monitors.values()))

    # §2.1, as the article writes it
    model = Model(network, loss_fn, optimizer)
    model.train(epoch_size, dataset, callbacks=[LossMonitor()])
    return monitors


if __name__ == "__main__":
    main()
