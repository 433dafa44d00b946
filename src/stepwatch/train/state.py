"""The training state, captured and restored in one place.

What training changes - the network's weights, the optimizer's state, the learning-rate
schedule, the loss scale, every random generator (the data loader's included) and the state of
the stateful callbacks - is captured by :meth:`TrainingState.capture` and put back by
:meth:`TrainingState.restore`. Checkpoints (``ModelCheckpoint``, ``BackupAndRestore``,
``OnRequestExit``, anomaly snapshots), resuming a run, ``load_checkpoint`` and
``AnomalyMonitor``'s rollback all go through it, so they agree on what "the state" is.

A network sharded with FSDP2's ``fully_shard`` is captured and restored shard by shard, never
gathered onto one rank: a copy in memory holds each rank's own shards and is put back in place,
and a checkpoint file keeps the shards in a folder beside it, each rank writing and reading its
own (see :mod:`stepwatch.train.sharded`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from . import sharded
from .serialization import check_optimizer_matches, read_checkpoint, to_cpu

__all__ = ["TrainingState", "load_checkpoint", "rng_state", "set_rng_state"]

# The parts with a state_dict besides the network and the optimizer.
_SCHEDULES = ("lr_scheduler", "loss_scaler")


def data_generators(dataset: Any) -> list[torch.Generator]:
    """The generators a DataLoader shuffles with: its own ``generator=`` and its sampler's."""
    found: list[torch.Generator] = []
    holders = (
        dataset,
        getattr(dataset, "sampler", None),
        getattr(getattr(dataset, "batch_sampler", None), "sampler", None),
    )
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def rng_state(dataset: Any = None) -> dict[str, Any]:
    """Every random generator a training step may draw from: torch's, NumPy's, Python's,
    CUDA's, and those of ``dataset`` (a DataLoader built with ``generator=``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": [version, list(internal), py_gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if dataset is not None:
        generators = data_generators(dataset)
        if generators:
            state["data"] = [g.get_state() for g in generators]
    return state


def set_rng_state(state: dict[str, Any], dataset: Any = None) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("data")
    if dataset is not None and saved:
        generators = data_generators(dataset)
        if len(generators) != len(saved):
            raise ValueError(
                f"the checkpoint holds {len(saved)} data-loader generator states but this "
                f"run's dataset has {len(generators)} generators: resume with a DataLoader "
                "built the same way (the same generator= and sampler)."
            )
        for generator, generator_state in zip(generators, saved):
            generator.set_state(generator_state)


class TrainingState:
    """The state of one run's training objects.

    Args:
        network: the network being trained.
        optimizer: its optimizer, or None.
        lr_scheduler / loss_scaler: a torch LR scheduler and a loss scaler (anything with
            ``state_dict``/``load_state_dict``), or None.
        callbacks: the run's CallbackList (its stateful callbacks' state), or None.
        dataset: the training data, whose own random generators are part of the state.
    """

    def __init__(
        self,
        network: nn.Module,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        loss_scaler: Any = None,
        callbacks: Any = None,
        dataset: Any = None,
    ) -> None:
        self.network, self.optimizer = network, optimizer
        self.lr_scheduler, self.loss_scaler = lr_scheduler, loss_scaler
        self.callbacks, self.dataset = callbacks, dataset

    @classmethod
    def of(cls, owner: Any) -> TrainingState:
        """The state of ``owner``: an ``nn.Module`` (weights only), or anything with
        ``train_network`` and ``optimizer`` (a Model, the loop's parts, cb_params), whose
        ``lr_scheduler``, ``loss_scaler``, ``list_callback`` and ``train_dataset`` are taken
        when it has them."""
        if isinstance(owner, nn.Module):
            return cls(owner)
        get = owner.get if hasattr(owner, "keys") and hasattr(owner, "get") else None

        def field(name: str) -> Any:
            return get(name) if get is not None else getattr(owner, name, None)

        callbacks = field("list_callback")
        return cls(
            owner.train_network,
            field("optimizer"),
            field("lr_scheduler"),
            field("loss_scaler"),
            callbacks if hasattr(callbacks, "state_dicts") else None,  # a hand-made cb_params
            field("train_dataset"),
        )

    def capture(
        self, *, rng: bool = True, callbacks: bool = True, copy: bool = False
    ) -> dict[str, Any]:
        """The state as a checkpoint dict: ``network``, ``optimizer``, ``lr_scheduler``,
        ``loss_scaler``, and with ``rng`` every generator's state (``rng``), with
        ``callbacks`` the stateful callbacks' states (``callbacks``). ``copy=True`` copies every
        tensor to the CPU, so the result stays as it is while training goes on.

        For a sharded network the network's and optimizer's tensors are DTensors (this rank's
        shards; with ``copy``, copies of them) and ``sharded`` is True: written with
        :func:`~stepwatch.train.serialization.write_checkpoint`, every rank writes its own."""
        optimizer = self.optimizer
        state: dict[str, Any] = {
            "network": self.network.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
        }
        is_sharded = sharded.is_sharded(self.network)
        if is_sharded:
            state["sharded"] = True
        for name in _SCHEDULES:
            obj = getattr(self, name)
            state[name] = obj.state_dict() if obj is not None else None
        if rng:
            state["rng"] = rng_state(self.dataset)
        if callbacks and self.callbacks is not None:
            state["callbacks"] = to_cpu(self.callbacks.state_dicts())
        if not copy:
            return state
        return sharded.stash(state) if is_sharded else to_cpu(state)

    def restore(
        self,
        state: dict[str, Any],
        *,
        path: Any = "the saved state",
        strict: bool = True,
        rng: bool = False,
        callbacks: bool = False,
        copy: bool = False,
    ) -> None:
        """Put ``state`` (from :meth:`capture` or a checkpoint file) back.

        The optimizer is checked first, so a mismatch changes nothing. With ``rng`` the random
        generators are restored too, with ``callbacks`` the callbacks' states (matched by
        ``state_key``). With ``copy`` the optimizer gets its own copies of the saved tensors
        (its ``load_state_dict`` would otherwise keep them and update them in place), so the
        same saved state can be restored again later (a rollback copy).

        A sharded checkpoint's shards are read by every rank, each its own, straight into
        the network (every rank calls this); a copy from :meth:`capture` is put back shard by
        shard, with no collective.

        Raises:
            ValueError: the saved optimizer is of another kind or shape than this one; a
                sharded checkpoint's shards folder is missing or does not fit the network.
        """
        optimizer = self.optimizer
        saved_optimizer = state.get("optimizer")
        if optimizer is not None and saved_optimizer is not None:
            check_optimizer_matches(path, saved_optimizer, optimizer)
        if isinstance(state.get("shards"), str):
            state = sharded.load_shards(state, self.network, optimizer, f"{str(path)!r}")
            saved_optimizer = state.get("optimizer")
        elif sharded.has_local_shards(state.get("network")) or sharded.has_local_shards(
            saved_optimizer
        ):
            # Fresh DTensors from this rank's copies: the copy stays as it is.
            state = {**state, "network": sharded.unstash(state["network"])}
            saved_optimizer = sharded.unstash(saved_optimizer)
        elif sharded.is_sharded(self.network):
            # A checkpoint of the network unsharded: each rank keeps its slices of it.
            state = sharded.shard_full(state, self.network, optimizer)
            saved_optimizer = state.get("optimizer")
        elif copy and saved_optimizer is not None:
            saved_optimizer = to_cpu(saved_optimizer)
        try:
            self.network.load_state_dict(state["network"], strict=strict)
        except RuntimeError as exc:  # torch's wall of missing/unexpected/size-mismatch lines
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = "; ".join(lines[1:4]) if len(lines) > 1 else str(exc)
            raise ValueError(
                f"{str(path)!r} holds the weights of another network than this "
                f"{type(self.network).__name__}: {detail}. Build the network as it was when "
                "the checkpoint was saved."
            ) from None
        if optimizer is not None and saved_optimizer is not None:
            optimizer.load_state_dict(saved_optimizer)
        for name in _SCHEDULES:
            target = getattr(self, name)
            if target is not None and state.get(name) is not None:
                target.load_state_dict(state[name])
        if rng and state.get("rng") is not None:
            set_rng_state(state["rng"], self.dataset)
        if callbacks:
            self.restore_callbacks(state)

    def restore_callbacks(self, state: dict[str, Any]) -> None:
        """Give each stateful callback its saved state, matched by ``state_key``."""
        saved = state.get("callbacks", {})
        for cb in self.callbacks or ():
            key = getattr(cb, "state_key", None)
            if key is not None and key in saved:  # only stateful callbacks were saved
                cb.load_state_dict(saved[key])


def load_checkpoint(
    path: str | os.PathLike[str],
    model: Any = None,
    callbacks: Iterable[Any] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint; restore ``model``'s network and optimizer and the callbacks' state.

    Args:
        path: a file written by ``ModelCheckpoint``, ``BackupAndRestore`` or ``OnRequestExit``.
        model: a :class:`stepwatch.Model` (its network and optimizer are restored) or an
            ``nn.Module`` (its weights are restored), or None to only read the file.
        callbacks: callbacks whose state to restore, matched by ``state_key``.
        strict: passed to ``load_state_dict`` of the network.

    Returns:
        The checkpoint dict: ``network``, ``optimizer``, ``epoch``, ``step``,
        ``step_in_epoch``, ``epoch_complete``, ``callbacks``, ``append_info``, ...

    To resume training, pass the path to ``Model.train/fit(..., resume_from=path)`` instead:
    that also restores the random generators and continues at the saved epoch and step.
    """

    state = read_checkpoint(path)
    if model is not None:
        TrainingState.of(model).restore(state, path=path, strict=strict)
    if callbacks is not None:
        TrainingState(nn.Module(), callbacks=callbacks).restore_callbacks(state)
    return state
