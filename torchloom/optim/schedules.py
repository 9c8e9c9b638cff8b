"""Learning-rate schedules (Loom ``nn/scheduler.go``): ``get_lr(step)`` objects, and
``ScheduleLR``, the ``LRScheduler`` that applies one to any torch optimizer (stepped once per batch by
``train()``; ``train(..., scheduler=cosine_annealing(0.1, 0.001, 1000))`` wraps it for you).

``step`` is 0-based: the first batch trains with ``get_lr(0)``.

| schedule | lr(step) |
|---|---|
| ``constant(lr)`` | lr |
| ``linear_decay(lr0, lr_final, total)`` | lr0 + (lr_final − lr0)·step/total; lr_final from ``total`` on |
| ``cosine_annealing(lr0, lr_min, total)`` | lr_min + (lr0 − lr_min)(1 + cos(π·step/total))/2; lr_min from ``total`` on |
| ``cosine_warm_restarts(lr0, lr_min, period)`` | the cosine over (step mod period)/period |
| ``exponential_decay(lr0, rate, decay_steps)`` | lr0 · rate^(step/decay_steps) |
| ``step_decay(lr0, gamma, step_size)`` | lr0 · gamma^⌊step/step_size⌋ |
| ``polynomial_decay(lr0, lr_final, total, power)`` | (lr0 − lr_final)(1 − step/total)^power + lr_final; lr_final from ``total`` on |
| ``warmup(warmup_steps, warmup_lr, base_lr, after=None)`` | warmup_lr + (base_lr − warmup_lr)·step/warmup_steps, then ``after(step − warmup_steps)`` or base_lr |

Each schedule is a frozen dataclass whose arguments are checked when it is made; Loom computes in
float32, torchloom in float64 (the values agree to float32 rounding).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "Schedule",
    "ScheduleLR",
    "constant",
    "linear_decay",
    "cosine_annealing",
    "cosine_warm_restarts",
    "exponential_decay",
    "step_decay",
    "polynomial_decay",
    "warmup",
    "SCHEDULES",
]


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # the schedules are frozen dataclasses


def _check_lr(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{type(obj).__name__}: {name} must be a finite learning rate >= 0, got {value!r}")
    _set(obj, name, float(value))  # plain Python numbers: state_dict() loads with weights_only=True


def _check_steps(obj: Any, name: str, minimum: int = 1) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{type(obj).__name__}: {name} must be an int >= {minimum}, got {value!r}")
    _set(obj, name, int(value))


def _check_positive(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{type(obj).__name__}: {name} must be a finite number > 0, got {value!r}")
    _set(obj, name, float(value))


class Schedule:
    """Base of the schedules: ``get_lr(step) -> float`` for a 0-based step; calling the schedule is
    the same. ``scheduler(optimizer)`` wraps it as an ``LRScheduler``."""

    def get_lr(self, step: int) -> float:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"{type(self).__name__}.get_lr: step must be an int >= 0, got {step!r}")
        return float(self._lr(int(step)))

    def __call__(self, step: int) -> float:
        return self.get_lr(step)

    def scheduler(self, optimizer: Optimizer) -> ScheduleLR:
        """This schedule as an ``LRScheduler`` of ``optimizer`` (``.step()`` once per batch)."""
        return ScheduleLR(optimizer, self)

    def _lr(self, step: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class constant(Schedule):  # noqa: N801 - Loom's schedule names
    """``lr`` at every step."""

    lr: float
    """The rate of every step (> 0)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr")

    def _lr(self, step: int) -> float:
        return self.lr


@dataclass(frozen=True)
class linear_decay(Schedule):  # noqa: N801
    """From ``lr0`` at step 0 linearly to ``lr_final`` at step ``total``, then ``lr_final``."""

    lr0: float
    """The rate at step 0 (> 0)."""
    lr_final: float
    """The rate at step ``total`` and after (> 0)."""
    total: int
    """Steps of the decay (>= 1)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr0")
        _check_lr(self, "lr_final")
        _check_steps(self, "total")

    def _lr(self, step: int) -> float:
        if step >= self.total:
            return self.lr_final
        return self.lr0 + (self.lr_final - self.lr0) * (step / self.total)


@dataclass(frozen=True)
class cosine_annealing(Schedule):  # noqa: N801
    """Half a cosine from ``lr0`` at step 0 to ``lr_min`` at step ``total``, then ``lr_min``."""

    lr0: float
    """The rate at step 0 (> 0)."""
    lr_min: float
    """The rate at step ``total`` and after (> 0)."""
    total: int
    """Steps of the half cosine (>= 1)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr0")
        _check_lr(self, "lr_min")
        _check_steps(self, "total")

    def _lr(self, step: int) -> float:
        if step >= self.total:
            return self.lr_min
        return self.lr_min + (self.lr0 - self.lr_min) * (1.0 + math.cos(math.pi * step / self.total)) / 2.0


