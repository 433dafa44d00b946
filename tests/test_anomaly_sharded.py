"""AnomalyMonitor in a hand loop over a network sharded with FSDP2 (``fully_shard``), on two
real processes (gloo on the CPU): the full model's gradient statistics, one collective per
look, and the same decisions on every rank.

The two ranks run every scenario of ``tests/_fsdp_worker.py`` once per module, with a
deadline; each rank is ended by its PID if it outlives it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from stepwatch import Store

from ._ranks import finish, launch, torchrun

pytest.importorskip("torch.distributed.fsdp")

WORKER = Path(__file__).with_name("_fsdp_worker.py")
DEADLINE = 240.0  # seconds for both ranks and every scenario (about 15 on an idle machine)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp")
    procs = launch(WORKER, str(out))
    results = [(code, err) for code, _, err in finish(procs, DEADLINE)]
    for code, err in results:
        assert code == 0, err[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_per_layer_and_global_norms_are_those_of_the_full_model(ranks: list[Any]) -> None:
    for seen in ranks:
        layers = seen["layers"]
        assert layers["rows"] == [64, 1]  # rank 1 holds no row of the last layer
        assert layers["norms"] == pytest.approx(layers["full"], rel=1e-6)
        assert layers["dead"] == layers["full_dead"]
        assert layers["total"] == pytest.approx(layers["clip"], rel=1e-6)
    assert ranks[0]["layers"]["norms"] == ranks[1]["layers"]["norms"]


def test_the_monitors_global_norm_is_clip_grad_norms_total(ranks: list[Any]) -> None:
    healthy = [seen["healthy"] for seen in ranks]
    norms, clip = healthy[0]["norms"], healthy[0]["clip"]
    assert len(norms) >= 10 and set(norms) == set(clip)  # steps 1, 11, 21, ... 128, 256, ...
    for step, norm in norms.items():
        assert norm == pytest.approx(clip[step], rel=1e-5), step
    assert healthy[1]["norms"] == norms  # the same numbers on both ranks


def test_no_false_alert_in_512_healthy_steps_and_one_collective_per_look(
    ranks: list[Any],
) -> None:
    healthy = [seen["healthy"] for seen in ranks]
    for run in healthy:
        assert run["alerts"] == [] and run["last_step"] == 512
        assert run["losses"][-1] < 0.1 * run["losses"][0]
    calls = {int(step): n for step, n in healthy[0]["calls"].items()}
    assert healthy[1]["calls"] == healthy[0]["calls"]
    # The looks: the losses every 8 steps (the gradients measured at 128 and 256 ride on
    # them), and the gradients measured on other steps while the explosion detector warms up.
    measured = {int(step) for step in healthy[0]["norms"]}
    looks = {s for s in range(8, 513, 8)} | measured
    assert set(calls) == looks and set(calls.values()) == {1}
    assert len(calls) == 64 + len(measured - set(range(8, 513, 8)))  # none on the other steps


def test_a_nan_in_one_ranks_gradient_shard_stops_both_ranks_at_the_same_step(
    ranks: list[Any],
) -> None:
    runs = [seen["nan"] for seen in ranks]
    assert runs[0]["alerts"] == runs[1]["alerts"]
    assert [kind for _, kind in runs[0]["alerts"]] == ["nonfinite"]
    step = runs[0]["alerts"][0][0]
    assert 30 <= step <= 38
    assert runs[0]["last_step"] == runs[1]["last_step"] <= 40
    assert runs[0]["outcomes"] == ["stopping training"] == runs[1]["outcomes"]


def test_a_blow_up_on_one_rank_is_rolled_back_on_both_to_a_finite_loss(
    ranks: list[Any],
) -> None:
    runs = [seen["blowup"] for seen in ranks]
    assert runs[0]["alerts"] == runs[1]["alerts"] == [[200, "spike"]]
    assert runs[0]["outcomes"] == runs[1]["outcomes"]
    assert "rolled back to step 150" in runs[0]["outcomes"][0]
    for run in runs:
        assert run["rollbacks"] == 1 and run["run_rollbacks"] == [[150, 200]]
        assert run["last_step"] == 300
        assert all(math.isfinite(v) for v in run["losses"][-50:])
        assert max(run["losses"][-50:]) < 1.0


def test_vanishing_gradients_of_a_deep_sigmoid_net_are_found_on_both_ranks(
    ranks: list[Any],
) -> None:
    runs = [seen["vanishing"] for seen in ranks]
    assert runs[0]["alerts"] == runs[1]["alerts"]
    assert "grad_vanishing" in [kind for _, kind in runs[0]["alerts"]]


def test_the_watched_fsdp_example_rolls_back_on_every_rank_and_stores_one_run(
    tmp_path: Path,
) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "fsdp_watch.py"
    code, out, err = torchrun(example, "out", cwd=tmp_path, timeout=240)
    assert code == 0, err[-3000:]
    # Rank 0 prints, once: the spike of rank 1's batch (a warning), the rollback, the MFU.
    assert err.count("step 200: loss jumped to") == 1
    assert out.count("rolled back at step 200 to the copy of step 150") == 1
    assert out.count("Full model flops is") == 1 and out.count("Train per step time:") == 4
    assert out.rstrip().endswith("last step 400")
    with Store(tmp_path / "out" / "runs.db") as store:
        [run] = store.runs()
        assert run.status == "finished"
        alerts = [e for e in store.events(run.id) if e["kind"] == "alert"]
        assert [(e["step"], e["data"]["kind"]) for e in alerts] == [(200, "spike")]
        assert alerts[0]["data"]["actions"][0].startswith("rolled back to step 150")
        steps, losses = store.metrics(run.id, "step_loss")
        assert steps.tolist() == list(range(1, 401)) and float(losses[-1]) < 1
        _, mfu = store.metrics(run.id, "mfu")
        assert len(mfu) == 4 and all(0 < m <= 1 for m in mfu)
        _, rates = store.metrics(run.id, "samples_per_second")
        assert len(rates) == 4 and all(r > 0 for r in rates)
