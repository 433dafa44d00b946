"""A hand-written FSDP2 loop watched by stepwatch on every rank: the full model's gradient
statistics, a blow-up on one rank rolled back on all of them, a frozen rank that ends the job,
and the FLOPs and MFU of a step.

Run it: ``torchrun --nproc-per-node 2 examples/fsdp_watch.py [folder]`` (gloo on the CPU, NCCL
on GPUs), or on several machines with one launcher each (``--nnodes 2 --rdzv-backend c10d
--rdzv-endpoint host0:29500``). The run is stored in ``folder/runs.db`` (``fsdp-watch`` by
default, a folder rank 0 can write).

Every rank shards the same network layer by layer and then as a whole, and trains on batches
of its own. ``stepwatch.watch`` runs the same callbacks on every rank:

* ``AnomalyMonitor`` judges the gradient norms of the full model (one all-reduce of a few
  numbers per look, none on the steps between), so every rank decides the same. At step 200
  rank 1 gets a batch a thousand times too large, as a corrupted shard of data would: both
  ranks raise the alert at that step and roll back together, each restoring its own shards.
* ``DistributedMonitor`` gathers the ranks' losses and step times every 50 steps; with
  ``action={"frozen": "abort"}`` a rank that stops running (SIGSTOP, a frozen machine) ends the
  whole job within seconds of ``frozen_seconds``, naming the rank and its host, instead of
  leaving the others waiting in a collective for half an hour.
* ``FlopsUtilizationCollector`` counts one step's FLOPs once and prints the MFU every 100 steps
  (a GPU's peak comes from its name; a CPU's is given here as a round figure).
* ``RunRecorder`` records one run, from rank 0; only rank 0 prints.

Then ``stepwatch show fsdp-watch --db fsdp-watch/runs.db`` shows the alert and the rollback,
and ``stepwatch serve --db fsdp-watch/runs.db`` the loss beside the MFU.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import stepwatch as sw

STEPS = 400
BLOW_UP_AT = 200  # the step whose batch is corrupted on rank 1


def sharded_mlp(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)  # the same starting weights on every rank
    net = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)
    ).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def main(folder: Path) -> None:
    cuda = torch.cuda.is_available()
    # A collective that cannot complete raises after this, as a last line behind the monitors.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    device = torch.device("cuda", sw.distributed.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    net = sharded_mlp(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)  # made after sharding
    gen = torch.Generator().manual_seed(rank)  # each rank its own batches
    w = torch.linspace(-1.0, 1.0, 32)

    callbacks = [
        sw.LossMonitor(100),
        sw.AnomalyMonitor(
            action={"nonfinite": "stop", "spike": "rollback", "grad_explosion": "rollback"},
            rollback_every=50,
        ),
        sw.DistributedMonitor(every_n_steps=50, frozen_seconds=30, action={"frozen": "abort"}),
        sw.FlopsUtilizationCollector(100, computility=None if cuda else 1e11),
        sw.RunRecorder(db=folder / "runs.db", run_name="fsdp-watch"),
    ]
    run = sw.watch(net, opt, callbacks, epochs=1, steps_per_epoch=STEPS)
    with run:
        for step in range(1, STEPS + 1):
            x = torch.randn(64, 32, generator=gen)
            y = (x @ w).unsqueeze(1)
            if rank == 1 and step == BLOW_UP_AT:
                x = x * 1e3  # a corrupted batch on one rank only
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            run.step(loss.detach(), batch=(x, y))  # the batch: samples per second
            if run.should_stop:
                break
        run.epoch_end()
    if rank == 0:
        for restored, at in run.rollbacks:
            print(f"rolled back at step {at} to the copy of step {restored}")
        print(f"last step {run.step_num}")
    sw.distributed.shutdown()  # every rank leaves together


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "fsdp-watch"))
