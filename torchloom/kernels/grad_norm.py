"""Global L2 norm of a list of gradients and the clip scale, in one reduction without a host sync:
``norm = sqrt(Σ_t Σ g_t²)``, ``scale = max_norm / norm`` when ``norm > max_norm`` else 1
(Loom's ``ClipGradients(maxNorm)``).

The kernel path: each gradient's blocks write their ``Σ g²`` into one shared buffer of partials (one
launch per gradient, reading it once), then a single program sums the partials and writes the norm,
the clip scale and a ``found_inf`` flag (1.0 when the norm is NaN/Inf, i.e. some gradient is). All
three stay on the device as 0-d float32 tensors, ready for the fused optimizers' ``grad_scale`` and
``found_inf`` arguments, so clipping needs neither a host sync nor an extra pass over the gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import elementwise_settings, use_kernel
from ._update import coalesce

__all__ = ["grad_norm_ref", "clip_scale_ref", "grad_norm", "grad_sq_partials", "grad_norm_clip_scale", "clip_grad_norm_"]


def grad_norm_ref(grads: list[Tensor]) -> Tensor:
    """Reference: the global L2 norm of ``grads`` as a 0-d tensor, accumulated in float32 (float64 for
    float64 gradients)."""
    acc = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=acc) for g in grads]))


def clip_scale_ref(norm: Tensor, max_norm: float) -> tuple[Tensor, Tensor]:
    """Reference: ``(scale, found_inf)`` from a 0-d ``norm``: ``scale = max_norm/norm`` when
    ``norm > max_norm`` else 1; ``found_inf`` 1.0 when ``norm`` is NaN/Inf else 0.0 (float32)."""
    scale = torch.where(norm > max_norm, max_norm / norm, torch.ones_like(norm))
    return scale, (~torch.isfinite(norm)).float()


@jit
def _sum_squares_kernel(
    partial_ptr,  # [programs] out, float32: Σ_block g²
    g_ptr,  # [N]
    n,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK + BLOCK <= n:  # a whole block: unmasked, so the loads vectorise whatever n is
        g = tl.load(g_ptr + offs).to(tl.float32)
    else:
        g = tl.load(g_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(g * g, axis=0))


@jit
def _norm_finish_kernel(
    norm_ptr,  # 0-d out, float32
    scale_ptr,  # 0-d out, float32 (written when HAS_CLIP)
    found_inf_ptr,  # 0-d out, float32 (written when HAS_CLIP)
    partial_ptr,  # [n_partials] float32
    n_partials,
    max_norm,
    BLOCK: tl.constexpr,
    HAS_CLIP: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    max_norm = tl.cast(max_norm, tl.float32)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK):
        acc += tl.load(partial_ptr + start + cols, mask=start + cols < n_partials, other=0.0)
    norm = tl.sqrt(tl.sum(acc, axis=0))
    tl.store(norm_ptr, norm)
    if HAS_CLIP:
        tl.store(scale_ptr, tl.where(norm > max_norm, max_norm / norm, 1.0))
        # The sum of squares is >= 0, so "not < inf" means Inf or NaN.
        tl.store(found_inf_ptr, tl.where(norm < float("inf"), 0.0, 1.0))


def _check_grads(grads: list[Tensor]) -> None:
    if not isinstance(grads, (list, tuple)) or not grads:
        raise ValueError(f"grads must be a non-empty list of tensors, got {grads!r}")
    device = grads[0].device
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor) or not g.is_floating_point():
            raise TypeError(f"grads[{i}] must be a floating tensor, got {type(g).__name__}{'' if not isinstance(g, Tensor) else ' of dtype ' + str(g.dtype)}")
        if g.device != device:
            raise ValueError(f"grads[{i}] is on {g.device}, grads[0] on {device}: all gradients must share one device")


def _layout(numels: tuple[int, ...], is_cuda: bool) -> tuple[list[tuple[int, int, int, int]], int]:
    """Per gradient ``(offset into the partials, programs, BLOCK, num_warps)`` and the partials'
    total length: a few integer operations per tensor, none per element."""
    out, offset = [], 0
    for n in numels:
        block, num_warps, programs = elementwise_settings(n, is_cuda)
        programs = programs if n > 0 else 0  # an empty gradient owns no partial
        out.append((offset, programs, block, num_warps))
        offset += programs
    return out, offset


def _kernel_sq_partials(grads: list[Tensor]) -> tuple[Tensor, int]:
    """The partial sums of squares of ``grads`` (one launch per gradient, or one for gradients laid
    back to back) and how many there are (at least one slot, zero when every gradient is empty)."""
    device = grads[0].device
    flat = coalesce(grads)
    if flat is not None:  # gradients laid back to back: one launch reads them all
        grads = flat[0]
    layout, total = _layout(tuple(g.numel() for g in grads), grads[0].is_cuda)
    partials = torch.empty(max(total, 1), device=device, dtype=torch.float32)
    if total == 0:  # only empty gradients: the norm is 0
        partials.zero_()
    for g, (offset, programs, block, num_warps) in zip(grads, layout):
        if g.numel() == 0:
            continue
        _sum_squares_kernel[(programs,)](partials[offset:], g.contiguous(), g.numel(), BLOCK=block, num_warps=num_warps)
    return partials, total


def _kernel_norm(grads: list[Tensor], max_norm: float | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    device = grads[0].device
    partials, total = _kernel_sq_partials(grads)
    norm = torch.empty((), device=device, dtype=torch.float32)
    clip = max_norm is not None
    scale = torch.empty((), device=device, dtype=torch.float32) if clip else norm
    found_inf = torch.empty((), device=device, dtype=torch.float32) if clip else norm
    block = min(max(1 << (max(total, 1) - 1).bit_length(), 16), 1024)
    _norm_finish_kernel[(1,)](
        norm, scale, found_inf, partials, max(total, 1), float(max_norm or 0.0), BLOCK=block, HAS_CLIP=clip, num_warps=4
    )
    return norm, (scale if clip else None), (found_inf if clip else None)


def _on_triton(grads: list[Tensor], backend: str | None) -> bool:
    return all(use_kernel(g, backend) for g in grads)


def grad_norm(grads: list[Tensor], backend: str | None = None) -> Tensor:
    """Global L2 norm of ``grads`` (tensors of any shapes on one device) as a 0-d tensor on that
    device (float32; float64 from the reference for float64 gradients), NaN/Inf if any gradient is;
    Triton on CUDA (no host sync), the reference elsewhere."""
    _check_grads(grads)
    if not _on_triton(grads, backend):
        return grad_norm_ref(list(grads))
    return _kernel_norm(list(grads), None)[0]


def grad_sq_partials(grads: list[Tensor], backend: str | None = None) -> Tensor:
    """Partial sums of ``g²`` over all of ``grads``: a 1-D tensor whose sum is the squared global norm
    (NaN/Inf if any gradient is), left unreduced for a later kernel to add up (the CUDA training
    step's guard). One launch per gradient on CUDA (one in all for gradients laid back to back); the
    reference returns the one-element squared norm."""
    _check_grads(grads)
    if not _on_triton(grads, backend):
        return grad_norm_ref(list(grads)).square().reshape(1)
    return _kernel_sq_partials(list(grads))[0]


def grad_norm_clip_scale(grads: list[Tensor], max_norm: float, backend: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(norm, scale, found_inf)``, 0-d tensors on the gradients' device: the global L2 norm,
    the clip scale ``min(1, max_norm/norm)`` (1 when ``norm <= max_norm``) and 1.0 when the norm is
    NaN/Inf. Pass ``scale`` and ``found_inf`` to a fused optimizer update to clip and guard in its pass."""
    _check_grads(grads)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    if not _on_triton(grads, backend):
        norm = grad_norm_ref(list(grads))
        return (norm, *clip_scale_ref(norm, float(max_norm)))
    norm, scale, found_inf = _kernel_norm(list(grads), float(max_norm))
    return norm, scale, found_inf


@torch.no_grad()
def clip_grad_norm_(grads: list[Tensor], max_norm: float, backend: str | None = None) -> Tensor:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``; returns the norm
    before clipping (0-d tensor). No host sync: the scale is computed on the device."""
    norm, scale, _ = grad_norm_clip_scale(grads, max_norm, backend)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, scale.to(dtype))
    return norm
