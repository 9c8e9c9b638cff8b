"""Fused Dense backward for small batches.

At batch sizes of a few rows a Dense backward is four tiny kernels whose cost is their launches:
the activation gradient, ``dW = gPreᵀx``, ``db = Σ gPre`` and ``dx = gPre W``. Here it is one kernel
whose programs split into two roles, ``dW``/``db`` tiles and ``dx`` tiles, each recomputing
``gPre = g ⊙ f'(pre)`` for its own slice (a few rows: cheaper than a round trip through memory).
Measured on an H100 inside a CUDA graph (bench/bench_dense_small.py, 2026-11-22): 784→256 ReLU at
batch 1, 6.1 µs against 12.5 µs for the four kernels, and 8.4 µs against 20.4 µs at batch 128.
The forward stays ``addmm`` + activation: a fused forward kernel measured 18.5 µs against 4.0 µs
(cuBLAS's GEMV spreads the 800 KB of weights over far more SMs). Larger batches keep cuBLAS;
``SMALL_BATCH_MAX`` is the switch.

Products run in IEEE float32 (``input_precision="ieee"``), not TF32, so results match the CPU path.

Under ``torch.compile`` the kernel is reached through the custom operator
``torch.ops.torchloom.dense_small_backward`` (``torch.library.triton_op``, the launch wrapped by
``torch.library.wrap_triton``): Dynamo records one op node, and AOTAutograd hands Inductor the Triton
kernel itself, which it schedules with the code around it. Eager calls launch the kernel directly
(no dispatcher on the way, and they may write into given ``out=`` buffers).
"""

from __future__ import annotations

import torch
from torch import Tensor, float32
from torch.compiler import is_compiling

from ._tl import jit, tl, triton
from ._triton import triton_operator, use_triton

__all__ = ["ACT_CODES", "SMALL_BATCH_MAX", "dense_small_backward_ref", "dense_small_backward", "supports", "OP_NAME"]

# Activations the kernels implement (the others keep the torch path).
ACT_CODES = {"linear": 0, "relu": 1, "leaky_relu": 2, "relu2": 3, "sigmoid": 4, "tanh": 5, "silu": 6}
# Batches of at most this many rows use the fused kernel on CUDA (it won at every size measured up
# to 128 rows).
SMALL_BATCH_MAX = 128
_BLOCK_M = 16  # tl.dot needs ≥ 16 rows; smaller batches are masked
_BWD_BLOCK_N, _BWD_BLOCK_K = 32, 64


def supports(x2: Tensor, activation_name: str) -> bool:
    """Whether the fused kernel handles this 2-D input and activation (else use the torch path)."""
    return (
        x2.is_cuda
        and x2.dtype == float32
        and x2.shape[0] <= SMALL_BATCH_MAX
        and activation_name in ACT_CODES
        and use_triton(x2)
    )


# ------------------------------------------------------------------------------------ references
def _act_grad_ref(g: Tensor, pre: Tensor, code: int) -> Tensor:
    if code == 0:
        return g
    if code == 1:
        return torch.where(pre > 0, g, torch.zeros_like(g))
    if code == 2:
        return torch.where(pre > 0, g, g * 0.01)
    if code == 3:
        return g * 2.0 * torch.relu(pre)
    if code == 4:
        s = torch.sigmoid(pre)
        return g * s * (1 - s)
    if code == 5:
        t = torch.tanh(pre)
        return g * (1 - t * t)
    s = torch.sigmoid(pre)
    return g * s * (1 + pre * (1 - s))


