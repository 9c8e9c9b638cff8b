"""Loom's ``"crossentropy"`` on probabilities (SPEC §4): ``loss = (1/N) Σ −y·ln(o + 1e-10)``,
``grad = −y/(o + 1e-10)/N``, computed in float64 as Loom does, over all ``N`` output elements."""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import use_triton

__all__ = ["loom_ce_loss_grad_ref", "loom_ce_loss_grad", "LOOM_CE_EPS"]

LOOM_CE_EPS = 1e-10


def loom_ce_loss_grad_ref(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: ``(loss, grad)``; ``loss`` 0-d float64, ``grad`` like ``output``."""
    n = output.numel()
    p = output.double() + LOOM_CE_EPS
    y = target.double()
    loss = -(y * torch.log(p)).sum() / n
    grad = (-(y / p) * (1.0 / n)).to(output.dtype)
    return loss, grad


def loom_ce_loss_grad(output: Tensor, target: Tensor, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``(loss, grad)`` of Loom's probability cross-entropy; Triton on CUDA, the reference elsewhere."""
    if use_triton(output, backend):
        raise NotImplementedError("Triton crossentropy kernel not written yet")
    return loom_ce_loss_grad_ref(output, target)
