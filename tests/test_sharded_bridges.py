"""The bridges under sharding (FSDP2), on two real CPU processes (gloo): what runs here, and
what the bridge does where it runs.

- Lightning's ModelParallelStrategy (FSDP2, ``fully_shard`` in ``configure_model``) runs on the
  CPU: the bridge keeps the gradient detectors on, reading the full model's norm; a NaN on one
  rank stops both at the same step; a rollback restores each rank's own shards.
- Lightning's FSDPStrategy (FSDP1) needs a GPU: Lightning refuses it on the CPU.
- The Hugging Face Trainer shards only on GPUs: on the CPU accelerate drops ``fsdp=...`` and
  trains under DDP (the bridge says so, and watches the DDP run it is); a model sharded
  beforehand is refused by ``attach`` with a clear error (the Trainer's DDP cannot wrap it).

Each job's two ranks are started here (Lightning then starts no process of its own) with a
deadline, and each is ended by its PID if it outlives it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stepwatch import Store
from stepwatch.monitor import values

from ._ranks import finish, launch

JOBS = Path(__file__).resolve().parent / "jobs"
ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 180.0  # seconds for a whole two-process job (about 30 on a quiet 2-core machine)


def _two_ranks(job: str, out: Path, *args: str) -> list[dict[str, Any]]:
    """Run ``job`` as ranks 0 and 1 of one process group; each rank's JSON result."""
    procs = launch(
        JOBS / job,
        str(out),
        *args,
        env={"NODE_RANK": "0", "PYTHONWARNINGS": "ignore"},
        cwd=out,
    )
    done = finish(procs, DEADLINE)  # past the deadline: each rank ended by its own PID
    for rank, (code, _, stderr) in enumerate(done):
        assert code == 0, f"rank {rank} of {job} failed:\n{stderr[-4000:]}"
    return [
        {**json.loads((out / f"rank{r}.json").read_text()), "stdout": done[r][1]} for r in range(2)
    ]


def _one_run(db: Path) -> Any:
    with Store(db) as store:
        (run,) = store.runs()
        alerts = [e for e in store.events(run.id) if e["kind"] == "alert"]
        steps = store.metrics(run.id, values.STEP_LOSS)[0].tolist()
    return run, alerts, steps


# -- Lightning: ModelParallelStrategy (FSDP2) --------------------------------------------------
@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning_fsdp")
    return {"out": out, "ranks": _two_ranks("lightning_fsdp_job.py", out)}


def test_lightning_fsdp2_shards_and_keeps_the_gradient_detectors_on(
    lightning: dict[str, Any],
) -> None:
    healthy = [r["healthy"] for r in lightning["ranks"]]
    for rank in healthy:
        assert rank["param_type"] == "DTensor"
        assert (rank["grads"], rank["restores"]) == (True, True)
        assert rank["steps"] == list(range(1, 33))  # 2 epochs of 16 steps on each rank
        assert rank["alerts"] == []
    # The ranks hold different shards of the model, and see the same full-model norm.
    sizes = [r["rollback"]["shard_sizes"] for r in lightning["ranks"]]
    assert sizes[0] != sizes[1] and sum(map(sum, sizes)) == 4 * 16 + 16 + 16 + 1
    assert healthy[0]["reference"] == healthy[1]["reference"]
    # AnomalyMonitor's global gradient norm is clip_grad_norm_'s total over the shards.
    for rank in healthy:
        measured = rank["measured"]
        assert len(measured) >= 4
        for step, norm in measured.items():
            assert norm == pytest.approx(rank["reference"][step], rel=1e-5)
    assert healthy[0]["measured"] == healthy[1]["measured"]
    run, alerts, steps = _one_run(lightning["out"] / "healthy.db")
    assert (run.status, run.config["host"], alerts) == ("finished", "lightning", [])
    assert run.config["host_config"]["trainer"]["strategy"] == "ModelParallelStrategy"
    assert steps == list(range(1, 33))


