"""Row-wise softmax with temperature and its hand-written backward, each fused into one kernel.

Rows are the leading dimensions of ``x [..., C]``; every row is normalised on its own, so nothing
crosses batch samples (Loom's softmax spans the whole batch: not replicated, see docs/PARITY.md).

    forward   p  = softmax(x / T)
    backward  dx = p ⊙ (g − ⟨g, p⟩) / T      (⟨g, p⟩ = Σ_j g_j p_j per row, from the saved output p)

Eager PyTorch runs the hand-written backward as four kernels (``g*p``, the row sum, the subtraction,
the scaling) that move the ``[rows, C]`` data about seven times; the fused kernel reads ``g`` and
``p`` once and writes ``dx`` once. The forward fuses the ``x / T`` scaling into the softmax.

One program per row. A row that fits one block (``SINGLE``) is loaded once and kept in registers;
a longer row is swept twice in chunks (online max and sum, then the output), so any ``C`` works.

Read top to bottom: ``softmax_ref`` / ``softmax_backward_ref`` (the spec), the Triton kernels, the
launchers ``softmax`` / ``softmax_backward`` (the one place that picks the kernel or the reference).

Under ``torch.compile`` softmax hands Inductor its reference (``_triton.COMPILED_AS_REFERENCE``). With
that table emptied, or ``backend="triton"``, the kernels are reached through the custom operators
``torch.ops.torchloom.softmax`` / ``torch.ops.torchloom.softmax_backward`` (``torch.library.triton_op``,
the launches wrapped by ``torch.library.wrap_triton``): Dynamo records one op node each, and
AOTAutograd hands Inductor the Triton kernels themselves. Eager calls launch them directly.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ._tl import jit, tl, triton
from ._triton import row_settings, cast, compute_dtype, traced_as_reference, triton_operator, use_kernel

__all__ = ["softmax_ref", "softmax_backward_ref", "softmax", "softmax_backward", "OP_NAMES"]


# ------------------------------------------------------------------------------------ reference
def softmax_ref(x: Tensor, temperature: float = 1.0) -> Tensor:
    """``softmax(x / T)`` over the last dimension; ``x [..., C]`` → ``p [..., C]`` in ``x``'s dtype."""
    xc = cast(x, compute_dtype(x))
    return cast((xc / temperature).softmax(dim=-1), x.dtype)


def softmax_backward_ref(grad_out: Tensor, p: Tensor, temperature: float = 1.0) -> Tensor:
    """``dx = p ⊙ (g − ⟨g, p⟩) / T`` over the last dimension, from the saved output ``p [..., C]``."""
    dt = compute_dtype(p)
    g, pc = cast(grad_out, dt), cast(p, dt)
    dot = (g * pc).sum(dim=-1, keepdim=True)
    return cast(pc * (g - dot) / temperature, p.dtype)


