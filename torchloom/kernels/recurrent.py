"""Fused LSTM cell step, forward and backward: the gate non-linearities and the cell update of one time
step in one kernel each (the recurrent product ``h_{t−1} W_hhᵀ`` stays a cuBLAS call in the layer's
time loop).

Gate pre-activations ``pre [B, 4H]`` (blocks i, f, g, o; any row stride, so a time step's view of a
``[B, T, 4H]`` buffer works), cell and hidden states ``[B, H]`` (any row stride).

Forward::

    i, f, o = σ(pre_i), σ(pre_f), σ(pre_o);   g = tanh(pre_g)
    c_t = f ⊙ c_{t−1} + i ⊙ g;   h_t = o ⊙ tanh(c_t)          (c_{t−1} = 0 at the first step)

Backward, with ``dh_t`` (gOut_t + gPre_{t+1} W_hh) and the carry ``κ_{t+1} = dc_{t+1} ⊙ f_{t+1}``
(zero after the last step)::

    dc_t  = κ_{t+1} + dh_t ⊙ o ⊙ (1 − tanh² c_t)
    gPre_t = [dc_t ⊙ g ⊙ i(1−i),  dc_t ⊙ c_{t−1} ⊙ f(1−f),  dc_t ⊙ i ⊙ (1−g²),  dh_t ⊙ tanh c_t ⊙ o(1−o)]
    κ_t   = dc_t ⊙ f                                       (written over κ_{t+1}, in place)

Everything is computed in float32 and stored in the tensors' dtype. ``*_ref`` are the PyTorch
references (CPU, float64, and the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import KERNEL_DTYPES, use_triton

__all__ = ["lstm_cell", "lstm_cell_backward", "lstm_cell_ref", "lstm_cell_backward_ref"]


@jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@jit
def _tanh(x):
    # tanh(x) = 2σ(2x) − 1, stable at both ends in float32
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@jit
def _gates(p, H, m):
    """The four gates of one step from the pre-activations ``[i | f | g | o]`` at ``p`` (float32)."""
    i = _sigmoid(tl.load(p, mask=m, other=0.0).to(tl.float32))
    f = _sigmoid(tl.load(p + H, mask=m, other=0.0).to(tl.float32))
    g = _tanh(tl.load(p + 2 * H, mask=m, other=0.0).to(tl.float32))
    o = _sigmoid(tl.load(p + 3 * H, mask=m, other=0.0).to(tl.float32))
    return i, f, g, o


@jit
def _lstm_fwd_kernel(
    PRE, C_PREV, C, Hh, s_pre, s_cp, s_c, s_h, H,
    HAS_PREV: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    i, f, g, o = _gates(PRE + row * s_pre + cols, H, m)
    c = i * g
    if HAS_PREV:
        c += f * tl.load(C_PREV + row * s_cp + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(C + row * s_c + cols, c.to(C.dtype.element_ty), mask=m)
    tl.store(Hh + row * s_h + cols, (o * _tanh(c)).to(Hh.dtype.element_ty), mask=m)


@jit
def _lstm_bwd_kernel(
    PRE, C, C_PREV, DH, KAPPA, GPRE, s_pre, s_c, s_cp, s_dh, s_k, s_g, H,
    HAS_PREV: tl.constexpr, HAS_KAPPA: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    i, f, g, o = _gates(PRE + row * s_pre + cols, H, m)
    tc = _tanh(tl.load(C + row * s_c + cols, mask=m, other=0.0).to(tl.float32))
    dh = tl.load(DH + row * s_dh + cols, mask=m, other=0.0).to(tl.float32)
    dc = dh * o * (1.0 - tc * tc)
    if HAS_KAPPA:
        dc += tl.load(KAPPA + row * s_k + cols, mask=m, other=0.0).to(tl.float32)
    cp = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_PREV:
        cp = tl.load(C_PREV + row * s_cp + cols, mask=m, other=0.0).to(tl.float32)
    gp = GPRE + row * s_g + cols
    ty = GPRE.dtype.element_ty
    tl.store(gp, (dc * g * i * (1.0 - i)).to(ty), mask=m)
    tl.store(gp + H, (dc * cp * f * (1.0 - f)).to(ty), mask=m)
    tl.store(gp + 2 * H, (dc * i * (1.0 - g * g)).to(ty), mask=m)
    tl.store(gp + 3 * H, (dh * tc * o * (1.0 - o)).to(ty), mask=m)
    tl.store(KAPPA + row * s_k + cols, (dc * f).to(KAPPA.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------- references
def lstm_cell_ref(pre: Tensor, c_prev: Tensor | None, c_out: Tensor, h_out: Tensor) -> None:
    """Reference forward step: writes ``c_t`` into ``c_out`` and ``h_t`` into ``h_out``."""
    hsz = c_out.shape[-1]
    act = torch.sigmoid(pre)
    i, f, o = act[:, :hsz], act[:, hsz : 2 * hsz], act[:, 3 * hsz :]
    g = torch.tanh(pre[:, 2 * hsz : 3 * hsz])
    c = i * g if c_prev is None else torch.addcmul(i * g, f, c_prev)
    c_out.copy_(c)
    torch.mul(o, torch.tanh(c), out=h_out)


def lstm_cell_backward_ref(
    pre: Tensor, c: Tensor, c_prev: Tensor | None, dh: Tensor, kappa: Tensor, g_pre: Tensor, has_kappa: bool
) -> None:
    """Reference backward step: writes ``gPre_t`` into ``g_pre`` and ``κ_t`` over ``kappa``."""
    hsz = c.shape[-1]
    act = torch.sigmoid(pre)
    i, f, o = act[:, :hsz], act[:, hsz : 2 * hsz], act[:, 3 * hsz :]
    g = torch.tanh(pre[:, 2 * hsz : 3 * hsz])
    tc = torch.tanh(c)
    dc = dh * o * (1.0 - tc * tc)
    if has_kappa:
        dc = dc + kappa
    cp = torch.zeros_like(c) if c_prev is None else c_prev
    g_pre[:, :hsz] = dc * g * i * (1.0 - i)
    g_pre[:, hsz : 2 * hsz] = dc * cp * f * (1.0 - f)
    g_pre[:, 2 * hsz : 3 * hsz] = dc * i * (1.0 - g * g)
    g_pre[:, 3 * hsz :] = dh * tc * o * (1.0 - o)
    kappa.copy_(dc * f)


# ------------------------------------------------------------------------------------- launchers
def _block(hsz: int, is_cuda: bool) -> int:
    cap = 1024 if is_cuda else 4096
    return min(max(16, 1 << max(hsz - 1, 0).bit_length()), cap)


def lstm_cell(pre: Tensor, c_prev: Tensor | None, c_out: Tensor, h_out: Tensor, backend: str | None = None) -> None:
    """One forward step (see the module doc): ``pre [B, 4H]``, ``c_prev [B, H]`` or None (zero),
    results written into ``c_out``, ``h_out [B, H]``. The last dimension must have unit stride."""
    if not use_triton(pre, backend, KERNEL_DTYPES):
        lstm_cell_ref(pre, c_prev, c_out, h_out)
        return
    bsz, hsz = c_out.shape
    block = _block(hsz, pre.is_cuda)
    cp = c_out if c_prev is None else c_prev
    _lstm_fwd_kernel[(bsz, -(-hsz // block))](
        pre, cp, c_out, h_out, pre.stride(0), cp.stride(0), c_out.stride(0), h_out.stride(0), hsz,
        HAS_PREV=c_prev is not None, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )


def lstm_cell_backward(
    pre: Tensor, c: Tensor, c_prev: Tensor | None, dh: Tensor, kappa: Tensor, g_pre: Tensor,
    has_kappa: bool, backend: str | None = None,
) -> None:
    """One backward step (see the module doc): reads ``pre [B, 4H]``, ``c``, ``c_prev`` (None: zero),
    ``dh [B, H]`` and, when ``has_kappa``, the carry ``kappa [B, H]``; writes ``g_pre [B, 4H]`` and the
    new carry over ``kappa``. The last dimension must have unit stride."""
    if not use_triton(pre, backend, KERNEL_DTYPES):
        lstm_cell_backward_ref(pre, c, c_prev, dh, kappa, g_pre, has_kappa)
        return
    bsz, hsz = c.shape
    block = _block(hsz, pre.is_cuda)
    cp = c if c_prev is None else c_prev
    _lstm_bwd_kernel[(bsz, -(-hsz // block))](
        pre, c, cp, dh, kappa, g_pre,
        pre.stride(0), c.stride(0), cp.stride(0), dh.stride(0), kappa.stride(0), g_pre.stride(0), hsz,
        HAS_PREV=c_prev is not None, HAS_KAPPA=has_kappa, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )


# ------------------------------------------------------------------------------ CUDA-graphed loops
# The time loops launch two small kernels per step; from Python each launch costs more than the
# kernel itself at typical sizes. On CUDA the loop (cuBLAS products + fused step kernels) is captured
# once per shape into a CUDA graph over preallocated buffers and replayed: the layer copies its
# inputs into the buffers, replays, and copies the results out (a few bandwidth-bound copies).
# The buffers stay allocated while the shape is cached (``graph_cache_bytes``; ``clear_graph_cache``
# frees them); at most ``_MAX_GRAPHS`` shapes are kept. Inside another CUDA-graph capture, or with
# ``USE_CUDA_GRAPHS = False``, the loop runs step by step.
import collections  # noqa: E402
from typing import Callable  # noqa: E402

USE_CUDA_GRAPHS = True
_MAX_GRAPHS = 8
_GRAPHS: collections.OrderedDict = collections.OrderedDict()


def graphs_usable(t: Tensor) -> bool:
    """True when the recurrent loops on ``t``'s device may run as CUDA graphs."""
    return USE_CUDA_GRAPHS and t.is_cuda and not torch.cuda.is_current_stream_capturing()


def graph_buffers(key: tuple, make: Callable[[], dict]) -> dict:
    """The cached entry for ``key`` (its buffers from ``make()`` and its captured graphs)."""
    entry = _GRAPHS.get(key)
    if entry is None:
        entry = {"buffers": make(), "graphs": {}}
        _GRAPHS[key] = entry
        while len(_GRAPHS) > _MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    else:
        _GRAPHS.move_to_end(key)
    return entry


def ensure_graph(entry: dict, name: str, body: Callable[[], None]):
    """The graph ``name`` of ``entry``, captured from ``body()`` on first use (after one warm-up run
    on a side stream, which compiles the kernels). Call before writing the inputs: the warm-up runs
    on the buffers."""
    g = entry["graphs"].get(name)
    if g is None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            body()
        entry["graphs"][name] = g
    return g


def graph_cache_bytes() -> int:
    """Bytes held by the cached loop buffers."""
    return sum(t.numel() * t.element_size() for e in _GRAPHS.values() for t in e["buffers"].values())


def clear_graph_cache() -> None:
    """Drop every cached graph and its buffers."""
    _GRAPHS.clear()
