"""Multi-head attention with RoPE and grouped-query heads, with a hand-written backward.

Shapes: ``B`` batch, ``S`` sequence, ``d`` = d_model, ``H`` query heads, ``K`` kv heads, ``G = H/K``
query heads per kv head, ``D = d/H`` head size. Input ``x [B, S, d]`` → output ``[B, S, d]``.

Forward, for every sample on its own (nothing crosses samples):

1. ``q = x W_qᵀ + b_q [B,S,H·D]``, ``k = x W_kᵀ + b_k``, ``v = x W_vᵀ + b_v [B,S,K·D]``, split into heads.
2. RoPE on ``q`` and ``k`` (rotate-half convention, as Loom and GPT-NeoX/LLaMA-HF): at position
   ``s`` (0-based inside the sample) and pair ``i < D/2`` with angle ``s · θ^(−2i/D)``, the pair
   ``(x_i, x_{i+D/2})`` is rotated: ``(x_i cos − x_{i+D/2} sin, x_i sin + x_{i+D/2} cos)``.
3. Query head ``h`` uses kv head ``h // G``. The ``G`` query heads of one group are stacked along
   the rows, ``q [B, K, G·S, D]``, so one batched product ``q kᵀ`` serves the whole group.
4. ``P = softmax(q kᵀ / √D)`` over the keys, with keys after the query masked out when causal.
5. ``o = P v``, heads merged back to ``[B, S, d]`` (Loom's pre-activation), ``y = o W_oᵀ + b_o``.

Backward (the same steps in reverse):

    dW_o = gyᵀ o, db_o = Σ gy, do = gy W_o
    dP = do vᵀ,  dv = Pᵀ do              (dv sums over the G query heads sharing the kv head)
    dS = P ⊙ (dP − ⟨dP, P⟩) / √D         (softmax backward; masked entries have P = 0)
    dq = dS k,   dk = dSᵀ q              (dk sums over the group too)
    RoPE backward = rotation by −angle (a rotation's transpose is its inverse)
    dW_{q,k,v} = d{q,k,v}ᵀ x, db = Σ d{q,k,v},  dx = dq W_q + dk W_k + dv W_v

On CUDA (float32/float16/bfloat16, head size ≤ 128) the flash path runs: q, k and v come from one
fused product, RoPE is applied in place, and only the softmax's log-sum-exp per query is saved, so
memory is linear in S; the backward recomputes P block by block (same formulas as above). Its core,
softmax(q kᵀ/√D) v and that backward, is the fused kernel PyTorch's ``F.scaled_dot_product_attention``
would pick for the same q, k, v (FlashAttention-2, the memory-efficient kernel or cuDNN's, following
the ``torch.backends.cuda`` switches), called as separate forward and backward operators; where none
applies (grouped heads in float32, or all disabled) and with ``backend="triton"``, the Triton kernel
of ``torchloom.kernels.flash_attention``. Elsewhere (CPU, float64) the materialised path above runs.
Under ``torch.compile``, where PyTorch's fused kernel serves the core and the sequence length and width
are static, the flash path is traced: the compiled graph calls that kernel's ATen operators directly,
with RoPE as pointwise ops Inductor fuses, as for PyTorch's own projections + RoPE + SDPA (also where
Triton is absent, whose eager layer runs the materialised path there). Elsewhere (the Triton kernel;
a symbolic sequence length or width, as under ``dynamic=True``) its core (RoPE, the kernel, and their
backward) runs behind two opaque operators, ``torch.ops.torchloom.flash_attention_core`` and
``flash_attention_core_backward``, which launch the very kernels of an eager layer.

Mixed precision: under ``torch.autocast`` the input and the parameters are cast to the autocast
dtype, the layer computes in it (softmax statistics in float32) and the gradients come back in the
input's and parameters' own dtypes; bfloat16/float16 parameters work as they are. Outside autocast an
input whose dtype differs from the parameters' is a ``TypeError``. Not supported, each failing with a
``RuntimeError``: double backward (``create_graph=True``), ``torch.func`` transforms (``vmap``,
``grad``...: the Function has no ``setup_context``) and ``torch.jit.script``;
``torch.func.functional_call`` works.

Loom's code keeps keys and values in a KV cache that spans the batch, so sample ``b`` attends to the
samples before it and its RoPE positions continue from theirs: not replicated. The
softmax runs in the fused kernels of ``torchloom.kernels.softmax`` on CUDA.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, arange, cat, empty, float32, float64, is_tensor, matmul, mm, nn, no_grad
from torch.compiler import is_compiling

from .base import (
    column_sum, linear_2d, mm_sum, output_view, Layer, autocast_off, cast_for_autocast, check_dtype, dispatch_mode_active, forbid_double_backward,
)
from .rope import rope_rotate, rope_rotate_inverse, rope_tables

__all__ = [
    "MultiHeadAttention", "MultiHeadAttentionFunction", "AttentionSpec", "AttentionSaved", "FlashAttentionSaved",
    "SdpaAttentionSaved",
    "multi_head_attention", "attention_forward", "attention_backward",
    "rope_tables", "rope_rotate", "rope_rotate_inverse",
]


@dataclass(frozen=True)
class AttentionSpec:
    """The attention's fixed settings: head counts, causal mask, RoPE on/off and its base θ.
    (A dataclass, not a tuple, so autograd and gradcheck treat it as one opaque argument.)"""

    num_heads: int
    num_kv_heads: int
    causal: bool
    rope: bool
    rope_theta: float
    backend: str | None = None  # None: on CUDA the flash path with PyTorch's fused kernel (else the Triton
    # kernel), the materialised path elsewhere; "triton": the flash path with the Triton kernel (on CPU
    # through Triton's interpreter); "reference": materialised


# ------------------------------------------------------------------------------------------ RoPE
_ROPE_CACHE: dict[tuple, tuple[Tensor, Tensor]] = {}  # (S, D, θ, device, dtype, stream) → (cos, sin)
_ROPE_CACHE_BYTES = 64 << 20  # the tables kept, in all (oldest dropped first)
_ROPE_PINNED: set = set()  # keys of kept tables a CUDA graph captured: never dropped (the graph reads them)
_ROPE_LOCK = threading.Lock()


def _rope_tables_kept(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``rope_tables``, made once per ``(S, D, θ, device, dtype)`` and current CUDA stream, then kept
    (64 MB of tables in all, the oldest dropped first): a step's forward and backward each need them,
    and making them is ~9 small kernels of host launch time per call. Read only on the stream that made
    them (their kernels are ordered before every later use) and never written. During a CUDA graph
    capture, tables kept for the capturing stream (made on it before the capture began) are read and
    pinned: never dropped from then on, since a graph holds their address (pinned tables stay for the
    process, one pair per captured (S, D, θ, dtype, stream), and may take the store past its budget:
    2 × S × D/2 × 4 bytes each, 0.5 MB at S = 2,048, D = 64); tables the store does not
    hold are made in the capture (from the graph's own pool: ~30 µs of sin/cos and copy kernels in every
    replay of an attention step, 4 % of a bfloat16 step at S = 2,048 on an H200) and not kept. The store is
    neither read nor filled under a ``TorchDispatchMode`` such as fake-tensor tracing (its tensors are
    not real ones), nor while ``torch.compile`` traces the materialised path: there the tables are made
    by the compiled graph itself (its own tensors, no host-side store or lock inside the traced
    region). The flash path's opaque operators (``_flash_core``, ``_flash_core_backward``, where a
    compiled layer runs them) are called with real tensors at run time, so they read and fill the
    store as eager calls do; the traced flash path's tables are constants of its graph
    (``_traced_attention.rope_constants``)."""
    if is_compiling() or dispatch_mode_active():
        return rope_tables(seq_len, head_dim, theta, device, dtype)
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    key = (seq_len, head_dim, theta, device, dtype, stream)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        with _ROPE_LOCK:
            kept = _ROPE_CACHE.get(key)
            if kept is not None:
                _ROPE_PINNED.add(key)
        return kept if kept is not None else rope_tables(seq_len, head_dim, theta, device, dtype)
    kept = _ROPE_CACHE.get(key)
    if kept is not None:
        return kept
    with torch.inference_mode(False), no_grad():  # plain tensors, whatever the caller's mode
        tables = rope_tables(seq_len, head_dim, theta, device, dtype)
    size = _nbytes(tables)
    if size > _ROPE_CACHE_BYTES:  # larger than the whole store: made each time, the kept ones stay
        return tables
    with _ROPE_LOCK:
        kept = _ROPE_CACHE.get(key)
        if kept is not None:  # another thread made them meanwhile (and a capture may have pinned them)
            return kept
        droppable = [k for k in _ROPE_CACHE if k not in _ROPE_PINNED]  # oldest first
        while droppable and size + sum(map(_nbytes, _ROPE_CACHE.values())) > _ROPE_CACHE_BYTES:
            _ROPE_CACHE.pop(droppable.pop(0))
        _ROPE_CACHE[key] = tables
    return tables


