"""One live window of backprop on a small Dense chain in one kernel launch.

For each of K samples in order (the live loop's device-resident stream, ``torchloom.live``): the
forward (its output is the served prediction, written to ``preds[k]``), the MSE loss and gradient
``2(o − y)/N``, the backward through every layer, and the SGD update ``w −= lr·g``, guarded as the
engine's device step guards it (``step_guard.py``, ``weight_guard.py``): a non-finite loss skips the
update (status 1) and every later update of the window (status 3), a non-finite squared gradient
norm skips it (status 2), an update that would make a weight non-finite is not written (status 4).

One program runs the whole window: a net of this size (adaptv2's Dense 8→32→64→64→64→32→4, 15k
weights) is a few thousand multiply-adds per layer, where the per-sample cost of the captured loop
of torch ops is its ~25 tiny kernels. Layers are at most ``BLOCK`` (≤ 128) wide; each layer's
``[n_out, n_in]`` weight and bias are read from one flat parameter buffer (offsets in ``meta``); the
layer outputs, the gradients and the new weights go through scratch buffers, and a CTA barrier
separates each phase. Products run in float32 with tree sums (not cuBLAS's order), so the numbers
match the torch path to rounding.

``live_window_ref`` is the same computation in torch ops (the tests' reference, and the path off CUDA
without Triton's interpreter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl

__all__ = ["ACT_CODES", "MAX_WIDTH", "live_window_", "live_window_ref"]

ACT_CODES = {"linear": 0, "relu": 1, "sigmoid": 4, "tanh": 5}
MAX_WIDTH = 128
_META = 5  # per layer: n_in, n_out, weight offset, bias offset (-1: none), activation code


def _act_ref(p: Tensor, code: int) -> Tensor:
    if code == 1:
        return torch.relu(p)
    if code == 4:
        return torch.sigmoid(p)
    if code == 5:
        return torch.tanh(p)
    return p


def _act_grad_ref(g: Tensor, y: Tensor, code: int) -> Tensor:
    """``g ⊙ f'(pre)`` from the output ``y = f(pre)``."""
    if code == 1:
        return torch.where(y > 0, g, torch.zeros_like(g))
    if code == 4:
        return g * y * (1 - y)
    if code == 5:
        return g * (1 - y * y)
    return g


@torch.no_grad()
def live_window_ref(
    xs: Tensor, targets: Tensor, flat: Tensor, meta: list[tuple[int, int, int, int, int]], lr: float,
    preds: Tensor, status: Tensor,
) -> None:
    """Reference: ``xs [K, in]``, ``targets [K, out]``, ``flat`` the parameters (updated in place),
    ``meta`` per layer ``(n_in, n_out, weight offset, bias offset or -1, activation code)``; writes
    ``preds [K, out]`` and ``status [K]`` (int32, see the module docstring)."""
    dead = False
    for k in range(xs.shape[0]):
        acts = [xs[k : k + 1]]
        for n_in, n_out, wo, bo, act in meta:
            w = flat[wo : wo + n_in * n_out].view(n_out, n_in)
            pre = acts[-1] @ w.t()
            if bo >= 0:
                pre = pre + flat[bo : bo + n_out]
            acts.append(_act_ref(pre, act))
        out = acts[-1]
        preds[k : k + 1].copy_(out)
        diff = out - targets[k : k + 1]
        n = diff.numel()
        loss = (diff * diff).sum() / n
        g = diff * (2.0 / n)
        grad = torch.zeros_like(flat)
        for i in range(len(meta) - 1, -1, -1):
            n_in, n_out, wo, bo, act = meta[i]
            gp = _act_grad_ref(g, acts[i + 1], act)
            grad[wo : wo + n_in * n_out] = (gp.t() @ acts[i]).reshape(-1)
            if bo >= 0:
                grad[bo : bo + n_out] = gp.reshape(-1)
            g = gp @ flat[wo : wo + n_in * n_out].view(n_out, n_in)
        if dead:
            status[k] = 3
            continue
        if not torch.isfinite(loss):
            status[k], dead = 1, True
            continue
        if not torch.isfinite((grad * grad).sum()):
            status[k] = 2
            continue
        new = flat - lr * grad
        if not torch.isfinite(new).all():
            status[k] = 4
            continue
        flat.copy_(new)
        status[k] = 0


@jit
def _act(p, code):
    t = 2.0 / (1.0 + tl.exp(-2.0 * p)) - 1.0
    s = 1.0 / (1.0 + tl.exp(-p))
    y = tl.where(code == 1, tl.maximum(p, 0.0), p)
    y = tl.where(code == 4, s, y)
    return tl.where(code == 5, t, y)


@jit
def _act_grad(g, y, code):
    r = tl.where(code == 1, tl.where(y > 0, g, 0.0), g)
    r = tl.where(code == 4, g * y * (1.0 - y), r)
    return tl.where(code == 5, g * (1.0 - y * y), r)


