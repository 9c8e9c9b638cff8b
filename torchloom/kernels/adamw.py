"""Fused AdamW update: bias-corrected Adam with decoupled weight decay, in place.

Per element, in ``torch.optim.AdamW``'s order (its numbers are the test reference), at step ``t``
(1-based, counted before the update)::

    g  = clamp(g · grad_scale, ±clip_value)          # both optional
    w  = w · (1 − lr·wd)                              # decoupled decay
    m  = m + (1 − β1)(g − m)                          # = β1·m + (1 − β1)·g
    v  = β2·v + (1 − β2)·g²
    w  = w − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

which is Loom's ``w −= lr·(m̂/(√v̂ + ε) + wd·w)``. The kernel reads ``w, g, m, v`` once and writes
``w, m, v`` once: 28 bytes per float32 element. One launch per tensor. ``lr`` and ``step`` may be 0-d
device tensors the kernel reads (the bias corrections are then computed on the device), so a CUDA
graph replays correctly as they change; ``found_inf`` (nonzero: nothing is written) guards the update.
"""

from __future__ import annotations

import math

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

__all__ = ["adamw_ref", "adamw_update_"]


@torch.no_grad()
def adamw_ref(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int | float | Tensor],
    *,
    lr: float | Tensor,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    clip_value: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Reference, ``torch.optim.AdamW``'s single-tensor loop plus the optional scale and clip.
    ``steps[i]``: the step number of this update for ``params[i]`` (1-based, already incremented).
    Updates ``params``, ``exp_avgs`` and ``exp_avg_sqs`` in place."""
    if ref_skip(found_inf):
        return
    lr = host_float(lr)
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        g = ref_prepare_grad(g, grad_scale, clip_value)
        step = host_float(step)
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)


@jit
def _one_minus_exp(y):
    """``1 − e^y`` for ``y <= 0`` in float32 without cancellation: near 0 (``1 − β2^t`` at small ``t``
    is 1e-3 and the direct form would lose 5 digits) a Taylor series to y⁷ (truncation < 1e-8
    relative for ``y > −0.3``), the direct form elsewhere (error < 3e-7 relative there)."""
    series = -y * (1.0 + y * (0.5 + y * (1.0 / 6 + y * (1.0 / 24 + y * (1.0 / 120 + y * (1.0 / 720 + y * (1.0 / 5040)))))))
    return tl.where(y > -0.3, series, 1.0 - tl.exp(y))


@jit
def _adamw_kernel(
    w_ptr,  # [N] in/out
    g_ptr,  # [N]
    m_ptr,  # [N] in/out first moment
    v_ptr,  # [N] in/out second moment
    lr,  # number, or pointer to a 0-d tensor when LR_ON_DEVICE
    step,  # pointer to the 0-d step count when STEP_ON_DEVICE (else unused)
    scale_ptr,  # 0-d grad_scale (read when HAS_SCALE)
    found_inf_ptr,  # 0-d found_inf (read when HAS_FOUND_INF)
    n,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    log_beta1,  # ln β1, ln β2: the device-side bias corrections 1 − β^t = 1 − e^(t·ln β)
    log_beta2,
    bias_correction1,  # host-side 1 − β1^t (when not STEP_ON_DEVICE)
    bias_correction2_sqrt,  # host-side √(1 − β2^t)
    eps,
    weight_decay,
    clip_value,
    BLOCK: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
    STEP_ON_DEVICE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    beta2 = tl.cast(beta2, tl.float32)
    one_minus_beta1 = tl.cast(one_minus_beta1, tl.float32)
    one_minus_beta2 = tl.cast(one_minus_beta2, tl.float32)
    log_beta1 = tl.cast(log_beta1, tl.float32)
    log_beta2 = tl.cast(log_beta2, tl.float32)
    bias_correction1 = tl.cast(bias_correction1, tl.float32)
    bias_correction2_sqrt = tl.cast(bias_correction2_sqrt, tl.float32)
    eps = tl.cast(eps, tl.float32)
    weight_decay = tl.cast(weight_decay, tl.float32)
    clip_value = tl.cast(clip_value, tl.float32)
    offs, mask = update_block(n, found_inf_ptr, BLOCK, HAS_FOUND_INF)
    lr_v = scalar_value(lr, LR_ON_DEVICE)
    if STEP_ON_DEVICE:
        t = tl.load(step).to(tl.float32)
        bc1 = _one_minus_exp(t * log_beta1)
        bc2_sqrt = tl.sqrt(_one_minus_exp(t * log_beta2))
    else:
        bc1 = bias_correction1
        bc2_sqrt = bias_correction2_sqrt

    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    g = scaled_clipped(g, scale_ptr, clip_value, HAS_SCALE, HAS_CLIP)
    w = w * (1.0 - lr_v * weight_decay)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.sqrt(v) / bc2_sqrt + eps
    w = w - (lr_v / bc1) * (m / denom)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=mask)


@torch.no_grad()
def adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: int | Tensor | list[int | float | Tensor],
    *,
    lr: float | Tensor,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    clip_value: float = 0.0,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """One AdamW step on every tensor of ``params`` (any shapes, one device), in place.

    ``grads``, ``exp_avgs``, ``exp_avg_sqs``: one tensor per parameter, of its shape (the moments
    start at zero). ``steps``: this update's step number ``t >= 1``, one for all parameters or one
    per parameter; a number, or a 0-d tensor on the parameters' device that the kernel reads (the
    caller increments it). ``lr``: a number or a 0-d device tensor. ``grad_scale``/``found_inf``:
    optional 0-d device tensors, see the module docstring. Triton on CUDA (no host sync), the
    reference elsewhere.
    """
    op = "adamw_update_"
    check_update_lists(op, params, grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if not isinstance(steps, (list, tuple)):
        steps = [steps] * len(params)
    if len(steps) != len(params):
        raise ValueError(f"{op}: got {len(params)} params but {len(steps)} steps")
    if not params:
        return
    device = params[0].device
    check_scalar(op, "lr", lr, device)
    for i, s in enumerate(steps):
        check_scalar(op, f"steps[{i}]", s, device, low=1)
    check_number(op, "beta1", beta1, high=1.0)
    check_number(op, "beta2", beta2, high=1.0)
    check_number(op, "eps", eps)
    check_number(op, "weight_decay", weight_decay)
    check_number(op, "clip_value", clip_value)
    check_guards(op, grad_scale, found_inf, device)
    for name, lst in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if any(t is None for t in lst):
            raise ValueError(f"{op}: {name} must hold a tensor per parameter (zeros before the first step)")

    if not on_kernel_path(op, params, backend, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs):
        adamw_ref(
            params, grads, exp_avgs, exp_avg_sqs, list(steps), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, clip_value=clip_value, grad_scale=grad_scale, found_inf=found_inf,
        )
        return
    same_step = all(t is steps[0] for t in steps) or all(
        not isinstance(t, Tensor) and t == steps[0] for t in steps
    )
    flat = coalesce(params, grads, exp_avgs, exp_avg_sqs) if same_step else None
    if flat is not None:  # tensors laid back to back, one step count: one launch for all of them
        params, grads, exp_avgs, exp_avg_sqs = flat
        steps = steps[:1]
    lr_arg, lr_on_device = scalar_arg(lr)
    # ln 0 = -inf would give e^(t·-inf) = 0, the right limit; a large finite value gives the same.
    log_beta1 = math.log(beta1) if beta1 > 0 else -1e30
    log_beta2 = math.log(beta2) if beta2 > 0 else -1e30
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        n = p.numel()
        if n == 0:
            continue
        step_arg, step_on_device = scalar_arg(step)
        if step_on_device:
            bc1, bc2_sqrt = 1.0, 1.0  # unused: the kernel computes them from the step it reads
        else:
            bc1, bc2_sqrt = 1 - beta1**step_arg, math.sqrt(1 - beta2**step_arg)
        scale_arg, found_arg, has_scale, has_found = guard_args(p, grad_scale, found_inf)
        block, num_warps, programs = elementwise_settings(n, p.is_cuda)
        _adamw_kernel[(programs,)](
            p, g.contiguous(), m, v, lr_arg, step_arg if step_on_device else p, scale_arg, found_arg, n,
            float(beta2), 1.0 - beta1, 1.0 - beta2, log_beta1, log_beta2, bc1, bc2_sqrt,
            float(eps), float(weight_decay), float(clip_value),
            BLOCK=block, LR_ON_DEVICE=lr_on_device, STEP_ON_DEVICE=step_on_device, HAS_SCALE=has_scale,
            HAS_FOUND_INF=has_found, HAS_CLIP=clip_value > 0, num_warps=num_warps,
        )
