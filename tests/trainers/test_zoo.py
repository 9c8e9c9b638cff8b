"""The credit-assignment zoo: feedback alignment, DFA, sign symmetry and Welvet's FastProxy, and the
alignment diagnostics every method gets (``TrainingConfig(alignment_every=N)``).

* each rule: two SGD steps equal an independent float64 reference written from its paper's equations
  (Lillicrap et al. 2016; Nøkland 2016; Liao et al. 2016; Welvet's FastProxy as its Go source reads,
  with Welvet's flattened ``projectGap`` written out here), not from the code under test;
* the feedback is seeded, checkpointed and restored exactly on resume (also under another seed);
* the device step (the engine's runner on CPU tensors) equals the host step; bf16-mixed trains;
* layers a rule is not defined on are refused, naming the layer; bad settings name the field;
* alignment diagnostics: backprop measures 0°, a rule's angle equals the angle between the reference
  rule's gradient and torch autograd's, a rule with its own update measures its applied change; the
  values reach the history, the CSV and the epoch line; measuring changes nothing in the run.
"""

from __future__ import annotations

import copy
import csv
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchloom import (
    CSVLogger,
    Checkpoint,
    Conv2D,
    Dense,
    DFAConfig,
    FastProxyConfig,
    FeedbackAlignmentConfig,
    Flatten,
    Network,
    SignSymmetryConfig,
    TrainingConfig,
    TweenConfig,
    train,
)
from torchloom.engine.cuda_path import CudaRunner
from torchloom.engine.train import make_trainer
from torchloom.methods.fast_proxy import block_average_matrix

F64 = torch.float64
RULES = {
    "feedback_alignment": FeedbackAlignmentConfig(seed=3),
    "dfa": DFAConfig(seed=5),
    "sign_symmetry": SignSymmetryConfig(),
    "sign_symmetry_unit": SignSymmetryConfig(scale="unit"),
    "fast_proxy": FastProxyConfig(),
}


def _net(dtype=F64, seed=0):
    """5 → 9 (tanh) → 4 (sigmoid) → 3 (tanh): hidden widths that differ from each other and from the
    head's input (FastProxy projects 4 → 9 and 4 → 4), a head with an activation."""
    torch.manual_seed(seed)
    return Network(Dense(5, 9, "tanh", dtype=dtype), Dense(9, 4, "sigmoid", dtype=dtype), Dense(4, 3, "tanh", dtype=dtype))


def _batches(n=2, bs=6, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 5, generator=g, dtype=dtype), torch.rand(bs, 3, generator=g, dtype=dtype)) for _ in range(n)]


def _cfg(rule, **kw):
    return TrainingConfig(**{"method": copy.deepcopy(RULES[rule]), "loss_type": "mse", "epochs": 1, "verbose": 0, **kw})


# ------------------------------------------------------------------ references from the papers
def welvet_project_gap(src: torch.Tensor, width: int) -> torch.Tensor:
    """Welvet's ``projectGap``: the flattened ``[batch · m]`` source block-averaged to ``batch · width``."""
    flat = src.reshape(-1)
    sn, dn = flat.numel(), src.shape[0] * width
    out = torch.empty(dn, dtype=src.dtype)
    for i in range(dn):
        lo, hi = i * sn // dn, (i + 1) * sn // dn
        hi = min(max(hi, lo + 1), sn)
        out[i] = flat[lo:hi].mean()
    return out.reshape(src.shape[0], width)


def _forward(ws, bs, x):
    """The 5-9-4-3 net by hand: pre-activations z and activations a (a[0] = x)."""
    acts = (torch.tanh, torch.sigmoid, torch.tanh)
    a, z = [x], []
    for w, b, f in zip(ws, bs, acts):
        z.append(a[-1] @ w.T + b)
        a.append(f(z[-1]))
    return z, a


def _derivs(z):
    s = torch.sigmoid(z[1])
    return [1 - torch.tanh(z[0]) ** 2, s * (1 - s), 1 - torch.tanh(z[2]) ** 2]


