"""Flash-style attention: softmax(q kᵀ · scale) v without the S×S matrix, forward and backward.

Layouts (strides are passed, so views of a projection's output work without copies):
``q [B, S, H, D]``, ``k, v [B, S, K, D]`` with ``H = G·K`` (grouped-query: query head ``h`` reads kv
head ``h // G``), output ``o [B, S, H, D]`` (contiguous, so ``o.view(B, S, H·D)`` feeds the output
projection), log-sum-exp ``lse [B, H, S]`` float32 (natural log). ``causal`` masks key ``j > i`` for
query ``i``. Any ``S >= 1`` (ragged tails are masked) and ``D <= 128``.

Forward (one program per block of queries of one head): the keys are streamed block by block with the
online softmax — running max ``m``, running sum ``l``, ``acc`` rescaled by ``exp(m_old − m_new)`` — and
only ``o = acc / l`` and ``lse = m + log l`` are stored.

Backward, with ``δ_i = Σ_d o_id · do_id`` (one cheap pass) and the probabilities recomputed block by
block as ``P = exp(q kᵀ · scale − lse)``::

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ⊙ (dP − δ),   dQ = dS K · scale,   dK = dSᵀ Q · scale

``dK, dV`` come from one program per key block and kv head, which loops over the ``G`` query heads of
its group and over the query blocks (no atomics); ``dQ`` from one program per query block and head,
which loops over the key blocks. All products accumulate in float32; float32 inputs use TF32×3
(float32-accurate, as PyTorch's memory-efficient SDPA) unless ``torch.backends.cuda.matmul.allow_tf32``
is set, then TF32.

``attention_ref`` is the materialised reference (float32 softmax), for the CPU and the tests.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import cublas_allows_tf32, use_kernel

__all__ = [
    "flash_attention", "flash_attention_backward", "attention_ref", "rope_", "rope_ref_", "MAX_HEAD_DIM",
    "sdpa_choice", "sdpa_ops_match", "sdpa_forward", "sdpa_backward", "sdpa_forward_raw", "sdpa_backward_raw",
    "SDPA_FLASH", "SDPA_EFFICIENT", "SDPA_CUDNN",
]

MAX_HEAD_DIM = 128
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------- reference
def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(o [B,S,H,D], lse [B,H,S] float32)``, materialising the ``[B,H,S,S]`` scores (float32 math
    for half inputs, float64 stays float64)."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.to(ct).permute(0, 2, 1, 3)
    kh = k.to(ct).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    vh = v.to(ct).permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        pos = torch.arange(s, device=q.device)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.matmul(torch.exp(scores - lse[..., None]), vh)
    return o.permute(0, 2, 1, 3).to(q.dtype).contiguous(), lse.to(torch.float32 if ct == torch.float32 else ct)


# ------------------------------------------------------------------------------------------ kernels
@jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST (the interpreter only): its bfloat16 tl.dot is wrong, so the operands (already rounded
    # to their dtype, as on the GPU) are multiplied in float32.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, sks, svs, offs_m, offs_n, offs_d, lo, hi, S, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Key blocks [lo, hi). MASK: the block may hold keys ≥ S or (causal) after some query; otherwise
    # every key is valid for every query and nothing is masked.
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            kmask = (cols < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
        else:
            kmask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :], mask=kmask, other=0.0)
        qk = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # log2 units
        if MASK:
            keep = cols[None, :] < S
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=kmask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@jit
def _fwd_kernel(
    Q, K, V, O, LSE,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    S, H, GROUP, qk_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, so nothing below is promoted to fp64.
    qk_scale = tl.cast(qk_scale, tl.float32)
    # BLOCK_M is a multiple of BLOCK_N: a query block's diagonal starts on a key-block boundary.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < S
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        full_end = start_m  # keys before the block's first query: visible to all its queries
        end_n = tl.minimum(S, start_m + BLOCK_M)
    else:
        full_end = (S // BLOCK_N) * BLOCK_N
        end_n = S
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, sks, svs, offs_m, offs_n, offs_d, 0, full_end, S, qk_scale,
                               False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, sks, svs, offs_m, offs_n, offs_d, full_end, end_n, S, qk_scale,
                               True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST)
    acc = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    # lse in natural-log units: (m + log2 l) · ln 2
    tl.store(LSE + bh * S + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=m_ok)


@jit
def _bwd_delta_kernel(
    O, DO, DELTA, sob, sos, soh, sdob, sdos, sdoh, S, H,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # δ_i = Σ_d o_id · do_id for one block of queries of one head, in float32.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * S + offs_m, tl.sum(o * do, 1), mask=offs_m < S)


@jit
def _dkdv_inner(
    dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqs, sdos, offs_n, offs_m0, offs_d, lo, hi, S, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Query blocks [lo, hi) against one key block. MASK: queries ≥ S or (causal) before some key.
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if MASK:
            m_ok = offs_m < S
            qm = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
            lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
        else:
            qm = (offs_d < HEAD_DIM)[None, :]
            lse = tl.load(LSE + row_base + offs_m) * 1.4426950408889634
            delta = tl.load(DELTA + row_base + offs_m)
        q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :], mask=qm, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdos + offs_d[None, :], mask=qm, other=0.0)
        qkT = _dot(k, tl.trans(q), PRECISION, UPCAST) * qk_scale  # [N, M], log2 units
        pT = tl.math.exp2(qkT - lse[None, :])
        if MASK:
            keep = (offs_m < S)[None, :]
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :])
            pT = tl.where(keep, pT, 0.0)
        dv += _dot(pT.to(do.dtype), do, PRECISION, UPCAST)
        dpT = _dot(v, tl.trans(do), PRECISION, UPCAST)
        dsT = pT * (dpT - delta[None, :])
        dk += _dot(dsT.to(q.dtype), q, PRECISION, UPCAST)
    return dk, dv


@jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
    S, H, KVH, GROUP, qk_scale, scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, so nothing below is promoted to fp64.
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    # BLOCK_N (keys) is a multiple of BLOCK_M (queries): the diagonal spans whole query blocks.
    start_n = tl.program_id(0) * BLOCK_N
    bk = tl.program_id(1)
    b = bk // KVH
    kvh = bk % KVH
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < S
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + kvh * skh + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + kvh * svh + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    full_end = (S // BLOCK_M) * BLOCK_M  # query blocks before it have no rows ≥ S
    if CAUSAL:
        diag_end = tl.minimum(start_n + BLOCK_N, full_end)
        lo = start_n
    else:
        diag_end = 0
        lo = 0
    for j in range(0, GROUP):
        h = kvh * GROUP + j
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        row_base = (b * H + h) * S
        if CAUSAL:  # the diagonal blocks: query before key is masked
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqs, sdos, offs_n, offs_m0, offs_d,
                                 lo, tl.minimum(start_n + BLOCK_N, S), S, qk_scale, True, True, HEAD_DIM, BLOCK_M, PRECISION, UPCAST)
            inner_lo = tl.minimum(start_n + BLOCK_N, S)
        else:
            inner_lo = 0
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqs, sdos, offs_n, offs_m0, offs_d,
                             inner_lo, tl.maximum(full_end, inner_lo), S, qk_scale, False, False, HEAD_DIM, BLOCK_M, PRECISION, UPCAST)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, LSE, DELTA, row_base, sqs, sdos, offs_n, offs_m0, offs_d,
                             tl.maximum(full_end, inner_lo), S, S, qk_scale, True, False, HEAD_DIM, BLOCK_M, PRECISION, UPCAST)
    dk = dk * scale
    tl.store(DK + b * sdkb + kvh * sdkh + offs_n[:, None] * sdks + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + kvh * sdvh + offs_n[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@jit
def _dq_inner(
    dq, q, do, lse, delta, k_base, v_base, sks, svs, offs_m, offs_n0, offs_d, lo, hi, S, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n0
        if MASK:
            kvm = (cols < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
        else:
            kvm = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :], mask=kvm, other=0.0)
        v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :], mask=kvm, other=0.0)
        qk = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        if MASK:
            keep = cols[None, :] < S
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
    return dq


@jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
    S, H, GROUP, qk_scale, scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, so nothing below is promoted to fp64.
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    # BLOCK_M is a multiple of BLOCK_N (as in the forward).
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < S
    qm = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=qm, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=qm, other=0.0)
    lse = tl.load(LSE + bh * S + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh * S + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        full_end = start_m
        end_n = tl.minimum(S, start_m + BLOCK_M)
    else:
        full_end = (S // BLOCK_N) * BLOCK_N
        end_n = S
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, sks, svs, offs_m, offs_n0, offs_d, 0, full_end, S, qk_scale,
                   False, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, UPCAST)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, sks, svs, offs_m, offs_n0, offs_d, full_end, end_n, S, qk_scale,
                   True, CAUSAL, HEAD_DIM, BLOCK_N, PRECISION, UPCAST)
    dq = dq * scale
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qm)


@jit
def _rope_kernel(
    X, SRC, COS, SIN, sxb, sxs, sxh, ssb, sss, ssh, S, NH,
    HALF: tl.constexpr, BLOCK_NH: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr,
):
    # One (sample, position) per program: every head's pair (x_i, x_{i+D/2}) of SRC rotated into X
    # (the same tensor for the in-place rotation).
    pid = tl.program_id(0)
    b = pid // S
    s = pid % S
    offs_h = tl.arange(0, BLOCK_NH)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    mask = (offs_h < NH)[:, None] & d_ok[None, :]
    p1 = X + b * sxb + s * sxs + offs_h[:, None] * sxh + offs_d[None, :]
    q1 = SRC + b * ssb + s * sss + offs_h[:, None] * ssh + offs_d[None, :]
    x1 = tl.load(q1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(q1 + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(COS + s * HALF + offs_d, mask=d_ok, other=0.0)[None, :]
    sn = tl.load(SIN + s * HALF + offs_d, mask=d_ok, other=0.0)[None, :]
    if INVERSE:
        n1 = x1 * c + x2 * sn
        n2 = x2 * c - x1 * sn
    else:
        n1 = x1 * c - x2 * sn
        n2 = x1 * sn + x2 * c
    tl.store(p1, n1.to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, n2.to(X.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ launch
def rope_ref_(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Reference of ``rope_``, in place with one half-size temporary."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    t1, t2 = x.chunk(2, dim=-1)
    if inverse:  # (g1 cos + g2 sin, g2 cos − g1 sin)
        new1 = t1 * cos + t2 * sin
        t2.mul_(cos).addcmul_(t1, sin, value=-1.0)
    else:  # (x1 cos − x2 sin, x1 sin + x2 cos)
        new1 = t1 * cos - t2 * sin
        t2.mul_(cos).addcmul_(t1, sin)
    t1.copy_(new1)
    return x


def rope_(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False, backend: str | None = None,
          src: Tensor | None = None) -> Tensor:
    """Rotate-half RoPE in place on ``x [B, S, n, D]`` (any strides but unit stride on D) with float32
    tables ``cos, sin [S, D/2]``: the pair ``(x_i, x_{i+D/2})`` becomes ``(x_i cos − x_{i+D/2} sin,
    x_i sin + x_{i+D/2} cos)`` (``inverse``: the opposite angle, the backward). ``src`` (the shape of
    ``x``, unit stride on D, in memory of its own): rotate it into ``x`` instead, in the same one pass.
    Float32 math, no temporaries on the kernel path. Returns ``x``."""
    if src is not None and (src.shape != x.shape or src.dtype != x.dtype):
        raise ValueError(f"rope_: src must match x ({list(x.shape)}, {x.dtype}), got {list(src.shape)}, {src.dtype}")
    if src is not None and src.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("rope_: src must not share memory with x (pass src=None to rotate x in place)")
    if not use_kernel(x, backend):
        if src is not None:
            x.copy_(src)
        return rope_ref_(x, cos, sin, inverse)
    src = x if src is None else src
    b, s, n, d = x.shape
    if x.stride(3) != 1 or src.stride(3) != 1:
        raise ValueError("rope_: x and src must have unit stride on the head dimension")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    half = d // 2
    _rope_kernel[(b * s,)](
        x, src, cos, sin, x.stride(0), x.stride(1), x.stride(2), src.stride(0), src.stride(1), src.stride(2), s, n,
        HALF=half, BLOCK_NH=_pow2(n), BLOCK_HALF=_pow2(half), INVERSE=inverse, num_warps=4,
    )
    return x


def _precision(dtype: torch.dtype, is_cuda: bool) -> str:
    if dtype != torch.float32 or not is_cuda:
        return "ieee" if not is_cuda else "tf32"  # half inputs: the value is ignored by the MMA
    return "tf32" if cublas_allows_tf32() else "tf32x3"


def _settings(s: int, d: int, is_cuda: bool, dtype: torch.dtype, backward: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. The forward needs BLOCK_M a multiple of BLOCK_N,
    the backward BLOCK_M == BLOCK_N (its two kernels split the diagonal one way each). The CUDA values
    are the fastest of a small sweep on an H100 (B 4, H 16, S 2048, D 64, causal; autotuning at run
    time was tried and dropped: compiling every configuration took minutes)."""
    if not is_cuda:
        return 16, 16, 4, 1  # the interpreter: small blocks keep the test shapes' tails ragged
    if dtype == torch.float32:
        return (32, 32, 4, 2) if backward else (128, 64, 8, 3)
    if d > 64:
        return (64, 64, 4, 2) if backward else (128, 64, 8, 3)
    return (64, 64, 4, 3)


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: need q [B,S,H,D] and k, v [B,S,K,D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"flash_attention: query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim must be <= {MAX_HEAD_DIM}, got {q.shape[3]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1:
            raise ValueError(f"flash_attention: {name} must have unit stride on the head dimension")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``(o [B,S,H,D], lse [B,H,S] float32)`` for ``q [B,S,H,D]``, ``k, v [B,S,K,D]`` (see the module
    doc). ``scale`` defaults to ``1/√D``. The Triton kernel on CUDA (or ``backend="triton"``), else
    ``attention_ref``."""
    _check(q, k, v)
    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not use_kernel(q, backend):
        return attention_ref(q, k, v, causal, scale)
    o = torch.empty(b, s, h, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    args = (q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            s, h, h // k.shape[2], scale * _LOG2E)
    fixed = dict(CAUSAL=causal, HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)), PRECISION=_precision(q.dtype, q.is_cuda), UPCAST=not q.is_cuda)
    bm, bn, warps, stages = _settings(s, d, q.is_cuda, q.dtype, False)
    _fwd_kernel[(triton_cdiv(s, bm), b * h)](*args, **fixed, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return o, lse


def flash_attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
    scale: float | None = None, backend: str | None = None, out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq [B,S,H,D], dk, dv [B,S,K,D])`` in the inputs' dtype, from the forward's ``o`` and ``lse``,
    recomputing the probabilities block by block (formulas in the module doc). ``out``: three
    tensors of those shapes (views with unit stride on D allowed) to write the gradients into."""
    _check(q, k, v)
    b, s, h, d = q.shape
    kvh = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not use_kernel(q, backend):
        grads = _backward_ref(do, q, k, v, causal, scale)
        if out is None:
            return grads
        for dst, src in zip(out, grads):
            dst.copy_(src)
        return out
    do = do if do.stride(3) == 1 else do.contiguous()
    delta = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    _bwd_delta_kernel[(triton_cdiv(s, 64), b * h)](
        o, do, delta, *_strides(o), *_strides(do), s, h, HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)), BLOCK_M=64,
    )
    if out is None:
        dq = torch.empty(b, s, h, d, device=q.device, dtype=q.dtype)
        dk = torch.empty(b, s, kvh, d, device=q.device, dtype=k.dtype)
        dv = torch.empty(b, s, kvh, d, device=q.device, dtype=v.dtype)
    else:
        dq, dk, dv = out
        _check(dq, dk, dv)
    fixed = dict(CAUSAL=causal, HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)), PRECISION=_precision(q.dtype, q.is_cuda), UPCAST=not q.is_cuda)
    dkdv_args = (q, k, v, do, lse, delta, dk, dv,
                 *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
                 s, h, kvh, h // kvh, scale * _LOG2E, scale)
    dq_args = (q, k, v, do, lse, delta, dq,
               *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
               s, h, h // kvh, scale * _LOG2E, scale)
    bm, bn, warps, stages = _settings(s, d, q.is_cuda, q.dtype, True)
    launch = dict(fixed, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    _bwd_dkdv_kernel[(triton_cdiv(s, bn), b * kvh)](*dkdv_args, **launch)
    _bwd_dq_kernel[(triton_cdiv(s, bm), b * h)](*dq_args, **launch)
    return dq, dk, dv


def _backward_ref(do, q, k, v, causal, scale):
    """Materialised backward (float32 math for half inputs): ``P`` rebuilt, then the formulas of the
    module doc, ``dK, dV`` summed over each kv head's group of query heads."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh, doh = (t.to(ct).permute(0, 2, 1, 3) for t in (q, do))
    kh, vh = (t.to(ct).permute(0, 2, 1, 3).repeat_interleave(g, dim=1) for t in (k, v))
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        pos = torch.arange(s, device=q.device)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    dv = torch.matmul(p.transpose(-1, -2), doh)
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
    dk, dv = (t.view(b, kv, g, s, d).sum(2) for t in (dk, dv))
    return tuple(t.permute(0, 2, 1, 3).to(q.dtype).contiguous() for t in (dq, dk, dv))


# ------------------------------------------------------------------ PyTorch's fused attention kernels
# ``F.scaled_dot_product_attention`` picks one of PyTorch's fused CUDA kernels for a call (FlashAttention-2,
# the memory-efficient kernel, cuDNN's) by the inputs and the ``torch.backends.cuda`` switches. The flash
# path of ``torchloom.layers.attention`` runs the very kernel it would pick, forward and backward called
# as separate operators (its backward stays hand-written: RoPE, the projections), and the Triton kernel
# above where none applies. On an H200 (bfloat16, B 4, S 2,048, 16 heads of 64, causal) PyTorch picks
# cuDNN's; the Triton kernel takes 0.79× FlashAttention-2's time there but ~1.2–1.3× cuDNN's
# (bench/RESULTS.md §10).
SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN = 1, 2, 3  # torch.nn.attention.SDPBackend's values


# The private operators called below, with the arguments this module passes them (as in torch 2.11, run
# on CUDA, and 2.13); an installed torch whose operator takes other arguments runs the Triton kernel.
_SDPA_SCHEMAS = {
    0: {"_fused_sdp_choice": "query key value attn_mask dropout_p is_causal scale enable_gqa"},
    SDPA_FLASH: {
        "_scaled_dot_product_flash_attention": "query key value dropout_p is_causal return_debug_mask scale",
        "_scaled_dot_product_flash_attention_backward": "grad_out query key value out logsumexp cum_seq_q cum_seq_k "
                                                         "max_q max_k dropout_p is_causal philox_seed philox_offset scale",
    },
    SDPA_EFFICIENT: {
        "_scaled_dot_product_efficient_attention": "query key value attn_bias compute_log_sumexp dropout_p is_causal scale",
        "_scaled_dot_product_efficient_attention_backward": "grad_out_ query key value attn_bias out logsumexp philox_seed "
                                                             "philox_offset dropout_p grad_input_mask is_causal scale",
    },
    SDPA_CUDNN: {
        "_scaled_dot_product_cudnn_attention": "query key value attn_bias compute_log_sumexp dropout_p is_causal "
                                               "return_debug_mask scale",
        "_scaled_dot_product_cudnn_attention_backward": "grad_out query key value out logsumexp philox_seed philox_offset "
                                                        "attn_bias cum_seq_q cum_seq_k max_q max_k dropout_p is_causal scale",
    },
}


@functools.lru_cache(maxsize=None)
def sdpa_ops_match(choice: int) -> bool:
    """Whether this torch's operators for ``choice`` (0: the chooser ``torch._fused_sdp_choice``) take
    the arguments ``sdpa_forward`` / ``sdpa_backward`` pass them (``_SDPA_SCHEMAS``)."""
    for name, args in _SDPA_SCHEMAS[choice].items():
        try:
            schema = getattr(torch.ops.aten, name).default._schema
        except (AttributeError, RuntimeError):
            return False
        if [a.name for a in schema.arguments] != args.split():
            return False
    return True


def sdpa_choice(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None = None) -> int | None:
    """The fused kernel PyTorch's SDPA would run for ``q [B,S,H,D]``, ``k, v [B,S,K,D]`` (``SDPA_FLASH``,
    ``SDPA_EFFICIENT`` or ``SDPA_CUDNN``), or None: none applies (CPU, its math fallback, grouped heads
    where only the memory-efficient kernel would run, which does not take them, or operators of another
    signature in this torch: ``sdpa_ops_match``)."""
    if not q.is_cuda or not sdpa_ops_match(0):
        return None
    grouped = q.shape[2] != k.shape[2]
    # as for training: the chooser then also checks that the kernel has a backward for these inputs
    qt, kt, vt = (_as_trained(t).transpose(1, 2) for t in (q, k, v))
    choice = int(torch._fused_sdp_choice(qt, kt, vt, None, 0.0, causal, scale=scale, enable_gqa=grouped))
    if choice == SDPA_FLASH and q.shape[3] % 8:  # F.scaled_dot_product_attention pads D for it; its operator refuses
        return None
    if choice in (SDPA_FLASH, SDPA_CUDNN) or (choice == SDPA_EFFICIENT and not grouped):
        return choice if sdpa_ops_match(choice) else None
    return None


def _as_trained(t: Tensor) -> Tensor:
    """``t``'s data as a tensor that requires grad (for the chooser's training checks), or ``t`` where
    that is refused (an inference tensor outside inference mode)."""
    try:
        return t.detach().requires_grad_()
    except RuntimeError:
        return t


@functools.lru_cache(maxsize=256)
def _raw_lse_shape(choice: int, seq_len: int) -> tuple[int, ...]:
    """The shape of the log-sum-exp the fused forward ``choice`` itself returns for one sample and head at
    ``seq_len`` (its meta kernel: the memory-efficient one pads S, cuDNN's adds a unit dimension), which
    its backward takes back."""
    q = torch.empty(1, 1, seq_len, 16, device="meta", dtype=torch.float16)
    if choice == SDPA_FLASH:
        lse = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, False, scale=0.25)[1]
    elif choice == SDPA_EFFICIENT:
        lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True, scale=0.25)[1]
    else:
        lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, True, False, scale=0.25)[1]
    return tuple(lse.shape)


# The operators the traced raw calls make, bound once (one name per operator: see _triton.triton_operator; None
# where this torch lacks one: the chooser then never picks it)
_SCALED_DOT_PRODUCT_CUDNN_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
_SCALED_DOT_PRODUCT_CUDNN_ATTENTION_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)
_SCALED_DOT_PRODUCT_EFFICIENT_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
_SCALED_DOT_PRODUCT_EFFICIENT_ATTENTION_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", None)
_SCALED_DOT_PRODUCT_FLASH_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_SCALED_DOT_PRODUCT_FLASH_ATTENTION_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None)


def sdpa_forward_raw(
    choice: int, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch's fused forward ``choice`` (``sdpa_choice``) on ``q [B,S,H,D]``, ``k, v [B,S,K,D]`` (any
    strides with the last one 1): ``(o [B,S,H,D], lse, seed, offset)`` as the operator returns them —
    ``o`` a view in the kernel's own layout, ``lse`` in its own shape (``_raw_lse_shape``), and the
    random-state tensors its backward takes back (unused: no dropout). What ``sdpa_backward_raw``
    takes; ``torch.compile`` traces the operator call as it is."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if choice == SDPA_FLASH:
        out = _SCALED_DOT_PRODUCT_FLASH_ATTENTION(qt, kt, vt, 0.0, causal, False, scale=scale)
        o, lse, seed, offset = out[0], out[1], out[6], out[7]
    elif choice == SDPA_EFFICIENT:
        o, lse, seed, offset = _SCALED_DOT_PRODUCT_EFFICIENT_ATTENTION(
            qt, kt, vt, None, True, 0.0, causal, scale=scale)
    elif choice == SDPA_CUDNN:
        out = _SCALED_DOT_PRODUCT_CUDNN_ATTENTION(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
        o, lse, seed, offset = out[0], out[1], out[6], out[7]
    else:
        raise ValueError(f"sdpa_forward_raw: choice must be SDPA_FLASH, SDPA_EFFICIENT or SDPA_CUDNN, got {choice!r}")
    return o.transpose(1, 2), lse, seed, offset


def sdpa_backward_raw(
    choice: int, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor, offset: Tensor,
    causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``sdpa_forward_raw``: ``(dq [B,S,H,D], dk, dv [B,S,K,D])``, views in the kernel's
    own layout, from ``do [B,S,H,D]`` and the forward's ``o``, raw ``lse``, ``seed`` and ``offset``."""
    s = q.shape[1]
    qt, kt, vt, ot, dot = (t.transpose(1, 2) for t in (q, k, v, o, do))
    if choice == SDPA_FLASH:
        grads = _SCALED_DOT_PRODUCT_FLASH_ATTENTION_BACKWARD(
            dot, qt, kt, vt, ot, lse, None, None, s, s, 0.0, causal, seed, offset, scale=scale)
    elif choice == SDPA_EFFICIENT:
        grads = _SCALED_DOT_PRODUCT_EFFICIENT_ATTENTION_BACKWARD(
            dot, qt, kt, vt, None, ot, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    elif choice == SDPA_CUDNN:
        grads = _SCALED_DOT_PRODUCT_CUDNN_ATTENTION_BACKWARD(
            dot, qt, kt, vt, ot, lse, seed, offset, None, None, None, s, s, 0.0, causal, scale=scale)
    else:
        raise ValueError(f"sdpa_backward_raw: choice must be SDPA_FLASH, SDPA_EFFICIENT or SDPA_CUDNN, got {choice!r}")
    return tuple(t.transpose(1, 2) for t in grads)


def sdpa_forward(choice: int, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``flash_attention``'s ``(o [B,S,H,D] contiguous, lse [B,H,S] float32)`` from PyTorch's fused
    kernel ``choice`` (``sdpa_choice``)."""
    b, s, h, _ = q.shape
    o, lse = sdpa_forward_raw(choice, q, k, v, causal, scale)[:2]
    # [B, H, S] whatever the kernel's own shape (_raw_lse_shape: S padded, a unit dimension); contiguous()
    # and reshape() copy nothing where the layout already is this one
    lse = lse.reshape(b, h, -1)[..., :s]
    return o.contiguous(), lse.contiguous()


def sdpa_backward(
    choice: int, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq [B,S,H,D], dk, dv [B,S,K,D])`` from the backward of PyTorch's fused kernel ``choice``, given
    ``sdpa_forward``'s ``o`` and ``lse`` (no dropout: its random-state arguments are placeholders)."""
    b, s, h, _ = q.shape
    dev = q.device
    raw = _raw_lse_shape(choice, s)
    if raw[2] != s:  # padded rows: +inf makes their probabilities exp(score − inf) = 0, never NaN
        full = lse.new_full((b, h, raw[2]), float("inf"))
        full[..., :s] = lse
        lse = full
    lse = lse.view(b, h, *raw[2:])
    if choice == SDPA_FLASH:
        seed, offset = torch.empty(2, dtype=torch.uint64, device=dev), torch.empty((), dtype=torch.uint64, device=dev)
    else:  # the memory-efficient kernel takes them on the host, cuDNN's on the device
        seed = offset = torch.empty((), dtype=torch.int64, device=dev if choice == SDPA_CUDNN else "cpu")
    return sdpa_backward_raw(choice, do, q, k, v, o, lse, seed, offset, causal, scale)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
