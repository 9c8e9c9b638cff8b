"""Fused SGD update, plain or with momentum (dampening, Nesterov), in place.

Per element, in this order (``torch.optim.SGD``'s order, so its numbers are the test reference)::

    g = clamp(g · grad_scale, ±clip_value)       # both optional
    g = g + weight_decay · w                      # L2 decay, optional
    v = g                       on the first step  # torch's rule; Loom starts v at 0 (PARITY.md)
    v = μ·v + (1 − dampening)·g  afterwards
    g = g + μ·v  (Nesterov)   or   g = v
    w = w − lr·g

The kernel reads ``w``, ``g`` (and ``v``) once and writes ``w`` (and ``v``) once: 12 bytes per float32
element without momentum, 20 with. One launch per tensor; ``lr`` may be a 0-d device tensor and
``found_inf`` (nonzero: nothing is written) guards the whole update, so a CUDA graph can replay it.
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

__all__ = ["sgd_ref", "sgd_update_"]


@torch.no_grad()
def sgd_ref(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    *,
    lr: float | Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_value: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Reference, ``torch.optim.SGD``'s single-tensor loop plus the optional scale and clip. Updates
    ``params`` and ``momentum_buffers`` in place; a ``None`` buffer is created (``v = g``) and stored
    back into the list."""
    if ref_skip(found_inf):
        return
    lr = host_float(lr)
    for i, (p, g) in enumerate(zip(params, grads)):
        g = ref_prepare_grad(g, grad_scale, clip_value)
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if buf is None:
                buf = momentum_buffers[i] = torch.clone(g).detach()
            else:
                buf.mul_(momentum).add_(g, alpha=1.0 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)


@jit
def _sgd_kernel(
    w_ptr,  # [N] in/out
    g_ptr,  # [N]
    v_ptr,  # [N] in/out momentum buffer (unused without momentum)
    lr,  # number, or pointer to a 0-d tensor when LR_ON_DEVICE
    scale_ptr,  # 0-d grad_scale (read when HAS_SCALE)
    found_inf_ptr,  # 0-d found_inf (read when HAS_FOUND_INF)
    n,
    momentum,
    one_minus_dampening,
    weight_decay,
    clip_value,
    BLOCK: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    HAS_WD: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr,
    NESTEROV: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    momentum = tl.cast(momentum, tl.float32)
    one_minus_dampening = tl.cast(one_minus_dampening, tl.float32)
    weight_decay = tl.cast(weight_decay, tl.float32)
    clip_value = tl.cast(clip_value, tl.float32)
    offs, mask = update_block(n, found_inf_ptr, BLOCK, HAS_FOUND_INF)
    lr_v = scalar_value(lr, LR_ON_DEVICE)

    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    g = scaled_clipped(g, scale_ptr, clip_value, HAS_SCALE, HAS_CLIP)
    if HAS_WD:
        g = g + weight_decay * w
    if HAS_MOMENTUM:
        if FIRST_STEP:
            v = g
        else:
            v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
            v = v * momentum + one_minus_dampening * g
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = g + momentum * v
        else:
            g = v
    tl.store(w_ptr + offs, (w - lr_v * g).to(w_ptr.dtype.element_ty), mask=mask)


@torch.no_grad()
def sgd_update_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None] | None = None,
    *,
    lr: float | Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_value: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """One SGD step on every tensor of ``params`` (any shapes, one device), in place.

    ``grads[i]`` and ``momentum_buffers[i]`` have ``params[i]``'s shape; a ``None`` buffer (first
    step) is created and stored into the list. ``lr``: a number or a 0-d tensor on the parameters'
    device (read by the kernel). ``grad_scale``/``found_inf``: optional 0-d device tensors, see the
    module docstring. The Triton kernel runs on CUDA (no host sync), the reference elsewhere.

    One corner differs between the two: when ``found_inf`` skips the very first momentum step, the
    kernel (which cannot look at ``found_inf`` on the host) leaves zero buffers, so the next step
    takes ``v = (1 − dampening)·g`` where the reference, whose buffer stays ``None``, takes ``v = g``;
    they agree whenever ``dampening`` is 0.
    """
    op = "sgd_update_"
    if momentum != 0 and momentum_buffers is None:
        raise ValueError(f"{op}: momentum={momentum} needs momentum_buffers (a list, None entries for new buffers)")
    check_update_lists(op, params, grads, momentum_buffers=momentum_buffers if momentum != 0 else None)
    if not params:
        return
    device = params[0].device
    check_scalar(op, "lr", lr, device)
    for name, value in (("momentum", momentum), ("dampening", dampening), ("weight_decay", weight_decay), ("clip_value", clip_value)):
        check_number(op, name, value)
    check_guards(op, grad_scale, found_inf, device)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{op}: nesterov needs momentum > 0 and dampening 0, got momentum={momentum}, dampening={dampening}")

    if not on_kernel_path(op, params, backend, momentum_buffers=momentum_buffers if momentum != 0 else None):
        sgd_ref(
            params, grads, momentum_buffers if momentum != 0 else [None] * len(params), lr=lr, momentum=momentum,
            dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, clip_value=clip_value,
            grad_scale=grad_scale, found_inf=found_inf,
        )
        return
    if momentum == 0 or all(b is not None for b in momentum_buffers):
        flat = coalesce(params, grads, momentum_buffers if momentum != 0 else None)
        if flat is not None:  # tensors laid back to back: one launch for all of them
            params, grads, flat_bufs = flat
            momentum_buffers = flat_bufs if momentum != 0 else momentum_buffers
    lr_arg, lr_on_device = scalar_arg(lr)
    for i, (p, g) in enumerate(zip(params, grads)):
        n = p.numel()
        if n == 0:
            continue
        first = False
        buf = p  # placeholder pointer without momentum (never read)
        if momentum != 0:
            buf = momentum_buffers[i]
            if buf is None:  # zeros, so a first step skipped by found_inf leaves a clean buffer
                buf = momentum_buffers[i] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                first = True
        scale_arg, found_arg, has_scale, has_found = guard_args(p, grad_scale, found_inf)
        block, num_warps, programs = elementwise_settings(n, p.is_cuda)
        _sgd_kernel[(programs,)](
            p, g.contiguous(), buf, lr_arg, scale_arg, found_arg, n,
            float(momentum), 1.0 - float(dampening), float(weight_decay), float(clip_value),
            BLOCK=block, LR_ON_DEVICE=lr_on_device, HAS_SCALE=has_scale, HAS_FOUND_INF=has_found,
            HAS_CLIP=clip_value > 0, HAS_WD=weight_decay != 0, HAS_MOMENTUM=momentum != 0,
            FIRST_STEP=first, NESTEROV=bool(nesterov), num_warps=num_warps,
        )