def reference_grads(rule, ws, bs, x, t, feedback):
    """The rule's weight and bias gradients from its paper's equations, float64."""
    z, a = _forward(ws, bs, x)
    d = _derivs(z)
    gy = 2 * (a[3] - t) / a[3].numel()  # ∂ mean((a−t)²) / ∂a
    delta = [None, None, gy * d[2]]  # every rule: the head's own error
    if rule == "feedback_alignment":  # δ_l = (δ_{l+1} B_{l+1}) ⊙ f'(z_l)
        delta[1] = (delta[2] @ feedback[1]) * d[1]
        delta[0] = (delta[1] @ feedback[0]) * d[0]
    elif rule.startswith("sign_symmetry"):  # B = s · sign(W)
        unit = rule.endswith("unit")
        sb = [torch.sign(w) * (1.0 if unit else w.abs().mean()) for w in ws]
        delta[1] = (delta[2] @ sb[2]) * d[1]
        delta[0] = (delta[1] @ sb[1]) * d[0]
    elif rule == "dfa":  # δ_l = (e B_l) ⊙ f'(z_l), e the output layer's error
        e = delta[2]
        delta[0] = (e @ feedback[0]) * d[0]
        delta[1] = (e @ feedback[1]) * d[1]
    elif rule == "fast_proxy":  # g_proxy = W_headᵀ g_y, no act'; projected, 1/H each; f'(z_l) at the layer
        proxy = gy @ ws[2]
        delta[0] = welvet_project_gap(proxy, 9) / 2 * d[0]
        delta[1] = welvet_project_gap(proxy, 4) / 2 * d[1]
    return [dl.T @ al for dl, al in zip(delta, a)], [dl.sum(0) for dl in delta]


def _method_of(rule, net):
    """The rule bound to ``net`` (to read its seeded feedback, as the run draws it)."""
    return make_trainer(net, _cfg(rule)).method


@pytest.mark.parametrize("rule", list(RULES))
def test_two_sgd_steps_equal_the_papers_equations(rule):
    net, data = _net(), _batches()
    before = copy.deepcopy(net)
    method = _method_of(rule, copy.deepcopy(net))
    fb = [b.clone() for b in getattr(method, "feedback", [])]
    train(net, data, _cfg(rule, learning_rate=0.3))
    ws = [l.weight.detach().clone() for l in before.layers]
    bs = [l.bias.detach().clone() for l in before.layers]
    for x, t in data:
        gw, gb = reference_grads(rule, ws, bs, x, t, fb)
        ws = [w - 0.3 * g for w, g in zip(ws, gw)]
        bs = [b - 0.3 * g for b, g in zip(bs, gb)]
    for layer, w, b in zip(net.layers, ws, bs):
        torch.testing.assert_close(layer.weight.detach(), w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.bias.detach(), b, rtol=1e-12, atol=1e-12)
    exact = copy.deepcopy(before)  # and it is not backprop: the first layer moves elsewhere
    train(exact, data, TrainingConfig(loss_type="mse", learning_rate=0.3, epochs=1, verbose=0))
    assert not torch.allclose(exact.layers[0].weight, net.layers[0].weight, atol=1e-6)


def test_fast_proxy_projection_is_welvets_project_gap():
    g = torch.Generator().manual_seed(0)
    for m, n in [(4, 9), (9, 4), (10, 4), (7, 3), (3, 7), (256, 100), (6, 6)]:
        v = torch.randn(5, m, generator=g, dtype=F64)
        torch.testing.assert_close(v @ block_average_matrix(m, n, F64), welvet_project_gap(v, n), rtol=1e-14, atol=1e-14)


