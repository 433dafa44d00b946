"""The team store on a real PostgreSQL server (a throwaway cluster, tests/pg_cluster.py).

Where PostgreSQL cannot be started these tests skip with the reason; with
``STEPWATCH_REQUIRE_POSTGRES=1`` (``.ci/run`` sets it) that is a failure instead.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepwatch import RunRecorder, RunWriter, Store
from stepwatch.store.backends import postgres_read

from .conftest import make_batches, make_model, run_cli, wait_until
from .pg_cluster import PgCluster, pg_cluster_fixture, pg_url_fixture  # noqa: F401 - fixtures

JOB = Path(__file__).resolve().parent / "jobs" / "pg_writer_job.py"


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _exact(key: str) -> bool:
    """A key whose values the seed decides (not a timing)."""
    return not any(word in key for word in ("time", "per_s", "throughput", "speed"))


def test_a_run_recorded_by_model_train_reads_back_as_from_a_local_store(
    pg_url: str, tmp_path: Path
) -> None:
    local = tmp_path / "runs.db"
    recorders = []
    for db in (pg_url, local):
        # The recorder hands its points over every flush period and at each epoch's end, and
        # logs lr and step_time at each hand-over: with a flush period longer than the run,
        # only the epochs' ends, so both runs hold the same points whatever the machine's
        # speed (and no system sample, taken every system_every seconds).
        recorder = RunRecorder(
            db=db, run_name="team", config={"lr": 0.1}, flush_seconds=600, system_every=None
        )
        make_model().train(3, make_batches(4), callbacks=[recorder])
        recorders.append(recorder)
    with Store(pg_url) as team, Store(local) as mine:
        assert type(team._sql).__name__ == "PostgresDialect" and "***" in team.location
        (run,) = team.runs()
        assert run.status == "finished" and run.name == "team" and run.steps == 12
        assert run.host and run.user and run.config["lr"] == 0.1
        other = mine.run(recorders[1].run_id)
        assert team.keys(run.id) == mine.keys(other.id)
        ours = [(k, s, e, v) for k, s, e, _, v in team.points(run.id) if _exact(k)]
        theirs = [(k, s, e, v) for k, s, e, _, v in mine.points(other.id) if _exact(k)]
        assert ours == theirs and len(ours) >= 18  # same seed, same points (but the timings)
        assert [s for k, s, _, _ in ours if k == "lr"] == [4, 8, 12]  # the epochs' ends
        assert [s for k, s, _, _ in ours if k == "step_loss"] == list(range(1, 13))
        assert [(e["kind"], e["step"]) for e in team.events(run.id)] == [
            (e["kind"], e["step"]) for e in mine.events(other.id)
        ]
        ours_summary, theirs_summary = team.summary(run.id), mine.summary(other.id)
        assert ours_summary.keys() == theirs_summary.keys()
        assert {k: v for k, v in ours_summary.items() if _exact(k)} == {
            k: v for k, v in theirs_summary.items() if _exact(k)
        }
        assert team.loss_stats(run.id) == mine.loss_stats(other.id)
        assert [r.name for r in team.runs(name="te*")] == ["team"]
        assert team.runs(name="nope") == [] and team.runs(status="crashed") == []


def test_downsampled_and_live_reads_match_the_local_store(pg_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(20_000).cumsum()
    values[[5, 777, 13_000]] = np.nan
    values[9_999] = 1e6  # a spike every downsampling keeps
    for db in (pg_url, tmp_path / "runs.db"):
        writer = RunWriter(db, name="curve", flush_seconds=0.05)
        for at in range(0, 20_000, 5_000):  # in several batches: the rollups merge
            writer.log_batch("step_loss", range(at, at + 5_000), values[at : at + 5_000], epoch=1)
        writer.close()
    with Store(pg_url) as team, Store(tmp_path / "runs.db") as mine:
        for kwargs in ({}, {"max_points": 200}, {"max_points": 64, "start": 100, "end": 9_000},
                       {"max_points": 500, "after": 15_000}, {"after": 19_990}):  # fmt: skip
            a_steps, a_values = team.metrics(1, "step_loss", **kwargs)
            b_steps, b_values = mine.metrics(1, "step_loss", **kwargs)
            assert a_steps.tolist() == b_steps.tolist(), kwargs
            assert all(map(_same, a_values.tolist(), b_values.tolist())), kwargs
        assert 1e6 in team.metrics(1, "step_loss", max_points=50)[1]
        with pytest.raises(KeyError, match="no metric 'nope'"):
            team.metrics(1, "nope")


def test_a_batch_sent_twice_is_stored_once(pg_url: str) -> None:
    from stepwatch.store.base import open_write_backend

    backend = open_write_backend(pg_url)
    try:
        run = backend.create_run("again", "{}", "here", 1, 1.0)
        key = backend.key_id("loss")
        flat = [v for step in range(100) for v in (key, step, 0, 1.0, float(step))]
        event = [(1, 0, 1.0, "note", "info", "once", "{}")]
        backend.write(run, flat, event, 2.0)
        backend._resend = True  # as after a connection lost before the commit's answer
        backend._seq[run] = 0
        backend.write(run, flat, event, 3.0)
        overlap = [*flat[:50], key, 100, 0, 1.0, 100.0]  # steps 0-9 again, and one new
        backend.write(run, overlap, [], 4.0)  # the COPY fails on the stored steps: row by row
        backend.finish(run, "finished", 5.0, 0)
    finally:
        backend.close()
    with Store(pg_url) as store:
        assert store.metrics(run, "loss")[0].tolist() == list(range(101))
        assert store.summary(run)["loss"]["count"] == 101
        assert len(store.events(run)) == 1
        steps, _ = store.metrics(run, "loss", max_points=4)
        assert steps.tolist() == [0, 50, 51, 100]  # two buckets: min and max of each


def test_a_run_created_twice_after_a_lost_answer_is_one_run(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from stepwatch.store.backends import postgres_write

    created = postgres_write._create_run
    lost = [1]

    def answer_lost(conn: Any, *args: Any) -> int:  # committed, then the connection drops
        run = created(conn, *args)
        if lost:
            lost.pop()
            conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return run

    monkeypatch.setattr(postgres_write, "_create_run", answer_lost)
    writer = RunWriter(pg_url, name="once", flush_seconds=0.05)
    for step in range(20):
        writer.log("loss", float(step), step)
    writer.close(timeout=30)
    with Store(pg_url) as store:
        assert [(r.name, r.status) for r in store.runs()] == [("once", "finished")]
        assert store.metrics(writer.run_id, "loss")[0].tolist() == list(range(20))


def _start(url: str, name: str, points: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(JOB), url, name, str(points), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_three_processes_at_once_one_killed(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    points = 3_000
    procs = {name: _start(pg_url, name, points, mode)
             for name, mode in (("a", "finish"), ("b", "finish"), ("victim", "hang"))}  # fmt: skip
    try:
        victim = procs["victim"]
        assert victim.stdout is not None
        victim_id = int(victim.stdout.readline())
        assert victim.stdout.readline().strip() == "flushed"
        victim.send_signal(signal.SIGKILL)
        for name in ("a", "b"):
            _, err = procs[name].communicate(timeout=60)
            assert procs[name].returncode == 0, err
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
    monkeypatch.setattr(postgres_read, "STALE_SECONDS", 1.0)  # not 20 s, for the test
    with Store(pg_url) as store:
        wait_until(lambda: store.run(victim_id).status == "crashed", timeout=30, interval=0.1)
        runs = {r.name: r for r in store.runs()}
        assert {r.status for n, r in runs.items() if n != "victim"} == {"finished"}
        for name, run in runs.items():
            steps, values = store.metrics(run.id, "step_loss")
            expected = points if name != "victim" else points // 2
            assert steps.tolist() == list(range(expected)), name  # none lost, none twice
            assert values.tolist() == [float(s) for s in range(expected)]
            assert store.summary(run.id)["step_loss"]["count"] == expected
            assert store.metrics(run.id, "lr")[0].tolist() == list(range(0, expected, 50))
            assert [e["message"] for e in store.events(run.id)] == (
                ["done"] if name != "victim" else []
            )
        assert [r.name for r in store.runs(status="crashed")] == ["victim"]


def test_a_server_restarted_mid_run_loses_no_training_and_counts_the_gap(
    pg_cluster: PgCluster, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = RunWriter(pg_url, name="restarted", flush_seconds=0.05, max_pending=100)
    restarted = threading.Event()

    def restart() -> None:
        pg_cluster.restart(down_seconds=1.0)
        restarted.set()

    step, after = 0, None
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        writer.log("loss", 0.0, step)
        assert writer.flush()
        thread = threading.Thread(target=restart)
        thread.start()
        try:
            # Training goes on through the gap, and on until the writer is back, and then some.
            while after is None or step < after + 300:
                step += 1
                writer.log("loss", float(step), step)
                time.sleep(0.001)
                if after is None and restarted.is_set() and writer._busy_since is None:
                    after = step
                if step > 100_000:  # bounded: the writer never came back
                    pytest.fail("the writer did not reconnect after the restart")
        finally:
            thread.join(60)
        assert writer.flush(timeout=30)
        writer.close()
    assert "cannot be reached" in caplog.text and "is free again" in caplog.text
    assert pg_cluster.password not in caplog.text
    with Store(pg_url) as store:
        run = store.run(writer.run_id)
        steps = store.metrics(run.id, "loss")[0].tolist()
    assert len(steps) == len(set(steps)) == writer.written
    assert writer.dropped > 0 and run.dropped == writer.dropped  # the gap's drops, counted
    assert len(steps) + writer.dropped == step + 1
    assert steps[-1] == step and [s for s in steps if s > after]  # points after the gap arrive
    assert run.status == "finished"


def test_the_password_is_never_in_an_error(pg_cluster: PgCluster, pg_url: str) -> None:
    secret = pg_cluster.password
    wrong = pg_url.replace(secret, "not-" + secret)
    for make in (lambda: RunRecorder(db=wrong), lambda: RunWriter(wrong), lambda: Store(wrong)):
        with pytest.raises(ValueError, match=r"the server refused: .*password authentication") as e:
            make()
        assert secret not in str(e.value) and "stepwatch:***@127.0.0.1" in str(e.value)
    missing = pg_cluster.url("no_such_db")
    with pytest.raises(ValueError, match='database "no_such_db" does not exist') as info:
        RunRecorder(db=missing)
    assert secret not in str(info.value)
    done = run_cli("runs", "--db", wrong, timeout=60)
    assert done.returncode == 2 and "password authentication failed" in done.stderr
    assert secret not in done.stderr + done.stdout


def test_credentials_from_pgpassword(
    pg_cluster: PgCluster, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", pg_cluster.password)
    bare = pg_url.replace(f":{pg_cluster.password}@", "@")
    writer = RunWriter(bare, name="env")
    writer.log("loss", 1.0, 1)
    writer.close()
    with Store(bare) as store:
        assert [r.name for r in store.runs()] == ["env"]
        assert store.location == bare
    monkeypatch.setenv("STEPWATCH_DB", bare)  # the default store may be a team store too
    with Store() as store:
        assert [r.name for r in store.runs()] == ["env"]


def test_a_store_of_a_newer_schema_is_refused_clearly(pg_url: str) -> None:
    import psycopg

    writer = RunWriter(pg_url, name="old")
    writer.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    for make in (lambda: RunRecorder(db=pg_url), lambda: RunWriter(pg_url), lambda: Store(pg_url)):
        with pytest.raises(ValueError, match=r"newer stepwatch \(store schema 99; this version"):
            make()


def test_an_empty_database_is_no_store_yet(pg_url: str) -> None:
    with pytest.raises(FileNotFoundError, match="no stepwatch store in"):
        Store(pg_url)
    done = run_cli("runs", "--db", pg_url, timeout=60)
    assert done.returncode == 2 and "record a run into it first" in done.stderr


def _get(server: Any, path: str) -> tuple[int, Any]:
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def test_the_dashboard_api_over_postgresql(pg_url: str) -> None:
    from stepwatch.dashboard.server import make_server, serve_in_thread

    writer = RunWriter(pg_url, name="served", config={"lr": 0.5}, flush_seconds=0.05)
    writer.log_batch("step_loss", range(1_000), np.linspace(2.0, 0.1, 1_000), epoch=1)
    writer.log("loss", 0.5, 999, epoch=1)
    writer.event("checkpoint", "saved", 999)
    assert writer.flush()
    server = make_server(pg_url, port=0)
    thread = serve_in_thread(server)
    try:
        status, runs = _get(server, "/api/runs")
        assert status == 200 and [r["name"] for r in runs] == ["served"]
        assert runs[0]["status"] == "running" and runs[0]["loss_key"] == "loss"
        assert runs[0]["best_loss"] == 0.5 and runs[0]["config"] == {"lr": 0.5}
        rid = runs[0]["id"]
        status, keys = _get(server, f"/api/runs/{rid}/keys")
        assert keys == ["loss", "step_loss"]
        status, curve = _get(server, f"/api/runs/{rid}/metrics/step_loss?max_points=100")
        assert status == 200 and len(curve["steps"]) <= 100 and curve["steps"][0] == 0
        writer.log_batch("step_loss", range(1_000, 1_010), np.zeros(10), epoch=2)
        assert writer.flush()
        status, new = _get(server, f"/api/runs/{rid}/metrics/step_loss?after=999")
        assert new["steps"] == list(range(1_000, 1_010))  # the live view: only the new points
        status, events = _get(server, f"/api/runs/{rid}/events")
        assert [e["kind"] for e in events] == ["checkpoint"]
        status, missing = _get(server, "/api/runs/999/keys")
        assert status == 404 and "no run" in missing["error"]
    finally:
        writer.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _local_store(db: Path) -> RunWriter:
    """A local store with a finished run ('done': 501 points, 2 events) and a run still
    recording ('live': 300 points so far); returns the live run's writer."""
    done = RunWriter(db, name="done", config={"lr": 0.1})
    done.log_batch("step_loss", range(500), np.linspace(1.0, 0.5, 500), epoch=1)
    done.log("loss", 0.7, 499, epoch=1)
    done.event("checkpoint", "saved", 499)
    done.event("note", "end", 499)
    done.close()
    live = RunWriter(db, name="live", flush_seconds=0.05)
    live.log_batch("step_loss", range(300), np.full(300, 2.0), epoch=1)
    assert live.flush()
    return live


