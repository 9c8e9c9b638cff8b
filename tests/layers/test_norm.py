"""RMSNorm and LayerNorm: hand-written backward against gradcheck, ``torch.nn.RMSNorm`` and
``F.layer_norm`` (SPEC §3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.layers.norm import (
    LayerNorm,
    LayerNormFunction,
    RMSNorm,
    RMSNormFunction,
    layer_norm,
    rms_norm,
)
from torchloom.engine.train import TrainingConfig, train

SHAPES = [(3, 5), (2, 3, 7), (4, 1), (2, 2, 3, 4)]  # odd sizes, n = 1, more than one leading dim


def _ids(s):
    return "x".join(map(str, s))


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_gradcheck_float64(shape):
    n = shape[-1]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, dtype=torch.float64, requires_grad=True)
    b = torch.randn(n, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(RMSNormFunction.apply, (x, w, 1e-6))
    assert torch.autograd.gradcheck(LayerNormFunction.apply, (x, w, b, 1e-5))


def _random_affine(layer: nn.Module) -> None:
    """Non-trivial weights (the defaults 1 and 0 would hide a missing factor in a gradient)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.5, 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_rmsnorm_matches_torch_rmsnorm(shape, dtype, tol):
    n = shape[-1]
    layer = RMSNorm(n, eps=1e-6, dtype=dtype)
    _random_affine(layer)
    ref = nn.RMSNorm(n, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
    x = torch.randn(*shape, dtype=dtype) * 2
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = layer(xo), ref(xr)
    assert_close(y, y_ref, name="output", rtol=tol, atol=tol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert_close(xo.grad, xr.grad, name="grad input", rtol=tol, atol=tol)
    assert_close(layer.weight.grad, ref.weight.grad, name="grad weight", rtol=tol, atol=tol)
    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        gx, (gw,) = layer.backward_saved(g, saved)
    assert_close(y2, y_ref, name="forward_saved output", rtol=tol, atol=tol)
    assert_close(gx, xr.grad, name="backward_saved grad input", rtol=tol, atol=tol)
    assert_close(gw, ref.weight.grad, name="backward_saved grad weight", rtol=tol, atol=tol)
    none_x, (gw2,) = layer.backward_saved(g, saved, needs_input_grad=False)
    assert none_x is None and torch.equal(gw2, gw)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_layernorm_matches_f_layer_norm(shape, dtype, tol):
    n = shape[-1]
    layer = LayerNorm(n, eps=1e-5, dtype=dtype)
    _random_affine(layer)
    x = torch.randn(*shape, dtype=dtype) * 2 + 1
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    wr, br = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    y, y_ref = layer(xo), F.layer_norm(xr, (n,), wr, br, 1e-5)
    assert_close(y, y_ref, name="output", rtol=tol, atol=tol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert_close(xo.grad, xr.grad, name="grad input", rtol=tol, atol=tol)
    assert_close(layer.weight.grad, wr.grad, name="grad weight", rtol=tol, atol=tol)
    assert_close(layer.bias.grad, br.grad, name="grad bias", rtol=tol, atol=tol)
    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        gx, (gw, gb) = layer.backward_saved(g, saved)
    assert_close(y2, y_ref, name="forward_saved output", rtol=tol, atol=tol)
    assert_close(gx, xr.grad, name="backward_saved grad input", rtol=tol, atol=tol)
    assert_close(gw, wr.grad, name="backward_saved grad weight", rtol=tol, atol=tol)
    assert_close(gb, br.grad, name="backward_saved grad bias", rtol=tol, atol=tol)
    assert layer.backward_saved(g, saved, needs_input_grad=False)[0] is None


def test_functionals_match_modules():
    x = torch.randn(3, 6, dtype=torch.float64)
    rms, ln = RMSNorm(6, eps=1e-4, dtype=torch.float64), LayerNorm(6, eps=1e-3, dtype=torch.float64)
    _random_affine(rms)
    _random_affine(ln)
    assert torch.equal(rms_norm(x, rms.weight, 1e-4), rms(x))
    assert torch.equal(layer_norm(x, ln.weight, ln.bias, 1e-3), ln(x))


def test_eps_is_used():
    """A small-norm row shows eps: y = x / sqrt(mean(x²) + eps)."""
    x = torch.full((2, 4), 1e-3, dtype=torch.float64)
    y = RMSNorm(4, eps=1e-6, dtype=torch.float64)(x)
    assert_close(y, x / torch.sqrt(torch.tensor(1e-6 + 1e-6, dtype=torch.float64)), name="y", rtol=1e-12, atol=0)


@pytest.mark.parametrize("make", [lambda: RMSNorm(6), lambda: LayerNorm(6)], ids=["RMSNorm", "LayerNorm"])
def test_batch_independence(make):
    layer = make()
    _random_affine(layer)
    x = torch.randn(4, 3, 6)
    x2 = x.clone()
    x2[0] = torch.randn(3, 6) * 7
    y, y2 = layer(x), layer(x2)
    assert not torch.equal(y[0], y2[0])
    assert torch.equal(y[1:], y2[1:])
    xr = x.clone().requires_grad_()
    layer(xr)[1:].square().sum().backward()
    assert torch.count_nonzero(xr.grad[0]) == 0


def test_inside_network_with_history():
    """Dense → RMSNorm → Dense → LayerNorm in Loom mode: hand-written backward equals autograd through
    the torch reference; the norms record no pre-activation."""
    dt = torch.float64
    net = Network(Dense(4, 6, "tanh", dtype=dt), RMSNorm(6, dtype=dt), Dense(6, 5, dtype=dt), LayerNorm(5, dtype=dt), record_history=True)
    _random_affine(net[1])
    _random_affine(net[3])
    x = torch.randn(7, 4, dtype=dt)
    y = net(x)
    assert net.history[1].pre is None and net.history[3].pre is None
    g = torch.randn_like(y)
    gx = net.backward(g, input_grad=True)
    got = [p.grad.clone() for p in net.parameters()]

    params = [p.detach().clone().requires_grad_() for p in net.parameters()]
    w0, b0, g1, w2, b2, g3, b3 = params
    xr = x.clone().requires_grad_()
    h = torch.tanh(F.linear(xr, w0, b0))
    h = F.rms_norm(h, (6,), g1, 1e-6)
    h = F.linear(h, w2, b2)
    y_ref = F.layer_norm(h, (5,), g3, b3, 1e-5)
    assert_close(y, y_ref, name="output", rtol=1e-12, atol=1e-12)
    ref = torch.autograd.grad(y_ref, [xr, *params], g)
    assert_close(gx, ref[0], name="grad input", rtol=1e-10, atol=1e-12)
    for i, (a, r) in enumerate(zip(got, ref[1:])):
        assert_close(a, r, name=f"param {i}", rtol=1e-10, atol=1e-12)


def test_init_layout_and_repr():
    rms, ln = RMSNorm(5), LayerNorm(5, dtype=torch.float64)
    assert [n for n, _ in rms.named_parameters()] == ["weight"]
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    assert torch.equal(rms.weight, torch.ones(5)) and torch.equal(ln.weight, torch.ones(5, dtype=torch.float64))
    assert torch.count_nonzero(ln.bias) == 0 and ln.bias.dtype == torch.float64
    with torch.no_grad():
        rms.weight.mul_(3)
    rms.reset_parameters()
    assert torch.equal(rms.weight, torch.ones(5))
    assert "5, eps=1e-06" in repr(rms) and "5, eps=1e-05" in repr(ln)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize(
    "args,pattern",
    [
        ((0,), "normalized_shape must be a positive int, got 0"),
        ((4.0,), "normalized_shape must be a positive int, got 4.0"),
        ((4, 0.0), "eps must be a finite number > 0, got 0.0"),
        ((4, -1e-5), "eps must be a finite number > 0, got -1e-05"),
    ],
)
def test_bad_constructor_args(cls, args, pattern):
    with pytest.raises(ValueError, match=pattern):
        cls(*args)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("shape", [(3, 5), (4,)], ids=["wrong-size", "no-batch"])
def test_bad_input_shape(cls, shape):
    layer = cls(4)
    want = rf"\[batch, \.\.\., 4\], got \[{', '.join(map(str, shape))}\]"
    with pytest.raises(ValueError, match=want):
        layer(torch.randn(*shape))
    with pytest.raises(ValueError, match=want):
        layer.forward_saved(torch.randn(*shape))


def _regression_batches(device, n=128, batch=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    y = torch.stack([torch.sin(2 * x[:, 0]) * x[:, 1], x[:, 2].abs() - 0.5], dim=1)
    return [(x[i : i + batch].to(device), y[i : i + batch].to(device)) for i in range(0, n, batch)]


def _train_norm_net(device):
    torch.manual_seed(0)
    net = Network(Dense(3, 16, "tanh"), LayerNorm(16), Dense(16, 16, "relu"), RMSNorm(16), Dense(16, 2)).to(device)
    res = train(net, _regression_batches(device), TrainingConfig(epochs=30, learning_rate=0.02, optimizer="momentum", verbose=False))
    return res.loss_history[0], res.final_loss


def test_train_reduces_loss():
    first, last = _train_norm_net("cpu")
    assert last < 0.5 * first, (first, last)


@pytest.mark.cuda
def test_cuda_kernels_match_reference_and_train():
    """On CUDA, RMSNorm runs the fused kernels (LayerNorm plain PyTorch): forward and gradients equal
    the float64 CPU references, and training reduces the loss."""
    n = 333
    x = torch.randn(5, 7, n, dtype=torch.float64)
    g = torch.randn_like(x)
    w = torch.randn(n, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = F.rms_norm(xr, (n,), wr, 1e-6)
    y_ref.backward(g)
    layer = RMSNorm(n).cuda()
    with torch.no_grad():
        layer.weight.copy_(w)
    xc = x.float().cuda().requires_grad_()
    y = layer(xc)
    y.backward(g.float().cuda())
    assert_close(y, y_ref, name="output", rtol=1e-5, atol=1e-5)
    assert_close(xc.grad, xr.grad, name="grad input", rtol=1e-4, atol=1e-4)
    assert_close(layer.weight.grad, wr.grad, name="grad weight", rtol=1e-4, atol=1e-3)
    first, last = _train_norm_net("cuda")
    assert last < 0.5 * first, (first, last)
