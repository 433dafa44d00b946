"""The reading contract every store keeps: one suite, run over a local SQLite file and a team
store on a real PostgreSQL server (a throwaway cluster, tests/pg_cluster.py).

Each test writes through :class:`RunWriter` (or a backend's own writing interface) and reads
back through :class:`Store`, and expects the same answers from both; downsampled curves are
checked against a reference computed here from the points written.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepwatch import RunWriter, Store
from stepwatch.store.backends import rollup
from stepwatch.store.base import open_write_backend
from stepwatch.store.reader import delete_runs

from .pg_cluster import pg_cluster_fixture, pg_url_fixture  # noqa: F401 - fixtures

KINDS = ["sqlite", "postgresql"]


@pytest.fixture(params=KINDS)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new, empty store of each kind: a file path, or a PostgreSQL URL."""
    if request.param == "sqlite":
        yield str(tmp_path / "runs.db")
    else:
        yield request.getfixturevalue("pg_url")


def _kind(where: str) -> str:
    return "postgresql" if where.startswith("postgresql://") else "sqlite"


def _run(where: str, name: str, status: str = "finished", **keys: Any) -> int:
    """A closed run with ``keys``: ``{key: (steps, values)}`` (epoch 1)."""
    writer = RunWriter(where, name=name, config={"name": name})
    for key, (steps, values) in keys.items():
        writer.log_batch(key, steps, np.asarray(values, dtype=np.float64), epoch=1)
    writer.close(status)
    assert writer.run_id is not None
    return writer.run_id


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b)
    )


# -- runs -------------------------------------------------------------------------------------
def test_runs_are_listed_oldest_first_and_found_by_id_or_name(where: str) -> None:
    first = _run(where, "alpha")
    second = _run(where, "beta", "failed")
    third = _run(where, "alpha")
    with Store(where) as store:
        runs = store.runs()
        assert [(r.id, r.name, r.status) for r in runs] == [
            (first, "alpha", "finished"), (second, "beta", "failed"), (third, "alpha", "finished")
        ]  # fmt: skip
        assert runs[0].config == {"name": "alpha"} and runs[0].ended is not None
        assert runs[0].host and runs[0].pid == os.getpid() and runs[0].dropped == 0
        assert store.run("alpha").id == third  # the newest of that name
        assert store.run(str(second)).name == "beta" and store.run(first).name == "alpha"
        with pytest.raises(KeyError, match="no run 'gamma'"):
            store.run("gamma")
        with pytest.raises(KeyError, match="no run 99"):
            store.keys(99)
        with pytest.raises(TypeError, match="'run' must be a run id or name"):
            store.run(1.5)  # type: ignore[arg-type]


def test_runs_filters_by_name_status_host_and_last(where: str) -> None:
    import socket

    for name in ("lr=0.1", "lr=0.2", "other"):
        _run(where, name)
    _run(where, "broken", "failed")
    with Store(where) as store:
        assert [r.name for r in store.runs(name="lr=*")] == ["lr=0.1", "lr=0.2"]
        assert [r.name for r in store.runs(name="0.")] == ["lr=0.1", "lr=0.2"]
        assert [r.name for r in store.runs(name="[ob]*")] == ["other", "broken"]
        assert [r.name for r in store.runs(status="failed")] == ["broken"]
        assert [r.name for r in store.runs(last=2)] == ["other", "broken"]
        assert [r.name for r in store.runs(status="finished", last=1)] == ["other"]
        assert len(store.runs(host=socket.gethostname())) == 4
        assert store.runs(host="no-such-host") == [] and store.runs(name="nope") == []
        with pytest.raises(ValueError, match="'status'"):
            store.runs(status="done")
        with pytest.raises(ValueError, match="'last'"):
            store.runs(last=0)
        with pytest.raises(TypeError, match="'name' must be a str or None"):
            store.runs(name=3)  # type: ignore[arg-type]
        if _kind(where) == "postgresql":  # a team store records who ran each run
            assert len(store.runs(user=store.runs()[0].user)) == 4
        else:
            with pytest.raises(ValueError, match="a local store records no users"):
                store.runs(user="me")


def test_a_run_being_recorded_is_running_and_read_live(where: str) -> None:
    writer = RunWriter(where, name="live", flush_seconds=0.05)
    try:
        writer.log_batch("step_loss", range(100), np.full(100, 2.0), epoch=1)
        assert writer.flush()
        with Store(where) as store:
            run = store.run("live")
            assert run.status == run.stored_status == "running" and run.steps == 99
            steps, _ = store.metrics(run.id, "step_loss", after=95)
            assert steps.tolist() == [96, 97, 98, 99]
            assert store.metrics(run.id, "step_loss", after=99)[0].tolist() == []
            writer.log_batch("step_loss", range(100, 110), np.zeros(10), epoch=2)
            assert writer.flush()
            assert store.metrics(run.id, "step_loss", after=99)[0].tolist() == list(range(100, 110))
            with pytest.raises(ValueError, match=r"run \d+ \(live\) is still running"):
                store.delete_runs(["live"])
    finally:
        writer.close()


