"""``train()`` and its config/result types, losses, optimizers, schedules, and Loom's trainers."""

from .graphed_step import GraphedStep, make_graphed_step
from .loop import DivergenceWarning, StepOutput, StepStatus, Trainer, TrainingBatch, TrainingResult
from .losses import LOSS_TYPES, compute_loss, loss_and_grad, loss_gradient
from .optim import SGD, AdamW, RMSprop, flatten_optimizer_, make_optimizer
from .schedules import SCHEDULES, Schedule, ScheduleLR
from .target_prop import (
    TargetPropConfig,
    TargetPropState,
    TargetPropTrainer,
    apply_target_prop_gaps,
    estimate_input_target,
    target_prop_backward,
    target_prop_forward,
)
from .backprop import BackpropTrainer
from .config import TrainingConfig
from .train import make_trainer, train
from .tween import TweenConfig, TweenState, TweenTrainer
from .data import Batches, as_batch_iterable, predict_inputs
from .evaluate import evaluate, predict
from .metrics import METRIC_NAMES, MetricSet

__all__ = [
    "StepOutput",
    "StepStatus",
    "DivergenceWarning",
    "Trainer",
    "TrainingBatch",
    "TrainingResult",
    "LOSS_TYPES",
    "compute_loss",
    "loss_and_grad",
    "loss_gradient",
    "SGD",
    "AdamW",
    "RMSprop",
    "make_optimizer",
    "flatten_optimizer_",
    "Schedule",
    "ScheduleLR",
    "SCHEDULES",
    "BackpropTrainer",
    "TrainingConfig",
    "train",
    "make_trainer",
    "TargetPropConfig",
    "TargetPropState",
    "TargetPropTrainer",
    "target_prop_forward",
    "target_prop_backward",
    "apply_target_prop_gaps",
    "estimate_input_target",
    "TweenConfig",
    "TweenState",
    "TweenTrainer",
    "GraphedStep",
    "make_graphed_step",
    "Batches",
    "as_batch_iterable",
    "predict_inputs",
    "evaluate",
    "predict",
    "MetricSet",
    "METRIC_NAMES",
]
