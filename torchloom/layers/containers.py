"""Container layers: ``Residual`` (``x + inner(x)``) and ``Parallel`` (branches on one input).

Both hold torchloom layers and are torchloom layers themselves: their forward runs the children's
``forward_saved`` and keeps every child's ``saved``; their hand-written backward routes the gradient
to the children's ``backward_saved`` and returns the parameter gradients in the order of
``tuple(container.parameters())``. As modules they go through the base class's generic
``LayerFunction``, so ``container(x)`` followed by ``loss.backward()`` uses the same backward.
(``Sequential``, the third container, lives in ``network.py``.)

Under ``torch.compile``, a container holding a ``ModuleLayer`` (a plain PyTorch module, whose
backward is autograd's: ``torch.autograd.grad``, which a traced backward cannot call) calls its
children as modules instead and combines their outputs with torch ops: the same sums, each child's
own backward (hand-written, or autograd's for the plain module), one graph.

    Residual   y = x + f(x)                   dx = gy + f.backward(gy)
    Parallel   concat: y = [f₁(x), …, f_n(x)] along the last dimension
                                               dx = Σ_i f_i.backward(gy[..., slice_i])
               add:    y = Σ_i f_i(x)          dx = Σ_i f_i.backward(gy)
               avg:    y = (1/n) Σ_i f_i(x)    dx = Σ_i f_i.backward(gy / n)

Loom's ``Parallel`` concatenates each sample's flattened branch outputs but its backward slices the
gradient branch-major over the whole batch; torchloom slices every sample's last
dimension, the exact inverse of the concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, is_tensor, nn
from torch.compiler import is_compiling

from .base import Layer, gather_param_grads

__all__ = ["Residual", "Parallel", "COMBINE_MODES"]

COMBINE_MODES = ("concat", "add", "avg")


def _require_layer(obj: Any, owner: str, what: str) -> Layer:
    if not isinstance(obj, Layer):
        raise TypeError(f"{owner}: {what} must be a torchloom layer (torchloom.layers.Layer), got {type(obj).__name__}")
    return obj


def _check_tensor(x: Any, owner: Layer) -> None:
    if not is_tensor(x):
        raise TypeError(f"{owner.loom_type}: input must be a torch.Tensor, got {type(x).__name__}")


def _children_as_modules(container: Layer) -> bool:
    """Whether ``container``'s module call composes its children's module calls (module note): while
    ``torch.compile`` traces, where a ``ModuleLayer`` lies anywhere inside it."""
    if not is_compiling():
        return False
    from .module_layer import ModuleLayer

    return any(isinstance(m, ModuleLayer) for m in container.modules())


# =========================================================================================== Residual
class Residual(Layer):
    """Residual connection around one torchloom layer: ``y = x + inner(x)``.

    ``inner`` must map its input to a tensor of the same shape. Shapes: input ``[batch, ...]`` as
    ``inner`` accepts → output of the same shape. Parameters: ``inner``'s.
    """

    def __init__(self, inner: Layer) -> None:
        super().__init__()
        self.inner = _require_layer(inner, "Residual", "inner")

    def forward(self, x: Tensor) -> Tensor:
        if _children_as_modules(self):
            _check_tensor(x, self)
            return self._add(x, self.inner(x))
        return super().forward(x)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, tuple[Any]]:
        _check_tensor(x, self)
        fx, saved = self.inner.forward_saved(x)
        return self._add(x, fx), (saved,)

    def _add(self, x: Tensor, fx: Tensor) -> Tensor:
        if fx.shape != x.shape:
            raise ValueError(
                f"Residual: inner layer {self.inner.loom_type} must keep the input's shape {list(x.shape)}, "
                f"got output shape {list(fx.shape)}"
            )
        return x + fx

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        g_inner, grads = self.inner.backward_saved(grad_out, saved[0], needs_input_grad)
        dx = grad_out + g_inner if needs_input_grad else None
        return dx, gather_param_grads(self, (self.inner,), (grads,))

    def pre_activation(self, saved):
        return None

    def reset_parameters(self) -> None:
        if hasattr(self.inner, "reset_parameters"):
            self.inner.reset_parameters()


# =========================================================================================== Parallel
class Parallel(Layer):
    """Every branch gets the same input; their outputs are combined.

    Args:
        branches: a non-empty list (or tuple) of torchloom layers.
        combine: ``"concat"`` (default: along the last dimension; all other dimensions must agree),
            ``"add"`` (sum; shapes must agree) or ``"avg"`` (mean of the branches).

    Shapes: input ``[batch, ...]`` as every branch accepts → ``concat``: the branches' outputs joined
    along the last dimension; ``add``/``avg``: the common output shape. Parameters: the branches', in
    branch order.
    """

    def __init__(self, branches: Sequence[Layer], combine: str = "concat") -> None:
        super().__init__()
        if isinstance(branches, Layer) or not isinstance(branches, (list, tuple, nn.ModuleList)):
            raise TypeError(
                f"Parallel: branches must be a list or tuple of torchloom layers, got {type(branches).__name__}"
            )
        if len(branches) == 0:
            raise ValueError("Parallel: branches must hold at least one layer, got an empty sequence")
        for i, b in enumerate(branches):
            _require_layer(b, "Parallel", f"branches[{i}]")
        if combine not in COMBINE_MODES:
            raise ValueError(f"Parallel: combine must be one of {COMBINE_MODES}, got {combine!r}")
        self.branches = nn.ModuleList(branches)
        self.combine = combine

    def forward(self, x: Tensor) -> Tensor:
        if _children_as_modules(self):
            _check_tensor(x, self)
            return self._combine([branch(x) for branch in self.branches])
        return super().forward(x)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, tuple[tuple[Any, ...], tuple[int, ...]]]:
        _check_tensor(x, self)
        outs, saved = [], []
        for branch in self.branches:
            y, s = branch.forward_saved(x)
            outs.append(y)
            saved.append(s)
        return self._combine(outs), (tuple(saved), tuple(y.shape[-1] for y in outs))

    def _combine(self, outs: list[Tensor]) -> Tensor:
        """The branches' outputs joined as ``combine`` says."""
        shapes = [list(y.shape) for y in outs]
        if self.combine == "concat":
            if any(y.dim() != outs[0].dim() or y.shape[:-1] != outs[0].shape[:-1] for y in outs):
                raise ValueError(
                    f"Parallel(combine='concat'): branch outputs must agree on all but the last dimension, got {shapes}"
                )
            out = torch.cat(outs, dim=-1)
        else:
            if any(y.shape != outs[0].shape for y in outs):
                raise ValueError(f"Parallel(combine={self.combine!r}): branch outputs must have one shape, got {shapes}")
            out = torch.stack(outs).sum(0) if len(outs) > 1 else outs[0].clone()
            if self.combine == "avg":
                out = out / len(outs)
        return out

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        branch_saved, sizes = saved
        if self.combine == "concat":
            branch_grads = grad_out.split(list(sizes), dim=-1)
        else:
            g = grad_out / len(self.branches) if self.combine == "avg" else grad_out
            branch_grads = [g] * len(self.branches)
        dx = None
        child_grads = []
        for branch, g, s in zip(self.branches, branch_grads, branch_saved):
            g_in, grads = branch.backward_saved(g.contiguous(), s, needs_input_grad)
            child_grads.append(grads)
            if needs_input_grad:
                dx = g_in if dx is None else dx + g_in
        return dx, gather_param_grads(self, list(self.branches), child_grads)

    def pre_activation(self, saved):
        return None

    def reset_parameters(self) -> None:
        for branch in self.branches:
            if hasattr(branch, "reset_parameters"):
                branch.reset_parameters()

    def extra_repr(self) -> str:
        return f"combine={self.combine!r}"
