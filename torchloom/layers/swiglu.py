"""SwiGLU feed-forward block with a hand-written backward.

    forward   g = x W_gateᵀ + b_gate,   u = x W_upᵀ + b_up          [*, m]
              a = silu(g) ⊙ u                                       [*, m]  (Loom's pre-activation)
              y = a W_downᵀ + b_down                                [*, h]
    backward  dW_down = gyᵀ a,   db_down = Σ gy,   da = gy W_down
              dg = da ⊙ u ⊙ silu'(g),   du = da ⊙ silu(g)
              dW_gate = dgᵀ x,   dW_up = duᵀ x,   db_gate = Σ dg,   db_up = Σ du
              dx = dg W_gate + du W_up

Sums run over every row (all leading dimensions). Loom's code accumulates the down projection's
weight gradient transposed (into ``[m, h]`` positions of an ``[h, m]`` weight); torchloom
computes ``gyᵀ a``, the ``[h, m]`` gradient. The gate (``silu(g) ⊙ u`` and its backward) runs in the
fused Triton kernels of ``torchloom.kernels.swiglu`` on CUDA, their reference elsewhere; the
projections are ordinary matrix products.

Read top to bottom: ``swiglu_forward`` / ``swiglu_backward`` (the math), ``SwiGLUFunction`` (the
autograd bridge), ``swiglu`` (functional), ``SwiGLU`` (module).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, is_grad_enabled, is_tensor, nn

from .base import column_sum, linear_2d, mm_sum, output_view, Layer, autocast_off, cast_for_autocast, check_dtype, forbid_double_backward

__all__ = ["SwiGLU", "SwiGLUFunction", "SwiGLUSaved", "swiglu", "swiglu_forward", "swiglu_backward"]


class SwiGLUSaved(NamedTuple):
    """What the backward needs: input ``[*, h]``, gate and up projections ``g, u [*, m]``, the gated
    intermediate ``pre = silu(g) ⊙ u [*, m]`` (Loom's pre-activation; ``None`` when the caller
    dropped it to save memory: the backward then recomputes it from ``g`` and ``u``), the three
    weights, whether there are biases, and ``dtypes`` = ``(input dtype, parameter dtype)`` when the
    forward cast for autocast (the gradients are returned in those), else ``None``."""

    input: Tensor
    gate: Tensor
    up: Tensor
    pre: Tensor | None
    gate_weight: Tensor
    up_weight: Tensor
    down_weight: Tensor
    has_bias: bool
    dtypes: tuple[torch.dtype, torch.dtype] | None = None


def swiglu_forward(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Tensor | None = None,
    up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> tuple[Tensor, SwiGLUSaved]:
    """``x [*, h]``, ``gate_weight, up_weight [m, h]``, ``down_weight [h, m]``, biases ``[m], [m], [h]``
    (all or none) → ``(y [*, h], saved)``. No autograd. Under ``torch.autocast`` the input, weights
    and biases are cast to the autocast dtype first (as autocast does for ``F.linear``)."""
    y, fields = _swiglu_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    return y, SwiGLUSaved(*fields)


# The bodies of swiglu_forward / swiglu_backward on plain arguments, which SwiGLUFunction calls: a
# saved record (a NamedTuple) built while torch.compile traces adds ~20 guards to every compiled call.
def _swiglu_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
    """``(y, fields)``: ``swiglu_forward``'s result with its record's fields as a plain tuple."""
    dev = x.device.type
    dtypes = (x.dtype, gate_weight.dtype)
    cast_to, tensors = cast_for_autocast(dev, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias = tensors
    x2 = x.reshape(-1, x.shape[-1])
    from ..kernels.swiglu import swiglu as swiglu_gate  # here: the kernels import Triton (see norm.py)

    with autocast_off(dev):
        g = linear_2d(x2, gate_weight, gate_bias)
        u = linear_2d(x2, up_weight, up_bias)
        a = swiglu_gate(g, u)
        y = output_view(linear_2d(a, down_weight, down_bias), *x.shape[:-1], down_weight.shape[0])
    return y, (x, g, u, a, gate_weight, up_weight, down_weight, gate_bias is not None, dtypes if cast_to is not None else None)


def swiglu_backward(
    grad_out: Tensor, saved: SwiGLUSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, ...]]:
    """Hand-written backward. Returns ``(dx or None, (dW_gate, dW_up, dW_down[, db_gate, db_up, db_down]))``,
    the order of ``SwiGLU.parameters()``, in the parameters' dtype (``dx`` in the input's).

    Memory: ``pre`` is recomputed when it was not saved and released after ``dW_down``; the gate's
    gradient is written over ``da``'s buffer, so the backward holds at most four ``[rows, m]``
    tensors (``g``, ``u``, ``da``/``dg``, ``du``)."""
    return _swiglu_backward(grad_out, *saved, needs_input_grad)


def _swiglu_backward(grad_out, x, g, u, a, gate_weight, up_weight, down_weight, has_bias, dtypes, needs_input_grad):
    h = down_weight.shape[0]
    from ..kernels.swiglu import swiglu as swiglu_gate, swiglu_backward as swiglu_gate_backward

    with autocast_off(x.device.type):
        gy = grad_out.reshape(-1, h)
        if gy.dtype != g.dtype:
            gy = gy.to(g.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        if a is None:
            a = swiglu_gate(g, u)
        d_down = gy.t().mm(a)  # [h, m]: the correct orientation (Loom's code transposes it)
        del a  # a recomputed intermediate is freed here
        da = gy.mm(down_weight)  # [rows, m]
        dg, du = swiglu_gate_backward(da, g, u, out_gate=da)  # dg over da: one [rows, m] less
        del da
        d_gate = dg.t().mm(x2)
        d_up = du.t().mm(x2)
        grads: tuple[Tensor, ...] = (d_gate, d_up, d_down)
        if has_bias:
            grads += (column_sum(dg), column_sum(du), column_sum(gy))
        dx = None
        if needs_input_grad:
            dx = mm_sum([dg, du], [gate_weight, up_weight]).view(x.shape)
    if dtypes is not None:
        grads = tuple(t.to(dtypes[1]) for t in grads)
        dx = dx.to(dtypes[0]) if dx is not None else None
    return dx, grads


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU as an ``autograd.Function``. Saves ``x``, ``g``, ``u`` (not the gated intermediate,
    recomputed in the backward: one ``[rows, m]`` tensor less between forward and backward). A second
    derivative raises ``RuntimeError``."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
        y, (x, g, u, _, gw, uw, dw, has_bias, dtypes) = _swiglu_forward(
            x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias
        )
        ctx.save_for_backward(x, g, u, gw, uw, dw)
        ctx.has_bias = has_bias
        ctx.dtypes = dtypes
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():
            forbid_double_backward("SwiGLU")
        x, g, u, gw, uw, dw = ctx.saved_tensors
        dx, grads = _swiglu_backward(grad_out, x, g, u, None, gw, uw, dw, ctx.has_bias, ctx.dtypes, ctx.needs_input_grad[0])
        biases = grads[3:] if ctx.has_bias else (None, None, None)
        return (dx, *grads[:3], *biases)


def swiglu(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Tensor | None = None,
    up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """Functional SwiGLU ``(silu(x W_gateᵀ + b_g) ⊙ (x W_upᵀ + b_u)) W_downᵀ + b_d``; differentiable
    through the hand-written backward. Biases: all three or none."""
    biases = (gate_bias, up_bias, down_bias)
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("swiglu: pass all three biases (gate_bias, up_bias, down_bias) or none of them")
    return SwiGLUFunction.apply(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)


class SwiGLU(Layer):
    """SwiGLU feed-forward block: ``(silu(x W_gateᵀ + b_gate) ⊙ (x W_upᵀ + b_up)) W_downᵀ + b_down``.

    Args:
        hidden: ``h``, the input and output size.
        intermediate: ``m``, the size of the gated intermediate.
        bias: learnable ``gate_bias [m]``, ``up_bias [m]``, ``down_bias [h]`` (default True).

    Parameters: ``gate_weight [m, h]``, ``up_weight [m, h]``, ``down_weight [h, m]`` (then the biases),
    weights drawn from ``N(0, 1/fan_in)`` (keeps the activations' scale through the linear
    projections), biases 0.

    Shapes: input ``[batch, ..., h]`` → output ``[batch, ..., h]``.

    The input's dtype must be the parameters' (``TypeError`` otherwise) except under
    ``torch.autocast`` (input and parameters cast to the autocast dtype, gradients returned in their
    own dtypes). A second derivative (``create_graph=True``) raises ``RuntimeError``;
    ``torch.func.functional_call`` works; ``vmap`` and ``torch.jit.script`` raise ``RuntimeError``.
    """

    kernel_modules = ("torchloom.kernels.swiglu",)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for arg, v in (("hidden", hidden), ("intermediate", intermediate)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SwiGLU: {arg} must be a positive int, got {v!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"SwiGLU: bias must be a bool, got {bias!r}")
        self.hidden = hidden
        self.intermediate = intermediate
        factory = {"device": device, "dtype": dtype}
        self.gate_weight = nn.Parameter(torch.empty(intermediate, hidden, **factory))
        self.up_weight = nn.Parameter(torch.empty(intermediate, hidden, **factory))
        self.down_weight = nn.Parameter(torch.empty(hidden, intermediate, **factory))
        if bias:
            self.gate_bias = nn.Parameter(torch.empty(intermediate, **factory))
            self.up_bias = nn.Parameter(torch.empty(intermediate, **factory))
            self.down_bias = nn.Parameter(torch.empty(hidden, **factory))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w in (self.gate_weight, self.up_weight, self.down_weight):
                w.normal_(0.0, 1.0 / math.sqrt(w.shape[1]))
            for b in (self.gate_bias, self.up_bias, self.down_bias):
                if b is not None:
                    b.zero_()

    def _check(self, x: Tensor) -> None:
        w = self.gate_weight  # the common case reads only tensors, which torch.compile guards already
        if is_tensor(x) and x.dim() >= 2 and x.shape[-1] == w.shape[1] and x.dtype == w.dtype:
            return
        if not is_tensor(x):
            raise TypeError(f"{self!r}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != self.hidden:
            raise ValueError(
                f"SwiGLU({self.hidden}→{self.intermediate}→{self.hidden}): input must have shape "
                f"[batch, ..., {self.hidden}], got {list(x.shape)}"
            )
        check_dtype(x, "input", self.gate_weight.dtype, f"SwiGLU({self.hidden}→{self.intermediate}→{self.hidden})")

    def _params(self) -> tuple[Tensor | None, ...]:
        return (self.gate_weight, self.up_weight, self.down_weight, self.gate_bias, self.up_bias, self.down_bias)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return SwiGLUFunction.apply(x, *self._params())

    def forward_saved(self, x: Tensor) -> tuple[Tensor, SwiGLUSaved]:
        self._check(x)
        return swiglu_forward(x, *self._params())

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return swiglu_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, intermediate={self.intermediate}, bias={self.gate_bias is not None}"
