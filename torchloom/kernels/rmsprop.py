"""Fused RMSprop update, optionally centered and with momentum, in place.

Per element, in ``torch.optim.RMSprop``'s order (its numbers are the test reference)::

    g   = clamp(g · grad_scale, ±clip_value)       # both optional
    g   = g + weight_decay · w                      # L2 decay, optional
    s   = α·s + (1 − α)·g²
    avg = √(s − ḡ²) + ε   with ḡ = ḡ + (1 − α)(g − ḡ)   when centered
    avg = √s + ε          otherwise                  # ε outside the root (Loom's code: inside, PARITY.md)
    b   = μ·b + g/avg,  w = w − lr·b                 with momentum μ > 0
    w   = w − lr·g/avg                               otherwise

The kernel reads ``w, g, s`` (and ``ḡ``, ``b``) once and writes them once: 20 bytes per float32
element in the plain form. One launch per tensor; ``lr`` may be a 0-d device tensor and
``found_inf`` (nonzero: nothing is written) guards the update, so a CUDA graph can replay it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._update_jit import scaled_clipped, scalar_value, update_block
from ._triton import elementwise_settings
from ._update import (
    check_guards,
    check_number,
    check_scalar,
    check_update_lists,
    coalesce,
    guard_args,
    host_float,
    on_kernel_path,
    ref_prepare_grad,
    ref_skip,
    scalar_arg,
)

__all__ = ["rmsprop_ref", "rmsprop_update_"]


@torch.no_grad()
def rmsprop_ref(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    grad_avgs: list[Tensor] | None,
    momentum_buffers: list[Tensor] | None,
    *,
    lr: float | Tensor,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    clip_value: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Reference, ``torch.optim.RMSprop``'s single-tensor loop plus the optional scale and clip.
    Updates ``params`` and the state lists in place (``grad_avgs`` used when ``centered``,
    ``momentum_buffers`` when ``momentum > 0``)."""
    if ref_skip(found_inf):
        return
    lr = host_float(lr)
    for i, (p, g, square_avg) in enumerate(zip(params, grads, square_avgs)):
        g = ref_prepare_grad(g, grad_scale, clip_value)
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
        if centered:
            grad_avg = grad_avgs[i]
            grad_avg.lerp_(g, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add_(eps)
        if momentum > 0:
            buf = momentum_buffers[i]
            buf.mul_(momentum).addcdiv_(g, avg)
            p.add_(buf, alpha=-lr)
        else:
            p.addcdiv_(g, avg, value=-lr)


@jit
def _rmsprop_kernel(
    w_ptr,  # [N] in/out
    g_ptr,  # [N]
    s_ptr,  # [N] in/out running mean of g²
    gavg_ptr,  # [N] in/out running mean of g (CENTERED)
    b_ptr,  # [N] in/out momentum buffer (HAS_MOMENTUM)
    lr,  # number, or pointer to a 0-d tensor when LR_ON_DEVICE
    scale_ptr,  # 0-d grad_scale (read when HAS_SCALE)
    found_inf_ptr,  # 0-d found_inf (read when HAS_FOUND_INF)
    n,
    alpha,
    one_minus_alpha,
    eps,
    weight_decay,
    momentum,
    clip_value,
    BLOCK: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_WD: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    alpha = tl.cast(alpha, tl.float32)
    one_minus_alpha = tl.cast(one_minus_alpha, tl.float32)
    eps = tl.cast(eps, tl.float32)
    weight_decay = tl.cast(weight_decay, tl.float32)
    momentum = tl.cast(momentum, tl.float32)
    clip_value = tl.cast(clip_value, tl.float32)
    offs, mask = update_block(n, found_inf_ptr, BLOCK, HAS_FOUND_INF)
    lr_v = scalar_value(lr, LR_ON_DEVICE)

    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    s = tl.load(s_ptr + offs, mask=mask).to(tl.float32)
    g = scaled_clipped(g, scale_ptr, clip_value, HAS_SCALE, HAS_CLIP)
    if HAS_WD:
        g = g + weight_decay * w
    s = s * alpha + one_minus_alpha * (g * g)
    tl.store(s_ptr + offs, s.to(s_ptr.dtype.element_ty), mask=mask)
    if CENTERED:
        gavg = tl.load(gavg_ptr + offs, mask=mask).to(tl.float32)
        gavg = gavg + one_minus_alpha * (g - gavg)
        tl.store(gavg_ptr + offs, gavg.to(gavg_ptr.dtype.element_ty), mask=mask)
        avg = tl.sqrt(s - gavg * gavg) + eps
    else:
        avg = tl.sqrt(s) + eps
    if HAS_MOMENTUM:
        b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
        b = b * momentum + g / avg
        tl.store(b_ptr + offs, b.to(b_ptr.dtype.element_ty), mask=mask)
        w = w - lr_v * b
    else:
        w = w - lr_v * (g / avg)
    tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=mask)


@torch.no_grad()
def rmsprop_update_(
    params: list[Tensor],
    grads: list[Tensor],
    square_avgs: list[Tensor],
    grad_avgs: list[Tensor] | None = None,
    momentum_buffers: list[Tensor] | None = None,
    *,
    lr: float | Tensor,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    clip_value: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """One RMSprop step on every tensor of ``params`` (any shapes, one device), in place.

    State lists hold one tensor per parameter, of its shape, zeros before the first step:
    ``square_avgs`` always, ``grad_avgs`` when ``centered``, ``momentum_buffers`` when
    ``momentum > 0``. ``lr``: a number or a 0-d device tensor. ``grad_scale``/``found_inf``: optional
    0-d device tensors, see the module docstring. Triton on CUDA (no host sync), the reference elsewhere.
    """
    op = "rmsprop_update_"
    if centered and grad_avgs is None:
        raise ValueError(f"{op}: centered=True needs grad_avgs (zeros before the first step)")
    if momentum > 0 and momentum_buffers is None:
        raise ValueError(f"{op}: momentum={momentum} needs momentum_buffers (zeros before the first step)")
    states = {
        "square_avgs": square_avgs,
        "grad_avgs": grad_avgs if centered else None,
        "momentum_buffers": momentum_buffers if momentum > 0 else None,
    }
    check_update_lists(op, params, grads, **states)
    for name, lst in states.items():
        if lst is not None and any(t is None for t in lst):
            raise ValueError(f"{op}: {name} must hold a tensor per parameter (zeros before the first step)")
    if not params:
        return
    device = params[0].device
    check_scalar(op, "lr", lr, device)
    check_number(op, "alpha", alpha, high=1.0)
    for name, value in (("eps", eps), ("weight_decay", weight_decay), ("momentum", momentum), ("clip_value", clip_value)):
        check_number(op, name, value)
    check_guards(op, grad_scale, found_inf, device)

    if not on_kernel_path(op, params, backend, **states):
        rmsprop_ref(
            params, grads, square_avgs, grad_avgs, momentum_buffers, lr=lr, alpha=alpha, eps=eps,
            weight_decay=weight_decay, momentum=momentum, centered=centered, clip_value=clip_value,
            grad_scale=grad_scale, found_inf=found_inf,
        )
        return
    flat = coalesce(params, grads, square_avgs, grad_avgs if centered else None, momentum_buffers if momentum > 0 else None)
    if flat is not None:  # tensors laid back to back: one launch for all of them
        params, grads, square_avgs, flat_gavg, flat_buf = flat
        grad_avgs = flat_gavg if centered else grad_avgs
        momentum_buffers = flat_buf if momentum > 0 else momentum_buffers
    lr_arg, lr_on_device = scalar_arg(lr)
    for i, (p, g, s) in enumerate(zip(params, grads, square_avgs)):
        n = p.numel()
        if n == 0:
            continue
        gavg = grad_avgs[i] if centered else p  # placeholders are never read: their flag is off
        buf = momentum_buffers[i] if momentum > 0 else p
        scale_arg, found_arg, has_scale, has_found = guard_args(p, grad_scale, found_inf)
        block, num_warps, programs = elementwise_settings(n, p.is_cuda)
        _rmsprop_kernel[(programs,)](
            p, g.contiguous(), s, gavg, buf, lr_arg, scale_arg, found_arg, n,
            float(alpha), 1.0 - alpha, float(eps), float(weight_decay), float(momentum), float(clip_value),
            BLOCK=block, LR_ON_DEVICE=lr_on_device, HAS_SCALE=has_scale, HAS_FOUND_INF=has_found,
            HAS_CLIP=clip_value > 0, HAS_WD=weight_decay != 0, CENTERED=bool(centered),
            HAS_MOMENTUM=momentum > 0, num_warps=num_warps,
        )
