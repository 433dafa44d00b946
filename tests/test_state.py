"""TrainingState in one process: rollback copies that stay as they were, and the checks on a
sharded checkpoint's two parts (the FSDP2 runs themselves are in tests/test_sharded.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from stepwatch import load_checkpoint
from stepwatch.train.callback._callback import CallbackParams
from stepwatch.train.serialization import (
    FORMAT,
    VERSION,
    remove_checkpoint,
    write_atomic,
    writes_here,
)
from stepwatch.train.state import TrainingState
from stepwatch.view.host import TorchState


def _adam_step(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    net(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()


def test_a_rollback_copy_can_be_restored_again_after_training_went_on() -> None:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    _adam_step(net, opt)
    state = TorchState(TrainingState(net, opt))
    saved = state.capture()
    kept = {k: v.clone() for k, v in saved["optimizer"]["state"][0].items()}
    state.restore(saved)
    for _ in range(3):
        _adam_step(net, opt)  # Adam updates its state tensors in place
    # The copy is as it was taken: the optimizer was given tensors of its own.
    assert all(torch.equal(saved["optimizer"]["state"][0][k], kept[k]) for k in kept)
    state.restore(saved)
    now = opt.state_dict()["state"][0]
    assert all(torch.equal(now[k], kept[k]) for k in kept)


def _sharded_file(path: Path, folder: str) -> None:
    write_atomic(
        {
            "format": FORMAT,
            "version": VERSION,
            "sharded": True,
            "shards": folder,
            "network": {"weight": {"__shard__": "network.weight"}},
            "optimizer": None,
        },
        path,
    )


def test_a_sharded_checkpoint_without_its_shards_folder_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    _sharded_file(path, "ck.pt.shards-0badf00d")
    with pytest.raises(ValueError, match=r"shards folder .*ck\.pt\.shards-0badf00d.* is missing"):
        load_checkpoint(path, nn.Linear(4, 2, bias=False))


def test_removing_a_checkpoint_removes_its_shards_folders(tmp_path: Path) -> None:
    path = tmp_path / "ck.pt"
    _sharded_file(path, "ck.pt.shards-00000001")
    (tmp_path / "ck.pt.shards-00000001").mkdir()
    (tmp_path / "ck.pt.shards-00000001" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "other.pt.shards-00000002").mkdir()  # another file's: kept
    remove_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt.shards-00000002"]


def test_only_rank_zero_writes_the_checkpoints_of_a_network_that_is_not_sharded() -> None:
    net = nn.Linear(2, 2)
    assert writes_here(CallbackParams(rank_id=0, train_network=net))
    assert not writes_here(CallbackParams(rank_id=1, train_network=net))
