"""TargetProp (SPEC §8): exact values on a hand-sized network, the SGD property against autograd,
pure-mode estimates against the formula, bad input, and digits.

The references here are written independently of torchloom: plain Python float arithmetic for the
hand-sized network (``_reference_step``), plain torch autograd in float64 for the SGD property.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.lstm import LSTM
from torchloom.layers.network import Network
from torchloom.layers.rnn import RNN, LastStep
from torchloom.engine.types import StepStatus
from torchloom import TargetPropTrainer
from torchloom.methods.target_prop import (
    TargetPropConfig,
    TargetPropState,
    apply_target_prop_gaps,
    target_prop_backward,
    target_prop_forward,
)

F64 = torch.float64

# ------------------------------------------------------------------------------------------------
# A 2-layer network small enough to follow by hand: Dense(2→2, tanh, bias) → Dense(2→1, linear, bias),
# a batch of two rows.

W0 = [[0.1, -0.2], [0.3, 0.4]]
B0 = [0.05, -0.1]
W1 = [[0.5, -0.6]]
B1 = [0.2]
X = [[1.0, -2.0], [0.5, 1.5]]
T = [[0.7], [-0.3]]


def _hand_net() -> Network:
    net = Network(Dense(2, 2, "tanh", dtype=F64), Dense(2, 1, "linear", dtype=F64))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor(W0, dtype=F64))
        net[0].bias.copy_(torch.tensor(B0, dtype=F64))
        net[1].weight.copy_(torch.tensor(W1, dtype=F64))
        net[1].bias.copy_(torch.tensor(B1, dtype=F64))
    return net


def _params_of(net: Network) -> dict:
    return {
        "W0": net[0].weight.tolist(), "b0": net[0].bias.tolist(),
        "W1": net[1].weight.tolist(), "b1": net[1].bias.tolist(),
    }


def _zeros_like(params: dict) -> dict:
    return {k: [[0.0] * len(r) for r in v] if isinstance(v[0], list) else [0.0] * len(v) for k, v in params.items()}


def _cos_budget(f: list[float], b: list[float]) -> float:
    dot = sum(p * q for p, q in zip(f, b))
    nf = math.sqrt(sum(p * p for p in f))
    nb = math.sqrt(sum(q * q for q in b))
    return (dot / (nf * nb) + 1) / 2


def _rms(f: list[float], b: list[float]) -> float:
    return math.sqrt(sum((p - q) ** 2 for p, q in zip(f, b)) / len(f))


def _flat(m):
    return [v for row in m for v in row]


def _reference_step(p: dict, vel: dict, x, t, *, chain: bool, lr, scale=0.1, factor=1.1, mu=0.9, gate=0.2):
    """One TargetProp step of the hand-sized network in plain Python floats, straight from SPEC §8.

    Returns (new params, new velocities, intermediates)."""
    W0, b0, W1, b1 = p["W0"], p["b0"], p["W1"], p["b1"]
    nb = len(x)
    # forward
    a1 = [[math.tanh(W0[o][0] * r[0] + W0[o][1] * r[1] + b0[o]) for o in range(2)] for r in x]
    y = [[W1[0][0] * h[0] + W1[0][1] * h[1] + b1[0]] for h in a1]
    targets = {2: t}
    if chain:
        g2 = [[t[b][0] - y[b][0]] for b in range(nb)]
        # layer 1 (linear): parameter gradient and input gradient
        d = {"W1": [[sum(g2[b][0] * a1[b][o] for b in range(nb)) for o in range(2)]], "b1": [sum(g2[b][0] for b in range(nb))]}
        g1 = [[g2[b][0] * W1[0][o] for o in range(2)] for b in range(nb)]
        # layer 0 (tanh): through f'(pre) = 1 − a²
        gp = [[g1[b][o] * (1 - a1[b][o] ** 2) for o in range(2)] for b in range(nb)]
        d["W0"] = [[sum(gp[b][o] * x[b][j] for b in range(nb)) for j in range(2)] for o in range(2)]
        d["b0"] = [sum(gp[b][o] for b in range(nb)) for o in range(2)]
        g0 = [[sum(gp[b][o] * W0[o][j] for o in range(2)) for j in range(2)] for b in range(nb)]
        targets[1] = [[a1[b][o] + scale * g1[b][o] for o in range(2)] for b in range(nb)]
        targets[0] = [[x[b][j] + scale * g0[b][j] for j in range(2)] for b in range(nb)]
    else:
        gap1 = [[t[b][0] - y[b][0]] for b in range(nb)]
        d = {"W1": [[sum(gap1[b][0] * a1[b][o] for b in range(nb)) for o in range(2)]], "b1": [sum(gap1[b][0] for b in range(nb))]}
        # estimate through W1 [1, 2]: est[b, j] = W1[0][j]·t[b][0] / |W1[0][j]|
        targets[1] = [[W1[0][j] * t[b][0] / abs(W1[0][j]) if abs(W1[0][j]) > 0.01 else 0.0 for j in range(2)] for b in range(nb)]
        gap0 = [[targets[1][b][o] - a1[b][o] for o in range(2)] for b in range(nb)]
        d["W0"] = [[sum(gap0[b][o] * x[b][j] for b in range(nb)) for j in range(2)] for o in range(2)]
        d["b0"] = [sum(gap0[b][o] for b in range(nb)) for o in range(2)]
        den = [abs(W0[0][j]) + abs(W0[1][j]) for j in range(2)]
        targets[0] = [[(W0[0][j] * targets[1][b][0] + W0[1][j] * targets[1][b][1]) / den[j] if den[j] > 0.01 else 0.0 for j in range(2)] for b in range(nb)]
    budgets = [_cos_budget(_flat(a1), _flat(targets[1])), _cos_budget(_flat(y), _flat(t))]
    gaps = [_rms(_flat(a1), _flat(targets[1])), _rms(_flat(y), _flat(t))]
    rates = [lr * (0.5 + 0.5 * budgets[i]) * factor**i for i in range(2)]
    new_p, new_v = copy.deepcopy(p), copy.deepcopy(vel)
    for i, names in ((0, ("W0", "b0")), (1, ("W1", "b1"))):
        if budgets[i] < gate:
            continue
        for name in names:
            if isinstance(p[name][0], list):
                for r in range(len(p[name])):
                    for c in range(len(p[name][0])):
                        new_v[name][r][c] = mu * vel[name][r][c] + (1 - mu) * rates[i] * d[name][r][c]
                        new_p[name][r][c] = p[name][r][c] + new_v[name][r][c]
            else:
                for r in range(len(p[name])):
                    new_v[name][r] = mu * vel[name][r] + (1 - mu) * rates[i] * d[name][r]
                    new_p[name][r] = p[name][r] + new_v[name][r]
    info = {"a1": a1, "y": y, "targets": targets, "budgets": budgets, "gaps": gaps, "rates": rates, "directions": d}
    return new_p, new_v, info


def _run_functional(net, state, x, t, lr):
    target_prop_forward(net, state, torch.tensor(x, dtype=F64))
    target_prop_backward(net, state, torch.tensor(t, dtype=F64))
    state.calculate_link_budgets()
    return apply_target_prop_gaps(net, state, lr)


def _assert_params(net, p, rtol=1e-12):
    for name, got in (("W0", net[0].weight), ("b0", net[0].bias), ("W1", net[1].weight), ("b1", net[1].bias)):
        assert_close(got, torch.tensor(p[name], dtype=F64), name=name, rtol=rtol, atol=1e-15)


@pytest.mark.parametrize("chain", [True, False], ids=["chain_rule", "pure"])
def test_hand_sized_network_targets_budgets_gaps_rates_and_two_momentum_steps(chain):
    net = _hand_net()
    cfg = TargetPropConfig(reduction="sum", use_chain_rule=chain, learning_rate=0.3, pure_targets="loom")  # the hand reference follows Loom's estimate
    state = TargetPropState(net, cfg)
    p, vel = _params_of(net), _zeros_like(_params_of(net))
    for step in range(2):  # the second step sees the momentum of the first
        p, vel, ref = _reference_step(p, vel, X, T, chain=chain, lr=0.3)
        skipped = _run_functional(net, state, X, T, 0.3)
        assert skipped == []
        for i in (0, 1, 2):
            assert_close(state.backward_targets[i], torch.tensor(ref["targets"][i], dtype=F64), name=f"step {step} target {i}", rtol=1e-12, atol=1e-15)
        assert_close(state.forward_acts[1], torch.tensor(ref["a1"], dtype=F64), name="a1", rtol=1e-12, atol=0)
        assert state.link_budgets == pytest.approx(ref["budgets"], rel=1e-12)
        assert state.gaps == pytest.approx(ref["gaps"], rel=1e-12)
        for name, got in (("W0", state.weight_gradients[0][0]), ("b0", state.weight_gradients[0][1]),
                          ("W1", state.weight_gradients[1][0]), ("b1", state.weight_gradients[1][1])):
            assert_close(got, torch.tensor(ref["directions"][name], dtype=F64), name=f"direction {name}", rtol=1e-12, atol=1e-15)
        _assert_params(net, p)
        assert_close(state.velocities[0][0], torch.tensor(vel["W0"], dtype=F64), name="velocity W0", rtol=1e-12, atol=1e-16)
        assert_close(state.velocities[1][1], torch.tensor(vel["b1"], dtype=F64), name="velocity b1", rtol=1e-12, atol=1e-16)
    # the rates really differ per layer (budget and depth): the test would notice a missing factor
    assert ref["rates"][1] != pytest.approx(ref["rates"][0], rel=1e-3)
    if chain:  # the chain-rule gradients at the output are t − y
        assert_close(state.gradients[2], torch.tensor(T, dtype=F64) - state.forward_acts[2], name="g_L", rtol=0, atol=0)


def test_rate_is_lr_times_half_plus_half_budget_times_depth_factor_power():
    """Budgets set by hand, momentum 0: each layer moves by exactly rate_i · direction."""
    net = _hand_net()
    cfg = TargetPropConfig(reduction="sum", learning_rate=0.2, momentum=0.0, depth_scale_factor=1.7, gate_threshold=0.2)
    state = TargetPropState(net, cfg)
    target_prop_forward(net, state, torch.tensor(X, dtype=F64))
    target_prop_backward(net, state, torch.tensor(T, dtype=F64))
    state.link_budgets = [0.25, 0.9]
    before = [p.detach().clone() for p in net.parameters()]
    apply_target_prop_gaps(net, state, 0.2)
    rates = [0.2 * (0.5 + 0.5 * 0.25) * 1.7**0, 0.2 * (0.5 + 0.5 * 0.9) * 1.7**1]
    for k, (p, b) in enumerate(zip(net.parameters(), before)):
        layer = k // 2
        d = state.weight_gradients[layer][k % 2]
        assert_close(p - b, rates[layer] * d, name=f"param {k}", rtol=1e-12, atol=1e-16)


def test_gate_leaves_a_layer_with_budget_below_threshold_untouched():
    net = _hand_net()
    with torch.no_grad():
        y = net(torch.tensor(X, dtype=F64))
    t = (-2.0 * y).tolist()  # the target points away from the output: cos = −1, budget 0
    cfg = TargetPropConfig(reduction="sum", learning_rate=0.3)
    state = TargetPropState(net, cfg)
    p = _params_of(net)
    new_p, _, ref = _reference_step(p, _zeros_like(p), X, t, chain=True, lr=0.3)
    assert ref["budgets"][1] < 0.2 <= ref["budgets"][0]
    skipped = _run_functional(net, state, X, t, 0.3)
    assert skipped == [1] and state.skipped_layers == [1]
    assert state.link_budgets[1] == pytest.approx(0.0, abs=1e-12)
    assert torch.equal(net[1].weight, torch.tensor(W1, dtype=F64)) and torch.equal(net[1].bias, torch.tensor(B1, dtype=F64))
    assert state.velocities[1] is None  # its momentum is untouched too
    _assert_params(net, new_p)  # layer 0 moved exactly as the reference says
    assert not torch.equal(net[0].weight, torch.tensor(W0, dtype=F64))
    # without the gate the same layer does move
    net2 = _hand_net()
    state2 = TargetPropState(net2, TargetPropConfig(reduction="sum", learning_rate=0.3, gate_threshold=0.0))
    assert _run_functional(net2, state2, X, t, 0.3) == []
    assert not torch.equal(net2[1].weight, torch.tensor(W1, dtype=F64))


def test_budgets_start_at_zero_so_an_update_without_budgets_is_gated():
    """Loom's state starts with budgets 0; apply without calculate_link_budgets skips every layer."""
    net = _hand_net()
    state = TargetPropState(net)
    assert state.link_budgets == [0.0, 0.0]
    target_prop_forward(net, state, torch.tensor(X, dtype=F64))
    target_prop_backward(net, state, torch.tensor(T, dtype=F64))
    assert apply_target_prop_gaps(net, state) == [0, 1]
    _assert_params(net, {"W0": W0, "b0": B0, "W1": W1, "b1": B1}, rtol=0)


