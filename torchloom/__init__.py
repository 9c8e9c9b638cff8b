"""torchloom: Loom's training semantics for PyTorch.

Loom's layers as ``nn.Module``s with hand-written backwards, its one-call ``train()`` API, Target
Propagation and Neural Tweening, on CPU and on CUDA through fused Triton kernels. Importing torchloom
imports torch only: no Triton, no GPU work, no other side effect.

Quick start::

    import torch, torchloom
    from torchloom import Dense, Network, TrainingConfig

    net = Network(Dense(1, 1))
    c = torch.tensor([[-40.], [-10.], [0.], [8.], [15.], [38.]])
    batches = [(c / 100, (1.8 * c + 32) / 100)]
    result = torchloom.train(net, batches, TrainingConfig(epochs=2000, learning_rate=0.5, verbose=False))
"""

from . import optim
from .layers import (
    ACTIVATIONS,
    Activation,
    Dense,
    DenseFunction,
    Layer,
    LayerFunction,
    LayerRecord,
    Network,
    Sequential,
    activation_names,
    dense,
    get_activation,
)
from .observers import History, Observer
from .trainers import (
    LOSS_TYPES,
    BackpropTrainer,
    StepOutput,
    StepStatus,
    Trainer,
    TrainingBatch,
    TrainingConfig,
    TrainingResult,
    compute_loss,
    loss_and_grad,
    loss_gradient,
    train,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "optim",
    # layers
    "ACTIVATIONS",
    "Activation",
    "activation_names",
    "get_activation",
    "Layer",
    "LayerFunction",
    "LayerRecord",
    "Dense",
    "DenseFunction",
    "dense",
    "Network",
    "Sequential",
    # losses
    "LOSS_TYPES",
    "compute_loss",
    "loss_and_grad",
    "loss_gradient",
    # training
    "train",
    "TrainingConfig",
    "TrainingBatch",
    "TrainingResult",
    "Trainer",
    "BackpropTrainer",
    "StepOutput",
    "StepStatus",
    # observers
    "Observer",
    "History",
]
