"""Counter-based random bits for stochastic rounding, keyed by ``(seed, step, parameter index)``.

Every draw is a pure function of its key and the element's position, written in integer torch ops
(int64 tensors holding 32-bit values, and multiplications split so that no product exceeds 2⁴⁸):
the same bits on CPU and GPU, on every rank, run after run, and after a resume from any step. No
generator state, no host read: the ops can sit in a captured CUDA graph.

The mixing function is Chris Wellons' ``lowbias32`` (two multiply–xorshift rounds, bias ≈ 0.17 ‰);
a key is the chain ``mix(mix(mix(seed) ^ step) ^ index)`` and element ``i`` draws
``mix(mix(i_lo + key_a) ^ key_b ^ i_hi) >> 8``: 24 uniform bits, ``u = bits · 2⁻²⁴ ∈ [0, 1)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mix32", "stream_key", "uniform_bits", "uniform"]

from ..kernels._counter import U_BITS, draw_bits, mix32, stream_key


def uniform_bits(numel: int, seed: int, step, index: int, device: torch.device | str | None = None) -> Tensor:
    """``numel`` draws of 24 uniform bits (int64 tensor in [0, 2²⁴)) for parameter ``index`` at
    ``step``; element ``i``'s draw depends only on ``(seed, step, index, i)``."""
    a, b = stream_key(seed, step, index)
    return draw_bits(torch.arange(numel, dtype=torch.int64, device=device), a, b)


def uniform(numel: int, seed: int, step, index: int, device: torch.device | str | None = None) -> Tensor:
    """``numel`` float32 draws ``u = bits · 2⁻²⁴`` in [0, 1) (exact in float32)."""
    return uniform_bits(numel, seed, step, index, device).to(torch.float32) * (2.0 ** -U_BITS)
