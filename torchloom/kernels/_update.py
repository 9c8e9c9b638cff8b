"""What the fused optimizer updates (``sgd.py``, ``adamw.py``, ``rmsprop.py``) share: argument checks,
the choice between kernel and reference for a list of tensors, and the scalars a kernel reads either
as numbers or from 0-d device tensors.

CUDA-graph safety: ``lr`` (and AdamW's ``step``) may be a 0-d tensor on the parameters' device that
the kernel reads, so a replayed graph sees the value of the moment; ``grad_scale`` (multiplies the
gradient before clip and update) and ``found_inf`` (nonzero: write nothing) are always device
tensors. The kernel path never reads a device value on the host. The references, plain PyTorch for
CPU, read tensor scalars with ``float()``.

Imports only torch: ``trainers.optim`` uses the checks at import time without importing Triton.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from ._triton import use_kernel

__all__ = [
    "check_number",
    "check_update_lists",
    "check_scalar",
    "check_guards",
    "on_kernel_path",
    "scalar_arg",
    "guard_args",
    "host_float",
    "ref_skip",
    "ref_prepare_grad",
    "coalesce",
]


def check_number(owner: str, name: str, value: Any, *, low: float = 0.0, low_inclusive: bool = True, high: float | None = None) -> Any:
    """``ValueError`` unless ``value`` is a finite real number in the stated range; returns it as a
    Python number. Numpy scalars and one-element real tensors are accepted (as ``torch.optim`` does)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    elif isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        value = float(value)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value < high
    if not ok:
        bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")
    return value


def check_update_lists(op: str, params: list[Tensor], grads: list[Tensor], **states: list[Tensor | None] | None) -> None:
    """Every list as long as ``params``; all parameters on one device; every tensor a floating tensor
    of its parameter's shape and device. ``None`` entries of a state list are buffers the update creates."""
    if not isinstance(params, (list, tuple)) or not isinstance(grads, (list, tuple)):
        raise TypeError(f"{op}: params and grads must be lists of tensors, got {type(params).__name__} and {type(grads).__name__}")
    if len(grads) != len(params):
        raise ValueError(f"{op}: got {len(params)} params but {len(grads)} grads")
    for name, lst in states.items():
        if lst is not None and len(lst) != len(params):
            raise ValueError(f"{op}: got {len(params)} params but {len(lst)} {name}")
    for i, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise TypeError(f"{op}: params[{i}] must be a floating tensor, got {type(p).__name__}")
        if p.device != params[0].device:
            raise ValueError(f"{op}: params[{i}] is on {p.device}, params[0] on {params[0].device}: one call updates tensors of one device")
        tensors = {"grads": g, **{name: lst[i] for name, lst in states.items() if lst is not None}}
        for name, t in tensors.items():
            if t is None and name != "grads":
                continue
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise TypeError(f"{op}: {name}[{i}] must be a floating tensor, got {type(t).__name__}")
            if t.is_sparse:
                raise TypeError(f"{op}: {name}[{i}] is sparse; the fused updates take dense tensors only")
            if t.shape != p.shape or t.device != p.device:
                raise ValueError(
                    f"{op}: {name}[{i}] has shape {list(t.shape)} on {t.device}, its parameter "
                    f"{list(p.shape)} on {p.device}: they must match"
                )


