"""Loom's activation functions with explicit derivatives.

Every activation is written twice, side by side: ``f(x)`` and ``f'(x)`` as a function of the
**pre-activation** ``x`` (Loom applies the derivative to the saved pre-activation, and so does
torchloom). ``grad(grad_out, pre)`` returns ``grad_out ⊙ f'(pre)``, the step every layer's
hand-written backward takes first.

Names are case-insensitive and accept Loom's aliases; an unknown name is a ``ValueError`` that lists
the valid ones (Loom silently maps it to linear).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, erf, exp, full_like, ones_like, relu, sigmoid, tanh, where, zeros

# The formulas call torch's functions by these imported names: torch.compile traces them inside every
# layer, and the ``torch`` module read from this module's globals too added an aliasing check to each
# compiled call (see kernels/_triton.py, autocast).

__all__ = ["Activation", "get_activation", "ACTIVATIONS", "activation_names"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_THRESHOLD_BACKWARD = torch.ops.aten.threshold_backward  # one name per operator: see kernels/_triton.triton_operator
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_C = 0.044715
_LEAKY_SLOPE = 0.01


class Activation:
    """One activation: ``forward(x)``, ``derivative(x)`` (w.r.t. the pre-activation) and
    ``grad(grad_out, x) = grad_out * derivative(x)``. Stateless; shapes are elementwise."""

    name: str = ""

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def derivative(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def grad(self, grad_out: Tensor, x: Tensor) -> Tensor:
        return grad_out * self.derivative(x)

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(x)

    def __repr__(self) -> str:
        return f"Activation({self.name!r})"

    # Equal by kind. Each layer holds an instance of its own (``get_activation`` returns a new one):
    # torch.compile, tracing a model whose layers shared one object, checked on every call that they
    # still did (a Python-level aliasing guard per pair of layers).
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    def __reduce__(self):  # pickle / deepcopy by name
        return (get_activation, (self.name,))


class ReLU(Activation):
    name = "relu"

    def forward(self, x):
        return relu(x)

    def derivative(self, x):  # f'(0) = 0, as Loom
        return (x > 0).to(x.dtype)

    def grad(self, grad_out, x):
        # one kernel (PyTorch's own ReLU backward), where a compare and a ``where`` would be two; it
        # passes ``grad_out`` where ``x > 0`` and writes 0 elsewhere, as ``grad_out * derivative(x)``,
        # except at a NaN ``x``: ``grad_out`` passes there (as in PyTorch), where the product gives 0.
        # A NaN pre-activation makes the output NaN, so the step it belongs to is skipped either way.
        # Twice differentiable as ``where`` is: w.r.t. ``grad_out`` the same mask, w.r.t. ``x`` zero.
        if grad_out.dtype == x.dtype:
            return _THRESHOLD_BACKWARD(grad_out, x, 0)
        return where(x > 0, grad_out, zeros((), dtype=grad_out.dtype, device=grad_out.device))


class LeakyReLU(Activation):
    name = "leaky_relu"

    def forward(self, x):
        return where(x >= 0, x, x * _LEAKY_SLOPE)

    def derivative(self, x):  # 1 if x > 0 else 0.01 (Loom: f'(0) = 0.01)
        return where(x > 0, ones_like(x), full_like(x, _LEAKY_SLOPE))

    def grad(self, grad_out, x):
        return where(x > 0, grad_out, grad_out * _LEAKY_SLOPE)


class ReLU2(Activation):
    name = "relu2"

    def forward(self, x):
        r = relu(x)
        return r * r

    def derivative(self, x):
        return 2.0 * relu(x)


class Sigmoid(Activation):
    name = "sigmoid"

    def forward(self, x):
        return sigmoid(x)

    def derivative(self, x):
        s = sigmoid(x)
        return s * (1.0 - s)


class Tanh(Activation):
    name = "tanh"

    def forward(self, x):
        return tanh(x)

    def derivative(self, x):
        t = tanh(x)
        return 1.0 - t * t


class SiLU(Activation):
    name = "silu"

    def forward(self, x):
        return x * sigmoid(x)

    def derivative(self, x):
        s = sigmoid(x)
        return s * (1.0 + x * (1.0 - s))


class GELU(Activation):
    """Exact GELU, ``x·Φ(x)``; derivative ``Φ(x) + x·φ(x)`` (Loom's training document)."""

    name = "gelu"

    def forward(self, x):
        return x * 0.5 * (1.0 + erf(x * _INV_SQRT_2))

    def derivative(self, x):
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT_2))
        pdf = exp(-0.5 * x * x) * _INV_SQRT_2PI
        return cdf + x * pdf


