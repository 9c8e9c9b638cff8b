"""SwiGLU: hand-written backward against gradcheck and a plain-torch SwiGLU with autograd (SPEC §3, §13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.layers.norm import RMSNorm
from torchloom.layers.swiglu import SwiGLU, SwiGLUFunction, swiglu
from torchloom.engine.train import TrainingConfig, train

# (leading shape, hidden, intermediate, bias): odd sizes, batch > 1, extra leading dims, m < h.
CASES = [((3,), 5, 7, True), ((2, 3), 4, 9, True), ((4,), 6, 3, False), ((2, 1, 3), 3, 5, True)]


def _ids(c):
    return f"{'x'.join(map(str, c[0]))}-h{c[1]}-m{c[2]}-{'bias' if c[3] else 'nobias'}"


def _reference(x, gw, uw, dw, gb=None, ub=None, db=None):
    """SwiGLU written in plain torch, differentiated by autograd."""
    return F.linear(F.silu(F.linear(x, gw, gb)) * F.linear(x, uw, ub), dw, db)


def _random_biases(layer: SwiGLU) -> None:
    with torch.no_grad():
        for b in (layer.gate_bias, layer.up_bias, layer.down_bias):
            if b is not None:
                b.normal_()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradcheck_float64(case):
    lead, h, m, bias = case
    dt = torch.float64
    x = torch.randn(*lead, h, dtype=dt, requires_grad=True)
    ws = [torch.randn(*s, dtype=dt, requires_grad=True) for s in ((m, h), (m, h), (h, m))]
    bs = [torch.randn(s, dtype=dt, requires_grad=True) if bias else None for s in (m, m, h)]
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (x, *ws, *bs))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_plain_torch(case, dtype, tol):
    """Forward and every gradient (input, three weights, three biases) equal the plain-torch SwiGLU;
    through the module and through ``backward_saved``."""
    lead, h, m, bias = case
    layer = SwiGLU(h, m, bias=bias, dtype=dtype)
    _random_biases(layer)
    params = tuple(layer.parameters())
    names = [n for n, _ in layer.named_parameters()]
    refs = [p.detach().clone().requires_grad_() for p in params]
    x = torch.randn(*lead, h, dtype=dtype)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xo)
    y_ref = _reference(xr, *refs) if bias else _reference(xr, *refs, None, None, None)
    assert_close(y, y_ref, name="output", rtol=tol, atol=tol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    ref_grads = torch.autograd.grad(y_ref, [xr, *refs], g)
    assert_close(xo.grad, ref_grads[0], name="grad input", rtol=tol, atol=tol)
    for p, r, n in zip(params, ref_grads[1:], names):
        assert_close(p.grad, r, name=f"grad {n}", rtol=tol, atol=tol)
    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        gx, grads = layer.backward_saved(g, saved)
    assert len(grads) == len(params)
    assert_close(y2, y_ref, name="forward_saved output", rtol=tol, atol=tol)
    assert_close(gx, ref_grads[0], name="backward_saved grad input", rtol=tol, atol=tol)
    for got, r, n in zip(grads, ref_grads[1:], names):
        assert_close(got, r, name=f"backward_saved grad {n}", rtol=tol, atol=tol)
    assert layer.backward_saved(g, saved, needs_input_grad=False)[0] is None


def test_down_projection_gradient_is_not_transposed():
    """Loom accumulates dW_down in transposed positions (SPEC §13). With h != m the gradient has
    W_down's shape [h, m] and equals gyᵀ·a, the gated intermediate Loom calls the pre-activation."""
    layer = SwiGLU(3, 5, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        y, saved = layer.forward_saved(x)
    g = torch.randn_like(y)
    _, (_, _, d_down, *_) = layer.backward_saved(g, saved)
    a = F.silu(F.linear(x, layer.gate_weight, layer.gate_bias)) * F.linear(x, layer.up_weight, layer.up_bias)
    assert layer.pre_activation(saved) is saved.pre
    assert_close(saved.pre, a, name="pre (gated intermediate)", rtol=1e-12, atol=1e-12)
    assert d_down.shape == (3, 5)
    assert_close(d_down, g.t() @ a, name="grad down_weight", rtol=1e-12, atol=1e-12)


def test_functional_matches_module_and_rejects_partial_biases():
    layer = SwiGLU(4, 6, dtype=torch.float64)
    _random_biases(layer)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(swiglu(x, *layer.parameters()), layer(x))
    with pytest.raises(ValueError, match="all three biases"):
        swiglu(x, layer.gate_weight, layer.up_weight, layer.down_weight, layer.gate_bias)


def test_batch_independence():
    layer = SwiGLU(5, 8)
    _random_biases(layer)
    x = torch.randn(4, 3, 5)
    x2 = x.clone()
    x2[0] = torch.randn(3, 5) * 4
    y, y2 = layer(x), layer(x2)
    assert not torch.equal(y[0], y2[0])
    assert torch.equal(y[1:], y2[1:])
    xr = x.clone().requires_grad_()
    layer(xr)[1:].sum().backward()
    assert torch.count_nonzero(xr.grad[0]) == 0


def test_inside_network_with_history():
    """Dense → SwiGLU → Dense in Loom mode: history and hand-written backward equal autograd through
    the plain-torch reference."""
    dt = torch.float64
    net = Network(Dense(4, 6, "tanh", dtype=dt), SwiGLU(6, 9, dtype=dt), Dense(6, 2, dtype=dt), record_history=True)
    _random_biases(net[1])
    x = torch.randn(5, 4, dtype=dt)
    y = net(x)
    g = torch.randn_like(y)
    gx = net.backward(g, input_grad=True)
    got = [p.grad.clone() for p in net.parameters()]
    params = [p.detach().clone().requires_grad_() for p in net.parameters()]
    w0, b0, gw, uw, dw, gb, ub, db, w2, b2 = params
    xr = x.clone().requires_grad_()
    h0 = torch.tanh(F.linear(xr, w0, b0))
    a = F.silu(F.linear(h0, gw, gb)) * F.linear(h0, uw, ub)
    y_ref = F.linear(_reference(h0, gw, uw, dw, gb, ub, db), w2, b2)
    assert_close(y, y_ref, name="output", rtol=1e-12, atol=1e-12)
    assert_close(net.history[1].pre, a, name="history pre", rtol=1e-12, atol=1e-12)
    ref = torch.autograd.grad(y_ref, [xr, *params], g)
    assert_close(gx, ref[0], name="grad input", rtol=1e-11, atol=1e-12)
    for i, (a_, r) in enumerate(zip(got, ref[1:])):
        assert_close(a_, r, name=f"param {i}", rtol=1e-11, atol=1e-12)


def test_layout_init_and_repr():
    torch.manual_seed(1)
    layer = SwiGLU(64, 96)
    assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()] == [
        ("gate_weight", (96, 64)), ("up_weight", (96, 64)), ("down_weight", (64, 96)),
        ("gate_bias", (96,)), ("up_bias", (96,)), ("down_bias", (64,)),
    ]
    assert abs(layer.gate_weight.std().item() - 64**-0.5) < 0.1 * 64**-0.5
    assert abs(layer.down_weight.std().item() - 96**-0.5) < 0.1 * 96**-0.5
    assert all(torch.count_nonzero(b) == 0 for b in (layer.gate_bias, layer.up_bias, layer.down_bias))
    nb = SwiGLU(3, 4, bias=False, dtype=torch.float64)
    assert [n for n, _ in nb.named_parameters()] == ["gate_weight", "up_weight", "down_weight"]
    assert nb.gate_weight.dtype == torch.float64
    assert "hidden=3, intermediate=4, bias=False" in repr(nb)


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((0, 4), {}, ValueError, "hidden must be a positive int, got 0"),
        ((4, -2), {}, ValueError, "intermediate must be a positive int, got -2"),
        ((4, 2.0), {}, ValueError, "intermediate must be a positive int, got 2.0"),
        ((4, 2), {"bias": 1}, TypeError, "bias must be a bool, got 1"),
    ],
)
def test_bad_constructor_args(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        SwiGLU(*args, **kwargs)


@pytest.mark.parametrize("shape", [(3, 5), (4,)], ids=["wrong-size", "no-batch"])
def test_bad_input_shape(shape):
    layer = SwiGLU(4, 6)
    want = rf"\[batch, \.\.\., 4\], got \[{', '.join(map(str, shape))}\]"
    with pytest.raises(ValueError, match=want):
        layer(torch.randn(*shape))
    with pytest.raises(ValueError, match=want):
        layer.forward_saved(torch.randn(*shape))


def _batches(device, n=128, batch=32):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, :1] * x[:, 1:2] + torch.sin(x[:, 2:3]) - 0.5 * x[:, 3:4] ** 2) / 2
    return [(x[i : i + batch].to(device), y[i : i + batch].to(device)) for i in range(0, n, batch)]