def _nbytes(tables: tuple[Tensor, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tables)


# ------------------------------------------------------------------------------- forward/backward
class AttentionSaved(NamedTuple):
    """What the backward needs. ``q [B,K,G·S,D]`` and ``k [B,K,S,D]`` after RoPE, ``v [B,K,S,D]``,
    ``probs [B,K,G·S,S]``, ``pre [B,S,d]`` (the merged heads before the output projection, Loom's
    pre-activation), the input, the four weights, whether there are biases and the spec."""

    input: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    probs: Tensor
    pre: Tensor
    q_weight: Tensor
    k_weight: Tensor
    v_weight: Tensor
    o_weight: Tensor
    has_bias: bool
    spec: AttentionSpec
    param_dtype: torch.dtype | None = None  # the parameters' dtype when autocast cast them (grads come back in it)


class FlashAttentionSaved(NamedTuple):
    """What the flash path's backward needs (no ``[S, S]`` tensor): the input ``[B, S, d]``, ``qkv
    [B·S, (H + 2K)·D]`` (the fused q|k|v projection, q and k after RoPE), ``lse [B, H, S]`` float32
    (the softmax's log-sum-exp per query), ``pre [B, S, d]`` (attention output before the output
    projection), ``w_qkv [(H + 2K)·D, d]`` (the three input weights stacked), ``o_weight``, whether
    there are biases, the spec and the parameters' dtype when autocast cast them."""

    input: Tensor
    qkv: Tensor
    lse: Tensor
    pre: Tensor
    w_qkv: Tensor
    o_weight: Tensor
    has_bias: bool
    spec: AttentionSpec
    param_dtype: torch.dtype | None = None


class SdpaAttentionSaved(NamedTuple):
    """What the backward of the flash path as ``torch.compile`` traces it needs (``_traced_forward``): the
    input ``[B, S, d]``, ``qk [B, S, H+K, D]`` (q heads | k heads, after RoPE), ``v [B, S, K, D]``, ``o [B,
    S, H, D]`` (the attention output before the output projection, Loom's pre-activation) in the fused
    kernel's layout, the kernel's own ``lse``, ``seed`` and ``offset`` (``flash_attention.sdpa_forward_raw``),
    ``w_qk [(H+K)·D, d]`` (the q and k weights stacked), ``v_weight``, ``o_weight``, whether there are
    biases, the spec, the kernel (``flash_attention.SDPA_*``) and the parameters' dtype when autocast
    cast them."""

    input: Tensor
    qk: Tensor
    v: Tensor
    o: Tensor
    lse: Tensor
    seed: Tensor
    offset: Tensor
    w_qk: Tensor
    v_weight: Tensor
    o_weight: Tensor
    has_bias: bool
    spec: AttentionSpec
    choice: int
    param_dtype: torch.dtype | None = None


def _causal_mask(seq_len: int, groups: int, device) -> Tensor:
    """``[G·S, S]`` bool, True where key ``j`` comes after the query's position ``r mod S``."""
    pos = arange(seq_len, device=device)
    return (pos[None, :] > pos[:, None]).repeat(groups, 1)


def attention_forward(
    x: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    v_weight: Tensor,
    o_weight: Tensor,
    q_bias: Tensor | None,
    k_bias: Tensor | None,
    v_bias: Tensor | None,
    o_bias: Tensor | None,
    spec: AttentionSpec,
) -> tuple[Tensor, AttentionSaved]:
    """``x [B, S, d]`` → ``(y [B, S, d], saved)``. Biases: all four or none. No autograd.

    With ``spec.backend`` None on CUDA (float32/16/bfloat16, head size ≤ 128) or ``"triton"``, the
    flash path: one fused q|k|v product, RoPE in place, the flash-attention kernel (memory linear in
    S), ``saved`` a ``FlashAttentionSaved``. While ``torch.compile`` traces, where PyTorch's fused
    kernel serves it, the traced flash path (``_traced_forward``; ``saved`` a ``SdpaAttentionSaved``).
    Otherwise the materialised path (``AttentionSaved``)."""
    if is_compiling():  # before _use_flash: the traced core needs no Triton
        choice = _traced_choice(x, spec)
        if choice is not None:
            return _traced_forward(x, q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias, spec, choice)
    if _use_flash(x, spec):
        return _flash_forward(x, q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias, spec)
    b, s, d = x.shape
    h, kv = spec.num_heads, spec.num_kv_heads
    hd, g = d // h, h // kv
    x2 = x.reshape(b * s, d)
    q = linear_2d(x2, q_weight, q_bias).view(b, s, h, hd).transpose(1, 2)  # [B,H,S,D]
    k = linear_2d(x2, k_weight, k_bias).view(b, s, kv, hd).transpose(1, 2)  # [B,K,S,D]
    v = linear_2d(x2, v_weight, v_bias).view(b, s, kv, hd).transpose(1, 2).contiguous()
    if spec.rope:
        cos, sin = _rope_tables_kept(s, hd, spec.rope_theta, x.device, x.dtype)
        q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
    q = q.reshape(b, kv, g * s, hd)  # query heads h = kv·G + j → group kv, rows j·S … j·S+S−1
    k = k.contiguous()
    scores = matmul(q, k.transpose(-1, -2))  # [B,K,G·S,S], unscaled: the softmax divides by √D
    if spec.causal:
        scores.masked_fill_(_causal_mask(s, g, x.device), float("-inf"))
    from ..kernels.softmax import softmax  # here: the kernels import Triton (see norm.py)

    probs = softmax(scores, math.sqrt(hd))
    o = matmul(probs, v)  # [B,K,G·S,D]
    pre = o.view(b, h, s, hd).transpose(1, 2).reshape(b, s, d)
    y = output_view(linear_2d(pre.reshape(b * s, d), o_weight, o_bias), b, s, d)
    saved = AttentionSaved(x, q, k, v, probs, pre, q_weight, k_weight, v_weight, o_weight, q_bias is not None, spec)
    return y, saved


def attention_backward(
    grad_out: Tensor, saved: AttentionSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, ...]]:
    """Hand-written backward. Returns ``(dx or None, (dW_q, dW_k, dW_v, dW_o[, db_q, db_k, db_v, db_o]))``,
    the order of ``MultiHeadAttention.parameters()``; the parameter gradients in the parameters'
    dtype (``saved.param_dtype`` when autocast cast them)."""
    if isinstance(saved, FlashAttentionSaved):
        return _flash_backward(grad_out, saved, needs_input_grad)
    if isinstance(saved, SdpaAttentionSaved):
        return _traced_backward(grad_out, saved, needs_input_grad)
    x, q, k, v, probs, pre, q_weight, k_weight, v_weight, o_weight, has_bias, spec, param_dtype = saved
    grad_out = grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)  # no no-op .to (kernels._triton.cast)
    b, s, d = x.shape
    h, kv = spec.num_heads, spec.num_kv_heads
    hd, g = d // h, h // kv
    gy = grad_out.reshape(b * s, d)
    x2 = x.reshape(b * s, d)

    d_o_weight = mm(gy.t(), pre.reshape(b * s, d))
    d_o = mm(gy, o_weight).view(b, s, h, hd).transpose(1, 2).reshape(b, kv, g * s, hd)
    d_probs = matmul(d_o, v.transpose(-1, -2))  # [B,K,G·S,S]
    d_v = matmul(probs.transpose(-1, -2), d_o)  # [B,K,S,D], summed over the group's heads
    from ..kernels.softmax import softmax_backward

    d_scores = softmax_backward(d_probs, probs, math.sqrt(hd))
    d_q = matmul(d_scores, k).view(b, h, s, hd)
    d_k = matmul(d_scores.transpose(-1, -2), q)  # [B,K,S,D], summed over the group's heads
    if spec.rope:
        cos, sin = _rope_tables_kept(s, hd, spec.rope_theta, x.device, x.dtype)
        d_q, d_k = rope_rotate_inverse(d_q, cos, sin), rope_rotate_inverse(d_k, cos, sin)
    d_q = d_q.transpose(1, 2).reshape(b * s, d)
    d_k = d_k.transpose(1, 2).reshape(b * s, kv * hd)
    d_v = d_v.transpose(1, 2).reshape(b * s, kv * hd)

    grads: tuple[Tensor, ...] = (mm(d_q.t(), x2), mm(d_k.t(), x2), mm(d_v.t(), x2), d_o_weight)
    if has_bias:
        grads += (column_sum(d_q), column_sum(d_k), column_sum(d_v), column_sum(gy))
    dx = None
    if needs_input_grad:
        dx = mm_sum([d_q, d_k, d_v], [q_weight, k_weight, v_weight]).view(b, s, d)
    return dx, _to_param_dtype(grads, param_dtype)


