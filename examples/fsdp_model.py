"""A network sharded with FSDP2 (``fully_shard``), trained through stepwatch's ``Model``.

Run it: ``torchrun --nproc-per-node 2 examples/fsdp_model.py [folder]`` (gloo on the CPU,
NCCL on GPUs; the folder, ``fsdp-run`` by default, must be one every rank can reach).

Each rank builds the same network, shards it layer by layer and then as a whole, and hands it
to ``Model`` as it is: FSDP2 gathers the parameters for each layer's forward and averages the
gradients, so the run trains as the same network would unsharded under DDP. ``Model`` gives
each rank its share of the data and prints rank 0's lines. The checkpoints are written by
every rank, each its own shards, into a folder beside each ``.pt`` file; a second ``Model``
then resumes from the newest one and trains one more epoch, exactly as if the run had not
stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import stepwatch as sw


def sharded_model(device: torch.device) -> sw.Model:
    torch.manual_seed(0)  # the same starting weights on every rank
    net = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    ).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)  # each layer gathered only for its own forward
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)  # made after sharding
    return sw.Model(net, nn.MSELoss(), optimizer, metrics={"mae"}, device=device)


def main(folder: Path) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", sw.distributed.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16)).astype(np.float32)
    y = (x @ rng.normal(size=(16, 1)) * 0.3).astype(np.float32)
    train = sw.NumpySlicesDataset((x[:896], y[:896]), shuffle=True).batch(16)  # per rank
    valid = sw.NumpySlicesDataset((x[896:], y[896:])).batch(64)

    def callbacks() -> list[sw.Callback]:
        config = sw.CheckpointConfig(save_checkpoint_steps=14, keep_checkpoint_max=2)
        return [sw.LossMonitor(14), sw.ModelCheckpoint("fsdp", folder, config)]

    model = sharded_model(device)
    recorder = sw.RunRecorder(db=folder / "runs.db", run_name="fsdp")
    first = callbacks()
    model.fit(3, train, valid, callbacks=[*first, recorder])
    # Its newest checkpoint (run again, the example writes beside the earlier run's files,
    # as MindSpore does: under the prefix fsdp_1, fsdp_2, ...).
    latest = first[1].latest_ckpt_file_name

    # A restarted job: a new sharded Model continues from the newest checkpoint, every rank
    # reading back its own shards (and the callbacks their state).
    resumed = sharded_model(device)
    resumed.fit(4, train, valid, callbacks=callbacks(), resume_from=latest)
    metrics = resumed.eval(valid)  # on every rank: FSDP2 gathers the weights in each forward
    if dist.get_rank() == 0:
        print(f"resumed after epoch 3; after epoch 4: {metrics}")
    sw.distributed.shutdown()  # every rank leaves together


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "fsdp-run"))
