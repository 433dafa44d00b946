"""The labelled scenario suite (bench/diagnose.py) at AnomalyMonitor's defaults, real training
runs: every fault found within its goal (the bugs that crash nothing among them: shuffled
labels, an LR typo, an epoch schedule stepped per batch, unnormalised inputs into tanh, data
sorted by class, softmax before CrossEntropyLoss, a bad batch every epoch), and no alert at all
on the healthy runs, their look-alikes included (label smoothing, warm-up from 0, cosine to 0,
step decay, dropout with batch 8, a loss in the thousands, slow-then-sudden learning, a
separable task with batches of 4 whose losses reach exactly 0); the per-detector figures
(false alarms per 100,000 healthy steps, delays) are printed as the bench prints them."""

from __future__ import annotations

import importlib.util
import io
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "diagnose.py"


@pytest.fixture(scope="module")
def suite() -> Any:
    spec = importlib.util.spec_from_file_location("diagnose", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["diagnose"] = module
    spec.loader.exec_module(module)
    logging.getLogger("stepwatch").disabled = True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the bench runs it: tiny networks gain nothing from two
    try:
        with pytest.warns(RuntimeWarning):  # the fault runs warn about NaN epoch losses
            results = [module.run(s) for s in module.SCENARIOS]
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("stepwatch").disabled = False
        sys.modules.pop("diagnose", None)
    return module, results


@pytest.mark.timeout(900)
def test_every_fault_is_caught_within_its_goal_and_healthy_runs_stay_quiet(suite: Any) -> None:
    module, results = suite
    out = io.StringIO()
    summary = module.report(results, out)
    print(out.getvalue())
    for r in results:
        kind = r.scenario.expected
        if kind is None:
            assert r.alerts == [], f"{r.scenario.name}: false alarms {r.alerts}"
        else:
            assert r.delay is not None, f"{r.scenario.name}: {kind} missed"
            assert 0 <= r.delay <= module.GOALS[kind][0], f"{r.scenario.name}: delay {r.delay}"
    faults = [r for r in results if r.scenario.expected is not None]
    assert summary["recall"] == f"{len(faults)}/{len(faults)}" and len(faults) >= 15
    held = [r for r in results if r.scenario.held_out]
    assert len(held) >= 18 and len(results) - len(held) >= 25
    rows = module.figures(results, io.StringIO())
    assert {row["detector"] for row in rows} >= {"spike", "grad_explosion", "divergence"}
    for row in rows:
        assert row["false alarms"] == 0 and row["per 100k healthy steps"] == 0.0, row
        caught, runs = row["faults caught"].split("/")
        assert caught == runs, row
