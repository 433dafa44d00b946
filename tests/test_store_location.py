"""Where a store is: a location string picks the backend, everywhere a store is named."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stepwatch import RunRecorder, RunWriter, Store
from stepwatch.store.backends.sqlite_read import SQLiteDialect
from stepwatch.store.backends.sqlite_write import SQLiteWriteBackend
from stepwatch.store.base import WriteBackend, parse_location


def test_a_path_or_a_sqlite_url_is_the_sqlite_store(tmp_path: Path) -> None:
    assert parse_location("runs.db").kind == "sqlite"
    assert parse_location("runs.db").target == Path("runs.db")
    assert parse_location(tmp_path / "x.db").target == tmp_path / "x.db"
    assert parse_location("sqlite:///runs.db").target == Path("runs.db")
    assert parse_location(f"sqlite:///{tmp_path}/x.db").target == tmp_path / "x.db"


def test_writer_reader_and_recorder_take_a_location(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/runs.db"
    writer = RunWriter(url, name="by-url")
    assert isinstance(writer._backend, SQLiteWriteBackend)
    assert isinstance(writer._backend, WriteBackend)
    writer.log("loss", 0.5, 1)
    writer.event("note", "hello", 1)
    writer.close()
    with Store(url) as store:
        assert isinstance(store._sql, SQLiteDialect)
        assert store.location == str(tmp_path / "runs.db")
        assert [r.name for r in store.runs()] == ["by-url"]
        assert store.metrics(writer.run_id, "loss")[1].tolist() == [0.5]
    with Store(tmp_path / "runs.db") as store:  # the same file, named as a path
        assert store.events(writer.run_id)[0]["message"] == "hello"
    RunRecorder(db=url)  # accepted at construction


def test_the_cli_reads_a_store_named_by_url(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "runs.db", name="cli-url")
    writer.log("loss", 1.0, 1)
    writer.close()
    out = subprocess.run(
        [sys.executable, "-m", "stepwatch", "runs", "--db", f"sqlite:///{tmp_path}/runs.db"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "cli-url" in out


def test_a_server_store_that_cannot_be_reached_is_one_warning_and_a_local_spool(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import logging
    import socket

    pytest.importorskip("psycopg")
    from stepwatch.store import writer as writer_module

    monkeypatch.setattr(writer_module, "_UNREACHABLE_CLOSE_WAIT", 0.5)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://trainer:s3cret@127.0.0.1:{port}/runs"
    spool = tmp_path / "spool.db"
    monkeypatch.setenv("STEPWATCH_SPOOL", str(spool))
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        RunRecorder(db=url)  # accepted, without a word: the writer says what happens
        assert caplog.records == []
        writer = RunWriter(url, name="away")
        for step in range(10):
            writer.log("loss", 1.0, step)
        writer.close()
    # Nothing lost: the run went into the local spool file, named in one warning with the
    # line that uploads it.
    assert writer.spool == spool and writer.dropped == 0
    (said,) = [r.getMessage() for r in caplog.records]
    assert "trainer:***@127.0.0.1" in said and "cannot be reached" in said
    assert f"stepwatch push --db {spool} --to postgresql://trainer:***@127.0.0.1" in said
    with Store(spool) as store:
        assert store.metrics(writer.run_id, "loss")[0].tolist() == list(range(10))
    with pytest.raises(ConnectionError, match="cannot reach the store") as info:
        Store(url)
    assert "s3cret" not in str(info.value) and "s3cret" not in caplog.text
    with pytest.raises(ValueError, match=r"unknown kind of store \(mysql://\)"):
        RunRecorder(db="mysql://x/y")
    with pytest.raises(TypeError, match="'db' must be a path, a store URL or None"):
        RunRecorder(db=123)  # type: ignore[arg-type]


def test_a_password_is_hidden_wherever_it_is_in_the_url() -> None:
    from stepwatch.store.base import hide_password

    assert hide_password("postgresql://u:p%40ss@h:5/db") == "postgresql://u:***@h:5/db"
    assert hide_password("postgresql://u@h/db?password=x&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert hide_password("postgresql://u@h/db") == "postgresql://u@h/db"
    shown = parse_location("postgresql://u:secret@h:notaport/db").shown
    assert "secret" not in shown
    # A password with an unencoded '/', '?', '#' or '@' (where a URL parser stops early).
    for raw in ("Se/cret", "Se?cret", "Se#cret", "Se@cret"):
        assert hide_password(f"postgresql://u:{raw}@h:5/db") == "postgresql://u:***@h:5/db"


@pytest.mark.parametrize(
    "credentials", ["trainer:Se/cret@", "trainer:Se?cret@", "trainer:Se#cret@", "trainer:Se@cret@"]
)
def test_the_cli_never_shows_an_odd_password_of_a_store_it_cannot_reach(
    credentials: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    pytest.importorskip("psycopg")
    from stepwatch.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for query in ("", "?password=se%zzcret"):
        url = f"postgresql://{credentials}127.0.0.1:{port}/runs{query}"
        assert main(["runs", "--db", url]) == 2
        err = capsys.readouterr().err
        assert "cret" not in err and "***" in err, err


def _store_with_a_run(path: Path, points: int = 5000) -> None:
    import numpy as np

    writer = RunWriter(path, name="kept")
    writer.log_batch("step_loss", range(points), np.linspace(1.0, 0.1, points))
    writer.close()


def test_a_truncated_store_is_refused_by_readers_and_writers(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    _store_with_a_run(db)
    data = db.read_bytes()
    db.write_bytes(data[: int(len(data) * 0.99)])
    for open_it in (lambda: Store(db), lambda: RunWriter(db), lambda: RunRecorder(db=db)):
        with pytest.raises(ValueError, match="is damaged: it is truncated"):
            open_it()


def test_a_store_with_damaged_pages_gets_no_new_run(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    _store_with_a_run(db)
    data = bytearray(db.read_bytes())
    page = 4096
    for offset in range(3 * page, len(data) - page, 7 * page):  # scribble over some pages
        data[offset + 100 : offset + 300] = b"\xff" * 200
    db.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"is damaged \(SQLite's quick_check"):
        RunWriter(db)


def test_a_newer_or_changed_store_is_refused_naming_the_versions(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "runs.db"
    _store_with_a_run(db, 10)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    for open_it in (lambda: Store(db), lambda: RunWriter(db)):
        with pytest.raises(ValueError, match=r"newer stepwatch \(store schema 99; this version"):
            open_it()
    other = tmp_path / "changed.db"
    _store_with_a_run(other, 10)
    with sqlite3.connect(other) as conn:
        conn.execute("ALTER TABLE points RENAME COLUMN value TO v")
    with pytest.raises(ValueError, match=r"table 'points' lacks \['value'\]"):
        Store(other)


def test_a_store_locked_by_another_process_is_reported_within_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import sqlite3
    import threading

    from .conftest import wait_until

    db = tmp_path / "runs.db"
    _store_with_a_run(db, 10)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another program holds the write lock
    made: list[RunWriter] = []
    thread = threading.Thread(target=lambda: made.append(RunWriter(db, name="waits")))
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        thread.start()
        try:
            wait_until(lambda: "is locked by another process; " in caplog.text, timeout=20)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
            thread.join(60)
    assert not thread.is_alive() and made and made[0].name == "waits"
    made[0].close()
    # One message, and one that holds: the writer does not say it waits for minutes and then,
    # seconds later, that training goes on.
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "waiting" not in said[0], said
    assert "training goes on and the run is recorded once it is free" in said[0]


def test_a_lock_taken_mid_run_delays_records_and_drops_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import sqlite3

    from .conftest import wait_until

    db = tmp_path / "runs.db"
    writer = RunWriter(db, name="mid-run", flush_seconds=0.1)
    writer.log("loss", 1.0, 1)
    assert writer.flush()
    holder = sqlite3.connect(db, isolation_level=None)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        holder.execute("BEGIN IMMEDIATE")  # another program takes the write lock
        try:
            for step in range(2, 202):
                writer.log("loss", float(step), step)  # training goes on
            wait_until(lambda: "is locked by another process; " in caplog.text, timeout=20)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert writer.flush(timeout=30)
    writer.close()
    assert writer.dropped == 0 and writer.written == 201
    with Store(db) as store:
        assert store.metrics(writer.run_id, "loss")[0].tolist() == list(range(1, 202))


def test_a_store_locked_when_training_starts_lets_training_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import sqlite3
    import threading

    from stepwatch import LambdaCallback

    from .conftest import make_batches, make_model

    db = tmp_path / "runs.db"
    _store_with_a_run(db, 10)
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another program holds the store as training starts
    steps: list[int] = []
    released = threading.Event()

    def release_later(rc: object) -> None:
        if not released.is_set():  # the first step ran although the store is locked
            released.set()
            holder.execute("ROLLBACK")
            holder.close()

    recorder = RunRecorder(db=db, flush_seconds=0.1)
    seen = LambdaCallback(on_train_step_end=lambda rc: steps.append(rc.cb_params.cur_step_num))
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        make_model().train(2, make_batches(4), callbacks=[seen, recorder, LambdaCallback(
            on_train_epoch_end=release_later)])  # fmt: skip
    assert "training goes on and the run is recorded once it is free" in caplog.text
    assert steps == list(range(1, 9)) and released.is_set()
    assert recorder.run_id == 2 and recorder.dropped == 0
    with Store(db) as store:
        assert store.run(2).status == "finished"
        assert store.metrics(2, "step_loss")[0].tolist() == list(range(1, 9))


def test_a_store_locked_through_the_whole_run_says_so_in_two_lines_that_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import sqlite3

    db = tmp_path / "runs.db"
    _store_with_a_run(db, 10)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # held from before the run starts until after it ends
    try:
        with caplog.at_level(logging.WARNING, logger="stepwatch"):
            writer = RunWriter(db, name="never-written", flush_seconds=0.1)
            for step in range(1, 31):
                writer.log("loss", float(step), step)
            writer.close(timeout=1.0)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    # What it says as the run starts, and at its end what became of it: no third line
    # between them saying that records are being dropped while training continues.
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 2, said
    assert "training goes on and the run is recorded once it is free" in said[0]
    assert "stayed locked by another process; this run was not recorded" in said[1]
    assert "(30 records dropped)" in said[1] and writer.dropped == 30
    with Store(db) as store:
        assert [run.name for run in store.runs()] == ["kept"]


def test_a_store_in_folders_that_do_not_exist_is_refused_but_its_own_folder_is_made(
    tmp_path: Path,
) -> None:
    deep = tmp_path / "nonexistent" / "dir" / "runs.db"
    for make in (lambda: RunRecorder(db=deep), lambda: RunWriter(deep)):
        with pytest.raises(
            ValueError, match=r"cannot be created: '.*nonexistent' does not exist \(a store's own"
        ):
            make()
    assert list(tmp_path.iterdir()) == []  # no folder made without a word
    own = tmp_path / "runs" / "exp.db"  # one folder missing: the store's own, made
    RunRecorder(db=own)
    writer = RunWriter(own, name="in-its-folder")
    writer.close()
    with Store(own) as store:
        assert [r.name for r in store.runs()] == ["in-its-folder"]


def test_a_folder_given_as_the_store_gets_one_message_everywhere(tmp_path: Path) -> None:
    from .conftest import run_cli

    folder = tmp_path / "adir"
    folder.mkdir()
    said = f"{str(folder)!r} is a folder; pass a database file such as"
    with pytest.raises(ValueError, match=f"'db' {re.escape(said)}"):
        RunRecorder(db=folder)
    with pytest.raises(ValueError, match=re.escape(said)):
        Store(folder)
    done = run_cli("runs", "--db", str(folder))
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert "no stepwatch database" not in done.stderr


def test_closing_a_run_puts_it_into_the_database_file_itself(tmp_path: Path) -> None:
    """A copy of the .db alone holds a closed run, even while another connection kept SQLite
    from checkpointing its -wal on close."""
    import shutil
    import sqlite3

    db = tmp_path / "runs.db"
    RunWriter(db, name="first").close()
    reader = sqlite3.connect(db)  # another program holds the file open (a dashboard, a shell)
    try:
        reader.execute("SELECT count(*) FROM runs").fetchone()
        writer = RunWriter(db, name="copied")
        writer.log_batch("loss", range(5_000), [float(i) for i in range(5_000)])
        writer.close()
        copy = tmp_path / "copy" / "runs.db"
        copy.parent.mkdir()
        shutil.copyfile(db, copy)  # the .db only, not its -wal
    finally:
        reader.close()
    with Store(copy) as store:
        assert [r.name for r in store.runs()] == ["first", "copied"]
        assert store.metrics("copied", "loss")[0].tolist() == list(range(5_000))
        assert store.run("copied").status == "finished"