def check_scalar(op: str, name: str, value: float | Tensor, device: torch.device, *, low: float = 0.0, low_inclusive: bool = True) -> None:
    """A hyper-parameter given as a number (range-checked) or as a 0-d/1-element tensor on
    ``device`` (not read: reading it would sync the host with the GPU)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.device != device:
            raise ValueError(f"{op}: {name} as a tensor must hold one value on {device}, got shape {list(value.shape)} on {value.device}")
        return
    check_number(op, name, value, low=low, low_inclusive=low_inclusive)


def check_guards(op: str, grad_scale: Tensor | None, found_inf: Tensor | None, device: torch.device) -> None:
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None and (not isinstance(t, Tensor) or t.numel() != 1 or t.device != device):
            raise ValueError(
                f"{op}: {name} must be None or a one-element tensor on {device}, got "
                + (f"shape {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__)
            )


def on_kernel_path(op: str, params: list[Tensor], backend: str | None, **states: list[Tensor | None] | None) -> bool:
    """True when the Triton kernel updates ``params`` (all of them: the choice is per call). The
    kernel updates ``params`` and the ``states`` lists in place, so those must be contiguous."""
    if not params:
        return False
    kernel = all(use_kernel(p, backend) for p in params)
    if kernel:
        for name, lst in {"params": params, **states}.items():
            for i, t in enumerate(lst or ()):
                if t is not None and not t.is_contiguous():
                    raise ValueError(f"{op}: {name}[{i}] is not contiguous; the fused kernel updates contiguous tensors in place")
    return kernel


def scalar_arg(value: float | Tensor) -> tuple[float | Tensor, bool]:
    """``(kernel argument, ON_DEVICE flag)``: a number goes by value, a tensor as a pointer the kernel
    reads (``.reshape(())`` keeps a view, so in-place updates of ``value`` are seen)."""
    if isinstance(value, Tensor):
        return value.reshape(()), True
    return float(value), False


def guard_args(dummy: Tensor, grad_scale: Tensor | None, found_inf: Tensor | None) -> tuple[Tensor, Tensor, bool, bool]:
    """``(scale pointer, found_inf pointer, HAS_SCALE, HAS_FOUND_INF)``; an absent guard passes
    ``dummy`` (never read: its flag is off)."""
    return (
        grad_scale if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        grad_scale is not None,
        found_inf is not None,
    )


def host_float(value: float | Tensor) -> float:
    """A scalar for the references, read on the host."""
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def ref_skip(found_inf: Tensor | None) -> bool:
    """Reference: skip the whole update when ``found_inf`` is nonzero (read on the host)."""
    return found_inf is not None and bool(found_inf.item() != 0)


def ref_prepare_grad(g: Tensor, grad_scale: Tensor | None, clip_value: float) -> Tensor:
    """Reference: the gradient the update uses, ``clamp(g · grad_scale, ±clip_value)`` (a new tensor
    when changed; ``g`` itself is never modified)."""
    if grad_scale is not None:
        g = g * grad_scale  # a 0-d tensor never promotes g's dtype
    if clip_value > 0:
        g = g.clamp(-clip_value, clip_value)
    return g


def _flat_view(tensors: list[Tensor | None]) -> Tensor | None:
    """``tensors`` as one 1-D tensor when they are contiguous views laid back to back, in order, in one
    storage (same dtype); else None. A view: no copy, no kernel (so it works inside graph capture)."""
    first = tensors[0]
    if first is None or not first.is_contiguous():
        return None
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    size = first.element_size()
    for t in tensors:
        if t is None or t.dtype != first.dtype or not t.is_contiguous() or t.data_ptr() != expected:
            return None
        if t.untyped_storage().data_ptr() != storage:
            return None
        expected += t.numel() * size
    return first.as_strided(((expected - first.data_ptr()) // size,), (1,), first.storage_offset())


def coalesce(*lists: list[Tensor | None] | None) -> tuple[list[Tensor] | None, ...] | None:
    """Multi-tensor updates in one launch, when the memory allows it.

    If every given list (``None`` lists are passed through) holds several tensors that are consecutive
    contiguous views of one buffer, each list becomes ``[flat]``, its one 1-D tensor, and an
    elementwise update launches once instead of once per tensor. The element order is the same in
    every list, so element ``i`` of each flat tensor still belongs together. Returns None (update
    tensor by tensor) otherwise. ``trainers.optim.flatten_optimizer_`` lays tensors out this way."""
    present = [lst for lst in lists if lst is not None]
    if not present or len(present[0]) < 2:
        return None
    out = []
    for lst in lists:
        if lst is None:
            out.append(None)
            continue
        flat = _flat_view(list(lst))
        if flat is None:
            return None
        out.append([flat])
    return tuple(out)
