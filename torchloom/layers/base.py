"""The contract every torchloom layer keeps.

A layer's math lives in two plain functions written by hand, side by side:

* ``forward_saved(x) -> (y, saved)``: the forward pass, run without building an autograd graph,
  returning the output and what the backward needs (Loom keeps the same: input and pre-activation);
* ``backward_saved(grad_out, saved, needs_input_grad=True) -> (grad_in, param_grads)``: the
  hand-written backward. ``param_grads`` is a tuple aligned with ``tuple(layer.parameters())``.

The same backward serves twice: through a ``torch.autograd.Function`` when the layer is used
as an ordinary module (``layer(x)`` then ``loss.backward()``), and directly from the trainers, which
never ask autograd for the layer's gradients (like Loom's ``DispatchLayerBackward``).

``LayerFunction`` is a generic ``autograd.Function`` over that contract, used by container layers;
leaf ops such as Dense have their own named Function with a functional API.

Mixed precision. Under ``torch.autocast`` the layers with matrix products (Dense, Conv,
ConvTranspose, SwiGLU) cast their floating inputs and parameters to the autocast dtype in
``forward_saved`` (as autocast does for ``F.linear``), save those casts, and their backward runs with
autocast off in the saved dtypes and returns every gradient in its own input's / parameter's dtype.
Norms and softmax compute in float32 and return the input's dtype. ``backward_saved`` works with
half-precision tensors and parameters too. Outside autocast, an input to Dense, Conv, ConvTranspose
or SwiGLU whose dtype differs from the parameters' is a ``TypeError`` naming both dtypes (norms and
softmax accept it: they compute in float32).

What the hand-written backwards do not support, and how it fails:

* double backward (``create_graph=True``, ``gradgradcheck``): a ``RuntimeError`` naming the layer
  (Dense without autocast casts is twice differentiable and correct);
* ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``...): the Functions define no
  ``setup_context``/``vmap``, so PyTorch raises a ``RuntimeError``; ``torch.func.functional_call``
  works;
* ``torch.jit.script``: the modules call ``autograd.Function.apply`` and Python-side helpers, which
  TorchScript cannot compile; it raises ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, is_grad_enabled, is_tensor, nn
from torch.compiler import is_compiling

# the layers' and methods' names for the autocast helpers, which the kernels share
from ..kernels._triton import autocast_dtype, autocast_off, cast_for_autocast  # noqa: F401

__all__ = [
    "Layer",
    "LayerFunction",
    "LayerRecord",
    "autocast_dtype",
    "autocast_off",
    "cast_for_autocast",
    "check_dtype",
    "check_input",
    "forbid_double_backward",
    "gather_param_grads",
    "host_checks",
    "precision_context",
    "host_checks_enabled",
]


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
    ``autograd.Function`` so the layer is a drop-in module (while ``torch.compile`` traces a call
    where nothing needs a gradient, ``forward_saved`` alone). ``pre_activation(saved)`` names the
    pre-activation inside ``saved`` for history recording (``None`` when the layer has none).
    """

    # Whether ``backward_saved`` takes ``out=``: buffers (aligned with ``parameters()``) to write the
    # parameter gradients into instead of allocating them (the CUDA training step passes its flat
    # ``.grad`` views). A layer that takes it may still return other tensors; callers check.
    accepts_grad_out = False

    # The kernel modules (dotted names) its forward and backward launch on CUDA: the training engine
    # imports them on a helper thread before the first step (``torchloom/kernels/_preload.py``).
    kernel_modules: tuple[str, ...] = ()

    def forward(self, x: Tensor) -> Tensor:
        params = tuple(self.parameters())
        if is_compiling() and not (
                is_grad_enabled() and (getattr(x, "requires_grad", False) or any(p.requires_grad for p in params))):
            # Traced with nothing to differentiate (no_grad, inference_mode, everything frozen): the
            # hand-written forward alone, which is what the Function would run. torch.compile's no-grad
            # trace of the Function passes ``ctx`` wrongly when a layer has exactly 2 parameters.
            # (Eagerly the Function runs: it refuses forward-mode AD and torch.func transforms.)
            return self.forward_saved(x)[0]
        return LayerFunction.apply(self, x, *params)

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
    if not is_tensor(x):
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


# ------------------------------------------------------------------------------ mixed precision
PRECISIONS = ("32", "bf16-mixed", "16-mixed")


