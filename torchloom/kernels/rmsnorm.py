"""RMSNorm forward and hand-written backward, each fused into one pass over the rows.

Rows are the leading dimensions of ``x [..., n]``, each normalised over its last dimension:

    forward   r = 1 / sqrt(mean(x²) + eps)         (one per row, saved for the backward)
              y = x · r · w
    backward  x̂ = x · r,  gw = g ⊙ w
              dx = r · (gw − x̂ · mean(gw ⊙ x̂))
              dw = Σ_rows g ⊙ x̂

Eager PyTorch runs the forward as ~5 kernels and the backward as ~10, each a full pass over
``[rows, n]``; the kernels read x (and g) once. The backward kernel gives each program a block of rows
and accumulates its share of ``dw`` in float32 registers, so ``dw`` costs one small ``[programs, n]``
sum instead of another pass over ``[rows, n]``. A row longer than one block (``SINGLE`` false) is
swept twice in chunks, so any ``n`` works.

Read top to bottom: ``rmsnorm_ref`` / ``rmsnorm_backward_ref`` (the spec), the Triton kernels, the
launchers ``rmsnorm`` / ``rmsnorm_backward`` (the one place that picks the kernel or the reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import row_settings, cast, compute_dtype, traced_as_reference, use_kernel

__all__ = ["rmsnorm_ref", "rmsnorm_backward_ref", "rmsnorm", "rmsnorm_backward"]


# ------------------------------------------------------------------------------------ reference
def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x [..., n]``, ``weight [n]`` → ``(y [..., n] in x's dtype, rstd [...] in the compute dtype)``."""
    xc = cast(x, compute_dtype(x))
    rstd = (xc.square().mean(dim=-1) + eps).rsqrt()
    y = xc * rstd.unsqueeze(-1) * cast(weight, xc.dtype)
    return cast(y, x.dtype), rstd


def rmsnorm_backward_ref(grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx [..., n], dw [n])`` from the upstream gradient, the input, the weight and the saved ``rstd``."""
    dt = compute_dtype(x)
    g, xc, r = cast(grad_out, dt), cast(x, dt), cast(rstd, dt).unsqueeze(-1)
    x_hat = xc * r
    gw = g * cast(weight, dt)
    dx = r * (gw - x_hat * (gw * x_hat).mean(dim=-1, keepdim=True))
    dw = (g * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return cast(dx, x.dtype), cast(dw, weight.dtype)


# -------------------------------------------------------------------------------------- kernels
@jit
def _rmsnorm_kernel(
    y_ptr,  # [R, n] out, x's dtype
    rstd_ptr,  # [R] out, float32
    x_ptr,  # [R, n], rows contiguous
    w_ptr,  # [n]
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the row fits one block: load it once
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    eps = tl.cast(eps, tl.float32)
    row = tl.program_id(0).to(tl.int64)  # int64: row · n may pass 2³¹
    x_row, y_row = x_ptr + row * n_cols, y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
        tl.store(y_row + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + c, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _rmsnorm_backward_kernel(
    dx_ptr,  # [R, n] out, x's dtype
    dw_partial_ptr,  # [programs, n] out, float32: this program's share of dw (zeroed when not SINGLE)
    g_ptr,  # [R, n] upstream gradient, rows contiguous
    x_ptr,  # [R, n], rows contiguous
    w_ptr,  # [n]
    rstd_ptr,  # [R] float32
    n_rows,
    n_cols,
    rows_per_program,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the row fits one block: w and dw stay in registers
):
    # Program p handles rows [p·rows_per_program, …) and writes its share of dw to dw_partial[p].
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    dw_row = dw_partial_ptr + pid * n_cols
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(row_start, row_end):
            g = tl.load(g_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            gw = g * w
            dx = rstd * (gw - x_hat * (tl.sum(gw * x_hat, axis=0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += g * x_hat
        tl.store(dw_row + cols, dw, mask=mask)
    else:
        for row in range(row_start, row_end):
            rstd = tl.load(rstd_ptr + row)
            acc = tl.zeros([BLOCK], dtype=tl.float32)  # sweep 1: Σ gw ⊙ x̂
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                mask = c < n_cols
                g = tl.load(g_ptr + row * n_cols + c, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + row * n_cols + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
                acc += g * w * x * rstd
            mean_gw_xhat = tl.sum(acc, axis=0) / n_cols
            for start in range(0, n_cols, BLOCK):  # sweep 2: dx, and dw into this program's row
                c = start + cols
                mask = c < n_cols
                g = tl.load(g_ptr + row * n_cols + c, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + row * n_cols + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
                x_hat = x * rstd
                dx = rstd * (g * w - x_hat * mean_gw_xhat)
                tl.store(dx_ptr + row * n_cols + c, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + c, mask=mask, other=0.0)
                tl.store(dw_row + c, dw + g * x_hat, mask=mask)


# ------------------------------------------------------------------------------------ launchers
def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _backward_programs(x: Tensor, n_rows: int) -> int:
    """Programs of the backward kernel: 4 per SM (enough to hide latency), never more than rows.
    Each writes one row of partial ``dw``, so fewer programs also mean a smaller final sum."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    return max(1, min(n_rows, 4 * sms))