# ------------------------------------------------------------------------------------------------
# The SPEC's property: chain rule, momentum 0, gate 0, factor 1, budgets 1 == SGD on ½Σ(y−t)²


def _sgd_reference(net, forward, batches, lr):
    """Plain torch autograd SGD on ½Σ(y−t)² (float64), the independent reference."""
    ref = copy.deepcopy(net)
    params = list(ref.parameters())
    for x, t in batches:
        loss = 0.5 * ((forward(ref, x) - t) ** 2).sum()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
    return ref


def _sgd_property(net, batches, lr):
    cfg = TargetPropConfig(reduction="sum", momentum=0.0, gate_threshold=0.0, depth_scale_factor=1.0, learning_rate=lr)
    state = TargetPropState(net, cfg)
    for x, t in batches:
        target_prop_forward(net, state, x)
        target_prop_backward(net, state, t)
        state.calculate_link_budgets()
        state.link_budgets = [1.0] * len(state.link_budgets)
        apply_target_prop_gaps(net, state, lr)


def _mlp(device="cpu"):
    return Network(
        Dense(3, 5, "tanh", dtype=F64, device=device),
        Dense(5, 4, "sigmoid", dtype=F64, device=device),
        Dense(4, 2, "linear", dtype=F64, device=device),
    )


