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

_M32 = 0xFFFFFFFF
U_BITS = 24  # bits per draw: u is exact in float32, and P(u < p) = ceil(p·2²⁴)/2²⁴ (bias < 6e-8)


def _mul32(a, c: int):
    """``a · c mod 2³²`` for ``a`` in [0, 2³²) (a Python int or an int64 tensor) and a constant
    ``c`` < 2³²; the product is split in 16-bit halves so that an int64 never overflows."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """Wellons' ``lowbias32`` of 32-bit values (Python int or int64 tensor)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int, step, index: int):
    """The two 32-bit keys ``(a, b)`` of parameter ``index`` at ``step`` (``step`` a Python int or
    a 0-d int64 tensor, for a step counter that lives on the device)."""
    s = seed & ((1 << 64) - 1)
    k = mix32(mix32((s & _M32) ^ 0x9E3779B9) ^ (s >> 32))
    if isinstance(step, Tensor):
        k = mix32((step & _M32) ^ k)
        k = mix32(((step >> 32) & _M32) ^ k)
    else:
        k = mix32(((step & _M32) ^ k))
        k = mix32((((step >> 32) & _M32) ^ k))
    a = mix32(k ^ (index & _M32))
    b = mix32(a ^ 0x85EBCA6B)
    return a, b


def uniform_bits(numel: int, seed: int, step, index: int, device: torch.device | str | None = None) -> Tensor:
    """``numel`` draws of 24 uniform bits (int64 tensor in [0, 2²⁴)) for parameter ``index`` at
    ``step``; element ``i``'s draw depends only on ``(seed, step, index, i)``."""
    a, b = stream_key(seed, step, index)
    i = torch.arange(numel, dtype=torch.int64, device=device)
    h = mix32(((i & _M32) + a) & _M32)
    h = mix32(h ^ b ^ (i >> 32))
    return h >> (32 - U_BITS)


def uniform(numel: int, seed: int, step, index: int, device: torch.device | str | None = None) -> Tensor:
    """``numel`` float32 draws ``u = bits · 2⁻²⁴`` in [0, 1) (exact in float32)."""
    return uniform_bits(numel, seed, step, index, device).to(torch.float32) * (2.0 ** -U_BITS)