def _to_param_dtype(grads: tuple[Tensor, ...], param_dtype: torch.dtype | None) -> tuple[Tensor, ...]:
    return grads if param_dtype is None else tuple(t.to(param_dtype) for t in grads)


# ------------------------------------------------------------------------------------ flash path
def _use_flash(x: Tensor, spec: AttentionSpec) -> bool:
    if spec.backend == "reference" or x.dtype == float64 and spec.backend is None:
        return False
    if spec.backend is None and not x.is_cuda:
        return False
    from ..kernels._triton import use_kernel

    hd = x.shape[-1] // spec.num_heads
    if hd > 128 or hd < 1:
        if spec.backend == "triton":
            raise ValueError(f"MultiHeadAttention: the flash kernel handles head sizes up to 128, got {hd}")
        return False
    return use_kernel(x, spec.backend)


def _flash_forward(x, q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias, spec):
    b, s, d = x.shape
    w_qkv = cat((q_weight, k_weight, v_weight))
    b_qkv = None if q_bias is None else cat((q_bias, k_bias, v_bias))
    qkv = linear_2d(x.reshape(b * s, d), w_qkv, b_qkv)  # [B·S, (H+2K)·D]
    core = _FLASH_OPS[0] if is_compiling() else _flash_core
    o, lse = core(qkv, s, spec.num_heads, spec.num_kv_heads, spec.causal, spec.rope, spec.rope_theta, spec.backend)
    pre = o.view(b, s, d)
    y = output_view(linear_2d(pre.view(b * s, d), o_weight, o_bias), b, s, d)
    return y, FlashAttentionSaved(x, qkv, lse, pre, w_qkv, o_weight, q_bias is not None, spec)