def precision_context(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward-pass context of a training precision: ``"32"`` → no autocast; ``"bf16-mixed"`` →
    ``torch.autocast(device_type, dtype=torch.bfloat16)``; ``"16-mixed"`` → float16 autocast (pair
    it with loss scaling). Parameters stay in their own dtype (float32 master weights); every
    torchloom layer's backward returns gradients in the parameters' dtype. ``ValueError`` for another
    ``precision``, or ``"16-mixed"`` on a device type without float16 autocast support."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    try:
        return torch.autocast(device_type=device_type, dtype=dtype)
    except RuntimeError as e:  # e.g. an unsupported device type / dtype pair
        raise ValueError(f"precision={precision!r} is not supported on device type {device_type!r}: {e}") from None


def check_dtype(x: Tensor, name: str, expected: torch.dtype, layer: str) -> None:
    """Raise ``TypeError`` unless ``x`` is floating and has dtype ``expected`` (the layer's parameter
    dtype). Under ``torch.autocast`` on ``x``'s device any floating dtype is accepted: autocast casts."""
    if not x.is_floating_point():
        raise TypeError(f"{layer}: {name} must be a floating-point tensor (the layer's dtype is {expected}), got dtype {x.dtype}")
    if x.dtype != expected and autocast_dtype(x.device.type) is None:
        raise TypeError(
            f"{layer}: {name} has dtype {x.dtype} but the layer's parameters are {expected}; convert the input "
            f"(x.to({expected})) or the layer (layer.to({x.dtype})), or run under torch.autocast"
        )


def column_sum(t: Tensor, out: Tensor | None = None) -> Tensor:
    """``Σ_rows t`` of a 2-D ``t [rows, n]`` → ``[n]`` in ``t``'s dtype (a bias gradient), written into
    ``out`` when given. On CUDA (outside autocast) a vector-matrix product with a ones vector (cuBLAS
    GEMV, accumulating in float32 for half inputs): PyTorch's ``t.sum(0)`` stages its reduction in
    scratch memory as large as the input (measured on an H100, torch 2.11: 64 MB for ``[8192, 1024]``,
    132 MB for ``[8192, 3072]``), which set the peak memory of attention's and SwiGLU's backward. The
    result is close to ``sum(0)``'s, not bit-equal (another summation order). Elsewhere — and for an
    ``out`` of another dtype, or a ``t`` with neither dimension contiguous, which the GEMV would
    first copy — ``t.sum(0)``. Under ``torch.compile``, ``t.sum(0)`` too: the compiler plans the
    reduction's memory itself, and reading strides while it traces a backward makes Dynamo trace that
    backward again (which, inside the backward's ``autocast_off``, leaves autocast switched off)."""
    if not t.is_cuda or is_compiling():
        return t.sum(0) if out is None else torch.sum(t, 0, out=out)
    gemv = t.dim() == 2 and t.is_floating_point() and not torch.is_autocast_enabled(t.device.type)
    gemv = gemv and (out is None or out.dtype == t.dtype) and (t.stride(1) == 1 or t.stride(0) == 1)
    if gemv:
        ones = torch.ones(t.shape[0], dtype=t.dtype, device=t.device)
        return torch.mv(t.t(), ones) if out is None else torch.mv(t.t(), ones, out=out)
    return t.sum(0) if out is None else torch.sum(t, 0, out=out)


_UNSAFE_VIEW = torch.ops.aten._unsafe_view  # one name per operator: see kernels/_triton.triton_operator


def linear_2d(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x2 [rows, in] Wᵀ + b`` → ``[rows, out]`` (tensor methods: no ``torch`` read while traced)."""
    return x2.mm(weight.t()) if bias is None else bias.addmm(x2, weight.t())


def output_view(t: Tensor, *shape: int) -> Tensor:
    """``t.view(*shape)`` as a layer's output (``t`` an intermediate, such as a 2-D product reshaped to
    ``[batch, seq, features]``). Under ``torch.compile`` the result is not a view but a new tensor on
    ``t``'s storage (``aten._unsafe_view``, which PyTorch's own ``matmul`` returns for such a reshape):
    a compiled graph's output that is a view of an intermediate makes AOTAutograd rebuild the view in
    Python on every call."""
    if is_compiling():
        return _UNSAFE_VIEW(t, shape)
    return t.view(*shape)


def mm_sum(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """``Σ_i a[i] @ b[i]`` (``a[i] [n, k_i]``, ``b[i] [k_i, m]``) → a fresh ``[n, m]``: an input
    gradient fed by several projections (attention's q, k, v; SwiGLU's gate and up).

    One ``mm``, then each further product accumulated by a GEMM with β = 1: ``addmm_`` eagerly (the
    sum is never written twice), its out-of-place ``addmm`` under ``torch.compile`` (traced,
    ``addmm_`` becomes that anyway). Each product is added to the running sum inside the GEMM, in its
    float32 accumulator, so half precision rounds once per product, as eagerly (two products rounded
    and then added, as ``mm + mm`` would, differ from it by up to a few per cent in bfloat16 where they
    cancel). The traced ``addmm`` copies its addend into its output first (a device copy of the sum per
    further product). The previous compiled form, an opaque operator around the eager chain, avoided
    that copy, yet its graphed step measured slower (H200, bfloat16: SwiGLU's 0.80 against 0.76 ms
    traced; host time included, no difference beyond the noise; bench/RESULTS.md §10, run K)."""
    if is_compiling():
        with autocast_off(a[0].device.type):  # a compiled backward may run under the caller's autocast
            out = a[0].mm(b[0])
            for x, w in zip(a[1:], b[1:]):
                out = out.addmm(x, w)
        return out
    out = torch.mm(a[0], b[0])
    for x, w in zip(a[1:], b[1:]):
        out.addmm_(x, w)
    return out


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (fake-tensor tracing, for one) is active: its tensors are not real
    ones, so no host-side store may keep them."""
    from torch.utils import _python_dispatch

    active = getattr(_python_dispatch, "is_in_torch_dispatch_mode", None)
    return bool(active()) if active is not None else False


def forbid_double_backward(layer: str) -> None:
    """Called first in a hand-written backward: raise ``RuntimeError`` when a second derivative is
    being asked for (``create_graph=True``; autograd runs the backward with grad mode on exactly
    then). The hand-written backwards are not differentiable, and ``once_differentiable`` alone lets
    some second derivatives come out as silent zeros."""
    if is_grad_enabled():
        raise RuntimeError(
            f"{layer}: double backward (create_graph=True, e.g. gradient penalties or gradgradcheck) is not "
            "supported: its hand-written backward is not differentiable. Use the equivalent PyTorch layer "
            "for higher-order gradients."
        )


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
        forbid_double_backward(ctx.layer.loom_type)
        saved = ctx.rebuild(list(ctx.saved_tensors))
        with autocast_off(grad_out.device.type):
            grad_in, param_grads = ctx.layer.backward_saved(
                grad_out.contiguous(), saved, needs_input_grad=ctx.needs_input_grad[1]
            )
        return (None, grad_in, *param_grads)