def _mlp_forward(net, x):
    h = torch.tanh(F.linear(x, net[0].weight, net[0].bias))
    h = torch.sigmoid(F.linear(h, net[1].weight, net[1].bias))
    return F.linear(h, net[2].weight, net[2].bias)


def _check_sgd_property(device):
    net = _mlp(device)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 3, generator=g, dtype=F64).to(device), torch.randn(6, 2, generator=g, dtype=F64).to(device)) for _ in range(4)]
    initial = net[0].weight.detach().clone()
    ref = _sgd_reference(net, _mlp_forward, batches, lr=0.05)
    _sgd_property(net, batches, lr=0.05)
    for k, (p, r) in enumerate(zip(net.parameters(), ref.parameters())):
        assert p.device == r.device
        assert_close(p, r, name=f"param {k}", rtol=1e-10, atol=1e-14)
    assert (net[0].weight - initial).abs().max() > 1e-3  # the weights really moved


def test_chain_rule_with_neutral_settings_is_exactly_sgd_on_half_squared_error():
    _check_sgd_property("cpu")


def test_sgd_property_holds_through_an_rnn_and_laststep():
    """Any Network of torchloom layers: the chain rule goes through RNN's hand-written BPTT."""
    net = Network(RNN(3, 4, dtype=F64), LastStep(), Dense(4, 2, "tanh", dtype=F64))

    def forward(m, x):
        rnn = m[0]
        h = torch.zeros(x.shape[0], 4, dtype=F64)
        for s in range(x.shape[1]):
            h = torch.tanh(x[:, s] @ rnn.weight_ih.T + h @ rnn.weight_hh.T + rnn.bias)
        return torch.tanh(F.linear(h, m[2].weight, m[2].bias))

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(5, 6, 3, generator=g, dtype=F64), torch.rand(5, 2, generator=g, dtype=F64)) for _ in range(3)]
    ref = _sgd_reference(net, forward, batches, lr=0.1)
    _sgd_property(net, batches, lr=0.1)
    for k, (p, r) in enumerate(zip(net.parameters(), ref.parameters())):
        assert_close(p, r, name=f"param {k}", rtol=1e-10, atol=1e-14)


@pytest.mark.cuda
def test_sgd_property_on_cuda():
    _check_sgd_property("cuda")


# ------------------------------------------------------------------------------------------------
# Pure mode: weight-based estimates, every batch row, [out, in] indexing


