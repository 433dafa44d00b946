"""Data-parallel training on two real processes (gloo on the CPU): one coherent run.

Each two-process run is started once per module (``tests/_dist_worker.py``) with a deadline;
the process group is torn down by every rank, and no process outlives its test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch import NumpySlicesDataset, Store
from stepwatch.distributed import all_gather_rows, broadcast_int, rank_and_world, sum_across

from ._dist_worker import make_data, make_model
from ._ranks import SRC, launch
from ._ranks import finish as _finish
from .conftest import wait_until

WORKER = Path(__file__).with_name("_dist_worker.py")


def _launch(scenario: str, out: Path) -> list[subprocess.Popen[str]]:
    return launch(WORKER, scenario, str(out))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dist")
    ranks = _finish(_launch("main", out), timeout=90)
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return {
        "out": out,
        "stdout": [r[1] for r in ranks],
        "results": [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)],
        "weights": {
            name: [torch.load(out / f"{name}-rank{r}.pt") for r in range(2)]
            for name in ("main", "full", "resumed", "accumulate")
        },
    }


def _allclose(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) for k in a)


def test_rank_zero_prints_each_loss_line_once(run: dict[str, Any]) -> None:
    lines = [line for line in run["stdout"][0].splitlines() if line.startswith("epoch:")]
    assert [line.split(",")[0] for line in lines] == [
        "epoch: 1 step: 4",
        "epoch: 1 step: 8",
        "epoch: 2 step: 4",
        "epoch: 2 step: 8",
    ]
    assert "\nepoch:" not in "\n" + run["stdout"][1]


def test_every_rank_prints_when_asked_prefixed_with_its_rank(run: dict[str, Any]) -> None:
    for rank, stdout in enumerate(run["stdout"]):
        mine = [line for line in stdout.splitlines() if line.startswith("[rank")]
        assert all(line.startswith(f"[rank {rank}] ") for line in mine)
        assert [line.split(",")[0] for line in mine if "loss is" in line] == [
            f"[rank {rank}] epoch: 1 step: 8",
            f"[rank {rank}] epoch: 2 step: 8",
        ]
        assert sum("Train epoch time" in line for line in mine) == 2


def test_each_rank_trains_a_disjoint_half(run: dict[str, Any]) -> None:
    x, _ = make_data()
    halves = [r["main"]["rows"] for r in run["results"]]
    epoch_one = [set(h[:32]) for h in halves]  # 8 steps of 4 rows per rank and epoch
    assert all(len(h) == 32 for h in epoch_one)
    assert not epoch_one[0] & epoch_one[1]
    assert epoch_one[0] | epoch_one[1] == set(x[:, 0].tolist())
    for rank, result in enumerate(run["results"]):
        assert result["main"]["fields"] == {
            "batch_num": 8,
            "local_rank": rank,
            "parallel_mode": "data_parallel",
            "device_number": 2,
        }


def test_gradients_are_averaged_as_one_global_batch(run: dict[str, Any]) -> None:
    main = run["weights"]["main"]
    assert _allclose(main[0], main[1], rtol=0, atol=0)  # replicas stay identical
    # One process with the global batch (8 rows: rank 0's 4 and rank 1's 4) ends the same.
    x, y = make_data()
    single = make_model()
    history = single.train(2, NumpySlicesDataset((x, y)).batch(8))
    assert _allclose(main[0], single.train_network.state_dict(), atol=1e-6)
    # The epoch loss and training metrics are the cross-rank values, the same on every rank.
    dist_history = [r["main"]["history"] for r in run["results"]]
    assert dist_history[0]["loss"] == dist_history[1]["loss"]
    assert dist_history[0]["loss"] == pytest.approx(history.history["loss"], rel=1e-5)
    assert dist_history[0]["train_accuracy"] == history.history["train_accuracy"]


def test_accumulation_matches_one_process_with_the_global_batch(run: dict[str, Any]) -> None:
    accumulated = run["weights"]["accumulate"]
    assert _allclose(accumulated[0], accumulated[1], rtol=0, atol=0)
    x, y = make_data()
    single = make_model(accumulate_grad_batches=2)
    single.train(1, NumpySlicesDataset((x, y)).batch(8))
    assert _allclose(accumulated[0], single.train_network.state_dict(), atol=1e-6)


def test_the_store_holds_one_run_with_the_reduced_loss(run: dict[str, Any]) -> None:
    store = Store(run["out"] / "runs.db")
    runs = store.runs()
    assert len(runs) == 1 and runs[0].name == "dist"
    assert run["results"][1]["main"]["run_id"] is None  # rank 1 never opened the store
    _, epoch_loss = store.metrics(runs[0].id, "loss")
    assert epoch_loss.tolist() == pytest.approx(run["results"][0]["main"]["history"]["loss"])
    keys = set(store.keys(runs[0].id))
    assert {"dist/loss_mean", "dist/loss_max", "dist/step_time_max", "dist/data_time_min"} <= keys


def test_eval_returns_the_global_metrics_on_every_rank(run: dict[str, Any]) -> None:
    # 30 rows: 15 per rank, reduced in one collective, equal to one process over all 30.
    single = make_model()
    single.train_network.load_state_dict(run["weights"]["main"][0])
    xv, yv = make_data(30, seed=1)
    expected = single.eval(NumpySlicesDataset((xv, yv)).batch(5))
    for result in run["results"]:
        assert result["main"]["eval"]["accuracy"] == pytest.approx(expected["accuracy"])
        assert result["main"]["eval"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)


def test_a_dataloader_without_distributed_sampler_warns_once(run: dict[str, Any]) -> None:
    assert [r["loader_warnings"] for r in run["results"]] == [1, 1]


def test_early_stopping_stops_every_rank_at_the_same_epoch(run: dict[str, Any]) -> None:
    early = [r["early"] for r in run["results"]]
    assert early[0]["stopped_epoch"] == early[1]["stopped_epoch"] > 0
    assert early[0]["stopped_epoch"] < 30
    assert early[0]["history"]["loss"] == early[1]["history"]["loss"]


def test_rank_zero_checkpoint_resumes_on_two_ranks(run: dict[str, Any]) -> None:
    latest = [r["ckpt"]["latest"] for r in run["results"]]
    assert latest[0] is not None and latest[0].endswith("ck-4_8.pt")
    assert latest[1] is None  # only rank 0 wrote
    files = sorted(p.name for p in (run["out"] / "ckpt").glob("ck-*.pt"))
    assert "ck-2_8.pt" in files
    full, resumed = run["weights"]["full"], run["weights"]["resumed"]
    assert _allclose(resumed[0], resumed[1], rtol=0, atol=0)
    # Resumed at epoch 2 with the shuffled shares replayed: the same as the uninterrupted run.
    assert _allclose(resumed[0], full[0], atol=1e-6)


def test_no_alert_on_a_healthy_run(run: dict[str, Any]) -> None:
    for result in run["results"]:
        assert result["main"]["alerts"] == []
        last = result["main"]["last"]
        assert last["loss_min"] <= last["loss_mean"] <= last["loss_max"]


def test_straggler_and_desync_are_reported_once_per_episode(run: dict[str, Any]) -> None:
    # Both conditions hold at the checks of steps 4 and 8: one episode each, one alert each.
    for result in run["results"]:
        kinds = [(step, kind) for step, kind, _ in result["alerts"]]
        assert sorted(kinds) == [(4, "desync"), (4, "straggler")]
        straggler = next(m for _, kind, m in result["alerts"] if kind == "straggler")
        assert straggler.startswith("step 4: rank 1 is a straggler")
    store = Store(run["out"] / "alerts.db")
    events = store.events(run["results"][0]["alerts_run_id"])
    alerts = [e for e in events if e["kind"] == "alert"]
    assert len(alerts) == 2
    assert {e["data"]["source"] for e in alerts} == {"DistributedMonitor"}
    assert all(e["message"].startswith(("rank 1", "rank ")) for e in alerts)


def test_anomaly_monitor_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    ranks = _finish(_launch("anomaly", tmp_path), timeout=90)
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["kind"] == results[1]["kind"] == "anomaly"
    assert results[0]["step"] == results[1]["step"] <= 30 + 8
    first = results[0]["alerts"][0][:2]
    assert first == results[1]["alerts"][0][:2]
    # the loss at step 30, or the gradients if a measurement (every 10 steps while the
    # explosion detector warms up) comes before the losses' next read, at step 32
    assert first in ([30, "nonfinite"], [31, "nonfinite"])


def test_a_rank_that_raises_makes_the_other_fail_fast(tmp_path: Path) -> None:
    procs = _launch("raise", tmp_path)
    (code0, _, _), (code1, _, err1) = _finish(procs, timeout=60)
    elapsed = time.time() - float((tmp_path / "raised").read_text())  # since rank 1 raised
    assert code1 != 0 and "rank 1 fails on purpose" in err1
    assert code0 != 0, "rank 0 should have failed with its peer"
    # Far below the process group's 30 s timeout: the failing rank tore the group down.
    assert elapsed < 25, f"rank 0 took {elapsed:.1f} s to fail"


def test_collectives_are_identities_in_one_process() -> None:
    assert rank_and_world() == (0, 1)
    summed = sum_across([torch.tensor([1.0, 2.0]), 3, 0.5])
    assert [t.tolist() for t in summed] == [[1.0, 2.0], 3.0, 0.5]
    assert all_gather_rows([1.0, torch.tensor(2.0)]).tolist() == [[1.0, 2.0]]
    assert broadcast_int(7) == 7


def test_demo_runs_on_two_processes(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    args = ["demo", "--nproc", "2", "--epochs", "2", "--db", "d.db", "--checkpoint-dir", "ck"]
    done = subprocess.run(
        [sys.executable, "-m", "stepwatch", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "2 processes" in out
    assert out.count("Eval result: epoch 2") == 1  # rank 0 prints, once
    accuracy = float(out.split("validation accuracy: ")[1].split()[0])
    assert accuracy > 0.8
    runs = Store(tmp_path / "d.db").runs()
    assert [r.status for r in runs] == ["finished"]  # one run, recorded by rank 0
    assert len(list((tmp_path / "ck").glob("digits-*.pt"))) == 1


def test_rank_shares_are_disjoint_padded_and_reshuffled_per_epoch() -> None:
    x = torch.arange(10.0).reshape(10, 1)
    ds = NumpySlicesDataset((x, torch.zeros(10)), shuffle=True).batch(2)
    shares = [ds.for_rank(rank, 3, seed=7) for rank in range(3)]
    assert [s.num_rows for s in shares] == [4, 4, 4]  # 10 rows padded to 12
    assert [s.get_dataset_size() for s in shares] == [2, 2, 2]
    epoch_one = [torch.cat([b[0] for b in s]).flatten().tolist() for s in shares]
    rows = sorted(v for share in epoch_one for v in share)
    assert set(rows) == set(range(10)) and len(rows) == 12  # two rows repeated as padding
    epoch_two = [torch.cat([b[0] for b in s]).flatten().tolist() for s in shares]
    assert epoch_two != epoch_one  # reshuffled, the same way on every rank
    # Without padding (evaluation), the shares are exact: 4 + 3 + 3 rows.
    exact = [ds.for_rank(rank, 3, seed=7, pad=False).num_rows for rank in range(3)]
    assert exact == [4, 3, 3]


def test_distributed_monitor_in_one_process_summarises_without_alerts() -> None:
    from stepwatch import DistributedMonitor

    monitor = DistributedMonitor(every_n_steps=2)
    x, y = make_data(32)
    with pytest.warns(UserWarning, match="DistributedMonitor is in a run of one process"):
        make_model().train(1, NumpySlicesDataset((x, y)).batch(8), callbacks=[monitor])
    assert monitor.alerts == []
    assert set(monitor.last) == {
        f"{name}_{stat}"
        for name in ("loss", "step_time", "data_time")
        for stat in ("mean", "min", "max")
    }
    assert monitor.last["loss_min"] == monitor.last["loss_max"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_steps": 0}, ValueError, "every_n_steps"),
        ({"straggler_factor": 1.0}, ValueError, "straggler_factor"),
        ({"desync_tolerance": -1.0}, ValueError, "desync_tolerance"),
        ({"loss_tolerance": "x"}, TypeError, "loss_tolerance"),
        ({"action": "abort"}, ValueError, "'action' must be 'warn' or a dict"),
        ({"action": 3}, TypeError, "'action' must be 'warn' or a dict"),
        ({"action": {"straggler": "abort"}}, ValueError, "for 'straggler' must be one of 'warn'"),
        ({"action": {"hang": "abort"}}, ValueError, "names the kind 'hang'"),
        ({"action": {"frozen": "abort"}, "frozen_seconds": None}, ValueError, "frozen_seconds"),
    ],
)
def test_distributed_monitor_checks_its_arguments(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    from stepwatch import DistributedMonitor

    with pytest.raises(error, match=match):
        DistributedMonitor(**kwargs)


def test_all_ranks_must_be_a_bool() -> None:
    from stepwatch import LossMonitor, TimeMonitor

    with pytest.raises(TypeError, match="all_ranks"):
        LossMonitor(1, all_ranks=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="all_ranks"):
        TimeMonitor(all_ranks="yes")  # type: ignore[arg-type]


def test_a_stopped_rank_is_named_before_the_collective_times_out(tmp_path: Path) -> None:
    import signal

    procs = _launch("frozen", tmp_path)
    db = tmp_path / "frozen.db"

    def named() -> bool:
        if not db.exists():
            return False
        try:
            with Store(db) as store:
                runs = store.runs()
                return bool(runs) and any(
                    e["kind"] == "alert" and e["data"]["kind"] == "frozen"
                    for e in store.events(runs[0].id)
                )
        except (OSError, ValueError, KeyError):
            return False

    try:
        wait_until(named, timeout=60, interval=0.1)  # rank 0 says so while it waits
    finally:
        procs[1].send_signal(signal.SIGCONT)  # let rank 1 go on: both finish the epoch
    ranks = _finish(procs, timeout=90)
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    alerts = json.loads((tmp_path / "rank0.json").read_text())["alerts"]
    assert [kind for _, kind, _ in alerts] == ["frozen"]
    # Named while rank 0 waited for it in step 6's gradient all-reduce.
    assert alerts[0][2].startswith("step 6: rank 1 (host ")
    # It stopped right after step 5, faster than a heartbeat: still named at its last step.
    assert "the last step it finished is 5," in alerts[0][2]
    with Store(db) as store:
        event = next(e for e in store.events(1) if e["kind"] == "alert")
        assert event["data"]["source"] == "DistributedMonitor" and "rank 1" in event["message"]


def test_distributed_monitor_under_fsdp2_compares_only_what_is_meant_to_be_equal(
    tmp_path: Path,
) -> None:
    ranks = _finish(_launch("sharded", tmp_path), timeout=120)
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        # FSDP2: each rank holds other shards, nothing to compare, no false alarm in 16 steps.
        assert result["fsdp"]["alerts"] == []
        last = result["fsdp"]["last"]
        assert last["loss_min"] <= last["loss_mean"] <= last["loss_max"]
        # FlopsUtilizationCollector on the sharded network: FlopCounterMode's count of a step.
        shard, full, by_hand = result["fsdp"]["flops"]
        assert shard == pytest.approx(by_hand, rel=0.02) and full == 2 * shard
        assert 0 < result["fsdp"]["mfu"] <= 1
        # HSDP over (replicate=2, shard=1): both ranks hold the same shards, which must agree.
        assert result["hsdp"]["healthy"] == []
        [(step, kind, message)] = result["hsdp"]["knocked"]
        assert (step, kind) == (4, "desync")
        assert message.startswith("step 4: rank 1's shards are out of step with rank 0's")
        # A hand loop's slow data on rank 1: a straggler, its wait counted as data wait.
        [(step, kind, message)] = result["slow_data"]["alerts"]
        assert (step, kind) == (4, "straggler") and message.startswith("step 4: rank 1 is a")
        last = result["slow_data"]["last"]
        assert last["data_time_max"] >= 0.04 > last["data_time_min"]
        # Model on a network sharded as one unit: the callbacks see its shards (DTensors),
        # and DistributedMonitor reads them safely at every look.
        one_unit = result["one_unit"]
        assert one_unit["kinds"] == ["DTensor"] and one_unit["alerts"] == []
        assert math.isfinite(one_unit["last"]["loss_mean"])
    with Store(tmp_path / "sharded.db") as store:
        [run] = store.runs()
        assert {"dist/loss_mean", "dist/step_time_max", "mfu", "flops_per_step"} <= set(
            store.keys(run.id)
        )
        _, means = store.metrics(run.id, "dist/loss_mean")
        assert len(means) == 4  # steps 4, 8, 12, 16


def test_a_process_launched_as_one_of_several_without_a_process_group_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun sets WORLD_SIZE; a script that forgets init_process_group trains alone.
    from torch import nn

    import stepwatch

    monkeypatch.setenv("WORLD_SIZE", "2")
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    told = pytest.warns(UserWarning, match=r"one of WORLD_SIZE=2 .*init_process_group")
    with told, stepwatch.watch(net, opt, [], steps_per_epoch=1) as run:
        run.step(nn.functional.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 1)))
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing to say
    with stepwatch.watch(net, opt, [], steps_per_epoch=1) as run:
        run.step(nn.functional.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 1)))
