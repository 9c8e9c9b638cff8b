"""The SwiGLU gate, ``a = silu(gate) ⊙ up``, and its hand-written backward, each one elementwise pass.

The projections around the gate (``x W_gateᵀ``, ``x W_upᵀ``, ``a W_downᵀ``) are matrix products and
stay with cuBLAS; the gate between them is pure memory traffic, which is what fusing saves:

    forward   a  = g · σ(g) · u
    backward  dg = da · u · σ(g) · (1 + g · (1 − σ(g)))      (silu'(g))
              du = da · g · σ(g)                              (silu(g))

Eager PyTorch runs the forward as 2 kernels (silu, multiply) and the backward as ~7; the kernels read
``g``, ``u`` (and ``da``) once and write ``a`` (or ``dg``, ``du``) once.

Read top to bottom: ``swiglu_ref`` / ``swiglu_backward_ref`` (the spec), the Triton kernels, the
launchers ``swiglu`` / ``swiglu_backward`` (the one place that picks the kernel or the reference).

Under ``torch.compile`` the gate hands Inductor its reference (``_triton.COMPILED_AS_REFERENCE``:
Inductor fuses it with its neighbours). With that table emptied, or ``backend="triton"``, the kernels
are reached through the custom operators ``torch.ops.torchloom.swiglu`` /
``torch.ops.torchloom.swiglu_backward`` / ``swiglu_backward_`` (the gradient of the gate written over
the incoming gradient) (``torch.library.triton_op``, the launches wrapped by
``torch.library.wrap_triton``): Dynamo records one op node each, and AOTAutograd hands Inductor the
Triton kernels themselves. Eager calls launch them directly.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ._tl import jit, tl, triton
from ._triton import elementwise_settings, cast, compute_dtype, traced_as_reference, triton_operator, use_kernel

__all__ = ["swiglu_ref", "swiglu_backward_ref", "swiglu", "swiglu_backward", "OP_NAMES"]


# ------------------------------------------------------------------------------------ reference
def swiglu_ref(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) ⊙ up``; ``gate``, ``up`` of one shape → the same shape, in ``gate``'s dtype."""
    dt = compute_dtype(gate)
    g, u = cast(gate, dt), cast(up, dt)
    return cast(g * g.sigmoid() * u, gate.dtype)