# -------------------------------------------------------------------------------------- kernels
@jit
def _softmax_kernel(
    out_ptr,  # [R, C] out, x's dtype
    x_ptr,  # [R, C], rows contiguous
    n_cols,
    inv_temperature,  # 1/T
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the row fits one block
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    inv_temperature = tl.cast(inv_temperature, tl.float32)
    row = tl.program_id(0).to(tl.int64)  # int64: row · C may pass 2³¹
    x_row = x_ptr + row * n_cols
    out_row = out_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
        e = tl.exp(x - tl.max(x, axis=0))  # masked lanes: exp(−inf) = 0
        tl.store(out_row + cols, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Sweep 1: running max m and s = Σ exp(x − m). While every value seen is −inf (a masked
        # prefix) the shift is 0 instead of m, so exp(−inf − (−inf)) = NaN never happens.
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32) * inv_temperature
        m = tl.max(x, axis=0)
        shift = tl.where(m == -float("inf"), 0.0, m)
        s = tl.sum(tl.exp(x - shift), axis=0)
        for start in range(BLOCK, n_cols, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=-float("inf")).to(tl.float32) * inv_temperature
            m = tl.maximum(m, tl.max(x, axis=0))
            new_shift = tl.where(m == -float("inf"), 0.0, m)
            s = s * tl.exp(shift - new_shift) + tl.sum(tl.exp(x - new_shift), axis=0)
            shift = new_shift
        # Sweep 2: the probabilities.
        inv_s = 1.0 / s
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
            tl.store(out_row + c, (tl.exp(x - shift) * inv_s).to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _softmax_backward_kernel(
    dx_ptr,  # [R, C] out, p's dtype
    g_ptr,  # [R, C] upstream gradient, rows contiguous
    p_ptr,  # [R, C] saved output, rows contiguous
    n_cols,
    inv_temperature,  # 1/T
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the row fits one block
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    inv_temperature = tl.cast(inv_temperature, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    g_row, p_row, dx_row = g_ptr + row * n_cols, p_ptr + row * n_cols, dx_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n_cols
        g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
        dx = p * (g - tl.sum(g * p, axis=0)) * inv_temperature
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)  # sweep 1: ⟨g, p⟩
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            g = tl.load(g_row + c, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_row + c, mask=mask, other=0.0).to(tl.float32)
            acc += g * p
        dot = tl.sum(acc, axis=0)
        for start in range(0, n_cols, BLOCK):  # sweep 2: dx
            c = start + cols
            mask = c < n_cols
            g = tl.load(g_row + c, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_row + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + c, (p * (g - dot) * inv_temperature).to(dx_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------ launchers
def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _launch_softmax(x: Tensor, temperature: float, block: int | None = None) -> Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    n = x2.shape[1]
    default_block, num_warps = row_settings(n, x2.is_cuda)
    block = block or default_block  # an explicit block is for tests of the chunked path
    _softmax_kernel[(x2.shape[0],)](out, x2, n, 1.0 / temperature, BLOCK=block, SINGLE=n <= block, num_warps=num_warps)
    return out.view(x.shape)


def _launch_softmax_backward(grad_out: Tensor, p: Tensor, temperature: float, block: int | None = None) -> Tensor:
    g2, p2 = _rows(grad_out), _rows(p)
    dx = torch.empty_like(p2)
    n = p2.shape[1]
    default_block, num_warps = row_settings(n, p2.is_cuda)
    block = block or default_block
    _softmax_backward_kernel[(p2.shape[0],)](
        dx, g2, p2, n, 1.0 / temperature, BLOCK=block, SINGLE=n <= block, num_warps=num_warps
    )
    return dx.view(p.shape)


# ------------------------------------------------------------------------------------ operators
OP_NAMES = ("torchloom::softmax", "torchloom::softmax_backward")


def _softmax_op(x: Tensor, temperature: float) -> Tensor:
    """``torch.ops.torchloom.softmax``: a fresh ``[..., C]`` output (run on fake tensors, also the
    operator's shape function; a symbolic row length is specialised, the row count stays symbolic)."""
    n = int(x.shape[-1])
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    block, num_warps = row_settings(n, x2.is_cuda)
    torch.library.wrap_triton(_softmax_kernel)[(x2.shape[0],)](
        out, x2, n, 1.0 / temperature, BLOCK=block, SINGLE=n <= block, num_warps=num_warps
    )
    return out


def _softmax_backward_op(grad_out: Tensor, p: Tensor, temperature: float) -> Tensor:
    """``torch.ops.torchloom.softmax_backward``: a fresh ``dx`` of ``p``'s shape."""
    n = int(p.shape[-1])
    g2, p2 = grad_out.reshape(-1, n).contiguous(), p.reshape(-1, n).contiguous()
    dx = torch.empty(p.shape, device=p.device, dtype=p.dtype)
    block, num_warps = row_settings(n, p2.is_cuda)
    torch.library.wrap_triton(_softmax_backward_kernel)[(p2.shape[0],)](
        dx, g2, p2, n, 1.0 / temperature, BLOCK=block, SINGLE=n <= block, num_warps=num_warps
    )
    return dx


# The operators, as the traced code calls them (None without Triton: the layer never reaches the kernels)
_SOFTMAX, _SOFTMAX_BACKWARD = (
    (triton_operator(OP_NAMES[0], _softmax_op), triton_operator(OP_NAMES[1], _softmax_backward_op))
    if triton is not None else (None, None))


def softmax(x: Tensor, temperature: float = 1.0, backend: str | None = None) -> Tensor:
    """``softmax(x / T)`` over the last dimension of ``x [..., C]``: the Triton kernel on CUDA for
    float32/float16/bfloat16, the reference elsewhere (``backend`` as ``_triton.use_triton``); while
    ``torch.compile`` traces, the reference (or, where ``COMPILED_AS_REFERENCE`` does not name it, the
    operator ``torch.ops.torchloom.softmax``)."""
    if not use_kernel(x, backend) or x.numel() == 0 or traced_as_reference("softmax", x.dtype, backend):
        return softmax_ref(x, temperature)
    if is_compiling():
        return _SOFTMAX(x, float(temperature))
    return _launch_softmax(x, temperature)


def softmax_backward(grad_out: Tensor, p: Tensor, temperature: float = 1.0, backend: str | None = None) -> Tensor:
    """``p ⊙ (g − ⟨g, p⟩) / T`` over the last dimension; ``grad_out`` and ``p`` are ``[..., C]``. The
    Triton kernel on CUDA, the reference elsewhere; while ``torch.compile`` traces, as ``softmax``
    (the reference, or the operator ``torch.ops.torchloom.softmax_backward``)."""
    if not use_kernel(p, backend) or p.numel() == 0 or traced_as_reference("softmax", p.dtype, backend):
        return softmax_backward_ref(grad_out, p, temperature)
    if is_compiling():
        return _SOFTMAX_BACKWARD(grad_out, p, float(temperature))
    return _launch_softmax_backward(grad_out, p, temperature)
