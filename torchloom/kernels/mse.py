"""Fused MSE gradient + loss (Loom ``DispatchMSEGradPartialLoss``, SPEC §11).

``loss = (1/N) Σ (o−y)²`` and ``grad = 2(o−y)/N`` over all ``N`` elements of ``output``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import use_triton

__all__ = ["mse_loss_grad_ref", "mse_loss_grad"]


def mse_loss_grad_ref(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: ``output``, ``target`` of one shape → ``(loss, grad)``; ``loss`` is a 0-d float64
    tensor summed in float64 as Loom does; ``grad`` has ``output``'s shape and dtype."""
    diff = output - target
    n = diff.numel()
    grad = diff * (2.0 / n)
    loss = diff.double().square().sum() / n
    return loss, grad


def mse_loss_grad(output: Tensor, target: Tensor, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``(loss, grad)`` of MSE; the Triton kernel on CUDA, the reference elsewhere."""
    if use_triton(output, backend):
        raise NotImplementedError("Triton MSE kernel not written yet")
    return mse_loss_grad_ref(output, target)
