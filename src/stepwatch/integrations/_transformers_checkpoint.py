"""The Hugging Face bridge's snapshot: a Trainer checkpoint folder, written mid-step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import transformers
from torch import nn

__all__ = ["write_checkpoint"]


def write_checkpoint(folder: Path, model: nn.Module, optimizer: Any, args: Any) -> Path:
    """Write ``model`` (``save_pretrained``, or its state dict as safetensors), the
    optimizer, the loss scaler and the random generators into ``folder`` as the Trainer lays a
    checkpoint out, so ``from_pretrained`` and ``train(resume_from_checkpoint=folder)`` read
    it; the schedule and the trainer state are written by the caller when the step ends."""
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(model, transformers.PreTrainedModel):
        model.save_pretrained(folder)
    else:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        try:
            safetensors.torch.save_file(
                state, str(folder / "model.safetensors"), metadata={"format": "pt"}
            )
        except RuntimeError:  # tensors that share memory (tied weights)
            torch.save(state, folder / "pytorch_model.bin")
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None:
        torch.save(scaler.state_dict(), folder / "scaler.pt")
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        world = int(args.world_size)
        cuda = torch.cuda.random
        rng["cuda"] = cuda.get_rng_state_all() if world > 1 else cuda.get_rng_state()
    name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    torch.save(rng, folder / name)
    return folder
