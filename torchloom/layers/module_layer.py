"""``ModuleLayer``: any ``nn.Module`` as a link of a torchloom ``Network``.

torchloom layers carry a hand-written backward; a plain module (``nn.Dropout``, ``nn.BatchNorm1d``,
pooling, an activation, a user's own block) gets its backward from autograd, on that module alone:

* ``forward_saved(x)`` runs ``module(x)`` with autograd on (whatever the caller's grad mode), from a
  detached copy of ``x``, and keeps the small graph of that one module;
* ``backward_saved(grad_out, saved)`` asks autograd for the gradient of the module's output with
  respect to its input and its parameters (``torch.autograd.grad``), zeros for parameters the output
  does not depend on.

So a ``Network`` mixes both kinds freely, and every trainer (backprop, TargetProp, Tweening) trains
the whole chain: the torchloom layers through their hand-written backward, the plain modules
through autograd. Train/eval mode is the module's own (``Network.train()`` / ``eval()`` reach it):
Dropout is active and BatchNorm updates its running statistics exactly once per forward in train
mode. ``Network`` wraps plain modules in a ``ModuleLayer`` by itself.

In-place modules (``nn.ReLU(inplace=True)``, ``nn.Dropout(inplace=True)``, any submodule whose
``inplace`` attribute is true) get a copy of their input: the input is the previous layer's output,
which the network keeps (its history, that layer's saved tensors, the caller's batch), so it must not
change. A module that writes into its input without saying so (``x.add_(1)`` in a user's
``forward``) is a ``RuntimeError`` naming the module on the training path, where autograd catches
the write.

Shapes: whatever the module takes and returns (``[batch, ...]``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, is_tensor, nn

from .base import Layer

__all__ = ["ModuleLayer"]


class ModuleSaved(NamedTuple):
    """The module's input (a detached leaf that requires grad, for floating inputs) and output, the
    ends of the one-module autograd graph."""

    input: Tensor
    output: Tensor


class ModuleLayer(Layer):
    """A plain ``nn.Module`` inside a torchloom chain, its backward taken from autograd (module
    docstring). ``ModuleLayer(nn.Dropout(0.1))``; ``.module`` is the wrapped module, and its
    parameters are this layer's parameters (same order)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ModuleLayer: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, Layer):
            raise TypeError(f"ModuleLayer: {type(module).__name__} is a torchloom layer already; use it directly")
        self.module = module

    @property
    def loom_type(self) -> str:
        return type(self.module).__name__

    def _in_place(self) -> bool:
        """Whether the module says it writes into its input (an ``inplace`` attribute that is true)."""
        return any(getattr(m, "inplace", False) is True for m in self.module.modules())

    def forward(self, x: Tensor | tuple[Tensor, ...]) -> Tensor:
        # ordinary autograd when used as a module; an in-place module works on a copy, so that the
        # previous layer's output (which its backward may have saved) stays as it was. A tuple is
        # the inputs of a module that takes several: module(*x)
        if isinstance(x, tuple):
            return self.module(*x)
        return self.module(x.clone() if self._in_place() and is_tensor(x) else x)

    def forward_saved(self, x: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ModuleSaved]:
        with torch.enable_grad():
            if isinstance(x, tuple):  # several inputs (the first link of a network): module(*x)
                leaf = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
            else:
                leaf = x.detach().requires_grad_(x.is_floating_point())
            try:
                # the input is the previous layer's output, kept by the network: an in-place module
                # gets a copy (the copy is part of the graph, so the input gradient still flows)
                if isinstance(leaf, tuple):
                    y = self.module(*leaf)
                else:
                    y = self.module(leaf.clone() if self._in_place() else leaf)
            except RuntimeError as e:
                if "in-place operation" not in str(e):
                    raise
                raise RuntimeError(
                    f"ModuleLayer({type(self.module).__name__}): the module writes into its input in place, which "
                    "torchloom keeps for the backward pass (and which may be the previous layer's output or your "
                    "batch); give the module an inplace=True attribute (torchloom then passes it a copy) or "
                    f"compute out of place. ({e})"
                ) from None
        if not is_tensor(y):
            raise TypeError(f"ModuleLayer({type(self.module).__name__}): the module must return one tensor, got {type(y).__name__}")
        return y.detach(), ModuleSaved(leaf, y)

    def backward_saved(self, grad_out: Tensor, saved: ModuleSaved, needs_input_grad: bool = True) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        params = list(self.module.parameters())
        many = isinstance(saved.input, tuple)  # several inputs: one gradient per input (None for integer ones)
        leaves = [t for t in saved.input if t.requires_grad] if many else [saved.input]
        wants_input = needs_input_grad and all(t.requires_grad for t in leaves) and bool(leaves)
        inputs = (leaves if wants_input else []) + [p for p in params if p.requires_grad]
        if not saved.output.requires_grad or not inputs:  # nothing in the module depends on a grad input
            zeros = tuple(torch.zeros_like(p) for p in params)
            return (self._input_grads(saved.input, []) if wants_input else None), zeros
        with torch.enable_grad():
            grads = torch.autograd.grad(saved.output, inputs, grad_out, allow_unused=True)
        grads = list(grads)
        grad_in = None
        if wants_input:
            grad_in = self._input_grads(saved.input, grads[: len(leaves)])
            del grads[: len(leaves)]
        it = iter(grads)
        param_grads = []
        for p in params:
            g = next(it) if p.requires_grad else None
            param_grads.append(torch.zeros_like(p) if g is None else g)
        return grad_in, tuple(param_grads)

    @staticmethod
    def _input_grads(inputs: Tensor | tuple[Tensor, ...], grads: list[Tensor | None]) -> Any:
        """The input gradient (zeros where autograd found none), a tuple for several inputs."""
        if not isinstance(inputs, tuple):
            g = grads[0] if grads else None
            return torch.zeros_like(inputs) if g is None else g
        it = iter(grads)
        out = []
        for t in inputs:
            g = next(it, None) if t.requires_grad else None
            out.append(torch.zeros_like(t) if g is None and t.requires_grad else g)
        return tuple(out)

    def pre_activation(self, saved: Any) -> Tensor | None:
        return None

    def extra_repr(self) -> str:
        return ""
