"""The recurrent layers' time loops. First the fused LSTM cell step, forward and backward: the gate
non-linearities and the cell update of one time step in one kernel each (the per-step loop, beside a
cuBLAS call for the recurrent product ``h_{t−1} W_hhᵀ``).

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

Then the CUDA-graph cache of the per-step loops, the persistent Elman RNN loop and the persistent LSTM
loop: the whole forward or backward time loop of ``torchloom.layers.rnn`` / ``torchloom.layers.lstm``
in one kernel launch (their sections below), and the loops under ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor, addcmul, addmm, backends, bfloat16, cat, empty_like, float32, mm, mul, sigmoid, stack, tanh
from torch import zeros, zeros_like
from torch.compiler import is_compiling

from . import _replay
from ._launch import launch as _launch_kernel, launch_traced
from ._tl import jit, tl, triton
from ._triton import autocast_off, cublas_allows_tf32, device_index, interpreter_enabled, tf32_capable, use_kernel
from ._triton import triton_operator, use_triton
from ._triton import cudnn_rnn_allows_tf32 as _rnn_allows_tf32
from ._triton import sm_count
from .fp32_matmul import Product, mm as fp32_mm, mm_many as fp32_mm_many, mm_traced as fp32_mm_traced
from .fp32_matmul import _round_tf32  # the loop kernel's TF32 operands, rounded as the projections'

__all__ = [
    "lstm_cell", "lstm_cell_backward", "lstm_cell_ref", "lstm_cell_backward_ref",
    "rnn_forward_loop", "rnn_backward_loop", "rnn_forward_loop_ref", "rnn_backward_loop_ref", "rnn_loop_uses_triton",
    "lstm_cell_values", "lstm_cell_backward_values", "lstm_forward_loop_unrolled", "lstm_backward_loop_unrolled",
    "rnn_forward_traced", "rnn_backward_loop_traced", "rnn_projected_forward",
    "lstm_forward_loop", "lstm_backward_loop", "lstm_forward_loop_steps", "lstm_backward_loop_steps",
    "lstm_loop_uses_triton", "lstm_forward_loop_traced", "lstm_backward_loop_traced", "projection_mm",
    "gemm_precision", "compiled_fp32",
]


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
def _store_gate_grads(gp, H, m, i, f, g, o, tc, dh, dc, cp):
    """``gPre_t``'s four blocks (module doc) stored at ``gp`` (gate q at ``gp + q·H``) in its dtype."""
    ty = gp.dtype.element_ty
    tl.store(gp, (dc * g * i * (1.0 - i)).to(ty), mask=m)
    tl.store(gp + H, (dc * cp * f * (1.0 - f)).to(ty), mask=m)
    tl.store(gp + 2 * H, (dc * i * (1.0 - g * g)).to(ty), mask=m)
    tl.store(gp + 3 * H, (dh * tc * o * (1.0 - o)).to(ty), mask=m)


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
    _store_gate_grads(GPRE + row * s_g + cols, H, m, i, f, g, o, tc, dh, dc, cp)
    tl.store(KAPPA + row * s_k + cols, (dc * f).to(KAPPA.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------------- references
def _store(op, *args: Tensor, out: Tensor) -> None:
    """``op(*args, out=out)``; under ``torch.compile``, ``out.copy_(op(*args))`` (the same values).
    Dynamo traces no ``out=`` into a strided view such as one time step of a ``[B, T, H]`` buffer (a
    graph break); eager keeps the one-kernel form that the CUDA-graphed loops capture."""
    if is_compiling():
        out.copy_(op(*args))
    else:
        op(*args, out=out)


def lstm_cell_values(pre: Tensor, c_prev: Tensor | None) -> tuple[Tensor, Tensor]:
    """One forward step as fresh tensors: ``(c_t, h_t)`` ``[B, H]`` from ``pre [B, 4H]`` and ``c_{t−1}``
    (None: zero); the formulas of the module doc, in the inputs' dtype."""
    hsz = pre.shape[-1] // 4
    act = sigmoid(pre)
    i, f, o = act[:, :hsz], act[:, hsz : 2 * hsz], act[:, 3 * hsz :]
    g = tanh(pre[:, 2 * hsz : 3 * hsz])
    c = i * g if c_prev is None else addcmul(i * g, f, c_prev)
    return c, o * tanh(c)


def lstm_cell_backward_values(
    pre: Tensor, c: Tensor, c_prev: Tensor | None, dh: Tensor, kappa: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One backward step as fresh tensors: ``(gPre_t [B, 4H], κ_t [B, H])`` from the carry ``κ_{t+1}``
    (None after the last step); the formulas of the module doc."""
    hsz = c.shape[-1]
    act = sigmoid(pre)
    i, f, o = act[:, :hsz], act[:, hsz : 2 * hsz], act[:, 3 * hsz :]
    g = tanh(pre[:, 2 * hsz : 3 * hsz])
    tc = tanh(c)
    dc = dh * o * (1.0 - tc * tc)
    if kappa is not None:
        dc = dc + kappa
    cp = zeros_like(c) if c_prev is None else c_prev
    g_pre = cat((dc * g * i * (1.0 - i), dc * cp * f * (1.0 - f), dc * i * (1.0 - g * g), dh * tc * o * (1.0 - o)), dim=1)
    return g_pre, dc * f


def lstm_cell_ref(pre: Tensor, c_prev: Tensor | None, c_out: Tensor, h_out: Tensor) -> None:
    """Reference forward step: writes ``c_t`` into ``c_out`` and ``h_t`` into ``h_out``."""
    c, h = lstm_cell_values(pre, c_prev)
    c_out.copy_(c)
    h_out.copy_(h)


def lstm_cell_backward_ref(
    pre: Tensor, c: Tensor, c_prev: Tensor | None, dh: Tensor, kappa: Tensor, g_pre: Tensor, has_kappa: bool
) -> None:
    """Reference backward step: writes ``gPre_t`` into ``g_pre`` and ``κ_t`` over ``kappa``."""
    g, k = lstm_cell_backward_values(pre, c, c_prev, dh, kappa if has_kappa else None)
    g_pre.copy_(g)
    kappa.copy_(k)


# ------------------------------------------------------------------------------------- launchers
def _block(hsz: int, is_cuda: bool) -> int:
    cap = 1024 if is_cuda else 4096
    return min(max(16, 1 << max(hsz - 1, 0).bit_length()), cap)


def lstm_cell(pre: Tensor, c_prev: Tensor | None, c_out: Tensor, h_out: Tensor, backend: str | None = None) -> None:
    """One forward step (see the module doc): ``pre [B, 4H]``, ``c_prev [B, H]`` or None (zero),
    results written into ``c_out``, ``h_out [B, H]``. The last dimension must have unit stride."""
    if not use_kernel(pre, backend):
        lstm_cell_ref(pre, c_prev, c_out, h_out)
        return
    bsz, hsz = c_out.shape
    block = _block(hsz, pre.is_cuda)
    cp = c_out if c_prev is None else c_prev
    _launch_kernel(_lstm_fwd_kernel, (bsz, -(-hsz // block)),
                   (pre, cp, c_out, h_out, pre.stride(0), cp.stride(0), c_out.stride(0), h_out.stride(0), hsz),
                   {"HAS_PREV": c_prev is not None, "BLOCK": block}, {"num_warps": 4 if block >= 512 else 1})


def lstm_cell_backward(
    pre: Tensor, c: Tensor, c_prev: Tensor | None, dh: Tensor, kappa: Tensor, g_pre: Tensor,
    has_kappa: bool, backend: str | None = None,
) -> None:
    """One backward step (see the module doc): reads ``pre [B, 4H]``, ``c``, ``c_prev`` (None: zero),
    ``dh [B, H]`` and, when ``has_kappa``, the carry ``kappa [B, H]``; writes ``g_pre [B, 4H]`` and the
    new carry over ``kappa``. The last dimension must have unit stride."""
    if not use_kernel(pre, backend):
        lstm_cell_backward_ref(pre, c, c_prev, dh, kappa, g_pre, has_kappa)
        return
    bsz, hsz = c.shape
    block = _block(hsz, pre.is_cuda)
    cp = c if c_prev is None else c_prev
    _launch_kernel(_lstm_bwd_kernel, (bsz, -(-hsz // block)),
                   (pre, c, cp, dh, kappa, g_pre,
                    pre.stride(0), c.stride(0), cp.stride(0), dh.stride(0), kappa.stride(0), g_pre.stride(0), hsz),
                   {"HAS_PREV": c_prev is not None, "HAS_KAPPA": has_kappa, "BLOCK": block},
                   {"num_warps": 4 if block >= 512 else 1})


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
    """True when the per-step recurrent loops on ``t``'s device may run as CUDA graphs: never while
    ``torch.compile`` traces (its tensors are fake: no buffer to keep, no graph to capture; the traced
    layer calls the loop operators or unrolls the loop instead, see "loops under torch.compile")."""
    if is_compiling():
        return False
    return USE_CUDA_GRAPHS and t.is_cuda and t.numel() > 0 and not torch.cuda.is_current_stream_capturing()


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
    """The graph ``name`` of ``entry``, captured from ``body()`` on first use (after one warm-up run,
    which compiles the kernels). Call before writing the inputs: the warm-up runs on the buffers.

    The warm-up runs on the current stream, not on a new side stream: PyTorch keeps a cuBLAS workspace
    per stream (tens of MiB on recent GPUs) for as long as the stream lives, so a fresh side stream per
    capture held one more workspace per graph, part of the scratch of an LSTM's first call (issue 36).
    The capture stream's own workspace is created inside the capture either way: a side stream's
    warm-up never warmed it."""
    g = entry["graphs"].get(name)
    if g is None:
        body()
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


# --------------------------------------------------------------------- persistent Elman RNN loop
# The Elman RNN's two time loops (``torchloom.layers.rnn``) carry a state ``s [B, H]`` across time with
# one ``[B, H] × [H, H]`` product per step:
#
#   forward:   pre_t += h_{t−1} W_hhᵀ  (t > 0);        h_t = tanh(pre_t)
#   backward:  gPre_t = (1 − h_t²) ⊙ (gOut_t + gPre_{t+1} W_hh)   (no product at t = T−1)
#
# At B = 64, H = 256 one step is 4 MFLOP: a cuBLAS call per step leaves the GPU idle between
# launches even inside a CUDA graph (1.4 ms forward + backward at T = 64 on an H100, cuDNN 0.35 ms).
# ``_rnn_loop_kernel`` runs the whole loop in one launch. Program (b, n) owns rows
# [b·BLOCK_B, (b+1)·BLOCK_B) and ``COL_TILES`` column tiles of ``BLOCK_N``; each step it reads the
# previous state (all H columns of its rows, written by its sibling programs) back from the output
# tensor, multiplies it by its slice of W_hh (L1-hot: W_hh never changes) and writes its tiles.
#
# Waiting for the siblings: the output is filled with a signalling-NaN bit pattern (``_SENTINEL``)
# before the launch, and each element is written once, with a computed value (an arithmetic NaN is
# the canonical quiet NaN, never that pattern). A program re-reads a chunk of the previous state
# (volatile loads: from L2, never a stale L1 line) until none of it is the sentinel. Each element is
# its own flag, so no fence, atomic counter or barrier orders anything: the wait costs the store's
# trip to L2 and one load's round trip (an atomic step counter with release/acquire instead: 207 µs
# against 160 µs for the TF32 forward loop at B = 64, T = 64, H = 256 on an H100). The spin is only
# safe when every program is resident at once: on CUDA the grid never exceeds the SM count
# (``_rnn_loop_settings``) and the kernel is a cooperative launch (Triton's
# ``launch_cooperative_grid``: CUDA starts it only with every program resident, and refuses a grid
# that cannot be — never a partial start behind other kernels, e.g. a data-parallel run's NCCL
# kernels on another stream; same time on the H100, captured in CUDA graphs alike). Launched plainly
# (by a compiled graph's code, which makes no cooperative launch, or on a Triton without that option)
# the kernel first checks that its programs all run at once (``_all_resident``) and otherwise takes
# time-major (step, tile) tickets (``_rnn_tickets``), which cannot deadlock on a program that never
# started; a compiled graph fills the sentinel with ``_sentinel_fill_kernel`` (Inductor writes an int32
# view's fill as the float NaN, which is not the pattern). A wait longer than ``_SPIN_LIMIT`` polls still gives up
# rather than hang the GPU: the sentinels it then reads become NaNs (in every precision), so the result
# is NaN, never a silent number. A kernel that cannot compile or launch for a shape (registers, a grid
# CUDA refuses) warns once and that shape runs the reference loop from then on. Triton's interpreter
# runs programs one after another, so there one program per batch block loops over all column tiles
# and never waits.
#
# Precision: fp32 products follow PyTorch's switch for its own recurrent layers, the one ``nn.RNN`` and
# ``nn.LSTM`` (cuDNN) obey: ``torch.backends.cudnn.rnn.fp32_precision`` (``_triton.cudnn_rnn_allows_tf32``;
# on a torch without it, ``torch.backends.cudnn.allow_tf32``). "tf32", PyTorch's default → TF32 tensor
# cores, as cuDNN's RNN; "ieee" → ``_FP32_PRODUCT`` ("ieee": exact fp32 FMA, the numbers of the
# cuBLAS loop with TF32 off). The layers' input projections and weight gradients follow the same switch
# (``projection_mm``: cuBLAS where its own switch agrees, else ``fp32_matmul.mm``). The per-step
# cuBLAS loop (shapes the kernel does not take: H > 1,024, grids too large) multiplies ``h W_hh``
# under cuBLAS's switch, ``torch.backends.cuda.matmul`` (default exact). Half inputs multiply on
# tensor cores; everything accumulates in fp32 and is stored in the tensors' dtype.
from typing import NamedTuple  # noqa: E402

@torch.compiler.assume_constant_result
def _sm_count(index: int) -> int:
    """``_triton.sm_count``, which the loops' settings ask while ``torch.compile`` traces the layers:
    marked constant, Dynamo calls it and keeps the answer (traced through, its ``functools.lru_cache``
    drew a warning to the user from Dynamo on every compile)."""
    return sm_count(index)


_cooperative = [True]  # cleared when this Triton does not know ``launch_cooperative_grid``
USE_PERSISTENT_RNN = True  # False: the RNN runs the CUDA-graphed cuBLAS loop (the benchmark's baseline)
_FP32_PRODUCT = "ieee"  # tl.dot's input_precision for fp32 without TF32 (the benchmark also times "tf32x3")
_RNN_W_RESIDENT = True  # W_hh's slice held in registers across the loop where one K chunk covers H (the benchmark's A/B)
_RNN_W_IN_PLACE = True  # that slice read from W_hh's own layout (False: from a row-major copy; the benchmark's A/B)
_RNN_MAX_HIDDEN = 1024  # larger H: one step's product fills the GPU well enough through cuBLAS
_ARRIVE_LIMIT = 256  # polls of the handshake's count (~0.5 µs each) before a plain launch's loop takes tickets
_SPIN_LIMIT = 1 << 20  # polls per wait (~0.5 µs each): siblings are one step (µs) away, not half a second
# Signalling NaNs (exponent all ones, mantissa 1), as the integers of the same width.
_SENTINEL = {torch.float32: (0x7F800001, torch.int32), torch.bfloat16: (0x7F81, torch.int16),
             torch.float16: (0x7C01, torch.int16)}


@jit
def _wait_load(ptrs, mask, SENTINEL: tl.constexpr, BITS: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """``ptrs`` read (volatile: from L2, never a stale L1 line) once none of its elements, read as
    ``BITS`` integers, is ``SENTINEL`` any more. A wait that gives up after ``SPIN_LIMIT`` polls leaves
    NaN where the sentinels were."""
    s = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    polls = 0
    while (tl.max((s.to(BITS, bitcast=True) == SENTINEL).to(tl.int32), axis=None) > 0) & (polls < SPIN_LIMIT):
        s = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        polls += 1
    # a wait that gave up leaves sentinels: NaN, whatever the precision does with the pattern next
    return tl.where(s.to(BITS, bitcast=True) == SENTINEL, float("nan"), s.to(tl.float32)).to(s.dtype)


@jit
def _wait_state(S, rows, rm, s_sb, k, K, BLOCK_K: tl.constexpr, SENTINEL: tl.constexpr, BITS: tl.constexpr,
                SPIN_LIMIT: tl.constexpr):
    """``(S[rows, k:k+BLOCK_K], ks, km)``: the chunk once it holds no sentinel (``_wait_load``; zero
    outside ``K``), with its column indices and mask."""
    ks = k + tl.arange(0, BLOCK_K)
    km = ks < K
    s = _wait_load(S + rows[:, None] * s_sb + ks[None, :], rm[:, None] & km[None, :], SENTINEL, BITS, SPIN_LIMIT)
    return s, ks, km


@jit
def _chunk_dot(acc, s, w, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, W_ROUNDED: tl.constexpr = False):
    """``acc + s @ w`` on tensor cores or fp32 FMA (``PRECISION``, see the section note); ``W_ROUNDED``:
    ``w`` already rounded for it (a slice held across the loop, rounded once)."""
    if DOT_F32:  # the interpreter multiplies bfloat16's raw bits (numpy has no bfloat16)
        s, w = s.to(tl.float32), w.to(tl.float32)
    if PRECISION == "tf32":  # rounded operands: 1.2× the error of cuDNN's TF32 on an H100, unrounded 2.5×
        s = _round_tf32(s)
        if not W_ROUNDED:
            w = _round_tf32(w)
    return tl.dot(s, w, acc, input_precision=PRECISION)


@jit
def _state_product(acc, S, W, rows, rm, s_sb, cols, cm, s_wk, k, H,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                   SENTINEL: tl.constexpr, BITS: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """``acc + S[rows, k:k+BLOCK_K] @ W[k:k+BLOCK_K, cols]`` (fp32 accumulator; zero outside H; ``W``
    row-major with row stride ``s_wk``), once the ``S`` chunk holds no sentinel (``_wait_state``)."""
    ks = k + tl.arange(0, BLOCK_K)
    # W's chunk first: its load is in flight while the wait spins
    w = tl.load(W + ks[:, None] * s_wk + cols[None, :], mask=(ks < H)[:, None] & cm[None, :], other=0.0)
    s, _, _ = _wait_state(S, rows, rm, s_sb, k, H, BLOCK_K, SENTINEL, BITS, SPIN_LIMIT)
    return _chunk_dot(acc, s, w, PRECISION, DOT_F32)


@jit
def _rnn_tile(OUT, IN, AUX, W, w_slice, rows, rm, cols, cm, i, T,
              s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, H,
              BACKWARD: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
              SENTINEL: tl.constexpr, BITS: tl.constexpr, SPIN_LIMIT: tl.constexpr, W_RESIDENT: tl.constexpr,
              W_ROUNDED: tl.constexpr):
    """Step ``i`` of ``T`` (time step ``t = i``, or ``T − 1 − i`` backward) of one tile (``rows × cols``)
    of the loop (``_rnn_loop_kernel``'s operands), its product with the previous state after the first
    step: with ``w_slice`` (``W_RESIDENT``: the tile's whole slice of W, rounded for TF32 already where
    ``W_ROUNDED``) or chunk by chunk from ``W``."""
    if BACKWARD:
        t = T - 1 - i
        prev = t + 1
    else:
        t = i
        prev = t - 1
    m = rm[:, None] & cm[None, :]
    # This step's own inputs first: they do not wait for the siblings.
    acc = tl.load(IN + rows[:, None] * s_ib + t * s_it + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        h = tl.load(AUX + rows[:, None] * s_ab + t * s_at + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if i > 0:
        if W_RESIDENT:
            s, _, _ = _wait_state(OUT + prev * s_ot, rows, rm, s_ob, 0, H, BLOCK_K, SENTINEL, BITS, SPIN_LIMIT)
            acc = _chunk_dot(acc, s, w_slice, PRECISION, DOT_F32, W_ROUNDED)
        else:
            for k in range(0, H, BLOCK_K):
                acc = _state_product(acc, OUT + prev * s_ot, W, rows, rm, s_ob, cols, cm, s_wk, k, H,
                                     BLOCK_K, PRECISION, DOT_F32, SENTINEL, BITS, SPIN_LIMIT)
    if BACKWARD:
        out = acc * (1.0 - h * h)
    else:
        tl.store(IN + rows[:, None] * s_ib + t * s_it + cols[None, :], acc.to(IN.dtype.element_ty), mask=m)
        out = _tanh(acc)
    tl.store(OUT + rows[:, None] * s_ob + t * s_ot + cols[None, :], out.to(OUT.dtype.element_ty), mask=m)


@jit
def _w_tile(W, cols, s_wk, s_wn, H, BLOCK_K: tl.constexpr):
    """``W[0:BLOCK_K, cols]`` (zero outside H): a tile's whole slice of W, in any layout."""
    wk = tl.arange(0, BLOCK_K)
    return tl.load(W + wk[:, None] * s_wk + cols[None, :] * s_wn, mask=(wk < H)[:, None] & (cols < H)[None, :], other=0.0)


@jit
def _all_resident(FLAGS, ARRIVE_LIMIT: tl.constexpr):
    """The handshake of a plainly launched loop (``FLAGS``: three int32 zeros on entry): whether every
    program of the grid was running at once. Each program counts itself in (``FLAGS[0]``) and polls the
    count up to ``ARRIVE_LIMIT`` times (or until the answer is in); the first to decide writes the answer
    (``FLAGS[1]``: 1 all were, 2 not), and every program takes that one, so all of them agree."""
    programs = tl.num_programs(0) * tl.num_programs(1)
    arrived = tl.atomic_add(FLAGS, 1) + 1
    decided = 0
    polls = 0
    while (arrived < programs) & (decided == 0) & (polls < ARRIVE_LIMIT):  # a late program: the answer is in
        arrived = tl.load(FLAGS, volatile=True)
        decided = tl.load(FLAGS + 1, volatile=True)
        polls += 1
    want = tl.where(arrived >= programs, 1, 2)
    decided = tl.atomic_cas(FLAGS + 1, 0, want)
    return tl.where(decided == 0, want, decided) == 1


@jit
def _rnn_own_tiles(OUT, IN, AUX, W, w_slice, s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, B, T, H,
                   BACKWARD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   COL_TILES: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SENTINEL: tl.constexpr,
                   BITS: tl.constexpr, SPIN_LIMIT: tl.constexpr, W_RESIDENT: tl.constexpr):
    """The loop with every program running: program (b, n) owns its rows and ``COL_TILES`` column
    tiles for every step (``W_RESIDENT``: ``w_slice``, its slice of W loaded before the loop, is
    rounded once here)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rm = rows < B
    rows = rows.to(tl.int64)
    if W_RESIDENT:
        if PRECISION == "tf32":  # rounded once, as ``_chunk_dot`` would round it every step
            w_slice = _round_tf32(w_slice)
    for i in range(T):
        for j in tl.static_range(COL_TILES):
            cols = (tl.program_id(1) * COL_TILES + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            _rnn_tile(OUT, IN, AUX, W, w_slice, rows, rm, cols, cols < H, i, T,
                      s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, H, BACKWARD, BLOCK_K, PRECISION, DOT_F32,
                      SENTINEL, BITS, SPIN_LIMIT, W_RESIDENT, True)


@jit
def _rnn_tickets(OUT, IN, AUX, W, COUNTER, s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, s_wn, B, T, H,
                 BACKWARD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SENTINEL: tl.constexpr, BITS: tl.constexpr,
                 SPIN_LIMIT: tl.constexpr, W_RESIDENT: tl.constexpr):
    """The loop where not every program runs at once: the programs take (step, tile) tickets in
    time-major order from ``COUNTER`` (int32, zero on entry) until none is left. A ticket waits only
    on lower ones, which programs that started hold. W's slice is loaded for every ticket."""
    col_blocks = tl.cdiv(H, BLOCK_N)
    tiles = tl.num_programs(0) * col_blocks
    ticket = tl.atomic_add(COUNTER, 1)
    while ticket < T * tiles:
        following = tl.atomic_add(COUNTER, 1)  # taken first: its trip overlaps this ticket's wait
        i = ticket // tiles
        rows = (ticket % tiles) // col_blocks * BLOCK_B + tl.arange(0, BLOCK_B)
        rm = rows < B
        rows = rows.to(tl.int64)
        cols = (ticket % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_slice = 0.0
        if W_RESIDENT:
            w_slice = _w_tile(W, cols, s_wk, s_wn, H, BLOCK_K)
        _rnn_tile(OUT, IN, AUX, W, w_slice, rows, rm, cols, cols < H, i, T,
                  s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, H, BACKWARD, BLOCK_K, PRECISION, DOT_F32,
                  SENTINEL, BITS, SPIN_LIMIT, W_RESIDENT, False)
        ticket = following


@jit
def _rnn_loop_kernel(
    OUT, IN, AUX, W, FLAGS,
    s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, s_wn,
    B, T, H,
    BACKWARD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COL_TILES: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SENTINEL: tl.constexpr,
    BITS: tl.constexpr, SPIN_LIMIT: tl.constexpr, W_RESIDENT: tl.constexpr, HANDSHAKE: tl.constexpr,
    ARRIVE_LIMIT: tl.constexpr,
):
    """Forward: ``IN`` = pre (updated in place), ``OUT`` = hidden, ``W`` = W_hhᵀ. Backward: ``IN`` =
    gOut, ``AUX`` = hidden, ``OUT`` = gPre, ``W`` = W_hh. ``W [H, H]`` with strides ``s_wk, s_wn``
    (``s_wn = 1`` unless ``W_RESIDENT``). ``OUT`` holds ``SENTINEL`` (as an integer) everywhere on entry.
    ``W_RESIDENT`` (one column tile per program, one K chunk covering H): the program's slice of W is
    loaded once, before the loop, in any layout (the forward reads W_hh's transpose in place), and
    rounded once for TF32 products.

    ``HANDSHAKE`` (a plain launch; ``FLAGS``: three int32 zeros): the programs first agree whether all
    of them run at once (``_all_resident``). If they do, each owns its tile as above. If not, they take
    (step, tile) tickets in time-major order from ``FLAGS[2]``: a ticket waits only on lower ones, which
    started programs hold, so the loop cannot deadlock on a program that never started (the same
    numbers, bit for bit; W's slice loaded for every ticket)."""
    w_slice = 0.0  # unused unless W_RESIDENT
    if W_RESIDENT:  # loaded first: with a handshake, in flight while the programs count themselves in
        w_slice = _w_tile(W, tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), s_wk, s_wn, H, BLOCK_K)
    if HANDSHAKE:
        if _all_resident(FLAGS, ARRIVE_LIMIT):
            _rnn_own_tiles(OUT, IN, AUX, W, w_slice, s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, B, T, H, BACKWARD, BLOCK_B,
                           BLOCK_N, BLOCK_K, COL_TILES, PRECISION, DOT_F32, SENTINEL, BITS, SPIN_LIMIT, W_RESIDENT)
        else:
            _rnn_tickets(OUT, IN, AUX, W, FLAGS + 2, s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, s_wn, B, T, H, BACKWARD,
                         BLOCK_B, BLOCK_N, BLOCK_K, PRECISION, DOT_F32, SENTINEL, BITS, SPIN_LIMIT, W_RESIDENT)
    else:
        _rnn_own_tiles(OUT, IN, AUX, W, w_slice, s_ob, s_ot, s_ib, s_it, s_ab, s_at, s_wk, B, T, H, BACKWARD, BLOCK_B,
                       BLOCK_N, BLOCK_K, COL_TILES, PRECISION, DOT_F32, SENTINEL, BITS, SPIN_LIMIT, W_RESIDENT)


def rnn_forward_loop_ref(pre: Tensor, weight_hh: Tensor, hidden: Tensor) -> None:
    """Reference forward loop over ``pre, hidden [B, T, H]``: ``pre_t += h_{t−1} W_hhᵀ`` (t > 0, in
    place), ``h_t = tanh(pre_t)`` into ``hidden``."""
    w_hh_t = weight_hh.t()
    for t in range(pre.shape[1]):
        if t > 0:  # h_0 = 0 contributes nothing
            pre[:, t].addmm_(hidden[:, t - 1], w_hh_t)
        _store(tanh, pre[:, t], out=hidden[:, t])


def rnn_backward_loop_ref(grad_out: Tensor, weight_hh: Tensor, g_pre: Tensor, dh: Tensor) -> None:
    """Reference backward loop: ``g_pre [B, T, H]`` holds ``1 − h_t²`` on entry and ``gPre_t`` on exit;
    ``dh [B, H]`` is scratch for ``gOut_t + gPre_{t+1} W_hh``."""
    T = g_pre.shape[1]
    g_pre[:, T - 1].mul_(grad_out[:, T - 1])
    for t in range(T - 2, -1, -1):
        addmm(grad_out[:, t], g_pre[:, t + 1], weight_hh, out=dh)  # gOut_t + gPre_{t+1} W_hh
        g_pre[:, t].mul_(dh)


class RNNLoopSettings(NamedTuple):
    """Launch settings of ``_rnn_loop_kernel``: ``col_programs`` programs per batch block, each with
    ``col_tiles`` tiles of ``block_n`` columns; the product runs over K in ``block_k`` chunks."""

    block_b: int
    block_n: int
    block_k: int
    col_tiles: int
    col_programs: int
    num_warps: int


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rnn_loop_settings(x: Tensor, batch: int, hidden: int) -> RNNLoopSettings | None:
    """Settings for the loop of ``[batch, ·, hidden]`` on ``x``'s device and dtype, or None where the
    kernel does not apply (CUDA: hidden above ``_RNN_MAX_HIDDEN``, or no grid of at most one program
    per SM)."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if not x.is_cuda:  # the interpreter: one program per batch block, every column tile
        return RNNLoopSettings(16, 16, 16, cdiv(hidden, 16), 1, 4)
    if hidden > _RNN_MAX_HIDDEN:
        return None
    sms = _sm_count(device_index(x))
    # The whole previous state of a program's rows in one chunk up to H = 256 (one wait per step) and
    # 4 warps: the best of bench/bench_rnn_loop.py --sweep on an H100 for fp32, TF32 and bf16 (3-pass
    # TF32, whose split operands fill the registers: chunks of 128).
    block_k = min(max(_next_pow2(hidden), 16), 128 if _FP32_PRODUCT == "tf32x3" else 256)
    num_warps = 4
    # 16 × 16 tiles (tl.dot's minimum): the most programs, so the least work per program between two
    # waits (B = 64, H = 256: 64 programs); wider tiles only where the grid would not fit on the GPU.
    for block_b, block_n in ((16, 16), (16, 32), (32, 32), (32, 64), (64, 64), (64, 128)):
        programs = cdiv(batch, block_b) * cdiv(hidden, block_n)
        if programs <= sms:
            return RNNLoopSettings(block_b, block_n, block_k, 1, cdiv(hidden, block_n), num_warps)
    return None


def _dot_precision(t: Tensor) -> str:
    """fp32 products: TF32 where PyTorch's recurrent layers would use it (``_rnn_allows_tf32``; see
    the section note), else ``_FP32_PRODUCT``."""
    if not t.is_cuda or t.dtype != float32:
        return "ieee"  # half inputs: ignored; the interpreter: numpy's fp32
    return "tf32" if _rnn_allows_tf32() and _tf32_capable(t) else _FP32_PRODUCT


def _tf32_capable(t: Tensor) -> bool:
    return tf32_capable(device_index(t))


def gemm_precision(a: Tensor, b: Tensor, backend: str | None) -> str | None:
    """The product precision (``"tf32"`` / ``"ieee"``) in which ``fp32_matmul`` computes a recurrent
    layer's product of ``a`` and ``b``: float32 on a CUDA GPU with TF32 where PyTorch's RNN switch and
    cuBLAS's (``torch.backends.cuda.matmul``) disagree; None where cuBLAS computes it (anything else,
    and ``backend="reference"``)."""
    if not (a.is_cuda and a.dtype == float32 and b.dtype == float32 and backend != "reference"):
        return None
    if not use_triton(a, None, (float32,)) or not _tf32_capable(a):
        return None
    tf32 = _rnn_allows_tf32()
    return None if tf32 == cublas_allows_tf32() else ("tf32" if tf32 else "ieee")


def compiled_fp32(a: Tensor, b: Tensor, backend: str | None) -> bool:
    """Whether a recurrent product of ``a`` and ``b`` is traced for ``torch.compile`` in float32 on CUDA
    (not ``backend="reference"``): by ``compiled_plan``'s rule, as cuBLAS calls or ``fp32_matmul``'s
    launches in the graph, or, where it has no plan, as one of the opaque operators
    (``torchloom::recurrent_mm`` here, ``torchloom::recurrent_grads`` in ``layers.rnn``), which choose
    cuBLAS or ``fp32_matmul`` at run time."""
    return (is_compiling() and a.is_cuda and a.dtype == float32 and b.dtype == float32
            and backend != "reference")


@torch.compiler.assume_constant_result
def _cublas_allows_tf32_constant() -> bool:
    return cublas_allows_tf32()


def allows_tf32_traced(op: str) -> bool:
    """``_triton._allows_tf32(op)`` ("matmul" or "rnn") for code that ``torch.compile`` traces, where the
    getter it calls is a graph break, and a compiled graph must be traced anew when the answer changes.
    "rnn": read from the settings' attributes (``torch.backends.cudnn.rnn.fp32_precision``...), on
    each of which Dynamo guards (a torch with the ``fp32_precision`` settings). "matmul": the answer
    taken as a constant; Dynamo's guard on PyTorch's global state covers cuBLAS's switch."""
    b = backends
    if op == "matmul":
        return _cublas_allows_tf32_constant()
    for precision in (b.cudnn.rnn.fp32_precision, b.cudnn.fp32_precision, b.fp32_precision):
        if precision != "none":  # ("cuda", "rnn"), then ("cuda", "all"), then ("generic", "all")
            return precision == "tf32"
    return False


USE_INDUCTOR_LOOPS = True  # False: compiled, the RNN's loops and the products run as the opaque operators (the benchmark's A/B)


@torch.compiler.assume_constant_result
def _kernels_launchable_in_graphs() -> bool:
    """Whether a compiled graph can launch the kernels itself: Triton installed and not its interpreter
    (the eager kernels' own condition, ``use_triton``), ``torch.library.triton_op`` (torch 2.6) and the
    ``fp32_precision`` settings ``allows_tf32_traced`` reads."""
    return (triton is not None and not interpreter_enabled() and hasattr(torch.library, "triton_op")
            and getattr(torch._C, "_get_fp32_precision_getter", None) is not None)


@torch.compiler.assume_constant_result
def _tf32_capable_constant(index: int) -> bool:
    return tf32_capable(index)


def compiled_plan(t: Tensor) -> tuple[str, str | None] | None:
    """How ``torch.compile`` traces a recurrent layer on CUDA ``t``, PyTorch's switches read while
    tracing (``allows_tf32_traced``: a change traces anew): ``(loop, products)``. ``loop``: the
    loop kernels' fp32 product precision ("tf32" where PyTorch's RNN switch asks for TF32, else
    ``_FP32_PRODUCT``). ``products``: None where cuBLAS's switch agrees with the RNN's (the products
    are traced cuBLAS calls), else the precision of ``fp32_matmul``'s kernel, launched by Inductor's
    code (``fp32_matmul.mm_traced``). Half dtypes: ``("ieee", None)``. None with
    ``USE_INDUCTOR_LOOPS`` off, without Triton or under its interpreter, and on a torch without
    ``torch.library.triton_op`` or the ``fp32_precision`` settings: the opaque operators then decide
    everything at run time, as the eager code would."""
    if not USE_INDUCTOR_LOOPS or not t.is_cuda or not _kernels_launchable_in_graphs():
        return None
    if t.dtype != float32:
        return "ieee", None
    capable = _tf32_capable_constant(device_index(t))
    rnn = capable and allows_tf32_traced("rnn")
    loop = "tf32" if rnn else _FP32_PRODUCT
    return loop, (None if rnn == (capable and allows_tf32_traced("matmul")) else ("tf32" if rnn else "ieee"))


def projection_mm(a: Tensor, b: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                  backend: str | None = None) -> Tensor:
    """``a @ b (+ bias)`` (``[M, K] @ [K, N]``, or ``[M, G, K] @ [G, K, N]`` summed over ``G`` and ``K``:
    ``fp32_matmul.mm``'s forms) for the recurrent layers' input projections, in the precision cuDNN's
    RNN would compute them in (it computes the whole layer, projections included, under
    ``torch.backends.cudnn.rnn``'s switch): ``fp32_matmul.mm`` where ``gemm_precision`` names one (float32
    on CUDA where that switch and cuBLAS's disagree), else cuBLAS (``torch.mm`` / ``addmm``, into ``out``
    when given). Under ``torch.compile`` a float32 CUDA product follows ``compiled_plan``: a traced
    cuBLAS call or ``fp32_matmul.mm_traced`` (decided while tracing, from the same switches), else the
    opaque ``torchloom::recurrent_mm``, which decides the same at run time."""
    if out is None and compiled_fp32(a, b, backend):
        plan = compiled_plan(a)
        if plan is None:
            return _RECURRENT_MM(a, b, bias)
        if plan[1] is not None:
            return fp32_mm_traced(a, b, plan[1], bias)
        # else traced as cuBLAS's below
    # traced otherwise only where cuBLAS computes it (not float32 on CUDA): no switch read while tracing
    precision = None if is_compiling() else gemm_precision(a, b, backend)
    if precision is not None:
        r = fp32_mm(a, b, precision, bias)
        return r if out is None else out.copy_(r)
    if a.dim() == 3:  # [M, G, K] @ [G, K, N]: a copy, as the rows need (sizes given: M or N may be 0)
        a, b = a.reshape(a.shape[0], a.shape[1] * a.shape[2]), b.reshape(b.shape[0] * b.shape[1], b.shape[2])
    if out is None:
        return mm(a, b) if bias is None else addmm(bias, a, b)
    return mm(a, b, out=out) if bias is None else addmm(bias, a, b, out=out)


def _recurrent_mm_eager(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    with autocast_off(a.device.type):  # a compiled backward may run under the caller's autocast
        return _replay.run(replay_key("recurrent_mm"), projection_mm, (a, b, bias))  # fresh: every product's is


def _register_recurrent_mm():
    op = torch.library.custom_op("torchloom::recurrent_mm", _recurrent_mm_eager, mutates_args=())
    op.register_fake(lambda a, b, bias: a.new_empty(a.shape[0], b.shape[-1]))
    return op


_RECURRENT_MM = _register_recurrent_mm()


def rnn_loop_uses_triton(x: Tensor, batch: int, hidden: int, backend: str | None = None) -> bool:
    """Whether the RNN's loops on ``x``'s device and dtype at ``[batch, ·, hidden]`` run
    ``_rnn_loop_kernel`` (``backend`` as in ``use_triton``; None also needs ``USE_PERSISTENT_RNN``).
    ``backend="triton"`` where the kernel does not apply is a ``ValueError``. An empty batch never
    does: the per-step loop has nothing to compute."""
    if batch == 0 or not use_kernel(x, backend) or (backend is None and not USE_PERSISTENT_RNN):
        return False
    if _rnn_loop_settings(x, batch, hidden) is None:
        if backend == "triton":
            raise ValueError(f"backend='triton': no persistent-loop grid for batch {batch}, hidden {hidden} on {x.device}")
        return False
    return not _loop_failed("RNN", x, batch, hidden)


@jit
def _sentinel_fill_kernel(OUT, N, FLAGS, SENTINEL: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """``OUT[:N]`` (contiguous) written with the bits of ``SENTINEL`` (a ``BITS`` integer), and the three
    int32 ``FLAGS`` of a loop's handshake zeroed by program 0: the fill a compiled graph's loop launch
    is given. (A fill of an int32 view of ``OUT`` is not kept as such in a compiled graph: Inductor
    writes it as the float NaN, whose bits are not the sentinel's.)"""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.full((BLOCK,), SENTINEL, BITS)
    tl.store(OUT + offs, bits.to(OUT.dtype.element_ty, bitcast=True), mask=offs < N)
    if tl.program_id(0) == 0:
        f = tl.arange(0, 4)
        tl.store(FLAGS + f, tl.zeros((4,), tl.int32), mask=f < 3)


def _launch_rnn_loop(out: Tensor, inp: Tensor, aux: Tensor, weight_hh: Tensor, backward: bool,
                     settings: RNNLoopSettings | None = None, filled: bool = False, precision: str | None = None,
                     traced: bool = False, handshake: bool = False, flags: Tensor | None = None) -> None:
    """One launch of ``_rnn_loop_kernel`` (``settings``: the benchmark's sweep, else
    ``_rnn_loop_settings``), after filling ``out`` with the sentinel (``filled``: it holds it already).
    ``precision``: the fp32 products' (``_dot_precision`` when None). On CUDA a cooperative launch
    where Triton makes one; else, with ``traced`` (inside a ``torch.library.triton_op``, which Inductor
    launches plainly) and with ``handshake`` (tests), a plain launch whose programs check that they all
    run at once (``_all_resident``) and take tickets where they do not (``flags``: its three int32
    zeros, given to read the answer back: ``flags[1]`` 1 or 2)."""
    B, T, H = out.shape
    for name, t in (("output", out), ("input", inp), ("aux", aux)):
        if t.shape != out.shape or t.stride(-1) != 1:
            raise ValueError(f"RNN loop: {name} must be [B, T, H] = {list(out.shape)} with unit last stride, "
                             f"got {list(t.shape)} strides {t.stride()}")
    st = settings or _rnn_loop_settings(out, B, H)
    precision = precision or _dot_precision(out)
    sentinel, int_dtype = _SENTINEL[out.dtype]
    if traced:  # the fill and the handshake's zeros in one launch of our own (``_sentinel_fill_kernel``)
        if not out.is_contiguous():
            raise ValueError(f"RNN loop: a traced launch's output must be contiguous, got strides {out.stride()}")
        if not filled:  # never a fill of an int32 view here (``_sentinel_fill_kernel``'s note)
            flags = out.new_empty(3, dtype=torch.int32) if flags is None else flags
            launch_traced(_sentinel_fill_kernel, (max(1, -(-out.numel() // 1024)),), (out, out.numel(), flags),
                          dict(SENTINEL=sentinel, BITS=tl.int32 if int_dtype == torch.int32 else tl.int16, BLOCK=1024))
            filled = True
        elif flags is None:
            flags = out.new_zeros(3, dtype=torch.int32)
    if not filled:
        out.view(int_dtype).fill_(sentinel)  # a view of the same bytes (unit last stride), whatever the strides
    # K × N: forward multiplies by W_hhᵀ, backward by W_hh (``_w_in_place``: read where it lies, else
    # from a row-major copy).
    w = weight_hh if backward else weight_hh.t()
    if not _w_in_place(st, H, out, precision):
        w = w.contiguous()
    grid = (-(-B // st.block_b), st.col_programs)
    strides = (out.stride(0), out.stride(1), inp.stride(0), inp.stride(1), aux.stride(0), aux.stride(1),
               w.stride(0), w.stride(1), B, T, H)
    kw = dict(_loop_constants(out, st, backward, precision), W_RESIDENT=_w_resident(st, H, out.dtype),
              ARRIVE_LIMIT=_ARRIVE_LIMIT)

    def plain() -> None:  # with the handshake
        f = zeros(3, dtype=torch.int32, device=out.device) if flags is None else flags
        args, constants = (out, inp, aux, w, f, *strides), dict(kw, HANDSHAKE=True)
        if traced:
            launch_traced(_rnn_loop_kernel, grid, args, constants)
        else:
            _cooperative_launch(_rnn_loop_kernel, grid, args, constants, False)

    if traced or handshake:
        plain()
    else:
        _cooperative_launch(_rnn_loop_kernel, grid, (out, inp, aux, w, out, *strides), dict(kw, HANDSHAKE=False),
                            out.is_cuda, plain=plain)


def _w_resident(st: RNNLoopSettings, hidden: int, dtype: torch.dtype) -> bool:
    """Whether ``_rnn_loop_kernel`` holds its W_hh slice in registers across the loop: one column tile
    per program, one K chunk covering ``hidden``, and a slice of at most 16 KB (B = 64, H = 256, fp32:
    16 × 16 tiles, 256 × 16 × 4 bytes); a larger one would spill."""
    return (_RNN_W_RESIDENT and st.col_tiles == 1 and st.block_k >= hidden
            and st.block_k * st.block_n * dtype.itemsize <= 16384)


def _w_in_place(st: RNNLoopSettings, hidden: int, out: Tensor, precision: str) -> bool:
    """Whether ``_rnn_loop_kernel``, multiplying fp32 in ``precision``, reads W_hh (or its transpose)
    where it lies rather than from a row-major copy: where it holds the slice across the loop (``_w_resident``) and multiplies on
    tensor cores (TF32, half inputs; the interpreter alike), which take it in any layout at the same
    speed (the forward's copy cost a launch: 0.328 vs 0.329 ms for the TF32 loops at 64 × 64 × 256 on
    an H200). fp32 FMA products ("ieee") on CUDA read the copy: a transposed tile cost them a layout
    change every step (0.647 vs 0.419 ms there; 2.4× the backward's time on an H100 re-reading W)."""
    fma = out.is_cuda and out.dtype == float32 and precision != "tf32"
    return _RNN_W_IN_PLACE and _w_resident(st, hidden, out.dtype) and not fma


def _loop_constants(flags: Tensor, st: RNNLoopSettings, backward: bool, precision: str | None = None) -> dict:
    """The compile-time arguments of a persistent loop kernel (``_rnn_loop_kernel``, ``_lstm_loop_kernel``)
    whose output ``flags`` carries the sentinel: settings, product precision, the sentinel and its width."""
    sentinel, int_dtype = _SENTINEL[flags.dtype]
    return dict(
        BACKWARD=backward, BLOCK_B=st.block_b, BLOCK_N=st.block_n, BLOCK_K=st.block_k, COL_TILES=st.col_tiles,
        PRECISION=precision or _dot_precision(flags), DOT_F32=not flags.is_cuda and flags.dtype == bfloat16,
        SENTINEL=sentinel, BITS=tl.int32 if int_dtype == torch.int32 else tl.int16, SPIN_LIMIT=_SPIN_LIMIT,
        num_warps=st.num_warps,
    )


def _cooperative_launch(kernel, grid: tuple[int, ...], args: tuple, kw: dict, is_cuda: bool,
                        plain: Callable[[], None] | None = None) -> None:
    """``kernel[grid](*args, **kw)`` (through ``_launch.launch``: host time), cooperatively on CUDA
    (every program resident) where Triton can; where it cannot, ``plain()`` when given (the RNN's
    loop with its handshake), else the same launch made plainly. ``kw``: the constexprs and ``num_warps``."""
    constants = dict(kw)
    options = {"num_warps": constants.pop("num_warps")}
    if is_cuda and _cooperative[0]:
        try:
            _launch_kernel(kernel, grid, args, constants, dict(options, launch_cooperative_grid=True))
            return
        except KeyError:  # "Keyword argument ... unrecognised": an older Triton
            _cooperative[0] = False
    if is_cuda and plain is not None:
        plain()
        return
    _launch_kernel(kernel, grid, args, constants, options)


_failed: set = set()  # (layer, B, H, dtype, device) whose kernel could not launch: the per-step loop from then on


def _failure_key(layer: str, x: Tensor, batch: int, hidden: int) -> tuple:
    return layer, batch, hidden, x.dtype, x.device


def _loop_failed(layer: str, x: Tensor, batch: int, hidden: int) -> bool:
    """Whether ``layer``'s loop kernel failed to launch at ``[batch, ·, hidden]`` on ``x``'s dtype and
    device (either direction): its loops then run step by step, graphed where they can be."""
    return _failure_key(layer, x, batch, hidden) in _failed


def _launch_or_fallback(layer: str, flags: Tensor, hidden: int, launch: Callable[[], None]) -> bool:
    """``launch()`` (one persistent-loop launch writing ``flags [B, T, ·]``; ``hidden``: the layer's H),
    or False (with one ``RuntimeWarning`` per layer and shape) when the kernel cannot compile or launch
    for this shape on this GPU (too many registers, a cooperative grid CUDA refuses...): the caller then
    runs the per-step loop, and both directions do from then on (``_loop_failed``). Nothing was written
    but the sentinel, which that loop overwrites."""
    key = _failure_key(layer, flags, flags.shape[0], hidden)
    if key in _failed:
        return False
    try:
        launch()
        return True
    except (ValueError, TypeError):  # the operands themselves: the caller's error
        raise
    except Exception as e:  # noqa: BLE001 - any compile/launch failure: the per-step loop instead
        if flags.is_cuda and torch.cuda.is_current_stream_capturing():
            raise  # a capture cannot fall back mid-way; the engine's warm-up runs first and lands here
        _failed.add(key)
        _replay.unreplayable()  # a call that fell back is never replayed (its fallback is what runs next time)
        import warnings

        warnings.warn(
            f"{layer}: the persistent loop kernel could not run for batch {key[1]}, hidden {key[2]}, {key[3]} on {key[4]} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); using the per-step loop",
            RuntimeWarning, stacklevel=3,
        )
        return False


def rnn_forward_loop(pre: Tensor, weight_hh: Tensor, hidden: Tensor, backend: str | None = None,
                     filled: bool = False) -> None:
    """The RNN's forward loop (``rnn_forward_loop_ref``) in one launch of ``_rnn_loop_kernel`` where
    ``rnn_loop_uses_triton``, else the reference. ``pre`` (updated in place) and ``hidden``
    ``[B, T, H]`` with unit last stride; ``filled``: ``hidden`` holds the kernel's sentinel already."""
    B, _, H = pre.shape
    if not rnn_loop_uses_triton(pre, B, H, backend) or not _launch_or_fallback(
            "RNN", hidden, H, lambda: _launch_rnn_loop(hidden, pre, pre, weight_hh, False, filled=filled)):
        rnn_forward_loop_ref(pre, weight_hh, hidden)


def _projection_filling(x2: Tensor, w_ih_t: Tensor, bias: Tensor | None, hidden: Tensor, precision: str,
                        backend: str | None = None, traced: bool = False) -> Tensor:
    """``x2 @ w_ih_t (+ bias)`` (``[B·T, H]``) by ``fp32_matmul.mm_many`` in ``precision`` (``traced``: its
    launches through ``torch.library.wrap_triton``), which also writes the loop's sentinel's bits over the
    float32 ``hidden [B, T, H]`` (``Product.fill``: one launch fewer than a fill of its own)."""
    fill = hidden.view(-1, hidden.shape[-1])
    product = Product(x2, w_ih_t, bias, fill=fill, fill_value=_SENTINEL[hidden.dtype][0])
    return fp32_mm_many([product], precision, backend, traced=traced)[0][0]


def rnn_projected_forward(x2: Tensor, w_ih_t: Tensor, bias: Tensor | None, weight_hh: Tensor, batch: int,
                          steps: int, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """The RNN's forward from its input: ``pre = x2 @ w_ih_t (+ bias)`` (``x2 [B·T, I]``, ``w_ih_t
    [I, H]``: ``projection_mm``) viewed ``[B, T, H]`` (``batch``, ``steps``), then ``rnn_forward_loop``
    → ``(pre, hidden)``, fresh ``[B, T, H]`` tensors. Where the loop is the kernel's and the product
    ``fp32_matmul``'s (``gemm_precision``), the product also writes the loop's sentinel over ``hidden``
    (``Product.fill``): one launch fewer. While ``torch.compile`` traces (a compiled RNN reaches this
    only where the loop kernel does not apply) the switches are not read here: ``projection_mm``
    decides its product by ``compiled_plan``."""
    H, T = w_ih_t.shape[1], steps
    precision = None
    if not is_compiling() and rnn_loop_uses_triton(x2, batch, H, backend):
        precision = gemm_precision(x2, w_ih_t, backend)
    if precision is not None:
        hidden = x2.new_empty(batch, T, H)
        pre = _projection_filling(x2, w_ih_t, bias, hidden, precision, backend).view(batch, T, H)
        rnn_forward_loop(pre, weight_hh, hidden, backend, filled=True)
        return pre, hidden
    pre = projection_mm(x2, w_ih_t, bias, backend=backend).view(batch, T, H)
    hidden = empty_like(pre)
    rnn_forward_loop(pre, weight_hh, hidden, backend)
    return pre, hidden


def rnn_backward_loop(grad_out: Tensor, weight_hh: Tensor, hidden: Tensor, g_pre: Tensor, backend: str | None = None) -> None:
    """The RNN's backward loop: ``gPre_t = (1 − h_t²) ⊙ (gOut_t + gPre_{t+1} W_hh)`` written into
    ``g_pre``, from ``grad_out`` and ``hidden`` (all ``[B, T, H]``, unit last stride); one launch of
    ``_rnn_loop_kernel`` where ``rnn_loop_uses_triton``, else ``rnn_backward_loop_ref``."""
    B, _, H = g_pre.shape
    if not rnn_loop_uses_triton(g_pre, B, H, backend) or not _launch_or_fallback(
            "RNN", g_pre, H, lambda: _launch_rnn_loop(g_pre, grad_out, hidden, weight_hh, True)):
        mul(hidden, hidden, out=g_pre).neg_().add_(1.0)  # tanh'(pre_t) = 1 − h_t²
        rnn_backward_loop_ref(grad_out, weight_hh, g_pre, g_pre.new_empty(B, H))


# -------------------------------------------------------------------------- persistent LSTM loop
# The LSTM's two time loops (``torchloom.layers.lstm``), each in one launch, on the RNN loop's scheme
# (the section above: sentinel-filled output as per-element flags, a cooperative grid, the same tile
# settings and product precision). Program (b, n) owns BLOCK_B rows and BLOCK_N hidden columns ``cols``,
# and with them the four gate columns ``q·H + cols`` (q = i, f, g, o), so the cell update of its
# columns needs nothing from its siblings; only the product reads their results:
#
#   forward:   pre_t[q] += h_{t−1} W_hhᵀ[:, q·H + cols]   (t > 0: waits on all H columns of h_{t−1})
#              then c_t, h_t as ``_lstm_fwd_kernel``; h_t, written to HID, is the flag
#   backward:  dh_t = gOut_t + gPre_{t+1} W_hh[:, cols]   (t < T−1: waits on all 4H columns of gPre_{t+1})
#              then gPre_t and κ_t as ``_lstm_bwd_kernel``; gPre_t, written to GPRE, is the flag
#
# What a program carries from one step to the next (c_{t−1}; κ_{t+1}) it reads back from where it
# stored it, in the tensors' dtype, after a barrier of its threads: the numbers of the per-step loop
# (whose kernels read them back the same way, and whose products and dh round to the dtype as here),
# and any number of column tiles per program (Triton's interpreter: one program per batch block).
# κ alternates between two slots, so a step's store never meets the previous step's load.
USE_PERSISTENT_LSTM = True  # False: the per-step loop (fused cell kernels, CUDA-graphed; the benchmark's baseline)


@jit
def _lstm_loop_kernel(
    PRE, CELL, HID, GOUT, GPRE, KAPPA, W,
    s_pb, s_pt, s_cb, s_ct, s_hb, s_ht, s_gb, s_gt, s_qb, s_qt, s_kb, s_ks, s_wk,
    B, T, H,
    BACKWARD: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COL_TILES: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SENTINEL: tl.constexpr,
    BITS: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):
    """Forward: ``PRE [B, T, 4H]`` (input projections on entry, pre-activations on exit), ``CELL`` and
    ``HID [B, T, H]`` written (``HID`` holds ``SENTINEL`` on entry), ``W = W_hhᵀ [H, 4H]``. Backward:
    ``GPRE [B, T, 4H]`` written (``SENTINEL`` on entry) from ``GOUT [B, T, H]``, ``PRE``, ``CELL``;
    ``KAPPA [2, B, H]`` scratch; ``W = W_hh [4H, H]``. ``W`` row-major (row stride ``s_wk``)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rm = rows < B
    rows = rows.to(tl.int64)
    r2 = rows[:, None]
    q3 = tl.arange(0, 4)[:, None, None]  # the gate blocks i, f, g, o
    for step in range(T):
        tl.debug_barrier()  # this program's stores of the previous step (c, κ) visible to all its threads
        for j in tl.static_range(COL_TILES):
            cols = (tl.program_id(1) * COL_TILES + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            cm = cols < H
            m = rm[:, None] & cm[None, :]
            c2 = cols[None, :]
            if BACKWARD:
                t = T - 1 - step
                dh = tl.load(GOUT + r2 * s_gb + t * s_gt + c2, mask=m, other=0.0).to(tl.float32)
                if step > 0:
                    # dh += Σ_q gPre_{t+1}[:, q·H + k] W_hh[q·H + k, cols]: the four gate blocks of K as a
                    # batch of four products, summed at the end (one [BB, 4H] × [4H, BN] product keeps
                    # one warp's tile busy over all of K: 1.55× the time in bf16 on an H200, about equal in fp32)
                    part = tl.zeros([4, BLOCK_B, BLOCK_N], dtype=tl.float32)
                    for k in range(0, H, BLOCK_K):
                        ks = k + tl.arange(0, BLOCK_K)
                        km = ks < H
                        sp = GPRE + (t + 1) * s_qt + rows[None, :, None] * s_qb + q3 * H + ks[None, None, :]
                        s = _wait_load(sp, rm[None, :, None] & km[None, None, :], SENTINEL, BITS, SPIN_LIMIT)
                        wp = W + (q3 * H + ks[None, :, None]) * s_wk + cols[None, None, :]
                        w = tl.load(wp, mask=km[None, :, None] & cm[None, None, :], other=0.0)
                        part = _chunk_dot(part, s, w, PRECISION, DOT_F32)
                    # rounded to the dtype, as the per-step loop's dh buffer
                    dh = (dh + tl.sum(part, axis=0)).to(GOUT.dtype.element_ty).to(tl.float32)
                ig, fg, gg, og = _gates(PRE + r2 * s_pb + t * s_pt + c2, H, m)
                tc = _tanh(tl.load(CELL + r2 * s_cb + t * s_ct + c2, mask=m, other=0.0).to(tl.float32))
                dc = dh * og * (1.0 - tc * tc)
                if step > 0:
                    dc += tl.load(KAPPA + (step - 1) % 2 * s_ks + r2 * s_kb + c2, mask=m, other=0.0).to(tl.float32)
                cp = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
                if t > 0:
                    cp = tl.load(CELL + r2 * s_cb + (t - 1) * s_ct + c2, mask=m, other=0.0).to(tl.float32)
                _store_gate_grads(GPRE + r2 * s_qb + t * s_qt + c2, H, m, ig, fg, gg, og, tc, dh, dc, cp)
                tl.store(KAPPA + step % 2 * s_ks + r2 * s_kb + c2, (dc * fg).to(KAPPA.dtype.element_ty), mask=m)
            else:
                t = step
                # the tile's four gate columns side by side, [BB, 4·BN] (column q·BN + n is gate q of
                # cols[n]): one product per K chunk (four [BB, BN] products: 1.5× the time in fp32 and 1.7–1.9×
                # in bf16 on an H200)
                lane = tl.arange(0, 4 * BLOCK_N)
                qcols = (tl.program_id(1) * COL_TILES + j) * BLOCK_N + lane % BLOCK_N
                gcols = (lane // BLOCK_N) * H + qcols
                qcm = qcols < H
                qm = rm[:, None] & qcm[None, :]
                p = PRE + r2 * s_pb + t * s_pt + gcols[None, :]
                acc = tl.load(p, mask=qm, other=0.0).to(tl.float32)
                if step > 0:
                    for k in range(0, H, BLOCK_K):
                        s, ks, km = _wait_state(HID + (t - 1) * s_ht, rows, rm, s_hb, k, H, BLOCK_K,
                                                SENTINEL, BITS, SPIN_LIMIT)
                        w = tl.load(W + ks[:, None] * s_wk + gcols[None, :], mask=km[:, None] & qcm[None, :], other=0.0)
                        acc = _chunk_dot(acc, s, w, PRECISION, DOT_F32)
                    # stored in the dtype, and the gates take the stored (rounded) values, as step by step
                    acc = acc.to(PRE.dtype.element_ty)
                    tl.store(p, acc, mask=qm)
                    acc = acc.to(tl.float32)
                a4 = tl.permute(tl.reshape(acc, [BLOCK_B, 2, 2, BLOCK_N]), (0, 3, 1, 2))  # [BB, BN, q // 2, q % 2]
                even, odd = tl.split(a4)  # q % 2 = 0: gates i, g; q % 2 = 1: f, o
                a_i, a_g = tl.split(even)
                a_f, a_o = tl.split(odd)
                ig, fg, gg, og = _sigmoid(a_i), _sigmoid(a_f), _tanh(a_g), _sigmoid(a_o)
                c = ig * gg
                if step > 0:
                    c += fg * tl.load(CELL + r2 * s_cb + (t - 1) * s_ct + c2, mask=m, other=0.0).to(tl.float32)
                tl.store(CELL + r2 * s_cb + t * s_ct + c2, c.to(CELL.dtype.element_ty), mask=m)
                tl.store(HID + r2 * s_hb + t * s_ht + c2, (og * _tanh(c)).to(HID.dtype.element_ty), mask=m)


def _lstm_loop_settings(x: Tensor, batch: int, hidden: int, backward: bool = False) -> RNNLoopSettings | None:
    """Settings of ``_lstm_loop_kernel`` for ``[batch, ·, hidden]`` on ``x``'s device and dtype (the
    RNN loop's grid, ``_rnn_loop_settings``), or None where that grid's tiles are wider than 32 × 32 (the
    gates' accumulators would leave the registers). On CUDA 8 warps and K chunks of 128, or 256 for a
    half-precision forward: the best or within 7 % of the best of the sweep on an H200 at 64 × 256
    (``bench/bench_lstm_loop.py --sweep``; bench/RESULTS.md §10 run C)."""
    st = _rnn_loop_settings(x, batch, hidden)
    if st is None or not x.is_cuda:
        return st
    if st.block_b * st.block_n > 32 * 32:
        return None
    chunk = 256 if x.dtype != float32 and not backward else 128
    return st._replace(block_k=min(max(_next_pow2(hidden), 16), chunk), num_warps=8)


def lstm_loop_uses_triton(x: Tensor, batch: int, hidden: int, backend: str | None = None) -> bool:
    """Whether the LSTM's loops on ``x``'s device and dtype at ``[batch, ·, hidden]`` run
    ``_lstm_loop_kernel``: where Triton runs (``backend`` as in ``use_triton``), ``USE_PERSISTENT_LSTM``
    is set, a grid of at most one program per SM exists (``_lstm_loop_settings``) and no launch at this
    shape has failed. Elsewhere the per-step loop runs (with ``backend="triton"``: its fused cell
    kernels, CUDA-graphed where they can be). An empty batch never does."""
    if batch == 0 or not USE_PERSISTENT_LSTM or not use_kernel(x, backend):
        return False
    return _lstm_loop_settings(x, batch, hidden) is not None and not _loop_failed("LSTM", x, batch, hidden)


def _launch_lstm_loop(pre: Tensor, cell: Tensor, weight_hh: Tensor, hidden: Tensor | None = None,
                      grad_out: Tensor | None = None, g_pre: Tensor | None = None,
                      settings: RNNLoopSettings | None = None) -> None:
    """One launch of ``_lstm_loop_kernel``: forward when ``hidden`` is given (``pre [B, T, 4H]``
    updated in place, ``cell``, ``hidden [B, T, H]`` written), else backward (``g_pre [B, T, 4H]``
    written from ``grad_out [B, T, H]``, ``pre`` and ``cell``). Every operand has unit last stride."""
    backward = hidden is None
    flags = g_pre if backward else hidden
    B, T, H = cell.shape
    named = (("pre", pre, 4 * H), ("cell", cell, H)) + (
        (("grad_out", grad_out, H), ("g_pre", g_pre, 4 * H)) if backward else (("hidden", hidden, H),))
    for name, t, width in named:
        if t.shape != (B, T, width) or t.stride(-1) != 1:
            raise ValueError(f"LSTM loop: {name} must be [B, T, {width}] = {[B, T, width]} with unit last stride, "
                             f"got {list(t.shape)} strides {t.stride()}")
    st = settings or _lstm_loop_settings(cell, B, H, backward)
    sentinel, int_dtype = _SENTINEL[flags.dtype]
    flags.view(int_dtype).fill_(sentinel)
    # Row-major K × N, as the RNN loop: forward multiplies by W_hhᵀ [H, 4H], backward by W_hh [4H, H].
    w = weight_hh.contiguous() if backward else weight_hh.t().contiguous()
    kappa = cell.new_empty(2, B, H) if backward else cell
    gout = grad_out if backward else cell
    hid = cell if backward else hidden
    grid = (-(-B // st.block_b), st.col_programs)
    args = (
        pre, cell, hid, gout, flags, kappa, w,
        pre.stride(0), pre.stride(1), cell.stride(0), cell.stride(1), hid.stride(0), hid.stride(1),
        gout.stride(0), gout.stride(1), flags.stride(0), flags.stride(1), kappa.stride(1), kappa.stride(0), w.stride(0),
        B, T, H,
    )
    _cooperative_launch(_lstm_loop_kernel, grid, args, _loop_constants(flags, st, backward), cell.is_cuda)


def lstm_forward_loop_steps(pre: Tensor, weight_hh: Tensor, cell: Tensor, hidden: Tensor, backend: str | None = None) -> None:
    """The LSTM's forward loop step by step: ``pre_t += h_{t−1} W_hhᵀ`` in place (cuBLAS), then one
    cell step (``lstm_cell``) writing ``c_t`` and ``h_t``; ``pre [B, T, 4H]``, ``cell``, ``hidden [B, T, H]``."""
    w_hh_t = weight_hh.t()
    for t in range(pre.shape[1]):
        if t > 0:  # h_0 = 0 contributes nothing
            pre[:, t].addmm_(hidden[:, t - 1], w_hh_t)
        lstm_cell(pre[:, t], cell[:, t - 1] if t > 0 else None, cell[:, t], hidden[:, t], backend=backend)


def lstm_backward_loop_steps(grad_out: Tensor, pre: Tensor, cell: Tensor, weight_hh: Tensor, g_pre: Tensor,
                             kappa: Tensor, dh_buf: Tensor, backend: str | None = None) -> None:
    """The LSTM's backward loop step by step: ``dh_t = gOut_t + gPre_{t+1} W_hh`` (cuBLAS, into
    ``dh_buf [B, H]``), then one cell step (``lstm_cell_backward``) writing ``gPre_t`` into ``g_pre
    [B, T, 4H]`` and the carry over ``kappa [B, H]``."""
    T = pre.shape[1]
    for t in range(T - 1, -1, -1):
        dh = grad_out[:, t] if t == T - 1 else addmm(grad_out[:, t], g_pre[:, t + 1], weight_hh, out=dh_buf)
        lstm_cell_backward(pre[:, t], cell[:, t], cell[:, t - 1] if t > 0 else None, dh, kappa, g_pre[:, t],
                           has_kappa=t < T - 1, backend=backend)


def lstm_forward_loop(pre: Tensor, weight_hh: Tensor, cell: Tensor, hidden: Tensor, backend: str | None = None) -> None:
    """The LSTM's forward loop (``lstm_forward_loop_steps``' numbers) in one launch of
    ``_lstm_loop_kernel`` where ``lstm_loop_uses_triton``, else step by step. ``pre [B, T, 4H]``
    (input projections and bias on entry; updated in place), ``cell``, ``hidden [B, T, H]`` written."""
    B, _, H = cell.shape
    if not lstm_loop_uses_triton(pre, B, H, backend) or not _launch_or_fallback(
            "LSTM", hidden, H, lambda: _launch_lstm_loop(pre, cell, weight_hh, hidden=hidden)):
        lstm_forward_loop_steps(pre, weight_hh, cell, hidden, _cell_backend(pre, backend))


def lstm_backward_loop(grad_out: Tensor, pre: Tensor, cell: Tensor, weight_hh: Tensor, g_pre: Tensor,
                       backend: str | None = None) -> None:
    """The LSTM's backward loop: ``gPre [B, T, 4H]`` written into ``g_pre`` from ``grad_out [B, T, H]``
    and the forward's ``pre`` and ``cell``; one launch of ``_lstm_loop_kernel`` where
    ``lstm_loop_uses_triton``, else step by step."""
    B, _, H = cell.shape
    if not lstm_loop_uses_triton(pre, B, H, backend) or not _launch_or_fallback(
            "LSTM", g_pre, H, lambda: _launch_lstm_loop(pre, cell, weight_hh, grad_out=grad_out, g_pre=g_pre)):
        lstm_backward_loop_steps(grad_out, pre, cell, weight_hh, g_pre, cell.new_empty(B, H), cell.new_empty(B, H),
                                 _cell_backend(pre, backend))


def _cell_backend(x: Tensor, backend: str | None) -> str:
    """The per-step cell's backend: the fused kernels where Triton runs, else the reference."""
    return "triton" if use_kernel(x, backend) else "reference"


# -------------------------------------------------------------------- loops under torch.compile
# While ``torch.compile`` traces, the CUDA paths above are not used as they are: the CUDA-graph cache
# needs real buffers, and a Triton kernel launched into strided views of a ``[B, T, ·]`` buffer is a
# write that Inductor must functionalise (a copy of the buffer per step unless its re-inplacing
# proves the view free); a compiled LSTM at 64×64×256×256 on an H200 ended in an illegal memory access
# (issue 36). Where the persistent loops apply, they get fresh outputs. The RNN's loop kernel is
# launched by the compiled graph's own code (``torchloom::rnn_forward_launched``, which computes the
# input projection too, and ``rnn_loop_backward_launched``: ``torch.library.triton_op``s; a plain
# launch, which the kernel's handshake makes safe), wherever ``compiled_plan`` has a plan; else, and
# for the LSTM, whose kernel has no handshake, they run behind opaque operators
# (``torchloom::rnn_forward`` / ``rnn_loop_backward``; ``torchloom::lstm_loop`` / ``lstm_loop_backward``)
# whose eager launchers start the kernels cooperatively at run time. Where the LSTM's loop kernel does not apply but its
# fused cell kernels would, the loop is unrolled from fresh tensors instead (``*_unrolled``: the
# formulas of ``lstm_cell_values`` / ``lstm_cell_backward_values``, which the references also use,
# written as PyTorch ops that Inductor fuses into one kernel per step, stacked at the end). On the CPU
# and in float64 the reference loops (PyTorch ops only) are traced as they are.


def lstm_forward_loop_unrolled(proj: Tensor, weight_hh: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The LSTM's forward loop from fresh tensors (for ``torch.compile``): ``proj [B, T, 4H]`` (input
    projections and bias) → ``(pre [B, T, 4H], cell, hidden [B, T, H])``; ``proj`` is not written."""
    w_hh_t = weight_hh.t()
    pres, cells, hiddens = [], [], []
    c = h = None
    for t in range(proj.shape[1]):
        p = proj[:, t] if t == 0 else addmm(proj[:, t], h, w_hh_t)
        c, h = lstm_cell_values(p, c)
        pres.append(p)
        cells.append(c)
        hiddens.append(h)
    return stack(pres, 1), stack(cells, 1), stack(hiddens, 1)


def lstm_backward_loop_unrolled(grad_out: Tensor, pre: Tensor, cell: Tensor, weight_hh: Tensor) -> Tensor:
    """The LSTM's backward loop from fresh tensors (for ``torch.compile``): ``gPre [B, T, 4H]`` from
    ``grad_out [B, T, H]`` and the forward's ``pre`` and ``cell``."""
    T = pre.shape[1]
    g_pres: list = [None] * T
    kappa = None
    for t in range(T - 1, -1, -1):
        dh = grad_out[:, t] if t == T - 1 else addmm(grad_out[:, t], g_pres[t + 1], weight_hh)
        g_pres[t], kappa = lstm_cell_backward_values(pre[:, t], cell[:, t], cell[:, t - 1] if t > 0 else None, dh, kappa)
    return stack(g_pres, 1)


def replay_key(name: str) -> tuple:
    """``_replay.run``'s key for the recurrent operator ``name``: what its Python decides from besides
    its operands' layouts: PyTorch's two product switches, this module's settings and ``fp32_matmul``'s
    rounding switch (the benchmarks' A/B switches), and the shapes whose loops failed to launch. Tile
    sizes and split limits (``fp32_matmul._BLOCK_*``, ``_MAX_SPLIT``...) are assumed fixed: a sweep
    that changes them calls ``_replay.clear_programs()``."""
    from . import fp32_matmul  # its switch as it is now (eager code: no compiled graph reads this)

    return (name, _rnn_allows_tf32(), cublas_allows_tf32(), USE_PERSISTENT_RNN, USE_PERSISTENT_LSTM, _RNN_W_RESIDENT,
            _RNN_W_IN_PLACE, _FP32_PRODUCT, _RNN_MAX_HIDDEN, _SPIN_LIMIT, _cooperative[0], frozenset(_failed),
            fp32_matmul._ROUND)


def _rnn_forward_eager(x2: Tensor, w_ih_t: Tensor, bias: Tensor | None, weight_hh: Tensor, batch: int, steps: int,
                       backend: str | None) -> tuple[Tensor, Tensor]:
    with autocast_off(x2.device.type):  # as ``_recurrent_mm_eager``
        return _replay.run(replay_key("rnn_forward"), rnn_projected_forward, (x2, w_ih_t, bias, weight_hh, batch, steps, backend))


def _rnn_loop_backward(grad_out: Tensor, weight_hh: Tensor, hidden: Tensor, backend: str | None) -> Tensor:
    hidden = hidden.contiguous()
    g_pre = empty_like(hidden)
    rnn_backward_loop(grad_out.contiguous(), weight_hh, hidden, g_pre, backend)
    return g_pre


def _rnn_loop_backward_eager(grad_out: Tensor, weight_hh: Tensor, hidden: Tensor, backend: str | None) -> Tensor:
    return _replay.run(replay_key("rnn_loop_backward"), _rnn_loop_backward, (grad_out, weight_hh, hidden, backend))


def _lstm_loop(proj: Tensor, weight_hh: Tensor, backend: str | None) -> tuple[Tensor, Tensor]:
    # the loop updates the pre-activations in place: in ``proj`` itself, or in a contiguous copy
    # written back where ``proj`` has another layout
    pre = proj if proj.is_contiguous() else proj.contiguous()
    B, T, H4 = pre.shape
    cell, hidden = pre.new_empty(B, T, H4 // 4), pre.new_empty(B, T, H4 // 4)
    lstm_forward_loop(pre, weight_hh, cell, hidden, backend)
    if pre is not proj:
        proj.copy_(pre)
    return cell, hidden


def _lstm_loop_eager(proj: Tensor, weight_hh: Tensor, backend: str | None) -> tuple[Tensor, Tensor]:
    return _replay.run(replay_key("lstm_loop"), _lstm_loop, (proj, weight_hh, backend))


def _lstm_loop_backward(grad_out: Tensor, pre: Tensor, cell: Tensor, weight_hh: Tensor, backend: str | None) -> Tensor:
    pre = pre.contiguous()
    g_pre = empty_like(pre)
    lstm_backward_loop(grad_out.contiguous(), pre, cell.contiguous(), weight_hh, g_pre, backend)
    return g_pre


def _lstm_loop_backward_eager(grad_out: Tensor, pre: Tensor, cell: Tensor, weight_hh: Tensor, backend: str | None) -> Tensor:
    return _replay.run(replay_key("lstm_loop_backward"), _lstm_loop_backward, (grad_out, pre, cell, weight_hh, backend))


def _register_loop_ops():
    """The persistent loops as opaque operators with fresh (contiguous) outputs: ``((rnn_forward,
    rnn_loop_backward), (lstm_loop, lstm_loop_backward))``. The RNN's forward operator takes the input
    and computes the projection itself (``rnn_projected_forward``: the projection also writes the loop's
    sentinel flags, where it is ``fp32_matmul``'s). The LSTM's forward loop is declared to write
    ``proj`` (the input projections become the pre-activations in place, as eagerly): Inductor then
    lets it write the projection's own buffer, which nothing else reads, where a copy of it cost a
    16 MB device copy per compiled LSTM step at B = 64, T = 64, H = 256 in float32."""
    op = lambda name, fn, mutates=(): torch.library.custom_op(f"torchloom::{name}", fn, mutates_args=mutates)  # noqa: E731
    rnn = op("rnn_forward", _rnn_forward_eager), op("rnn_loop_backward", _rnn_loop_backward_eager)
    lstm = op("lstm_loop", _lstm_loop_eager, ("proj",)), op("lstm_loop_backward", _lstm_loop_backward_eager)

    def rnn_fake(x2, w_ih_t, bias, weight_hh, batch, steps, backend):
        return x2.new_empty(batch, steps, w_ih_t.shape[1]), x2.new_empty(batch, steps, w_ih_t.shape[1])

    rnn[0].register_fake(rnn_fake)
    rnn[1].register_fake(lambda grad_out, weight_hh, hidden, backend: hidden.new_empty(hidden.shape))

    def lstm_fake(proj, weight_hh, backend):
        B, T, H4 = proj.shape
        return proj.new_empty(B, T, H4 // 4), proj.new_empty(B, T, H4 // 4)

    lstm[0].register_fake(lstm_fake)
    lstm[1].register_fake(lambda grad_out, pre, cell, weight_hh, backend: pre.new_empty(pre.shape))
    return rnn, lstm


_RNN_OPS, _LSTM_OPS = _register_loop_ops()


def _rnn_forward_launched(x2: Tensor, w_ih_t: Tensor, bias: Tensor | None, weight_hh: Tensor, batch: int,
                          steps: int, precision: str, products: str | None) -> tuple[Tensor, Tensor]:
    H = w_ih_t.shape[1]
    hidden = x2.new_empty(batch, steps, H)
    if products is None:  # cuBLAS
        pre = mm(x2, w_ih_t) if bias is None else addmm(bias, x2, w_ih_t)
        filled = False
    else:  # fp32_matmul, which also writes the loop's sentinel
        pre = _projection_filling(x2, w_ih_t, bias, hidden, products, traced=True)
        filled = True
    pre = pre.view(batch, steps, H)
    _launch_rnn_loop(hidden, pre, pre, weight_hh, False, filled=filled, precision=precision, traced=True)
    return pre, hidden


def _rnn_loop_backward_launched(grad_out: Tensor, weight_hh: Tensor, hidden: Tensor, precision: str) -> Tensor:
    g_pre = empty_like(hidden)
    _launch_rnn_loop(g_pre, grad_out, hidden, weight_hh, True, precision=precision, traced=True)
    return g_pre


def recurrent_grads_mm_many(g_pre: Tensor, x: Tensor, hidden: Tensor, weight_ih: Tensor, has_bias: bool,
                          needs_input_grad: bool, precision: str, backend: str | None = None, traced: bool = False
                          ) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """``layers.rnn.recurrent_grads`` (``(dx [B, T, I] or None, dW_ih [G, I], dW_hh [G, H], db [G] or
    None)`` from ``g_pre [B, T, G]``, ``x [B, T, I]``, ``hidden [B, T, H]``, ``weight_ih [G, I]``) in
    ``fp32_matmul.mm_many``'s one launch (and one summing its K splits), in ``precision`` (``traced``:
    launched through ``torch.library.wrap_triton``)."""
    B, T, G = g_pre.shape
    g2, x2 = g_pre.reshape(B * T, G), x.reshape(B * T, x.shape[-1])
    products = [Product(g2.t(), x2, row_sums=has_bias), Product(g_pre[:, 1:].permute(2, 0, 1), hidden[:, :-1])]
    if needs_input_grad:
        products.append(Product(g2, weight_ih))
    (dw_ih, db), (dw_hh, _), *dx = fp32_mm_many(products, precision, backend, traced=traced)
    return (dx[0][0].view(B, T, x.shape[-1]) if dx else None), dw_ih, dw_hh, db


def _recurrent_grads_launched(g_pre: Tensor, x: Tensor, hidden: Tensor, weight_ih: Tensor, has_bias: bool,
                              needs_input_grad: bool, precision: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, dw_ih, dw_hh, db = recurrent_grads_mm_many(g_pre, x, hidden, weight_ih, has_bias, needs_input_grad, precision,
                                                 traced=True)
    return (g_pre.new_empty(0) if dx is None else dx), dw_ih, dw_hh, (g_pre.new_empty(0) if db is None else db)


if triton is not None and hasattr(torch.library, "triton_op"):  # else ``compiled_plan`` never routes here
    # the operators, as the traced code calls them
    _RNN_FORWARD_LAUNCHED = triton_operator("torchloom::rnn_forward_launched", _rnn_forward_launched)
    _RNN_LOOP_BACKWARD_LAUNCHED = triton_operator("torchloom::rnn_loop_backward_launched", _rnn_loop_backward_launched)
    _RECURRENT_GRADS_LAUNCHED = triton_operator("torchloom::recurrent_grads_launched", _recurrent_grads_launched)
else:
    _RNN_FORWARD_LAUNCHED = _RNN_LOOP_BACKWARD_LAUNCHED = _RECURRENT_GRADS_LAUNCHED = None


def rnn_forward_traced(x2: Tensor, w_ih_t: Tensor, bias: Tensor | None, weight_hh: Tensor, batch: int, steps: int,
                       backend: str | None = None) -> tuple[Tensor, Tensor]:
    """The RNN's forward for ``torch.compile`` (where ``rnn_loop_uses_triton``), ``x2 [B·T, I]`` →
    ``(pre, hidden [B, T, H])``: the input projection, then the persistent loop kernel.

    Where ``compiled_plan`` has a plan: ``torchloom::rnn_forward_launched`` (``torch.library.triton_op``):
    Inductor sees the projection as a cuBLAS call, or launches ``fp32_matmul``'s kernel where the plan
    names a precision for the products, and launches the loop kernel from its own code, plainly (the kernel's handshake covers the cooperative
    launch it cannot make). Else the opaque ``torchloom::rnn_forward`` (``rnn_projected_forward`` at run
    time, replayed)."""
    plan = compiled_plan(x2)
    if plan is None:
        return _RNN_OPS[0](x2, w_ih_t, bias, weight_hh, batch, steps, backend)
    return _RNN_FORWARD_LAUNCHED(x2, w_ih_t, bias, weight_hh, batch, steps, *plan)


def rnn_backward_loop_traced(grad_out: Tensor, weight_hh: Tensor, hidden: Tensor, backend: str | None = None) -> Tensor:
    """The RNN's backward loop for ``torch.compile`` (where ``rnn_loop_uses_triton``): ``gPre [B, T, H]``
    from ``torchloom::rnn_loop_backward_launched`` (the kernel launched by Inductor's code, as in
    ``rnn_forward_traced``), or from the opaque ``torchloom::rnn_loop_backward`` where ``compiled_plan``
    has none."""
    plan = compiled_plan(hidden)
    if plan is None:
        return _RNN_OPS[1](grad_out, weight_hh, hidden, backend)
    return _RNN_LOOP_BACKWARD_LAUNCHED(grad_out, weight_hh, hidden, plan[0])


def lstm_forward_loop_traced(proj: Tensor, weight_hh: Tensor, backend: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The LSTM's forward loop for ``torch.compile`` (where ``lstm_loop_uses_triton``): one call
    of the opaque ``torchloom::lstm_loop``, ``proj [B, T, 4H]`` (input projections and bias) →
    ``(pre [B, T, 4H], cell, hidden [B, T, H])``, ``pre`` being ``proj`` itself, written."""
    return (proj, *_LSTM_OPS[0](proj, weight_hh, backend))


def lstm_backward_loop_traced(grad_out: Tensor, pre: Tensor, cell: Tensor, weight_hh: Tensor, backend: str | None = None) -> Tensor:
    """The LSTM's backward loop for ``torch.compile`` (where ``lstm_loop_uses_triton``):
    ``gPre [B, T, 4H]`` from one call of the opaque ``torchloom::lstm_loop_backward``."""
    return _LSTM_OPS[1](grad_out, pre, cell, weight_hh, backend)
