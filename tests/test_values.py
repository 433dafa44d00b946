"""The value-name module: one name, one meaning, one store key, one direction."""

from __future__ import annotations

import math

from stepwatch.monitor import values
from stepwatch.monitor.values import direction, epoch_values, metric_directions


def test_direction_from_the_metric_then_the_name() -> None:
    assert direction("eval_accuracy") == "max" and direction("loss") == "min"
    assert direction("perplexity") == "min" and direction("step_time") == "min"
    assert direction("lr") is None and direction("loss_scale") is None
    for smaller in ("eval_nll", "nll", "eval_top1_err", "errs", "kl", "train_kld"):
        assert direction(smaller) == "min", smaller
    assert direction("system/rss_mb") is None and direction("system/gpu0_util") is None
    assert direction("eval_f1", {"f1": "min"}) == "min"  # a declared direction wins
    assert direction("eval_precision/3", {"precision": "max"}) == "max"  # per-class keys
    assert direction("train_mse/0") == "min"


def test_grouped_names_and_error_rates_are_minimised() -> None:
    # Names another trainer or DistributedMonitor groups with '/', read by their words.
    for name in ("train/loss", "val/loss", "dist/loss_mean", "dist/step_time_max", "eval/wer"):
        assert direction(name) == "min", name
    for name in ("wer", "eval_cer", "test_ter"):
        assert direction(name) == "min", name
    assert direction("val/accuracy") == "max" and direction("eval_power") == "max"
    assert direction("samples_per_second") == "max"
    assert direction("train/lr") is None


def test_metric_directions_read_what_metrics_declare() -> None:
    from stepwatch.train import metrics

    declared = metric_directions({"accuracy": metrics.Accuracy(), "mae": metrics.MAE(), "x": 1})
    assert declared == {"accuracy": "max", "mae": "min"}


def test_bare_names_mean_one_thing_for_the_whole_run() -> None:
    train = {"loss": 0.5, "accuracy": 0.8}
    validated = epoch_values(train, {"accuracy": 0.7, "eval_loss": 0.6}, validates=True)
    assert validated == {
        "loss": 0.5,
        "train_accuracy": 0.8,
        "eval_accuracy": 0.7,
        "eval_loss": 0.6,
        "accuracy": 0.7,
    }
    # An epoch without validation in a run that validates: the bare name is absent, never the
    # training value.
    skipped = epoch_values(train, None, validates=True)
    assert "accuracy" not in skipped and skipped["train_accuracy"] == 0.8
    assert epoch_values(train, None, validates=False)["accuracy"] == 0.8
    stored = epoch_values(train, {"loss": 0.6, "eval_loss": 0.6}, validates=True, aliases=False)
    assert stored == {"loss": 0.5, "train_accuracy": 0.8, "eval_loss": 0.6}
    assert not math.isnan(stored["eval_loss"])


def test_values_hosts_log_under_short_names_get_one_name() -> None:
    assert values.from_host("val_acc") == values.from_host("val_accuracy") == "eval_accuracy"
    assert values.from_host("train_acc") == values.from_host("acc") == "train_accuracy"
    assert values.from_host("val/loss") == "eval_loss" and values.from_host("train_loss") == "loss"
