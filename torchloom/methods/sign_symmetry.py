"""Sign symmetry (Liao, Leibo and Poggio 2016, "How important is weight symmetry in
backpropagation?", the "uniform sign-concordant feedback" uSF): ``TrainingConfig(method="sign_symmetry")``.

The error goes down through the *signs* of the forward weights: for a chain of Dense layers,
``δ_L = ∂loss/∂a_L ⊙ f_L'(z_L)``, ``δ_l = (δ_{l+1} B_{l+1}) ⊙ f_l'(z_l)`` with
``B_l = s_l · sign(W_l)`` taken from the current weights at every step, ``∂W_l = δ_lᵀ a_{l−1}``,
``∂b_l = Σ_batch δ_l``. Only the sign of each weight travels back, never its magnitude.

``SignSymmetryConfig.scale`` sets ``s_l``: ``"mean_abs"`` (the default) ``s_l = mean|W_l|``, so the
feedback has the forward weights' overall magnitude (on CUDA every layer's ``Σ|W|`` in one
``_foreach_norm``, and at most 128 rows ``s · sign(W)`` formed inside each layer's one-launch backward,
``kernels/feedback.py``);
``"unit"``: ``s_l = 1``, the paper's ±1 feedback, whose error grows by about ``1/mean|W|`` per layer
(Liao et al. train it with batch normalisation; without it, lower the rate); or a number ``s > 0``.

Defined for Dense layers; layers without parameters pass the error through their exact backward; any
other layer with parameters is refused with a ``ValueError`` naming it. There is no state besides
backprop's (the feedback is the weights' sign). Everything else is backprop's (``Backprop``).
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
from ._feedback import FeedbackRule
from .._settings import settings

__all__ = ["SignSymmetry", "SignSymmetryConfig"]

SCALES = ("mean_abs", "unit")


@settings()
@dataclass
class SignSymmetryConfig:
    """Settings of sign symmetry: ``scale`` of the feedback ``s · sign(W)``: ``"mean_abs"`` (``s =
    mean|W|``, the default), ``"unit"`` (``s = 1``, the paper's) or a finite number > 0."""

    scale: str | float = "mean_abs"
    """The feedback is ``s · sign(W)``: ``"mean_abs"`` (``s = mean|W|``), ``"unit"`` (``s = 1``, the paper's) or a number > 0."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        s = self.scale
        if isinstance(s, str):
            if s not in SCALES:
                raise ValueError(f"SignSymmetryConfig: scale must be 'mean_abs', 'unit' or a finite number > 0, got {s!r}")
        elif isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"SignSymmetryConfig: scale must be 'mean_abs', 'unit' or a finite number > 0, got {s!r}")


class SignSymmetry(FeedbackRule):
    """Sign symmetry: backprop's machinery with ``s · sign(W_l)`` in place of ``W_l`` in each Dense
    layer's input gradient (see the module docstring)."""

    name = "sign_symmetry"
    config_type = SignSymmetryConfig
    rule = "sign_symmetry"

    def sign_feedback(self, weight: Tensor) -> Tensor:
        """``s · sign(weight)`` in ``weight``'s dtype (no host read)."""
        b = torch.sign(weight)
        scale = self.config.scale
        if scale == "mean_abs":
            return b.mul_(weight.abs().mean())
        if scale == "unit":
            return b
        return b.mul_(float(scale))

    def backward(self, grad_out: Tensor, saved: Sequence[Any], out: Sequence[Tensor | None] | None = None) -> list[Tensor]:
        """Parameter gradients, last layer first: each Dense layer above the first shown
        ``s · sign(W)`` of its fp32 weight (cast to the saved weight's dtype under autocast). On CUDA at
        most ``SMALL_BATCH_MAX`` rows, each such layer is one launch that forms ``s · sign(W)`` inside
        its error product (``kernels/feedback.py``), every ``s = mean|W|`` coming from one
        ``_foreach_norm``. ``out``: the gradients' buffers (aligned with ``model.parameters()``)."""
        outs = self.layer_outs(out)
        fused = self.fused_chain(grad_out, saved) and len(self.layers) > 1
        if fused:
            scales, muls = self._device_scales()
        grads: list[Tensor] = []
        g = grad_out
        for i in range(len(self.layers) - 1, -1, -1):
            s = saved[i]
            layer = self.layers[i]
            if fused and i > 0:
                from ..kernels.feedback import dense_backward_fb

                g, dw, db = dense_backward_fb(
                    g, s.pre, s.input, layer.weight.detach(), s.activation.name, s.has_bias, scales[i - 1], muls[i - 1],
                    out=layer._out_pair(outs[i]), backend=self.kernel_backend,
                )
                grads[:0] = (dw,) if db is None else (dw, db)
                continue
            if i > 0 and i in self.dense_indices:
                b = self.sign_feedback(layer.weight.detach())
                s = s._replace(weight=b if b.dtype == s.weight.dtype else b.to(s.weight.dtype))
            g, param_grads = layer.backward_saved(g, s, needs_input_grad=i > 0, **self.out_kw(outs[i]))
            grads[:0] = param_grads
        return grads

    def _device_scales(self) -> tuple[list[Tensor], list[float]]:
        """Per layer above the first: a one-element device tensor and a float whose product is ``s``:
        ``(Σ|W|, 1/numel)`` for ``"mean_abs"`` (every layer's ``Σ|W|`` in one ``_foreach_norm``), else
        ``(1, s)``."""
        weights = [layer.weight.detach() for layer in self.layers[1:]]
        scale = self.config.scale
        if scale == "mean_abs":
            return list(torch._foreach_norm(weights, 1)), [1.0 / w.numel() for w in weights]
        one = self.__dict__.get("_one")
        if one is None or one.device != weights[0].device:
            one = self._one = torch.ones(1, dtype=torch.float32, device=weights[0].device)
        return [one] * len(weights), [1.0 if scale == "unit" else float(scale)] * len(weights)


register_method(SignSymmetry, "usf")
