"""Correct or loud: second derivatives, ``torch.func.functional_call``, and the transforms that are not
supported (``vmap``, ``torch.jit.script``) fail with a clear error instead of a silent wrong result.

Dense (without autocast) is twice differentiable: ``gradgradcheck`` in float64 compares its second
derivatives with finite differences. Every other layer raises ``RuntimeError`` as soon as a second
derivative is asked for (``create_graph=True``), including under ``gradgradcheck`` (which, with
``once_differentiable`` alone, can see a silent zero)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, vmap

from torchloom.layers.activations import activation_names, get_activation
from torchloom.layers.containers import Parallel, Residual
from torchloom.layers.conv import Conv1D, Conv2D, Conv3D, Flatten
from torchloom.layers.dense import Dense, DenseFunction
from torchloom.layers.embedding import Embedding
from torchloom.layers.network import Network, Sequential
from torchloom.layers.norm import LayerNorm, RMSNorm
from torchloom.layers.softmax import Softmax
from torchloom.layers.swiglu import SwiGLU

D = torch.float64


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("act", activation_names())
def test_dense_gradgradcheck(act, bias):
    """Dense's second derivatives (w.r.t. input, weight, bias and the incoming gradient) match finite
    differences for every activation; a 3-D input covers the reshapes."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=D, requires_grad=True)
    w = torch.randn(5, 4, dtype=D, requires_grad=True)
    b = torch.randn(5, dtype=D, requires_grad=True) if bias else None
    a = get_activation(act)
    fn = (lambda x, w, b: DenseFunction.apply(x, w, b, a)) if bias else (lambda x, w: DenseFunction.apply(x, w, None, a))
    assert torch.autograd.gradgradcheck(fn, (x, w, b) if bias else (x, w))


