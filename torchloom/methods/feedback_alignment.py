"""Feedback alignment (Lillicrap et al. 2016, "Random synaptic feedback weights support error
backpropagation for deep learning"): ``TrainingConfig(method="feedback_alignment")``.

The error goes down the network through a fixed random matrix ``B_l`` per layer in place of the
transposed weights: for a chain of Dense layers ``a_l = f_l(z_l)``, ``z_l = a_{l−1} W_lᵀ + b_l``,

* ``δ_L = ∂loss/∂a_L ⊙ f_L'(z_L)`` (the output layer's own error, exactly backprop's);
* ``δ_l = (δ_{l+1} B_{l+1}) ⊙ f_l'(z_l)`` with ``B_{l+1}`` of ``W_{l+1}``'s shape ``[out, in]``
  (backprop: ``δ_{l+1} W_{l+1}``);
* ``∂W_l = δ_lᵀ a_{l−1}`` and ``∂b_l = Σ_batch δ_l``, handed to the run's optimizer.

So the top layer learns exactly as with backprop; the layers below learn from an error carried by
matrices that never change, and the forward weights come to align with them. ``B_l`` is drawn once,
``N(0, scale² · 2/in_l)`` (He-normal of the weight it stands in for), from a generator seeded by
``FeedbackAlignmentConfig.seed``, and is saved in checkpoints (restored exactly on resume). The default ``scale`` is
0.1: at 1 the 784-256-256-10 ReLU network of ``bench/bench_methods.py`` diverged on Fashion-MNIST
(SGD with momentum at 0.01; 0.03, 0.1, 0.3 and 1 were tried, 0.1 learned best).

Defined for Dense layers; layers without parameters (``Flatten``, a parameterless ``nn.Module``)
pass the error on through their exact backward. Any other layer with parameters is refused with a
``ValueError`` naming it. Everything else is backprop's (``Backprop``): any optimizer, clipping,
guards, precision, data-parallel training and the CUDA device step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..engine.method import register_method
from ._feedback import FeedbackRule, check_seed_and_scale, draw_feedback
from .._settings import settings

__all__ = ["FeedbackAlignment", "FeedbackAlignmentConfig"]


@settings()
@dataclass
class FeedbackAlignmentConfig:
    """Settings of feedback alignment: ``seed`` of the feedback matrices (drawn on the CPU, the same on
    every device and rank) and ``scale`` (0.1), their standard deviation relative to He-normal
    (``sqrt(2/in)``, > 0). The learning rate and optimizer are ``TrainingConfig``'s."""

    seed: int = 0
    """Seed of the fixed random feedback matrices (drawn on the CPU: the same on every device and rank)."""
    scale: float = 0.1
    """Their standard deviation relative to He-normal ``sqrt(2/in)`` (> 0; 1 diverged on Fashion-MNIST)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_seed_and_scale("FeedbackAlignmentConfig", self.seed, self.scale)


class FeedbackAlignment(FeedbackRule):
    """Feedback alignment: backprop's machinery with fixed random ``B_l`` in place of ``W_l`` in each
    Dense layer's input gradient (see the module docstring)."""

    name = "feedback_alignment"
    config_type = FeedbackAlignmentConfig
    rule = "feedback_alignment"

    def make_feedback(self) -> list[Tensor]:
        """One ``B_l`` per Dense layer above the first (the first layer's input gradient is never
        needed), of the layer's weight shape ``[out, in]``."""
        shapes, stds = [], []
        for i in self.dense_indices[1:]:
            w = self.layers[i].weight
            shapes.append(tuple(w.shape))
            stds.append(self.config.scale * math.sqrt(2.0 / w.shape[1]))
        return draw_feedback(self.config.seed, shapes, stds)

    def backward(self, grad_out: Tensor, saved: Sequence[Any], out: Sequence[Tensor | None] | None = None) -> list[Tensor]:
        """Parameter gradients, last layer first: each Dense layer's own backward shown ``B_l`` as its
        weight (its ``∂W = δᵀ a`` does not read the weight); other layers' exact backward. ``out``:
        the gradients' buffers (aligned with ``model.parameters()``)."""
        outs = self.layer_outs(out)
        fb = {i: k for k, i in enumerate(self.dense_indices[1:])}
        grads: list[Tensor] = []
        g = grad_out
        for i in range(len(self.layers) - 1, -1, -1):
            s = saved[i]
            if i in fb:
                s = s._replace(weight=self.feedback_as(fb[i], s.weight))
            g, param_grads = self.layers[i].backward_saved(g, s, needs_input_grad=i > 0, **self.out_kw(outs[i]))
            grads[:0] = param_grads
        return grads


register_method(FeedbackAlignment, "fa")
