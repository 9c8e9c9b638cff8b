"""Losses — value and gradient w.r.t. the network output, functional API.

| ``loss_type``      | value                                    | gradient               |
|--------------------|------------------------------------------|------------------------|
| ``"mse"``          | (1/N) Σ (o−y)²                           | 2(o−y)/N               |
| ``"cross_entropy"``| (1/B) Σ_b −Σ_j y_bj log softmax(o_b)_j   | (softmax(o) − y)/B     |
| ``"crossentropy"`` | (1/N) Σ −y·ln(o + 1e-10)  (o = probs)    | −y/(o+1e-10)/N         |

``N`` = number of output elements, ``B`` = number of rows (all dimensions but the last).
``"cross_entropy"`` takes integer class labels ``[...]`` (the output's shape without its last
dimension) or one-hot / soft targets of the output's shape. Each loss runs a fused Triton kernel on
CUDA tensors and its PyTorch reference elsewhere (``torchloom.kernels``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = [
    "LOSS_TYPES", "check_loss_type", "check_target", "loss_and_grad", "compute_loss", "loss_gradient", "label_bounds",
    "prefetched_label_bounds", "as_float_target", "mse_to_target",
]

LOSS_TYPES = ("mse", "cross_entropy", "crossentropy")

# loss_type → (kernel module, launcher name)
_KERNELS = {
    "mse": ("torchloom.kernels.mse", "mse_loss_grad"),
    "cross_entropy": ("torchloom.kernels.softmax_ce", "softmax_ce_loss_grad"),
    "crossentropy": ("torchloom.kernels.loom_ce", "loom_ce_loss_grad"),
}

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_loss_type(loss_type: Any) -> Any:
    """Return ``loss_type`` if it is one of ``LOSS_TYPES`` or a callable ``loss(output, target) ->
    scalar tensor``; else ``ValueError`` listing the names."""
    if callable(loss_type) and not isinstance(loss_type, str):
        return loss_type
    if loss_type not in LOSS_TYPES:
        hint = ""
        if isinstance(loss_type, str) and loss_type.lower().replace("-", "_") in LOSS_TYPES:
            hint = f" (names are case-sensitive: did you mean {loss_type.lower().replace('-', '_')!r}?)"
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(map(repr, LOSS_TYPES))}{hint}")
    return loss_type


def is_label_target(target: Tensor) -> bool:
    return target.dtype in _INT_DTYPES


def as_float_target(output: Tensor, target: Tensor) -> Tensor:
    """A checked target as a float tensor like ``output``: class labels one-hot over the last
    dimension (a scatter: ``F.one_hot`` checks the label range on the host, a sync on CUDA)."""
    if target.dtype in _INT_DTYPES:
        labels = target.to(output.device, torch.long)
        hot = torch.zeros(*labels.shape, output.shape[-1], dtype=output.dtype, device=output.device)
        return hot.scatter_(-1, labels.unsqueeze(-1), 1.0)
    return target.to(output.device, output.dtype)


def mse_to_target(output: Tensor, target: Tensor) -> Tensor:
    """The ``"mse"`` loss of a method that trains towards targets (TargetProp, Tweening):
    ``mean((output − t)²)``, class labels one-hot encoded (backprop's ``"mse"`` takes float targets only)."""
    return ((output - as_float_target(output, target)) ** 2).mean()


# ------------------------------------------------------------------ label ranges, read in one go
_prefetched = threading.local()


_PREFETCH_CHUNK = 1 << 24  # label elements stacked at once (128 MB of int64): bounded extra memory
_HOST_REDUCE = 1 << 20  # up to this many labels in all (8 MB of int64) are reduced on the CPU


def _identity(t: Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


def _prefetchable(t: Any) -> bool:
    # inference tensors keep no version counter: they are read when asked
    return isinstance(t, Tensor) and t.dtype in _INT_DTYPES and t.numel() > 0 and t.device.type != "cpu" and not t.is_inference()


def label_bounds(labels: Tensor) -> tuple[int, int]:
    """``(min, max)`` of non-empty integer ``labels`` as Python ints: from the values
    ``prefetched_label_bounds`` read for them when they are among its tensors (unchanged since), else
    read now (one device sync on a GPU)."""
    values = getattr(_prefetched, "values", None)
    if values is not None and _prefetchable(labels):
        hit = values.get(_identity(labels))
        if hit is not None:
            return hit
    lo, hi = torch.stack([labels.min(), labels.max()]).tolist()
    return int(lo), int(hi)


@contextlib.contextmanager
def prefetched_label_bounds(targets: Iterable[Any]) -> Iterator[None]:
    """Within the block (this thread), ``label_bounds`` of any of the non-empty integer device tensors
    among ``targets`` answers from one read for all of them: tensors of one shape are stacked (at
    most 2²⁴ elements at a time) and reduced, one host sync in all (on the CPU, one per shape, when
    there are at most 2²⁰ labels in all). A run over a list of batches
    checks every batch's label range before it starts; one sync per batch (1,875 at batch 32 over
    60,000 samples) was most of its start. CPU tensors (no sync to save) and inference tensors (no
    version counter to notice a change by) are read when asked."""
    groups: dict[tuple, list[Tensor]] = {}
    for t in targets:
        if _prefetchable(t):
            groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)
    values: dict[tuple, tuple[int, int]] = {}
    if groups:
        lows, highs, flat = [], [], []
        # a few labels are copied over and reduced on the CPU: a fresh process would otherwise load the
        # device's min/max reduction kernel for this alone (~7 ms on the H100 machine)
        on_host = sum(t.numel() for group in groups.values() for t in group) <= _HOST_REDUCE
        for group in groups.values():
            step = max(1, _PREFETCH_CHUNK // group[0].numel())  # stack a bounded number of elements at a time
            for i in range(0, len(group), step):
                chunk = group[i : i + step]
                stacked = torch.stack(chunk).reshape(len(chunk), -1)
                lo, hi = torch.aminmax(stacked.cpu() if on_host else stacked, dim=1)
                lows.append(lo.long())
                highs.append(hi.long())
                flat += chunk
        read = torch.stack([torch.cat(lows), torch.cat(highs)]).tolist()
        values = {_identity(t): (int(lo), int(hi)) for t, lo, hi in zip(flat, read[0], read[1])}
    previous = getattr(_prefetched, "values", None)
    _prefetched.values = values if previous is None else {**previous, **values}
    try:
        yield
    finally:
        _prefetched.values = previous


def check_target(output_shape: torch.Size | tuple[int, ...], target: Tensor, loss_type: str, *, check_labels: bool = True) -> None:
    """Raise ``ValueError`` unless ``target`` fits an output of ``output_shape`` for ``loss_type``.

    Integer class labels (``"cross_entropy"`` only) must have shape ``output_shape[:-1]`` and values in
    ``[0, C)``; the label range check reads the labels (a device sync on GPU): ``check_labels=False``
    skips it where the caller already checked."""
    check_loss_type(loss_type)
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if callable(loss_type) and not isinstance(loss_type, str):
        return  # a loss callable decides what targets it takes (the batch sizes were checked)
    output_shape = tuple(output_shape)
    if is_label_target(target):
        if loss_type != "cross_entropy":
            raise ValueError(
                f"integer class labels are only accepted by loss_type='cross_entropy'; "
                f"loss_type={loss_type!r} needs a float target of shape {list(output_shape)}"
            )
        if tuple(target.shape) != output_shape[:-1]:
            raise ValueError(
                f"class labels must have shape {list(output_shape[:-1])} for an output of shape "
                f"{list(output_shape)}, got {list(target.shape)}"
            )
        if check_labels and target.numel() > 0:
            lo, hi = label_bounds(target)
            if lo < 0 or hi >= output_shape[-1]:
                raise ValueError(
                    f"class labels must lie in [0, {output_shape[-1]}), got values in [{lo}, {hi}]"
                )
        return
    if not target.is_floating_point():
        raise TypeError(f"target must be a floating tensor or integer class labels, got dtype {target.dtype}")
    if tuple(target.shape) != output_shape:
        raise ValueError(
            f"target shape {list(target.shape)} does not match output shape {list(output_shape)} "
            f"for loss_type={loss_type!r}"
        )
    if check_labels and loss_type in ("cross_entropy", "crossentropy") and target.numel() > 0:
        lo = float(target.min())  # soft targets are probabilities: a negative one makes the loss negative
        if not lo >= 0:
            raise ValueError(
                f"loss_type={loss_type!r} needs a target of probabilities (every value >= 0, e.g. one-hot "
                f"or soft labels), got a minimum of {lo}"
            )


def loss_and_grad(
    output: Tensor, target: Tensor, loss_type: str = "mse", *, validate: bool = True, backend: str | None = None,
    unreduced: bool = False,
) -> tuple[Tensor, Tensor]:
    """Loss value and its gradient w.r.t. ``output``, in one fused pass where a kernel exists.

    Returns ``(loss, grad)``: ``loss`` a 0-d tensor on ``output``'s device (float64 from the
    references, float32 from the kernels), ``grad`` of ``output``'s shape and dtype. ``validate=False``
    skips the checks (the trainers validate every batch once, up front). ``unreduced=True`` returns
    a 1-D tensor of partial sums whose sum is the loss instead (the CUDA training step adds them up
    inside its step guard, saving a launch)."""
    if callable(loss_type) and not isinstance(loss_type, str):
        return callable_loss_and_grad(loss_type, output, target, unreduced=unreduced)
    if validate:
        if not isinstance(output, Tensor):
            raise TypeError(f"output must be a torch.Tensor, got {type(output).__name__}")
        check_target(output.shape, target, loss_type)
    return _launcher(loss_type)(output, target, backend=backend, unreduced=unreduced)


def callable_loss_and_grad(loss: Callable[[Tensor, Tensor], Tensor], output: Tensor, target: Tensor, *, unreduced: bool = False) -> tuple[Tensor, Tensor]:
    """A user's ``loss(output, target) -> scalar tensor``: its value and, through autograd on the loss
    alone, its gradient w.r.t. ``output``. ``TypeError`` when it returns anything but a one-element
    tensor that depends on ``output``."""
    with torch.enable_grad():
        out = output.detach().requires_grad_(True)
        value = loss(out, target)
        if not isinstance(value, Tensor) or value.numel() != 1:
            raise TypeError(f"loss_type: a loss callable must return a scalar tensor, got {type(value).__name__}"
                            + (f" of shape {list(value.shape)}" if isinstance(value, Tensor) else ""))
        if not value.requires_grad:
            raise TypeError("loss_type: the loss callable's result does not depend on the output (no gradient)")
        (grad,) = torch.autograd.grad(value.reshape(()), out)
    value = value.detach().reshape(1 if unreduced else ())
    return value, grad


def kernel_module(loss_type: Any) -> str | None:
    """The module of ``loss_type``'s fused loss kernel; None for a loss callable."""
    return _KERNELS[loss_type][0] if isinstance(loss_type, str) and loss_type in _KERNELS else None


@functools.lru_cache(maxsize=None)
def _launcher(loss_type: str):
    module, name = _KERNELS[check_loss_type(loss_type)]
    return getattr(importlib.import_module(module), name)


def compute_loss(output: Tensor, target: Tensor, loss_type: str = "mse") -> Tensor:
    """The loss value only (0-d tensor). Same checks as ``loss_and_grad``."""
    return loss_and_grad(output, target, loss_type)[0]


def loss_gradient(output: Tensor, target: Tensor, loss_type: str = "mse") -> Tensor:
    """The gradient of the loss w.r.t. ``output`` only (shape of ``output``)."""
    return loss_and_grad(output, target, loss_type)[1]
