"""The training engine: one loop that runs every credit-assignment rule.

``train(model, data, TrainingConfig(...))`` builds a ``Trainer`` around the method that
``TrainingConfig.method`` names (``engine/method.py``: the protocol a method implements and the
registry that finds it by name) and runs it with everything else the engine owns: data in any form
(``data.py``, ``batches.py``), validation and metrics (``evaluate.py``, ``metrics.py``), NaN/Inf and
weight guards (``guards.py``), schedules, checkpoints and exact resume (``checkpoint.py``), mixed
precision, data-parallel training (``distributed.py``), and the CUDA device path with graph capture
(``cuda_path.py``). The engine imports no method: methods import the engine.
"""

from .config import TrainingConfig, resolve_method
from .evaluate import evaluate, predict
from .graphed_step import GraphedStep, make_graphed_step
from .loop import Trainer
from .losses import LOSS_TYPES, compute_loss, loss_and_grad, loss_gradient
from .method import Method, RateHolder, method_names, register_method
from .metrics import METRIC_NAMES, MetricSet
from .train import make_trainer, train
from .types import DivergenceWarning, StepOutput, StepStatus, TrainingBatch, TrainingResult

__all__ = [
    "train", "make_trainer", "Trainer", "TrainingConfig", "TrainingResult", "TrainingBatch", "StepOutput",
    "StepStatus", "DivergenceWarning", "Method", "RateHolder", "register_method", "method_names", "resolve_method",
    "evaluate", "predict", "MetricSet", "METRIC_NAMES", "LOSS_TYPES", "compute_loss", "loss_and_grad",
    "loss_gradient", "GraphedStep", "make_graphed_step",
]
