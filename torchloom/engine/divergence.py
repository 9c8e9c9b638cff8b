"""Divergence is never silent: the engine's per-epoch watch for a run that is blowing up or collapsed.

A NaN/Inf loss or update is caught step by step (the guards); this catches the finite blow-ups that pass
them. At the end of each epoch an epoch **diverged** when

* its loss is more than ``factor`` times the larger of the run's first epoch loss and its best epoch
  loss so far (a finite blow-up: 482 → 1.6e8). Against the larger of the two, a loss that falls far
  and then wobbles (1e-4 → 1e-3) is no alarm; the first epoch itself is judged by the weights;
* its loss is above the run's first epoch loss and more than ``REGRESSION`` (1.1) times its best epoch
  loss: training is undoing its progress (a collapse towards chance stays bounded: a digits network
  going from 1.40 back to 1.66, 2.02, 2.07 while its accuracy fell from 54 % to 18 %). An epoch's mean
  loss includes the untrained start of the first epoch, so a run that learns stays below it;
* the weights' L2 norm is more than ``factor`` times the norm at the start of the run, or
* the method reports a collapse (``Method.diagnose``: Tweening's layers that pass no signal at all),
* more than half of its batches were skipped by the NaN/Inf guards (the few that counted make its
  loss; one run skipped 4,095 of 4,096 batches and reported 0.0),

or when no batch counted (its loss is NaN). Such an epoch raises a ``DivergenceWarning`` naming the
epoch, what grew and the likely cause (the learning rate), has ``diverged = 1.0`` in its logs and the
history, and is never an improvement for ``EarlyStopping`` / ``Checkpoint``. ``TerminateOnDivergence``
stops training there. ``factor`` is ``TrainingConfig.divergence_factor`` (default 10; 0 switches the
loss and weight tests off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["DivergenceWatch", "weight_norm", "REGRESSION"]

REGRESSION = 1.1  # a loss above the first epoch's and this many times the best: training undoes its progress


@torch.no_grad()
def weight_norm(params: Sequence[Tensor]) -> float:
    """The L2 norm of ``params`` together, in float64 (one host read)."""
    params = [p for p in params if p.numel()]
    if not params:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in params])))


class DivergenceWatch:
    """The watch of one run (see the module docstring). ``start(params)`` at the run's start (after a
    resume's restore), ``check(...)`` at each epoch's end; ``state_dict`` / ``load_state_dict`` carry
    the best loss and the starting norm across a resume."""

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)
        self.best = math.inf
        self.best_epoch: int | None = None
        self.first = math.nan  # the run's first epoch loss
        self.start_norm: float | None = None

    def start(self, params: Sequence[Tensor]) -> None:
        if self.start_norm is None and self.factor > 0:
            self.start_norm = weight_norm(params)

    def check(self, epoch: int, loss: float, params: Sequence[Tensor], counted: bool, collapse: str | None = None,
              skipped: int = 0, batches: int = 0) -> list[str]:
        """The reasons epoch ``epoch`` (0-based) diverged, empty when it did not. The run's first
        finite epoch loss is kept as a reference; a finite loss that did not diverge becomes the new
        best when it is lower."""
        reasons = []
        finite = [v for v in (self.first, self.best) if math.isfinite(v) and v > 0]
        ref = max(finite) if finite else math.nan
        if not counted:
            reasons.append("no batch counted: every loss, gradient or update was non-finite")
        elif self.factor > 0 and math.isfinite(ref) and loss > self.factor * ref:
            where = "its first epoch" if ref == self.first else f"epoch {self.best_epoch + 1}, its best"
            reasons.append(f"the loss grew from {ref:.4g} ({where}) to {loss:.4g}, more than {self.factor:g}×")
        elif (self.factor > 0 and math.isfinite(self.first) and math.isfinite(self.best) and self.best_epoch is not None
              and self.best > 0 and loss > self.first and loss > REGRESSION * self.best):
            reasons.append(
                f"the loss rose from {self.best:.4g} (epoch {self.best_epoch + 1}, its best) to {loss:.4g}, above its first "
                f"epoch's {self.first:.4g}: training is undoing its progress"
            )
        if self.factor > 0 and self.start_norm:
            norm = weight_norm(params)
            if norm > self.factor * self.start_norm:
                reasons.append(f"the weights' norm grew from {self.start_norm:.4g} to {norm:.4g}, more than {self.factor:g}× the start's")
        if counted and 2 * skipped > batches:
            reasons.append(f"{skipped} of its {batches} batches were skipped (non-finite loss, gradients or weights)")
        if collapse:
            reasons.append(collapse)
        if counted and math.isfinite(loss) and math.isnan(self.first):
            self.first = loss
        if not reasons and counted and math.isfinite(loss) and loss < self.best:
            self.best, self.best_epoch = loss, epoch
        return reasons

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "first": self.first, "start_norm": self.start_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch, self.first, self.start_norm = state["best"], state["best_epoch"], state["first"], state["start_norm"]
