"""Console output of training progress: Loom's epoch lines, an in-place progress bar on a terminal,
and Go's duration formatting the epoch lines use.

``verbose`` levels (``TrainingConfig.verbose``, Keras' convention): 0 silent; 1 ``ProgressObserver``
(bar within the epoch when stdout is a terminal, plus the epoch lines); 2 ``EpochLinePrinter`` (the
epoch lines only). When stdout is not a terminal (a log file, a notebook capture, CI) level 1 prints
just the epoch lines: redrawing with ``\r`` there would leave one line per redraw.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from .base import Observer

__all__ = ["EpochLinePrinter", "ProgressObserver", "format_duration", "format_epoch_line"]


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


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


class ProgressObserver(EpochLinePrinter):
    """Verbose level 1: a progress bar redrawn in place within each epoch (batches done, running
    mean loss, samples/s) followed by Loom's epoch line; just the epoch lines when the stream is not
    a terminal.

    Args:
        stream: where to print (default ``sys.stdout``).
        bar: draw the bar; ``None`` (default) = only when ``stream`` is a terminal.
        width: characters of the bar itself.
        interval: seconds between redraws (the last batch of an epoch always redraws); 0.1 s
            keeps a fast loop from spending its time printing.

    The bar needs every batch's loss, so only when it is drawn does this observer have an
    ``on_batch_end`` hook; otherwise the trainer sees no per-batch listener and does no per-batch
    work for it (no host sync on GPU).
    """

    def __init__(self, stream: TextIO | None = None, bar: bool | None = None, width: int = 30, interval: float = 0.1) -> None:
        super().__init__(stream)
        if bar is not None and not isinstance(bar, bool):
            raise TypeError(f"ProgressObserver: bar must be a bool or None (auto), got {bar!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"ProgressObserver: width must be an int >= 1, got {width!r}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval >= 0:
            raise ValueError(f"ProgressObserver: interval must be a number of seconds >= 0, got {interval!r}")
        self.bar = _is_terminal(stream or sys.stdout) if bar is None else bar
        self.width = width
        self.interval = float(interval)
        if self.bar:  # an instance attribute: observers without a bar have no per-batch hook at all
            self.on_batch_end = self._update_bar
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self._start = time.perf_counter()
        self._last_draw = -math.inf
        self._batches = 0
        self._samples = 0.0
        self._loss_sum = 0.0
        self._drawn = 0  # length of the bar line on screen, to erase it

    def on_epoch_begin(self, trainer: Any, epoch: int) -> None:
        self._reset_epoch()

    def _update_bar(self, trainer: Any, step: int, logs: dict[str, float]) -> None:
        self._batches += 1
        self._samples += logs.get("batch_size", 0.0)
        self._loss_sum += logs["loss"]
        total = getattr(trainer, "steps_per_epoch", None)
        now = time.perf_counter()
        if now - self._last_draw < self.interval and self._batches != total:
            return
        self._last_draw = now
        self._draw(self.format_bar(trainer.epoch + 1, trainer.epochs, self._batches, total,
                                   self._loss_sum / self._batches, self._samples / max(now - self._start, 1e-9)))

    def format_bar(self, epoch: int, epochs: int, done: int, total: int | None, loss: float, samples_per_second: float) -> str:
        """``Epoch 3/10 12/50 [=======>......................] - loss: 0.123456 - 81234.50 samples/s``
        (1-based epoch; ``12 batches`` in place of the bar when the epoch length is unknown)."""
        if total:
            filled = min(self.width, self.width * done // total)
            arrow = ">" if filled < self.width else ""
            body = "=" * max(filled - len(arrow), 0) + arrow
            progress = f"{done}/{total} [{body.ljust(self.width, '.')}]"
        else:
            progress = f"{done} batches"
        return f"Epoch {epoch}/{epochs} {progress} - loss: {loss:.6f} - {samples_per_second:.2f} samples/s"

    def _draw(self, text: str) -> None:
        out = self.stream or sys.stdout
        out.write("\r" + text.ljust(self._drawn))
        out.flush()
        self._drawn = len(text)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if self._drawn:  # erase the bar; the epoch line takes its place
            out = self.stream or sys.stdout
            out.write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        super().on_epoch_end(trainer, epoch, logs)
