"""What importing stepwatch loads: the package faces are lazy and reading never loads torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stepwatch
import stepwatch.monitor
import stepwatch.store
from stepwatch import RunWriter

ROOT = Path(__file__).resolve().parents[1]

# The public faces as they were when the package imported everything eagerly.
PACKAGE_ALL = [
    "GRAPH_MODE",
    "MAE",
    "MSE",
    "PYNATIVE_MODE",
    "Accuracy",
    "Alert",
    "AnomalyMonitor",
    "BackupAndRestore",
    "Callback",
    "CallbackParams",
    "CheckpointConfig",
    "DistributedMonitor",
    "DynamicLossScaleManager",
    "EarlyStopping",
    "Every",
    "FixedLossScaleManager",
    "FlopsUtilizationCollector",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "Loss",
    "LossMonitor",
    "Metric",
    "Model",
    "ModelCheckpoint",
    "NumpySlicesDataset",
    "OnRequestExit",
    "ParallelMode",
    "PlotMonitor",
    "Precision",
    "ProgressBar",
    "Recall",
    "ReduceLROnPlateau",
    "RingBuffer",
    "RunContext",
    "RunRecorder",
    "RunWriter",
    "Store",
    "Tensor",
    "TerminateOnNaN",
    "TimeMonitor",
    "TopKCategoricalAccuracy",
    "WatchedRun",
    "__version__",
    "get_auto_parallel_context",
    "get_context",
    "load_checkpoint",
    "reset_auto_parallel_context",
    "save_checkpoint",
    "set_auto_parallel_context",
    "set_context",
    "watch",
]
PACKAGE_SUBMODULES = {
    "amp",
    "context",
    "dataset",
    "distributed",
    "monitor",
    "store",
    "train",
    "view",
}


def _python(code: str, timeout: float = 60) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def _loads_torch(statements: str) -> bool:
    return _python(f"import sys\n{statements}\nprint('torch' in sys.modules)") == "True"


def _public(names: list[str]) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_the_version_has_one_source() -> None:
    # pyproject.toml takes it from _version.py, which the package and the CLI read.
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    source = config["tool"]["setuptools"]["dynamic"]["version"]
    assert source == {"attr": "stepwatch._version.__version__"}
    from stepwatch._version import __version__

    assert stepwatch.__version__ == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_package_faces_keep_their_names() -> None:
    assert stepwatch.__all__ == PACKAGE_ALL
    assert stepwatch.store.__all__ == [
        "RunInfo",
        "RunRecorder",
        "RunWriter",
        "Store",
        "default_path",
    ]
    assert stepwatch.monitor.__all__ == ["Alert", "Every", "RingBuffer"]
    # dir() in a fresh interpreter (here, other tests may have loaded more submodules).
    listed = json.loads(
        _python(
            "import json, stepwatch, stepwatch.store, stepwatch.monitor\n"
            "print(json.dumps([dir(stepwatch), dir(stepwatch.store), dir(stepwatch.monitor)]))"
        )
    )
    assert _public(listed[0]) == _public(PACKAGE_ALL) | PACKAGE_SUBMODULES
    assert _public(listed[1]) == {*stepwatch.store.__all__, "reader", "recorder", "writer"}
    assert _public(listed[2]) == {
        *stepwatch.monitor.__all__,
        "detectors",
        "epoch_detectors",
        "learning_detectors",
        "layer_detectors",
        "ring",
        "schedule",
        "values",
    }
    for name in PACKAGE_ALL:
        assert getattr(stepwatch, name) is not None
    from stepwatch import Model
    from stepwatch.train import Model as TrainModel

    assert Model is TrainModel is stepwatch.Model
    assert stepwatch.train.Model is Model
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        stepwatch.nope  # noqa: B018


@pytest.mark.parametrize(
    "statements",
    [
        "import stepwatch",
        "import stepwatch.store.reader",
        "from stepwatch import Store, RunWriter, Every, RingBuffer, __version__",
        "from stepwatch.store import Store, RunInfo, RunWriter, default_path",
        "import stepwatch.monitor.values, stepwatch.store.export, stepwatch.cli",
        "import stepwatch.dashboard.server, stepwatch.plotting",
        "from stepwatch import context, GRAPH_MODE, set_context, get_context",
    ],
)
def test_reading_imports_no_torch(statements: str) -> None:
    assert not _loads_torch(statements)


def test_training_names_still_load_torch() -> None:
    assert _loads_torch("from stepwatch import Model")
    assert _loads_torch("import stepwatch\nstepwatch.RunRecorder")


def test_cli_read_commands_import_no_torch(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    writer = RunWriter(db, name="plain")
    for step in range(1, 6):
        writer.log("step_loss", 1.0 / step, step)
    writer.close()
    out = tmp_path / "r.json"
    code = (
        "import contextlib, io, sys\n"
        "from stepwatch.cli import main\n"
        "sink = io.StringIO()\n"
        "with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):\n"
        f"    codes = [main(['runs', '--db', {str(tmp_path / 'missing.db')!r}])]\n"
        f"    for args in (['runs'], ['show', '1'], ['compare', '1', 'plain'],\n"
        f"                 ['export', '1', '--format', 'json', '--out', {str(out)!r}],\n"
        f"                 ['export', '1', '--format', 'csv', '--out', {str(out)!r} + '.csv']):\n"
        f"        codes.append(main([*args, '--db', {str(db)!r}]))\n"
        "print(codes, 'torch' in sys.modules)"
    )
    assert _python(code) == "[2, 0, 0, 0, 0, 0] False"


def test_python_m_stepwatch_runs_imports_no_torch(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    RunWriter(db, name="plain").close()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "stepwatch", "runs", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "plain" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert {"stepwatch.cli", "stepwatch.store._schema"} <= imported
    assert "torch" not in imported
