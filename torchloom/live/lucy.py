"""Welvet's Lucy metrics (openfluke/welvet ``lucy/score.go``), computed the way Welvet computes them.

Lucy scores a live loop: a model that serves a prediction for every sample of a stream and trains
on it. Per window (Welvet's ``adaptv2`` uses 1-second wall-clock windows) it keeps the outputs
served, the hard accuracy (0–100, the mean over the window's samples of 100 × [argmax = label]), the
SoftAcc, and the time spent serving and training. The aggregates (``finalize``):

* **Throughput** = outputs / wall-clock duration (samples per second);
* **Availability** = 100 × serve time / (serve time + train time), the times measured on the
  serving thread's CPU clock (Welvet: ``RUSAGE_THREAD``; Python: ``time.thread_time``); with no
  measured time at all, the share of the duration not blocked by training;
* **Acc** (``avg_accuracy``) = the mean of the windows' hard accuracies, every window counted (an
  empty window counts as 0), falling back to correct / outputs without windows;
* **Score** = Throughput × Availability × Acc / 10⁴ (0 when not finite);
* **ZeroDowntime** = Acc × Availability / 100;
* SoftAcc = 100 × (1 − |pred − target| / scale) clamped to [0, 100] (``adaptv2`` feeds it
  softmax p(true label) against 1 at scale 1), its mean over windows; **Stability** = 100 − the
  standard deviation of the windows' SoftAcc around that mean (at least 0); **Consistency** = the
  share of windows whose SoftAcc is at least ``cons_threshold`` (10); **AdaptPct** = the mean SoftAcc
  of the ``adapt_windows`` windows starting at each window that holds a phase switch (``adaptv2``
  passes 1; Welvet's default is 4).

``flip`` is ``adaptv2``'s "1st flip" / "2nd flip" column: the accuracy of the window before a flip and
the first window from the flip on with accuracy ≥ 50, and how many windows later it came.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "LucyWindow", "LucySnapshot", "soft_acc", "availability", "score", "zero_downtime", "window_accuracy",
    "finalize", "flip", "SOFT_ACC_SCALE_SINE", "SOFT_ACC_SCALE_CLASS", "CONS_THRESHOLD", "ADAPT_WINDOWS_DEFAULT",
]

SOFT_ACC_SCALE_SINE = 0.10  # Welvet's scale for a regressed sine value
SOFT_ACC_SCALE_CLASS = 1.0  # Welvet's scale for p(true class) against 1
CONS_THRESHOLD = 10.0  # a window's SoftAcc at least this counts toward Consistency (%)
ADAPT_WINDOWS_DEFAULT = 4  # windows after a switch folded into AdaptPct when none is given


def soft_acc(pred: float, target: float, scale: float = SOFT_ACC_SCALE_SINE) -> float:
    """100 × (1 − |pred − target| / scale), clamped to [0, 100]; 0 for a non-positive scale or a
    non-finite prediction."""
    if scale <= 0 or not math.isfinite(pred):
        return 0.0
    return min(100.0, max(0.0, 100.0 * (1.0 - abs(pred - target) / scale)))


def availability(infer_ms: float, train_ms: float) -> float:
    """100 × infer / (infer + train), clamped to [0, 100]; 0 when nothing was timed."""
    busy = infer_ms + train_ms
    if busy <= 0:
        return 0.0
    return min(100.0, max(0.0, 100.0 * infer_ms / busy))


def score(throughput: float, availability_pct: float, acc: float) -> float:
    """Throughput × Availability × Acc / 10⁴ (Acc is the hard accuracy, 0–100); 0 when not finite."""
    s = throughput * availability_pct * acc / 10_000
    return s if math.isfinite(s) else 0.0


def zero_downtime(acc: float, availability_pct: float) -> float:
    """Acc × Availability / 100: how much of the time the model was serving correct answers."""
    return acc * availability_pct / 100


def window_accuracy(correct: int, outputs: int) -> float:
    """100 × correct / outputs; 0 for an empty window."""
    return 100.0 * correct / outputs if outputs > 0 else 0.0


@dataclass
class LucyWindow:
    """One window of a live run: the samples served (``outputs``), how many were right, the updates
    run, the serve and train time (ms, thread CPU clock), the phase, how many phase switches fell in
    it, its hard accuracy and mean SoftAcc (0–100)."""

    outputs: int = 0
    correct: int = 0
    train_steps: int = 0
    infer_ms: float = 0.0
    train_ms: float = 0.0
    phase: str = ""
    phase_switches: int = 0
    accuracy: float = 0.0
    soft_acc: float = 0.0


@dataclass
class LucySnapshot:
    """The aggregate of one run (Welvet's ``lucy.Snapshot``, without its memory and mobile fields
    but ``weight_bytes`` / ``weight_mib``): totals and times in, ``finalize`` fills the rest."""

    total_outputs: int = 0
    total_correct: int = 0
    total_train: int = 0
    infer_ms: float = 0.0
    train_ms: float = 0.0
    blocked_train_s: float = 0.0
    duration_s: float = 0.0
    windows: list[LucyWindow] = field(default_factory=list)
    weight_bytes: int = 0
    # filled by finalize
    avg_accuracy: float = 0.0
    soft_acc: float = 0.0
    adapt_pct: float = 0.0
    stability: float = 0.0
    consistency: float = 0.0
    throughput: float = 0.0
    availability: float = 0.0
    score: float = 0.0
    zero_downtime: float = 0.0
    weight_mib: float = 0.0
    acc_per_sec: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The scalar fields as plain floats (windows left out)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "windows"}


def finalize(s: LucySnapshot, adapt_windows: int = 0, cons_threshold: float = 0.0) -> LucySnapshot:
    """Fill ``s``'s aggregates from its totals, times and windows (Welvet's ``lucy.Finalize``; a
    non-positive ``adapt_windows`` / ``cons_threshold`` takes Welvet's default, 4 / 10). Returns ``s``."""
    adapt_windows = adapt_windows if adapt_windows > 0 else ADAPT_WINDOWS_DEFAULT
    cons_threshold = cons_threshold if cons_threshold > 0 else CONS_THRESHOLD
    if s.duration_s > 0:
        s.throughput = s.total_outputs / s.duration_s
    busy = s.infer_ms + s.train_ms
    if busy > 0:
        s.availability = 100.0 * s.infer_ms / busy
    elif s.duration_s > 0:
        s.availability = max(0.0, s.duration_s - s.blocked_train_s) / s.duration_s * 100.0
    if s.windows:  # every window counts, an empty one as 0
        s.avg_accuracy = sum(w.accuracy for w in s.windows) / len(s.windows)
        s.soft_acc = sum(w.soft_acc for w in s.windows) / len(s.windows)
    if s.avg_accuracy == 0 and s.total_outputs > 0:
        s.avg_accuracy = 100.0 * s.total_correct / s.total_outputs
    blocks = [w.soft_acc for w in s.windows]
    if blocks:
        valid = [a for a in blocks if not math.isnan(a)]
        if valid:
            var = sum((a - s.soft_acc) ** 2 for a in valid) / len(valid)
            s.stability = max(0.0, 100.0 - math.sqrt(var))
        s.consistency = sum(a >= cons_threshold for a in valid) / len(blocks) * 100.0
        folded = [blocks[i + k] for i, w in enumerate(s.windows) if w.phase_switches > 0
                  for k in range(adapt_windows) if i + k < len(blocks)]
        if folded:
            s.adapt_pct = sum(folded) / len(folded)
    s.score = score(s.throughput, s.availability, s.avg_accuracy)
    s.zero_downtime = zero_downtime(s.avg_accuracy, s.availability)
    s.weight_mib = s.weight_bytes / (1024 * 1024)
    if s.duration_s > 0:
        s.acc_per_sec = s.avg_accuracy / s.duration_s
    return s


def flip(acc: Sequence[float], before: int, start: int, until: int) -> tuple[float, float | None, int | None]:
    """``adaptv2``'s flip column over per-window accuracies ``acc``: ``(acc[before], after, delay)``
    where ``after`` is the first accuracy ≥ 50 among windows ``start .. until-1`` and ``delay`` its
    distance from ``start`` in windows (``None, None`` when none reached 50)."""
    b = acc[before] if 0 <= before < len(acc) else 0.0
    for i in range(max(start, 0), min(until, len(acc))):
        if acc[i] >= 50:
            return b, acc[i], i - start
    return b, None, None
