"""NumpySlicesDataset: batching, shuffling, shards and argument checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from stepwatch.dataset import NumpySlicesDataset


def test_batches_columns_and_size() -> None:
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    ds = NumpySlicesDataset((x, y), column_names=["x", "y"]).batch(4)
    assert ds.get_dataset_size() == len(ds) == 3
    batches = list(ds)
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    assert isinstance(batches[0][0], torch.Tensor) and batches[0][0].dtype == torch.float32
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(10))
    assert ds.batch(4, drop_remainder=True).get_dataset_size() == 2
    assert next(iter(ds.create_dict_iterator())).keys() == {"x", "y"}
    assert ds.get_col_names() == ["x", "y"] and ds.get_batch_size() == 4


def test_shuffle_is_seeded_by_torch_and_differs_per_epoch() -> None:
    ds = NumpySlicesDataset(np.arange(50), shuffle=True).batch(50)
    torch.manual_seed(3)
    first, second = next(iter(ds))[0], next(iter(ds))[0]
    torch.manual_seed(3)
    assert torch.equal(next(iter(ds))[0], first)
    assert not torch.equal(first, second)
    assert sorted(first.tolist()) == list(range(50))


def test_dict_data_and_shards() -> None:
    ds = NumpySlicesDataset({"a": np.arange(10), "b": np.arange(10) * 2}, num_shards=3, shard_id=1)
    assert ds.column_names == ["a", "b"]
    assert torch.equal(next(iter(ds.batch(10)))[0], torch.tensor([1, 4, 7]))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"data": (np.zeros(3), np.zeros(4))}, ValueError, "same number of rows"),
        ({"data": ()}, ValueError, "at least one column"),
        ({"data": np.float32(1)}, ValueError, "is a scalar"),
        ({"data": [np.array([{}, {}])]}, TypeError, "dtype object"),
        ({"column_names": ["a", "b"]}, ValueError, "has 2 names"),
        ({"column_names": [1]}, TypeError, "'column_names' must be a list of str"),
        ({"shuffle": "yes"}, TypeError, "'shuffle' must be a bool"),
        ({"num_shards": 2}, ValueError, "must be given together"),
        ({"num_shards": 2, "shard_id": 2}, ValueError, "'shard_id' must be smaller"),
        ({"num_shards": 0, "shard_id": 0}, ValueError, "'num_shards' must be an int >= 1"),
    ],
)
def test_argument_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    args: dict[str, Any] = {"data": np.zeros((6, 2))}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        NumpySlicesDataset(**args)


def test_batch_argument_validation() -> None:
    ds = NumpySlicesDataset(np.zeros(4))
    with pytest.raises(ValueError, match="'batch_size' must be an int >= 1"):
        ds.batch(0)
    with pytest.raises(TypeError, match="'drop_remainder' must be a bool"):
        ds.batch(2, drop_remainder=None)  # type: ignore[arg-type]


def test_a_list_is_one_column_as_in_mindspore() -> None:
    rows = [batch[0].tolist() for batch in NumpySlicesDataset([1, 2, 3], column_names=["n"])]
    assert rows == [[1], [2], [3]]
    (pair,) = NumpySlicesDataset([[1, 2], [3, 4]]).batch(2)
    assert len(pair) == 1 and pair[0].tolist() == [[1, 2], [3, 4]]  # one column of two rows
    with pytest.raises(ValueError, match=r"pass a tuple for several columns"):
        NumpySlicesDataset([np.ones((4, 2)), np.zeros(4)])
