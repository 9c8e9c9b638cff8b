"""The low-bit weight update of every grid-dtype layer of a model in two launches (``lowbit/fused.py``).

The parameters of all layers (``groups``) that train in a grid dtype (int16, int8, uint16, uint8,
int4, uint4, int2, uint2, ternary) with one scale per layer lie back to back in flat buffers: ``P``
(what the parameters hold after the method's update, gathered by one copy), ``B`` (what they held
before it), ``M`` (the float32 master, absent with ``master="none"``) and ``S`` (one scale per
group). One step, as ``lowbit/weights.py``'s reference computes it group by group::

    ok     = status == 0                                  # the step guard's verdict (host loop: true)
    M     += ok ? P − B : 0                               # the master takes the update
    x      = M  (or P without a master)
    s      = max|x_g| / qmax_g   (mean|x_g| / qmax_g: ternary, int2, uint2)   per group g; 0 → 1
             int4 / uint4: of s·r, r ∈ ratios, the one with the least Σ(Q(x) − x)² over every
             stride-th value of the group (``codec._least_squares_clip``)
    s      = fixed_g ? S_g : (ok ? s : S_g);  S_g = s
    q      = clamp(round(x / s), lo_g, hi_g)              # nearest (half to even) or stochastic
    B      = ok ? q · s : P                               # the new parameters (and the next "before")

Stochastic rounding draws ``lowbit/rng.py``'s bits keyed by ``(seed, step, parameter index)``, the
keys computed in the kernel from the 0-d int64 step counter, so nothing is read on the host and a
CUDA graph can hold the step. With ``advance``, the first launch also moves the device step counter
on by one unless the step did not run (status 3), after noting the step this update draws with.

Launch 1 (``_reduce_kernel``) updates the master and writes each block's max|x| and Σ|x|; launch 2
(``_apply_kernel``) sums its group's block partials into the scale and requantises its block. A
block never straddles two parameters. Σ|x| (the mean scale) and the clipping errors are summed in
another order than torch's: bit for bit equal to the reference when those sums are exact (the
max-scaled dtypes always), else equal up to float32 rounding of the sums. The products are rounded
as torch rounds them (no fused multiply-add).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._counter import U_BITS, draw_bits, seed_key, stream_key
from ._tl import jit, tl
from ._triton import exact_div, use_triton
from .requant import _mix32

__all__ = ["GridLayout", "grid_layout", "requant_groups_ref", "requant_groups_", "MODE_MAX", "MODE_MEAN", "MODE_CLIP"]

MODE_MAX, MODE_MEAN, MODE_CLIP = 0, 1, 2  # how a group's scale is found
_CUDA_BLOCK = 1024
_INTERPRETER_BLOCK = 64  # small blocks: the tests' small layers still span several programs


@dataclass
class GridLayout:
    """Where each group's parameters lie in the flat buffers, and the launch tables.

    ``groups``: per group ``dict(start, n, params=[(offset, numel, index)], lo, hi, qmax, mode, fixed,
    stride, count)``; ``prog`` int64 ``[programs, 8]``: (block start in its parameter, parameter
    offset, parameter numel, parameter index, group, 0, 0, 0); ``gi`` int64 ``[G, 8]``: (start, n,
    first program, end program, mode, fixed, stride, count); ``gf`` float32 ``[G, 4]``: (qmax, lo,
    hi, 0); ``key`` int64 ``[1]``: the seed's key; ``ratios`` float32 ``[R]``: the clipping ratios."""

    groups: list[dict]
    n: int
    block: int
    seed: int
    prog: Tensor
    gi: Tensor
    gf: Tensor
    key: Tensor
    ratios: Tensor
    pmax: Tensor
    psum: Tensor
    step_used: Tensor


