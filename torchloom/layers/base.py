"""The contract every torchloom layer keeps.

A layer's math lives in two plain functions written by hand, side by side:

* ``forward_saved(x) -> (y, saved)``: the forward pass, run without building an autograd graph,
  returning the output and what the backward needs (Loom keeps the same: input and pre-activation);
* ``backward_saved(grad_out, saved, needs_input_grad=True) -> (grad_in, param_grads)``: the
  hand-written backward. ``param_grads`` is a tuple aligned with ``tuple(layer.parameters())``.

The same backward serves twice (SPEC §1): through a ``torch.autograd.Function`` when the layer is used
as an ordinary module (``layer(x)`` then ``loss.backward()``), and directly from the trainers, which
never ask autograd for the layer's gradients (like Loom's ``DispatchLayerBackward``).

``LayerFunction`` is a generic ``autograd.Function`` over that contract, used by container layers;
leaf ops such as Dense have their own named Function with a functional API.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Layer", "LayerFunction", "LayerRecord", "check_input", "gather_param_grads", "host_checks", "host_checks_enabled"]


class LayerRecord(NamedTuple):
    """One layer's entry in a network's history (Loom's ``histIn`` / ``histPre`` plus the output).

    ``input``: the layer's input; ``pre``: its pre-activation (``None`` for layers without one);
    ``output``: its output; ``saved``: what its backward needs."""

    input: Tensor
    pre: Tensor | None
    output: Tensor
    saved: Any


class Layer(nn.Module):
    """Base class of torchloom layers: explicit forward, hand-written backward.

    Subclasses implement ``forward_saved`` and ``backward_saved``; ``forward`` runs them through
    ``autograd.Function`` so the layer is a drop-in module. ``pre_activation(saved)`` names the
    pre-activation inside ``saved`` for history recording (``None`` when the layer has none).
    """

    # Whether ``backward_saved`` takes ``out=``: buffers (aligned with ``parameters()``) to write the
    # parameter gradients into instead of allocating them (the CUDA training step passes its flat
    # ``.grad`` views). A layer that takes it may still return other tensors; callers check.
    accepts_grad_out = False

    def forward(self, x: Tensor) -> Tensor:
        return LayerFunction.apply(self, x, *self.parameters())

    def forward_saved(self, x: Tensor) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def backward_saved(
        self, grad_out: Tensor, saved: Any, needs_input_grad: bool = True
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        raise NotImplementedError

    def pre_activation(self, saved: Any) -> Tensor | None:
        return getattr(saved, "pre", None)

    # The layer's type name as Loom's observer prints it ("Dense", "Conv2D", ...).
    @property
    def loom_type(self) -> str:
        return type(self).__name__


def check_input(x: Tensor, name: str, trailing: tuple[int | None, ...], layer: str) -> None:
    """Raise ``ValueError`` unless ``x`` is ``[batch, *trailing]`` (``None`` = any size).

    ``name`` is the argument's name, ``layer`` the layer's repr for the message."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer}: {name} must be a torch.Tensor, got {type(x).__name__}")
    expected_dims = 1 + len(trailing)
    ok = x.dim() == expected_dims and all(t is None or s == t for s, t in zip(x.shape[1:], trailing))
    if not ok:
        want = ", ".join(["batch"] + ["*" if t is None else str(t) for t in trailing])
        raise ValueError(f"{layer}: {name} must have shape [{want}], got {list(x.shape)}")


def gather_param_grads(owner: nn.Module, children, child_grads) -> tuple[Tensor, ...]:
    """The children's parameter gradients in ``tuple(owner.parameters())`` order. A parameter that
    several children share (the same layer used twice, tied weights) gets the sum of its gradients,
    as autograd would give; ``parameters()`` lists it once."""
    acc: dict[int, Tensor] = {}
    for child, grads in zip(children, child_grads):
        for p, g in zip(child.parameters(), grads):
            acc[id(p)] = g if id(p) not in acc else acc[id(p)] + g
    return tuple(acc[id(p)] for p in owner.parameters())


_host_checks = threading.local()


def host_checks_enabled() -> bool:
    """Whether layers may run validations that read device values on the host (e.g. Embedding's
    index range check). ``host_checks(False)`` turns them off around CUDA graph capture, where a host
    read is impossible; every batch was checked eagerly before."""
    return getattr(_host_checks, "enabled", True)


@contextlib.contextmanager
def host_checks(enabled: bool) -> Iterator[None]:
    """Within the block, ``host_checks_enabled()`` returns ``enabled`` (this thread only)."""
    previous = host_checks_enabled()
    _host_checks.enabled = enabled
    try:
        yield
    finally:
        _host_checks.enabled = previous


# --------------------------------------------------------------------------------------------
# Generic autograd bridge. ``saved`` may be any nest of tuples / NamedTuples / lists holding
# tensors and plain values; tensors go through ctx.save_for_backward (so in-place modification is
# detected and outputs saved for backward don't form reference cycles), the rest stays on ctx.


def _flatten(obj: Any, tensors: list[Tensor]) -> Callable[[list[Tensor]], Any]:
    if isinstance(obj, Tensor):
        i = len(tensors)
        tensors.append(obj)
        return lambda ts: ts[i]
    if isinstance(obj, (tuple, list)):
        parts = [_flatten(o, tensors) for o in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple
            cls = type(obj)
            return lambda ts: cls(*(p(ts) for p in parts))
        cls = type(obj)
        return lambda ts: cls(p(ts) for p in parts)
    return lambda ts: obj


class LayerFunction(torch.autograd.Function):
    """``autograd.Function`` over the ``Layer`` contract: forward = ``layer.forward_saved``,
    backward = ``layer.backward_saved``. Parameters are passed as inputs so autograd routes their
    gradients; ``param_grads`` come back in ``layer.parameters()`` order."""

    @staticmethod
    def forward(ctx, layer: Layer, x: Tensor, *params: Tensor) -> Tensor:
        y, saved = layer.forward_saved(x)
        tensors: list[Tensor] = []
        ctx.rebuild = _flatten(saved, tensors)
        ctx.save_for_backward(*tensors)
        ctx.layer = layer
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        saved = ctx.rebuild(list(ctx.saved_tensors))
        grad_in, param_grads = ctx.layer.backward_saved(
            grad_out.contiguous(), saved, needs_input_grad=ctx.needs_input_grad[1]
        )
        return (None, grad_in, *param_grads)