def _flash_backward(grad_out: Tensor, saved: FlashAttentionSaved, needs_input_grad: bool):
    x, qkv, lse, pre, w_qkv, o_weight, has_bias, spec, param_dtype = saved
    b, s, d = x.shape
    kd = spec.num_kv_heads * (d // spec.num_heads)
    gy = (grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)).reshape(b * s, d)
    x2 = x.reshape(b * s, d)
    d_o_weight = mm(gy.t(), pre.reshape(b * s, d))
    core = _FLASH_OPS[1] if is_compiling() else _flash_core_backward
    # dq [B·S, H·D], dk, dv [B·S, K·D], before RoPE
    dq, dk, dv = core(mm(gy, o_weight), qkv, pre, lse, s, spec.num_heads, spec.num_kv_heads, spec.causal,
                      spec.rope, spec.rope_theta, spec.backend)
    grads: tuple[Tensor, ...] = (mm(dq.t(), x2), mm(dk.t(), x2), mm(dv.t(), x2), d_o_weight)
    if has_bias:
        grads += (column_sum(dq), column_sum(dk), column_sum(dv), column_sum(gy))
    dx = None
    if needs_input_grad:  # w_qkv's rows: W_q | W_k | W_v
        dx = mm_sum([dq, dk, dv], [w_qkv[:d], w_qkv[d : d + kd], w_qkv[d + kd :]]).view(b, s, d)
    return dx, _to_param_dtype(grads, param_dtype)


