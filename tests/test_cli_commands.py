"""The read and delete commands, run in-process through ``stepwatch.cli.main``: what they print,
which loss and which "best" they show, filters, ``rm``, export and one-line failures."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stepwatch import RunWriter, Store
from stepwatch._format import duration, number, table
from stepwatch.cli import main

from .conftest import run_cli
from .test_reader import write_run


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, text: str) -> None:
    assert text in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def rows(out: str) -> dict[str, list[str]]:
    """Table lines by their first cell."""
    return {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "s.db"
    write_run(
        path,
        "full",
        [3.0 - 0.1 * i for i in range(20)],
        [2.5, 1.5],
        config={"lr": 0.1, "seed": 0, "directions": {"eval_score": "min"}},
        extra={
            "eval_accuracy": [0.8, 0.9],
            "eval_perplexity": [5.0, 3.0],
            "eval_score": [0.5, 0.2],
            "lr": [0.1, 0.05],
            "step_time": [0.012345678, 0.0111],
        },
    )
    write_run(path, "steps-only", [4.0, 2.0, 3.0], config={"lr": 0.2, "seed": 0, "extra": "x"})
    write_run(path, "lr=0.1", [1.0] * 10, [0.9], status="failed", config={"lr": 0.1, "seed": 0})
    return path


def test_format_rules() -> None:
    assert [number(x) for x in (1.23456789, 0.000123456, 12345.678, 2.0, 7, None)] == [
        "1.235",
        "0.0001235",
        "1.235e+04",
        "2",
        "7",
        "-",
    ]
    assert [number(x) for x in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]
    assert [duration(s) for s in (5, 65, 3725)] == ["0:05", "1:05", "1:02:05"]
    assert table(["a", "bb"], [["xyz", "1"]]) == "a    bb\nxyz  1"


# -- runs -----------------------------------------------------------------------------------
def test_runs_best_loss_is_the_epoch_mean_else_marked_step_loss(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    code, out, err = cli(capsys, "runs", "--db", str(db))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["id", "name", "status", "steps", "best", "loss"]
    table_rows = rows(out)
    assert table_rows["1"][1:6] == ["full", "finished", "20", "1.5", "1.5"]
    assert table_rows["2"][1:6] == ["steps-only", "finished", "3", "2*", "3*"]
    assert table_rows["3"][1:6] == ["lr=0.1", "failed", "10", "0.9", "0.9"]
    assert lines[-1] == "* per-step loss: the run has no epoch-mean loss (yet)"


def test_runs_filters(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    def ids(*args: str) -> list[str]:
        code, out, err = cli(capsys, "runs", "--db", str(db), *args)
        assert code == 0, err
        return [line.split()[0] for line in out.splitlines()[1:] if line[:1].isdigit()]

    assert ids("--name", "only") == ["2"]
    assert ids("--name", "lr=*") == ["3"]
    assert ids("--status", "finished") == ["1", "2"]
    assert ids("--status", "finished", "--last", "1") == ["2"]
    assert ids("--last", "2") == ["2", "3"]
    code, out, _ = cli(capsys, "runs", "--db", str(db), "--name", "nothing")
    assert code == 0 and out.startswith("no runs match in ")


# -- show and compare -----------------------------------------------------------------------
def test_show_loss_is_the_same_quantity_as_in_runs(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    code, out, err = cli(capsys, "show", "full", "--db", str(db))
    assert code == 0, err
    assert "  loss      best 1.5, last 1.5 (epoch mean, key 'loss')" in out.splitlines()
    code, out, err = cli(capsys, "show", "steps-only", "--db", str(db))
    assert "  loss      best 2, last 3 (per step, key 'step_loss')" in out.splitlines()


def test_show_lists_the_config_one_setting_a_line(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    code, out, err = cli(capsys, "show", "full", "--db", str(db))
    assert code == 0, err
    lines = out.splitlines()
    at = lines.index("  config")
    assert lines[at + 1 : at + 4] == [
        "    directions.eval_score = min",
        "    lr = 0.1",
        "    seed = 0",
    ]


def test_show_best_follows_each_values_direction(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    code, out, err = cli(capsys, "show", "full", "--db", str(db))
    assert code == 0, err
    metrics = rows(out.split("\n\n")[1])
    assert metrics["metric"] == ["metric", "final", "best", "better", "points"]
    assert metrics["eval_accuracy"][1:4] == ["0.9", "0.9", "max"]
    assert metrics["eval_perplexity"][1:4] == ["3", "3", "min"]  # smaller is better
    assert metrics["eval_score"][1:4] == ["0.2", "0.2", "min"]  # declared in the run's config
    assert metrics["lr"][1:4] == ["0.05", "-", "-"]  # a setting: no best
    assert metrics["step_time"][1:4] == ["0.0111", "0.0111", "min"]
    assert metrics["loss"][1:5] == ["1.5", "1.5", "min", "2"]
    assert metrics["step_loss"][1:4] == ["1.1", "1.1", "min"]


def test_compare_shows_best_by_direction_and_config_differences(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    code, out, err = cli(capsys, "compare", "1", "2", "--db", str(db))
    assert code == 0, err
    metrics, config = out.split("\n\n")
    assert rows(metrics)["eval_perplexity"][1:] == ["3", "3", "-", "-"]
    assert rows(metrics)["lr"][1:] == ["0.05", "-", "-", "-"]
    assert config.splitlines()[0].split() == ["config", "1:full", "2:steps-only"]
    differences = rows(config)
    assert differences["lr"][1:] == ["0.1", "0.2"]
    assert differences["extra"][1:] == ["-", "x"]
    assert differences["directions"][1:] == ['{"eval_score":"min"}', "-"]
    assert "seed" not in differences
    code, out, _ = cli(capsys, "compare", "1", "full", "--db", str(db))
    assert code == 0 and out.rstrip().endswith("config: the same in every run")


def test_read_commands_leave_no_files_beside_the_database(
    capsys: pytest.CaptureFixture[str], db: Path, tmp_path: Path
) -> None:
    (tmp_path / "out").mkdir()
    before = sorted(p.name for p in db.parent.iterdir())
    for args in (
        ["runs"],
        ["show", "1"],
        ["compare", "1", "2"],
        ["export", "1", "--format", "csv", "--out", str(tmp_path / "out" / "r.csv")],
    ):
        code, _, err = cli(capsys, *args, "--db", str(db))
        assert code == 0, err
    assert sorted(p.name for p in db.parent.iterdir()) == before


# -- rm -------------------------------------------------------------------------------------
def _names(db: Path) -> list[str]:
    with Store(db) as store:
        return [r.name for r in store.runs()]


def test_rm_with_yes_deletes_runs(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    code, out, err = cli(capsys, "rm", "1", "lr=0.1", "--yes", "--db", str(db))
    assert code == 0, err
    assert out.splitlines() == ["deleted run 1 (full)", "deleted run 3 (lr=0.1)"]
    assert _names(db) == ["steps-only"]


@pytest.mark.parametrize(
    ("answer", "code", "left"),
    [("y\n", 0, ["full", "lr=0.1"]), ("no\n", 1, ["full", "steps-only", "lr=0.1"])],
)
def test_rm_asks_first(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    db: Path,
    answer: str,
    code: int,
    left: list[str],
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
    result, out, err = cli(capsys, "rm", "2", "--db", str(db))
    assert result == code
    assert err.startswith("delete run 2 (steps-only, finished, 3 steps) from ")
    assert err.rstrip().endswith("? [y/N]")
    assert ("deleted run 2" in out) == (code == 0)
    assert _names(db) == left


def test_rm_without_an_answer_refuses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Path
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = cli(capsys, "rm", "2", "--db", str(db))
    assert code == 2
    assert "no answer on stdin: nothing deleted; pass --yes" in err.splitlines()[-1]
    assert _names(db) == ["full", "steps-only", "lr=0.1"]
    result = subprocess.run(
        [sys.executable, "-m", "stepwatch", "rm", "2", "--db", str(db)],
        stdin=subprocess.DEVNULL,  # a script's empty stdin: EOF at once
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert _names(db) == ["full", "steps-only", "lr=0.1"]


def test_rm_refuses_a_running_run_and_unknown_runs(
    capsys: pytest.CaptureFixture[str], db: Path
) -> None:
    writer = RunWriter(db, name="live")
    try:
        code, _, err = cli(capsys, "rm", "1", "live", "--yes", "--db", str(db))
        assert code == 2
        one_line_error(err, "run 4 (live) is still running; nothing deleted")
        code, _, err = cli(capsys, "rm", "1", "nope", "--yes", "--db", str(db))
        assert code == 2
        one_line_error(err, "no run 'nope'")
        assert _names(db) == ["full", "steps-only", "lr=0.1", "live"]
    finally:
        writer.close()


# -- export ---------------------------------------------------------------------------------
def test_export_json_with_infinities(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    write_run(db, "diverged", [1.0, math.inf, math.nan])
    code, _, err = cli(
        capsys,
        "export",
        "1",
        "--format",
        "json",
        "--out",
        str(tmp_path / "r.json"),
        "--db",
        str(db),
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["metrics"]["step_loss"]["values"] == [1.0, "Infinity", None]


def test_export_several_runs_keeps_them_apart(
    capsys: pytest.CaptureFixture[str], db: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tb"
    code, printed, err = cli(
        capsys, "export", "1", "2", "--format", "tensorboard", "--out", str(out), "--db", str(db)
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["1-full", "2-steps-only"]
    assert f"exported run 2 (tensorboard) to {out / '2-steps-only'}" in printed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = {}
    for name in ("1-full", "2-steps-only"):
        acc = EventAccumulator(str(out / name))
        acc.Reload()
        steps[name] = [e.step for e in acc.Scalars("step_loss")]
    assert steps == {"1-full": list(range(1, 21)), "2-steps-only": [1, 2, 3]}
    code, _, err = cli(
        capsys,
        "export",
        "1",
        "3",
        "--format",
        "csv",
        "--out",
        str(tmp_path / "csv"),
        "--db",
        str(db),
    )
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == ["1-full.csv", "3-lr=0.1.csv"]
    # A mistyped folder is refused, not made: neither for a file nor for a folder of runs.
    for out in (tmp_path / "typo" / "run1.csv", tmp_path / "typo" / "runs"):
        code, _, err = cli(capsys, "export", "1", "--format", "csv", "--out", str(out),
                           "--db", str(db))  # fmt: skip
        assert code == 2 and f"the folder {tmp_path / 'typo'} does not exist" in err
    assert not (tmp_path / "typo").exists()


# -- failures -------------------------------------------------------------------------------
def test_any_failure_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Path, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    code, _, err = cli(
        capsys,
        "export",
        "1",
        "--format",
        "json",
        "--out",
        str(tmp_path / "a-file" / "r.json"),
        "--db",
        str(db),
    )
    assert code == 2
    one_line_error(err, "stepwatch export: ")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(Store, "summary", broken)
    code, _, err = cli(capsys, "show", "1", "--db", str(db))
    assert code == 2
    one_line_error(err, "stepwatch show: RuntimeError: disk on fire second line")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "runs_summary", interrupted)
    code, _, err = cli(capsys, "runs", "--db", str(db))
    assert code == 130 and err == "stepwatch runs: interrupted\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "--device 'tpu' is not a torch device"),
        (["--device", "cpu", "--db", "/proc/x/s.db"], "--db /proc/x/s.db: cannot create files in"),
        (["--device", "cpu", "--db", "{tmp}"], "is not a file"),
        (["--device", "cpu", "--checkpoint-dir", "{tmp}/a-file"], "is a file; pass a folder"),
        (["--device", "cpu", "--db", "{tmp}/a-file/s.db"], "a-file is not a folder"),
    ],
)
def test_demo_checks_its_arguments_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "a-file").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = cli(capsys, "demo", "--epochs", "1", *args)
    assert code == 2 and out == "" and err.startswith("stepwatch demo: --")
    one_line_error(err, message)


def test_demo_on_a_missing_accelerator_is_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_cli("demo", "--device", "cuda", timeout=60)
    assert result.returncode == 2
    assert re.fullmatch(
        r"stepwatch demo: --device 'cuda': no cuda device on this machine\n", result.stderr
    )


def test_demo_does_not_import_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys, stepwatch.demo; print('stepwatch.cli' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_show_by_a_shared_name_says_which_run_it_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"
    for _ in range(3):
        writer = RunWriter(db, name="again")
        writer.log("loss", 1.0, 1)
        writer.close()
    code, out, err = cli(capsys, "show", "again", "--db", str(db))
    assert code == 0 and out.startswith("run 3: again")
    assert "note: 3 runs are named 'again'; showing the newest, 3 (the others: 1, 2" in err


def test_a_logged_minus_inf_is_not_the_best_loss_and_unicode_names_survive_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stepwatch.store.export import run_label

    db = tmp_path / "runs.db"
    writer = RunWriter(db, name="训练-lr=0.1")
    for step, value in enumerate([2.0, 1.5, float("-inf"), 1.0], start=1):
        writer.log("step_loss", value, step)
    writer.close()
    with Store(db) as store:
        ((run, loss),) = store.runs_summary()
        assert loss is not None and loss.min == 1.0
        assert run_label(run) == "1-训练-lr=0.1"
    code, out, _ = cli(capsys, "runs", "--db", str(db))
    assert code == 0 and "训练-lr=0.1" in out and "-inf" not in out


def test_a_bad_argument_is_named_as_its_flag(
    capsys: pytest.CaptureFixture[str], db: Path, tmp_path: Path
) -> None:
    code, _, err = cli(capsys, "runs", "--db", "sqllite:///runs.db")
    assert code == 2 and err.startswith("stepwatch runs: --db 'sqllite:///runs.db' names an")
    code, _, err = cli(capsys, "serve", "--db", str(db), "--port", "99999")
    assert (
        code == 2 and err.strip() == "stepwatch serve: --port must be at most 65535, but got 99999."
    )
    code, _, err = cli(capsys, "push", "--db", str(db), "--to", "postgresq://u:pw@h/db")
    one_line_error(err, "--to 'postgresq://u:***@h/db' is not a team store: pass a postgresql://")
    assert code == 2 and "ValueError" not in err and ":pw@" not in err, err
