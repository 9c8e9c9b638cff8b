"""One live window of backprop on a small Dense chain in one kernel launch.

For each of K samples in order (the live loop's device-resident stream, ``torchloom.live``): the
forward (its output is the served prediction, written to ``preds[k]``), the MSE loss and gradient
``2(o − y)/N``, the backward through every layer, and the SGD update ``w −= lr·g``, guarded as the
engine's device step guards it (``step_guard.py``, ``weight_guard.py``): a non-finite loss skips the
update (status 1) and every later update of the window (status 3), a non-finite squared gradient
norm skips it (status 2), an update that would make a weight non-finite is not written (status 4).

One program runs the whole window: a net of this size (adaptv2's Dense 8→32→64→64→64→32→4, 12.9k
weights) is a few thousand multiply-adds per layer, where the per-sample cost of the captured loop
of torch ops is its ~25 tiny kernels. Two kernels, the launcher picking (``kernel_settings``):

* **registers** (``_live_window_regs_kernel``): every layer's weight ``[n_out, n_in]`` and bias,
  padded to powers of two, are loaded into registers once per window and stored once at its end; a
  sample touches memory only for its input, target, prediction and status. The weight gradient is the
  outer product of the layer's output gradient and its input, never stored: the update recomputes
  it. The guard costs one reduction per sample, not one per check: wherever an element could make
  the loss, the squared gradient norm or a new weight non-finite (a square above ``BIG`` = 2^126 / the
  number of squares, so no sum of squares below it overflows; a non-finite ``w − lr·g``), a NaN joins
  the gradient flowing to the layer below (0 elsewhere, which changes no value), and one sum at the
  first layer carries it. Only when that sum is not 0 (a NaN sample, an overflow, or a gradient
  element above the bound) are the loss, the squared norm and the new weights checked in full, in
  the reference's order. For chains of at most ``MAX_REGISTER_LAYERS`` layers whose padded weights
  fit ``REGISTER_BUDGET``. Against the global kernel on an H200 (adaptv2, K = 64): see
  ``bench/RESULTS.md`` §8.
* **global** (``_live_window_kernel``): any chain up to ``MAX_WIDTH`` wide. Each layer's weight and
  bias are read from the flat parameter buffer every sample (offsets in ``meta``); the layer outputs,
  the gradients and the new weights go through scratch buffers, and a CTA barrier separates each
  phase.

Products run in float32 with tree sums (not cuBLAS's order), so the numbers match the torch path to
rounding.

``live_window_ref`` is the same computation in torch ops (the tests' reference, and the path off CUDA
without Triton's interpreter).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from ._tl import jit, tl

__all__ = ["ACT_CODES", "MAX_WIDTH", "MAX_REGISTER_LAYERS", "REGISTER_BUDGET", "live_window_", "kernel_settings", "live_window_ref",
           "register_constexprs", "register_elements"]

ACT_CODES = {"linear": 0, "relu": 1, "sigmoid": 4, "tanh": 5}
MAX_WIDTH = 128
MAX_REGISTER_LAYERS = 8
REGISTER_BUDGET = 24576  # padded weight slots the register kernel takes (16 warps: 48 per thread)
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



@jit
def _fwd(w, b, h, CODE: tl.constexpr, n_out: tl.constexpr, PO: tl.constexpr):
    """One layer's output ``[PO]`` (rows past ``n_out`` zero) from ``w [PO, PI]``, ``b [PO]`` and the
    input ``h [PI]``."""
    pre = tl.sum(w * h[None, :], axis=1) + b
    if CODE == 1:
        y = tl.maximum(pre, 0.0)
    elif CODE == 4:
        y = 1.0 / (1.0 + tl.exp(-pre))
    elif CODE == 5:
        y = 2.0 / (1.0 + tl.exp(-2.0 * pre)) - 1.0
    else:
        y = pre
    return tl.where(tl.arange(0, PO) < n_out, y, 0.0)


@jit
def _bwd_act(g, y, CODE: tl.constexpr):
    """``g ⊙ f'(pre)`` from the output ``y = f(pre)``."""
    if CODE == 1:
        r = tl.where(y > 0, g, 0.0)
    elif CODE == 4:
        r = g * y * (1.0 - y)
    elif CODE == 5:
        r = g * (1.0 - y * y)
    else:
        r = g
    return r


