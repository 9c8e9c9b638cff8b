"""Neural Tweening (SPEC §9) against independent references.

Every expected number is computed here from SPEC §9's formulas with torch autograd in float64 (for
the loss gradients) and plain tensor arithmetic (for targets, gaps, link budgets, alignments, depth
scales, rates, velocities and updates) — never with the code under test.
"""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_close
from torchloom.layers.base import Layer
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network, Sequential
from torchloom.engine.types import StepStatus
from torchloom import TweenConfig, TweenState, TweenTrainer

D = torch.float64
EXACT = dict(rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------- reference
def _tiny_net():
    """3 weighted layers: tanh, sigmoid, linear (float64)."""
    return Network(Dense(3, 4, "tanh", dtype=D), Dense(4, 3, "sigmoid", dtype=D), Dense(3, 2, dtype=D))


def _ref_forward(params, x):
    w1, b1, w2, b2, w3, b3 = params
    a1 = torch.tanh(x @ w1.T + b1)
    a2 = torch.sigmoid(a1 @ w2.T + b2)
    a3 = a2 @ w3.T + b3
    return [x, a1, a2, a3]


def _per_sample_loss(out, target, kind):
    """ℓ_b with the batch loss = mean_b ℓ_b (SPEC §4 mse / softmax cross-entropy)."""
    if kind == "mse":
        return (out - target).pow(2).mean(1)
    return -(target * torch.log_softmax(out, 1)).sum(1)


class RefWatch:
    """The explosion rule written out from its documented formulas (plain Python floats): baseline
    ``exp(min(m + 3s, peak))`` of ``x = log(avg_gap)``; 10 warm-up steps of plain averages; then
    exponential averages over 100 steps, a peak forgetting ln 10 per 1000 steps; explosive steps clip
    the pull at the threshold, move the peak 10 %, and three leaky (0.9) explosions re-anchor."""

    def __init__(self, cfg: TweenConfig):
        self.cfg = cfg
        self.m, self.s, self.peak, self.p, self.k = 0.0, 0.0, -math.inf, 0.0, 0
        self.adaptive = cfg.base_rate

    def step(self, g, base=None):
        cfg, lim = self.cfg, math.log(self.cfg.explosion_limit)
        base = cfg.base_rate if base is None else base
        x = math.log(min(max(g, 1e-30), 1e30))
        level = min(self.m + 3 * self.s, self.peak)
        growth = math.exp(x - level) if self.k > 0 else 1.0
        exploded = False
        if self.k < 10:
            m_new = self.m + (x - self.m) / (self.k + 1)
            self.s += (abs(x - m_new) - self.s) / (self.k + 1)
            self.m, self.peak = m_new, max(self.peak, x)
        else:
            exploded = cfg.explosion_detection and x - level > lim
            d, c = x - self.m, lim + 3 * self.s
            if exploded:
                self.m += min(d, c) / 100
                self.s += (min(abs(d), c) - self.s) / 100
                self.peak += 0.1 * (x - self.peak)
                self.p = 0.9 * self.p + 1
                if self.p >= 3:
                    self.m, self.peak, self.p = x - 3 * self.s, x, 0.0
            else:
                self.m += d / 100
                self.s += (abs(d) - self.s) / 100
                self.peak = max(x, self.peak - math.log(10) / 1000)
                self.p *= 0.9
        self.k += 1
        if not cfg.explosion_detection:
            self.adaptive = base
        elif exploded:
            self.adaptive = min(base, max(self.adaptive * cfg.recovery_rate, 0.01 * base))
        else:
            self.adaptive = min(base, self.adaptive * cfg.recovery_growth)
        baseline = math.exp(min(self.m + 3 * self.s, self.peak))
        return exploded, growth, baseline


class RefTween:
    """SPEC §9 written out for the 3-layer reference network: one object per run, ``step`` per batch."""

    def __init__(self, net, cfg: TweenConfig, kind: str):
        self.params = [p.detach().clone() for p in net.parameters()]
        self.vel = [torch.zeros_like(p) for p in self.params]
        self.cfg, self.kind = cfg, kind
        self.watch = RefWatch(cfg)
        self.prev = None
        self.explosions = 0

    @property
    def adaptive(self):
        return self.watch.adaptive

    def step(self, x, target, out_classes=None):
        cfg = self.cfg
        ps = [p.clone().requires_grad_(True) for p in self.params]
        acts = _ref_forward(ps, x)
        out = acts[-1]
        t = F.one_hot(target, out.shape[1]).to(D) if out_classes else target
        y_hat = torch.softmax(out, 1) if self.kind == "ce" else out
        err = (y_hat - t).pow(2).sum(1).detach()
        mask = (err >= cfg.gap_threshold).to(D)
        per = _per_sample_loss(out, t, "mse" if self.kind == "mse" else "ce")
        loss = per.mean().item()
        objective = (mask * per).sum()
        grads = torch.autograd.grad(objective, [acts[1], acts[2], out, *ps])
        chain = [None, grads[0], grads[1], grads[2]]
        pgrads = grads[3:]
        a = [v.detach() for v in acts]
        targets = [None, a[1] - cfg.gradient_scale * chain[1], a[2] - cfg.gradient_scale * chain[2], t]
        fs = [a[1], a[2], y_hat.detach()]
        rms = lambda v: v.pow(2).mean().sqrt()
        gaps = [(fs[i] - targets[i + 1]).pow(2).mean() for i in range(3)]
        budgets = [rms(a[i + 1]) / rms(a[i]) for i in range(3)]
        aligns = [((fs[i] * targets[i + 1]).sum() / (fs[i].norm() * targets[i + 1].norm()) + 1) / 2 for i in range(3)]
        avg = sum(float(g) for g in gaps) / 3
        exploded, growth, baseline = self.watch.step(avg)
        if exploded:
            self.explosions += 1
            self.vel = [torch.zeros_like(v) for v in self.vel]
        self.prev = avg
        scales = [1 / math.sqrt(3), 1 / math.sqrt(2), 1.0] if cfg.depth_scaling else [1.0, 1.0, 1.0]
        s = cfg.link_budget_scale
        rates = [self.adaptive * (1 - s / 2 + s / 2 * float(aligns[i])) * scales[i] for i in range(3)]
        b = x.shape[0]
        for j in range(6):
            self.vel[j] = cfg.momentum_decay * self.vel[j] - rates[j // 2] * pgrads[j] / b
            self.params[j] = self.params[j] + self.vel[j]
        return dict(loss=loss, chain=chain, targets=targets, gaps=gaps, budgets=budgets, aligns=aligns,
                    rates=rates, mask=mask.bool(), growth=growth, exploded=exploded, avg=avg, baseline=baseline)


def _check_step(state, net, ref, r, step_name):
    for i in range(3):
        assert_close(state.chain_gradients[i + 1], r["chain"][i + 1], name=f"{step_name} chain_gradients[{i + 1}]", **EXACT)
        assert_close(state.backward_targets[i + 1], r["targets"][i + 1], name=f"{step_name} backward_targets[{i + 1}]", **EXACT)
    assert state.backward_targets[0] is None and state.chain_gradients[0] is None
    for name, got, want in (("gaps", state.gaps, r["gaps"]), ("link_budgets", state.link_budgets, r["budgets"]),
                            ("alignments", state.alignments, r["aligns"]), ("layer_rates", state.layer_rates, r["rates"])):
        assert_close(torch.tensor(got, dtype=D), torch.tensor([float(v) for v in want], dtype=D), name=f"{step_name} {name}", **EXACT)
    assert torch.equal(state.active.cpu(), r["mask"]), f"{step_name}: active samples {state.active} != {r['mask']}"
    assert state.gap_growth_rate == pytest.approx(r["growth"], rel=1e-12)
    assert state.gap_baseline == pytest.approx(r["baseline"], rel=1e-12)
    assert state.explosion_count == ref.explosions and state.adaptive_rate == pytest.approx(ref.adaptive, rel=1e-15)
    for j, (p, want) in enumerate(zip(net.parameters(), ref.params)):
        assert_close(p, want, name=f"{step_name} parameter {j}", **EXACT)
    vels = [v for i in range(3) for v in (state.weight_velocity[i][0], state.bias_velocity[i][0])]
    for j, (v, want) in enumerate(zip(vels, ref.vel)):
        assert_close(v, want, name=f"{step_name} velocity {j}", **EXACT)


def _gated_threshold(net, x, target, kind):
    """A gap_threshold strictly between two samples' output errors, so one sample is gated."""
    with torch.no_grad():
        out = net(x)
        t = F.one_hot(target, out.shape[1]).to(D) if kind == "ce" else target
        y_hat = torch.softmax(out, 1) if kind == "ce" else out
        err = (y_hat - t).pow(2).sum(1).sort().values
    return float((err[0] + err[1]) / 2)


# ------------------------------------------------------------------------------ exact values
@pytest.mark.parametrize("kind", ["mse", "ce"])
def test_two_tween_steps_exact_values(kind):
    net = _tiny_net()
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(5, 3, generator=g, dtype=D), torch.randn(5, 3, generator=g, dtype=D)
    if kind == "mse":
        y1, y2 = torch.randn(5, 2, generator=g, dtype=D), torch.randn(5, 2, generator=g, dtype=D)
    else:
        y1, y2 = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([1, 0, 0, 1, 1])
    thr = _gated_threshold(net, x1, y1, kind)
    cfg = TweenConfig(base_rate=0.3, momentum_decay=0.8, link_budget_scale=1.5, gap_threshold=thr,
                      gradient_scale=0.5, explosion_limit=1e6)
    state = TweenState(net, cfg)
    ref = RefTween(net, cfg, kind)

    assert state.depth_scales == pytest.approx([1 / math.sqrt(3), 1 / math.sqrt(2), 1.0], rel=1e-15)
    r1 = ref.step(x1, y1, out_classes=kind == "ce")
    assert 0 < int(r1["mask"].sum()) < 5, "the threshold must gate some but not all samples"
    loss1 = state.tween_step(net, x1, y1, num_classes=2 if kind == "ce" else None)
    assert loss1 == pytest.approx(r1["loss"], rel=1e-12)
    _check_step(state, net, ref, r1, "step 1")
    assert_close(state.forward_acts[0], x1, name="forward_acts[0]", **EXACT)

    r2 = ref.step(x2, y2, out_classes=kind == "ce")  # momentum: v = μ v1 − r G/B
    loss2 = state.tween_step(net, x2, y2)
    assert loss2 == pytest.approx(r2["loss"], rel=1e-12)
    _check_step(state, net, ref, r2, "step 2")
    assert state.loss_history == pytest.approx([r1["loss"], r2["loss"]], rel=1e-12)
    assert state.gap_history == pytest.approx([r1["avg"], r2["avg"]], rel=1e-12)
    assert state.link_budget_history == pytest.approx([sum(float(b) for b in r["budgets"]) / 3 for r in (r1, r2)], rel=1e-12)
    assert state.steps == 2 and state.explosion_count == 0 and state.rate_history == [0.3, 0.3]
    assert state.prev_avg_gap == pytest.approx(r2["avg"], rel=1e-12)


# -------------------------------------------------------------------------------- explosions
def _warm(state, ref, net, x, y, steps):
    for k in range(steps):
        r = ref.step(x, y)
        state.tween_step(net, x, y)
        _check_step(state, net, ref, r, f"warm step {k}")
    return r


def test_explosion_cuts_rate_resets_velocity_and_recovers_to_base_never_above():
    net = _tiny_net()
    cfg = TweenConfig(base_rate=0.05, momentum_decay=0.9, gap_threshold=0.0, explosion_limit=10.0,
                      recovery_rate=0.5, recovery_growth=1.05)
    state = TweenState(net, cfg)
    ref = RefTween(net, cfg, "mse")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, generator=g, dtype=D)
    with torch.no_grad():
        y = net(x) + 0.01 * torch.randn(6, 2, generator=g, dtype=D)  # a small error first
    assert state.gap_baseline == 0.0 and state.gap_growth_rate == 1.0
    r = _warm(state, ref, net, x, y, 12)  # past the 10-step warm-up, no explosion
    assert state.explosion_count == 0 and not r["exploded"] and state.gap_baseline > 0
    assert any(v.abs().sum() > 0 for v in state.weight_velocity[0] + state.bias_velocity[2]), "momentum must be non-zero before the spike"

    y_far = y + 2.0  # the output gap jumps ~10⁴-fold, far more than explosion_limit × baseline
    r = ref.step(x, y_far)
    assert r["exploded"] and r["growth"] > 10
    baseline_before = state.gap_baseline
    state.tween_step(net, x, y_far)
    assert state.explosion_count == 1 and state.explosion_history[-2:] == [0, 1]
    assert state.adaptive_rate == pytest.approx(0.05 * 0.5, rel=1e-15)
    assert state.gap_growth_rate == pytest.approx(state.prev_avg_gap / baseline_before, rel=1e-12)
    assert state.gap_baseline < 2 * baseline_before, "one explosive step must not pull the baseline up at full weight"
    # The reference zeroed every velocity before the update; matching it to 1e-12 (with μ = 0.9 and a
    # non-zero old velocity) shows the state did too.
    _check_step(state, net, ref, r, "explosion step")

    rates = []
    for k in range(25):  # back to ordinary batches (a small error again): no explosion, the rate recovers 5 % per step
        with torch.no_grad():
            y = net(x) + 0.01 * torch.randn(6, 2, generator=g, dtype=D)
        r = ref.step(x, y)
        state.tween_step(net, x, y)
        _check_step(state, net, ref, r, f"recovery step {k}")
        rates.append(state.adaptive_rate)
    assert state.explosion_count == 1
    expected = [min(0.05, 0.025 * 1.05 ** (k + 1)) for k in range(25)]
    assert rates == pytest.approx(expected, rel=1e-12)
    assert max(state.rate_history) <= 0.05 and rates[-1] == 0.05


def test_sustained_new_gap_level_is_absorbed_and_the_rate_floor_holds():
    net = _tiny_net()
    cfg = TweenConfig(base_rate=0.05, gap_threshold=0.0, recovery_rate=0.05)
    state = TweenState(net, cfg)
    ref = RefTween(net, cfg, "mse")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, generator=g, dtype=D)
    with torch.no_grad():
        y = net(x) + 0.01 * torch.randn(6, 2, generator=g, dtype=D)
    _warm(state, ref, net, x, y, 12)
    y_new = y + 3.0  # a new task whose gap stays far above the old level
    losses = []
    for k in range(120):
        r = ref.step(x, y_new)
        losses.append(state.tween_step(net, x, y_new))
        _check_step(state, net, ref, r, f"new level step {k}")
        assert state.adaptive_rate >= 0.01 * 0.05 * (1 - 1e-12), "adaptive_rate fell below its floor of 1 % of base_rate"
    rates = state.rate_history[12:]
    assert min(rates) == pytest.approx(0.01 * 0.05, rel=1e-12), "three cuts of ×0.05 must reach the floor"
    assert 3 <= state.explosion_count <= 6, f"a sustained level must be absorbed after a few explosions, got {state.explosion_count}"
    assert state.explosion_history[-60:] == [state.explosion_count] * 60, "detection kept firing on the new level"
    assert state.adaptive_rate == 0.05, "the rate must recover to base_rate: learning never freezes"
    assert losses[-1] < 0.2 * losses[0], "the new target must be learned"


