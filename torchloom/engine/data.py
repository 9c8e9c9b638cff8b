"""Training data in every form users hold it, as re-iterable epochs of ``(input, target)`` batches.

::

    batches = as_batch_iterable((X, Y), batch_size=64, shuffle=True, seed=0)
    for epoch in range(3):
        batches.set_epoch(epoch)          # permutation number ``epoch`` (optional: iter() advances by itself)
        for x, y in batches:              # x = X[idx], y = Y[idx], 64 rows each (the last may be shorter)
            ...

``as_batch_iterable(data, ...)`` accepts:

* **a list (or tuple, or other finite iterable) of batches**, each a ``TrainingBatch``, an
  ``(input, target)`` pair or a dict with ``'input'`` and ``'target'``: used as given, in order;
* **a tuple ``(X, Y)`` of two tensors** (or NumPy arrays) with the same first dimension ``n``:
  split into batches of ``batch_size`` rows (default 32), in order, or in a new seeded permutation
  every epoch with ``shuffle=True``;
* **a ``torch.utils.data.DataLoader``** yielding batches in any of the forms above: used as is
  (its own batch size, sampler and collate function);
* **a ``torch.utils.data.Dataset``** whose items are ``(x, y)`` pairs: batched by a ``DataLoader``
  of ``batch_size`` (default 32), shuffled with ``shuffle=True`` (seeded); an ``IterableDataset``
  is batched in its own order.

**The one ambiguity**: a *tuple of exactly two tensors* is ``(X, Y)`` data (whole tensors, split into
batches), while a *list* of ``(x, y)`` pairs is a list of batches. ``[X, Y]`` (a list of two
tensors) is rejected with a hint to pass the tuple ``(X, Y)``.

Shuffling never touches torch's global RNG: the order of epoch ``e`` is drawn from a
``torch.Generator`` seeded by a 64-bit mix of ``(seed, e)``, so it depends on the seed and the epoch
number only: reproducible run to run, and a run resumed at epoch ``e`` (``set_epoch(e)``) sees the
same orders as an uninterrupted one. Without a seed, a base seed is drawn once from torch's global
RNG when the ``Batches`` is made (so ``torch.manual_seed`` still makes runs reproducible) and kept
in ``Batches.seed``.

``predict_inputs(data, batch_size)`` is the inputs-only counterpart for prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .types import TrainingBatch

__all__ = ["Batches", "as_batch_iterable", "predict_inputs", "epoch_seed", "DEFAULT_BATCH_SIZE"]

DEFAULT_BATCH_SIZE = 32

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: consecutive epochs get well-separated seeds
_MASK64 = (1 << 64) - 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffling generator: ``(seed + 0x9E3779B97F4A7C15 * (epoch + 1)) mod 2**64``."""
    return (int(seed) + _GOLDEN * (int(epoch) + 1)) & _MASK64


# ----------------------------------------------------------------------------- argument checks
def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return name


def _check_batch_size(batch_size: Any, name: str) -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"{name}: batch_size must be a positive int or None, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"{name}: batch_size must be >= 1, got {batch_size}")
    return batch_size


def _check_flag(value: Any, arg: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: {arg} must be True or False, got {value!r}")
    return value


def _check_seed(seed: Any, name: str) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name}: seed must be an int or None, got {seed!r}")
    return seed


