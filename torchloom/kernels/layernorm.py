"""LayerNorm forward and hand-written backward, each one pass over the rows, and the row-tiled kernels
that RMSNorm shares (``RMS=True``).

Rows are the leading dimensions of ``x [..., n]``, each normalised over its last dimension:

    forward   μ = mean(x),  r = 1 / sqrt(mean((x − μ)²) + eps)     (μ, r saved: one float32 per row)
              x̂ = (x − μ)·r,  y = x̂·w + b
    backward  gw = g ⊙ w
              dx = r·(gw − mean(gw) − x̂·mean(gw ⊙ x̂))
              dw = Σ_rows g ⊙ x̂,   db = Σ_rows g

RMSNorm is the same with ``μ = 0``, no ``b`` and no ``mean(gw)`` term.

Bytes: the forward reads ``x`` and writes ``y``; the backward reads ``g`` and ``x`` and writes ``dx``
(plus ``[programs, n]`` float32 partial sums of ``dw``/``db``, reduced by one small ``sum``). That is
the floor for these ops; the flops (~10 per element) are far below the H100's ratio, so the kernels
are memory bound and the work is to keep enough loads in flight: a program normalises a tile of
``ROWS`` rows at once (``ROWS · BLOCK`` ≈ ``_TILE_ELEMS`` values), and the backward gives each program
several tiles so that ``dw``/``db`` accumulate in registers.

The tiled kernels need the row in one block (``n ≤ 8192`` on CUDA); longer rows run the reference
(LayerNorm) or RMSNorm's chunked kernel.

Read top to bottom: ``layernorm_ref`` / ``layernorm_backward_ref`` (the spec), the kernels, the
launchers ``layernorm`` / ``layernorm_backward`` (the one place that picks the kernel or the
reference) and ``tiled_forward`` / ``tiled_backward`` (shared with RMSNorm).

Under ``torch.compile`` half-precision rows hand Inductor the reference (``_triton.COMPILED_AS_REFERENCE``);
float32 rows, and any with ``backend="triton"``, reach the tiled kernels through the custom operators
``torch.ops.torchloom.norm_forward`` / ``torch.ops.torchloom.norm_backward`` (``torch.library.triton_op``,
the launches wrapped by ``torch.library.wrap_triton``): Dynamo records one op node each, and
AOTAutograd hands Inductor the Triton kernels themselves. Eager calls launch them directly.
"""

from __future__ import annotations

import functools
from typing import Optional  # (the operators' schemas are read from their annotations)

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ._tl import jit, tl, triton
from ._triton import cast, compute_dtype, traced_as_reference, triton_operator, use_kernel
from ._triton import device_index, sm_count as _sm_count

__all__ = ["layernorm_ref", "layernorm_backward_ref", "layernorm", "layernorm_backward", "fits_tiled", "OP_NAMES"]

_CUDA_MAX_BLOCK = 8192  # a row up to this length sits in registers in one piece
_INTERPRETER_MAX_BLOCK = 1 << 16
# Launch settings: values per tile, programs per SM in the backward (capped below so that the float32
# partial sums of dw/db stay a small fraction of the input), values per thread (warps capped at 16).
# In an eager loop at 8192 rows of 1024 the layer's time is the host's (launch and autograd overhead),
# not the kernels': the settings only show in a CUDA-graphed step (bench/bench_layers.py, graphed).
_TILE_ELEMS = 4096
_PROGRAMS_PER_SM = 4
_ELEMS_PER_THREAD = 16
# The backward's dw/db partial rows: at most one per this many bytes of a column of x, at least one per
# SM. Measured on an H100 (8192 rows of 1024, layer step in a CUDA graph): 256 instead of 64 cut the
# float32 step by 8-15 % and the peak memory from 1.13x to 1.03x the input's; bfloat16 (fewer
# programs then) lost 10-20 % but its peak fell from 1.13x to 1.07x.
_COLUMN_BYTES_PER_PARTIAL = 256


