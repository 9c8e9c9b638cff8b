"""``ConsoleObserver``: Loom's per-layer console lines (Loom poly ``observer.go``).

    [FWD] (0,0,0,0) Dense: avg=0.1234 max=0.9876 active=120/128
    [BWD] (0,0,0,0) Dense: grad_avg=0.0012 grad_max=0.0345

The four numbers are the layer's grid position (z, y, x, l); the forward line describes the layer's
output, the backward line the gradient w.r.t. the layer's input (see ``layer_stats``). Loom defines
this observer but its training loops never call it; torchloom's trainers do.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .base import Observer, is_main_process
from .layer_stats import LayerEvent

__all__ = ["ConsoleObserver", "format_forward_line", "format_backward_line"]


def format_forward_line(event: LayerEvent) -> str:
    """Loom's ``[FWD] (z,y,x,l) Type: avg=%.4f max=%.4f active=%d/%d``."""
    z, y, x, l = event.position
    s = event.stats
    return f"[FWD] ({z},{y},{x},{l}) {event.layer_type}: avg={s.avg:.4f} max={s.max:.4f} active={s.active}/{s.total}"


def format_backward_line(event: LayerEvent) -> str:
    """Loom's ``[BWD] (z,y,x,l) Type: grad_avg=%.4f grad_max=%.4f``."""
    z, y, x, l = event.position
    s = event.stats
    return f"[BWD] ({z},{y},{x},{l}) {event.layer_type}: grad_avg={s.avg:.4f} grad_max={s.max:.4f}"


class ConsoleObserver(Observer):
    """Prints one line per layer per pass, on every ``every``-th training step (steps 0, every,
    2·every, …; a line per layer and step adds up fast, so large runs want ``every`` in the
    hundreds).

    Args:
        every: print on steps whose 0-based global step is a multiple of this (>= 1).
        stream: where to print (default: ``sys.stdout`` at the time of printing).
    """

    def __init__(self, every: int = 1, stream: TextIO | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ConsoleObserver: every must be an int >= 1 (print every N steps), got {every!r}")
        self.every = every
        self.stream = stream

    def on_layer_forward(self, event: LayerEvent) -> None:
        if event.step % self.every == 0 and is_main_process():
            print(format_forward_line(event), file=self.stream or sys.stdout)

    def on_layer_backward(self, event: LayerEvent) -> None:
        if event.step % self.every == 0 and is_main_process():
            print(format_backward_line(event), file=self.stream or sys.stdout)