@dataclass(frozen=True)
class cosine_warm_restarts(Schedule):  # noqa: N801
    """The cosine from ``lr0`` towards ``lr_min`` over ``period`` steps, restarting at ``lr0`` every
    ``period`` steps."""

    lr0: float
    """The rate at the start of every period (> 0)."""
    lr_min: float
    """The rate the cosine falls towards within a period (> 0)."""
    period: int
    """Steps between restarts (>= 1)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr0")
        _check_lr(self, "lr_min")
        _check_steps(self, "period")

    def _lr(self, step: int) -> float:
        progress = (step % self.period) / self.period
        return self.lr_min + (self.lr0 - self.lr_min) * (1.0 + math.cos(math.pi * progress)) / 2.0


@dataclass(frozen=True)
class exponential_decay(Schedule):  # noqa: N801
    """``lr0 · rate^(step/decay_steps)``: multiplied by ``rate`` every ``decay_steps``, smoothly."""

    lr0: float
    """The rate at step 0 (> 0)."""
    rate: float
    """The factor the rate is multiplied by every ``decay_steps`` steps (> 0)."""
    decay_steps: int
    """Steps over which the rate is multiplied by ``rate`` once (>= 1)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr0")
        _check_positive(self, "rate")
        _check_steps(self, "decay_steps")

    def _lr(self, step: int) -> float:
        return self.lr0 * self.rate ** (step / self.decay_steps)