@jit
def _live_window_kernel(
    x_ptr, t_ptr,  # [K, in], [K, out]
    w_ptr,  # [P] the flat parameters, updated in place
    g_ptr, new_ptr,  # [P] scratch: gradients, new weights
    acts_ptr,  # [(L + 1) * BLOCK] scratch: the layers' outputs of the current sample
    pred_ptr, status_ptr,  # [K, out], [K] int32
    meta_ptr,  # [L * 5] int32
    lr, K, P,
    L: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, TRAIN: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    lr = tl.cast(lr, tl.float32)
    r = tl.arange(0, BLOCK)
    rp = tl.arange(0, BLOCK_P)
    n_x = tl.load(meta_ptr + 0)
    n_y = tl.load(meta_ptr + (L - 1) * 5 + 1)
    dead = n_x * 0
    for k in range(K):
        # ---- forward: each layer's output into the scratch rows, the last one is the prediction
        h = tl.load(x_ptr + k * n_x + r, mask=r < n_x, other=0.0)
        tl.store(acts_ptr + r, h)
        for l in tl.static_range(L):
            n_in = tl.load(meta_ptr + l * 5 + 0)
            n_out = tl.load(meta_ptr + l * 5 + 1)
            wo = tl.load(meta_ptr + l * 5 + 2)
            bo = tl.load(meta_ptr + l * 5 + 3)
            code = tl.load(meta_ptr + l * 5 + 4)
            wmask = (r[:, None] < n_out) & (r[None, :] < n_in)
            w = tl.load(w_ptr + wo + r[:, None] * n_in + r[None, :], mask=wmask, other=0.0)
            pre = tl.sum(w * h[None, :], axis=1)
            bmask = (r < n_out) & ((r * 0 + bo) >= 0)  # (a vector: the interpreter takes no scalar in a mask)
            pre += tl.load(w_ptr + bo + r, mask=bmask, other=0.0)
            h = tl.where(r < n_out, _act(pre, code), 0.0)
            tl.store(acts_ptr + (l + 1) * BLOCK + r, h)
        tl.store(pred_ptr + k * n_y + r, h, mask=r < n_y)
        if TRAIN:
            # ---- loss and the backward: gradients into the scratch buffer, their squared norm
            tgt = tl.load(t_ptr + k * n_y + r, mask=r < n_y, other=0.0)
            diff = tl.where(r < n_y, h - tgt, 0.0)
            loss = tl.sum(diff * diff, axis=0) / n_y
            g = diff * (2.0 / n_y)
            sq = loss * 0.0
            tl.debug_barrier()
            for j in tl.static_range(L):
                l = L - 1 - j
                n_in = tl.load(meta_ptr + l * 5 + 0)
                n_out = tl.load(meta_ptr + l * 5 + 1)
                wo = tl.load(meta_ptr + l * 5 + 2)
                bo = tl.load(meta_ptr + l * 5 + 3)
                code = tl.load(meta_ptr + l * 5 + 4)
                y = tl.load(acts_ptr + (l + 1) * BLOCK + r)
                x = tl.load(acts_ptr + l * BLOCK + r)
                gp = tl.where(r < n_out, _act_grad(g, y, code), 0.0)
                wmask = (r[:, None] < n_out) & (r[None, :] < n_in)
                gw = gp[:, None] * x[None, :]
                tl.store(g_ptr + wo + r[:, None] * n_in + r[None, :], gw, mask=wmask)
                bmask = (r < n_out) & ((r * 0 + bo) >= 0)
                tl.store(g_ptr + bo + r, gp, mask=bmask)
                sq += tl.sum(tl.sum(tl.where(wmask, gw * gw, 0.0), axis=1), axis=0)
                sq += tl.sum(tl.where(bmask, gp * gp, 0.0), axis=0)
                w = tl.load(w_ptr + wo + r[:, None] * n_in + r[None, :], mask=wmask, other=0.0)
                g = tl.sum(w * gp[:, None], axis=0)
            tl.debug_barrier()
            loss_ok = (loss - loss) == 0.0  # NaN − NaN and ±Inf − ±Inf are NaN
            grad_ok = (sq - sq) == 0.0
            # ---- the update, written only when every new weight is finite
            bad_new = sq * 0.0
            for start in range(0, P, BLOCK_P):
                m = start + rp < P
                nw = tl.load(w_ptr + start + rp, mask=m, other=0.0) - lr * tl.load(g_ptr + start + rp, mask=m, other=0.0)
                tl.store(new_ptr + start + rp, nw, mask=m)
                bad_new += tl.sum(tl.where(m, nw - nw, 0.0), axis=0)  # NaN when any is NaN or ±Inf
            new_ok = bad_new == 0.0
            status = tl.where(dead != 0, 3, tl.where(loss_ok, tl.where(grad_ok, tl.where(new_ok, 0, 4), 2), 1))
            dead = tl.where(loss_ok, dead, 1)
            tl.debug_barrier()
            write = (rp * 0 + status) == 0
            for start in range(0, P, BLOCK_P):
                m = (start + rp < P) & write
                tl.store(w_ptr + start + rp, tl.load(new_ptr + start + rp, mask=m, other=0.0), mask=m)
            tl.store(status_ptr + k, status)
            tl.debug_barrier()


def live_window_(
    xs: Tensor, targets: Tensor, flat: Tensor, meta: Tensor, lr: float, preds: Tensor, status: Tensor,
    scratch: Tensor, n_layers: int, block: int, train: bool = True,
) -> None:
    """The kernel over one window (see the module docstring): ``xs [K, in]``, ``targets [K, out]``
    (float32, contiguous), ``flat [P]`` the parameters (updated in place), ``meta`` int32 ``[L * 5]``
    on the device, ``preds [K, out]`` and ``status [K]`` (int32) written, ``scratch`` float32 of at
    least ``2 P + (L + 1) * block`` elements. ``train=False``: the forwards alone (the serving share
    of a window's time)."""
    p = flat.numel()
    grads, new, acts = scratch[:p], scratch[p : 2 * p], scratch[2 * p : 2 * p + (n_layers + 1) * block]
    _live_window_kernel[(1,)](
        xs, targets, flat, grads, new, acts, preds, status, meta, float(lr), xs.shape[0], p,
        L=n_layers, BLOCK=block, BLOCK_P=1024, TRAIN=train, num_warps=8,
    )
