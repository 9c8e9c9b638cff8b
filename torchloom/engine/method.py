"""The method protocol: what a credit-assignment rule gives the engine, and what it gets back.

A **method** is the rule that turns a batch into an update of the weights: backpropagation,
TargetProp, Tweening, or a rule of your own. It is one object, a subclass of ``Method``, holding its
settings, its state and its step; the engine (``torchloom.engine.Trainer``) does everything else the
same way for every method: data in any form, validation and metrics, observers and verbose levels,
NaN/Inf and weight guards (every update is checked and undone when it overflows), schedules,
checkpoints with exact resume, mixed precision, data-parallel training and the CUDA device path with
graph capture. A method knows nothing of epochs, observers, data forms or graph capture.

What a method implements:

* ``step(x, y) -> StepOutput``: one update on the host from one checked batch (``x`` on the training
  device; ``y`` class labels or a target), returning the **pre-update** loss, a ``StepStatus``
  (``NAN_LOSS`` when the loss is not finite: nothing changed; ``NAN_GRAD`` when the update direction
  is not finite: nothing changed) and optional per-step logs (plain floats, averaged per epoch);
* optionally ``step_from_forward(x, y, out, saved)``: the same step when the caller has already run
  the forward at the current weights (the live loop serves with it, ``torchloom.live``); by default
  it calls ``step``;
* ``state_tensors()``: the tensors besides the trainable parameters that an update changes (momentum,
  optimizer state): the engine snapshots them with the parameters before each update and puts both
  back when the update produced a non-finite value;
* ``state_dict()`` / ``load_state_dict(state)``: what goes into a checkpoint besides the model and
  the schedule (keys of your choosing; tensors, numbers, strings, lists and dicts);
* ``schedulable()``: the ``torch.optim.Optimizer`` whose ``param_groups[i]["lr"]`` a schedule drives:
  an optimizer of the method's, or a ``RateHolder`` for a method with its own update rule.

Optionally, ``update_direction(x, y)``: the direction the step on ``(x, y)`` would move the trainable
parameters along, computed without changing anything (``Backprop`` and its subclasses: the rule's
gradient), which the alignment diagnostics (``TrainingConfig.alignment_every``) compare with the exact
gradient; without it they measure the change the step applied.

Optionally, the **device step** (CUDA, every decision in device tensors, no host read, so the runner
can capture it in a CUDA graph): ``device_ready()`` returns True, ``device_setup(runner)`` lays out
buffers once, and ``device_step(x, y, slot, runner)`` runs one step using the runner's three services
(``runner.decide(slot, loss_partials, sq_partials, clip_norm)``, ``with runner.guard_update(slot):``
around the update, ``runner.log(slot, values)`` for ``device_log_names``).

Distribution: under ``torch.distributed`` (``self.dist`` is then the engine's ``DistContext``, else
``None``) a method all-reduces exactly what makes its update equal to one process's update on the
global batch, with ``self.dist.all_reduce_(tensors, "sum" | "mean")``: gradients (mean), update
directions summed over samples (sum), the loss and per-step statistics. The engine shards the data,
agrees every decision across ranks and writes files on rank 0 only.

The engine's services, available once the engine has bound the method (``bind``): ``model`` (a
``Network``), ``device``, ``dtype``, ``dist``, ``clip`` / ``clip_mode`` (``TrainingConfig.gradient_clip``),
``training`` (the ``TrainingConfig``), ``observe_outputs(out, y)`` (feeds the training metrics) and
``layer_events()`` (per-layer observer events, ``None`` when nobody listens).

Registering: ``register_method(MyRule)`` makes ``TrainingConfig(method="my_rule")`` build one; a method
object can also be given directly, ``TrainingConfig(method=MyRule(...))``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..kernels._update import coalesce
from ..optim.optimizers import rehome
from .guards import finite_flag
from .types import StepOutput

DEFAULT_LR = 0.01  # an optimizer given by name when TrainingConfig.learning_rate is None ("not set")

__all__ = [
    "Method", "RateHolder", "register_method", "method_names", "method_class", "flatten_tensors_", "as_flat",
    "all_finite",
]


class Method:
    """Base class of a credit-assignment rule (see the module docstring for the protocol).

    Class attributes a subclass sets:

    * ``name``: the registry name (``TrainingConfig(method=name)``), e.g. ``"backprop"``;
    * ``config_type``: the dataclass of its settings, if it has one (``TargetPropConfig``); a config
      instance given as ``TrainingConfig.method`` then selects this method;
    * ``uses_optimizer``: whether ``TrainingConfig.optimizer`` applies (a rule with its own update,
      like TargetProp's momentum, refuses any optimizer but the default);
    * ``rate_field``: the field of its config that holds its learning rate, if any;
    * ``losses``: the ``loss_type`` names it can train on (``None``: any the engine knows), with
      ``loss_hint`` saying why in the refusal; a config with a ``loss_type`` field of its own may name
      the loss instead of the ``TrainingConfig`` (``loss_of``);
    * ``device_log_names``: the per-step logs its device step writes (``runner.log``);
    * ``multi_input``: whether it trains models of several inputs (batches ``((x1, x2, ...), y)``,
      ``model(*inputs)``); ``custom_loss``: whether it takes ``TrainingConfig.loss_fn``;
      ``accumulates``: whether it takes ``TrainingConfig.accumulate_grad_batches`` > 1 (backprop all
      three; a method that needs the one input tensor and its own loss refuses them);
    * ``compiles``: whether it takes ``TrainingConfig.compile`` (its step differentiates the model
      with autograd, which ``torch.compile`` can trace; backprop only: a rule that calls the layers'
      hand-written backward directly refuses it).

    A method object is bound to one training run at a time (``bind``): its state is built then.
    """

    name: ClassVar[str] = ""
    config_type: ClassVar[type | None] = None
    uses_optimizer: ClassVar[bool] = False
    rate_field: ClassVar[str | None] = None
    losses: ClassVar[tuple[str, ...] | None] = None
    loss_hint: ClassVar[str] = ""
    device_log_names: tuple[str, ...] = ()
    multi_input: ClassVar[bool] = False
    custom_loss: ClassVar[bool] = False
    accumulates: ClassVar[bool] = False
    compiles: ClassVar[bool] = False
    engine: Any = None

    # ------------------------------------------------------------------ building
    def __init__(self, config: Any = None) -> None:
        """A method with a ``config_type`` keeps ``config`` (default settings when ``None``), checked
        to be of that type and valid; one without takes no settings."""
        kind = type(self).config_type
        if kind is None:
            if config is not None:
                raise TypeError(f"{type(self).__name__}: takes no config, got {type(config).__name__}")
            return
        config = kind() if config is None else config
        if not isinstance(config, kind):
            raise TypeError(f"{type(self).__name__}: config must be a {kind.__name__}, got {type(config).__name__}")
        config.validate()
        self.config = config

    @classmethod
    def config_from_training(cls, training: Any) -> Any:
        """The method's settings when ``TrainingConfig.method`` names it: by default ``config_type()``
        (or ``None`` without a config type). Override to take fields of the ``TrainingConfig`` (its
        ``learning_rate``, say: ``None`` when the user did not set it, the method's own default)."""
        return cls.config_type() if cls.config_type is not None else None

    @classmethod
    def check_training(cls, training: Any, config: Any) -> None:
        """Raise ``ValueError`` when ``training`` (a ``TrainingConfig``) asks for something this method
        cannot do with ``config`` (its settings). The base refuses, for a method with its own update
        rule (``uses_optimizer`` False), an optimizer other than the default, ``optimizer_options`` and
        float16 loss scaling; ``compile`` for a method that is not ``compiles``;
        a loss it cannot train on (``losses``) or a config's ``loss_type`` that disagrees with the
        ``TrainingConfig``'s; and, for a method whose config holds its rate (``rate_field``), a
        ``learning_rate`` given (any number; ``None`` is "not set") that disagrees with it (one rate, one
        place)."""
        label = cls.display_name(config)
        if getattr(training, "loss_fn", None) is not None and not cls.custom_loss:
            raise ValueError(
                f"TrainingConfig: loss_fn is for backprop; method {label} trains on its own loss "
                "(set loss_type, or use method='backprop')"
            )
        if getattr(training, "accumulate_grad_batches", 1) != 1 and not cls.accumulates:
            raise ValueError(
                f"TrainingConfig: accumulate_grad_batches={training.accumulate_grad_batches!r} is for backprop; "
                f"method {label} updates the weights from every batch by its own rule (leave it at 1)"
            )
        if getattr(training, "compile", False) and not cls.compiles:
            raise ValueError(
                f"TrainingConfig: compile is for backprop; method {label} runs the layers' hand-written backward (or "
                "its own) directly, outside autograd, which torch.compile does not trace (leave compile=False)"
            )
        if not cls.uses_optimizer:
            if not (isinstance(training.optimizer, str) and training.optimizer.lower() == "sgd"):
                raise ValueError(
                    f"TrainingConfig: optimizer={training.optimizer!r} cannot be used with method {label}: it "
                    "updates the weights with its own momentum rule (leave optimizer='sgd')"
                )
            if getattr(training, "optimizer_options", None):
                raise ValueError(
                    f"TrainingConfig: optimizer_options cannot be used with method {label}: it updates the weights "
                    "with its own momentum rule (its settings are in its config)"
                )
            if training.precision == "16-mixed":
                raise ValueError(
                    f"TrainingConfig: precision='16-mixed' (float16 with loss scaling) is for backprop; {label} "
                    "updates from its own rule, not from a scaled loss: use 'bf16-mixed'"
                )
        own = getattr(config, "loss_type", None) if config is not None and not isinstance(config, Method) else None
        if own is not None and training.loss_type != "mse" and training.loss_type != own:  # ("mse": the default)
            raise ValueError(
                f"TrainingConfig: loss_type={training.loss_type!r} disagrees with the {type(config).__name__}'s "
                f"loss_type={own!r}; set the loss in one place"
            )
        loss = own or training.loss_type
        if cls.losses is not None and not (isinstance(loss, str) and loss in cls.losses):
            raise ValueError(
                f"TrainingConfig: loss_type={loss!r} cannot be used with {cls.__name__}"
                f"{', ' + cls.loss_hint if cls.loss_hint else ''}: use one of {', '.join(map(repr, cls.losses))}"
            )
        if cls.rate_field is not None and config is not None and not isinstance(config, Method):
            rate = getattr(config, cls.rate_field)
            if training.learning_rate is not None and training.learning_rate != rate:
                own = " (the config's own default)" if rate is None else ""
                raise ValueError(
                    f"TrainingConfig: learning_rate={training.learning_rate!r} disagrees with the method config's "
                    f"{cls.rate_field}={rate!r}{own}; set the rate in the {type(config).__name__} only"
                )

    @staticmethod
    def loss_of(training: Any, config: Any) -> Any:
        """The loss a run trains on: its config's own ``loss_type`` when it has one, else the
        ``TrainingConfig``'s."""
        return getattr(config, "loss_type", None) or training.loss_type

    @classmethod
    def display_name(cls, config: Any = None) -> str:
        """How messages name the method: its config's class, else its registry name."""
        if config is not None and not isinstance(config, Method):
            return type(config).__name__
        return repr(cls.name or cls.__name__)

    @classmethod
    def from_training(cls, training: Any, config: Any) -> "Method":
        """The method object a run of ``training`` uses, with settings ``config``."""
        return cls(config) if cls.config_type is not None else cls()

    def bind(self, engine: Any) -> None:
        """Attach the method to the engine of a run, which exists with its device, model and settings;
        a subclass builds its state here (after ``super().bind(engine)``)."""
        self.engine = engine

    # ----------------------------------------------------------- engine services
    @property
    def model(self) -> Any:
        return self.engine.model

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def dist(self) -> Any:
        return self.engine.dist

    @property
    def clip(self) -> float:
        return self.engine.clip

    @property
    def clip_mode(self) -> str:
        return self.engine.clip_mode

    @property
    def training(self) -> Any:
        return self.engine.training

    @property
    def kernel_backend(self) -> str | None:
        """The engine's choice of kernels for fused device steps (None: Triton on CUDA)."""
        return self.engine.kernel_backend

    def observe_outputs(self, output: Tensor, target: Tensor) -> None:
        """Feed a step's (pre-update) outputs to the training metrics, if any (no host read)."""
        self.engine.observe_outputs(output, target)

    def layer_events(self) -> Any:
        """Per-layer observer events for this step (``.forward(i, layer, out)`` /
        ``.backward(i, layer, grad)``, or ``run_forward`` / ``run_backward``), or ``None`` when no
        observer listens (then take the lean path)."""
        return self.engine.layer_events()

    # --------------------------------------------------------------------- hooks
    def schedulable(self) -> torch.optim.Optimizer | None:
        """The optimizer whose learning rate a schedule drives (``None``: the method has no rate)."""
        return None

    def convert_batch(self, x: Any, y: Any, index: int) -> tuple[Tensor, Tensor]:
        """One batch on the training device, checked: by default as the engine's
        ``prepare_batch`` (tensors, batch sizes, the model's output shape) and, for class labels,
        their shape and range against the output (``losses.check_target`` with ``"mse"`` targets of
        the output's shape otherwise)."""
        from .losses import check_target, is_label_target

        where = f"batch {index}: "
        x, y, out_shape = self.engine.prepare_batch(x, y, where)
        try:
            check_target(out_shape, y, "cross_entropy" if is_label_target(y) else "mse")
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        return x, y

    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement step(x, y) -> StepOutput")

    def step_from_forward(self, x: Tensor, y: Tensor, out: Tensor, saved: Any) -> StepOutput:
        """``step(x, y)`` for a caller that has just run ``out, saved = model.forward_saved(x)`` at the
        current weights (the live loop's serve forward, ``torchloom.live``). A method whose update
        starts from that forward reuses it (backprop); by default the step runs its own forward."""
        return self.step(x, y)

    def state_tensors(self) -> list[Tensor]:
        """Tensors besides the trainable parameters that an update changes (guarded with them)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """The method's part of a checkpoint (besides the model and the schedule)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what ``state_dict`` returned (the whole checkpoint's training state is given)."""

    def eval_loss_type(self) -> Any:
        """The loss ``val_loss`` reports: the one the training loss reports (``TrainingConfig.loss_type``)."""
        return self.training.loss_type

    def setup(self) -> None:
        """Called once data and checkpoint are checked, before the model moves to the training device."""

    def update_direction(self, x: Tensor, y: Tensor) -> list[Tensor] | None:
        """The direction this method's step on ``(x, y)`` would move the trainable parameters along,
        one tensor per trainable parameter (the update subtracts it: for a gradient rule, its estimate
        of the gradient, before the optimizer), computed without changing anything; ``None`` (the
        default): the engine's alignment diagnostics (``TrainingConfig.alignment_every``) measure the
        change the step applies instead."""
        return None

    def diagnose(self) -> str | None:
        """At an epoch's end: a sentence saying how the run collapsed, if the method sees it (the
        engine then reports the epoch as diverged), else ``None``. The engine itself watches the loss
        and the weights' norm."""
        return None

    # ---------------------------------------------------------------- device step
    def device_ready(self) -> bool:
        """Whether this method has a device step (decisions in device tensors, no host read)."""
        return False

    def device_kernel_modules(self) -> list[str]:
        """Kernel modules (dotted names) the device step launches, imported on a helper thread while
        the run gets ready."""
        return []

    def device_setup(self, runner: Any) -> None:
        """Lay out what the device step needs once the runner exists."""

    def device_step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no device step")

    def guarded_device_tensors(self) -> list[Tensor] | None:
        """What a device update changes, as few tensors as possible (``None``: the parameters and
        ``state_tensors()``)."""
        return None

    def device_epoch_begin(self, runner: Any, epoch: int) -> None:
        """Before an epoch's device steps (not while graphs are captured)."""

    def device_epoch_tensors(self) -> list[Tensor]:
        """Device tensors to read back with the epoch's one host sync (given to ``device_epoch_end``)."""
        return []

    def device_epoch_end(
        self, runner: Any, losses: list[float], statuses: list[int], logs: list[list[float]] | None,
        values: list[list[float]],
    ) -> None:
        """After the epoch's one host read: the per-step losses, statuses (0 = counted), logs and the
        values of ``device_epoch_tensors()``; bring host-side state up to date."""


