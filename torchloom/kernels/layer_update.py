"""Fused pieces of TargetProp's and Tweening's device steps (every layer at once, no host read).

Two ops, each a Triton kernel on CUDA beside a plain-PyTorch reference of the same math:

* ``pair_stats(f, t, extra=None) -> Tensor [5]`` (float32 sums, float64 for float64 inputs): one
  pass over a layer's output ``f`` and its target ``t`` (same shape) giving
  ``[Σ f·t, Σ f², Σ t², Σ (f − t)², Σ extra²]`` — everything the link budget / alignment (a cosine),
  the gap (a mean square) and Tween's RMS-based link budget need, instead of some twenty-five small
  eager ops per layer. Each block writes its five partial sums; one ``sum`` finishes them.
* ``momentum_update_flat_(p, v, g, bounds, a, c, apply)``: every layer's momentum update in one
  launch over the flat parameter, velocity and gradient buffers (consecutive views, same layout):
  for the element ``e`` in layer segment ``l`` (``bounds[l] ≤ e < bounds[l+1]``)::

      v[e] = a[l]·v[e] + c[l]·g[e];   p[e] += v[e]         when apply[l] ≠ 0
      (unchanged)                                           otherwise

  TargetProp: ``a = μ``, ``c = (1 − μ)·rate_l`` (gated layers: ``apply = 0``); Tween:
  ``a = momentum_decay`` (0 after an explosion), ``c = −rate_l/B``. ``a``, ``c`` and ``apply`` are
  device tensors ``[L]`` (float32 / float64 for ``a``/``c``, any dtype for ``apply``), so a captured
  step reads the current values. The layer of an element is found from the ``L + 1`` segment
  boundaries (a constexpr-length loop), so no per-element index buffer is read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import KERNEL_DTYPES, elementwise_settings, use_triton

__all__ = ["pair_stats", "pair_stats_ref", "momentum_update_flat_", "momentum_update_flat_ref_"]

_MAX_SEGMENTS = 64  # layers with parameters in one flat buffer (more: the reference)


# --------------------------------------------------------------------------------- pair stats
def pair_stats_ref(f: Tensor, t: Tensor, extra: Tensor | None = None) -> Tensor:
    """Reference: ``[Σ f·t, Σ f², Σ t², Σ (f − t)², Σ extra²]`` (0 for a missing ``extra``)."""
    acc = torch.float64 if f.dtype == torch.float64 else torch.float32
    f2, t2 = f.reshape(-1).to(acc), t.reshape(-1).to(acc)
    d = f2 - t2
    e2 = (extra.reshape(-1).to(acc).square().sum()) if extra is not None else torch.zeros((), dtype=acc, device=f.device)
    return torch.stack([f2 @ t2, f2 @ f2, t2 @ t2, d @ d, e2])


@jit
def _pair_stats_kernel(part_ptr, f_ptr, t_ptr, e_ptr, n, n_extra, BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr, F64: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if F64:
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        t = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    else:
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = f - t
    base = part_ptr + pid * 5
    tl.store(base + 0, tl.sum(f * t, axis=0))
    tl.store(base + 1, tl.sum(f * f, axis=0))
    tl.store(base + 2, tl.sum(t * t, axis=0))
    tl.store(base + 3, tl.sum(d * d, axis=0))
    if HAS_EXTRA:
        em = offs < n_extra
        if F64:
            e = tl.load(e_ptr + offs, mask=em, other=0.0).to(tl.float64)
        else:
            e = tl.load(e_ptr + offs, mask=em, other=0.0).to(tl.float32)
        tl.store(base + 4, tl.sum(e * e, axis=0))
    else:
        tl.store(base + 4, tl.sum(d * 0.0, axis=0))


def pair_stats(f: Tensor, t: Tensor, extra: Tensor | None = None, backend: str | None = None) -> Tensor:
    """``[Σ f·t, Σ f², Σ t², Σ (f − t)², Σ extra²]`` of ``f`` and ``t`` (same number of elements) and an
    optional ``extra`` tensor (any size); one launch and one small ``sum`` on CUDA (module docstring)."""
    if f.numel() != t.numel():
        raise ValueError(f"pair_stats: f and t must have the same number of elements, got {f.numel()} and {t.numel()}")
    ok = use_triton(f, backend) and f.dtype in KERNEL_DTYPES + (torch.float64,) and f.is_contiguous() and t.is_contiguous()
    ok = ok and (extra is None or extra.is_contiguous())
    if not ok:
        return pair_stats_ref(f, t, extra)
    f64 = f.dtype == torch.float64
    n = max(f.numel(), extra.numel() if extra is not None else 0)
    block, num_warps, programs = elementwise_settings(n, f.is_cuda)
    part = torch.empty(programs, 5, dtype=torch.float64 if f64 else torch.float32, device=f.device)
    _pair_stats_kernel[(programs,)](
        part, f, t, extra if extra is not None else f, f.numel(), extra.numel() if extra is not None else 0,
        BLOCK=block, HAS_EXTRA=extra is not None, F64=f64, num_warps=num_warps,
    )
    return part.sum(0)


# ------------------------------------------------------------------------ momentum update
def momentum_update_flat_ref_(
    p: Tensor, v: Tensor, g: Tensor, bounds: list[int], a: Tensor, c: Tensor, apply: Tensor,
    backup: tuple[Tensor, Tensor] | None = None, flag: Tensor | None = None,
) -> None:
    """Reference of ``momentum_update_flat_`` (same math, one segment at a time, no host read)."""
    if backup is not None:
        backup[0].copy_(p)
        backup[1].copy_(v)
    for layer in range(len(bounds) - 1):
        lo, hi = bounds[layer], bounds[layer + 1]
        if hi <= lo:
            continue
        on = apply[layer] != 0
        vs, ps, gs = v[lo:hi], p[lo:hi], g[lo:hi]
        new_v = a[layer].to(vs.dtype) * vs + c[layer].to(vs.dtype) * gs
        vs.copy_(torch.where(on, new_v, vs))
        ps.add_(torch.where(on, vs, torch.zeros_like(vs)))
    if flag is not None:
        bad = ~(torch.isfinite(p).all() & torch.isfinite(v).all())
        flag.copy_(torch.where(bad, torch.ones_like(flag), flag))


@jit
def _momentum_kernel(
    p_ptr, v_ptr, g_ptr, bounds_ptr, a_ptr, c_ptr, apply_ptr, bp_ptr, bv_ptr, flag_ptr, n,
    L: tl.constexpr, BLOCK: tl.constexpr, GUARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seg = tl.zeros([BLOCK], dtype=tl.int32)
    for j in tl.static_range(1, L):
        b = tl.load(bounds_ptr + j)
        seg += (offs >= b).to(tl.int32)
    a = tl.load(a_ptr + seg, mask=mask, other=0.0)
    c = tl.load(c_ptr + seg, mask=mask, other=0.0)
    on = tl.load(apply_ptr + seg, mask=mask, other=0) != 0
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if GUARD:  # the weight guard's copy, made while the values are in registers anyway
        tl.store(bp_ptr + offs, p, mask=mask)
        tl.store(bv_ptr + offs, v, mask=mask)
    new_v = (a * v.to(a.dtype) + c * g.to(a.dtype)).to(v.dtype)
    new_v = tl.where(on, new_v, v)
    new_p = tl.where(on, p + new_v, p)
    tl.store(v_ptr + offs, new_v, mask=mask)
    tl.store(p_ptr + offs, new_p, mask=mask)
    if GUARD:  # ... and its check: any NaN/±Inf among the new values raises the flag
        if new_v.dtype == tl.float64:  # compared in their own dtype: float64 beyond float32's range is finite
            finite = (tl.abs(new_v) < float("inf")) & (tl.abs(new_p) < float("inf"))
        else:
            finite = (tl.abs(new_v.to(tl.float32)) < float("inf")) & (tl.abs(new_p.to(tl.float32)) < float("inf"))
        if tl.max(tl.where(finite, 0, 1), axis=0) != 0:
            tl.atomic_max(flag_ptr, 1)


def momentum_update_flat_(
    p: Tensor, v: Tensor, g: Tensor, bounds: list[int], a: Tensor, c: Tensor, apply: Tensor, bounds_t: Tensor | None = None,
    backend: str | None = None, backup: tuple[Tensor, Tensor] | None = None, flag: Tensor | None = None,
) -> None:
    """Every layer's momentum update in one launch (module docstring). ``p``, ``v``, ``g``: 1-D buffers
    of one layout; ``bounds``: the ``L + 1`` segment boundaries (``bounds_t``: the same as an int64
    device tensor, made once by the caller); ``a``, ``c``, ``apply``: ``[L]`` device tensors.

    With ``backup = (bp, bv)`` (buffers like ``p`` and ``v``) and ``flag`` (a 0-d int32, zeroed by the
    caller) the same launch does a weight guard's work (``trainers/guards.py``): the old values into
    ``bp``/``bv``, and ``flag`` raised when any new value of ``p`` or ``v`` is NaN/±Inf; the caller
    then restores from the backup when it is raised (``kernels.weight_guard.restore_if_flagged_``)."""
    if (backup is None) != (flag is None):
        raise ValueError("momentum_update_flat_: backup and flag go together")
    if backup is not None and not (backup[0].numel() == p.numel() and backup[1].numel() == v.numel()):
        raise ValueError(f"momentum_update_flat_: backup buffers must hold {p.numel()} elements each, got {backup[0].numel()}, {backup[1].numel()}")
    n_layers = len(bounds) - 1
    if not (p.numel() == v.numel() == g.numel() == bounds[-1]):
        raise ValueError(f"momentum_update_flat_: p, v, g must hold the {bounds[-1]} elements of the segments, got {p.numel()}, {v.numel()}, {g.numel()}")
    ok = use_triton(p, backend) and p.dtype in KERNEL_DTYPES + (torch.float64,) and 0 < n_layers <= _MAX_SEGMENTS
    if not ok:
        momentum_update_flat_ref_(p, v, g, bounds, a, c, apply, backup, flag)
        return
    if bounds_t is None:
        bounds_t = torch.tensor(bounds, dtype=torch.int64, device=p.device)
    block, num_warps, programs = elementwise_settings(p.numel(), p.is_cuda)
    bp, bv = backup if backup is not None else (p, v)
    _momentum_kernel[(programs,)](
        p, v, g, bounds_t, a, c, apply, bp, bv, flag if flag is not None else apply, p.numel(),
        L=n_layers, BLOCK=block, GUARD=backup is not None, num_warps=num_warps,
    )
