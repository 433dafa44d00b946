"""FSDP2-sharded networks through ``Model`` on two real processes (gloo on the CPU): training as
the same network does unsharded under DDP, and sharded state (checkpoints, resume, backups,
rollback copies, snapshots) saved and loaded shard by shard.

Each two-process run is started once per module (``tests/_fsdp_model_worker.py``) with a deadline;
every rank is ended by its PID if it has not finished by then.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch import Store, load_checkpoint
from stepwatch.train.serialization import read_checkpoint

from ._fsdp_model_worker import STOP_AT, make_mlp
from ._ranks import finish as _finish
from ._ranks import launch, torchrun

WORKER = Path(__file__).with_name("_fsdp_model_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _launch(scenario: str, out: Path) -> list[subprocess.Popen[str]]:
    return launch(WORKER, scenario, str(out))


def _run(scenario: str, out: Path) -> list[dict[str, Any]]:
    ranks = _finish(_launch(scenario, out), timeout=90)
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank} of {scenario!r} failed:\n{err[-3000:]}"
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    train = _run("train", out)
    # What the interrupted run left, looked at before the resumed runs change it.
    left = {
        "ck": sorted(p.name for p in (out / "ck").iterdir()),
        "backup": sorted(p.name for p in (out / "backup").iterdir()),
    }
    resume = _run("resume", out)
    return {"out": out, "train": train, "resume": resume, "left": left}


def _load(out: Path, name: str) -> list[Any]:
    return [torch.load(out / f"{name}-rank{r}.pt") for r in range(2)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_network_trains_as_the_same_network_under_ddp(runs: dict[str, Any]) -> None:
    for rank in range(2):
        result = runs["train"][rank]
        ddp = result["ddp"]["loss"]
        assert ddp[-1] < ddp[0] / 4  # it learns
        for kind in ("whole", "layer", "hsdp"):
            sharded = result[kind]["loss"]
            assert not result[kind]["ddp"]  # no DistributedDataParallel over the shards
            assert sharded[-1] == pytest.approx(ddp[-1], rel=0.02)
            assert sharded == pytest.approx(ddp, rel=1e-4)  # in fact the same run
        assert result["layer_clip"]["loss"] == pytest.approx(result["ddp_clip"]["loss"], rel=1e-4)
        assert result["layer_acc"]["loss"] == pytest.approx(result["ddp_acc"]["loss"], rel=1e-4)
        # The clipped step's global norm is the whole model's, as DDP's is.
        assert len(result["layer_clip"]["norms"]) == 5
        assert result["layer_clip"]["norms"] == pytest.approx(result["ddp_clip"]["norms"], 1e-5)


def test_sharded_evaluation_on_uneven_shares_gives_the_global_metrics(
    runs: dict[str, Any],
) -> None:
    # 9 rows: rank 0 runs two batches, rank 1 one; FSDP2 gathers in every forward.
    for rank in range(2):
        result = runs["train"][rank]
        for kind in ("whole", "layer"):
            assert result[kind]["eval"]["mae"] == pytest.approx(result["ddp"]["eval"]["mae"], 1e-4)
        # MindSpore's eval network with eval_indexes around the sharded network, too.
        assert result["layer_indexed_eval"]["mae"] == pytest.approx(result["layer"]["eval"]["mae"])


def test_sharded_checkpoints_hold_each_ranks_shards_beside_the_file(runs: dict[str, Any]) -> None:
    out = runs["out"]
    left = runs["left"]
    # keep_checkpoint_max=2: the step-5 file went, and its shards folder with it.
    files = [n for n in left["ck"] if n.endswith(".pt")]
    assert files == ["fsdp-2_2.pt", "fsdp-2_3.pt", "fsdp-last.pt"]
    folders = [n for n in left["ck"] if ".shards-" in n]
    assert sorted(f.split(".shards-")[0] for f in folders) == ["fsdp-2_2.pt", "fsdp-2_3.pt"]
    state = read_checkpoint(out / "ck" / "fsdp-2_2.pt")
    assert state["sharded"] and state["step"] == 10
    # The file holds no weights: each is a reference into the folder, which each rank wrote.
    assert state["network"]["0.weight"] == {"__shard__": "network.0.weight"}
    folder = Path(state["shards"])
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # The backup was rewritten in place: one file, one folder (the older ones deleted).
    assert len(left["backup"]) == 2 and "backup.pt" in left["backup"]


def test_a_sharded_run_resumes_exactly_in_new_processes(runs: dict[str, Any]) -> None:
    out = runs["out"]
    reference = _load(out, "uninterrupted")
    for name in ("checkpoint", "backup", "exit"):
        resumed = _load(out, f"resumed-{name}")
        for rank in range(2):
            assert _equal(resumed[rank]["local"], reference[rank]["local"]), (name, rank)
    assert runs["train"][0]["exit_checkpoint"].endswith("Net.pt")
    # The resumed backup run ended normally: its backup and shards are gone.
    assert list((out / "backup").iterdir()) == []


def test_rollback_copies_of_shards_restore_in_place_and_repeatably(runs: dict[str, Any]) -> None:
    for rank in range(2):
        rollback = runs["train"][rank]["rollback"]
        assert rollback == {
            "changed": True,
            "weights_back": True,
            "optimizer_back": True,
            "repeatable": True,
        }


def test_one_process_reads_a_sharded_checkpoint_into_an_unsharded_network(
    runs: dict[str, Any],
) -> None:
    out = runs["out"]
    net = make_mlp(5)
    load_checkpoint(out / "snap" / "anomaly-spike-step7.pt", net)
    expected = runs["train"][0]["snapshot_weights"]
    for key, value in net.state_dict().items():
        assert torch.equal(value, torch.tensor(expected[key])), key
    assert json.loads((out / "snap" / "anomaly-spike-step7.json").read_text())["trained_step"] == 7
    # A resumable checkpoint too: the reference run's weights at the stop, whole.
    net = make_mlp(5)
    state = load_checkpoint(out / "exit" / "Net.pt", net)
    assert state["step"] == STOP_AT


def test_a_ddp_checkpoint_loads_into_a_sharded_network(runs: dict[str, Any]) -> None:
    out = runs["out"]
    ddp = _load(out, "ddp")[0]
    for rank in range(2):
        assert _equal(_load(out, "ddp-into-sharded")[rank], ddp)


def test_a_tensor_parallel_layout_is_refused_naming_the_network(runs: dict[str, Any]) -> None:
    message = runs["train"][0]["tp_error"]
    assert message.startswith("'network' parameter '0.weight' is a DTensor laid out as")
    assert "stepwatch.watch" in message


def test_the_fsdp_example_trains_and_resumes_under_torchrun(tmp_path: Path) -> None:
    code, out, err = torchrun(ROOT / "examples" / "fsdp_model.py", "out", cwd=tmp_path, timeout=120)
    assert code == 0, err[-3000:]
    assert out.count("Eval result: epoch 3") == 1  # rank 0 prints, once
    assert out.count("Eval result: epoch 4") == 1  # the resumed run's epoch
    final = float(out.split("after epoch 4: {'mae': ")[1].split("}")[0])
    first = float(out.split("Eval result: epoch 1, metrics: {'mae': ")[1].split("}")[0])
    assert final < first / 2
    assert "holds state for callbacks" not in err  # the resumed run took every callback's state
    folder = tmp_path / "out"
    pairs = sorted(p.name for p in folder.glob("fsdp-*.pt") if p.name != "fsdp-last.pt")
    assert pairs == ["fsdp-4_14.pt", "fsdp-4_28.pt"]  # the series went on, two kept
    assert len(list(folder.glob("fsdp-*.pt.shards-*"))) == 2  # one shards folder each
    assert [r.status for r in Store(folder / "runs.db").runs()] == ["finished"]
    # Run again in the same folder: rank 0 names the new series fsdp_1 (as MindSpore does),
    # every rank writes and resumes under that name, and the run ends as the first did.
    again, out_again, err = torchrun(
        ROOT / "examples" / "fsdp_model.py", "out", cwd=tmp_path, timeout=120
    )
    assert again == 0, err[-3000:]
    assert out_again.split("after epoch 4: ")[1] == out.split("after epoch 4: ")[1]
    pairs = sorted(p.name for p in folder.glob("fsdp_1-*.pt") if p.name != "fsdp_1-last.pt")
    assert pairs == ["fsdp_1-4_14.pt", "fsdp_1-4_28.pt"]
    assert [r.status for r in Store(folder / "runs.db").runs()] == ["finished", "finished"]
