"""The weight check after an update, on the device in a handful of launches.

A training step copies what its update will change (parameters, optimizer or method state) before
the update; afterwards it must find out whether anything became non-finite and, if so, put every
tensor back, all without a host read (the step may be inside a CUDA graph). With plain torch ops that
is one ``aminmax`` per tensor, a stack, an ``isfinite``, an ``all``, one ``where`` and one ``copy`` per
tensor and three more ops for the step's status: about twenty launches for a small network. Here:

* ``nonfinite_flag_(tensors, flag)``: one launch per tensor (usually one flat buffer per kind),
  each block raising the shared int32 ``flag`` (``atomic_max``) when it holds a NaN/±Inf;
* ``restore_if_flagged_(live, backup, flag, status)``: one launch per tensor; when ``flag`` is set
  every program copies its block of ``backup`` back into ``live``, and the first launch's program 0
  turns an OK ``status`` (0) into ``NAN_WEIGHTS`` (4).

``flag`` is zeroed by the caller before the check (one memset, with the backup copy). The reference
(CPU, or no Triton) does the same with torch ops; both leave identical results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import KERNEL_DTYPES, elementwise_settings, use_triton

__all__ = ["nonfinite_flag_", "restore_if_flagged_", "NAN_WEIGHTS"]

NAN_WEIGHTS = 4


@jit
def _nonfinite_kernel(x_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK + BLOCK <= n:  # a whole block: unmasked, so the loads vectorise whatever n is
        x = tl.load(x_ptr + offs).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    bad = tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=0)  # NaN and ±Inf fail "< inf"
    if bad != 0:
        tl.atomic_max(flag_ptr, 1)


@jit
def _restore_kernel(live_ptr, backup_ptr, flag_ptr, status_ptr, n, BLOCK: tl.constexpr, WRITE_STATUS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    flag = tl.load(flag_ptr)
    if flag != 0:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(live_ptr + offs, tl.load(backup_ptr + offs, mask=mask), mask=mask)
        if WRITE_STATUS:
            if pid == 0:
                status = tl.load(status_ptr)
                tl.store(status_ptr, tl.where(status == 0, 4, status))


def _kernel_ok(t: Tensor, backend: str | None) -> bool:
    return use_triton(t, backend) and t.dtype in KERNEL_DTYPES and t.is_contiguous()


@torch.no_grad()
def nonfinite_flag_(tensors: list[Tensor], flag: Tensor, backend: str | None = None) -> None:
    """Raise the 0-d int32 ``flag`` to 1 when any element of ``tensors`` is NaN/±Inf (never lowers it)."""
    for t in tensors:
        if t.numel() == 0:
            continue
        if _kernel_ok(t, backend):
            block, num_warps, programs = elementwise_settings(t.numel(), t.is_cuda)
            _nonfinite_kernel[(programs,)](t, flag, t.numel(), BLOCK=block, num_warps=num_warps)
        else:
            lo, hi = torch.aminmax(t)
            bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
            flag.copy_(torch.maximum(flag, bad.to(flag.dtype)))


@torch.no_grad()
def restore_if_flagged_(live: list[Tensor], backup: list[Tensor], flag: Tensor, status: Tensor | None = None, backend: str | None = None) -> None:
    """When ``flag`` is set: ``live[i].copy_(backup[i])`` for every ``i``, and an OK (0) ``status``
    becomes ``NAN_WEIGHTS`` (4). No host read either way."""
    status_done = status is None
    for t, b in zip(live, backup):
        if t.numel() == 0:
            continue
        if _kernel_ok(t, backend) and b.is_contiguous():
            block, num_warps, programs = elementwise_settings(t.numel(), t.is_cuda)
            _restore_kernel[(programs,)](
                t, b, flag, status if status is not None else flag, t.numel(),
                BLOCK=block, WRITE_STATUS=not status_done, num_warps=num_warps,
            )
        else:
            t.copy_(torch.where(flag != 0, b, t))
            if not status_done:
                status.copy_(torch.where((flag != 0) & (status == 0), NAN_WEIGHTS, status))
        status_done = True
    if not status_done:  # nothing to restore, but the status still reports a flagged step
        status.copy_(torch.where((flag != 0) & (status == 0), NAN_WEIGHTS, status))