def test_explosion_detection_off_keeps_rate_and_velocity():
    net = _tiny_net()
    cfg = TweenConfig(base_rate=0.05, gap_threshold=0.0, explosion_detection=False)
    state = TweenState(net, cfg)
    x = torch.randn(4, 3, dtype=D)
    y = torch.zeros(4, 2, dtype=D)
    state.tween_step(net, x, y)
    state.tween_step(net, x, y + 1000.0)
    assert state.gap_growth_rate > 10 and state.explosion_count == 0 and state.adaptive_rate == 0.05


# ------------------------------------------------------------------------ SGD equivalence
SGD_LIKE = dict(depth_scaling=False, link_budget_scale=0.0, gap_threshold=0.0, momentum_decay=0.0)


@pytest.mark.parametrize("kind", ["mse", "ce"])
def test_tween_step_equals_sgd_step(kind):
    net = _tiny_net()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=g, dtype=D)
    y = torch.randn(7, 2, generator=g, dtype=D) if kind == "mse" else torch.randint(0, 2, (7,), generator=g)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    l0, l1, l2 = ref
    out = F.linear(torch.sigmoid(F.linear(torch.tanh(F.linear(x, l0.weight, l0.bias)), l1.weight, l1.bias)), l2.weight, l2.bias)
    loss = F.mse_loss(out, y) if kind == "mse" else F.cross_entropy(out, y)
    loss.backward()
    opt.step()

    state = TweenState(net, TweenConfig(base_rate=0.2, **SGD_LIKE))
    got = state.tween_step(net, x, y)
    assert got == pytest.approx(loss.item(), rel=1e-10)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p, q, name=name, rtol=1e-10, atol=0)


