"""Activations (SPEC §2) against torch's own functions and autograd, in float64."""

import copy
import pickle

import pytest
import torch
from helpers import ACTIVATION_REFERENCE, op_names
from torchloom.layers.activations import ACTIVATIONS, activation_names, get_activation

REFERENCE = ACTIVATION_REFERENCE


def test_all_nine_are_there():
    assert activation_names() == ["relu", "leaky_relu", "relu2", "sigmoid", "tanh", "silu", "gelu", "gelu_tanh", "linear"]
    assert set(REFERENCE) == set(ACTIVATIONS)


@pytest.mark.parametrize("name", list(REFERENCE))
def test_forward_and_derivative_match_torch(name):
    act = get_activation(name)
    x = torch.randn(1000, dtype=torch.float64) * 3
    x = x[x.abs() > 1e-3]  # stay off the kinks, where autograd picks a side
    xr = x.clone().requires_grad_(True)
    y_ref = REFERENCE[name](xr)
    (d_ref,) = torch.autograd.grad(y_ref.sum(), xr)
    torch.testing.assert_close(act.forward(x), y_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(act.derivative(x), d_ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(x)
    torch.testing.assert_close(act.grad(g, x), g * d_ref, rtol=1e-10, atol=1e-12)


def test_derivatives_at_zero_follow_loom():
    z = torch.zeros(1, dtype=torch.float64)
    assert get_activation("relu").derivative(z).item() == 0.0
    assert get_activation("leaky_relu").derivative(z).item() == 0.01
    assert get_activation("relu2").derivative(z).item() == 0.0
    assert get_activation("leaky_relu").grad(torch.ones(1, dtype=torch.float64), z).item() == 0.01
    assert get_activation("relu").grad(torch.ones(1, dtype=torch.float64), z).item() == 0.0


def test_relu_grad_is_one_op_with_loom_values_at_the_kink_and_both_dtypes():
    relu = get_activation("relu")
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([-2.0, -0.0, 0.0, 1e-30, 3.0, float("inf"), -float("inf")], dtype=dtype)
        g = torch.tensor([1.0, 2.0, 3.0, 4.0, float("nan"), 6.0, float("inf")], dtype=dtype)
        with op_names() as ops:
            out = relu.grad(g, x)
        assert ops.names == ["threshold_backward"]  # one kernel on the device (a compare and a where: two)
        expected = torch.tensor([0.0, 0.0, 0.0, 4.0, float("nan"), 6.0, 0.0], dtype=dtype)  # f'(0) = 0 (Loom)
        torch.testing.assert_close(out, expected, equal_nan=True, rtol=0, atol=0)
        assert out.dtype == dtype
    # a gradient of another dtype than the pre-activation keeps its own dtype (the two-op path)
    out = relu.grad(torch.ones(3, dtype=torch.float64), torch.tensor([-1.0, 0.0, 2.0]))
    assert out.dtype == torch.float64 and out.tolist() == [0.0, 0.0, 1.0]


def test_relu_grad_is_twice_differentiable_like_the_mask():
    x = torch.randn(6, 5, dtype=torch.float64)
    x = torch.where(x.abs() < 1e-3, 0.5, x)  # off the kink
    g = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    relu = get_activation("relu")
    torch.autograd.gradcheck(lambda g: relu.grad(g, x), (g,))
    (second,) = torch.autograd.grad(relu.grad(g, x).square().sum(), g)
    torch.testing.assert_close(second, 2 * g.detach() * (x > 0), rtol=0, atol=1e-15)


def test_gelu_derivative_is_the_documented_formula():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    phi = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
    cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
    torch.testing.assert_close(get_activation("gelu").derivative(x), cdf + x * phi, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "alias,canonical",
    [("ReLU", "relu"), ("LeakyReLU", "leaky_relu"), ("leakyrelu", "leaky_relu"), ("LEAKY_RELU", "leaky_relu"),
     ("none", "linear"), ("Identity", "linear"), ("Linear", "linear"), ("GELU_TANH", "gelu_tanh"), ("SiLU", "silu")],
)
def test_aliases_case_insensitive(alias, canonical):
    assert get_activation(alias) == ACTIVATIONS[canonical]


def test_each_lookup_is_an_instance_of_its_own_equal_by_kind():
    """Layers do not share an activation object (a compiled model's guards would check, on every call,
    that they still did), and instances compare and hash by kind."""
    a, b = get_activation("relu"), get_activation("ReLU")
    assert a is not b and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert get_activation("relu") != get_activation("tanh")
    assert get_activation(a) is a  # an instance passes through
    assert get_activation("gelu_loom") is not get_activation("gelu_loom")


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_activation("softplus")
    msg = str(e.value)
    assert "'softplus'" in msg
    for name in activation_names():
        assert name in msg


def test_non_string_is_type_error():
    with pytest.raises(TypeError, match="activation must be a str"):
        get_activation(3)


def test_pickle_and_deepcopy_keep_the_kind():
    act = get_activation("tanh")
    for back in (pickle.loads(pickle.dumps(act)), copy.deepcopy(act)):
        assert type(back) is type(act) and back == act and back.name == "tanh"
