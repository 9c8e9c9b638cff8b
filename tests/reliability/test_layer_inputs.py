"""Bad inputs to the layers (issue 12, item 7): each gets the exact exception type with a message that
names the argument (and, for dtypes, both dtypes), raised before anything changes: the parameters,
their ``.grad`` and the layer's state are left as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchloom.layers.containers import Parallel, Residual
from torchloom.layers.conv import Conv1D, Conv2D, Conv3D, Flatten
from torchloom.layers.dense import Dense
from torchloom.layers.embedding import Embedding
from torchloom.layers.network import Network, Sequential
from torchloom.layers.norm import LayerNorm, RMSNorm
from torchloom.layers.softmax import Softmax
from torchloom.layers.swiglu import SwiGLU

f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def _r(*s, dtype=f32):
    return lambda: torch.randn(*s, dtype=dtype)


# (id, layer factory, input factory, exception type, words the message must contain)
CASES = [
    # Dense: dtype, kind, shape
    ("dense_f64_input", lambda: Dense(4, 3), _r(2, 4, dtype=f64), TypeError, ["input", "torch.float64", "torch.float32"]),
    ("dense_bf16_input", lambda: Dense(4, 3, "relu"), _r(2, 4, dtype=bf16), TypeError, ["input", "torch.bfloat16", "torch.float32"]),
    ("dense_f32_input_bf16_layer", lambda: Dense(4, 3).to(bf16), _r(2, 4), TypeError, ["input", "torch.float32", "torch.bfloat16"]),
    ("dense_int_input", lambda: Dense(4, 3), lambda: torch.ones(2, 4, dtype=torch.int64), TypeError, ["input", "torch.int64"]),
    ("dense_bool_input", lambda: Dense(4, 3), lambda: torch.ones(2, 4, dtype=torch.bool), TypeError, ["input", "torch.bool"]),
    ("dense_wrong_features", lambda: Dense(4, 3), _r(2, 5), ValueError, ["input", "[2, 5]"]),
    ("dense_1d", lambda: Dense(4, 3), _r(4), ValueError, ["input", "[4]"]),
    ("dense_list", lambda: Dense(4, 3), lambda: [[0.0] * 4], TypeError, ["input", "list"]),
    ("dense_numpy", lambda: Dense(4, 3), lambda: np.zeros((2, 4), dtype=np.float32), TypeError, ["input", "ndarray"]),
    # SwiGLU
    ("swiglu_f64_input", lambda: SwiGLU(4, 6), _r(3, 4, dtype=f64), TypeError, ["input", "torch.float64", "torch.float32"]),
    ("swiglu_f16_input", lambda: SwiGLU(4, 6), _r(3, 4, dtype=f16), TypeError, ["input", "torch.float16", "torch.float32"]),
    ("swiglu_int_input", lambda: SwiGLU(4, 6), lambda: torch.ones(3, 4, dtype=torch.int32), TypeError, ["input", "torch.int32"]),
    ("swiglu_wrong_hidden", lambda: SwiGLU(4, 6), _r(3, 6), ValueError, ["input", "[3, 6]"]),
    ("swiglu_1d", lambda: SwiGLU(4, 6), _r(4), ValueError, ["input", "[4]"]),
    ("swiglu_scalar", lambda: SwiGLU(4, 6), lambda: 1.0, TypeError, ["input", "float"]),
    # Convolutions
    ("conv1d_f64_input", lambda: Conv1D(2, 3, 3), _r(1, 2, 5, dtype=f64), TypeError, ["input", "torch.float64", "torch.float32"]),
    ("conv2d_bf16_input", lambda: Conv2D(2, 3, 3), _r(1, 2, 5, 5, dtype=bf16), TypeError, ["input", "torch.bfloat16"]),
    ("conv2d_int_input", lambda: Conv2D(2, 3, 3), lambda: torch.ones(1, 2, 5, 5, dtype=torch.uint8), TypeError, ["input", "torch.uint8"]),
    ("conv2d_wrong_channels", lambda: Conv2D(2, 3, 3), _r(1, 3, 5, 5), ValueError, ["input", "[1, 3, 5, 5]"]),
    ("conv2d_3d_input", lambda: Conv2D(2, 3, 3), _r(2, 5, 5), ValueError, ["input", "[2, 5, 5]"]),
    ("conv2d_too_small", lambda: Conv2D(2, 3, 3), _r(1, 2, 2, 5), ValueError, ["input", "kernel_size"]),
    ("conv3d_4d_input", lambda: Conv3D(1, 2, 2), _r(1, 3, 3, 3), ValueError, ["input", "[1, 3, 3, 3]"]),
    ("conv1d_tuple", lambda: Conv1D(2, 3, 3), lambda: (torch.randn(1, 2, 5),), TypeError, ["input", "tuple"]),
    # Norms
    ("rmsnorm_int_input", lambda: RMSNorm(4), lambda: torch.ones(2, 4, dtype=torch.int64), TypeError, ["input", "torch.int64", "torch.float32"]),
    ("rmsnorm_wrong_size", lambda: RMSNorm(4), _r(2, 5), ValueError, ["input", "[2, 5]"]),
    ("rmsnorm_1d", lambda: RMSNorm(4), _r(4), ValueError, ["input", "[4]"]),
    ("layernorm_int_input", lambda: LayerNorm(4), lambda: torch.ones(2, 4, dtype=torch.int16), TypeError, ["input", "torch.int16"]),
    ("layernorm_wrong_size", lambda: LayerNorm(4), _r(2, 3, 5), ValueError, ["input", "[2, 3, 5]"]),
    ("layernorm_list", lambda: LayerNorm(4), lambda: [1.0, 2.0], TypeError, ["input", "list"]),
    # Softmax, Flatten, Embedding
    ("softmax_int_input", lambda: Softmax(), lambda: torch.ones(2, 4, dtype=torch.int64), TypeError, ["input", "torch.int64"]),
    ("softmax_1d", lambda: Softmax(), _r(4), ValueError, ["input", "[4]"]),
    ("flatten_1d", lambda: Flatten(), _r(4), ValueError, ["input", "[4]"]),
    ("embedding_float_indices", lambda: Embedding(5, 3), _r(2, 3), TypeError, ["input", "torch.float32"]),
    ("embedding_out_of_range", lambda: Embedding(5, 3), lambda: torch.tensor([[0, 5]]), ValueError, ["indices", "[0, 5)"]),
    ("embedding_negative", lambda: Embedding(5, 3), lambda: torch.tensor([[-1, 2]]), ValueError, ["indices", "[-1, 2]"]),
    ("embedding_0d", lambda: Embedding(5, 3), lambda: torch.tensor(2), ValueError, ["input", "[]"]),
    # Containers: the error of a child, before any child ran its update
    ("residual_shape_change", lambda: Residual(Dense(4, 3)), _r(2, 4), ValueError, ["inner", "[2, 4]"]),
    ("residual_child_dtype", lambda: Residual(Dense(4, 4)), _r(2, 4, dtype=f64), TypeError, ["input", "torch.float64"]),
    ("parallel_concat_mismatch", lambda: Parallel([Dense(4, 2), Flatten()]), _r(2, 4, 1), ValueError, ["input", "[2, 4, 1]"]),
    ("parallel_add_mismatch", lambda: Parallel([Dense(4, 2), Dense(4, 3)], combine="add"), _r(2, 4), ValueError, ["one shape", "[2, 3]"]),
    ("sequential_second_layer_dtype", lambda: Sequential(Dense(4, 4), Dense(4, 2).double()), _r(2, 4), TypeError, ["input", "torch.float32", "torch.float64"]),
    ("network_bf16_input", lambda: Network(Dense(4, 4), RMSNorm(4)), _r(2, 4, dtype=bf16), TypeError, ["input", "torch.bfloat16"]),
]


def _snapshot(layer):
    return {n: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in layer.named_parameters()}


def _unchanged(layer, snap):
    for n, p in layer.named_parameters():
        value, grad = snap[n]
        assert torch.equal(p.detach(), value), f"parameter {n} changed"
        assert (p.grad is None and grad is None) or torch.equal(p.grad, grad), f".grad of {n} changed"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("path", ["module", "forward_saved"])
def test_bad_layer_input(case, path):
    _, make_layer, make_x, exc, words = case
    layer = make_layer()
    with torch.no_grad():  # non-trivial .grad to check it is left alone
        for p in layer.parameters():
            p.grad = torch.full_like(p, 0.25)
    snap = _snapshot(layer)
    x = make_x()
    with pytest.raises(exc) as info:
        if path == "module":
            layer(x)
        else:
            layer.forward_saved(x)
    message = str(info.value)
    for w in words:
        assert w in message, f"message {message!r} does not name {w!r}"
    _unchanged(layer, snap)


def test_network_backward_bad_grad_shape_leaves_grads():
    net = Network(Dense(4, 3), record_history=True)
    net(torch.randn(2, 4))
    net.backward(torch.ones(2, 3))
    snap = _snapshot(net)
    with pytest.raises(ValueError, match="grad_output"):
        net.backward(torch.ones(2, 4))
    _unchanged(net, snap)


def test_autocast_accepts_mixed_dtypes_that_are_errors_outside():
    """The dtype check gives way to autocast (which casts), and only to it."""
    layer = Dense(4, 3)
    x = torch.randn(2, 4, dtype=bf16)
    with torch.autocast("cpu", dtype=bf16):
        assert layer(x).dtype == bf16
    with pytest.raises(TypeError, match="torch.bfloat16"):
        layer(x)


# ------------------------------------------------ plain in-place modules inside a Network (issue 11)
class _AddsInPlace(torch.nn.Module):
    """Writes into its input without saying so (no ``inplace`` attribute)."""

    def forward(self, x):
        return x.add_(1.0)


def _inplace_nets():
    torch.manual_seed(0)
    nn = torch.nn
    return {
        "ReLU(inplace) after a sigmoid Dense": Network(Dense(3, 4, "sigmoid", dtype=f64), nn.ReLU(inplace=True), Dense(4, 2, dtype=f64)),
        "ReLU(inplace) after Softmax (saves its output)": Network(Dense(3, 4, dtype=f64), Softmax(), nn.ReLU(inplace=True), Dense(4, 2, dtype=f64)),
        "first layer LeakyReLU(inplace)": Network(nn.LeakyReLU(0.1, inplace=True), Dense(3, 2, dtype=f64)),
        "in-place inside an nn.Sequential": Network(Dense(3, 4, dtype=f64), nn.Sequential(nn.Hardtanh(-0.5, 0.5, inplace=True), nn.Linear(4, 2, dtype=f64))),
    }


def _reference(net, x):
    """The same function with out-of-place modules, in plain autograd (float64)."""
    import copy

    ref = copy.deepcopy(net)
    for m in ref.modules():
        if hasattr(m, "inplace"):
            m.inplace = False
    return ref, ref(x)


@pytest.mark.parametrize("name", list(_inplace_nets()))
def test_in_place_module_in_a_network_trains_and_changes_nothing_it_reads(name):
    """``nn.ReLU(inplace=True)`` and friends: the autograd path (``net(x)`` + ``backward``) and the
    training path (``train()``, hand-written backward) both give the gradients of the out-of-place
    network, and the caller's batch is never modified."""
    from torchloom.engine.train import TrainingConfig, train

    net = _inplace_nets()[name]
    x = torch.randn(5, 3, dtype=f64)
    y = torch.randn(5, 2, dtype=f64)
    x0 = x.clone()
    ref, out_ref = _reference(net, x)
    loss_ref = ((out_ref - y) ** 2).mean()
    grads_ref = torch.autograd.grad(loss_ref, list(ref.parameters()))
    out = net(x)  # autograd path
    grads = torch.autograd.grad(((out - y) ** 2).mean(), list(net.parameters()))
    for i, (g, gr) in enumerate(zip(grads, grads_ref)):
        torch.testing.assert_close(g, gr, rtol=1e-12, atol=1e-12, msg=f"{name}: autograd gradient {i}")
    before = [p.detach().clone() for p in net.parameters()]
    train(net, [(x, y)], TrainingConfig(epochs=1, learning_rate=0.1, loss_type="mse", verbose=0))
    for i, (p, p0, gr) in enumerate(zip(net.parameters(), before, grads_ref)):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * gr, rtol=0, atol=1e-12, msg=f"{name}: trained parameter {i}")
    assert torch.equal(x, x0)


def test_a_module_writing_into_its_input_unannounced_is_a_clear_error():
    from torchloom.engine.train import TrainingConfig, train

    net = Network(Dense(3, 4, dtype=f64), _AddsInPlace(), Dense(4, 2, dtype=f64))
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError) as info:
        train(net, [(torch.randn(5, 3, dtype=f64), torch.randn(5, 2, dtype=f64))], TrainingConfig(epochs=1, verbose=0))
    assert str(info.value).startswith(
        "ModuleLayer(_AddsInPlace): the module writes into its input in place, which torchloom keeps for the backward "
        "pass (and which may be the previous layer's output or your batch); give the module an inplace=True "
        "attribute (torchloom then passes it a copy) or compute out of place. ("
    )
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