# ------------------------------------------------------------------------------------ reference
def layernorm_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``x [..., n]``, ``weight [n]``, ``bias [n]`` → ``(y [..., n] in x's dtype, mean [...],
    rstd [...])`` (mean and rstd in the compute dtype; biased variance)."""
    dt = compute_dtype(x)
    xc = cast(x, dt)
    mean = xc.mean(dim=-1)
    centered = xc - mean.unsqueeze(-1)
    rstd = (centered.square().mean(dim=-1) + eps).rsqrt()
    y = centered * rstd.unsqueeze(-1) * cast(weight, dt) + cast(bias, dt)
    return cast(y, x.dtype), mean, rstd


def layernorm_backward_ref(
    grad_out: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx [..., n] in x's dtype, dw [n], db [n] in weight's dtype)`` from the upstream gradient, the
    input, the weight and the saved ``mean``, ``rstd``."""
    dt = compute_dtype(x)
    n = x.shape[-1]
    g, r = cast(grad_out, dt), cast(rstd, dt).unsqueeze(-1)
    x_hat = (cast(x, dt) - cast(mean, dt).unsqueeze(-1)) * r
    gw = g * cast(weight, dt)
    dx = r * (gw - gw.mean(dim=-1, keepdim=True) - x_hat * (gw * x_hat).mean(dim=-1, keepdim=True))
    dw = (g * x_hat).reshape(-1, n).sum(0)
    db = g.reshape(-1, n).sum(0)
    return cast(dx, x.dtype), cast(dw, weight.dtype), cast(db, weight.dtype)