def test_feedback_is_seeded_and_scaled():
    a, b = _method_of("dfa", _net()), _method_of("dfa", _net(seed=9))
    assert all(torch.equal(p, q) for p, q in zip(a.feedback, b.feedback))  # the rule's seed, not the model's
    assert [tuple(f.shape) for f in a.feedback] == [(3, 9), (3, 4)]
    other = make_trainer(_net(), _cfg("dfa", method=DFAConfig(seed=6))).method
    assert not torch.equal(a.feedback[0], other.feedback[0])
    torch.manual_seed(0)
    big = Network(Dense(400, 300, "relu"), Dense(300, 200, "relu"), Dense(200, 10))
    fa = make_trainer(big, TrainingConfig(method=FeedbackAlignmentConfig(scale=2.0), verbose=0)).method
    assert [tuple(f.shape) for f in fa.feedback] == [(200, 300), (10, 200)]
    assert float(fa.feedback[0].std()) == pytest.approx(2.0 * math.sqrt(2 / 300), rel=0.02)
    assert fa.feedback[0].dtype == torch.float32


@pytest.mark.parametrize("rule", ["feedback_alignment", "dfa", "sign_symmetry", "fast_proxy"])
def test_resume_is_exact_and_restores_the_feedback(rule, tmp_path):
    data = _batches(n=4)

    def cfg(**kw):
        return _cfg(rule, optimizer="momentum", learning_rate=0.2, batch_size=3, shuffle=True, seed=2, **kw)

    xy = (torch.cat([x for x, _ in data]), torch.cat([t for _, t in data]))
    whole = _net()
    result = train(whole, xy, cfg(epochs=4))
    path = tmp_path / "ck.pt"
    train(_net(), xy, cfg(epochs=2, observers=[Checkpoint(path, save_best_only=False)]))
    state = torch.load(path, weights_only=True)
    assert state["method"] == rule
    assert ("feedback" in state["training"]) == (rule in ("feedback_alignment", "dfa"))
    resumed = _net()
    kw = {}
    if rule in ("feedback_alignment", "dfa"):  # another seed: the checkpoint's feedback is what counts
        kw["method"] = type(RULES[rule])(seed=77)
    again = train(resumed, xy, cfg(epochs=4, resume_from=path, **kw))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    assert again.loss_history == result.loss_history


@pytest.mark.parametrize("rule", ["feedback_alignment", "dfa", "sign_symmetry", "fast_proxy"])
def test_device_step_equals_host_step(rule):
    """The engine's device runner on CPU tensors (every decision in tensors, no host read): the rule's
    own backward runs inside backprop's device step."""
    data = _batches(n=3)
    cfg = _cfg(rule, optimizer="momentum", learning_rate=0.2, epochs=2, gradient_clip=0.5)
    host, dev = _net(), _net()
    rh = train(host, data, cfg)
    trainer = make_trainer(dev, copy.deepcopy(cfg))
    trainer._runner = CudaRunner(trainer)
    rd = trainer.fit(data, cfg.epochs)
    np.testing.assert_allclose(rd.loss_history, rh.loss_history, rtol=1e-6)
    for p, q in zip(dev.parameters(), host.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", ["feedback_alignment", "dfa", "sign_symmetry", "fast_proxy"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_like_float32(rule, precision):
    """float32 master weights; float16 with loss scaling (its first step overflows the initial scale
    and is skipped, as backprop's: the scale halves)."""
    data = _batches(n=4, bs=16, dtype=torch.float32)
    a, b = _net(torch.float32), _net(torch.float32)
    ra = train(a, data, _cfg(rule, learning_rate=0.5, epochs=6))
    rb = train(b, data, _cfg(rule, learning_rate=0.5, epochs=6, precision=precision))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in b.parameters())
    assert rb.loss_history[-1] < rb.loss_history[0]
    assert rb.loss_history[-1] == pytest.approx(ra.loss_history[-1], abs=0.01)


