"""Loom's ``"crossentropy"`` on probabilities: ``loss = (1/N) Σ −y·ln(o + 1e-10)``,
``grad = −y/(o + 1e-10)/N``, over all ``N`` output elements.

The reference computes in float64 as Loom does. The kernel reads ``o`` and ``y`` once, writes
``grad`` once and one partial loss per block (summed on the device, no host sync); it computes in
float32, which moves the loss by about 1e-7 relative (float32's log is correct to ~1 ulp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import elementwise_settings, use_kernel

__all__ = ["loom_ce_loss_grad_ref", "loom_ce_loss_grad", "LOOM_CE_EPS"]

LOOM_CE_EPS = 1e-10


def loom_ce_loss_grad_ref(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: ``(loss, grad)``; ``loss`` 0-d float64, ``grad`` like ``output``."""
    n = output.numel()
    p = output.double() + LOOM_CE_EPS
    y = target.double()
    loss = -(y * torch.log(p)).sum() / n
    grad = (-(y / p) * (1.0 / n)).to(output.dtype)
    return loss, grad


@jit
def _loom_ce_kernel(
    grad_ptr,  # [N] out, output's dtype
    partial_ptr,  # [programs] out, float32: Σ_block −y·ln(o + eps)/N
    out_ptr,  # [N] probabilities
    tgt_ptr,  # [N]
    n,
    inv_n,  # 1/N
    eps,
    BLOCK: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    inv_n = tl.cast(inv_n, tl.float32)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(out_ptr + offs, mask=mask, other=1.0).to(tl.float32) + eps
    y = tl.load(tgt_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # masked lanes: y = 0 adds 0
    tl.store(grad_ptr + offs, (-(y / p) * inv_n).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + pid, -tl.sum(y * tl.log(p), axis=0) * inv_n)


def loom_ce_loss_grad(output: Tensor, target: Tensor, backend: str | None = None, *, unreduced: bool = False) -> tuple[Tensor, Tensor]:
    """``(loss, grad)`` of Loom's probability cross-entropy: the Triton kernel on CUDA (``loss`` 0-d
    float32, the sum of per-block partials, no host sync), the reference elsewhere.
    ``unreduced=True`` returns the 1-D partial sums instead of the loss (their sum is the loss), so a
    later kernel can add them up in its own pass."""
    if not use_kernel(output, backend) or output.numel() == 0:
        loss, grad = loom_ce_loss_grad_ref(output, target)
        return (loss.reshape(1) if unreduced else loss), grad
    o = output.contiguous()
    y = target.contiguous()
    n = o.numel()
    block, num_warps, programs = elementwise_settings(n, o.is_cuda)
    grad = torch.empty_like(o)
    partials = torch.empty(programs, device=o.device, dtype=torch.float32)
    _loom_ce_kernel[(programs,)](grad, partials, o, y, n, 1.0 / n, LOOM_CE_EPS, BLOCK=block, num_warps=num_warps)
    return (partials if unreduced else partials.sum()), grad.view(output.shape)