class Gain(Layer):
    """A contract layer written for this test: ``y = x ⊙ gain + bias`` with a hand-written backward."""

    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.rand(n, dtype=D) + 0.5)
        self.bias = nn.Parameter(torch.randn(n, dtype=D) * 0.1)

    def forward_saved(self, x):
        return x * self.gain + self.bias, (x,)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        (x,) = saved
        return (grad_out * self.gain if needs_input_grad else None), ((grad_out * x).sum(0), grad_out.sum(0))


class Square(Layer):
    """A parameter-free contract layer: ``y = x²``."""

    def forward_saved(self, x):
        return x * x, (x,)

    def backward_saved(self, grad_out, saved, needs_input_grad=True):
        return (2 * saved[0] * grad_out if needs_input_grad else None), ()


def test_any_contract_layer_sgd_equivalence_and_depth_scales():
    net = Network(Dense(3, 4, "tanh", dtype=D), Square(), Sequential(Gain(4), Dense(4, 3, dtype=D)))
    ref = copy.deepcopy(net)
    x = torch.randn(6, 3, dtype=D)
    y = torch.tensor([0, 2, 1, 1, 0, 2])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    d0, _, seq = ref
    gain, d1 = seq
    h = torch.tanh(F.linear(x, d0.weight, d0.bias)) ** 2
    out = F.linear(h * gain.gain + gain.bias, d1.weight, d1.bias)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    state = TweenState(net, TweenConfig(base_rate=0.1, **SGD_LIKE))
    assert state.tween_step(net, x, y) == pytest.approx(loss.item(), rel=1e-10)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p, q, name=name, rtol=1e-10, atol=0)
    # velocities: Gain's "bias" and Dense biases go to bias_velocity, "gain" and weights to weight_velocity
    assert [len(v) for v in state.weight_velocity] == [1, 0, 2] and [len(v) for v in state.bias_velocity] == [1, 0, 2]
    # depth scaling counts only the weighted layers (2 here): 1/sqrt(2), none, 1
    assert TweenState(net).depth_scales == pytest.approx([1 / math.sqrt(2), None, 1.0])


