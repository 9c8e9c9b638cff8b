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
Whole blocks are read and written without a mask (vector accesses whatever the length), only the
last block of a tensor is masked.

``sgd_probe_`` is the guarded CUDA step's look ahead: one read of ``g`` (and ``v``; ``w`` only with
weight decay or where a step is large enough to overflow a finite weight) that writes the partial
sums of ``g²`` (the step guard's NaN/Inf-gradient test and norm) and raises a
flag when the update with these arguments would make a finite weight or momentum value NaN/±Inf, computed
by the same Triton function as the update. The step is refused before anything changes, so the
guard needs no backup copy of the weights and no restore pass (``engine/cuda_path.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._tl import jit, tl
from ._update_jit import scaled_clipped, scalar_value
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

__all__ = ["sgd_ref", "sgd_update_", "sgd_probe_ref", "sgd_probe_"]


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
def _sgd_new(
    w, g, v, lr_v, scale_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
    HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
):
    """The new weight and momentum of a block (float32 values in, float32 out). Both the update and
    the probe compute them here, so the probe sees the very values the update would write."""
    g = scaled_clipped(g, scale_ptr, clip_value, HAS_SCALE, HAS_CLIP)
    if HAS_WD:
        g = g + weight_decay * w
    if HAS_MOMENTUM:
        if FIRST_STEP:
            v = g
        else:
            v = v * momentum + one_minus_dampening * g
        if NESTEROV:
            g = g + momentum * v
        else:
            g = v
    return w - lr_v * g, v


@jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    """A block as float32: unmasked for a whole block (vector loads, whatever ``n``), else masked
    with 0 beyond ``n``."""
    if MASKED:
        x = tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(ptr + offs)
    return x.to(tl.float32)


@jit
def _store(ptr, offs, x, n, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=offs < n)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty))


@jit
def _sgd_block(
    w_ptr, g_ptr, v_ptr, offs, n, lr_v, scale_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
    MASKED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_WD: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
):
    w = _load(w_ptr, offs, n, MASKED)
    g = _load(g_ptr, offs, n, MASKED)
    v = g
    if HAS_MOMENTUM:
        if not FIRST_STEP:
            v = _load(v_ptr, offs, n, MASKED)
    w, v = _sgd_new(
        w, g, v, lr_v, scale_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
        HAS_SCALE, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
    )
    if HAS_MOMENTUM:
        _store(v_ptr, offs, v, n, MASKED)
    _store(w_ptr, offs, w, n, MASKED)


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
    # Whole blocks load and store without a mask: a mask ``offs < n`` with ``n`` not a multiple of 16
    # (the 20,037,642 weights of 784-4096-4096-10) keeps Triton from vectorising any access; only the
    # last block is masked. A nonzero ``found_inf`` skips the program before any load.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    go = True
    if HAS_FOUND_INF:
        go = tl.load(found_inf_ptr) == 0
    if go:
        lr_v = scalar_value(lr, LR_ON_DEVICE)
        if pid * BLOCK + BLOCK <= n:
            _sgd_block(
                w_ptr, g_ptr, v_ptr, offs, n, lr_v, scale_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
                False, HAS_SCALE, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
            )
        else:
            _sgd_block(
                w_ptr, g_ptr, v_ptr, offs, n, lr_v, scale_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
                True, HAS_SCALE, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
            )


@jit
def _made_nonfinite(old, new, ptr):
    """1 when some value of ``new``, stored in ``ptr``'s dtype (a float32 value past float16's range
    is an Inf there), is NaN/±Inf where ``old`` was finite, else 0 (a value already non-finite is
    left as it was)."""
    new = new.to(ptr.dtype.element_ty).to(tl.float32)
    # NaN and ±Inf fail "< inf"
    return tl.max(tl.where((tl.abs(new) < float("inf")) | (tl.abs(old) >= float("inf")) | (old != old), 0, 1), axis=0)