def test_by_name_alias_and_config():
    for spec, cls in [("dfa", "DFA"), ("feedback_alignment", "FeedbackAlignment"), ("fa", "FeedbackAlignment"),
                      ("usf", "SignSymmetry"), ("fast-proxy", "FastProxy"), (DFAConfig(seed=1), "DFA"),
                      (FastProxyConfig(scale=0.5), "FastProxy")]:
        assert TrainingConfig(method=spec).method_spec()[0].__name__ == cls
    with pytest.raises(ValueError, match="own momentum rule"):
        TrainingConfig(method="tween", optimizer="adamw")  # (the rules take any optimizer:)
    TrainingConfig(method="dfa", optimizer="adamw", learning_rate=1e-3)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match=r"^FeedbackAlignmentConfig: scale must be a finite number > 0, got 0$"):
        FeedbackAlignmentConfig(scale=0)
    with pytest.raises(TypeError, match=r"^DFAConfig: seed must be an int, got 1.5$"):
        DFAConfig(seed=1.5)
    with pytest.raises(ValueError, match=r"^SignSymmetryConfig: scale must be 'mean_abs', 'unit' or a finite number > 0, got 'big'$"):
        SignSymmetryConfig(scale="big")
    with pytest.raises(ValueError, match=r"^FastProxyConfig: scale must be None \(1/number of hidden layers\) or a finite number > 0, got -1$"):
        FastProxyConfig(scale=-1)
    with pytest.raises(ValueError, match=r"^TrainingConfig: alignment_every must be an int >= 0 .*got -1$"):
        TrainingConfig(alignment_every=-1)
    TrainingConfig(alignment_every=5, cuda_graph=True)  # measured on the device path too (test_zoo_device.py)