def _launch_rmsnorm(x: Tensor, weight: Tensor, eps: float, block: int | None = None) -> tuple[Tensor, Tensor]:
    x2 = _rows(x)
    n = x2.shape[1]
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    default_block, num_warps = row_settings(n, x2.is_cuda)
    block = block or default_block  # an explicit block is for tests of the chunked path
    _rmsnorm_kernel[(x2.shape[0],)](
        y, rstd, x2, weight.contiguous(), n, eps, BLOCK=block, SINGLE=n <= block, num_warps=num_warps
    )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _launch_rmsnorm_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, block: int | None = None
) -> tuple[Tensor, Tensor]:
    x2, g2 = _rows(x), _rows(grad_out)
    rstd2 = rstd.reshape(-1).to(torch.float32).contiguous()
    rows, n = x2.shape
    rows_per_program = -(-rows // _backward_programs(x, rows))
    programs = -(-rows // rows_per_program)  # no program without rows
    default_block, num_warps = row_settings(n, x2.is_cuda)
    block = block or default_block
    single = n <= block
    dx = torch.empty_like(x2)
    dw_partial = (torch.empty if single else torch.zeros)(programs, n, device=x.device, dtype=torch.float32)
    _rmsnorm_backward_kernel[(programs,)](
        dx, dw_partial, g2, x2, weight.contiguous(), rstd2, rows, n, rows_per_program,
        BLOCK=block, SINGLE=single, num_warps=num_warps,
    )
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)


# Rows that fit one block run the row-tiled kernels shared with LayerNorm (``kernels/layernorm.py``:
# several rows per program, more loads in flight for short rows); longer rows the chunked kernels
# above. ``_TILED = False`` forces the kernels above (the GPU timing script compares the two).
_TILED = True


def _tiled(x: Tensor) -> bool:
    from .layernorm import fits_tiled

    return _TILED and fits_tiled(x.shape[-1], x.is_cuda)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of RMSNorm over the last dimension of ``x [..., n]`` with ``weight [n]``: the
    Triton kernel on CUDA for float32/float16/bfloat16 (``rstd [...]`` float32), the reference
    elsewhere (``backend`` as ``_triton.use_triton``)."""
    if not use_kernel(x, backend) or x.numel() == 0 or traced_as_reference("rmsnorm", x.dtype, backend):
        return rmsnorm_ref(x, weight, eps)
    if _tiled(x):
        from .layernorm import tiled_forward

        y, _, rstd = tiled_forward(x, weight, None, eps, rms=True)
        return y, rstd
    return _launch_rmsnorm(x, weight, eps)


def rmsnorm_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, backend: str | None = None
) -> tuple[Tensor, Tensor]:
    """``(dx [..., n], dw [n])`` of RMSNorm: the Triton kernel on CUDA, the reference elsewhere."""
    if not use_kernel(x, backend) or x.numel() == 0 or traced_as_reference("rmsnorm", x.dtype, backend):
        return rmsnorm_backward_ref(grad_out, x, weight, rstd)
    if _tiled(x):
        from .layernorm import tiled_backward

        dx, dw, _ = tiled_backward(grad_out, x, weight, None, rstd, has_bias=False)
        return dx, dw
    return _launch_rmsnorm_backward(grad_out, x, weight, rstd)
