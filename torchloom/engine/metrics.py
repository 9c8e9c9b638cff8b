"""Metrics accumulated over batches on the device, read once: ``MetricSet``.

::

    metrics = MetricSet(["accuracy", "mae", my_metric, torchmetrics_object])
    metrics.reset()
    for x, y in batches:
        metrics.update(model(x), y)     # no host sync: sums stay in device tensors
    metrics.compute()                   # {"accuracy": 0.93, "mae": 0.12, ...}: one host read

Named metrics (``METRIC_NAMES``), for an output ``o [..., C]`` and a target ``y``:

| name                | value                                                                              |
|---------------------|------------------------------------------------------------------------------------|
| ``"accuracy"``      | fraction of rows (all dimensions but the last) where ``argmax(o)`` equals the class: ``y`` integer labels ``[...]`` (or ``[..., 1]``), or ``argmax(y)`` for one-hot / soft targets ``[..., C]``. One output column (``C == 1``, or ``o [B]``): ``o > 0.5`` against ``y > 0.5`` |
| ``"binary_accuracy"`` | fraction of elements where ``(o > 0.5) == (y > 0.5)`` (``o`` probabilities, ``y`` 0/1 of ``o``'s shape) |
| ``"mse"``           | mean of ``(o − y)²`` over every element of every batch                             |
| ``"mae"``           | mean of ``abs(o − y)`` over every element of every batch                           |
| ``"rmse"``          | ``sqrt`` of the ``"mse"`` above (of the whole data, not a mean of per-batch values) |

For ``mse``/``mae``/``rmse``/``binary_accuracy`` the target has the output's shape (an output
``[B, 1]`` and a target ``[B]``, or the reverse, also match).

Besides names, a metric can be:

* any callable ``metric(output, target)`` returning a number or a one-element tensor: its value
  per batch is averaged weighted by the batch size (``output.shape[0]``); named by its
  ``__name__`` (or its class name for a callable object);
* an object with ``update(output, target)``, ``compute()`` and ``reset()`` (the protocol of
  torchmetrics' ``Metric``): driven through those three methods, named by its class name;
* a mapping ``{name: metric}`` to choose the names (``{"acc": "accuracy", "f1": F1Score(...)}``).

Names must be distinct, must not be ``"loss"`` and must not start with ``"val_"`` (those keys are
the loss and validation entries of a training history).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._settings import closest

__all__ = ["METRIC_NAMES", "MetricSet"]

METRIC_NAMES = ("accuracy", "binary_accuracy", "mse", "mae", "rmse")

# ------------------------------------------------------------------------------ shape matching
def _same_shape(output: Tensor, target: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """``output`` and ``target`` with equal shapes (``[B]`` against ``[B, 1]`` is squeezed)."""
    if target.shape == output.shape:
        return output, target
    if output.dim() == target.dim() + 1 and output.shape[-1] == 1 and output.shape[:-1] == target.shape:
        return output[..., 0], target
    if target.dim() == output.dim() + 1 and target.shape[-1] == 1 and target.shape[:-1] == output.shape:
        return output, target[..., 0]
    hint = ""
    if not target.is_floating_point() and output.dim() >= 1 and target.shape == output.shape[:-1]:
        hint = " (integer class labels: use 'accuracy', or one-hot targets)"
    raise ValueError(
        f"metric {name!r}: target shape {list(target.shape)} does not match output shape {list(output.shape)}{hint}"
    )


def _class_pairs(output: Tensor, target: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """Predicted and true classes (same shape) for ``"accuracy"``."""
    o = output.unsqueeze(-1) if output.dim() == 1 else output
    if o.dim() == 0:
        raise ValueError(f"metric {name!r}: output must be [batch, ...], got a 0-d tensor")
    if o.shape[-1] == 1:  # one column: a probability, thresholded at 0.5
        if target.shape == o.shape:
            t = target[..., 0]
        elif target.shape == o.shape[:-1]:
            t = target
        else:
            raise ValueError(
                f"metric {name!r}: for a one-column output {list(output.shape)} the target must be 0/1 of shape "
                f"{list(o.shape)} or {list(o.shape[:-1])}, got {list(target.shape)}"
            )
        return o[..., 0] > 0.5, t > 0.5
    if target.shape == o.shape:  # one-hot / soft targets
        truth = target.argmax(-1)
    elif target.shape == o.shape[:-1]:  # class labels
        truth = target
    elif target.shape == (*o.shape[:-1], 1):
        truth = target[..., 0]
    else:
        raise ValueError(
            f"metric {name!r}: target must be class labels of shape {list(o.shape[:-1])} or one-hot/soft targets "
            f"of shape {list(o.shape)} for an output of shape {list(output.shape)}, got {list(target.shape)}"
        )
    if truth.is_floating_point():  # labels held as floats (e.g. from NumPy)
        truth = truth.round().long()
    return o.argmax(-1), truth


# ----------------------------------------------------------------------------------- metrics
class _Metric:
    """One metric's accumulators: a float64 ``total`` (device tensor, or a host float for callables
    that return numbers) and a host ``count``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reset()

    def reset(self) -> None:
        self.total: Tensor | float = 0.0
        self.count = 0

    def _add(self, value: Tensor | float, count: int) -> None:
        if isinstance(value, Tensor):
            value = value.detach().to(torch.float64)
            if isinstance(self.total, Tensor):
                self.total = self.total + value.to(self.total.device)
            else:
                self.total = value + self.total
        else:
            self.total = self.total + float(value)
        self.count += count

    def update(self, output: Tensor, target: Tensor) -> None:
        raise NotImplementedError

    def value(self) -> Tensor | float:
        """The metric's value (0-d float64 tensor, or a float)."""
        return self.total / self.count


