"""``torchloom.train()``: Loom's one-call ``Train()`` API (SPEC §5).

    result = torchloom.train(model, batches, TrainingConfig(epochs=10, learning_rate=0.01, loss_type="mse"))

One step (``BackpropTrainer.step``), as Loom ``poly.Train``'s CPU path:

1. forward through the layers' explicit forward (no autograd graph);
2. loss and output gradient in one pass (``loss_and_grad``: fused kernel on CUDA);
3. if the loss is NaN/Inf, report ``NAN_LOSS`` (the loop abandons the epoch; weights untouched);
4. backward through the layers' hand-written backward;
5. if any gradient is NaN/Inf, report ``NAN_GRAD`` (the update is skipped);
6. optional clip: global L2 norm (``clip_mode="norm"``, Loom's documents) or per element
   (``clip_mode="value"``, Loom ``poly``'s code);
7. optimizer update, then one scheduler step.

Per-layer observer events (``on_layer_forward`` / ``on_layer_backward``): only when an observer
implements one of them does the step record history (``forward_record``) and send one event per
layer; otherwise steps 1 and 4 stay the lean ``forward_saved`` / ``backward_saved`` pair.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..layers.base import Layer
from ..layers.network import Network
from ..observers.layer_stats import LayerEvents
from .guards import state_tensors
from .loop import StepOutput, StepStatus, Trainer, TrainingResult, all_finite
from .losses import check_loss_type, check_target, loss_and_grad
from .optim import OPTIMIZERS, FusedOptimizer, make_optimizer

__all__ = ["TrainingConfig", "BackpropTrainer", "train", "resolve_device", "as_network"]

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


@dataclass
class TrainingConfig:
    """Settings of ``train()`` (Loom's ``TrainingConfig`` in snake_case, SPEC §5)."""

    epochs: int = 10  # passes over the batches; >= 1
    learning_rate: float = 0.01  # > 0; used when the optimizer is given by name
    loss_type: str = "mse"  # "mse" | "cross_entropy" | "crossentropy" (SPEC §4)
    gradient_clip: float = 0.0  # 0 = off; max global L2 norm, or max |g| with clip_mode="value"
    clip_mode: str = "norm"  # "norm" (Loom's documents) | "value" (Loom poly's code)
    verbose: bool | int = True  # 0 silent; 1 (= True) progress bar on a terminal + epoch lines; 2 epoch lines only
    use_gpu: bool = False  # True = device "cuda:<device_id>"
    device: str | torch.device | None = None  # explicit device; None = the model's own device
    device_id: int = 0  # which GPU when use_gpu=True
    optimizer: str | Optimizer = "sgd"  # "sgd" | "momentum" | ... or a torch.optim.Optimizer instance
    scheduler: Any = None  # a learning-rate schedule or LRScheduler, stepped once per batch
    observers: Sequence[Any] = ()  # SPEC §10
    track_perf: bool = False  # record per-epoch samples/s and step time in the result
    seed: int | None = None  # torch.manual_seed at the start, for run-to-run reproducibility
    cuda_graph: bool | None = None  # CUDA: None = capture steps in graphs when possible, False = never, True = required

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` unless every field is valid. ``train()`` calls it again
        when a run starts, so a field changed after construction is checked too. Numbers may be given
        as numpy scalars or one-element tensors (stored as Python numbers)."""
        for name in ("learning_rate", "gradient_clip"):
            setattr(self, name, _as_number(getattr(self, name)))
        if isinstance(self.epochs, numbers.Integral) and not isinstance(self.epochs, (bool, int)):
            self.epochs = int(self.epochs)
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"TrainingConfig: epochs must be an int >= 1, got {self.epochs!r}")
        if not _is_number(self.learning_rate) or not math.isfinite(self.learning_rate) or self.learning_rate <= 0:
            raise ValueError(f"TrainingConfig: learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        try:
            check_loss_type(self.loss_type)
        except ValueError as e:
            raise ValueError(f"TrainingConfig: {e}") from None
        if not _is_number(self.gradient_clip) or not math.isfinite(self.gradient_clip) or self.gradient_clip < 0:
            raise ValueError(f"TrainingConfig: gradient_clip must be a finite number >= 0 (0 = off), got {self.gradient_clip!r}")
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
                    f"{', '.join(map(repr, OPTIMIZERS))} or a torch.optim.Optimizer instance"
                )
        elif not isinstance(self.optimizer, Optimizer):
            raise TypeError(f"TrainingConfig: optimizer must be a name or a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        if isinstance(self.observers, (str, bytes)) or not hasattr(self.observers, "__iter__"):
            raise TypeError(f"TrainingConfig: observers must be a sequence of observers, got {type(self.observers).__name__}")
        self.observers = tuple(self.observers)
        if not isinstance(self.track_perf, bool):
            raise TypeError(f"TrainingConfig: track_perf must be a bool, got {self.track_perf!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"TrainingConfig: seed must be an int or None, got {self.seed!r}")
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            raise TypeError(f"TrainingConfig: cuda_graph must be None (automatic), True or False, got {self.cuda_graph!r}")


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


def _global_step_hooks() -> bool:
    """Whether any optimizer step hook is registered globally (``register_optimizer_step_*_hook``)."""
    from torch.optim import optimizer as torch_optimizer

    return bool(getattr(torch_optimizer, "_global_optimizer_pre_hooks", None) or getattr(torch_optimizer, "_global_optimizer_post_hooks", None))


def as_network(model: Any) -> Network:
    """``model`` as a ``Network``: a Network as is, a torchloom layer or a list of layers wrapped.
    Any other module is a ``TypeError``: torchloom trains through hand-written backwards only."""
    if isinstance(model, Network):
        return model
    if isinstance(model, Layer):
        return Network(model)
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, Layer) for m in model):
        return Network(*model)
    raise TypeError(
        f"model must be a torchloom Network, a torchloom layer or a list of them, got {type(model).__name__}; "
        "torchloom trains through the layers' hand-written backward, so plain nn.Modules are not accepted"
    )


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


def as_scheduler(spec: Any, optimizer: Optimizer) -> LRScheduler | None:
    """A per-batch ``LRScheduler`` from ``train()``'s ``scheduler`` setting."""
    if spec is None:
        return None
    if isinstance(spec, LRScheduler):
        if spec.optimizer is not optimizer:
            raise ValueError(
                "scheduler is an LRScheduler bound to another optimizer; pass that optimizer as "
                "TrainingConfig(optimizer=...) or give a schedule (see torchloom.schedules) instead"
            )
        return spec
    from .schedules import ScheduleLR

    return ScheduleLR(optimizer, spec)


class BackpropTrainer(Trainer):
    """``train()``'s trainer: exact gradients through the hand-written backward, any optimizer."""

    def __init__(self, model: Network, config: TrainingConfig) -> None:
        super().__init__(model, observers=config.observers, verbose=config.verbose)
        self.config = config
        all_params = list(model.parameters())
        if not all_params:
            raise ValueError("model has no parameters to train")
        # frozen parameters (requires_grad=False) are never updated: only the others reach the optimizer
        self._trainable = [p.requires_grad for p in all_params]
        self.params = [p for p in all_params if p.requires_grad]
        if not self.params:
            raise ValueError("model: every parameter has requires_grad=False; nothing to train")
        self.device = resolve_device(config.device, config.use_gpu, config.device_id, model)
        self.dtype = all_params[0].dtype
        self.loss_type = config.loss_type
        if isinstance(config.optimizer, Optimizer):
            check_optimizer_params(config.optimizer, model)
        self.optimizer = make_optimizer(config.optimizer, self.params, config.learning_rate)
        self._owns_optimizer = not isinstance(config.optimizer, Optimizer)
        self.clip = float(config.gradient_clip)
        self._value_clip_in_optimizer = False
        if self.clip > 0 and config.clip_mode == "value" and self._owns_optimizer and "clip_value" in self.optimizer.defaults:
            for group in self.optimizer.param_groups:  # fused into the update pass
                group["clip_value"] = self.clip
            self._value_clip_in_optimizer = True
        if self.device.type == "cuda" and self._owns_optimizer and "capturable" in self.optimizer.defaults:
            for group in self.optimizer.param_groups:  # step counts on the device: graph-capturable
                group["capturable"] = True
        self.scheduler = as_scheduler(config.scheduler, self.optimizer)
        self._direct_update = self._owns_optimizer and self.scheduler is None and isinstance(self.optimizer, FusedOptimizer)
        self._cuda = None
        if self.device.type == "cuda":
            from .cuda_path import guarded_optimizer

            if not guarded_optimizer(self.optimizer) and config.cuda_graph:
                raise ValueError(
                    "TrainingConfig(cuda_graph=True) needs one of torchloom's optimizers (AdamW with "
                    f"capturable=True), got {type(self.optimizer).__name__}"
                )

    def setup(self) -> None:
        """Move the model to the training device (after the data was checked) and, on CUDA with one
        of torchloom's optimizers, build the device runner."""
        self.model.to(self.device)
        if self.device.type == "cuda" and self._cuda is None:
            from .cuda_path import CudaRunner, guarded_optimizer

            if guarded_optimizer(self.optimizer):
                self._cuda = CudaRunner(self)

    def guarded_tensors(self) -> list[Tensor]:
        return [*self.params, *state_tensors(self.optimizer)]

    def training_state(self) -> dict[str, Any]:
        state = super().training_state()
        state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_training_state(self, state: dict[str, Any]) -> None:
        super().load_training_state(state)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    # ----------------------------------------------------------------- epochs
    def run_epoch(self, source, epoch):
        """On CUDA with a torchloom optimizer and no per-batch or per-layer observer, the device path
        (``cuda_path.py``: guarded steps, graph replay, one sync per epoch); otherwise Loom's loop of
        host-checked steps. The schedule advances once per batch of the epoch either way."""
        if self._cuda is not None and not self.observers.wants("on_batch_end") and LayerEvents.for_trainer(self) is None:
            if self.config.cuda_graph and epoch == 0:
                from .cuda_path import graph_eligible

                if not graph_eligible(self, source):
                    raise ValueError("TrainingConfig(cuda_graph=True) needs a list of batches (a DataLoader yields new tensors every epoch)")
            return self._cuda.run_epoch(source, epoch)
        if self.config.cuda_graph and epoch == 0:
            raise ValueError("TrainingConfig(cuda_graph=True) cannot be honoured: it needs CUDA and no per-batch or per-layer observers")
        out = super().run_epoch(source, epoch)
        if self.scheduler is not None and source.sized:
            for _ in range(len(source) - out.batches_run):  # batches an abandoned epoch did not reach
                self.scheduler.step()
        return out

    # --------------------------------------------------------------- batches
    def convert_batch(self, x: Any, y: Any, index: int) -> tuple[Tensor, Tensor]:
        """Move one batch to the device and dtype of the model and check it against the model's
        output shape (a forward without update, once per distinct input shape)."""
        where = f"batch {index}: "
        x, y, out_shape = self.prepare_batch(x, y, where)
        try:
            check_target(out_shape, y, self.loss_type)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        return x, y

    # ------------------------------------------------------------------ step
    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        """One host-checked step (steps 1-7 of the module docstring), then one scheduler step."""
        out = self._step(x, y)
        if self.scheduler is not None:
            self.scheduler.step()
        return out

    @torch.no_grad()
    def _step(self, x: Tensor, y: Tensor) -> StepOutput:
        events = LayerEvents.for_trainer(self)  # None unless an observer wants per-layer events
        if events is None:
            out, saved = self.model.forward_saved(x)
        else:
            out = events.run_forward(self.model, x)
        loss_t, grad = loss_and_grad(out, y, self.loss_type, validate=False)
        loss = float(loss_t)
        if not math.isfinite(loss):
            return StepOutput(loss, StepStatus.NAN_LOSS)
        if events is None:
            _, grads = self.model.backward_saved(grad, saved, needs_input_grad=False)
        else:
            grads = events.run_backward(self.model, grad)
        if len(grads) != len(self.params):  # frozen parameters get no gradient and no update
            grads = tuple(g for g, keep in zip(grads, self._trainable) if keep)
        if not all_finite(grads):
            return StepOutput(loss, StepStatus.NAN_GRAD)
        for p, g in zip(self.params, grads):
            p.grad = g
        self._clip(grads)
        self.optimizer_update()  # the loop checks the weights after it (UpdateGuard)
        return StepOutput(loss)

    def optimizer_update(self, **guards: Tensor | None) -> None:
        """``optimizer.step(**guards)``; for an optimizer ``train()`` made itself, with no step hooks
        and no schedule wrapping its ``step``, the update is called directly (``update()``), which
        skips torch's profiler record around ``step`` (about 60 µs a step on one CPU core)."""
        opt = self.optimizer
        if self._direct_update and not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_step_hooks()):
            opt.update(**guards)
        else:
            opt.step(**guards)

    def _clip(self, grads: Sequence[Tensor]) -> None:
        if self.clip <= 0 or self._value_clip_in_optimizer:
            return
        if self.config.clip_mode == "value":
            for g in grads:
                g.clamp_(-self.clip, self.clip)
        else:
            from ..kernels.grad_norm import clip_grad_norm_

            clip_grad_norm_(list(grads), self.clip)


def train(model: Network | Layer | Sequence[Layer], batches: Any, config: TrainingConfig | None = None, **overrides: Any) -> TrainingResult:
    """Train ``model`` on ``batches`` with Loom's loop and return a ``TrainingResult``.

    Args:
        model: a torchloom ``Network`` (or a layer / list of layers, wrapped in one).
        batches: a list of ``TrainingBatch(input, target)`` or ``(input, target)`` pairs, or a
            ``DataLoader`` yielding pairs; inputs ``[batch, ...]``, targets as ``config.loss_type``
            needs (SPEC §4). Lists are moved to the device once, not per epoch.
        config: a ``TrainingConfig``; keyword ``overrides`` replace its fields
            (``train(net, data, epochs=5, loss_type="cross_entropy")``).

    Bad settings or batches raise ``ValueError``/``TypeError`` before any weight changes.
    """
    config = config if config is not None else TrainingConfig()
    if not isinstance(config, TrainingConfig):
        raise TypeError(f"config must be a TrainingConfig, got {type(config).__name__}")
    if overrides:
        names = {f.name for f in dataclasses.fields(TrainingConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"train() got unknown setting(s) {unknown}; TrainingConfig fields: {sorted(names)}")
        config = dataclasses.replace(config, **overrides)
    config.validate()  # fields changed after construction are checked too
    net = as_network(model)
    trainer = BackpropTrainer(net, config)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    return trainer.fit(batches, config.epochs, track_perf=config.track_perf)