def _draw_seed() -> int:
    """A base seed from torch's global RNG (one draw), for shuffling without an explicit seed."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _is_array(a: Any) -> bool:
    """A tensor or a NumPy-style array (``__array__`` and ``shape``), without importing NumPy."""
    return isinstance(a, Tensor) or (hasattr(a, "__array__") and hasattr(a, "shape") and not isinstance(a, (list, tuple)))


def _as_tensor(a: Any, what: str) -> Tensor:
    if isinstance(a, Tensor):
        return a
    try:
        return torch.as_tensor(a)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a tensor (or convertible to one), got {type(a).__name__}: {e}") from None


def _pair(batch: Any, where: str) -> tuple[Any, Any]:
    """``(input, target)`` of one batch given as a TrainingBatch, a pair or a dict; ``TypeError`` otherwise."""
    if isinstance(batch, TrainingBatch):
        return batch.input, batch.target
    if isinstance(batch, Mapping):
        if "input" in batch and "target" in batch:
            return batch["input"], batch["target"]
        raise TypeError(f"{where} is a dict without 'input' and 'target' keys (keys: {sorted(map(str, batch))})")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    got = type(batch).__name__ + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    if isinstance(batch, Tensor):
        got += f" of shape {list(batch.shape)}"
    raise TypeError(
        f"{where} must be a TrainingBatch, an (input, target) pair or a dict with 'input' and 'target', got {got}"
    )


def as_inputs(x: Any, what: str) -> Tensor | tuple[Tensor, ...]:
    """An input batch as a tensor ``[batch, ...]``, or, for a model of several inputs, a tuple of
    tensors ``(x1, x2, ...)`` each ``[batch, ...]`` with one batch size (``model(*inputs)``)."""
    if not isinstance(x, tuple):
        x = _as_tensor(x, what)
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"{what} must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        return x
    if not x:
        raise ValueError(f"{what} is an empty tuple; a model of several inputs takes a tuple (x1, x2, ...) of tensors")
    xs = tuple(_as_tensor(t, f"{what} {i}") for i, t in enumerate(x))
    if any(t.dim() == 0 for t in xs) or len({t.shape[0] for t in xs}) != 1 or xs[0].shape[0] == 0:
        raise ValueError(
            f"{what}s must each be [batch, ...] with one batch size >= 1, got shapes {[list(t.shape) for t in xs]}"
        )
    return xs


def _checked_pair(batch: Any, where: str) -> tuple[Tensor | tuple[Tensor, ...], Tensor]:
    """One batch as ``(input, target)``, tensors ``[batch, ...]`` with the same batch size (the input
    a tuple of such tensors for a model of several inputs)."""
    x, y = _pair(batch, where)
    x, y = as_inputs(x, f"{where}: input"), _as_tensor(y, f"{where}: target")
    rows = (x[0] if isinstance(x, tuple) else x).shape[0]
    if y.dim() == 0 or y.shape[0] != rows:
        raise ValueError(
            f"{where}: target must have the input's batch size {rows} as its first dimension, "
            f"got shape {list(y.shape)}"
        )
    return x, y


def _sized_len(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:  # e.g. a DataLoader over an IterableDataset without __len__
        return None


# ------------------------------------------------------------------------------------ Batches
class Batches:
    """Re-iterable training data: each ``iter()`` is one epoch of ``(input, target)`` tensor pairs.

    Made by ``as_batch_iterable``. Inputs are ``[batch, ...]`` and targets share their first
    dimension; tensors are yielded where the data lives (no device move, no dtype change).

    * ``iter(batches)`` runs epoch number ``batches.epoch`` and then advances ``epoch`` by one, so
      plain repeated iteration gives a new order each time for shuffled data; ``set_epoch(e)`` before
      an epoch makes it epoch ``e`` whatever iterated before (a peek, a resumed run).
    * ``len(batches)``: batches per epoch; ``TypeError`` when unknown (``sized`` is then False).
    * ``is_list``: True when every epoch yields the same fixed list of batches (a list of batches,
      or ``(X, Y)`` without shuffling); ``materialise()`` returns that list.
    * ``set_epoch(epoch)``: chooses the shuffling order; a ``DataLoader``'s sampler that has
      ``set_epoch`` (a ``DistributedSampler``) gets the epoch number at ``set_epoch`` and at the
      start of every epoch's iteration.
    * ``first()``: the first batch of the current epoch, without advancing the epoch.
    * ``state_dict()`` / ``load_state_dict(d)``: ``{"epoch", "seed"}`` for an exact resume.
    """

    is_list: bool = False
    seed: int | None = None  # the base seed of a shuffled source (drawn once when none was given)

    def __init__(self, name: str) -> None:
        self.name = name
        self._epoch = 0

    # -- to implement
    def _epoch_iter(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def _length(self) -> int | None:
        raise NotImplementedError

    # -- public
    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch = self._epoch
        self._epoch += 1
        return self._epoch_iter(epoch)

    def __len__(self) -> int:
        n = self._length()
        if n is None:
            raise TypeError(f"{self.name}: the number of batches per epoch is not known (an unsized DataLoader or IterableDataset)")
        return n

    @property
    def sized(self) -> bool:
        """Whether ``len()`` is known."""
        return self._length() is not None

    @property
    def epoch(self) -> int:
        """The epoch number the next ``iter()`` runs (0 at first)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` epoch number ``epoch`` (>= 0): its shuffling order, and the
        ``set_epoch`` of a ``DataLoader``'s sampler (``DistributedSampler``) when it has one."""
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise TypeError(f"{self.name}: epoch must be an int, got {epoch!r}")
        if epoch < 0:
            raise ValueError(f"{self.name}: epoch must be >= 0, got {epoch}")
        self._epoch = epoch

    def first(self) -> tuple[Tensor, Tensor]:
        """The first batch of the current epoch (``self.epoch``), without advancing the epoch. For a
        ``DataLoader`` this starts (and drops) one iteration of it."""
        it = self._epoch_iter(self._epoch)
        batch = next(it, None)
        if batch is None:
            raise ValueError(f"{self.name} is empty: it yielded no batch")
        return batch

    def materialise(self) -> list[tuple[Tensor, Tensor]]:
        """The fixed list of batches of every epoch (only when ``is_list``; ``TypeError`` otherwise)."""
        raise TypeError(
            f"{self.name}: materialise() needs a fixed list of batches (a list of batches, or (X, Y) without "
            f"shuffle); this is {self.describe()}, whose batches change from epoch to epoch"
        )

    def state_dict(self) -> dict[str, int | None]:
        """``{"epoch": next epoch number, "seed": base seed or None}``: what an exact resume needs."""
        return {"epoch": self._epoch, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``: the next epoch number and the shuffling base seed."""
        self.set_epoch(state["epoch"])
        if state.get("seed") is not None:
            self.seed = int(state["seed"])

    def describe(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        n = self._length()
        return f"Batches({self.describe()}, batches={'?' if n is None else n}, epoch={self._epoch})"


class _ListBatches(Batches):
    """A fixed list of ``(input, target)`` batches, yielded in order every epoch."""

    is_list = True

    def __init__(self, items: list[tuple[Tensor, Tensor]], name: str) -> None:
        super().__init__(name)
        self._items = items

    def _epoch_iter(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        return iter(self._items)

    def _length(self) -> int:
        return len(self._items)

    def materialise(self) -> list[tuple[Tensor, Tensor]]:
        return list(self._items)

    def describe(self) -> str:
        return "a list of batches"


class _TensorBatches(Batches):
    """``(X, Y)`` cut into row batches, in order or in a seeded permutation per epoch."""

    def __init__(self, X: Tensor, Y: Tensor, batch_size: int, shuffle: bool, seed: int | None, drop_last: bool, name: str) -> None:
        super().__init__(name)
        self.X, self.Y = X, Y
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.is_list = not shuffle
        self.seed = (seed if seed is not None else _draw_seed()) if shuffle else seed
        n = _rows(X)
        self._n = n // batch_size if drop_last else math.ceil(n / batch_size)

    def _length(self) -> int:
        return self._n

    def order(self, epoch: int) -> Tensor:
        """The row order of epoch ``epoch`` (int64 ``[n]`` on the CPU): ``arange(n)`` without shuffling,
        else ``randperm(n)`` from a ``torch.Generator`` seeded with ``epoch_seed(seed, epoch)``."""
        n = _rows(self.X)
        if not self.shuffle:
            return torch.arange(n)
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(n, generator=g)

    def _epoch_iter(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        bs = self.batch_size
        if not self.shuffle:
            for i in range(self._n):
                yield _take(self.X, slice(i * bs, (i + 1) * bs)), self.Y[i * bs : (i + 1) * bs]
            return
        order = self.order(epoch)
        x_device = (self.X[0] if isinstance(self.X, tuple) else self.X).device
        ox = order.to(x_device)
        oy = ox if self.Y.device == x_device else order.to(self.Y.device)
        for i in range(self._n):
            yield _take(self.X, ox[i * bs : (i + 1) * bs]), self.Y[oy[i * bs : (i + 1) * bs]]

    def materialise(self) -> list[tuple[Tensor, Tensor]]:
        if self.shuffle:
            return super().materialise()
        return list(self._epoch_iter(0))

    def describe(self) -> str:
        return f"(X, Y) tensors of {_rows(self.X)} rows, batch_size={self.batch_size}" + (", shuffled" if self.shuffle else "")


class _LoaderBatches(Batches):
    """A ``DataLoader`` (the user's, or one made for a ``Dataset``), its batches converted to pairs.

    ``generator``: the loader's shuffling generator, reseeded with ``epoch_seed(seed, epoch)`` at the
    start of each epoch (a ``Dataset`` with ``shuffle=True``)."""

    def __init__(self, loader: DataLoader, name: str, *, kind: str, generator: torch.Generator | None = None, seed: int | None = None) -> None:
        super().__init__(name)
        self.loader = loader
        self._kind = kind
        self._generator = generator
        self.seed = seed

    def _length(self) -> int | None:
        return _sized_len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._forward_epoch(epoch)

    def _forward_epoch(self, epoch: int) -> None:
        for sampler in (getattr(self.loader, "sampler", None), getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if sampler is not None and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)
                return

    def _epoch_iter(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        if self._generator is not None:
            self._generator.manual_seed(epoch_seed(self.seed, epoch))
        self._forward_epoch(epoch)
        for i, batch in enumerate(self.loader):
            yield _checked_pair(batch, f"{self.name}: batch {i}")

    def describe(self) -> str:
        return self._kind


# ------------------------------------------------------------------------------ construction
_FORMS = (
    "a list of (input, target) pairs / TrainingBatch / {'input', 'target'} dicts, a tuple (X, Y) of two "
    "tensors with the same first dimension, a torch.utils.data.DataLoader, or a torch.utils.data.Dataset "
    "of (x, y) items"
)


def as_batch_iterable(
    data: Any,
    *,
    batch_size: int | None = None,
    shuffle: bool = False,
    seed: int | None = None,
    drop_last: bool = False,
    name: str = "data",
) -> Batches:
    """``data`` in any form users hold it, as a re-iterable ``Batches`` (one ``iter()`` = one epoch).

    Args:
        data: one of
            * a list / tuple (or other finite iterable, read once) of batches, each a
              ``TrainingBatch``, an ``(input, target)`` pair or a dict with ``'input'`` and
              ``'target'``; inputs ``[batch, ...]``, targets with the same first dimension. Used in
              order; ``batch_size``, ``shuffle`` and ``drop_last`` do not apply (errors if given).
            * a tuple ``(X, Y)`` of two tensors (or NumPy arrays) ``X [n, ...]``, ``Y [n, ...]``
              (``X`` may be a tuple ``(X1, X2, ...)`` of such tensors for a model of several
              inputs, each batch's input then the tuple of their rows): batches of ``batch_size`` rows (default 32; the last one shorter unless ``drop_last``).
              With ``shuffle=True`` each epoch uses a new permutation of the rows (see ``seed``).
              A tuple of exactly two tensors is always read this way, never as two batches.
            * a ``torch.utils.data.DataLoader``: used as is; ``batch_size``, ``shuffle`` and
              ``drop_last`` must be left at their defaults (the loader has its own).
            * a map-style ``torch.utils.data.Dataset`` whose items are ``(x, y)`` pairs: batched by
              a ``DataLoader(dataset, batch_size or 32, shuffle=shuffle, drop_last=drop_last)``
              whose shuffling generator is seeded per epoch. An ``IterableDataset`` is batched in
              its own order (``shuffle=True`` is an error).
            * a ``Batches`` (from an earlier call): returned as is.
        batch_size: rows per batch for ``(X, Y)`` and ``Dataset`` data (default 32); >= 1.
        shuffle: a new row order every epoch, for ``(X, Y)`` and map-style ``Dataset`` data.
        seed: seeds the shuffling (epoch ``e`` uses ``torch.Generator().manual_seed(epoch_seed(seed,
            e))``; torch's global RNG is never used). ``None``: one base seed is drawn from torch's
            global RNG now (kept in ``Batches.seed``).
        drop_last: drop a last batch shorter than ``batch_size`` (``(X, Y)`` and ``Dataset`` data).
        name: the argument's name in error messages (``"batches"``, ``"validation_data"``, ...).

    Returns:
        a ``Batches``: ``iter()`` yields ``(input, target)`` tensor pairs; ``len``, ``is_list``,
        ``materialise()``, ``set_epoch(e)``, ``first()``, ``state_dict()``.

    Raises:
        TypeError / ValueError naming ``name``, the bad value and what is allowed, before any batch is
        consumed (for a list: every batch is checked; for a ``DataLoader`` or ``IterableDataset``:
        batches are checked as they stream): unsupported types, empty data, ``(X, Y)`` of different
        lengths, ``batch_size`` < 1 or given where it does not apply, a non-bool ``shuffle`` or
        ``drop_last``, a ``Dataset`` whose items are not pairs.
    """
    name = _check_name(name)
    batch_size = _check_batch_size(batch_size, name)
    shuffle = _check_flag(shuffle, "shuffle", name)
    drop_last = _check_flag(drop_last, "drop_last", name)
    seed = _check_seed(seed, name)

    if isinstance(data, Batches):
        _no_batching_args(name, "a Batches", batch_size, shuffle, drop_last, "it is already batched")
        return data

    if isinstance(data, DataLoader):
        _no_batching_args(name, "a DataLoader", batch_size, shuffle, drop_last, "set them on the DataLoader itself")
        if _sized_len(data) == 0:
            raise ValueError(f"{name} is empty: the DataLoader has no batches (len(loader) == 0)")
        return _LoaderBatches(data, name, kind="a DataLoader")

    if isinstance(data, Dataset):
        return _from_dataset(data, batch_size, shuffle, seed, drop_last, name)

    if _is_xy(data):
        return _from_tensors(data[0], data[1], batch_size, shuffle, seed, drop_last, name)

    if isinstance(data, (str, bytes, Tensor, TrainingBatch, Mapping)) or _is_array(data) or not isinstance(data, Iterable):
        hint = ""
        if isinstance(data, (Tensor, TrainingBatch, Mapping)) or _is_array(data):
            hint = " (a single batch? wrap it in a list: [(x, y)]; whole tensors: the tuple (X, Y))"
        raise TypeError(f"{name} must be {_FORMS}; got {type(data).__name__}{hint}")

    items = list(data)
    if not items:
        raise ValueError(f"{name} is empty: give at least one (input, target) batch")
    if len(items) == 2 and isinstance(data, list) and all(_is_array(a) for a in items):
        raise TypeError(
            f"{name} is a list of two tensors/arrays of shapes {list(items[0].shape)} and {list(items[1].shape)}: "
            f"a list holds (input, target) batches; for whole tensors X and Y pass the tuple (X, Y)"
        )
    _no_batching_args(name, "a list of batches", batch_size, shuffle, drop_last, "the batches are used as given")
    return _ListBatches([_checked_pair(b, f"{name}: batch {i}") for i, b in enumerate(items)], name)


def _no_batching_args(name: str, what: str, batch_size: int | None, shuffle: bool, drop_last: bool, why: str) -> None:
    for arg, value, default in (("batch_size", batch_size, None), ("shuffle", shuffle, False), ("drop_last", drop_last, False)):
        if value != default:
            raise ValueError(
                f"{name}: {arg}={value!r} does not apply to {what} ({why}); batch_size, shuffle and drop_last "
                f"apply to (X, Y) tensors and Datasets"
            )


def _rows(X: Tensor | tuple[Tensor, ...]) -> int:
    return (X[0] if isinstance(X, tuple) else X).shape[0]


def _take(X: Tensor | tuple[Tensor, ...], rows: Any) -> Tensor | tuple[Tensor, ...]:
    """Rows of ``X``, or of each input of a tuple ``(X1, X2, ...)`` (a model of several inputs)."""
    return tuple(x[rows] for x in X) if isinstance(X, tuple) else X[rows]


def _is_xy(data: Any) -> bool:
    """A tuple ``(X, Y)`` of two tensors or arrays, ``X`` possibly a tuple ``(X1, X2, ...)`` of them
    (the inputs of a model that takes several)."""
    if not (isinstance(data, tuple) and len(data) == 2 and _is_array(data[1])):
        return False
    X = data[0]
    return _is_array(X) or (isinstance(X, tuple) and len(X) > 0 and all(_is_array(x) for x in X))


def _from_tensors(X: Any, Y: Any, batch_size: int | None, shuffle: bool, seed: int | None, drop_last: bool, name: str) -> Batches:
    if isinstance(X, tuple):  # (X1, X2, ...): the inputs of a model of several, sliced alike
        X = tuple(_as_tensor(x, f"{name}: X[{i}]") for i, x in enumerate(X))
        shapes = [list(x.shape) for x in X]
        if any(x.dim() == 0 for x in X) or len({x.shape[0] for x in X}) != 1:
            raise ValueError(f"{name}: the inputs (X1, X2, ...) must be tensors [n, ...] with the same number of rows, got shapes {shapes}")
        first = X[0]
    else:
        X = first = _as_tensor(X, f"{name}: X")
    Y = _as_tensor(Y, f"{name}: Y")
    if first.dim() == 0 or Y.dim() == 0:
        raise ValueError(
            f"{name}: (X, Y) must be tensors [n, ...] with a first (sample) dimension, got shapes "
            f"{list(first.shape)} and {list(Y.shape)}"
        )
    if first.shape[0] != Y.shape[0]:
        raise ValueError(
            f"{name}: X and Y must have the same number of rows (first dimension), got X {list(first.shape)} "
            f"and Y {list(Y.shape)}"
        )
    if first.shape[0] == 0:
        raise ValueError(f"{name} is empty: (X, Y) have 0 rows")
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if drop_last and first.shape[0] < batch_size:
        raise ValueError(
            f"{name}: drop_last=True with batch_size={batch_size} leaves no batch of the {first.shape[0]} rows"
        )
    return _TensorBatches(X, Y, batch_size, shuffle, seed, drop_last, name)


def _from_dataset(dataset: Dataset, batch_size: int | None, shuffle: bool, seed: int | None, drop_last: bool, name: str) -> Batches:
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise ValueError(
                f"{name}: shuffle=True does not apply to an IterableDataset (it yields items in its own "
                f"order); shuffle inside the dataset, or use a map-style Dataset or (X, Y) tensors"
            )
        loader = DataLoader(dataset, batch_size=batch_size, drop_last=drop_last)
        return _LoaderBatches(loader, name, kind=f"an IterableDataset ({type(dataset).__name__}) in batches of {batch_size}")
    n = _sized_len(dataset)
    if n is None:
        raise TypeError(f"{name}: a map-style Dataset needs __len__ (got {type(dataset).__name__} without it)")
    if n == 0:
        raise ValueError(f"{name} is empty: the Dataset has 0 items")
    if drop_last and n < batch_size:
        raise ValueError(f"{name}: drop_last=True with batch_size={batch_size} leaves no batch of the {n} items")
    item = dataset[0]
    if isinstance(item, TrainingBatch) or (isinstance(item, Mapping) and {"input", "target"} <= item.keys()):
        pass
    elif not (isinstance(item, (tuple, list)) and len(item) == 2):
        got = type(item).__name__ + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
        raise TypeError(
            f"{name}: the Dataset's items must be (x, y) pairs (or dicts with 'input' and 'target'), "
            f"got item 0 = {got}"
        )
    generator = torch.Generator() if shuffle else None
    seed = (seed if seed is not None else _draw_seed()) if shuffle else seed
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, generator=generator)
    kind = f"a Dataset ({type(dataset).__name__}) in batches of {batch_size}" + (", shuffled" if shuffle else "")
    return _LoaderBatches(loader, name, kind=kind, generator=generator, seed=seed)


# ------------------------------------------------------------------------------------ predict
def predict_inputs(data: Any, batch_size: int | None = None, *, name: str = "data") -> Iterator[Tensor]:
    """The input batches of ``data``, for prediction (targets, where present, are ignored).

    ``data``: a tensor (or NumPy array) ``X [n, ...]`` cut into batches of ``batch_size`` rows
    (default 32), in order; a tuple ``(X, Y)`` (``X`` used the same way); a list of batches (pairs,
    ``TrainingBatch``es or dicts: their inputs; a bare tensor element is an input batch); a
    ``DataLoader`` (the first element of each batch, or the batch itself when it is a tensor); a
    ``Dataset`` (batched by a ``DataLoader`` of ``batch_size``; the first element of each item, or
    the item itself when it is a tensor). Never shuffled. ``batch_size`` must be None for a list or a
    ``DataLoader``. Checked up front (``TypeError``/``ValueError`` naming ``name``) where possible;
    returns an iterator of input tensors ``[batch, ...]``.
    """
    name = _check_name(name)
    batch_size = _check_batch_size(batch_size, name)

    if _is_array(data) or (isinstance(data, tuple) and len(data) == 2 and all(_is_array(a) for a in data)):
        if isinstance(data, tuple):
            X, Y = _as_tensor(data[0], f"{name}: X"), _as_tensor(data[1], f"{name}: Y")
            if X.dim() >= 1 and Y.dim() >= 1 and X.shape[0] != Y.shape[0]:
                raise ValueError(
                    f"{name}: X and Y must have the same number of rows, got X {list(X.shape)} and Y {list(Y.shape)}"
                )
        else:
            X = _as_tensor(data, f"{name}")
        if X.dim() == 0 or X.shape[0] == 0:
            raise ValueError(f"{name}: inputs must be [n, ...] with n >= 1, got shape {list(X.shape)}")
        bs = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        return (X[i : i + bs] for i in range(0, X.shape[0], bs))

    if isinstance(data, DataLoader):
        if batch_size is not None:
            raise ValueError(f"{name}: batch_size={batch_size} does not apply to a DataLoader (it has its own batch size)")
        if _sized_len(data) == 0:
            raise ValueError(f"{name} is empty: the DataLoader has no batches (len(loader) == 0)")
        return _loader_inputs(data, name)

    if isinstance(data, Dataset):
        n = None if isinstance(data, IterableDataset) else _sized_len(data)
        if n == 0:
            raise ValueError(f"{name} is empty: the Dataset has 0 items")
        loader = DataLoader(data, batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size)
        return _loader_inputs(loader, name)

    if isinstance(data, (str, bytes, TrainingBatch, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(
            f"{name} must be a tensor X, a tuple (X, Y), a list of batches, a DataLoader or a Dataset; "
            f"got {type(data).__name__}"
        )
    items = list(data)
    if not items:
        raise ValueError(f"{name} is empty: give at least one batch")
    if batch_size is not None:
        raise ValueError(f"{name}: batch_size={batch_size} does not apply to a list of batches (they are used as given)")
    inputs = []
    for i, b in enumerate(items):
        where = f"{name}: batch {i}"
        x = b if _is_array(b) else _pair(b, where)[0]
        x = _as_tensor(x, f"{where}: input")
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"{where}: input must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        inputs.append(x)
    return iter(inputs)


def _loader_inputs(loader: DataLoader, name: str) -> Iterator[Tensor]:
    for i, batch in enumerate(loader):
        where = f"{name}: batch {i}"
        if isinstance(batch, Tensor):
            x = batch
        elif isinstance(batch, TrainingBatch):
            x = batch.input
        elif isinstance(batch, Mapping) and "input" in batch:
            x = batch["input"]
        elif isinstance(batch, (tuple, list)) and len(batch) >= 1:
            x = batch[0]
        else:
            raise TypeError(f"{where} must be a tensor, a (input, ...) tuple or a dict with 'input', got {type(batch).__name__}")
        x = _as_tensor(x, f"{where}: input")
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"{where}: input must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        yield x