# --------------------------------------------------------------------------------- bad input
def _snapshot(net, state):
    return (
        [p.detach().clone() for p in net.parameters()],
        [v.clone() for vs in state.weight_velocity + state.bias_velocity for v in vs],
        copy.deepcopy({k: v for k, v in vars(state).items() if k not in ("weight_velocity", "bias_velocity", "_net")}),
    )


def _assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    sa, sb = a[2], b[2]
    assert sa.keys() == sb.keys()
    for k in sa:
        va, vb = sa[k], sb[k]
        if isinstance(va, list) and va and isinstance(va[0], torch.Tensor):
            assert len(va) == len(vb) and all(torch.equal(p, q) for p, q in zip(va, vb)), k
        elif isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), k
        elif isinstance(va, list):
            assert len(va) == len(vb) and all((p is None and q is None) or (isinstance(p, torch.Tensor) and torch.equal(p, q)) or p == q for p, q in zip(va, vb)), k
        else:
            assert va == vb, k


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(target=torch.zeros(4, 3, dtype=D)), "target shape"),
        (dict(target=torch.zeros(4, dtype=D)), "target shape"),
        (dict(target=torch.tensor([0, 1, 2, 0])), r"class labels must lie in \[0, 2\)"),
        (dict(target=torch.tensor([0, -1, 1, 0])), r"class labels must lie in \[0, 2\)"),
        (dict(target=torch.tensor([[0], [1], [1], [0]])), "class labels must have shape"),
        (dict(rate=0.0), "rate"),
        (dict(rate=-0.1), "rate"),
        (dict(rate=float("nan")), "rate"),
        (dict(num_classes=3, target=torch.tensor([0, 1, 1, 0])), "num_classes=3"),
        (dict(x=torch.randn(4, 5, dtype=D)), r"\[batch, \.\.\., 3\]"),
    ],
)
def test_bad_input_raises_value_error_and_changes_nothing(args, match):
    net = _tiny_net()
    state = TweenState(net, TweenConfig(gap_threshold=0.0))
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    state.tween_step(net, x, y)  # a first step so that velocities and histories are non-trivial
    before = _snapshot(net, state)
    call = dict(x=x, target=y, num_classes=None, rate=None) | args
    with pytest.raises(ValueError, match=match):
        state.tween_step(net, call["x"], call["target"], num_classes=call["num_classes"], rate=call["rate"])
    _assert_same(before, _snapshot(net, state))


