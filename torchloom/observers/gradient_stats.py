"""``print_gradient_stats(model)``: per layer min, max, mean and L2 norm of the weight gradients
(Loom's documented ``network.PrintGradientStats()``: "look for zeros (vanishing) or huge values
(exploding)"). The numbers come from ``Network.gradient_stats()``; this only lays them out."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["print_gradient_stats", "format_gradient_stats"]


def _network(model: Any) -> Any:
    """``model`` itself, or a trainer's ``model``: whichever has ``gradient_stats()``."""
    for candidate in (model, getattr(model, "model", None)):
        if callable(getattr(candidate, "gradient_stats", None)):
            return candidate
    raise TypeError(
        "print_gradient_stats: model must be a torchloom Network (or a trainer holding one), "
        f"got {type(model).__name__}; wrap a single layer as Network(layer)"
    )


def format_gradient_stats(model: Any) -> list[str]:
    """The lines ``print_gradient_stats`` prints: a header, then one line per layer that has a
    gradient (all its parameters' gradients taken together, from ``Network.gradient_stats()``)."""
    stats = _network(model).gradient_stats()
    if not stats:
        return ["Gradient statistics: no gradients yet (run a backward pass or a training step first)"]
    lines = ["Gradient statistics (per layer, weight and bias gradients together):"]
    for s in stats:
        lines.append(
            f"  Layer {s['layer']} ({s['type']}): min={s['min']:.6g} max={s['max']:.6g} "
            f"mean={s['mean']:.6g} norm={s['norm']:.6g}"
        )
    return lines


def print_gradient_stats(model: Any, stream: TextIO | None = None) -> None:
    """Print per-layer ``min``, ``max``, ``mean`` and L2 ``norm`` of the gradients stored in
    ``.grad`` (after ``Network.backward`` or a training step).

    Args:
        model: a torchloom ``Network`` (or a trainer: its ``model``).
        stream: where to print (default ``sys.stdout``).
    """
    print("\n".join(format_gradient_stats(model)), file=stream or sys.stdout)
