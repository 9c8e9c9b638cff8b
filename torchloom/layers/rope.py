"""Rotary position embedding (RoPE, rotate-half convention, as Loom and GPT-NeoX/LLaMA-HF): the angle
tables and the rotation of ``[..., S, D]`` tensors and its inverse, in plain torch ops. Used by
``layers.attention`` (re-exported there) and its traced path under ``torch.compile``."""

from __future__ import annotations

from torch import Tensor, arange, cat, float64

__all__ = ["rope_tables", "rope_rotate", "rope_rotate_inverse"]


def rope_tables(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``[S, D/2]``: angle ``s · θ^(−2i/D)`` for position ``s`` and pair ``i``.
    Computed in float64, then cast, so the tables are exact to the working precision."""
    inv_freq = theta ** (-arange(0, head_dim, 2, device=device, dtype=float64) / head_dim)
    angle = arange(seq_len, device=device, dtype=float64)[:, None] * inv_freq[None, :]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on ``x [..., S, D]`` with ``cos, sin [S, D/2]`` (or any shape that broadcasts
    against ``x``'s halves: ``[S, 1, D/2]`` for ``x [B, S, H, D]``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rope_rotate_inverse(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The backward of ``rope_rotate``: rotation by the opposite angle (the transpose)."""
    g1, g2 = g.chunk(2, dim=-1)
    return cat((g1 * cos + g2 * sin, g2 * cos - g1 * sin), dim=-1)
