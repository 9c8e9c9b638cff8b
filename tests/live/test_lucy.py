"""Welvet's Lucy metrics (openfluke/welvet lucy/score.go) against the rows Welvet published for its
adaptv2 benchmark (openfluke/aai adaptv2/README.md, CPU board, 15 s, workers=1, SIMD off)."""

from __future__ import annotations

import math

import pytest

from torchloom.live import LucySnapshot, LucyWindow, availability, finalize, flip, score, soft_acc, zero_downtime

# mode: (Thru, Avail %, Acc %, Score), as published (rounded to the digits shown)
PUBLISHED = {
    "NormalBP": (1762, 63.7, 89.2, 1001),
    "StepBP": (2181, 9.8, 89.4, 192),
    "Tween": (1632, 20.0, 46.9, 154),
    "TweenChain": (1802, 63.5, 89.7, 1027),
    "FastProxy": (3492, 82.7, 91.2, 2634),
    "Sparse": (7613, 95.5, 85.9, 6241),
    "LinearCache": (3484, 82.5, 43.8, 1259),
}

# hard accuracy by 1-s window (chase 1-5 | avoid 6-10 | chase 11-15), published, and the two flip columns
PER_SECOND = {
    "NormalBP": ([81, 88, 89, 89, 90, 87, 91, 90, 91, 90, 86, 92, 90, 91, 92], (90, 87, 0), (90, 86, 0)),
    "FastProxy": ([82, 93, 94, 94, 94, 81, 94, 94, 93, 94, 83, 93, 93, 93, 93], (94, 81, 0), (94, 83, 0)),
    "Sparse": ([81, 86, 83, 84, 87, 82, 84, 87, 87, 87, 87, 87, 89, 89, 89], (87, 82, 0), (87, 87, 0)),
    "Tween": ([44, 64, 65, 68, 69, 9, 8, 24, 51, 57, 15, 37, 65, 62, 65], (69, 51, 3), (57, 65, 2)),
}


@pytest.mark.parametrize("mode", sorted(PUBLISHED))
def test_score_reproduces_published_rows(mode):
    """Score = Thru × Avail × Acc / 10⁴: the published Score lies between the scores of the lowest and
    highest values that round to the published inputs, and within 0.6 % of the score of the inputs."""
    thru, avail, acc, published = PUBLISHED[mode]
    lo = score(thru - 0.5, avail - 0.05, acc - 0.05)
    hi = score(thru + 0.5, avail + 0.05, acc + 0.05)
    assert lo - 0.5 <= published <= hi + 0.5, (mode, lo, hi, published)
    assert abs(score(thru, avail, acc) - published) / published < 0.006
    # the three headline rows, to the unit
    if mode in ("NormalBP", "FastProxy"):
        assert round(score(thru, avail, acc)) == published


def test_score_is_zero_when_not_finite():
    assert score(float("inf"), 50.0, 90.0) == 0.0
    assert score(float("nan"), 50.0, 90.0) == 0.0
    assert score(1000.0, 50.0, 90.0) == 1000.0 * 50.0 * 90.0 / 10_000


@pytest.mark.parametrize("mode", sorted(PER_SECOND))
def test_acc_is_the_mean_of_window_accuracies(mode):
    """Lucy's Acc term: the mean of the 15 windows' hard accuracies. From the published whole-number
    windows it rounds to the published Acc (±0.5 of rounding per window)."""
    acc1s, _, _ = PER_SECOND[mode]
    snap = finalize(LucySnapshot(windows=[LucyWindow(outputs=100, accuracy=a) for a in acc1s], total_outputs=1500))
    assert snap.avg_accuracy == pytest.approx(sum(acc1s) / 15, abs=1e-12)
    assert abs(snap.avg_accuracy - PUBLISHED[mode][2]) <= 0.5 + 0.05


@pytest.mark.parametrize("mode", sorted(PER_SECOND))
def test_flip_columns_match_published(mode):
    """adaptv2's "1st flip"/"2nd flip": window before the flip → first window ≥ 50 %, and its delay."""
    acc1s, first, second = PER_SECOND[mode]
    assert flip(acc1s, 4, 5, 10) == first
    assert flip(acc1s, 9, 10, 15) == second


def test_flip_never_reaching_50():
    assert flip([90, 10, 20, 30], 0, 1, 4) == (90, None, None)


def test_finalize_throughput_availability_and_score_from_totals():
    """A run of 15 s with NormalBP's totals: throughput 1762/s, availability from the thread-CPU times,
    Score to the published 1001."""
    snap = LucySnapshot(
        total_outputs=1762 * 15, total_correct=0, infer_ms=637.0, train_ms=363.0, duration_s=15.0,
        windows=[LucyWindow(outputs=1762, accuracy=a) for a in PER_SECOND["NormalBP"][0]],
    )
    finalize(snap)
    assert snap.throughput == pytest.approx(1762.0)
    assert snap.availability == pytest.approx(63.7)
    # 1762 × 63.7 × 89.13 / 10⁴ = 1000.4: the published windows are whole numbers (Acc 89.13, not 89.2)
    assert abs(snap.score - 1001) < 1.0
    assert snap.zero_downtime == pytest.approx(snap.avg_accuracy * 63.7 / 100)
    assert snap.acc_per_sec == pytest.approx(snap.avg_accuracy / 15)


def test_empty_window_counts_as_zero_and_fallback_to_totals():
    snap = finalize(LucySnapshot(windows=[LucyWindow(outputs=10, accuracy=80.0), LucyWindow()], total_outputs=10, total_correct=8))
    assert snap.avg_accuracy == 40.0  # Welvet divides by every window
    snap = finalize(LucySnapshot(total_outputs=10, total_correct=7))
    assert snap.avg_accuracy == 70.0


def test_availability_without_timings_uses_blocked_time():
    snap = finalize(LucySnapshot(duration_s=10.0, blocked_train_s=4.0))
    assert snap.availability == pytest.approx(60.0)
    assert availability(0.0, 0.0) == 0.0
    assert availability(3.0, 1.0) == 75.0


def test_soft_metrics_from_their_formulas():
    """Stability = 100 − std of window SoftAcc around its mean; Consistency = % of windows ≥ 10;
    AdaptPct = mean SoftAcc of the windows from each phase switch (adapt_windows of them)."""
    soft = [20.0, 5.0, 30.0, 40.0]
    wins = [LucyWindow(outputs=1, soft_acc=s) for s in soft]
    wins[1].phase_switches = 1
    snap = finalize(LucySnapshot(windows=wins, total_outputs=4), adapt_windows=2)
    mean = sum(soft) / 4
    assert snap.soft_acc == mean
    assert snap.stability == pytest.approx(100 - math.sqrt(sum((s - mean) ** 2 for s in soft) / 4))
    assert snap.consistency == 75.0
    assert snap.adapt_pct == pytest.approx((5.0 + 30.0) / 2)
    assert finalize(LucySnapshot(windows=[LucyWindow(outputs=1, soft_acc=s) for s in soft], total_outputs=4)).adapt_pct == 0.0


def test_soft_acc_clamps():
    assert soft_acc(0.5, 0.5) == 100.0
    assert soft_acc(0.55, 0.5) == pytest.approx(50.0)
    assert soft_acc(2.0, 0.5) == 0.0
    assert soft_acc(float("nan"), 0.5) == 0.0
    assert soft_acc(0.7, 1.0, scale=1.0) == pytest.approx(70.0)
    assert soft_acc(0.5, 0.5, scale=0.0) == 0.0
    assert zero_downtime(90.0, 50.0) == 45.0
