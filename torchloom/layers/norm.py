"""RMSNorm and LayerNorm over the last dimension, with hand-written backwards.

    RMSNorm    r = 1/sqrt(mean(x²) + eps),            y = x·r·g
               dx = r·(gw − x̂·mean(gw ⊙ x̂)),  dg = Σ_rows gy ⊙ x̂     (x̂ = x·r, gw = gy ⊙ g)
    LayerNorm  μ = mean(x), r = 1/sqrt(var(x) + eps)  (biased variance),  x̂ = (x − μ)·r,  y = x̂·g + b
               dx = r·(gw − mean(gw) − x̂·mean(gw ⊙ x̂)),  dg = Σ_rows gy ⊙ x̂,  db = Σ_rows gy

Every row (all leading dimensions of ``[batch, ..., n]``) is normalised on its own. Loom's code
normalises a whole sample when the layer's size is left unset; torchloom always normalises the last
dimension (PyTorch's convention). Both run fused Triton kernels on CUDA
(``torchloom.kernels.rmsnorm`` / ``torchloom.kernels.layernorm``), their reference elsewhere.

Mixed precision: the statistics and the arithmetic are float32 for half-precision inputs; the output
and ``dx`` have the input's dtype, ``dw``/``db`` the parameters' (so bfloat16 activations with float32
parameters, as under ``torch.autocast``, work without a cast; an input of another floating dtype than
the parameters is accepted for the same reason). Double backward raises ``RuntimeError``.

Read top to bottom: RMSNorm (forward / backward, Function, functional, module), then LayerNorm.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, is_grad_enabled, is_tensor, nn

from .base import Layer, forbid_double_backward

__all__ = [
    "RMSNorm", "RMSNormFunction", "RMSNormSaved", "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "LayerNorm", "LayerNormFunction", "LayerNormSaved", "layer_norm", "layer_norm_forward", "layer_norm_backward",
]


# The kernel functions are imported where they are called: a kernel module imports Triton, which
# ``import torchloom`` must not; and a function imported by name leaves a compiled graph one guard,
# where reading it from the module object (``kernels.rmsnorm``) also made Dynamo check, on every call,
# that this module object is the one the kernel's own code runs in.


def _check_size(n: int, layer: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{layer}: normalized_shape must be a positive int, got {n!r}")


def _check_eps(eps: float, layer: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{layer}: eps must be a finite number > 0, got {eps!r}")


def _check_input(x: Tensor, n: int, layer: nn.Module) -> None:
    if not is_tensor(x):
        raise TypeError(f"{layer!r}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != n:
        raise ValueError(f"{layer!r}: input must have shape [batch, ..., {n}], got {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(
            f"{layer!r}: input must be a floating-point tensor (the layer's dtype is {layer.weight.dtype}), got dtype {x.dtype}"
        )


# ============================================================================================ RMSNorm
class RMSNormSaved(NamedTuple):
    """What RMSNorm's backward needs: input ``[..., n]``, weight ``[n]``, ``rstd [...]`` (one per row)."""

    input: Tensor
    weight: Tensor
    rstd: Tensor


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, RMSNormSaved]:
    """``y = x / sqrt(mean(x²) + eps) · weight`` over the last dim of ``x [..., n]``. No autograd."""
    from ..kernels.rmsnorm import rmsnorm

    y, rstd = rmsnorm(x, weight, eps)
    return y, RMSNormSaved(x, weight, rstd)


def rms_norm_backward(
    grad_out: Tensor, saved: RMSNormSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor]]:
    """Hand-written backward: ``dx = r·(gw − x̂·mean(gw ⊙ x̂))``, ``dw = Σ_rows gy ⊙ x̂``.
    Returns ``(dx or None, (dw,))``."""
    x, weight, rstd = saved
    from ..kernels.rmsnorm import rmsnorm_backward

    dx, dw = rmsnorm_backward(grad_out, x, weight, rstd)
    return (dx if needs_input_grad else None), (dw,)


