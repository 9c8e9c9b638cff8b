"""Float32 matrix products in a product precision chosen per call, whatever cuBLAS's switch says.

cuBLAS multiplies float32 in TF32 or exactly as ``torch.backends.cuda.matmul`` says: one switch for
the whole process, exact by default. PyTorch's recurrent layers obey another one,
``torch.backends.cudnn.rnn`` (TF32 by default), under which cuDNN computes the whole layer, its input
projections included. torchloom's RNN and LSTM multiply their projections and weight gradients
outside cuDNN; where the two switches disagree, ``mm`` gives those products the recurrent switch's
precision (``kernels.recurrent.projection_mm`` decides), with no process-wide setting touched.

``mm(a, b, precision, bias)``: ``a [M, K] @ b [K, N] (+ bias [N])`` → a fresh ``[M, N]`` float32, any
strides. One Triton kernel, ``_mm_kernel``: 128 × 64 output tiles, 8 warps, K in chunks of 32 (the best
of nine settings at the layers' shapes on an H200, bench/RESULTS.md §10 run E), products on TF32
tensor cores with both operands rounded to the nearest TF32 first (``"tf32"``: as the recurrent loop
kernel, whose rounding measured 1.2× the error of cuDNN's TF32 on an H100, against 2.5× truncated), or
fp32 FMA (``"ieee"``); fp32 accumulation. Where the output has too few tiles to fill the GPU (a weight
gradient: ``[H, I]`` summed over ``B·T`` rows), K is split over more programs, each writing its partial
product, summed after. ``mm_ref`` is the same math in PyTorch (TF32 rounding included), which the CPU
runs and the tests compare against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import sm_count as _sm_count, use_triton

__all__ = ["PRECISIONS", "mm", "mm_ref", "round_tf32_ref"]

PRECISIONS = ("tf32", "ieee")
_BLOCK_M, _BLOCK_N, _BLOCK_K = 128, 64, 32
_NUM_WARPS, _NUM_STAGES = 8, 3
_ROUND = True  # "tf32": operands rounded to the nearest TF32 first (False: the tensor cores' truncation)
_MIN_K_PER_SPLIT = 256  # a split's K: at least this many products per output (its partial is written out)
_MAX_SPLIT = 16


@jit
def _round_tf32(x):
    """fp32 → the nearest TF32 (10 mantissa bits; ties away from zero), still stored as fp32. NaN and
    ±Inf stay as they are (the bit trick would carry a NaN's payload into the sign: −0)."""
    rounded = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), rounded, x)


@jit
def _mm_kernel(
    A, B, C, BIAS,
    M, N, K, KI, s_am, s_ag, s_ak, s_bg, s_bk, s_bn, s_bias, s_cs, s_cm, K_PER_SPLIT,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``C[s] = A[:, ks] @ B[ks, :]`` over split ``s``'s ``K_PER_SPLIT`` of the ``K`` products (a
    multiple of ``BLOCK_K``), plus ``BIAS`` in split 0; ``C [splits, M, N]`` contiguous in its last
    dimension. The contracted index ``k`` is ``(g, i) = divmod(k, KI)``: ``A[m, g, i]`` (strides
    ``s_am, s_ag, s_ak``), ``B[g, i, n]`` (``s_bg, s_bk, s_bn``)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    mm_ = rm < M
    nm = rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_start + k + tl.arange(0, BLOCK_K)
        km = ks < K
        gs = (ks // KI).to(tl.int64)
        ins = (ks % KI).to(tl.int64)
        a_k = gs * s_ag + ins * s_ak
        b_k = gs * s_bg + ins * s_bk
        a = tl.load(A + rm64[:, None] * s_am + a_k[None, :], mask=mm_[:, None] & km[None, :], other=0.0)
        b = tl.load(B + b_k[:, None] + rn64[None, :] * s_bn, mask=km[:, None] & nm[None, :], other=0.0)
        if ROUND:
            a, b = _round_tf32(a), _round_tf32(b)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(BIAS + rn64 * s_bias, mask=nm, other=0.0)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    tl.store(C + split * s_cs + rm64[:, None] * s_cm + rn64[None, :], acc, mask=mm_[:, None] & nm[None, :])


def round_tf32_ref(t: Tensor) -> Tensor:
    """``_round_tf32`` in PyTorch: each fp32 element to the nearest TF32 (NaN, ±Inf unchanged)."""
    rounded = ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)
    return torch.where(t.abs() < float("inf"), rounded, t)


