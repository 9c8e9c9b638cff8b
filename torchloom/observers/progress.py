"""Epoch lines in Loom's format, and Go's duration formatting they use."""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from .base import Observer

__all__ = ["EpochLinePrinter", "format_duration", "format_epoch_line"]


def _trim(v: float, decimals: int) -> str:
    s = f"{v:.{decimals}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def format_duration(seconds: float) -> str:
    """Go's ``time.Duration.String()``: ``850ns``, ``1.5µs``, ``12.345678ms``, ``2.5s``, ``1m30s``, ``2h0m0s``."""
    if seconds != seconds or seconds in (math.inf, -math.inf):
        return str(seconds)
    ns = int(round(seconds * 1e9))
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns == 0:
        return "0s"
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_trim(ns / 1e3, 3)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_trim(ns / 1e6, 6)}ms"
    h, rem = divmod(ns, 3_600_000_000_000)
    m, rem = divmod(rem, 60_000_000_000)
    s = _trim(rem / 1e9, 9)
    if h:
        return f"{sign}{h}h{m}m{s}s"
    if m:
        return f"{sign}{m}m{s}s"
    return f"{sign}{s}s"


def format_epoch_line(epoch: int, epochs: int, loss: float, epoch_time: float, samples_per_second: float, eta: float) -> str:
    """``Epoch 3/10 - Loss: 0.123456 | Time: 12.3ms | Samples/s: 81234.50 | ETA: 1s`` (1-based epoch;
    ETA rounded to whole seconds as Loom does)."""
    return (
        f"Epoch {epoch}/{epochs} - Loss: {loss:.6f} | Time: {format_duration(epoch_time)} | "
        f"Samples/s: {samples_per_second:.2f} | ETA: {format_duration(round(eta))}"
    )


class EpochLinePrinter(Observer):
    """Prints Loom's epoch line at the end of every epoch (``verbose`` training)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        line = format_epoch_line(
            epoch + 1,
            trainer.epochs,
            logs["loss"],
            logs["epoch_time"],
            logs["samples_per_second"],
            logs["eta"],
        )
        print(line, file=self.stream or sys.stdout, flush=True)
