"""The engine's device runner: every method's step on CUDA, graph-captured, read back once per epoch.

Loom's GPU trainer records forward, loss gradient, backward and update of a batch into one command
buffer and reads back only partial loss sums. Here a method's ``device_step(x, y, slot, runner)``
records one step with every decision in device tensors, using three services of the runner:

1. ``runner.decide(slot, loss_partials, sq_partials, clip_norm)``: the step guard
   (``kernels/step_guard.py``) adds up the loss and the squared-norm partials and decides on the
   device whether the update may happen (NaN/Inf loss: no, and the rest of the epoch is abandoned;
   NaN/Inf gradient or update direction: no), records the step's loss and status in per-epoch arrays,
   and writes ``found_inf`` (nonzero: update nothing) and the clip-by-norm ``grad_scale``;
2. ``with runner.guard_update(slot):`` around the update: the tensors the update changes
   (``trainer.guarded_device_tensors()``) are copied before it and put back in place
   when it made any of them non-finite (status 4, ``NAN_WEIGHTS``), without a host read. A method
   whose optimizer can look ahead (``SGD.probe``: the values the update would write, checked in the
   same pass as the gradients' squared norm) passes ``update_flag=runner.update_flag`` to ``decide``
   instead, so a step whose update would make a finite value NaN/±Inf gets status 4 and ``found_inf`` before
   anything changes, and wraps its update in ``guard_update(slot, checked=True)``: no backup copy,
   no check after, no restore (three passes over the weights fewer);
3. ``runner.log(slot, values)``: the method's per-step logs (``trainer.device_log_names``, e.g. Tween's
   mean gap), one row per step, averaged into the epoch log at read-back.

The runner knows no method's rules. Nothing in a step reads a device value on the host, so steps
queue up back to back. When the batches are a list (shapes fixed per position, a ragged last batch
included) the steps are captured in two CUDA graphs, whatever the number of batches: one of
up to ``STEPS_PER_GRAPH`` steps (fewer in a short run) over static input slots, replayed once per chunk of that many batches
(copied into the slots by one ``torch.stack``), and one for the remaining tail (``_capture``). Capture
starts in the first epoch when no layer needs an eager host check of its inputs (Embedding's index
range), else in the second. A ``DataLoader`` (new tensors every epoch) runs eager device steps. At the end of an epoch
one host sync reads the per-step losses, statuses and logs, prints Loom's NaN messages and fills the
epoch log.

Alignment diagnostics (``TrainingConfig.alignment_every``, ``alignment.py``): a measured step is the
probe's device-only measurement, the step, and the probe's fold (``measured_step``). Captured, it
runs through two extra one-step graphs (``_capture_single``: with and without the probe), which
``_replay`` uses, step by step, for a chunk (or the tail) holding a measured step; other chunks
replay their graph as usual.

Learning-rate schedules: the schedule is advanced on the host once per batch of the epoch ahead of
time, and each captured step reads its learning rate from a device table filled at epoch start (the
rate groups of ``trainer.rate_groups()`` point at their row).
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..layers.base import host_checks
from .guards import UpdateGuard
from .types import EpochOutcome, StepStatus, batch_rows, user_stacklevel

__all__ = ["CudaRunner", "STEPS_PER_GRAPH", "NAN_WEIGHTS", "steps_per_graph"]

# Steps recorded into the chunk graph, at most: enough to amortise a replay's six launches (two slot
# stacks, the graph, three result copies) over many steps, few enough that capture stays short:
# capturing costs the Python of every recorded step (~1 ms of host time a step on the H100 machine,
# Tween's more), and a graph's instantiation grows with its nodes. At 64, a 59-batch epoch captured 59
# steps (~0.5 s of a 4-epoch Tween run at batch 1,024, H100); at 16 it captures at most 31 (16 + a
# tail of at most 15). Shorter runs record fewer (``steps_per_graph``).
STEPS_PER_GRAPH = 16
# A recorded step costs about as much host time as this many chunk replays (H100 machine: ~1 ms
# against ~50 µs); it sets ``steps_per_graph``'s balance.
_RECORD_VS_REPLAY = 20


def steps_per_graph(steps_left: int) -> int:
    """How many steps the chunk graph records for a run with ``steps_left`` steps still to go: the
    power of two K in [2, STEPS_PER_GRAPH] nearest (on a log scale) to √(steps_left /
    _RECORD_VS_REPLAY), which balances recording K steps once against steps_left / K replays of the
    chunk graph (the tail graph's steps, at most K more, are left out of the balance). A 4-epoch run of
    59 batches (236 steps) records 4 + 3 steps instead of 16 + 11; a 4-epoch run of 469 batches or more
    keeps 8 or 16. The steps are the same steps whatever K: the numbers do not change with it."""
    best = math.sqrt(max(steps_left, 1) / _RECORD_VS_REPLAY)
    k = 2
    while k < STEPS_PER_GRAPH and best >= k * math.sqrt(2):  # nearest power of two, on a log scale
        k *= 2
    return k


_STATUS = {1: StepStatus.NAN_LOSS, 2: StepStatus.NAN_GRAD, 4: StepStatus.NAN_WEIGHTS}
NAN_WEIGHTS = 4  # status written after the update when it made a weight or state non-finite (undone)
_SLOT = 4  # 4 × 4 bytes: one 16-byte-aligned row per step or learning rate


@contextlib.contextmanager
def capturing(graph: "torch.cuda.CUDAGraph", pool: object | None = None) -> Iterator[None]:
    """``torch.cuda.graph`` for the engine's captures, made robust against what other code does
    meanwhile: Python's garbage collector is paused (a collection in the middle of a capture can free
    CUDA objects left by earlier code, which the capture forbids), and only this thread's CUDA calls
    are checked (``capture_error_mode="thread_local"``: a thread of other code that calls CUDA, say a
    data loader's, cannot break the capture). ``torch.cuda.graph`` itself collects garbage first."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


# ops that read a device value on the host (a stream synchronisation a CUDA graph cannot hold)
_HOST_READS = frozenset({
    "_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "nonzero_static", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave", "bincount", "histc",
})


class _NoHostReads(TorchDispatchMode):
    """Raises ``RuntimeError`` at the first op of a step that reads a device value on the host
    (``.item()``, ``bool(t)``, ``nonzero``, a copy to the CPU, ...): such a step cannot be captured, and
    a capture that fails half way leaves CUDA's random-number state unusable. A dispatch mode of this
    thread only, active around the warm-up steps before a capture."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_READS or (name in ("_to_copy", "copy_") and _to_host(name, args, kwargs)):
            raise RuntimeError(f"the step reads a device value on the host ({func})")
        return func(*args, **kwargs)


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a ``_to_copy`` / ``copy_`` moves a CUDA tensor's values to the CPU."""
    if name == "_to_copy":
        dst = kwargs.get("device")
        return isinstance(args[0], Tensor) and args[0].is_cuda and dst is not None and torch.device(dst).type == "cpu"
    dst, src = args[0], args[1]
    return isinstance(src, Tensor) and src.is_cuda and isinstance(dst, Tensor) and dst.device.type == "cpu"


def _needs_eager_checks(model: torch.nn.Module) -> bool:
    """Whether a layer validates its input on the host (Embedding's index range): such a model runs
    its first epoch eagerly, checking every batch, before any graph is captured."""
    from ..layers.embedding import Embedding

    return any(isinstance(m, Embedding) for m in model.modules())


class CudaRunner:
    """Runs the epochs of one training run on the device, for any method with a device step (see the
    module docstring). It also runs on CPU tensors (kernels fall back to their references), which the
    tests use to check a method's device step against its host step; graphs need CUDA."""

    def __init__(self, trainer: Any) -> None:  # the engine's Trainer
        self.t = trainer
        dev = trainer.device
        self.dead = torch.zeros((), dtype=torch.int32, device=dev)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        # the clip scale multiplies the gradients: float64 models keep it in float64
        scale_dtype = torch.float64 if trainer.dtype == torch.float64 else torch.float32
        self.grad_scale = torch.ones((), dtype=scale_dtype, device=dev)
        # raised by an optimizer's look-ahead (``SGD.probe``) when the update would make a finite value NaN/±Inf;
        # read and zeroed by the step guard (``decide(update_flag=...)``)
        self.update_flag = torch.zeros((), dtype=torch.int32, device=dev)
        # per-step results, one 16-byte row per step: every slot a kernel writes is 16-byte aligned, so
        # all steps share one compiled kernel specialisation (Triton specialises on pointer alignment,
        # and nothing may compile while a graph is being captured)
        # per-step losses in float32 (the fused kernels' accumulator), float64 for float64 models
        self.loss_dtype = torch.float64 if trainer.dtype == torch.float64 else torch.float32
        self.step_loss = torch.zeros(0, _SLOT, dtype=self.loss_dtype, device=dev)
        self.step_status = torch.zeros(0, _SLOT, dtype=torch.int32, device=dev)
        self.n_logs = len(trainer.device_log_names)
        self.step_logs = torch.zeros(0, max(self.n_logs, 1), dtype=torch.float64, device=dev)
        self.lr_table: Tensor | None = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self._chunk: dict[str, Any] | None = None
        self._single: dict[str, Any] | None = None  # the one-step graphs of alignment diagnostics
        self._tail_start = 0
        self._streamed_samples = 0
        self.capture_count = 0  # graphs captured (for tests and curiosity)
        self.capture_failed = False
        self._step_lrs: dict[int, dict[str, float]] = {}
        # data-parallel on CUDA: events recorded as the epoch's steps are queued, waited for in order
        # with the process group's timeout at read-back (``DistContext.wait_device``)
        self._progress: list[Any] = []
        self.eager_first_epoch = _needs_eager_checks(trainer.model)
        trainer.device_setup(self)
        tensors = trainer.guarded_device_tensors
        self.update_guard = UpdateGuard(tensors)
        # module buffers (BatchNorm statistics) change in the forward: saved before every step and put
        # back when it did not count (status nonzero), device ops only (guards.py)
        self.buffer_guard = UpdateGuard(trainer.guarded_buffers) if trainer.guarded_buffers() else None

    # ------------------------------------------------------------ services for device steps
    def decide(
        self, slot: int, loss_partials: Tensor, sq_partials: Tensor, clip_norm: float = 0.0, update_flag: Tensor | None = None
    ) -> None:
        """The step guard for ``slot``: status and loss recorded, ``found_inf`` and ``grad_scale``
        written. ``update_flag`` (``runner.update_flag``, raised by a look-ahead of the update): when
        set on an otherwise OK step, the status is ``NAN_WEIGHTS`` and the update is refused; the
        flag is zeroed for the next step."""
        from ..kernels.step_guard import step_guard_

        step_guard_(
            loss_partials, sq_partials, self.dead, self.step_loss[slot, 0], self.step_status[slot, 0],
            self.found_inf, self.grad_scale, clip_norm, update_flag=update_flag,
        )

    @contextlib.contextmanager
    def guard_update(self, slot: int, checked: bool = False) -> Iterator[None]:
        """Around an update: copy what it changes before, undo it in place when it made anything
        non-finite (status ``NAN_WEIGHTS`` for ``slot``); device ops only. ``checked=True``: the
        step's ``decide`` already had the look-ahead's ``update_flag``, covering everything this
        update changes, so the update either writes finite values or (``found_inf``) nothing:
        nothing is copied or checked."""
        if checked:
            yield
            return
        self.update_guard.device_flag(self.t.device)
        self.update_guard.save()
        yield
        self.update_guard.restore_if_nonfinite_(self.step_status[slot, 0])

    def guarded_step(self, x: Tensor, y: Tensor, slot: int) -> None:
        """The method's device step for ``slot``, with the model's buffers saved before it and put
        back after it when its status is not OK."""
        guard = self.buffer_guard
        if guard is not None:
            guard.device_flag(self.t.device)
            guard.save()
        self.t.device_step(x, y, slot, self)
        if guard is not None:
            guard.restore_unless_ok_(self.step_status[slot, 0])

    def probe(self) -> Any:
        """The run's alignment probe (``TrainingConfig.alignment_every``; ``engine/alignment.py``) with
        its device accumulators made, or ``None``."""
        probe = self.t.__dict__.get("alignment")
        if probe is not None:
            probe.device_buffers(self.t.device)
        return probe

    def measured_step(self, x: Tensor, y: Tensor, slot: int, measured: bool) -> None:
        """``guarded_step``, preceded by the alignment probe's measurement and followed by its fold
        (the angles counted when the step's status is OK) when ``measured``; device ops only."""
        if measured:
            self.t.alignment.measure(x, y)
        self.guarded_step(x, y, slot)
        if measured:
            self.t.alignment.fold(self.step_status[slot, 0])

    def log(self, slot: int, values: Sequence[Tensor] | Tensor) -> None:
        """Write the method's per-step logs (``trainer.device_log_names`` order) into row ``slot``."""
        row = values if isinstance(values, Tensor) else torch.stack([v.reshape(()).double() for v in values])
        self.step_logs[slot, : self.n_logs].copy_(row)

    def graph_eligible(self, source: Any) -> bool:
        """Whether the steps over ``source`` may be captured and replayed: a list of batches on CUDA,
        and no training metrics (their running sums live on the host side of each step)."""
        t = self.t
        return (
            t.device.type == "cuda" and t.training.cuda_graph is not False and source.items is not None
            and not getattr(source, "shuffled", False)  # graphs replay the batches in one order
            and getattr(t, "metric_set", None) is None
        )

    # ---------------------------------------------------------------------- one epoch
    @torch.no_grad()
    def run_epoch(self, source: Any, epoch: int) -> EpochOutcome:
        t = self.t
        n = len(source) if source.sized else None
        self._prepare_arrays(n)
        self.dead.zero_()
        if self.graphs is None:  # captured graphs hold their tensors: no re-layout
            t.device_epoch_begin(self, epoch)
        first_capture = epoch > 0 or not self.eager_first_epoch
        if self.graphs is None and not self.capture_failed and first_capture and self.graph_eligible(source):
            try:
                self._capture(source, steps_left=len(source) * max(t.epochs - epoch, 1))
            except RuntimeError as e:  # a layer or update that cannot be captured (a host read)
                if t.training.cuda_graph:
                    raise
                self.capture_failed = True
                torch.cuda.synchronize(t.device)
                cause = e
                while cause.__context__ is not None:  # the first failure, not capture_end's echo of it
                    cause = cause.__context__
                warnings.warn(
                    f"train(): this training step cannot be captured in a CUDA graph ({type(cause).__name__}: "
                    f"{str(cause).splitlines()[0]}); running it eagerly on the device instead. "
                    "TrainingConfig(cuda_graph=False) silences this.",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
        every = getattr(t.training, "log_every_n_steps", 0)
        start = t.global_step
        probe = self.probe()

        def logged(k: int) -> bool:  # whether step k of this epoch's logs are delivered (log_every_n_steps)
            return every > 0 and (start + k + 1) % every == 0

        self._step_lrs: dict[int, dict[str, float]] = {}  # the rates of the logged steps, host floats
        if self.graphs is not None:
            if every > 0:
                base = t.lr_logs()
                self._step_lrs = {k: base for k in range(n) if logged(k)}
            if t.scheduler is not None:
                self.lr_table[:, :, 0].copy_(self._epoch_lrs(n))
                if every > 0:
                    names = list(base)
                    self._step_lrs = {k: dict(zip(names, self._lr_rows[k])) for k in range(n) if logged(k)}
            with t.op_recorder():
                self._replay(source, start)
            t.finish_op_record()
            count = n
        else:
            count = 0
            self._streamed_samples = 0
            for k, (x, y) in enumerate(t.epoch_batches(source, epoch)):
                if k >= self.step_loss.shape[0]:
                    self._grow_arrays()
                if logged(k):
                    self._step_lrs[k] = t.lr_logs()
                self.measured_step(x, y, k, probe is not None and probe.due(start + k))
                if t.batch_scheduler is not None:
                    t.batch_scheduler.step()
                count += 1
                if count % STEPS_PER_GRAPH == 0:
                    self._mark_progress()
                self._streamed_samples += batch_rows(x)
        t.global_step += count
        return self._read_back(count, epoch, source)

    # ------------------------------------------------------------------------- helpers
    def _prepare_arrays(self, n: int | None) -> None:
        size = n if n is not None else max(self.step_loss.shape[0], 64)
        if self.step_loss.shape[0] != size:
            dev = self.t.device
            self.step_loss = torch.zeros(size, _SLOT, dtype=self.loss_dtype, device=dev)
            self.step_status = torch.zeros(size, _SLOT, dtype=torch.int32, device=dev)
            self.step_logs = torch.zeros(size, self.step_logs.shape[1], dtype=torch.float64, device=dev)

    def _grow_arrays(self) -> None:
        rows = self.step_loss.shape[0]
        for name in ("step_loss", "step_status", "step_logs"):
            old = getattr(self, name)
            new = torch.zeros(2 * rows, old.shape[1], dtype=old.dtype, device=old.device)
            new[:rows] = old
            setattr(self, name, new)

    def _epoch_lrs(self, n: int) -> Tensor:
        """This epoch's learning rates ``[n, groups]``, found on the host by advancing a per-batch
        scheduler once per batch ahead of the replay (an epoch-interval scheduler keeps them fixed)."""
        groups = self.t.rate_groups()
        scheduler = self.t.batch_scheduler
        rows = []
        for _ in range(n):
            rows.append([float(g["lr"]) for g in groups])
            if scheduler is not None:
                scheduler.step()
        self._lr_rows = rows  # as host floats, for the step logs (log_every_n_steps)
        return torch.tensor(rows, dtype=torch.float32)

    def _capture(self, source: Any, steps_left: int) -> None:
        """Capture the epoch's steps in two CUDA graphs that share one memory pool, whatever the
        number of batches:

        * the **chunk graph**: ``K = steps_per_graph(steps_left)`` steps reading their inputs from a static slot
          buffer ``[K, batch, ...]`` (and their learning rates from ``K`` slot rows), writing their
          results into ``K`` slot rows. It serves every whole chunk of ``K`` equal-shaped batches:
          before each replay one ``torch.stack`` copies the chunk's batches into the slots, after it
          one copy per result array moves the slot rows to the epoch's rows;
        * the **tail graph**: the remaining steps (at most ``K``, a ragged last batch among them),
          captured over their own batches and rows.

        So capture costs at most ``2K`` recorded steps, not one per batch, and a replay costs one
        stack, one graph launch and three small copies per ``K`` steps. A masked warm-up first
        compiles every kernel specialisation the captured steps use (the learning rate read from the
        device, for one) and creates lazily made state: compiling or allocating state is impossible
        during capture. It runs with CUDA's sync debug mode set to "error", so a step that reads a
        device value on the host fails there, before any capture starts (a capture that fails midway
        leaves CUDA's random-number state unusable for the rest of the process)."""
        t = self.t
        items = source.items
        n = len(items)
        groups = t.rate_groups()
        host_lrs = [g["lr"] for g in groups]
        x0, y0 = items[0]
        same = 0
        while same < n and items[same][0].shape == x0.shape and items[same][1].shape == y0.shape:
            same += 1
        k_steps = steps_per_graph(steps_left)
        n_chunks = same // k_steps
        self._chunk = None
        if n_chunks:
            self._chunk = {
                "x": torch.empty(k_steps, *x0.shape, dtype=x0.dtype, device=x0.device),
                "y": torch.empty(k_steps, *y0.shape, dtype=y0.dtype, device=y0.device),
                "loss": torch.zeros(k_steps, _SLOT, dtype=self.loss_dtype, device=t.device),
                "status": torch.zeros(k_steps, _SLOT, dtype=torch.int32, device=t.device),
                "logs": torch.zeros(k_steps, self.step_logs.shape[1], dtype=torch.float64, device=t.device),
                "lr": torch.zeros(k_steps, len(groups), _SLOT, dtype=torch.float32, device=t.device),
                "n_chunks": n_chunks,
            }
        tail_start = n_chunks * k_steps
        self._tail_start = tail_start
        self._single = None
        if t.scheduler is not None:  # each captured step reads its lr from its (aligned) row
            self.lr_table = torch.zeros(n, len(groups), _SLOT, dtype=torch.float32, device=t.device)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        try:
            with host_checks(False):  # every batch was checked before (shapes up front, or an eager epoch)
                self._use_lr_row(0)
                # two masked warm-ups: the first creates lazily made state (a first-step kernel
                # variant), the layout then takes it in, the second compiles the variants of later steps
                # ... and one more for every other batch shape (a ragged last batch): its kernel
                # variants must be compiled before the capture too
                shapes = {}
                for k, (x, y) in enumerate(items):
                    shapes.setdefault((tuple(x.shape), tuple(y.shape)), k)
                warmups = [0, 0, *[k for k in shapes.values() if k != 0]]
                probe = self.probe()
                with t.op_recorder():  # a first run notes the kernels for the next (op_warm.py)
                    for i, k in enumerate(warmups):
                        self.dead.fill_(1)  # the guard reports NOT_RUN, so the warm-up updates nothing
                        try:  # a host read would break the capture: found here, before it starts
                            with _NoHostReads():  # (the probe's measurement too: NOT_RUN counts nothing)
                                self.measured_step(*items[k], k, probe is not None and i == 1)
                        finally:
                            self.dead.zero_()
                        t.device_epoch_begin(self, 1)  # state the warm-up created joins the layout
                t.join_op_warm()  # no helper thread launches anything while a graph is captured
                torch.cuda.synchronize(t.device)
                if self._chunk is not None:
                    c = self._chunk
                    epoch_rows = (self.step_loss, self.step_status, self.step_logs)
                    self.step_loss, self.step_status, self.step_logs = c["loss"], c["status"], c["logs"]
                    try:
                        graph = torch.cuda.CUDAGraph()
                        with capturing(graph, pool):
                            for k in range(k_steps):
                                self._use_lr_row(k, table=c["lr"] if t.scheduler is not None else None)
                                self.guarded_step(c["x"][k], c["y"][k], k)
                    finally:
                        self.step_loss, self.step_status, self.step_logs = epoch_rows
                    c["graph"] = graph
                    self.capture_count += 1
                if tail_start < n:
                    graph = torch.cuda.CUDAGraph()
                    with capturing(graph, pool):
                        for k in range(tail_start, n):
                            self._use_lr_row(k)
                            self.guarded_step(*items[k], k)
                    graphs.append(graph)
                    self.capture_count += 1
                if probe is not None:
                    self._single = self._capture_single(x0, y0, pool, probe)
        finally:
            for g, lr in zip(groups, host_lrs):
                g["lr"] = lr
        self.graphs = graphs

    def _capture_single(self, x0: Tensor, y0: Tensor, pool: Any, probe: Any) -> dict[str, Any]:
        """With alignment diagnostics: two one-step graphs over one static slot of the first batch's
        shape, ``"plain"`` (the step) and ``"probe"`` (the probe's measurement, the step, the fold),
        through which ``_replay`` runs the chunks that hold a measured step."""
        t = self.t
        groups = t.rate_groups()
        one = {
            "x": x0.clone(), "y": y0.clone(),
            "loss": torch.zeros(1, _SLOT, dtype=self.loss_dtype, device=t.device),
            "status": torch.zeros(1, _SLOT, dtype=torch.int32, device=t.device),
            "logs": torch.zeros(1, self.step_logs.shape[1], dtype=torch.float64, device=t.device),
            "lr": torch.zeros(1, len(groups), _SLOT, dtype=torch.float32, device=t.device),
        }
        epoch_rows = (self.step_loss, self.step_status, self.step_logs)
        self.step_loss, self.step_status, self.step_logs = one["loss"], one["status"], one["logs"]
        try:
            for name in ("plain", "probe"):
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, pool):
                    self._use_lr_row(0, table=one["lr"] if t.scheduler is not None else None)
                    self.measured_step(one["x"], one["y"], 0, name == "probe")
                one[name] = graph
                self.capture_count += 1
        finally:
            self.step_loss, self.step_status, self.step_logs = epoch_rows
        return one

    def _replay_one(self, k: int, x: Tensor, y: Tensor, measured: bool) -> None:
        """Step ``k`` of the epoch alone: through the one-step graphs when ``x``, ``y`` have their shape,
        else (a ragged last batch) eagerly; measured by the alignment probe when ``measured``."""
        one = self._single
        if x.shape == one["x"].shape and y.shape == one["y"].shape:
            one["x"].copy_(x)
            one["y"].copy_(y)
            if self.lr_table is not None:
                one["lr"].copy_(self.lr_table[k : k + 1])
            one["probe" if measured else "plain"].replay()
            self._take_rows(k, k + 1, one)
            return
        groups = self.t.rate_groups()
        host_lrs = [g["lr"] for g in groups]
        try:
            self._use_lr_row(k)
            self.measured_step(x, y, k, measured)
        finally:
            for g, lr in zip(groups, host_lrs):
                g["lr"] = lr

    def _replay(self, source: Any, start: int = 0) -> None:
        """One epoch from the captured graphs (see ``_capture``); with alignment diagnostics, a chunk
        (or the tail) that holds a measured step (global step ``start + k``) runs step by step
        through the one-step graphs (``_capture_single``) instead."""
        c = self._chunk
        items = source.items
        probe = self.probe() if self._single is not None else None
        measured = {k for k in range(len(items)) if probe.due(start + k)} if probe is not None else set()
        if c is not None:
            k_steps = c["x"].shape[0]
            for chunk in range(c["n_chunks"]):
                lo, hi = chunk * k_steps, (chunk + 1) * k_steps
                if measured and any(k in measured for k in range(lo, hi)):
                    for k in range(lo, hi):
                        self._replay_one(k, *items[k], k in measured)
                    self._mark_progress()
                    continue
                torch.stack([x for x, _ in items[lo:hi]], out=c["x"])
                torch.stack([y for _, y in items[lo:hi]], out=c["y"])
                if self.lr_table is not None:
                    c["lr"].copy_(self.lr_table[lo:hi])
                c["graph"].replay()
                self._mark_progress()
                self._take_rows(lo, hi, c)
        tail = range(self._tail_start, len(items))
        if measured and any(k in measured for k in tail):
            for k in tail:
                self._replay_one(k, *items[k], k in measured)
            return
        for graph in self.graphs:
            graph.replay()

    def _take_rows(self, lo: int, hi: int, slots: dict[str, Any]) -> None:
        """Steps ``lo:hi`` of the epoch's losses, statuses and logs from a replayed graph's ``slots``."""
        self.step_loss[lo:hi].copy_(slots["loss"])
        self.step_status[lo:hi].copy_(slots["status"])
        if self.n_logs:
            self.step_logs[lo:hi].copy_(slots["logs"])

    def _mark_progress(self) -> None:
        """Data-parallel on CUDA: note (a CUDA event) that the steps queued so far are done once it
        completes: read-back waits for each within the process group's timeout."""
        if self.t.dist is not None and self.t.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._progress.append(event)

    def release(self) -> None:
        """Drop the captured graphs (their memory pool goes with the last tensor allocated in it). A
        graph that captured NCCL collectives holds a reference on the communicator, and
        ``destroy_process_group`` (or the process group's destructor at exit) waits until it is
        destroyed: the engine releases a data-parallel run's graphs as ``fit`` returns or raises, so
        that the process can exit."""
        self.graphs = None
        self._chunk = None
        self._single = None
        self._progress = []

    def _use_lr_row(self, k: int, table: Tensor | None = None) -> None:
        """Point every rate group's lr at row ``k`` of the lr table, or of ``table`` (when there is a
        schedule)."""
        table = self.lr_table if table is None else table
        if table is not None:
            for j, g in enumerate(self.t.rate_groups()):
                g["lr"] = table[k, j, 0]

    def _read_back(self, count: int, epoch: int, source: Any) -> EpochOutcome:
        """One host sync: the epoch's per-step losses, statuses and logs → an ``EpochOutcome``, with
        Loom's messages for skipped updates."""
        # one sync: losses, statuses, logs and the method's epoch-end tensors copied as they are (no
        # device kernel: a fresh process would load a conversion kernel for it, ~10 ms on the H100
        # machine), converted to float64 on the host
        extras = self.t.device_epoch_tensors()
        parts = [self.step_loss[:count], self.step_status[:count]]
        if self.n_logs:
            parts.append(self.step_logs[:count])
        parts += [e.detach().reshape(-1) for e in extras]
        on_device = self.t.device.type == "cuda"
        host = [p.to("cpu", non_blocking=on_device) for p in parts]
        if on_device and self.t.dist is not None:  # bounded: a rank that is gone becomes an error here
            self._mark_progress()
            progress, self._progress = self._progress, []
            self.t.dist.wait_device(progress)
        elif on_device:
            torch.cuda.current_stream(self.t.device).synchronize()
        host[0], host[1] = host[0][:, 0], host[1][:, 0]
        if self.n_logs:
            host[2] = host[2][:, : self.n_logs].reshape(-1)
        flat = torch.cat([h.double() for h in host]).tolist()
        losses, statuses = flat[:count], [int(s) for s in flat[count : 2 * count]]
        at = 2 * count
        logs = None
        if self.n_logs:
            logs = [flat[at + k * self.n_logs : at + (k + 1) * self.n_logs] for k in range(count)]
            at += count * self.n_logs
        extra_values = []
        for e in extras:
            extra_values.append(flat[at : at + e.numel()])
            at += e.numel()
        names = self.t.device_log_names
        sizes = source.batch_sizes
        out = EpochOutcome()
        for k, status in enumerate(statuses):
            if status == 3:  # not run: an earlier batch abandoned the epoch
                break
            out.batches_run += 1
            out.samples += sizes[k] if sizes is not None else 0
            if status == 0:
                out.add(losses[k], dict(zip(names, logs[k])) if logs is not None else None)
                continue
            out.skipped += 1
            self.t.report_nan(_STATUS[status], epoch)
            if status == 1:
                break
        if sizes is None:
            out.samples = self._streamed_samples
        start = self.t.global_step - count
        for k, lrs in sorted(self._step_lrs.items()):  # log_every_n_steps: from this one read, no sync of their own
            if k < out.batches_run:
                method_logs = dict(zip(names, logs[k])) if logs is not None else None
                self.t.log_step(start + k, losses[k], method_logs, lrs, statuses[k] != 0)
        kept = (losses[: out.batches_run], statuses[: out.batches_run], logs[: out.batches_run] if logs is not None else None)
        self.t.device_epoch_end(self, *kept, extra_values)
        return out
