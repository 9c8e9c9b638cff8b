"""Residual and Parallel: hand-written backward through the children, against gradcheck and autograd
through plain-torch references (SPEC §3, §13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.layers.attention import MultiHeadAttention
from torchloom.layers.base import Layer, LayerFunction
from torchloom.layers.containers import Parallel, Residual
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network, Sequential
from torchloom.layers.norm import RMSNorm
from torchloom.layers.swiglu import SwiGLU
from torchloom.engine.train import TrainingConfig, train

DT = torch.float64


def _dense(x, layer, params):
    """A torchloom Dense written in plain torch with the given (weight[, bias])."""
    return layer.activation.forward(F.linear(x, params[0], params[1] if len(params) > 1 else None))


def _check_against(module, reference, x, tol=1e-12):
    """``module(x)`` through LayerFunction and ``backward_saved`` both equal ``reference(x, params)``
    (plain torch) differentiated by autograd: output, input gradient and every parameter gradient,
    the latter in ``tuple(module.parameters())`` order."""
    params = tuple(module.parameters())
    refs = [p.detach().clone().requires_grad_() for p in params]
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = module(xo)
    y_ref = reference(xr, refs)
    assert_close(y, y_ref, name="output", rtol=tol, atol=tol)
    g = torch.randn_like(y_ref)
    y.backward(g)
    ref_grads = torch.autograd.grad(y_ref, [xr, *refs], g)
    assert_close(xo.grad, ref_grads[0], name="grad input", rtol=tol, atol=tol)
    for i, (p, r) in enumerate(zip(params, ref_grads[1:])):
        assert_close(p.grad, r, name=f"grad param {i}", rtol=tol, atol=tol)
    with torch.no_grad():
        y2, saved = module.forward_saved(x)
        gx, grads = module.backward_saved(g, saved)
    assert module.pre_activation(saved) is None
    assert len(grads) == len(params)
    assert_close(y2, y_ref, name="forward_saved output", rtol=tol, atol=tol)
    assert_close(gx, ref_grads[0], name="backward_saved grad input", rtol=tol, atol=tol)
    for i, (a, r) in enumerate(zip(grads, ref_grads[1:])):
        assert_close(a, r, name=f"backward_saved grad param {i}", rtol=tol, atol=tol)
    none_x, grads2 = module.backward_saved(g, saved, needs_input_grad=False)
    assert none_x is None
    for a, b in zip(grads2, grads):
        assert torch.equal(a, b)


# =========================================================================================== Residual
def test_residual_gradcheck_through_layer_function():
    """gradcheck of the generic LayerFunction over Residual(Dense): the parameters are passed as
    inputs, so gradcheck perturbs the layer's own weights and checks their gradients too."""
    res = Residual(Dense(5, 5, "tanh", dtype=DT))
    x = torch.randn(3, 5, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: LayerFunction.apply(res, x, *p), (x, *res.parameters()))


def test_residual_matches_autograd():
    res = Residual(Dense(5, 5, "tanh", dtype=DT))
    _check_against(res, lambda x, p: x + torch.tanh(F.linear(x, p[0], p[1])), torch.randn(4, 5, dtype=DT))


@pytest.mark.parametrize("case", ["residual", "parallel", "frozen input and one frozen branch"])
def test_parameter_gradients_when_the_input_wants_none(case):
    """An input without ``requires_grad`` (a first layer's batch): the parameters still get their
    gradients, through the hand-written backward, equal to plain torch's autograd; a frozen branch's
    parameters get none."""
    torch.manual_seed(0)
    if case == "residual":
        module = Residual(Dense(5, 5, "tanh", dtype=DT))
        reference = lambda x, p: x + torch.tanh(F.linear(x, p[0], p[1]))  # noqa: E731
    else:
        module = Parallel([Dense(5, 3, "tanh", dtype=DT), Dense(5, 2, dtype=DT)])
        reference = lambda x, p: torch.cat([torch.tanh(F.linear(x, p[0], p[1])), F.linear(x, p[2], p[3])], -1)  # noqa: E731
    if case.startswith("frozen"):
        module.branches[1].requires_grad_(False)
    params = tuple(module.parameters())
    refs = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    x = torch.randn(4, 5, dtype=DT)  # requires no gradient
    y, y_ref = module(x), reference(x, refs)
    assert type(y.grad_fn).__name__ == "LayerFunctionBackward"  # the hand-written backward, not autograd's
    g = torch.randn_like(y_ref)
    y.backward(g)
    wanted = [r for r in refs if r.requires_grad]
    ref_grads = iter(torch.autograd.grad(y_ref, wanted, g))
    for i, (p, r) in enumerate(zip(params, refs)):
        if r.requires_grad:
            assert_close(p.grad, next(ref_grads), name=f"grad param {i}", rtol=1e-12, atol=1e-12)
        else:
            assert p.grad is None


