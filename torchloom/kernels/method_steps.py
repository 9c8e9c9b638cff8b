"""Fused pieces of TargetProp's and Tweening's captured device steps: a step in about eighteen launches.

A captured step's time at small batches is its launch count (about 2.5 µs a kernel on an H100), and
a TargetProp or Tween step written in torch ops launched 110–130 kernels against backprop's 16: one
per small op of the per-layer link budgets, gates, rates, logs and targets. These kernels do that
bookkeeping for every layer at once, so a step is its forward, its backward and a handful of
launches:

* ``target_rows(out, y, mode, ...)``: one program per output row: the loss partial, the gradient
  the method propagates, the target and prediction the last layer's statistics need, and the
  accuracy partial (class labels). TargetProp (``TP``): ``g = t − out``, loss ``mean((out − t)²)``;
  TargetProp on cross-entropy (``TP_CE``): ``g = t − softmax(out)``, the output target ``out + g``,
  loss the batch mean of the cross-entropy; Tween:
  ``loss_and_grad``'s gradient times the batch, masked to rows whose error ``Σ(ŷ − t)²`` reaches
  ``gap_threshold`` (``ŷ``: the softmax for cross-entropy, the output for MSE).
* ``estimate_gap(t_out, W, act)``: pure TargetProp's input target of a Dense layer (``t_out W``
  divided by the ``|W|`` column sums where they exceed ``MIN_CONNECTION``, else 0) and its gap
  ``t − act``, one launch (up to 16 rows it computes the product too); with ``difference=True`` the
  estimate ``e`` of the gap ``t_out`` above is the gap, and ``act + e`` the target (difference
  target propagation).
* ``layer_stats_into(part, f, t, extra, scale)``: ``pair_stats``'s five sums (``Σ f·t, Σ f², Σ t²,
  Σ (f − t)², Σ extra²``) for one layer, left as per-program partials in that layer's rows of one
  shared buffer (no ``sum`` launch). With ``scale`` the target is never materialised: ``t = f +
  scale·t_arg`` is formed in registers (TargetProp's ``a + s·g``, Tween's ``a − s·g``).
* ``tp_rule_`` / ``tween_rule_``: one program that adds up every layer's partials and does the rest
  of the step's decisions in float64: cosines, link budgets and gaps; TargetProp's gate and rates;
  Tween's gaps, RMS link budgets, alignments, the explosion rule (``kernels.explosion_rule``, the
  same lines) and its rates; then the per-parameter coefficients ``a``, ``c`` and ``apply`` of
  ``momentum_update_flat_`` and the step's log row.

Each has a reference in torch ops (the same math, float64 decisions) that the tests compare the
kernels to; the trainers' CPU device steps keep their torch-op form. Limits of the fused step: at
most ``MAX_LAYERS`` layers and ``MAX_SEGMENTS`` parameters, rows of at most 8,192 outputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import elementwise_settings, row_settings
from .explosion_rule import rule_body

__all__ = [
    "MAX_LAYERS", "MAX_SEGMENTS", "MIN_CONNECTION", "TP", "TP_CE", "TWEEN_MSE", "TWEEN_CE", "target_rows", "target_rows_ref",
    "estimate_gap", "estimate_gap_ref",
    "layer_stats_into", "stats_into", "stats_partials", "stats_ref", "stats_programs", "tp_rule_", "tp_rule_ref", "tween_metrics_ref", "tween_rule_",
]

MAX_LAYERS = 16
MAX_SEGMENTS = 64
_MAX_ROW = 8192
TP, TWEEN_MSE, TWEEN_CE, TP_CE = 0, 1, 2, 3


# ------------------------------------------------------------------------------ 1. target rows
def target_rows_ref(out: Tensor, y: Tensor, mode: int, gap_threshold: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference: ``out [B, C]``, ``y`` labels ``[B]`` or a float target ``[B, C]`` →
    ``(loss_partials [B] float32, g [B, C], t [B, C], y_hat [B, C], correct [B] float32)``; see the
    module docstring for ``g`` per ``mode``."""
    rows, c = out.shape
    o = out.float()
    t = torch.zeros_like(o).scatter_(-1, y.long().unsqueeze(-1), 1.0) if not y.is_floating_point() else y.float()
    correct = (o.argmax(-1) == y).float() if not y.is_floating_point() else torch.zeros(rows, device=out.device)
    if mode == TP:
        g = t - o
        loss = (g * g).sum(1) / max(rows * c, 1)
        y_hat = o
    elif mode == TP_CE:
        g = t - torch.softmax(o, dim=-1)
        loss = (t * (torch.logsumexp(o, -1, keepdim=True) - o)).sum(1) / rows
        y_hat = o
        t = o + g  # the output's target: its gap is t − softmax(out)
    else:
        if mode == TWEEN_CE:
            y_hat = torch.softmax(o, dim=-1)
            loss = (t * (torch.logsumexp(o, -1, keepdim=True) - o)).sum(1) / rows
            grad = (y_hat - t) / rows
        else:
            y_hat = o
            d = o - t
            loss = (d * d).sum(1) / max(rows * c, 1)
            grad = d * (2.0 / max(rows * c, 1))
        err = (y_hat - t).square().sum(1)
        keep = (err >= gap_threshold).float() if gap_threshold > 0 else torch.ones_like(err)
        g = grad * rows * keep[:, None]
    return loss, g.to(out.dtype), t.to(out.dtype), y_hat.to(out.dtype), correct


