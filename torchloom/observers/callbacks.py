"""``EarlyStopping`` and ``Checkpoint``: the callbacks users of Keras and Lightning expect, as
observers. Both watch one key of the epoch logs (``monitor``, default ``"loss"``) and use only the
trainer interface: ``trainer.model`` and ``trainer.stop_training``.

Note: the epoch ``loss`` is the mean of the batches' **pre-update** losses (Loom's definition), so the
weights kept as "best" are those at the end of the best epoch, one update past the last loss counted
in it — the same convention as Keras' training-loss monitoring.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from .base import Observer

__all__ = ["EarlyStopping", "Checkpoint"]

_MODES = ("min", "max")


class _Monitor:
    """Tracks the best value of one log key: ``improved(value)`` says whether ``value`` beats the
    best so far by more than ``min_delta`` (down for ``"min"``, up for ``"max"``) and records it."""

    def __init__(self, owner: str, monitor: str, mode: str, min_delta: float) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"{owner}: monitor must be the name of an epoch log key such as 'loss', got {monitor!r}")
        if mode not in _MODES:
            raise ValueError(f"{owner}: mode must be one of {_MODES}, got {mode!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(f"{owner}: min_delta must be a finite number >= 0, got {min_delta!r}")
        self.owner = owner
        self.monitor = monitor
        self.mode = mode
        self.min_delta = float(min_delta)
        self.reset()

    def reset(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch: int | None = None

    def value(self, logs: dict[str, float]) -> float:
        if self.monitor not in logs:
            raise ValueError(
                f"{self.owner}: monitor {self.monitor!r} is not in the epoch logs; available keys: {sorted(logs)}"
            )
        return float(logs[self.monitor])

    def improved(self, value: float, epoch: int) -> bool:
        if math.isnan(value):  # a NaN epoch is never the best one
            return False
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best = value
            self.best_epoch = epoch
        return better


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model.state_dict()`` on the model's own device (no host transfer, no sync)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class EarlyStopping(Observer):
    """Stops training when ``monitor`` has not improved for ``patience`` epochs in a row.

    Args:
        monitor: the epoch log key to watch.
        patience: stop after this many epochs in a row without improvement (>= 1; Lightning's
            default 3 rides out a short plateau).
        min_delta: an improvement must beat the best value by more than this.
        mode: ``"min"`` (loss-like) or ``"max"`` (accuracy-like).
        restore_best: at the end of training, load the weights of the best epoch back into the
            model (kept as an on-device copy of ``state_dict()`` at each improvement).

    After training: ``stopped_epoch`` (0-based epoch at which it stopped, ``None`` if it never did),
    ``best`` (best monitored value), ``best_epoch`` (0-based).
    """

    def __init__(
        self,
        monitor: str = "loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "min",
        restore_best: bool = True,
    ) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an int >= 1, got {patience!r}")
        if not isinstance(restore_best, bool):
            raise TypeError(f"EarlyStopping: restore_best must be a bool, got {restore_best!r}")
        self._monitor = _Monitor("EarlyStopping", monitor, mode, min_delta)
        self.monitor = monitor
        self.patience = patience
        self.restore_best = restore_best
        self._reset()

    def _reset(self) -> None:
        self._monitor.reset()
        self.wait = 0
        self.stopped_epoch: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None

    @property
    def best(self) -> float:
        return self._monitor.best

    @property
    def best_epoch(self) -> int | None:
        return self._monitor.best_epoch

    def on_train_begin(self, trainer: Any) -> None:
        self._reset()

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        if self._monitor.improved(self._monitor.value(logs), epoch):
            self.wait = 0
            if self.restore_best:
                self.best_state = _snapshot(trainer.model)
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            trainer.stop_training = True

    def on_train_end(self, trainer: Any, result: Any) -> None:
        if self.restore_best and self.best_state is not None:
            trainer.model.load_state_dict(self.best_state)


class Checkpoint(Observer):
    """Saves ``trainer.model.state_dict()`` with ``torch.save`` at the end of an epoch: the best so
    far by ``monitor`` (``save_best_only=True``) or every epoch (overwriting ``path``).

    The file is written beside ``path`` and then renamed over it, so an interrupted save never
    leaves a truncated checkpoint. Load with ``model.load_state_dict(torch.load(path))``.

    Args:
        path: the file to write.
        monitor: the epoch log key that decides "best".
        save_best_only: save only when ``monitor`` improves (else every epoch).
        mode: ``"min"`` or ``"max"``.
        min_delta: an improvement must beat the best value by more than this.

    After training: ``best``, ``best_epoch`` (0-based) and ``saved_epochs`` (every epoch saved).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        monitor: str = "loss",
        save_best_only: bool = True,
        mode: str = "min",
        min_delta: float = 0.0,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Checkpoint: path must be a str or os.PathLike, got {type(path).__name__}")
        if not isinstance(save_best_only, bool):
            raise TypeError(f"Checkpoint: save_best_only must be a bool, got {save_best_only!r}")
        self._monitor = _Monitor("Checkpoint", monitor, mode, min_delta)
        self.path = os.fspath(path)
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.saved_epochs: list[int] = []

    @property
    def best(self) -> float:
        return self._monitor.best

    @property
    def best_epoch(self) -> int | None:
        return self._monitor.best_epoch

    def on_train_begin(self, trainer: Any) -> None:
        self._monitor.reset()
        self.saved_epochs = []

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        improved = self._monitor.improved(self._monitor.value(logs), epoch)
        if improved or not self.save_best_only:
            tmp = self.path + ".tmp"
            torch.save(trainer.model.state_dict(), tmp)
            os.replace(tmp, self.path)
            self.saved_epochs.append(epoch)
