"""Convolutions ``Conv1D`` / ``Conv2D`` / ``Conv3D`` (Loom ``CNN1/2/3``) and ``Flatten``, each with a
hand-written backward.

One N-d implementation serves the three layers. Read top to bottom: ``conv_forward`` /
``conv_backward`` (the math, side by side), ``ConvFunction`` (the autograd bridge), ``conv``
(functional), ``_ConvND`` and its three subclasses (modules), then ``Flatten``.

* forward: cross-correlation (``F.conv1d/2d/3d``), ``pre = x ⋆ W + b``, then ``y = f(pre)``;
* backward: ``gPre = gOut ⊙ f'(pre)``, then ``dx``, ``dW`` and ``db`` from one call of the explicit
  convolution-backward primitive ``torch.ops.aten.convolution_backward`` (the transposed convolution
  for ``dx``, the input/gradient correlation for ``dW``, the spatial sum for ``db``). It is the
  primitive ``torch.nn.grad.conv*d_input/_weight`` themselves call; no autograd graph is built on our
  forward.

Tensors are channel-first like Loom and PyTorch: input ``[B, C, L]`` / ``[B, C, H, W]`` /
``[B, C, D, H, W]``, weight ``[F, C, k…]``, output size per spatial dim ``⌊(n + 2p − k)/s⌋ + 1``.
Loom's CNN layers have a square/cubic kernel, equal strides and no bias: ``bias=False`` with int
``kernel_size``/``stride``/``padding`` reproduces them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, is_grad_enabled, is_tensor, nn

from .activations import Activation, get_activation
from .base import Layer, autocast_off, cast_for_autocast, check_dtype, forbid_double_backward

__all__ = [
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "ConvFunction",
    "ConvSaved",
    "Flatten",
    "conv",
    "conv_forward",
    "conv_backward",
]

_INITS = ("he_normal", "loom_uniform")
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward  # one name per operator: see kernels/_triton.triton_operator
_CONV_FNS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_SPATIAL_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}


class ConvSaved(NamedTuple):
    """What the convolution's backward needs: input ``[B, C, *n]``, weight ``[F, C, *k]``,
    pre-activation ``[B, F, *out]``, the activation, whether there is a bias, stride and padding."""

    input: Tensor
    weight: Tensor
    pre: Tensor
    activation: Activation
    has_bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype] | None = None  # (input, parameters) when cast for autocast


def conv_forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    activation: Activation,
) -> tuple[Tensor, ConvSaved]:
    """``x [B, C, *n]``, ``weight [F, C, *k]``, ``bias [F]`` → ``(y [B, F, *out], saved)`` with
    ``out = ⌊(n + 2p − k)/s⌋ + 1``. Cross-correlation, as Loom and PyTorch. No autograd. Under
    ``torch.autocast`` the input and parameters are cast to the autocast dtype first (as autocast does
    for ``F.conv2d``) and ``y`` has that dtype."""
    y, x, weight, pre, dtypes = _conv_forward(x, weight, bias, stride, padding, activation)
    return y, ConvSaved(x, weight, pre, activation, bias is not None, stride, padding, dtypes)


# The bodies of conv_forward / conv_backward on plain arguments, which ConvFunction calls: a saved
# record (a NamedTuple) built while torch.compile traces adds ~20 guards to every compiled call.
def _conv_forward(x, weight, bias, stride, padding, activation):
    """``(y, x, weight, pre, dtypes)``: ``conv_forward``'s result, its record's fields unpacked."""
    nd = weight.dim() - 2
    dev = x.device.type
    dtypes = (x.dtype, weight.dtype)
    cast_to, (x, weight, bias) = cast_for_autocast(dev, x, weight, bias)
    with autocast_off(dev):
        pre = _CONV_FNS[nd](x, weight, bias, stride, padding)
        y = activation.forward(pre)
    return y, x, weight, pre, dtypes if cast_to is not None else None


def conv_backward(
    grad_out: Tensor, saved: ConvSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, Tensor | None]]:
    """Hand-written backward: ``gPre = gOut ⊙ f'(pre)``; ``dx = gPre ⋆ᵀ W`` (transposed convolution,
    zero where the stride skipped input positions), ``dW[f, c, κ] = Σ_{b, o} gPre[b, f, o] ·
    x_pad[b, c, o·s + κ]``, ``db[f] = Σ_{b, o} gPre[b, f, o]``. Returns ``(dx or None, (dW, db or None))``.
    Runs in the saved tensors' dtype with autocast off; after an autocast cast the gradients come
    back in the input's and the parameters' own dtypes."""
    return _conv_backward(grad_out, *saved, needs_input_grad)


def _conv_backward(grad_out, x, weight, pre, activation, has_bias, stride, padding, dtypes, needs_input_grad):
    nd = weight.dim() - 2
    if grad_out.dtype != pre.dtype:
        grad_out = grad_out.to(pre.dtype)
    with autocast_off(x.device.type):
        grad_x, grad_w, grad_b = _conv_products(grad_out, x, weight, pre, activation, has_bias, stride, padding, nd, needs_input_grad)
    if dtypes is not None:
        grad_x = grad_x.to(dtypes[0]) if grad_x is not None else None
        grad_w = grad_w.to(dtypes[1])
        grad_b = grad_b.to(dtypes[1]) if grad_b is not None else None
    return (grad_x if needs_input_grad else None), (grad_w, grad_b if has_bias else None)


def _conv_products(grad_out, x, weight, pre, activation, has_bias, stride, padding, nd, needs_input_grad):
    g_pre = activation.grad(grad_out, pre)
    # One explicit primitive computes the three products (it is what torch.nn.grad.conv*d_input /
    # conv*d_weight call); output_mask skips what is not needed.
    return _CONVOLUTION_BACKWARD(
        g_pre,
        x,
        weight,
        [weight.shape[0]] if has_bias else None,
        list(stride),
        list(padding),
        [1] * nd,  # dilation
        False,  # transposed
        [0] * nd,  # output_padding
        1,  # groups
        [needs_input_grad, True, has_bias],
    )


class ConvFunction(torch.autograd.Function):
    """The convolution as an ``autograd.Function``; a second derivative raises ``RuntimeError``."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, activation):
        y, x_used, w_used, pre, dtypes = _conv_forward(x, weight, bias, stride, padding, activation)
        ctx.save_for_backward(x_used, w_used, pre)
        ctx.activation, ctx.has_bias, ctx.stride, ctx.padding = activation, bias is not None, stride, padding
        ctx.dtypes = dtypes
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():
            forbid_double_backward(f"Conv{len(ctx.stride)}D")
        x, weight, pre = ctx.saved_tensors
        grad_x, (grad_w, grad_b) = _conv_backward(
            grad_out.contiguous(), x, weight, pre, ctx.activation, ctx.has_bias, ctx.stride, ctx.padding, ctx.dtypes,
            ctx.needs_input_grad[0],
        )
        return grad_x, grad_w, grad_b, None, None, None


