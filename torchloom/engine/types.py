"""The engine's vocabulary: what a step reports, what a run returns, and the messages of its guards.

Every method and the engine share these types; it imports nothing of the engine (only the
``History`` observer), so any module can use them without an import circle.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..observers.history import History

__all__ = [
    "StepStatus", "StepOutput", "EpochOutcome", "TrainingBatch", "TrainingResult", "DivergenceWarning",
    "NAN_LOSS_MESSAGE", "NAN_GRAD_MESSAGE", "NAN_WEIGHTS_MESSAGE", "MESSAGES", "INT_DTYPES", "user_stacklevel",
    "batch_rows",
]

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

NAN_LOSS_MESSAGE = "⚠️ Fatal NaN/Inf loss in epoch {epoch}. Skipping epoch."
NAN_GRAD_MESSAGE = "⚠️ Fatal NaN/Inf gradients in epoch {epoch}. Skipping batch updates."
NAN_WEIGHTS_MESSAGE = "⚠️ Non-finite weights after an update in epoch {epoch}. Update undone."
MESSAGES = {"nan_loss": NAN_LOSS_MESSAGE, "nan_grad": NAN_GRAD_MESSAGE, "nan_weights": NAN_WEIGHTS_MESSAGE}


class StepStatus(enum.Enum):
    OK = "ok"
    NAN_LOSS = "nan_loss"
    NAN_GRAD = "nan_grad"
    NAN_WEIGHTS = "nan_weights"  # the update made a weight or state non-finite: it was undone


class DivergenceWarning(RuntimeWarning):
    """An epoch in which no batch counted (every loss or update was non-finite, or no batch came):
    its loss is reported as NaN. Issued whatever the ``verbose`` level."""


class StepOutput(NamedTuple):
    """What one training step reports: the pre-update ``loss``, its ``status`` and optional extra
    per-step numbers (``logs``, plain floats, averaged into the epoch logs)."""

    loss: float
    status: StepStatus = StepStatus.OK
    logs: dict[str, float] | None = None


@dataclass
class TrainingBatch:
    """One batch: ``input [batch, ...]`` and ``target`` (same leading batch size)."""

    input: Tensor
    target: Tensor


@dataclass
class TrainingResult:
    """What a training run returns (Loom's ``TrainingResult`` plus torchloom's extras).

    ``final_loss``: the last epoch's loss; ``total_time``: seconds; ``loss_history``: one loss per
    epoch (NaN for an epoch in which no batch counted: see ``DivergenceWarning``); ``epoch_times``:
    seconds per epoch; ``samples_per_second``: real samples/s over the run; ``skipped_batches``:
    batches that did not count (NaN/Inf loss, NaN/Inf gradients, an update undone because it made a
    weight non-finite, and batches an abandoned epoch did not reach); ``skipped_per_epoch``: the same,
    epoch by epoch; ``history``: every epoch log (``History``); ``perf``: per-epoch samples/s and mean
    step time when ``track_perf`` was set; ``model``: the model ``train()`` trained (the one a model
    factory built)."""

    final_loss: float
    total_time: float
    loss_history: list[float]
    epoch_times: list[float]
    samples_per_second: float = 0.0
    skipped_batches: int = 0
    history: History = field(default_factory=History)
    perf: list[dict[str, float]] | None = None
    skipped_per_epoch: list[int] = field(default_factory=list)
    model: Any = None  # the model trained (by ``train()``: the one a model factory built, too)


@dataclass
class EpochOutcome:
    """What one epoch of steps produced: the sum and count of counted (finite, applied) batch losses,
    batches run (reached), samples in them, updates skipped, and sums of extra per-step logs."""

    loss_sum: float = 0.0
    counted: int = 0
    batches_run: int = 0
    samples: int = 0
    skipped: int = 0
    extra_sums: dict[str, float] = field(default_factory=dict)
    schedule_steps: int = 0  # per-batch schedule steps taken (once per update)

    def add(self, loss: float, logs: dict[str, float] | None = None) -> None:
        self.loss_sum += loss
        self.counted += 1
        for k, v in (logs or {}).items():
            self.extra_sums[k] = self.extra_sums.get(k, 0.0) + v


def batch_rows(x: Tensor | tuple[Tensor, ...]) -> int:
    """Rows of an input batch: ``x.shape[0]``, or the first tensor's for a model of several inputs
    (a tuple ``(x1, x2, ...)``, every one ``[batch, ...]``)."""
    return (x[0] if isinstance(x, tuple) else x).shape[0]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # torchloom/


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller of this function that names the first
    frame outside torchloom: the user's ``train()`` / ``fit()`` call, however deep the engine's own
    calls go."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level
