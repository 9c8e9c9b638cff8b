"""The constants of attention's traced flash path under ``torch.compile`` (``layers.attention``): the
fused kernel it calls and RoPE's tables, each made once while Dynamo traces and kept by the compiled
graph. Imported only then (``torch.compiler.assume_constant_result`` imports ``torch._dynamo``, which
``import torchloom`` must not)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .base import dispatch_mode_active
from .rope import rope_tables


@torch.compiler.assume_constant_result
def sdpa_choice_constant(s: int, h: int, kv: int, hd: int, dtype: torch.dtype, device: torch.device,
                         causal: bool) -> int | None:
    """``flash_attention.sdpa_choice`` for q ``[1, S, H, D]`` and k, v ``[1, S, K, D]`` of ``dtype`` on
    ``device`` (None off CUDA, and for head sizes over 128, as the eager flash path). Dynamo calls it
    once while it traces and keeps the answer in the graph. The chooser reads only metadata, but of
    real CUDA tensors (of fake ones it answers "math"): these are views of one ``D``-element row, every
    stride but the last 0. One sample serves every batch size: on an H200 with torch 2.11 it answers
    as for the traced path's own tensors (q and k slices of one buffer, v its own) at batch 1, 3 and 8
    in every case tests/layers/test_compile_cuda.py asks."""
    if device.type != "cuda" or hd > _flash_attention().MAX_HEAD_DIM:
        return None
    row = torch.empty(hd, dtype=dtype, device=device)
    q = row.as_strided((1, s, h, hd), (0, 0, 0, 1))
    k = row.as_strided((1, s, kv, hd), (0, 0, 0, 1))
    return _flash_attention().sdpa_choice(q, k, k, causal, 1.0 / math.sqrt(hd))


def _rope_table(seq_len: int, head_dim: int, theta: float, device: torch.device, sine: bool) -> Tensor:
    """One table of ``rope_constants``: the same tensor for the same arguments (the graphs of a layer's
    forward and backward, traced one after the other, name it alike), the last 8 kept; made afresh,
    and not kept, under a ``TorchDispatchMode`` such as fake-tensor tracing (its tensors are not real)."""
    if dispatch_mode_active():
        return _make_rope_table.__wrapped__(seq_len, head_dim, theta, device, sine)
    return _make_rope_table(seq_len, head_dim, theta, device, sine)


@functools.lru_cache(maxsize=8)
def _make_rope_table(seq_len: int, head_dim: int, theta: float, device: torch.device, sine: bool) -> Tensor:
    """The table, made whole before any stream reads it."""
    with torch.inference_mode(False), torch.no_grad():
        table = rope_tables(seq_len, head_dim, theta, device, torch.float32)[int(sine)][:, None].contiguous()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return table


@torch.compiler.assume_constant_result
def rope_cos_constant(seq_len: int, head_dim: int, theta: float, device: torch.device) -> Tensor:
    return _rope_table(seq_len, head_dim, theta, device, False)


@torch.compiler.assume_constant_result
def rope_sin_constant(seq_len: int, head_dim: int, theta: float, device: torch.device) -> Tensor:
    return _rope_table(seq_len, head_dim, theta, device, True)


def rope_constants(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """``rope_tables``' cos and sin in float32 on ``device``, each ``[S, 1, D/2]`` (the unit dimension
    broadcasts over the heads of ``[B, S, H, D]``), made while Dynamo traces and kept by the compiled
    graph as constants (S × D/2 × 4 bytes each). Two tensors, each read by the rotation of both q and k:
    Inductor then fuses the two rotations into one kernel. (One function per table: Dynamo names a
    constant after the function that made it.)"""
    return rope_cos_constant(seq_len, head_dim, theta, device), rope_sin_constant(seq_len, head_dim, theta, device)


def _flash_attention():
    from ..kernels import flash_attention

    return flash_attention
