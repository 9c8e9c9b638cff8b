"""What the feedback rules share (feedback alignment, DFA, sign symmetry, FastProxy).

Each rule is a ``Backprop`` whose ``backward(grad_out, saved)`` assigns credit its own way; the
optimizer, clipping, guards, schedules, precision, data-parallel averaging (the rule's gradients are
all-reduced as backprop's are) and the CUDA device step (its ``backward`` reads nothing on the host)
are backprop's. This module holds the checks of the model the rules run on, the seeded feedback
matrices (drawn on the CPU in float32 from the rule's own seed, so every rank and every device draws
the same values, then cast to the weights' dtype and device) and their checkpointing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..layers.dense import Dense
from .backprop import Backprop

__all__ = ["FeedbackRule", "check_seed_and_scale", "draw_feedback"]


def check_seed_and_scale(owner: str, seed: Any, scale: Any) -> None:
    """``TypeError``/``ValueError`` naming the field unless ``seed`` is an int and ``scale`` a finite
    number > 0."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{owner}: seed must be an int, got {seed!r}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{owner}: scale must be a finite number > 0, got {scale!r}")


def draw_feedback(seed: int, shapes: list[tuple[int, int]], stds: list[float]) -> list[Tensor]:
    """One ``N(0, std²)`` matrix per shape, in order, from a CPU generator seeded with ``seed``
    (float32, the same values whatever the training device and dtype)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float32).mul_(std) for shape, std in zip(shapes, stds)]


class FeedbackRule(Backprop):
    """A ``Backprop`` with its own ``backward``; checks at ``bind`` that the model is one the rule is
    defined on, and keeps the rule's fixed feedback matrices (``self.feedback``, possibly empty) in
    the checkpoint.

    Class attributes a rule sets: ``dense_chain`` (True: every layer must be a ``Dense``, the rule
    reaches each layer from the output directly; False: layers with parameters must be ``Dense``,
    layers without parameters pass the error on through their exact backward) and ``rule`` (its
    name in messages)."""

    dense_chain = False
    rule = ""
    compiles = False  # its own backward runs outside autograd: TrainingConfig.compile is refused
    backward_out = True  # the device step hands ``backward`` the flat .grad views (``out=``)
    feedback: list[Tensor]

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        self.layers = list(self.model.layers)
        self.dense_indices = self._check_layers()
        self._param_counts = [sum(1 for _ in layer.parameters()) for layer in self.layers]
        self.feedback = [b.to(device=self.device, dtype=self.dtype) for b in self.make_feedback()]

    def layer_outs(self, out: Sequence[Tensor | None] | None) -> list[Sequence[Tensor | None] | None]:
        """``out`` (buffers aligned with ``model.parameters()``, None for frozen ones; or None) split
        into one slice per layer, for each layer's ``backward_saved(..., out=)``."""
        if out is None:
            return [None] * len(self.layers)
        outs, k = [], 0
        for count in self._param_counts:
            outs.append(out[k : k + count] if count else None)
            k += count
        return outs

    @staticmethod
    def out_kw(out: Sequence[Tensor | None] | None) -> dict[str, Any]:
        """``{"out": out}`` for a layer's ``backward_saved`` when there are buffers (a Dense layer's),
        else ``{}`` (a layer without parameters takes no ``out``)."""
        return {} if out is None else {"out": out}

    def fused_chain(self, grad_out: Tensor, saved: Sequence[Any]) -> bool:
        """Whether the rule's backward takes the fused kernels (``kernels/feedback.py``): every layer a
        ``Dense`` with a float32 ``[batch, features]`` input of at most ``SMALL_BATCH_MAX`` rows and
        no autocast cast, on CUDA (or the interpreter with ``kernel_backend="triton"``: the tests)."""
        backend = self.kernel_backend
        if not (grad_out.is_cuda or backend == "triton") or backend == "reference":
            return False  # (CPU runs never import the kernels)
        if grad_out.dim() != 2 or grad_out.dtype != torch.float32 or len(self.dense_indices) != len(self.layers):
            return False
        from ..kernels.feedback import fits

        return all(
            s.dtypes is None and s.weight.dtype == torch.float32 and s.input.dim() == 2 and fits(s.input, s.activation.name, backend)
            for s in saved
        )

    def _check_layers(self) -> list[int]:
        """The indices of the Dense layers; ``ValueError`` naming the first layer the rule is not
        defined on (before any state changes: ``bind`` runs before the first step)."""
        dense = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Dense):
                dense.append(i)
                continue
            has_params = any(True for _ in layer.parameters())
            if self.dense_chain or has_params:
                what = "a chain of Dense layers" if self.dense_chain else "Dense layers (layers without parameters pass the error on)"
                raise ValueError(
                    f"{self.rule}: layer {i} ({type(layer).__name__}) is not a Dense layer; the rule is defined for "
                    f"{what} only: train this model with method='backprop', 'target_prop' or 'tween'"
                )
        if self.dense_chain and len(dense) < 1:
            raise ValueError(f"{self.rule}: the model has no Dense layer")
        if sum(1 for layer in self.layers for _ in layer.parameters()) != sum(1 for _ in self.model.parameters()):
            raise ValueError(
                f"{self.rule}: the model uses a layer or parameter at more than one place; the rule gives each "
                "layer its own update: use a separate layer at each place"
            )
        return dense

    def make_feedback(self) -> list[Tensor]:
        """The rule's fixed feedback matrices, in a fixed order (none by default)."""
        return []

    def feedback_as(self, index: int, like: Tensor) -> Tensor:
        """Feedback matrix ``index`` in ``like``'s dtype (the autocast dtype under mixed precision)."""
        b = self.feedback[index]
        return b if b.dtype == like.dtype else b.to(like.dtype)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.feedback:
            state["feedback"] = [b.detach().clone() for b in self.feedback]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("feedback") if self.feedback else None
        if self.feedback:
            shapes = [tuple(b.shape) for b in self.feedback]
            theirs = [tuple(b.shape) for b in saved] if saved is not None else None
            if theirs != shapes:
                raise ValueError(
                    f"resume_from: the checkpoint's {self.rule} feedback matrices {theirs} do not match this model's {shapes}"
                )
        super().load_state_dict(state)
        if saved is not None:
            for b, s in zip(self.feedback, saved):
                b.copy_(s)