class RMSNormFunction(torch.autograd.Function):
    # Calls the ops that rms_norm_forward / rms_norm_backward call, without their saved record: a
    # NamedTuple built while torch.compile traces adds ~20 guards to every compiled call.
    @staticmethod
    def forward(ctx, x, weight, eps):
        from ..kernels.rmsnorm import rmsnorm

        y, rstd = rmsnorm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():  # forbid_double_backward's question, asked here: one call fewer to trace
            forbid_double_backward("RMSNorm")
        x, weight, rstd = ctx.saved_tensors
        from ..kernels.rmsnorm import rmsnorm_backward

        dx, dw = rmsnorm_backward(grad_out, x, weight, rstd)
        return (dx if ctx.needs_input_grad[0] else None), dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Functional RMSNorm over the last dimension; differentiable through the hand-written backward."""
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(Layer):
    """RMS normalisation over the last dimension: ``x / sqrt(mean(x²) + eps) · weight``
    (``torch.nn.RMSNorm(n, eps)`` computes the same).

    Args:
        normalized_shape: ``n``, the size of the last dimension; ``weight [n]`` starts at 1.
        eps: added to the mean square (default 1e-6, Loom's).

    Shapes: input ``[batch, ..., n]`` → output of the same shape.
    """

    kernel_modules = ("torchloom.kernels.rmsnorm", "torchloom.kernels.layernorm")

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_size(normalized_shape, "RMSNorm")
        _check_eps(eps, "RMSNorm")
        self.normalized_shape = normalized_shape
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.empty(normalized_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        _check_input(x, self.weight.shape[0], self)  # the weight's size: torch.compile guards it already
        return RMSNormFunction.apply(x, self.weight, self.eps)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, RMSNormSaved]:
        _check_input(x, self.normalized_shape, self)
        return rms_norm_forward(x, self.weight, self.eps)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return rms_norm_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


# ========================================================================================== LayerNorm
class LayerNormSaved(NamedTuple):
    """What LayerNorm's backward needs: input ``[..., n]``, weight ``[n]``, ``mean`` and ``rstd``
    ``[...]`` (one per row; float32 for half-precision input)."""

    input: Tensor
    weight: Tensor
    mean: Tensor
    rstd: Tensor


def layer_norm_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, LayerNormSaved]:
    """``y = (x − mean) / sqrt(var + eps) · weight + bias`` (biased variance) over the last dim of
    ``x [..., n]``. No autograd. Half precision is computed in float32."""
    from ..kernels.layernorm import layernorm

    y, mean, rstd = layernorm(x, weight, bias, eps)
    return y, LayerNormSaved(x, weight, mean, rstd)


def layer_norm_backward(
    grad_out: Tensor, saved: LayerNormSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, Tensor]]:
    """Hand-written backward: ``dx = r·(gw − mean(gw) − x̂·mean(gw ⊙ x̂))``, ``dw = Σ_rows gy ⊙ x̂``,
    ``db = Σ_rows gy``. Returns ``(dx or None, (dw, db))``."""
    x, weight, mean, rstd = saved
    from ..kernels.layernorm import layernorm_backward

    dx, dw, db = layernorm_backward(grad_out, x, weight, mean, rstd)
    return (dx if needs_input_grad else None), (dw, db)


class LayerNormFunction(torch.autograd.Function):
    # As RMSNormFunction: the ops of layer_norm_forward / layer_norm_backward, without the record.
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        from ..kernels.layernorm import layernorm

        y, mean, rstd = layernorm(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():
            forbid_double_backward("LayerNorm")
        x, weight, mean, rstd = ctx.saved_tensors
        from ..kernels.layernorm import layernorm_backward

        dx, dw, db = layernorm_backward(grad_out, x, weight, mean, rstd)
        return (dx if ctx.needs_input_grad[0] else None), dw, db, None


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Functional LayerNorm over the last dimension; differentiable through the hand-written backward."""
    return LayerNormFunction.apply(x, weight, bias, eps)


class LayerNorm(Layer):
    """Layer normalisation over the last dimension with the biased variance:
    ``(x − mean) / sqrt(var + eps) · weight + bias`` (``F.layer_norm`` computes the same).

    Args:
        normalized_shape: ``n``, the size of the last dimension; ``weight [n]`` starts at 1,
            ``bias [n]`` at 0.
        eps: added to the variance (default 1e-5, Loom's and PyTorch's).

    Shapes: input ``[batch, ..., n]`` → output of the same shape.
    """

    kernel_modules = ("torchloom.kernels.layernorm",)

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_size(normalized_shape, "LayerNorm")
        _check_eps(eps, "LayerNorm")
        self.normalized_shape = normalized_shape
        self.eps = float(eps)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(normalized_shape, **factory))
        self.bias = nn.Parameter(torch.empty(normalized_shape, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        _check_input(x, self.weight.shape[0], self)  # the weight's size: torch.compile guards it already
        return LayerNormFunction.apply(x, self.weight, self.bias, self.eps)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, LayerNormSaved]:
        _check_input(x, self.normalized_shape, self)
        return layer_norm_forward(x, self.weight, self.bias, self.eps)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return layer_norm_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
