"""``Embedding`` (Loom ``Embedding``): a row lookup with a hand-written backward.

Read top to bottom: ``embedding_forward`` / ``embedding_backward`` (the math, side by side),
``EmbeddingFunction`` (the autograd bridge), ``embedding`` (functional), ``Embedding`` (module).

* forward: ``y[b, …] = W[x[b, …]]`` for integer indices ``x [B, …]`` → ``y [B, …, E]``;
* backward: ``dW[v] = Σ_{positions with x = v} gOut`` — a scatter-add (``index_add_``) of the
  output gradient rows into a zero ``[V, E]`` gradient. The indices are not differentiable: the input
  gradient is ``None``.

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
from torch import Tensor, nn

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
    """What Embedding's backward needs: the indices ``[B, …]`` and the table size ``V``."""

    indices: Tensor
    num_embeddings: int
    weight_dtype: torch.dtype | None = None  # dW's dtype (None: grad_out's)


def check_indices(x: Tensor, num_embeddings: int, owner: str = "Embedding", check_range: bool = True) -> None:
    """Raise ``TypeError`` unless ``x`` is an integer tensor of at least 1 dimension, and (when
    ``check_range``) ``ValueError`` unless every index lies in ``[0, num_embeddings)``. The range
    check reads back min and max (one host sync on CUDA). Under ``torch.compile`` it is a
    device-side assertion in the graph instead (``torch._assert_async``: no host read, no graph
    break), which raises ``RuntimeError`` with the same message when the graph runs."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: input must be a torch.Tensor of integer indices, got {type(x).__name__}")
    if x.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{owner}: input must hold integer indices (int64, int32, ...), got dtype {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{owner}: input must have shape [batch, ...] (at least 1-d), got {list(x.shape)}")
    if check_range and x.numel() > 0 and host_checks_enabled():
        if torch.compiler.is_compiling():  # no host read in a compiled graph: a device-side assertion
            in_range = ((x >= 0) & (x < num_embeddings)).all()
            torch._assert_async(in_range, f"{owner}: indices must lie in [0, {num_embeddings})")
            return
        lo, hi = torch.aminmax(x)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= num_embeddings:
            raise ValueError(f"{owner}: indices must lie in [0, {num_embeddings}), got values in [{lo}, {hi}]")


def embedding_forward(x: Tensor, weight: Tensor) -> tuple[Tensor, EmbeddingSaved]:
    """``x [B, …]`` (integer, in range) and ``weight [V, E]`` → ``(W[x] [B, …, E], saved)``. No autograd."""
    y = weight.index_select(0, x.reshape(-1)).view(*x.shape, weight.shape[1])
    return y, EmbeddingSaved(x, weight.shape[0], weight.dtype)


def embedding_backward(
    grad_out: Tensor, saved: EmbeddingSaved, needs_input_grad: bool = True
) -> tuple[None, tuple[Tensor]]:
    """Hand-written backward: ``dW = 0``, then ``dW[x[n]] += gOut[n]`` for every position ``n``
    (``index_add_``; a row used k times gets the sum of its k gradients). Returns ``(None, (dW,))``:
    integer indices have no gradient."""
    indices, num_embeddings, weight_dtype = saved
    E = grad_out.shape[-1]
    if weight_dtype is not None and grad_out.dtype != weight_dtype:
        grad_out = grad_out.to(weight_dtype)  # e.g. a bfloat16 gradient for a float32 table
    grad_w = grad_out.new_zeros(num_embeddings, E)
    grad_w.index_add_(0, indices.reshape(-1), grad_out.reshape(-1, E))
    return None, (grad_w,)


class EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        y, saved = embedding_forward(x, weight)
        ctx.save_for_backward(x)
        ctx.num_embeddings, ctx.weight_dtype = saved.num_embeddings, saved.weight_dtype
        return y

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("Embedding")
        (x,) = ctx.saved_tensors
        saved = EmbeddingSaved(x, ctx.num_embeddings, ctx.weight_dtype)
        _, (grad_w,) = embedding_backward(grad_out.contiguous(), saved)
        return None, grad_w


def embedding(x: Tensor, weight: Tensor) -> Tensor:
    """Functional embedding lookup ``W[x]``: ``x [B, …]`` integer indices in ``[0, V)``, ``weight
    [V, E]`` → ``[B, …, E]``; differentiable in ``weight`` through the hand-written backward."""
    check_indices(x, weight.shape[0], "embedding")
    return EmbeddingFunction.apply(x, weight)


class Embedding(Layer):
    """Lookup table ``y = W[x]``.

    Args:
        num_embeddings: ``V``, the vocabulary size; embedding_dim: ``E``.
        init: ``"normal"`` (default: ``N(0, 1)``, as ``nn.Embedding``) or ``"loom_uniform"``
            (``U(−0.1, 0.1)``, Loom ``poly``).
        check_indices: check on every forward that indices lie in ``[0, V)`` (``ValueError``
            otherwise). Costs one host sync per forward on CUDA; ``False`` skips it.

    Parameters: ``weight [V, E]``. Shapes: integer input ``[B, …]`` → output ``[B, …, E]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init: str = "normal",
        check_indices: bool = True,
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
        return EmbeddingFunction.apply(x, self.weight)

    def forward_saved(self, x: Tensor) -> tuple[Tensor, EmbeddingSaved]:
        self._check(x)
        return embedding_forward(x, self.weight)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return embedding_backward(grad_out, saved, needs_input_grad)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
