"""The small-batch scale of the automatic rates (``TweenConfig(base_rate=None)``,
``TargetPropConfig(learning_rate=None)``): a step of ``B`` rows moves ``min(1, B/16)`` of the rate
chosen for mini-batches, the linear scaling rule below 16 rows.

Measured (bench/RESULTS.md §7 run F, CPU, short runs): the rates that meet issue 31's targets at batch 32
and 256 (TargetProp's chain rule 0.1, Tween 0.03) collapse one sample at a time, and the largest rate
that still learns grows about in proportion to the batch up to ~16 rows (Tween on Fashion-MNIST: 0.002
learns at batch 1 where 0.0075 falls to 36 % and 0.01 to chance; 0.01 at batch 4 where 0.03 collapses;
0.03 from batch 8–16)."""

from __future__ import annotations

__all__ = ["SMALL_BATCH_ROWS", "small_batch_scale"]

SMALL_BATCH_ROWS = 16


def small_batch_scale(rows: int) -> float:
    """``min(1, rows/16)``: what an automatic rate is multiplied by for a step of ``rows`` rows (the
    global batch under data-parallel training)."""
    return 1.0 if rows >= SMALL_BATCH_ROWS else rows / SMALL_BATCH_ROWS