def _train_swiglu_net(device):
    """Dense → RMSNorm → SwiGLU → Dense regression with train()."""
    torch.manual_seed(0)
    net = Network(Dense(4, 16), RMSNorm(16), SwiGLU(16, 32), Dense(16, 1)).to(device)
    res = train(net, _batches(device), TrainingConfig(epochs=20, learning_rate=0.05, optimizer="momentum", verbose=False))
    return res.loss_history[0], res.final_loss


def test_train_reduces_loss():
    first, last = _train_swiglu_net("cpu")
    assert last < 0.5 * first, (first, last)


@pytest.mark.cuda
def test_cuda_kernels_match_reference_and_train():
    """On CUDA the gate runs the fused kernels: forward and every gradient equal the float64
    plain-torch reference on the CPU, and training reduces the loss."""
    layer = SwiGLU(48, 80, dtype=torch.float64)
    _random_biases(layer)
    x = torch.randn(3, 7, 48, dtype=torch.float64)
    refs = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    xr = x.clone().requires_grad_()
    y_ref = _reference(xr, *refs)
    g = torch.randn_like(y_ref)
    ref_grads = torch.autograd.grad(y_ref, [xr, *refs], g)
    cuda_layer = layer.float().cuda()
    xc = x.float().cuda().requires_grad_()
    y = cuda_layer(xc)
    y.backward(g.float().cuda())
    assert_close(y, y_ref, name="output", rtol=1e-4, atol=1e-4)
    assert_close(xc.grad, ref_grads[0], name="grad input", rtol=1e-4, atol=1e-4)
    for (n, p), r in zip(cuda_layer.named_parameters(), ref_grads[1:]):
        assert_close(p.grad, r, name=f"grad {n}", rtol=1e-4, atol=1e-3)
    first, last = _train_swiglu_net("cuda")
    assert last < 0.5 * first, (first, last)
