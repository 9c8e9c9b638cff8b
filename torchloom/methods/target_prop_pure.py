"""Pure-mode TargetProp's weight-based estimates and delta-rule directions (the rules of
``target_prop_rules.py``'s module docstring, point 2), for Dense, RNN, LSTM and MultiHeadAttention.

Precision: everything here works in float32 at least (``_work``): under ``precision="bf16-mixed"``
the activations are bfloat16, and a hidden gap (an estimate divided by a column sum of ``|W|``), or
a target ``a + gap`` from which the next gap is taken back out, rounded to bfloat16's 8 significant
bits loses the step's signal. Float32 and float64 tensors pass through unchanged (the same tensors,
the same operations). The caller turns autocast off around these calls (``_fill_backward``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..layers.attention import MultiHeadAttention
from ..layers.base import Layer
from ..layers.dense import Dense
from ..layers.lstm import LSTM
from ..layers.rnn import RNN

__all__ = ["estimate_input_target"]

# Below this total |weight| into an input unit, the pure-mode estimate leaves that unit's target at 0
# (Loom: "only assign target if enough weight connects this neuron").
_MIN_CONNECTION = 0.01


def _work(t: Tensor) -> Tensor:
    """``t`` in pure mode's working precision: a bfloat16 / float16 tensor as float32, any other as it is
    (the same tensor: float32 and float64 runs are untouched)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _weighted_estimate(target: Tensor, weight: Tensor, abs_weight_sum: Tensor) -> Tensor:
    """``est[..., j] = Σ_o weight[o, j]·target[..., o] / abs_weight_sum[j]`` where that sum > 0.01, else 0.

    ``target [..., out]``, ``weight [out, in]``, ``abs_weight_sum [in]`` → ``[..., in]``."""
    weight, abs_weight_sum = weight.to(target.dtype), abs_weight_sum.to(target.dtype)  # no-ops unless a half model
    num = torch.matmul(target, weight)
    connected = abs_weight_sum > _MIN_CONNECTION
    return torch.where(connected, num / torch.where(connected, abs_weight_sum, 1.0), 0.0)


def _dense_estimate(layer: Dense, target: Tensor) -> Tensor:
    w = layer.weight  # [out, in]
    return _weighted_estimate(target, w, w.abs().sum(0))


def _rnn_estimate(layer: RNN, target: Tensor) -> Tensor:
    w = layer.weight_ih  # [H, I]; target [B, T, H] → [B, T, I], each time step on its own
    return _weighted_estimate(target, w, w.abs().sum(0))


def _lstm_estimate(layer: LSTM, target: Tensor) -> Tensor:
    # weight_ih [4H, I]: each gate's block maps the input to H units; all four are read against the
    # same hidden target, so numerator and denominator sum over gates and units.
    w = layer.weight_ih.view(4, layer.hidden_size, layer.input_size)
    return _weighted_estimate(target, w.sum(0), w.abs().sum((0, 1)))


def _mha_estimate(layer: MultiHeadAttention, target: Tensor) -> Tensor:
    # Back through the output projection to the attention context [B, S, d], then through the value
    # projection as the query heads see it: kv head k serves query heads k·g … k·g+g−1, so its rows
    # are repeated g times (the effective [d, d] map from the input to the context).
    o_w = layer.o_weight  # [d, d]
    context = _weighted_estimate(target, o_w, o_w.abs().sum(0))
    v_w = layer.v_weight  # [kv_dim, d]
    group = layer.num_heads // layer.num_kv_heads
    if group > 1:
        head_dim = v_w.shape[0] // layer.num_kv_heads
        v_w = v_w.view(layer.num_kv_heads, head_dim, -1).repeat_interleave(group, dim=0).reshape(-1, v_w.shape[1])
    return _weighted_estimate(context, v_w, v_w.abs().sum(0))


_ESTIMATORS: dict[type, Callable[[Any, Tensor], Tensor]] = {
    Dense: _dense_estimate,
    RNN: _rnn_estimate,
    LSTM: _lstm_estimate,
    MultiHeadAttention: _mha_estimate,
}


@torch.no_grad()
def estimate_input_target(layer: Layer, target: Tensor, layer_input: Tensor, layer_output: Tensor | None = None) -> Tensor:
    """Pure-mode target for ``layer``'s input ``[B, ..., in]`` from the ``target`` of its output
    ``[B, ..., out]``, with ``est`` the weight-based estimate of Dense / RNN / LSTM / MultiHeadAttention
    (module docstring): ``est(target)`` (Loom's rule) without ``layer_output``; with it, difference
    target propagation (Lee et al. 2015), ``layer_input + est(target − layer_output)``: ``est`` is
    linear, so the estimate's error on the layer's own output cancels. Any other layer:
    ``layer_input`` itself (Loom's fallback: no gap below it). Computed in float32 at least: a
    bfloat16 / float16 input's target is float32 (a float32 or float64 one keeps its dtype)."""
    for cls in type(layer).__mro__:  # subclasses of Dense & co. inherit their estimate
        if cls in _ESTIMATORS:
            x = _work(layer_input)
            if layer_output is None:
                return _ESTIMATORS[cls](layer, _work(target)).to(x.dtype)
            return x + _ESTIMATORS[cls](layer, _work(target) - _work(layer_output)).to(x.dtype)
    return layer_input


def _pure_direction(layer: Layer, x: Tensor, out: Tensor, target: Tensor, saved: Any) -> tuple[Tensor, ...]:
    """Pure-mode update direction of one layer (before the rate), aligned with ``layer.parameters()``.

    Dense: ``gapᵀ x`` summed over every leading dimension, bias ``Σ gap`` (``gap = target − out``, no
    ``f'``: Loom's delta rule). Other layers with parameters: their hand-written backward fed with the
    gap, i.e. the negated gradient of the local loss ½‖target − out‖². No parameters: ``()``."""
    if not any(True for _ in layer.parameters()):
        return ()
    if isinstance(layer, Dense):  # in float32 at least (a half-precision activation is read as float32)
        g2 = (_work(target) - _work(out)).reshape(-1, layer.out_features)
        w = layer.weight
        delta_w = torch.mm(g2.t(), _work(x).reshape(-1, layer.in_features).to(g2.dtype)).to(w.dtype)
        return (delta_w,) if layer.bias is None else (delta_w, g2.sum(0).to(layer.bias.dtype))
    gap = (target - out).to(out.dtype)
    _, directions = layer.backward_saved(gap, saved, needs_input_grad=False)
    return tuple(directions)
