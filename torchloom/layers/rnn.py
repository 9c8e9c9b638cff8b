"""Elman ``RNN`` (Loom ``RNN``) with full backpropagation through time written by hand, and
``LastStep``, which keeps a sequence's last time step.

Read top to bottom: ``rnn_forward`` / ``rnn_backward`` (the math, side by side), ``RNNFunction``
(the autograd bridge), ``rnn`` (functional), ``RNN`` (module), then ``LastStep``.

For an input ``x [B, T, I]``, with ``h_0 = 0``::

    pre_t = x_t W_ihᵀ + h_{t−1} W_hhᵀ + b        (pre-activation, [B, H])
    h_t   = tanh(pre_t)                         (returned for every t: [B, T, H])

One bias ``b`` (Loom's layout): it equals ``nn.RNN`` with ``bias_ih = b`` and ``bias_hh = 0``. The
input projections ``x_t W_ihᵀ + b`` of all steps are one matmul; only the recurrent product runs per
step. BPTT goes backward over t with ``dh_t = gOut_t + gPre_{t+1} W_hh`` and
``gPre_t = dh_t ⊙ (1 − h_t²)``; the weight and input gradients are then one matmul each over all steps.

RNN and LSTM under ``torch.autocast``: the input and parameters are cast to the autocast dtype, the
whole recurrence runs in it, and the gradients come back in the input's and parameters' own dtypes;
half-precision parameters work as they are. Outside autocast an input whose dtype differs from the
parameters' is a ``TypeError``. Not supported, each failing with a ``RuntimeError``: double backward
(``create_graph=True``), ``torch.func`` transforms (``vmap``, ``grad``...) and ``torch.jit.script``;
``torch.func.functional_call`` works.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, empty, empty_like, float64, is_tensor, mul, nn, no_grad
from torch.compiler import is_compiling

from .base import column_sum, Layer, autocast_off, cast_for_autocast, check_dtype, forbid_double_backward

__all__ = [
    "RecurrentLayer", "RNN", "RNNFunction", "RNNSaved", "LastStep", "rnn", "rnn_forward", "rnn_backward",
    "autocast_recurrent_forward",
]

_RNN_INITS = ("uniform", "loom_uniform")

# The kernel functions (kernels/recurrent.py) are imported by name where they are called (see norm.py).


class RNNSaved(NamedTuple):
    """What the RNN's backward needs: input ``[B, T, I]``, ``weight_ih [H, I]``, ``weight_hh [H, H]``,
    pre-activations ``[B, T, H]``, hidden states ``h_1 … h_T`` ``[B, T, H]`` (the output) and whether
    there is a bias."""

    input: Tensor
    weight_ih: Tensor
    weight_hh: Tensor
    pre: Tensor
    hidden: Tensor
    has_bias: bool
    param_dtype: torch.dtype | None = None  # set when autocast cast the parameters: grads come back in it


def autocast_recurrent_forward(forward, x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None):
    """Run ``forward(x, weight_ih, weight_hh, bias)`` (``rnn_forward`` / ``lstm_forward``); under
    ``torch.autocast`` on ``x``'s device the input and parameters are first cast to the autocast dtype
    (as autocast does for ``F.linear``; the whole recurrence then runs in it with autocast off) and
    ``saved.param_dtype`` records the parameters' dtype for the backward."""
    dt, (xc, w_ih, w_hh, b) = cast_for_autocast(x.device.type, x, weight_ih, weight_hh, bias)
    with autocast_off(x.device.type):
        out, saved = forward(xc, w_ih, w_hh, b)
    if dt is not None:
        saved = saved._replace(param_dtype=weight_ih.dtype)
    return out, saved


