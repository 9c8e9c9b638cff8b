"""Loom training bugs that torchloom does not reproduce (docs/PARITY.md, "Layers"): torchloom's
gradients against torch autograd in float64 (always run), and Loom's own update against the faulty
rule the PARITY row states (marked ``loom``; skipped without welvet).

* ``Sequential[A, B, Residual]``: Loom adds the Residual's skip gradient to B's *output* gradient
  instead of B's input gradient, so B's weights get ``2·g`` and A gets ``2·J_Bᵀg`` instead of
  ``g + J_Bᵀg``.
* ``Sequential[A, C]`` with ``C`` a nested Sequential or Parallel: Loom takes C's weight-gradient
  container for a Residual's skip gradient and adds C's first child's weight gradient to A's output
  gradient whenever the two happen to have the same length (batch × A's outputs = that child's
  weight count), so A's update depends on the batch size.
* Embedding with an activation: Loom's backward skips the activation's derivative.
"""

from __future__ import annotations

import base64
import ctypes
import json

import numpy as np
import pytest
import torch

from helpers import ACTIVATION_REFERENCE, assert_close
from loom_oracle import _check, _lib, _take_string, welvet
from torchloom import TrainingConfig, train
from torchloom.interop import from_loom_json

loom = [
    pytest.mark.loom,
    pytest.mark.skipif(welvet is None, reason="needs Loom's Python binding welvet (pip install welvet==0.80.0)"),
]
LR = 0.1


def _dense(i, o, act="tanh"):
    return {"type": "dense", "input_height": i, "output_height": o, "activation": act, "dtype": "float32"}


def _cfg(layers):
    return {"id": "t", "depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1,
            "layers": [dict(layer, z=0, y=0, x=i, l=0) for i, layer in enumerate(layers)]}


RESIDUAL = [{"type": "sequential", "sequential_layers": [_dense(6, 5), _dense(5, 5), {"type": "residual"}]}]


def _nested(kind):
    inner = [_dense(5, 4), _dense(4, 3, "sigmoid")] if kind == "Sequential" else [_dense(5, 4), _dense(5, 4, "sigmoid")]
    key = "sequential_layers" if kind == "Sequential" else "parallel_branches"
    extra = {} if kind == "Sequential" else {"combine_mode": "add"}
    return [{"type": "sequential", "sequential_layers": [_dense(6, 5), {"type": kind.lower(), key: inner, **extra}]}]


def _reference_forward(net, x):
    """The imported network's function rewritten in plain torch ops on its (float64) weights, with
    the weights as autograd leaves: ``(output, {name: leaf})``."""
    seq = net[0]
    w = {}

    def leaf(name, p):
        w[name] = p.detach().double().clone().requires_grad_()
        return w[name]

    def dense(layer, name, h):
        return ACTIVATION_REFERENCE[layer.activation.name](h @ leaf(name, layer.weight).T)

    a = dense(seq[0], "A", x)
    second = seq[1]
    if type(second).__name__ == "Residual":
        out = a + dense(second.inner, "B", a)
    elif type(second).__name__ == "Parallel":
        out = dense(second.branches[0], "C", a) + dense(second.branches[1], "D", a)
    else:
        out = dense(second[1], "D", dense(second[0], "C", a))
    return out, w, a


def _data(layers, batch):
    rng = np.random.RandomState(0)
    n_out = 5 if layers is RESIDUAL else (3 if layers[0]["sequential_layers"][1]["type"] == "sequential" else 4)
    return rng.randn(1, batch, 6).astype(np.float32), rng.rand(1, batch, n_out).astype(np.float32)


CASES = {"Residual": (RESIDUAL, 4), "nested Sequential": (_nested("Sequential"), 4),
         "nested Parallel": (_nested("Parallel"), 4)}


