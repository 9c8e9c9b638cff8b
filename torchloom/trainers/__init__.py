"""``torchloom.trainers``: the names this package had before the engine and the methods were split.

Kept so that code written against earlier releases keeps working; new code imports from
``torchloom`` (the public API), ``torchloom.engine`` (the loop and its protocol),
``torchloom.methods`` (one module per rule) and ``torchloom.optim`` (optimizers and schedules).
Every name here is the same object as there."""

from ..engine import (
    LOSS_TYPES,
    METRIC_NAMES,
    DivergenceWarning,
    GraphedStep,
    MetricSet,
    StepOutput,
    StepStatus,
    Trainer,
    TrainingBatch,
    TrainingConfig,
    TrainingResult,
    compute_loss,
    evaluate,
    loss_and_grad,
    loss_gradient,
    make_graphed_step,
    make_trainer,
    predict,
    train,
)
from ..engine.data import Batches, as_batch_iterable, predict_inputs
from ..methods import (
    BackpropTrainer,
    TargetPropConfig,
    TargetPropState,
    TargetPropTrainer,
    TweenConfig,
    TweenState,
    TweenTrainer,
    apply_target_prop_gaps,
    estimate_input_target,
    target_prop_backward,
    target_prop_forward,
)
from ..optim import SGD, AdamW, RMSprop, flatten_optimizer_, make_optimizer
from ..optim.schedules import SCHEDULES, Schedule, ScheduleLR

__all__ = [
    "StepOutput", "StepStatus", "DivergenceWarning", "Trainer", "TrainingBatch", "TrainingResult", "LOSS_TYPES",
    "compute_loss", "loss_and_grad", "loss_gradient", "SGD", "AdamW", "RMSprop", "make_optimizer",
    "flatten_optimizer_", "Schedule", "ScheduleLR", "SCHEDULES", "BackpropTrainer", "TrainingConfig", "train",
    "make_trainer", "TargetPropConfig", "TargetPropState", "TargetPropTrainer", "target_prop_forward",
    "target_prop_backward", "apply_target_prop_gaps", "estimate_input_target", "TweenConfig", "TweenState",
    "TweenTrainer", "GraphedStep", "make_graphed_step", "Batches", "as_batch_iterable", "predict_inputs",
    "evaluate", "predict", "MetricSet", "METRIC_NAMES",
]
