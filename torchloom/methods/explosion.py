"""Tweening's explosion rule (``ExplosionRule``): one step's decision, from its mean gap and a running
baseline, whether the step exploded, and the adaptive rate that follows. Written once over a few
operations (``_FloatOps`` on floats for the host step, ``_TensorOps`` on 0-d tensors for the device
step; ``kernels/explosion_rule.py`` launches the same rule as one kernel)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ExplosionRule", "EXPLOSION_RULE"]


class _FloatOps:
    """The few operations ``ExplosionRule`` needs, on Python floats and bools (the host step). NaN
    propagates as in the device forms (``torch.log``/``maximum``/``minimum`` and the kernel), so a
    NaN gap leaves the same state on both paths (a skipped step never reaches the rule anyway)."""

    @staticmethod
    def log(v: float) -> float:
        if v != v:
            return v
        return math.log(v) if v > 0 else -math.inf

    exp = staticmethod(math.exp)

    @staticmethod
    def maximum(a: float, b: float) -> float:
        return a if a != a else b if b != b else max(a, b)

    @staticmethod
    def minimum(a: float, b: float) -> float:
        return a if a != a else b if b != b else min(a, b)

    @staticmethod
    def clamp(v: float, lo: float, hi: float) -> float:
        return min(max(v, lo), hi)  # NaN stays NaN: comparisons with it are False

    @staticmethod
    def where(cond: bool, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def logical_not(c: bool) -> bool:
        return not c


class _TensorOps:
    """The same operations on 0-d tensors (the device step: no host read)."""

    log = staticmethod(torch.log)
    exp = staticmethod(torch.exp)
    clamp = staticmethod(torch.clamp)
    maximum = staticmethod(torch.maximum)
    minimum = staticmethod(torch.minimum)
    where = staticmethod(torch.where)
    logical_not = staticmethod(torch.logical_not)


@dataclass(frozen=True)
class ExplosionRule:
    """Tweening's explosion detection: one step's decision from its mean gap and a running baseline.

    A step's mean gap ``g = avg_gap`` (the mean of the per-layer gaps) varies enormously in ordinary
    training: with one sample per step it is ~1e-4 (or far less) for a sample the network already gets
    right (its gradient is gated off) and ~0.1 for one it gets wrong; with 32 samples per step it varies
    far less. The baseline is built from ``x = log g`` (``g`` clamped to ``[1e-30, 1e30]``) by two
    running statistics, and is the lower of the two:

    * a running mean ``m`` of ``x`` and running mean absolute deviation ``s`` of ``x`` from ``m``:
      ``m + spread·s`` (``spread`` = 3) sits well above ordinary variation whatever its size (tight at
      batch 32, wide at batch 1);
    * a running peak ``λ`` of ``x`` that forgets slowly (falls by ``ln 10`` over ``forget_steps`` = 1000
      quiet steps): the largest gap of recent ordinary training (at batch 1, the last wrong sample's);

        gap_baseline = exp(min(m + spread·s, λ)),
        explosion    = g > explosion_limit · gap_baseline   (after the warm-up, detection on),
        gap_growth_rate = g / gap_baseline                  (the baseline before this step's update).

    Updates, per counted step ``k`` (``d = x − m``):

    * **warm-up** (the first ``warmup`` = 10 steps): plain averages (``m += d/(k+1)``, ``s += (|x − m| −
      s)/(k+1)``), ``λ = max(λ, x)``; no detection;
    * **ordinary step**: ``m += d/horizon``, ``s += (|d| − s)/horizon`` (exponential averages over
      ``horizon`` = 100 steps), ``λ = max(x, λ − ln 10/forget_steps)``;
    * **explosive step**: the baseline is pulled only part of the way: ``d`` is clipped to the
      detection threshold ``c = ln(explosion_limit) + spread·s`` in the averages, and ``λ`` moves a tenth
      of the way (``absorb`` = 0.1) towards ``x``. Explosions also add to a leaky count ``p`` (``p =
      0.9·p + 1``; ``p = 0.9·p`` on an ordinary step); when ``p`` reaches ``sustain`` = 3 (explosions on
      about 4 steps in a row, or 4–5 close together) the gap is taken as a **new level** (a task switch, a
      new data regime, damage that stays): ``m = x − spread·s``, ``λ = x`` (the baseline jumps to the
      current gap) and ``p = 0``. A persistent change costs a few rate cuts, then detection stops
      firing and the rate recovers: learning never freezes.

    Rate (detection on): an explosion sets ``adaptive_rate = min(base, max(adaptive_rate·recovery_rate,
    floor·base))`` (``floor`` = 0.01: never below 1 % of the rate, Loom's legacy floor; ``base`` =
    ``base_rate`` or the step's scheduled rate) and the caller resets every velocity to zero; an
    ordinary step sets ``adaptive_rate = min(base, adaptive_rate·recovery_growth)``. With detection off
    the baseline is still tracked (for watching) and ``adaptive_rate = base``.

    The rule is written once over an ``ops`` namespace (``log``, ``exp``, ``clamp``, ``maximum``,
    ``minimum``, ``where``, ``logical_not``), so the same code runs on Python floats in the host step
    and on 0-d tensors with ``torch.where`` in the device step off CUDA (no host read). On CUDA the
    device step runs it as one float64 kernel (``torchloom.kernels.explosion_rule``: the same lines in
    Triton, tested step by step against this rule on floats), not ~80 scalar kernels.
    """

    warmup: int = 10
    horizon: float = 100.0
    spread: float = 3.0
    forget_steps: float = 1000.0
    absorb: float = 0.1
    sustain: float = 3.0
    leak: float = 0.9
    floor: float = 0.01
    gap_min: float = 1e-30
    gap_max: float = 1e30

    def __call__(
        self, ops: Any, avg_gap: Any, watch: tuple[Any, Any, Any, Any], adaptive_rate: Any, steps: Any, base: Any,
        config: Any,  # a TweenConfig
    ) -> tuple[Any, Any, tuple[Any, Any, Any, Any], Any, Any]:
        """One step. ``watch = (m, s, λ, p)`` and ``adaptive_rate`` are the values before it (``(0, 0,
        −inf, 0)`` before the first step), ``steps`` the counted steps before it, ``base`` the ceiling
        of the rate. Returns ``(exploded, adaptive_rate, watch, gap_baseline, gap_growth_rate)`` after
        it (``gap_baseline`` from the updated watch)."""
        m, s, lam, p = watch
        x = ops.log(ops.clamp(avg_gap, self.gap_min, self.gap_max))
        level = ops.minimum(m + self.spread * s, lam)  # log of the baseline before this step
        growth = ops.where(steps > 0, ops.exp(ops.clamp(x - level, -700.0, 700.0)), 1.0)
        d = x - m
        threshold = math.log(config.explosion_limit) + self.spread * s
        warm = steps < self.warmup
        exploded = ops.logical_not(warm) & (x - level > math.log(config.explosion_limit))
        if not config.explosion_detection:
            exploded = exploded & False
        # warm-up: plain averages and the peak
        w0 = 1.0 / (steps + 1.0)
        m_warm = m + w0 * d
        s_warm = s + w0 * (abs(x - m_warm) - s)
        lam_warm = ops.maximum(lam, x)
        # after it: exponential averages and a forgetting peak, an explosive step pulling only part way
        w = 1.0 / self.horizon
        m_run = m + w * ops.where(exploded, ops.minimum(d, threshold), d)
        s_run = s + w * (ops.where(exploded, ops.minimum(abs(d), threshold), abs(d)) - s)
        lam_run = ops.where(exploded, lam + self.absorb * (x - lam), ops.maximum(x, lam - math.log(10.0) / self.forget_steps))
        p_run = self.leak * p + ops.where(exploded, 1.0, 0.0)
        shift = p_run >= self.sustain  # a sustained new level: the baseline jumps to it
        m_run = ops.where(shift, x - self.spread * s_run, m_run)
        lam_run = ops.where(shift, x, lam_run)
        p_run = ops.where(shift, 0.0, p_run)
        m_new = ops.where(warm, m_warm, m_run)
        s_new = ops.where(warm, s_warm, s_run)
        lam_new = ops.where(warm, lam_warm, lam_run)
        p_new = ops.where(warm, 0.0, p_run)
        if config.explosion_detection:
            cut = ops.minimum(base, ops.maximum(adaptive_rate * config.recovery_rate, base * self.floor))
            new_rate = ops.where(exploded, cut, ops.minimum(base, adaptive_rate * config.recovery_growth))
        else:
            new_rate = base
        baseline = ops.exp(ops.minimum(m_new + self.spread * s_new, lam_new))
        return exploded, new_rate, (m_new, s_new, lam_new, p_new), baseline, growth


EXPLOSION_RULE = ExplosionRule()
