"""The NaN/Inf guard of one training step, decided on the device (``train()``'s GPU path).

Loom's loop checks every batch on the host: a NaN/Inf loss abandons the rest of the epoch, a NaN/Inf
gradient skips the batch's update. A graph-captured step cannot branch on the host, so this op turns
the batch's loss and the global gradient norm into device flags the fused optimizer obeys
(``found_inf``: nonzero means "write nothing") and records per step what happened, read once per
epoch:

=============  ===============================================================================
status         meaning
=============  ===============================================================================
0 OK           loss and gradients finite: update applied, loss counted
1 NAN_LOSS     loss NaN/Inf: update skipped and the epoch abandoned from here on
2 NAN_GRAD     a gradient NaN/Inf (loss finite): update skipped, loss not counted
3 NOT_RUN      an earlier batch of this epoch abandoned it: update skipped, loss not counted
4 NAN_WEIGHTS  (with ``update_flag``) loss and gradients finite, but the update would make a
               finite weight or state value NaN/±Inf (``kernels.sgd.sgd_probe_`` found it): refused
=============  ===============================================================================

``update_flag`` (optional 0-d int32, raised by ``kernels.sgd.sgd_probe_``) is read and set back to
0, so the next step's probe starts from a clean flag without a memset of its own.

It also writes the clip-by-global-norm scale ``min(1, max_norm / norm)`` (1 when clipping is off).
The loss and the norm arrive as the unreduced partial sums their kernels wrote (loss partials; partial
sums of squares of the gradients): one program adds them up, decides, and writes a handful of
scalars, a single tiny launch instead of two reductions and a dozen eager scalar ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import use_triton

__all__ = ["OK", "NAN_LOSS", "NAN_GRAD", "NOT_RUN", "NAN_WEIGHTS", "step_guard_ref", "step_guard_"]

OK, NAN_LOSS, NAN_GRAD, NOT_RUN, NAN_WEIGHTS = 0, 1, 2, 3, 4


@torch.no_grad()
def step_guard_ref(
    loss_partials: Tensor, sq_partials: Tensor, dead: Tensor, step_loss: Tensor, step_status: Tensor,
    found_inf: Tensor, grad_scale: Tensor, max_norm: float, update_flag: Tensor | None = None,
) -> None:
    """Reference in torch ops (no host sync). ``loss_partials`` (sum = the batch loss) and
    ``sq_partials`` (sum = the squared global gradient norm) are 1-D and read; ``dead`` (int32, read
    and updated), ``step_loss`` (float32, or float64 to keep a float64 model's loss exact), ``step_status`` (int32), ``found_inf`` (float32) and
    ``grad_scale`` (float32, or float64 for float64 models) are one-element tensors, written."""
    loss = loss_partials.sum()
    norm = sq_partials.sum().sqrt()
    was_dead = dead.reshape(()) != 0
    loss_ok = torch.isfinite(loss)
    grad_ok = torch.isfinite(norm)
    status = torch.where(was_dead, NOT_RUN, torch.where(~loss_ok, NAN_LOSS, torch.where(~grad_ok, NAN_GRAD, OK)))
    if update_flag is not None:
        status = torch.where((status == OK) & (update_flag.reshape(()) != 0), NAN_WEIGHTS, status)
        update_flag.zero_()
    ok = status == OK
    step_status.copy_(status.reshape(step_status.shape))
    step_loss.copy_(torch.where(ok, loss.to(step_loss.dtype), 0.0).reshape(step_loss.shape))
    found_inf.copy_((~ok).float().reshape(found_inf.shape))
    dead.copy_((was_dead | ~loss_ok).to(dead.dtype).reshape(dead.shape))
    n = norm.to(grad_scale.dtype)
    if max_norm > 0:
        scale = torch.where(n > max_norm, max_norm / n.clamp_min(1e-30), torch.ones_like(n))
    else:
        scale = torch.ones_like(n)
    grad_scale.copy_(scale.reshape(grad_scale.shape))


@jit
def _step_guard_kernel(
    dead_ptr, step_loss_ptr, step_status_ptr, found_inf_ptr, grad_scale_ptr,  # written
    loss_ptr, n_loss, sq_ptr, n_sq,  # read: the two arrays of partial sums
    update_flag_ptr,  # read and zeroed when HAS_UPDATE_FLAG
    max_norm,
    CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_UPDATE_FLAG: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    max_norm = tl.cast(max_norm, tl.float32)
    cols = tl.arange(0, BLOCK)
    acc_loss = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_loss, BLOCK):
        acc_loss += tl.load(loss_ptr + start + cols, mask=start + cols < n_loss, other=0.0).to(tl.float32)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_sq, BLOCK):
        acc_sq += tl.load(sq_ptr + start + cols, mask=start + cols < n_sq, other=0.0).to(tl.float32)
    loss = tl.sum(acc_loss, axis=0)
    norm = tl.sqrt(tl.sum(acc_sq, axis=0))
    was_dead = tl.load(dead_ptr) != 0
    loss_ok = tl.abs(loss) < float("inf")  # False for NaN and ±Inf
    grad_ok = norm < float("inf")  # a norm is >= 0 or NaN
    status = tl.where(was_dead, 3, tl.where(loss_ok, tl.where(grad_ok, 0, 2), 1))
    if HAS_UPDATE_FLAG:
        status = tl.where((status == 0) & (tl.load(update_flag_ptr) != 0), 4, status)
        tl.store(update_flag_ptr, 0)
    tl.store(step_status_ptr, status)
    tl.store(step_loss_ptr, tl.where(status == 0, loss, 0.0))
    tl.store(found_inf_ptr, tl.where(status == 0, 0.0, 1.0))
    tl.store(dead_ptr, tl.where(was_dead | (~loss_ok), 1, 0))
    if CLIP:
        tl.store(grad_scale_ptr, tl.where(norm > max_norm, max_norm / tl.maximum(norm, 1e-30), 1.0))
    else:
        tl.store(grad_scale_ptr, 1.0)


def step_guard_(
    loss_partials: Tensor, sq_partials: Tensor, dead: Tensor, step_loss: Tensor, step_status: Tensor,
    found_inf: Tensor, grad_scale: Tensor, max_norm: float = 0.0, backend: str | None = None,
    update_flag: Tensor | None = None,
) -> None:
    """Decide one step's fate on the device (see the module docstring); one launch on CUDA."""
    if not use_triton(loss_partials, backend) or grad_scale.dtype != torch.float32 or step_loss.dtype != torch.float32:
        return step_guard_ref(loss_partials, sq_partials, dead, step_loss, step_status, found_inf, grad_scale, max_norm, update_flag)
    n_loss, n_sq = loss_partials.numel(), sq_partials.numel()
    block = min(max(1 << (max(n_loss, n_sq, 1) - 1).bit_length(), 16), 1024)  # one pass for up to 1024 partials
    _step_guard_kernel[(1,)](
        dead, step_loss, step_status, found_inf, grad_scale, loss_partials, n_loss, sq_partials, n_sq,
        update_flag if update_flag is not None else dead, float(max_norm), CLIP=max_norm > 0, BLOCK=block,
        HAS_UPDATE_FLAG=update_flag is not None, num_warps=4,
    )
