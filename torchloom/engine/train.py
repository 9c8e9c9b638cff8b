"""``torchloom.train()``: Loom's one-call ``Train()`` API, for every method of the engine.

    result = torchloom.train(model, batches, TrainingConfig(epochs=10, learning_rate=0.01, loss_type="mse"))
    result = torchloom.train(model, batches, TrainingConfig(method="tween"))

``TrainingConfig.method`` picks the method (a registered name, a method's config, or a
``torchloom.Method`` of your own); every method runs the engine's one loop (``loop.Trainer.fit``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..layers.base import Layer
from ..layers.network import Network
from .config import _ALIASES, TrainingConfig, as_network, resolve_device
from .._settings import unknown_setting
from .loop import Trainer
from .types import TrainingResult

__all__ = ["TrainingConfig", "train", "make_trainer", "resolve_device", "as_network"]

def train(model: Network | Layer | Sequence[Layer] | torch.nn.Module | Callable[[], torch.nn.Module], batches: Any, config: TrainingConfig | None = None, **overrides: Any) -> TrainingResult:
    """Train ``model`` on ``batches`` with the method ``config.method`` names (backprop by default) and
    return a ``TrainingResult``.

        result = torchloom.train(net, (X, Y), TrainingConfig(epochs=10, batch_size=32, optimizer="adam"))
        result = torchloom.train(net, loader, epochs=5, loss_type="cross_entropy", metrics=["accuracy"])

    Args:
        model: a torchloom ``Network`` (or a layer / list of layers, wrapped in one), any
            ``nn.Module``, or a zero-argument callable that builds one (``lambda: Network(...)``, or
            an ``nn.Module`` subclass whose constructor takes no argument):
            called after ``torch.manual_seed(config.seed)`` when a seed is set, so that the seed
            covers the weights' initialisation; the model built is ``result.model``.
        batches: the training data, in any of these forms (inputs ``[batch, ...]``, targets as
            ``config.loss_type`` needs: the output's shape, or class labels ``[batch]`` for
            cross-entropy):

            * a list of ``(input, target)`` pairs or ``TrainingBatch``es: ready-made batches, moved to
              the device once, not per epoch;
            * a pair ``(X, Y)`` of tensors or NumPy arrays (anything ``torch.as_tensor`` takes),
              ``X`` a tuple ``(X1, X2, ...)`` for a model of several inputs: cut into batches of
              ``config.batch_size`` rows (32 by default), in a new order every epoch with
              ``config.shuffle``;
            * a ``torch.utils.data.Dataset`` of ``(x, y)`` items (batched the same way) or a
              ``DataLoader`` yielding pairs (streamed).
        config: a ``TrainingConfig`` (every field documented there: ``help(TrainingConfig)``);
            keyword ``overrides`` replace its fields (``train(net, data, epochs=5,
            loss_type="cross_entropy")``; an unknown keyword names the closest field).

    Returns:
        a ``TrainingResult``: ``final_loss``, ``loss_history`` (one loss per epoch), ``history``
        (every epoch log: ``loss``, the metrics, ``val_*``, ``lr``, ...), ``model`` (the model
        trained) and timings.

    The model is moved to the training device (``use_gpu`` / ``device``) and left there, in train
    mode; observers such as ``EarlyStopping`` and ``Checkpoint`` watch the run, and
    ``torchloom.load_checkpoint(path)`` loads a checkpoint back for inference. Bad settings or
    batches raise ``ValueError``/``TypeError`` naming the setting or batch before any weight
    changes; an epoch that diverges is reported (``DivergenceWarning``, ``logs["diverged"]``), never
    taken for the best.
    """
    config = config if config is not None else TrainingConfig()
    if not isinstance(config, TrainingConfig):
        raise TypeError(f"config must be a TrainingConfig, got {type(config).__name__}")
    if overrides:
        names = [f.name for f in dataclasses.fields(TrainingConfig)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(unknown_setting("train()", unknown[0], names, _ALIASES))
        config = dataclasses.replace(config, **overrides)
    config.validate()  # fields changed after construction are checked too
    is_class = isinstance(model, type)
    if (is_class and issubclass(model, torch.nn.Module)) or (callable(model) and not is_class and not isinstance(model, (torch.nn.Module, list, tuple))):
        model = _build(model, config.seed)  # a factory (or an nn.Module class): built under the seed
    trainer = make_trainer(as_network(model), config)
    result = trainer.fit(batches, config.epochs, track_perf=config.track_perf)
    result.model = model
    return result


def _build(factory: Callable[[], Any], seed: int | None) -> torch.nn.Module:
    """The model ``factory()`` builds, after ``torch.manual_seed(seed)`` when a seed is set (so the
    seed covers the weights' initialisation too)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        name = getattr(factory, "__name__", type(factory).__name__)
        raise TypeError(f"model: the factory {name!r} must return an nn.Module (e.g. a torchloom Network), got {type(model).__name__}")
    return model


def make_trainer(model: Network, config: TrainingConfig) -> Trainer:
    """The engine's ``Trainer`` for ``config``, with the method ``config.method`` names (resolved through
    the method registry, or the ``Method`` object given there)."""
    return Trainer(model, config)
