"""The counter hash of stochastic rounding in torch integer ops (no Triton): Wellons' ``lowbias32``,
the key chain ``mix(mix(mix(seed) ^ step) ^ index)`` and an element's draw. ``lowbit/rng.py`` builds
its public draws on it, and the requantisation kernels' references (``requant.py``,
``requant_groups.py``) call it, so every path hashes with one piece of code; the Triton kernels carry
the same arithmetic in ``tl`` ops. Values are 32-bit numbers held in int64 (Python ints or tensors);
multiplications are split so that no product exceeds 2⁴⁸."""

from __future__ import annotations

from torch import Tensor

M32 = 0xFFFFFFFF
U_BITS = 24  # bits per draw: u is exact in float32, and P(u < p) = ceil(p·2²⁴)/2²⁴ (bias < 6e-8)


def _mul32(a, c: int):
    """``a · c mod 2³²`` for ``a`` in [0, 2³²) (a Python int or an int64 tensor) and a constant
    ``c`` < 2³²; the product is split in 16-bit halves so that an int64 never overflows."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & M32


def mix32(x):
    """Wellons' ``lowbias32`` of 32-bit values (Python int or int64 tensor)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The first link of the key chain: ``seed`` (any int, taken mod 2⁶⁴) mixed to 32 bits."""
    s = seed & ((1 << 64) - 1)
    return mix32(mix32((s & M32) ^ 0x9E3779B9) ^ (s >> 32))


def stream_key(seed: int, step, index: int):
    """The two 32-bit keys ``(a, b)`` of parameter ``index`` at ``step`` (``step`` a Python int or
    a 0-d int64 tensor, for a step counter that lives on the device)."""
    k = mix32((step & M32) ^ seed_key(seed))
    k = mix32(((step >> 32) & M32) ^ k)
    a = mix32(k ^ (index & M32))
    return a, mix32(a ^ 0x85EBCA6B)


def draw_bits(i: Tensor, key_a, key_b) -> Tensor:
    """The ``U_BITS`` uniform bits of the elements at positions ``i`` (int64) under keys ``(a, b)``:
    ``mix(mix(i_lo + a) ^ b ^ i_hi) >> 8``."""
    h = mix32(((i & M32) + key_a) & M32)
    return mix32(h ^ key_b ^ (i >> 32)) >> (32 - U_BITS)
