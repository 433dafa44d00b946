"""One worker of the torchrun jobs of tests/test_several_machines.py (gloo on the CPU).

torchrun --nnodes 2 --nproc-per-node 2 ... tests/jobs/torchrun_job.py SCENARIO OUT_DIR

Each worker writes its pid to OUT_DIR/pids/<pid> first (the test ends every worker by its pid).

SCENARIO:
  nodes     train 2 epochs with a RunRecorder, LossMonitor and DistributedMonitor (rank 0 waits,
            bounded, until it has sampled the other machine's system metrics); then train
            again, where rank 3 stops itself (SIGSTOP) after step 12 and
            DistributedMonitor(action={'frozen': 'abort'}) ends the job
  restart   checkpoints every 4 steps; in the first attempt the last rank raises after step 10; the
            attempt torchrun starts again resumes from the latest checkpoint
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Longer than any test waits: a test that passes never relies on the collective's timeout.
PG_TIMEOUT = datetime.timedelta(seconds=300)


def build() -> Any:
    from stepwatch import Model, NumpySlicesDataset

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    model = Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1))
    return model, NumpySlicesDataset((x, y), shuffle=True).batch(4)  # 4 steps an epoch


def scenario_nodes(out: Path, rank: int) -> None:
    from stepwatch import Callback, DistributedMonitor, LossMonitor, RunRecorder

    recorder = RunRecorder(db=out / "runs.db", run_name="nodes", system_every=0.05)

    class SampledEveryNode(Callback):
        def on_train_end(self, run_context: Any) -> None:
            # Rank 0's writer has taken the other machine's sample at least once (bounded).
            writer = recorder.writer
            deadline = time.monotonic() + 30
            while writer is not None and time.monotonic() < deadline:
                if getattr(writer.system, "_seen", {}):
                    break
                time.sleep(0.02)

    model, data = build()
    callbacks = [LossMonitor(2), recorder, DistributedMonitor(every_n_steps=4), SampledEveryNode()]
    model.train(2, data, callbacks=callbacks)
    frozen(out, rank)  # never returns: the job ends


def frozen(out: Path, rank: int) -> None:
    from stepwatch import Callback, DistributedMonitor, RunRecorder

    class Freeze(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if rank == 3 and run_context.cb_params.cur_step_num == 12:
                (out / "stopped").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)

    monitor = DistributedMonitor(every_n_steps=1000, frozen_seconds=2.0, action={"frozen": "abort"})
    recorder = RunRecorder(db=out / "runs.db", run_name="frozen", flush_seconds=0.1)
    model, data = build()
    model.train(10_000, data, callbacks=[monitor, recorder, Freeze()])


def scenario_restart(out: Path, rank: int) -> None:
    from stepwatch import Callback, CheckpointConfig, ModelCheckpoint, RunRecorder

    class FailOnce(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            marker = out / "failed-once"
            last = rank == dist.get_world_size() - 1
            if last and run_context.cb_params.cur_step_num == 10 and not marker.exists():
                marker.write_text("1")
                raise RuntimeError("the last rank fails once, on purpose")

    ckpt = out / "ckpt"
    saved = sorted(ckpt.glob("ck-*.pt"), key=lambda p: p.stat().st_mtime) if ckpt.exists() else []
    saver = ModelCheckpoint("ck", ckpt, CheckpointConfig(save_checkpoint_steps=4))
    recorder = RunRecorder(db=out / "runs.db", run_name="restart", flush_seconds=0.1)
    model, data = build()  # 64 rows, 4 per step and rank: 8 steps an epoch on 2 ranks
    model.train(
        3,
        data,
        callbacks=[saver, recorder, FailOnce()],
        resume_from=saved[-1] if saved else None,
    )


def main() -> int:
    from stepwatch.distributed import shutdown

    scenario, out = sys.argv[1], Path(sys.argv[2])
    (out / "pids").mkdir(exist_ok=True)
    (out / "pids" / str(os.getpid())).write_text(os.environ.get("RANK", ""))
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    scenarios = {"nodes": scenario_nodes, "restart": scenario_restart}
    try:
        scenarios[scenario](out, rank)
        shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