@jit
def _target_rows_kernel(
    loss_ptr, g_ptr, t_ptr, yhat_ptr, correct_ptr,  # written
    out_ptr, y_ptr, n_cols, inv_n, rows_f, gap_threshold,  # read
    BLOCK: tl.constexpr, LABELS: tl.constexpr, MODE: tl.constexpr, MASK_GAP: tl.constexpr,
):
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    inv_n = tl.cast(inv_n, tl.float32)
    rows_f = tl.cast(rows_f, tl.float32)
    gap_threshold = tl.cast(gap_threshold, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    o = tl.load(out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if LABELS:
        label = tl.load(y_ptr + row).to(tl.int32)
        t = tl.where(cols == label, 1.0, 0.0)
        best = tl.argmax(tl.where(mask, o, -float("inf")), axis=0)
        tl.store(correct_ptr + row, tl.where(best == label, 1.0, 0.0))
    else:
        t = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:  # TargetProp: g = t − out, loss mean((out − t)²)
        g = t - o
        tl.store(loss_ptr + row, tl.sum(tl.where(mask, g * g, 0.0), axis=0) * inv_n)
        y_hat = o
    elif MODE == 3:  # TargetProp on cross-entropy: g = t − softmax(out), target out + g, loss Σ t (lse − o) / B
        m = tl.max(tl.where(mask, o, -float("inf")), axis=0)
        e = tl.where(mask, tl.exp(o - m), 0.0)
        s = tl.sum(e, axis=0)
        lse = m + tl.log(s)
        tl.store(loss_ptr + row, tl.sum(tl.where(mask, t * (lse - o), 0.0), axis=0) * inv_n)
        g = t - e / s
        t = o + g
        y_hat = o
    else:
        if MODE == 2:  # cross-entropy: softmax, loss Σ t (lse − o) / B, grad (p − t) / B
            m = tl.max(tl.where(mask, o, -float("inf")), axis=0)
            e = tl.where(mask, tl.exp(o - m), 0.0)
            s = tl.sum(e, axis=0)
            y_hat = e / s
            lse = m + tl.log(s)
            tl.store(loss_ptr + row, tl.sum(tl.where(mask, t * (lse - o), 0.0), axis=0) * inv_n)
            grad = (y_hat - t) * inv_n
        else:  # MSE: loss Σ (o − t)² / N, grad 2 (o − t) / N
            y_hat = o
            d = o - t
            tl.store(loss_ptr + row, tl.sum(tl.where(mask, d * d, 0.0), axis=0) * inv_n)
            grad = d * (2.0 * inv_n)
        g = grad * rows_f
        if MASK_GAP:
            diff = tl.where(mask, y_hat - t, 0.0)
            err = tl.sum(diff * diff, axis=0)
            g = g * tl.where(err >= gap_threshold, 1.0, 0.0)
    tl.store(g_ptr + row * n_cols + cols, g.to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(t_ptr + row * n_cols + cols, t.to(t_ptr.dtype.element_ty), mask=mask)
    if MODE == 2:
        tl.store(yhat_ptr + row * n_cols + cols, y_hat.to(yhat_ptr.dtype.element_ty), mask=mask)


def target_rows(out: Tensor, y: Tensor, mode: int, gap_threshold: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One launch (``out`` 2-D, contiguous, at most 8,192 columns; the caller checks): the outputs of
    ``target_rows_ref``. ``y_hat`` is ``out`` itself unless the mode is ``TWEEN_CE``."""
    rows, c = out.shape
    labels = not y.is_floating_point()
    loss = torch.empty(rows, dtype=torch.float32, device=out.device)
    correct = torch.empty(rows if labels else 1, dtype=torch.float32, device=out.device)
    g, t = torch.empty_like(out), torch.empty_like(out)
    y_hat = torch.empty_like(out) if mode == TWEEN_CE else out
    inv_n = 1.0 / max(rows * c, 1) if mode not in (TWEEN_CE, TP_CE) else 1.0 / max(rows, 1)
    block, num_warps = row_settings(c, out.is_cuda)
    _target_rows_kernel[(rows,)](
        loss, g, t, y_hat if mode == TWEEN_CE else g, correct, out, y.contiguous(), c, inv_n, float(rows), float(gap_threshold),
        BLOCK=block, LABELS=labels, MODE=mode, MASK_GAP=mode in (TWEEN_MSE, TWEEN_CE) and gap_threshold > 0, num_warps=num_warps,
    )
    if not labels:
        correct.zero_()
    return loss, g, t, y_hat, correct


# ------------------------------------------------------------- 1b. pure TargetProp's estimates
MIN_CONNECTION = 0.01  # a column of |W| summing to at most this gets no estimate (Loom's rule)
_EST_ROWS, _EST_COLS, _EST_OUTS, _EST_PROGRAMS = 16, 32, 64, 128


def estimate_gap_ref(t_out: Tensor, weight: Tensor, act: Tensor, difference: bool = False) -> tuple[Tensor, Tensor]:
    """Reference: pure TargetProp's input target of a Dense layer and its gap. ``t_out [B, out]`` the
    target of the layer's output, ``weight`` ``W [out, in]``, ``act`` the layer's input ``[B, in]`` →
    ``(t, t − act)`` with ``t = est(t_out)``, ``est(v) = (v W) / Σ_o |W[o, :]|`` where that sum exceeds
    ``MIN_CONNECTION``, else 0. With ``difference``, ``t_out`` is the output's gap and the result is
    ``(act + est(t_out), est(t_out))``."""
    colsum = weight.abs().sum(0)
    connected = colsum > MIN_CONNECTION
    e = torch.where(connected, (t_out @ weight) / torch.where(connected, colsum, 1.0), 0.0)
    return (act + e, e) if difference else (e, e - act)


@jit
def _estimate_kernel(
    t_ptr, gap_ptr, w_ptr, act_ptr, tout_ptr, rows, cols, outs, min_connection, row_programs,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr, WITH_NUM: tl.constexpr, DIFFERENCE: tl.constexpr,
):
    """Program (c, r): the |W| column sums of column block c (W read once per program) — with
    ``WITH_NUM`` (at most ``BLOCK_R`` rows) also ``t_out W`` for the block, from the same W tiles —
    then rows r, r + row_programs, ... in blocks of ``BLOCK_R``: t = num / colsum where connected, and
    the gap t − act. Without ``WITH_NUM``, ``t_ptr`` holds ``num`` on entry and ``t`` on exit."""
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    min_connection = tl.cast(min_connection, tl.float32)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < cols
    rr = tl.arange(0, BLOCK_R)
    oo = tl.arange(0, BLOCK_O)
    s = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for o in range(0, outs, BLOCK_O):
        om = (o + oo) < outs
        w = tl.load(w_ptr + (o + oo)[:, None].to(tl.int64) * cols + c[None, :], mask=om[:, None] & cmask[None, :], other=0.0)
        s += tl.sum(tl.abs(w.to(tl.float32)), axis=0)
        if WITH_NUM:
            tt = tl.load(tout_ptr + rr[:, None] * outs + (o + oo)[None, :], mask=(rr < rows)[:, None] & om[None, :], other=0.0)
            acc += tl.dot(tt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    connected = s > min_connection
    denom = tl.where(connected, s, 1.0)
    for r0 in range(tl.program_id(1) * BLOCK_R, rows, row_programs * BLOCK_R):
        r = r0 + rr
        m = (r < rows)[:, None] & cmask[None, :]
        offs = r[:, None].to(tl.int64) * cols + c[None, :]
        if WITH_NUM:
            num = acc
        else:
            num = tl.load(t_ptr + offs, mask=m, other=0.0).to(tl.float32)
        a = tl.load(act_ptr + offs, mask=m, other=0.0).to(tl.float32)
        e = tl.where(connected[None, :], num / denom[None, :], 0.0)
        if DIFFERENCE:  # the estimate of the gap above is the gap; the target is act + gap
            tl.store(t_ptr + offs, (a + e).to(t_ptr.dtype.element_ty), mask=m)
            tl.store(gap_ptr + offs, e.to(gap_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(t_ptr + offs, e.to(t_ptr.dtype.element_ty), mask=m)
            tl.store(gap_ptr + offs, (e - a).to(gap_ptr.dtype.element_ty), mask=m)


def estimate_gap(t_out: Tensor, weight: Tensor, act: Tensor, difference: bool = False) -> tuple[Tensor, Tensor]:
    """``estimate_gap_ref`` (all contiguous, one dtype: ``t_out [B, out]``, ``weight [out, in]``,
    ``act [B, in]``) → ``(t, gap)``. Up to 16 rows: one launch, the product ``t_out W`` computed from
    the same weight tiles as the ``|W|`` column sums (IEEE float32 products); more rows: cuBLAS's
    product, then one launch."""
    rows, cols = act.shape
    outs = weight.shape[0]
    if not (t_out.is_contiguous() and weight.is_contiguous() and act.is_contiguous()):
        raise ValueError("estimate_gap: t_out, weight and act must be contiguous")
    if t_out.shape != (rows, outs) or weight.shape[1] != cols:
        raise ValueError(f"estimate_gap: t_out {list(t_out.shape)}, weight {list(weight.shape)} and act {list(act.shape)} do not fit")
    gap = torch.empty_like(act)
    col_blocks = -(-cols // _EST_COLS)
    with_num = rows <= _EST_ROWS
    t = torch.empty_like(act) if with_num else torch.mm(t_out, weight)
    row_programs = 1 if with_num else max(1, min(-(-rows // _EST_ROWS), _EST_PROGRAMS // col_blocks))
    _estimate_kernel[(col_blocks, row_programs)](
        t, gap, weight, act, t_out, rows, cols, outs, MIN_CONNECTION, row_programs,
        BLOCK_R=_EST_ROWS, BLOCK_C=_EST_COLS, BLOCK_O=_EST_OUTS, WITH_NUM=with_num, DIFFERENCE=bool(difference), num_warps=4,
    )
    return t, gap


# ------------------------------------------------------------------------- 2. layer statistics
def stats_ref(f: Tensor, t: Tensor | None, extra: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Reference: ``[Σ f·t, Σ f², Σ t², Σ (f − t)², Σ extra²]`` in float32, with ``t`` replaced by
    ``f + scale·t`` when ``scale`` is given."""
    f2 = f.reshape(-1).float()
    t2 = f2 if t is None else t.reshape(-1).float()
    if scale is not None and t is not None:
        t2 = f2 + scale * t2
    d = f2 - t2
    e2 = extra.reshape(-1).float().square().sum() if extra is not None else f2.new_zeros(())
    return torch.stack([(f2 * t2).sum(), (f2 * f2).sum(), (t2 * t2).sum(), (d * d).sum(), e2])


@jit
def _stats_program(
    out_ptr, f_ptr, t_ptr, e_ptr, n, n_extra, scale, pid, programs,
    BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr, FROM_GRAD: tl.constexpr, T_IS_F: tl.constexpr,
):
    """One program's five partial sums (grid-stride over ``programs`` programs) into ``out_ptr[0:5]``."""
    a0 = tl.zeros([BLOCK], dtype=tl.float32)
    a1 = tl.zeros([BLOCK], dtype=tl.float32)
    a2 = tl.zeros([BLOCK], dtype=tl.float32)
    a3 = tl.zeros([BLOCK], dtype=tl.float32)
    a4 = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, tl.maximum(n, n_extra), programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if T_IS_F:
            t = f
        else:
            t = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if FROM_GRAD:
                t = f + scale * t
        d = f - t
        a0 += f * t
        a1 += f * f
        a2 += t * t
        a3 += d * d
        if HAS_EXTRA:
            e = tl.load(e_ptr + offs, mask=offs < n_extra, other=0.0).to(tl.float32)
            a4 += e * e
    tl.store(out_ptr + 0, tl.sum(a0, axis=0))
    tl.store(out_ptr + 1, tl.sum(a1, axis=0))
    tl.store(out_ptr + 2, tl.sum(a2, axis=0))
    tl.store(out_ptr + 3, tl.sum(a3, axis=0))
    tl.store(out_ptr + 4, tl.sum(a4, axis=0))


@jit
def _stats_kernel(
    part_ptr, f_ptr, t_ptr, e_ptr, n, n_extra, scale, programs,
    BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr, FROM_GRAD: tl.constexpr, T_IS_F: tl.constexpr,
):
    # grid-stride: at most _MAX_STATS_PROGRAMS partial rows, so the rule kernel's single program adds
    # up few of them whatever the batch
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    scale = tl.cast(scale, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    _stats_program(part_ptr + pid * 5, f_ptr, t_ptr, e_ptr, n, n_extra, scale, pid, programs, BLOCK, HAS_EXTRA, FROM_GRAD, T_IS_F)


@jit
def _stats_pairs_kernel(
    part_ptr, programs,
    f0, t0, e0, n0, ne0, s0, f1, t1, e1, n1, ne1, s1, f2, t2, e2, n2, ne2, s2, f3, t3, e3, n3, ne3, s3,
    f4, t4, e4, n4, ne4, s4, f5, t5, e5, n5, ne5, s5, f6, t6, e6, n6, ne6, s6, f7, t7, e7, n7, ne7, s7,
    NP: tl.constexpr, BLOCK: tl.constexpr, EXTRA: tl.constexpr, GRAD: tl.constexpr, SAME: tl.constexpr,
):
    # every pair's statistics in one launch: grid (programs, pairs); pair j's flags are bit j of the masks
    # Inductor passes a Python float as fp64: fp32 here, as Triton's own launcher passes it.
    s0 = tl.cast(s0, tl.float32)
    s1 = tl.cast(s1, tl.float32)
    s2 = tl.cast(s2, tl.float32)
    s3 = tl.cast(s3, tl.float32)
    s4 = tl.cast(s4, tl.float32)
    s5 = tl.cast(s5, tl.float32)
    s6 = tl.cast(s6, tl.float32)
    s7 = tl.cast(s7, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1)
    for j in tl.static_range(NP):
        if j == 0:
            f, t, e, n, ne, sc = f0, t0, e0, n0, ne0, s0
        if j == 1:
            f, t, e, n, ne, sc = f1, t1, e1, n1, ne1, s1
        if j == 2:
            f, t, e, n, ne, sc = f2, t2, e2, n2, ne2, s2
        if j == 3:
            f, t, e, n, ne, sc = f3, t3, e3, n3, ne3, s3
        if j == 4:
            f, t, e, n, ne, sc = f4, t4, e4, n4, ne4, s4
        if j == 5:
            f, t, e, n, ne, sc = f5, t5, e5, n5, ne5, s5
        if j == 6:
            f, t, e, n, ne, sc = f6, t6, e6, n6, ne6, s6
        if j == 7:
            f, t, e, n, ne, sc = f7, t7, e7, n7, ne7, s7
        if pair == j:
            _stats_program(
                part_ptr + (j * programs + pid) * 5, f, t, e, n, ne, sc, pid, programs, BLOCK,
                ((EXTRA >> j) & 1) == 1, ((GRAD >> j) & 1) == 1, ((SAME >> j) & 1) == 1,
            )


_MAX_PAIRS = 8
_MAX_STATS_PROGRAMS = 1024


def stats_programs(n: int, is_cuda: bool) -> int:
    """How many partial rows ``layer_stats_into`` writes for ``n`` elements."""
    return min(elementwise_settings(n, is_cuda)[2], _MAX_STATS_PROGRAMS)


def layer_stats_into(part: Tensor, f: Tensor, t: Tensor | None, extra: Tensor | None = None, scale: float | None = None) -> None:
    """Write one layer's partial sums into ``part`` (``[≥ stats_programs(n), 5]`` float32 rows, zeroed
    beforehand by the caller: a program that has nothing to add leaves its row alone). ``f``, ``t``
    contiguous with ``n`` elements each (``t=None``: ``t = f``, read once); ``extra`` contiguous with
    at most ``n`` elements."""
    n = f.numel()
    block, num_warps, _ = elementwise_settings(n, f.is_cuda)
    programs = stats_programs(n, f.is_cuda)
    _stats_kernel[(programs,)](
        part, f, f if t is None else t, extra if extra is not None else f, n, extra.numel() if extra is not None else 0,
        float(scale or 0.0), programs, BLOCK=block, HAS_EXTRA=extra is not None, FROM_GRAD=scale is not None,
        T_IS_F=t is None, num_warps=num_warps,
    )


def stats_partials(pairs: list[tuple[Tensor, Tensor | None, Tensor | None, float | None]]) -> int:
    """``P``, the partial rows per pair ``stats_into(pairs)`` writes."""
    cuda = pairs[0][0].is_cuda
    return max(stats_programs(max(f.numel(), e.numel() if e is not None else 0), cuda) for f, _, e, _ in pairs)


def stats_into(pairs: list[tuple[Tensor, Tensor | None, Tensor | None, float | None]], out: Tensor | None = None) -> Tensor:
    """Every pair's ``layer_stats_into`` at once: ``[len(pairs), P, 5]`` float32 partials (every row
    written: no zeroing), one launch for up to eight pairs (else one per pair, on a zeroed buffer).
    A pair is ``(f, t or None, extra or None, scale or None)`` as ``layer_stats_into`` takes them.
    ``out``: a contiguous float32 ``[len(pairs), P, 5]`` tensor to write into (``P`` from
    ``stats_partials(pairs)``; a view of a larger buffer, say one all-reduced with the update
    directions), else a new one."""
    f0 = pairs[0][0]
    cuda = f0.is_cuda
    p = stats_partials(pairs)
    if out is not None and (tuple(out.shape) != (len(pairs), p, 5) or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"stats_into: out must be a contiguous float32 tensor of shape {[len(pairs), p, 5]}, got "
                         f"{out.dtype} {list(out.shape)}")
    if len(pairs) > _MAX_PAIRS:
        part = torch.zeros(len(pairs), p, 5, dtype=torch.float32, device=f0.device) if out is None else out.zero_()
        for i, (f, t, e, scale) in enumerate(pairs):
            layer_stats_into(part[i], f, t, e, scale)
        return part
    part = torch.empty(len(pairs), p, 5, dtype=torch.float32, device=f0.device) if out is None else out
    block = max(elementwise_settings(max(f.numel(), e.numel() if e is not None else 0), cuda)[0] for f, _, e, _ in pairs)
    num_warps = elementwise_settings(1 << 20, cuda)[1]
    args, extra_mask, grad_mask, same_mask = [], 0, 0, 0
    for j in range(_MAX_PAIRS):
        f, t, e, scale = pairs[j] if j < len(pairs) else (f0, None, None, None)
        args += [f, f if t is None else t, f if e is None else e, f.numel(), e.numel() if e is not None else 0, float(scale or 0.0)]
        if j < len(pairs):
            extra_mask |= (e is not None) << j
            grad_mask |= (scale is not None and t is not None) << j
            same_mask |= (t is None) << j
    _stats_pairs_kernel[(p, len(pairs))](
        part, p, *args, NP=len(pairs), BLOCK=block, EXTRA=extra_mask, GRAD=grad_mask, SAME=same_mask, num_warps=num_warps,
    )
    return part


# ------------------------------------------------------------------------------ 3. the rules
def _layer_sums(part: Tensor, layers: int) -> Tensor:
    """``[layers, 5]`` float64 sums of a ``[layers, P, 5]`` partial buffer."""
    return part[:layers].double().sum(1)


def _segments(per_layer: Tensor, seg_layer: Tensor) -> Tensor:
    return per_layer.index_select(0, seg_layer)


def tp_rule_ref(
    part: Tensor, widths: Tensor, consts: Tensor, budgets: Tensor, depth: Tensor, weighted: Tensor, status: Tensor,
    found_inf: Tensor, lr: Tensor, grad_scale: Tensor | None, correct: Tensor | None, rows: int, seg_layer: Tensor,
    trainable: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``tp_rule_`` (TargetProp's device-step rule, as ``TargetPropTrainer.device_step``
    writes it in torch ops): updates ``budgets`` in place; returns ``(a, c, apply)`` per parameter
    segment and the log row ``[mean budget, mean gap, gated layers, accuracy]`` (float64).
    ``consts = [gate_threshold, momentum]`` (float64); a layer's output has ``rows × widths[l]``
    elements."""
    n = budgets.numel()
    gate, mu = consts[0], consts[1]
    s = _layer_sums(part, n)
    dot, f_mag, b_mag, sq = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
    both = (f_mag > 0) & (b_mag > 0)
    cosine = dot / torch.where(both, f_mag.sqrt() * b_mag.sqrt(), 1.0)
    measured = (status == 0) | (status == 2)
    new = torch.where(both & measured, ((cosine + 1.0) / 2.0).clamp(0.0, 1.0), budgets)
    budgets.copy_(new)
    gaps = (sq / (widths * rows).clamp_min(1.0)).sqrt()
    open_gate = new >= gate
    rates = lr.double().reshape(()) * (0.5 + 0.5 * new) * depth
    if grad_scale is not None:
        rates = rates * grad_scale.double()
    ok = found_inf.reshape(()) == 0
    a = torch.zeros_like(rates) + mu
    c = (1.0 - mu) * rates
    apply = (ok & open_gate).index_select(0, seg_layer) & (trainable != 0)
    acc = correct.double().sum() / rows if correct is not None else torch.full((), math.nan, dtype=torch.float64, device=part.device)
    log = torch.stack([new.mean(), gaps.mean(), (weighted & ~open_gate).double().sum(), acc])
    return _segments(a, seg_layer), _segments(c, seg_layer), apply.to(torch.int8), log


@jit
def _layer_vectors(part_ptr, P, LP: tl.constexpr, L, BLOCK_P: tl.constexpr):
    """The five ``[LP]`` float64 sums of a ``[L, P, 5]`` float32 partial buffer (rows beyond ``L``: 0)."""
    lidx = tl.arange(0, LP)
    pidx = tl.arange(0, BLOCK_P)
    s0 = tl.zeros([LP], dtype=tl.float64)
    s1 = tl.zeros([LP], dtype=tl.float64)
    s2 = tl.zeros([LP], dtype=tl.float64)
    s3 = tl.zeros([LP], dtype=tl.float64)
    s4 = tl.zeros([LP], dtype=tl.float64)
    for start in range(0, P, BLOCK_P):
        p = start + pidx
        m = (lidx[:, None] < L) & (p[None, :] < P)
        base = part_ptr + (lidx[:, None].to(tl.int64) * P + p[None, :]) * 5
        s0 += tl.sum(tl.load(base + 0, mask=m, other=0.0).to(tl.float64), axis=1)
        s1 += tl.sum(tl.load(base + 1, mask=m, other=0.0).to(tl.float64), axis=1)
        s2 += tl.sum(tl.load(base + 2, mask=m, other=0.0).to(tl.float64), axis=1)
        s3 += tl.sum(tl.load(base + 3, mask=m, other=0.0).to(tl.float64), axis=1)
        s4 += tl.sum(tl.load(base + 4, mask=m, other=0.0).to(tl.float64), axis=1)
    return s0, s1, s2, s3, s4


@jit
def _to_segments(v, seg_layer, LP: tl.constexpr):
    """``v[seg_layer]`` for an ``[LP]`` register vector: a one-hot select (no gather from registers)."""
    lidx = tl.arange(0, LP)
    hit = seg_layer[:, None] == lidx[None, :]
    return tl.sum(tl.where(hit, v[None, :], 0.0), axis=1)


@jit
def _sum_partials(ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, n, BLOCK):
        acc += tl.load(ptr + start + cols, mask=start + cols < n, other=0.0).to(tl.float64)
    return tl.sum(acc, axis=0)


@jit
def _tp_rule_kernel(
    a_ptr, c_ptr, apply_ptr, log_ptr, budgets_ptr,  # written (budgets: read and written)
    part_ptr, P, widths_ptr, consts_ptr, depth_ptr, weighted_ptr, status_ptr, found_inf_ptr, lr_ptr, scale_ptr,
    correct_ptr, n_correct, rows, seg_layer_ptr, trainable_ptr, L, S,
    LP: tl.constexpr, SP: tl.constexpr, BLOCK_P: tl.constexpr, CLIP: tl.constexpr, LABELS: tl.constexpr,
):
    dot, f_mag, b_mag, sq, _unused = _layer_vectors(part_ptr, P, LP, L, BLOCK_P)
    gate = tl.load(consts_ptr + 0)
    mu = tl.load(consts_ptr + 1)
    lidx = tl.arange(0, LP)
    lm = lidx < L
    old = tl.load(budgets_ptr + lidx, mask=lm, other=0.0)
    both = (f_mag > 0) & (b_mag > 0)
    cosine = dot / tl.where(both, tl.sqrt(f_mag) * tl.sqrt(b_mag), 1.0)
    status = tl.load(status_ptr)
    measured = (status == 0) | (status == 2)
    cos01 = (cosine + 1.0) / 2.0
    cos01 = tl.where(cos01 < 0.0, 0.0, tl.where(cos01 > 1.0, 1.0, cos01))
    new = tl.where(both & measured & (cos01 == cos01), cos01, old)  # a NaN cosine measures nothing
    tl.store(budgets_ptr + lidx, new, mask=lm)
    numel = tl.load(widths_ptr + lidx, mask=lm, other=1.0) * rows
    gaps = tl.sqrt(sq / tl.maximum(numel, 1.0))
    open_gate = new >= gate
    lr = tl.load(lr_ptr).to(tl.float64)
    depth = tl.load(depth_ptr + lidx, mask=lm, other=0.0)
    rates = lr * (0.5 + 0.5 * new) * depth
    if CLIP:
        rates = rates * tl.load(scale_ptr).to(tl.float64)
    ok = tl.load(found_inf_ptr) == 0
    weighted = tl.load(weighted_ptr + lidx, mask=lm, other=0) != 0
    sidx = tl.arange(0, SP)
    sm = sidx < S
    seg = tl.load(seg_layer_ptr + sidx, mask=sm, other=0)
    tl.store(a_ptr + sidx, tl.zeros([SP], dtype=tl.float64) + mu, mask=sm)
    tl.store(c_ptr + sidx, _to_segments((1.0 - mu) * rates, seg, LP), mask=sm)
    on_layer = tl.where(open_gate, 1.0, 0.0).to(tl.float64) * tl.where(ok, 1.0, 0.0)
    on = _to_segments(on_layer, seg, LP) > 0.5
    trainable = tl.load(trainable_ptr + sidx, mask=sm, other=0) != 0
    tl.store(apply_ptr + sidx, tl.where(on & trainable, 1, 0).to(tl.int8), mask=sm)
    tl.store(log_ptr + 0, tl.sum(tl.where(lm, new, 0.0), axis=0) / L)
    tl.store(log_ptr + 1, tl.sum(tl.where(lm, gaps, 0.0), axis=0) / L)
    tl.store(log_ptr + 2, tl.sum(tl.where(lm & weighted & (~open_gate), 1.0, 0.0).to(tl.float64), axis=0))
    if LABELS:
        tl.store(log_ptr + 3, _sum_partials(correct_ptr, n_correct, 1024) / rows)
    else:
        tl.store(log_ptr + 3, float("nan"))


def _pow2(n: int) -> int:
    return max(1 << max(n - 1, 0).bit_length(), 2)


def tp_rule_(
    part: Tensor, widths: Tensor, consts: Tensor, budgets: Tensor, depth: Tensor, weighted: Tensor, status: Tensor,
    found_inf: Tensor, lr: Tensor, grad_scale: Tensor | None, correct: Tensor | None, rows: int, seg_layer: Tensor,
    trainable: Tensor, log_row: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """One launch: ``tp_rule_ref``'s outputs, ``(a, c, apply)`` returned and the log row written into
    ``log_row`` (4 float64). ``part``: ``[L, P, 5]`` float32; ``widths``, ``consts``, ``depth``,
    ``budgets``: float64; ``lr``: a one-element tensor; ``weighted``, ``trainable``: bool/int8;
    ``correct``: per-row (or already summed) correct counts, float32, whose sum over ``rows`` rows is
    the accuracy."""
    n, p = budgets.numel(), part.shape[1]
    s = seg_layer.numel()
    a = torch.empty(s, dtype=torch.float64, device=part.device)
    c = torch.empty_like(a)
    apply = torch.empty(s, dtype=torch.int8, device=part.device)
    _tp_rule_kernel[(1,)](
        a, c, apply, log_row, budgets, part, p, widths, consts, depth, weighted, status, found_inf, lr,
        grad_scale if grad_scale is not None else lr, correct if correct is not None else lr,
        correct.numel() if correct is not None else 0, rows, seg_layer, trainable, n, s,
        LP=_pow2(n), SP=_pow2(s), BLOCK_P=min(_pow2(p), 64), CLIP=grad_scale is not None, LABELS=correct is not None,
        num_warps=4,
    )
    return a, c, apply


# --------------------------------------------------------------------------------- Tweening
def tween_metrics_ref(part: Tensor, widths: Tensor, rows: int) -> Tensor:
    """``[L, 3]`` float64 per layer ``[gap, link budget, alignment]`` (``TweenTrainer._fused_metrics``'s
    math) from the ``[L + 1, P, 5]`` partials: row 0 the input's (``layer_stats_into(part[0], x,
    None)``: its ``Σ f²`` is ``Σ x²``), row ``i + 1`` layer ``i``'s ``(ŷ or output, target, output)``
    statistics. ``widths``: ``[L + 1]`` float64, the input's width then each layer's output width."""
    n = widths.numel() - 1
    s = part.double().sum(1)
    dot, ff, tt, dd, out_sq = s[1:].unbind(1)
    in_sq = torch.cat([s[:1, 1], s[1:n, 4]])
    numel = (widths * rows).clamp_min(1.0)
    numel_in, numel_f = numel[:n], numel[1:]
    gap = dd / numel_f
    rms_in = (in_sq / numel_in).sqrt()
    rms_out = (out_sq / numel_f).sqrt()
    budget = torch.where(rms_in > 0, rms_out / torch.where(rms_in > 0, rms_in, 1.0), 0.0)
    nf, nt = ff.sqrt(), tt.sqrt()
    both = (nf > 0) & (nt > 0)
    align = torch.where(both, (dot / torch.where(both, nf * nt, 1.0) + 1) / 2, 0.5)
    return torch.stack([gap, budget, align], dim=1)


@jit
def _tween_rule_kernel(
    a_ptr, c_ptr, apply_ptr, log_ptr, metrics_ptr, state_ptr,  # written (state: read and written)
    part_ptr, P, widths_ptr, consts_ptr, scales_ptr, rule_c_ptr, lr_ptr, scale_ptr, found_inf_ptr, rows,
    seg_layer_ptr, trainable_ptr, L, S,
    LP: tl.constexpr, SP: tl.constexpr, BLOCK_P: tl.constexpr, CLIP: tl.constexpr,
):
    dot, ff, tt, dd, out_sq = _layer_vectors(part_ptr + P * 5, P, LP, L, BLOCK_P)  # rows 1..L: the layers
    _a, x_sq, _c, _d, below_sq = _layer_vectors(part_ptr, P, LP, L, BLOCK_P)  # rows 0..L−1: each layer's input
    lidx = tl.arange(0, LP)
    lm = lidx < L
    in_sq = tl.where(lidx == 0, x_sq, below_sq)  # the input's Σ x² is its row's Σ f²
    numel_in = tl.maximum(tl.load(widths_ptr + lidx, mask=lm, other=1.0) * rows, 1.0)
    numel_f = tl.maximum(tl.load(widths_ptr + 1 + lidx, mask=lm, other=1.0) * rows, 1.0)
    gap = dd / numel_f
    rms_in = tl.sqrt(in_sq / numel_in)
    rms_out = tl.sqrt(out_sq / numel_f)
    budget = tl.where(rms_in > 0, rms_out / tl.where(rms_in > 0, rms_in, 1.0), 0.0)
    nf = tl.sqrt(ff)
    nt = tl.sqrt(tt)
    both = (nf > 0) & (nt > 0)
    align = tl.where(both, (dot / tl.where(both, nf * nt, 1.0) + 1) / 2, 0.5)
    tl.store(metrics_ptr + lidx * 3 + 0, gap, mask=lm)
    tl.store(metrics_ptr + lidx * 3 + 1, budget, mask=lm)
    tl.store(metrics_ptr + lidx * 3 + 2, align, mask=lm)
    avg_gap = tl.sum(tl.where(lm, gap, 0.0), axis=0) / L
    ok = tl.load(found_inf_ptr) == 0
    base = tl.load(lr_ptr).to(tl.float64)
    exploded, rate, baseline, count = rule_body(state_ptr, avg_gap, base, ok, rule_c_ptr)
    s_link = tl.load(consts_ptr + 0)
    decay = tl.load(consts_ptr + 1)
    scales = tl.load(scales_ptr + lidx, mask=lm, other=0.0)
    rates = rate * (1.0 - s_link / 2 + s_link / 2 * align) * scales
    if CLIP:
        rates = rates * tl.load(scale_ptr).to(tl.float64)
    keep = tl.where(exploded, 0.0, 1.0) * decay
    sidx = tl.arange(0, SP)
    sm = sidx < S
    seg = tl.load(seg_layer_ptr + sidx, mask=sm, other=0)
    tl.store(a_ptr + sidx, tl.zeros([SP], dtype=tl.float64) + keep, mask=sm)
    tl.store(c_ptr + sidx, -_to_segments(rates, seg, LP) / rows, mask=sm)
    trainable = tl.load(trainable_ptr + sidx, mask=sm, other=0) != 0
    tl.store(apply_ptr + sidx, tl.where(trainable, 1, 0).to(tl.int8) * tl.where(ok, 1, 0).to(tl.int8), mask=sm)
    tl.store(log_ptr + 0, avg_gap)
    tl.store(log_ptr + 1, tl.sum(tl.where(lm, budget, 0.0), axis=0) / L)
    tl.store(log_ptr + 2, tl.where(exploded, 1.0, 0.0).to(tl.float64))
    tl.store(log_ptr + 3, rate)
    tl.store(log_ptr + 4, baseline)
    tl.store(log_ptr + 5, count)


def tween_rule_(
    part: Tensor, widths: Tensor, consts: Tensor, scales: Tensor, state: Tensor, rule_constants: Tensor,
    lr: Tensor, grad_scale: Tensor | None, found_inf: Tensor, rows: int, seg_layer: Tensor, trainable: Tensor,
    log_row: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One launch: Tween's metrics (``tween_metrics_ref``, same ``part`` and ``widths``), its mean gap through the explosion rule
    (``state``, ``rule_constants``: ``kernels.explosion_rule``'s, updated in place, masked by
    ``found_inf``), the rates ``adaptive_rate·(1 − s/2 + s/2·alignment)·depth_scale`` (``consts =
    [link_budget_scale, momentum_decay]``), and ``momentum_update_flat_``'s ``(a, c, apply)`` per
    parameter segment: ``a = momentum_decay`` (0 after an explosion), ``c = −rate/rows``, ``apply`` =
    step ok and trainable. Writes ``log_row`` (6 float64, ``TweenTrainer.device_log_names``) and
    returns ``(a, c, apply, metrics [L, 3])``."""
    n, p = widths.numel() - 1, part.shape[1]
    s = seg_layer.numel()
    a = torch.empty(s, dtype=torch.float64, device=part.device)
    c = torch.empty_like(a)
    apply = torch.empty(s, dtype=torch.int8, device=part.device)
    metrics = torch.empty(n, 3, dtype=torch.float64, device=part.device)
    # no FMA contraction: the explosion rule's roundings as its reference's (see kernels/explosion_rule.py)
    _tween_rule_kernel[(1,)](
        a, c, apply, log_row, metrics, state, part, p, widths, consts, scales, rule_constants, lr,
        grad_scale if grad_scale is not None else lr, found_inf, rows, seg_layer, trainable, n, s,
        LP=_pow2(n), SP=_pow2(s), BLOCK_P=min(_pow2(p), 64), CLIP=grad_scale is not None, num_warps=4,
        enable_fp_fusion=False,
    )
    return a, c, apply, metrics
