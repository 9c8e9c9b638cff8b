"""Embedding: hand-written scatter-add backward against gradcheck and ``nn.Embedding``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.embedding import Embedding, EmbeddingFunction, embedding
from torchloom.layers.network import Network


ACTS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "silu": nn.functional.silu,
        "gelu": nn.functional.gelu, "leaky_relu": lambda t: nn.functional.leaky_relu(t, 0.01)}


def _copy_to_torch(layer: Embedding) -> nn.Embedding:
    ref = nn.Embedding(layer.num_embeddings, layer.embedding_dim, dtype=layer.weight.dtype)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
    return ref


@pytest.mark.parametrize("index_shape", [(3, 5), (2,), (2, 3, 4)])
def test_gradcheck_float64(index_shape):
    """Gradient w.r.t. the table, with indices that repeat (so the scatter must add)."""
    idx = torch.randint(0, 4, index_shape)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: EmbeddingFunction.apply(idx, w), (w,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_matches_torch_embedding(dtype, index_dtype):
    layer = Embedding(7, 5, dtype=dtype)
    ref = _copy_to_torch(layer)
    idx = torch.tensor([[0, 3, 3, 6], [6, 6, 1, 0], [2, 2, 2, 2]], dtype=index_dtype)
    y = layer(idx)
    y_ref = ref(idx.long())
    assert torch.equal(y, y_ref)  # a lookup: bit-exact
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert_close(layer.weight.grad, ref.weight.grad, name="grad weight", rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(layer.weight.grad[[4, 5]]) == 0  # unused rows get no gradient

    with torch.no_grad():
        y2, saved = layer.forward_saved(idx)
        grad_in, (grad_w,) = layer.backward_saved(g, saved)
    assert grad_in is None
    assert torch.equal(y2, y_ref)
    assert_close(grad_w, ref.weight.grad, name="backward_saved grad weight", rtol=1e-6, atol=1e-6)


def test_batch_independence():
    """Changing row 0's tokens leaves the other rows' outputs unchanged, and row b's output sends
    gradient only into the table rows row b used."""
    layer = Embedding(10, 4, dtype=torch.float64)
    idx = torch.tensor([[1, 2, 3], [4, 5, 4], [7, 8, 9]])
    y = layer(idx)
    idx2 = idx.clone()
    idx2[0] = torch.tensor([0, 6, 6])
    y2 = layer(idx2)
    assert not torch.equal(y2[0], y[0])
    assert torch.equal(y2[1:], y[1:])
    for b in range(3):
        out = layer(idx)
        (gw,) = torch.autograd.grad((out[b] * torch.randn_like(out[b])).sum(), layer.weight)
        used = set(idx[b].tolist())
        for v in range(10):
            assert (gw[v].abs().max() > 0) == (v in used), f"row {b}, table row {v}"


def test_network_history_matches_autograd():
    """Embedding → Dense in a Network: forward_record + Network.backward equal autograd through
    nn.Embedding and nn.Linear."""
    dt = torch.float64
    net = Network(Embedding(6, 4, dtype=dt), Dense(4, 3, activation="tanh", dtype=dt))
    ref = _copy_to_torch(net[0])
    lin = nn.Linear(4, 3, dtype=dt)
    with torch.no_grad():
        net[1].bias.normal_()
        lin.weight.copy_(net[1].weight)
        lin.bias.copy_(net[1].bias)
    idx = torch.randint(0, 6, (3, 5))
    out = net.forward_record(idx)
    e = ref(idx)
    out_ref = torch.tanh(lin(e))
    assert_close(out, out_ref, name="network output", rtol=1e-12, atol=1e-12)
    assert net.history[0].pre is None
    assert torch.equal(net.forward_acts[0], idx)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    assert net.backward(g, input_grad=True) is None  # integer input: no gradient
    assert_close(net[0].weight.grad, ref.weight.grad, name="embedding weight", rtol=1e-12, atol=1e-12)
    assert_close(net[1].weight.grad, lin.weight.grad, name="dense weight", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad,pattern", [(-1, r"\[0, 5\).*\[-1, 4\]"), (5, r"\[0, 5\).*\[0, 5\]")])
def test_out_of_range_indices(bad, pattern):
    layer = Embedding(5, 2)
    idx = torch.tensor([[0, 4], [bad, 1]])
    with pytest.raises(ValueError, match=pattern):
        layer(idx)
    with pytest.raises(ValueError, match=pattern):
        layer.forward_saved(idx)
    with pytest.raises(ValueError, match=pattern):
        embedding(idx, layer.weight)


def test_check_indices_off_still_checks_type_and_shape():
    layer = Embedding(5, 2, check_indices=False)
    assert layer(torch.tensor([[1, 2]])).shape == (1, 2, 2)
    with pytest.raises(TypeError, match="integer indices"):
        layer(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"\[batch, \.\.\.\].*got \[\]"):
        layer(torch.tensor(3))


@pytest.mark.parametrize(
    "x,err,pattern",
    [
        (torch.tensor([[0.0, 1.0]]), TypeError, "integer indices.*float32"),
        (torch.tensor(2), ValueError, r"\[batch, \.\.\.\].*got \[\]"),
        ([[0, 1]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_input(x, err, pattern):
    with pytest.raises(err, match=pattern):
        Embedding(5, 2)(x)


@pytest.mark.parametrize(
    "args,kwargs,pattern",
    [
        ((0, 4), {}, "num_embeddings must be a positive int, got 0"),
        ((5, -1), {}, "embedding_dim must be a positive int, got -1"),
        ((5, 4), {"init": "he_normal"}, "init must be one of"),
        ((5, 4), {"check_indices": "no"}, "check_indices must be a bool"),
        ((5, 4), {"activation": "softplus"}, "unknown activation 'softplus'"),
    ],
)
def test_bad_constructor_args(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Embedding(*args, **kwargs)


def test_init_and_repr():
    layer = Embedding(200, 50)
    assert tuple(layer.weight.shape) == (200, 50)
    assert abs(layer.weight.std().item() - 1.0) < 0.03 and abs(layer.weight.mean().item()) < 0.03
    assert Embedding(200, 50, init="loom_uniform").weight.abs().max() <= 0.1
    assert repr(layer) == "Embedding(num_embeddings=200, embedding_dim=50)"


# ------------------------------------------------------------------------------ activation
@pytest.mark.parametrize("act", sorted(ACTS))
def test_activation_forward_and_every_gradient_against_autograd(act):
    """``f(W[x])`` with the derivative taken at the looked-up rows: both paths (module autograd,
    ``forward_saved``/``backward_saved``) against ``f(nn.Embedding)`` through torch autograd in
    float64, and gradcheck."""
    layer = Embedding(6, 4, activation=act, dtype=torch.float64)
    ref = _copy_to_torch(layer)
    idx = torch.tensor([[0, 3, 3, 5], [5, 5, 1, 0]])  # repeats: the scatter must add
    out_ref = ACTS[act](ref(idx))
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    y = layer(idx)
    assert_close(y, out_ref, name="output", rtol=1e-12, atol=1e-12)
    (gw,) = torch.autograd.grad(y, layer.weight, g)
    assert_close(gw, ref.weight.grad, name="grad weight (autograd path)", rtol=1e-12, atol=1e-12)
    y2, saved = layer.forward_saved(idx)
    assert_close(layer.pre_activation(saved), ref(idx), name="pre-activation", rtol=0, atol=0)
    _, (gw2,) = layer.backward_saved(g, saved)
    assert_close(gw2, ref.weight.grad, name="grad weight (backward_saved)", rtol=1e-12, atol=1e-12)
    w = layer.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda w: embedding(idx, w, act), (w,))


def test_linear_activation_keeps_nothing_more():
    layer = Embedding(5, 3)
    _, saved = layer.forward_saved(torch.tensor([[1, 2]]))
    assert saved.pre is None and saved.activation is None and layer.pre_activation(saved) is None
    assert repr(Embedding(5, 3, activation="tanh")) == "Embedding(num_embeddings=5, embedding_dim=3, activation=tanh)"
