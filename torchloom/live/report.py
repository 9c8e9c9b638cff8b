"""What a live run records per sample, and the report made from it.

``LiveRecord`` keeps one row per served sample: when it was served (wall clock since the start), its
phase, whether the prediction was right (known once the label arrives), its SoftAcc, the thread-CPU
time of its serve and of the training it triggered, its serve latency (wall clock), how many weight
versions the weights it was served from lagged behind the trainer's (staleness), and whether its label
went into an update. ``LiveRecord.report()`` turns the rows into a ``LiveReport``:

* ``lucy``: Welvet's Lucy aggregate (``lucy.finalize``) over wall-clock windows of ``window_s``
  seconds (``adaptv2``: 1 s, 15 windows), or over windows of ``window_samples`` samples (clock-free);
* per shock (a phase switch): the accuracy before it (over the ``pre_samples`` samples before the
  switch, at most back to the previous one), the minimum accuracy over sliding ``window``-sample
  windows after it (up to the next switch), and the samples from the switch to the end of the first
  such window at 80 % / 90 % of the accuracy before it (``None``: never within the phase);
* serve latency p50 / p99 (µs, wall clock), mean and maximum staleness, and the fraction of served
  samples whose label went into an update.

``LiveReport.to_csv(path)`` writes one row per Lucy window (atomically); ``LiveReport.logs()`` is the
flat dict of floats the observers get.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .lucy import LucySnapshot, LucyWindow, finalize, flip

__all__ = ["LiveRecord", "LiveReport", "ShockStats"]


@dataclass
class ShockStats:
    """One phase switch: at sample ``at`` (the first sample of the new phase), into ``phase``."""

    at: int
    phase: str
    pre_accuracy: float
    min_accuracy: float | None
    recover_80: int | None
    recover_90: int | None


@dataclass
class LiveReport:
    """The report of a live run (see the module docstring). Accuracies in %, latencies in µs."""

    samples: int
    lucy: LucySnapshot
    window_accuracy: list[float]
    flips: list[tuple[float, float | None, int | None]]
    shocks: list[ShockStats]
    latency_p50_us: float
    latency_p99_us: float
    staleness_mean: float
    staleness_max: int
    trained_fraction: float
    extra: dict[str, float] = field(default_factory=dict)

    def logs(self) -> dict[str, float]:
        """A flat dict of plain floats: the Lucy aggregates (``acc``, ``availability``, ``throughput``,
        ``score``, ...), the latency, staleness and trained fraction, and per shock ``shock<i>_min_acc``,
        ``shock<i>_recover80``, ``shock<i>_recover90`` (NaN where none)."""
        lucy = self.lucy
        out = {
            "samples": float(self.samples), "acc": lucy.avg_accuracy, "availability": lucy.availability,
            "throughput": lucy.throughput, "score": lucy.score, "soft_acc": lucy.soft_acc,
            "zero_downtime": lucy.zero_downtime, "stability": lucy.stability, "consistency": lucy.consistency,
            "adapt_pct": lucy.adapt_pct, "latency_p50_us": self.latency_p50_us, "latency_p99_us": self.latency_p99_us,
            "staleness_mean": self.staleness_mean, "staleness_max": float(self.staleness_max),
            "trained_fraction": self.trained_fraction,
        }
        for i, s in enumerate(self.shocks):
            none = float("nan")
            out[f"shock{i}_pre_acc"] = s.pre_accuracy
            out[f"shock{i}_min_acc"] = none if s.min_accuracy is None else s.min_accuracy
            out[f"shock{i}_recover80"] = none if s.recover_80 is None else float(s.recover_80)
            out[f"shock{i}_recover90"] = none if s.recover_90 is None else float(s.recover_90)
        out.update(self.extra)
        return {k: float(v) for k, v in out.items()}

    def to_csv(self, path: Any) -> None:
        """One row per Lucy window (index, phase, outputs, correct, train steps, serve and train ms,
        accuracy, SoftAcc, phase switches), written atomically (a temporary file renamed over ``path``)."""
        from ..observers._files import atomic_write, check_output_path

        p = check_output_path("LiveReport.to_csv", path)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["window", "phase", "outputs", "correct", "train_steps", "infer_ms", "train_ms", "accuracy",
                    "soft_acc", "phase_switches"])
        for i, win in enumerate(self.lucy.windows):
            w.writerow([i, win.phase, win.outputs, win.correct, win.train_steps, f"{win.infer_ms:.6f}",
                        f"{win.train_ms:.6f}", f"{win.accuracy:.6f}", f"{win.soft_acc:.6f}", win.phase_switches])
        data = buf.getvalue().encode()
        atomic_write("LiveReport.to_csv", p, lambda f: f.write(data))


class LiveRecord:
    """Per-sample rows of a live run (columns as Python lists; see the module docstring)."""

    def __init__(self) -> None:
        self.t: list[float] = []  # wall seconds since the run started, at serve
        self.phase: list[str] = []
        self.correct: list[int] = []  # -1 until the label arrives
        self.soft: list[float] = []
        self.serve_s: list[float] = []  # thread CPU seconds
        self.train_s: list[float] = []  # thread CPU seconds of the training its learn() ran
        self.latency_s: list[float] = []  # wall seconds of the serve
        self.staleness: list[int] = []
        self.trained: list[bool] = []
        self.train_steps: list[int] = []  # updates run inside this sample's learn()
        self.duration_s = 0.0
        self.weight_bytes = 0

    def __len__(self) -> int:
        return len(self.t)

    def add_serve(self, t: float, phase: str, serve_s: float, latency_s: float, staleness: int) -> int:
        """A served sample; returns its index."""
        self.t.append(t)
        self.phase.append(phase)
        self.correct.append(-1)
        self.soft.append(0.0)
        self.serve_s.append(serve_s)
        self.train_s.append(0.0)
        self.latency_s.append(latency_s)
        self.staleness.append(staleness)
        self.trained.append(False)
        self.train_steps.append(0)
        return len(self.t) - 1

    def add_serves(self, n: int, t: float, phase: str, serve_s: float, latency_s: float, staleness: int) -> int:
        """``n`` samples served together (their serve time split evenly); returns the first's index.
        O(1) per sample: one append per column."""
        first = len(self.t)
        for _ in range(n):
            self.add_serve(t, phase, serve_s / n, latency_s, staleness)
        return first

    def add_window(self, n: int, t: float, phase: str, serve_s: float, train_s: float, latency_s: float) -> int:
        """``n`` samples served and trained one by one in one window (the device-resident stream), each
        with ``serve_s`` / ``train_s`` / ``latency_s``; returns the first's index. One ``extend`` per
        column."""
        first = len(self.t)
        self.t.extend([t] * n)
        self.phase.extend([phase] * n)
        self.correct.extend([-1] * n)
        self.soft.extend([0.0] * n)
        self.serve_s.extend([serve_s] * n)
        self.train_s.extend([train_s] * n)
        self.latency_s.extend([latency_s] * n)
        self.staleness.extend([0] * n)
        self.trained.extend([True] * n)
        self.train_steps.extend([1] * n)
        return first

    # ------------------------------------------------------------------------------ report
    def report(
        self, *, window_s: float | None = 1.0, n_windows: int | None = None, window_samples: int | None = None,
        window: int = 50, pre_samples: int = 500, adapt_windows: int = 1, extra: dict[str, float] | None = None,
    ) -> LiveReport:
        """The ``LiveReport`` of the rows so far. Lucy windows: ``window_samples`` samples each when
        given (clock-free), else ``window_s`` wall-clock seconds, ``n_windows`` of them (default: enough
        to cover the run; samples past the last fall into it, as in ``adaptv2``). ``window``: samples
        per shock window; ``pre_samples``: samples before a shock that set its reference accuracy;
        ``adapt_windows``: Lucy's AdaptPct span (``adaptv2`` passes 1)."""
        n = len(self.t)
        labelled = [i for i in range(n) if self.correct[i] >= 0]
        if window_samples is not None:
            if window_samples < 1:
                raise ValueError(f"window_samples must be >= 1, got {window_samples!r}")
            idx = [i // window_samples for i in range(n)]
            count = max(1, -(-n // window_samples))
        else:
            if window_s is None or window_s <= 0:
                raise ValueError(f"window_s must be > 0, got {window_s!r}")
            count = n_windows if n_windows is not None else max(1, math.ceil(self.duration_s / window_s - 1e-9))
            idx = [min(int(self.t[i] // window_s), count - 1) for i in range(n)]
        wins = [LucyWindow() for _ in range(count)]
        scored = [0] * count  # samples whose label arrived: a window's accuracy is over these
        prev = None
        for i in range(n):
            w = wins[idx[i]]
            if prev is not None and self.phase[i] != prev:
                w.phase_switches += 1
            prev = self.phase[i]
            w.phase = self.phase[i]
            w.outputs += 1
            w.train_steps += self.train_steps[i]
            w.infer_ms += self.serve_s[i] * 1000
            w.train_ms += self.train_s[i] * 1000
            if self.correct[i] >= 0:
                scored[idx[i]] += 1
                w.correct += self.correct[i]
                w.soft_acc += self.soft[i]
        for w, m in zip(wins, scored):
            w.accuracy = 100.0 * w.correct / m if m else 0.0
            w.soft_acc = w.soft_acc / m if m else 0.0
        snap = LucySnapshot(
            total_outputs=n, total_correct=sum(1 for c in self.correct if c > 0), total_train=sum(self.trained),
            infer_ms=sum(self.serve_s) * 1000, train_ms=sum(self.train_s) * 1000, duration_s=self.duration_s,
            windows=wins, weight_bytes=self.weight_bytes,
        )
        finalize(snap, adapt_windows=adapt_windows)
        acc = [w.accuracy for w in wins]
        switches = [k for k, w in enumerate(wins) if w.phase_switches > 0]
        flips = [flip(acc, k - 1, k, switches[j + 1] if j + 1 < len(switches) else len(acc)) for j, k in enumerate(switches)]
        lat = torch.tensor(self.latency_s, dtype=torch.float64) * 1e6
        p50, p99 = (torch.quantile(lat, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist() if n else (0.0, 0.0))
        return LiveReport(
            samples=n, lucy=snap, window_accuracy=acc, flips=flips,
            shocks=self._shocks(labelled, window, pre_samples),
            latency_p50_us=p50, latency_p99_us=p99,
            staleness_mean=sum(self.staleness) / n if n else 0.0, staleness_max=max(self.staleness, default=0),
            trained_fraction=sum(self.trained) / n if n else 0.0, extra=dict(extra or {}),
        )

    def _shocks(self, labelled: list[int], window: int, pre_samples: int) -> list[ShockStats]:
        """Per phase switch, over the labelled samples in serve order (see the module docstring)."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        hits = [1.0 if self.correct[i] > 0 else 0.0 for i in labelled]
        phases = [self.phase[i] for i in labelled]
        starts = [j for j in range(1, len(phases)) if phases[j] != phases[j - 1]]
        bounds = [0, *starts, len(phases)]
        csum = [0.0]
        for h in hits:
            csum.append(csum[-1] + h)
        out = []
        for k, s in enumerate(starts):
            seg_begin, seg_end = bounds[k], bounds[k + 2]
            lo = max(seg_begin, s - pre_samples)
            pre = 100.0 * (csum[s] - csum[lo]) / (s - lo)
            means = [100.0 * (csum[e] - csum[e - window]) / window for e in range(s + window, seg_end + 1)]
            recover = []
            for frac in (0.8, 0.9):
                first = next((j for j, m in enumerate(means) if m >= frac * pre), None)
                recover.append(None if first is None else first + window)
            out.append(ShockStats(
                at=labelled[s], phase=phases[s], pre_accuracy=pre, min_accuracy=min(means) if means else None,
                recover_80=recover[0], recover_90=recover[1],
            ))
        return out
