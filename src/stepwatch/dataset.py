"""Datasets: what ``Model.train/fit/eval`` accept, a small array adapter, and how a batch is
checked, moved to the device and fed to the network.

The loops take a ``torch.utils.data.DataLoader``, any re-iterable sized sequence of
``(data, label)`` batches (a list of tuples works), or :class:`NumpySlicesDataset`, named and
shaped as MindSpore users know it::

    ds = NumpySlicesDataset((X, y), column_names=["data", "label"], shuffle=True).batch(32)
    ds.get_dataset_size()   # number of batches
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ._validation import check_bool, check_int

__all__ = ["NumpySlicesDataset"]


class NumpySlicesDataset:
    """Slices of in-memory arrays, batched, yielding tuples of ``torch.Tensor`` columns.

    Args:
        data: a tuple of arrays (one per column), a dict ``{column: array}``, a single array,
            or a list, which is one column whose items are the rows (as in MindSpore:
            ``NumpySlicesDataset([1, 2, 3])`` has three rows). All columns must have the same
            first dimension.
        column_names: names of the columns (default ``column_0``, ``column_1``, ... or the dict
            keys).
        shuffle: reshuffle the rows every epoch, using torch's global RNG (so
            ``torch.manual_seed`` makes it repeatable).
        num_shards / shard_id: keep every ``num_shards``-th row starting at ``shard_id`` (for
            one process per rank).

    Raises:
        TypeError: ``data`` is not arrays; ``shuffle`` not a bool.
        ValueError: columns of different lengths, bad shard arguments.
    """

    def __init__(
        self,
        data: Any,
        column_names: Sequence[str] | None = None,
        shuffle: bool = False,
        num_shards: int | None = None,
        shard_id: int | None = None,
    ) -> None:
        if isinstance(data, dict):
            names = list(data)
            columns = list(data.values())
        elif isinstance(data, tuple):
            columns = list(data)
            names = [f"column_{i}" for i in range(len(columns))]
        elif isinstance(data, list):
            # As in MindSpore, a list is one column: its items are the rows.
            try:
                column = np.asarray(data)
            except ValueError:
                raise ValueError(
                    "'data' is a list, which is one column with one row per item (as in "
                    "MindSpore), but its items differ in shape; pass a tuple for several "
                    "columns: NumpySlicesDataset((x, y))."
                ) from None
            if not data:
                raise ValueError("'data' must hold at least one row, but got an empty list.")
            columns, names = [column], ["column_0"]
        else:
            columns = [data]
            names = ["column_0"]
        if not columns:
            raise ValueError("'data' must hold at least one column, but got an empty container.")
        arrays = []
        for i, col in enumerate(columns):
            if isinstance(col, torch.Tensor):
                col = col.detach().cpu().numpy()
            try:
                arr = np.asarray(col)
            except Exception as exc:
                raise TypeError(f"'data' column {i} cannot be read as an array: {exc}") from exc
            if arr.ndim == 0:
                raise ValueError(
                    f"'data' column {i} is a scalar; each column needs one row per sample."
                )
            if arr.dtype == object:
                raise TypeError(f"'data' column {i} has dtype object; pass numeric arrays.")
            arrays.append(arr)
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise ValueError(
                "'data' columns must have the same number of rows, but got "
                f"{[len(a) for a in arrays]}."
            )
        if column_names is not None:
            if isinstance(column_names, str):
                column_names = [column_names]
            if not all(isinstance(n, str) for n in column_names):
                raise TypeError(f"'column_names' must be a list of str, but got {column_names!r}.")
            if len(column_names) != len(arrays):
                raise ValueError(
                    f"'column_names' has {len(column_names)} names but 'data' has "
                    f"{len(arrays)} columns."
                )
            names = list(column_names)
        check_bool("shuffle", shuffle)
        if (num_shards is None) != (shard_id is None):
            raise ValueError("'num_shards' and 'shard_id' must be given together.")
        if num_shards is not None:
            check_int("num_shards", num_shards, minimum=1)
            check_int("shard_id", shard_id, minimum=0)
            assert shard_id is not None
            if shard_id >= num_shards:
                raise ValueError(
                    f"'shard_id' must be smaller than 'num_shards' ({num_shards}), but got "
                    f"{shard_id}."
                )
            arrays = [a[shard_id::num_shards] for a in arrays]
        # Sharded by the user already: Model leaves it as it is in a distributed run.
        self.user_sharded = num_shards is not None and num_shards > 1
        self._arrays = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        self.column_names = names
        self.shuffle = shuffle
        self._batch_size = 1
        self._drop_remainder = False
        self._rank_view: tuple[int, int, bool] | None = None  # (rank, world, pad)
        self.generator: torch.Generator | None = None

    @property
    def num_rows(self) -> int:
        """Rows per epoch (this rank's share in a distributed run's view)."""
        n = len(self._arrays[0])
        if self._rank_view is None:
            return n
        rank, world, pad = self._rank_view
        return -(-n // world) if pad else len(range(rank, n, world))

    def for_rank(self, rank: int, world: int, seed: int, pad: bool = True) -> NumpySlicesDataset:
        """A copy that yields only rank ``rank``'s share of the rows, for data-parallel runs.

        Every epoch the rows are (re)shuffled with a generator seeded with ``seed`` (the same on
        every rank, so the shares are disjoint), then rank ``r`` takes rows ``r, r + world, ...``:
        one global batch is the same rows a single process would see with ``world`` times the
        batch size. With ``pad`` (training), the order is padded with its first rows to a
        multiple of ``world`` so that every rank has the same number of batches, as
        ``DistributedSampler`` does. ``Model`` makes this copy itself under torch.distributed.
        """
        check_int("rank", rank, minimum=0)
        check_int("world", world, minimum=1)
        out = object.__new__(NumpySlicesDataset)
        out.__dict__.update(self.__dict__)
        out._rank_view = (rank, world, pad)
        out.generator = torch.Generator().manual_seed(seed) if self.shuffle else None
        return out

    def batch(self, batch_size: int, drop_remainder: bool = False) -> NumpySlicesDataset:
        """Return a copy of this dataset that yields batches of ``batch_size`` rows."""
        check_int("batch_size", batch_size, minimum=1)
        check_bool("drop_remainder", drop_remainder)
        out = object.__new__(NumpySlicesDataset)
        out.__dict__.update(self.__dict__)
        out._batch_size = batch_size
        out._drop_remainder = drop_remainder
        return out

    def get_batch_size(self) -> int:
        return self._batch_size

    def get_dataset_size(self) -> int:
        """Number of batches per epoch."""
        n, b = self.num_rows, self._batch_size
        return n // b if self._drop_remainder else -(-n // b)

    def get_col_names(self) -> list[str]:
        return list(self.column_names)

    def __len__(self) -> int:
        return self.get_dataset_size()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return self.create_tuple_iterator()

    def create_tuple_iterator(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yield one tuple of column tensors per batch."""
        n, b = self.num_rows, self._batch_size
        steps = self.get_dataset_size()
        if self._rank_view is not None:
            rows = self._rank_rows()
            for i in range(steps):
                idx = rows[i * b : (i + 1) * b]
                yield tuple(a[idx] for a in self._arrays)
        elif self.shuffle:
            order = torch.randperm(n)
            for i in range(steps):
                idx = order[i * b : (i + 1) * b]
                yield tuple(a[idx] for a in self._arrays)
        else:
            for i in range(steps):
                yield tuple(a[i * b : (i + 1) * b] for a in self._arrays)

    def _rank_rows(self) -> torch.Tensor:
        """This rank's rows for the epoch starting now (draws from ``generator``)."""
        assert self._rank_view is not None
        rank, world, pad = self._rank_view
        total = len(self._arrays[0])
        if self.generator is not None:
            order = torch.randperm(total, generator=self.generator)
        else:
            order = torch.arange(total)
        if pad and total % world:
            extra = world - total % world
            order = torch.cat([order, order.repeat(-(-extra // total))[:extra]])
        return order[rank::world]

    def create_dict_iterator(self) -> Iterator[dict[str, torch.Tensor]]:
        """Yield one ``{column_name: tensor}`` dict per batch."""
        for cols in self.create_tuple_iterator():
            yield dict(zip(self.column_names, cols))

    def __repr__(self) -> str:
        return (
            f"NumpySlicesDataset(rows={self.num_rows}, columns={self.column_names}, "
            f"batch_size={self._batch_size}, shuffle={self.shuffle})"
        )


def dataset_size(dataset: Any, argname: str) -> int:
    """Number of batches per epoch, with a clear error for what the loops cannot use."""
    if dataset is None:
        raise TypeError(f"'{argname}' must be a dataset, but got None.")
    if isinstance(dataset, NumpySlicesDataset):
        size = dataset.get_dataset_size()
    else:
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"'{argname}' must be a DataLoader, a NumpySlicesDataset or a sized sequence of "
                f"(data, label) batches, but got {type(dataset).__name__}."
            )
        if iter(dataset) is dataset:
            raise TypeError(
                f"'{argname}' is a one-shot iterator ({type(dataset).__name__}); the loops iterate "
                "the dataset once per epoch, so pass a re-iterable: a list of batches or a "
                "DataLoader."
            )
        try:
            size = len(dataset)
        except TypeError:
            raise TypeError(
                f"'{argname}' ({type(dataset).__name__}) has no length; the loops need the number "
                "of batches per epoch. Pass a DataLoader over a map-style dataset, a list of "
                "batches, or give your dataset a __len__."
            ) from None
    if size == 0:
        raise ValueError(
            f"There is no valid data in dataset, please check dataset file firstly. "
            f"('{argname}' has 0 batches.)"
        )
    return int(size)


def first_batch(dataset: Any) -> Any:
    """The first batch of an indexable dataset without iterating it; None if not cheap."""
    if isinstance(dataset, (list, tuple)):
        return dataset[0]
    return None


def set_epoch(dataset: Any, epoch: int) -> None:
    """Tell a DataLoader's distributed sampler which epoch starts, so shards reshuffle."""
    sampler = getattr(dataset, "sampler", None)
    if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)


def check_batch(batch: Any, argname: str, has_loss_fn: bool) -> None:
    """Raise a clear ValueError when a batch is not ``(data, label)`` but must be."""
    if not has_loss_fn and argname == "train_dataset":
        return
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = (
            f"{len(batch)} columns"
            if isinstance(batch, (tuple, list))
            else (f"a {type(batch).__name__}")
        )
        keys = f" with keys {', '.join(map(repr, batch))}" if isinstance(batch, dict) else ""
        raise ValueError(
            f"each batch of '{argname}' must be (data, label) when loss_fn is set, but got "
            f"{got}{keys}. Make the dataset yield (data, label) pairs, or use loss_fn=None with "
            "a network that computes its own loss."
        )


def check_first_batch(dataset: Any, argname: str, has_loss_fn: bool) -> None:
    """Check the first batch of an indexable dataset before any callback runs."""
    batch = first_batch(dataset)
    if batch is not None:
        check_batch(batch, argname, has_loss_fn)


def move(obj: Any, device: torch.device) -> Any:
    """Move tensors (in tuples, lists and dicts too) to ``device`` without blocking."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        moved = [move(x, device) for x in obj]
        return type(obj)(moved) if type(obj) in (tuple, list) else type(obj)(*moved)
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return torch.from_numpy(obj).to(device, non_blocking=True)
    return obj


def feed(network: Any, inputs: Any) -> Any:
    """Call ``network`` on a batch's data: a tuple/list is spread, a dict passed by name."""
    if isinstance(inputs, (tuple, list)):
        return network(*inputs)
    if isinstance(inputs, dict):
        return network(**inputs)
    return network(inputs)


def split_loss(result: Any) -> tuple[torch.Tensor, Any]:
    """(loss, outputs) from a network that computes its own loss."""
    if isinstance(result, torch.Tensor):
        if result.numel() != 1:
            raise ValueError(
                "with loss_fn=None the network must return the loss (one value), but it "
                f"returned a tensor of shape {tuple(result.shape)} (its outputs?): pass the "
                "Model a loss_fn (e.g. nn.CrossEntropyLoss()), or return the loss."
            )
        return result, None
    if isinstance(result, dict) and "loss" in result:
        return result["loss"], result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0], result[1:] if len(result) > 1 else None
    raise TypeError(
        "with loss_fn=None the network must return the loss (a tensor, a tuple starting with "
        f"it, or a dict with a 'loss' key), but it returned {type(result).__name__}."
    )


class ContinuingBatches:
    """Batches that continue across epochs, restarting the dataset when it runs out (sink
    mode with ``sink_size``)."""

    def __init__(self, dataset: Iterable[Any]) -> None:
        self._dataset = dataset
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._it is not None:
            try:
                return next(self._it)
            except StopIteration:
                pass
        self._it = iter(self._dataset)
        return next(self._it)
