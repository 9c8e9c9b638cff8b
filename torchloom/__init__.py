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
    result = torchloom.train(net, batches, TrainingConfig(epochs=1500, learning_rate=0.9, verbose=False))
"""

from . import optim, schedules
from .interop import from_loom_json, load_loom, save_loom, to_loom_json
from .layers import (
    ACTIVATIONS,
    LSTM,
    RNN,
    Activation,
    Conv1D,
    Conv2D,
    Conv3D,
    ConvTranspose1D,
    ConvTranspose2D,
    ConvTranspose3D,
    Dense,
    DenseFunction,
    Embedding,
    Flatten,
    LastStep,
    Layer,
    LayerFunction,
    LayerNorm,
    LayerRecord,
    ModuleLayer,
    MultiHeadAttention,
    Network,
    Parallel,
    Residual,
    RMSNorm,
    Sequential,
    Softmax,
    SwiGLU,
    activation_names,
    dense,
    get_activation,
)
from .layers.summary import summary
from .observers import (
    Checkpoint,
    ConsoleObserver,
    CSVLogger,
    EarlyStopping,
    History,
    LayerEvent,
    LayerStats,
    LossPlot,
    Observer,
    ProgressObserver,
    TensorBoardLogger,
    TerminateOnDivergence,
    print_gradient_stats,
)
from .engine import (
    LOSS_TYPES,
    DivergenceWarning,
    GraphedStep,
    Method,
    MetricSet,
    RateHolder,
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
    method_names,
    predict,
    register_method,
    train,
)
from .lowbit import LOOM_DTYPES, LowBitConfig
from .methods import (
    DFA,
    Backprop,
    BackpropTrainer,
    DFAConfig,
    FastProxy,
    FastProxyConfig,
    FeedbackAlignment,
    FeedbackAlignmentConfig,
    SignSymmetry,
    SignSymmetryConfig,
    TargetProp,
    TargetPropConfig,
    TargetPropState,
    TargetPropTrainer,
    Tween,
    TweenConfig,
    TweenState,
    TweenTrainer,
    apply_target_prop_gaps,
    target_prop_backward,
    target_prop_forward,
)

from ._version import __version__
from .saving import load_checkpoint

# live mode (torchloom.live) is imported on first use: ``import torchloom`` stays cheap
_LAZY = {"LiveTrainer": "torchloom.live", "LiveConfig": "torchloom.live", "train_online": "torchloom.live", "live": "torchloom.live"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchloom' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(module)
    value = mod if name == "live" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "__version__",
    # low-bit training (docs/low-bit.md)
    "LowBitConfig",
    "LOOM_DTYPES",
    "optim",
    "schedules",
    # layers
    "ACTIVATIONS",
    "Activation",
    "activation_names",
    "get_activation",
    "Layer",
    "LayerFunction",
    "LayerRecord",
    "Network",
    "ModuleLayer",
    "Sequential",
    "Dense",
    "DenseFunction",
    "dense",
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "ConvTranspose1D",
    "ConvTranspose2D",
    "ConvTranspose3D",
    "Flatten",
    "RNN",
    "LSTM",
    "LastStep",
    "Embedding",
    "MultiHeadAttention",
    "SwiGLU",
    "RMSNorm",
    "LayerNorm",
    "Softmax",
    "Residual",
    "Parallel",
    # losses
    "LOSS_TYPES",
    "compute_loss",
    "loss_and_grad",
    "loss_gradient",
    # training
    "train",
    "evaluate",
    "predict",
    "summary",
    "MetricSet",
    "TrainingConfig",
    "TrainingBatch",
    "TrainingResult",
    "Trainer",
    "BackpropTrainer",
    "StepOutput",
    "StepStatus",
    "DivergenceWarning",
    "make_graphed_step",
    "GraphedStep",
    # methods as plug-ins
    "Method",
    "RateHolder",
    "register_method",
    "method_names",
    "Backprop",
    "TargetProp",
    "Tween",
    # feedback rules
    "FeedbackAlignment",
    "FeedbackAlignmentConfig",
    "DFA",
    "DFAConfig",
    "SignSymmetry",
    "SignSymmetryConfig",
    "FastProxy",
    "FastProxyConfig",
    # TargetProp
    "TargetPropConfig",
    "TargetPropState",
    "TargetPropTrainer",
    "target_prop_forward",
    "target_prop_backward",
    "apply_target_prop_gaps",
    # Neural Tweening
    "TweenConfig",
    "TweenState",
    "TweenTrainer",
    # observers
    "Observer",
    "History",
    "ProgressObserver",
    "ConsoleObserver",
    "LayerStats",
    "LayerEvent",
    "print_gradient_stats",
    "LossPlot",
    "CSVLogger",
    "TensorBoardLogger",
    "EarlyStopping",
    "Checkpoint",
    "TerminateOnDivergence",
    # saved models
    "load_checkpoint",
    # live mode: serve while training on a stream (imported on first use; the module is torchloom.live)
    "LiveTrainer",
    "LiveConfig",
    "train_online",
    # Loom interop
    "from_loom_json",
    "to_loom_json",
    "load_loom",
    "save_loom",
]