def test_residual_around_a_sequential_block():
    """A pre-norm block x + SwiGLU(RMSNorm(x)) on [B, S, h]."""
    block = Residual(Sequential(RMSNorm(6, dtype=DT), SwiGLU(6, 10, dtype=DT)))
    with torch.no_grad():
        block.inner[0].weight.normal_(1.0, 0.3)

    def ref(x, p):
        g, gw, uw, dw, gb, ub, db = p
        h = F.rms_norm(x, (6,), g, 1e-6)
        return x + F.linear(F.silu(F.linear(h, gw, gb)) * F.linear(h, uw, ub), dw, db)

    _check_against(block, ref, torch.randn(3, 4, 6, dtype=DT), tol=1e-11)


def test_residual_rejects_a_shape_changing_inner_layer_and_non_layers():
    with pytest.raises(ValueError, match=r"must keep the input's shape \[3, 5\], got output shape \[3, 4\]"):
        Residual(Dense(5, 4))(torch.randn(3, 5))
    with pytest.raises(TypeError, match="inner must be a torchloom layer .* got Linear"):
        Residual(torch.nn.Linear(3, 3))


# =========================================================================================== Parallel
class _Flatten(Layer):
    """[B, ...] → [B, prod(...)]: a rank-changing layer for the shape checks."""

    def forward_saved(self, x):
        return x.reshape(x.shape[0], -1), x.shape

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return (grad_out.reshape(saved) if needs_input_grad else None), ()


def _branches():
    return [Dense(5, 3, "tanh", dtype=DT), Dense(5, 4, "relu", bias=False, dtype=DT), SwiGLU(5, 6, dtype=DT)]


def test_parallel_concat_gradcheck_and_matches_autograd():
    """Concat along the last dimension; the backward slices every sample's last dimension (Loom
    slices branch-major over the batch: SPEC §13), checked at batch 4."""
    par = Parallel(_branches(), combine="concat")
    x = torch.randn(4, 5, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: LayerFunction.apply(par, x, *p), (x, *par.parameters()))

    def ref(x, p):
        a = torch.tanh(F.linear(x, p[0], p[1]))
        b = torch.relu(F.linear(x, p[2]))
        gw, uw, dw, gb, ub, db = p[3:]
        c = F.linear(F.silu(F.linear(x, gw, gb)) * F.linear(x, uw, ub), dw, db)
        return torch.cat([a, b, c], dim=-1)

    _check_against(par, ref, torch.randn(4, 5, dtype=DT))
    assert par(torch.randn(2, 5, dtype=DT)).shape == (2, 3 + 4 + 5)


@pytest.mark.parametrize("combine", ["add", "avg"])
def test_parallel_add_avg_matches_autograd(combine):
    par = Parallel([Dense(5, 3, "tanh", dtype=DT), Dense(5, 3, "sigmoid", dtype=DT), Dense(5, 3, dtype=DT)], combine)
    x = torch.randn(3, 5, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *p: LayerFunction.apply(par, x, *p), (x, *par.parameters()))

    def ref(x, p):
        s = torch.tanh(F.linear(x, p[0], p[1])) + torch.sigmoid(F.linear(x, p[2], p[3])) + F.linear(x, p[4], p[5])
        return s / 3 if combine == "avg" else s

    _check_against(par, ref, torch.randn(3, 5, dtype=DT))


def test_parallel_concat_on_sequences_with_attention():
    """Branches on [B, S, d]: attention and a Dense, concatenated per time step."""
    mha = MultiHeadAttention(4, 2, dtype=DT)
    dense = Dense(4, 3, "tanh", dtype=DT)
    par = Parallel([mha, dense])
    x = torch.randn(2, 5, 4, dtype=DT)
    with torch.no_grad():
        ya, _ = mha.forward_saved(x)
    y = par(x)
    assert y.shape == (2, 5, 7)
    assert_close(y[..., :4], ya, name="attention part", rtol=0, atol=0)
    xr = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, *p: LayerFunction.apply(par, x, *p), (xr, *par.parameters()))


def test_shared_branch_gets_the_summed_gradient():
    """The same layer twice: parameters() lists its weights once, their gradient is the sum over
    both uses (what autograd gives)."""
    d = Dense(4, 3, "tanh", dtype=DT)
    par = Parallel([d, d], combine="concat")
    assert len(tuple(par.parameters())) == 2
    _check_against(par, lambda x, p: torch.cat([torch.tanh(F.linear(x, p[0], p[1]))] * 2, dim=-1), torch.randn(3, 4, dtype=DT))