def test_layers_a_rule_is_not_defined_on_are_refused():
    torch.manual_seed(0)
    conv = Network(Conv2D(1, 2, 3, dtype=F64), Flatten(), Dense(8, 3, dtype=F64))
    data = [(torch.randn(4, 1, 4, 4, dtype=F64), torch.rand(4, 3, dtype=F64))]
    before = copy.deepcopy(conv)
    for rule in ("feedback_alignment", "dfa", "sign_symmetry", "fast_proxy"):
        chain = "a chain of Dense layers" if rule in ("dfa", "fast_proxy") else "Dense layers \\(layers without parameters pass the error on\\)"
        with pytest.raises(ValueError, match=rf"^{rule}: layer 0 \(Conv2D\) is not a Dense layer; the rule is defined for {chain} only"):
            train(conv, data, _cfg(rule))
        assert all(torch.equal(p, q) for p, q in zip(conv.parameters(), before.parameters()))
    shared = Dense(5, 5, "tanh", dtype=F64)
    twice = Network(shared, shared, Dense(5, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"^sign_symmetry: the model uses a layer or parameter at more than one place"):
        train(twice, _batches(n=1), _cfg("sign_symmetry"))
    flat = Network(Flatten(), Dense(16, 6, "relu", dtype=F64), Dense(6, 3, dtype=F64))
    train(flat, data, _cfg("feedback_alignment"))  # a layer without parameters passes the error on
    with pytest.raises(ValueError, match=r"^dfa: layer 0 \(Flatten\) is not a Dense layer; the rule is defined for a chain"):
        train(flat, data, _cfg("dfa"))


# ------------------------------------------------------------------------- alignment diagnostics
def _autograd_grads(net, x, t):
    """The exact gradient by torch autograd on a copy (independent of the hand-written backward)."""
    ref = copy.deepcopy(net)
    z, a = _forward([l.weight for l in ref.layers], [l.bias for l in ref.layers], x)
    F.mse_loss(a[3], t).backward()
    return [(l.weight.grad, l.bias.grad) for l in ref.layers]


def _angle(u, v):
    u, v = torch.cat([p.reshape(-1) for p in u]), torch.cat([p.reshape(-1) for p in v])
    return math.degrees(math.acos(max(-1.0, min(1.0, float(u @ v / (u.norm() * v.norm()))))))


@pytest.mark.parametrize("rule", ["feedback_alignment", "dfa", "fast_proxy", "backprop"])
def test_alignment_of_a_rule_is_the_angle_to_autograds_gradient(rule):
    net, data = _net(), _batches(n=1)
    before = copy.deepcopy(net)
    fb = [b.clone() for b in getattr(_method_of(rule, copy.deepcopy(net)), "feedback", [])] if rule != "backprop" else []
    cfg = TrainingConfig(method=rule if rule == "backprop" else copy.deepcopy(RULES[rule]), loss_type="mse",
                         epochs=1, verbose=0, alignment_every=1)
    r = train(net, data, cfg)
    x, t = data[0]
    exact = _autograd_grads(before, x, t)
    if rule == "backprop":
        for i in range(3):
            assert r.history[f"alignment_bp/{i}"][0] == pytest.approx(0.0, abs=1e-5)
        return
    gw, gb = reference_grads(rule, [l.weight.detach() for l in before.layers], [l.bias.detach() for l in before.layers], x, t, fb)
    for i in range(3):
        want = _angle((gw[i], gb[i]), exact[i])
        assert r.history[f"alignment_bp/{i}"][0] == pytest.approx(want, abs=1e-6)
    assert r.history["alignment_bp/0"][0] > 1.0  # a lower layer's rule is not backprop


def test_alignment_of_a_rule_with_its_own_update_is_its_applied_change():
    net, data = _net(), _batches(n=1)
    before = copy.deepcopy(net)
    r = train(net, data, TrainingConfig(method=TweenConfig(base_rate=0.05, gap_threshold=0.0), loss_type="mse", epochs=1,
                                        verbose=0, alignment_every=1))
    x, t = data[0]
    exact = _autograd_grads(before, x, t)
    for i, (b, a) in enumerate(zip(before.layers, net.layers)):
        change = (b.weight.detach() - a.weight.detach(), b.bias.detach() - a.bias.detach())
        assert r.history[f"alignment_bp/{i}"][0] == pytest.approx(_angle(change, exact[i]), abs=1e-6)


def test_alignment_every_n_logs_everywhere_and_changes_nothing(tmp_path, capsys):
    data = _batches(n=5)
    plain, probed = _net(), _net()
    rp = train(plain, data, _cfg("dfa", epochs=3, optimizer="momentum", learning_rate=0.1))
    path = tmp_path / "log.csv"
    rq = train(probed, data, _cfg("dfa", epochs=3, optimizer="momentum", learning_rate=0.1, alignment_every=11, verbose=2,
                                  observers=[CSVLogger(path)]))
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), probed.parameters()))
    assert rp.loss_history == rq.loss_history
    # steps 0 and 11 are measured (epochs 1 and 3), none in epoch 2 (steps 5-9): NaN, never a made-up value
    values = rq.history["alignment_bp/0"]
    assert math.isfinite(values[0]) and math.isnan(values[1]) and math.isfinite(values[2])
    assert rq.history["alignment_bp/2"][0] == pytest.approx(0.0, abs=1e-5)  # the head: its exact gradient
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert {"alignment_bp/0", "alignment_bp/1", "alignment_bp/2"} <= set(rows[0])
    assert float(rows[0]["alignment_bp/0"]) == pytest.approx(values[0], rel=1e-4)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Epoch ")]
    assert len(lines) == 3 and "| alignment_bp/0: " in lines[0]


def test_measuring_leaves_dropout_and_batchnorm_as_they_were():
    """A plain module with random numbers (Dropout) and running statistics (BatchNorm) in the chain:
    a measured run equals an unmeasured one, bit for bit."""

    def net():
        torch.manual_seed(0)
        return Network(Dense(5, 8, "relu", dtype=F64), torch.nn.Dropout(0.3), torch.nn.BatchNorm1d(8, dtype=F64), Dense(8, 3, dtype=F64))

    data = _batches(n=4)
    a, b = net(), net()
    ra = train(a, data, TrainingConfig(loss_type="mse", epochs=2, verbose=0, seed=1))
    rb = train(b, data, TrainingConfig(loss_type="mse", epochs=2, verbose=0, seed=1, alignment_every=1))
    assert ra.loss_history == rb.loss_history
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert set(rb.history.keys()) >= {"alignment_bp/0", "alignment_bp/3"} and "alignment_bp/2" in rb.history.keys()