# The attention core of the flash path, between the q|k|v projection and the output projection. Eager
# calls run these two functions directly; while ``torch.compile`` traces a layer the traced path below
# does not serve (the Triton kernel, symbolic shapes), the graph calls them through the opaque
# operators ``torchloom::flash_attention_core`` / ``flash_attention_core_backward`` (below), so a
# compiled layer runs the very kernels, buffers and RoPE tables of an eager one. (Traced with the
# projection's buffer written in place by RoPE and the gradients joined, as eagerly, a compiled
# bfloat16 step took 1.49× / 1.80× the device time of PyTorch's compiled one at S = 8,192 / 2,048 on an
# H200: Inductor functionalises each write into a view of ``qkv``. The traced path below writes none.)
def _heads(t: Tensor, seq_len: int, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``t [B·S, (H+2K)·D]`` as ``[B, S, H+2K, D]`` and its q ``[B,S,H,D]``, k, v ``[B,S,K,D]`` views."""
    n = num_heads + 2 * num_kv_heads
    heads = t.view(t.shape[0] // seq_len, seq_len, n, t.shape[1] // n)
    qk = num_heads + num_kv_heads
    return heads, heads[:, :, :num_heads], heads[:, :, num_heads:qk], heads[:, :, qk:]


def _flash_core(
    qkv: Tensor, seq_len: int, num_heads: int, num_kv_heads: int, causal: bool, rope: bool, rope_theta: float,
    backend: str | None,
) -> tuple[Tensor, Tensor]:
    """The flash path's attention on the fused projection ``qkv [B·S, (H+2K)·D]`` (rows ``b·S + s``,
    columns q heads | k heads | v heads, each ``D`` wide): RoPE in place on its q and k columns
    (``qkv`` is written), then the flash kernel. Returns ``(o [B,S,H,D] contiguous, lse [B,H,S]
    float32)``."""
    from ..kernels.flash_attention import flash_attention, rope_, sdpa_forward

    heads, q, k, v = _heads(qkv, seq_len, num_heads, num_kv_heads)
    if rope:
        cos, sin = _rope_tables_kept(seq_len, heads.shape[3], rope_theta, qkv.device, float32)
        rope_(heads[:, :, : num_heads + num_kv_heads], cos, sin, inverse=False, backend=backend)
    fused = _fused_kernel(q, k, v, causal, backend)
    if fused is not None:
        return sdpa_forward(fused, q, k, v, causal, 1.0 / math.sqrt(heads.shape[3]))
    return flash_attention(q, k, v, causal, backend=backend)


def _fused_kernel(q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str | None) -> int | None:
    """PyTorch's fused attention kernel for the core (``backend`` None on CUDA, where one applies:
    ``flash_attention.sdpa_choice``), else None: the Triton flash kernel."""
    from ..kernels.flash_attention import sdpa_choice

    return sdpa_choice(q, k, v, causal, 1.0 / math.sqrt(q.shape[3])) if backend is None else None


def _flash_core_backward(
    d_o: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, seq_len: int, num_heads: int, num_kv_heads: int, causal: bool,
    rope: bool, rope_theta: float, backend: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``_flash_core``: ``(dq [B·S, H·D], dk, dv [B·S, K·D])`` (fresh, contiguous; the
    gradients with respect to the projection before RoPE) from ``d_o`` and ``o`` (``B·S·H·D`` elements
    each, rows ``b·S + s``), the forward's ``qkv`` (after RoPE) and ``lse``; dq and dk are rotated back
    in place. Three tensors, not one joined ``[B·S, (H+2K)·D]``: PyTorch's fused kernels return their
    own, and a join would hold both at once (1.39× PyTorch's peak memory at S = 2,048 in float32 on an
    H200, against 1.04× apart). No input is written."""
    from ..kernels.flash_attention import flash_attention_backward, rope_, sdpa_backward

    heads, q, k, v = _heads(qkv, seq_len, num_heads, num_kv_heads)
    b, _, _, hd = heads.shape
    d_o, o = (t.reshape(b, seq_len, num_heads, hd) for t in (d_o, o))
    # Chosen again: the forward's choice where the switches are as they were then. Where they differ (an
    # ``sdpa_kernel`` context around the forward alone), another kernel's backward still fits: every
    # kernel's saved quantities are the output and the natural-log log-sum-exp per query (the tests check each
    # against float64, and a forward under every forced kernel with the backward outside it).
    fused = _fused_kernel(q, k, v, causal, backend)
    if fused is None:
        grads = tuple(empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
        flash_attention_backward(d_o, q, k, v, o, lse, causal, backend=backend, out=grads)
    else:  # gradients in the kernel's own layout: made contiguous below, by RoPE's one pass where there is one
        grads = sdpa_backward(fused, d_o, q, k, v, o, lse, causal, 1.0 / math.sqrt(hd))
    if rope:
        cos, sin = _rope_tables_kept(seq_len, hd, rope_theta, qkv.device, float32)
        rotated = []
        for t in grads[:2]:  # in place, or into a contiguous tensor in the same one pass
            dst = t if t.is_contiguous() else empty(t.shape, device=t.device, dtype=t.dtype)
            rotated.append(rope_(dst, cos, sin, inverse=True, backend=backend, src=None if dst is t else t))
        grads = (*rotated, grads[2])
    out = [t.contiguous().view(b * seq_len, -1) for t in grads]
    for i in (1, 2):  # an operator's outputs must not share memory (a kernel may hand back slices of one buffer)
        if any(out[i].untyped_storage().data_ptr() == out[j].untyped_storage().data_ptr() for j in range(i)):
            out[i] = out[i].clone()
    return tuple(out)


def _register_flash_ops():
    """``torchloom::flash_attention_core`` (``_flash_core``, declared to write ``qkv``: Inductor then
    lets it write the projection's own buffer, which nothing else reads before RoPE) and
    ``torchloom::flash_attention_core_backward`` (``_flash_core_backward``, which writes no input).
    Registered when this module is imported (~2 ms, no Triton import: the bodies import the kernels
    when they run)."""
    fwd = torch.library.custom_op("torchloom::flash_attention_core", _flash_core, mutates_args=("qkv",))
    bwd = torch.library.custom_op("torchloom::flash_attention_core_backward", _flash_core_backward, mutates_args=())

    @fwd.register_fake
    def _core_fake(qkv, seq_len, num_heads, num_kv_heads, causal, rope, rope_theta, backend):
        b, hd = qkv.shape[0] // seq_len, qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        o = qkv.new_empty(b, seq_len, num_heads, hd)
        return o, qkv.new_empty(b, num_heads, seq_len, dtype=float32)

    @bwd.register_fake
    def _core_backward_fake(d_o, qkv, o, lse, seq_len, num_heads, num_kv_heads, causal, rope, rope_theta, backend):
        hd = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        return tuple(qkv.new_empty(qkv.shape[0], n * hd) for n in (num_heads, num_kv_heads, num_kv_heads))

    return fwd, bwd


_FLASH_OPS = _register_flash_ops()


# ------------------------------------------------------------------- the flash path, traced by torch.compile
# Where PyTorch's fused kernel serves the core (``sdpa_choice``; static S and d, ``backend`` None), a
# compiled layer's flash path is traced through, as PyTorch's own projections + RoPE +
# ``F.scaled_dot_product_attention`` are: the fused kernel's forward and backward ATen operators sit in
# the compiled graph (Inductor calls them directly), RoPE and its inverse are pointwise torch ops Inductor
# fuses into one kernel each (q and k together), and the projections are plain products (q and k in one,
# their gradients' products too). Behind the opaque operators above, a compiled step paid their Python
# bodies' host time on every call (~0.6 ms each for the forward and the backward core at S = 2,048 in
# bfloat16 on an H200, of which the fused kernels' own calls took 0.13 ms: the compiled step took
# 1.4–1.7× PyTorch's compiled one, issue 36). The kernel is chosen once, while Dynamo traces
# (``_traced_attention.sdpa_choice_constant``), and kept by the graph: a later change of the
# ``torch.backends.cuda`` switches (or an ``sdpa_kernel`` context around a call) reaches a compiled layer
# only once it is compiled again (``torch._dynamo.reset()``). Elsewhere (the Triton kernel, a symbolic
# sequence length or width) the opaque operators run.
def _traced_choice(x: Tensor, spec: AttentionSpec) -> int | None:
    """The fused kernel for the traced core of ``x [B, S, d]``'s attention, or None (the opaque
    operators). The batch may be symbolic (Dynamo's recompile after a ragged last batch makes it so):
    the kernel is chosen for one sample, as the chooser's answer does not depend on the batch
    (tests/layers/test_compile_cuda.py); the sequence length and width must be plain ints."""
    from ._traced_attention import sdpa_choice_constant  # here: marking a constant imports torch._dynamo

    if spec.backend is not None or not _static(x.shape[1:]):
        return None
    _, s, d = x.shape
    hd = d // spec.num_heads
    return sdpa_choice_constant(s, spec.num_heads, spec.num_kv_heads, hd, x.dtype, x.device, spec.causal)


def _static(sizes) -> bool:
    """Whether every size is a plain int while Dynamo traces (not a symbolic one: ``dynamic=True``, or
    sizes marked dynamic after a recompile), asked without adding a guard (Dynamo reports a symbolic
    size to ``isinstance`` as an ``int``). A torch without ``has_static_value``: False (the opaque
    operators)."""
    from torch.fx.experimental import symbolic_shapes

    has_static_value = getattr(symbolic_shapes, "has_static_value", None)
    return has_static_value is not None and all(has_static_value(n) for n in sizes)


def _traced_forward(x, q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias, spec, choice):
    """The flash path as ``torch.compile`` traces it (see above): ``x [B, S, d]`` → ``(y [B, S, d],
    SdpaAttentionSaved)``. q and k come from one product (their weights stacked: one rotation kernel
    reads and writes them together), v from its own (no copy of it into a joined buffer)."""
    from ..kernels.flash_attention import sdpa_forward_raw
    from ._traced_attention import rope_constants

    b, s, d = x.shape
    h, kv = spec.num_heads, spec.num_kv_heads
    hd = d // h
    x2 = x.reshape(b * s, d)
    w_qk = cat((q_weight, k_weight))
    qk = linear_2d(x2, w_qk, None if q_bias is None else cat((q_bias, k_bias))).view(b, s, h + kv, hd)
    v = linear_2d(x2, v_weight, v_bias).view(b, s, kv, hd)
    if spec.rope:  # in float32 (the tables'), rounded once, as the eager path's RoPE kernel
        cos, sin = rope_constants(s, hd, spec.rope_theta, x.device)
        qk = rope_rotate(qk, cos, sin).to(qk.dtype)
    o, lse, seed, offset = sdpa_forward_raw(choice, qk[:, :, :h], qk[:, :, h:], v, spec.causal, 1.0 / math.sqrt(hd))
    y = output_view(linear_2d(o.reshape(b * s, d), o_weight, o_bias), b, s, d)
    saved = SdpaAttentionSaved(x, qk, v, o, lse, seed, offset, w_qk, v_weight, o_weight, q_bias is not None, spec, choice)
    return y, saved


def _traced_backward(grad_out: Tensor, saved: SdpaAttentionSaved, needs_input_grad: bool):
    """The backward of ``_traced_forward`` (``attention_backward``'s return)."""
    from ..kernels.flash_attention import sdpa_backward_raw
    from ._traced_attention import rope_constants

    x, qk, v, o, lse, seed, offset, w_qk, v_weight, o_weight, has_bias, spec, choice, param_dtype = saved
    b, s, d = x.shape
    h, kv, hd = spec.num_heads, spec.num_kv_heads, d // spec.num_heads
    kd = kv * hd
    gy = (grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)).reshape(b * s, d)
    x2 = x.reshape(b * s, d)
    d_o_weight = mm(gy.t(), o.reshape(b * s, d))
    d_o = mm(gy, o_weight).view(b, s, h, hd)
    dq, dk, dv = sdpa_backward_raw(choice, d_o, qk[:, :, :h], qk[:, :, h:], v, o, lse, seed, offset,
                                   spec.causal, 1.0 / math.sqrt(hd))
    dqk = cat((dq, dk), dim=2)  # one [B, S, H+K, D] (written by the rotation's kernel where there is one)
    if spec.rope:
        cos, sin = rope_constants(s, hd, spec.rope_theta, x.device)
        dqk = rope_rotate_inverse(dqk, cos, sin).to(dq.dtype)
    dqk, dv = dqk.reshape(b * s, d + kd), dv.reshape(b * s, kd)
    dw_qk = mm(dqk.t(), x2)  # the q and k weights' gradients in one product
    grads: tuple[Tensor, ...] = (dw_qk[:d], dw_qk[d:], mm(dv.t(), x2), d_o_weight)
    if has_bias:
        db_qk = column_sum(dqk)
        grads += (db_qk[:d], db_qk[d:], column_sum(dv), column_sum(gy))
    dx = (mm(dqk, w_qk) + mm(dv, v_weight)).view(b, s, d) if needs_input_grad else None
    return dx, _to_param_dtype(grads, param_dtype)