def test_a_continued_run_is_running_again_and_keeps_what_it_had(where: str) -> None:
    first = RunWriter(where, name="job", config={"lr": 0.1})
    run = first.run_id
    assert run is not None
    first.log_batch("loss", range(1, 6), np.arange(1.0, 6.0), epoch=1)
    first.event("note", "first attempt")
    first.close("failed")
    again = RunWriter(where, name="ignored", config={"lr": 9}, continue_run=run)
    assert again.run_id == run and again.name == "job"
    with Store(where) as store:
        assert store.run(run).stored_status == "running"
    again.event("restart", "second attempt")
    again.log_batch("loss", range(6, 9), np.arange(6.0, 9.0), epoch=2)
    again.close("finished")
    with Store(where) as store:
        [info] = store.runs()
        assert info.status == "finished" and info.ended is not None
        assert info.config == {"lr": 0.1}
        steps, values = store.metrics(run, "loss")
        assert steps.tolist() == list(range(1, 9)) and values.tolist() == list(range(1, 9))
        assert [e["message"] for e in store.events(run)] == ["first attempt", "second attempt"]
    with pytest.raises(ValueError, match=f"no run {run + 1} to continue"):
        RunWriter(where, continue_run=run + 1)
    with pytest.raises(ValueError, match="continue_run"):
        RunWriter(where, continue_run=0)


# -- metrics ------------------------------------------------------------------------------------
def test_keys_metrics_summary_and_points(where: str) -> None:
    values = [0.5, 0.25, math.nan, 1.0, 0.125]
    rid = _run(where, "m", step_loss=(range(1, 6), values), loss=([5], [0.375]))
    with Store(where) as store:
        assert store.keys(rid) == ["loss", "step_loss"]
        steps, got = store.metrics(rid, "step_loss")
        assert steps.tolist() == [1, 2, 3, 4, 5] and _same(got.tolist(), values)
        assert store.metrics(rid, "step_loss", start=2, end=4)[0].tolist() == [2, 3, 4]
        assert store.metrics(rid, "step_loss", after=3)[0].tolist() == [4, 5]
        assert store.metrics(rid, "step_loss", start=9)[0].tolist() == []  # a key, no points
        assert store.metrics(rid, "step_loss", max_points=5)[0].tolist() == [1, 2, 3, 4, 5]
        with pytest.raises(KeyError, match=r"run \d+ has no metric 'acc'"):
            store.metrics(rid, "acc")
        with pytest.raises(TypeError, match="'key' must be a str"):
            store.metrics(rid, 1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="'max_points'"):
            store.metrics(rid, "step_loss", max_points=1)
        summary = store.summary(rid)
        assert summary["loss"] == {"last": 0.375, "min": 0.375, "max": 0.375, "count": 1,
                                   "last_step": 5}  # fmt: skip
        assert summary["step_loss"] == {"last": 0.125, "min": 0.125, "max": 1.0, "count": 5,
                                        "last_step": 5}  # fmt: skip
        points = store.points(rid)
        assert [(k, s, e) for k, s, e, _, _ in points] == [("loss", 5, 1)] + [
            ("step_loss", s, 1) for s in range(1, 6)
        ]
        assert _same([v for *_, v in points], [0.375, *values])
        assert all(isinstance(t, float) and t > 0 for _, _, _, t, _ in points)


def _reference(
    steps: np.ndarray, values: np.ndarray, lo: int, hi: int, max_points: int, align: int
) -> list[tuple[int, float | None]]:
    """Per bucket of ``rollup.bounds``: its minimum and maximum (the smaller step on a tie)
    and its first NaN, computed from the points."""
    edges = rollup.bounds(lo, hi, max_points, align)
    found: set[tuple[int, float | None]] = set()
    for first, stop in itertools.pairwise(edges):
        inside = (steps >= first) & (steps < stop)
        s, v = steps[inside], values[inside]
        numbers = ~np.isnan(v)
        if numbers.any():
            sn, vn = s[numbers], v[numbers]
            found.add((int(sn[np.argmin(vn)]), float(vn.min())))
            found.add((int(sn[np.argmax(vn)]), float(vn.max())))
        if (~numbers).any():
            found.add((int(s[~numbers].min()), None))
    return sorted(found, key=lambda r: (r[0], r[1] is not None, r[1] or 0.0))


