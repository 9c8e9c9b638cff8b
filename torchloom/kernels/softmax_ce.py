"""Fused softmax cross-entropy: loss and gradient w.r.t. the logits in one row-wise pass.

Rows are the leading dimensions of ``logits [..., C]`` (``B`` rows). Targets are integer class
labels ``[...]`` or one-hot / soft probabilities ``[..., C]``.
``loss = (1/B) Σ_b −Σ_j y_bj log softmax(o_b)_j``, ``grad = (softmax(o) − y)/B``.

The kernel runs one program per row: a first sweep finds the row's log-sum-exp ``lse`` (online
softmax over chunks, so any ``C`` works), a second writes ``grad = (exp(x − lse) − y)/B`` and
accumulates the row's loss ``Σ_j y_j (lse − x_j)``, stored as one partial ``loss_b/B`` per row; the
loss is the sum of the partials and stays on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import row_settings, use_kernel

__all__ = ["softmax_ce_loss_grad_ref", "softmax_ce_loss_grad"]

_LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def softmax_ce_loss_grad_ref(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: ``(loss, grad)``; ``loss`` 0-d float64, ``grad`` like ``logits``."""
    c = logits.shape[-1]
    x = logits.reshape(-1, c)
    rows = x.shape[0]
    logp = torch.log_softmax(x, dim=-1)
    grad = logp.exp()
    if target.dtype in _LABEL_DTYPES:
        labels = target.reshape(-1).long()
        idx = torch.arange(rows, device=x.device)
        loss = -logp[idx, labels].double().sum() / rows
        grad[idx, labels] -= 1.0
    else:
        y = target.reshape(-1, c)
        loss = -(y.double() * logp.double()).sum() / rows
        grad = grad - y
    return loss, (grad / rows).view(logits.shape)


@jit
def _softmax_ce_kernel(
    grad_ptr,  # [B, C] out, logits' dtype
    loss_ptr,  # [B] out, float32: loss_b / B
    x_ptr,  # [B, C] logits, rows contiguous
    y_ptr,  # [B] class labels (LABELS) or [B, C] target probabilities
    n_cols,
    inv_rows,  # 1/B
    BLOCK: tl.constexpr,
    LABELS: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    inv_rows = tl.cast(inv_rows, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)

    # Sweep 1: running max m and s = Σ exp(x − m); masked lanes are −inf and add exp(−inf) = 0.
    # The first chunk always holds at least one real value, so m is finite from the start.
    x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    for start in range(BLOCK, n_cols, BLOCK):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    # Sweep 2: gradient and the row's loss Σ_j y_j (lse − x_j) = −Σ_j y_j log p_j.
    if LABELS:
        label = tl.load(y_ptr + row).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        mask = c < n_cols
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        if LABELS:
            y = tl.where(c == label, 1.0, 0.0)
        else:
            y = tl.load(y_ptr + row * n_cols + c, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        tl.store(grad_ptr + row * n_cols + c, ((p - y) * inv_rows).to(grad_ptr.dtype.element_ty), mask=mask)
        acc += tl.where(mask, y * (lse - x), 0.0)
    tl.store(loss_ptr + row, tl.sum(acc, axis=0) * inv_rows)


def softmax_ce_loss_grad(logits: Tensor, target: Tensor, backend: str | None = None, *, unreduced: bool = False) -> tuple[Tensor, Tensor]:
    """``(loss, grad)`` of softmax cross-entropy: the Triton kernel on CUDA (``loss`` 0-d float32, the
    sum of per-row partials, no host sync), the reference elsewhere. Labels must lie in ``[0, C)``
    (``trainers.losses.check_target`` checks them; the kernel does not). ``unreduced=True`` returns
    the per-row partials instead of the loss (their sum is the loss)."""
    if not use_kernel(logits, backend) or logits.numel() == 0:
        loss, grad = softmax_ce_loss_grad_ref(logits, target)
        return (loss.reshape(1) if unreduced else loss), grad
    c = logits.shape[-1]
    x = logits.reshape(-1, c).contiguous()
    rows = x.shape[0]
    labels = target.dtype in _LABEL_DTYPES
    y = target.reshape(-1).contiguous() if labels else target.reshape(-1, c).contiguous()
    grad = torch.empty_like(x)
    row_loss = torch.empty(rows, device=x.device, dtype=torch.float32)
    block, num_warps = row_settings(c, x.is_cuda)
    _softmax_ce_kernel[(rows,)](grad, row_loss, x, y, c, 1.0 / rows, BLOCK=block, LABELS=labels, num_warps=num_warps)
    return (row_loss if unreduced else row_loss.sum()), grad.view(logits.shape)
