"""RMSNorm and LayerNorm over the last dimension, with hand-written backwards (SPEC §3).

    RMSNorm    r = 1/sqrt(mean(x²) + eps),            y = x·r·g
               dx = r·(gw − x̂·mean(gw ⊙ x̂)),  dg = Σ_rows gy ⊙ x̂     (x̂ = x·r, gw = gy ⊙ g)
    LayerNorm  μ = mean(x), r = 1/sqrt(var(x) + eps)  (biased variance),  x̂ = (x − μ)·r,  y = x̂·g + b
               dx = r·(gw − mean(gw) − x̂·mean(gw ⊙ x̂)),  dg = Σ_rows gy ⊙ x̂,  db = Σ_rows gy

Every row (all leading dimensions of ``[batch, ..., n]``) is normalised on its own. Loom's code
normalises a whole sample when the layer's size is left unset; torchloom always normalises the last
dimension (PyTorch's convention). RMSNorm runs the fused Triton kernels of
``torchloom.kernels.rmsnorm`` on CUDA, their reference elsewhere; LayerNorm is plain PyTorch.

Read top to bottom: RMSNorm (forward / backward, Function, functional, module), then LayerNorm.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .base import Layer

__all__ = [
    "RMSNorm", "RMSNormFunction", "RMSNormSaved", "rms_norm", "rms_norm_forward", "rms_norm_backward",
    "LayerNorm", "LayerNormFunction", "LayerNormSaved", "layer_norm", "layer_norm_forward", "layer_norm_backward",
]


def _kernels():
    # Imported on first use: the kernel module imports Triton, which ``import torchloom`` must not.
    from ..kernels import rmsnorm as kernels

    return kernels


def _check_size(n: int, layer: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{layer}: normalized_shape must be a positive int, got {n!r}")


def _check_eps(eps: float, layer: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{layer}: eps must be a finite number > 0, got {eps!r}")


def _check_input(x: Tensor, n: int, layer: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != n:
        raise ValueError(f"{layer}: input must have shape [batch, ..., {n}], got {list(x.shape)}")


# ============================================================================================ RMSNorm
class RMSNormSaved(NamedTuple):
    """What RMSNorm's backward needs: input ``[..., n]``, weight ``[n]``, ``rstd [...]`` (one per row)."""

    input: Tensor
    weight: Tensor
    rstd: Tensor


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, RMSNormSaved]:
    """``y = x / sqrt(mean(x²) + eps) · weight`` over the last dim of ``x [..., n]``. No autograd."""
    y, rstd = _kernels().rmsnorm(x, weight, eps)
    return y, RMSNormSaved(x, weight, rstd)


def rms_norm_backward(
    grad_out: Tensor, saved: RMSNormSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor]]:
    """Hand-written backward: ``dx = r·(gw − x̂·mean(gw ⊙ x̂))``, ``dw = Σ_rows gy ⊙ x̂``.
    Returns ``(dx or None, (dw,))``."""
    x, weight, rstd = saved
    dx, dw = _kernels().rmsnorm_backward(grad_out, x, weight, rstd)
    return (dx if needs_input_grad else None), (dw,)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, saved = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        dx, (dw,) = rms_norm_backward(grad_out, RMSNormSaved(*ctx.saved_tensors), ctx.needs_input_grad[0])
        return dx, dw, None


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
        _check_input(x, self.normalized_shape, repr(self))
        return RMSNormFunction.apply(x, self.weight, self.eps)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, RMSNormSaved]:
        _check_input(x, self.normalized_shape, repr(self))
        return rms_norm_forward(x, self.weight, self.eps)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return rms_norm_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


# ========================================================================================== LayerNorm
class LayerNormSaved(NamedTuple):
    """What LayerNorm's backward needs: ``x_hat [..., n]`` (the normalised input), ``rstd [..., 1]``
    and ``weight [n]``."""

    x_hat: Tensor
    rstd: Tensor
    weight: Tensor


def layer_norm_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, LayerNormSaved]:
    """``y = (x − mean) / sqrt(var + eps) · weight + bias`` (biased variance) over the last dim of
    ``x [..., n]``. No autograd. Half precision is computed in float32."""
    dt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xc = x.to(dt)
    mean = xc.mean(dim=-1, keepdim=True)
    centered = xc - mean
    rstd = torch.rsqrt(centered.square().mean(dim=-1, keepdim=True) + eps)
    x_hat = centered * rstd
    y = x_hat * weight.to(dt) + bias.to(dt)
    return y.to(x.dtype), LayerNormSaved(x_hat, rstd, weight)


def layer_norm_backward(
    grad_out: Tensor, saved: LayerNormSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, Tensor]]:
    """Hand-written backward: ``dx = r·(gw − mean(gw) − x̂·mean(gw ⊙ x̂))``, ``dw = Σ_rows gy ⊙ x̂``,
    ``db = Σ_rows gy``. Returns ``(dx or None, (dw, db))``."""
    x_hat, rstd, weight = saved
    n = x_hat.shape[-1]
    g = grad_out.to(x_hat.dtype)
    dw = (g * x_hat).reshape(-1, n).sum(0).to(weight.dtype)
    db = g.reshape(-1, n).sum(0).to(weight.dtype)
    dx = None
    if needs_input_grad:
        gw = g * weight.to(x_hat.dtype)
        dx = rstd * (gw - gw.mean(dim=-1, keepdim=True) - x_hat * (gw * x_hat).mean(dim=-1, keepdim=True))
        dx = dx.to(grad_out.dtype)
    return dx, (dw, db)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, saved = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        dx, (dw, db) = layer_norm_backward(grad_out, LayerNormSaved(*ctx.saved_tensors), ctx.needs_input_grad[0])
        return dx, dw, db, None


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
        _check_input(x, self.normalized_shape, repr(self))
        return LayerNormFunction.apply(x, self.weight, self.bias, self.eps)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, LayerNormSaved]:
        _check_input(x, self.normalized_shape, repr(self))
        return layer_norm_forward(x, self.weight, self.bias, self.eps)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return layer_norm_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
