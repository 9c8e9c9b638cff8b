"""RNN (Elman, full BPTT) and LastStep: hand-written backward against gradcheck and ``nn.RNN``."""

from __future__ import annotations

import math

import warnings

import pytest
import torch
from torch import nn

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.layers.rnn import RNN, LastStep, RNNFunction, rnn

# (batch, time, input, hidden, bias): odd sizes, a single step, batch > 1.
SHAPES = [(3, 5, 4, 3, True), (2, 1, 3, 5, True), (3, 4, 2, 5, False), (3, 3, 5, 1, True)]


def _ids(s):
    return f"B{s[0]}T{s[1]}I{s[2]}H{s[3]}-{'bias' if s[4] else 'nobias'}"


def _torch_rnn(layer: RNN) -> nn.RNN:
    """nn.RNN computing the same: weights copied, bias_ih = our bias, bias_hh = 0."""
    ref = nn.RNN(
        layer.input_size, layer.hidden_size, nonlinearity="tanh", bias=layer.bias is not None,
        batch_first=True, dtype=layer.weight_ih.dtype,
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
    w_ih = (torch.randn(H, I, dtype=dt) * 0.6).requires_grad_()
    w_hh = (torch.randn(H, H, dtype=dt) * 0.6).requires_grad_()
    b = torch.randn(H, dtype=dt, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(RNNFunction.apply, (x, w_ih, w_hh, b))


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-10, 1e-12), (torch.float32, 1e-5, 1e-5)])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_matches_torch_rnn(shape, dtype, rtol, atol):
    """Forward and every gradient equal nn.RNN (bias_hh = 0), through the module and through
    backward_saved, from one upstream gradient on every time step."""
    B, T, I, H, bias = shape
    layer = RNN(I, H, bias=bias, dtype=dtype)
    ref = _torch_rnn(layer)
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


def test_saved_pre_is_the_exact_pre_activation():
    """saved.pre = x_t W_ihᵀ + h_{t−1} W_hhᵀ + b, computed here step by step in float64."""
    layer = RNN(3, 4, dtype=torch.float64)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    _, saved = layer.forward_saved(x)
    h = torch.zeros(2, 4, dtype=torch.float64)
    for t in range(5):
        pre = x[:, t] @ layer.weight_ih.T + h @ layer.weight_hh.T + layer.bias
        assert_close(saved.pre[:, t], pre.detach(), name=f"pre[:, {t}]", rtol=1e-12, atol=1e-12)
        h = torch.tanh(pre)


def test_batch_independence():
    layer = RNN(3, 4, dtype=torch.float64)
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
    """RNN → LastStep → Dense in a Network: forward_record + Network.backward equal autograd through
    nn.RNN (bias_hh = 0), [:, -1] and nn.Linear."""
    dt = torch.float64
    net = Network(RNN(3, 6, dtype=dt), LastStep(), Dense(6, 2, dtype=dt))
    ref = _torch_rnn(net[0])
    lin = nn.Linear(6, 2, dtype=dt)
    with torch.no_grad():
        net[2].bias.normal_()
        lin.weight.copy_(net[2].weight)
        lin.bias.copy_(net[2].bias)
    x = torch.randn(3, 4, 3, dtype=dt)
    out = net.forward_record(x)
    xr = x.clone().requires_grad_()
    hs, _ = ref(xr)
    out_ref = lin(hs[:, -1])
    assert_close(out, out_ref, name="network output", rtol=1e-12, atol=1e-12)
    assert_close(net.history[0].output, hs, name="history[0].output", rtol=1e-12, atol=1e-12)
    assert net.history[0].pre.shape == (3, 4, 6)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    grad_in = net.backward(g, input_grad=True)
    assert_close(grad_in, xr.grad, name="grad input", rtol=1e-12, atol=1e-12)
    for p, r, n in [
        (net[0].weight_ih, ref.weight_ih_l0, "weight_ih"),
        (net[0].weight_hh, ref.weight_hh_l0, "weight_hh"),
        (net[0].bias, ref.bias_ih_l0, "bias"),
        (net[2].weight, lin.weight, "dense weight"),
    ]:
        assert_close(p.grad, r.grad, name=n, rtol=1e-12, atol=1e-12)


