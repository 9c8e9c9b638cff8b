"""Softmax layer: hand-written backward against gradcheck and ``F.softmax`` (SPEC §3, §13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.layers.softmax import Softmax, SoftmaxFunction, softmax, softmax_backward, softmax_forward
from torchloom.engine.train import TrainingConfig, train

# (shape, dim, temperature): odd sizes, batch > 1, a non-last dim, temperatures below and above 1.
CASES = [((3, 5), -1, 1.0), ((4, 7), 1, 0.6), ((2, 3, 5), 1, 2.5), ((3, 4, 1), -1, 1.0), ((2, 5, 3), -2, 0.8)]


def _ids(c):
    return f"{'x'.join(map(str, c[0]))}-dim{c[1]}-T{c[2]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradcheck_float64(case):
    shape, dim, t = case
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SoftmaxFunction.apply, (x, dim, t))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_torch_softmax(case, dtype, tol):
    """Module output and input gradient equal ``F.softmax(x / T, dim)`` with autograd; the direct
    ``backward_saved`` gives the same gradient."""
    shape, dim, t = case
    layer = Softmax(dim, t)
    x = torch.randn(*shape, dtype=dtype) * 3
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(xo)
    y_ref = F.softmax(xr / t, dim=dim)
    assert_close(y, y_ref, name="output", rtol=tol, atol=tol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert_close(xo.grad, xr.grad, name="grad input", rtol=tol, atol=tol)
    with torch.no_grad():
        y2, saved = layer.forward_saved(x)
        gx, grads = layer.backward_saved(g, saved)
    assert grads == ()
    assert_close(y2, y_ref, name="forward_saved output", rtol=tol, atol=tol)
    assert_close(gx, xr.grad, name="backward_saved grad input", rtol=tol, atol=tol)
    assert layer.backward_saved(g, saved, needs_input_grad=False)[0] is None


def test_backward_uses_the_probabilities_not_the_logits():
    """Loom evaluates the Jacobian at the logits (SPEC §13). Here the saved tensor is the output p and
    the gradient is p ⊙ (g − ⟨g,p⟩)/T, which differs from the logits-evaluated one."""
    x = torch.randn(4, 6, dtype=torch.float64) * 2
    p, saved = softmax_forward(x, -1, 1.5)
    assert saved.output is p
    g = torch.randn_like(x)
    gx, _ = softmax_backward(g, saved)
    expected = p * (g - (g * p).sum(-1, keepdim=True)) / 1.5
    assert_close(gx, expected, name="grad input", rtol=1e-12, atol=1e-12)
    at_logits = x * (g - (g * x).sum(-1, keepdim=True)) / 1.5
    assert (gx - at_logits).abs().max() > 1e-3


def test_functional_matches_module():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    assert torch.equal(softmax(x, 1, 0.5), Softmax(1, 0.5)(x))


def test_batch_independence():
    """Every sample is normalised on its own (Loom spans the whole batch): perturbing sample 0 leaves
    the other samples' outputs and gradients unchanged, bit for bit."""
    layer = Softmax()
    x = torch.randn(5, 7)
    x2 = x.clone()
    x2[0] += torch.randn(7) * 5
    y, y2 = layer(x), layer(x2)
    assert not torch.equal(y[0], y2[0])
    assert torch.equal(y[1:], y2[1:])
    assert_close(y.sum(-1), torch.ones(5), name="row sums", rtol=1e-6, atol=1e-6)
    xr = x.clone().requires_grad_()
    layer(xr)[1:].sum().backward()
    assert torch.count_nonzero(xr.grad[0]) == 0


