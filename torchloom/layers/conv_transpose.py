"""Transposed convolutions ``ConvTranspose1D`` / ``ConvTranspose2D`` / ``ConvTranspose3D`` (Loom
``ConvTransposed1D/2D/3D``), each with a hand-written backward.

Read top to bottom: ``conv_transpose_forward`` / ``conv_transpose_backward`` (the math, side by side),
``ConvTransposeFunction`` (the autograd bridge), ``conv_transpose`` (functional), then the modules.

* forward: every input position scatters its kernel into the output,
  ``pre[b, f, i·s − p + κ] += Σ_c x[b, c, i] · W[c, f, κ]`` (plus ``bias[f]``), then ``y = f(pre)``; it is
  ``F.conv_transpose1d/2d/3d``. Output size per spatial dim ``(n − 1)·s − 2p + k + output_padding``.
* backward: ``gPre = gOut ⊙ f'(pre)``; ``dx = gPre ⋆ W`` (an ordinary strided cross-correlation of the
  gradient with the kernel), ``dW[c, f, κ] = Σ_{b, i} x[b, c, i] · gPre[b, f, i·s − p + κ]``,
  ``db[f] = Σ gPre[b, f, ·]``, all from one call of the explicit primitive
  ``torch.ops.aten.convolution_backward`` (``transposed=True``); no autograd graph is built.

Weights use PyTorch's transposed-convolution layout ``[C, F, k…]`` (input channels first). Loom stores
``[F, C, k…]``, has a square/cubic kernel, equal strides and no bias; the Loom JSON interop transposes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, is_grad_enabled, is_tensor, nn, no_grad

from .activations import Activation, get_activation
from .base import Layer, autocast_off, cast_for_autocast, check_dtype, forbid_double_backward
from .conv import _CONVOLUTION_BACKWARD, _ntuple

__all__ = [
    "ConvTranspose1D",
    "ConvTranspose2D",
    "ConvTranspose3D",
    "ConvTransposeFunction",
    "conv_transpose",
    "conv_transpose_forward",
    "conv_transpose_backward",
]

_FNS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_SPATIAL_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}
_INITS = ("he_normal", "loom_uniform")


class ConvTransposeSaved(NamedTuple):
    """What the backward needs: input ``[B, C, *n]``, weight ``[C, F, *k]``, pre-activation
    ``[B, F, *out]``, the activation, whether there is a bias, stride, padding, output padding and,
    when the forward cast for autocast, ``(input dtype, parameter dtype)``."""

    input: Tensor
    weight: Tensor
    pre: Tensor
    activation: Activation
    has_bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    output_padding: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype] | None = None  # (input, parameters) when cast for autocast


def conv_transpose_forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    output_padding: tuple[int, ...],
    activation: Activation,
) -> tuple[Tensor, ConvTransposeSaved]:
    """``x [B, C, *n]``, ``weight [C, F, *k]``, ``bias [F]`` → ``(y [B, F, *out], saved)`` with
    ``out = (n − 1)·s − 2p + k + output_padding``. No autograd graph is built. Under
    ``torch.autocast`` the input and parameters are cast to the autocast dtype first (as autocast does
    for ``F.conv_transpose2d``) and ``y`` has that dtype."""
    y, x, weight, pre, dtypes = _conv_transpose_forward(x, weight, bias, stride, padding, output_padding, activation)
    return y, ConvTransposeSaved(x, weight, pre, activation, bias is not None, stride, padding, output_padding, dtypes)


# The bodies of conv_transpose_forward / conv_transpose_backward on plain arguments, which
# ConvTransposeFunction calls: a saved record (a NamedTuple) built while torch.compile traces adds ~20
# guards to every compiled call.
def _conv_transpose_forward(x, weight, bias, stride, padding, output_padding, activation):
    """``(y, x, weight, pre, dtypes)``: ``conv_transpose_forward``'s result, its record's fields unpacked."""
    nd = weight.dim() - 2
    dev = x.device.type
    dtypes = (x.dtype, weight.dtype)
    cast_to, (x, weight, bias) = cast_for_autocast(dev, x, weight, bias)
    with no_grad(), autocast_off(dev):
        pre = _FNS[nd](x, weight, bias, stride, padding, output_padding)
        y = activation.forward(pre)
    return y, x, weight, pre, dtypes if cast_to is not None else None


def conv_transpose_backward(
    grad_out: Tensor, saved: ConvTransposeSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, Tensor | None]]:
    """Hand-written backward: ``gPre = gOut ⊙ f'(pre)``; ``dx = gPre ⋆ W`` (strided
    cross-correlation), ``dW[c, f, κ] = Σ_{b, i} x[b, c, i]·gPre[b, f, i·s − p + κ]``,
    ``db[f] = Σ_{b, o} gPre[b, f, o]``. Returns ``(dx or None, (dW, db or None))``. Runs in the saved
    tensors' dtype with autocast off; after an autocast cast the gradients come back in the input's
    and the parameters' own dtypes."""
    return _conv_transpose_backward(grad_out, *saved, needs_input_grad)


