"""``torchloom.optim``: the optimizers and the learning-rate schedules.

* SGD (momentum, Nesterov), AdamW and RMSprop as ``torch.optim.Optimizer``s, numerically as
  ``torch.optim``, with fused update kernels on CUDA (``optimizers.py``);
* Loom's schedules as ``get_lr(step)`` objects and ``ScheduleLR`` (``schedules.py``, also
  importable as ``torchloom.schedules``).
"""

from . import schedules
from .optimizers import OPTIMIZERS, SGD, AdamW, FusedOptimizer, RMSprop, flatten_optimizer_, make_optimizer

__all__ = ["SGD", "AdamW", "RMSprop", "FusedOptimizer", "OPTIMIZERS", "make_optimizer", "flatten_optimizer_", "schedules"]