@dataclass(frozen=True)
class step_decay(Schedule):  # noqa: N801
    """``lr0 · gamma^⌊step/step_size⌋``: multiplied by ``gamma`` every ``step_size`` steps."""

    lr0: float
    """The rate of the first ``step_size`` steps (> 0)."""
    gamma: float
    """The factor the rate is multiplied by every ``step_size`` steps (> 0)."""
    step_size: int
    """Steps between two drops of the rate (>= 1)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr0")
        _check_positive(self, "gamma")
        _check_steps(self, "step_size")

    def _lr(self, step: int) -> float:
        return self.lr0 * self.gamma ** (step // self.step_size)


@dataclass(frozen=True)
class polynomial_decay(Schedule):  # noqa: N801
    """``(lr0 − lr_final)(1 − step/total)^power + lr_final`` up to ``total``, then ``lr_final``."""

    lr0: float
    """The rate at step 0 (> 0)."""
    lr_final: float
    """The rate at step ``total`` and after (> 0)."""
    total: int
    """Steps of the decay (>= 1)."""
    power: float = 1.0
    """The exponent of ``(1 − step/total)`` (> 0; 1 = linear)."""

    def __post_init__(self) -> None:
        _check_lr(self, "lr0")
        _check_lr(self, "lr_final")
        _check_steps(self, "total")
        _check_positive(self, "power")

    def _lr(self, step: int) -> float:
        if step >= self.total:
            return self.lr_final
        return (self.lr0 - self.lr_final) * (1.0 - step / self.total) ** self.power + self.lr_final


@dataclass(frozen=True)
class warmup(Schedule):  # noqa: N801
    """Linear warm-up from ``warmup_lr`` (step 0) towards ``base_lr`` over ``warmup_steps`` steps; then
    ``after(step − warmup_steps)`` (any schedule or callable ``step -> lr``) or ``base_lr``."""

    warmup_steps: int
    """Steps of the linear warm-up (>= 0; 0 = none)."""
    warmup_lr: float
    """The rate at step 0 (> 0)."""
    base_lr: float
    """The rate the warm-up reaches, kept after it when there is no ``after`` (> 0)."""
    after: Schedule | Callable[[int], float] | None = None
    """The schedule after the warm-up, called with ``step − warmup_steps``; ``None`` = ``base_lr``."""

    def __post_init__(self) -> None:
        _check_steps(self, "warmup_steps", minimum=0)
        _check_lr(self, "warmup_lr")
        _check_lr(self, "base_lr")
        if self.after is not None and not callable(getattr(self.after, "get_lr", self.after)):
            raise TypeError(f"warmup: after must be None, a schedule or a callable step -> lr, got {type(self.after).__name__}")

    def _lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * (step / self.warmup_steps)
        if self.after is not None:
            return float(getattr(self.after, "get_lr", self.after)(step - self.warmup_steps))
        return self.base_lr


# Loom's scheduler names (``nn/scheduler.go``) → the schedule.
SCHEDULES: dict[str, type[Schedule]] = {
    "constant": constant,
    "linear_decay": linear_decay,
    "cosine_annealing": cosine_annealing,
    "cosine_warm_restarts": cosine_warm_restarts,
    "exponential_decay": exponential_decay,
    "step_decay": step_decay,
    "polynomial_decay": polynomial_decay,
    "warmup": warmup,
}


def _spec(schedule: Any) -> dict[str, Any] | None:
    """A torchloom schedule as plain data (``{"name": ..., <field>: number, ...}``, nested for
    ``warmup.after``), or ``None`` for anything else (a function, a user's class)."""
    if type(schedule) not in SCHEDULES.values():
        return None
    spec: dict[str, Any] = {"name": type(schedule).__name__}
    for f in fields(schedule):
        value = getattr(schedule, f.name)
        if f.name == "after":
            if value is not None:
                inner = _spec(value)
                if inner is None:
                    return None  # a callable ``after`` cannot be stored as data
                value = inner
        spec[f.name] = value
    return spec


def _from_spec(spec: Any) -> Schedule:
    """The schedule ``_spec`` described; ``ValueError`` for a malformed description."""
    if not isinstance(spec, dict) or spec.get("name") not in SCHEDULES:
        raise ValueError(
            f"ScheduleLR.load_state_dict: 'schedule' must be None or a dict with 'name' one of {sorted(SCHEDULES)}, "
            f"got {spec!r}"
        )
    params = {k: v for k, v in spec.items() if k != "name"}
    if params.get("after") is not None:
        params["after"] = _from_spec(params["after"])
    try:
        return SCHEDULES[spec["name"]](**params)
    except TypeError as e:
        raise ValueError(f"ScheduleLR.load_state_dict: bad parameters for {spec['name']}: {e}") from None


class ScheduleLR(LRScheduler):
    """Set every group's lr to ``schedule(step)`` (0-based step = number of ``.step()`` calls so far).

    ``schedule`` is any callable ``step -> lr`` or an object with ``get_lr(step)``. A group whose lr
    is a tensor is updated in place (``LRScheduler`` does), so a captured CUDA graph reading it sees
    the new value.

    ``state_dict()`` holds only numbers, lists, booleans, strings and dicts, so it loads back with
    ``torch.load(..., weights_only=True)``: the step count, the base and last lrs, and the schedule
    as ``{"name": ..., <parameter>: number}`` (``None`` for a schedule that is a plain function, which
    ``load_state_dict`` then keeps as it is). ``load_state_dict`` rebuilds a described schedule, so
    a restored scheduler continues exactly where the saved one stopped."""

    def __init__(self, optimizer: Optimizer, schedule: Callable[[int], float], last_epoch: int = -1) -> None:
        fn = getattr(schedule, "get_lr", schedule)
        if not callable(fn):
            raise TypeError(f"schedule must be callable step -> lr or have get_lr(step), got {type(schedule).__name__}")
        self.schedule = fn
        self._source = schedule
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        lr = float(self.schedule(self.last_epoch))
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"ScheduleLR: the schedule gave lr={lr!r} at step {self.last_epoch}; it must be finite and >= 0")
        return [lr for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedule", "_source")}
        state["schedule"] = _spec(self._source)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"ScheduleLR.load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
        state = dict(state_dict)
        spec = state.pop("schedule", None)
        state.pop("_source", None)
        state.pop("optimizer", None)
        if callable(spec):  # a state_dict from an older torchloom held the function itself
            self._source, self.schedule = spec, spec
        elif spec is not None:
            schedule = _from_spec(spec)
            self._source, self.schedule = schedule, schedule.get_lr
        self.__dict__.update(state)
