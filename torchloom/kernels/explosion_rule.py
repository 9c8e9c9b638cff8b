"""Tweening's explosion rule for one step as one tiny kernel (the Tween device step).

The rule itself (``torchloom.methods.explosion.ExplosionRule``: a running log-space baseline of the mean
gap, explosion = gap above ``explosion_limit`` × baseline, rate cut and recovery) is written once over
an ``ops`` namespace and runs on Python floats in the host step. Over 0-d device tensors it costs
about 80 scalar kernels per step, which in a captured Tween step was about half of its launches
(batch 1) and a seventh of its time at batch 16,384 (H100). This kernel does the same arithmetic in
float64 in one program: it reads the step's mean gap, the rate ceiling and the guard's ``found_inf``,
and updates the rule's state in place, every write masked by ``found_inf == 0`` as the reference's
``torch.where``s are. ``explosion_rule_ref_`` is the reference: the rule over torch ops, with the same
masked writes.

State: one float64 buffer, fields in ``STATE_FIELDS`` order (``TweenTrainer`` keeps its device state
in that order). Constants: one float64 buffer from ``rule_constants`` (built once per run, so that a
captured step reads them without a host→device copy).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._tl import jit, tl
from ._triton import use_triton

__all__ = ["STATE_FIELDS", "rule_constants", "explosion_rule_ref_", "explosion_rule_"]

STATE_FIELDS = (
    "adaptive_rate", "explosion_count", "steps", "prev_avg_gap", "gap_baseline", "gap_growth_rate",
    "gap_log_mean", "gap_log_dev", "gap_log_peak", "explosion_pressure",
)
_CONSTANTS = (
    "warmup", "horizon", "spread", "forget", "absorb", "sustain", "leak", "floor", "gap_min", "gap_max",
    "log_limit", "recovery_rate", "recovery_growth", "detect",
)


# The kernel reads both buffers by these offsets: a change of either order must change the kernel.
assert STATE_FIELDS.index("adaptive_rate") == 0 and STATE_FIELDS.index("steps") == 2 and STATE_FIELDS.index("explosion_pressure") == 9
assert _CONSTANTS.index("warmup") == 0 and _CONSTANTS.index("log_limit") == 10 and _CONSTANTS.index("detect") == 13


def rule_constants(rule: Any, config: Any, device: torch.device | str) -> Tensor:
    """The rule's and the config's constants as a float64 tensor on ``device`` (``_CONSTANTS`` order);
    ``forget`` is the peak's fall per quiet step, ``ln 10 / forget_steps``."""
    values = {
        "warmup": rule.warmup, "horizon": rule.horizon, "spread": rule.spread, "forget": math.log(10.0) / rule.forget_steps,
        "absorb": rule.absorb, "sustain": rule.sustain, "leak": rule.leak, "floor": rule.floor, "gap_min": rule.gap_min,
        "gap_max": rule.gap_max, "log_limit": math.log(config.explosion_limit), "recovery_rate": config.recovery_rate,
        "recovery_growth": config.recovery_growth, "detect": 1.0 if config.explosion_detection else 0.0,
    }
    return torch.tensor([float(values[k]) for k in _CONSTANTS], dtype=torch.float64, device=device)


def explosion_rule_ref_(rule: Any, ops: Any, config: Any, state: Tensor, avg_gap: Tensor, base: Tensor, found_inf: Tensor) -> Tensor:
    """Reference: ``rule`` over torch ops (``ops``), writes masked by ``found_inf == 0``. Returns the
    0-d bool ``exploded`` (False on a skipped step)."""
    d = dict(zip(STATE_FIELDS, state.unbind(0)))
    ok = found_inf.reshape(()) == 0
    watch = (d["gap_log_mean"], d["gap_log_dev"], d["gap_log_peak"], d["explosion_pressure"])
    exploded, rate, (m, s, lam, p), baseline, growth = rule(ops, avg_gap, watch, d["adaptive_rate"], d["steps"], base, config)
    exploded = ok & exploded
    new = {
        "adaptive_rate": rate, "explosion_count": d["explosion_count"] + exploded.double(), "steps": d["steps"] + ok.double(),
        "prev_avg_gap": avg_gap, "gap_baseline": baseline, "gap_growth_rate": growth,
        "gap_log_mean": m, "gap_log_dev": s, "gap_log_peak": lam, "explosion_pressure": p,
    }
    values = torch.stack([torch.as_tensor(new[k], dtype=torch.float64, device=state.device).reshape(()) for k in STATE_FIELDS])
    state.copy_(torch.where(ok, values, state))
    return exploded