@pytest.mark.parametrize(
    "field, value",
    [("base_rate", 0.0), ("base_rate", -1.0), ("momentum_decay", 1.0), ("link_budget_scale", 2.5), ("gap_threshold", -0.1),
     ("explosion_limit", 1.0), ("recovery_rate", 0.0), ("recovery_rate", 1.5), ("recovery_growth", 0.9),
     ("gradient_scale", 0.0), ("loss_type", "hinge")],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        TweenConfig(**{field: value})


def test_model_mismatch_and_no_parameters():
    state = TweenState(_tiny_net())
    with pytest.raises(ValueError, match="does not match"):
        state.tween_step(Network(Dense(3, 2, dtype=D)), torch.randn(2, 3, dtype=D), torch.randn(2, 2, dtype=D))
    with pytest.raises(ValueError, match="no parameters"):
        TweenState(Network(Square()))


def test_nan_loss_changes_nothing():
    net = _tiny_net()
    state = TweenState(net)
    before = _snapshot(net, state)
    x = torch.randn(3, 3, dtype=D)
    x[1, 0] = float("nan")
    out = state.step(net, x, torch.randn(3, 2, dtype=D))
    assert out.status is StepStatus.NAN_LOSS and state.last_status is StepStatus.NAN_LOSS
    after = _snapshot(net, state)
    after[2]["last_status"] = before[2]["last_status"]
    _assert_same(before, after)


# ---------------------------------------------------------------------------------- trainer
def test_trainer_logs_histories_observers_and_online_split():
    net = _tiny_net()
    calls = []

    class Watch:
        def on_batch_end(self, trainer, step, logs):
            calls.append((step, dict(logs)))

    trainer = TweenTrainer(net, TweenConfig(gap_threshold=0.0), observers=[Watch()])
    x, y = torch.randn(10, 3, dtype=D), torch.randn(10, 2, dtype=D)
    result = trainer.fit((x, y), epochs=2)  # online: 10 batches of one sample per epoch
    st = trainer.state
    assert st.steps == 20 and len(st.loss_history) == len(st.gap_history) == len(st.rate_history) == 20
    assert len(calls) == 20 and {"loss", "mean_gap", "mean_link_budget", "explosion", "adaptive_rate"} <= calls[0][1].keys()
    assert result.history["mean_gap"][1] == pytest.approx(sum(st.gap_history[10:]) / 10, rel=1e-12)
    assert result.loss_history[0] == pytest.approx(sum(st.loss_history[:10]) / 10, rel=1e-12)
    batched = TweenTrainer(_tiny_net()).fit((x, y), epochs=1, batch_size=4)
    assert batched.history["loss"] and TweenTrainer(_tiny_net()).state.steps == 0
    with pytest.raises(ValueError, match="batch 0: class labels must lie"):
        TweenTrainer(_tiny_net()).fit([(x, torch.full((10,), 5))], epochs=1)
    with pytest.raises(ValueError, match="batch_size"):
        TweenTrainer(_tiny_net()).fit((x, y), epochs=1, batch_size=0)


def test_trainer_per_layer_events_carry_outputs_and_input_gradients():
    net = _tiny_net()
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    params = [p.detach().clone().requires_grad_(True) for p in net.parameters()]
    acts = _ref_forward(params, x.requires_grad_(True))
    loss = F.mse_loss(acts[-1], y)
    grads_in = torch.autograd.grad(loss, acts[:3])  # the batch loss's gradient at each layer's input
    events = []

    class Watch:
        def on_layer_forward(self, e):
            events.append(("forward", e.index, e.tensor.clone()))

        def on_layer_backward(self, e):
            events.append(("backward", e.index, e.tensor.clone()))

    TweenTrainer(net, TweenConfig(gap_threshold=0.0), observers=[Watch()]).fit([(x.detach(), y)], epochs=1)
    assert [(k, i) for k, i, _ in events] == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 2), ("backward", 1), ("backward", 0)]
    for kind, i, t in events:
        want = acts[i + 1] if kind == "forward" else grads_in[i]
        assert_close(t, want, name=f"{kind} event of layer {i}", **EXACT)


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    return train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)