def _conv_transpose_backward(grad_out, x, weight, pre, activation, has_bias, stride, padding, output_padding, dtypes,
                             needs_input_grad):
    nd = weight.dim() - 2
    if grad_out.dtype != pre.dtype:
        grad_out = grad_out.to(pre.dtype)
    with no_grad(), autocast_off(x.device.type):
        g_pre = activation.grad(grad_out, pre)
        grad_x, grad_w, grad_b = _CONVOLUTION_BACKWARD(
            g_pre.contiguous(),
            x,
            weight,
            [weight.shape[1]] if has_bias else None,
            list(stride),
            list(padding),
            [1] * nd,  # dilation
            True,  # transposed
            list(output_padding),
            1,  # groups
            [needs_input_grad, True, has_bias],
        )
    if dtypes is not None:
        grad_x = grad_x.to(dtypes[0]) if grad_x is not None else None
        grad_w = grad_w.to(dtypes[1])
        grad_b = grad_b.to(dtypes[1]) if grad_b is not None else None
    return (grad_x if needs_input_grad else None), (grad_w, grad_b if has_bias else None)


class ConvTransposeFunction(torch.autograd.Function):
    """The transposed convolution as an ``autograd.Function``; a second derivative raises."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, output_padding, activation):
        y, x_used, w_used, pre, dtypes = _conv_transpose_forward(x, weight, bias, stride, padding, output_padding, activation)
        ctx.save_for_backward(x_used, w_used, pre)
        ctx.meta = (activation, bias is not None, stride, padding, output_padding, dtypes)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():
            forbid_double_backward(f"ConvTranspose{len(ctx.meta[2])}D")
        x, weight, pre = ctx.saved_tensors
        grad_x, (grad_w, grad_b) = _conv_transpose_backward(grad_out.contiguous(), x, weight, pre, *ctx.meta,
                                                            ctx.needs_input_grad[0])
        return grad_x, grad_w, grad_b, None, None, None, None


def conv_transpose(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] = 0,
    output_padding: int | tuple[int, ...] = 0,
    activation: str | Activation = "linear",
) -> Tensor:
    """Functional N-d transposed convolution ``f(conv_transpose(x, W) + b)`` for ``x [B, C, *n]``,
    ``weight [C, F, *k]`` (N = 1, 2, 3 from ``weight.dim()``); differentiable through the
    hand-written backward."""
    nd = weight.dim() - 2
    if nd not in _FNS:
        raise ValueError(f"conv_transpose: weight must be [C, F, k...] with 1 to 3 spatial dims, got {list(weight.shape)}")
    stride = _ntuple(stride, nd, "stride", "conv_transpose", 1)
    padding = _ntuple(padding, nd, "padding", "conv_transpose", 0)
    output_padding = _ntuple(output_padding, nd, "output_padding", "conv_transpose", 0)
    return ConvTransposeFunction.apply(x, weight, bias, stride, padding, output_padding, get_activation(activation))


class _ConvTransposeND(Layer):
    """N-d transposed convolution ``y = f(conv_transpose(x, W) + b)``; ``ConvTranspose1D/2D/3D`` fix N.

    Args:
        in_channels: ``C``, channels of the input.
        filters: ``F``, output channels; ``weight`` is ``[C, F, *kernel_size]`` (PyTorch's layout).
        kernel_size, stride, padding, output_padding: an int (same for every spatial dim) or a tuple of
            N ints; ``kernel_size, stride >= 1``, ``padding, output_padding >= 0`` and
            ``output_padding < stride`` (it only adds rows at the end that no input reaches otherwise).
        activation: an activation name (default ``"linear"``).
        bias: add a learnable ``bias [F]`` (Loom's transposed convolutions have none: ``bias=False``).
        init: ``"he_normal"`` (``N(0, 2/fan_in)``, ``fan_in = F·∏k``) or ``"loom_uniform"``
            (``U(−0.1, 0.1)``, Loom ``poly``); biases start at 0.

    Shapes: input ``[B, C, *n]`` → output ``[B, F, *out]``, ``out = (n − 1)·s − 2p + k + output_padding``
    (must be >= 1).
    """

    ndim: int = 0

    def __init__(
        self,
        in_channels: int,
        filters: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
        output_padding: int | tuple[int, ...] = 0,
        activation: str | Activation = "linear",
        bias: bool = True,
        init: str = "he_normal",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        name, nd = type(self).__name__, self.ndim
        for arg, v in (("in_channels", in_channels), ("filters", filters)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {v!r}")
        self.kernel_size = _ntuple(kernel_size, nd, "kernel_size", name, 1)
        self.stride = _ntuple(stride, nd, "stride", name, 1)
        self.padding = _ntuple(padding, nd, "padding", name, 0)
        self.output_padding = _ntuple(output_padding, nd, "output_padding", name, 0)
        if any(op >= s for op, s in zip(self.output_padding, self.stride)):
            raise ValueError(f"{name}: output_padding must be smaller than stride, got output_padding={self.output_padding}, stride={self.stride}")
        if not isinstance(bias, bool):
            raise ValueError(f"{name}: bias must be a bool, got {bias!r}")
        if init not in _INITS:
            raise ValueError(f"{name}: init must be one of {_INITS}, got {init!r}")
        self.in_channels, self.filters, self.init = in_channels, filters, init
        self.activation = get_activation(activation)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(in_channels, filters, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(filters, **factory)) if bias else None
        self.reset_parameters()

    @property
    def loom_type(self) -> str:  # Loom's name ("ConvTransposed2D" for ConvTranspose2D)
        return f"ConvTransposed{self.ndim}D"

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.init == "he_normal":
                self.weight.normal_(0.0, math.sqrt(2.0 / (self.filters * math.prod(self.kernel_size))))
            else:
                self.weight.uniform_(-0.1, 0.1)
            if self.bias is not None:
                self.bias.zero_()

    def output_shape(self, spatial: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size ``(n − 1)·s − 2p + k + output_padding`` for input spatial size ``spatial``."""
        return tuple(
            (n - 1) * s - 2 * p + k + op
            for n, k, s, p, op in zip(spatial, self.kernel_size, self.stride, self.padding, self.output_padding)
        )

    def _check(self, x: Tensor) -> None:
        name, nd = type(self).__name__, self.ndim
        if not is_tensor(x):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        fits = x.dim() == nd + 2 and x.shape[1] == self.in_channels and all(n >= 1 for n in x.shape[2:])
        fits = fits and all(o >= 1 for o in self.output_shape(tuple(x.shape[2:])))
        if not fits:
            dims = ", ".join(_SPATIAL_NAMES[nd])
            raise ValueError(
                f"{name}(in_channels={self.in_channels}, kernel_size={self.kernel_size}, padding={self.padding}): "
                f"input must have shape [batch, {self.in_channels}, {dims}] with every output size "
                f"(n − 1)·stride − 2·padding + kernel_size + output_padding >= 1, got {list(x.shape)}"
            )
        check_dtype(x, "input", self.weight.dtype, name)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return ConvTransposeFunction.apply(
            x, self.weight, self.bias, self.stride, self.padding, self.output_padding, self.activation
        )

    def forward_saved(self, x: Tensor) -> tuple[Tensor, ConvTransposeSaved]:
        self._check(x)
        return conv_transpose_forward(x, self.weight, self.bias, self.stride, self.padding, self.output_padding, self.activation)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        grad_x, (grad_w, grad_b) = conv_transpose_backward(grad_out, saved, needs_input_grad)
        return grad_x, (grad_w,) if grad_b is None else (grad_w, grad_b)

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, filters={self.filters}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, output_padding={self.output_padding}, "
            f"activation={self.activation.name}, bias={self.bias is not None}"
        )


class ConvTranspose1D(_ConvTransposeND):
    """1-d transposed convolution (Loom ``ConvTransposed1D``): ``[B, C, L] → [B, F, L_out]``;
    see ``_ConvTransposeND``."""

    ndim = 1


class ConvTranspose2D(_ConvTransposeND):
    """2-d transposed convolution (Loom ``ConvTransposed2D``): ``[B, C, H, W] → [B, F, H_out, W_out]``;
    see ``_ConvTransposeND``."""

    ndim = 2


class ConvTranspose3D(_ConvTransposeND):
    """3-d transposed convolution (Loom ``ConvTransposed3D``): ``[B, C, D, H, W] →
    [B, F, D_out, H_out, W_out]``; see ``_ConvTransposeND``."""

    ndim = 3