@jit
def rule_body(state_ptr, g, base, ok, c_ptr):
    """The rule for one step inside a kernel (``_rule_kernel`` here, Tween's fused step rule in
    ``kernels/method_steps.py``): updates the state at ``state_ptr`` in place (writes masked by
    ``ok``) from the mean gap ``g`` and the rate ceiling ``base`` (float64 scalars); returns
    ``(exploded & ok, adaptive_rate, gap_baseline, explosion_count)``, the last three as stored."""
    rate0 = tl.load(state_ptr + 0)
    count0 = tl.load(state_ptr + 1)
    steps = tl.load(state_ptr + 2)
    m = tl.load(state_ptr + 6)
    s = tl.load(state_ptr + 7)
    lam = tl.load(state_ptr + 8)
    p = tl.load(state_ptr + 9)
    baseline0 = tl.load(state_ptr + 4)
    warmup, horizon, spread = tl.load(c_ptr + 0), tl.load(c_ptr + 1), tl.load(c_ptr + 2)
    forget, absorb, sustain, leak = tl.load(c_ptr + 3), tl.load(c_ptr + 4), tl.load(c_ptr + 5), tl.load(c_ptr + 6)
    floor, gap_min, gap_max, log_limit = tl.load(c_ptr + 7), tl.load(c_ptr + 8), tl.load(c_ptr + 9), tl.load(c_ptr + 10)
    recovery_rate, recovery_growth, detect = tl.load(c_ptr + 11), tl.load(c_ptr + 12), tl.load(c_ptr + 13) != 0
    # ExplosionRule.__call__, line by line (NaN gaps: clamp and log keep NaN, as torch.clamp does)
    x = tl.log(tl.where(g < gap_min, gap_min, tl.where(g > gap_max, gap_max, g)))
    level = tl.minimum(m + spread * s, lam, propagate_nan=tl.PropagateNan.ALL)
    diff = x - level
    growth = tl.where(steps > 0, tl.exp(tl.where(diff < -700.0, -700.0, tl.where(diff > 700.0, 700.0, diff))), 1.0)
    d = x - m
    threshold = log_limit + spread * s
    warm = steps < warmup
    exploded = (~warm) & (x - level > log_limit) & detect
    w0 = 1.0 / (steps + 1.0)
    m_warm = m + w0 * d
    s_warm = s + w0 * (tl.abs(x - m_warm) - s)
    lam_warm = tl.maximum(lam, x, propagate_nan=tl.PropagateNan.ALL)
    w = 1.0 / horizon
    m_run = m + w * tl.where(exploded, tl.minimum(d, threshold, propagate_nan=tl.PropagateNan.ALL), d)
    s_run = s + w * (tl.where(exploded, tl.minimum(tl.abs(d), threshold, propagate_nan=tl.PropagateNan.ALL), tl.abs(d)) - s)
    lam_run = tl.where(exploded, lam + absorb * (x - lam), tl.maximum(x, lam - forget, propagate_nan=tl.PropagateNan.ALL))
    p_run = leak * p + tl.where(exploded, 1.0, 0.0)
    shift = p_run >= sustain
    m_run = tl.where(shift, x - spread * s_run, m_run)
    lam_run = tl.where(shift, x, lam_run)
    p_run = tl.where(shift, 0.0, p_run)
    m_new = tl.where(warm, m_warm, m_run)
    s_new = tl.where(warm, s_warm, s_run)
    lam_new = tl.where(warm, lam_warm, lam_run)
    p_new = tl.where(warm, 0.0, p_run)
    cut = tl.minimum(base, tl.maximum(rate0 * recovery_rate, base * floor, propagate_nan=tl.PropagateNan.ALL), propagate_nan=tl.PropagateNan.ALL)
    rate = tl.where(detect, tl.where(exploded, cut, tl.minimum(base, rate0 * recovery_growth, propagate_nan=tl.PropagateNan.ALL)), base)
    baseline = tl.exp(tl.minimum(m_new + spread * s_new, lam_new, propagate_nan=tl.PropagateNan.ALL))

    exploded = exploded & ok
    tl.store(state_ptr + 0, tl.where(ok, rate, rate0))
    tl.store(state_ptr + 1, tl.where(exploded, count0 + 1.0, count0))
    tl.store(state_ptr + 2, tl.where(ok, steps + 1.0, steps))
    tl.store(state_ptr + 3, tl.where(ok, g, tl.load(state_ptr + 3)))
    tl.store(state_ptr + 4, tl.where(ok, baseline, baseline0))
    tl.store(state_ptr + 5, tl.where(ok, growth, tl.load(state_ptr + 5)))
    tl.store(state_ptr + 6, tl.where(ok, m_new, m))
    tl.store(state_ptr + 7, tl.where(ok, s_new, s))
    tl.store(state_ptr + 8, tl.where(ok, lam_new, lam))
    tl.store(state_ptr + 9, tl.where(ok, p_new, p))
    return exploded, tl.where(ok, rate, rate0), tl.where(ok, baseline, baseline0), tl.where(exploded, count0 + 1.0, count0)


@jit
def _rule_kernel(state_ptr, exploded_ptr, gap_ptr, base_ptr, found_inf_ptr, c_ptr):
    ok = tl.load(found_inf_ptr) == 0
    g = tl.load(gap_ptr).to(tl.float64)
    base = tl.load(base_ptr).to(tl.float64)
    exploded, _rate, _baseline, _count = rule_body(state_ptr, g, base, ok, c_ptr)
    tl.store(exploded_ptr, tl.where(exploded, 1, 0).to(tl.int8))


def explosion_rule_(
    rule: Any, ops: Any, config: Any, state: Tensor, constants: Tensor, avg_gap: Tensor, base: Tensor, found_inf: Tensor,
    backend: str | None = None,
) -> Tensor:
    """One step of the explosion rule on the device: ``state`` (float64, ``STATE_FIELDS``) updated in
    place unless ``found_inf`` is nonzero; returns the 0-d bool ``exploded``. One launch on CUDA
    (``constants`` from ``rule_constants``), ``explosion_rule_ref_`` elsewhere. ``avg_gap`` and
    ``base`` are 0-d tensors (any float dtype), ``found_inf`` a one-element float tensor."""
    if not use_triton(state, backend) or state.dtype != torch.float64 or state.numel() != len(STATE_FIELDS):
        return explosion_rule_ref_(rule, ops, config, state, avg_gap, base, found_inf)
    exploded = torch.empty((), dtype=torch.int8, device=state.device)
    # no FMA contraction: the same roundings as the reference's separate torch ops (bit for bit)
    _rule_kernel[(1,)](state, exploded, avg_gap, base, found_inf, constants, num_warps=1, enable_fp_fusion=False)
    return exploded != 0