def test_nested_containers():
    inner = Parallel([Dense(4, 4, "tanh", dtype=DT), Residual(Dense(4, 4, "relu", dtype=DT))], combine="avg")
    net = Residual(inner)

    def ref(x, p):
        a = torch.tanh(F.linear(x, p[0], p[1]))
        b = x + torch.relu(F.linear(x, p[2], p[3]))
        return x + (a + b) / 2

    _check_against(net, ref, torch.randn(5, 4, dtype=DT))


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        (([],), {}, ValueError, "branches must hold at least one layer, got an empty sequence"),
        ((Dense(2, 2),), {}, TypeError, "branches must be a list or tuple of torchloom layers, got Dense"),
        (([Dense(2, 2), torch.nn.ReLU()],), {}, TypeError, r"branches\[1\] must be a torchloom layer .* got ReLU"),
        (([Dense(2, 2)],), {"combine": "mul"}, ValueError, r"combine must be one of \('concat', 'add', 'avg'\), got 'mul'"),
    ],
)
def test_parallel_bad_constructor_args(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        Parallel(*args, **kwargs)


def test_parallel_bad_branch_shapes():
    with pytest.raises(ValueError, match=r"combine='add'\): branch outputs must have one shape, got \[\[3, 2\], \[3, 4\]\]"):
        Parallel([Dense(5, 2), Dense(5, 4)], combine="add")(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"must agree on all but the last dimension, got \[\[3, 4, 2\], \[3, 16\]\]"):
        Parallel([Dense(4, 2), _Flatten()])(torch.randn(3, 4, 4))
    # Dense rejects the wrong width itself, naming expected and received shapes:
    with pytest.raises(ValueError, match=r"\[batch, \.\.\., 5\], got \[3, 6\]"):
        Parallel([Dense(5, 2)])(torch.randn(3, 6))


# ====================================================================================== both, in nets
@pytest.mark.parametrize("make", [
    lambda: Residual(Dense(6, 6, "tanh")),
    lambda: Parallel([Dense(6, 2, "tanh"), Dense(6, 3)]),
    lambda: Parallel([Dense(6, 3, "tanh"), Dense(6, 3)], combine="avg"),
], ids=["residual", "parallel-concat", "parallel-avg"])
def test_batch_independence(make):
    layer = make()
    x = torch.randn(4, 6)
    x2 = x.clone()
    x2[0] = torch.randn(6) * 3
    y, y2 = layer(x), layer(x2)
    assert not torch.equal(y[0], y2[0])
    assert torch.equal(y[1:], y2[1:])
    xr = x.clone().requires_grad_()
    layer(xr)[1:].sum().backward()
    assert torch.count_nonzero(xr.grad[0]) == 0


def test_inside_network_with_history():
    """Dense → Residual(Dense) → Parallel(concat) → Dense in Loom mode: the containers record no
    pre-activation and the hand-written backward equals autograd."""
    net = Network(
        Dense(3, 6, "tanh", dtype=DT),
        Residual(Dense(6, 6, "relu", dtype=DT)),
        Parallel([Dense(6, 2, "sigmoid", dtype=DT), Dense(6, 3, dtype=DT)]),
        Dense(5, 2, dtype=DT),
        record_history=True,
    )
    x = torch.randn(7, 3, dtype=DT)
    y = net(x)
    assert net.history[1].pre is None and net.history[2].pre is None
    g = torch.randn_like(y)
    gx = net.backward(g, input_grad=True)
    got = [p.grad.clone() for p in net.parameters()]
    p = [t.detach().clone().requires_grad_() for t in net.parameters()]
    xr = x.clone().requires_grad_()
    h = torch.tanh(F.linear(xr, p[0], p[1]))
    h = h + torch.relu(F.linear(h, p[2], p[3]))
    h = torch.cat([torch.sigmoid(F.linear(h, p[4], p[5])), F.linear(h, p[6], p[7])], dim=-1)
    y_ref = F.linear(h, p[8], p[9])
    assert_close(y, y_ref, name="output", rtol=1e-12, atol=1e-12)
    ref = torch.autograd.grad(y_ref, [xr, *p], g)
    assert_close(gx, ref[0], name="grad input", rtol=1e-11, atol=1e-12)
    for i, (a, r) in enumerate(zip(got, ref[1:])):
        assert_close(a, r, name=f"param {i}", rtol=1e-11, atol=1e-12)


def test_reset_parameters_reaches_the_children():
    par = Parallel([Dense(4, 3), Residual(RMSNorm(4))])
    with torch.no_grad():
        for q in par.parameters():
            q.fill_(7.0)
    par.reset_parameters()
    assert torch.count_nonzero(par.branches[0].bias) == 0
    assert torch.equal(par.branches[1].inner.weight, torch.ones(4))
    assert "combine='concat'" in repr(par)


def _batches(device, n=128, batch=32):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=g)
    y = torch.stack([x[:, 0] * x[:, 1], torch.tanh(x[:, 2]) + 0.3 * x[:, 0]], dim=1)
    return [(x[i : i + batch].to(device), y[i : i + batch].to(device)) for i in range(0, n, batch)]


def _train_container_net(device):
    torch.manual_seed(0)
    net = Network(
        Dense(3, 12, "tanh"),
        Residual(Dense(12, 12, "tanh")),
        Parallel([Dense(12, 6, "relu"), Dense(12, 6, "tanh")]),
        Dense(12, 2),
    ).to(device)
    res = train(net, _batches(device), TrainingConfig(epochs=20, learning_rate=0.05, optimizer="momentum", verbose=False))
    return res.loss_history[0], res.final_loss


def test_train_reduces_loss():
    first, last = _train_container_net("cpu")
    assert last < 0.5 * first, (first, last)


@pytest.mark.cuda
def test_cuda_trains():
    first, last = _train_container_net("cuda")
    assert last < 0.5 * first, (first, last)
