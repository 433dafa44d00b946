"""Wall time of ``import stepwatch`` against ``import torch``, each in a fresh interpreter.

Method: every sample is a new ``python -c`` process that times its own import with
``time.perf_counter()`` (interpreter start-up is left out). The two imports alternate, their
order flipping every run, so drift on a noisy machine hits both alike; one discarded warm-up
run of each fills the file cache first. The medians and their ratio are printed, against the
goal ``stepwatch / torch <= 1.15``.

A last pair of processes lists the top-level modules that ``import stepwatch`` loads beyond
those that ``import torch`` loads, and warns about any heavy optional library among them.

Usage::

    python bench/import_time.py            # 5 runs of each
    python bench/import_time.py --runs 11
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

GOAL = 1.15
MODULES = ("torch", "stepwatch")
# Optional libraries that a bare ``import stepwatch`` should never pull in.
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

TIME_SNIPPET = (
    "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
)
MODULES_SNIPPET = (
    "import json, sys; import {module}; "
    "print(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
)


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"subprocess failed ({done.returncode}): {code}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def import_seconds(module: str) -> float:
    return float(run_python(TIME_SNIPPET.format(module=module)))


def top_level_modules(module: str) -> set[str]:
    return set(json.loads(run_python(MODULES_SNIPPET.format(module=module))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per module (default 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    for module in MODULES:  # warm-up: file cache, .pyc files
        import_seconds(module)
    samples: dict[str, list[float]] = {module: [] for module in MODULES}
    for run in range(args.runs):
        order = MODULES if run % 2 == 0 else MODULES[::-1]
        for module in order:
            samples[module].append(import_seconds(module))

    medians = {module: statistics.median(values) for module, values in samples.items()}
    print(f"import time: median of {args.runs} fresh processes each, {sys.executable}")
    print(f"{'import':<12} {'median ms':>10}  {'all runs (ms)'}")
    for module in MODULES:
        runs = " ".join(f"{s * 1e3:.0f}" for s in samples[module])
        print(f"{module:<12} {medians[module] * 1e3:>10.1f}  {runs}")
    ratio = medians["stepwatch"] / medians["torch"]
    verdict = "met" if ratio <= GOAL else "NOT met"
    print(f"ratio stepwatch/torch: {ratio:.3f} (goal <= {GOAL:.2f}: {verdict})")

    extra = sorted(top_level_modules("stepwatch") - top_level_modules("torch"))
    print()
    print(f"top-level modules loaded by `import stepwatch` beyond `import torch`: {len(extra)}")
    print("  " + (", ".join(extra) if extra else "(none)"))
    heavy = [name for name in extra if name in HEAVY]
    if heavy:
        print(f"WARNING: `import stepwatch` imports heavy optional modules: {', '.join(heavy)}")
    else:
        print(f"no heavy optional module imported (checked: {', '.join(HEAVY)})")


if __name__ == "__main__":
    main()
