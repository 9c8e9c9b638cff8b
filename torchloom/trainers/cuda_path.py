"""``train()`` on CUDA: the whole step on the device, graph-captured, read back once per epoch.

Loom's GPU trainer records forward, loss gradient, backward and update of a batch into one command
buffer and reads back only partial loss sums. Here one step (``device_step``) is:

1. forward through the layers' explicit forward (small batches: one fused kernel per Dense layer);
2. loss and output gradient in one fused kernel (per-block partial sums of the loss);
3. backward through the layers' hand-written backward;
4. the gradients land in fixed ``.grad`` views laid back to back (Dense layers write them there,
   other layers' are copied in one launch), their partial sums of squares are taken (one launch), and the step guard (``kernels/step_guard.py``) adds up the
   loss and norm partials and decides on the device whether the update may happen (NaN/Inf loss:
   no, and the rest of the epoch is abandoned; NaN/Inf gradient: no), records the step's loss and
   status in per-epoch arrays, and computes the clip-by-norm scale;
5. the fused optimizer update, masked by the guard's ``found_inf`` and scaled by its ``grad_scale``;
6. the weights checked after the update (``guards.UpdateGuard``, device form): copied before it, and
   put back in place with ``torch.where`` when the update made any of them non-finite (status 4,
   ``NAN_WEIGHTS``), all without a host read.

Nothing in a step reads a device value on the host, so steps queue up back to back. The first epoch
runs the steps eagerly (compiling kernels and creating optimizer state); then, when the batches are a
list (shapes fixed per position, a ragged last batch included) and the optimizer is one of
torchloom's, every batch position's step is captured once into CUDA graphs of up to
``STEPS_PER_GRAPH`` steps each (sharing one memory pool) and replayed every later epoch. A
``DataLoader`` (new tensors every epoch) keeps the eager device steps. At the end of an epoch one
host sync reads the per-step losses and statuses, prints Loom's NaN messages and fills the epoch log.

Learning-rate schedules: the schedule is advanced on the host once per batch of the epoch ahead of
time, and each captured step reads its learning rate from a device table filled at epoch start.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..layers.base import host_checks
from .guards import UpdateGuard
from .loop import BatchSource, EpochOutcome, StepStatus
from .losses import loss_and_grad

if TYPE_CHECKING:
    from .train import BackpropTrainer

__all__ = ["CudaRunner", "STEPS_PER_GRAPH", "graph_eligible"]

# Steps recorded into one CUDA graph: enough to amortise a replay's launch cost (~10 µs) over many
# steps, few enough that capture and instantiation stay short.
STEPS_PER_GRAPH = 64

_STATUS = {1: StepStatus.NAN_LOSS, 2: StepStatus.NAN_GRAD, 4: StepStatus.NAN_WEIGHTS}
NAN_WEIGHTS = 4  # status written after the update when it made a weight or state non-finite (undone)
_SLOT = 4  # 4 × 4 bytes: one 16-byte-aligned row per step or learning rate


def guarded_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True for torchloom's optimizers, whose update takes ``found_inf`` / ``grad_scale`` tensors and
    never reads them on the host (AdamW only with ``capturable=True``)."""
    from .optim import AdamW, FusedOptimizer

    if isinstance(optimizer, AdamW):
        return all(g["capturable"] for g in optimizer.param_groups)
    return isinstance(optimizer, FusedOptimizer)


def graph_eligible(trainer: "BackpropTrainer", source: BatchSource) -> bool:
    """Whether ``trainer`` may replay captured graphs over ``source`` (see the module docstring)."""
    return trainer.device.type == "cuda" and trainer.config.cuda_graph is not False and source.items is not None


