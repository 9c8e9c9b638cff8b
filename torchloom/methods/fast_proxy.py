"""FastProxy, Welvet's credit-assignment rule (``TweenSplitFastProxy`` in openfluke/welvet,
``layers/parallel/tween_split_w.go``): ``TrainingConfig(method="fast_proxy")``.

One product with the head's weights gives every hidden layer its error, with no sequential backward.
For a chain of Dense layers ``a_l = f_l(z_l)``, ``z_l = a_{l−1} W_lᵀ + b_l``, ``l = 1 … L`` (the last,
the **head**, has ``n_L`` outputs), ``g_y = ∂loss/∂a_L`` the loss gradient at the network output and
``H = L − 1`` hidden layers:

* head: its exact gradient, ``δ_L = g_y ⊙ f_L'(z_L)``;
* the proxy: ``g_proxy = g_y W_L`` (``W_headᵀ g_y`` per sample, ``[batch, n_{L−1}]``), with **no**
  activation derivative, not even the head's;
* hidden layer ``l``: ``δ_l = (P_l(g_proxy) · scale) ⊙ f_l'(z_l)``, where ``P_l`` block-averages the
  proxy's ``n_{L−1}`` values of each sample to the layer's width ``n_l`` (output ``j`` is the mean
  of inputs ``⌊j·m/n⌋ … max(⌊(j+1)·m/n⌋, ⌊j·m/n⌋+1) − 1`` for ``m → n``; the identity when the widths
  agree, a repeat when the layer is wider) and ``scale = 1/H`` by default (Welvet's split of the
  proxy over the hidden layers);
* ``∂W_l = δ_lᵀ a_{l−1}``, ``∂b_l = Σ_batch δ_l``, handed to the run's optimizer.

Read from Welvet's source (facts, not code): the proxy is ``dense.LinearGradIn`` (``Wᵀ g_y``, no
act'), computed from the head's weights before its update; the head's ``dW`` and every hidden
layer's come from ``dense.GradWOnly`` with the layer's own pre-activation (so ``f_l'`` *is* applied
at each hidden layer, to the projected proxy); the projection is Welvet's ``projectGap`` over the
flattened ``[batch · width]`` tensor, which equals the per-sample block average above; the hidden
share is ``1/(N−1)`` for ``N`` trainable leaves. Where torchloom differs (docs/choosing-a-method.md):
Welvet updates with plain SGD at the rule's rate and its Dense has no bias; here the gradients go to
the run's optimizer (SGD, momentum, AdamW, ...) and a bias gets ``Σ_batch δ_l``; Welvet falls back
to a layer's full local backward for non-Dense leaves, torchloom refuses a model that is not a chain
of Dense layers (``ValueError`` naming the layer).

Projections are fixed by the widths (no random state; nothing to checkpoint besides backprop's).
Everything else is backprop's (``Backprop``): any optimizer, clipping, guards, precision,
data-parallel training and the CUDA device step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..engine.method import register_method
from ..layers.base import autocast_off
from ._feedback import FeedbackRule
from .._settings import settings

__all__ = ["FastProxy", "FastProxyConfig", "block_average_matrix"]


@settings()
@dataclass
class FastProxyConfig:
    """Settings of FastProxy: ``scale`` of every hidden layer's share of the proxy, ``None`` (the
    default) for Welvet's ``1/H`` over ``H`` hidden layers, or a finite number > 0. The learning rate
    and optimizer are ``TrainingConfig``'s."""

    scale: float | None = None
    """Each hidden layer's share of the proxy: ``None`` for Welvet's ``1/H`` over ``H`` hidden layers, or a number > 0."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        s = self.scale
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s <= 0):
            raise ValueError(f"FastProxyConfig: scale must be None (1/number of hidden layers) or a finite number > 0, got {s!r}")


def block_average_matrix(m: int, n: int, dtype: torch.dtype = torch.float32, device: Any = None) -> Tensor:
    """``P [m, n]`` with ``v @ P`` the block average of ``v [*, m]`` to width ``n``: column ``j``
    averages rows ``lo … hi−1``, ``lo = ⌊j·m/n⌋``, ``hi = max(⌊(j+1)·m/n⌋, lo + 1)`` (at most ``m``)."""
    p = torch.zeros(m, n, dtype=torch.float64)
    for j in range(n):
        lo = j * m // n
        hi = min(max((j + 1) * m // n, lo + 1), m)
        p[lo:hi, j] = 1.0 / (hi - lo)
    return p.to(dtype=dtype, device=device)


class FastProxy(FeedbackRule):
    """Welvet's FastProxy (see the module docstring)."""

    name = "fast_proxy"
    config_type = FastProxyConfig
    rule = "fast_proxy"
    dense_chain = True

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        hidden = self.layers[:-1]
        self.share = self.config.scale if self.config.scale is not None else 1.0 / max(len(hidden), 1)
        m = self.layers[-1].in_features
        # None where the widths agree (the identity); folded with the share otherwise
        self.projections = [
            None if layer.out_features == m else block_average_matrix(m, layer.out_features, self.dtype, self.device)
            for layer in hidden
        ]

    def backward(self, grad_out: Tensor, saved: Sequence[Any], out: Sequence[Tensor | None] | None = None) -> list[Tensor]:
        """The head's exact gradients; the proxy ``g_y W_head`` (pre-update weights, no act'),
        block-averaged and scaled, as the gradient at each hidden layer's output (its own backward
        applies ``f_l'(z_l)`` and forms ``δ_lᵀ a_{l−1}``). ``out``: the gradients' buffers."""
        outs = self.layer_outs(out)
        head, s_head = self.layers[-1], saved[-1]
        _, head_grads = head.backward_saved(grad_out, s_head, needs_input_grad=False, out=outs[-1])
        with autocast_off(grad_out.device.type):
            w = s_head.weight
            proxy = grad_out.to(w.dtype) @ w  # [*, n_L] @ [n_L, n_{L-1}]
        grads: list[Tensor] = []
        for i, layer in enumerate(self.layers[:-1]):
            p = self.projections[i]
            with autocast_off(proxy.device.type):
                g = proxy if p is None else proxy @ (p if p.dtype == proxy.dtype else p.to(proxy.dtype))
                g = g * self.share
            _, param_grads = layer.backward_saved(g, saved[i], needs_input_grad=False, out=outs[i])
            grads.extend(param_grads)
        grads.extend(head_grads)
        return grads


register_method(FastProxy, "fastproxy")
