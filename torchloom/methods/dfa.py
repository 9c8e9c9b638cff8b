"""Direct feedback alignment (Nøkland 2016, "Direct Feedback Alignment Provides Learning in Deep
Neural Networks"): ``TrainingConfig(method="dfa")``.

The output layer's error is sent straight to every hidden layer through a fixed random matrix, with
no sequential backward pass. For a chain of Dense layers ``a_l = f_l(z_l)``, ``z_l = a_{l−1} W_lᵀ + b_l``,
``l = 1 … L``, and ``n_L`` outputs:

* ``e = ∂loss/∂a_L ⊙ f_L'(z_L)``, the error at the output layer's pre-activation (for a linear output
  trained on cross-entropy: softmax − one-hot, over the batch size);
* output layer: ``δ_L = e`` (its exact gradient, as backprop);
* hidden layer ``l < L``: ``δ_l = (e B_l) ⊙ f_l'(z_l)`` with ``B_l`` fixed, ``[n_L, n_l]``: one
  matrix product per layer, all independent of each other;
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

    def backward(self, grad_out: Tensor, saved: Sequence[Any]) -> list[Tensor]:
        """The output layer's exact gradients; each hidden layer's from ``e B_l`` as the gradient at
        its output (its own backward applies ``f_l'(z_l)`` and forms ``δ_lᵀ a_{l−1}``)."""
        head, s_head = self.layers[-1], saved[-1]
        _, head_grads = head.backward_saved(grad_out, s_head, needs_input_grad=False)
        pre = s_head.pre
        with autocast_off(pre.device.type):
            e = s_head.activation.grad(grad_out.to(pre.dtype), pre)
        grads: list[Tensor] = []
        for i, layer in enumerate(self.layers[:-1]):
            s = saved[i]
            with autocast_off(e.device.type):
                g = e @ self.feedback_as(i, s.pre)  # [*, n_L] @ [n_L, n_l]: the error at layer i's output
            _, param_grads = layer.backward_saved(g, s, needs_input_grad=False)
            grads.extend(param_grads)
        grads.extend(head_grads)
        return grads


register_method(DFA, "direct_feedback_alignment")
