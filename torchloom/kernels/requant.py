"""Fused requantisation of a weight on an integer grid (the grid dtypes of ``torchloom.lowbit``:
int8…int64, uint8…uint64, int4, uint4, int2, uint2, ternary), in place.

Per element, after the master took the update (``lowbit/weights.py``)::

    y = x / scale                                   # IEEE division (round to nearest)
    q = floor(y) + (u < y − floor(y))               # stochastic, u = bits(i, key_a, key_b) · 2^-24
    q = round-half-even(y)                          # nearest
    q = clamp(q, lo, hi)
    param  = ok ? q · scale : param
    before = param                                  # what the next step's update starts from

``bits`` is ``lowbit/rng.py``'s counter hash, so the kernel and the reference draw the same bits: one
launch reads ``x`` and ``param`` and writes ``param`` and ``before`` (16 bytes per float32 weight,
against ~20 torch ops). ``scale``, ``ok`` and the keys are 0-d device tensors: nothing is read on the
host and a CUDA graph can replay it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._counter import U_BITS, draw_bits
from ._tl import jit, tl
from ._triton import elementwise_settings, use_triton

__all__ = ["requant_grid_ref", "requant_grid_"]

@torch.no_grad()
def requant_grid_ref(x: Tensor, param: Tensor, before: Tensor | None, scale: Tensor, ok: Tensor, key_a: Tensor,
                     key_b: Tensor, lo: int, hi: int, stochastic: bool) -> None:
    """Reference in torch ops (what ``lowbit.codec``'s grid encoder computes with ``lowbit.rng``'s
    draws; tests/kernels/test_requant.py checks the two agree)."""
    y = x.reshape(-1).to(torch.float32) / scale
    if stochastic:
        i = torch.arange(y.numel(), dtype=torch.int64, device=y.device)
        u = draw_bits(i, key_a, key_b).to(torch.float32) * (2.0 ** -U_BITS)
        f = torch.floor(y)
        q = f + (u < (y - f)).to(torch.float32)
    else:
        q = torch.round(y)
    q = q.clamp(lo, hi).to(torch.float64).to(torch.int64).clamp(lo, hi)
    out = q.to(torch.float32) * scale
    flat = param.view(-1)
    flat.copy_(torch.where(ok, out, flat))
    if before is not None:
        before.view(-1).copy_(flat)


@jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@jit
def _requant_grid_kernel(
    param_ptr,  # [N] float32 in/out
    before_ptr,  # [N] float32 out (unused without HAS_BEFORE)
    x_ptr,  # [N] float32: the master (or the updated weights)
    scale_ptr,  # 0-d float32
    ok_ptr,  # 0-d bool (as uint8)
    key_a_ptr,  # 0-d int64 holding a 32-bit key
    key_b_ptr,  # 0-d int64
    n,
    lo,
    hi,
    BLOCK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HAS_BEFORE: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    lo = tl.cast(lo, tl.float32)
    hi = tl.cast(hi, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(scale_ptr)
    ok = tl.load(ok_ptr) != 0
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    y = tl.math.div_rn(x, s)  # IEEE division, as torch's
    f = tl.floor(y)
    d = y - f  # exact for |y| < 2^23; integral beyond, d = 0
    if STOCHASTIC:
        a = tl.load(key_a_ptr).to(tl.uint32)
        b = tl.load(key_b_ptr).to(tl.uint32)
        i_lo = (offs & 0xFFFFFFFF).to(tl.uint32)
        i_hi = (offs >> 32).to(tl.uint32)
        h = _mix32(i_lo + a)
        h = _mix32(h ^ b ^ i_hi)
        u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
        q = f + tl.where(u < d, 1.0, 0.0)
    else:  # half to even: up past the half, and at the half when floor(y) is odd
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        q = f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
    q = tl.minimum(tl.maximum(q, lo), hi)
    out = tl.where(ok, q * s, p)
    tl.store(param_ptr + offs, out, mask=mask)
    if HAS_BEFORE:
        tl.store(before_ptr + offs, out, mask=mask)


@torch.no_grad()
def requant_grid_(x: Tensor, param: Tensor, before: Tensor | None, scale: Tensor, ok: Tensor, key_a: Tensor,
                  key_b: Tensor, lo: int, hi: int, stochastic: bool, backend: str | None = None) -> None:
    """Requantise ``param`` (contiguous float32, any shape) from ``x`` (same numel) onto the grid
    ``lo…hi`` of ``scale``; see the module docstring. Triton on CUDA (or ``backend="triton"``), the
    reference otherwise. The kernel takes grids of at most 2^24 codes either side (float32 ``lo``,
    ``hi`` exact): wider grids run the reference."""
    narrow = -(2 ** 24) <= lo and hi <= 2 ** 24
    if not (narrow and param.is_contiguous() and x.is_contiguous() and use_triton(param, backend, (torch.float32,))):
        requant_grid_ref(x, param, before, scale, ok, key_a, key_b, lo, hi, stochastic)
        return
    n = param.numel()
    block, num_warps, programs = elementwise_settings(n, param.is_cuda)
    _requant_grid_kernel[(programs,)](
        param, before if before is not None else param, x.to(torch.float32), scale.to(torch.float32).reshape(()),
        ok.reshape(()).to(torch.uint8), torch.as_tensor(key_a, device=param.device).reshape(()),
        torch.as_tensor(key_b, device=param.device).reshape(()), n, float(lo), float(hi),
        BLOCK=block, STOCHASTIC=stochastic, HAS_BEFORE=before is not None, num_warps=num_warps,
    )
