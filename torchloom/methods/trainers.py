"""The engine with one built-in method each: ``BackpropTrainer``, ``TargetPropTrainer`` and
``TweenTrainer``, for code written against the per-method trainer classes of earlier releases.

Each is the engine's ``Trainer`` given its method object; nothing here computes anything of its own.
``train(model, data, TrainingConfig(method=...))`` is the one-call way to the same run. The method's
attributes (``trainer.state``, ``trainer.optimizer``, ``trainer.rates``) are reachable on the trainer,
and ``trainer.config`` is the method's settings (the engine's are ``trainer.training``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ..engine.config import TrainingConfig, as_network
from ..engine.loop import Trainer
from ..engine.types import TrainingResult
from ..layers.base import Layer
from ..layers.network import Network
from .backprop import Backprop
from .target_prop import TargetProp, TargetPropConfig
from .tween import Tween, TweenConfig

__all__ = ["BackpropTrainer", "TargetPropTrainer", "TweenTrainer"]


class BackpropTrainer(Trainer):
    """The engine's ``Trainer`` with the ``Backprop`` method (what ``train()`` runs by default); kept for
    code written against the per-method trainer classes. ``trainer.optimizer``, ``trainer.params``
    and the other attributes of the method are reachable on it.

    Args:
        model: a ``Network``.
        config: a ``TrainingConfig``.
    """

    def __init__(self, model: Network, config: TrainingConfig) -> None:
        super().__init__(model, config, Backprop())


# ================================================================================================
# The trainer


class TargetPropTrainer(Trainer):
    """The training engine with the ``TargetProp`` method (what ``train(...,
    TrainingConfig(method="target_prop"))`` runs). ``trainer.step(x, y)`` runs one checked host step;
    ``trainer.fit(batches, epochs)`` the engine's loop. ``trainer.state`` (the ``TargetPropState``),
    ``trainer.config`` (the ``TargetPropConfig``) and ``trainer.rates`` are the method's.

    Args:
        model: a torchloom ``Network`` (or a layer / list of layers, wrapped in one).
        config: a ``TargetPropConfig`` (default settings when ``None``).
        observers, verbose: as ``TrainingConfig``'s (only without ``training``).
        training: the engine's settings, a ``TrainingConfig`` whose ``method`` is ``config`` (what
            ``train()`` passes); default: ``TrainingConfig(method=config, observers=..., verbose=...)``,
            training on the model's device.
    """

    def __init__(
        self,
        model: Network | Layer | Iterable[Layer],
        config: TargetPropConfig | None = None,
        observers: Iterable[Any] = (),
        verbose: bool | int = False,
        *,
        training: Any = None,
    ) -> None:
        _with_method(self, TargetProp(config), model, observers, verbose, training)


class TweenTrainer(Trainer):
    """The training engine with the ``Tween`` method: ``fit(data, epochs)`` runs ``TweenState.step``
    per batch.

    Args:
        model: a ``Network`` (or a torchloom layer / list of layers).
        cfg: a ``TweenConfig`` (defaults when ``None``).
        observers: objects with hook methods (per-layer events included); each ``on_batch_end`` gets ``loss``, ``mean_gap``,
            ``mean_link_budget``, ``explosion`` (1.0 when the step detected one), ``adaptive_rate``,
            ``gap_baseline`` and ``explosion_count`` (the total so far); epoch logs (and the result's
            history) hold their per-epoch means (``explosion``: the fraction of steps that detected one).
        verbose: print Loom's epoch line.
        training: the engine's settings, a ``TrainingConfig`` whose ``method`` is ``cfg`` (what
            ``train()`` passes); default: ``TrainingConfig(method=cfg, observers=..., verbose=...)``.

    ``trainer.state`` is the ``TweenState`` (its histories are per step) and ``trainer.config`` the
    ``TweenConfig``. Training runs on the model's device and dtype; batches are moved there.
    """

    def __init__(
        self,
        model: Network | Layer | Iterable[Layer],
        cfg: TweenConfig | None = None,
        observers: Iterable[Any] = (),
        verbose: bool | int = False,
        *,
        training: Any = None,
    ) -> None:
        _with_method(self, Tween(cfg), model, observers, verbose, training)

    def fit(self, data: Any, epochs: int = 1, *, batch_size: int | None = None, track_perf: bool = False) -> TrainingResult:
        """Train for ``epochs`` passes over ``data`` and return a ``TrainingResult``.

        ``data``: a list of ``(input, target)`` batches (or ``TrainingBatch``es, or a ``DataLoader``);
        or one ``(X [N, ...], Y [N, ...])`` pair of tensors, split in order into batches of
        ``batch_size`` (default 1: online learning, Loom's one ``TweenStep`` per sample; the default
        ``base_rate=None`` then steps at 0.03/16, docs/tweening.md). The
        ``TweenConfig`` is re-validated first (a field changed after construction raises here, before
        anything changes)."""
        self.method.config.validate()
        engine_batches = batch_size is None and self.training.batch_size is not None  # train(..., batch_size=B): the engine cuts (X, Y)
        if isinstance(data, tuple) and len(data) == 2 and all(isinstance(d, Tensor) for d in data) and not engine_batches:
            xs, ys = data
            if xs.dim() == 0 or ys.dim() == 0 or xs.shape[0] != ys.shape[0]:
                raise ValueError(f"data: X and Y must have the same number of samples, got shapes {list(xs.shape)} and {list(ys.shape)}")
            bs = 1 if batch_size is None else batch_size
            if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
                raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
            data = [(xs[j : j + bs], ys[j : j + bs]) for j in range(0, xs.shape[0], bs)]
        elif batch_size is not None:
            raise ValueError("batch_size is only used when data is one (X, Y) pair of tensors")
        return super().fit(data, epochs, track_perf=track_perf)


def _with_method(trainer: Trainer, method: Any, model: Any, observers: Iterable[Any], verbose: bool | int, training: Any) -> None:
    """The engine's ``__init__`` for ``trainer`` with ``method``: its ``TrainingConfig`` is ``training``,
    else one holding the method's settings, ``observers`` and ``verbose`` (given in one place only);
    ``trainer.config`` is the method's settings."""
    if training is None:
        training = TrainingConfig(method=method.config, observers=tuple(observers), verbose=verbose)
    elif tuple(observers) or verbose:
        raise ValueError(f"{type(trainer).__name__}: give observers and verbose in the TrainingConfig (training=...) only")
    Trainer.__init__(trainer, as_network(model), training, method)
    trainer.config = method.config
