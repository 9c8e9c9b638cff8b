"""``train()`` and its config/result types, losses, optimizers, schedules, and Loom's trainers."""

from .loop import StepOutput, StepStatus, Trainer, TrainingBatch, TrainingResult
from .losses import LOSS_TYPES, compute_loss, loss_and_grad, loss_gradient
from .optim import SGD, make_optimizer
from .schedules import ScheduleLR
from .train import BackpropTrainer, TrainingConfig, train

__all__ = [
    "StepOutput",
    "StepStatus",
    "Trainer",
    "TrainingBatch",
    "TrainingResult",
    "LOSS_TYPES",
    "compute_loss",
    "loss_and_grad",
    "loss_gradient",
    "SGD",
    "make_optimizer",
    "ScheduleLR",
    "BackpropTrainer",
    "TrainingConfig",
    "train",
]
