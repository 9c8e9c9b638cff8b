"""``TrainingConfig``: the settings of ``torchloom.train()``, and the checks every method shares.

``TrainingConfig(method=...)`` chooses the credit-assignment rule that the one training engine runs:
a registered name (``"backprop"``, the default, ``"target_prop"``, ``"tween"``), a method's config
instance (``TargetPropConfig`` / ``TweenConfig``) or a ``torchloom.Method``; every other field applies to every method (observers, verbose levels, seed, device and CUDA
graphs, schedules, clipping, NaN/Inf guards).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..layers.network import Network, chain_of
from ..layers.base import PRECISIONS
from ..optim.optimizers import OPTIMIZERS, check_optimizer_options
from ..observers.base import ObserverList
from ..optim.schedules import ScheduleLR
from .distributed import unwrap_ddp
from .losses import check_loss_type
from .method import DEFAULT_LR, Method, method_class, method_names
from .metrics import MetricSet
from .._settings import closest, python_numbers, settings

__all__ = [
    "TrainingConfig", "CLIP_MODES", "resolve_method", "resolve_device", "as_network", "check_optimizer_params",
    "check_factory_lr", "check_optimizer_device", "check_scheduler", "as_scheduler", "is_plateau", "COMPILE_OPTIONS",
]


CLIP_MODES = ("norm", "value")


def _is_number(v: Any) -> bool:
    """A real number: int, float, a numpy scalar (``numbers.Real``) or a one-element real tensor."""
    if isinstance(v, Tensor):
        return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _as_number(v: Any) -> Any:
    """``v`` as a Python float/int when it is a numpy scalar or a one-element tensor; else unchanged."""
    if isinstance(v, Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
        return float(v)
    return v


# Names other libraries use for TrainingConfig's fields: TrainingConfig(lr=0.1) says "did you mean
# 'learning_rate'?" (Keras, Lightning, plain PyTorch loops).
_ALIASES = {
    "lr": "learning_rate", "learningrate": "learning_rate", "rate": "learning_rate",
    "max_epochs": "epochs", "num_epochs": "epochs", "n_epochs": "epochs", "epoch": "epochs", "nb_epoch": "epochs",
    "loss": "loss_type", "criterion": "loss_fn", "gradient_accumulation_steps": "accumulate_grad_batches",
    "callbacks": "observers", "callback": "observers", "optim": "optimizer", "opt": "optimizer",
    "lr_scheduler": "scheduler", "schedule": "scheduler", "gradient_clip_val": "gradient_clip", "clipnorm": "gradient_clip",
    "clip_grad_norm": "gradient_clip", "max_grad_norm": "gradient_clip", "clipvalue": "clip_mode",
    "gpu": "use_gpu", "cuda": "use_gpu", "gpus": "use_gpu", "accelerator": "device", "val_data": "validation_data",
    "validation": "validation_data", "val_dataloaders": "validation_data", "random_seed": "seed",
    "weight_decay": "optimizer_options", "momentum": "optimizer_options", "betas": "optimizer_options",
    "eps": "optimizer_options", "nesterov": "optimizer_options", "resume": "resume_from", "ckpt_path": "resume_from",
    "torch_compile": "compile", "compiled": "compile",
}


@settings(_ALIASES)
@dataclass
class TrainingConfig:
    """Settings of ``train()`` (Loom's ``TrainingConfig`` in snake_case).

    Every field is checked when the config is built (and again when a run starts, so a field changed
    afterwards is checked too): a bad value is a ``ValueError`` / ``TypeError`` naming the field, the
    value and what is allowed; an unknown keyword names the closest field (``TrainingConfig(lr=0.1)``:
    "did you mean 'learning_rate'?"). Numbers may be NumPy scalars (``np.float32(0.01)``,
    ``np.int64(5)``): they are stored as Python numbers. The training guide (docs/training.md) has
    the same table with examples.
    """

    epochs: int = 10
    """Passes over the batches (>= 1). With ``resume_from`` it counts the whole run, the resumed
    epochs included."""
    learning_rate: float | None = None
    """The rate (a finite number > 0) of an optimizer given by name, and of a method named by
    ``method`` that has its own rule (TargetProp, Tweening). ``None`` (default), not set: a named
    optimizer trains at 0.01 (``DEFAULT_LR``), TargetProp / Tweening take their automatic rate for
    the batch size. Any number, 0.01 included, is used as given. An optimizer instance or factory
    keeps its own rate (a number given beside one must equal it), and so does a method config
    instance (``TargetPropConfig`` / ``TweenConfig``: a number given must equal its rate)."""
    loss_type: str = "mse"
    """The loss every method trains on and logs: ``"mse"``, ``"cross_entropy"`` (logits against class
    labels ``[B]`` or one-hot / soft targets) or ``"crossentropy"`` (Loom poly's loss on
    probabilities); see ``torchloom.LOSS_TYPES``."""
    gradient_clip: float = 0.0
    """0 = off; else the largest global L2 norm of all gradients together, or with
    ``clip_mode="value"`` the largest ``|g|`` of each element (>= 0)."""
    clip_mode: str = "norm"
    """``"norm"`` (Loom's documents: scale every gradient by ``max_norm / norm`` when the norm is
    larger) or ``"value"`` (Loom poly's code: clamp each element to ``±gradient_clip``)."""
    verbose: bool | int = True
    """``0`` / ``False`` silent; ``1`` / ``True`` a progress bar on a terminal plus one line per epoch;
    ``2`` epoch lines only."""
    use_gpu: bool = False
    """Train on ``cuda:<device_id>`` (the model is moved there; see the GPU guide)."""
    device: str | torch.device | None = None
    """An explicit device (``"cpu"``, ``"cuda:1"``); ``None`` = the model's own device (or
    ``cuda:<device_id>`` with ``use_gpu``)."""
    device_id: int = 0
    """Which GPU ``use_gpu=True`` trains on (>= 0)."""
    optimizer: str | Optimizer | Callable[[list[Tensor]], Optimizer] = "sgd"
    """A name (``"sgd"``, ``"momentum"`` = SGD with μ 0.9, ``"adam"``, ``"adamw"``, ``"rmsprop"``; set
    their options in ``optimizer_options``), a ``torch.optim.Optimizer`` built over the model's
    parameters, or a factory ``params -> Optimizer`` such as ``functools.partial(torch.optim.AdamW,
    weight_decay=0.1)``, called with the trainable parameters when the run starts."""
    scheduler: Any = None
    """A learning-rate schedule: ``lr(step)`` (``torchloom.schedules``: ``cosine_annealing(...)``, ...,
    or any callable), an ``LRScheduler`` class or ``functools.partial`` of one (built over the
    optimizer), or an ``LRScheduler`` instance over the optimizer; stepped every batch or epoch
    (``scheduler_interval``). ``None`` = a constant rate."""
    observers: Sequence[Any] = ()
    """Objects with hook methods (``on_epoch_end(trainer, epoch, logs)``, ...): ``EarlyStopping``,
    ``Checkpoint``, ``CSVLogger``, or your own (any object with one of the hooks)."""
    track_perf: bool = False
    """Record per-epoch samples/s and mean step time in ``result.perf``."""
    seed: int | None = None
    """``torch.manual_seed(seed)`` at the start of the run (and the shuffle order): the same run gives
    the same numbers on the same device. ``None`` leaves the random state alone."""
    cuda_graph: bool | None = None
    """On CUDA: ``None`` captures steps in CUDA graphs when possible, ``False`` never, ``True``
    requires it (an error when the run cannot be captured)."""
    method: Any = "backprop"
    """The credit-assignment method: a registered name (``"backprop"``, ``"target_prop"``,
    ``"tween"``, or a rule of your own), a method's config (``TargetPropConfig(...)``,
    ``TweenConfig(...)``) or a ``torchloom.Method``."""
    validation_data: Any = None
    """Data in any form ``train()`` accepts, evaluated after every epoch in eval mode without
    gradients: ``val_loss`` and ``val_<metric>`` in the epoch logs."""
    metrics: Any = ()
    """Metrics logged every epoch: names (``"accuracy"``, ``"binary_accuracy"``, ``"mse"``, ``"mae"``,
    ``"rmse"``), callables ``metric(output, target)``, objects with ``update/compute/reset``, a mapping
    ``{name: metric}`` (the value is the metric: ``{"mse": my_fn}`` logs ``my_fn`` as ``mse``) or a
    ``MetricSet``."""
    batch_size: int | None = None
    """For a ``Dataset`` or arrays ``(X, Y)``: rows per batch (>= 1; 32 when not given). Ready-made
    batches are used as given."""
    shuffle: bool = False
    """For a ``Dataset`` or arrays ``(X, Y)``: a new row order every epoch; for a list of batches: a new
    batch order every epoch; seeded by ``seed`` (and kept exactly across a resume). A ``DataLoader``
    shuffles itself: ``shuffle=True`` with one is a ``ValueError``."""
    resume_from: Any = None
    """A file written by ``Checkpoint`` (full state, ``str`` or ``os.PathLike``): training continues
    from its epoch up to ``epochs``, bit for bit as one run on CPU."""
    scheduler_interval: str = "batch"
    """Step the scheduler every ``"batch"`` (Loom's per-step schedules) or every ``"epoch"``."""
    scheduler_monitor: str | None = None
    """The log key a ``ReduceLROnPlateau`` steps on; ``None`` = ``"val_loss"`` with validation data,
    else ``"loss"``."""
    precision: str = "32"
    """``"32"``, ``"bf16-mixed"`` (autocast, float32 weights) or ``"16-mixed"`` (float16 with dynamic
    loss scaling; backprop only)."""
    distributed: bool | None = None
    """Data-parallel training under ``torch.distributed``: ``None`` when a process group of more than
    one process is initialised, ``True`` required, ``False`` off."""
    shard_data: bool | None = None
    """Data-parallel training with ``(X, Y)`` data: ``None`` shards it when every rank holds the same
    rows, else each rank's rows are its own shard (the usual pre-sharded DDP habit); ``True`` / ``False``
    always / never shard (a ``Dataset`` is sharded unless ``False``)."""
    weight_dtype: Any = None
    """Train in one of Loom's 21 weight dtypes (``"int8"``, ``"int4"``, ``"fp4"``, ``"ternary"``, ...) or
    a ``{layer name: dtype}`` mapping: the forward and backward run on the dtype's values (docs/low-bit.md).
    ``None`` = float32."""
    low_bit: Any = None
    """A ``torchloom.LowBitConfig`` (``master``, ``rounding``, ``scale``, ``loom_compat``, ``seed``) for
    ``weight_dtype``; ``None`` = its defaults."""
    divergence_factor: float = 10.0
    """An epoch whose loss exceeds this × the larger of the first epoch's and the best, or whose
    weights' norm exceeds this × the start's, is reported as diverged (> 1; ``0`` = off); so is one
    whose loss climbs back above the first epoch's and 1.1 × the best (engine/divergence.py)."""
    loss_fn: Any = None
    """A custom loss for backprop: ``loss_fn(output, target) -> one-element tensor`` (the batch's mean
    loss), differentiated by autograd with respect to the output, in place of ``loss_type``; also what
    ``val_loss`` reports. ``None`` (default): ``loss_type``. The other methods train on their own
    losses and refuse it."""
    accumulate_grad_batches: int = 1
    """Backprop: average the gradients of this many consecutive batches and update once (Lightning's
    ``accumulate_grad_batches``); with a mean-reduced loss and equal-sized batches, equal to one step
    on the batch ``k`` times as large. The last batch of an epoch updates with what it has. A
    per-batch schedule advances once per update. ``1`` (default): an update every batch."""
    log_every_n_steps: int = 0
    """Per-step logs every this many steps (Lightning's ``log_every_n_steps``): ``loss``, ``lr`` and
    the method's step logs of that step go to the observers' ``on_step_log(trainer, step, logs)``
    hook, ``History.step_history``, ``CSVLogger(step_path=...)`` and ``TensorBoardLogger``. On the
    CUDA device path they are read with the epoch's one host sync (the steps stay graph-captured) and
    delivered at the epoch's end. ``0`` (default): off."""
    optimizer_options: Mapping[str, Any] | None = None
    """Settings of an optimizer given by name, e.g. ``{"weight_decay": 0.1, "betas": (0.9, 0.95)}``:
    any argument of its class (``torchloom.optim.SGD`` / ``AdamW`` / ``RMSprop``) but the parameters
    and ``lr``; checked when the config is built. ``None`` = the optimizer's defaults."""
    alignment_every: int = 0
    """Alignment diagnostics: every this many steps, the angle in degrees between the method's update
    direction and the exact backprop gradient, per layer with parameters, logged per epoch as
    ``alignment_bp/<layer index>`` (engine/alignment.py; docs/choosing-a-method.md). On the CUDA
    device path it is measured on the device inside captured one-step graphs, read once per epoch.
    ``0`` (default): off."""
    compile: bool | Mapping[str, Any] = False
    """Backprop: run each step's forward and backward through ``torch.compile`` of the model (each
    layer's hand-written backward kept as one node of the compiled graph; the loss, the guards and
    the optimizer update run as in the eager step). ``True``: torch.compile's defaults (Inductor);
    or a mapping of its keyword arguments ``fullgraph`` (bool), ``dynamic`` (bool or None), ``backend``
    (a name or a callable), ``mode`` (None or a name), ``options`` (None or a dict with str keys; not
    with a ``mode``): ``{"mode": "reduce-overhead"}`` for Inductor's CUDA graphs, ``{"dynamic": True}``.
    Compiled steps run the host loop, never the CUDA device path; TargetProp and Tweening refuse it."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` unless every field is valid. ``train()`` calls it again
        when a run starts, so a field changed after construction is checked too. Numbers may be given
        as numpy scalars or one-element tensors (stored as Python numbers)."""
        python_numbers(self)  # NumPy scalars → Python numbers
        for name in ("learning_rate", "gradient_clip", "divergence_factor"):
            setattr(self, name, _as_number(getattr(self, name)))
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"TrainingConfig: epochs must be an int >= 1, got {self.epochs!r}")
        if self.learning_rate is not None and (
                not _is_number(self.learning_rate) or not math.isfinite(self.learning_rate) or self.learning_rate <= 0):
            raise ValueError(
                "TrainingConfig: learning_rate must be a finite number > 0 or None (not set: 0.01 for an optimizer "
                f"given by name, TargetProp's / Tweening's automatic rate), got {self.learning_rate!r}"
            )
        try:
            check_loss_type(self.loss_type)
        except ValueError as e:
            raise ValueError(f"TrainingConfig: {e}") from None
        if not _is_number(self.gradient_clip) or not math.isfinite(self.gradient_clip) or self.gradient_clip < 0:
            raise ValueError(f"TrainingConfig: gradient_clip must be a finite number >= 0 (0 = off), got {self.gradient_clip!r}")
        if (not _is_number(self.divergence_factor) or not math.isfinite(self.divergence_factor)
                or not (self.divergence_factor == 0 or self.divergence_factor > 1)):
            raise ValueError(
                "TrainingConfig: divergence_factor must be 0 (off) or a finite number > 1 (an epoch whose loss exceeds "
                f"this × the best, or whose weights' norm exceeds this × the start's, diverged), got {self.divergence_factor!r}"
            )
        if isinstance(self.alignment_every, bool) or not isinstance(self.alignment_every, numbers.Integral) or self.alignment_every < 0:
            raise ValueError(
                "TrainingConfig: alignment_every must be an int >= 0 (0 = off; N: every N steps, the angle between the "
                f"method's update and the exact gradient per layer), got {self.alignment_every!r}"
            )
        self.alignment_every = int(self.alignment_every)
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"TrainingConfig: clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.verbose not in (True, False, 0, 1, 2):
            raise ValueError(
                "TrainingConfig: verbose must be a bool or 0, 1, 2 (0/False silent, 1/True progress bar on a "
                f"terminal + epoch lines, 2 epoch lines only), got {self.verbose!r}"
            )
        if self.verbose is not True and self.verbose is not False:
            self.verbose = int(self.verbose)
        if not isinstance(self.use_gpu, bool):
            raise TypeError(f"TrainingConfig: use_gpu must be a bool, got {self.use_gpu!r}")
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"TrainingConfig: device must be a torch device such as 'cpu' or 'cuda:0', got {self.device!r}") from None
            if dev.type == "meta":
                raise ValueError("TrainingConfig: device 'meta' holds no values and cannot train; use 'cpu' or 'cuda'")
        if isinstance(self.device_id, bool) or not isinstance(self.device_id, int) or self.device_id < 0:
            raise ValueError(f"TrainingConfig: device_id must be an int >= 0, got {self.device_id!r}")
        if isinstance(self.optimizer, str):
            if self.optimizer.lower() not in OPTIMIZERS:
                raise ValueError(
                    f"TrainingConfig: unknown optimizer {self.optimizer!r}; valid names: "
                    f"{', '.join(map(repr, OPTIMIZERS))}, a torch.optim.Optimizer instance or a factory params -> "
                    "Optimizer (e.g. functools.partial(torch.optim.AdamW, weight_decay=0.1))"
                )
            self.optimizer_options = check_optimizer_options(
                self.optimizer, self.optimizer_options, self.optimizer_rate(), owner="TrainingConfig: optimizer_options"
            )
        elif not isinstance(self.optimizer, Optimizer) and not callable(self.optimizer):
            raise TypeError(
                f"TrainingConfig: optimizer must be a name ({', '.join(map(repr, OPTIMIZERS))}), a torch.optim.Optimizer or a "
                f"factory params -> Optimizer (e.g. functools.partial(torch.optim.AdamW, weight_decay=0.1)), got {type(self.optimizer).__name__}"
            )
        elif self.optimizer_options:
            raise ValueError(
                "TrainingConfig: optimizer_options apply to an optimizer given by name; an optimizer instance or factory "
                "carries its own settings (e.g. functools.partial(torch.optim.AdamW, weight_decay=0.1))"
            )
        if isinstance(self.observers, (str, bytes)) or not hasattr(self.observers, "__iter__"):
            raise TypeError(f"TrainingConfig: observers must be a sequence of observers, got {type(self.observers).__name__}")
        self.observers = tuple(self.observers)
        if not isinstance(self.track_perf, bool):
            raise TypeError(f"TrainingConfig: track_perf must be a bool, got {self.track_perf!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"TrainingConfig: seed must be an int or None, got {self.seed!r}")
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            raise TypeError(f"TrainingConfig: cuda_graph must be None (automatic), True or False, got {self.cuda_graph!r}")
        self.compile = _compile_setting(self.compile, self.cuda_graph)
        if self.loss_fn is not None and (not callable(self.loss_fn) or isinstance(self.loss_fn, (str, type))):
            raise TypeError(
                f"TrainingConfig: loss_fn must be None or a callable loss_fn(output, target) -> one-element tensor, got {self.loss_fn!r}"
            )
        for name in ("accumulate_grad_batches", "log_every_n_steps"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                value = int(value)  # a NumPy integer
                setattr(self, name, value)
            least = 1 if name == "accumulate_grad_batches" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "an int >= 1 (1 = an update every batch)" if least else "an int >= 0 (0 = off)"
                raise ValueError(f"TrainingConfig: {name} must be {what}, got {value!r}")
        self.method_spec()  # checks method and its agreement with the other fields
        self.metrics = _metrics_setting(self.metrics)
        check_scheduler(self.scheduler)
        try:
            ObserverList(self.observers)  # each has a hook
        except TypeError as e:
            raise TypeError(f"TrainingConfig: observers: {e}") from None
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, numbers.Integral) or self.batch_size < 1):
            raise ValueError(f"TrainingConfig: batch_size must be None or an int >= 1, got {self.batch_size!r}")
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"TrainingConfig: shuffle must be a bool, got {self.shuffle!r}")
        if self.resume_from is not None and not isinstance(self.resume_from, (str, os.PathLike)):
            raise TypeError(f"TrainingConfig: resume_from must be None or a path (str or os.PathLike), got {type(self.resume_from).__name__}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainingConfig: precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.scheduler_interval not in ("batch", "epoch"):
            raise ValueError(f"TrainingConfig: scheduler_interval must be 'batch' or 'epoch', got {self.scheduler_interval!r}")
        if self.distributed is not None and not isinstance(self.distributed, bool):
            raise TypeError(f"TrainingConfig: distributed must be None (automatic), True or False, got {self.distributed!r}")
        if self.shard_data is not None and not isinstance(self.shard_data, bool):
            raise TypeError(f"TrainingConfig: shard_data must be None (automatic), True or False, got {self.shard_data!r}")
        if self.scheduler_monitor is not None and not isinstance(self.scheduler_monitor, str):
            raise TypeError(f"TrainingConfig: scheduler_monitor must be None or a log key such as 'val_loss', got {self.scheduler_monitor!r}")
        self.low_bit_config()  # checks weight_dtype and low_bit
        if isinstance(self.optimizer, Optimizer) and self.learning_rate is not None:
            lrs = sorted({float(g["lr"]) for g in self.optimizer.param_groups})
            if lrs != [float(self.learning_rate)]:
                raise ValueError(
                    f"TrainingConfig: learning_rate={self.learning_rate!r} is given with an optimizer instance whose "
                    f"lr is {lrs if len(lrs) > 1 else lrs[0]}; the instance's lr is used: leave learning_rate unset "
                    "(None) or build the optimizer with that lr"
                )

    def optimizer_rate(self) -> float:
        """The rate an optimizer given by name is built with: ``learning_rate``, or ``DEFAULT_LR``
        (0.01) when it is ``None`` (not set)."""
        return DEFAULT_LR if self.learning_rate is None else float(self.learning_rate)

    def low_bit_config(self) -> Any:
        """The ``LowBitConfig`` of ``weight_dtype`` (``low_bit`` or the defaults), checked with it;
        ``None`` when ``weight_dtype`` is ``None``."""
        from ..lowbit.config import LowBitConfig
        from ..lowbit.weights import check_weight_dtype

        if self.low_bit is not None and not isinstance(self.low_bit, LowBitConfig):
            raise TypeError(f"TrainingConfig: low_bit must be None or a torchloom.LowBitConfig, got {type(self.low_bit).__name__}")
        if self.low_bit is not None:
            self.low_bit.validate()
        cfg = self.low_bit if self.low_bit is not None else LowBitConfig()
        check_weight_dtype(self.weight_dtype, cfg)
        return None if self.weight_dtype is None else cfg

    def method_spec(self) -> tuple[Any, Any]:
        """``(method class, its settings)`` for ``method``, checked against the other fields.

        ``method`` is a registered name (``torchloom.method_names()``: ``"backprop"``,
        ``"target_prop"``, ``"tween"``, ...), a registered method's config instance
        (``TargetPropConfig(...)``), or a ``torchloom.Method`` object or class. By name, the method
        builds its settings from this config (``Method.config_from_training``: TargetProp and Tweening
        take ``learning_rate`` as their rate, ``None`` their automatic one). Given as an instance, the
        config's own rate is used, and a ``learning_rate`` set to another number as well is a
        ``ValueError`` (one rate, one place).
        Each method refuses what it cannot do (``Method.check_training``): an ``optimizer`` other than
        the default for a rule with its own update, a loss it cannot train on."""
        m = self.method
        found = method_class(m)
        if found is None:
            if isinstance(m, str):
                raise ValueError(
                    f"TrainingConfig: unknown method {m!r}; valid: {', '.join(map(repr, method_names()))}, "
                    "a method's config instance (e.g. TargetPropConfig(...)) or a torchloom.Method"
                )
            raise TypeError(
                f"TrainingConfig: method must be a method name ({', '.join(map(repr, method_names()))}), a method's "
                f"config instance or a torchloom.Method, got {type(m).__name__}"
            )
        cls, cfg = found
        if isinstance(m, str):
            cfg = cls.config_from_training(self)
        elif not isinstance(cfg, Method) and hasattr(cfg, "validate"):
            cfg.validate()  # a field changed after construction is checked too
        cls.check_training(self, cfg)
        return cls, cfg

    def method_config(self) -> Any:
        """The method's own settings (``None`` for a method without a config type, e.g. backprop)."""
        cls, cfg = self.method_spec()
        return None if isinstance(cfg, Method) else cfg


COMPILE_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options")


def _compile_setting(spec: Any, cuda_graph: bool | None) -> bool | dict[str, Any]:
    """``TrainingConfig.compile`` checked: a bool, or a mapping of ``torch.compile`` keyword arguments
    (``COMPILE_OPTIONS``; ``mode`` and ``options`` not both) kept as a dict; not with
    ``cuda_graph=True`` (a compiled step runs the host loop)."""
    if isinstance(spec, Mapping):
        unknown = sorted(str(k) for k in spec if k not in COMPILE_OPTIONS)
        if unknown:
            guess = closest(unknown[0], COMPILE_OPTIONS)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise ValueError(
                f"TrainingConfig: compile has unknown torch.compile option {unknown[0]!r}{hint}; valid: "
                f"{', '.join(map(repr, COMPILE_OPTIONS))}"
            )
        if spec.get("mode") is not None and spec.get("options") is not None:
            raise ValueError("TrainingConfig: compile cannot hold both 'mode' and 'options' (torch.compile takes one of them)")
        spec = dict(spec)
        _check_compile_values(spec)
    elif not isinstance(spec, bool):
        raise TypeError(
            "TrainingConfig: compile must be a bool or a mapping of torch.compile options (e.g. {'mode': "
            f"'reduce-overhead'}}), got {spec!r}"
        )
    if spec is not False and cuda_graph:
        raise ValueError(
            "TrainingConfig: compile and cuda_graph=True cannot be combined: compiled steps run the host loop, not "
            "the CUDA device path; for CUDA graphs of the compiled step use compile={'mode': 'reduce-overhead'}"
        )
    return spec


def _check_compile_values(spec: dict[str, Any]) -> None:
    """The types of a ``compile`` mapping's values, as ``torch.compile`` takes them: ``fullgraph`` a
    bool, ``dynamic`` a bool or None, ``backend`` a name or a callable, ``mode`` None or a name (which
    names exist is the backend's to say: Inductor's ``"default"``, ``"reduce-overhead"``...),
    ``options`` None or a mapping with string keys."""
    def bad(key: str, allowed: str) -> TypeError:
        return TypeError(f"TrainingConfig: compile[{key!r}] must be {allowed}, got {spec[key]!r}")

    if "fullgraph" in spec and not isinstance(spec["fullgraph"], bool):
        raise bad("fullgraph", "a bool")
    if "dynamic" in spec and spec["dynamic"] is not None and not isinstance(spec["dynamic"], bool):
        raise bad("dynamic", "a bool or None")
    if "backend" in spec and not (isinstance(spec["backend"], str) or callable(spec["backend"])):
        raise bad("backend", "a backend name (a str) or a callable")
    if spec.get("mode") is not None and not isinstance(spec["mode"], str):
        raise bad("mode", "None or a mode's name (a str, e.g. 'reduce-overhead')")
    options = spec.get("options")
    if options is not None and not (isinstance(options, Mapping) and all(isinstance(k, str) for k in options)):
        raise bad("options", "None or a mapping of option names (str) to values")


def resolve_method(config: TrainingConfig) -> Method:
    """The method object a run of ``config`` uses: ``config.method`` itself when it is a ``Method``,
    else one built by the registered class from its settings."""
    cls, cfg = config.method_spec()
    return cfg if isinstance(cfg, Method) else cls.from_training(config, cfg)


def resolve_device(device: str | torch.device | None, use_gpu: bool, device_id: int, model: torch.nn.Module) -> torch.device:
    """The device training runs on: ``device`` if given, ``cuda:<device_id>`` if ``use_gpu``, else the
    model's own. Raises ``RuntimeError`` when CUDA is asked for and not available."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", device_id)
    elif use_gpu:
        dev = torch.device("cuda", device_id)
    else:
        first = next(model.parameters(), None)
        dev = first.device if first is not None else torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"training on {dev} was requested (use_gpu/device) but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"training on {dev} was requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def as_network(model: Any) -> Network:
    """``model`` as a ``Network`` (``torchloom.layers.network.chain_of``: a Network as is, a layer,
    a list or an ``nn.Sequential`` as the chain of its items, any other ``nn.Module`` as a one-link
    chain; the parameters are the model's own), after unwrapping ``DistributedDataParallel``."""
    return chain_of(unwrap_ddp(model))  # a DistributedDataParallel wrapper: its .module, with a note


def check_optimizer_params(optimizer: Optimizer, model: torch.nn.Module) -> None:
    """``ValueError`` unless every parameter ``optimizer`` holds belongs to ``model`` and at least one
    trainable parameter of the model is in it (an optimizer over another model's parameters would
    train nothing without a word)."""
    mine = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in mine for p in held)
    if foreign:
        raise ValueError(
            f"optimizer: {type(optimizer).__name__} holds {foreign} parameter(s) that are not the model's; "
            "build it over model.parameters()"
        )
    if not any(p.requires_grad for p in held):
        raise ValueError(f"optimizer: {type(optimizer).__name__} holds none of the model's trainable parameters")


def check_factory_lr(config: TrainingConfig, optimizer: Optimizer) -> None:
    """``ValueError`` when ``learning_rate`` was set (any number; ``None`` is not set) beside an optimizer
    factory that built another rate: the factory's rate is used, so one of the two would be ignored."""
    if isinstance(config.optimizer, (str, Optimizer)) or config.learning_rate is None:
        return
    lrs = sorted({float(g["lr"]) for g in optimizer.param_groups})
    if lrs != [float(config.learning_rate)]:
        raise ValueError(
            f"TrainingConfig: learning_rate={config.learning_rate!r} is given with an optimizer factory that builds "
            f"lr {lrs if len(lrs) > 1 else lrs[0]}; the factory's lr is used: leave learning_rate unset (None) or "
            f"give the factory that lr (e.g. functools.partial(torch.optim.AdamW, lr={config.learning_rate!r}, ...))"
        )


def check_optimizer_device(optimizer: Optimizer, device: torch.device, state_only: bool = False) -> None:
    """``ValueError`` when ``optimizer`` (after the model moved to the training ``device``) holds a
    parameter that is not on ``device`` (a move that made new parameters left the optimizer with the
    old ones), or state on another device than its parameter: an optimizer built and used before
    ``train()`` moved the model (``use_gpu=True`` / ``device``) whose parameters or state stayed
    behind. ``state_only`` (before the move, when the run starts): state not on ``device`` (a move
    of the model never moves it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            stale = not state_only and p.device != device
            state = optimizer.state.get(p, {})
            home = device if state_only else p.device
            away = [k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0 and v.device != home]
            if stale or away:
                where = f"parameters on {p.device}" if stale else f"state {away[0]!r} on {state[away[0]].device}"
                raise ValueError(
                    f"optimizer: the {type(optimizer).__name__} instance holds {where}, but training runs on {device} "
                    "(train() moved the model there: use_gpu/device); build the optimizer after moving the model "
                    f"(model.to({str(device)!r})), or give it by name or as a factory (e.g. optimizer='adamw' or "
                    "functools.partial(torch.optim.AdamW, weight_decay=0.1)), which train() builds on the training device"
                )


def check_scheduler(spec: Any) -> None:
    """``TypeError`` unless ``spec`` is a form ``as_scheduler`` takes: ``None``, an ``LRScheduler``
    instance, an ``LRScheduler`` class or ``functools.partial`` of one, or a schedule ``lr(step)``
    (any callable). A string names the closest of ``torchloom.schedules``."""
    if spec is None or callable(spec) or isinstance(spec, (LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return
    from ..optim import schedules

    names = [n for n in schedules.__all__ if n[0].islower() and callable(getattr(schedules, n))]
    hint = ""
    if isinstance(spec, str):
        guess = closest(spec, names)
        hint = f" (did you mean torchloom.schedules.{guess}(...)?)" if guess else ""
    raise TypeError(
        f"TrainingConfig: scheduler must be None, a schedule lr(step) (torchloom.schedules: {', '.join(names)}; or any "
        "callable), an LRScheduler class or functools.partial of one (e.g. functools.partial("
        "torch.optim.lr_scheduler.ReduceLROnPlateau, patience=2)) or an LRScheduler instance, "
        f"got {spec!r}{hint}"
    )


def _scheduler_class(spec: Any) -> bool:
    """Whether ``spec`` builds an LRScheduler from an optimizer: an ``LRScheduler`` subclass (e.g.
    ``ReduceLROnPlateau``) or a ``functools.partial`` of one."""
    func = spec.func if isinstance(spec, functools.partial) else spec
    return isinstance(func, type) and (issubclass(func, LRScheduler) or func.__name__ == "ReduceLROnPlateau")


def as_scheduler(spec: Any, optimizer: Optimizer) -> Any:
    """The ``LRScheduler`` of ``train()``'s ``scheduler`` setting, over ``optimizer`` (the optimizer
    of backprop, or the rate holder of TargetProp / Tweening):

    * an ``LRScheduler`` instance bound to that optimizer;
    * an ``LRScheduler`` class or a ``functools.partial`` of one (``partial(ReduceLROnPlateau,
      patience=2)``), built over it: the way to schedule TargetProp's and Tweening's rate;
    * a schedule ``lr(step)`` (``torchloom.schedules`` or any callable), wrapped in ``ScheduleLR``."""
    if spec is None:
        return None
    if isinstance(spec, (LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        if spec.optimizer is not optimizer:
            raise ValueError(
                "scheduler is an LRScheduler bound to another optimizer; pass that optimizer as "
                "TrainingConfig(optimizer=...), or give the scheduler's class (e.g. functools.partial("
                "ReduceLROnPlateau, patience=2)) or a schedule (see torchloom.schedules) instead"
            )
        return spec
    if _scheduler_class(spec):
        return spec(optimizer)
    return ScheduleLR(optimizer, spec)


def is_plateau(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on a monitored value (``ReduceLROnPlateau``) rather than a count."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _metrics_setting(metrics: Any) -> Any:
    """``TrainingConfig.metrics`` checked (by building the ``MetricSet`` it describes, so an unknown
    name or a duplicate fails here) and kept in its form: a mapping ``{name: metric}`` as a dict (its
    values are the metrics: ``{"mse": my_fn}`` logs ``my_fn`` under ``"mse"``), a ``MetricSet`` as it
    is, any other sequence as a tuple."""
    if isinstance(metrics, MetricSet):
        return metrics
    if isinstance(metrics, Mapping):
        metrics = dict(metrics)
    elif isinstance(metrics, (str, bytes)) or callable(metrics) or not hasattr(metrics, "__iter__"):
        raise TypeError(
            "TrainingConfig: metrics must be a sequence of metric names or callables, e.g. ('accuracy',), a mapping "
            f"{{name: metric}} or a MetricSet, got {metrics!r}"
        )
    else:
        metrics = tuple(metrics)
        for m in metrics:
            if not (isinstance(m, str) or callable(m) or hasattr(m, "update")):
                raise TypeError(f"TrainingConfig: each metric must be a name or a callable metric(output, target), got {m!r}")
    try:
        MetricSet(metrics)
    except (TypeError, ValueError) as e:
        raise type(e)(f"TrainingConfig: {e}") from None
    return metrics
