"""The observer protocol: a base class of no-op hooks, and the dispatcher the trainers use.

Any object with a matching method is an observer; it need not inherit from ``Observer``. Hooks:

* ``on_train_begin(trainer)``, ``on_train_end(trainer, result)``
* ``on_epoch_begin(trainer, epoch)``, ``on_epoch_end(trainer, epoch, logs)``
* ``on_batch_end(trainer, step, logs)`` (every batch: a listener keeps a run off the CUDA device path)
* ``on_step_log(trainer, step, logs)`` (every ``TrainingConfig.log_every_n_steps`` steps: ``loss``,
  ``lr``, the method's step logs, ``skipped``; on the CUDA device path delivered at the epoch's end,
  from its one host read, so it never costs a sync per step)
* ``on_layer_forward(event)``, ``on_layer_backward(event)`` (per layer: ``layer_stats.LayerEvent``)

``epoch`` and ``step`` are 0-based; ``logs`` are plain Python floats. A hook that sets
``trainer.stop_training = True`` ends training after the current epoch.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["Observer", "ObserverList", "HOOKS"]

HOOKS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_end",
    "on_step_log",
    "on_epoch_end",
    "on_train_end",
    "on_layer_forward",
    "on_layer_backward",
)


class Observer:
    """No-op base class; override the hooks you need."""

    def on_train_begin(self, trainer: Any) -> None: ...
    def on_epoch_begin(self, trainer: Any, epoch: int) -> None: ...
    def on_batch_end(self, trainer: Any, step: int, logs: dict[str, float]) -> None: ...
    def on_step_log(self, trainer: Any, step: int, logs: dict[str, float]) -> None: ...
    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict[str, float]) -> None: ...
    def on_train_end(self, trainer: Any, result: Any) -> None: ...
    def on_layer_forward(self, event: Any) -> None: ...
    def on_layer_backward(self, event: Any) -> None: ...


def _implements(obs: Any, hook: str) -> bool:
    """True when ``obs`` has ``hook`` and it is not ``Observer``'s no-op."""
    own = getattr(obs, "__dict__", {})
    if hook in own:  # set on the instance (e.g. ProgressObserver's bar hook, only on a terminal)
        return callable(own[hook])
    method = getattr(type(obs), hook, None)
    if method is None:
        return callable(getattr(obs, hook, None))  # provided by __getattr__
    return method is not getattr(Observer, hook, None)


class ObserverList:
    """Dispatch by method name to the observers that implement a hook.

    ``wants(hook)`` tells the trainer whether anyone listens, so work such as per-layer statistics
    or a per-step host sync is done only when asked for."""

    def __init__(self, observers: Iterable[Any] = ()) -> None:
        self.observers = list(observers)
        for o in self.observers:
            if not any(hasattr(o, h) for h in HOOKS):
                raise TypeError(
                    f"observer {type(o).__name__} has none of the hooks {', '.join(HOOKS)}"
                )
        self._by_hook = {h: [getattr(o, h) for o in self.observers if _implements(o, h)] for h in HOOKS}

    def wants(self, hook: str) -> bool:
        return bool(self._by_hook[hook])

    def __call__(self, hook: str, *args: Any) -> None:
        for fn in self._by_hook[hook]:
            fn(*args)

    def __len__(self) -> int:
        return len(self.observers)


def is_main_process() -> bool:
    """``True`` unless ``torch.distributed`` is initialised and this process's rank is not 0: the
    process that prints and writes files in data-parallel training."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