def test_digits_64_32_10_reaches_95_percent():
    xtr, xte, ytr, yte = _digits()
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    trainer = TweenTrainer(net, TweenConfig(loss_type="cross_entropy"))  # the document's defaults, softmax cross-entropy
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-32-10 steps are too small to gain from threads; on busy cores they cost
    try:
        start = time.perf_counter()
        trainer.fit((xtr, ytr), epochs=16, batch_size=16)  # ~3 s; over seeds 0-7: 96.2-97.1 %
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    acc = (net(xte).argmax(1) == yte).double().mean().item()
    assert acc >= 0.95, f"Tween test accuracy {acc:.4f} < 0.95 after {elapsed:.1f}s"
    assert elapsed < 60, f"the digits run took {elapsed:.1f}s; budget a few seconds"


# ------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_step_matches_cpu():
    cpu = _tiny_net()
    gpu = copy.deepcopy(cpu).cuda()
    x, y = torch.randn(6, 3, dtype=D), torch.tensor([0, 1, 1, 0, 1, 0])
    sc, sg = TweenState(cpu, TweenConfig(gap_threshold=0.05)), TweenState(gpu, TweenConfig(gap_threshold=0.05))
    for _ in range(3):
        lc = sc.tween_step(cpu, x, y)
        lg = sg.tween_step(gpu, x.cuda(), y.cuda())
        assert lg == pytest.approx(lc, rel=1e-6)
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert_close(q, p, name=name, rtol=1e-9, atol=1e-12)
    assert sg.gaps == pytest.approx(sc.gaps, rel=1e-9, abs=1e-15)


@pytest.mark.cuda
def test_cuda_trainer_digits():
    xtr, xte, ytr, yte = _digits()
    net = Network(Dense(64, 32, "relu"), Dense(32, 10)).cuda()
    TweenTrainer(net, TweenConfig(loss_type="cross_entropy")).fit((xtr, ytr), epochs=16, batch_size=16)
    acc = (net(xte.cuda()).argmax(1).cpu() == yte).double().mean().item()
    assert acc >= 0.95