def _ntuple(value: int | tuple[int, ...], nd: int, name: str, owner: str, minimum: int) -> tuple[int, ...]:
    """``value`` as a tuple of ``nd`` ints ``>= minimum`` (an int is repeated); else ``ValueError``."""
    items = (value,) * nd if isinstance(value, int) and not isinstance(value, bool) else value
    ok = isinstance(items, (tuple, list)) and len(items) == nd
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in items)
    if not ok:
        raise ValueError(
            f"{owner}: {name} must be an int >= {minimum} or a tuple of {nd} such ints, got {value!r}"
        )
    return tuple(items)


def conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] = 0,
    activation: str | Activation = "linear",
) -> Tensor:
    """Functional N-d convolution ``f(x ⋆ W + b)`` for ``x [B, C, *n]``, ``weight [F, C, *k]``
    (N = 1, 2, 3 from ``weight.dim()``); differentiable through the hand-written backward."""
    nd = weight.dim() - 2
    if nd not in _CONV_FNS:
        raise ValueError(f"conv: weight must be [F, C, k...] with 1 to 3 spatial dims, got {list(weight.shape)}")
    stride = _ntuple(stride, nd, "stride", "conv", 1)
    padding = _ntuple(padding, nd, "padding", "conv", 0)
    return ConvFunction.apply(x, weight, bias, stride, padding, get_activation(activation))


