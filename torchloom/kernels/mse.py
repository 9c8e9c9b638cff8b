"""Fused MSE gradient + loss (Loom ``DispatchMSEGradPartialLoss``).

``loss = (1/N) Σ (o−y)²`` and ``grad = 2(o−y)/N`` over all ``N`` elements of ``output``.

The kernel reads ``o`` and ``y`` once and writes ``grad`` once (12 bytes per float32 element) plus
one partial sum ``Σ_block (o−y)²/N`` per block; the loss is the sum of those partials, a 0-d tensor
that stays on the device (no host sync). Eager PyTorch needs four passes for the same
(``d = o−y``, ``d*d``, the mean, ``2d/N``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import elementwise_settings, use_kernel

__all__ = ["mse_loss_grad_ref", "mse_loss_grad"]

# BLOCK 4096 with 8 warps: on an H100 (bench/sweep_mse_16m.py, 2026-11-22) 96.0 % of copy bandwidth
# at 64M elements against 93.7 % for the streaming default (1024/4), and 4x fewer partials to add up.
_CUDA_SETTINGS = (4096, 8)


def mse_loss_grad_ref(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: ``output``, ``target`` of one shape → ``(loss, grad)``; ``loss`` is a 0-d float64
    tensor summed in float64 as Loom does; ``grad`` has ``output``'s shape and dtype."""
    diff = output - target
    n = diff.numel()
    grad = diff * (2.0 / n)
    d64 = diff.reshape(-1).double()
    return torch.dot(d64, d64) / n, grad


@jit
def _mse_kernel(
    grad_ptr,  # [N] out, output's dtype
    partial_ptr,  # [programs] out, float32: Σ_block (o−y)²/N
    out_ptr,  # [N]
    tgt_ptr,  # [N]
    n,
    inv_n,  # 1/N
    BLOCK: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    inv_n = tl.cast(inv_n, tl.float32)
    pid = tl.program_id(0).to(tl.int64)  # int64: offsets past 2^31 elements stay exact
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(tgt_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = o - y  # masked lanes are 0 - 0: they add nothing to the partial
    tl.store(grad_ptr + offs, (d * (2.0 * inv_n)).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + pid, tl.sum(d * d, axis=0) * inv_n)


def mse_loss_grad(output: Tensor, target: Tensor, backend: str | None = None, *, unreduced: bool = False) -> tuple[Tensor, Tensor]:
    """``(loss, grad)`` of MSE for ``output``, ``target`` of one shape: the Triton kernel on CUDA
    (``loss`` 0-d float32, the sum of per-block partials, no host sync), the reference elsewhere.
    ``unreduced=True`` returns the 1-D partial sums instead of the loss (their sum is the loss), so a
    later kernel can add them up in its own pass."""
    if not use_kernel(output, backend) or output.numel() == 0:
        loss, grad = mse_loss_grad_ref(output, target)
        return (loss.reshape(1) if unreduced else loss), grad
    o = output.contiguous()
    y = target.contiguous()
    n = o.numel()
    block, num_warps, programs = elementwise_settings(n, o.is_cuda, _CUDA_SETTINGS)
    grad = torch.empty_like(o)
    partials = torch.empty(programs, device=o.device, dtype=torch.float32)
    _mse_kernel[(programs,)](grad, partials, o, y, n, 1.0 / n, BLOCK=block, num_warps=num_warps)
    return (partials if unreduced else partials.sum()), grad.view(output.shape)