def _autocast_forward(x, params, spec):
    """Under ``torch.autocast`` on ``x``'s device: cast the input and parameters to the autocast dtype
    (as autocast does for ``F.linear``), run the forward with autocast off, and record the parameters'
    dtype so the backward returns their gradients in it."""
    dt, cast = cast_for_autocast(x.device.type, x, *params)
    with autocast_off(x.device.type):
        y, saved = attention_forward(*cast, spec)
    if dt is not None:
        saved = saved._replace(param_dtype=params[0].dtype)
    return y, saved


class MultiHeadAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias, spec):
        y, saved = _autocast_forward(x, (q_weight, k_weight, v_weight, o_weight, q_bias, k_bias, v_bias, o_bias), spec)
        ctx.kind = type(saved)
        n = saved._fields.index("has_bias")  # the tensors; has_bias and the fields after it kept on ctx
        ctx.save_for_backward(*saved[:n])
        ctx.extra = tuple(saved[n:])
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("MultiHeadAttention")
        saved = ctx.kind(*ctx.saved_tensors, *ctx.extra)
        with autocast_off(grad_out.device.type):
            dx, grads = attention_backward(grad_out.contiguous(), saved, ctx.needs_input_grad[0])
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        biases = grads[4:] if ctx.extra[0] else (None,) * 4
        return (dx, *grads[:4], *biases, None)