@pytest.mark.parametrize("name", list(CASES))
def test_torchloom_step_is_the_exact_gradient(name):
    """One ``train()`` step (MSE, SGD) on the imported network equals ``w − lr·∂L/∂w`` from torch
    autograd in float64, for every weight — at a batch size where Loom's faulty additions apply."""
    layers, batch = CASES[name]
    x, y = _data(layers, batch)
    net = from_loom_json(_cfg(layers), dtype=torch.float64)
    xt, yt = torch.from_numpy(x[0]).double(), torch.from_numpy(y[0]).double()
    out, leaves, _ = _reference_forward(net, xt)
    loss = ((out - yt) ** 2).mean()
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    before = {k: v.detach().clone() for k, v in leaves.items()}
    result = train(net, [(xt, yt)], TrainingConfig(epochs=1, learning_rate=LR, loss_type="mse", verbose=0))
    assert_close(torch.tensor(result.loss_history), loss.detach().reshape(1), name="loss", rtol=1e-7, atol=0)
    _, now, _ = _reference_forward(net, xt)  # leaves of the updated weights
    for k in leaves:
        assert_close(now[k], before[k] - LR * grads[k], name=f"{name}: weight {k}", rtol=0, atol=1e-13)
        assert (grads[k].abs().max() > 1e-4), k  # every weight really moved


# --------------------------------------------------------------------------------- real Loom
def _seeded(saved: str) -> str:
    """Loom's saved JSON with every layer's (time-seeded) weights replaced by seeded N(0, 0.5²)
    float32 values, so that the test is the same on every run."""
    rng = np.random.RandomState(1)
    spec = json.loads(saved)

    def walk(layer):
        if layer.get("weights"):
            n = len(base64.b64decode(layer["weights"])) // 4
            layer["weights"] = base64.b64encode((rng.randn(n) * 0.5).astype("<f4").tobytes()).decode()
        for child in layer.get("sequential_layers") or layer.get("parallel_branches") or []:
            walk(child)

    for layer in spec["layers"]:
        assert layer.get("dtype", "float32") == "float32"
        walk(layer)
    return json.dumps(spec)


def _loom_step(layers, x, y):
    """Loom builds ``layers`` (weights seeded here) and trains one SGD step: the JSON before and after."""
    built = welvet.build_network(_cfg(layers))
    try:
        saved = welvet.serialize_network(built)
    finally:
        welvet.free_network(built)
    handle = welvet.deserialize_network(_seeded(saved))
    try:
        before = welvet.serialize_network(handle)
        cfg = {"Epochs": 1, "LearningRate": LR, "LossType": "mse", "GradientClip": 0.0, "Verbose": False, "UseGPU": False}
        fp = ctypes.POINTER(ctypes.c_float)
        text = _take_string(_lib().LoomTrain(handle, x.ctypes.data_as(fp), x.size, y.ctypes.data_as(fp), y.size,
                                             x.shape[1], int(np.prod(x.shape[2:])), int(np.prod(y.shape[2:])),
                                             json.dumps(cfg).encode()))
        _check(text, "train")
        after = welvet.serialize_network(handle)
    finally:
        welvet.free_network(handle)
    return before, after


def _loom_delta(before, after, pick):
    return (pick(from_loom_json(after, dtype=torch.float64)) - pick(from_loom_json(before, dtype=torch.float64))).detach()


@pytest.mark.parametrize("m", [pytest.param(0, marks=loom)])
def test_loom_residual_in_sequential_gives_the_layer_before_twice_the_jacobian_term(m):
    """PARITY: in ``Sequential[A, B, Residual]`` Loom gives B ``2g`` and A ``2·J_Bᵀg`` (not ``g +
    J_Bᵀg``)."""
    x, y = _data(RESIDUAL, 4)
    before, after = _loom_step(RESIDUAL, x, y)
    net = from_loom_json(before, dtype=torch.float64)
    xt, yt = torch.from_numpy(x[0]).double(), torch.from_numpy(y[0]).double()
    out, w, a = _reference_forward(net, xt)
    loss = ((out - yt) ** 2).mean()
    g = torch.autograd.grad(loss, out, retain_graph=True)[0]
    b = out - a  # B's output
    exact_a = torch.autograd.grad(loss, w["A"], retain_graph=True)[0]
    loom_a = torch.autograd.grad(b, w["A"], 2 * g, retain_graph=True)[0]  # 2·J_Bᵀg, no skip term
    loom_b = torch.autograd.grad(b, w["B"], 2 * g)[0]
    got_a = _loom_delta(before, after, lambda n: n[0][0].weight)
    got_b = _loom_delta(before, after, lambda n: n[0][1].inner.weight)
    assert_close(got_a, -LR * loom_a, name="Loom's A update vs 2·J_Bᵀg", rtol=0, atol=1e-6)
    assert_close(got_b, -LR * loom_b, name="Loom's B update vs 2g", rtol=0, atol=1e-6)
    assert (got_a + LR * exact_a).abs().max() > 1e-3  # measurably not the exact gradient


