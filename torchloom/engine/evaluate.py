"""``evaluate(model, data, ...)`` (loss and metrics over a data set) and ``predict(model, data, ...)``.

::

    scores = torchloom.evaluate(net, (X_test, y_test), loss_type="cross_entropy", metrics=["accuracy"])
    # {"loss": 0.21, "accuracy": 0.94}
    probs = torchloom.predict(net, X_test, batch_size=256).softmax(-1)

Both work for any ``nn.Module`` called as ``model(x)`` (torchloom ``Network``s included): the model
runs in eval mode under ``torch.no_grad()``, and every submodule's train/eval mode is put back
afterwards. A torchloom ``Network`` in Loom mode (``record_history=True``) keeps the ``history`` of
its last training forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..layers.network import Network
from .data import as_batch_iterable, predict_inputs
from .losses import LOSS_TYPES, check_loss_type, check_target, is_label_target, loss_and_grad
from .metrics import MetricSet
from .types import batch_rows

__all__ = ["evaluate", "predict"]

def evaluate(
    model: nn.Module,
    data: Any,
    *,
    loss_type: str | Callable[[Tensor, Tensor], Tensor] = "mse",
    metrics: Iterable[Any] | MetricSet = (),
    batch_size: int | None = None,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """The loss and metrics of ``model`` over ``data``: ``{"loss": ..., <metric name>: ..., ...}``.

    Args:
        model: any ``nn.Module``; called as ``model(x)`` on each input batch (``model(*x)`` when
            the input is a tuple ``(x1, x2, ...)``, a model of several inputs) and must return a
            tensor ``[batch, ...]``.
        data: any form of ``as_batch_iterable``: a list of ``(input, target)`` batches (or
            ``TrainingBatch``es / dicts), a tuple ``(X, Y)`` of tensors, a ``DataLoader``, a
            ``Dataset`` of ``(x, y)`` items, or a ``Batches``. Never shuffled.
        loss_type: ``"mse"`` (mean of ``(o − y)²`` over the elements), ``"cross_entropy"`` (softmax
            + cross-entropy on logits; integer class labels ``[...]`` or one-hot / soft targets of the
            output's shape), ``"crossentropy"`` (``mean(−y·ln(o + 1e-10))``, ``o`` already
            probabilities), or a callable ``loss(output, target)`` returning a one-element tensor
            (or a number), the mean over the batch.
        metrics: metric names (``"accuracy"``, ``"binary_accuracy"``, ``"mse"``, ``"mae"``,
            ``"rmse"``), callables ``metric(output, target)``, objects with
            ``update``/``compute``/``reset``, a mapping ``{name: metric}``, or a ``MetricSet``
            (reset first); see ``MetricSet``.
        batch_size: rows per batch for ``(X, Y)`` and ``Dataset`` data (default 32); must be None
            for a list of batches or a ``DataLoader``.
        device: where the forward runs. ``None``: the device of the model's first parameter (or
            buffer; CPU without either). When given, the model is moved there (``model.to(device)``,
            as ``train()`` does) and stays there.

    Returns:
        ``{"loss": L, **metrics}`` as floats. ``L`` is the sample-weighted mean of the batch losses,
        ``Σ_b n_b·loss_b / Σ_b n_b`` with ``n_b = input.shape[0]``, which equals the loss of the whole
        data in one batch for all three named losses. Batches move to ``device``; floating inputs
        are cast to the model's floating dtype, floating targets to the output's dtype.

    Raises:
        ``TypeError``/``ValueError`` for a bad model, loss, metric, data or device before the model
        runs (list data is checked whole; streamed data batch by batch); a batch whose target does
        not fit the loss or the metrics; a ``RuntimeError`` for a CUDA device without CUDA.
    """
    _check_model(model)
    named_loss = _check_loss(loss_type)
    metric_set = metrics if isinstance(metrics, MetricSet) else MetricSet(metrics)
    dev = _resolve_device(device, model)
    batches = as_batch_iterable(data, batch_size=batch_size, name="data")
    if device is not None:
        model.to(dev)
    dtype = _float_dtype(model)

    metric_set.reset()
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    bad_target = torch.zeros((), dtype=torch.bool, device=dev)  # label range / negative probabilities (CUDA)
    rows = 0
    host_checks = dev.type == "cpu"  # reading labels is free on the CPU; elsewhere it is a sync per batch
    with _inference(model):
        for i, (x, y) in enumerate(batches):
            x, y = _to_device(x, dev, dtype), y.to(dev, non_blocking=True)
            out = _forward(model, x, i)
            if y.is_floating_point():
                y = y.to(out.dtype)
            n = batch_rows(x)
            if named_loss is not None:
                try:
                    check_target(out.shape, y, named_loss, check_labels=host_checks)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"data: batch {i}: {e}") from None
                if not host_checks:
                    y_loss, bad = _device_target_check(out, y, named_loss)
                    bad_target |= bad
                else:
                    y_loss = y
                loss = loss_and_grad(out, y_loss, named_loss, validate=False)[0]
            else:
                loss = _callable_loss(loss_type, out, y, i)
            if isinstance(loss, Tensor):
                loss_sum += loss.detach().to(device=dev, dtype=torch.float64) * n
            else:
                loss_sum += loss * n
            rows += n
            metric_set.update(out, y)
    if rows == 0:
        raise ValueError("data is empty: it yielded no batch")
    values = torch.stack([loss_sum / rows, bad_target.to(torch.float64)]).tolist()  # one host read
    if values[1]:
        raise ValueError(
            f"data: loss_type={named_loss!r} needs class labels in [0, C) or targets of probabilities (>= 0); "
            f"a batch had values outside that range"
        )
    result = {"loss": float(values[0])}
    if len(metric_set):
        result.update(metric_set.compute())
    return result


def predict(
    model: nn.Module,
    data: Any,
    *,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
) -> Tensor:
    """``model``'s outputs for every input of ``data``, concatenated in order along dimension 0.

    Args:
        model: any ``nn.Module``, called as ``model(x)``; must return a tensor ``[batch, ...]`` whose
            trailing dimensions are the same for every batch.
        data: a tensor (or NumPy array) ``X [n, ...]`` (cut into batches of ``batch_size`` rows,
            default 32), a tuple ``(X, Y)`` (targets ignored), a list of batches (their inputs; a bare
            tensor element is an input batch), a ``DataLoader`` (first element of each batch), or a
            ``Dataset`` (first element of each item, batched by ``batch_size``). Never shuffled.
        batch_size: rows per batch for tensors and ``Dataset``s; None for a list or a ``DataLoader``.
        device: where the forward runs and the result lives; ``None``: the model's device. When
            given, the model is moved there and stays there.

    Returns:
        ``[n, ...]``: the outputs, on ``device`` (the model's device by default), detached, in eval
        mode (every submodule's mode is restored afterwards).
    """
    _check_model(model)
    dev = _resolve_device(device, model)
    inputs = predict_inputs(data, batch_size, name="data")
    if device is not None:
        model.to(dev)
    dtype = _float_dtype(model)
    outputs: list[Tensor] = []
    with _inference(model):
        for i, x in enumerate(inputs):
            out = _forward(model, _to_device(x, dev, dtype), i)
            if outputs and out.shape[1:] != outputs[0].shape[1:]:
                raise ValueError(
                    f"data: batch {i}: the model's output {list(out.shape)} does not stack with batch 0's "
                    f"{list(outputs[0].shape)} (every batch must give the same trailing dimensions)"
                )
            outputs.append(out.to(dev))
    if not outputs:
        raise ValueError("data is empty: it yielded no batch")
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


# ---------------------------------------------------------------------------------- helpers
def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (e.g. a torchloom Network), got {type(model).__name__}")


def _check_loss(loss_type: Any) -> str | None:
    """The loss name, or None for a callable loss; errors for anything else."""
    if isinstance(loss_type, str):
        return check_loss_type(loss_type)
    if callable(loss_type) and not isinstance(loss_type, type):
        return None
    raise TypeError(
        f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))} or a callable loss(output, target) -> "
        f"scalar tensor, got {loss_type!r}"
    )


def _resolve_device(device: Any, model: nn.Module) -> torch.device:
    if device is None:
        for t in model.parameters():
            return t.device
        for t in model.buffers():
            return t.device
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str, a torch.device or None, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was requested but CUDA is not available on this machine")
    return dev


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype floating inputs are cast to: the model's first floating parameter (or buffer)."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _to_device(x: Tensor | tuple[Tensor, ...], dev: torch.device, dtype: torch.dtype | None) -> Tensor | tuple[Tensor, ...]:
    if isinstance(x, tuple):  # a model of several inputs
        return tuple(_to_device(t, dev, dtype) for t in x)
    return x.to(dev, dtype=dtype if (dtype is not None and x.is_floating_point()) else None, non_blocking=True)


def _forward(model: nn.Module, x: Tensor | tuple[Tensor, ...], index: int) -> Tensor:
    # several inputs: model(*inputs); a Network passes the tuple to its first link, which unpacks it
    out = model(*x) if isinstance(x, tuple) and not isinstance(model, Network) else model(x)
    if not isinstance(out, Tensor):
        raise TypeError(f"data: batch {index}: the model returned {type(out).__name__}; evaluate/predict need a tensor output")
    rows = batch_rows(x)
    if out.dim() == 0 or out.shape[0] != rows:
        raise ValueError(
            f"data: batch {index}: the model's output {list(out.shape)} has no batch dimension of the input's "
            f"{rows} rows"
        )
    return out


def _callable_loss(loss: Callable[[Tensor, Tensor], Any], out: Tensor, y: Tensor, index: int) -> Tensor | float:
    value = loss(out, y)
    name = getattr(loss, "__name__", type(loss).__name__)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"data: batch {index}: loss_type {name!r} returned a tensor of shape {list(value.shape)}; a loss "
                f"must return one number (the mean over the batch), e.g. reduction='mean'"
            )
        return value.reshape(())
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise TypeError(f"data: batch {index}: loss_type {name!r} returned {type(value).__name__}; a loss must return a scalar tensor")
    return float(value)


def _device_target_check(out: Tensor, y: Tensor, loss_type: str) -> tuple[Tensor, Tensor]:
    """Off the CPU: the target range check as a device flag (read once at the end, no sync per
    batch), and the target the loss kernel may read (labels clamped into range)."""
    if is_label_target(y):
        c = out.shape[-1]
        return y.clamp(0, c - 1), ((y < 0) | (y >= c)).any()
    if loss_type in ("cross_entropy", "crossentropy"):
        return y, (y < 0).any()
    return y, torch.zeros((), dtype=torch.bool, device=y.device)


class _inference:
    """Eval mode and ``torch.no_grad()`` for the block; every submodule's mode (and a Loom-mode
    ``Network``'s recorded ``history``) is put back afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.histories = [(m, m.history) for m in self.model.modules() if isinstance(m, Network)]
        self.no_grad = torch.no_grad()
        self.no_grad.__enter__()
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.no_grad.__exit__(*exc)
        for m, mode in self.modes:
            m.training = mode
        for m, history in self.histories:
            m.history = history