def multi_head_attention(
    x: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    v_weight: Tensor,
    o_weight: Tensor,
    q_bias: Tensor | None = None,
    k_bias: Tensor | None = None,
    v_bias: Tensor | None = None,
    o_bias: Tensor | None = None,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = True,
    rope: bool = True,
    rope_theta: float = 10000.0,
    backend: str | None = None,
) -> Tensor:
    """Functional multi-head attention on ``x [B, S, d]`` (weights as ``MultiHeadAttention``'s);
    differentiable through the hand-written backward. Biases: all four or none. ``backend``: None
    (on CUDA the flash path on the fused kernel PyTorch's SDPA would pick, else the Triton kernel; the
    materialised softmax elsewhere), ``"triton"`` (the flash path on the Triton kernel; on CPU through
    Triton's interpreter) or ``"reference"`` (materialised)."""
    biases = (q_bias, k_bias, v_bias, o_bias)
    if any(t is None for t in biases) and not all(t is None for t in biases):
        raise ValueError("multi_head_attention: pass all four biases (q, k, v, o) or none of them")
    if backend not in (None, "triton", "reference"):
        raise ValueError(f"multi_head_attention: backend must be None, 'triton' or 'reference', got {backend!r}")
    for name, t in (("k_weight", k_weight), ("v_weight", v_weight), ("o_weight", o_weight), *zip(("q_bias", "k_bias", "v_bias", "o_bias"), biases)):
        if t is not None and t.dtype != q_weight.dtype:
            raise TypeError(f"multi_head_attention: {name} has dtype {t.dtype} but q_weight has {q_weight.dtype}; all parameters must share one dtype")
    check_dtype(x, "input", q_weight.dtype, "multi_head_attention")
    spec = AttentionSpec(num_heads, num_heads if num_kv_heads is None else num_kv_heads, causal, rope, float(rope_theta), backend)
    return MultiHeadAttentionFunction.apply(x, q_weight, k_weight, v_weight, o_weight, *biases, spec)