class _ConvND(Layer):
    """N-d convolution layer ``y = f(x ⋆ W + b)`` (cross-correlation); ``Conv1D/2D/3D`` fix N.

    Args:
        in_channels: ``C``, channels of the input.
        filters: ``F``, output channels; ``weight`` is ``[F, C, *kernel_size]``.
        kernel_size, stride, padding: an int (same for every spatial dim) or a tuple of N ints;
            ``kernel_size, stride >= 1``, ``padding >= 0`` (zero padding on both sides).
        activation: an activation name, see ``activation_names()`` (default ``"linear"``).
        bias: add a learnable ``bias [F]`` (Loom's CNN layers have none: ``bias=False``).
        init: ``"he_normal"`` (``N(0, 2/fan_in)``, ``fan_in = C·∏k``, Loom ``nn.InitDenseLayer``'s
            rule) or ``"loom_uniform"`` (``U(−0.1, 0.1)``, Loom ``poly``); biases start at 0.

    Shapes: input ``[B, C, *n]`` → output ``[B, F, *out]``, ``out = ⌊(n + 2p − k)/s⌋ + 1``; every
    spatial ``n + 2p >= k``.

    The input's dtype must be the parameters' (``TypeError`` otherwise) except under
    ``torch.autocast`` (input and parameters cast to the autocast dtype, gradients returned in their
    own dtypes). A second derivative (``create_graph=True``) raises ``RuntimeError``;
    ``torch.func.functional_call`` works; ``vmap`` and ``torch.jit.script`` raise ``RuntimeError``.
    """

    ndim: int = 0  # spatial dimensions, set by the subclasses

    def __init__(
        self,
        in_channels: int,
        filters: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] = 0,
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
        if not isinstance(bias, bool):
            raise ValueError(f"{name}: bias must be a bool, got {bias!r}")
        if init not in _INITS:
            raise ValueError(f"{name}: init must be one of {_INITS}, got {init!r}")
        self.in_channels = in_channels
        self.filters = filters
        self.activation = get_activation(activation)
        self.init = init
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(filters, in_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(filters, **factory)) if bias else None
        self.reset_parameters()

    @property
    def loom_type(self) -> str:  # Loom's name for the layer ("CNN2" for Conv2D)
        return f"CNN{self.ndim}"

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.init == "he_normal":
                fan_in = self.in_channels * math.prod(self.kernel_size)
                self.weight.normal_(0.0, math.sqrt(2.0 / fan_in))
            else:
                self.weight.uniform_(-0.1, 0.1)
            if self.bias is not None:
                self.bias.zero_()

    def output_shape(self, spatial: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size ``⌊(n + 2p − k)/s⌋ + 1`` for input spatial size ``spatial``."""
        return tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(spatial, self.kernel_size, self.stride, self.padding))

    def _check(self, x: Tensor) -> None:
        w = self.weight  # the common case reads only tensors (guarded by torch.compile already) and padding
        if is_tensor(x) and x.dim() == w.dim() and x.shape[1] == w.shape[1] and x.dtype == w.dtype:
            if all(n + 2 * p >= k for n, k, p in zip(x.shape[2:], w.shape[2:], self.padding)):
                return
        name, nd = type(self).__name__, self.ndim
        if not is_tensor(x):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        fits = x.dim() == nd + 2 and x.shape[1] == self.in_channels
        fits = fits and all(n + 2 * p >= k for n, k, p in zip(x.shape[2:], self.kernel_size, self.padding))
        if not fits:
            dims = ", ".join(_SPATIAL_NAMES[nd])
            raise ValueError(
                f"{name}(in_channels={self.in_channels}, kernel_size={self.kernel_size}, padding={self.padding}): "
                f"input must have shape [batch, {self.in_channels}, {dims}] with each spatial size + "
                f"2·padding >= kernel_size, got {list(x.shape)}"
            )
        check_dtype(x, "input", self.weight.dtype, name)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return ConvFunction.apply(x, self.weight, self.bias, self.stride, self.padding, self.activation)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, ConvSaved]:
        self._check(x)
        return conv_forward(x, self.weight, self.bias, self.stride, self.padding, self.activation)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        grad_x, (grad_w, grad_b) = conv_backward(grad_out, saved, needs_input_grad)
        return grad_x, (grad_w,) if grad_b is None else (grad_w, grad_b)

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, filters={self.filters}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, activation={self.activation.name}, "
            f"bias={self.bias is not None}"
        )


class Conv1D(_ConvND):
    """1-d convolution (Loom ``CNN1``): input ``[B, C, L]`` → output ``[B, F, L_out]``; see ``_ConvND``."""

    ndim = 1


class Conv2D(_ConvND):
    """2-d convolution (Loom ``CNN2``): input ``[B, C, H, W]`` → output ``[B, F, H_out, W_out]``;
    see ``_ConvND``."""

    ndim = 2


class Conv3D(_ConvND):
    """3-d convolution (Loom ``CNN3``): input ``[B, C, D, H, W]`` → output
    ``[B, F, D_out, H_out, W_out]``; see ``_ConvND``."""

    ndim = 3


# --------------------------------------------------------------------------------------------
# Flatten: the bridge from a convolution's [B, F, ...] output to Dense's [B, features] input (Loom
# keeps every activation as a flat buffer, so it needs no such layer).


class FlattenSaved(NamedTuple):
    """What Flatten's backward needs: the input's shape."""

    shape: tuple[int, ...]


class Flatten(Layer):
    """Flattens every dimension but the batch: ``[B, d1, d2, …] → [B, d1·d2·…]`` (C order, as
    ``torch.flatten(x, 1)``). Backward reshapes the gradient back. No parameters; input at least 2-d."""

    def _check(self, x: Tensor) -> None:
        if not is_tensor(x):
            raise TypeError(f"Flatten: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"Flatten: input must have shape [batch, d1, ...] (at least 2-d), got {list(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return super().forward(x)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, FlattenSaved]:
        self._check(x)
        return x.reshape(x.shape[0], -1), FlattenSaved(tuple(x.shape))

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return (grad_out.reshape(saved.shape) if needs_input_grad else None), ()

    def reset_parameters(self) -> None:  # no parameters
        pass
