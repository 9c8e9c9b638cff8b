"""Tweening's explosion rule as one device kernel (interpreter / CUDA) and its torch-ops reference,
against the rule run on Python floats (the host step's form), step by step over gap sequences with
warm-up, spikes, a sustained new level, skipped steps and a changing rate ceiling."""

import math
import random

import pytest
import torch

from torchloom.kernels._triton import triton_available
from torchloom.kernels.explosion_rule import STATE_FIELDS, explosion_rule_, rule_constants
from torchloom.methods.explosion import EXPLOSION_RULE, _FloatOps, _TensorOps
from torchloom.methods.tween import TweenConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if triton_available() else [])


def _gaps(seed: int, n: int = 120) -> list[tuple[float, bool, float]]:
    """``(avg_gap, step ok, rate ceiling)`` per step: log-normal noise, single spikes, a sustained jump
    to a new level, a few skipped steps (found_inf set) and a ceiling that follows a schedule."""
    rng = random.Random(seed)
    out = []
    level = 1e-2
    for k in range(n):
        g = level * math.exp(rng.gauss(0.0, 1.0))
        if k in (30, 55):
            g *= 1e4  # single spikes
        if k == 70:
            level *= 1e3  # a sustained new level
        ok = rng.random() > 0.08
        out.append((g, ok, 0.05 / (1.0 + 0.01 * k)))
    return out


def _float_run(cfg: TweenConfig, seq):
    """The host step's form: the rule on floats, run only on steps whose update is applied."""
    st = dict(adaptive_rate=0.05, explosion_count=0.0, steps=0.0, prev_avg_gap=math.nan, gap_baseline=0.0,
              gap_growth_rate=1.0, gap_log_mean=0.0, gap_log_dev=0.0, gap_log_peak=-math.inf, explosion_pressure=0.0)
    history = []
    for g, ok, base in seq:
        exploded = False
        if ok:
            watch = (st["gap_log_mean"], st["gap_log_dev"], st["gap_log_peak"], st["explosion_pressure"])
            exploded, rate, (m, s, lam, p), baseline, growth = EXPLOSION_RULE(_FloatOps, g, watch, st["adaptive_rate"], st["steps"], base, cfg)
            exploded = bool(exploded)
            st.update(adaptive_rate=rate, explosion_count=st["explosion_count"] + exploded, steps=st["steps"] + 1,
                      prev_avg_gap=g, gap_baseline=baseline, gap_growth_rate=growth, gap_log_mean=m, gap_log_dev=s,
                      gap_log_peak=lam, explosion_pressure=p)
        history.append((exploded, dict(st)))
    return history


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("detection", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_rule_follows_the_float_rule(backend, detection, seed):
    cfg = TweenConfig(explosion_detection=detection)
    seq = _gaps(seed)
    expected = _float_run(cfg, seq)
    assert detection is False or sum(e for e, _ in expected) >= 3, "the sequence must exercise explosions"
    state = torch.tensor([0.05, 0.0, 0.0, math.nan, 0.0, 1.0, 0.0, 0.0, -math.inf, 0.0], dtype=torch.float64, device=DEVICE)
    constants = rule_constants(EXPLOSION_RULE, cfg, DEVICE)
    for k, ((g, ok, base), (want_exploded, want)) in enumerate(zip(seq, expected)):
        gap = torch.tensor(g, dtype=torch.float64, device=DEVICE)
        ceiling = torch.tensor(base, dtype=torch.float64, device=DEVICE)
        found_inf = torch.tensor([0.0 if ok else 1.0], device=DEVICE)
        exploded = explosion_rule_(EXPLOSION_RULE, _TensorOps, cfg, state, constants, gap, ceiling, found_inf, backend=backend)
        assert bool(exploded) == want_exploded, f"step {k}"
        got = dict(zip(STATE_FIELDS, state.tolist()))
        for key in STATE_FIELDS:
            a, b = got[key], want[key]
            if math.isnan(b) or math.isinf(b):
                assert (math.isnan(a) and math.isnan(b)) or a == b, f"step {k} {key}: {a} vs {b}"
            else:
                assert a == pytest.approx(b, rel=1e-12, abs=1e-300), f"step {k} {key}: {a} vs {b}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_step_writes_nothing(backend):
    cfg = TweenConfig()
    state = torch.arange(1.0, 11.0, dtype=torch.float64, device=DEVICE)
    before = state.clone()
    one = torch.tensor(1e6, dtype=torch.float64, device=DEVICE)
    exploded = explosion_rule_(EXPLOSION_RULE, _TensorOps, cfg, state, rule_constants(EXPLOSION_RULE, cfg, DEVICE),
                               one, one, torch.tensor([1.0], device=DEVICE), backend=backend)
    assert not bool(exploded) and torch.equal(state, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_gap_leaves_the_same_state_as_the_float_rule(backend):
    """A NaN mean gap on an applied step (unreachable in training: it comes with a NaN loss or
    gradient, whose step is skipped) still leaves the device and host forms in the same state."""
    cfg = TweenConfig()
    seq = [(g, True, 0.05) for g, _, _ in _gaps(3, 20)]
    seq[15] = (math.nan, True, 0.05)
    expected = _float_run(cfg, seq)
    state = torch.tensor([0.05, 0.0, 0.0, math.nan, 0.0, 1.0, 0.0, 0.0, -math.inf, 0.0], dtype=torch.float64, device=DEVICE)
    constants = rule_constants(EXPLOSION_RULE, cfg, DEVICE)
    for k, (g, _, base) in enumerate(seq):
        t = lambda v: torch.tensor(v, dtype=torch.float64, device=DEVICE)  # noqa: E731
        exploded = explosion_rule_(EXPLOSION_RULE, _TensorOps, cfg, state, constants, t(g), t(base),
                                   torch.tensor([0.0], device=DEVICE), backend=backend)
        want_exploded, want = expected[k]
        assert bool(exploded) == want_exploded
        for key, a in zip(STATE_FIELDS, state.tolist()):
            b = want[key]
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-300), f"step {k} {key}: {a} vs {b}"


def test_constants_follow_their_names():
    cfg = TweenConfig(explosion_limit=7.0, recovery_rate=0.25, recovery_growth=1.5, explosion_detection=False)
    from torchloom.kernels.explosion_rule import _CONSTANTS

    values = dict(zip(_CONSTANTS, rule_constants(EXPLOSION_RULE, cfg, "cpu").tolist()))
    assert values["log_limit"] == pytest.approx(math.log(7.0)) and values["recovery_rate"] == 0.25
    assert values["recovery_growth"] == 1.5 and values["detect"] == 0.0 and values["warmup"] == EXPLOSION_RULE.warmup
    assert values["forget"] == pytest.approx(math.log(10.0) / EXPLOSION_RULE.forget_steps)