def test_last_step():
    ls = LastStep()
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ls, (x,))
    y = ls(x)
    assert torch.equal(y, x[:, -1])
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.count_nonzero(g[:, :-1]) == 0 and torch.equal(g[:, -1], torch.ones(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[batch, time, \.\.\.\].*got \[3, 4\]"):
        ls(torch.randn(3, 4))
    assert list(ls.parameters()) == []


def test_functional_matches_module():
    layer = RNN(2, 3)
    x = torch.randn(2, 4, 2)
    assert torch.equal(rnn(x, layer.weight_ih, layer.weight_hh, layer.bias), layer(x))


@pytest.mark.parametrize(
    "shape,pattern",
    [
        ((2, 5), r"\[batch, time, 3\].*got \[2, 5\]"),
        ((2, 5, 4), r"\[batch, time, 3\].*got \[2, 5, 4\]"),
        ((2, 0, 3), r"time >= 1.*got \[2, 0, 3\]"),
        ((1, 2, 5, 3), r"got \[1, 2, 5, 3\]"),
    ],
)
def test_bad_input_shape(shape, pattern):
    layer = RNN(3, 4)
    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(*shape))
    with pytest.raises(ValueError, match=pattern):
        layer.forward_saved(torch.randn(*shape))


def test_bad_input_dtype():
    with pytest.raises(TypeError, match="float64.*float32"):
        RNN(3, 4)(torch.randn(2, 2, 3, dtype=torch.float64))


@pytest.mark.parametrize(
    "args,kwargs,pattern",
    [
        ((0, 4), {}, "input_size must be a positive int, got 0"),
        ((3, -2), {}, "hidden_size must be a positive int, got -2"),
        ((3, 2.0), {}, r"hidden_size must be a positive int, got 2\.0"),
        ((3, 4), {"bias": 1}, "bias must be a bool"),
        ((3, 4), {"init": "he_normal"}, "init must be one of"),
    ],
)
def test_bad_constructor_args(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        RNN(*args, **kwargs)


def test_layout_init_and_repr():
    layer = RNN(5, 64)
    assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()] == [
        ("weight_ih", (64, 5)), ("weight_hh", (64, 64)), ("bias", (64,))
    ]
    bound = 1 / math.sqrt(64)
    assert layer.weight_hh.abs().max() <= bound and layer.weight_hh.abs().max() > 0.9 * bound
    assert RNN(5, 64, init="loom_uniform").weight_hh.abs().max() <= 0.1
    assert [n for n, _ in RNN(2, 3, bias=False).named_parameters()] == ["weight_ih", "weight_hh"]
    assert repr(layer) == "RNN(input_size=5, hidden_size=64, bias=True)"


# ------------------------------------------------------- mixed precision, double backward, transforms
from torchloom.layers.lstm import LSTM  # noqa: E402

_TORCH = {"RNN": nn.RNN, "LSTM": nn.LSTM}


def _torch_twin(layer, dtype=None):
    ref = _TORCH[type(layer).__name__](layer.input_size, layer.hidden_size, batch_first=True, dtype=dtype or layer.weight_ih.dtype)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(layer.weight_ih)
        ref.weight_hh_l0.copy_(layer.weight_hh)
        ref.bias_ih_l0.copy_(layer.bias)
        ref.bias_hh_l0.zero_()
    return ref


def _check_low(layer, x, g, y, gx, low_ctx):
    """Output and gradients against the float64 truth: error at most twice that of PyTorch's module
    run in ``low_ctx`` on the same input, plus a floor of 2 % of the largest value (bfloat16 keeps 8
    bits)."""
    truth_mod = _torch_twin(layer, torch.float64)
    xr = x.detach().double().requires_grad_()
    yt, _ = truth_mod(xr)
    truth = (yt, *torch.autograd.grad(yt, [xr, truth_mod.weight_ih_l0, truth_mod.weight_hh_l0, truth_mod.bias_ih_l0], g.double()))
    low_mod = _torch_twin(layer, torch.float32)
    xl = x.detach().float().requires_grad_()
    with low_ctx():
        yl, _ = low_mod(xl)
    low = (yl, *torch.autograd.grad(yl, [xl, low_mod.weight_ih_l0, low_mod.weight_hh_l0, low_mod.bias_ih_l0], g.to(yl.dtype)))
    got = (y, gx, layer.weight_ih.grad, layer.weight_hh.grad, layer.bias.grad)
    for name, a, t, lo in zip(("output", "grad input", "grad weight_ih", "grad weight_hh", "grad bias"), got, truth, low):
        err = (a.detach().double() - t).abs().max().item()
        lo_err = (lo.detach().double() - t).abs().max().item()
        assert err <= 2 * lo_err + 0.02 * t.abs().max().item(), f"{name}: error {err:.3e} vs PyTorch's {lo_err:.3e}"


@pytest.mark.parametrize("cls", [RNN, LSTM], ids=["RNN", "LSTM"])
def test_cpu_autocast_bfloat16(cls):
    """Under torch.autocast("cpu", bfloat16) the layer computes in bfloat16 and returns float32
    gradients for its float32 parameters and input (forward + backward, no dtype error)."""
    layer = cls(5, 12)
    x = torch.randn(3, 6, 5)
    g = torch.randn(3, 6, 12)
    xo = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xo)
        assert y.dtype == torch.bfloat16
        y.backward(g.to(torch.bfloat16))  # backward inside autocast too
    assert xo.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in layer.parameters())
    _check_low(layer, x, g, y, xo.grad, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y2, saved = layer.forward_saved(x)
        _, grads = layer.backward_saved(g.to(torch.bfloat16), saved)
    assert y2.dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in grads)