def dense_small_backward_ref(
    g: Tensor, pre: Tensor, x: Tensor, w: Tensor, act: str, has_bias: bool, need_dx: bool
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``g, pre [M, N]``, ``x [M, K]``, ``w [N, K]`` → ``(dx [M, K] or None, dW [N, K], db [N] or None)``."""
    gp = _act_grad_ref(g, pre, ACT_CODES[act])
    return (gp @ w if need_dx else None), gp.t() @ x, (gp.sum(0) if has_bias else None)


# --------------------------------------------------------------------------------------- kernels
@jit
def _act_grad(g, p, ACT: tl.constexpr):
    if ACT == 1:
        g = tl.where(p > 0, g, 0.0)
    elif ACT == 2:
        g = tl.where(p > 0, g, g * 0.01)
    elif ACT == 3:
        g = g * 2.0 * tl.maximum(p, 0.0)
    elif ACT == 4:
        s = 1.0 / (1.0 + tl.exp(-p))
        g = g * s * (1.0 - s)
    elif ACT == 5:
        t = 2.0 / (1.0 + tl.exp(-2.0 * p)) - 1.0
        g = g * (1.0 - t * t)
    elif ACT == 6:
        s = 1.0 / (1.0 + tl.exp(-p))
        g = g * s * (1.0 + p * (1.0 - s))
    return g


@jit
def _dense_bwd_kernel(
    dw_ptr, db_ptr, dx_ptr,  # [N, K], [N], [M, K] out
    g_ptr, pre_ptr, x_ptr, w_ptr,  # [M, N], [M, N], [M, K], [N, K]
    M, N, K,
    stride_gm, stride_xm, stride_wn,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    n_dw = tl.cdiv(N, BLOCK_N) * tiles_k
    if pid < n_dw:
        # Role 1: one [BLOCK_N, BLOCK_K] tile of dW = gPreᵀ x (and db for the tiles of column 0).
        tile_n = pid // tiles_k
        tile_k = pid % tiles_k
        cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
        acc_w = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for m0 in range(0, M, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            mask_g = (rows[:, None] < M) & (cols_n[None, :] < N)
            g1 = tl.load(g_ptr + rows[:, None] * stride_gm + cols_n[None, :], mask=mask_g, other=0.0)
            p1 = tl.load(pre_ptr + rows[:, None] * stride_gm + cols_n[None, :], mask=mask_g, other=0.0)
            gp1 = _act_grad(g1, p1, ACT)  # masked rows have g1 = 0, hence gp1 = 0
            x1 = tl.load(x_ptr + rows[:, None] * stride_xm + cols_k[None, :],
                        mask=(rows[:, None] < M) & (cols_k[None, :] < K), other=0.0)
            acc_w += tl.dot(tl.trans(gp1), x1, input_precision="ieee")
            db += tl.sum(gp1, axis=0)
        tl.store(dw_ptr + cols_n[:, None] * K + cols_k[None, :], acc_w,
                 mask=(cols_n[:, None] < N) & (cols_k[None, :] < K))
        if HAS_BIAS:
            if tile_k == 0:  # one tile column writes db
                tl.store(db_ptr + cols_n, db, mask=cols_n < N)
    else:
        # Role 2: one [BLOCK_M, BLOCK_K] tile of dx = gPre W.
        q = pid - n_dw
        pm = q // tiles_k
        pk = q % tiles_k
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            gmask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :], mask=gmask, other=0.0)
            p = tl.load(pre_ptr + offs_m[:, None] * stride_gm + offs_n[None, :], mask=gmask, other=0.0)
            gp = _act_grad(g, p, ACT)
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
            acc += tl.dot(gp, w, input_precision="ieee")
        tl.store(dx_ptr + offs_m[:, None] * K + offs_k[None, :], acc,
                 mask=(offs_m[:, None] < M) & (offs_k[None, :] < K))


# -------------------------------------------------------------------------------------- launchers
def _contig(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _programs(m, n, k, need_dx: bool):
    """The launch grid's size: the dW/db tiles, then the dx tiles (plain or symbolic sizes)."""
    tiles_k = (k + _BWD_BLOCK_K - 1) // _BWD_BLOCK_K
    dx_tiles = ((m + _BLOCK_M - 1) // _BLOCK_M) * tiles_k if need_dx else 0
    return ((n + _BWD_BLOCK_N - 1) // _BWD_BLOCK_N) * tiles_k + dx_tiles


OP_NAME = "torchloom::dense_small_backward"


def _op_body(
    g: Tensor, pre: Tensor, x: Tensor, w: Tensor, act: int, has_bias: bool, need_dx: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The operator's implementation (and, run on fake tensors, its shape function): ``g, pre [M, N]``,
    ``x [M, K]``, ``w [N, K]`` float32 → ``(dx [M, K], dW [N, K], db [N])``, fresh tensors; ``dx`` is
    ``[1, K]`` and unwritten when ``need_dx`` is False, ``db`` unwritten when ``has_bias`` is False
    (the kernel gets three distinct buffers: a functional trace copies each one it writes)."""
    g, pre, x, w = g.contiguous(), pre.contiguous(), x.contiguous(), w.contiguous()
    m, n = g.shape
    k = x.shape[1]
    dw = torch.empty(n, k, device=g.device, dtype=torch.float32)
    db = torch.empty(n, device=g.device, dtype=torch.float32)
    dx = torch.empty(m if need_dx else 1, k, device=g.device, dtype=torch.float32)
    torch.library.wrap_triton(_dense_bwd_kernel)[(_programs(m, n, k, need_dx),)](
        dw, db, dx, g, pre, x, w, m, n, k, n, k, k,
        ACT=act, HAS_BIAS=has_bias, BLOCK_M=_BLOCK_M, BLOCK_N=_BWD_BLOCK_N, BLOCK_K=_BWD_BLOCK_K, num_warps=4,
    )
    return dx, dw, db


# The operator, as the traced code calls it (None without Triton: the layer then never reaches the kernel)
_DENSE_SMALL_BACKWARD = triton_operator(OP_NAME, _op_body) if triton is not None else None


def dense_small_backward(
    g: Tensor, pre: Tensor, x: Tensor, w: Tensor, act: str, has_bias: bool, need_dx: bool, backend: str | None = None,
    out: tuple[Tensor | None, Tensor | None] | None = None,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """``(dx or None, dW, db or None)`` of a Dense layer from the output gradient ``g [M, N]``, the
    saved ``pre [M, N]`` and ``x [M, K]`` and the weight ``w [N, K]``: one kernel on CUDA. ``out``:
    optional contiguous ``(dW [N, K], db [N])`` buffers the kernel writes into (returned as dW, db).
    While ``torch.compile`` traces, the kernel is called as the operator
    ``torch.ops.torchloom.dense_small_backward`` (``out`` is then copied into)."""
    if not use_triton(g, backend):
        return dense_small_backward_ref(g, pre, x, w, act, has_bias, need_dx)
    if is_compiling():
        dx, dw, db = _DENSE_SMALL_BACKWARD(g, pre, x, w, ACT_CODES[act], has_bias, need_dx)
        dw_out, db_out = out if out is not None else (None, None)
        dw = dw_out.copy_(dw) if dw_out is not None else dw
        db = (db_out.copy_(db) if db_out is not None else db) if has_bias else None
        return (dx if need_dx else None), dw, db
    g, pre, x, w = g.contiguous(), pre.contiguous(), _contig(x), w.contiguous()
    m, n = g.shape
    k = x.shape[1]
    dw_out, db_out = out if out is not None else (None, None)
    dw = dw_out if dw_out is not None and dw_out.is_contiguous() else torch.empty(n, k, device=g.device, dtype=torch.float32)
    db = None
    if has_bias:
        db = db_out if db_out is not None and db_out.is_contiguous() else torch.empty(n, device=g.device, dtype=torch.float32)
    dx = torch.empty(m, k, device=g.device, dtype=torch.float32) if need_dx else None
    _dense_bwd_kernel[(_programs(m, n, k, need_dx),)](
        dw, db if db is not None else dw, dx if dx is not None else dw,
        g, pre, x, w, m, n, k, g.stride(0), x.stride(0), w.stride(0),
        ACT=ACT_CODES[act], HAS_BIAS=has_bias,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BWD_BLOCK_N, BLOCK_K=_BWD_BLOCK_K, num_warps=4,
    )
    return dx, dw, db
