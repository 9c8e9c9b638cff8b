"""``History``: the per-epoch logs of a training run, returned inside every trainer's result."""

from __future__ import annotations

from typing import Any

from .base import Observer

__all__ = ["History"]


class History(Observer):
    """Records every ``on_epoch_end`` log: ``history.history["loss"]`` is the list of epoch losses,
    one entry per epoch, and likewise for every other key a trainer logs (Keras' ``History``).

    With ``TrainingConfig(log_every_n_steps=N)`` it also records the per-step logs:
    ``history.step_history["loss"]`` one entry per logged step, at the 0-based global steps
    ``history.steps``."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epochs: list[int] = []
        self.step_history: dict[str, list[float]] = {}
        self.steps: list[int] = []

    def on_step_log(self, trainer: Any, step: int, logs: dict[str, float]) -> None:
        self.steps.append(step)
        for key, value in logs.items():
            self.step_history.setdefault(key, []).append(value)

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None:
        self.epochs.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(value)

    def __getitem__(self, key: str) -> list[float]:
        return self.history[key]

    def __contains__(self, key: str) -> bool:
        return key in self.history

    def keys(self):
        return self.history.keys()

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epochs)}, keys={sorted(self.history)})"