def test_inside_network_with_history():
    """Network(Dense, Softmax) in Loom mode: history and the hand-written backward equal autograd
    through a functional reference."""
    net = Network(Dense(5, 4, "tanh", dtype=torch.float64), Softmax(temperature=0.7), record_history=True)
    x = torch.randn(6, 5, dtype=torch.float64)
    y = net(x)
    rec = net.history[1]
    assert rec.input is net.history[0].output and rec.output is y and rec.pre is None
    g = torch.randn_like(y)
    gx = net.backward(g, input_grad=True)
    xr = x.clone().requires_grad_()
    dense = net[0]
    y_ref = F.softmax(torch.tanh(F.linear(xr, dense.weight, dense.bias)) / 0.7, dim=-1)
    assert_close(y, y_ref, name="output", rtol=1e-12, atol=1e-12)
    ref_grads = torch.autograd.grad(y_ref, (xr, dense.weight, dense.bias), g)
    assert_close(gx, ref_grads[0], name="grad input", rtol=1e-12, atol=1e-12)
    assert_close(dense.weight.grad, ref_grads[1], name="grad weight", rtol=1e-12, atol=1e-12)
    assert_close(dense.bias.grad, ref_grads[2], name="grad bias", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(dim=0), ValueError, "dim must not be 0, the batch dimension"),
        (dict(dim=1.0), TypeError, "dim must be an int, got float 1.0"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0, got 0.0"),
        (dict(temperature=-2), ValueError, "temperature must be a finite number > 0, got -2"),
        (dict(temperature=float("nan")), ValueError, "temperature must be a finite number > 0, got nan"),
        (dict(temperature=True), ValueError, "temperature must be a finite number > 0, got True"),
    ],
)
def test_bad_constructor_args(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Softmax(**kwargs)


@pytest.mark.parametrize(
    "dim,shape,pattern",
    [
        (-1, (5,), r"got shape \[5\]"),  # no batch dimension
        (2, (3, 4), r"dimension 2 a non-batch dimension .*got shape \[3, 4\]"),
        (-2, (3, 4), r"dimension -2 a non-batch dimension .*got shape \[3, 4\]"),  # -2 is the batch dim here
    ],
)
def test_bad_input_shape(dim, shape, pattern):
    with pytest.raises(ValueError, match=pattern):
        Softmax(dim)(torch.randn(*shape))
    with pytest.raises(ValueError, match=pattern):
        Softmax(dim).forward_saved(torch.randn(*shape))


def test_repr_and_no_parameters():
    layer = Softmax(-1, 2.0)
    assert "dim=-1, temperature=2.0" in repr(layer)
    assert list(layer.parameters()) == []


def _blobs(device: str | torch.device, n: int = 96, classes: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(classes, 4, generator=g) * 3
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, 4, generator=g) * 0.5
    y = F.one_hot(labels, classes).float()
    return [(x[i : i + 16].to(device), y[i : i + 16].to(device)) for i in range(0, n, 16)]


def _train_softmax_classifier(device: str) -> tuple[float, float]:
    """Dense → Softmax trained with Loom's probability cross-entropy (``"crossentropy"``)."""
    net = Network(Dense(4, 3, device=device), Softmax())
    res = train(net, _blobs(device), TrainingConfig(epochs=15, learning_rate=0.5, loss_type="crossentropy", verbose=False))
    return res.loss_history[0], res.final_loss


def test_train_reduces_loss():
    first, last = _train_softmax_classifier("cpu")
    assert last < 0.3 * first, (first, last)


@pytest.mark.cuda
def test_cuda_kernel_matches_reference_and_trains():
    """On CUDA the layer runs the fused kernels: forward and gradient equal F.softmax in float64 on the
    CPU, and training reduces the loss."""
    x = torch.randn(37, 300, dtype=torch.float64) * 3
    g = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    y_ref = F.softmax(xr / 0.7, dim=-1)
    y_ref.backward(g)
    xc = x.float().cuda().requires_grad_()
    y = Softmax(temperature=0.7)(xc)
    y.backward(g.float().cuda())
    assert_close(y, y_ref, name="output", rtol=1e-5, atol=1e-6)
    assert_close(xc.grad, xr.grad, name="grad input", rtol=1e-4, atol=1e-5)
    first, last = _train_softmax_classifier("cuda")
    assert last < 0.3 * first, (first, last)
