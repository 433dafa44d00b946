"""Min/max rollups: the writer keeps them, a downsampled read uses them and answers as the
exact read over the same buckets does."""

from __future__ import annotations

import math
import sqlite3
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepwatch import RunWriter, Store
from stepwatch.store.backends import rollup as _rollup
from stepwatch.store.reader import delete_runs

N = 60_000


def _series(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps 0..N-1 with noise, one-step spikes, two equal maxima in one block, NaN runs."""
    rng = np.random.default_rng(seed)
    steps = np.arange(N, dtype=np.int64)
    values = np.cumsum(rng.standard_normal(N)) * 0.01 + rng.standard_normal(N)
    values[20_000:20_300] = math.nan  # a NaN stretch spanning blocks
    values[rng.choice(N, 20, replace=False)] = math.nan
    values[[1_234, 15_000, 30_001, 45_678, 59_999]] = 40.0 + rng.random(5)  # one-step spikes
    values[[0, 3_333, 22_222, 37_000, 50_505]] = -40.0 - rng.random(5)
    values[7_000] = values[7_010] = 99.0  # a tie: the smaller step must win
    return steps, values


def _write_shuffled(writer: RunWriter, key: str, steps: np.ndarray, values: np.ndarray) -> None:
    """Batches in random order, each in random order, some points one by one."""
    rng = np.random.default_rng(len(key))
    order = rng.permutation(len(steps))
    for chunk in np.array_split(order, 7):
        writer.log_batch(key, steps[chunk], values[chunk])
    for i in rng.choice(len(steps), 50, replace=False):  # a second point at an existing step
        writer.log(key, float(values[i]) + 0.5, int(steps[i]))


def _exact(store: Store, key: str, max_points: int, align: int, **bounds: Any) -> list[Any]:
    """The exact path's answer (every point read) over the same buckets."""
    where, params = "run = ? AND key = ?", []
    for op, name in ((">=", "start"), ("<=", "end"), (">", "after")):
        if bounds.get(name) is not None:
            where += f" AND step {op} ?"
            params.append(bounds[name])

    def read(conn: Any) -> list[Any]:
        (key_id,) = conn.execute("SELECT id FROM keys WHERE name = ?", (key,)).fetchone()
        args = (1, key_id, *params)
        count, lo, hi = conn.execute(
            f"SELECT COUNT(*), MIN(step), MAX(step) FROM points WHERE {where}", args
        ).fetchone()
        if count <= max_points:
            return list(
                conn.execute(
                    f"SELECT step, value FROM points WHERE {where} ORDER BY step, rowid", args
                ).fetchall()
            )
        return store._buckets(conn, where, args, max_points, lo, hi, align=align)

    return store._sql.read(read)


def _pairs(steps: np.ndarray, values: np.ndarray) -> list[tuple[int, float | None]]:
    return [(int(s), None if math.isnan(v) else float(v)) for s, v in zip(steps, values)]


def _traced(store: Store) -> list[str]:
    statements: list[str] = []
    store._sql.conn.set_trace_callback(statements.append)
    return statements


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two writers at once on one file: run 1 (shuffled points) and run 2 (in order)."""
    path = tmp_path_factory.mktemp("rollup") / "runs.db"
    steps, values = _series(0)
    first, second = RunWriter(path, name="shuffled"), RunWriter(path, name="ordered")
    done = threading.Event()

    def ordered() -> None:
        for start in range(0, N, 5_000):
            second.log_batch("loss", range(start, start + 5_000), values[start : start + 5_000])
            second.flush(timeout=60)
        done.set()

    thread = threading.Thread(target=ordered)
    thread.start()
    _write_shuffled(first, "loss", steps, values)
    for step in range(0, N, 3):  # a second key, point by point, interleaved in each batch
        first.log("acc", step * 1e-4, step)
    first.close()
    thread.join(timeout=60)
    assert done.is_set()
    second.close()
    return path


def test_rollup_rows_match_the_points(db: Path) -> None:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT * FROM rollups ORDER BY run, key, width, bucket").fetchall()
        points = conn.execute("SELECT run, key, step, value FROM points").fetchall()
    finally:
        conn.close()
    expected: dict[tuple[int, int, int, int], list[Any]] = {}
    for run, key, step, value in sorted(points, key=lambda p: (p[0], p[1], p[2])):
        for width in _rollup.WIDTHS:
            e = expected.setdefault(
                (run, key, width, step // width), [0, None, None, None, None, None]
            )
            e[0] += 1
            if value is None:
                e[5] = step if e[5] is None else min(e[5], step)
                continue
            if e[2] is None or value < e[2]:
                e[1], e[2] = step, value
            if e[4] is None or value > e[4]:
                e[3], e[4] = step, value
    assert {tuple(r[:4]): list(r[4:]) for r in rows} == expected


@pytest.mark.parametrize("max_points", [2, 9, 100, 333, 1000, 1800])
def test_downsampled_read_uses_rollups_and_equals_the_exact_path(db: Path, max_points: int) -> None:
    with Store(db) as store:
        for run in (1, 2):
            statements = _traced(store)
            steps, values = store.metrics(run, "loss", max_points=max_points)
            assert any("FROM rollups" in s for s in statements)
            width = _rollup.pick_width(_rollup.WIDTHS, 0, N - 1, max_points)
            assert width is not None
            store._sql.conn.set_trace_callback(None)
            if run == 1:
                assert _pairs(steps, values) == _exact(store, "loss", max_points, width)
            assert len(steps) <= max_points + max_points // 2  # min, max, and a NaN at most
            assert list(steps) == sorted(steps)
            assert np.nanmin(values) < -40 and 7_000 in steps and 7_010 not in steps
            if max_points >= 333:  # then the one-step spikes lie in buckets of their own
                for spike in (40.0, -40.0):
                    assert int(np.sum(np.abs(values - spike) < 1)) == 5
            assert np.isnan(values).any()
            if max_points >= 1000:  # the NaN stretch spans several buckets
                assert np.isnan(values[(steps >= 20_000) & (steps < 20_300)]).any()


@pytest.mark.parametrize(
    "bounds",
    [
        {"start": 123, "end": 54_321},
        {"start": 20_100},
        {"end": 33_333},
        {"after": 4_095},
        {"after": 999, "end": 40_961},
        {"start": 65, "end": 3_000},  # narrower than a rollup block per bucket: exact path
    ],
)
def test_range_edges_are_read_from_points(db: Path, bounds: dict[str, int]) -> None:
    with Store(db) as store:
        for max_points in (4, 150, 1000):
            steps, values = store.metrics(1, "loss", max_points=max_points, **bounds)
            lo = bounds.get("start", bounds.get("after", -1) + 1)
            hi = bounds.get("end", N - 1)
            assert steps[0] >= lo and steps[-1] <= hi
            width = _rollup.pick_width(_rollup.WIDTHS, lo, hi, max_points) or 1
            assert _pairs(steps, values) == _exact(store, "loss", max_points, width, **bounds)


def test_a_run_without_rollups_is_read_exactly(tmp_path: Path) -> None:
    """A run written before rollups existed (not in rollup_runs) takes the exact path, also in
    a file that has no rollup tables at all; a new writer adds them for its own runs only."""
    path = tmp_path / "old.db"
    values = _series(1)[1]
    writer = RunWriter(path)
    writer.log_batch("loss", range(N), values)
    writer.close()
    with Store(path) as store:
        expected = store.metrics(1, "loss", max_points=500)
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP TABLE rollups; DROP TABLE rollup_runs; "
        "UPDATE meta SET value = '1' WHERE key = 'schema_version';"
    )
    conn.close()
    with Store(path) as store:
        statements = _traced(store)
        old = store.metrics(1, "loss", max_points=500)
        assert not any("rollup" in s for s in statements if "sqlite_master" not in s)
        assert _pairs(*old) == _exact(store, "loss", 500, 1)
    writer = RunWriter(path)  # the new writer adds the tables
    writer.log_batch("loss", range(N), values)
    writer.close()
    with Store(path) as store:
        assert _pairs(*store.metrics(1, "loss", max_points=500)) == _pairs(*old)
        assert _pairs(*store.metrics(2, "loss", max_points=500)) == _pairs(*expected)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT DISTINCT run FROM rollups").fetchall() == [(2,)]
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version == ("2",)
    finally:
        conn.close()


def test_delete_runs_removes_the_rollups(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    for _ in range(3):
        writer = RunWriter(path)
        writer.log_batch("loss", range(5_000), np.linspace(0, 1, 5_000))
        writer.close()
    assert [r.id for r in delete_runs(path, [1])] == [1]
    conn = sqlite3.connect(path)
    try:
        for table in ("rollups", "rollup_runs"):
            assert conn.execute(f"SELECT DISTINCT run FROM {table}").fetchall() == [(2,), (3,)]
        conn.executescript("DROP TABLE rollups; DROP TABLE rollup_runs;")  # a file from before
    finally:
        conn.close()
    assert [r.id for r in delete_runs(path, [2])] == [2]
    with Store(path) as store:
        assert [r.id for r in store.runs()] == [3]
        assert len(store.metrics(3, "loss", max_points=100)[0]) == 100
