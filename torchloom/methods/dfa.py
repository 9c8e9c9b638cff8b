"""Direct feedback alignment (Nøkland 2016, "Direct Feedback Alignment Provides Learning in Deep
Neural Networks"): ``TrainingConfig(method="dfa")``.

The output layer's error is sent straight to every hidden layer through a fixed random matrix, with
no sequential backward pass. For a chain of Dense layers ``a_l = f_l(z_l)``, ``z_l = a_{l−1} W_lᵀ + b_l``,
``l = 1 … L``, and ``n_L`` outputs:

* ``e = ∂loss/∂a_L ⊙ f_L'(z_L)``, the error at the output layer's pre-activation (for a linear output
  trained on cross-entropy: softmax − one-hot, over the batch size);
* output layer: ``δ_L = e`` (its exact gradient, as backprop);
* hidden layer ``l < L``: ``δ_l = (e B_l) ⊙ f_l'(z_l)`` with ``B_l`` fixed, ``[n_L, n_l]``, all
  independent of each other: every ``e B_l`` comes from one product ``e [B_1 | … | B_{L−1}]`` (the
  ``B_l`` are kept side by side, ``feedback_cat``), so the backward has fewer matrix products than
  backprop's (4 against 5 for three layers), and on CUDA at most 128 rows it is two launches
  (``kernels/feedback.py``);
* ``∂W_l = δ_lᵀ a_{l−1}``, ``∂b_l = Σ_batch δ_l``, handed to the run's optimizer.

``B_l`` is drawn once, ``N(0, scale² · 2/n_l)`` (He-normal of a Dense(n_l → n_L), the shape of the
head's weight it stands in for), from a generator seeded by ``DFAConfig.seed``, and is saved in
checkpoints (restored exactly on resume). The default ``scale`` is
0.1: at 1 the 784-256-256-10 ReLU network of ``bench/bench_methods.py`` diverged on Fashion-MNIST
(SGD with momentum at 0.01; 0.03, 0.1, 0.3 and 1 were tried, 0.1 learned best).

Defined for a chain of Dense layers (the network output is the last Dense layer's); any other layer
is refused with a ``ValueError`` naming it (for convolutions DFA needs a projection to every feature
map, which torchloom does not define). Everything else is backprop's (``Backprop``): any optimizer,
clipping, guards, precision, data-parallel training and the CUDA device step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..engine.method import register_method
from ..layers.base import autocast_off
from ._feedback import FeedbackRule, check_seed_and_scale, draw_feedback
from .._settings import settings

__all__ = ["DFA", "DFAConfig"]


@settings()
@dataclass
class DFAConfig:
    """Settings of direct feedback alignment: ``seed`` of the feedback matrices (drawn on the CPU, the
    same on every device and rank) and ``scale`` (0.1), their standard deviation relative to He-normal
    (``sqrt(2/n_l)``, > 0). The learning rate and optimizer are ``TrainingConfig``'s."""

    seed: int = 0
    """Seed of the fixed random feedback matrices (drawn on the CPU: the same on every device and rank)."""
    scale: float = 0.1
    """Their standard deviation relative to He-normal ``sqrt(2/n_l)`` (> 0; 1 diverged on Fashion-MNIST)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_seed_and_scale("DFAConfig", self.seed, self.scale)


class DFA(FeedbackRule):
    """Direct feedback alignment (see the module docstring)."""

    name = "dfa"
    config_type = DFAConfig
    rule = "dfa"
    dense_chain = True

    def make_feedback(self) -> list[Tensor]:
        """One ``B_l [n_L, n_l]`` per hidden layer, first layer first."""
        n_out = self.layers[-1].out_features
        shapes = [(n_out, layer.out_features) for layer in self.layers[:-1]]
        stds = [self.config.scale * math.sqrt(2.0 / layer.out_features) for layer in self.layers[:-1]]
        return draw_feedback(self.config.seed, shapes, stds)

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        # the B_l side by side, [n_L, Σ n_l]: one product gives every hidden layer its error; each
        # ``feedback[l]`` is a view of its columns (checkpoints keep the list, restored in place)
        self.bounds = [0]
        for b in self.feedback:
            self.bounds.append(self.bounds[-1] + b.shape[1])
        self.feedback_cat = torch.cat(self.feedback, 1) if self.feedback else None
        self.feedback = [self.feedback_cat[:, lo:hi] for lo, hi in zip(self.bounds, self.bounds[1:])]

    def backward(self, grad_out: Tensor, saved: Sequence[Any], out: Sequence[Tensor | None] | None = None) -> list[Tensor]:
        """The output layer's exact gradients; each hidden layer's from ``e B_l`` as the gradient at
        its output (its own backward applies ``f_l'(z_l)`` and forms ``δ_lᵀ a_{l−1}``). Every ``e B_l``
        comes from one product ``e [B_1 | … | B_{L−1}]``; on CUDA at most ``SMALL_BATCH_MAX`` rows the
        whole backward is two launches (``kernels/feedback.py``). ``out``: the gradients' buffers."""
        outs = self.layer_outs(out)
        if self.feedback and self.fused_chain(grad_out, saved):
            return self._fused_backward(grad_out, saved, outs)
        head, s_head = self.layers[-1], saved[-1]
        _, head_grads = head.backward_saved(grad_out, s_head, needs_input_grad=False, out=outs[-1])
        grads: list[Tensor] = []
        if self.feedback:
            pre = s_head.pre
            with autocast_off(pre.device.type):
                e = s_head.activation.grad(grad_out.to(pre.dtype), pre)
                cat = self.feedback_cat if self.feedback_cat.dtype == pre.dtype else self.feedback_cat.to(pre.dtype)
                g_all = e @ cat  # [*, n_L] @ [n_L, Σ n_l]: the error at every hidden layer's output
            for i, layer in enumerate(self.layers[:-1]):
                g = g_all[..., self.bounds[i] : self.bounds[i + 1]]
                _, param_grads = layer.backward_saved(g, saved[i], needs_input_grad=False, out=outs[i])
                grads.extend(param_grads)
        grads.extend(head_grads)
        return grads

    def _fused_backward(self, grad_out: Tensor, saved: Sequence[Any], outs: list[Any]) -> list[Tensor]:
        """Two launches: ``e [B_1 | …]`` (the head's ``f_L'`` applied inside), then every layer's
        ``dW``/``db`` (three layers per launch), written into ``outs``."""
        from ..kernels.feedback import dense_grads, feedback_product

        backend = self.kernel_backend
        s_head = saved[-1]
        g_all = feedback_product(grad_out, s_head.pre, self.feedback_cat, s_head.activation.name, backend=backend)
        jobs = []
        last = len(self.layers) - 1
        for i, (layer, s) in enumerate(zip(self.layers, saved)):
            g = grad_out if i == last else g_all[:, self.bounds[i] : self.bounds[i + 1]]
            w_out, b_out = layer._out_pair(outs[i]) or (None, None)
            jobs.append((g, s.pre, s.input, s.activation.name, s.has_bias, w_out, b_out))
        grads: list[Tensor] = []
        for dw, db in dense_grads(jobs, backend=backend):
            grads.extend((dw,) if db is None else (dw, db))
        return grads


register_method(DFA, "direct_feedback_alignment")