@no_grad()
def rnn_forward(
    x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None, backend: str | None = None
) -> tuple[Tensor, RNNSaved]:
    """``x [B, T, I]`` → ``(h [B, T, H], saved)``: ``h_t = tanh(x_t W_ihᵀ + h_{t−1} W_hhᵀ + b)``,
    ``h_0 = 0``. No autograd graph is built.

    The input projections (and the bias) of every step are one matmul; the time loop then adds
    ``h_{t−1} W_hhᵀ`` in place (``torchloom.kernels.recurrent``): on CUDA one launch of the persistent
    loop kernel, else (shapes it does not take, ``USE_PERSISTENT_RNN = False``) the per-step cuBLAS
    loop replayed as a CUDA graph; on CPU and in float64 the plain loop. ``backend``: None (that
    choice), ``"triton"`` (the kernel, required) or ``"reference"`` (the cuBLAS loop)."""
    B, T, I = x.shape
    H = weight_hh.shape[0]
    x2 = x.reshape(B * T, I)
    w_ih_t = weight_ih.t()
    from ..kernels.recurrent import (
        ensure_graph, projection_mm, rnn_forward_loop_ref, rnn_forward_traced, rnn_loop_uses_triton,
        rnn_projected_forward
    )

    if is_compiling() and rnn_loop_uses_triton(x, B, H, backend):  # operators (kernels/recurrent.py)
        pre, hidden = rnn_forward_traced(x2, w_ih_t, bias, weight_hh, B, T, backend)
    elif not rnn_loop_uses_triton(x, B, H, backend) and _graphs_usable(x):
        entry = _rnn_graph_entry(B, T, H, x)
        buf = entry["buffers"]
        graph = ensure_graph(entry, "forward", lambda: rnn_forward_loop_ref(buf["pre"], buf["w_hh"], buf["hidden"]))
        # Input projections (and the bias) of every step in one matmul, straight into the graph's buffer.
        out = buf["pre"].view(B * T, H)
        projection_mm(x2, w_ih_t, bias, out=out, backend=backend)
        buf["w_hh"].copy_(weight_hh)
        graph.replay()
        pre, hidden = buf["pre"].clone(), buf["hidden"].clone()
    else:
        pre, hidden = rnn_projected_forward(x2, w_ih_t, bias, weight_hh, B, T, backend)
    return hidden, RNNSaved(x, weight_ih, weight_hh, pre, hidden, bias is not None)


def _graphs_usable(x: Tensor) -> bool:
    """True when the cuBLAS loops of ``x`` may run as CUDA graphs (float64 runs step by step)."""
    from ..kernels.recurrent import graphs_usable

    return x.dtype != float64 and graphs_usable(x)


def _rnn_graph_entry(B: int, T: int, H: int, x: Tensor) -> dict:
    from ..kernels.recurrent import graph_buffers

    def make():
        e = lambda *shape: x.new_empty(*shape)  # noqa: E731
        return {"pre": e(B, T, H), "hidden": e(B, T, H), "w_hh": e(H, H), "g_pre": e(B, T, H), "g_out": e(B, T, H), "dh": e(B, H)}

    return graph_buffers(("rnn", B, T, H, x.dtype, x.device), make)


@no_grad()
def rnn_backward(
    grad_out: Tensor, saved: RNNSaved, needs_input_grad: bool = True, backend: str | None = None
) -> tuple[Tensor | None, tuple[Tensor, Tensor, Tensor | None]]:
    """Hand-written BPTT over all steps. With ``gPre_t = (gOut_t + gPre_{t+1} W_hh) ⊙ (1 − h_t²)``:
    ``dW_ih = Σ_t gPre_tᵀ x_t``, ``dW_hh = Σ_{t≥2} gPre_tᵀ h_{t−1}``, ``db = Σ_{b,t} gPre_t``,
    ``dx_t = gPre_t W_ih``. Returns ``(dx [B, T, I] or None, (dW_ih, dW_hh, db or None))``, the
    parameter gradients in ``saved.param_dtype`` when set. The loop over t runs as in ``rnn_forward``
    (``backend`` likewise): one kernel launch, or per step one cuBLAS call into a preallocated buffer
    and one in-place multiply."""
    x, weight_ih, weight_hh, _, hidden, has_bias, param_dtype = saved
    B, T, I = x.shape
    H = weight_hh.shape[0]
    # The loops read it one time step at a time, in rows of unit stride: contiguous (a copy only when
    # it is not). No stride is read: torch.compile cannot answer that while it traces a backward.
    grad_out = (grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)).contiguous()
    from ..kernels.recurrent import (
        ensure_graph, rnn_backward_loop, rnn_backward_loop_ref, rnn_backward_loop_traced, rnn_loop_uses_triton
    )

    if is_compiling() and rnn_loop_uses_triton(x, B, H, backend):  # operators (kernels/recurrent.py)
        g_pre = rnn_backward_loop_traced(grad_out, weight_hh, hidden, backend)
    elif not rnn_loop_uses_triton(x, B, H, backend) and _graphs_usable(x):
        entry = _rnn_graph_entry(B, T, H, x)
        buf = entry["buffers"]
        graph = ensure_graph(
            entry, "backward", lambda: rnn_backward_loop_ref(buf["g_out"], buf["w_hh"], buf["g_pre"], buf["dh"]))
        mul(hidden, hidden, out=buf["g_pre"]).neg_().add_(1.0)  # tanh'(pre_t) = 1 − h_t²
        buf["g_out"].copy_(grad_out)
        buf["w_hh"].copy_(weight_hh)
        graph.replay()
        g_pre = buf["g_pre"]  # read by the products below before any other replay
    else:
        g_pre = empty_like(hidden)
        rnn_backward_loop(grad_out, weight_hh, hidden, g_pre, backend)
    grad_x, grad_w_ih, grad_w_hh, grad_b = recurrent_grads(g_pre, x, hidden, weight_ih, has_bias, needs_input_grad, backend)
    if param_dtype is not None:
        grad_w_ih, grad_w_hh = grad_w_ih.to(param_dtype), grad_w_hh.to(param_dtype)
        grad_b = None if grad_b is None else grad_b.to(param_dtype)
    return grad_x, (grad_w_ih, grad_w_hh, grad_b)


