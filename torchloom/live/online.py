"""``train_online(model, stream, config)``: test-then-train over a stream, River's
``progressive_val_score`` for torchloom models.

For each ``(x, y)`` of ``stream`` (one sample, or a batch ``[batch, ...]``): the model predicts ``x``
(``LiveTrainer.serve``), the prediction is scored against ``y``, then ``y`` trains the model per the
schedule (``LiveTrainer.learn``). A ``(x, y, phase)`` triple also names the stream's phase (a change
marks a shock in the report). At the end, the samples still waiting are trained (``flush``) and the
``LiveReport`` is returned. ``print_every`` (as River's) prints the running accuracy every that many
samples.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .report import LiveReport
from .trainer import LiveConfig, LiveTrainer

__all__ = ["train_online"]


def train_online(
    model: Any, stream: Iterable[Any], config: LiveConfig | None = None, *, print_every: int = 0,
    report_options: dict[str, Any] | None = None, **fields: Any,
) -> LiveReport:
    """Serve, score and train on every sample of ``stream`` in turn; returns the ``LiveReport``.

    Args:
        model: a ``Network`` (or layers).
        stream: an iterable of ``(x, y)`` or ``(x, y, phase)``.
        config: a ``LiveConfig``; keyword ``fields`` replace its fields.
        print_every: print ``[n] accuracy: a%`` every that many samples (0: never).
        report_options: passed to ``LiveTrainer.report`` (``window_s``, ``window_samples``, ...).
    """
    if isinstance(print_every, bool) or not isinstance(print_every, int) or print_every < 0:
        raise ValueError(f"train_online: print_every must be an int >= 0, got {print_every!r}")
    live = LiveTrainer(model, config, **fields)
    shown = 0
    for k, item in enumerate(stream):
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise ValueError(f"train_online: stream item {k} must be (x, y) or (x, y, phase), got {type(item).__name__}")
        if len(item) == 3:
            live.set_phase(item[2])
        pred, ticket = live.serve(item[0])
        live.learn(ticket, item[1])
        n = len(live.record)
        if print_every and n - shown >= print_every:
            scored = [c for c in live.record.correct if c >= 0]
            print(f"[{n:,d}] accuracy: {100.0 * sum(scored) / max(len(scored), 1):.2f}%")
            shown = n
    live.flush()
    rep = live.report(**(report_options or {}))
    live.observers("on_train_end", live, rep)
    return rep
