"""``BatchSource``: the batches of a run in whatever form the user gave them, checked and re-iterable
once per epoch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from .data import _is_xy
from .data import as_batch_iterable
from .losses import prefetched_label_bounds
from .types import TrainingBatch, batch_rows

__all__ = ["BatchSource", "to_pair", "moved"]


def to_pair(batch: Any, index: int) -> tuple[Any, Any]:
    if isinstance(batch, TrainingBatch):
        return batch.input, batch.target
    if isinstance(batch, dict) and {"input", "target"} <= batch.keys():
        return batch["input"], batch["target"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"batch {index} must be a TrainingBatch, an (input, target) pair or a dict with 'input' and "
        f"'target', got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


class BatchSource:
    """The batches of a run, re-iterable once per epoch.

    Data forms: a list of ``(input, target)`` pairs / ``TrainingBatch``es (converted, moved to the
    device and validated once, up front); a ``DataLoader`` (converted batch by batch as it streams,
    its first batch checked before training starts); a ``Dataset`` or a tuple ``(X, Y)`` of tensors,
    batched by ``config.batch_size`` (default 32) and, with ``config.shuffle``, reordered every epoch
    from ``config.seed`` (``engine/data.py``). ``name`` names the data in error messages."""

    def __init__(
        self, batches: Any, convert: Callable[[Any, Any, int], tuple[Tensor, Tensor]], config: Any = None, *,
        name: str = "batches", shuffle: bool | None = None, dist: Any = None,
    ) -> None:
        self._convert = convert
        self._loader: Any = None
        self._items: list[tuple[Tensor, Tensor]] | None = None
        batch_size = getattr(config, "batch_size", None)
        shuffle = getattr(config, "shuffle", False) if shuffle is None else shuffle
        seed = getattr(config, "seed", None)
        # (X, Y) as tensors or NumPy arrays (anything with __array__ and a shape)
        is_xy = _is_xy(batches)
        is_dataset = isinstance(batches, torch.utils.data.Dataset) and not isinstance(batches, torch.utils.data.DataLoader)
        if is_xy or is_dataset:
            data = as_batch_iterable(batches, batch_size=batch_size, shuffle=shuffle, seed=seed, name=name)
            if dist is not None:  # data-parallel: this rank's equal share of every global batch
                data = dist.shard_batches(data, batch_size, name)
            if data.is_list:
                batches = data.materialise()
            else:
                self._stream(data, f"{name} is empty: it yields no batch")
                return
        elif batch_size is not None and name == "batches":
            raise ValueError(
                f"batch_size={batch_size} applies to a Dataset or an (X, Y) pair of tensors; these {name} are "
                "already batched (a list of batches or a DataLoader): leave batch_size at None"
            )
        if isinstance(batches, torch.utils.data.DataLoader):
            if dist is not None:  # data-parallel: a DistributedSampler unless the loader has the user's own
                batches = dist.distribute_loader(batches, seed)
            self._stream(batches, f"{name} is empty: the DataLoader yielded no batch")
            return
        if isinstance(batches, (str, bytes, Tensor, TrainingBatch)) or not isinstance(batches, Iterable):
            raise TypeError(
                f"{name} must be a list of TrainingBatch / (input, target) pairs, a DataLoader, a Dataset or an "
                f"(X, Y) pair of tensors, got {type(batches).__name__}"
            )
        items = list(batches)
        if not items:
            raise ValueError(f"{name} is empty: give at least one (input, target) batch")
        pairs = [to_pair(b, i) for i, b in enumerate(items)]
        with prefetched_label_bounds(y for _, y in pairs):  # every batch's label range in one read
            self._items = [convert(x, y, i) for i, (x, y) in enumerate(pairs)]

    def _stream(self, loader: Any, empty_message: str) -> None:
        """Batches converted as they stream from ``loader``; its first batch is checked now."""
        self._loader = loader
        first = next(iter(loader), None)
        if first is None:
            raise ValueError(empty_message)
        self._convert(*to_pair(first, 0), 0)

    def set_epoch(self, epoch: int) -> None:
        """Tell a shuffling source (or a ``DataLoader``'s ``DistributedSampler``) which epoch starts."""
        loader = self._loader
        if loader is None:
            return
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self._items is not None:
            return iter(self._items)
        return (self._convert(*to_pair(b, i), i) for i, b in enumerate(self._loader))

    def __len__(self) -> int:
        if self._items is not None:
            return len(self._items)
        return len(self._loader)

    @property
    def sized(self) -> bool:
        try:
            len(self)
        except TypeError:  # a DataLoader over an IterableDataset has no length
            return False
        return True

    @property
    def items(self) -> list[tuple[Tensor, Tensor]] | None:
        """The converted batches of a list source (None for a DataLoader)."""
        return self._items

    @property
    def batch_sizes(self) -> list[int] | None:
        """Rows of each batch of a list source (None for a DataLoader)."""
        if self._items is None:
            return None
        return [batch_rows(x) for x, _ in self._items]


def moved(t: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``t`` on ``device`` in ``dtype``, itself when it is already (no PyTorch call: each releases and
    takes back the interpreter lock, a wait while a helper thread holds it)."""
    if t.device == device and t.dtype == dtype:
        return t
    return t.to(device, dtype=dtype, non_blocking=True)
