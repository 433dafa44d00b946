"""Mixed precision on a GPU: float16 with dynamic loss scaling, checked and timed.

1. ``Model(amp_level="O2")`` on CUDA resolves to ``16-mixed`` with a GradScaler; the forward
   runs in float16.
2. An infinite gradient injected at one step is skipped (the weights do not move, the scale
   halves, ``cb_params.skipped_steps`` counts it) - the skip path on real CUDA kernels.
3. Quiet steps run under ``torch.cuda.set_sync_debug_mode("error")`` with scaling and
   ``clip_grad_norm``: the overflow flag and the gradient norm stay on the device. (The
   optimizer is ``SGD(fused=True)``: with a non-fused optimizer, ``GradScaler.step`` itself
   reads the overflow flag on the host, in PyTorch and in any loop built on it.)
4. Steps/s of the O2 ``Model.train`` (with clipping) against a hand-written autocast +
   GradScaler + clip loop, interleaved, median ratio (goal >= 0.99).

Where there is no CUDA device it says so and exits 0.

Usage::

    python bench/gpu_amp.py                # 200 steps per epoch, 5 rounds
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

# The same GPU-bound MLP as bench/gpu_sync.py (this folder is on sys.path when run as a script).
from gpu_sync import BATCH, CLASSES, WIDTH, make_net
from torch import nn

import stepwatch


class Checks(stepwatch.Callback):
    """Injects one infinite gradient; guards quiet steps with the sync check."""

    order = -10_000

    def __init__(self, poison_step: int) -> None:
        self.poison_step = poison_step
        self.moved: list[bool] = []
        self.quiet = 0
        self.dtypes: set[torch.dtype] = set()

    def on_train_begin(self, run_context: stepwatch.RunContext) -> None:
        net = run_context.cb_params.network
        first = next(net.parameters())
        first.register_hook(self._hook)
        net[0].register_forward_hook(lambda m, i, out: self.dtypes.add(out.dtype))
        self._p = run_context.cb_params

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if self._p.cur_step_num == self.poison_step else grad

    def on_train_step_begin(self, run_context: stepwatch.RunContext) -> None:
        p = run_context.cb_params
        self._before = next(p.network.parameters()).detach().clone()
        loud = p.last_step_of_epoch or p.cur_step_num == 1
        torch.cuda.set_sync_debug_mode("default" if loud else "error")
        self.quiet += not loud

    def on_train_step_end(self, run_context: stepwatch.RunContext) -> None:
        torch.cuda.set_sync_debug_mode("default")
        now = next(run_context.cb_params.network.parameters())
        self.moved.append(not torch.equal(now, self._before))

    def __exit__(self, *err: object) -> None:
        torch.cuda.set_sync_debug_mode("default")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_amp: skipped - no CUDA device here (torch.cuda.is_available() is False).")
        return 0
    device = torch.device("cuda")
    x = torch.randn(args.steps * BATCH, WIDTH, device=device)
    y = torch.randint(0, CLASSES, (args.steps * BATCH,), device=device)
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]

    # 1-3. Resolution, the skip path, no sync on quiet steps.
    net = make_net(device)
    manager = stepwatch.DynamicLossScaleManager(init_loss_scale=2**16)
    model = stepwatch.Model(
        net,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(net.parameters(), 0.01, fused=True),
        amp_level="O2",
        loss_scale_manager=manager,
        clip_grad_norm=1.0,
    )
    checks = Checks(poison_step=5)
    model.train(1, batches, callbacks=[checks])
    skipped = [i + 1 for i, moved in enumerate(checks.moved) if not moved]
    print(f"precision: {model.precision}, forward dtypes seen: {sorted(map(str, checks.dtypes))}")
    print(
        f"skip path: steps that did not move the weights: {skipped} (expected [5]); "
        f"scale now {model.loss_scaler.get_scale():g} (started at {2**16})"
    )
    print(f"sync check: {checks.quiet} quiet steps under set_sync_debug_mode('error'): no error")

    # 4. Speed against the hand-written equivalent.
    raw_net = make_net(device)
    raw_opt = torch.optim.SGD(raw_net.parameters(), 0.01, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2**16)
    loss_fn = nn.CrossEntropyLoss()
    params = list(raw_net.parameters())

    def raw_epoch() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for xb, yb in batches:
            raw_opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(raw_net(xb), yb)
            scaler.scale(loss).backward()
            scaler.unscale_(raw_opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            scaler.step(raw_opt)
            scaler.update()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def model_epoch() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.train(1, batches)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    raw_epoch()
    model_epoch()
    ratios = []
    for i in range(args.rounds):
        if i % 2 == 0:
            t_raw, t_model = raw_epoch(), model_epoch()
        else:
            t_model, t_raw = model_epoch(), raw_epoch()
        ratios.append(t_raw / t_model)
    ratio = statistics.median(ratios)
    print(
        f"speed: O2 Model.train / hand-written autocast+GradScaler+clip loop steps/s = "
        f"{ratio:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) over {args.rounds} rounds "
        f"on {torch.cuda.get_device_name()}"
    )
    print(f"goal: ratio >= 0.99 -> {'met' if ratio >= 0.99 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