@jit
def _live_window_regs_kernel(
    x_ptr, t_ptr,  # [K, in], [K, out]
    w_ptr,  # [P] the flat parameters: read at the start, written at the end
    pred_ptr, status_ptr,  # [K, out], [K] int32
    lr, K,
    L: tl.constexpr, DIMS: tl.constexpr, PADS: tl.constexpr,  # L + 1 widths, and their powers of two
    WOFF: tl.constexpr, BOFF: tl.constexpr, ACTS: tl.constexpr,  # per layer (BOFF -1: no bias)
    BIG: tl.constexpr,  # a square at most this: the sum of all of them stays finite (2^126 / terms)
    TRAIN: tl.constexpr,
):
    # every weight and bias lives in registers for the whole window: loaded once here, stored once at
    # the end; a sample touches memory only for its input, target, prediction and status
    ws = ()
    bs = ()
    for l in tl.static_range(L):
        ro = tl.arange(0, PADS[l + 1])
        ri = tl.arange(0, PADS[l])
        wmask = (ro[:, None] < DIMS[l + 1]) & (ri[None, :] < DIMS[l])
        ws = ws + (tl.load(w_ptr + WOFF[l] + ro[:, None] * DIMS[l] + ri[None, :], mask=wmask, other=0.0),)
        if BOFF[l] >= 0:
            bs = bs + (tl.load(w_ptr + BOFF[l] + ro, mask=ro < DIMS[l + 1], other=0.0),)
        else:
            bs = bs + (tl.zeros([PADS[l + 1]], dtype=tl.float32),)
    r_in = tl.arange(0, PADS[0])
    r_out = tl.arange(0, PADS[L])
    n_y: tl.constexpr = DIMS[L]
    dead = tl.full([], 0, tl.int32)
    # the next sample's input and target load while this one computes (masks are vectors: the
    # interpreter takes no scalar in a mask)
    x_next = tl.load(x_ptr + r_in, mask=(r_in < DIMS[0]) & (r_in * 0 < K), other=0.0)
    t_next = tl.load(t_ptr + r_out, mask=(r_out < n_y) & (r_out * 0 < K), other=0.0)
    for k in range(K):
        h = x_next
        tgt = t_next
        x_next = tl.load(x_ptr + (k + 1) * DIMS[0] + r_in, mask=(r_in < DIMS[0]) & (r_in * 0 + k + 1 < K), other=0.0)
        t_next = tl.load(t_ptr + (k + 1) * n_y + r_out, mask=(r_out < n_y) & (r_out * 0 + k + 1 < K), other=0.0)
        # ---- forward: the served prediction (one forward serves and trains)
        acts = (h,)
        for l in tl.static_range(L):
            h = _fwd(ws[l], bs[l], h, ACTS[l], DIMS[l + 1], PADS[l + 1])
            acts = acts + (h,)
        tl.store(pred_ptr + k * n_y + r_out, h, mask=r_out < n_y)
        if TRAIN:
            # ---- the backward, each layer's output gradient gp (its weight gradient is the outer
            # product gp ⊗ input, never stored). The guard without a reduction per check: where an
            # element could make the loss, the squared gradient norm or a new weight non-finite (a
            # square above BIG, a non-finite w − lr·g), a NaN joins the gradient flowing down (0
            # elsewhere, which changes no value), and the one sum at the first layer is NaN
            diff = tl.where(r_out < n_y, h - tgt, 0.0)
            g = diff * (2.0 / n_y) + tl.where(diff * diff <= BIG, 0.0, float("nan"))
            gps = ()
            for l in tl.static_range(L - 1, -1, -1):
                gp = _bwd_act(g, acts[l + 1], ACTS[l]) + (g - g)  # (g − g: a NaN passes any activation)
                gw = gp[:, None] * acts[l][None, :]
                trial = ws[l] + gw * (-lr)  # the update's value, in another form than the update's
                # so the compiler does not keep it alive until then (it recomputes it)
                ok = (gw * gw <= BIG) & ((trial - trial) == 0.0)
                if BOFF[l] >= 0:
                    trial_b = bs[l] + gp * (-lr)
                    ok = ok & ((gp * gp <= BIG) & ((trial_b - trial_b) == 0.0))[:, None]
                poison = tl.where(ok, 0.0, float("nan"))
                if l > 0:
                    g = tl.sum(ws[l] * gp[:, None] + poison, axis=0)
                else:
                    check = tl.sum(tl.sum(poison, axis=1), axis=0)
                gps = (gp,) + gps
            clean = (check == 0.0) & (dead == 0)
            new_ws = ()
            new_bs = ()
            for l in tl.static_range(L):
                new_ws = new_ws + (tl.where(clean, ws[l] - lr * (gps[l][:, None] * acts[l][None, :]), ws[l]),)
                if BOFF[l] >= 0:
                    new_bs = new_bs + (tl.where(clean, bs[l] - lr * gps[l], bs[l]),)
                else:
                    new_bs = new_bs + (bs[l],)
            ws = new_ws
            bs = new_bs
            status = tl.where(dead != 0, 3, 0)
            if (check != 0.0) & (dead == 0):
                # rare: the engine's checks in full, in order (the loss: 1, the squared gradient
                # norm: 2, the new weights: 4), and the update when none fails
                loss = tl.sum(diff * diff, axis=0) / n_y
                g = diff * (2.0 / n_y)
                sq = loss * 0.0
                bad = loss * 0.0
                gcs = ()
                for l in tl.static_range(L - 1, -1, -1):
                    gc = _bwd_act(g, acts[l + 1], ACTS[l])
                    gwc = gc[:, None] * acts[l][None, :]
                    nwc = ws[l] - lr * gwc
                    sq += tl.sum(tl.sum(gwc * gwc, axis=1), axis=0)
                    bad += tl.sum(tl.sum(nwc - nwc, axis=1), axis=0)  # NaN when any is NaN or ±Inf
                    if BOFF[l] >= 0:
                        nbc = bs[l] - lr * gc
                        sq += tl.sum(gc * gc, axis=0)
                        bad += tl.sum(nbc - nbc, axis=0)
                    if l > 0:
                        g = tl.sum(ws[l] * gc[:, None], axis=0)
                    gcs = (gc,) + gcs
                loss_ok = (loss - loss) == 0.0  # NaN − NaN and ±Inf − ±Inf are NaN
                status = tl.where(loss_ok, tl.where((sq - sq) == 0.0, tl.where(bad == 0.0, 0, 4), 2), 1)
                dead = tl.where(loss_ok, dead, 1)
                apply = status == 0
                fixed_ws = ()
                fixed_bs = ()
                for l in tl.static_range(L):
                    fixed_ws = fixed_ws + (tl.where(apply, ws[l] - lr * (gcs[l][:, None] * acts[l][None, :]), ws[l]),)
                    if BOFF[l] >= 0:
                        fixed_bs = fixed_bs + (tl.where(apply, bs[l] - lr * gcs[l], bs[l]),)
                    else:
                        fixed_bs = fixed_bs + (bs[l],)
                ws = fixed_ws
                bs = fixed_bs
            tl.store(status_ptr + k, status)
    if TRAIN:
        for l in tl.static_range(L):
            ro = tl.arange(0, PADS[l + 1])
            ri = tl.arange(0, PADS[l])
            wmask = (ro[:, None] < DIMS[l + 1]) & (ri[None, :] < DIMS[l])
            tl.store(w_ptr + WOFF[l] + ro[:, None] * DIMS[l] + ri[None, :], ws[l], mask=wmask)
            if BOFF[l] >= 0:
                tl.store(w_ptr + BOFF[l] + ro, bs[l], mask=ro < DIMS[l + 1])


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def register_elements(meta: Sequence[tuple[int, int, int, int, int]]) -> int:
    """Register slots the register kernel holds per CTA for ``meta``'s weights and biases (each
    layer padded to powers of two)."""
    return sum(_pow2(n_out) * (_pow2(n_in) + 1) for n_in, n_out, *_ in meta)


