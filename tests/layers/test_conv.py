"""Conv1D / Conv2D / Conv3D and Flatten: hand-written backward against gradcheck and ``nn.Conv*d``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import ACTIVATION_REFERENCE, assert_close
from torchloom.layers.conv import Conv1D, Conv2D, Conv3D, Flatten, conv
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network

LAYERS = {1: Conv1D, 2: Conv2D, 3: Conv3D}
TORCH_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# (ndim, C, F, spatial input, kernel, stride, padding, activation, bias) — odd sizes, uneven strides
# (so the last input rows are skipped), padding, every dim count.
CASES = [
    (1, 3, 4, (9,), 3, 1, 0, "tanh", True),
    (1, 2, 3, (10,), 4, 3, 2, "linear", False),
    (2, 3, 4, (6, 5), 3, 1, 1, "sigmoid", True),
    (2, 1, 2, (8, 7), (3, 2), (2, 3), (0, 1), "silu", False),
    (2, 2, 3, (5, 5), 5, 1, 0, "gelu", True),
    (2, 2, 3, (6, 6), 2, 2, 0, "relu", True),
    (1, 3, 2, (7,), 2, 1, 1, "leaky_relu", True),
    (3, 2, 2, (4, 3, 5), 3, (1, 2, 2), 1, "tanh", True),
    (3, 1, 2, (4, 5, 3), (2, 3, 1), 2, (0, 1, 0), "linear", False),
]


def _ids(case):
    nd, C, F, n, k, s, p, act, bias = case
    return f"{nd}d-C{C}F{F}-n{n}-k{k}-s{s}-p{p}-{act}-{'bias' if bias else 'nobias'}"


def _make(case, dtype):
    nd, C, F, n, k, s, p, act, bias = case
    layer = LAYERS[nd](C, F, k, stride=s, padding=p, activation=act, bias=bias, dtype=dtype)
    with torch.no_grad():  # a non-zero bias, so its gradient path and the forward sum both matter
        if layer.bias is not None:
            layer.bias.normal_()
    ref = TORCH_CONVS[nd](C, F, k, stride=s, padding=p, bias=bias, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        if bias:
            ref.bias.copy_(layer.bias)
    return layer, ref, ACTIVATION_REFERENCE[act]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradcheck_float64(case):
    nd, C, F, n, k, s, p, act, bias = case
    layer, _, _ = _make(case, torch.float64)
    x = torch.randn(2, C, *n, dtype=torch.float64, requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_() if bias else None
    inputs = (x, w) if b is None else (x, w, b)
    fn = lambda x, w, b=None: conv(x, w, b, s, p, act)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-5, 1e-5)])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_torch_conv(case, dtype, rtol, atol):
    """Forward and every gradient equal nn.Conv*d + activation, through the module (autograd
    bridge) and through backward_saved (the trainers' path), from one upstream gradient."""
    nd, C, F, n, k, s, p, act, bias = case
    layer, ref, f = _make(case, dtype)
    x = torch.randn(4, C, *n, dtype=dtype)
    x_ours = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    y = layer(x_ours)
    pre_ref = ref(x_ref)
    y_ref = f(pre_ref)
    assert_close(y, y_ref, name="output", rtol=rtol, atol=atol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert_close(x_ours.grad, x_ref.grad, name="grad input", rtol=rtol, atol=atol)
    assert_close(layer.weight.grad, ref.weight.grad, name="grad weight", rtol=rtol, atol=atol)
    if bias:
        assert_close(layer.bias.grad, ref.bias.grad, name="grad bias", rtol=rtol, atol=atol)

    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        assert_close(saved.pre, pre_ref, name="saved.pre", rtol=rtol, atol=atol)
        grad_x, param_grads = layer.backward_saved(g, saved)
    assert len(param_grads) == len(tuple(layer.parameters()))
    assert_close(y2, y_ref, name="forward_saved output", rtol=rtol, atol=atol)
    assert_close(grad_x, x_ref.grad, name="backward_saved grad input", rtol=rtol, atol=atol)
    for got, p_ref, pname in zip(param_grads, ref.parameters(), ("weight", "bias")):
        assert_close(got, p_ref.grad, name=f"backward_saved grad {pname}", rtol=rtol, atol=atol)
    grad_x_none, _ = layer.backward_saved(g, saved, needs_input_grad=False)
    assert grad_x_none is None


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_output_size_formula(nd):
    """Output size ⌊(n + 2p − k)/s⌋ + 1 for every spatial dim, as nn.Conv*d."""
    n, k, s, p = (11, 7, 9)[:nd], (3, 4, 2)[:nd], (2, 3, 1)[:nd], (1, 0, 2)[:nd]
    layer = LAYERS[nd](2, 3, k, stride=s, padding=p)
    y = layer(torch.randn(2, 2, *n))
    expected = tuple((ni + 2 * pi - ki) // si + 1 for ni, ki, si, pi in zip(n, k, s, p))
    assert tuple(y.shape) == (2, 3, *expected)
    assert layer.output_shape(n) == expected


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_batch_independence(nd):
    """Output row b depends only on input row b: perturbing row 0 leaves the others unchanged, and
    the gradient of row b's output w.r.t. every other row is exactly zero."""
    layer = LAYERS[nd](2, 3, 3, stride=2, padding=1, activation="tanh", dtype=torch.float64)
    x = torch.randn(4, 2, *(7,) * nd, dtype=torch.float64)
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
        others = torch.cat([gx[:b], gx[b + 1 :]])
        assert torch.count_nonzero(others) == 0
        assert gx[b].abs().max() > 0


def test_network_history_matches_autograd():
    """Conv2D → Flatten → Dense inside Network: forward_record + Network.backward equal autograd
    through the PyTorch equivalent (nn.Conv2d, ReLU, nn.Flatten, nn.Linear) with copied weights."""
    dt = torch.float64
    net = Network(
        Conv2D(2, 3, 3, stride=2, padding=1, activation="relu", dtype=dt),
        Flatten(),
        Dense(3 * 4 * 3, 5, activation="tanh", dtype=dt),
        record_history=True,
    )
    conv_ref = nn.Conv2d(2, 3, 3, stride=2, padding=1, dtype=dt)
    lin_ref = nn.Linear(36, 5, dtype=dt)
    with torch.no_grad():
        net[0].bias.normal_()
        net[2].bias.normal_()
        conv_ref.weight.copy_(net[0].weight)
        conv_ref.bias.copy_(net[0].bias)
        lin_ref.weight.copy_(net[2].weight)
        lin_ref.bias.copy_(net[2].bias)
    x = torch.randn(3, 2, 7, 5, dtype=dt)
    out = net(x)  # record_history=True: the explicit path
    xr = x.clone().requires_grad_()
    pre_conv = conv_ref(xr)
    flat = torch.relu(pre_conv).flatten(1)
    out_ref = torch.tanh(lin_ref(flat))
    assert_close(out, out_ref, name="network output", rtol=1e-12, atol=1e-12)
    assert_close(net.history[0].pre, pre_conv, name="history[0].pre", rtol=1e-12, atol=1e-12)
    assert net.history[1].pre is None
    assert_close(net.forward_acts[2], flat, name="forward_acts[2]", rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    grad_in = net.backward(g, input_grad=True)
    assert_close(grad_in, xr.grad, name="grad input", rtol=1e-12, atol=1e-12)
    for p, r, name in [
        (net[0].weight, conv_ref.weight, "conv weight"),
        (net[0].bias, conv_ref.bias, "conv bias"),
        (net[2].weight, lin_ref.weight, "dense weight"),
        (net[2].bias, lin_ref.bias, "dense bias"),
    ]:
        assert_close(p.grad, r.grad, name=name, rtol=1e-12, atol=1e-12)


def test_flatten_gradcheck_and_shapes():
    f = Flatten()
    x = torch.randn(3, 2, 5, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x,))
    y = f(x)
    assert tuple(y.shape) == (3, 10)
    assert torch.equal(y, x.flatten(1))
    with pytest.raises(ValueError, match=r"\[batch, d1, \.\.\.\].*got \[4\]"):
        f(torch.randn(4))
    assert list(f.parameters()) == []


@pytest.mark.parametrize(
    "nd,shape,pattern",
    [
        (2, (2, 3, 8, 8), r"\[batch, 2, H, W\].*got \[2, 3, 8, 8\]"),  # wrong channel count
        (2, (2, 8, 8), r"\[batch, 2, H, W\].*got \[2, 8, 8\]"),  # missing batch dim
        (2, (2, 2, 2, 8), r"\[batch, 2, H, W\].*got \[2, 2, 2, 8\]"),  # H + 2p < k
        (1, (2, 2, 5, 5), r"\[batch, 2, L\].*got \[2, 2, 5, 5\]"),
        (3, (2, 2, 5, 5), r"\[batch, 2, D, H, W\].*got \[2, 2, 5, 5\]"),
    ],
)
def test_bad_input_shape(nd, shape, pattern):
    layer = LAYERS[nd](2, 3, 3)
    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(*shape))
    with pytest.raises(ValueError, match=pattern):
        layer.forward_saved(torch.randn(*shape))


def test_bad_input_type_and_dtype():
    layer = Conv1D(2, 3, 3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([[1.0, 2.0]])
    with pytest.raises(TypeError, match="float64.*float32"):
        layer(torch.randn(2, 2, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(in_channels=0, filters=3, kernel_size=3), "in_channels must be a positive int, got 0"),
        (dict(in_channels=2, filters=-1, kernel_size=3), "filters must be a positive int, got -1"),
        (dict(in_channels=2, filters=3, kernel_size=0), "kernel_size must be an int >= 1"),
        (dict(in_channels=2, filters=3, kernel_size=(3,)), r"kernel_size must be .* tuple of 2 .* got \(3,\)"),
        (dict(in_channels=2, filters=3, kernel_size=3, stride=0), "stride must be an int >= 1"),
        (dict(in_channels=2, filters=3, kernel_size=3, padding=-1), "padding must be an int >= 0"),
        (dict(in_channels=2, filters=3, kernel_size=3, padding=1.5), r"padding .* got 1\.5"),
        (dict(in_channels=2, filters=3, kernel_size=3, activation="swoosh"), "unknown activation 'swoosh'"),
        (dict(in_channels=2, filters=3, kernel_size=3, init="xavier"), "init must be one of"),
        (dict(in_channels=2, filters=3, kernel_size=3, bias="yes"), "bias must be a bool"),
        (dict(in_channels=True, filters=3, kernel_size=3), "in_channels must be a positive int"),
    ],
)
def test_bad_constructor_args(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Conv2D(**kwargs)


def test_init_he_normal_and_loom_uniform():
    layer = Conv2D(16, 64, (3, 5))
    fan_in = 16 * 3 * 5
    std = layer.weight.std().item()
    assert abs(std - math.sqrt(2.0 / fan_in)) < 0.05 * math.sqrt(2.0 / fan_in)
    assert abs(layer.weight.mean().item()) < 0.01
    assert torch.count_nonzero(layer.bias) == 0
    uni = Conv3D(4, 8, 3, init="loom_uniform")
    assert uni.weight.abs().max() <= 0.1
    assert uni.weight.abs().max() > 0.09
    assert abs(uni.weight.std().item() - 0.2 / math.sqrt(12)) < 0.005


def test_repr_and_loom_type():
    layer = Conv2D(3, 8, 3, stride=2, padding=1, activation="relu", bias=False)
    r = repr(layer)
    assert "in_channels=3" in r and "filters=8" in r and "kernel_size=(3, 3)" in r
    assert "stride=(2, 2)" in r and "padding=(1, 1)" in r and "activation=relu" in r and "bias=False" in r
    assert layer.loom_type == "CNN2"
    assert Conv1D(1, 1, 1).loom_type == "CNN1" and Conv3D(1, 1, 1).loom_type == "CNN3"
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    assert [n for n, _ in Conv1D(1, 2, 3).named_parameters()] == ["weight", "bias"]


def test_factory_kwargs():
    layer = Conv1D(2, 3, 3, dtype=torch.float64, device="cpu")
    assert layer.weight.dtype == torch.float64 and layer.bias.dtype == torch.float64
    assert tuple(layer.weight.shape) == (3, 2, 3)