def recurrent_grads(g_pre: Tensor, x: Tensor, hidden: Tensor, weight_ih: Tensor, has_bias: bool,
                    needs_input_grad: bool = True, backend: str | None = None
                    ) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """The products of a recurrent layer's backward after its time loop, from ``gPre [B, T, G]``
    (``G = H`` for the RNN, ``4H`` for the LSTM), the input ``x [B, T, I]``, the hidden states
    ``hidden [B, T, H]`` and ``weight_ih [G, I]``: ``(dx [B, T, I] or None, dW_ih = Σ_t gPre_tᵀ x_t
    [G, I], dW_hh = Σ_{t ≥ 1} gPre_tᵀ h_{t−1} [G, H], db = Σ_{b,t} gPre_t [G] or None)``, fresh tensors in
    ``g_pre``'s dtype, computed in the precision of ``kernels.recurrent.projection_mm``. Where ``gemm_precision`` picks
    ``fp32_matmul``: one launch for all of them (``kernels.fp32_matmul.mm_many``; ``db`` as the row sums of
    ``dW_ih``'s operand) and one summing their K splits, where cuBLAS and a column sum took seven;
    elsewhere cuBLAS and ``column_sum``. Under ``torch.compile`` a float32 CUDA backward follows
    ``kernels.recurrent.compiled_plan``, decided while tracing from the same switches: traced cuBLAS
    products, or ``fp32_matmul``'s launches in the compiled graph (``torchloom::recurrent_grads_launched``);
    without a plan, the opaque ``torchloom::recurrent_grads``, which decides at run time (``backend`` is
    not passed to it: it runs as ``backend=None``, as ``torchloom::recurrent_mm`` does)."""
    from ..kernels.recurrent import (
        _RECURRENT_GRADS_LAUNCHED, compiled_fp32, compiled_plan, gemm_precision, projection_mm, recurrent_grads_mm_many
    )

    plan = compiled_plan(g_pre) if compiled_fp32(g_pre, weight_ih, backend) else ()
    if plan is None or (plan and plan[1] is not None):  # an operator, which returns empty tensors for None
        args = (g_pre, x, hidden, weight_ih, has_bias, needs_input_grad)
        # the opaque operator (its Python decides at run time), or fp32_matmul launched by Inductor's code
        dx, dw_ih, dw_hh, db = _RECURRENT_GRADS(*args) if plan is None else _RECURRENT_GRADS_LAUNCHED(
            *args, plan[1])
        return (dx if needs_input_grad else None), dw_ih, dw_hh, (db if has_bias else None)
    # traced only where cuBLAS computes the products (not float32 on CUDA): no switch read while tracing
    precision = None if is_compiling() else gemm_precision(g_pre, weight_ih, backend)
    if precision is None:
        B, T, G = g_pre.shape
        g2, x2 = g_pre.reshape(B * T, G), x.reshape(B * T, x.shape[-1])
        dw_ih = projection_mm(g2.t(), x2, backend=backend)
        dw_hh = projection_mm(g_pre[:, 1:].permute(2, 0, 1), hidden[:, :-1], backend=backend)  # Σ over (b, t ≥ 1)
        db = column_sum(g2) if has_bias else None
        dx = projection_mm(g2, weight_ih, backend=backend).view(B, T, x.shape[-1]) if needs_input_grad else None
        return dx, dw_ih, dw_hh, db
    return recurrent_grads_mm_many(g_pre, x, hidden, weight_ih, has_bias, needs_input_grad, precision, backend)


