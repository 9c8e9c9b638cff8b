"""Fused softmax cross-entropy: loss and gradient w.r.t. the logits in one row-wise pass (SPEC §4, §11).

Rows are the leading dimensions of ``logits [..., C]`` (``B`` rows). Targets are integer class
labels ``[...]`` or one-hot / soft probabilities ``[..., C]``.
``loss = (1/B) Σ_b −Σ_j y_bj log softmax(o_b)_j``, ``grad = (softmax(o) − y)/B``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import use_triton

__all__ = ["softmax_ce_loss_grad_ref", "softmax_ce_loss_grad"]


def softmax_ce_loss_grad_ref(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: ``(loss, grad)``; ``loss`` 0-d float64, ``grad`` like ``logits``."""
    c = logits.shape[-1]
    x = logits.reshape(-1, c)
    rows = x.shape[0]
    logp = torch.log_softmax(x, dim=-1)
    grad = logp.exp()
    if target.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        labels = target.reshape(-1).long()
        idx = torch.arange(rows, device=x.device)
        loss = -logp[idx, labels].double().sum() / rows
        grad[idx, labels] -= 1.0
    else:
        y = target.reshape(-1, c)
        loss = -(y.double() * logp.double()).sum() / rows
        grad = grad - y
    return loss, (grad / rows).view(logits.shape)


def softmax_ce_loss_grad(logits: Tensor, target: Tensor, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``(loss, grad)`` of softmax cross-entropy; the Triton kernel on CUDA, the reference elsewhere."""
    if use_triton(logits, backend):
        raise NotImplementedError("Triton softmax cross-entropy kernel not written yet")
    return softmax_ce_loss_grad_ref(logits, target)
