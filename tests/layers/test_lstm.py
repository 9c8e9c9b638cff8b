"""LSTM (gates i, f, g, o, full BPTT): hand-written backward against gradcheck and ``nn.LSTM``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.lstm import LSTM, LSTMFunction, lstm
from torchloom.layers.network import Network
from torchloom.layers.rnn import LastStep

# (batch, time, input, hidden, bias): odd sizes, a single step, batch > 1.
SHAPES = [(3, 4, 3, 2, True), (2, 1, 3, 3, True), (3, 3, 2, 3, False), (2, 5, 1, 1, True)]


def _ids(s):
    return f"B{s[0]}T{s[1]}I{s[2]}H{s[3]}-{'bias' if s[4] else 'nobias'}"


def _torch_lstm(layer: LSTM) -> nn.LSTM:
    """nn.LSTM computing the same: weights copied (same i, f, g, o stacking), bias_ih = our bias,
    bias_hh = 0."""
    ref = nn.LSTM(
        layer.input_size, layer.hidden_size, bias=layer.bias is not None, batch_first=True,
        dtype=layer.weight_ih.dtype,
    )
    with torch.no_grad():
        ref.weight_ih_l0.copy_(layer.weight_ih)
        ref.weight_hh_l0.copy_(layer.weight_hh)
        if layer.bias is not None:
            ref.bias_ih_l0.copy_(layer.bias)
            ref.bias_hh_l0.zero_()
    return ref


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_gradcheck_float64(shape):
    B, T, I, H, bias = shape
    dt = torch.float64
    x = torch.randn(B, T, I, dtype=dt, requires_grad=True)
    w_ih = torch.randn(4 * H, I, dtype=dt, requires_grad=True)
    w_hh = torch.randn(4 * H, H, dtype=dt, requires_grad=True)
    b = torch.randn(4 * H, dtype=dt, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(LSTMFunction.apply, (x, w_ih, w_hh, b))


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-10, 1e-12), (torch.float32, 1e-5, 1e-5)])
@pytest.mark.parametrize("shape", SHAPES + [(5, 7, 6, 9, True)], ids=_ids)
def test_matches_torch_lstm(shape, dtype, rtol, atol):
    """Forward and every gradient equal nn.LSTM (bias_hh = 0), through the module and through
    backward_saved, from one upstream gradient on every time step."""
    B, T, I, H, bias = shape
    layer = LSTM(I, H, bias=bias, dtype=dtype)
    with torch.no_grad():  # larger weights than the default init, so every gate saturates somewhere
        for p in layer.parameters():
            p.mul_(3.0)
    ref = _torch_lstm(layer)
    x = torch.randn(B, T, I, dtype=dtype)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xo)
    y_ref, _ = ref(xr)
    assert_close(y, y_ref, name="output", rtol=rtol, atol=atol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert_close(xo.grad, xr.grad, name="grad input", rtol=rtol, atol=atol)
    assert_close(layer.weight_ih.grad, ref.weight_ih_l0.grad, name="grad weight_ih", rtol=rtol, atol=atol)
    assert_close(layer.weight_hh.grad, ref.weight_hh_l0.grad, name="grad weight_hh", rtol=rtol, atol=atol)
    if bias:
        assert_close(layer.bias.grad, ref.bias_ih_l0.grad, name="grad bias", rtol=rtol, atol=atol)

    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        grad_x, grads = layer.backward_saved(g, saved)
    assert_close(y2, y_ref, name="forward_saved output", rtol=rtol, atol=atol)
    assert len(grads) == len(tuple(layer.parameters()))
    assert_close(grad_x, xr.grad, name="backward_saved grad input", rtol=rtol, atol=atol)
    for got, r, n in zip(grads, ref.parameters(), ("w_ih", "w_hh", "b")):  # ref's bias_hh is unmatched
        assert_close(got, r.grad, name=f"backward_saved grad {n}", rtol=rtol, atol=atol)
    assert layer.backward_saved(g, saved, needs_input_grad=False)[0] is None


def test_gate_order_and_saved_state():
    """Gates i, f, g, o in row blocks [0:H], [H:2H], [2H:3H], [3H:4H], checked against the LSTM
    equations written out here; saved.pre holds the gate pre-activations and saved.cell c_t."""
    H = 3
    layer = LSTM(2, H, dtype=torch.float64)
    x = torch.randn(2, 4, 2, dtype=torch.float64)
    hs, saved = layer.forward_saved(x)
    h = torch.zeros(2, H, dtype=torch.float64)
    c = torch.zeros(2, H, dtype=torch.float64)
    W_ih, W_hh, b = layer.weight_ih.detach(), layer.weight_hh.detach(), layer.bias.detach()
    for t in range(4):
        pre = x[:, t] @ W_ih.T + h @ W_hh.T + b
        i, f, g, o = pre[:, :H].sigmoid(), pre[:, H : 2 * H].sigmoid(), pre[:, 2 * H : 3 * H].tanh(), pre[:, 3 * H :].sigmoid()
        c = f * c + i * g
        h = o * torch.tanh(c)
        assert_close(saved.pre[:, t], pre, name=f"pre[:, {t}]", rtol=1e-12, atol=1e-12)
        assert_close(saved.cell[:, t], c, name=f"cell[:, {t}]", rtol=1e-12, atol=1e-12)
        assert_close(hs[:, t], h, name=f"h[:, {t}]", rtol=1e-12, atol=1e-12)


def test_batch_independence():
    layer = LSTM(3, 4, dtype=torch.float64)
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    y = layer(x)
    x2 = x.clone()
    x2[0] += torch.randn_like(x2[0])
    y2 = layer(x2)
    assert (y2[0] - y[0]).abs().max() > 1e-3
    assert torch.equal(y2[1:], y[1:])
    for b in range(4):
        xb = x.clone().requires_grad_()
        out = layer(xb)
        (gx,) = torch.autograd.grad((out[b] * torch.randn_like(out[b])).sum(), xb)
        assert torch.count_nonzero(torch.cat([gx[:b], gx[b + 1 :]])) == 0
        assert gx[b].abs().max() > 0


def test_network_history_matches_autograd():
    """LSTM → LastStep → Dense in a Network: forward_record + Network.backward equal autograd through
    nn.LSTM (bias_hh = 0), [:, -1] and nn.Linear."""
    dt = torch.float64
    net = Network(LSTM(3, 5, dtype=dt), LastStep(), Dense(5, 2, activation="sigmoid", dtype=dt), record_history=True)
    ref = _torch_lstm(net[0])
    lin = nn.Linear(5, 2, dtype=dt)
    with torch.no_grad():
        net[2].bias.normal_()
        lin.weight.copy_(net[2].weight)
        lin.bias.copy_(net[2].bias)
    x = torch.randn(3, 4, 3, dtype=dt)
    out = net(x)
    xr = x.clone().requires_grad_()
    hs, _ = ref(xr)
    out_ref = torch.sigmoid(lin(hs[:, -1]))
    assert_close(out, out_ref, name="network output", rtol=1e-12, atol=1e-12)
    assert_close(net.forward_acts[1], hs, name="forward_acts[1]", rtol=1e-12, atol=1e-12)
    assert net.history[0].pre.shape == (3, 4, 20)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    grad_in = net.backward(g, input_grad=True)
    assert_close(grad_in, xr.grad, name="grad input", rtol=1e-12, atol=1e-12)
    for p, r, n in [
        (net[0].weight_ih, ref.weight_ih_l0, "weight_ih"),
        (net[0].weight_hh, ref.weight_hh_l0, "weight_hh"),
        (net[0].bias, ref.bias_ih_l0, "bias"),
        (net[2].weight, lin.weight, "dense weight"),
        (net[2].bias, lin.bias, "dense bias"),
    ]:
        assert_close(p.grad, r.grad, name=n, rtol=1e-12, atol=1e-12)


def test_functional_matches_module():
    layer = LSTM(2, 3)
    x = torch.randn(2, 4, 2)
    assert torch.equal(lstm(x, layer.weight_ih, layer.weight_hh, layer.bias), layer(x))


@pytest.mark.parametrize(
    "shape,pattern",
    [
        ((2, 5), r"\[batch, time, 3\].*got \[2, 5\]"),
        ((2, 5, 4), r"\[batch, time, 3\].*got \[2, 5, 4\]"),
        ((2, 0, 3), r"time >= 1.*got \[2, 0, 3\]"),
    ],
)
def test_bad_input_shape(shape, pattern):
    layer = LSTM(3, 4)
    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(*shape))
    with pytest.raises(ValueError, match=pattern):
        layer.forward_saved(torch.randn(*shape))


def test_bad_input_type():
    with pytest.raises(TypeError, match="torch.Tensor"):
        LSTM(3, 4)([[[1.0, 2.0, 3.0]]])
    with pytest.raises(TypeError, match="float64.*float32"):
        LSTM(3, 4)(torch.randn(2, 2, 3, dtype=torch.float64))


@pytest.mark.parametrize(
    "args,kwargs,pattern",
    [
        ((0, 4), {}, "input_size must be a positive int, got 0"),
        ((3, 0), {}, "hidden_size must be a positive int, got 0"),
        ((3, 4), {"bias": None}, "bias must be a bool"),
        ((3, 4), {"init": "orthogonal"}, "init must be one of"),
    ],
)
def test_bad_constructor_args(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LSTM(*args, **kwargs)


def test_layout_init_and_repr():
    layer = LSTM(5, 64)
    assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()] == [
        ("weight_ih", (256, 5)), ("weight_hh", (256, 64)), ("bias", (256,))
    ]
    bound = 1 / math.sqrt(64)
    assert layer.weight_hh.abs().max() <= bound and layer.weight_hh.abs().max() > 0.9 * bound
    assert LSTM(5, 64, init="loom_uniform").weight_ih.abs().max() <= 0.1
    assert [n for n, _ in LSTM(2, 3, bias=False).named_parameters()] == ["weight_ih", "weight_hh"]
    assert repr(layer) == "LSTM(input_size=5, hidden_size=64, bias=True)"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["LSTM", "RNN"])
def test_cuda_graphed_loops_keep_each_call_separate(name, monkeypatch):
    """On CUDA, where the persistent loop kernels do not run (here switched off), the time loops replay
    a cached CUDA graph over shared buffers: two forwards of the same shape before either backward,
    then both backwards, give nn.LSTM/nn.RNN's gradients for each."""
    from torchloom.kernels import recurrent
    from torchloom.layers.rnn import RNN

    monkeypatch.setattr(recurrent, "USE_PERSISTENT_LSTM", False)
    monkeypatch.setattr(recurrent, "USE_PERSISTENT_RNN", False)
    recurrent.clear_graph_cache()

    cls, ref_cls = (LSTM, nn.LSTM) if name == "LSTM" else (RNN, nn.RNN)
    layer = cls(6, 20, dtype=torch.float64).float().cuda()
    ref = ref_cls(6, 20, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(layer.weight_ih), ref.weight_hh_l0.copy_(layer.weight_hh)
        ref.bias_ih_l0.copy_(layer.bias), ref.bias_hh_l0.zero_()
    xs = [torch.randn(3, 7, 6) for _ in range(2)]
    gs = [torch.randn(3, 7, 20) for _ in range(2)]
    outs = [layer(x.cuda().requires_grad_()) for x in xs]
    assert any(k[0] == name.lower() for k in recurrent._GRAPHS), "the graphed loop was not used"
    for y, g in zip(outs, gs):
        y.backward(g.cuda())
    want = [torch.autograd.grad(ref(x.double())[0], list(ref.parameters())[:3], g.double()) for x, g in zip(xs, gs)]
    for got, w, n in zip((layer.weight_ih.grad, layer.weight_hh.grad, layer.bias.grad), zip(*want), ("w_ih", "w_hh", "b")):
        assert_close(got, w[0] + w[1], name=f"grad {n} (sum of both calls)", rtol=1e-4, atol=1e-4)
    for y, x in zip(outs, xs):
        assert_close(y, ref(x.double())[0], name="output", rtol=1e-4, atol=1e-5)
