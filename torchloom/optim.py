"""``torchloom.optim``: SGD (momentum, Nesterov), AdamW and RMSprop as
``torch.optim.Optimizer``s, numerically as ``torch.optim``, with fused update kernels on CUDA."""

from .trainers.optim import OPTIMIZERS, SGD, AdamW, RMSprop, flatten_optimizer_, make_optimizer

__all__ = ["SGD", "AdamW", "RMSprop", "OPTIMIZERS", "make_optimizer", "flatten_optimizer_"]
