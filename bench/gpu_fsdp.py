"""An FSDP2-sharded hand loop on the GPUs: no host sync on quiet steps with stepwatch watching it,
the cost of watching, the collectives it adds, and the MFU FlopsUtilizationCollector reports.

One process per CUDA device (NCCL), a GPU-bound MLP (4 x Linear(4096, 4096), batch 1024 per
rank, bf16 autocast), each layer and the root ``fully_shard``-ed over the ranks (a world of one
on a machine with one GPU: the parameters are still DTensors, the collectives are no-ops):

1. Sync check: the loop runs watched by ``AnomalyMonitor()``, ``RunRecorder()``,
   ``DistributedMonitor(100)`` and ``FlopsUtilizationCollector(100)`` under
   ``torch.cuda.set_sync_debug_mode("warn")``; the steps during which the host waited for the
   GPU are listed: they should be the monitors' look steps only (the gathers every 100 steps,
   AnomalyMonitor's reads and gradient measurements), none of the quiet ones.
2. Cost: epochs of the watched loop against the raw loop, interleaved, raw first in even rounds;
   a raw loop against another raw loop gives the noise floor (goal >= 0.95).
3. The all_reduce / all_gather / broadcast calls stepwatch adds over an epoch, counted.
4. The MFU FlopsUtilizationCollector prints, from the device's known peak (H100, H200, A100,
   ...): in (0, 1].

Where there is no CUDA device it says so and exits 0. ``--cpu`` runs the same on 2 CPU processes
(gloo, a smaller network, no sync check): a check of the script itself.

Usage::

    python bench/gpu_fsdp.py                # one process per GPU, 300 steps, 5 rounds
    python bench/gpu_fsdp.py --cpu --quick  # the script's own check, without a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stepwatch
from _ranks import Counter, run_ranks  # bench/_ranks.py (the script's folder)
from stepwatch.distributed import shutdown

GOAL = 0.95
CLASSES = 10
PRINT_EVERY = 100


class Shape:
    def __init__(self, cpu: bool) -> None:
        self.width, self.depth, self.batch = (256, 3, 32) if cpu else (4096, 4, 1024)


def make_sharded(shape: Shape, device: torch.device, seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(shape.depth):
        layers += [nn.Linear(shape.width, shape.width), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(shape.width, CLASSES)).to(device)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return net


class SyncGuard(stepwatch.Callback):
    """Records the steps during which the host waited for the GPU (CUDA's sync check in
    "warn" mode, its warnings counted step by step)."""

    order = 10_000  # after every other callback's step end

    def __init__(self) -> None:
        self.synced: list[int] = []
        self.steps = 0
        self._caught: Any = None
        self._records: list[warnings.WarningMessage] = []
        self._seen = 0

    def on_train_begin(self, run_context: stepwatch.RunContext) -> None:
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_step_end(self, run_context: stepwatch.RunContext) -> None:
        records = self._records
        new = [r for r in records[self._seen :] if "synchroniz" in str(r.message)]
        self._seen = len(records)
        self.steps += 1
        if new:
            self.synced.append(run_context.cb_params.cur_step_num)

    def on_train_end(self, run_context: stepwatch.RunContext) -> None:
        self._restore()

    def __exit__(self, *err: object) -> None:
        self._restore()

    def _restore(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        caught, self._caught = self._caught, None
        if caught is not None:
            caught.__exit__(None, None, None)


def loop(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    callbacks: list[Any] | None,
) -> float:
    """One epoch, watched by ``callbacks`` (None: the raw loop); its seconds."""
    loss_fn = nn.CrossEntropyLoss()
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    watched = (
        stepwatch.watch(net, opt, callbacks, steps_per_epoch=len(batches))
        if callbacks is not None
        else contextlib.nullcontext()
    )
    with watched as run:
        _sync(device)
        start = time.perf_counter()
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            if run is not None:
                run.step(loss, batch=(x, y))
        _sync(device)
        seconds = time.perf_counter() - start
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(args: argparse.Namespace, db: Path) -> None:
    rank = int(os.environ["RANK"])
    cpu = args.cpu
    if cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=600))
    counter = Counter()
    shape = Shape(cpu)
    gen = torch.Generator().manual_seed(100 + rank)
    # Labels a network can learn (the same rule on every rank): a healthy run, with no alert.
    rule = torch.randn(shape.width, CLASSES, generator=torch.Generator().manual_seed(0))
    inputs = [torch.randn(shape.batch, shape.width, generator=gen) for _ in range(args.steps)]
    batches = [(x.to(device), (x @ rule).argmax(1).to(device)) for x in inputs]
    nets = {name: make_sharded(shape, device, seed) for seed, name in enumerate("rRw")}
    opts = {name: torch.optim.SGD(net.parameters(), lr=0.01) for name, net in nets.items()}
    peak = 1e12 if cpu else None  # a CPU has no known peak; a GPU's comes from the table
    out = io.StringIO()

    def watched() -> float:
        monitors = [
            stepwatch.AnomalyMonitor(),
            stepwatch.RunRecorder(db=db, system_every=None),
            stepwatch.DistributedMonitor(PRINT_EVERY, frozen_seconds=None),
            stepwatch.FlopsUtilizationCollector(PRINT_EVERY, computility=peak),
        ]
        return loop(nets["w"], opts["w"], batches, device, monitors)

    try:
        # 1. No host sync on quiet steps (CUDA checks it), and the MFU printed.
        guard = SyncGuard()
        collector = stepwatch.FlopsUtilizationCollector(PRINT_EVERY, computility=peak)
        monitors: list[Any] = [
            stepwatch.AnomalyMonitor(),
            stepwatch.RunRecorder(db=db, system_every=None),
            stepwatch.DistributedMonitor(PRINT_EVERY, frozen_seconds=None),
            collector,
        ]
        if not cpu:
            monitors.append(guard)
        with contextlib.redirect_stdout(out):
            loop(nets["w"], opts["w"], batches, device, monitors)
        # 2-3. The cost, interleaved; the collectives of a watched epoch.
        ratios: dict[str, list[float]] = {"a raw vs raw": [], "b watched": []}
        calls = 0
        for round_index in range(args.rounds + 1):
            for name in ratios:

                def config(name: str = name) -> float:
                    if name == "a raw vs raw":
                        return loop(nets["R"], opts["R"], batches, device, None)
                    return watched()

                with contextlib.redirect_stdout(io.StringIO()), counter.counting():
                    if round_index % 2:
                        t_config = config()
                        t_raw = loop(nets["r"], opts["r"], batches, device, None)
                    else:
                        t_raw = loop(nets["r"], opts["r"], batches, device, None)
                        t_config = config()
                if name == "b watched":
                    calls = counter.total
                if round_index:
                    ratios[name].append(t_raw / t_config)
        if rank == 0:
            world = dist.get_world_size()
            where = "CPU (gloo)" if cpu else torch.cuda.get_device_name(device)
            steps, rounds = args.steps, args.rounds
            print(f"gpu_fsdp: {world} process(es) on {where}, {steps} steps x {rounds} rounds")
            if not cpu:
                print(f"sync check: the host waited for the GPU during {len(guard.synced)} of "
                      f"{guard.steps} steps: {guard.synced[:40]}")  # fmt: skip
            mfu_lines = [line for line in out.getvalue().splitlines() if "mfu:" in line]
            print(f"FlopsUtilizationCollector: {collector.shard_flops} FLOPs per step and rank; "
                  f"last line: {mfu_lines[-1] if mfu_lines else '(none)'}")  # fmt: skip
            ok = collector.mfu is not None and 0 < collector.mfu <= 1
            print(f"MFU {collector.mfu:.4f} in (0, 1]: {'yes' if ok else 'NO'}")
            floor = statistics.median(ratios["a raw vs raw"])
            ratio = statistics.median(ratios["b watched"])
            verdict = "met" if ratio >= GOAL else "NOT met"
            low = min(ratios["b watched"])
            print(f"goal watched/raw >= {GOAL}: median {ratio:.3f} (min {low:.3f}) "
                  f"(noise floor {floor:.3f}) -> {verdict}")  # fmt: skip
            print(f"collectives stepwatch adds over {args.steps} steps: {calls}")
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
    shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per epoch (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="steps=120, rounds=1")
    parser.add_argument("--cpu", action="store_true", help="2 CPU processes: check the script")
    parser.add_argument("--db", help=argparse.SUPPRESS)  # set for the worker processes
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 120, 1
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be at least 2 and --rounds at least 1")
    if args.db:
        worker(args, Path(args.db))
        return 0
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_fsdp: skipped - no CUDA device here (torch.cuda.is_available() is False).")
        return 0
    world = 2 if args.cpu else torch.cuda.device_count()
    args_out = ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    return run_ranks(__file__, args_out + (["--cpu"] if args.cpu else []), world)


if __name__ == "__main__":
    sys.exit(main())
