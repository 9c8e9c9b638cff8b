"""ConvTranspose1D/2D/3D: forward equals torch.nn.functional.conv_transposeNd, the hand-written backward
equals autograd through F.conv_transposeNd and passes gradcheck in float64."""

import pytest
import torch
import torch.nn.functional as F

from torchloom import ConvTranspose1D, ConvTranspose2D, ConvTranspose3D
from torchloom.layers.conv_transpose import conv_transpose

CASES = [
    (ConvTranspose1D, F.conv_transpose1d, (2, 3, 5), dict(kernel_size=3, stride=2, padding=1, output_padding=1)),
    (ConvTranspose1D, F.conv_transpose1d, (2, 3, 4), dict(kernel_size=2)),
    (ConvTranspose2D, F.conv_transpose2d, (2, 2, 3, 4), dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0))),
    (ConvTranspose3D, F.conv_transpose3d, (1, 2, 2, 3, 2), dict(kernel_size=2, stride=2, padding=0, output_padding=1)),
]


def _ref(fn, layer, x):
    pre = fn(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.output_padding)
    return torch.tanh(pre)


@pytest.mark.parametrize("cls,fn,shape,kw", CASES)
def test_forward_and_backward_match_torch(cls, fn, shape, kw):
    torch.manual_seed(0)
    layer = cls(shape[1], 4, activation="tanh", dtype=torch.float64, **kw)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape[2:] == layer.output_shape(tuple(shape[2:]))
    ref = _ref(fn, layer, x)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, layer.weight, layer.bias), g)
    want = torch.autograd.grad(ref, (x, layer.weight, layer.bias), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cls,fn,shape,kw", CASES)
def test_gradcheck(cls, fn, shape, kw):
    torch.manual_seed(1)
    layer = cls(shape[1], 2, activation="sigmoid", dtype=torch.float64, **kw)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    fn_ = lambda x, w, b: conv_transpose(x, w, b, layer.stride, layer.padding, layer.output_padding, "sigmoid")
    assert torch.autograd.gradcheck(fn_, (x, layer.weight, layer.bias))


def test_backward_saved_equals_autograd_and_no_bias():
    torch.manual_seed(2)
    layer = ConvTranspose2D(3, 2, 3, stride=2, bias=False, activation="relu", dtype=torch.float64)
    x = torch.randn(2, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    y, saved = layer.forward_saved(x)
    g = torch.randn_like(y)
    gx, (gw,) = layer.backward_saved(g, saved)
    ref = torch.relu(F.conv_transpose2d(x, layer.weight, None, 2))
    rx, rw = torch.autograd.grad(ref, (x, layer.weight), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert len(list(layer.parameters())) == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(in_channels=0), "in_channels must be a positive int"),
        (dict(kernel_size=0), "kernel_size must be an int >= 1"),
        (dict(stride=2, output_padding=2), "output_padding must be smaller than stride"),
        (dict(padding=-1), "padding must be an int >= 0"),
    ],
)
def test_bad_arguments(kw, match):
    args = dict(in_channels=2, filters=3, kernel_size=2)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ConvTranspose1D(**args)


def test_bad_input():
    layer = ConvTranspose1D(2, 3, 3, padding=2)
    with pytest.raises(ValueError, match="input must have shape"):
        layer(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="input must have shape"):
        layer(torch.randn(1, 2, 1))  # output size (1-1) - 4 + 3 < 1
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(1, 2, 4, dtype=torch.float64))