@pytest.mark.parametrize(
    ("max_points", "bounds"),
    [
        (200, {}),  # rollup blocks of 64 steps and more: the rollup path
        (64, {"start": 100, "end": 9_000}),  # the rollup path, its two edges from the points
        (500, {"after": 15_000}),  # buckets of 20 steps: the exact path
        (9, {"start": 7_000, "end": 7_100}),  # the exact path over a short range
    ],
)
def test_downsampled_curves_keep_each_buckets_extremes(
    where: str, max_points: int, bounds: dict[str, int]
) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(20_000).cumsum()
    values[[5, 777, 7_050, 13_000]] = np.nan
    values[9_999] = 1e6  # a one-step spike
    values[7_020] = values[7_030] = 99.0  # a tie: the smaller step wins
    writer = RunWriter(where, name="curve", flush_seconds=0.05)
    for at in range(0, 20_000, 5_000):  # several batches: the rollups are merged
        writer.log_batch("step_loss", range(at, at + 5_000), values[at : at + 5_000], epoch=1)
    writer.close()
    steps = np.arange(20_000)
    lo = bounds.get("start", bounds.get("after", -1) + 1)
    hi = bounds.get("end", 19_999)
    align = rollup.pick_width(rollup.WIDTHS, lo, hi, max_points) or 1
    with Store(where) as store:
        got_steps, got = store.metrics(writer.run_id or 0, "step_loss", max_points, **bounds)
    inside = (steps >= lo) & (steps <= hi)
    expected = _reference(steps[inside], values[inside], lo, hi, max_points, align)
    assert got_steps.tolist() == [s for s, _ in expected]
    assert _same(got.tolist(), [math.nan if v is None else v for _, v in expected])
    if lo <= 9_999 <= hi:
        assert 1e6 in got.tolist()


# -- events and the loss summary ------------------------------------------------------------
def test_events_come_back_in_order_with_their_data(where: str) -> None:
    writer = RunWriter(where, name="e")
    writer.event("checkpoint", "saved a.pt", 4, 1, data={"path": "a.pt"})
    writer.event("alert", "loss spike", 7, 2, level="warning", data={"value": 9.5})
    writer.event("note", "no step")
    writer.close()
    with Store(where) as store:
        events = store.events("e")
    assert [(e["kind"], e["step"], e["epoch"], e["level"], e["message"], e["data"])
            for e in events] == [
        ("checkpoint", 4, 1, "info", "saved a.pt", {"path": "a.pt"}),
        ("alert", 7, 2, "warning", "loss spike", {"value": 9.5}),
        ("note", None, None, "info", "no step", {}),
    ]  # fmt: skip
    assert all(e["time"] > 0 for e in events)


def test_runs_are_summarised_by_their_training_loss(where: str) -> None:
    epochs = RunWriter(where, name="epochs")
    epochs.log_batch("step_loss", range(1, 7), np.array([3.0, 2.0, 1.5, 1.2, 1.0, 0.9]), epoch=1)
    epochs.log("loss", 2.0, 3, epoch=1)
    epochs.log("loss", 1.5, 6, epoch=2)
    epochs.close()
    _run(where, "steps", step_loss=(range(1, 4), [0.9, 0.6, math.nan]))
    _run(where, "none", acc=([1], [0.5]))
    with Store(where) as store:
        summary = {run.name: stats for run, stats in store.runs_summary()}
        assert [run.name for run, _ in store.runs_summary(last=1)] == ["none"]
        assert store.loss_stats("epochs") == summary["epochs"]
    assert summary["epochs"] is not None
    assert summary["epochs"][:5] == ("loss", True, 1.5, 1.5, 2)
    assert summary["epochs"].last_step == 6
    steps = summary["steps"]
    assert steps is not None and (steps.key, steps.epoch_mean, steps.min) == (
        "step_loss",
        False,
        0.6,
    )
    assert math.isnan(steps.last) and (steps.count, steps.last_step) == (3, 3)
    assert summary["none"] is None


# -- deleting --------------------------------------------------------------------------------
def test_delete_runs_is_all_or_nothing(where: str) -> None:
    keep = _run(where, "keep", step_loss=(range(5_000), np.linspace(0, 1, 5_000)))
    gone = _run(where, "gone", step_loss=(range(5_000), np.linspace(1, 0, 5_000)))
    with pytest.raises(KeyError, match="no run 'nope'"):
        delete_runs(where, ["gone", "nope"])
    with Store(where) as store:
        assert [r.name for r in store.runs()] == ["keep", "gone"]  # nothing deleted
        assert store.delete_runs([]) == []
        assert [(r.id, r.name) for r in store.delete_runs(["gone", gone])] == [(gone, "gone")]
        assert [r.name for r in store.runs()] == ["keep"]
        with pytest.raises(KeyError):
            store.metrics(gone, "step_loss")
        assert len(store.metrics(keep, "step_loss", max_points=100)[0]) == 100
    backend = open_write_backend(where)  # the ids of deleted runs are never given again
    try:
        assert backend.create_run("next", "{}", "here", 1, 1.0) > gone
    finally:
        backend.close()
