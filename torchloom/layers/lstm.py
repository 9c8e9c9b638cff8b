"""``LSTM`` (Loom ``LSTM``) with full backpropagation through time written by hand (SPEC §3).

Read top to bottom: ``lstm_forward`` / ``lstm_backward`` (the math, side by side), ``LSTMFunction``
(the autograd bridge), ``lstm`` (functional), ``LSTM`` (module).

For an input ``x [B, T, I]``, with ``h_0 = c_0 = 0`` and the four gates stacked in ``nn.LSTM``'s
order i, f, g, o (rows ``[0:H]``, ``[H:2H]``, ``[2H:3H]``, ``[3H:4H]`` of every parameter)::

    pre_t = x_t W_ihᵀ + h_{t−1} W_hhᵀ + b          ([B, 4H]: the gate pre-activations)
    i, f, o = σ(pre_t[i]), σ(pre_t[f]), σ(pre_t[o]);   g = tanh(pre_t[g])
    c_t = f ⊙ c_{t−1} + i ⊙ g;   h_t = o ⊙ tanh(c_t)   (h_t returned for every t: [B, T, H])

One bias ``b [4H]`` (Loom's merged bias): ``nn.LSTM`` with ``bias_ih = b`` and ``bias_hh = 0``
computes the same. The input projections of all steps are one matmul; only the recurrent product
runs per step.

BPTT, backward over t (``dh``, ``dc`` carried from step t+1, zero after the last step)::

    dh_t = gOut_t + gPre_{t+1} W_hh
    dc_t = dc_{t+1} ⊙ f_{t+1} + dh_t ⊙ o_t ⊙ (1 − tanh² c_t)
    gPre_t = [dc_t ⊙ g ⊙ i(1−i),  dc_t ⊙ c_{t−1} ⊙ f(1−f),  dc_t ⊙ i ⊙ (1−g²),  dh_t ⊙ tanh c_t ⊙ o(1−o)]

then ``dW_ih = Σ_t gPre_tᵀ x_t``, ``dW_hh = Σ_{t≥2} gPre_tᵀ h_{t−1}``, ``db = Σ gPre_t``,
``dx_t = gPre_t W_ih`` (one matmul each over all steps).

Loom stores the four gates as separate ``[W_ih | W_hh | b]`` blocks in one flat buffer; torchloom
stacks them as ``nn.LSTM`` does (``from_loom_json`` reads Dense networks only, so no mapping is needed
yet).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .rnn import RecurrentLayer

__all__ = ["LSTM", "LSTMFunction", "LSTMSaved", "lstm", "lstm_forward", "lstm_backward"]

class LSTMSaved(NamedTuple):
    """What the LSTM's backward needs: input ``[B, T, I]``, ``weight_ih [4H, I]``, ``weight_hh
    [4H, H]``, gate pre-activations ``pre [B, T, 4H]``, cell states ``cell [B, T, H]``, hidden states
    ``hidden [B, T, H]`` (the output) and whether there is a bias. Gate activations are recomputed
    from ``pre`` in the backward (one elementwise pass) rather than stored."""

    input: Tensor
    weight_ih: Tensor
    weight_hh: Tensor
    pre: Tensor
    cell: Tensor
    hidden: Tensor
    has_bias: bool


@torch.no_grad()
def lstm_forward(
    x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None
) -> tuple[Tensor, LSTMSaved]:
    """``x [B, T, I]`` → ``(h [B, T, H], saved)``, gates i, f, g, o; ``h_0 = c_0 = 0``. No autograd."""
    B, T, I = x.shape
    H = weight_hh.shape[1]
    x2 = x.reshape(B * T, I)
    # Input projections (and the bias) of every step in one matmul; the loop adds h_{t-1} W_hhᵀ in place.
    pre = (torch.mm(x2, weight_ih.t()) if bias is None else torch.addmm(bias, x2, weight_ih.t())).view(B, T, 4 * H)
    cell = x.new_empty(B, T, H)
    hidden = x.new_empty(B, T, H)
    for t in range(T):
        if t > 0:  # h_0 = 0 contributes nothing
            pre[:, t].addmm_(hidden[:, t - 1], weight_hh.t())
        gates = torch.sigmoid(pre[:, t])  # i, f, o use σ; the g slice is replaced by tanh below
        i, f, o = gates[:, :H], gates[:, H : 2 * H], gates[:, 3 * H :]
        g = torch.tanh(pre[:, t, 2 * H : 3 * H])
        c = i * g if t == 0 else torch.addcmul(i * g, f, cell[:, t - 1])  # c_0 = 0
        cell[:, t] = c
        torch.mul(o, torch.tanh(c), out=hidden[:, t])
    return hidden, LSTMSaved(x, weight_ih, weight_hh, pre, cell, hidden, bias is not None)


@torch.no_grad()
def lstm_backward(
    grad_out: Tensor, saved: LSTMSaved, needs_input_grad: bool = True
) -> tuple[Tensor | None, tuple[Tensor, Tensor, Tensor | None]]:
    """Hand-written BPTT (formulas in the module docstring). Returns
    ``(dx [B, T, I] or None, (dW_ih [4H, I], dW_hh [4H, H], db [4H] or None))``."""
    x, weight_ih, weight_hh, pre, cell, hidden, has_bias = saved
    B, T, I = x.shape
    H = weight_hh.shape[1]
    # Everything that does not depend on the carried dh/dc, for all steps at once.
    act = torch.sigmoid(pre)
    i, f, o = act[..., :H], act[..., H : 2 * H], act[..., 3 * H :]
    g = torch.tanh(pre[..., 2 * H : 3 * H])
    tanh_c = torch.tanh(cell)
    dc_from_dh = o * (1.0 - tanh_c * tanh_c)  # ∂c_t/∂h_t path: dh ⊙ o ⊙ (1 − tanh² c)
    # gPre_t = [dc | dc | dc | dh] ⊙ factor_t, laid out like pre; built in place from σ' = σ(1 − σ).
    factor = act * (1.0 - act)
    factor[..., :H] *= g  # i: g ⊙ i(1−i)
    factor[:, 0, H : 2 * H] = 0.0  # f: c_{t−1} ⊙ f(1−f), and c_0 = 0
    factor[:, 1:, H : 2 * H] *= cell[:, :-1]
    torch.mul(i, 1.0 - g * g, out=factor[..., 2 * H : 3 * H])  # g: i ⊙ (1 − g²)
    factor[..., 3 * H :] *= tanh_c  # o: tanh c ⊙ o(1−o)

    g_pre = torch.empty_like(pre)
    dc = None
    for t in range(T - 1, -1, -1):
        dh = grad_out[:, t] if t == T - 1 else torch.addmm(grad_out[:, t], g_pre[:, t + 1], weight_hh)
        dc_t = dh * dc_from_dh[:, t]
        if dc is not None:
            dc_t.addcmul_(dc, f[:, t + 1])
        dc = dc_t
        gp = g_pre[:, t].view(B, 4, H)
        torch.mul(factor[:, t, : 3 * H].view(B, 3, H), dc.unsqueeze(1), out=gp[:, :3])
        torch.mul(factor[:, t, 3 * H :], dh, out=gp[:, 3])

    g2 = g_pre.reshape(B * T, 4 * H)
    grad_w_ih = torch.mm(g2.t(), x.reshape(B * T, I))
    grad_w_hh = torch.mm(g_pre[:, 1:].reshape(-1, 4 * H).t(), hidden[:, :-1].reshape(-1, H))
    grad_b = g2.sum(0) if has_bias else None
    grad_x = torch.mm(g2, weight_ih).view(B, T, I) if needs_input_grad else None
    return grad_x, (grad_w_ih, grad_w_hh, grad_b)


class LSTMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_ih, weight_hh, bias):
        hidden, saved = lstm_forward(x, weight_ih, weight_hh, bias)
        ctx.save_for_backward(x, weight_ih, weight_hh, saved.pre, saved.cell, hidden)
        ctx.has_bias = bias is not None
        return hidden

    @staticmethod
    def backward(ctx, grad_out):
        saved = LSTMSaved(*ctx.saved_tensors, ctx.has_bias)
        grad_x, (gw_ih, gw_hh, gb) = lstm_backward(grad_out.contiguous(), saved, ctx.needs_input_grad[0])
        return grad_x, gw_ih, gw_hh, gb


def lstm(x: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor | None = None) -> Tensor:
    """Functional LSTM: ``x [B, T, I]`` → all hidden states ``[B, T, H]``; differentiable through the
    hand-written BPTT."""
    return LSTMFunction.apply(x, weight_ih, weight_hh, bias)


class LSTM(RecurrentLayer):
    """LSTM with gates i, f, g, o (``nn.LSTM``'s order), ``h_0 = c_0 = 0``, all hidden states returned
    (arguments: ``RecurrentLayer``).

    Parameters: ``weight_ih [4H, I]``, ``weight_hh [4H, H]``, ``bias [4H]``, gate blocks i, f, g, o.
    Shapes: input ``[B, T, I]`` → output ``[B, T, H]`` (every hidden state). ``saved.pre`` (the
    history's pre-activation) holds the gate pre-activations ``[B, T, 4H]``.
    """

    _GATES = 4
    _NAME = "LSTM"
    _function = LSTMFunction
    _forward = staticmethod(lstm_forward)
    _backward = staticmethod(lstm_backward)
