"""The engine's epoch loop: one ``Trainer`` runs every method (Loom ``poly.Train``'s skeleton).

A method (``engine/method.py``'s protocol: backprop, TargetProp, Tweening or your own) is given to the
``Trainer``, which does the rest the same way for all of them. For each epoch, for each batch in the
given order, the method's ``step(x, y)`` runs one update and reports the **pre-update** loss and a
status:

* ``NAN_LOSS`` — the loss is NaN/Inf: print ``⚠️ Fatal NaN/Inf loss in epoch E. Skipping epoch.`` and
  abandon the rest of the epoch (the step left the weights as they were);
* ``NAN_GRAD`` — a gradient is NaN/Inf: print ``⚠️ Fatal NaN/Inf gradients in epoch E. Skipping batch
  updates.``, the update was skipped, the batch's loss is not counted;
* ``NAN_WEIGHTS`` — the update itself made a weight (or optimizer/method state) non-finite: the loop,
  which copies those tensors before every step (``guards.UpdateGuard``), puts them back, prints
  ``⚠️ Non-finite weights after an update in epoch E. Update undone.``, and the loss is not counted;
* ``OK`` — the loss is added to the epoch sum.

The epoch loss is the sum of counted batch losses divided by the number of batches (Loom's formula,
also when batches were skipped), except that an epoch in which **no** batch counted reports NaN,
never Loom's 0, and issues a ``DivergenceWarning`` whatever the verbose level. Each epoch's log holds
``skipped`` and ``counted`` batch counts; the result holds ``skipped_per_epoch``. Observers are called
by name; ``History`` is always kept. Per-batch work for observers (``on_batch_end``) happens only when
one implements that hook; per-layer events are the method's to send (``Method.layer_events()``).

Logs: each epoch's holds ``lr`` (the rate it starts with) and its own ``samples_per_second``; with
``TrainingConfig.log_every_n_steps`` = N, every N-th step's ``loss``, ``lr``, method logs and
``skipped`` go to ``History.step_history`` and the observers' ``on_step_log`` (``log_step``; the
device path delivers them from its one read per epoch).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..layers.base import precision_context
from ..layers.network import Network
from ..observers.base import ObserverList
from ..observers.history import History
from ..observers.layer_stats import LayerEvents
from ..observers.progress import EpochLinePrinter, ProgressObserver, print_line
from . import checkpoint
from .alignment import AlignmentProbe
from .batches import BatchSource, moved
from .config import as_scheduler, check_optimizer_device, is_plateau, resolve_device, resolve_method
from .divergence import DivergenceWatch
from .cuda_path import CudaRunner
from .distributed import resolve_distributed
from .evaluate import evaluate
from .guards import UpdateGuard
from .method import Method
from .metrics import METRIC_NAMES, MetricSet
from .start import WarmStart
from .data import as_inputs
from .types import INT_DTYPES, MESSAGES, batch_rows, EpochOutcome, StepOutput, StepStatus, TrainingResult, DivergenceWarning, user_stacklevel

__all__ = ["Trainer"]


class Trainer(WarmStart):
    """The training engine: the one epoch loop every method runs.

    The method (a ``torchloom.Method``: ``config.method`` resolved by name or config type through the
    registry, or given as ``method``) holds the update rule and its state; everything else lives here
    and works the same for every method: data handling, the NaN/Inf and weight guards, observers and
    verbose levels, the seed, the schedule, validation and metrics, checkpoints and resume, precision,
    data-parallel training, and the CUDA device path with its graph capture.

    Attributes of the method are reachable on the trainer too (``trainer.optimizer``,
    ``trainer.state``), for the code written against the per-method trainer classes.

    Args:
        model: a ``Network``.
        config: a ``TrainingConfig`` (observers, verbose, seed, device, scheduler, clipping, CUDA graphs).
        method: the method object; default: the one ``config.method`` names.
    """

    model: Network
    method: Method
    scheduler: Any = None
    alignment: Any = None  # the AlignmentProbe of a fit() run with TrainingConfig.alignment_every, else None
    metric_set: Any = None  # the training metrics of a fit() run (TrainingConfig.metrics), else None
    # kernels of the fused device steps: None = Triton on CUDA; "triton" runs them on CPU tensors
    # through Triton's interpreter (the tests), "reference" never (the torch-op device step)
    kernel_backend: str | None = None

    def __init__(self, model: Network, config: Any, method: Method | None = None) -> None:
        self.model = model
        self.training = config  # the engine's settings
        self.config = config
        self.user_observers = list(config.observers)
        self.verbose = int(config.verbose)
        first = next(model.parameters(), None)
        if first is None:
            raise ValueError("model has no parameters to train")
        self.device = resolve_device(config.device, config.use_gpu, config.device_id, model)
        self.dtype = first.dtype
        self.clip = float(config.gradient_clip)
        self.clip_mode = config.clip_mode
        self._runner: Any = None
        self.observers = ObserverList()  # replaced by make_observers() when fit() starts
        self.stop_training = False
        self.epochs = 0
        self.epoch = 0
        self.global_step = 0
        self.steps_per_epoch: int | None = None  # batches per epoch; None for an unsized DataLoader
        self.metric_names: tuple[str, ...] = METRIC_NAMES  # what the epoch line shows as metrics
        self.dist = resolve_distributed(getattr(config, "distributed", None), self.device)  # None: single process
        self.lowbit = _low_bit_weights(model, config)  # None unless TrainingConfig.weight_dtype is set
        if isinstance(config.optimizer, Optimizer):  # state made elsewhere never moves with the model: refused first
            check_optimizer_device(config.optimizer, self.device, state_only=True)
        self.method = resolve_method(config) if method is None else method
        self.method.bind(self)
        rates = self.method.schedulable()
        self.scheduler = as_scheduler(config.scheduler, rates) if rates is not None else None

    def __getattr__(self, name: str) -> Any:
        # the method's attributes (optimizer, state, rates, ...) on the trainer; only called for names
        # the trainer itself lacks
        method = self.__dict__.get("method")
        if method is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(method, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    @property
    def is_main(self) -> bool:
        """Whether this process prints and writes files: always, except on ranks other than 0 of
        data-parallel training (``TrainingConfig.distributed``)."""
        return self.dist is None or self.dist.is_main

    # ------------------------------------------------------- the method's hooks
    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        """One host-checked step of the method."""
        return self.method.step(x, y)

    def convert_batch(self, x: Any, y: Any, index: int) -> tuple[Tensor, Tensor]:
        """One batch on the training device, checked against the model by the method's rules."""
        return self.method.convert_batch(x, y, index)

    def layer_events(self) -> LayerEvents | None:
        """Per-layer observer events for a step, ``None`` unless an observer implements
        ``on_layer_forward`` / ``on_layer_backward``."""
        return LayerEvents.for_trainer(self)

    @property
    def device_log_names(self) -> tuple[str, ...]:
        """Per-step logs the device step writes (averaged per epoch)."""
        return tuple(self.method.device_log_names)

    def device_ready(self) -> bool:
        """Whether the method can run its steps on the device (decisions in device tensors)."""
        return self.method.device_ready()

    def device_setup(self, runner: Any) -> None:
        self.method.device_setup(runner)
        if self.lowbit is not None:  # the step count that keys stochastic rounding, on the device
            self._lowbit_step = torch.tensor(self.global_step, dtype=torch.int64, device=self.device)

    def device_step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        self.method.device_step(x, y, slot, runner)
        if self.lowbit is not None:  # after the guarded update: requantise where the step was kept (status 0),
            # and count the steps that ran (not a masked warm-up, nor a step after a NaN loss), as the host loop does
            self.lowbit.device_update(self._lowbit_step, runner.step_status[slot, 0])

    def guarded_device_tensors(self) -> list[Tensor]:
        own = self.method.guarded_device_tensors()
        return self.guarded_tensors() if own is None else own

    def device_epoch_begin(self, runner: Any, epoch: int) -> None:
        self.method.device_epoch_begin(runner, epoch)

    def device_epoch_tensors(self) -> list[Tensor]:
        return list(self.method.device_epoch_tensors())

    def device_epoch_end(self, runner: Any, losses: list[float], statuses: list[int], logs: Any, values: list[list[float]]) -> None:
        self.method.device_epoch_end(runner, losses, statuses, logs, values)

    def device_kernel_modules(self) -> list[str]:
        """The kernel modules the device step launches (dotted names), imported on a helper thread
        while the run gets ready (``kernels/_preload.py``): the engine's own (the step guard, the
        weight guard and the gradient norms), the model's layers' (``Layer.kernel_modules``) and the
        method's."""
        layers = [m for layer in self.model.modules() for m in getattr(layer, "kernel_modules", ())]
        own = ["torchloom.kernels.step_guard", "torchloom.kernels.weight_guard", "torchloom.kernels.grad_norm"]
        if self.lowbit is not None:
            own += ["torchloom.kernels.requant", "torchloom.kernels.requant_groups"]
        return [*own, *layers, *self.method.device_kernel_modules()]

    def rate_groups(self) -> list[dict[str, Any]]:
        """The param groups whose ``"lr"`` the schedule drives (and the graph runner's lr table sets)."""
        rates = self.method.schedulable()
        return [] if rates is None else rates.param_groups

    @property
    def batch_scheduler(self) -> Any:
        """The scheduler when it steps once per batch (``scheduler_interval="batch"``, not a
        ``ReduceLROnPlateau``), else ``None`` (stepped once per epoch by ``fit``)."""
        s = self.scheduler
        if s is None or self.training.scheduler_interval != "batch" or is_plateau(s):
            return None
        return s

    @property
    def runner(self) -> Any:
        """The device runner (``None`` until ``setup`` made one: CUDA and a method with a device step)."""
        return self._runner

    def prepare_batch(self, x: Any, y: Any, where: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
        """What every trainer's ``convert_batch`` starts with: ``x`` and ``y`` as tensors on the
        model's device (``self.device``; floats in ``self.dtype``, integer labels as int64), checked
        to be ``[batch, ...]`` with one batch size, and the model's output shape for ``x``. ``where``
        prefixes error messages ("batch 3: ")."""
        if isinstance(x, tuple):  # several inputs, model(*inputs)
            self._check_multi_input(x, where)
            x = as_inputs(x, f"{where}input")
            xs = x
        else:
            x = x if isinstance(x, Tensor) else torch.as_tensor(x)
            xs = (x,)
            if x.dim() == 0 or x.shape[0] == 0:
                raise ValueError(f"{where}input must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        y = y if isinstance(y, Tensor) else torch.as_tensor(y)
        rows = xs[0].shape[0]
        if y.dim() == 0 or y.shape[0] != rows:
            raise ValueError(
                f"{where}target must have the input's batch size {rows} as its first dimension, "
                f"got shape {list(y.shape)}"
            )
        for t in xs:
            if not (t.is_floating_point() or t.dtype in INT_DTYPES):
                raise TypeError(f"{where}input must be a floating or integer tensor, got dtype {t.dtype}")
        if not (y.is_floating_point() or y.dtype in INT_DTYPES):
            raise TypeError(f"{where}target must be a floating tensor or integer class labels, got dtype {y.dtype}")
        out_shape = (rows, *self.output_shape(x, where))
        xs = tuple(moved(t, self.device, self.dtype if t.is_floating_point() else t.dtype) for t in xs)
        x = xs if isinstance(x, tuple) else xs[0]
        y = moved(y, self.device, torch.long if y.dtype in INT_DTYPES else self.dtype)
        return x, y, out_shape

    def _check_multi_input(self, x: tuple, where: str) -> None:
        """``TypeError`` unless the method trains models of several inputs (``Method.multi_input``:
        backprop) and the model's first link is a plain ``nn.Module`` that takes them (``model(*inputs)``)."""
        from ..layers.module_layer import ModuleLayer

        if not getattr(self.method, "multi_input", False):
            raise TypeError(
                f"{where}input is a tuple of {len(x)} inputs; method {self.method.name or type(self.method).__name__!r} "
                "trains models of one input tensor (backprop trains models of several: model(*inputs))"
            )
        if not isinstance(self.model[0], ModuleLayer):
            raise TypeError(
                f"{where}input is a tuple of {len(x)} inputs, but the model's first layer "
                f"{type(self.model[0]).__name__} takes one input tensor; a model of several inputs is an "
                "nn.Module whose forward takes them (model(*inputs))"
            )
        self.multi_input = True  # no device step: the runner's slots hold one input tensor per step

    def output_shape(self, x: Tensor, where: str = "") -> tuple[int, ...]:
        """The model's output shape without the batch dimension for inputs like ``x``: one forward
        (no update), on the model's current device and dtype (the data is checked before
        the model moves), once per distinct input shape and dtype, cached. A layer's ``ValueError``
        about the input's shape is raised with ``where`` in front."""
        shapes = self.__dict__.setdefault("_output_shapes", {})
        xs = x if isinstance(x, tuple) else (x,)
        key = tuple((tuple(t.shape[1:]), t.is_floating_point()) for t in xs)
        if key not in shapes:
            first = next(self.model.parameters(), None)
            probe = xs
            if first is not None:
                probe = tuple(t.to(first.device, dtype=first.dtype if t.is_floating_point() else None) for t in xs)
            probe = probe if isinstance(x, tuple) else probe[0]
            was_training = self.model.training
            self.model.eval()  # no BatchNorm statistics, no dropout draw: the probe leaves no trace
            try:
                with torch.no_grad():
                    out, _ = self.model.forward_saved(probe)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{where}{e}") from None
            finally:
                self.model.train(was_training)
            shapes[key] = tuple(out.shape[1:])
        return shapes[key]

    def make_observers(self) -> ObserverList:
        """The user's observers plus the console printer of the ``verbose`` level: 1 = progress bar
        (on a terminal) + epoch lines, 2 = epoch lines only, 0 = nothing. Observers that write
        checkpoints (``writes_checkpoint = True``: ``Checkpoint``) are called after the others."""
        printer: Any = None
        if self.is_main and self.verbose == 2:
            printer = EpochLinePrinter()
        elif self.is_main and self.verbose == 1:
            # an in-epoch bar needs a per-batch hook, which takes the run off the device path: there,
            # the bar advances per epoch instead (unless another observer forces the host loop anyway)
            host_loop = self._runner is None or any(callable(getattr(o, "on_batch_end", None)) for o in self.user_observers)
            printer = ProgressObserver(per_batch=host_loop)
        # observers that write a checkpoint come after the others (as Lightning runs its ModelCheckpoint
        # last): the state they save holds every other observer's state after this epoch
        writers = [o for o in self.user_observers if getattr(o, "writes_checkpoint", False)]
        others = [o for o in self.user_observers if not getattr(o, "writes_checkpoint", False)]
        return ObserverList([*others, *writers, *([printer] if printer else [])])

    # ------------------------------------------------------------------- loop
    def run_epoch(self, source: "BatchSource", epoch: int) -> "EpochOutcome":
        """One epoch. With a device runner and no per-batch or per-layer observer: the device path
        (``cuda_path.py``: guarded steps, graph replay, one sync per epoch); otherwise Loom's loop of
        host-checked steps (``host_epoch``). The schedule advances once per batch either way, also
        over the batches an abandoned epoch did not reach."""
        with self.autocast():
            return self._run_epoch(source, epoch)

    def autocast(self) -> Any:
        """The training steps' precision context (``TrainingConfig.precision``): nothing for ``"32"``,
        ``torch.autocast`` to bfloat16 / float16 for the mixed precisions. Weights, gradients and
        method state stay in the parameters' dtype (float32 master weights)."""
        return precision_context(self.training.precision, self.device.type)

    def _run_epoch(self, source: "BatchSource", epoch: int) -> "EpochOutcome":
        cuda_graph = self.training.cuda_graph
        if self._runner is not None and not self.observers.wants("on_batch_end") and LayerEvents.for_trainer(self) is None:
            if cuda_graph and epoch == 0 and not self._runner.graph_eligible(source):
                raise ValueError(
                    "TrainingConfig(cuda_graph=True) needs a fixed list of batches (a DataLoader yields new tensors every "
                    "epoch; shuffle=True reorders them)"
                )
            return self._runner.run_epoch(source, epoch)
        if cuda_graph and epoch == 0:
            raise ValueError(
                "TrainingConfig(cuda_graph=True) cannot be honoured: it needs CUDA, a method and optimizer with a "
                "device step, and no per-batch or per-layer observers"
            )
        out = self.host_epoch(source, epoch)
        scheduler = self.batch_scheduler
        if scheduler is not None and source.sized:  # the updates an abandoned epoch did not reach
            k = max(int(getattr(self.training, "accumulate_grad_batches", 1) or 1), 1)
            for _ in range(-(-len(source) // k) - out.schedule_steps):  # a whole epoch: one step per update
                scheduler.step()
        return out

    def host_epoch(self, source: "BatchSource", epoch: int) -> "EpochOutcome":
        """One pass over ``source`` with ``step``, acting on each step's status at once (Loom's CPU
        loop); the weights are checked after every update (``UpdateGuard``)."""
        out = EpochOutcome()
        wants_batch = self.observers.wants("on_batch_end")
        scheduler = self.batch_scheduler
        guard = self.__dict__.get("_update_guard")
        if guard is None:
            guard = self._update_guard = UpdateGuard(self.guarded_tensors)
            self._buffer_guard = UpdateGuard(self.guarded_buffers)
        buffers = self._buffer_guard if self.guarded_buffers() else None
        every = getattr(self.training, "log_every_n_steps", 0)
        probe = self.__dict__.get("alignment")
        for x, y, last in _with_last(self.epoch_batches(source, epoch)):
            out.batches_run += 1
            out.samples += batch_rows(x)
            self.last_batch = last  # a method that accumulates gradients updates at the epoch's last batch
            log_now = every > 0 and (self.global_step + 1) % every == 0
            lrs = self.lr_logs() if log_now else None  # the rates this step uses
            guard.save()
            if buffers is not None:
                buffers.save()
            measure = probe is not None and probe.due(self.global_step)
            if measure:  # alignment diagnostics: the exact gradient and the method's direction, before the step
                probe.before(x, y)
            step = self.step(x, y)
            if step.status is StepStatus.OK and not guard.check_or_restore():  # the update overflowed: undone
                step = StepOutput(step.loss, StepStatus.NAN_WEIGHTS, step.logs)
            if buffers is not None:  # a step that did not count leaves no trace in the running statistics
                if step.status is StepStatus.OK and not buffers.check_or_restore():
                    guard.restore()
                    step = StepOutput(step.loss, StepStatus.NAN_WEIGHTS, step.logs)
                elif step.status is not StepStatus.OK:
                    buffers.restore()
            if step.status is StepStatus.OK and self.lowbit is not None and not getattr(self.method, "update_pending", False):
                self.lowbit.after_update(self.global_step)  # master takes the update, weights requantised
            if measure:
                probe.after(step.status is StepStatus.OK)
            if log_now:
                self.log_step(self.global_step, step.loss, step.logs, lrs, step.status is not StepStatus.OK)
            if scheduler is not None and not getattr(self.method, "update_pending", False):
                scheduler.step()  # once per update (an accumulating method updates every k batches)
                out.schedule_steps += 1
            self.global_step += 1
            if step.status is StepStatus.NAN_LOSS:
                out.skipped += 1
                self.report_nan(StepStatus.NAN_LOSS, epoch)
                break
            if step.status is not StepStatus.OK:  # NAN_GRAD / NAN_WEIGHTS: update skipped or undone
                out.skipped += 1
                self.report_nan(step.status, epoch)
                continue
            out.add(step.loss, step.logs)
            if wants_batch:
                batch_logs = {"loss": step.loss, **(step.logs or {}), "batch_size": float(batch_rows(x))}
                self.observers("on_batch_end", self, self.global_step - 1, batch_logs)
        return out

    def epoch_batches(self, source: "BatchSource", epoch: int) -> Any:
        """One epoch of ``source``; data-parallel with a streamed source (a ``DataLoader``), each batch
        agreed among the ranks before its step (``DistContext.agreed_batches``: a rank whose batch
        failed stops every rank at once; loaders of unequal length end the epoch together)."""
        if self.dist is None or source.items is not None:
            return source
        return self.dist.agreed_batches(source, epoch)

    def lr_logs(self) -> dict[str, float]:
        """The learning rates as log values: ``lr`` (the first param group's), and ``lr_group<i>``
        for each further group; ``{}`` for a method without a rate. Host floats (a rate held in a
        device tensor is read: once per epoch, or per logged step)."""
        groups = self.rate_groups()
        logs = {}
        for i, g in enumerate(groups):
            lr = g["lr"]
            logs["lr" if i == 0 else f"lr_group{i}"] = float(lr.item() if isinstance(lr, Tensor) else lr)
        return logs

    def log_step(self, step: int, loss: float, method_logs: dict[str, float] | None, lrs: dict[str, float] | None, skipped: bool) -> None:
        """Hand one step's logs to ``History`` and the observers' ``on_step_log(trainer, step, logs)``
        (every ``TrainingConfig.log_every_n_steps`` steps; ``step`` 0-based over the run): ``loss``
        (the pre-update loss), the method's step logs, the rates the step used and ``skipped`` (1.0
        when the step did not count)."""
        logs = {"loss": float(loss), **(method_logs or {}), **(lrs or {}), "skipped": float(skipped)}
        self.history.on_step_log(self, step, logs)
        self.observers("on_step_log", self, step, logs)

    def report_nan(self, status: StepStatus, epoch: int) -> None:
        """Print Loom's message for a NaN/Inf loss or gradient, or an undone update (when verbose)."""
        if self.verbose and self.is_main:
            print_line(MESSAGES[status.value].format(epoch=epoch + 1))  # above a live progress bar, if any

    # --------------------------------------------------------------- run state
    def preflight(self) -> None:
        """Checks that must pass before anything changes (``fit`` calls it first): every observer's
        ``check_ready()`` (paths, settings changed after construction). Trainers add their own."""
        for obs in self.user_observers:
            check = getattr(obs, "check_ready", None)
            if callable(check):
                check()

    def setup(self) -> None:
        """Called by ``fit`` once the data has been checked, before the first step: the model moves
        to the training device after the method's ``setup()`` (the device runner is built after it,
        and after a resume's restore)."""
        self.method.setup()
        self.model.to(self.device)
        optimizer = getattr(self.method, "optimizer", None)
        if isinstance(optimizer, Optimizer):  # one built before the move must have moved with the model
            check_optimizer_device(optimizer, self.device)
        if self.dist is not None:  # data-parallel: every rank starts from rank 0's weights
            self.dist.broadcast_module_(self.model)
        if self.lowbit is not None:  # the weights become the dtype's values (a master keeps them)
            self.lowbit.start(self.kernel_backend)

    def _build_runner(self) -> None:
        """On CUDA, with a method that has a device step: a fresh device runner. ``fit`` builds one per
        call, after ``setup`` and a resume's restore (graphs captured over an earlier fit's batches
        must never replay over this fit's, and the device state is laid out from the trainer's state
        as it is now, restored state included)."""
        if self._on_device_path():
            self._runner = None  # the old runner's graphs and buffers go before the new ones are made
            self._runner = CudaRunner(self)

    def guarded_params(self) -> list[Tensor]:
        """The trainable parameters (what an update changes in the model)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def guarded_tensors(self) -> list[Tensor]:
        """The tensors a step's update changes (checked after it, restored when it overflowed):
        the trainable parameters and the method's ``state_tensors()``."""
        return [*self.guarded_params(), *self.method.state_tensors()]

    def guarded_buffers(self) -> list[Tensor]:
        """The model's buffers (BatchNorm's running mean, variance and batch count): a step's forward
        changes them, so a step that does not count puts them back (``guards.py``). A floating buffer
        that holds a non-finite value when the run first asks (an attention mask of ``-inf``) is a
        constant, not a statistic: it is left out, or every step would look non-finite. Chosen by name
        once, so a move to another device keeps the choice."""
        names = self.__dict__.get("_guarded_buffer_names")
        if names is None:
            names = self._guarded_buffer_names = {
                n for n, b in self.model.named_buffers()
                if b.numel() and not (b.is_floating_point() and not bool(torch.isfinite(b).all()))
            }
        return [b for n, b in self.model.named_buffers() if n in names]

    def training_state(self) -> dict[str, Any]:
        """Everything a step changes (the model, the schedule and the method's ``state_dict()``), as
        tensors and plain values; ``load_training_state`` puts it back."""
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        state["rates"] = [float(g["lr"]) for g in self.rate_groups()]  # what the schedule had set
        # an automatic rate (rate unset: scaled by min(1, B/16) below 16 rows) steps differently from the
        # same number given explicitly: a resume must know which one the rates above are
        state["auto_rate"] = bool(getattr(self.method, "auto", False))
        state.update(self.method.state_dict())
        if self.lowbit is not None:
            state["lowbit"] = self.lowbit.state_dict()
        return state

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.method.load_state_dict(state)
        if self.lowbit is not None and "lowbit" in state:
            self.lowbit.load_state_dict(state["lowbit"])
        for group, lr in zip(self.rate_groups(), state.get("rates", ())):  # a schedule sets it again only at its next step
            group["lr"] = lr
        if hasattr(self.method, "auto") and "rates" in state:  # the checkpoint's kind of rate (older ones: explicit)
            self.method.auto = bool(state.get("auto_rate", False))

    def fit(self, batches: Any, epochs: int, *, track_perf: bool = False) -> TrainingResult:
        """Run the epochs over ``batches`` and return a ``TrainingResult``.

        ``epochs`` counts the whole run: with ``TrainingConfig(resume_from=path)`` training continues
        from the checkpoint's epoch up to ``epochs``. Order (nothing changes before the last check):
        ``epochs``, ``preflight()`` (observers' and the trainer's own checks), the data (every batch
        of a list converted and checked; a ``DataLoader``'s first batch; the validation data too),
        the checkpoint to resume from, then ``setup()`` (the model moves to the device), then the
        epochs. After each epoch: the validation data in eval mode without gradients (``val_loss``,
        ``val_<metric>``), the training metrics, an epoch-interval or ``ReduceLROnPlateau``
        schedule, then the observers. With a streamed source (a ``DataLoader``), a batch that fails
        its check mid-epoch, or any error inside an epoch, puts the model and the trainer's state
        back as they were at the start of that epoch before the error propagates. On CUDA, helper
        threads import Triton and the device step's kernel modules meanwhile (``kernels/_preload.py``;
        they have ended before the device runner is built, or before ``fit`` raises), and load the
        PyTorch kernels an earlier run of the same model, method and batch shapes noted
        (``op_warm.py``; ended before the engine's first CUDA graph capture, or before ``fit``
        returns or raises)."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
        cfg = self.training
        self.preflight()
        preload = self._start_preload(batches)
        try:
            self._start_op_warm(batches)
            return self._fit(batches, epochs, cfg, preload, track_perf)
        finally:
            if preload is not None:  # a run that failed before its runner leaves no thread behind
                preload.join()
            if self.dist is not None and self._runner is not None:  # graphs holding NCCL collectives
                self._runner.release()  # would keep destroy_process_group (and the exit) waiting
            self.join_op_warm(cancel=True)
            self._op_record_key = None  # a run that never replayed a graph keeps nothing
            self.__dict__.pop("_op_specs", None)

    def _get_ready(self, batches: Any, epochs: int, cfg: Any, preload: Any) -> tuple:
        """Everything before the first epoch, in ``fit``'s order: the data converted and checked, the
        checkpoint to resume from read, ``setup()``, the seed, the observers, a resume's restore, the
        preload threads joined, and the device runner. Returns ``(source, validation, history,
        observers, first_epoch)``."""
        error = None
        try:  # data-parallel: a check failing on one rank is agreed below, so no rank waits on it
            source = batches if isinstance(batches, BatchSource) else BatchSource(batches, self.convert_batch, cfg, dist=self.dist)
            validation = None
            if cfg.validation_data is not None:
                validation = BatchSource(cfg.validation_data, self.convert_batch, cfg, name="validation_data", shuffle=False)
            resume = checkpoint.read(self, cfg.resume_from, epochs) if cfg.resume_from is not None else None
        except Exception as e:  # noqa: BLE001
            if self.dist is None:
                raise
            error = e
        if self.dist is not None:
            (failed,) = self.dist.agree(error is not None)
            if failed:
                self.dist.raise_agreed(error, "the start of training (the data and checkpoint checks)")
            self.dist.check_same_count(len(source) if source.sized else None, "batches")
            if source.shuffled:  # a shuffled list of batches: every rank draws the same orders (rank 0's seed)
                source.set_shuffle_seed(self.dist.broadcast_int(source.shuffle_seed))
        self.setup()
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        self.metric_set = MetricSet(cfg.metrics) if cfg.metrics else None
        self.metric_names = _metric_names(self.metric_set)
        history = History()
        observers = self.make_observers()
        self.observers = observers
        self.epochs = epochs
        self.steps_per_epoch = len(source) if source.sized else None
        self.stop_training = False
        self.history = history
        self.loss_history: list[float] = []
        self.epoch_times: list[float] = []
        self.skipped_per_epoch: list[int] = []
        first_epoch = 0
        self.divergence = DivergenceWatch(cfg.divergence_factor)
        every = getattr(cfg, "alignment_every", 0)
        self.alignment = AlignmentProbe(self, every) if every else None
        self.source = source  # (a checkpoint keeps its shuffling seed)
        if resume is not None:
            first_epoch = checkpoint.restore(self, resume, history)
        self.epoch = first_epoch  # epochs done: what on_train_begin sees (a resumed run's observers catch up to it)
        self.divergence.start(self.guarded_params())
        if preload is not None:  # the runner imports and launches Triton's kernels on this thread
            preload.join()
        self._build_runner()
        return source, validation, history, observers, first_epoch

    def _fit(self, batches: Any, epochs: int, cfg: Any, preload: Any, track_perf: bool) -> TrainingResult:
        with self.op_recorder():  # a first run notes the kernels its start launches (op_warm.py)
            source, validation, history, observers, first_epoch = self._get_ready(batches, epochs, cfg, preload)

        perf: list[dict[str, float]] | None = [] if track_perf else None
        total_samples = 0
        observers("on_train_begin", self)
        start = time.perf_counter()

        for epoch in range(first_epoch, epochs):
            self.epoch = epoch
            source.set_epoch(epoch)
            self.model.train()  # validation switches to eval mode and back; training runs in train mode
            observers("on_epoch_begin", self, epoch)
            epoch_lrs = self.lr_logs()  # the rates the epoch starts with
            epoch_start = time.perf_counter()
            snapshot = copy.deepcopy(self.training_state()) if source.items is None else None
            if self.metric_set is not None:
                self.metric_set.reset()
            try:
                out = self.run_epoch(source, epoch)
            except Exception:
                if snapshot is not None:  # a streamed batch failed mid-epoch: undo the epoch's updates
                    self.load_training_state(snapshot)
                raise
            n_total = len(source) if source.sized else out.batches_run
            skipped = out.skipped + max(n_total - out.batches_run, 0)  # + batches an abandoned epoch did not reach
            epoch_time = time.perf_counter() - epoch_start
            total_samples += out.samples
            elapsed = time.perf_counter() - start
            # Loom's epoch loss: counted losses / all batches; NaN when nothing counted (never a fake 0)
            avg_loss = out.loss_sum / n_total if out.counted else math.nan
            if not out.counted and self.is_main:  # data-parallel: rank 0 alone warns (every rank skipped alike)
                warnings.warn(
                    f"epoch {epoch + 1}: no batch counted ({skipped} skipped for non-finite loss, gradients or "
                    f"weights{', or the data yielded no batch' if n_total == 0 else ''}); its loss is reported as NaN",
                    DivergenceWarning,
                    stacklevel=user_stacklevel(),
                )
            diverged = self.divergence.check(epoch, avg_loss, self.guarded_params(), bool(out.counted), self.method.diagnose(), skipped, n_total)
            if diverged and out.counted and self.is_main:
                rates = sorted({float(g["lr"]) for g in self.rate_groups()})
                rate = f" ({rates[0]:g})" if len(rates) == 1 else ""
                warnings.warn(
                    f"epoch {epoch + 1} diverged: {'; '.join(diverged)}. The learning rate{rate} is likely too high.",
                    DivergenceWarning,
                    stacklevel=user_stacklevel(),
                )
            self.loss_history.append(avg_loss)
            self.epoch_times.append(epoch_time)
            self.skipped_per_epoch.append(skipped)
            logs = {
                "loss": avg_loss,
                **{k: v / out.counted for k, v in out.extra_sums.items() if out.counted},
            }
            if self.metric_set is not None and out.counted:
                computed = self.metric_set.compute()
                logs.update(computed if self.dist is None else self.dist.mean_values(computed))  # equal shards: the global value
            error = None
            try:  # data-parallel: an error here on one rank is agreed below, so no rank waits on it
                if validation is not None:
                    logs.update({f"val_{k}": v for k, v in self.evaluate_source(validation).items()})
            except Exception as e:  # noqa: BLE001
                if self.dist is None:
                    raise
                error = e
            if out.counted and self.is_main and error is None:
                _warn_nonfinite_logs(epoch, logs)
            if self.alignment is not None:  # alignment_bp/<layer>: the epoch's mean angle (NaN: not measured; no warning)
                logs.update(self.alignment.epoch_logs())
            logs.update(epoch_lrs)
            logs.update(
                {
                    "skipped": float(skipped),
                    "counted": float(out.counted),
                    "diverged": float(bool(diverged)),
                    "epoch_time": epoch_time,
                    "samples_per_second": out.samples / epoch_time if epoch_time > 0 else 0.0,  # this epoch's
                    "eta": elapsed / (epoch + 1 - first_epoch) * (epochs - epoch - 1),
                }
            )
            if error is None:
                self._epoch_scheduler_step(logs)
            if perf is not None:
                perf.append(
                    {
                        "epoch": float(epoch),
                        "samples_per_second": out.samples / epoch_time if epoch_time > 0 else 0.0,
                        "step_time": epoch_time / max(out.batches_run, 1),
                    }
                )
            history.on_epoch_end(self, epoch, logs)
            self.epoch = epoch + 1  # epochs completed: what a checkpoint written now records
            try:
                if error is None:
                    observers("on_epoch_end", self, epoch, logs)
            except Exception as e:  # noqa: BLE001
                if self.dist is None:
                    raise
                error = e
            if self.dist is not None:  # data-parallel: stop when any rank's observers asked to, fail when any rank failed
                stop, failed = self.dist.agree(self.stop_training, error is not None)
                if failed:
                    self.dist.raise_agreed(error, f"the end of epoch {epoch + 1}")
                self.stop_training = bool(stop)
            if self.stop_training:
                break

        total_time = time.perf_counter() - start
        result = TrainingResult(
            final_loss=self.loss_history[-1] if self.loss_history else math.nan,
            total_time=total_time,
            loss_history=list(self.loss_history),
            epoch_times=list(self.epoch_times),
            samples_per_second=total_samples / total_time if total_time > 0 else 0.0,
            skipped_batches=sum(self.skipped_per_epoch),
            history=history,
            perf=perf,
            skipped_per_epoch=list(self.skipped_per_epoch),
        )
        observers("on_train_end", self, result)
        return result

    # ------------------------------------------------------------- validation
    @torch.no_grad()
    def evaluate_source(self, source: "BatchSource") -> dict[str, float]:
        """The loss (the method's ``eval_loss_type()``) and the metrics of the model on ``source``, in eval mode without gradients, each
        a sample-weighted mean over the batches. The model's train/eval mode is restored after."""
        was_training = self.model.training
        try:
            return evaluate(self.model, list(source), loss_type=self.method.eval_loss_type(), metrics=self.training.metrics, device=self.device)
        finally:
            self.model.train(was_training)

    def observe_outputs(self, output: Tensor, target: Tensor) -> None:
        """Feed a training step's (pre-update) outputs to the training metrics, if any (no host read)."""
        if self.metric_set is not None:
            self.metric_set.update(output, target)

    def _epoch_scheduler_step(self, logs: dict[str, float]) -> None:
        s = self.scheduler
        if s is None or self.batch_scheduler is s:
            return
        if is_plateau(s):
            key = self.training.scheduler_monitor or ("val_loss" if "val_loss" in logs else "loss")
            if key not in logs:
                raise ValueError(f"scheduler_monitor: the epoch logs have no key {key!r}; available: {sorted(logs)}")
            value = logs[key]
            if math.isfinite(value):  # a diverged epoch is not a plateau reading
                s.step(value)
        else:
            s.step()

    # ------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """The whole state of the run after ``self.epoch`` completed epochs (``checkpoint.state_of``):
        model, optimizer or method state, schedule, random-number states, history."""
        return checkpoint.state_of(self)


def _with_last(source: Any) -> Any:
    """``(x, y, is_last)`` for each batch of ``source``: one batch of look-ahead, so an unsized
    ``DataLoader`` tells its last batch too."""
    it = iter(source)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield (*prev, False)
        prev = item
    yield (*prev, True)


def _low_bit_weights(model: Network, config: Any) -> Any:
    """The ``LowBitWeights`` of ``config.weight_dtype`` (``lowbit/weights.py``), or ``None``."""
    if getattr(config, "weight_dtype", None) is None:
        return None
    from ..lowbit.weights import LowBitWeights

    seed = config.seed if getattr(config, "seed", None) is not None else 0
    low_bit = config.low_bit_config()
    weights = LowBitWeights(model, config.weight_dtype, low_bit, seed=seed)
    unsigned = [f"{g.name or '(model)'}: {g.dtype}" for g in weights.groups if g.dtype.startswith("uint")]
    if unsigned and not low_bit.loom_compat:  # loom_compat reproduces Loom: its users asked for exactly this
        warnings.warn(
            f"weight_dtype: {', '.join(unsigned)} — Loom's unsigned codes decode as code·scale with one scale per "
            "layer and no zero point, so every weight of such a layer has one sign (no unit can both excite and "
            "inhibit); expect a large accuracy loss (Fashion-MNIST: uint8 −7.5, uint4 −10.3 points from float32, "
            "docs/low-bit.md#unsigned-dtypes). The signed dtype of the same width trains close to float32 (int8 "
            "and int4 within half a point, int2 within about one).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return weights


def _metric_names(metric_set: MetricSet | None) -> tuple[str, ...]:
    """The training metrics' names of a run (its ``metric_set``), then the built-in names."""
    names = tuple(getattr(metric_set, "names", ())) if metric_set is not None else ()
    return names + tuple(n for n in METRIC_NAMES if n not in names)


def _warn_nonfinite_logs(epoch: int, logs: dict[str, float]) -> None:
    """A ``DivergenceWarning`` naming the epoch's validation values and metrics that are NaN/±Inf
    (the epoch's loss has its own warnings): the history keeps them as they are, and ``Checkpoint`` /
    ``EarlyStopping`` never take such a value as the best, so without a word a monitored
    ``val_loss`` of NaN would leave no file and no trace."""
    bad = [f"{k} is {v}" for k, v in logs.items() if k != "loss" and isinstance(v, float) and not math.isfinite(v)]
    if bad:
        warnings.warn(
            f"epoch {epoch + 1}: {', '.join(bad)} (the model's outputs or the validation data hold NaN/Inf); "
            "a non-finite value is never the best for Checkpoint or EarlyStopping",
            DivergenceWarning,
            stacklevel=user_stacklevel(),
        )