def grid_layout(groups: list[dict], seed: int, ratios: Tensor, device: torch.device, block: int | None = None) -> GridLayout:
    """The ``GridLayout`` of ``groups`` (each ``dict(numels=[...], indices=[...], lo, hi, qmax, mode,
    fixed, sample)``: its parameters' sizes and indices in ``model.parameters()`` order, its code
    range, the scale rule and, for ``MODE_CLIP``, how many values the error is measured on); the
    groups' parameters are laid out back to back in this order."""
    device = torch.device(device)
    if block is None:
        block = _CUDA_BLOCK if device.type == "cuda" else _INTERPRETER_BLOCK
    out, prog, gi, gf, at = [], [], [], [], 0
    for g, spec in enumerate(groups):
        start, plo, params = at, len(prog), []
        for numel, index in zip(spec["numels"], spec["indices"]):
            params.append((at, numel, index))
            for b in range(0, max(numel, 1), block):
                prog.append([b, at, numel, index, g, 0, 0, 0])
            at += numel
        n = at - start
        sample = int(spec.get("sample", n))
        stride = n // sample if n > sample else 1  # codec._least_squares_clip's xs[:, ::stride]
        count = -(-n // stride)
        row = dict(start=start, n=n, params=params, lo=int(spec["lo"]), hi=int(spec["hi"]), qmax=float(spec["qmax"]),
                   mode=int(spec["mode"]), fixed=bool(spec["fixed"]), stride=stride, count=count)
        out.append(row)
        gi.append([start, n, plo, len(prog), row["mode"], int(row["fixed"]), stride, count])
        gf.append([row["qmax"], float(row["lo"]), float(row["hi"]), 0.0])
    i64 = dict(dtype=torch.int64, device=device)
    return GridLayout(
        out, at, block, seed, torch.tensor(prog, **i64).reshape(-1, 8), torch.tensor(gi, **i64).reshape(-1, 8),
        torch.tensor(gf, dtype=torch.float32, device=device).reshape(-1, 4), torch.tensor([seed_key(seed)], **i64),
        ratios.to(device=device, dtype=torch.float32), torch.zeros(len(prog), dtype=torch.float32, device=device),
        torch.zeros(len(prog), dtype=torch.float32, device=device), torch.zeros((), **i64),
    )


# ------------------------------------------------------------------------------------ reference
def _round(y: Tensor, u: Tensor | None) -> Tensor:
    if u is None:
        return torch.round(y)
    f = torch.floor(y)
    return f + (u < (y - f)).to(torch.float32)


@torch.no_grad()
def requant_groups_ref(layout: GridLayout, M: Tensor | None, P: Tensor, B: Tensor, S: Tensor, step: Tensor,
                       status: Tensor | None, stochastic: bool, advance: bool) -> None:
    """The update of the module docstring in torch ops, group by group (the spec of the kernels)."""
    ok = torch.ones((), dtype=torch.bool, device=P.device) if status is None else status == 0
    used = step
    if advance:
        used = layout.step_used
        used.copy_(step)
        step.add_((status != 3).to(torch.int64))
    for g, grp in enumerate(layout.groups):
        sl = slice(grp["start"], grp["start"] + grp["n"])
        if M is not None:
            M[sl].add_(torch.where(ok, P[sl] - B[sl], torch.zeros_like(P[sl])))
        x = (M if M is not None else P)[sl]
        if grp["fixed"]:
            s = S[g]
        else:
            a = x.abs()
            m = exact_div(a.sum(), a.numel()) if grp["mode"] == MODE_MEAN else a.amax()  # as the kernel's div_rn
            s = exact_div(m, grp["qmax"])
            s = torch.where(s > 0, s, torch.ones_like(s))
            if grp["mode"] == MODE_CLIP:
                cand = s * layout.ratios
                xs = x[:: grp["stride"]]
                q = torch.round(xs / cand[:, None]).clamp(grp["lo"], grp["hi"]) * cand[:, None]
                s = cand[((q - xs) ** 2).sum(1).argmin()]
            s = torch.where(ok, s, S[g])
        out = []
        for off, numel, index in grp["params"]:
            xp = x[off - grp["start"]: off - grp["start"] + numel]
            u = None
            if stochastic:
                ka, kb = stream_key(layout.seed, used, index)
                i = torch.arange(numel, dtype=torch.int64, device=P.device)
                u = draw_bits(i, ka, kb).to(torch.float32) * (2.0 ** -U_BITS)
            q = _round(xp / s, u).clamp(grp["lo"], grp["hi"]).to(torch.int64)  # an integer code: no −0
            out.append(q.to(torch.float32) * s)
        B[sl].copy_(torch.where(ok, torch.cat(out), P[sl]))
        S[g].copy_(s)


# --------------------------------------------------------------------------------------- kernels
@jit
def _reduce_kernel(
    prog_ptr, M_ptr, P_ptr, B_ptr, pmax_ptr, psum_ptr, status_ptr, step_ptr, used_ptr,
    BLOCK: tl.constexpr, HAS_MASTER: tl.constexpr, HAS_STATUS: tl.constexpr, ADVANCE: tl.constexpr,
):
    pid = tl.program_id(0)
    row = prog_ptr + pid * 8
    start = tl.load(row)
    off = tl.load(row + 1)
    n = tl.load(row + 2)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    flat = off + offs
    if HAS_STATUS:
        ok = tl.load(status_ptr) == 0
    else:
        ok = pid >= 0  # true, as a tensor
    if HAS_MASTER:
        m = tl.load(M_ptr + flat, mask=mask, other=0.0)
        p = tl.load(P_ptr + flat, mask=mask, other=0.0)
        b = tl.load(B_ptr + flat, mask=mask, other=0.0)
        m = m + tl.where(ok, p - b, 0.0)
        tl.store(M_ptr + flat, m, mask=mask)
        x = m
    else:
        x = tl.load(P_ptr + flat, mask=mask, other=0.0)
    a = tl.where(mask, tl.abs(x), 0.0)
    tl.store(pmax_ptr + pid, tl.max(a, axis=0))
    tl.store(psum_ptr + pid, tl.sum(a, axis=0))
    if ADVANCE:
        if pid == 0:
            s = tl.load(step_ptr)
            tl.store(used_ptr, s)
            tl.store(step_ptr, s + (tl.load(status_ptr) != 3).to(tl.int64))


@jit
def _round_half_even(y):
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@jit
def _apply_kernel(
    prog_ptr, gi_ptr, gf_ptr, key_ptr, ratios_ptr, X_ptr, P_ptr, B_ptr, S_ptr, pmax_ptr, psum_ptr, status_ptr, used_ptr,
    BLOCK: tl.constexpr, RBLOCK: tl.constexpr, SBLOCK: tl.constexpr, N_RATIOS: tl.constexpr,
    HAS_STATUS: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    pid = tl.program_id(0)
    row = prog_ptr + pid * 8
    start = tl.load(row)
    off = tl.load(row + 1)
    n = tl.load(row + 2)
    index = tl.load(row + 3)
    g = tl.load(row + 4)
    grow = gi_ptr + g * 8
    qmax = tl.load(gf_ptr + g * 4)
    lo = tl.load(gf_ptr + g * 4 + 1)
    hi = tl.load(gf_ptr + g * 4 + 2)
    mode = tl.load(grow + 4)
    if HAS_STATUS:
        ok = tl.load(status_ptr) == 0
    else:
        ok = pid >= 0  # true, as a tensor
    s_old = tl.load(S_ptr + g)
    s = s_old
    if tl.load(grow + 5) == 0:  # not a fixed scale: this step's, from the group's block partials
        plo = tl.load(grow + 2)
        phi = tl.load(grow + 3)
        mxv = tl.zeros([RBLOCK], dtype=tl.float32)
        smv = tl.zeros([RBLOCK], dtype=tl.float32)
        for r0 in range(plo, phi, RBLOCK):
            ids = r0 + tl.arange(0, RBLOCK)
            rm = ids < phi
            mxv = tl.maximum(mxv, tl.load(pmax_ptr + ids, mask=rm, other=0.0))
            smv += tl.load(psum_ptr + ids, mask=rm, other=0.0)
        mx = tl.max(mxv, axis=0)
        sm = tl.sum(smv, axis=0)
        gn = tl.load(grow + 1)
        m = tl.where(mode == 1, tl.math.div_rn(sm, gn.to(tl.float32)), mx)
        s_new = tl.math.div_rn(m, qmax)
        s_new = tl.where(s_new > 0.0, s_new, 1.0)
        if mode == 2:  # the clipping scale with the least squared rounding error on the sample
            gstart = tl.load(grow)
            stride = tl.load(grow + 6)
            count = tl.load(grow + 7)
            for r in tl.static_range(N_RATIOS):
                c = s_new * tl.load(ratios_ptr + r)
                errv = tl.zeros([SBLOCK], dtype=tl.float32)
                for j0 in range(0, count, SBLOCK):
                    j = j0 + tl.arange(0, SBLOCK).to(tl.int64)
                    jm = j < count
                    xs = tl.load(X_ptr + gstart + j * stride, mask=jm, other=0.0)
                    q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(xs, c)), lo), hi)
                    e = q * c - xs
                    errv += tl.where(jm, e * e, 0.0)
                err = tl.sum(errv, axis=0)
                if r == 0:
                    best = err
                    best_c = c
                else:  # the first of equal errors wins, as torch's argmin
                    better = err < best
                    best_c = tl.where(better, c, best_c)
                    best = tl.where(better, err, best)
            s_new = best_c
        s = tl.where(ok, s_new, s_old)
        if ok:
            if pid == plo:
                tl.store(S_ptr + g, s)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    flat = off + offs
    x = tl.load(X_ptr + flat, mask=mask, other=0.0)
    p = tl.load(P_ptr + flat, mask=mask, other=0.0)
    y = tl.math.div_rn(x, s)
    if STOCHASTIC:
        step = tl.load(used_ptr)
        k = _mix32((step & 0xFFFFFFFF).to(tl.uint32) ^ tl.load(key_ptr).to(tl.uint32))
        k = _mix32(((step >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ k)
        a = _mix32((k ^ (index & 0xFFFFFFFF).to(tl.uint32)).to(tl.uint32))
        b = _mix32((a ^ 0x85EBCA6B).to(tl.uint32))
        h = _mix32((offs & 0xFFFFFFFF).to(tl.uint32) + a)
        h = _mix32((h ^ b ^ (offs >> 32).to(tl.uint32)).to(tl.uint32))
        u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
        f = tl.floor(y)
        q = f + tl.where(u < y - f, 1.0, 0.0)
    else:
        q = _round_half_even(y)
    q = tl.minimum(tl.maximum(q, lo), hi)
    tl.store(B_ptr + flat, tl.where(ok, q * s, p), mask=mask)


@torch.no_grad()
def requant_groups_(layout: GridLayout, M: Tensor | None, P: Tensor, B: Tensor, S: Tensor, step: Tensor,
                    status: Tensor | None, stochastic: bool, advance: bool, backend: str | None = None) -> None:
    """The update of the module docstring over ``layout``'s flat float32 buffers ``M`` (or ``None``),
    ``P``, ``B`` (``[layout.n]``) and scales ``S`` (``[G]``), in place. ``step``: 0-d int64, the
    draws' step (with ``advance``: the device counter, moved on past this step unless ``status`` is
    3); ``status``: 0-d int32 (``None``: the update was kept). Triton on CUDA (or
    ``backend="triton"``), the reference otherwise."""
    if advance and status is None:
        raise ValueError("requant_groups_: advance=True needs the step's status")
    if not use_triton(P, backend, (torch.float32,)):
        requant_groups_ref(layout, M, P, B, S, step, status, stochastic, advance)
        return
    used = layout.step_used if advance else step  # the step the draws are keyed by
    programs = layout.prog.shape[0]
    has_status = status is not None
    st = status if has_status else layout.step_used  # a placeholder pointer, never read
    warps = 4 if P.is_cuda else 1
    _reduce_kernel[(programs,)](
        layout.prog, M if M is not None else P, P, B, layout.pmax, layout.psum, st, step, used,
        BLOCK=layout.block, HAS_MASTER=M is not None, HAS_STATUS=has_status, ADVANCE=advance, num_warps=warps,
    )
    _apply_kernel[(programs,)](
        layout.prog, layout.gi, layout.gf, layout.key, layout.ratios, M if M is not None else P, P, B, S,
        layout.pmax, layout.psum, st, used,
        BLOCK=layout.block, RBLOCK=128 if P.is_cuda else 16, SBLOCK=1024 if P.is_cuda else 64,
        N_RATIOS=layout.ratios.numel(), HAS_STATUS=has_status, STOCHASTIC=stochastic, num_warps=warps,
        enable_fp_fusion=False,  # q·c − x and (q·c − x)² rounded as torch rounds them, no FMA
    )