@jit
def _probe_block(
    w_ptr, g_ptr, v_ptr, offs, n, lr_v, momentum, one_minus_dampening, weight_decay, clip_value, safe_step,
    MASKED: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr,
):
    """``(Σ g², 1 if a new weight or momentum value is NaN/±Inf else 0)`` of a block; lanes past
    ``n`` load 0 and stay finite.

    Without weight decay the step ``lr·g'`` (and the momentum) does not depend on the weights: when
    every ``|lr·g'|`` of the block is below ``safe_step`` (a quarter of the weight dtype's spacing at
    its largest value, at most float32's: 2¹⁰² for float32 and bfloat16, 8 for float16), ``w − lr·g'``
    rounds to a finite value for every finite ``w``, so the weights are not read at all. Otherwise
    (and always with weight decay) the block's new weights are computed from the weights and checked."""
    g = _load(g_ptr, offs, n, MASKED)
    sq = tl.sum(g * g, axis=0)
    v = g
    if HAS_MOMENTUM:
        if not FIRST_STEP:
            v = _load(v_ptr, offs, n, MASKED)
    v_old = v
    if HAS_WD:
        w_old = _load(w_ptr, offs, n, MASKED)
        w, v = _sgd_new(
            w_old, g, v_old, lr_v, w_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
            False, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
        )
        bad = _made_nonfinite(w_old, w, w_ptr)
    else:
        # the step alone: the update's arithmetic from w = 0 gives -lr·g' (and the exact new momentum)
        step, v = _sgd_new(
            tl.zeros_like(g), g, v_old, lr_v, w_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
            False, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
        )
        need_w = tl.max(tl.where(tl.abs(step) < safe_step, 0, 1), axis=0)  # NaN fails "< safe_step" too
        bad = need_w * 0
        if need_w != 0:  # a step large enough to overflow some weight: the update's new weights
            w_old = _load(w_ptr, offs, n, MASKED)
            w, _ = _sgd_new(
                w_old, g, v_old, lr_v, w_ptr, momentum, one_minus_dampening, weight_decay, clip_value,
                False, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
            )
            bad = _made_nonfinite(w_old, w, w_ptr)
    if HAS_MOMENTUM:
        if FIRST_STEP:  # no old momentum: a NaN/Inf gradient shows in the squares
            bad = tl.maximum(bad, _made_nonfinite(tl.zeros_like(v), v, v_ptr))
        else:
            bad = tl.maximum(bad, _made_nonfinite(v_old, v, v_ptr))
    return sq, bad