class CudaRunner:
    """Runs the epochs of one ``train()`` call on CUDA (see the module docstring)."""

    def __init__(self, trainer: "BackpropTrainer") -> None:
        self.t = trainer
        dev = trainer.device
        self.dead = torch.zeros((), dtype=torch.int32, device=dev)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        # the clip scale multiplies the gradients: float64 models keep it in float64
        scale_dtype = torch.float64 if trainer.dtype == torch.float64 else torch.float32
        self.grad_scale = torch.ones((), dtype=scale_dtype, device=dev)
        # per-step results, one 16-byte row per step: every slot a kernel writes is 16-byte aligned, so
        # all steps share one compiled kernel specialisation (Triton specialises on pointer alignment,
        # and nothing may compile while a graph is being captured)
        self.step_loss = torch.zeros(0, _SLOT, dtype=torch.float32, device=dev)
        self.step_status = torch.zeros(0, _SLOT, dtype=torch.int32, device=dev)
        self.lr_table: Tensor | None = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self._streamed_samples = 0
        self.clip_norm = trainer.clip if trainer.config.clip_mode == "norm" else 0.0
        self.capture_count = 0  # graphs captured (for tests and curiosity)
        self.capture_failed = False
        self._layout()

    def _layout(self) -> None:
        """Parameters, gradients and optimizer state back to back, one buffer per param group, so
        the gradient norm and the update are one launch per group (``flatten_optimizer_``). Each
        step copies the fresh gradients into the fixed ``.grad`` views (one launch)."""
        from .optim import flatten_optimizer_
        from ..kernels._update import coalesce

        t = self.t
        flatten_optimizer_(t.optimizer)
        for p in t.params:  # parameters the optimizer does not update still need a gradient home
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grad_views = [p.grad for p in t.params]
        norm_inputs = []
        for group in t.optimizer.param_groups:
            grads = [p.grad for p in group["params"]]
            flat = coalesce(grads)
            norm_inputs.extend(flat[0] if flat is not None else grads)
        in_groups = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
        norm_inputs.extend(p.grad for p in t.params if id(p) not in in_groups)
        self.norm_inputs = norm_inputs
        self.update_guard = UpdateGuard(self._guarded_tensors)

    def _guarded_tensors(self) -> list[Tensor]:
        """What an update changes, as few tensors as the flat layout allows: per param group its
        parameter buffer and one buffer per kind of state (momentum, moments, step counts)."""
        from ..kernels._update import coalesce

        t = self.t
        out: list[Tensor] = []
        for group in t.optimizer.param_groups:
            params = list(group["params"])
            flat = coalesce(params)
            out.extend(flat[0] if flat is not None else params)
            states = [t.optimizer.state.get(p, {}) for p in params]
            keys = {k for st in states for k, v in st.items() if isinstance(v, Tensor) and v.is_floating_point()}
            for k in sorted(keys):
                tensors = [st[k] for st in states if k in st]
                shared = list({id(v): v for v in tensors}.values())
                flat = coalesce(shared) if len(shared) == len(params) else None
                out.extend(flat[0] if flat is not None else shared)
        return out

    # ------------------------------------------------------------------------ one step
    @torch.no_grad()
    def device_step(self, x: Tensor, y: Tensor, slot: int) -> None:
        """One guarded training step writing its loss and status into ``slot``; no host sync."""
        from ..kernels.grad_norm import grad_sq_partials
        from ..kernels.step_guard import step_guard_

        t = self.t
        out, saved = t.model.forward_saved(x)
        loss_parts, grad = loss_and_grad(out, y, t.loss_type, validate=False, unreduced=True)
        # gradients land in the flat ``.grad`` views (Dense writes them there; others are copied)
        _, grads = t.model.backward_saved(grad, saved, needs_input_grad=False, out=self.grad_views)
        moved = [(v, g) for v, g in zip(self.grad_views, grads) if g.data_ptr() != v.data_ptr()]
        if moved:
            torch._foreach_copy_([v for v, _ in moved], [g for _, g in moved])
        sq_parts = grad_sq_partials(self.norm_inputs)
        step_guard_(
            loss_parts, sq_parts, self.dead, self.step_loss[slot, 0], self.step_status[slot, 0],
            self.found_inf, self.grad_scale, self.clip_norm,
        )
        if t.clip > 0 and t.config.clip_mode == "value" and not t._value_clip_in_optimizer:
            torch._foreach_clamp_min_(self.grad_views, -t.clip)
            torch._foreach_clamp_max_(self.grad_views, t.clip)
        self.update_guard.save()
        t.optimizer_update(grad_scale=self.grad_scale if self.clip_norm > 0 else None, found_inf=self.found_inf)
        # weights checked after the update, on the device: an overflowing update is undone in place
        undone = self.update_guard.restore_if_nonfinite_()
        status = self.step_status[slot, 0]
        status.copy_(torch.where(undone & (status == 0), NAN_WEIGHTS, status))

    # ---------------------------------------------------------------------- one epoch
    @torch.no_grad()
    def run_epoch(self, source: BatchSource, epoch: int) -> EpochOutcome:
        t = self.t
        n = len(source) if source.sized else None
        self._prepare_arrays(n)
        self.dead.zero_()
        if epoch == 1:  # state the first epoch created lazily (momentum, moments) joins the layout
            from .optim import flatten_optimizer_

            flatten_optimizer_(t.optimizer)
        if self.graphs is None and not self.capture_failed and epoch > 0 and graph_eligible(t, source):
            try:
                self._capture(source)
            except RuntimeError as e:  # a layer or optimizer that cannot be captured (a host read)
                if t.config.cuda_graph:
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
                    stacklevel=2,
                )
        if self.graphs is not None:
            if t.scheduler is not None:
                self.lr_table[:, :, 0].copy_(self._epoch_lrs(n))
            for graph in self.graphs:
                graph.replay()
            count = n
        else:
            count = 0
            self._streamed_samples = 0
            for k, (x, y) in enumerate(source):
                if k >= self.step_loss.shape[0]:
                    self._grow_arrays()
                self.device_step(x, y, k)
                if t.scheduler is not None:
                    t.scheduler.step()
                count += 1
                self._streamed_samples += x.shape[0]
        t.global_step += count
        return self._read_back(count, epoch, source)

    # ------------------------------------------------------------------------- helpers
    def _prepare_arrays(self, n: int | None) -> None:
        size = n if n is not None else max(self.step_loss.shape[0], 64)
        if self.step_loss.shape[0] != size:
            dev = self.t.device
            self.step_loss = torch.zeros(size, _SLOT, dtype=torch.float32, device=dev)
            self.step_status = torch.zeros(size, _SLOT, dtype=torch.int32, device=dev)

    def _grow_arrays(self) -> None:
        old_loss, old_status = self.step_loss, self.step_status
        rows = old_loss.shape[0]
        self.step_loss = torch.zeros(2 * rows, _SLOT, dtype=torch.float32, device=old_loss.device)
        self.step_status = torch.zeros(2 * rows, _SLOT, dtype=torch.int32, device=old_status.device)
        self.step_loss[:rows] = old_loss
        self.step_status[:rows] = old_status

    def _epoch_lrs(self, n: int) -> Tensor:
        """This epoch's learning rates ``[n, groups]``, found on the host by advancing the scheduler
        once per batch ahead of the replay."""
        groups = self.t.optimizer.param_groups
        rows = []
        for _ in range(n):
            rows.append([float(g["lr"]) for g in groups])
            self.t.scheduler.step()
        return torch.tensor(rows, dtype=torch.float32)

    def _capture(self, source: BatchSource) -> None:
        """Record every batch position's step into graphs of up to ``STEPS_PER_GRAPH`` steps that
        share one memory pool (captured and replayed in the same order). A masked warm-up step
        first compiles every kernel specialisation the captured steps use (the learning rate read
        from the device, for one): compiling is impossible during capture. It runs with CUDA's sync
        debug mode set to "error", so a step that reads a device value on the host fails there,
        before any capture starts (a capture that fails midway leaves CUDA's random-number state
        unusable for the rest of the process)."""
        t = self.t
        items = source.items
        groups = t.optimizer.param_groups
        host_lrs = [g["lr"] for g in groups]
        if t.scheduler is not None:  # each captured step reads its lr from its (aligned) row
            self.lr_table = torch.zeros(len(items), len(groups), _SLOT, dtype=torch.float32, device=t.device)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        try:
            with host_checks(False):  # every batch was checked eagerly in the first epoch
                self._use_lr_row(0)
                self.dead.fill_(1)  # the guard reports NOT_RUN, so the warm-up updates nothing
                previous_mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")  # a host read would break the capture: find it now
                try:
                    self.device_step(*items[0], 0)
                finally:
                    torch.cuda.set_sync_debug_mode(previous_mode)
                    self.dead.zero_()
                torch.cuda.synchronize(t.device)
                for start in range(0, len(items), STEPS_PER_GRAPH):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        for k in range(start, min(start + STEPS_PER_GRAPH, len(items))):
                            self._use_lr_row(k)
                            self.device_step(*items[k], k)
                    graphs.append(graph)
                    self.capture_count += 1
        finally:
            for g, lr in zip(groups, host_lrs):
                g["lr"] = lr
        self.graphs = graphs

    def _use_lr_row(self, k: int) -> None:
        """Point every param group's lr at row ``k`` of the lr table (when there is a schedule)."""
        if self.lr_table is not None:
            for j, g in enumerate(self.t.optimizer.param_groups):
                g["lr"] = self.lr_table[k, j, 0]

    def _read_back(self, count: int, epoch: int, source: BatchSource) -> EpochOutcome:
        """One host sync: the epoch's per-step losses and statuses → an ``EpochOutcome``, with Loom's
        messages for skipped updates."""
        losses = self.step_loss[:count, 0].double().cpu().tolist()
        statuses = self.step_status[:count, 0].cpu().tolist()
        sizes = source.batch_sizes
        out = EpochOutcome()
        for k, status in enumerate(statuses):
            if status == 3:  # not run: an earlier batch abandoned the epoch
                break
            out.batches_run += 1
            out.samples += sizes[k] if sizes is not None else 0
            if status == 0:
                out.add(losses[k])
                continue
            out.skipped += 1
            self.t.report_nan(_STATUS[status], epoch)
            if status == 1:
                break
        if sizes is None:
            out.samples = self._streamed_samples
        return out
