"""Triton pieces the fused optimizer updates share (``sgd.py``, ``adamw.py``, ``rmsprop.py``): the
guarded block mask, a hyper-parameter read as a number or from the device, and the gradient's
scale and per-element clip. Imported by those kernel modules only (it needs Triton)."""

from __future__ import annotations

from ._tl import jit, tl

__all__ = ["update_block", "scalar_value", "scaled_clipped"]


@jit
def update_block(n, found_inf_ptr, BLOCK: tl.constexpr, HAS_FOUND_INF: tl.constexpr):
    """This program's offsets (int64: past 2^31 elements stay exact) and their mask; a nonzero
    ``found_inf`` masks every lane, so nothing is loaded or stored."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    limit = n
    if HAS_FOUND_INF:
        limit = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    return offs, offs < limit


@jit
def scalar_value(value, ON_DEVICE: tl.constexpr):
    """A hyper-parameter passed by value, or (``ON_DEVICE``) read from the 0-d tensor it points to."""
    if ON_DEVICE:
        out = tl.load(value).to(tl.float32)
    else:
        out = tl.cast(value, tl.float32)  # Inductor passes a Python float as fp64
    return out


@jit
def scaled_clipped(g, scale_ptr, clip_value, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr):
    """``clamp(g · grad_scale, ±clip_value)``, each step optional."""
    if HAS_SCALE:
        g = g * tl.load(scale_ptr).to(tl.float32)
    if HAS_CLIP:
        g = tl.minimum(tl.maximum(g, -clip_value), clip_value)
    return g