class RateHolder(torch.optim.Optimizer):
    """The learning rate of a method that updates the weights with its own rule (TargetProp,
    Tweening), held as an optimizer's param group so that any ``LRScheduler`` or torchloom schedule
    drives it (``param_groups[0]["lr"]``) and the graph runner can point it at a device lr table.
    Its ``step`` does nothing: the method reads the rate each step."""

    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        super().__init__(list(params), {"lr": lr})
        # the method "steps" every batch: tell LRScheduler so (its order warning checks this flag)
        self._opt_called = True

    def step(self, closure: Any = None) -> None:  # noqa: D102 - the method applies its own update
        return None

    @property
    def lr(self) -> Any:
        """The current rate (a float, or a 0-d device tensor inside a captured step)."""
        return self.param_groups[0]["lr"]


# ------------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[Method]] = {}
_ALIASES: dict[str, str] = {}


def _key(name: str) -> str:
    return name.lower().replace("-", "_")


def register_method(cls: type[Method], *aliases: str) -> type[Method]:
    """Make ``TrainingConfig(method=cls.name)`` (or an alias) build ``cls``; returns ``cls`` (usable as a
    class decorator). Raises ``ValueError`` for a name taken by another class (the same class defined
    again, by module and qualified name, replaces its earlier definition)."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register_method: expected a subclass of torchloom.Method, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise ValueError(f"register_method: {cls.__name__}.name must be a non-empty string, got {cls.name!r}")
    for name in (cls.name, *aliases):
        key = _key(name)
        taken = _REGISTRY.get(_ALIASES.get(key, key))
        # the same class defined again (a re-run notebook cell, a reloaded module) takes its name back
        if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"register_method: the name {name!r} is taken by {taken.__module__}.{taken.__qualname__}; "
                "choose another name for " + f"{cls.__module__}.{cls.__qualname__}"
            )
    _REGISTRY[_key(cls.name)] = cls
    for alias in aliases:
        _ALIASES[_key(alias)] = _key(cls.name)
    return cls


def method_names() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(_REGISTRY)


def method_class(spec: Any) -> tuple[type[Method], Any] | None:
    """``(class, config)`` for a ``TrainingConfig.method`` given as a registered name, a registered
    method's config instance, a ``Method`` instance or a ``Method`` subclass; ``None`` for anything
    else. A name's config is left ``None`` (``config_from_training`` builds it)."""
    if isinstance(spec, str):
        key = _key(spec)
        cls = _REGISTRY.get(_ALIASES.get(key, key))
        return None if cls is None else (cls, None)
    if isinstance(spec, Method):
        return type(spec), spec
    if isinstance(spec, type) and issubclass(spec, Method):
        return spec, None
    for cls in _REGISTRY.values():
        if cls.config_type is not None and isinstance(spec, cls.config_type):
            return cls, spec
    return None


# ------------------------------------------------------------- flat layouts
@torch.no_grad()
def flatten_tensors_(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Re-home ``tensors`` (same dtype and device) as consecutive views of one new buffer holding the
    same values, re-pointing ``.data`` so every holder keeps its object; returns the views."""
    tensors = list(tensors)
    if len(tensors) < 2 or any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors):
        return tensors
    views = rehome([t.data for t in tensors])
    for t, v in zip(tensors, views):
        t.data = v
    return tensors


def as_flat(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``[flat]`` when ``tensors`` are consecutive views of one buffer (``flatten_tensors_``), else
    ``tensors``: the guard and the multi-tensor ops then touch one tensor."""
    tensors = [t for t in tensors if t.numel()]
    flat = coalesce(tensors) if len(tensors) > 1 else None
    return flat[0] if flat is not None else tensors


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """``finite_flag`` read on the host (one sync)."""
    return bool(finite_flag(tensors))