def register_constexprs(meta: Sequence[tuple[int, int, int, int, int]], train: bool) -> dict:
    """The register kernel's compile-time arguments for ``meta``: the widths and their powers of two,
    the offsets, the activations, and BIG (a square at most 2^126 / the number of squares summed: no
    sum of them overflows)."""
    dims = tuple([meta[0][0]] + [row[1] for row in meta])
    return {
        "L": len(meta), "DIMS": dims, "PADS": tuple(_pow2(d) for d in dims), "WOFF": tuple(row[2] for row in meta),
        "BOFF": tuple(row[3] for row in meta), "ACTS": tuple(row[4] for row in meta),
        "BIG": 2.0**126 / (register_elements(meta) + dims[-1]), "TRAIN": train,
    }


def kernel_settings(meta: Sequence[tuple[int, int, int, int, int]], kernel: str | None = None) -> tuple[str, int]:
    """(kernel, num_warps): ``"registers"`` when the padded weights fit ``REGISTER_BUDGET`` and the
    chain has at most ``MAX_REGISTER_LAYERS`` layers, else ``"global"``. Warps: the fewest of 4, 8,
    16 that hold at most 64 weights per thread (adaptv2's 12.9k: 8 warps; compiled for sm_90 that is
    255 registers a thread with ~0.3 KB spilled, against 128 and a like spill with 16 warps; the
    biases and the layers' output vectors are replicated across the threads of a row, which is most
    of the rest)."""
    if kernel is None:
        fits = len(meta) <= MAX_REGISTER_LAYERS and register_elements(meta) <= REGISTER_BUDGET
        kernel = "registers" if fits else "global"
    if kernel not in ("registers", "global"):
        raise ValueError(f"live_window_: kernel must be 'registers', 'global' or None, got {kernel!r}")
    if kernel == "global":
        return kernel, 8
    warps = 4
    while warps < 16 and register_elements(meta) > 64 * 32 * warps:
        warps *= 2
    return kernel, warps


