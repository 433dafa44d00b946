"""Start-up cost: stepwatch's training face against ``import torch``, and the CLI's read path
against a bare Python that imports ``sqlite3``; each sample in a fresh interpreter.

1. Import: ``from stepwatch import Model`` (and a bare ``import stepwatch``) against
   ``import torch``. Each process times its own import with ``time.perf_counter()``
   (interpreter start-up left out). Goal: ``Model / torch <= 1.15``.
2. CLI start: the wall time of a whole ``python -m stepwatch runs --db runs.db`` process on a
   store of 20 runs (and, for reference, on a missing file: the error path) against
   ``python -c "import sqlite3"`` (interpreter start-up included in both), timed by
   this script around ``subprocess.run``. The read commands import no torch, so the goal is
   ``cli / sqlite3 <= 4``; ``python -c "import torch"`` is timed too, for scale: it is what the
   CLI cost when the package imported torch eagerly.

The samples of each part alternate, their order flipping every round, so drift on a noisy
machine hits all alike; one discarded warm-up run of each fills the file cache first. Medians
and ratios are printed. Last, the top-level modules each path loads beyond its baseline are
listed, with a warning for any heavy library among them.

Usage::

    python bench/import_time.py            # 5 rounds
    python bench/import_time.py --runs 11
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

IMPORT_GOAL = 1.15
CLI_GOAL = 4.0
# Optional libraries that importing stepwatch should never pull in.
HEAVY = (
    "matplotlib",
    "sklearn",
    "scipy",
    "pandas",
    "tqdm",
    "lightning",
    "pytorch_lightning",
    "keras",
    "tensorflow",
    "tensorboard",
)
# ... and what the CLI's read commands should not load either.
HEAVY_FOR_CLI = (*HEAVY, "torch", "numpy")

IMPORTS = {
    "import torch": "import torch",
    "import stepwatch": "import stepwatch",
    "from stepwatch import Model": "from stepwatch import Model",
}
TIME_SNIPPET = "import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
MODULES_SNIPPET = (
    "import json, sys; {statement}; "
    "print(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
)
CLI_MODULES_SNIPPET = (
    "import json, runpy, sys\n"
    "sys.argv = ['stepwatch', 'runs', '--db', {db!r}]\n"
    "try:\n"
    "    runpy.run_module('stepwatch', run_name='__main__')\n"
    "except SystemExit:\n"
    "    pass\n"
    "print(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
)


def run_python(args: list[str], expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=False, timeout=300
    )
    if done.returncode != expect:
        raise SystemExit(f"subprocess failed ({done.returncode}): {args}\n{done.stderr}")
    return done


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout.strip().splitlines()[-1]


def import_seconds(statement: str) -> float:
    return float(last_line(run_python(["-c", TIME_SNIPPET.format(statement=statement)])))


def process_seconds(args: list[str], expect: int = 0) -> Callable[[], float]:
    def sample() -> float:
        start = time.perf_counter()
        run_python(args, expect)
        return time.perf_counter() - start

    return sample


def interleaved(samplers: dict[str, Callable[[], float]], runs: int) -> dict[str, list[float]]:
    """``runs`` samples of each, alternating, the order flipped every round."""
    names = list(samplers)
    for name in names:  # warm-up: file cache, .pyc files
        samplers[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for run in range(runs):
        for name in names if run % 2 == 0 else names[::-1]:
            samples[name].append(samplers[name]())
    return samples


def report(title: str, samples: dict[str, list[float]]) -> dict[str, float]:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    width = max(len(name) for name in samples)
    print(title)
    print(f"{'':<{width}} {'median ms':>10}  all runs (ms)")
    for name, values in samples.items():
        runs = " ".join(f"{s * 1e3:.0f}" for s in values)
        print(f"{name:<{width}} {medians[name] * 1e3:>10.1f}  {runs}")
    return medians


def verdict(ratio: float, goal: float) -> str:
    return f"goal <= {goal:g}: {'met' if ratio <= goal else 'NOT met'}"


def top_level_modules(snippet: str) -> set[str]:
    return set(json.loads(last_line(run_python(["-c", snippet]))))


def show_extra(label: str, extra: set[str], heavy: tuple[str, ...]) -> None:
    print(f"top-level modules loaded by {label}: {len(extra)}")
    print("  " + (", ".join(sorted(extra)) if extra else "(none)"))
    found = sorted(name for name in extra if name in heavy)
    if found:
        print(f"WARNING: {label} loads {', '.join(found)}")
    else:
        print(f"  none of: {', '.join(heavy)}")


def _make_store(path: str) -> None:
    """A store of 20 finished runs of 2,000 steps each: what `stepwatch runs` really reads."""
    from stepwatch.store import RunWriter

    for i in range(20):
        writer = RunWriter(path, name=f"run-{i}", config={"lr": 0.1 * (i + 1)})
        writer.log_batch("step_loss", range(1, 2001), [1.0 / (s + i) for s in range(1, 2001)])
        for epoch in range(1, 5):
            writer.log("loss", 1.0 / (epoch + i), epoch * 500, epoch)
        writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    print(f"start-up: median of {args.runs} fresh processes each, {sys.executable}")
    print()
    samples = interleaved(
        {name: (lambda s=statement: import_seconds(s)) for name, statement in IMPORTS.items()},
        args.runs,
    )
    medians = report("1. import, timed inside the process", samples)
    ratio = medians["from stepwatch import Model"] / medians["import torch"]
    print(f"ratio Model/torch: {ratio:.3f} ({verdict(ratio, IMPORT_GOAL)})")
    bare = medians["import stepwatch"] / medians["import torch"]
    print(f"ratio bare import stepwatch/torch: {bare:.3f} (loads no torch)")

    with tempfile.TemporaryDirectory() as folder:
        missing = str(Path(folder) / "missing.db")
        real = str(Path(folder) / "runs.db")
        _make_store(real)
        cli = "python -m stepwatch runs --db runs.db"
        samples = interleaved(
            {
                'python -c "import sqlite3"': process_seconds(["-c", "import sqlite3"]),
                cli: process_seconds(["-m", "stepwatch", "runs", "--db", real]),
                "(the error path: --db missing.db)": process_seconds(
                    ["-m", "stepwatch", "runs", "--db", missing], expect=2
                ),
                'python -c "import torch"': process_seconds(["-c", "import torch"]),
            },
            args.runs,
        )
        print()
        medians = report("2. whole process, timed around it", samples)
        ratio = medians[cli] / medians['python -c "import sqlite3"']
        print(f"ratio cli/sqlite3: {ratio:.2f} ({verdict(ratio, CLI_GOAL)})")
        scale = medians[cli] / medians['python -c "import torch"']
        print(f"ratio cli/torch: {scale:.3f} (what the CLI took when it imported torch: ~1)")

        print()
        torch_modules = top_level_modules(MODULES_SNIPPET.format(statement="import torch"))
        model = MODULES_SNIPPET.format(statement="from stepwatch import Model")
        show_extra(
            "`from stepwatch import Model` beyond `import torch`",
            top_level_modules(model) - torch_modules,
            HEAVY,
        )
        sqlite_modules = top_level_modules(MODULES_SNIPPET.format(statement="import sqlite3"))
        cli_modules = top_level_modules(CLI_MODULES_SNIPPET.format(db=missing))
        show_extra(
            "`stepwatch runs` beyond `import sqlite3`", cli_modules - sqlite_modules, HEAVY_FOR_CLI
        )


if __name__ == "__main__":
    main()