class _Named(_Metric):
    """A metric of ``METRIC_NAMES`` (``kind``), whatever name it is shown under."""

    def __init__(self, name: str, kind: str) -> None:
        super().__init__(name)
        self.kind = kind

    def update(self, output: Tensor, target: Tensor) -> None:
        name, kind = self.name, self.kind
        if kind == "accuracy":
            pred, truth = _class_pairs(output, target, name)
            self._add((pred == truth.to(pred.device)).sum(), pred.numel())
            return
        o, t = _same_shape(output, target, name)
        t = t.to(o.device)
        if kind == "binary_accuracy":
            self._add(((o > 0.5) == (t > 0.5)).sum(), o.numel())
        elif kind in ("mse", "rmse"):
            self._add((o.double() - t.double()).square().sum(), o.numel())
        else:  # mae
            self._add((o.double() - t.double()).abs().sum(), o.numel())

    def value(self) -> Tensor | float:
        mean = self.total / self.count
        return mean.sqrt() if self.kind == "rmse" else mean


class _Callable(_Metric):
    def __init__(self, name: str, fn: Callable[[Tensor, Tensor], Any]) -> None:
        super().__init__(name)
        self.fn = fn

    def update(self, output: Tensor, target: Tensor) -> None:
        value = _scalar(self.fn(output, target), self.name, "returned")
        n = output.shape[0] if output.dim() >= 1 else 1
        self._add(value * n, n)  # weighted by the batch size


class _Protocol(_Metric):
    """An object with ``update``/``compute``/``reset`` (torchmetrics' ``Metric`` protocol)."""

    def __init__(self, name: str, obj: Any) -> None:
        self.obj = obj
        super().__init__(name)

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "obj"):
            self.obj.reset()

    def update(self, output: Tensor, target: Tensor) -> None:
        self.obj.update(output, target)
        self.count += 1

    def value(self) -> Tensor | float:
        return _scalar(self.obj.compute(), self.name, "compute() returned")