@functools.lru_cache(maxsize=64)
def _plan(meta: tuple, kernel: str | None, train: bool) -> tuple[str, int, dict]:
    """(kernel, warps, the register kernel's constexprs) for a layout, worked out once per layout (a
    window's launch is on the live loop's host path)."""
    kernel, warps = kernel_settings(meta, kernel)
    return kernel, warps, register_constexprs(meta, train) if kernel == "registers" else {}


def live_window_(
    xs: Tensor, targets: Tensor, flat: Tensor, meta: Sequence[tuple[int, int, int, int, int]], lr: float,
    preds: Tensor, status: Tensor, *, train: bool = True, kernel: str | None = None,
    scratch: Tensor | None = None, meta_dev: Tensor | None = None, num_warps: int | None = None,
) -> None:
    """The kernel over one window (see the module docstring): ``xs [K, in]``, ``targets [K, out]``
    (float32, contiguous), ``flat [P]`` the parameters (updated in place), ``meta`` per layer
    ``(n_in, n_out, weight offset, bias offset or -1, activation code)`` (host ints), ``preds
    [K, out]`` and ``status [K]`` (int32) written. ``train=False``: the forwards alone (the serving
    share of a window's time). ``kernel``: ``"registers"`` (the weights held in registers through the
    window), ``"global"`` (read and written in memory every sample: any chain up to ``MAX_WIDTH``
    wide), None: the first where it fits (``kernel_settings``). The global kernel's ``scratch`` (float32,
    at least ``2 P + (L + 1) · BLOCK`` elements) and ``meta_dev`` (``meta`` as int32 on the device)
    are made when not given. ``num_warps``: the launch's warps instead of ``kernel_settings``' (a sweep)."""
    kernel, warps, constexprs = _plan(tuple(map(tuple, meta)), kernel, train)
    warps = num_warps or warps
    n_layers, k = len(meta), xs.shape[0]
    if kernel == "registers":
        _live_window_regs_kernel[(1,)](xs, targets, flat, preds, status, float(lr), k, **constexprs, num_warps=warps)
        return
    p = flat.numel()
    block = max(16, _pow2(max(max(row[0], row[1]) for row in meta)))
    if scratch is None:
        scratch = torch.zeros(2 * p + (n_layers + 1) * block, dtype=flat.dtype, device=flat.device)
    if meta_dev is None:
        meta_dev = torch.tensor([v for row in meta for v in row], dtype=torch.int32, device=flat.device)
    grads, new, acts = scratch[:p], scratch[p : 2 * p], scratch[2 * p : 2 * p + (n_layers + 1) * block]
    _live_window_kernel[(1,)](
        xs, targets, flat, grads, new, acts, preds, status, meta_dev, float(lr), k, p,
        L=n_layers, BLOCK=block, BLOCK_P=1024, TRAIN=train, num_warps=warps,
    )