def test_push_copies_local_runs_once_and_a_live_run_again_later(
    pg_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "runs.db"
    live = _local_store(db)
    try:
        first = run_cli("push", "--db", str(db), "--to", pg_url, timeout=60)
        assert first.returncode == 0, first.stderr
        assert "501 new points" in first.stdout and "2 new events" in first.stdout
        assert "300 new points" in first.stdout and "***" in first.stdout
        with Store(pg_url) as team, Store(db) as mine:
            runs = {r.name: r for r in team.runs()}
            assert {n: r.status for n, r in runs.items()} == {"done": "finished", "live": "running"}
            done, local_done = runs["done"], mine.run("done")
            assert team.points(done.id) == mine.points(local_done.id)
            assert team.events(done.id) == mine.events(local_done.id)
            assert team.summary(done.id) == mine.summary(local_done.id)
            assert team.loss_stats(done.id) == mine.loss_stats(local_done.id)
            assert done.user and done.host == local_done.host and done.config == {"lr": 0.1}
        again = run_cli("push", "--db", str(db), "--to", pg_url, timeout=60)
        assert again.returncode == 0 and again.stdout.count("0 new points, 0 new events") == 2
        live.log_batch("step_loss", range(300, 400), np.full(100, 1.0), epoch=2)
        assert live.flush()
    finally:
        live.close()
    live_id = str(live.run_id)  # named twice, by name and by id: pushed once
    later = run_cli("push", "--db", str(db), "--to", pg_url, "--run", "live", "--run", live_id,
                    timeout=60)  # fmt: skip
    assert later.returncode == 0 and "100 new points" in later.stdout
    assert "1 run(s) pushed" in later.stdout
    with Store(pg_url) as team:
        run = team.run("live")
        assert run.status == "finished" and len(team.runs()) == 2
        steps, _ = team.metrics(run.id, "step_loss")
        assert steps.tolist() == list(range(400))
        assert team.summary(run.id)["step_loss"]["count"] == 400  # nothing counted twice
    third = RunWriter(db, name="third")
    third.log("step_loss", 1.0, 1, epoch=1)
    third.close()
    assert run_cli("push", "--db", str(db), "--to", pg_url, timeout=60).returncode == 0
    with Store(pg_url) as team:  # the pushes that found nothing new used up no run id
        assert sorted(r.id for r in team.runs()) == [1, 2, 3] and team.run("third").id == 3
    bad = run_cli("push", "--db", str(db), "--to", str(tmp_path / "other.db"), timeout=60)
    assert bad.returncode == 2 and "is not a team store" in bad.stderr
    itself = run_cli("push", "--db", pg_url, "--to", pg_url, timeout=60)  # would copy it again
    assert itself.returncode == 2 and "name the same store" in itself.stderr
    with Store(pg_url) as team:
        assert len(team.runs()) == 3


def test_runs_filters_by_host_user_and_name_over_postgresql(pg_url: str, tmp_path: Path) -> None:
    import socket

    from stepwatch.store.backends.postgres_write import current_user

    for name in ("lr=0.1", "lr=0.2", "other"):
        writer = RunWriter(pg_url, name=name)
        writer.log("loss", 1.0, 1)
        writer.close()
    host, user = socket.gethostname(), current_user()
    with Store(pg_url) as store:
        assert [r.name for r in store.runs(name="lr=*", host=host, user=user)] == [
            "lr=0.1", "lr=0.2"
        ]  # fmt: skip
        assert store.runs(user="nobody-" + user) == [] and store.runs(host="no-such-host") == []
        assert len(store.runs(host=host[:2] + "*")) == 3
    listed = run_cli("runs", "--db", pg_url, "--user", user, "--name", "lr=", timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "lr=0.1" in listed.stdout and "other" not in listed.stdout
    assert f"{user}@{host}" in listed.stdout
    nobody = run_cli("runs", "--db", pg_url, "--host", "no-such-host", timeout=60)
    assert nobody.returncode == 0 and "no runs match" in nobody.stdout
    local = tmp_path / "runs.db"
    RunWriter(local, name="mine").close()
    refused = run_cli("runs", "--db", str(local), "--user", user, timeout=60)
    assert refused.returncode == 2 and "a local store records no users" in refused.stderr
    shown = run_cli("show", "lr=0.2", "--db", pg_url, timeout=60)
    assert shown.returncode == 0 and f"(user {user})" in shown.stdout


def test_host_and_name_globs_pick_the_same_runs_as_the_local_store(
    pg_url: str, tmp_path: Path
) -> None:
    from stepwatch.store.base import open_write_backend

    hosts = ["gpu-01.lab", "GPU_02", "node[1]", "x%y\\z", "!bang", "]close"]
    local = tmp_path / "runs.db"
    for location in (local, pg_url):
        backend = open_write_backend(location)
        try:
            for i, host in enumerate(hosts):
                run = backend.create_run(host, "{}", host, 1, float(i))
                backend.finish(run, "finished", float(i) + 1, 0)
        finally:
            backend.close()
    patterns = ["[!g]*", "*[!0-9]", "[z-a]*", "[!]*", "[[:alpha:]]*", "[^g]*", "*[0-9]",
                "gpu*", "*.lab", "[]]*", "node[1]", "x%y\\z", "[", "*[", "[a-z]*"]  # fmt: skip
    with Store(local) as sqlite_store, Store(pg_url) as pg_store:
        for pattern in patterns:
            want = [r.name for r in sqlite_store.runs(host=pattern)]
            assert [r.name for r in pg_store.runs(host=pattern)] == want, pattern
            assert [r.name for r in pg_store.runs(name=pattern)] == want, pattern


def test_a_run_whose_epoch_loss_is_nan_is_summarised_by_its_step_losses(
    pg_url: str, tmp_path: Path
) -> None:
    # Stopped by a NaN in its first epoch: the epoch's mean is NaN, its steps hold numbers.
    for where in (tmp_path / "runs.db", pg_url):
        writer = RunWriter(where, name="nan-stop")
        writer.log_batch("step_loss", range(1, 4), np.array([0.9, 0.6, math.nan]), epoch=1)
        writer.log("loss", math.nan, 3, epoch=1)
        writer.close()
    with Store(tmp_path / "runs.db") as mine, Store(pg_url) as team:
        local, shared = mine.loss_stats("nan-stop"), team.loss_stats("nan-stop")
    assert local is not None and (local.key, local.epoch_mean, local.min) == (
        "step_loss",
        False,
        0.6,
    )
    assert math.isnan(local.last) and (local.count, local.last_step) == (3, 3)
    assert shared is not None and shared.key == local.key and shared.min == local.min


def test_a_team_store_away_as_the_run_starts_loses_nothing_and_push_uploads_it_later(
    pg_cluster: PgCluster,
    pg_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spool = tmp_path / "spool.db"
    monkeypatch.setenv("STEPWATCH_SPOOL", str(spool))
    pg_cluster.stop_server()  # the server is down before the run starts, and through it
    try:
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            recorder = RunRecorder(
                db=pg_url, run_name="offline", config={"lr": 0.1}, flush_seconds=600,
                system_every=None,
            )  # fmt: skip
            make_model().train(3, make_batches(4), callbacks=[recorder])
    finally:
        pg_cluster._start_server()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, said  # one message: where the run is, and how to upload it
    assert f"recorded into the local file {spool}" in said[0]
    assert f"stepwatch push --db {spool} --to postgresql://stepwatch:***@" in said[0]
    assert pg_cluster.password not in said[0]
    assert recorder.dropped == 0 and recorder.writer is not None
    assert recorder.writer.spool == spool
    pushed = run_cli("push", "--db", str(spool), "--to", pg_url, timeout=60)
    assert pushed.returncode == 0, pushed.stderr
    with Store(pg_url) as team, Store(spool) as mine:
        local = mine.run(recorder.run_id or 0)
        (run,) = team.runs()
        assert (run.name, run.status, run.config) == ("offline", "finished", local.config)
        assert run.config["lr"] == 0.1 and run.steps == local.steps == 12
        assert team.keys(run.id) == mine.keys(local.id)
        assert team.points(run.id) == mine.points(local.id)  # every point, as recorded
        assert team.events(run.id) == mine.events(local.id)
        assert team.summary(run.id) == mine.summary(local.id)
        assert [s for k, s, *_ in team.points(run.id) if k == "step_loss"] == list(range(1, 13))


def test_push_to_a_team_store_that_refuses_names_to(
    pg_cluster: PgCluster, pg_url: str, tmp_path: Path
) -> None:
    db = tmp_path / "runs.db"
    RunWriter(db, name="mine").close()
    wrong = pg_url.replace(pg_cluster.password, "not-" + pg_cluster.password)
    done = run_cli("push", "--db", str(db), "--to", wrong, timeout=60)
    assert done.returncode == 2 and "password authentication failed" in done.stderr
    assert "push: --to 'postgresql://stepwatch:***@" in done.stderr and "--db" not in done.stderr
    assert pg_cluster.password not in done.stderr