# -------------------------------------------------------------------------------------- kernels
@jit
def _norm_forward_kernel(
    y_ptr,  # [R, n] out, x's dtype
    mean_ptr,  # [R] out, float32 (unused when RMS)
    rstd_ptr,  # [R] out, float32
    x_ptr,  # [R, n], rows contiguous
    w_ptr,  # [n]
    b_ptr,  # [n] (unused without HAS_BIAS)
    n_rows,
    n_cols,
    eps,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    eps = tl.cast(eps, tl.float32)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: row · n may pass 2³¹
    cols = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        tl.store(mean_ptr + rows, mean, mask=rmask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y += b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _norm_backward_kernel(
    dx_ptr,  # [R, n] out, x's dtype
    partial_ptr,  # [programs, 1 + HAS_BIAS, n] out, float32: this program's share of dw (and of db)
    g_ptr,  # [R, n] upstream gradient, rows contiguous
    x_ptr,  # [R, n], rows contiguous
    w_ptr,  # [n]
    mean_ptr,  # [R] float32 (unused when RMS)
    rstd_ptr,  # [R] float32
    n_rows,
    n_cols,
    tiles_per_program,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for t in range(0, tiles_per_program):
        rows = (pid * tiles_per_program + t) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        if RMS:
            x_hat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        gw = g * w[None, :]
        c1 = tl.sum(gw * x_hat, axis=1) / n_cols
        if RMS:
            dx = rstd[:, None] * (gw - x_hat * c1[:, None])
        else:
            c2 = tl.sum(gw, axis=1) / n_cols
            dx = rstd[:, None] * (gw - c2[:, None] - x_hat * c1[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(g * x_hat, axis=0)
        if HAS_BIAS:
            db += tl.sum(g, axis=0)
    if HAS_BIAS:  # dw's and db's rows side by side: one sum of the partials makes both
        tl.store(partial_ptr + pid * 2 * n_cols + cols, dw, mask=cmask)
        tl.store(partial_ptr + pid * 2 * n_cols + n_cols + cols, db, mask=cmask)
    else:
        tl.store(partial_ptr + pid * n_cols + cols, dw, mask=cmask)


# ------------------------------------------------------------------------------------ launchers
def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fits_tiled(n_cols: int, is_cuda: bool) -> bool:
    """Whether a row of ``n_cols`` fits the tiled kernels' single block."""
    return n_cols <= (_CUDA_MAX_BLOCK if is_cuda else _INTERPRETER_MAX_BLOCK)


@functools.lru_cache(maxsize=None)
def _settings(n_cols: int, is_cuda: bool) -> tuple[int, int, int]:
    """``(ROWS, BLOCK, num_warps)``: the row rounded up to a power of two, as many rows per tile as
    make ``_TILE_ELEMS`` values, ``_ELEMS_PER_THREAD`` values per thread (1 to 16 warps)."""
    block = max(_next_pow2(n_cols), 16)
    rows = max(1, _TILE_ELEMS // block) if is_cuda else max(1, min(16, 1024 // block))
    num_warps = min(max(rows * block // (32 * _ELEMS_PER_THREAD), 1), 16) if is_cuda else 4
    return rows, block, num_warps


def _grid(n_rows, n_cols: int, element_size: int, device_index: int | None):
    """``(programs, tiles_per_program)`` of the backward (``device_index=None``: the interpreter).
    Each program writes one float32 row of dw (and db) partials: at most one per
    ``_COLUMN_BYTES_PER_PARTIAL`` (256) bytes of a column of x, so the partials stay a small fraction
    of x's size (peak memory), but at least one per SM. ``n_rows`` may be symbolic (a compiled graph
    with dynamic sizes): ``torch.sym_min`` / ``sym_max`` keep the grid a formula of it."""
    rows, _, _ = _settings(n_cols, device_index is not None)
    tiles = -(-n_rows // rows)
    sms = _sm_count(device_index) if device_index is not None else 2
    cap = torch.sym_max(sms, n_rows * element_size // _COLUMN_BYTES_PER_PARTIAL)
    programs = torch.sym_max(1, torch.sym_min(tiles, torch.sym_min(_PROGRAMS_PER_SM * sms, cap)))
    tiles_per_program = -(-tiles // programs)
    return -(-tiles // tiles_per_program), tiles_per_program  # no program without rows


# Cached per shape for eager calls (at most 1,024 shapes).
_backward_grid = functools.lru_cache(maxsize=1024)(_grid)


def _dense(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


# ------------------------------------------------------------------------------------ operators
OP_NAMES = ("torchloom::norm_forward", "torchloom::norm_backward")


def _norm_forward_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.torchloom.norm_forward``: ``(y, mean, rstd)`` of the tiled kernel, fresh tensors
    (``mean`` unwritten when ``rms``); run on fake tensors, also the operator's shape function. Every
    buffer the kernel gets is its own (a functional trace copies each one a kernel writes)."""
    x2 = x.contiguous()
    n = x2.shape[-1]
    n_rows = x2.numel() // n
    rows, block, num_warps = _settings(int(n), x2.is_cuda)  # (a symbolic row length is specialised)
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[:-1], device=x2.device, dtype=torch.float32)
    mean = torch.empty_like(rstd)
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else w  # read by no RMS program: no buffer of its own
    torch.library.wrap_triton(_norm_forward_kernel)[(-(-n_rows // rows),)](
        y, mean, rstd, x2, w, b, n_rows, n, eps,
        RMS=rms, HAS_BIAS=bias is not None, ROWS=rows, BLOCK=block, num_warps=num_warps,
    )
    return y, mean, rstd


def _norm_backward_op(
    grad_out: Tensor, x: Tensor, weight: Tensor, mean: Optional[Tensor], rstd: Tensor, has_bias: bool
) -> tuple[Tensor, Tensor]:
    """``torch.ops.torchloom.norm_backward``: ``(dx, sums)``, fresh tensors; ``sums [2, n]`` holds
    ``dw`` and ``db`` (``[1, n]``, ``dw`` alone, without ``has_bias``) in the weight's dtype: one
    reduction of the partials for both, which a compiled graph launches once (the caller takes the
    rows; an operator's outputs may not be views of one another). LayerNorm with ``mean``, RMSNorm
    without."""
    x2, g2 = x.contiguous(), grad_out.contiguous()
    n = x2.shape[-1]
    n_rows = x2.numel() // n
    rows, block, num_warps = _settings(int(n), x2.is_cuda)
    programs, tiles_per_program = _grid(n_rows, int(n), x2.element_size(), device_index(x2))
    dx = torch.empty_like(x2)
    partial = torch.empty(programs, 2 if has_bias else 1, n, device=x2.device, dtype=torch.float32)
    rstd2 = rstd.to(torch.float32).contiguous()
    mean2 = rstd2 if mean is None else mean.to(torch.float32).contiguous()  # read by no RMS program
    torch.library.wrap_triton(_norm_backward_kernel)[(programs,)](
        dx, partial, g2, x2, weight.contiguous(), mean2, rstd2, n_rows, n, tiles_per_program,
        RMS=mean is None, HAS_BIAS=has_bias, ROWS=rows, BLOCK=block, num_warps=num_warps,
    )
    return dx, partial.sum(0).to(weight.dtype)


# The operators, as the traced code calls them (None without Triton: the layers never reach the kernels)
_NORM_FORWARD, _NORM_BACKWARD = (
    (triton_operator(OP_NAMES[0], _norm_forward_op), triton_operator(OP_NAMES[1], _norm_backward_op))
    if triton is not None else (None, None))


# The launchers below run on every call of a layer, so they keep the host's work small (at a few
# thousand rows the layer's time is the host's, not the GPU's): no reshapes (the kernels index
# contiguous rows), the launch settings cached per shape.
def tiled_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(y, mean or None, rstd)`` of LayerNorm (``rms=False``) or RMSNorm (``rms=True``, no bias)
    through the tiled kernel; ``mean``/``rstd`` float32 of shape ``x.shape[:-1]``. While
    ``torch.compile`` traces: the operator ``torch.ops.torchloom.norm_forward``."""
    if is_compiling():
        y, mean, rstd = _NORM_FORWARD(x, weight, bias, eps, rms)
        return y, (None if rms else mean), rstd
    x2 = _dense(x)
    n = x2.shape[-1]
    n_rows = x2.numel() // n
    rows, block, num_warps = _settings(n, x2.is_cuda)
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[:-1], device=x2.device, dtype=torch.float32)
    mean = rstd if rms else torch.empty_like(rstd)
    w = _dense(weight)
    b = _dense(bias) if bias is not None else w
    _norm_forward_kernel[(-(-n_rows // rows),)](
        y, mean, rstd, x2, w, b, n_rows, n, eps,
        RMS=rms, HAS_BIAS=bias is not None, ROWS=rows, BLOCK=block, num_warps=num_warps,
    )
    return y, (None if rms else mean), rstd


def tiled_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor, has_bias: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dx, dw, db or None)`` of LayerNorm (``mean`` given) or RMSNorm (``mean=None``) through the
    tiled kernel; ``dx`` in ``x``'s dtype, ``dw``/``db`` in ``weight``'s. While ``torch.compile``
    traces: the operator ``torch.ops.torchloom.norm_backward``."""
    if is_compiling():
        dx, sums = _NORM_BACKWARD(grad_out, x, weight, mean, rstd, has_bias)
        return dx, sums[0], (sums[1] if has_bias else None)
    x2, g2 = _dense(x), _dense(grad_out)
    n = x2.shape[-1]
    n_rows = x2.numel() // n
    rows, block, num_warps = _settings(n, x2.is_cuda)
    programs, tiles_per_program = _backward_grid(n_rows, n, x2.element_size(), device_index(x2))
    dx = torch.empty_like(x2)
    partial = torch.empty(programs, 2 if has_bias else 1, n, device=x.device, dtype=torch.float32)
    rstd2 = _dense(rstd if rstd.dtype == torch.float32 else rstd.to(torch.float32))
    mean2 = rstd2 if mean is None else _dense(mean if mean.dtype == torch.float32 else mean.to(torch.float32))
    _norm_backward_kernel[(programs,)](
        dx, partial, g2, x2, _dense(weight), mean2, rstd2, n_rows, n, tiles_per_program,
        RMS=mean is None, HAS_BIAS=has_bias, ROWS=rows, BLOCK=block, num_warps=num_warps,
    )
    sums = partial.sum(0)  # [1 or 2, n]: dw (and db), one reduction and at most one cast for both
    if sums.dtype != weight.dtype:
        sums = sums.to(weight.dtype)
    return dx, sums[0], (sums[1] if has_bias else None)


def layernorm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, backend: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of LayerNorm over the last dimension of ``x [..., n]``: the Triton kernel on
    CUDA for float32/float16/bfloat16 rows up to 8192 (``mean``, ``rstd`` float32), the reference
    elsewhere (``backend`` as ``_triton.use_triton``)."""
    if (
        not use_kernel(x, backend) or x.numel() == 0 or not fits_tiled(x.shape[-1], x.is_cuda)
        or traced_as_reference("layernorm", x.dtype, backend)
    ):
        return layernorm_ref(x, weight, bias, eps)
    y, mean, rstd = tiled_forward(x, weight, bias, eps, rms=False)
    return y, mean, rstd


def layernorm_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, backend: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dw, db)`` of LayerNorm: the Triton kernel on CUDA, the reference elsewhere."""
    if (
        not use_kernel(x, backend) or x.numel() == 0 or not fits_tiled(x.shape[-1], x.is_cuda)
        or traced_as_reference("layernorm", x.dtype, backend)
    ):
        return layernorm_backward_ref(grad_out, x, weight, mean, rstd)
    dx, dw, db = tiled_backward(grad_out, x, weight, mean, rstd, has_bias=True)
    return dx, dw, db