def test_dense_hessian_vector_product_matches_plain_torch():
    """A gradient penalty through a Network of Dense layers equals the same model in plain torch."""
    torch.manual_seed(0)
    net = Network(Dense(4, 6, "tanh"), Dense(6, 1, "gelu")).double()
    lin = [torch.nn.Linear(4, 6).double(), torch.nn.Linear(6, 1).double()]
    with torch.no_grad():
        for l, d in zip(lin, net.layers):
            l.weight.copy_(d.weight)
            l.bias.copy_(d.bias)
    x = torch.randn(7, 4, dtype=D, requires_grad=True)
    (gx,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
    gx.square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    yr = torch.nn.functional.gelu(lin[1](torch.tanh(lin[0](xr))))
    (gxr,) = torch.autograd.grad(yr.sum(), xr, create_graph=True)
    gxr.square().sum().backward()
    torch.testing.assert_close(gx, gxr, rtol=1e-10, atol=1e-12)
    for d, l in zip(net.layers, lin):
        torch.testing.assert_close(d.weight.grad, l.weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(d.bias.grad, l.bias.grad, rtol=1e-10, atol=1e-12)


def _loud_cases():
    f = lambda *s: torch.randn(*s, dtype=D)  # noqa: E731
    return {
        "conv1d": (lambda: Conv1D(2, 3, 3, activation="tanh"), f(2, 2, 6)),
        "conv2d": (lambda: Conv2D(2, 3, 2, activation="relu"), f(2, 2, 4, 5)),
        "conv3d": (lambda: Conv3D(1, 2, 2), f(1, 1, 3, 3, 3)),
        "swiglu": (lambda: SwiGLU(4, 5), f(3, 4)),
        "rmsnorm": (lambda: RMSNorm(5), f(3, 5)),
        "layernorm": (lambda: LayerNorm(5), f(3, 5)),
        "softmax": (lambda: Softmax(), f(3, 5)),
        "flatten": (lambda: Flatten(), f(2, 3, 2)),
        "residual": (lambda: Residual(Dense(4, 4, "tanh")), f(3, 4)),
        "parallel": (lambda: Parallel([Dense(4, 2), Dense(4, 3, "relu")]), f(3, 4)),
        "sequential_dense_norm": (lambda: Sequential(Dense(4, 4, "tanh"), RMSNorm(4)), f(3, 4)),
        "network_dense_softmax": (lambda: Network(Dense(4, 4, "tanh"), Softmax()), f(3, 4)),
    }


LOUD = _loud_cases()


@pytest.mark.parametrize("name", list(LOUD))
def test_second_derivative_is_loud(name):
    make, x = LOUD[name]
    layer = make().double()
    x = x.clone().requires_grad_()
    y = layer(x)
    # first order still works with create_graph=False
    torch.autograd.grad(y.sum(), [x, *layer.parameters()], retain_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    params = tuple(layer.parameters())

    def fn(x, *ps):
        return functional_call(layer, {n: p for (n, _), p in zip(layer.named_parameters(), ps)}, (x,))

    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(fn, (x, *[p.detach().clone().requires_grad_() for p in params]))


def test_embedding_second_derivative_is_loud():
    layer = Embedding(6, 3).double()
    y = layer(torch.tensor([[0, 5, 2]]))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((y * y).sum(), layer.weight, create_graph=True)


def test_dense_under_autocast_second_derivative_is_loud():
    layer = Dense(4, 3, "tanh")
    x = torch.randn(5, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.float().sum(), x, create_graph=True)


# ----------------------------------------------------------------------------- torch.func
FC_CASES = {
    **{k: v for k, v in LOUD.items()},
    "dense": (lambda: Dense(4, 3, "gelu"), torch.randn(3, 4, dtype=D)),
    "embedding": (lambda: Embedding(6, 3), torch.tensor([[0, 5], [2, 2]])),
}


@pytest.mark.parametrize("name", list(FC_CASES))
def test_functional_call_uses_the_given_parameters(name):
    """``functional_call(layer, params, x)`` equals the layer with ``params`` loaded, and the gradients
    reach the tensors passed in (the layer's own parameters are untouched)."""
    make, x = FC_CASES[name]
    layer = make().double()
    torch.manual_seed(5)
    new = {n: (torch.randn_like(p) * 0.7).requires_grad_() for n, p in layer.named_parameters()}
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    y = functional_call(layer, new, (x,))
    twin = make().double()
    twin.load_state_dict({n: t.detach() for n, t in new.items()}, strict=False)
    y_ref = twin(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    if new:
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, list(new.values()), g)
        (y_ref * g).sum().backward()
        for (n, p), gr in zip(twin.named_parameters(), grads):
            torch.testing.assert_close(gr, p.grad, rtol=1e-12, atol=1e-12)
    for n, p in layer.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None


@pytest.mark.parametrize("name", ["dense", "rmsnorm", "conv1d", "residual", "embedding"])
def test_vmap_and_jit_script_error_clearly(name):
    """Not supported: documented, and an error rather than a silent result."""
    make, x = FC_CASES[name]
    layer = make().double()
    with pytest.raises(RuntimeError):
        vmap(layer)(torch.stack([x, x]))
    with pytest.raises(RuntimeError):
        torch.jit.script(layer)


@pytest.mark.parametrize("how", ["no_grad", "frozen"])
def test_transforms_error_clearly_where_nothing_needs_a_gradient(how):
    """A container on the base class's forward keeps refusing ``vmap`` and forward-mode AD under
    ``no_grad`` and with its parameters frozen (the hand-written forward alone would drop the tangent
    of any part a kernel writes), as with gradients on."""
    import torch.autograd.forward_ad as fwAD

    make, x = FC_CASES["residual"]
    layer = make().double()
    if how == "frozen":
        layer.requires_grad_(False)
    context = torch.no_grad if how == "no_grad" else torch.enable_grad
    with context():
        with pytest.raises(RuntimeError):
            vmap(layer)(torch.stack([x, x]))
        with pytest.raises((RuntimeError, NotImplementedError)), fwAD.dual_level():
            layer(fwAD.make_dual(x, torch.ones_like(x)))