@pytest.mark.parametrize("cls", [RNN, LSTM], ids=["RNN", "LSTM"])
def test_bfloat16_parameters(cls):
    layer = cls(4, 10).to(torch.bfloat16)
    x = torch.randn(2, 5, 4).to(torch.bfloat16)
    g = torch.randn(2, 5, 10).to(torch.bfloat16)
    xo = x.clone().requires_grad_()
    y = layer(xo)
    y.backward(g)
    assert y.dtype == xo.grad.dtype == layer.weight_hh.grad.dtype == torch.bfloat16
    _check_low(layer, x, g, y, xo.grad, lambda: torch.autocast("cpu", dtype=torch.bfloat16))


@pytest.mark.parametrize("cls", [RNN, LSTM], ids=["RNN", "LSTM"])
def test_double_backward_raises(cls):
    layer = cls(3, 4, dtype=torch.float64)
    x = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).square().sum(), x)
    assert gx.abs().sum() > 0
    with pytest.raises(RuntimeError, match=f"{cls.__name__}: double backward"):
        torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(layer._function.apply, (x, *params))


@pytest.mark.parametrize("cls", [RNN, LSTM], ids=["RNN", "LSTM"])
def test_functional_call_and_vmap(cls):
    layer = cls(3, 4, dtype=torch.float64)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    new = {n: (p.detach() * 1.5).requires_grad_() for n, p in layer.named_parameters()}
    y = torch.func.functional_call(layer, new, (x,))
    twin = _TORCH[cls.__name__](3, 4, batch_first=True, dtype=torch.float64)
    yt, _ = torch.func.functional_call(
        twin, {"weight_ih_l0": new["weight_ih"], "weight_hh_l0": new["weight_hh"], "bias_ih_l0": new["bias"],
               "bias_hh_l0": torch.zeros_like(new["bias"])}, (x,))
    assert_close(y, yt, name="functional_call output", rtol=1e-10, atol=1e-12)
    g = torch.randn_like(y)
    for n, a, r in zip(new, torch.autograd.grad(y, list(new.values()), g), torch.autograd.grad(yt, list(new.values()), g)):
        assert_close(a, r, name=f"functional_call grad {n}", rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.vmap(layer)(x[:, None])
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: layer(t).sum())(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(RuntimeError):
            torch.jit.script(layer)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls", [RNN, LSTM], ids=["RNN", "LSTM"])
def test_cuda_autocast(cls, dtype):
    layer = cls(8, 40).cuda()
    x = torch.randn(4, 9, 8, device="cuda")
    g = torch.randn(4, 9, 40, device="cuda")
    xo = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        y = layer(xo)
    assert y.dtype == dtype
    y.backward(g.to(dtype))
    assert layer.weight_hh.grad.dtype == torch.float32
    cpu = cls(8, 40)
    cpu.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    for p, q in zip(cpu.parameters(), layer.parameters()):
        p.grad = q.grad.cpu()
    _check_low(cpu, x.cpu(), g.cpu(), y.cpu(), xo.grad.cpu(), lambda: torch.autocast("cpu", dtype=torch.bfloat16))


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", [RNN, LSTM], ids=["RNN", "LSTM"])
def test_empty_batch_like_pytorch(cls, dtype, device):
    """A batch of 0 sequences, as PyTorch's ``nn.RNN`` / ``nn.LSTM`` take it (``batch_first``): an
    empty ``[0, T, H]`` output, an empty input gradient and zero parameter gradients (no sample
    contributes), with no warning (on CUDA no loop kernel is launched for it)."""
    layer = cls(3, 4, device=device, dtype=dtype)
    torch_layer = _TORCH[cls.__name__](3, 4, batch_first=True, device=device, dtype=dtype)
    for T in (1, 5):
        x, x_ref = (torch.randn(0, T, 3, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        layer.zero_grad(set_to_none=True)
        torch_layer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = layer(x)
            y.sum().backward()
        y_ref = torch_layer(x_ref)[0]
        y_ref.sum().backward()
        assert y.shape == y_ref.shape == (0, T, 4) and y.dtype == y_ref.dtype
        assert x.grad.shape == x_ref.grad.shape
        for p in layer.parameters():
            assert p.grad is not None and p.grad.dtype == dtype and not p.grad.any()