# ------------------------------------------------------------------------------------------ module
def _positive_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"MultiHeadAttention: {name} must be a positive int, got {v!r}")


class MultiHeadAttention(Layer):
    """Per-sample multi-head self-attention with RoPE and grouped-query heads (see the module doc).

    Args:
        d_model: model width ``d``; must be divisible by ``num_heads`` (head size ``D = d/H``).
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``K`` (default ``H``); ``H`` must be divisible by it, and each
            group of ``H/K`` consecutive query heads shares one kv head.
        causal: mask keys after the query (default True).
        rope: rotary position embedding on q and k (default True; needs an even head size).
        bias: learnable biases on the four projections (default True).
        rope_theta: RoPE base θ (default 10000, Loom's).

    Parameters (in this order): ``q_weight [d, d]``, ``k_weight [K·D, d]``, ``v_weight [K·D, d]``,
    ``o_weight [d, d]``, then ``q_bias [d]``, ``k_bias [K·D]``, ``v_bias [K·D]``, ``o_bias [d]`` (Loom's
    storage order). Weights start at ``N(0, 1/fan_in)``, biases at 0.

    Shapes: input ``[batch, seq, d_model]`` → output ``[batch, seq, d_model]``.
    """

    kernel_modules = ("torchloom.kernels.softmax", "torchloom.kernels.flash_attention")

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        causal: bool = True,
        rope: bool = True,
        bias: bool = True,
        rope_theta: float = 10000.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _positive_int("d_model", d_model)
        _positive_int("num_heads", num_heads)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        _positive_int("num_kv_heads", num_kv_heads)
        if d_model % num_heads:
            raise ValueError(f"MultiHeadAttention: d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"MultiHeadAttention: num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
            )
        for name, flag in (("causal", causal), ("rope", rope), ("bias", bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"MultiHeadAttention: {name} must be a bool, got {flag!r}")
        head_dim = d_model // num_heads
        if rope and head_dim % 2:
            raise ValueError(
                f"MultiHeadAttention: rope=True needs an even head size d_model/num_heads, got "
                f"{d_model}/{num_heads} = {head_dim}"
            )
        theta_ok = isinstance(rope_theta, (int, float)) and not isinstance(rope_theta, bool) and math.isfinite(rope_theta)
        if not theta_ok or rope_theta <= 0:
            raise ValueError(f"MultiHeadAttention: rope_theta must be a finite number > 0, got {rope_theta!r}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.spec = AttentionSpec(num_heads, num_kv_heads, causal, rope, float(rope_theta))
        kv_dim = num_kv_heads * head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_weight = nn.Parameter(empty(d_model, d_model, **factory))
        self.k_weight = nn.Parameter(empty(kv_dim, d_model, **factory))
        self.v_weight = nn.Parameter(empty(kv_dim, d_model, **factory))
        self.o_weight = nn.Parameter(empty(d_model, d_model, **factory))
        if bias:
            self.q_bias = nn.Parameter(empty(d_model, **factory))
            self.k_bias = nn.Parameter(empty(kv_dim, **factory))
            self.v_bias = nn.Parameter(empty(kv_dim, **factory))
            self.o_bias = nn.Parameter(empty(d_model, **factory))
        else:
            self.q_bias = self.k_bias = self.v_bias = self.o_bias = None
        self.reset_parameters()

    @property
    def causal(self) -> bool:
        return self.spec.causal

    @property
    def rope(self) -> bool:
        return self.spec.rope

    @property
    def rope_theta(self) -> float:
        return self.spec.rope_theta

    def reset_parameters(self) -> None:
        with no_grad():
            for w in (self.q_weight, self.k_weight, self.v_weight, self.o_weight):
                w.normal_(0.0, 1.0 / math.sqrt(w.shape[1]))
            for b in (self.q_bias, self.k_bias, self.v_bias, self.o_bias):
                if b is not None:
                    b.zero_()

    def _check(self, x: Tensor) -> None:
        if not is_tensor(x):
            raise TypeError(f"{self!r}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.d_model or x.shape[1] < 1:
            raise ValueError(
                f"MultiHeadAttention(d_model={self.d_model}): input must have shape "
                f"[batch, seq, {self.d_model}], got {list(x.shape)}"
            )
        check_dtype(x, "input", self.q_weight.dtype, f"MultiHeadAttention(d_model={self.d_model})")

    def _params(self) -> tuple[Tensor | None, ...]:
        return (
            self.q_weight, self.k_weight, self.v_weight, self.o_weight,
            self.q_bias, self.k_bias, self.v_bias, self.o_bias,
        )

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return MultiHeadAttentionFunction.apply(x, *self._params(), self.spec)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, AttentionSaved | FlashAttentionSaved | SdpaAttentionSaved]:
        self._check(x)
        return _autocast_forward(x, self._params(), self.spec)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        with autocast_off(grad_out.device.type):
            return attention_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"d_model={self.d_model}, num_heads={s.num_heads}, num_kv_heads={s.num_kv_heads}, "
            f"causal={s.causal}, rope={s.rope}, bias={self.q_bias is not None}, rope_theta={s.rope_theta}"
        )
