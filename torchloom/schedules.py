"""``torchloom.schedules``: Loom's learning-rate schedules (constant, decays, warm restarts, warm-up) as
``get_lr(step)`` objects, and ``ScheduleLR``, which applies one to any torch optimizer.

The schedules live in ``torchloom.optim.schedules`` (with the optimizers they drive); this name is
the same module's public face, kept because ``torchloom.schedules`` is where users look."""

from .optim.schedules import (
    SCHEDULES,
    Schedule,
    ScheduleLR,
    constant,
    cosine_annealing,
    cosine_warm_restarts,
    exponential_decay,
    linear_decay,
    polynomial_decay,
    step_decay,
    warmup,
)

__all__ = [
    "Schedule",
    "ScheduleLR",
    "SCHEDULES",
    "constant",
    "linear_decay",
    "cosine_annealing",
    "cosine_warm_restarts",
    "exponential_decay",
    "step_decay",
    "polynomial_decay",
    "warmup",
]