def _recurrent_grads_tensors(g_pre: Tensor, x: Tensor, hidden: Tensor, weight_ih: Tensor, has_bias: bool,
                             needs_input_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, dw_ih, dw_hh, db = recurrent_grads(g_pre, x, hidden, weight_ih, has_bias, needs_input_grad)
    # an operator returns tensors: empty where the caller asked for none
    return (g_pre.new_empty(0) if dx is None else dx), dw_ih, dw_hh, (g_pre.new_empty(0) if db is None else db)


def _recurrent_grads_eager(g_pre: Tensor, x: Tensor, hidden: Tensor, weight_ih: Tensor, has_bias: bool,
                           needs_input_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from ..kernels.recurrent import _replay, replay_key

    with autocast_off(g_pre.device.type):  # as ``_recurrent_mm_eager``; replayed as its operators' (kernels._replay)
        return _replay.run(replay_key("recurrent_grads"), _recurrent_grads_tensors,
                             (g_pre, x, hidden, weight_ih, has_bias, needs_input_grad))


def _register_recurrent_grads():
    op = torch.library.custom_op("torchloom::recurrent_grads", _recurrent_grads_eager, mutates_args=())

    def fake(g_pre, x, hidden, weight_ih, has_bias, needs_input_grad):
        (B, T, G), I, H = g_pre.shape, x.shape[-1], hidden.shape[-1]
        new = g_pre.new_empty
        return new(B, T, I) if needs_input_grad else new(0), new(G, I), new(G, H), new(G) if has_bias else new(0)

    op.register_fake(fake)
    return op


_RECURRENT_GRADS = _register_recurrent_grads()


class RNNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_ih, weight_hh, bias):
        hidden, saved = autocast_recurrent_forward(rnn_forward, x, weight_ih, weight_hh, bias)
        ctx.save_for_backward(saved.input, saved.weight_ih, saved.weight_hh, hidden)
        ctx.has_bias, ctx.param_dtype, ctx.x_dtype = bias is not None, saved.param_dtype, x.dtype
        return hidden

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("RNN")
        x, weight_ih, weight_hh, hidden = ctx.saved_tensors
        saved = RNNSaved(x, weight_ih, weight_hh, None, hidden, ctx.has_bias, ctx.param_dtype)  # pre is not needed
        with autocast_off(grad_out.device.type):
            grad_x, (gw_ih, gw_hh, gb) = rnn_backward(grad_out.contiguous(), saved, ctx.needs_input_grad[0])
        return None if grad_x is None else grad_x.to(ctx.x_dtype), gw_ih, gw_hh, gb


def rnn(x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None = None) -> Tensor:
    """Functional Elman RNN: ``x [B, T, I]`` → all hidden states ``[B, T, H]``; differentiable
    through the hand-written BPTT (under ``torch.autocast`` the input and parameters are cast to the
    autocast dtype, the gradients come back in their own dtypes)."""
    return RNNFunction.apply(x, weight_ih, weight_hh, bias)


def _check_positive(owner: str, **sizes: int) -> None:
    for arg, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{owner}: {arg} must be a positive int, got {v!r}")


def check_sequence(x: Tensor, input_size: int, owner: str, dtype: torch.dtype) -> None:
    """Raise unless ``x`` is a ``[batch, time, input_size]`` floating tensor (time >= 1) of ``dtype``
    (the parameters'; any floating dtype under ``torch.autocast``, which casts)."""
    if not is_tensor(x):
        raise TypeError(f"{owner}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[2] != input_size or x.shape[1] < 1:
        raise ValueError(f"{owner}: input must have shape [batch, time, {input_size}] (time >= 1), got {list(x.shape)}")
    check_dtype(x, "input", dtype, owner)


class RecurrentLayer(Layer):
    """What RNN and LSTM share: ``weight_ih [G·H, I]``, ``weight_hh [G·H, H]`` and one merged
    ``bias [G·H]`` (G gate blocks: 1 for RNN, 4 for LSTM), the initialisation, the input check and
    the plumbing to the functional forward/backward. Subclasses set ``_GATES``, ``_NAME`` and the
    ``_function`` / ``_forward`` / ``_backward`` static methods.

    Args:
        input_size: ``I``; hidden_size: ``H``.
        bias: a learnable merged bias (Loom's layout; PyTorch's module with ``bias_ih = bias``,
            ``bias_hh = 0`` computes the same).
        init: ``"uniform"`` (default: ``U(−1/√H, 1/√H)`` for every parameter, PyTorch's rule, which
            keeps the gates out of saturation) or ``"loom_uniform"`` (``U(−0.1, 0.1)``, Loom ``poly``).
    """

    kernel_modules = ("torchloom.kernels.recurrent",)

    _GATES = 1
    _NAME = "Recurrent"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        init: str = "uniform",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        name = self._NAME
        _check_positive(name, input_size=input_size, hidden_size=hidden_size)
        if not isinstance(bias, bool):
            raise ValueError(f"{name}: bias must be a bool, got {bias!r}")
        if init not in _RNN_INITS:
            raise ValueError(f"{name}: init must be one of {_RNN_INITS}, got {init!r}")
        self.input_size, self.hidden_size, self.init = input_size, hidden_size, init
        factory = {"device": device, "dtype": dtype}
        rows = self._GATES * hidden_size
        self.weight_ih = nn.Parameter(empty(rows, input_size, **factory))
        self.weight_hh = nn.Parameter(empty(rows, hidden_size, **factory))
        self.bias = nn.Parameter(empty(rows, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size) if self.init == "uniform" else 0.1
        with no_grad():
            for p in self.parameters():
                p.uniform_(-bound, bound)

    def _check(self, x: Tensor) -> None:
        check_sequence(x, self.input_size, f"{self._NAME}({self.input_size}→{self.hidden_size})", self.weight_ih.dtype)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return self._function.apply(x, self.weight_ih, self.weight_hh, self.bias)

    def forward_saved(self, x: Tensor):
        self._check(x)
        return autocast_recurrent_forward(self._forward, x, self.weight_ih, self.weight_hh, self.bias)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        with autocast_off(grad_out.device.type):
            grad_x, (gw_ih, gw_hh, gb) = self._backward(grad_out, saved, needs_input_grad)
        return grad_x, (gw_ih, gw_hh) if gb is None else (gw_ih, gw_hh, gb)

    def extra_repr(self) -> str:
        return f"input_size={self.input_size}, hidden_size={self.hidden_size}, bias={self.bias is not None}"


class RNN(RecurrentLayer):
    """Elman RNN ``h_t = tanh(x_t W_ihᵀ + h_{t−1} W_hhᵀ + b)``, ``h_0 = 0``, all steps returned
    (arguments: ``RecurrentLayer``).

    Parameters: ``weight_ih [H, I]``, ``weight_hh [H, H]``, ``bias [H]``.
    Shapes: input ``[B, T, I]`` → output ``[B, T, H]`` (every hidden state).
    """

    _GATES = 1
    _NAME = "RNN"
    _function = RNNFunction
    _forward = staticmethod(rnn_forward)
    _backward = staticmethod(rnn_backward)


# --------------------------------------------------------------------------------------------
# LastStep: a sequence classifier reads the last hidden state. Loom's RNN/LSTM hand their whole
# [B, T, H] output on; torchloom keeps that and offers this layer to pick the last step.


class LastStepSaved(NamedTuple):
    """What LastStep's backward needs: the input's shape."""

    shape: tuple[int, ...]


class LastStep(Layer):
    """Keeps the last time step of a sequence: ``[B, T, H] → [B, H]`` (``x[:, -1]``).

    Backward: the gradient goes to step ``T`` and every earlier step gets zero. Input at least 3-d
    (``[B, T, ...]``, time is dimension 1). No parameters."""

    def _check(self, x: Tensor) -> None:
        if not is_tensor(x):
            raise TypeError(f"LastStep: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 3 or x.shape[1] < 1:
            raise ValueError(f"LastStep: input must have shape [batch, time, ...] with time >= 1, got {list(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return super().forward(x)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, LastStepSaved]:
        self._check(x)
        return x[:, -1].contiguous(), LastStepSaved(tuple(x.shape))

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        if not needs_input_grad:
            return None, ()
        grad_x = grad_out.new_zeros(saved.shape)
        grad_x[:, -1] = grad_out
        return grad_x, ()

    def reset_parameters(self) -> None:  # no parameters
        pass
