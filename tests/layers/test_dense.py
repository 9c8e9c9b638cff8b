"""Dense: hand-written backward vs gradcheck and torch autograd (SPEC §3)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import ACTIVATION_REFERENCE as REFERENCE, assert_close
from torchloom.layers.activations import activation_names, get_activation
from torchloom.layers.dense import Dense, DenseFunction, dense, dense_backward, dense_forward


def _inputs(batch, n_in, n_out, bias, dtype=torch.float64):
    x = torch.randn(batch, n_in, dtype=dtype, requires_grad=True)
    w = torch.randn(n_out, n_in, dtype=dtype, requires_grad=True)
    b = torch.randn(n_out, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", activation_names())
def test_gradcheck(name, bias, batch):
    x, w, b = _inputs(batch, 5, 3, bias)
    act = get_activation(name)
    inputs = (x, w, b, act) if bias else (x, w, None, act)
    assert torch.autograd.gradcheck(DenseFunction.apply, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", activation_names())
def test_matches_torch_functional_and_autograd(name, dtype, tol):
    x, w, b = _inputs(6, 9, 4, True, dtype)
    g = torch.randn(6, 4, dtype=dtype)
    y = dense(x, w, b, name)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), g)
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    yr = REFERENCE[name](F.linear(xr, wr, br))
    rx, rw, rb = torch.autograd.grad(yr, (xr, wr, br), g)
    for got, ref, n in ((y, yr, "y"), (gx, rx, "grad_x"), (gw, rw, "grad_w"), (gb, rb, "grad_b")):
        assert_close(got, ref, name=n, rtol=tol, atol=tol)


def test_direct_backward_is_the_same_math_and_skips_input_grad():
    x, w, b = _inputs(4, 3, 2, True)
    act = get_activation("tanh")
    y, saved = dense_forward(x.detach(), w.detach(), b.detach(), act)
    g = torch.randn_like(y)
    gx, (gw, gb) = dense_backward(g, saved)
    rx, rw, rb = torch.autograd.grad(torch.tanh(F.linear(x, w, b)), (x, w, b), g)
    assert_close(gx, rx, name="grad_x", rtol=1e-12, atol=1e-12)
    assert_close(gw, rw, name="grad_w", rtol=1e-12, atol=1e-12)
    assert_close(gb, rb, name="grad_b", rtol=1e-12, atol=1e-12)
    none_x, (gw2, _) = dense_backward(g, saved, needs_input_grad=False)
    assert none_x is None and torch.equal(gw2, gw)


def test_module_forward_and_backward_saved_agree_with_autograd():
    layer = Dense(5, 3, "silu", dtype=torch.float64)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    with torch.no_grad():
        y2, saved = layer.forward_saved(x.detach())
    gx, (gw, gb) = layer.backward_saved(g, saved)
    assert torch.equal(y.detach(), y2)
    assert_close(gx, x.grad, name="grad_x", rtol=1e-12, atol=1e-12)
    assert_close(gw, layer.weight.grad, name="grad_w", rtol=1e-12, atol=1e-12)
    assert_close(gb, layer.bias.grad, name="grad_b", rtol=1e-12, atol=1e-12)
    assert saved.pre is layer.pre_activation(saved)


def test_no_bias_returns_one_param_grad():
    layer = Dense(4, 2, "relu", bias=False)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    y, saved = layer.forward_saved(torch.randn(3, 4))
    _, grads = layer.backward_saved(torch.ones_like(y), saved)
    assert len(grads) == 1 and grads[0].shape == (2, 4)


def test_leading_dims_beyond_batch():
    layer = Dense(4, 3, "gelu", dtype=torch.float64)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t), (x,))
    ref = F.gelu(F.linear(x, layer.weight, layer.bias))
    assert_close(layer(x), ref, name="y", rtol=1e-12, atol=1e-12)


def test_he_normal_and_loom_uniform_init():
    torch.manual_seed(1)
    he = Dense(400, 300)
    std = he.weight.std().item()
    assert abs(std - math.sqrt(2 / 400)) < 0.02 * math.sqrt(2 / 400) * 5
    assert abs(he.weight.mean().item()) < 0.01
    assert torch.count_nonzero(he.bias) == 0
    lu = Dense(400, 300, init="loom_uniform")
    assert lu.weight.abs().max().item() <= 0.1
    assert lu.weight.abs().max().item() > 0.099  # really spans the range
    assert torch.count_nonzero(lu.bias) == 0


def test_factory_kwargs_and_repr():
    layer = Dense(3, 2, "tanh", bias=False, dtype=torch.float64)
    assert layer.weight.dtype == torch.float64
    assert "in_features=3, out_features=2, activation=tanh, bias=False" in repr(layer)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(in_features=0, out_features=2), "in_features must be a positive int, got 0"),
        (dict(in_features=3, out_features=2.5), "out_features must be a positive int, got 2.5"),
        (dict(in_features=3, out_features=2, init="xavier"), "init must be one of"),
        (dict(in_features=3, out_features=2, activation="swishy"), "unknown activation 'swishy'"),
    ],
)
def test_bad_constructor_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Dense(**kwargs)


def test_wrong_input_shape_names_expected_and_received():
    layer = Dense(4, 2)
    with pytest.raises(ValueError, match=r"\[batch, \.\.\., 4\], got \[3, 5\]"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"got \[4\]"):
        layer.forward_saved(torch.randn(4))


@torch.no_grad()  # as the trainers call it
def test_backward_writes_into_given_buffers():
    layer = Dense(4, 3, "relu", dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64)
    y, saved = layer.forward_saved(x)
    g = torch.randn_like(y)
    _, (rw, rb) = layer.backward_saved(g, saved)
    bw, bb = torch.full_like(rw, 7.0), torch.full_like(rb, 7.0)
    _, (gw, gb) = layer.backward_saved(g, saved, out=(bw, bb))
    assert gw is bw and gb is bb
    assert torch.equal(bw, rw) and torch.equal(bb, rb)
    # buffers that do not fit are not used
    _, (gw2, _) = layer.backward_saved(g, saved, out=(torch.zeros(2, 2, dtype=torch.float64), None))
    assert torch.equal(gw2, rw)