def mm_ref(a: Tensor, b: Tensor, precision: str = "tf32", bias: Tensor | None = None) -> Tensor:
    """``mm``'s math in PyTorch: operands rounded to TF32 for ``"tf32"``, then a float32 product (on
    the CPU an exact one; on CUDA cuBLAS's, in whatever precision its switch says)."""
    _check(a, b, precision, bias)
    a, b = a.reshape(a.shape[0], -1), b.reshape(-1, b.shape[-1])
    if precision == "tf32":
        a, b = round_tf32_ref(a), round_tf32_ref(b)
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _check(a: Tensor, b: Tensor, precision: str, bias: Tensor | None) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"fp32_matmul.mm: precision must be one of {PRECISIONS}, got {precision!r}")
    for name, t in (("a", a), ("b", b), ("bias", bias)):
        if t is not None and t.dtype != torch.float32:
            raise TypeError(f"fp32_matmul.mm: {name} must be float32, got {t.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim() or a.shape[1:] != b.shape[:-1]:
        raise ValueError(f"fp32_matmul.mm: a [M, K] and b [K, N], or a [M, G, K] and b [G, K, N], needed, got "
                         f"{list(a.shape)} and {list(b.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[-1]):
        raise ValueError(f"fp32_matmul.mm: bias must be [N] = [{b.shape[-1]}], got {list(bias.shape)}")
    devices = {t.device for t in (a, b, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"fp32_matmul.mm: a, b and bias must be on one device, got {sorted(map(str, devices))}")


def _splits(a: Tensor, m: int, n: int, k: int) -> int:
    """How many programs share each output tile's K: doubled while the grid still fits the GPU once
    and each split keeps at least ``_MIN_K_PER_SPLIT`` products (B = 64, T = 64, H = 256 on an H200's
    132 SMs: 16 and 8 for the ``[256, 256]`` weight gradients over 4,096 and 4,032 rows, 1 for the
    ``[4096, 256]`` projections)."""
    if not a.is_cuda:
        return 1
    tiles = -(-m // _BLOCK_M) * -(-n // _BLOCK_N)
    sms = _sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
    split = 1
    while split < _MAX_SPLIT and tiles * split * 2 <= sms and k >= split * 2 * _MIN_K_PER_SPLIT:
        split *= 2
    return split


def mm(a: Tensor, b: Tensor, precision: str = "tf32", bias: Tensor | None = None, backend: str | None = None,
       splits: int | None = None) -> Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` → a fresh float32 ``[M, N]`` with products in
    ``precision``: ``"tf32"`` (operands rounded to the nearest TF32, TF32 tensor cores) or ``"ieee"``
    (fp32 FMA); fp32 accumulation, any operand strides. Also ``a [M, G, K]``, ``b [G, K, N]``: the sum
    over both ``G`` and ``K`` (a product over rows that no 2-D view holds, e.g. the ``(b, t ≥ 1)``
    steps of a ``[B, T, H]`` tensor, read in place). The Triton kernel on CUDA (``backend`` as in
    ``use_triton``), else ``mm_ref``. ``splits``: programs per output tile along the contraction
    (default: enough to fill the GPU; the tests set it)."""
    _check(a, b, precision, bias)
    if not use_triton(a, backend, (torch.float32,)):
        return mm_ref(a, b, precision, bias)
    if a.dim() == 2:
        a, b = a.unsqueeze(1), b.unsqueeze(0)
    m, groups, ki = a.shape
    n = b.shape[2]
    k = groups * ki
    if k == 0:  # an empty sum
        out = a.new_zeros(m, n)
        return out if bias is None else out.add_(bias)
    split = splits or _splits(a, m, n, k)
    per_split = -(-(-(-k // split)) // _BLOCK_K) * _BLOCK_K  # K of one split, whole chunks
    split = -(-k // per_split)
    out = a.new_empty(split, m, n)
    if m and n:
        grid = (-(-m // _BLOCK_M), -(-n // _BLOCK_N), split)
        _mm_kernel[grid](
            a, b, out, bias if bias is not None else out,
            m, n, k, max(ki, 1), a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
            bias.stride(0) if bias is not None else 0, m * n, n, per_split,
            HAS_BIAS=bias is not None, PRECISION=precision, ROUND=precision == "tf32" and _ROUND,
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        )
    return out[0] if split == 1 else out.sum(0)
