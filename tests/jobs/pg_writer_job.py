"""One training process of tests/test_store_postgres.py's three-writer test.

``python tests/jobs/pg_writer_job.py URL NAME POINTS MODE``: records POINTS steps of
``step_loss`` (value = step, in batches) and an ``lr`` point every 50 steps into the store at
URL. It prints its run id first. MODE ``finish`` closes the run; ``hang`` flushes half of it,
prints ``flushed`` and waits to be killed (at most 120 s).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from stepwatch.store.writer import RunWriter


def main(url: str, name: str, points: int, mode: str) -> None:
    writer = RunWriter(url, name=name, flush_seconds=0.05)
    print(writer.run_id, flush=True)
    for start in range(0, points, 100):
        steps = range(start, start + 100)
        writer.log_batch("step_loss", steps, np.arange(start, start + 100, dtype=np.float64))
        for step in range(start, start + 100, 50):
            writer.log("lr", 0.1, step)
        if mode == "hang" and start + 100 >= points // 2:
            writer.flush()
            print("flushed", flush=True)
            time.sleep(120)
            return
        time.sleep(0.002)
    writer.event("note", "done", points)
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
