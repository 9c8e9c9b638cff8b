"""Learning-rate schedules (SPEC §7): ``get_lr(step)`` functions, and ``ScheduleLR``, the
``LRScheduler`` that applies one to any torch optimizer (stepped once per batch by ``train()``)."""

from __future__ import annotations

from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["ScheduleLR"]


class ScheduleLR(LRScheduler):
    """Set every group's lr to ``schedule(step)`` (0-based step = number of ``.step()`` calls so far).

    ``schedule`` is any callable ``step -> lr`` or an object with ``get_lr(step)``."""

    def __init__(self, optimizer: Optimizer, schedule: Callable[[int], float], last_epoch: int = -1) -> None:
        fn = getattr(schedule, "get_lr", schedule)
        if not callable(fn):
            raise TypeError(f"schedule must be callable step -> lr or have get_lr(step), got {type(schedule).__name__}")
        self.schedule = fn
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        lr = float(self.schedule(self.last_epoch))
        return [lr for _ in self.optimizer.param_groups]