@pytest.mark.parametrize("kind", [pytest.param(k, marks=loom) for k in ("Sequential", "Parallel")])
@pytest.mark.parametrize("batch", [4, 3])
def test_loom_nested_container_adds_its_first_childs_weight_gradient_when_lengths_match(kind, batch):
    """PARITY: ``Sequential[A(6→5), C]``, C a nested Sequential / Parallel whose first child has 5×4 =
    20 weights: at batch 4 (4×5 = 20 output gradients of A) Loom adds that weight gradient to A's
    output gradient; at batch 3 it does not, and Loom's update is the exact one."""
    layers = _nested(kind)
    x, y = _data(layers, batch)
    before, after = _loom_step(layers, x, y)
    net = from_loom_json(before, dtype=torch.float64)
    xt, yt = torch.from_numpy(x[0]).double(), torch.from_numpy(y[0]).double()
    out, w, a = _reference_forward(net, xt)
    loss = ((out - yt) ** 2).mean()
    g_a = torch.autograd.grad(loss, a, retain_graph=True)[0]
    g_c = torch.autograd.grad(loss, w["C"], retain_graph=True)[0]
    exact = torch.autograd.grad(a, w["A"], g_a, retain_graph=True)[0]
    got = _loom_delta(before, after, lambda n: n[0][0].weight)
    if batch == 4:
        faulty = torch.autograd.grad(a, w["A"], g_a + g_c.reshape(g_a.shape))[0]
        assert_close(got, -LR * faulty, name="Loom's A update vs g + flat(dW_C)", rtol=0, atol=1e-6)
        assert (got + LR * exact).abs().max() > 1e-4, (got + LR * exact).abs().max()
    else:
        assert_close(got, -LR * exact, name="Loom's A update (lengths differ)", rtol=0, atol=1e-6)


@pytest.mark.parametrize("act", [pytest.param(a, marks=loom) for a in ("sigmoid", "tanh")])
def test_loom_embedding_backward_skips_the_activation_derivative(act):
    """PARITY: Loom applies an Embedding's activation forward but trains it as if it were linear;
    torchloom's step is the exact gradient."""
    layers = [{"type": "embedding", "vocab_size": 5, "embedding_dim": 4, "activation": act}]
    rng = np.random.RandomState(0)
    x = rng.randint(0, 5, size=(1, 3, 2)).astype(np.float32)
    y = rng.rand(1, 3, 8).astype(np.float32)
    before, after = _loom_step(layers, x, y)
    net = from_loom_json(before, dtype=torch.float64)
    idx = torch.from_numpy(x[0]).long()
    w = net[0].weight.detach().clone().requires_grad_()
    post = ACTIVATION_REFERENCE[act](w[idx])
    loss = ((post.reshape(3, 8) - torch.from_numpy(y[0]).double()) ** 2).mean()
    g_post, exact = torch.autograd.grad(loss, [post, w], retain_graph=True)
    linear_rule = torch.zeros_like(w).index_add_(0, idx.reshape(-1), g_post.reshape(-1, 4))
    got = _loom_delta(before, after, lambda n: n[0].weight)
    assert_close(got, -LR * linear_rule, name="Loom's Embedding update vs no f'", rtol=0, atol=1e-7)
    assert (got + LR * exact).abs().max() > 1e-5  # tanh' ≈ 0.99 at Loom's small initial weights
    train(net, [(idx, torch.from_numpy(y[0]).double().reshape(3, 2, 4))], TrainingConfig(epochs=1, learning_rate=LR, verbose=0))
    assert_close(net[0].weight.detach() - w.detach(), -LR * exact, name="torchloom's Embedding update", rtol=0, atol=1e-13)
