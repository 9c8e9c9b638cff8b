"""Fused small-batch backward of the feedback rules (DFA, sign symmetry): fewer launches than a step's
layer-by-layer backward.

One kernel, ``_feedback_bwd_kernel``, whose programs split into up to four jobs, each a role of
``kernels/dense_small.py``'s Dense backward generalised:

* a **product job**: ``P = gPre · op(B)`` with ``gPre = g ⊙ f'(pre)`` ``[M, N]`` and ``B [N, KP]``
  of any width ``KP`` (not the layer's input width), ``op(B) = B`` or ``s · sign(B)`` with ``s`` read
  from a device scalar (sign symmetry's feedback formed inside the product, never materialised);
* up to three **gradient jobs**: ``dW = gPreᵀ x`` ``[N, K]`` and ``db = Σ_rows gPre`` of one Dense layer
  each, from an output gradient ``g`` of any row stride (a column slice of ``P``).

DFA's hidden layers are independent given the output error ``e``, so its backward is two launches
for a network of up to three layers (backprop's: one per layer): ``feedback_product`` forms
``e · [B_1 | … | B_{L−1}]`` once, and ``dense_grads`` forms every layer's ``dW``/``db`` in one launch
(three layers per launch). Sign symmetry's layer ``l > 0`` is one launch, ``dense_backward_fb``: its
``dW``/``db`` and the error below it through ``s_l · sign(W_l)``.

Products run in IEEE float32 (``input_precision="ieee"``), as ``dense_small``. Each op has a plain
PyTorch reference (``*_ref``), which the CPU and large batches run and the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import use_triton
from .dense_small import ACT_CODES, SMALL_BATCH_MAX, _act_grad, _act_grad_ref

__all__ = [
    "MAX_GRAD_JOBS", "dense_backward_fb", "dense_grads", "dense_grads_ref", "feedback_product",
    "feedback_product_ref", "fits",
]

MAX_GRAD_JOBS = 3  # gradient jobs per launch
_BLOCK_M = 16
_BLOCK_N, _BLOCK_K = 32, 64

GradJob = tuple[Tensor, Tensor, Tensor, str, bool, "Tensor | None", "Tensor | None"]
"""One gradient job of a launch: ``(g [M, N]`` (any row stride), ``pre [M, N]``, ``x [M, K]``, the
activation's name, whether the layer has a bias, the ``dW [N, K]`` buffer or ``None``, the ``db [N]``
buffer or ``None``)."""


def fits(x2: Tensor, activation_name: str, backend: str | None = None) -> bool:
    """Whether the fused kernel takes a layer with this 2-D float32 input and activation (CUDA, or the
    interpreter with ``backend="triton"``; at most ``SMALL_BATCH_MAX`` rows)."""
    return (
        x2.dim() == 2 and x2.dtype == torch.float32 and x2.shape[0] <= SMALL_BATCH_MAX
        and activation_name in ACT_CODES and use_triton(x2, backend)
    )


# ------------------------------------------------------------------------------------ references
def _sign_scaled(b: Tensor, scale: Tensor | None, scale_mul: float) -> Tensor:
    if scale is None:
        return b
    return torch.sign(b) * (scale.reshape(()) * scale_mul).to(b.dtype)


def feedback_product_ref(g: Tensor, pre: Tensor, b: Tensor, act: str, scale: Tensor | None = None, scale_mul: float = 1.0) -> Tensor:
    """``(g ⊙ f'(pre)) · op(b)``: ``g, pre [M, N]``, ``b [N, KP]`` → ``[M, KP]``; ``op(b) = b``, or
    ``(scale · scale_mul) · sign(b)`` when ``scale`` (a one-element tensor) is given."""
    return _act_grad_ref(g, pre, ACT_CODES[act]) @ _sign_scaled(b, scale, scale_mul)


def dense_grads_ref(jobs: Sequence[GradJob]) -> list[tuple[Tensor, Tensor | None]]:
    """Each job's ``(dW = gPreᵀ x, db = Σ gPre or None)``, written into its buffers when given."""
    out = []
    for g, pre, x, act, has_bias, dw_out, db_out in jobs:
        gp = _act_grad_ref(g, pre, ACT_CODES[act])
        dw = gp.t() @ x
        db = gp.sum(0) if has_bias else None
        dw = dw_out.copy_(dw) if dw_out is not None else dw
        if db is not None and db_out is not None:
            db = db_out.copy_(db)
        out.append((dw, db))
    return out


# --------------------------------------------------------------------------------------- kernels
@jit
def _product_tile(t, p_ptr, g_ptr, pre_ptr, b_ptr, scale_ptr, scale_mul, M, N, KP, s_g, s_pre, s_b,
                  ACT: tl.constexpr, SIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_K]`` tile of ``P = gPre · op(B)`` (``P`` contiguous ``[M, KP]``)."""
    tiles_k = tl.cdiv(KP, BLOCK_K)
    pm = t // tiles_k
    pk = t % tiles_k
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if SIGN:
        s = tl.load(scale_ptr) * scale_mul
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        gmask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        g = tl.load(g_ptr + offs_m[:, None] * s_g + offs_n[None, :], mask=gmask, other=0.0)
        p = tl.load(pre_ptr + offs_m[:, None] * s_pre + offs_n[None, :], mask=gmask, other=0.0)
        gp = _act_grad(g, p, ACT)
        b = tl.load(b_ptr + offs_n[:, None] * s_b + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < KP), other=0.0)
        if SIGN:  # s · sign(B), NaN kept (torch.sign's)
            b = tl.where(b > 0, s, tl.where(b < 0, -s, tl.where(b == b, 0.0, b)))
        acc += tl.dot(gp, b, input_precision="ieee")
    tl.store(p_ptr + offs_m[:, None] * KP + offs_k[None, :], acc, mask=(offs_m[:, None] < M) & (offs_k[None, :] < KP))


@jit
def _grad_tile(t, dw_ptr, db_ptr, g_ptr, pre_ptr, x_ptr, M, N, K, s_g, s_pre, s_x,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` tile of ``dW = gPreᵀ x`` (and ``db`` for the tiles of column 0)."""
    tiles_k = tl.cdiv(K, BLOCK_K)
    tile_n = t // tiles_k
    tile_k = t % tiles_k
    cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_g = (rows[:, None] < M) & (cols_n[None, :] < N)
        g = tl.load(g_ptr + rows[:, None] * s_g + cols_n[None, :], mask=mask_g, other=0.0)
        p = tl.load(pre_ptr + rows[:, None] * s_pre + cols_n[None, :], mask=mask_g, other=0.0)
        gp = _act_grad(g, p, ACT)  # masked rows: g = 0, hence gp = 0
        x = tl.load(x_ptr + rows[:, None] * s_x + cols_k[None, :], mask=(rows[:, None] < M) & (cols_k[None, :] < K), other=0.0)
        acc += tl.dot(tl.trans(gp), x, input_precision="ieee")
        db += tl.sum(gp, axis=0)
    tl.store(dw_ptr + cols_n[:, None] * K + cols_k[None, :], acc, mask=(cols_n[:, None] < N) & (cols_k[None, :] < K))
    if HAS_BIAS:
        if tile_k == 0:
            tl.store(db_ptr + cols_n, db, mask=cols_n < N)


@jit
def _feedback_bwd_kernel(
    p_ptr, pg_ptr, ppre_ptr, pb_ptr, scale_ptr, scale_mul, PN, PK, ps_g, ps_pre, ps_b,
    dw0, db0, g0, pre0, x0, N0, K0, sg0, sp0, sx0,
    dw1, db1, g1, pre1, x1, N1, K1, sg1, sp1, sx1,
    dw2, db2, g2, pre2, x2, N2, K2, sg2, sp2, sx2,
    M, E0, E1, E2,
    PACT: tl.constexpr, SIGN: tl.constexpr, JOBS: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr, ACT2: tl.constexpr,
    BIAS0: tl.constexpr, BIAS1: tl.constexpr, BIAS2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Programs ``[0, E0)``: the product job's tiles; ``[E0, E1)``, ``[E1, E2)``, ``[E2, grid)``: the
    gradient jobs' (``JOBS`` of them)."""
    pid = tl.program_id(0)
    if pid < E0:
        _product_tile(pid, p_ptr, pg_ptr, ppre_ptr, pb_ptr, scale_ptr, scale_mul, M, PN, PK, ps_g, ps_pre, ps_b,
                      PACT, SIGN, BLOCK_M, BLOCK_N, BLOCK_K)
    elif pid < E1:
        _grad_tile(pid - E0, dw0, db0, g0, pre0, x0, M, N0, K0, sg0, sp0, sx0, ACT0, BIAS0, BLOCK_M, BLOCK_N, BLOCK_K)
    elif JOBS > 1:
        if pid < E2:
            _grad_tile(pid - E1, dw1, db1, g1, pre1, x1, M, N1, K1, sg1, sp1, sx1, ACT1, BIAS1, BLOCK_M, BLOCK_N, BLOCK_K)
        elif JOBS > 2:
            _grad_tile(pid - E2, dw2, db2, g2, pre2, x2, M, N2, K2, sg2, sp2, sx2, ACT2, BIAS2, BLOCK_M, BLOCK_N, BLOCK_K)


# -------------------------------------------------------------------------------------- launchers
def _rows_contig(t: Tensor) -> Tensor:
    """``t`` when its last dimension is contiguous (any row stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _tiles(rows: int, cols: int, block_rows: int) -> int:
    return ((rows + block_rows - 1) // block_rows) * ((cols + _BLOCK_K - 1) // _BLOCK_K)


def _launch(product: tuple | None, jobs: Sequence[GradJob], m: int) -> tuple[Tensor | None, list[tuple[Tensor, Tensor | None]]]:
    """One launch: the product job (``(g, pre, b, act, scale, scale_mul)`` or None) and at most
    ``MAX_GRAD_JOBS`` gradient jobs over ``m`` rows."""
    dev_ref = product[0] if product is not None else jobs[0][0]
    args: list = []
    e0 = 0
    p = None
    if product is not None:
        g, pre, b, act, scale, scale_mul = product
        g, pre, b = _rows_contig(g), _rows_contig(pre), _rows_contig(b)
        n, kp = b.shape
        p = torch.empty(m, kp, device=g.device, dtype=torch.float32)
        sign = scale is not None
        args += [p, g, pre, b, scale if sign else b, float(scale_mul), n, kp, g.stride(0), pre.stride(0), b.stride(0)]
        e0 = _tiles(m, kp, _BLOCK_M)
        pact = ACT_CODES[act]
    else:
        z = dev_ref
        args += [z, z, z, z, z, 1.0, 1, 1, 1, 1, 1]
        sign, pact = False, 0
    ends, acts, biases, results = [], [], [], []
    end = e0
    for j in range(MAX_GRAD_JOBS):
        if j < len(jobs):
            g, pre, x, act, has_bias, dw_out, db_out = jobs[j]
            g, pre, x = _rows_contig(g), _rows_contig(pre), _rows_contig(x)
            n, k = pre.shape[1], x.shape[1]
            dw = dw_out if dw_out is not None and dw_out.is_contiguous() else torch.empty(n, k, device=g.device, dtype=torch.float32)
            db = None
            if has_bias:
                db = db_out if db_out is not None and db_out.is_contiguous() else torch.empty(n, device=g.device, dtype=torch.float32)
            results.append((dw, db))
            args += [dw, db if db is not None else dw, g, pre, x, n, k, g.stride(0), pre.stride(0), x.stride(0)]
            end += _tiles(n, k, _BLOCK_N)
            acts.append(ACT_CODES[act])
            biases.append(has_bias)
        else:
            z = dev_ref
            args += [z, z, z, z, z, 1, 1, 1, 1, 1]
            acts.append(0)
            biases.append(False)
        ends.append(end)
    grid = ends[len(jobs) - 1] if jobs else e0
    _feedback_bwd_kernel[(grid,)](
        *args, m, e0, ends[0], ends[1],
        PACT=pact, SIGN=sign, JOBS=len(jobs), ACT0=acts[0], ACT1=acts[1], ACT2=acts[2],
        BIAS0=biases[0], BIAS1=biases[1], BIAS2=biases[2],
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4,
    )
    return p, results


def feedback_product(g: Tensor, pre: Tensor, b: Tensor, act: str, scale: Tensor | None = None, scale_mul: float = 1.0,
                     backend: str | None = None) -> Tensor:
    """``(g ⊙ f'(pre)) · op(b)`` ``[M, KP]`` for ``g, pre [M, N]`` and ``b [N, KP]``, ``op(b) = b``
    or ``(scale · scale_mul) · sign(b)`` (``scale`` a one-element device tensor): one launch on CUDA,
    the reference elsewhere (``backend`` as ``use_triton``'s)."""
    if not use_triton(g, backend):
        return feedback_product_ref(g, pre, b, act, scale, scale_mul)
    p, _ = _launch((g, pre, b, act, scale, scale_mul), [], g.shape[0])
    return p


def dense_grads(jobs: Sequence[GradJob], backend: str | None = None) -> list[tuple[Tensor, Tensor | None]]:
    """Each job's ``(dW [N, K], db [N] or None)`` (written into the job's buffers when they are
    contiguous), ``MAX_GRAD_JOBS`` jobs per launch on CUDA; the reference elsewhere."""
    if not jobs:
        return []
    if not use_triton(jobs[0][0], backend):
        return dense_grads_ref(jobs)
    out: list[tuple[Tensor, Tensor | None]] = []
    m = jobs[0][0].shape[0]
    for lo in range(0, len(jobs), MAX_GRAD_JOBS):
        out.extend(_launch(None, jobs[lo : lo + MAX_GRAD_JOBS], m)[1])
    return out


def dense_backward_fb(g: Tensor, pre: Tensor, x: Tensor, w: Tensor, act: str, has_bias: bool, scale: Tensor | None,
                      scale_mul: float = 1.0, out: tuple[Tensor | None, Tensor | None] | None = None,
                      backend: str | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """A Dense layer's ``(dx, dW, db or None)`` with ``dx = gPre · op(w)`` (``op`` as
    ``feedback_product``'s: ``w`` itself, or sign symmetry's ``s · sign(w)``) in one launch on CUDA;
    ``out``: optional ``(dW, db)`` buffers."""
    dw_out, db_out = out if out is not None else (None, None)
    job = (g, pre, x, act, has_bias, dw_out, db_out)
    if not use_triton(g, backend):
        dx = feedback_product_ref(g, pre, w, act, scale, scale_mul)
        (dw, db), = dense_grads_ref([job])
        return dx, dw, db
    dx, ((dw, db),) = _launch((g, pre, w, act, scale, scale_mul), [job], g.shape[0])
    return dx, dw, db
