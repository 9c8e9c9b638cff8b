"""The epoch loop that ``train()``, TargetProp and Tweening share (Loom ``poly.Train``'s skeleton).

For each epoch, for each batch in the given order, the trainer's ``step(x, y)`` runs one update and
reports the **pre-update** loss and a status:

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
one implements that hook; per-layer events are the step's business
(``torchloom.observers.layer_stats.LayerEvents``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from ..layers.network import Network
from ..observers.base import ObserverList
from ..observers.history import History
from ..observers.progress import EpochLinePrinter, ProgressObserver
from .guards import UpdateGuard, finite_flag
from .losses import prefetched_label_bounds

__all__ = [
    "StepStatus", "StepOutput", "EpochOutcome", "TrainingBatch", "TrainingResult", "Trainer", "BatchSource",
    "DivergenceWarning", "RateHolder", "NAN_LOSS_MESSAGE", "NAN_GRAD_MESSAGE", "NAN_WEIGHTS_MESSAGE", "finite_flag", "all_finite",
]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

NAN_LOSS_MESSAGE = "⚠️ Fatal NaN/Inf loss in epoch {epoch}. Skipping epoch."
NAN_GRAD_MESSAGE = "⚠️ Fatal NaN/Inf gradients in epoch {epoch}. Skipping batch updates."
NAN_WEIGHTS_MESSAGE = "⚠️ Non-finite weights after an update in epoch {epoch}. Update undone."
_MESSAGES = {"nan_loss": NAN_LOSS_MESSAGE, "nan_grad": NAN_GRAD_MESSAGE, "nan_weights": NAN_WEIGHTS_MESSAGE}


class StepStatus(enum.Enum):
    OK = "ok"
    NAN_LOSS = "nan_loss"
    NAN_GRAD = "nan_grad"
    NAN_WEIGHTS = "nan_weights"  # the update made a weight or state non-finite: it was undone


class DivergenceWarning(RuntimeWarning):
    """An epoch in which no batch counted (every loss or update was non-finite, or no batch came):
    its loss is reported as NaN. Issued whatever the ``verbose`` level."""


class StepOutput(NamedTuple):
    """What one training step reports: the pre-update ``loss``, its ``status`` and optional extra
    per-step numbers (``logs``, plain floats, averaged into the epoch logs)."""

    loss: float
    status: StepStatus = StepStatus.OK
    logs: dict[str, float] | None = None


@dataclass
class TrainingBatch:
    """One batch: ``input [batch, ...]`` and ``target`` (same leading batch size)."""

    input: Tensor
    target: Tensor


@dataclass
class TrainingResult:
    """What a training run returns (Loom's ``TrainingResult`` plus torchloom's extras).

    ``final_loss``: the last epoch's loss; ``total_time``: seconds; ``loss_history``: one loss per
    epoch (NaN for an epoch in which no batch counted: see ``DivergenceWarning``); ``epoch_times``:
    seconds per epoch; ``samples_per_second``: real samples/s over the run; ``skipped_batches``:
    batches that did not count (NaN/Inf loss, NaN/Inf gradients, an update undone because it made a
    weight non-finite, and batches an abandoned epoch did not reach); ``skipped_per_epoch``: the same,
    epoch by epoch; ``history``: every epoch log (``History``); ``perf``: per-epoch samples/s and mean
    step time when ``track_perf`` was set."""

    final_loss: float
    total_time: float
    loss_history: list[float]
    epoch_times: list[float]
    samples_per_second: float = 0.0
    skipped_batches: int = 0
    history: History = field(default_factory=History)
    perf: list[dict[str, float]] | None = None
    skipped_per_epoch: list[int] = field(default_factory=list)


@dataclass
class EpochOutcome:
    """What one epoch of steps produced: the sum and count of counted (finite, applied) batch losses,
    batches run (reached), samples in them, updates skipped, and sums of extra per-step logs."""

    loss_sum: float = 0.0
    counted: int = 0
    batches_run: int = 0
    samples: int = 0
    skipped: int = 0
    extra_sums: dict[str, float] = field(default_factory=dict)

    def add(self, loss: float, logs: dict[str, float] | None = None) -> None:
        self.loss_sum += loss
        self.counted += 1
        for k, v in (logs or {}).items():
            self.extra_sums[k] = self.extra_sums.get(k, 0.0) + v


def _to_pair(batch: Any, index: int) -> tuple[Any, Any]:
    if isinstance(batch, TrainingBatch):
        return batch.input, batch.target
    if isinstance(batch, dict) and {"input", "target"} <= batch.keys():
        return batch["input"], batch["target"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"batch {index} must be a TrainingBatch, an (input, target) pair or a dict with 'input' and "
        f"'target', got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


class BatchSource:
    """The batches of a run, re-iterable once per epoch.

    Data forms: a list of ``(input, target)`` pairs / ``TrainingBatch``es (converted, moved to the
    device and validated once, up front); a ``DataLoader`` (converted batch by batch as it streams,
    its first batch checked before training starts); a ``Dataset`` or a tuple ``(X, Y)`` of tensors,
    batched by ``config.batch_size`` (default 32) and, with ``config.shuffle``, reordered every epoch
    from ``config.seed`` (``trainers/data.py``). ``name`` names the data in error messages."""

    def __init__(
        self, batches: Any, convert: Callable[[Any, Any, int], tuple[Tensor, Tensor]], config: Any = None, *,
        name: str = "batches", shuffle: bool | None = None, dist: Any = None,
    ) -> None:
        self._convert = convert
        self._loader: Any = None
        self._items: list[tuple[Tensor, Tensor]] | None = None
        batch_size = getattr(config, "batch_size", None)
        shuffle = getattr(config, "shuffle", False) if shuffle is None else shuffle
        seed = getattr(config, "seed", None)
        is_xy = isinstance(batches, tuple) and len(batches) == 2 and all(isinstance(t, Tensor) for t in batches)
        is_dataset = isinstance(batches, torch.utils.data.Dataset) and not isinstance(batches, torch.utils.data.DataLoader)
        if is_xy or is_dataset:
            from .data import as_batch_iterable

            data = as_batch_iterable(batches, batch_size=batch_size, shuffle=shuffle, seed=seed, name=name)
            if dist is not None:  # data-parallel: this rank's equal share of every global batch
                data = dist.shard_batches(data, batch_size, name)
            if data.is_list:
                batches = data.materialise()
            else:
                self._stream(data, f"{name} is empty: it yields no batch")
                return
        elif batch_size is not None and name == "batches":
            raise ValueError(
                f"batch_size={batch_size} applies to a Dataset or an (X, Y) pair of tensors; these {name} are "
                "already batched (a list of batches or a DataLoader): leave batch_size at None"
            )
        if isinstance(batches, torch.utils.data.DataLoader):
            if dist is not None:  # data-parallel: a DistributedSampler unless the loader has the user's own
                batches = dist.distribute_loader(batches, seed)
            self._stream(batches, f"{name} is empty: the DataLoader yielded no batch")
            return
        if isinstance(batches, (str, bytes, Tensor, TrainingBatch)) or not isinstance(batches, Iterable):
            raise TypeError(
                f"{name} must be a list of TrainingBatch / (input, target) pairs, a DataLoader, a Dataset or an "
                f"(X, Y) pair of tensors, got {type(batches).__name__}"
            )
        items = list(batches)
        if not items:
            raise ValueError(f"{name} is empty: give at least one (input, target) batch")
        pairs = [_to_pair(b, i) for i, b in enumerate(items)]
        with prefetched_label_bounds(y for _, y in pairs):  # every batch's label range in one read
            self._items = [convert(x, y, i) for i, (x, y) in enumerate(pairs)]

    def _stream(self, loader: Any, empty_message: str) -> None:
        """Batches converted as they stream from ``loader``; its first batch is checked now."""
        self._loader = loader
        first = next(iter(loader), None)
        if first is None:
            raise ValueError(empty_message)
        self._convert(*_to_pair(first, 0), 0)

    def set_epoch(self, epoch: int) -> None:
        """Tell a shuffling source (or a ``DataLoader``'s ``DistributedSampler``) which epoch starts."""
        loader = self._loader
        if loader is None:
            return
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self._items is not None:
            return iter(self._items)
        return (self._convert(*_to_pair(b, i), i) for i, b in enumerate(self._loader))

    def __len__(self) -> int:
        if self._items is not None:
            return len(self._items)
        return len(self._loader)

    @property
    def sized(self) -> bool:
        try:
            len(self)
        except TypeError:  # a DataLoader over an IterableDataset has no length
            return False
        return True

    @property
    def items(self) -> list[tuple[Tensor, Tensor]] | None:
        """The converted batches of a list source (None for a DataLoader)."""
        return self._items

    @property
    def batch_sizes(self) -> list[int] | None:
        """Rows of each batch of a list source (None for a DataLoader)."""
        if self._items is None:
            return None
        return [x.shape[0] for x, _ in self._items]


class Trainer:
    """The training engine: the one epoch loop every method runs.

    A method is a subclass that implements the step rules and nothing else:

    * ``step(x, y) -> StepOutput``: one host-checked step (Loom's CPU loop acts on its status at once);
    * ``convert_batch(x, y, index)``: move one batch to ``self.device`` and check it against the model;
    * optionally the device step, for the CUDA runner (``cuda_path.CudaRunner``: decisions in device
      tensors, graph capture, one host sync per epoch): ``device_ready()``, ``device_setup(runner)``,
      ``device_step(x, y, slot, runner)`` and ``device_log_names``;
    * ``rate_groups()``: the param groups whose ``"lr"`` a schedule drives (an optimizer's, or a
      method's own rate holder); ``guarded_tensors()`` and ``training_state()`` for the guards and
      for snapshots.

    Everything else lives here and works the same for every method: data handling, the NaN/Inf and
    weight guards, observers and verbose levels, the seed, the schedule (stepped once per batch), the
    device path and its graph capture, and the result.

    Args:
        model: a ``Network``.
        config: a ``TrainingConfig`` (observers, verbose, seed, device, scheduler, clipping, CUDA graphs).
    """

    model: Network
    scheduler: Any = None
    metric_set: Any = None  # the training metrics of a fit() run (TrainingConfig.metrics), else None
    device_log_names: tuple[str, ...] = ()  # per-step logs the device step writes (averaged per epoch)
    # kernels of the fused device steps: None = Triton on CUDA; "triton" runs them on CPU tensors
    # through Triton's interpreter (the tests), "reference" never (the torch-op device step)
    kernel_backend: str | None = None

    def __init__(self, model: Network, config: Any) -> None:
        from .config import resolve_device

        self.model = model
        self.training = config  # the engine's settings (a method may keep its own config in ``config``)
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
        from .distributed import resolve_distributed

        self.dist = resolve_distributed(getattr(config, "distributed", None), self.device)  # None: single process

    @property
    def is_main(self) -> bool:
        """Whether this process prints and writes files: always, except on ranks other than 0 of
        data-parallel training (``TrainingConfig.distributed``)."""
        return self.dist is None or self.dist.is_main

    # ---------------------------------------------------------------- device path
    def device_ready(self) -> bool:
        """Whether this method can run its steps on the device (decisions in device tensors)."""
        return False

    def device_setup(self, runner: Any) -> None:
        """Lay out what the device step needs (flat buffers, state) once the runner exists."""

    def device_kernel_modules(self) -> list[str]:
        """The kernel modules the device step launches (dotted names), imported on a helper thread
        while the run gets ready (``kernels/_preload.py``). The engine's own: the step guard, the
        weight guard and the gradient norms, and the model's layers' (``Layer.kernel_modules``); a
        method adds its own."""
        layers = [m for layer in self.model.modules() for m in getattr(layer, "kernel_modules", ())]
        return ["torchloom.kernels.step_guard", "torchloom.kernels.weight_guard", "torchloom.kernels.grad_norm", *layers]

    def device_step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        raise NotImplementedError

    def rate_groups(self) -> list[dict[str, Any]]:
        """The param groups whose ``"lr"`` the schedule drives (and the graph runner's lr table sets)."""
        return []

    @property
    def batch_scheduler(self) -> Any:
        """The scheduler when it steps once per batch (``scheduler_interval="batch"``, not a
        ``ReduceLROnPlateau``), else ``None`` (stepped once per epoch by ``fit``)."""
        from .config import is_plateau

        s = self.scheduler
        if s is None or self.training.scheduler_interval != "batch" or is_plateau(s):
            return None
        return s

    @property
    def runner(self) -> Any:
        """The device runner (``None`` until ``setup`` made one: CUDA and a method with a device step)."""
        return self._runner

    # ------------------------------------------------------------------ hooks
    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        raise NotImplementedError

    def convert_batch(self, x: Any, y: Any, index: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def prepare_batch(self, x: Any, y: Any, where: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
        """What every trainer's ``convert_batch`` starts with: ``x`` and ``y`` as tensors on the
        model's device (``self.device``; floats in ``self.dtype``, integer labels as int64), checked
        to be ``[batch, ...]`` with one batch size, and the model's output shape for ``x``. ``where``
        prefixes error messages ("batch 3: ")."""
        x = x if isinstance(x, Tensor) else torch.as_tensor(x)
        y = y if isinstance(y, Tensor) else torch.as_tensor(y)
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"{where}input must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        if y.dim() == 0 or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"{where}target must have the input's batch size {x.shape[0]} as its first dimension, "
                f"got shape {list(y.shape)}"
            )
        if not (x.is_floating_point() or x.dtype in _INT_DTYPES):
            raise TypeError(f"{where}input must be a floating or integer tensor, got dtype {x.dtype}")
        if not (y.is_floating_point() or y.dtype in _INT_DTYPES):
            raise TypeError(f"{where}target must be a floating tensor or integer class labels, got dtype {y.dtype}")
        out_shape = (x.shape[0], *self.output_shape(x, where))
        x = _moved(x, self.device, self.dtype if x.is_floating_point() else x.dtype)
        y = _moved(y, self.device, torch.long if y.dtype in _INT_DTYPES else self.dtype)
        return x, y, out_shape

    def output_shape(self, x: Tensor, where: str = "") -> tuple[int, ...]:
        """The model's output shape without the batch dimension for inputs like ``x``: one forward
        (no update), on the model's current device and dtype (the data is checked before
        the model moves), once per distinct input shape and dtype, cached. A layer's ``ValueError``
        about the input's shape is raised with ``where`` in front."""
        shapes = self.__dict__.setdefault("_output_shapes", {})
        key = (tuple(x.shape[1:]), x.is_floating_point())
        if key not in shapes:
            first = next(self.model.parameters(), None)
            probe = x
            if first is not None:
                probe = probe.to(first.device, dtype=first.dtype if probe.is_floating_point() else None)
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
        (on a terminal) + epoch lines, 2 = epoch lines only, 0 = nothing."""
        printer: Any = None
        if self.is_main and self.verbose == 2:
            printer = EpochLinePrinter()
        elif self.is_main and self.verbose == 1:
            # an in-epoch bar needs a per-batch hook, which takes the run off the device path: there,
            # the bar advances per epoch instead (unless another observer forces the host loop anyway)
            host_loop = self._runner is None or any(callable(getattr(o, "on_batch_end", None)) for o in self.user_observers)
            printer = ProgressObserver(per_batch=host_loop)
        return ObserverList([*self.user_observers, *([printer] if printer else [])])

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
        from ..layers.base import precision_context

        return precision_context(self.training.precision, self.device.type)

    def _run_epoch(self, source: "BatchSource", epoch: int) -> "EpochOutcome":
        from ..observers.layer_stats import LayerEvents

        cuda_graph = self.training.cuda_graph
        if self._runner is not None and not self.observers.wants("on_batch_end") and LayerEvents.for_trainer(self) is None:
            if cuda_graph and epoch == 0 and not self._runner.graph_eligible(source):
                raise ValueError("TrainingConfig(cuda_graph=True) needs a list of batches (a DataLoader yields new tensors every epoch)")
            return self._runner.run_epoch(source, epoch)
        if cuda_graph and epoch == 0:
            raise ValueError(
                "TrainingConfig(cuda_graph=True) cannot be honoured: it needs CUDA, a method and optimizer with a "
                "device step, and no per-batch or per-layer observers"
            )
        out = self.host_epoch(source, epoch)
        scheduler = self.batch_scheduler
        if scheduler is not None and source.sized:
            for _ in range(len(source) - out.batches_run):  # batches an abandoned epoch did not reach
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
        for x, y in source:
            out.batches_run += 1
            out.samples += x.shape[0]
            guard.save()
            step = self.step(x, y)
            if step.status is StepStatus.OK and not guard.check_or_restore():  # the update overflowed: undone
                step = StepOutput(step.loss, StepStatus.NAN_WEIGHTS, step.logs)
            if scheduler is not None:
                scheduler.step()
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
                batch_logs = {"loss": step.loss, **(step.logs or {}), "batch_size": float(x.shape[0])}
                self.observers("on_batch_end", self, self.global_step - 1, batch_logs)
        return out

    def report_nan(self, status: StepStatus, epoch: int) -> None:
        """Print Loom's message for a NaN/Inf loss or gradient, or an undone update (when verbose)."""
        if self.verbose and self.is_main:
            from ..observers.progress import print_line

            print_line(_MESSAGES[status.value].format(epoch=epoch + 1))  # above a live progress bar, if any

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
        to the training device (the device runner is built after it, and after a resume's restore)."""
        self.model.to(self.device)
        if self.dist is not None:  # data-parallel: every rank starts from rank 0's weights
            self.dist.broadcast_module_(self.model)

    def _build_runner(self) -> None:
        """On CUDA, with a method that has a device step: a fresh device runner. ``fit`` builds one per
        call, after ``setup`` and a resume's restore (graphs captured over an earlier fit's batches
        must never replay over this fit's, and the device state is laid out from the trainer's state
        as it is now, restored state included)."""
        if self._on_device_path():
            from .cuda_path import CudaRunner

            self._runner = None  # the old runner's graphs and buffers go before the new ones are made
            self._runner = CudaRunner(self)

    def guarded_tensors(self) -> list[Tensor]:
        """The tensors a step's update changes (checked after it, restored when it overflowed):
        the trainable parameters here; trainers add their optimizer's or method's state."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def training_state(self) -> dict[str, Any]:
        """Everything a step changes (model, and the trainer's optimizer / method state), as tensors
        and plain values; ``load_training_state`` puts it back. The base keeps the model and the
        schedule."""
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

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
            self.join_op_warm(cancel=True)
            self._op_record_key = None  # a run that never replayed a graph keeps nothing
            self.__dict__.pop("_op_specs", None)

    def _on_device_path(self) -> bool:
        """Whether this run's steps run on the CUDA device path (a CUDA device and a method with a
        device step)."""
        return self.device.type == "cuda" and self.device_ready()

    def _start_preload(self, batches: Any) -> Any:
        """On CUDA, with a device step: a ``kernels._preload.Preload`` importing Triton and the device
        step's kernel modules while the data is converted and checked; ``None`` otherwise, and when a
        ``DataLoader`` with worker processes is about to start them (workers forked beside a thread
        that is importing could inherit a half-imported module)."""
        if not self._on_device_path():
            return None
        loaders = (batches, getattr(self.training, "validation_data", None))
        if any(isinstance(d, torch.utils.data.DataLoader) and d.num_workers > 0 for d in loaders):
            return None
        from ..kernels._preload import Preload

        arch = None
        with contextlib.suppress(Exception):  # Triton's key for the GPU, asked on this thread (e.g. 90)
            major, minor = torch.cuda.get_device_capability(self.device)
            arch = 10 * major + minor
        return Preload(self.device_kernel_modules(), arch=arch)

    def _start_op_warm(self, batches: Any) -> None:
        """On CUDA, with a device step over a list of batches: the PyTorch kernels an earlier run of
        the same key noted (``op_warm.py``) loaded on helper threads from now on; without such a list,
        this run notes its own (``op_recorder``)."""
        from . import op_warm

        self._op_warm = None
        self._op_record_key = None
        if not self._on_device_path() or not op_warm.enabled():
            return
        try:  # a hint: anything that goes wrong here means no warming, never a failed run
            data = _data_signature(batches, self.training)
            if data is None:
                return
            cfg = self.training
            settings = [*(getattr(cfg, name, None) for name in _OP_SETTINGS), bool(cfg.gradient_clip)]  # a clip: on or off
            params = [(name, tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()]
            key = op_warm.run_key([
                torch.cuda.get_device_name(self.device), type(self).__qualname__, _describe_method(cfg.method),
                _describe(settings), repr(self.model), params, data,
            ])
            specs = op_warm.load(key)
        except Exception:  # noqa: BLE001
            return
        if specs:
            self._op_warm = op_warm.OpWarm(specs, self.device)
        else:
            self._op_record_key = key

    def op_recorder(self) -> contextlib.AbstractContextManager:
        """A context to run the start and the device path's first steps in: an ``op_warm.OpRecorder``
        when this run notes its kernels for the next, else one that does nothing;
        ``finish_op_record()`` keeps what was noted."""
        key = getattr(self, "_op_record_key", None)
        if key is None:
            return contextlib.nullcontext()
        from .op_warm import OpRecorder

        specs = self.__dict__.setdefault("_op_specs", [])
        return OpRecorder(self.device, specs)

    def finish_op_record(self) -> None:
        """Keep the noted kernels for the next run of this key (once; nothing raises)."""
        key = getattr(self, "_op_record_key", None)
        specs = self.__dict__.pop("_op_specs", None)
        self._op_record_key = None
        if key is not None and specs:
            from .op_warm import save

            save(key, specs)

    def join_op_warm(self, cancel: bool = False) -> None:
        """Wait for the helper threads warming kernels, if any (before a CUDA graph capture);
        ``cancel``: the ops not yet started are left (the run is ending)."""
        warm = getattr(self, "_op_warm", None)
        if warm is not None:
            if cancel:
                warm.cancel()
            warm.join()
            self._op_warm = None

    def _get_ready(self, batches: Any, epochs: int, cfg: Any, preload: Any) -> tuple:
        """Everything before the first epoch, in ``fit``'s order: the data converted and checked, the
        checkpoint to resume from read, ``setup()``, the seed, the observers, a resume's restore, the
        preload threads joined, and the device runner. Returns ``(source, validation, history,
        observers, first_epoch)``."""
        source = batches if isinstance(batches, BatchSource) else BatchSource(batches, self.convert_batch, cfg, dist=self.dist)
        if self.dist is not None:
            self.dist.check_same_count(len(source) if source.sized else None, "batches")
        validation = None
        if cfg.validation_data is not None:
            validation = BatchSource(cfg.validation_data, self.convert_batch, cfg, name="validation_data", shuffle=False)
        resume = self._read_checkpoint(cfg.resume_from, epochs) if cfg.resume_from is not None else None
        self.setup()
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        self.metric_set = _metric_set(cfg.metrics)
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
        if resume is not None:
            first_epoch = self._restore_checkpoint(resume, history)
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
            if validation is not None:
                logs.update({f"val_{k}": v for k, v in self.evaluate_source(validation).items()})
            logs.update(
                {
                    "skipped": float(skipped),
                    "counted": float(out.counted),
                    "epoch_time": epoch_time,
                    "samples_per_second": total_samples / elapsed if elapsed > 0 else 0.0,
                    "eta": elapsed / (epoch + 1 - first_epoch) * (epochs - epoch - 1),
                }
            )
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
            observers("on_epoch_end", self, epoch, logs)
            if self.dist is not None:  # data-parallel: stop when any rank's observers asked to
                self.stop_training = self.dist.any(self.stop_training)
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
        """The loss (the method's loss: ``"mse"`` for TargetProp, the config's ``loss_type``
        otherwise) and the metrics of the model on ``source``, in eval mode without gradients, each
        a sample-weighted mean over the batches. The model's train/eval mode is restored after."""
        from .evaluate import evaluate

        was_training = self.model.training
        try:
            return evaluate(self.model, list(source), loss_type=self.eval_loss_type(), metrics=self.training.metrics, device=self.device)
        finally:
            self.model.train(was_training)

    def eval_loss_type(self) -> Any:
        """The loss ``val_loss`` reports: the one the training loss reports."""
        return self.training.loss_type

    def observe_outputs(self, output: Tensor, target: Tensor) -> None:
        """Feed a training step's (pre-update) outputs to the training metrics, if any (no host read)."""
        if self.metric_set is not None:
            self.metric_set.update(output, target)

    def _epoch_scheduler_step(self, logs: dict[str, float]) -> None:
        from .config import is_plateau

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
        """The whole state of the run after ``self.epoch`` completed epochs: model, optimizer or method
        state, schedule, random-number states, history. Only tensors, numbers, strings, lists and
        dicts: ``torch.load(path, weights_only=True)`` reads it back."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": CHECKPOINT_FORMAT,
            "method": type(self).__name__,
            "epoch": int(self.epoch),
            "global_step": int(self.global_step),
            "training": self.training_state(),
            "rng": rng,
            "history": {k: list(v) for k, v in self.history.history.items()},
            "loss_history": list(self.loss_history),
            "epoch_times": list(self.epoch_times),
            "skipped_per_epoch": list(self.skipped_per_epoch),
        }

    def _read_checkpoint(self, path: Any, epochs: int) -> dict[str, Any]:
        """Read and check a full-state checkpoint (``weights_only=True``: data, never code)."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"resume_from: no such file {str(path)!r}") from None
        except Exception as e:
            raise ValueError(f"resume_from: {str(path)!r} is not a readable torchloom checkpoint ({type(e).__name__}: {e})") from None
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"resume_from: {str(path)!r} holds no full training state (write it with Checkpoint(..., full_state=True), "
                "the default); a bare state_dict loads with model.load_state_dict instead"
            )
        if state["method"] != type(self).__name__:
            raise ValueError(f"resume_from: the checkpoint was written by {state['method']}, this run uses {type(self).__name__}")
        if state["epoch"] >= epochs:
            raise ValueError(
                f"epochs: the checkpoint has {state['epoch']} epochs done already; epochs counts the whole run, "
                f"so it must be > {state['epoch']} to train more, got {epochs}"
            )
        own = self.model.state_dict()
        theirs = state["training"]["model"]
        shapes = {k: tuple(v.shape) for k, v in own.items()}
        if set(theirs) != set(own) or any(tuple(theirs[k].shape) != shapes[k] for k in own):
            raise ValueError(f"resume_from: the checkpoint's model does not match this model (parameters {sorted(theirs)} vs {sorted(own)})")
        return state

    def _restore_checkpoint(self, state: dict[str, Any], history: "History") -> int:
        """Put a checked checkpoint's state in place; returns the first epoch to run."""
        self.load_training_state(_to_device(state["training"], self.device))
        for key, values in state["history"].items():
            history.history[key] = list(values)
        history.epochs = list(range(state["epoch"]))
        self.loss_history = list(state["loss_history"])
        self.epoch_times = list(state["epoch_times"])
        self.skipped_per_epoch = list(state["skipped_per_epoch"])
        self.global_step = int(state["global_step"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        return int(state["epoch"])


CHECKPOINT_FORMAT = "torchloom-training-state-1"


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised by the caller of this function that names the first
    frame outside torchloom: the user's ``train()`` / ``fit()`` call, however deep the engine's own
    calls go."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _moved(t: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``t`` on ``device`` in ``dtype``, itself when it is already (no PyTorch call: each releases and
    takes back the interpreter lock, a wait while a helper thread holds it)."""
    if t.device == device and t.dtype == dtype:
        return t
    return t.to(device, dtype=dtype, non_blocking=True)


def _to_device(obj: Any, device: torch.device) -> Any:
    """Tensors of a loaded state moved to the training device (optimizer states stay where their
    ``load_state_dict`` puts them)."""
    if isinstance(obj, Tensor):
        return obj.to(device) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: (v if k in ("optimizer", "scheduler") else _to_device(v, device)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj


def _metric_set(metrics: Sequence[Any]) -> Any:
    if not metrics:
        return None
    from .metrics import MetricSet

    return MetricSet(list(metrics))


@torch.no_grad()
def flatten_tensors_(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Re-home ``tensors`` (same dtype and device) as consecutive views of one new buffer holding the
    same values, re-pointing ``.data`` so every holder keeps its object; returns the views."""
    from .optim import _rehome

    tensors = list(tensors)
    if len(tensors) < 2 or any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors):
        return tensors
    views = _rehome([t.data for t in tensors])
    for t, v in zip(tensors, views):
        t.data = v
    return tensors


def as_flat(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``[flat]`` when ``tensors`` are consecutive views of one buffer (``flatten_tensors_``), else
    ``tensors``: the guard and the multi-tensor ops then touch one tensor."""
    from ..kernels._update import coalesce

    tensors = [t for t in tensors if t.numel()]
    flat = coalesce(tensors) if len(tensors) > 1 else None
    return flat[0] if flat is not None else tensors


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


# the settings of a TrainingConfig that change which kernels a step launches (with the method, the
# model, the batches' shapes and whether gradients are clipped: ``Trainer._start_op_warm``'s key)
_OP_SETTINGS = (
    "loss_type", "clip_mode", "optimizer", "scheduler", "cuda_graph", "precision",
    "scheduler_interval", "batch_size", "shuffle", "distributed",
)


def _describe(value: Any) -> Any:
    """``value`` for a run key, the same in every process: objects by class name (an optimizer or a
    schedule, whose repr may hold addresses), plain values and containers as they are."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return type(value).__qualname__


def _describe_method(method: Any) -> Any:
    """``TrainingConfig.method`` for a run key: a name as it is; a config by class and field by field,
    each number by whether it is zero (a rate's size launches no other kernel, a switched-off rule
    may), other fields as ``_describe``."""
    if not dataclasses.is_dataclass(method) or isinstance(method, type):
        return _describe(method)
    fields = []
    for f in dataclasses.fields(method):
        v = getattr(method, f.name)
        fields.append((f.name, v != 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else _describe(v)))
    return [type(method).__qualname__, *fields]


def _data_signature(batches: Any, cfg: Any) -> Any:
    """The shapes and dtypes that decide a run's kernels: a list of ``(x, y)`` tensor batches by its
    first and last batch; ``(X, Y)`` tensors by their row shapes, the batch size and the ragged
    remainder; None for anything else (no kernel warming)."""
    def shapes(pair: Any) -> Any:
        if not isinstance(pair, (list, tuple)) or not pair or not all(isinstance(t, Tensor) for t in pair):
            return None
        return [(tuple(t.shape), t.dtype, t.device.type) for t in pair]

    if not isinstance(batches, (list, tuple)) or not batches:
        return None
    if len(batches) == 2 and all(isinstance(t, Tensor) for t in batches):
        from .data import DEFAULT_BATCH_SIZE

        size = cfg.batch_size or DEFAULT_BATCH_SIZE
        return ["tensors", [(tuple(t.shape[1:]), t.dtype, t.device.type) for t in batches], size, batches[0].shape[0] % size]
    first, last = shapes(batches[0]), shapes(batches[-1])
    return None if first is None or last is None else ["list", first, last]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """``finite_flag`` read on the host (one sync)."""
    return bool(finite_flag(tensors))