def _scalar(value: Any, name: str, what: str) -> Tensor | float:
    """A metric value as a 0-d tensor or a float; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} {what} a tensor of shape {list(value.shape)}; a metric must give one number "
                f"(a float or a one-element tensor)"
            )
        return value.detach().reshape(())
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise TypeError(f"metric {name!r} {what} {type(value).__name__}; a metric must give a number or a one-element tensor")
    return float(value)


# --------------------------------------------------------------------------------- MetricSet
class MetricSet:
    """Metrics accumulated over batches: ``reset()``, ``update(output, target)`` per batch,
    ``compute() -> {name: float}``.

    Args:
        metrics: a sequence of metrics, each a name from ``METRIC_NAMES``, a callable
            ``metric(output, target) -> number | one-element tensor`` (averaged over batches weighted
            by batch size, named by its ``__name__`` or class name), or an object with
            ``update``/``compute``/``reset`` (torchmetrics' protocol; named by its class name); or a
            mapping ``{name: metric}``. A single name or metric is taken as a one-element sequence.

    ``update`` adds to float64 sums kept in tensors on the output's device (no host sync: shapes
    are checked on the host, values are not read; run under ``torch.no_grad``, ``output`` detached).
    ``compute`` divides on the device and reads every value in one transfer per device; protocol
    objects give their own ``compute()``. Accuracy-like metrics count rows or elements, so the
    value over several batches equals the value over their concatenation; a callable's per-batch
    values are weighted by ``output.shape[0]``.

    Raises (at construction): ``ValueError`` for an unknown name (listing ``METRIC_NAMES``), a
    duplicate name, the names ``"loss"`` or ``"val_..."``, or a lambda (give it a name with a
    mapping); ``TypeError`` for anything that is neither a name, a callable nor a protocol object,
    or a class instead of an instance.
    """

    def __init__(self, metrics: Iterable[str | Callable[[Tensor, Tensor], Any] | Any] | Mapping[str, Any] | str | Callable[[Tensor, Tensor], Any] = ()) -> None:
        entries: list[tuple[str | None, Any]]
        if isinstance(metrics, MetricSet):
            entries = [(m.name, m) for m in metrics._metrics]
        elif isinstance(metrics, Mapping):
            entries = list(metrics.items())
        elif isinstance(metrics, str) or _is_protocol(metrics) or (callable(metrics) and not isinstance(metrics, type)):
            entries = [(None, metrics)]
        elif isinstance(metrics, Iterable) and not isinstance(metrics, (bytes, Tensor)):
            entries = [(None, m) for m in metrics]
        else:
            raise TypeError(
                f"metrics must be a sequence of metric names / callables / metric objects, or a mapping "
                f"{{name: metric}}; got {type(metrics).__name__}"
            )
        built: list[_Metric] = []
        for key, m in entries:
            metric = m if isinstance(m, _Metric) else _build(key, m)
            if metric.name in (x.name for x in built):
                raise ValueError(
                    f"metrics: duplicate metric name {metric.name!r}; names must be distinct "
                    f"(give names with a mapping, e.g. {{'acc_a': a, 'acc_b': b}})"
                )
            built.append(metric)
        self._metrics = built

    @property
    def names(self) -> tuple[str, ...]:
        """The metrics' names, in order (the keys of ``compute()``)."""
        return tuple(m.name for m in self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __repr__(self) -> str:
        return f"MetricSet({list(self.names)})"

    def reset(self) -> None:
        """Forget every accumulated batch (and ``reset()`` protocol objects)."""
        for m in self._metrics:
            m.reset()

    @torch.no_grad()
    def update(self, output: Tensor, target: Tensor) -> None:
        """Add one batch: ``output [batch, ...]`` from the model, ``target`` as the metrics need
        (see the module table). Shape errors are ``ValueError``s naming the metric."""
        if not isinstance(output, Tensor) or not isinstance(target, Tensor):
            raise TypeError(
                f"MetricSet.update: output and target must be tensors, got {type(output).__name__} and {type(target).__name__}"
            )
        output = output.detach()
        for m in self._metrics:
            m.update(output, target)

    def compute(self, prefix: str = "") -> dict[str, float]:
        """``{prefix + name: value}`` over every batch since the last ``reset()``: one host read per
        device. ``RuntimeError`` when no batch was added."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        values: list[Tensor | float] = []
        for m in self._metrics:
            if m.count == 0:
                raise RuntimeError(f"MetricSet.compute(): metric {m.name!r} has no batch; call update() first")
            values.append(m.value())
        out: list[float | None] = [v if isinstance(v, float) else None for v in values]
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(values):
            if isinstance(v, Tensor):
                by_device.setdefault(v.device, []).append(i)
        for idx in by_device.values():
            read = torch.stack([values[i].to(torch.float64) for i in idx]).tolist()  # the one host read
            for i, r in zip(idx, read):
                out[i] = float(r)
        return {prefix + m.name: float(v) for m, v in zip(self._metrics, out)}


def _is_protocol(obj: Any) -> bool:
    return not isinstance(obj, type) and all(callable(getattr(obj, a, None)) for a in ("update", "compute", "reset"))


def _build(key: str | None, m: Any) -> _Metric:
    """One metric object from a name, a callable or a protocol object (``key``: its chosen name)."""
    if key is not None and not isinstance(key, str):
        raise TypeError(f"metrics: mapping keys must be str names, got {key!r}")
    if isinstance(m, str):
        if m not in METRIC_NAMES:
            low = m.lower().replace("-", "_")
            close = closest(low, METRIC_NAMES)
            if low in METRIC_NAMES:
                hint = f" (names are lower case: did you mean {low!r}?)"
            else:
                hint = f" (did you mean {close!r}?)" if close else ""
            raise ValueError(f"metrics: unknown metric name {m!r}; valid names: {', '.join(map(repr, METRIC_NAMES))}{hint}")
        metric: _Metric = _Named(m, m)
    elif isinstance(m, type):
        raise TypeError(f"metrics: got the class {m.__name__}; pass an instance (e.g. {m.__name__}(...))")
    elif _is_protocol(m):
        metric = _Protocol(key or type(m).__name__, m)
    elif callable(m):
        metric = _Callable(key or getattr(m, "__name__", None) or type(m).__name__, m)
    else:
        raise TypeError(
            f"metrics: {m!r} ({type(m).__name__}) is not a metric; give a name from {list(METRIC_NAMES)}, a callable "
            f"metric(output, target), or an object with update/compute/reset"
        )
    if key is not None:
        metric.name = key
    _check_metric_name(metric.name)
    return metric


def _check_metric_name(name: str) -> None:
    if not name or "<" in name:
        raise ValueError(
            f"metrics: a metric named {name!r} (a lambda?) needs a name: pass a mapping "
            f"{{'my_metric': fn}} or a def'd function"
        )
    if name == "loss" or name.startswith("val_"):
        raise ValueError(
            f"metrics: the name {name!r} is reserved ('loss' and 'val_*' are the loss and validation entries of "
            f"a training history); choose another (pass a mapping {{'name': metric}})"
        )