class GELUTanh(Activation):
    """Tanh-approximated GELU with the exact derivative of that expression (Loom's code uses a
    hybrid derivative instead: PARITY.md)."""

    name = "gelu_tanh"

    def forward(self, x):
        return 0.5 * x * (1.0 + tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)))

    def derivative(self, x):
        u = _SQRT_2_OVER_PI * (x + _GELU_C * x * x * x)
        t = tanh(u)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


class GELULoom(Activation):
    """Loom's GELU, opt-in for bit-parity with Loom's training: the tanh-approximated forward
    ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` with Loom's hybrid derivative
    ``0.5·(1 + tanh(√(2/π)·(x + 0.044715·x³))) + x·exp(−x²/2)/√(2π)`` (the tanh form's Φ plus the exact
    Gaussian's ``x·φ(x)``, which is not the derivative of the forward). Both are evaluated in float64
    and rounded to the input's dtype, as Loom does. Use ``"gelu"`` or ``"gelu_tanh"`` for a correct
    derivative."""

    name = "gelu_loom"

    def forward(self, x):
        v = x.double()
        return (0.5 * v * (1.0 + tanh(_SQRT_2_OVER_PI * (v + _GELU_C * v * v * v)))).to(x.dtype)

    def derivative(self, x):
        v = x.double()
        cdf = 0.5 * (1.0 + tanh(_SQRT_2_OVER_PI * (v + _GELU_C * v * v * v)))
        pdf = exp(-0.5 * v * v) * _INV_SQRT_2PI
        return (cdf + v * pdf).to(x.dtype)


class Linear(Activation):
    name = "linear"

    def forward(self, x):
        return x

    def derivative(self, x):
        return ones_like(x)

    def grad(self, grad_out, x):
        return grad_out


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (ReLU(), LeakyReLU(), ReLU2(), Sigmoid(), Tanh(), SiLU(), GELU(), GELUTanh(), Linear())
}

# Opt-in activations: looked up by name but not listed in ACTIVATIONS / activation_names(), because
# their derivative is deliberately not the forward's derivative (they exist for bit-parity with Loom).
OPT_IN_ACTIVATIONS: dict[str, Activation] = {"gelu_loom": GELULoom()}

_ALIASES = {
    "leakyrelu": "leaky_relu",
    "leaky-relu": "leaky_relu",
    "swish": "silu",
    "gelutanh": "gelu_tanh",
    "gelu_approx": "gelu_tanh",
    "none": "linear",
    "identity": "linear",
}


def activation_names() -> list[str]:
    """The canonical activation names, in ``ACTIVATIONS`` order (``relu``, ``leaky_relu``, ``relu2``,
    ``sigmoid``, ``tanh``, ``silu``, ``gelu``, ``gelu_tanh``, ``linear``)."""
    return list(ACTIVATIONS)


def get_activation(name: str | Activation) -> Activation:
    """A new instance of the activation named ``name`` (case-insensitive, aliases accepted; equal to
    its entry in ``ACTIVATIONS`` or ``OPT_IN_ACTIVATIONS``), or ``name`` itself when it is an
    ``Activation``. The registered activations are stateless and built without arguments.

    Raises ``TypeError`` for a non-string and ``ValueError`` listing the valid names for an unknown one.
    """
    if isinstance(name, Activation):
        return name
    if not isinstance(name, str):
        raise TypeError(f"activation must be a str or Activation, got {type(name).__name__}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key in OPT_IN_ACTIVATIONS:
        return type(OPT_IN_ACTIVATIONS[key])()
    try:
        return type(ACTIVATIONS[key])()
    except KeyError:
        valid = ", ".join(activation_names())
        aliases = ", ".join(f"{a}→{c}" for a, c in _ALIASES.items())
        raise ValueError(
            f"unknown activation {name!r}; valid names: {valid} (aliases: {aliases}; opt-in: "
            f"{', '.join(OPT_IN_ACTIVATIONS)})"
        ) from None
