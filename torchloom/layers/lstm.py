"""``LSTM`` (Loom ``LSTM``) with full backpropagation through time written by hand.

Read top to bottom: ``lstm_forward`` / ``lstm_backward`` (the math, side by side), ``LSTMFunction``
(the autograd bridge), ``lstm`` (functional), ``LSTM`` (module).

For an input ``x [B, T, I]``, with ``h_0 = c_0 = 0`` and the four gates stacked in ``nn.LSTM``'s
order i, f, g, o (rows ``[0:H]``, ``[H:2H]``, ``[2H:3H]``, ``[3H:4H]`` of every parameter)::

    pre_t = x_t W_ihᵀ + h_{t−1} W_hhᵀ + b          ([B, 4H]: the gate pre-activations)
    i, f, o = σ(pre_t[i]), σ(pre_t[f]), σ(pre_t[o]);   g = tanh(pre_t[g])
    c_t = f ⊙ c_{t−1} + i ⊙ g;   h_t = o ⊙ tanh(c_t)   (h_t returned for every t: [B, T, H])

One bias ``b [4H]`` (Loom's merged bias): ``nn.LSTM`` with ``bias_ih = b`` and ``bias_hh = 0``
computes the same. The input projections of all steps are one matmul; the time loop then runs
(``torchloom.kernels.recurrent``) as one launch of the persistent loop kernel per direction on CUDA,
else per step the recurrent product (cuBLAS) and one fused kernel for the gates and the cell update
(its PyTorch reference on CPU and in float64). Both round what they store and carry (pre-activations,
cell states, ``dh``, the carry ``κ``) to the tensors' dtype: the same numbers up to the products' order.

BPTT, backward over t (``dh``, ``dc`` carried from step t+1, zero after the last step)::

    dh_t = gOut_t + gPre_{t+1} W_hh
    dc_t = dc_{t+1} ⊙ f_{t+1} + dh_t ⊙ o_t ⊙ (1 − tanh² c_t)
    gPre_t = [dc_t ⊙ g ⊙ i(1−i),  dc_t ⊙ c_{t−1} ⊙ f(1−f),  dc_t ⊙ i ⊙ (1−g²),  dh_t ⊙ tanh c_t ⊙ o(1−o)]

then ``dW_ih = Σ_t gPre_tᵀ x_t``, ``dW_hh = Σ_{t≥2} gPre_tᵀ h_{t−1}``, ``db = Σ gPre_t``,
``dx_t = gPre_t W_ih`` (one matmul each over all steps).

Loom stores the four gates as separate ``[W_ih | W_hh | b]`` blocks in one flat buffer; torchloom
stacks them as ``nn.LSTM`` does (``from_loom_json`` reads Dense networks only, so no mapping is needed
yet).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, empty_like, no_grad
from torch.compiler import is_compiling

from .base import autocast_off, forbid_double_backward
from .rnn import RecurrentLayer, autocast_recurrent_forward, recurrent_grads

__all__ = ["LSTM", "LSTMFunction", "LSTMSaved", "lstm", "lstm_forward", "lstm_backward"]

# The kernel functions (kernels/recurrent.py) are imported by name where they are called (see norm.py).


class LSTMSaved(NamedTuple):
    """What the LSTM's backward needs: input ``[B, T, I]``, ``weight_ih [4H, I]``, ``weight_hh
    [4H, H]``, gate pre-activations ``pre [B, T, 4H]``, cell states ``cell [B, T, H]``, hidden states
    ``hidden [B, T, H]`` (the output), whether there is a bias and, when autocast cast them, the
    parameters' dtype (their gradients come back in it). Gate activations are recomputed from
    ``pre`` in the backward (inside the fused step kernel) rather than stored."""

    input: Tensor
    weight_ih: Tensor
    weight_hh: Tensor
    pre: Tensor
    cell: Tensor
    hidden: Tensor
    has_bias: bool
    param_dtype: torch.dtype | None = None


@no_grad()
def lstm_forward(
    x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None, backend: str | None = None
) -> tuple[Tensor, LSTMSaved]:
    """``x [B, T, I]`` → ``(h [B, T, H], saved)``, gates i, f, g, o; ``h_0 = c_0 = 0``. No autograd.

    The input projections of all steps are one matmul. The time loop (``torchloom.kernels.recurrent``)
    then adds ``h_{t−1} W_hhᵀ`` and applies the gates and the cell update: on CUDA one launch of the
    persistent loop kernel; where that kernel does not apply (``lstm_loop_uses_triton``), per step a
    cuBLAS product and one fused cell kernel, replayed as a CUDA graph; on the CPU and in float64 the
    PyTorch reference of the same steps. ``backend``: None (that choice), ``"triton"`` (the Triton
    kernels, on CPU through Triton's interpreter) or ``"reference"``."""
    B, T, I = x.shape
    H = weight_hh.shape[1]
    from ..kernels.recurrent import (
        _cell_backend, ensure_graph, graphs_usable, lstm_forward_loop, lstm_forward_loop_steps,
        lstm_forward_loop_traced, lstm_forward_loop_unrolled, lstm_loop_uses_triton, projection_mm
    )

    step_backend = _cell_backend(x, backend)
    x2 = x.reshape(B * T, I)
    w_ih_t = weight_ih.t()
    loop_kernel = lstm_loop_uses_triton(x, B, H, backend)
    if step_backend == "triton" and not loop_kernel and graphs_usable(x):
        entry = _graph_entry(B, T, H, x)
        buf = entry["buffers"]
        graph = ensure_graph(entry, "forward", lambda: lstm_forward_loop_steps(buf["pre"], buf["w_hh"], buf["cell"], buf["hbuf"], "triton"))
        # Input projections (and the bias) of every step in one matmul, straight into the graph's buffer.
        out = buf["pre"].view(B * T, 4 * H)
        projection_mm(x2, w_ih_t, bias, out=out, backend=backend)
        buf["w_hh"].copy_(weight_hh)
        graph.replay()
        pre, cell, hidden = buf["pre"].clone(), buf["cell"].clone(), buf["hbuf"].clone()
        return hidden, LSTMSaved(x, weight_ih, weight_hh, pre, cell, hidden, bias is not None)
    # Input projections (and the bias) of every step in one matmul; the loop adds h_{t-1} W_hhᵀ.
    proj = projection_mm(x2, w_ih_t, bias, backend=backend).view(B, T, 4 * H)
    if is_compiling() and loop_kernel:  # opaque operators (kernels/recurrent.py)
        pre, cell, hidden = lstm_forward_loop_traced(proj, weight_hh, backend)
    elif is_compiling() and step_backend == "triton":  # fresh tensors per step
        pre, cell, hidden = lstm_forward_loop_unrolled(proj, weight_hh)
    else:
        pre, cell, hidden = proj, x.new_empty(B, T, H), x.new_empty(B, T, H)
        lstm_forward_loop(pre, weight_hh, cell, hidden, backend)
    return hidden, LSTMSaved(x, weight_ih, weight_hh, pre, cell, hidden, bias is not None)


def _graph_entry(B: int, T: int, H: int, x: Tensor) -> dict:
    """Buffers of the CUDA-graphed loops for one shape (forward and backward share pre/cell/w_hh)."""
    from ..kernels.recurrent import graph_buffers

    def make():
        e = lambda *shape: x.new_empty(*shape)  # noqa: E731
        return {"pre": e(B, T, 4 * H), "cell": e(B, T, H), "hbuf": e(B, T, H), "w_hh": e(4 * H, H),
                "g_pre": e(B, T, 4 * H), "kappa": e(B, H), "dh": e(B, H)}

    return graph_buffers(("lstm", B, T, H, x.dtype, x.device), make)


@no_grad()
def lstm_backward(
    grad_out: Tensor, saved: LSTMSaved, needs_input_grad: bool = True, backend: str | None = None
) -> tuple[Tensor | None, tuple[Tensor, Tensor, Tensor | None]]:
    """Hand-written BPTT (formulas in the module docstring). The loop over t runs as in
    ``lstm_forward`` (``backend`` likewise): one launch of the persistent loop kernel, or per step one
    cuBLAS call (``dh_t = gOut_t + gPre_{t+1} W_hh``, into a preallocated buffer) and one fused kernel
    (``dc_t``, ``gPre_t`` and the carry ``dc_t ⊙ f_t``). Returns ``(dx [B, T, I] or None, (dW_ih [4H, I],
    dW_hh [4H, H], db [4H] or None))``, the parameter gradients in ``saved.param_dtype`` when set."""
    x, weight_ih, weight_hh, pre, cell, hidden, has_bias, param_dtype = saved
    B, T, I = x.shape
    H = weight_hh.shape[1]
    from ..kernels.recurrent import (
        _cell_backend, ensure_graph, graphs_usable, lstm_backward_loop, lstm_backward_loop_steps,
        lstm_backward_loop_traced, lstm_backward_loop_unrolled, lstm_loop_uses_triton
    )

    step_backend = _cell_backend(x, backend)
    # The loops read it one time step at a time, in rows of unit stride: contiguous (a copy only when
    # it is not). No stride is read: torch.compile cannot answer that while it traces a backward.
    grad_out = (grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)).contiguous()
    loop_kernel = lstm_loop_uses_triton(x, B, H, backend)
    if is_compiling() and loop_kernel:  # opaque operators (kernels/recurrent.py)
        g_pre = lstm_backward_loop_traced(grad_out, pre, cell, weight_hh, backend)
    elif is_compiling() and step_backend == "triton":  # fresh tensors per step
        g_pre = lstm_backward_loop_unrolled(grad_out, pre, cell, weight_hh)
    elif step_backend == "triton" and not loop_kernel and graphs_usable(x):
        entry = _graph_entry(B, T, H, x)
        buf = entry["buffers"]
        graph = ensure_graph(entry, "backward", lambda: lstm_backward_loop_steps(
            buf["hbuf"], buf["pre"], buf["cell"], buf["w_hh"], buf["g_pre"], buf["kappa"], buf["dh"], "triton"))
        buf["hbuf"].copy_(grad_out)
        buf["pre"].copy_(pre)
        buf["cell"].copy_(cell)
        buf["w_hh"].copy_(weight_hh)
        graph.replay()
        g_pre = buf["g_pre"]  # read by the products below before any other replay
    else:
        g_pre = empty_like(pre)
        lstm_backward_loop(grad_out, pre, cell, weight_hh, g_pre, backend)

    grad_x, grad_w_ih, grad_w_hh, grad_b = recurrent_grads(g_pre, x, hidden, weight_ih, has_bias, needs_input_grad, backend)
    if param_dtype is not None:
        grad_w_ih, grad_w_hh = grad_w_ih.to(param_dtype), grad_w_hh.to(param_dtype)
        grad_b = None if grad_b is None else grad_b.to(param_dtype)
    return grad_x, (grad_w_ih, grad_w_hh, grad_b)


class LSTMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_ih, weight_hh, bias):
        hidden, saved = autocast_recurrent_forward(lstm_forward, x, weight_ih, weight_hh, bias)
        ctx.save_for_backward(*saved[:6])
        ctx.has_bias, ctx.param_dtype, ctx.x_dtype = saved.has_bias, saved.param_dtype, x.dtype
        return hidden

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("LSTM")
        saved = LSTMSaved(*ctx.saved_tensors, ctx.has_bias, ctx.param_dtype)
        with autocast_off(grad_out.device.type):
            grad_x, (gw_ih, gw_hh, gb) = lstm_backward(grad_out, saved, ctx.needs_input_grad[0])
        return None if grad_x is None else grad_x.to(ctx.x_dtype), gw_ih, gw_hh, gb


def lstm(x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None = None) -> Tensor:
    """Functional LSTM: ``x [B, T, I]`` → all hidden states ``[B, T, H]``; differentiable through the
    hand-written BPTT (under ``torch.autocast`` the input and parameters are cast to the autocast
    dtype, the gradients come back in their own dtypes)."""
    return LSTMFunction.apply(x, weight_ih, weight_hh, bias)


class LSTM(RecurrentLayer):
    """LSTM with gates i, f, g, o (``nn.LSTM``'s order), ``h_0 = c_0 = 0``, all hidden states returned
    (arguments: ``RecurrentLayer``).

    Parameters: ``weight_ih [4H, I]``, ``weight_hh [4H, H]``, ``bias [4H]``, gate blocks i, f, g, o.
    Shapes: input ``[B, T, I]`` → output ``[B, T, H]`` (every hidden state). ``saved.pre`` (the
    history's pre-activation) holds the gate pre-activations ``[B, T, 4H]``.
    """

    _GATES = 4
    _NAME = "LSTM"
    _function = LSTMFunction
    _forward = staticmethod(lstm_forward)
    _backward = staticmethod(lstm_backward)
