"""Dense (fully connected) layer: ``y = f(x Wᵀ + b)`` with a hand-written backward.

Read top to bottom: ``dense_forward`` / ``dense_backward`` (the math, side by side), ``DenseFunction``
(the autograd bridge), ``dense`` (functional), ``Dense`` (module). Loom's ``poly`` Dense has no bias:
``Dense(..., bias=False)`` reproduces it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, float32, is_grad_enabled, is_tensor, nn

from .activations import Activation, get_activation
from .base import column_sum, output_view, Layer, autocast_off, cast_for_autocast, check_dtype, forbid_double_backward

__all__ = ["Dense", "DenseFunction", "DenseSaved", "dense", "dense_forward", "dense_backward"]

_INITS = ("he_normal", "loom_uniform")


class DenseSaved(NamedTuple):
    """What Dense's backward needs: input ``[*, in]``, weight ``[out, in]``, pre-activation
    ``[*, out]``, the activation and whether there is a bias. Under autocast ``input``/``weight``
    are the autocast-dtype casts and ``dtypes`` holds ``(input dtype, parameter dtype)``, the dtypes
    the gradients are returned in (``None``: no cast happened)."""

    input: Tensor
    weight: Tensor
    pre: Tensor
    activation: Activation
    has_bias: bool
    dtypes: tuple[torch.dtype, torch.dtype] | None = None


def _small_batch_kernel(x2: Tensor, activation: Activation):
    """The fused small-batch backward (``kernels.dense_small.dense_small_backward``) when it handles
    this call (CUDA, float32, few rows), else None. Imported on the first CUDA call only: CPU code
    never imports the kernels."""
    if not x2.is_cuda:
        return None
    from ..kernels.dense_small import dense_small_backward, supports

    return dense_small_backward if supports(x2, activation.name) else None


def dense_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: Activation
) -> tuple[Tensor, DenseSaved]:
    """``x [*, in]``, ``weight [out, in]``, ``bias [out]`` → ``(y [*, out], saved)``. No autograd.
    Under ``torch.autocast`` on ``x``'s device, ``x``, ``weight`` and ``bias`` are cast to the
    autocast dtype first (as autocast does for ``F.linear``) and ``y`` has that dtype."""
    y, x, weight, pre, dtypes = _dense_forward(x, weight, bias, activation)
    return y, DenseSaved(x, weight, pre, activation, bias is not None, dtypes)


# The bodies of dense_forward / dense_backward on plain arguments, which DenseFunction calls: a saved
# record (a NamedTuple) built while torch.compile traces adds ~20 guards to every compiled call.
def _dense_forward(x: Tensor, weight: Tensor, bias: Tensor | None, activation: Activation):
    """``(y, x, weight, pre, dtypes)``: ``dense_forward``'s result, its record's fields unpacked."""
    dev = x.device.type
    dtypes = (x.dtype, weight.dtype)
    cast_to, (x, weight, bias) = cast_for_autocast(dev, x, weight, bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    with autocast_off(dev):
        pre = x2.mm(weight.t()) if bias is None else bias.addmm(x2, weight.t())
        if x.dim() != 2:
            pre = output_view(pre, *x.shape[:-1], weight.shape[0])
        y = activation.forward(pre)
    return y, x, weight, pre, dtypes if cast_to is not None else None


def _into(result: Tensor, buffer: Tensor | None) -> Tensor:
    """``result`` written into ``buffer`` (cast to its dtype) when one is given, else ``result``."""
    if buffer is None:
        return result
    return buffer.copy_(result)


def dense_backward(
    grad_out: Tensor, saved: DenseSaved, needs_input_grad: bool = True,
    out: tuple[Tensor | None, Tensor | None] | None = None,
) -> tuple[Tensor | None, tuple[Tensor, Tensor | None]]:
    """Hand-written backward: ``gPre = gOut ⊙ f'(pre)``, ``dW = gPreᵀ x`` (summed over the batch),
    ``db = Σ_b gPre``, ``dx = gPre W``. Returns ``(dx or None, (dW, db or None))``. On CUDA, small
    float32 batches run all of it in one fused kernel (``kernels/dense_small.py``). ``out``: optional
    ``(dW, db)`` buffers of the right shape and dtype to write the gradients into (the CUDA training
    step passes its flat ``.grad`` views, saving a copy); they are returned as dW and db.

    Runs in the dtype of the saved tensors with autocast off (``grad_out`` is cast to the
    pre-activation's dtype); when the forward cast for autocast, ``dx`` comes back in the input's
    dtype and ``dW``, ``db`` in the parameters'."""
    return _dense_backward(grad_out, *saved, needs_input_grad, out)


def _dense_backward(grad_out, x, weight, pre, activation, has_bias, dtypes, needs_input_grad, out):
    if grad_out.dtype != pre.dtype:
        grad_out = grad_out.to(pre.dtype)
    flat = x.dim() == 2  # the common case: no reshapes
    x2 = x if flat else x.reshape(-1, weight.shape[1])
    w_out, b_out = out if out is not None else (None, None)
    fused = _small_batch_kernel(x2, activation)
    if fused is not None and dtypes is None and weight.dtype == float32 and grad_out.dtype == float32:
        grad_x, grad_w, grad_b = fused(
            grad_out.reshape(-1, weight.shape[0]), pre.reshape(-1, weight.shape[0]), x2, weight,
            activation.name, has_bias, needs_input_grad, out=(w_out, b_out),
        )
        return (grad_x.view(x.shape) if grad_x is not None else None), (grad_w, grad_b)
    with autocast_off(x.device.type):
        g_pre = activation.grad(grad_out, pre)
        if not flat:
            g_pre = g_pre.reshape(-1, weight.shape[0])
        if dtypes is not None:  # computed in the autocast dtype, returned in each tensor's own
            grad_w = _into(g_pre.t().mm(x2), w_out).to(dtypes[1])
            grad_b = _into(column_sum(g_pre), b_out).to(dtypes[1]) if has_bias else None
        else:
            grad_w = torch.mm(g_pre.t(), x2, out=w_out) if w_out is not None else g_pre.t().mm(x2)
            grad_b = None
            if has_bias:
                grad_b = column_sum(g_pre, out=b_out)
        grad_x = None
        if needs_input_grad:
            grad_x = g_pre.mm(weight) if flat else g_pre.mm(weight).view(x.shape)
            if dtypes is not None:
                grad_x = grad_x.to(dtypes[0])
    return grad_x, (grad_w, grad_b)


def _dense_backward_graph(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, activation: Activation
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The same backward formulas written with differentiable ops on a recomputed ``pre = x Wᵀ + b``,
    for double backward (``create_graph=True``): autograd differentiates the hand-written gradient."""
    pre = torch.nn.functional.linear(x, weight, bias)
    g_pre = activation.grad(grad_out, pre).reshape(-1, weight.shape[0])
    x2 = x.reshape(-1, weight.shape[1])
    grad_b = g_pre.sum(0) if bias is not None else None
    return torch.mm(g_pre, weight).view(x.shape), torch.mm(g_pre.t(), x2), grad_b


class DenseFunction(torch.autograd.Function):
    """Dense as an ``autograd.Function``. Twice differentiable when no autocast cast happened (the
    second derivative differentiates the hand-written gradient formulas); under autocast a second
    derivative raises ``RuntimeError``."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        y, x_used, w_used, pre, dtypes = _dense_forward(x, weight, bias, activation)
        ctx.save_for_backward(x_used, w_used, pre, bias)
        ctx.activation = activation
        ctx.dtypes = dtypes
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, pre, bias = ctx.saved_tensors
        if is_grad_enabled():  # create_graph=True: a second derivative will be asked for
            if ctx.dtypes is not None:
                forbid_double_backward("Dense (run under torch.autocast)")
            grad_x, grad_w, grad_b = _dense_backward_graph(grad_out, x, weight, bias, ctx.activation)
            return (grad_x if ctx.needs_input_grad[0] else None), grad_w, grad_b, None
        grad_x, (grad_w, grad_b) = _dense_backward(
            grad_out, x, weight, pre, ctx.activation, bias is not None, ctx.dtypes, ctx.needs_input_grad[0], None
        )
        return grad_x, grad_w, grad_b, None


def dense(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | Activation = "linear") -> Tensor:
    """Functional Dense: ``f(x Wᵀ + b)`` for ``x [*, in]``, ``weight [out, in]``; differentiable
    through the hand-written backward."""
    return DenseFunction.apply(x, weight, bias, get_activation(activation))


class Dense(Layer):
    """Fully connected layer ``y = f(x Wᵀ + b)``.

    Args:
        in_features, out_features: sizes; ``weight`` is ``[out_features, in_features]``.
        activation: an activation name, see ``activation_names()`` (default ``"linear"``).
        bias: add a learnable ``bias [out_features]`` (Loom's poly Dense has none: ``bias=False``).
        init: ``"he_normal"`` (``N(0, 2/in)``, Loom ``nn.InitDenseLayer``) or ``"loom_uniform"``
            (``U(−0.1, 0.1)``, Loom ``poly``); biases start at 0.

    Shapes: input ``[batch, ..., in_features]`` → output ``[batch, ..., out_features]``.

    The input's dtype must be the parameters' (``TypeError`` otherwise) except under
    ``torch.autocast``, where input and parameters are cast to the autocast dtype and the gradients
    come back in their own dtypes. Twice differentiable (``create_graph=True``) outside autocast;
    ``torch.func.functional_call`` works; ``vmap``/``grad`` transforms and ``torch.jit.script`` raise
    ``RuntimeError``.
    """

    kernel_modules = ("torchloom.kernels.dense_small",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        activation: str | Activation = "linear",
        bias: bool = True,
        init: str = "he_normal",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for arg, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Dense: {arg} must be a positive int, got {v!r}")
        if init not in _INITS:
            raise ValueError(f"Dense: init must be one of {_INITS}, got {init!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation = get_activation(activation)
        self.init = init
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.init == "he_normal":
                self.weight.normal_(0.0, math.sqrt(2.0 / self.in_features))
            else:
                self.weight.uniform_(-0.1, 0.1)
            if self.bias is not None:
                self.bias.zero_()

    def _check(self, x: Tensor) -> None:
        w = self.weight  # the common case reads only tensors, which torch.compile guards already
        if is_tensor(x) and x.dim() >= 2 and x.shape[-1] == w.shape[1] and x.dtype == w.dtype:
            return
        if not is_tensor(x):
            raise TypeError(f"{self!r}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Dense({self.in_features}→{self.out_features}): input must have shape "
                f"[batch, ..., {self.in_features}], got {list(x.shape)}"
            )
        check_dtype(x, "input", self.weight.dtype, f"Dense({self.in_features}→{self.out_features})")

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return DenseFunction.apply(x, self.weight, self.bias, self.activation)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, DenseSaved]:
        self._check(x)
        return dense_forward(x, self.weight, self.bias, self.activation)

    accepts_grad_out = True

    def backward_saved(self, grad_out, saved, needs_input_grad=True, out=None):
        grad_x, (grad_w, grad_b) = dense_backward(grad_out, saved, needs_input_grad, out=self._out_pair(out))
        return grad_x, (grad_w,) if grad_b is None else (grad_w, grad_b)

    def _out_pair(self, out):
        """``out`` (aligned with ``parameters()``) as ``(dW buffer, db buffer)``, buffers that fit only."""
        if out is None:
            return None
        w_out = out[0] if out[0] is not None and out[0].shape == self.weight.shape and out[0].dtype == self.weight.dtype else None
        b_out = None
        if self.bias is not None and len(out) > 1 and out[1] is not None:
            b_out = out[1] if out[1].shape == self.bias.shape and out[1].dtype == self.bias.dtype else None
        return w_out, b_out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"activation={self.activation.name}, bias={self.bias is not None}"
        )
