"""``torchloom.optim``: optimizers with fused update kernels on CUDA (SPEC §6)."""

from .trainers.optim import OPTIMIZERS, SGD, AdamW, RMSprop, flatten_optimizer_, make_optimizer

__all__ = ["SGD", "AdamW", "RMSprop", "OPTIMIZERS", "make_optimizer", "flatten_optimizer_"]
