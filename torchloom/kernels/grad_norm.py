"""Global L2 norm of a list of gradients and the clip scale, in one reduction without a host sync
(SPEC §11): ``norm = sqrt(Σ_t Σ g_t²)``, ``scale = max_norm / norm`` when ``norm > max_norm`` else 1."""

from __future__ import annotations

import torch
from torch import Tensor

from ._triton import use_triton

__all__ = ["grad_norm_ref", "grad_norm", "clip_grad_norm_"]


def grad_norm_ref(grads: list[Tensor]) -> Tensor:
    """Reference: the global L2 norm of ``grads`` as a 0-d tensor, accumulated in float32 (float64 for
    float64 gradients)."""
    acc = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=acc) for g in grads]))


def grad_norm(grads: list[Tensor], backend: str | None = None) -> Tensor:
    """Global L2 norm (0-d tensor on the gradients' device); Triton on CUDA, the reference elsewhere."""
    if use_triton(grads[0], backend):
        raise NotImplementedError("Triton grad-norm kernel not written yet")
    return grad_norm_ref(grads)


@torch.no_grad()
def clip_grad_norm_(grads: list[Tensor], max_norm: float, backend: str | None = None) -> Tensor:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``; returns the norm
    before clipping (0-d tensor). No host sync: the scale is computed on the device."""
    norm = grad_norm(grads, backend)
    scale = torch.clamp(max_norm / norm, max=1.0)  # norm <= max_norm → 1; norm = 0 → inf → 1
    torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return norm
