"""One rank of the sharded (FSDP2) hand loops of tests/test_anomaly_sharded.py (gloo, CPU).

Run as ``python tests/_fsdp_worker.py OUT_DIR`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT set. Every scenario trains a network sharded with ``fully_shard`` (per layer,
then the root) on a one-dimensional CPU mesh of two ranks, in a loop watched by
``stepwatch.watch`` with an AnomalyMonitor; each rank gets its own batches. Each rank writes
what it saw to ``OUT_DIR/rank<r>.json``. Every call of ``torch.distributed.all_reduce`` is
counted, by the step it was made in.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PG_TIMEOUT = datetime.timedelta(seconds=30)


class Collectives:
    """Counts ``torch.distributed.all_reduce`` calls by the loop's current step."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: Counter[int] = Counter()
        self.on = False
        original = dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls[self.step] += 1
            return original(*args, **kwargs)

        dist.all_reduce = counted  # type: ignore[assignment]


COUNT = Collectives()


def shard(net: nn.Sequential) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def batches(rank: int, width: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches of a regression task (other rows on each rank)."""
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.linspace(-1.0, 1.0, width)
    out = []
    for _ in range(steps):
        x = torch.randn(16, width, generator=gen)
        out.append((x, (x @ w).unsqueeze(1) + 0.1 * torch.randn(16, 1, generator=gen)))
    return out


def train(
    net: nn.Sequential,
    monitor: Any,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float = 0.05,
    tamper: Callable[[int, nn.Sequential, torch.Tensor], torch.Tensor] | None = None,
    after_backward: Callable[[int, nn.Sequential], None] | None = None,
    count: bool = False,
) -> dict[str, Any]:
    """The hand loop: ``tamper(step, net, x)`` may change a step's inputs, ``after_backward``
    the gradients. Returns what the run saw."""
    import stepwatch

    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses: list[float] = []
    clip: dict[int, float] = {}
    run = stepwatch.watch(net, opt, callbacks=[monitor], steps_per_epoch=len(data))
    COUNT.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a NaN loss warns
        with run:
            for step, (x, y) in enumerate(data, start=1):
                COUNT.step, COUNT.on = step, False
                if tamper is not None:
                    x = tamper(step, net, x)
                opt.zero_grad()
                loss = nn.functional.mse_loss(net(x), y)
                loss.backward()
                if after_backward is not None:
                    after_backward(step, net)
                total = torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf)
                full = getattr(total, "full_tensor", None)
                clip[step] = float(full() if full is not None else total)
                opt.step()
                COUNT.on = count
                run.step(loss.detach())
                COUNT.on = False
                losses.append(float(loss))
                if run.should_stop:
                    break
            COUNT.step = len(data) + 1
            COUNT.on = count
            run.epoch_end()
            COUNT.on = False
    norms = dict(zip(monitor._history["grad_step"], monitor._history["grad_norm"]))
    return {
        "alerts": [[a.step, a.kind] for a in monitor.alerts],
        "outcomes": list(monitor.outcomes),
        "rollbacks": monitor.rollbacks,
        "run_rollbacks": [list(r) for r in run.rollbacks],
        "last_step": run.step_num,
        "losses": losses,
        "norms": {str(k): v for k, v in norms.items()},
        "clip": {str(k): clip[k] for k in norms if k in clip},
        "calls": {str(k): v for k, v in sorted(COUNT.calls.items())},
    }


def mlp(width: int = 16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))


def scenario_layers(rank: int) -> dict[str, Any]:
    """Per-layer norms of one measurement, against the full gradients' norms."""
    from stepwatch.distributed import sum_across
    from stepwatch.train.callback._anomaly_grads import GradStats

    net = shard(mlp())
    x, y = batches(rank, 16, 1)[0]
    nn.functional.mse_loss(net(x), y).backward()
    stats = GradStats(net, world=2)
    summed = sum_across([stats.measure()])[0]
    total, norms, dead, _ = stats.split(stats.finish(summed))
    clip = torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf)
    clip = getattr(clip, "full_tensor", lambda: clip)()
    full = [p.grad.full_tensor() for p in stats.params]  # type: ignore[union-attr]
    return {
        "total": total,
        "clip": float(clip),
        "norms": norms,
        "full": [float(g.norm()) for g in full],
        "dead": dead,
        "full_dead": [float((g.norm(dim=1) == 0).float().mean()) for g in full],
        "rows": stats.rows,
    }


def scenario_healthy(rank: int) -> dict[str, Any]:
    from stepwatch import AnomalyMonitor

    return train(shard(mlp()), AnomalyMonitor(), batches(rank, 16, 512), count=True)


def scenario_nan(rank: int) -> dict[str, Any]:
    from stepwatch import AnomalyMonitor

    def poison(step: int, net: nn.Sequential) -> None:
        if rank == 1 and step == 30:
            grad = net[0].weight.grad
            with torch.no_grad():
                grad.to_local()[0, 0] = math.nan  # this rank's shard only

    monitor = AnomalyMonitor(action={"nonfinite": "stop"})
    return train(shard(mlp()), monitor, batches(rank, 16, 80), after_backward=poison)


def scenario_blowup(rank: int) -> dict[str, Any]:
    from stepwatch import AnomalyMonitor

    def blow_up(step: int, net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        return x * 1e3 if rank == 1 and step == 200 else x

    actions = {"spike": "rollback", "grad_explosion": "rollback", "nonfinite": "stop"}
    monitor = AnomalyMonitor(action=actions, rollback_every=50)
    return train(shard(mlp()), monitor, batches(rank, 16, 300), tamper=blow_up)


def scenario_vanishing(rank: int) -> dict[str, Any]:
    from stepwatch import AnomalyMonitor

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(10):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    net = nn.Sequential(*layers, nn.Linear(16, 1))
    return train(shard(net), AnomalyMonitor(), batches(rank, 16, 60), lr=0.01)


SCENARIOS = {
    "layers": scenario_layers,
    "healthy": scenario_healthy,
    "nan": scenario_nan,
    "blowup": scenario_blowup,
    "vanishing": scenario_vanishing,
}


def main() -> int:
    out = Path(sys.argv[1])
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    try:
        result = {name: SCENARIOS[name](rank) for name in names}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