@jit
def _sgd_probe_kernel(
    partial_ptr,  # [programs] out, float32: Σ_block g²
    flag_ptr,  # 0-d int32, raised (atomic max) when the update would make a finite value NaN/±Inf
    w_ptr, g_ptr, v_ptr,  # read only
    lr,
    n,
    momentum,
    one_minus_dampening,
    weight_decay,
    clip_value,
    safe_step,
    BLOCK: tl.constexpr,
    LR_ON_DEVICE: tl.constexpr,
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
    safe_step = tl.cast(safe_step, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    lr_v = scalar_value(lr, LR_ON_DEVICE)
    if pid * BLOCK + BLOCK <= n:
        sq, bad = _probe_block(
            w_ptr, g_ptr, v_ptr, offs, n, lr_v, momentum, one_minus_dampening, weight_decay, clip_value, safe_step,
            False, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
        )
    else:
        sq, bad = _probe_block(
            w_ptr, g_ptr, v_ptr, offs, n, lr_v, momentum, one_minus_dampening, weight_decay, clip_value, safe_step,
            True, HAS_CLIP, HAS_WD, HAS_MOMENTUM, FIRST_STEP, NESTEROV,
        )
    tl.store(partial_ptr + pid, sq)
    if bad != 0:
        tl.atomic_max(flag_ptr, 1)


def _safe_step(dtype: torch.dtype) -> float:
    """A step size below which ``w − step`` is finite for every finite ``w`` of ``dtype`` (computed in
    float32, stored in ``dtype``): a quarter of the spacing of ``dtype``'s (or float32's, if smaller)
    numbers at their largest value, well inside the half spacing past which the sum rounds to Inf."""
    def spacing(dt: torch.dtype) -> float:
        info = torch.finfo(dt)
        return 2.0 ** (math.floor(math.log2(info.max)) - round(-math.log2(info.eps)))

    return min(spacing(dtype), spacing(torch.float32)) / 4


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


# ------------------------------------------------------------------------------------------- probe
@torch.no_grad()
def sgd_probe_ref(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    flag: Tensor,
    *,
    lr: float | Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_value: float = 0.0,
) -> Tensor:
    """Reference of ``sgd_probe_``: ``sgd_ref``'s arithmetic on copies (nothing given is changed).
    Returns the one-element ``Σ g²`` of ``grads`` (``grad_norm_ref``'s accumulation) and raises the
    0-d int32 ``flag`` to 1 when a finite weight or momentum value would become NaN/±Inf."""
    from .grad_norm import grad_norm_ref

    ws = [p.clone() for p in params]
    bufs = [None if b is None else b.clone() for b in momentum_buffers]
    sgd_ref(ws, list(grads), bufs, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
            weight_decay=weight_decay, clip_value=clip_value)
    pairs = list(zip(params, ws))
    if momentum != 0:  # a first step's buffer had no old value: counted as finite
        pairs += [(old if old is not None else torch.zeros_like(new), new) for old, new in zip(momentum_buffers, bufs)]
    bad = torch.zeros((), dtype=torch.bool, device=flag.device)
    for old, new in pairs:  # device ops only: no host read
        bad = bad | (~torch.isfinite(new) & torch.isfinite(old)).any()
    flag.copy_(torch.maximum(flag, bad.to(device=flag.device, dtype=flag.dtype)))
    return grad_norm_ref(list(grads)).square().reshape(1)


@torch.no_grad()
def sgd_probe_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None] | None,
    flag: Tensor,
    *,
    lr: float | Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_value: float = 0.0,
    backend: str | None = None,
) -> Tensor:
    """The step guard's pass over the gradients, fused with the weight check of the update to come.

    Returns the partial sums of ``g²`` (1-D float32, the input ``grad_sq_partials`` gives the step
    guard: NaN/Inf when a gradient is) and computes, in the update kernel's own arithmetic
    (``_sgd_new``), the weights and momentum values ``sgd_update_`` with the same arguments would
    write; the 0-d int32 ``flag`` is raised to 1 (never lowered) when one of them would be NaN/±Inf
    where the old value was finite (a value already non-finite is left as it was, not counted).
    Nothing given is written. The step guard refuses such an update before it happens, so a guarded
    step needs no backup copy of the weights and no restore.

    Reads the gradients and momentum buffers once; the weights only with weight decay, or in a block
    with a step ``|lr·g'|`` of at least ``_safe_step`` (2¹⁰² for float32: a smaller step cannot make a
    finite weight non-finite). So plain SGD's probe reads as many bytes as the gradient-norm pass it
    replaces. ``grad_scale`` (clip by norm) is not known before this pass: a step that clips by norm
    cannot use it. One launch per tensor (one for the flat layout); no host read. ``None`` momentum
    buffers stand for the first step (``v = g``)."""
    op = "sgd_probe_"
    if momentum != 0 and momentum_buffers is None:
        raise ValueError(f"{op}: momentum={momentum} needs momentum_buffers (a list, None entries for new buffers)")
    bufs_in = momentum_buffers if momentum != 0 else None
    check_update_lists(op, params, grads, momentum_buffers=bufs_in)
    if not params:
        raise ValueError(f"{op}: params is empty; the probe needs at least one parameter")
    device = params[0].device
    check_scalar(op, "lr", lr, device)
    if not isinstance(flag, Tensor) or flag.dtype != torch.int32 or flag.numel() != 1 or flag.device != device:
        raise ValueError(f"{op}: flag must be a one-element int32 tensor on {device}, got {flag!r}")
    if not on_kernel_path(op, params, backend, momentum_buffers=bufs_in) or not all(g.is_contiguous() for g in grads):
        return sgd_probe_ref(
            params, grads, momentum_buffers if momentum != 0 else [None] * len(params), flag, lr=lr,
            momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, clip_value=clip_value,
        )
    from .grad_norm import _layout

    bufs = list(momentum_buffers) if momentum != 0 else [None] * len(params)
    if momentum == 0 or all(b is not None for b in bufs):
        flat = coalesce(params, grads, bufs if momentum != 0 else None)
        if flat is not None:
            params, grads, flat_bufs = flat
            bufs = flat_bufs if momentum != 0 else [None]
    layout, total = _layout(tuple(p.numel() for p in params), params[0].is_cuda)
    partials = torch.empty(max(total, 1), device=device, dtype=torch.float32)
    if total == 0:  # only empty tensors: the norm is 0
        partials.zero_()
    lr_arg, lr_on_device = scalar_arg(lr)
    for p, g, buf, (offset, programs, block, num_warps) in zip(params, grads, bufs, layout):
        if p.numel() == 0:
            continue
        _sgd_probe_kernel[(programs,)](
            partials[offset:], flag, p, g, buf if buf is not None else p, lr_arg, p.numel(),
            float(momentum), 1.0 - float(dampening), float(weight_decay), float(clip_value), _safe_step(p.dtype),
            BLOCK=block, LR_ON_DEVICE=lr_on_device, HAS_CLIP=clip_value > 0, HAS_WD=weight_decay != 0,
            HAS_MOMENTUM=momentum != 0, FIRST_STEP=momentum != 0 and buf is None, NESTEROV=bool(nesterov),
            num_warps=num_warps,
        )
    return partials