def swiglu_backward_ref(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """``(d_gate, d_up)`` from the gradient ``grad`` w.r.t. ``silu(gate) ⊙ up`` (all of one shape)."""
    dt = compute_dtype(gate)
    da, g, u = cast(grad, dt), cast(gate, dt), cast(up, dt)
    s = g.sigmoid()
    d_gate = da * u * s * (1.0 + g * (1.0 - s))
    d_up = da * g * s
    return cast(d_gate, gate.dtype), cast(d_up, up.dtype)


# -------------------------------------------------------------------------------------- kernels
@jit
def _swiglu_kernel(
    a_ptr,  # [N] out, gate's dtype
    g_ptr,  # [N] gate projection
    u_ptr,  # [N] up projection
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: N may pass 2³¹
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(a_ptr + offs, (g * tl.sigmoid(g) * u).to(a_ptr.dtype.element_ty), mask=mask)


@jit
def _swiglu_backward_kernel(
    dg_ptr,  # [N] out, gate's dtype
    du_ptr,  # [N] out, up's dtype
    da_ptr,  # [N] gradient w.r.t. a = silu(g) ⊙ u
    g_ptr,  # [N]
    u_ptr,  # [N]
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    da = tl.load(da_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dg_ptr + offs, (da * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (da * g * s).to(du_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------ operators
OP_NAMES = ("torchloom::swiglu", "torchloom::swiglu_backward", "torchloom::swiglu_backward_")


def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    """``torch.ops.torchloom.swiglu``: the forward kernel on contiguous copies, a fresh output (run on
    fake tensors, also the operator's shape function)."""
    g, u = gate.contiguous(), up.contiguous()
    a = torch.empty_like(g)
    block, num_warps, programs = elementwise_settings(g.numel(), g.is_cuda)
    torch.library.wrap_triton(_swiglu_kernel)[(programs,)](a, g, u, g.numel(), BLOCK=block, num_warps=num_warps)
    return a


def _swiglu_backward_op(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.ops.torchloom.swiglu_backward``: ``(d_gate, d_up)``, fresh outputs."""
    da, g, u = grad.contiguous(), gate.contiguous(), up.contiguous()
    d_gate, d_up = torch.empty_like(g), torch.empty_like(u)
    block, num_warps, programs = elementwise_settings(g.numel(), g.is_cuda)
    torch.library.wrap_triton(_swiglu_backward_kernel)[(programs,)](
        d_gate, d_up, da, g, u, g.numel(), BLOCK=block, num_warps=num_warps
    )
    return d_gate, d_up


def _swiglu_backward_inplace_op(grad: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """``torch.ops.torchloom.swiglu_backward_``: ``d_gate`` written over ``grad`` (contiguous, ``gate``'s
    shape and dtype: every element is read before it is overwritten), ``d_up`` returned fresh. Inductor
    re-inplaces the write when ``grad`` is not used after (the layer's backward): one ``[rows, m]``
    tensor less at the backward's peak than the functional operator, as in eager calls."""
    g, u = gate.contiguous(), up.contiguous()
    d_up = torch.empty_like(u)
    block, num_warps, programs = elementwise_settings(g.numel(), g.is_cuda)
    torch.library.wrap_triton(_swiglu_backward_kernel)[(programs,)](
        grad, d_up, grad, g, u, g.numel(), BLOCK=block, num_warps=num_warps
    )
    return d_up


# The operators, as the traced code calls them (None without Triton: the layer never reaches the kernels)
_SWIGLU, _SWIGLU_BACKWARD, _SWIGLU_BACKWARD_ = (
    (triton_operator(OP_NAMES[0], _swiglu_op), triton_operator(OP_NAMES[1], _swiglu_backward_op),
     triton_operator(OP_NAMES[2], _swiglu_backward_inplace_op, mutates_args=("grad",)))
    if triton is not None else (None, None, None))


# ------------------------------------------------------------------------------------ launchers
def swiglu(gate: Tensor, up: Tensor, backend: str | None = None) -> Tensor:
    """``silu(gate) ⊙ up`` (same shapes): the Triton kernel on CUDA for float32/float16/bfloat16, the
    reference elsewhere (``backend`` as ``_triton.use_triton``); while ``torch.compile`` traces, the
    reference (``_triton.COMPILED_AS_REFERENCE``), or with ``backend="triton"`` the operator
    ``torch.ops.torchloom.swiglu``."""
    if not use_kernel(gate, backend) or gate.numel() == 0 or traced_as_reference("swiglu", gate.dtype, backend):
        return swiglu_ref(gate, up)
    if is_compiling():
        return _SWIGLU(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    a = torch.empty_like(g)
    block, num_warps, programs = elementwise_settings(g.numel(), g.is_cuda)
    _swiglu_kernel[(programs,)](a, g, u, g.numel(), BLOCK=block, num_warps=num_warps)
    return a


def swiglu_backward(
    grad: Tensor, gate: Tensor, up: Tensor, backend: str | None = None, out_gate: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(d_gate, d_up)`` of ``silu(gate) ⊙ up``: the Triton kernel on CUDA, the reference elsewhere.

    ``out_gate``: a buffer for ``d_gate`` (used when it is contiguous with ``gate``'s shape and dtype,
    else ignored); it may be ``grad`` itself: every element of ``grad`` is read before ``d_gate`` is
    written at the same place, so the gradient overwrites ``grad`` and saves one allocation. While
    ``torch.compile`` traces: the reference (``_triton.COMPILED_AS_REFERENCE``), or with
    ``backend="triton"`` the operator ``torch.ops.torchloom.swiglu_backward_`` (``d_gate`` over
    ``grad``) when ``out_gate`` is ``grad`` itself and fits, else ``torch.ops.torchloom.swiglu_backward``
    (fresh outputs)."""
    if not use_kernel(gate, backend) or gate.numel() == 0 or traced_as_reference("swiglu", gate.dtype, backend):
        return swiglu_backward_ref(grad, gate, up)
    if is_compiling():
        if out_gate is grad and grad.is_contiguous() and grad.shape == gate.shape and grad.dtype == gate.dtype:
            return grad, _SWIGLU_BACKWARD_(grad, gate, up)
        return _SWIGLU_BACKWARD(grad, gate, up)
    da, g, u = grad.contiguous(), gate.contiguous(), up.contiguous()
    fits = out_gate is not None and out_gate.is_contiguous() and out_gate.shape == g.shape and out_gate.dtype == g.dtype
    d_gate, d_up = (out_gate if fits else torch.empty_like(g)), torch.empty_like(u)
    block, num_warps, programs = elementwise_settings(g.numel(), g.is_cuda)
    _swiglu_backward_kernel[(programs,)](d_gate, d_up, da, g, u, g.numel(), BLOCK=block, num_warps=num_warps)
    return d_gate, d_up
