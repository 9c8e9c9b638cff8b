"""Softmax layer: row-wise ``softmax(x / T)`` with a hand-written backward.

    forward   p  = softmax(x / T)                 along ``dim``, separately for every sample
    backward  dx = p ⊙ (g − ⟨g, p⟩) / T          from the saved output ``p``

Loom's ``poly`` softmax normalises over the whole batch at once and evaluates its backward at the
logits instead of the probabilities: neither is replicated. ``dim`` may not be the batch
dimension, so output row ``b`` depends only on input row ``b``.

On CUDA the math runs in the fused Triton kernels of ``torchloom.kernels.softmax``; elsewhere in their
plain-PyTorch reference. Read top to bottom: ``softmax_forward`` / ``softmax_backward`` (the math),
``SoftmaxFunction`` (the autograd bridge), ``softmax`` (functional), ``Softmax`` (module).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, is_grad_enabled, is_tensor

from .base import Layer, forbid_double_backward

__all__ = ["Softmax", "SoftmaxFunction", "SoftmaxSaved", "softmax", "softmax_forward", "softmax_backward"]


class SoftmaxSaved(NamedTuple):
    """What the backward needs: the output ``p`` (shape of the input), ``dim`` and ``temperature``."""

    output: Tensor
    dim: int
    temperature: float


def softmax_forward(x: Tensor, dim: int = -1, temperature: float = 1.0) -> tuple[Tensor, SoftmaxSaved]:
    """``softmax(x / T)`` along ``dim`` → ``(p, saved)``; ``p`` has ``x``'s shape. No autograd."""
    p = _softmax(x, dim, temperature)
    return p, SoftmaxSaved(p, dim, temperature)


def softmax_backward(grad_out: Tensor, saved: SoftmaxSaved, needs_input_grad: bool = True) -> tuple[Tensor | None, tuple[()]]:
    """Hand-written backward ``dx = p ⊙ (g − ⟨g, p⟩) / T`` (sum along ``dim``). Returns ``(dx, ())``:
    no parameters."""
    if not needs_input_grad:
        return None, ()
    p, dim, temperature = saved
    return _softmax_grad(grad_out, p, dim, temperature), ()


# The bodies of softmax_forward / softmax_backward on plain arguments, which SoftmaxFunction calls: a
# saved record (a NamedTuple) built while torch.compile traces adds ~20 guards to every compiled call.
# The kernel functions are imported here, on first use: the kernel module imports Triton (see norm.py).
def _softmax(x: Tensor, dim: int, temperature: float) -> Tensor:
    from ..kernels.softmax import softmax as softmax_kernel

    return softmax_kernel(x.movedim(dim, -1), temperature).movedim(-1, dim)


def _softmax_grad(grad_out: Tensor, p: Tensor, dim: int, temperature: float) -> Tensor:
    from ..kernels.softmax import softmax_backward as softmax_kernel_backward

    return softmax_kernel_backward(grad_out.movedim(dim, -1), p.movedim(dim, -1), temperature).movedim(-1, dim)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, temperature):
        p = _softmax(x, dim, temperature)
        ctx.save_for_backward(p)
        ctx.dim, ctx.temperature = dim, temperature
        return p

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():
            forbid_double_backward("Softmax")
        if not ctx.needs_input_grad[0]:
            return None, None, None
        (p,) = ctx.saved_tensors
        return _softmax_grad(grad_out, p, ctx.dim, ctx.temperature), None, None


def softmax(x: Tensor, dim: int = -1, temperature: float = 1.0) -> Tensor:
    """Functional softmax of ``x / temperature`` along ``dim``; differentiable through the
    hand-written backward."""
    return SoftmaxFunction.apply(x, dim, temperature)


class Softmax(Layer):
    """Row-wise softmax with temperature: ``softmax(x / temperature)`` along ``dim``.

    Args:
        dim: the dimension to normalise (default ``-1``); never the batch dimension 0.
        temperature: ``T > 0`` (default 1.0); larger flattens the distribution.

    Shapes: input ``[batch, ...]`` (at least 2-D) → output of the same shape. No parameters.
    """

    kernel_modules = ("torchloom.kernels.softmax",)

    def __init__(self, dim: int = -1, temperature: float = 1.0) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Softmax: dim must be an int, got {type(dim).__name__} {dim!r}")
        if dim == 0:
            raise ValueError("Softmax: dim must not be 0, the batch dimension (each sample is normalised on its own), got 0")
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or temperature <= 0
        ):
            raise ValueError(f"Softmax: temperature must be a finite number > 0, got {temperature!r}")
        self.dim = dim
        self.temperature = float(temperature)

    def _check(self, x: Tensor) -> int:
        """Validate ``x`` and return ``dim`` as a non-negative index."""
        if not is_tensor(x):
            raise TypeError(f"{self!r}: input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{self!r}: input must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 2 or not -x.dim() <= self.dim < x.dim() or self.dim % x.dim() == 0:
            raise ValueError(
                f"Softmax(dim={self.dim}): input must be [batch, ...] with dimension {self.dim} a non-batch "
                f"dimension (at least {max(2, self.dim + 1 if self.dim >= 0 else -self.dim + 1)}-D), "
                f"got shape {list(x.shape)}"
            )
        return self.dim % x.dim()

    def forward(self, x: Tensor) -> Tensor:
        return softmax(x, self._check(x), self.temperature)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, SoftmaxSaved]:
        return softmax_forward(x, self._check(x), self.temperature)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return softmax_backward(grad_out, saved, needs_input_grad)

    def reset_parameters(self) -> None:
        """No parameters: nothing to reset."""

    def extra_repr(self) -> str:
        return f"dim={self.dim}, temperature={self.temperature}"
