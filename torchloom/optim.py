"""``torchloom.optim``: optimizers with fused update kernels on CUDA (SPEC §6)."""

from .trainers.optim import SGD, OPTIMIZERS, make_optimizer

__all__ = ["SGD", "OPTIMIZERS", "make_optimizer"]