def test_lightning_fsdp2_a_nan_on_one_rank_stops_both_at_the_same_step(
    lightning: dict[str, Any],
) -> None:
    nan = [r["nan"] for r in lightning["ranks"]]
    # Lightning's step 20 is stepwatch's step 21: the NaN in rank 1's loss (and so in every
    # rank's gradient shards) is alerted on both ranks at that step, and both stop there.
    for rank in nan:
        assert rank["alerts"] == [[21, "nonfinite"]]
        assert rank["stop_reason"] == "nonfinite at step 21"
    assert nan[0]["global_step"] == nan[1]["global_step"] <= 24
    assert nan[0]["steps"] == nan[1]["steps"] == list(range(1, nan[0]["global_step"] + 1))
    run, alerts, steps = _one_run(lightning["out"] / "nan.db")
    assert (run.name, run.status) == ("nan", "anomaly")
    assert [(e["step"], e["data"]["kind"]) for e in alerts] == [(21, "nonfinite")]
    assert steps == nan[0]["steps"]
    out = [r["stdout"] for r in lightning["ranks"]]
    # One set of LossMonitor's lines: rank 0's.
    assert out[0].count("epoch: 1 step: 8, loss is") == 1 and "loss is" not in out[1]


def test_lightning_fsdp2_rollback_restores_each_ranks_shards(lightning: dict[str, Any]) -> None:
    for rank in (r["rollback"] for r in lightning["ranks"]):
        assert rank["rollbacks"] == [[20, 21]]  # to the copy of step 20, at step 21
        assert rank["outcomes"] == [
            "rolled back to step 20 (1 of 3); the batch of step 21 is skipped"
        ]
        # The parameters' and Adam's shards after the rollback are those kept at step 20.
        assert rank["restored_equal_kept"] is True
        assert rank["stop_reason"] is None and rank["global_step"] == 32
        assert rank["final_finite"] is True


def test_lightning_fsdp1_needs_a_gpu() -> None:
    """Lightning's FSDPStrategy cannot run here: Lightning refuses it on the CPU (the bridge's
    docs send sharded CPU runs to ModelParallelStrategy)."""
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)


# -- Hugging Face Trainer: accelerate's FSDP is for GPUs ---------------------------------------
@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("transformers_fsdp")
    return {"out": out, "ranks": _two_ranks("transformers_fsdp_job.py", out, "5")}


def test_transformers_fsdp_on_the_cpu_trains_under_ddp_and_the_bridge_says_so(
    transformers_run: dict[str, Any],
) -> None:
    ranks = [r["fsdp_args"] for r in transformers_run["ranks"]]
    for rank in ranks:
        assert (rank["fsdp_enabled"], rank["distributed_type"]) == (
            False,
            "DistributedType.MULTI_CPU",
        )
        # The whole model on every rank: the gradient detectors and rollback stay on.
        assert (rank["grads"], rank["restores"]) == (True, True)
        # Rank 1's NaN (step 5) stops both ranks at the same step (the losses read at step 8).
        assert rank["alerts"] == [[5, "nonfinite"]] and rank["stop_reason"] == "nonfinite at step 5"
        assert rank["global_step"] == 8 and rank["steps"] == list(range(1, 9))
    dropped = [m for m in ranks[0]["warnings"] if "TrainingArguments(fsdp=...)" in m]
    assert len(dropped) == 1 and "accelerate shards (FSDP) only on GPUs" in dropped[0]
    assert not any("TrainingArguments(fsdp=...)" in m for m in ranks[1]["warnings"])
    run, alerts, steps = _one_run(transformers_run["out"] / "runs.db")
    assert (run.name, run.status, run.config["host"]) == ("fsdp-args", "anomaly", "transformers")
    assert [(e["step"], e["data"]["kind"]) for e in alerts] == [(5, "nonfinite")]
    assert steps == list(range(1, 9))


def test_transformers_attach_refuses_a_model_sharded_beforehand(
    transformers_run: dict[str, Any],
) -> None:
    for rank in transformers_run["ranks"]:
        message = rank["preshard"]
        assert message is not None and message.startswith(
            "attach() got a Trainer whose model is sharded already (fully_shard"
        )
        assert "accelerate runs FSDP only on GPUs, and this one trains on 'cpu'" in message
        assert "stepwatch.watch or stepwatch.Model" in message
