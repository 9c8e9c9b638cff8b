"""``BatchSource``: the batches of a run in whatever form the user gave them, checked and re-iterable
once per epoch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from .data import _is_xy
from .data import _draw_seed, as_batch_iterable, epoch_seed
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
    from ``config.seed`` (``engine/data.py``). With ``config.shuffle`` a list of batches is yielded in
    a new order of its batches every epoch (``randperm`` seeded by ``epoch_seed(seed, epoch)``: the
    same orders on a resume); a ``DataLoader`` with ``shuffle=True`` is a ``ValueError`` (it keeps its
    own order). ``name`` names the data in error messages."""

    def __init__(
        self, batches: Any, convert: Callable[[Any, Any, int], tuple[Tensor, Tensor]], config: Any = None, *,
        name: str = "batches", shuffle: bool | None = None, dist: Any = None,
    ) -> None:
        self._convert = convert
        self._loader: Any = None
        self._items: list[tuple[Tensor, Tensor]] | None = None
        self._order_seed: int | None = None  # a shuffled list of batches: the base seed of its orders
        self._shuffled_data: Any = None  # shuffled (X, Y) or Dataset: the Batches whose seed orders the rows
        self._epoch = 0
        batch_size = getattr(config, "batch_size", None)
        shuffle = getattr(config, "shuffle", False) if shuffle is None else shuffle
        seed = getattr(config, "seed", None)
        # (X, Y) as tensors or NumPy arrays (anything with __array__ and a shape)
        is_xy = _is_xy(batches)
        is_dataset = isinstance(batches, torch.utils.data.Dataset) and not isinstance(batches, torch.utils.data.DataLoader)
        if is_xy or is_dataset:
            setting = getattr(config, "shard_data", None)
            if dist is None:
                shard = False
            elif is_xy:  # (X, Y): automatic when not set (the ranks' rows compared)
                shard = dist.shards(batches, setting, name)
            else:  # a Dataset: cut unless shard_data=False
                shard = setting is not False
            if dist is not None and not shard:  # each rank's own rows: batch_size / world_size of them a step
                batch_size = dist.local_batch_size(batch_size, name)
            data = as_batch_iterable(batches, batch_size=batch_size, shuffle=shuffle, seed=seed, name=name)
            self._shuffled_data = data if shuffle else None
            if shard:  # data-parallel: this rank's equal share of every global batch
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
            if shuffle:
                raise ValueError(
                    f"shuffle=True does not apply to a DataLoader: it keeps its own order; build it with "
                    f"DataLoader(..., shuffle=True) (or a sampler), or leave shuffle at False"
                )
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
        if shuffle:  # a list of batches: a new order of the batches every epoch (the batches stay as given)
            self._order_seed = int(seed) if seed is not None else _draw_seed()

    def _stream(self, loader: Any, empty_message: str) -> None:
        """Batches converted as they stream from ``loader``; its first batch is checked now."""
        self._loader = loader
        first = next(iter(loader), None)
        if first is None:
            raise ValueError(empty_message)
        self._convert(*to_pair(first, 0), 0)

    @property
    def shuffle_seed(self) -> int | None:
        """The base seed of a shuffled source's per-epoch orders (None when it does not shuffle): a
        checkpoint keeps it, so a resumed run draws the same orders as the run it continues."""
        if self._order_seed is not None:
            return self._order_seed
        return None if self._shuffled_data is None else self._shuffled_data.seed

    def set_shuffle_seed(self, seed: int) -> None:
        """Use ``seed`` as the base seed of the per-epoch orders (a resumed run: the checkpoint's)."""
        if self._order_seed is not None:
            self._order_seed = int(seed)
        elif self._shuffled_data is not None:
            self._shuffled_data.seed = int(seed)

    def order(self) -> list[int]:
        """The batches' order this epoch (a list source): ``randperm`` from ``epoch_seed(seed, epoch)``
        when shuffled, else as given."""
        n = len(self._items or ())
        if self._order_seed is None:
            return list(range(n))
        g = torch.Generator().manual_seed(epoch_seed(self._order_seed, self._epoch))
        return torch.randperm(n, generator=g).tolist()

    @property
    def shuffled(self) -> bool:
        """Whether a list source yields its batches in a new order every epoch."""
        return self._order_seed is not None

    def set_epoch(self, epoch: int) -> None:
        """Tell a shuffling source (or a ``DataLoader``'s ``DistributedSampler``) which epoch starts."""
        self._epoch = epoch
        loader = self._loader
        if loader is None:
            return
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self._items is not None:
            return iter([self._items[k] for k in self.order()] if self.shuffled else self._items)
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
        return [batch_rows(self._items[k][0]) for k in self.order()]


def moved(t: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``t`` on ``device`` in ``dtype``, itself when it is already (no PyTorch call: each releases and
    takes back the interpreter lock, a wait while a helper thread holds it)."""
    if t.device == device and t.dtype == dtype:
        return t
    return t.to(device, dtype=dtype, non_blocking=True)
