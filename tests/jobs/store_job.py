"""Store jobs run as subprocesses by the store tests.

python -m tests.jobs.store_job MODE DB [ARG]

MODE:
  train-forever       train with RunRecorder (flush every 0.2 s) until killed; prints the
                      global step of each flush it has seen complete
  fail-at-step N      train with RunRecorder and raise at global step N
  disk-fails          train with RunRecorder; after the first flush, cap the file size so
                      every later write fails (the disk is "full")
  write-points N      write N points with RunWriter and close
"""

from __future__ import annotations

import resource
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from stepwatch import LambdaCallback, Model, RunRecorder, RunWriter

from ..conftest import make_batches


def model() -> Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    return Model(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.05), device="cpu"
    )


def main(argv: list[str]) -> None:
    mode, db = argv[0], Path(argv[1])
    arg = int(argv[2]) if len(argv) > 2 else 0
    if mode == "train-forever":
        recorder = RunRecorder(db=db, run_name="forever", flush_seconds=0.2, transfer_every=8)

        def report(rc: object) -> None:
            step = rc.original_args().cur_step_num  # type: ignore[attr-defined]
            if step % 50 == 0:
                recorder.writer.flush()  # type: ignore[union-attr]
                print(step, flush=True)

        model().train(
            10**6, make_batches(10), callbacks=[recorder, LambdaCallback(on_train_step_end=report)]
        )
    elif mode == "fail-at-step":

        def boom(rc: object) -> None:
            if rc.original_args().cur_step_num == arg:  # type: ignore[attr-defined]
                raise RuntimeError("simulated failure")

        model().train(
            100,
            make_batches(10),
            callbacks=[
                RunRecorder(db=db, run_name="fails"),
                LambdaCallback(on_train_step_end=boom),
            ],
        )
    elif mode == "disk-fails":
        recorder = RunRecorder(db=db, run_name="disk", flush_seconds=0.05, transfer_every=4)

        def cap_disk(rc: object) -> None:
            if rc.original_args().cur_step_num == 20:  # type: ignore[attr-defined]
                recorder.writer.flush()  # type: ignore[union-attr]
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))
                resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, resource.RLIM_INFINITY))

        started = time.monotonic()
        model().train(
            30, make_batches(10), callbacks=[recorder, LambdaCallback(on_train_step_end=cap_disk)]
        )
        print(
            f"finished in {time.monotonic() - started:.1f}s dropped={recorder.dropped}", flush=True
        )
    elif mode == "write-points":
        writer = RunWriter(db, name=f"writer-{arg}")
        for i in range(arg):
            writer.log("value", float(i), i)
        writer.close()
        print(writer.run_id, writer.written, writer.dropped, flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