def _estimate_loops(W: list[list[float]], t: list[list[float]]) -> list[list[float]]:
    """est[b][j] = Σ_o W[o][j]·t[b][o] / Σ_o |W[o][j]| if that sum > 0.01 else 0, in loops."""
    n_out, n_in = len(W), len(W[0])
    out = []
    for row in t:
        est = []
        for j in range(n_in):
            den = sum(abs(W[o][j]) for o in range(n_out))
            est.append(sum(W[o][j] * row[o] for o in range(n_out)) / den if den > 0.01 else 0.0)
        out.append(est)
    return out


def test_pure_mode_dense_estimate_matches_the_formula_for_every_row_non_square():
    net = Network(Dense(5, 3, "tanh", dtype=F64), Dense(3, 4, "sigmoid", dtype=F64), Dense(4, 2, dtype=F64))
    with torch.no_grad():
        net[1].weight[:, 2] = torch.tensor([0.002, -0.003, 0.001, 0.002], dtype=F64)  # Σ|W| = 0.008: no target
    state = TargetPropState(net, TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom"))
    x = torch.randn(4, 5, dtype=F64)
    t = torch.randn(4, 2, dtype=F64)
    target_prop_forward(net, state, x)
    target_prop_backward(net, state, t)
    expected = {3: t.tolist()}
    for i in (2, 1, 0):
        expected[i] = _estimate_loops(net[i].weight.tolist(), expected[i + 1])
        assert_close(state.backward_targets[i], torch.tensor(expected[i], dtype=F64), name=f"target {i}", rtol=1e-12, atol=1e-15)
    assert all(row[2] == 0.0 for row in expected[1])  # the weakly connected unit got target 0
    assert len({tuple(r) for r in expected[0]}) == 4  # rows really differ: every sample is used
    # update directions: gapᵀ x summed over the batch (no f'), bias Σ gap
    for i in range(3):
        gap = state.backward_targets[i + 1] - state.forward_acts[i + 1]
        assert_close(state.weight_gradients[i][0], gap.T @ state.forward_acts[i], name=f"dW {i}", rtol=1e-12, atol=1e-15)
        assert_close(state.weight_gradients[i][1], gap.sum(0), name=f"db {i}", rtol=1e-12, atol=1e-15)
    assert state.gradients == [None] * 4  # pure mode takes no derivatives


def test_pure_mode_difference_targets_match_the_formula_for_every_row():
    """The default ``pure_targets="difference"`` (difference target propagation): each input target is
    the activation plus the estimate of the gap above, ``t_i = a_i + est(t_{i+1} − a_{i+1})``, written
    out in loops from that formula (not from the code under test); a layer without an estimate passes
    no gap down."""
    net = Network(Dense(5, 3, "tanh", dtype=F64), Dense(3, 4, "relu", dtype=F64), Dense(4, 2, dtype=F64))
    with torch.no_grad():
        net[1].weight[:, 2] = torch.tensor([0.002, -0.003, 0.001, 0.002], dtype=F64)  # Σ|W| = 0.008: no estimate
    cfg = TargetPropConfig(reduction="sum", mode="pure")
    assert cfg.pure_targets == "difference"
    state = TargetPropState(net, cfg)
    x = torch.randn(4, 5, dtype=F64)
    t = torch.randn(4, 2, dtype=F64)
    target_prop_forward(net, state, x)
    target_prop_backward(net, state, t)
    acts = [a.tolist() for a in state.forward_acts]
    expected = {3: t.tolist()}
    for i in (2, 1, 0):
        gap_above = [[tv - av for tv, av in zip(tr, ar)] for tr, ar in zip(expected[i + 1], acts[i + 1])]
        est = _estimate_loops(net[i].weight.tolist(), gap_above)
        expected[i] = [[a + e for a, e in zip(ar, er)] for ar, er in zip(acts[i], est)]
        assert_close(state.backward_targets[i], torch.tensor(expected[i], dtype=F64), name=f"target {i}", rtol=1e-12, atol=1e-14)
    assert all(r[2] == a[2] for r, a in zip(expected[1], acts[1]))  # the weakly connected unit: no gap
    for i in range(3):  # the delta rule on the gaps (no f')
        gap = state.backward_targets[i + 1] - state.forward_acts[i + 1]
        assert_close(state.weight_gradients[i][0], gap.T @ state.forward_acts[i], name=f"dW {i}", rtol=1e-12, atol=1e-14)
    # a layer whose output meets its target passes no gap down
    target_prop_backward(net, state, state.forward_acts[3].clone())
    for i in range(3):
        assert_close(state.backward_targets[i], state.forward_acts[i], name=f"no gap {i}", rtol=0, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["cross_entropy", "mse"])
def test_pure_mode_under_bf16_autocast_forms_targets_and_directions_in_float32(loss_type):
    """Under ``torch.autocast`` to bfloat16 (``precision="bf16-mixed"``) the activations are bfloat16;
    pure mode's targets, gaps and update directions are formed from them in float32 (a target ``a + gap``
    rounded to 8 bits would lose the gap): against float64 loops of the formulas, from the same bf16
    activations and the float32 weights, to float32 rounding (bf16 arithmetic misses by ~1e-2)."""
    torch.manual_seed(3)
    net = Network(Dense(6, 8, "relu"), Dense(8, 7, "relu"), Dense(7, 4))
    x, labels = torch.randn(9, 6) * 3, torch.randint(0, 4, (9,))
    state = TargetPropState(net, TargetPropConfig(mode="pure", loss_type=loss_type))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        target_prop_forward(net, state, x)
        target_prop_backward(net, state, labels)
    assert state.forward_acts[3].dtype == torch.bfloat16  # the forward really ran in bf16
    acts = [a.double().tolist() for a in state.forward_acts]
    out = acts[3]
    if loss_type == "cross_entropy":  # t_L = y + onehot − softmax(y)
        soft = [[math.exp(v - max(r)) / sum(math.exp(u - max(r)) for u in r) for v in r] for r in out]
        t_top = [[y + (k == int(c)) - p for k, (y, p) in enumerate(zip(r, sr))] for r, sr, c in zip(out, soft, labels)]
    else:
        t_top = [[float(k == int(c)) for k in range(4)] for c in labels]
    expected = {3: t_top}
    for i in (2, 1, 0):
        gap = [[tv - av for tv, av in zip(tr, ar)] for tr, ar in zip(expected[i + 1], acts[i + 1])]
        dw = [[sum(gap[b][o] * acts[i][b][j] for b in range(9)) for j in range(len(acts[i][0]))] for o in range(len(gap[0]))]
        assert_close(state.weight_gradients[i][0], torch.tensor(dw), name=f"dW {i}", rtol=1e-5, atol=1e-5)
        assert_close(state.weight_gradients[i][1], torch.tensor([sum(c) for c in zip(*gap)]), name=f"db {i}", rtol=1e-5, atol=1e-5)
        est = _estimate_loops(net[i].weight.double().tolist(), gap)
        expected[i] = [[a + e for a, e in zip(ar, er)] for ar, er in zip(acts[i], est)]
        assert state.backward_targets[i].dtype == torch.float32
        assert_close(state.backward_targets[i].double(), torch.tensor(expected[i], dtype=F64), name=f"target {i}", rtol=1e-5, atol=1e-6)


def test_pure_mode_trains_under_bf16_mixed_as_in_float32_at_a_small_batch():
    """The regression of bench/RESULTS.md §7 run D (pure mode at batch 32 lost 13 points under
    bf16-mixed): at batch 8 on a small task the bf16-mixed run's losses follow the float32 run's to
    within the bf16 forward's rounding (before the fix they drifted far apart)."""
    from torchloom import TrainingConfig, train

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(1)
    losses = {}
    for precision in ("32", "bf16-mixed"):
        torch.manual_seed(0)
        net = Network(Dense(20, 32, "relu"), Dense(32, 32, "relu"), Dense(32, 4))
        cfg = TrainingConfig(method=TargetPropConfig(mode="pure", learning_rate=0.05), loss_type="cross_entropy", epochs=3,
                             batch_size=8, precision=precision, verbose=0)
        losses[precision] = train(net, (x, y), cfg).loss_history
    assert losses["32"][-1] < 0.6 * losses["32"][0]  # it learns
    for a, b in zip(losses["bf16-mixed"], losses["32"]):
        assert abs(a - b) <= 0.01 * b, (losses["bf16-mixed"], losses["32"])


def test_pure_targets_is_checked():
    with pytest.raises(ValueError, match=r"TargetPropConfig: pure_targets must be one of 'difference', 'loom' .* got 'absolute'"):
        TargetPropConfig(mode="pure", pure_targets="absolute")


def test_pure_mode_rnn_and_lstm_estimates_per_time_step():
    rnn, lstm = RNN(3, 4, dtype=F64), LSTM(4, 2, dtype=F64)
    net = Network(rnn, lstm)
    state = TargetPropState(net, TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom"))
    x = torch.randn(2, 5, 3, dtype=F64)
    t = torch.randn(2, 5, 2, dtype=F64)
    target_prop_forward(net, state, x)
    target_prop_backward(net, state, t)
    # LSTM: the four gate blocks of weight_ih [4H, I] summed, numerator and denominator
    w = lstm.weight_ih.tolist()
    H, I = 2, 4
    exp1 = torch.zeros(2, 5, I, dtype=F64)
    for b in range(2):
        for s in range(5):
            for j in range(I):
                num = sum(w[g * H + h][j] * t[b, s, h].item() for g in range(4) for h in range(H))
                den = sum(abs(w[g * H + h][j]) for g in range(4) for h in range(H))
                exp1[b, s, j] = num / den if den > 0.01 else 0.0
    assert_close(state.backward_targets[1], exp1, name="LSTM input target", rtol=1e-12, atol=1e-15)
    # RNN: weight_ih [H, I] per time step
    exp0 = torch.tensor([_estimate_loops(rnn.weight_ih.tolist(), exp1[b].tolist()) for b in range(2)], dtype=F64)
    assert_close(state.backward_targets[0], exp0, name="RNN input target", rtol=1e-12, atol=1e-15)


def test_pure_mode_attention_estimate_goes_back_through_o_then_v_with_grouped_heads():
    from torchloom.layers.attention import MultiHeadAttention

    d, H, K, D = 8, 4, 2, 2  # 4 query heads share 2 kv heads: query head h reads kv head h // 2
    mha = MultiHeadAttention(d, H, num_kv_heads=K, dtype=F64)
    net = Network(mha)
    state = TargetPropState(net, TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom"))
    x, t = torch.randn(2, 3, d, dtype=F64), torch.randn(2, 3, d, dtype=F64)
    target_prop_forward(net, state, x)
    target_prop_backward(net, state, t)
    wo, wv = mha.o_weight.tolist(), mha.v_weight.tolist()
    expected = torch.zeros(2, 3, d, dtype=F64)
    for b in range(2):
        for s in range(3):
            context = _estimate_loops(wo, [t[b, s].tolist()])[0]  # through o_weight [d, d]
            for j in range(d):
                rows = [((h // (H // K)) * D + e, h * D + e) for h in range(H) for e in range(D)]
                num = sum(wv[r][j] * context[c] for r, c in rows)
                den = sum(abs(wv[r][j]) for r, _ in rows)
                expected[b, s, j] = num / den if den > 0.01 else 0.0
    assert_close(state.backward_targets[0], expected, name="MHA input target", rtol=1e-12, atol=1e-15)


def test_pure_mode_update_of_a_recurrent_layer_is_its_local_loss_gradient():
    """Documented choice: non-Dense layers follow −∇ of ½‖t − a‖² through their own backward only."""
    rnn = RNN(3, 4, dtype=F64)
    net = Network(rnn, Dense(4, 2, dtype=F64))
    state = TargetPropState(net, TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom"))
    x, t = torch.randn(2, 5, 3, dtype=F64), torch.randn(2, 5, 2, dtype=F64)
    target_prop_forward(net, state, x)
    target_prop_backward(net, state, t)
    target = state.backward_targets[1].clone()
    ref = copy.deepcopy(rnn)
    params = list(ref.parameters())
    h = torch.zeros(2, 4, dtype=F64)
    outs = []
    for s in range(5):
        h = torch.tanh(x[:, s] @ ref.weight_ih.T + h @ ref.weight_hh.T + ref.bias)
        outs.append(h)
    local = 0.5 * ((torch.stack(outs, 1) - target) ** 2).sum()
    grads = torch.autograd.grad(local, params)
    for k, (d, g) in enumerate(zip(state.weight_gradients[0], grads)):
        assert_close(d, -g, name=f"RNN direction {k}", rtol=1e-10, atol=1e-14)


def test_layers_without_an_estimate_pass_their_input_through():
    net = Network(RNN(3, 4, dtype=F64), LastStep(), Dense(4, 2, dtype=F64))  # LastStep: no weights
    state = TargetPropState(net, TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom"))
    x = torch.randn(2, 3, 3, dtype=F64)
    target_prop_forward(net, state, x)
    target_prop_backward(net, state, torch.randn(2, 2, dtype=F64))
    assert torch.equal(state.backward_targets[1], state.forward_acts[1])
    assert state.weight_gradients[1] == ()


# ------------------------------------------------------------------------------------------------
# Trainer


def test_trainer_step_equals_the_four_functional_calls_and_accepts_labels():
    net_a, net_b = _hand_net(), _hand_net()
    cfg = TargetPropConfig(reduction="sum", learning_rate=0.3)
    trainer = TargetPropTrainer(net_a, cfg)
    labels = torch.tensor([0, 0])
    x = torch.tensor(X, dtype=F64)
    out = trainer.step(x, labels)
    state = TargetPropState(net_b, TargetPropConfig(reduction="sum", learning_rate=0.3))
    y = target_prop_forward(net_b, state, x)
    target_prop_backward(net_b, state, torch.ones(2, 1, dtype=F64))  # one-hot of label 0 with width 1
    state.calculate_link_budgets()
    apply_target_prop_gaps(net_b, state, 0.3)
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
    assert out.status is StepStatus.OK
    assert out.loss == pytest.approx(((y - 1.0) ** 2).mean().item(), rel=1e-12)
    assert out.logs["accuracy"] == 1.0  # argmax of a width-1 output is always class 0
    assert out.logs["mean_link_budget"] == pytest.approx(sum(state.link_budgets) / 2, rel=1e-12)
    assert out.logs["mean_gap"] == pytest.approx(sum(state.gaps) / 2, rel=1e-12)
    assert out.logs["skipped_layers"] == 0.0


def test_fit_history_has_loss_accuracy_budget_gap_and_skipped_layers():
    torch.manual_seed(3)
    net = Network(Dense(4, 8, "tanh"), Dense(8, 3))
    x = torch.randn(24, 4)
    labels = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    data = [(x[i : i + 8], labels[i : i + 8]) for i in range(0, 24, 8)]
    result = TargetPropTrainer(net, TargetPropConfig(reduction="sum", learning_rate=0.05)).fit(data, 40)
    h = result.history
    for key in ("loss", "accuracy", "mean_link_budget", "mean_gap", "skipped_layers"):
        assert len(h[key]) == 40, key
    assert h["loss"][-1] < 0.5 * h["loss"][0]
    assert h["accuracy"][-1] > h["accuracy"][0]
    assert all(0.0 <= b <= 1.0 for b in h["mean_link_budget"])
    # float targets of the output's shape: no accuracy is logged
    one_hot = [(a, F.one_hot(b, 3).float()) for a, b in data]
    r2 = TargetPropTrainer(Network(Dense(4, 8, "tanh"), Dense(8, 3)), TargetPropConfig(reduction="sum")).fit(one_hot, 2)
    assert "accuracy" not in r2.history and "mean_gap" in r2.history


def test_labels_and_their_one_hot_targets_train_identically():
    torch.manual_seed(4)
    net_a = Network(Dense(4, 6, "tanh"), Dense(6, 3))
    net_b = copy.deepcopy(net_a)
    x, labels = torch.randn(10, 4), torch.randint(0, 3, (10,))
    TargetPropTrainer(net_a).fit([(x, labels)], 3)
    TargetPropTrainer(net_b).fit([(x, F.one_hot(labels, 3).float())], 3)
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)


def test_nan_input_skips_the_step_and_leaves_weights_alone():
    net = _hand_net()
    before = [p.clone() for p in net.parameters()]
    trainer = TargetPropTrainer(net, TargetPropConfig(reduction="sum"))
    bad = torch.tensor([[float("nan"), 1.0], [0.0, 1.0]], dtype=F64)
    assert trainer.step(bad, torch.tensor(T, dtype=F64)).status is StepStatus.NAN_LOSS
    result = trainer.fit([(bad, torch.tensor(T, dtype=F64))], 2)
    assert result.skipped_batches == 2
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b)


def test_per_layer_observer_events_carry_outputs_and_loss_gradients():
    class Recorder:
        def __init__(self):
            self.events = []

        def on_layer_forward(self, event):
            self.events.append(("forward", event.index, event.tensor.clone()))

        def on_layer_backward(self, event):
            self.events.append(("backward", event.index, event.tensor.clone()))

    net = _hand_net()
    ref = copy.deepcopy(net)
    rec = Recorder()
    TargetPropTrainer(net, TargetPropConfig(reduction="sum"), observers=[rec]).fit([(torch.tensor(X, dtype=F64), torch.tensor(T, dtype=F64))], 1)
    assert [(k, i) for k, i, _ in rec.events] == [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]
    # against autograd on the untouched copy: outputs, and d(½Σ(y−t)²)/d(input of each layer)
    x = torch.tensor(X, dtype=F64, requires_grad=True)
    h = torch.tanh(F.linear(x, ref[0].weight, ref[0].bias))
    h.retain_grad()
    y = F.linear(h, ref[1].weight, ref[1].bias)
    (0.5 * ((y - torch.tensor(T, dtype=F64)) ** 2).sum()).backward()
    expected = [h, y, h.grad, x.grad]
    for (kind, i, got), want in zip(rec.events, expected):
        assert_close(got, want.detach(), name=f"{kind} event {i}", rtol=1e-12, atol=1e-15)


@pytest.mark.cuda
def test_trainer_on_cuda_matches_cpu():
    torch.manual_seed(5)
    net_cpu = Network(Dense(4, 8, "relu", dtype=F64), Dense(8, 3, "sigmoid", dtype=F64))
    net_gpu = copy.deepcopy(net_cpu).to("cuda")
    x, labels = torch.randn(16, 4, dtype=F64), torch.randint(0, 3, (16,))
    for mode in ("chain_rule", "pure"):
        r_cpu = TargetPropTrainer(net_cpu, TargetPropConfig(reduction="sum", mode=mode)).fit([(x, labels)], 3)
        r_gpu = TargetPropTrainer(net_gpu, TargetPropConfig(reduction="sum", mode=mode)).fit([(x, labels)], 3)  # batches moved to the GPU
        assert r_gpu.loss_history == pytest.approx(r_cpu.loss_history, rel=1e-9)
        for p, q in zip(net_gpu.parameters(), net_cpu.parameters()):
            assert p.is_cuda
            assert_close(p, q, name=f"{mode} param", rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Bad input: ValueError, nothing changes


def _snapshot(net: Network, state: TargetPropState):
    def c(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, (list, tuple)):
            return type(v)(c(e) for e in v)
        return v

    fields = {k: c(v) for k, v in vars(state).items() if k not in ("config", "saved")}
    fields["saved_ids"] = [id(s) for s in state.saved]
    return [p.detach().clone() for p in net.parameters()], fields


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _trained_trainer(mode="chain_rule"):
    net = _hand_net()
    trainer = TargetPropTrainer(net, TargetPropConfig(reduction="sum", mode=mode, learning_rate=0.3))
    trainer.step(torch.tensor(X, dtype=F64), torch.tensor(T, dtype=F64))  # non-trivial state
    return net, trainer


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "backprop"}, "unknown mode 'backprop'"),
        ({"learning_rate": -0.01}, "learning_rate must be a finite number > 0, got -0.01"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"gradient_scale": -0.1}, "gradient_scale"),
        ({"depth_scale_factor": -1.1}, "depth_scale_factor"),
        ({"momentum": 1.0}, "momentum"),
        ({"gate_threshold": 1.5}, "gate_threshold"),
        ({"mode": "chain_rule", "use_chain_rule": False}, "contradicts"),
        ({"mode": "pure", "use_chain_rule": True}, "contradicts"),
    ],
)
def test_bad_config_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TargetPropConfig(reduction="sum", **kwargs)


def test_mode_and_use_chain_rule_are_one_switch():
    assert TargetPropConfig(reduction="sum", mode="pure").use_chain_rule is False
    assert TargetPropConfig(reduction="sum", use_chain_rule=False).mode == "pure"
    assert TargetPropConfig(reduction="sum").mode == "chain_rule"


@pytest.mark.parametrize("mode", ["chain_rule", "pure"])
def test_wrong_target_shape_changes_nothing(mode):
    net, trainer = _trained_trainer(mode)
    before = _snapshot(net, trainer.state)
    x = torch.tensor(X, dtype=F64)
    for bad in (torch.zeros(2, 2, dtype=F64), torch.zeros(3, 1, dtype=F64), torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long).reshape(1, 2)):
        with pytest.raises(ValueError, match="target|class labels"):
            trainer.step(x, bad)
        assert _same(_snapshot(net, trainer.state), before)
    with pytest.raises(ValueError, match=r"target must have the output's shape \[2, 1\], got \[2, 2\]"):
        target_prop_backward(net, trainer.state, torch.zeros(2, 2, dtype=F64))
    assert _same(_snapshot(net, trainer.state), before)


def test_negative_rate_changes_nothing():
    net, trainer = _trained_trainer()
    state = trainer.state
    target_prop_forward(net, state, torch.tensor(X, dtype=F64))
    target_prop_backward(net, state, torch.tensor(T, dtype=F64))
    state.calculate_link_budgets()
    before = _snapshot(net, state)
    for lr in (-0.1, 0.0, float("nan")):
        with pytest.raises(ValueError, match="lr must be a finite number > 0"):
            apply_target_prop_gaps(net, state, lr)
        assert _same(_snapshot(net, state), before)
    state.config.learning_rate = -0.5  # a config changed after construction is checked again
    with pytest.raises(ValueError, match="learning_rate"):
        trainer.step(torch.tensor(X, dtype=F64), torch.tensor(T, dtype=F64))
    assert _same(_snapshot(net, state), before)


def test_unknown_mode_set_later_changes_nothing():
    net, trainer = _trained_trainer()
    before = _snapshot(net, trainer.state)
    trainer.state.config.mode = "sideways"
    x, t = torch.tensor(X, dtype=F64), torch.tensor(T, dtype=F64)
    for call in (lambda: trainer.step(x, t), lambda: target_prop_backward(net, trainer.state, t),
                 lambda: target_prop_forward(net, trainer.state, x), lambda: apply_target_prop_gaps(net, trainer.state, 0.1)):
        with pytest.raises(ValueError, match="unknown mode 'sideways'"):
            call()
        assert _same(_snapshot(net, trainer.state), before)


def test_backward_before_forward_and_model_mismatch_are_errors():
    net = _hand_net()
    state = TargetPropState(net)
    with pytest.raises(RuntimeError, match="target_prop_forward"):
        target_prop_backward(net, state, torch.zeros(2, 1, dtype=F64))
    with pytest.raises(ValueError, match="state was built for 2 layers, the model has 3"):
        target_prop_forward(_mlp(), state, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(TypeError, match="config must be a TargetPropConfig"):
        TargetPropTrainer(net, {"learning_rate": 0.1})


# ------------------------------------------------------------------------------------------------
# Digits (scikit-learn): standardized, fixed stratified split


@pytest.fixture
def one_thread():
    """The digits runs are many tiny matmuls: one thread is faster than two that compete with other
    processes on a busy machine (measured 20 s → 1 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _digits():
    sklearn = pytest.importorskip("sklearn")  # noqa: F841
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X_, y_ = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(X_, y_, test_size=0.25, random_state=0, stratify=y_)
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-8
    xtr = torch.tensor((xtr - mu) / sd, dtype=torch.float32)
    xte = torch.tensor((xte - mu) / sd, dtype=torch.float32)
    ytr, yte = torch.tensor(ytr), torch.tensor(yte)
    batches = [(xtr[i : i + 32], ytr[i : i + 32]) for i in range(0, len(xtr), 32)]
    return batches, xte, yte


def _accuracy(net, x, y):
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def test_digits_chain_rule_reaches_95_percent(one_thread):
    """Measured 95.3–97.1 % over seeds 0–5 (64 tanh units, lr 0.01, 30 epochs, ~1 s)."""
    batches, xte, yte = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 64, "tanh"), Dense(64, 10))
    result = TargetPropTrainer(net, TargetPropConfig(reduction="sum", learning_rate=0.01)).fit(batches, 30)
    assert _accuracy(net, xte, yte) >= 0.95
    assert result.history["skipped_layers"][-1] == 0.0


@pytest.mark.parametrize("rule,lr", [("loom", 0.001), ("difference", 0.01)])
def test_digits_pure_mode_hidden_targets_help(one_thread, rule, lr):
    """Pure mode after 10 epochs (Loom's rule: measured 92.2–93.8 % over seeds 0–5; the difference
    rule 93.6 % on seed 0) against the same network whose hidden layer is held fixed, so only the
    readout learns (85.3–88.9 %): the estimated hidden targets are worth ≥ 3 points. (Against a linear
    classifier see the note at the end.)"""
    batches, xte, yte = _digits()
    accs = []
    for frozen in (False, True):
        torch.manual_seed(0)
        net = Network(Dense(64, 64, "tanh"), Dense(64, 10))
        trainer = TargetPropTrainer(net, TargetPropConfig(reduction="sum", mode="pure", learning_rate=lr, pure_targets=rule))
        hidden = [p.clone() for p in net[0].parameters()]
        for _ in range(10):
            for xb, yb in batches:
                trainer.step(xb, yb)
                if frozen:
                    with torch.no_grad():
                        for p, h in zip(net[0].parameters(), hidden):
                            p.copy_(h)
        accs.append(_accuracy(net, xte, yte))
    assert accs[0] >= 0.90
    assert accs[0] >= accs[1] + 0.03


def test_digits_pure_mode_is_on_par_with_a_linear_classifier(one_thread):
    """Pure mode vs a linear least-squares classifier (torchloom.train, SGD, MSE, lr 0.1 — the best of
    0.03–0.3 — same 10 epochs). Measured over seeds 0–5: pure 92.2–93.8 %, linear 87.8–90.7 %; with
    lr 0.15 the linear one reaches 89.3–92.2 %, tying pure mode on one seed. So only "not worse" is
    asserted; a softmax cross-entropy linear classifier does better (94.7–95.8 %)."""
    from torchloom.engine.train import train

    batches, xte, yte = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 64, "tanh"), Dense(64, 10))
    TargetPropTrainer(net, TargetPropConfig(reduction="sum", mode="pure", pure_targets="loom", learning_rate=0.001)).fit(batches, 10)
    torch.manual_seed(0)
    linear = Network(Dense(64, 10))
    one_hot = [(xb, F.one_hot(yb, 10).float()) for xb, yb in batches]
    train(linear, one_hot, epochs=10, learning_rate=0.1, loss_type="mse", verbose=False)
    assert _accuracy(net, xte, yte) >= _accuracy(linear, xte, yte)
