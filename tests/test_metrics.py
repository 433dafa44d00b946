"""Metrics agree with scikit-learn / NumPy references and follow clear/update/eval."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from stepwatch.train import metrics as swm


def _batches(seed: int = 0, n: int = 5, size: int = 20, classes: int = 4) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, classes, generator=gen),
            torch.randint(0, classes, (size,), generator=gen),
        )
        for _ in range(n)
    ]


def _all(batches: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    return (
        torch.cat([b[0] for b in batches]).numpy(),
        torch.cat([b[1] for b in batches]).numpy(),
    )


def _run(metric: Any, batches: list[Any]) -> Any:
    metric.clear()
    for pred, label in batches:
        metric.update(pred, label)
    return metric.eval()


def test_accuracy_matches_sklearn_and_accepts_one_hot_and_numpy() -> None:
    batches = _batches()
    scores, labels = _all(batches)
    expected = skm.accuracy_score(labels, scores.argmax(1))
    assert _run(swm.Accuracy(), batches) == pytest.approx(expected)
    one_hot = [(p, torch.nn.functional.one_hot(y, 4)) for p, y in batches]
    assert _run(swm.Accuracy(), one_hot) == pytest.approx(expected)
    as_numpy = [(p.numpy(), y.numpy()) for p, y in batches]
    assert _run(swm.Accuracy(), as_numpy) == pytest.approx(expected)


def test_binary_and_multilabel_accuracy() -> None:
    probs = torch.tensor([0.9, 0.2, 0.6, 0.4])
    labels = torch.tensor([1, 0, 0, 0])
    assert _run(swm.Accuracy(), [(probs, labels)]) == pytest.approx(0.75)
    multi = torch.tensor([[0.9, 0.1], [0.8, 0.7]])
    assert _run(swm.Accuracy("multilabel"), [(multi, torch.tensor([[1, 0], [1, 0]]))]) == 0.5


def test_top_k_matches_sklearn() -> None:
    batches = _batches(classes=6)
    scores, labels = _all(batches)
    for k in (1, 2, 5):
        expected = skm.top_k_accuracy_score(labels, scores, k=k, labels=range(6))
        assert _run(swm.TopKCategoricalAccuracy(k), batches) == pytest.approx(expected)
    assert _run(swm.Top1CategoricalAccuracy(), batches) == pytest.approx(
        skm.accuracy_score(labels, scores.argmax(1))
    )


def test_mae_mse_match_numpy() -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, generator=gen), torch.randn(10, generator=gen)) for _ in range(3)]
    pred, true = _all(batches)
    assert _run(swm.MAE(), batches) == pytest.approx(np.abs(pred - true).mean(), rel=1e-5)
    assert _run(swm.MSE(), batches) == pytest.approx(((pred - true) ** 2).mean(), rel=1e-5)


def test_precision_recall_match_sklearn_macro_and_per_class() -> None:
    batches = _batches(classes=3)
    scores, labels = _all(batches)
    pred = scores.argmax(1)
    for cls, fn in ((swm.Precision, skm.precision_score), (swm.Recall, skm.recall_score)):
        assert _run(cls(), batches) == pytest.approx(fn(labels, pred, average="macro"), rel=1e-6)
        per_class = _run(cls(average=None), batches)
        np.testing.assert_allclose(per_class, fn(labels, pred, average=None), rtol=1e-6)


def test_loss_metric_averages_batches() -> None:
    metric = swm.Loss()
    for v in (1.0, 2.0, 6.0):
        metric.update(torch.tensor(v))
    assert metric.eval() == pytest.approx(3.0)


def test_metric_state_stays_a_tensor_until_eval() -> None:
    metric = swm.Accuracy()
    for pred, label in _batches():
        metric.update(pred, label)
    assert isinstance(metric._sum, torch.Tensor)


@pytest.mark.parametrize(
    "metric",
    [swm.Accuracy(), swm.MAE(), swm.Loss(), swm.Precision(), swm.TopKCategoricalAccuracy(2)],
)
def test_eval_before_update_is_runtime_error(metric: Any) -> None:
    metric.clear()
    with pytest.raises(RuntimeError, match="needs at least one update"):
        metric.eval()


def test_metric_argument_validation() -> None:
    with pytest.raises(ValueError, match="'eval_type' must be one of"):
        swm.Accuracy("regression")
    with pytest.raises(ValueError, match="'k' must be an int >= 1"):
        swm.TopKCategoricalAccuracy(0)
    with pytest.raises(ValueError, match="'average' must be one of"):
        swm.Recall(average="micro")
    with pytest.raises(ValueError, match=r"needs 2 inputs"):
        swm.Accuracy().update(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="classification metrics expect"):
        swm.Accuracy().update(torch.zeros(4, 3), torch.zeros(5))
    with pytest.raises(TypeError, match="a metric name must be a str"):
        swm.get_metric_fn(3)  # type: ignore[arg-type]


def test_custom_metric_object_and_names() -> None:
    class CountBatches:
        def clear(self) -> None:
            self.n = 0

        def update(self, *inputs: Any) -> None:
            self.n += 1

        def eval(self) -> int:
            return self.n

    built = swm.build_metrics({"accuracy", "loss"})
    assert list(built) == ["accuracy", "loss"]
    built = swm.build_metrics([swm.MAE(), CountBatches()])
    assert list(built) == ["mae", "count_batches"]
    assert "top_k_categorical_accuracy" in swm.names()
