"""``Embedding`` (Loom ``Embedding``): a row lookup, then an optional activation, with a hand-written
backward.

Read top to bottom: ``embedding_forward`` / ``embedding_backward`` (the math, side by side),
``EmbeddingFunction`` (the autograd bridge), ``embedding`` (functional), ``Embedding`` (module).

* forward: ``pre[b, …] = W[x[b, …]]`` for integer indices ``x [B, …]``, ``y = f(pre)`` → ``[B, …, E]``
  (``f`` linear by default; Loom's Embedding applies its ``activation`` field the same way);
* backward: ``gPre = gOut ⊙ f'(pre)``, then ``dW[v] = Σ_{positions with x = v} gPre`` — a scatter-add
  (``index_add_``) into a zero ``[V, E]`` gradient. The indices are not differentiable: the input
  gradient is ``None``. (Loom's backward skips ``f'``: PARITY.md.)

Out-of-range indices are a ``ValueError`` (Loom silently skips them and outputs a zero row). The check
reads two numbers (min and max) back from the indices' device: free on CPU, one host synchronisation
per forward on CUDA; ``Embedding(..., check_indices=False)`` drops it for a hot loop over data already
known to be in range (an out-of-range index then hits PyTorch's own device-side index assertion).
Under ``torch.compile`` the check is a device-side assertion inside the compiled graph: a
``RuntimeError`` with the same message, and no host synchronisation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, _assert_async, is_grad_enabled, is_tensor, nn
from torch.compiler import is_compiling

from .activations import Activation, get_activation
from .base import forbid_double_backward, host_checks_enabled, Layer

__all__ = [
    "Embedding",
    "EmbeddingFunction",
    "EmbeddingSaved",
    "embedding",
    "embedding_forward",
    "embedding_backward",
    "check_indices",
]

_EMB_INITS = ("normal", "loom_uniform")
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class EmbeddingSaved(NamedTuple):
    """What Embedding's backward needs: the indices ``[B, …]``, the table size ``V``, and for a
    non-linear activation the pre-activation rows and the activation (``None`` when linear: nothing
    more is kept)."""

    indices: Tensor
    num_embeddings: int
    weight_dtype: torch.dtype | None = None  # dW's dtype (None: grad_out's)
    pre: Tensor | None = None
    activation: Activation | None = None


def check_indices(x: Tensor, num_embeddings: int, owner: str = "Embedding", check_range: bool = True) -> None:
    """Raise ``TypeError`` unless ``x`` is an integer tensor of at least 1 dimension, and (when
    ``check_range``) ``ValueError`` unless every index lies in ``[0, num_embeddings)``. The range
    check reads back min and max (one host sync on CUDA). Under ``torch.compile`` it is a
    device-side assertion in the graph instead (``torch._assert_async``: no host read, no graph
    break), which raises ``RuntimeError`` with the same message when the graph runs."""
    if not is_tensor(x):
        raise TypeError(f"{owner}: input must be a torch.Tensor of integer indices, got {type(x).__name__}")
    if x.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{owner}: input must hold integer indices (int64, int32, ...), got dtype {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{owner}: input must have shape [batch, ...] (at least 1-d), got {list(x.shape)}")
    if check_range and x.numel() > 0 and host_checks_enabled():
        if is_compiling():  # no host read in a compiled graph: a device-side assertion
            in_range = ((x >= 0) & (x < num_embeddings)).all()
            _assert_async(in_range, f"{owner}: indices must lie in [0, {num_embeddings})")
            return
        lo, hi = torch.aminmax(x)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= num_embeddings:
            raise ValueError(f"{owner}: indices must lie in [0, {num_embeddings}), got values in [{lo}, {hi}]")


def embedding_forward(x: Tensor, weight: Tensor, activation: Activation | None = None) -> tuple[Tensor, EmbeddingSaved]:
    """``x [B, …]`` (integer, in range) and ``weight [V, E]`` → ``(f(W[x]) [B, …, E], saved)``; ``f``
    the activation (``None`` or linear: the rows themselves). No autograd."""
    y, pre, activation = _embedding_forward(x, weight, activation)
    return y, EmbeddingSaved(x, weight.shape[0], weight.dtype, pre, activation)


# The bodies of embedding_forward / embedding_backward on plain arguments, which EmbeddingFunction
# calls: a saved record (a NamedTuple) built while torch.compile traces adds ~20 guards to every
# compiled call.
def _embedding_forward(x, weight, activation):
    """``(y, pre, activation)``, the last two None for a linear activation (nothing more is kept)."""
    pre = weight.index_select(0, x.reshape(-1)).view(*x.shape, weight.shape[1])
    if activation is None or activation.name == "linear":
        return pre, None, None
    return activation.forward(pre), pre, activation


def embedding_backward(
    grad_out: Tensor, saved: EmbeddingSaved, needs_input_grad: bool = True
) -> tuple[None, tuple[Tensor]]:
    """Hand-written backward: ``gPre = gOut ⊙ f'(pre)`` (for a non-linear activation), ``dW = 0``,
    then ``dW[x[n]] += gPre[n]`` for every position ``n`` (``index_add_``; a row used k times gets the
    sum of its k gradients). Returns ``(None, (dW,))``: integer indices have no gradient."""
    return None, (_embedding_backward(grad_out, *saved),)


def _embedding_backward(grad_out, indices, num_embeddings, weight_dtype, pre, activation):
    E = grad_out.shape[-1]
    if weight_dtype is not None and grad_out.dtype != weight_dtype:
        grad_out = grad_out.to(weight_dtype)  # e.g. a bfloat16 gradient for a float32 table
    if activation is not None:
        grad_out = activation.grad(grad_out, pre)
    grad_w = grad_out.new_zeros(num_embeddings, E)
    grad_w.index_add_(0, indices.reshape(-1), grad_out.reshape(-1, E))
    return grad_w


class EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, activation=None):
        y, pre, kept = _embedding_forward(x, weight, activation)
        ctx.save_for_backward(x, pre)
        ctx.num_embeddings, ctx.weight_dtype, ctx.activation = weight.shape[0], weight.dtype, kept
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if is_grad_enabled():
            forbid_double_backward("Embedding")
        x, pre = ctx.saved_tensors
        grad_w = _embedding_backward(grad_out.contiguous(), x, ctx.num_embeddings, ctx.weight_dtype, pre, ctx.activation)
        return None, grad_w, None


def embedding(x: Tensor, weight: Tensor, activation: str | Activation = "linear") -> Tensor:
    """Functional embedding lookup ``f(W[x])``: ``x [B, …]`` integer indices in ``[0, V)``, ``weight
    [V, E]`` → ``[B, …, E]``; ``f`` an activation name (default linear). Differentiable in ``weight``
    through the hand-written backward."""
    check_indices(x, weight.shape[0], "embedding")
    return EmbeddingFunction.apply(x, weight, get_activation(activation))


class Embedding(Layer):
    """Lookup table ``y = f(W[x])``.

    Args:
        num_embeddings: ``V``, the vocabulary size; embedding_dim: ``E``.
        init: ``"normal"`` (default: ``N(0, 1)``, as ``nn.Embedding``) or ``"loom_uniform"``
            (``U(−0.1, 0.1)``, Loom ``poly``).
        check_indices: check on every forward that indices lie in ``[0, V)`` (``ValueError``
            otherwise). Costs one host sync per forward on CUDA; ``False`` skips it.
        activation: applied to the looked-up rows, see ``activation_names()`` (default
            ``"linear"``: the rows themselves, as ``nn.Embedding``). Loom's Embedding has this field.

    Parameters: ``weight [V, E]``. Shapes: integer input ``[B, …]`` → output ``[B, …, E]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init: str = "normal",
        check_indices: bool = True,
        activation: str | Activation = "linear",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for arg, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Embedding: {arg} must be a positive int, got {v!r}")
        if init not in _EMB_INITS:
            raise ValueError(f"Embedding: init must be one of {_EMB_INITS}, got {init!r}")
        if not isinstance(check_indices, bool):
            raise ValueError(f"Embedding: check_indices must be a bool, got {check_indices!r}")
        self.activation = get_activation(activation)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.init, self.check_indices = init, check_indices
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.init == "normal":
                self.weight.normal_(0.0, 1.0)
            else:
                self.weight.uniform_(-0.1, 0.1)

    def _check(self, x: Tensor) -> None:
        owner = f"Embedding({self.num_embeddings}, {self.embedding_dim})"
        check_indices(x, self.num_embeddings, owner, check_range=self.check_indices)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return EmbeddingFunction.apply(x, self.weight, self.activation)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, EmbeddingSaved]:
        self._check(x)
        return embedding_forward(x, self.weight, self.activation)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return embedding_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        act = "" if self.activation.name == "linear" else f", activation={self.activation.name}"
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}{act}"
