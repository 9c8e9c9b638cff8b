"""Data-parallel training on ``torch.distributed``: what the engine needs, resolved once per run.

Under ``torchrun`` (or any initialised process group with more than one process) every method of
``train()`` trains data-parallel: each rank runs the same steps on its own shard of every batch, and
the numbers a step's update depends on are all-reduced so that the result equals one process
training on the concatenated global batch (equal shards):

* backprop: the gradients of the (local mean) loss and the loss itself, averaged over the ranks;
* TargetProp: the update directions (sums over samples) summed, the link-budget and gap statistics
  built from per-layer sums (``dot(f, b)``, ``|f|²``, ``|b|²``, ``Σ(f − b)²``, element counts) summed
  before the budgets and gaps are formed; loss and accuracy averaged;
* Tweening: the parameter gradients ``G_i`` (sums over samples) summed and divided by the global
  batch size, the per-layer gap / link budget / alignment formed from summed sums, the loss weighted
  by the ranks' row counts.

TargetProp and Tweening reduce all of a step's numbers with one ``all_reduce_`` call: one collective
when they share a dtype (a float64 model; the fused device steps, whose direction buffer carries the
loss and the statistics' float32 partials in a tail: ``methods/_fused.py``), and no host read in the
device step. Backprop's device step reduces its gradients and its loss in one buffer too (its host
step, which reads the loss before the backward, in two).

A NaN or Inf on one rank survives the sum, so every guard (NaN/Inf loss or gradient, gates,
explosion detection) sees the same numbers on every rank and decides the same; the weights stay
identical. ``trainer.stop_training`` is agreed with "any rank". Only rank 0 prints and writes files.

Data: a ``DataLoader`` gets a ``DistributedSampler`` (``batch_size`` is then per rank) unless it
already has a sampler of the user's own; ``(X, Y)`` tensors and a ``Dataset`` are cut into global
batches of ``TrainingConfig.batch_size`` rows as in one process, and each rank takes its contiguous
equal share of every global batch (rank ``r`` of ``W`` takes rows ``r·b/W … (r+1)·b/W − 1`` of a
batch of ``b`` rows; ``batch_size`` must be a multiple of ``W``; of a shorter last batch the
``b mod W`` trailing rows are left out, and a last batch of fewer than ``W`` rows is left out);
a list of batches is the caller's: each rank passes its own shard, and every rank must pass the same
number of batches.

Also: rank 0's initial weights are broadcast when training starts; ``validation_data`` is
evaluated whole on every rank (give every rank the same), the training ``metrics`` are averaged over
the ranks; ``samples_per_second`` counts this rank's samples; a ``DistributedDataParallel`` wrapper
is unwrapped (its ``.module`` is trained, with a note); a checkpoint (written by rank 0) holds the
full state, identical on every rank, and resumes on any number of processes.

Everything is built on ``torch.distributed`` collectives (``all_reduce``, ``broadcast``): with the
NCCL backend the bucketed all-reduce is graph-capturable (fixed buffers allocated on the first call
for a given list of shapes, no host read), so on the CUDA device path it runs inside the captured
step. From ``OVERLAP_BYTES`` of gradients on, backprop and Tweening reduce each layer's gradients as
soon as its backward has run (asynchronously, overlapping the backward of the layers below). The
device path's Tweening step takes the global batch as ``world_size ×`` the local one (equal shards,
which the engine's sharding and ``DistributedSampler`` give); the host step counts the rows.

Ending: a captured CUDA graph that holds NCCL collectives keeps the communicator referenced, and
``destroy_process_group`` (or the group's destructor at exit) waits until the graph is destroyed, so
``fit`` releases a data-parallel run's graphs as it returns or raises (``CudaRunner.release``). The
collectives inside a graph are not watched by NCCL's own timeout: the device path's read-back waits
for each part of an epoch within the process group's timeout (``wait_device``) and, when another
rank has gone, aborts the group and raises instead of waiting forever.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor

from ..kernels._update import _flat_view
from .data import Batches, _LoaderBatches, _TensorBatches

__all__ = ["DistContext", "resolve_distributed", "BUCKET_BYTES", "OVERLAP_BYTES", "unwrap_ddp"]

BUCKET_BYTES = 4 * 1024 * 1024  # tensors are packed into buckets of about this size, one all_reduce each
# From this many gradient bytes on, each layer's gradients are all-reduced as soon as its backward has
# run, overlapping the layers below; smaller models reduce once after the backward (fewer collectives).
OVERLAP_BYTES = 16 * 1024 * 1024


def resolve_distributed(setting: Any, device: torch.device | None = None) -> "DistContext | None":
    """The run's data-parallel context from ``TrainingConfig.distributed``: ``None`` (automatic) = on
    when ``torch.distributed`` is available and initialised with more than one process; ``True`` = on
    (``RuntimeError`` without an initialised process group); ``False`` = off. Returns ``None`` when off.
    ``device``: the training device (NCCL's small host-side agreements use it)."""
    if setting is False:
        return None
    ready = tdist.is_available() and tdist.is_initialized()
    if setting is True and not ready:
        raise RuntimeError(
            "TrainingConfig(distributed=True) needs an initialised torch.distributed process group: run under "
            "torchrun (or call torch.distributed.init_process_group) before train(), or leave distributed=None"
        )
    if not ready:
        return None
    ctx = DistContext(device=device)
    if setting is None and ctx.world_size < 2:
        return None
    return ctx


def unwrap_ddp(model: Any) -> Any:
    """A ``DistributedDataParallel`` (or ``DataParallel``) wrapper's ``.module``, with a note: the
    engine all-reduces itself, the wrapper's hooks would not run with torchloom's hand-written
    backward. Anything else is returned as is."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        warnings.warn(
            f"train(): the model is wrapped in {type(model).__name__}; torchloom trains its .module and does the "
            "data-parallel all-reduce itself (every method, under an initialised process group): pass the bare "
            "model to silence this note",
            UserWarning,
            stacklevel=3,
        )
        return model.module
    return model


class DistContext:
    """Rank, world size and the collectives the methods use, over the default process group.

    Attributes: ``rank``, ``world_size``, ``is_main`` (rank 0), ``backend`` (``"gloo"``, ``"nccl"``...).
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device
        self.rank = tdist.get_rank(group)
        self.world_size = tdist.get_world_size(group)
        self.is_main = self.rank == 0
        self.backend = str(tdist.get_backend(group))
        # NCCL averages inside the reduction (ReduceOp.AVG): no separate division pass over the
        # gradients afterwards (80 MB on the benchmark's big net); gloo has no AVG: sum, then divide.
        self._avg = self.backend == "nccl" and hasattr(tdist.ReduceOp, "AVG")
        self._plans: dict[Any, list[tuple[Tensor, list[Tensor], list[int]]]] = {}

    def __repr__(self) -> str:
        return f"DistContext(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    # ------------------------------------------------------------------------- collectives
    def _scalar_device(self, like: Tensor | None = None) -> torch.device:
        if like is not None:
            return like.device
        if self.backend == "nccl":
            if self.device is not None and self.device.type == "cuda":
                return self.device
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @torch.no_grad()
    def all_reduce_(self, tensors: Sequence[Tensor], op: str = "sum", async_op: bool = False) -> Any:
        """All-reduce ``tensors`` in place (``op`` ``"sum"`` or ``"mean"``), bucketed: tensors that
        are consecutive views of one buffer are reduced as that buffer; others are copied into
        buckets of about ``BUCKET_BYTES`` (allocated on the first call for this list of shapes and
        reused), one ``all_reduce`` per bucket, and copied back. No host read: usable inside a
        captured CUDA graph with NCCL once a first call has made the buckets. ``async_op=True``
        returns a callable that completes the reduction (wait, mean, copy back): work queued on the
        device in between overlaps the communication. With NCCL the mean is the collective's own
        average (``ReduceOp.AVG``); elsewhere a sum divided by the world size afterwards."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce_: op must be 'sum' or 'mean', got {op!r}")
        pending: list[Any] = []
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in tensors:
            if t.numel():
                groups.setdefault((t.device, t.dtype), []).append(t)
        for key, members in groups.items():
            # NCCL's AVG scales each input by 1/W in the element's dtype: exact for a power-of-two W, within
            # an ulp in float32/64; half precision with another W would carry 1/W's rounding (bf16: +0.2 %)
            averaged = op == "mean" and self._avg and (key[1] in (torch.float32, torch.float64) or _power_of_two(self.world_size))
            reduce_op = tdist.ReduceOp.AVG if averaged else tdist.ReduceOp.SUM
            divide = op == "mean" and not averaged
            flat = _flat(members)
            if flat is not None:
                pending.append((tdist.all_reduce(flat, op=reduce_op, group=self.group, async_op=async_op), flat, None, None, divide))
                continue
            for buffer, views, index in self._plan(key, members):
                held = [members[i] for i in index]
                torch._foreach_copy_(views, held)
                pending.append((tdist.all_reduce(buffer, op=reduce_op, group=self.group, async_op=async_op), buffer, views, held, divide))

        def finish() -> None:
            for work, buffer, views, held, divide in pending:
                if work is not None:
                    work.wait()
                if divide:
                    buffer.div_(self.world_size)
                if views is not None:
                    torch._foreach_copy_(held, views)

        if async_op:
            return finish
        finish()
        return None

    def _plan(self, key: Any, members: list[Tensor]) -> list[tuple[Tensor, list[Tensor], list[int]]]:
        shapes = tuple(tuple(t.shape) for t in members)
        plan = self._plans.get((key, shapes))
        if plan is not None:
            return plan
        device, dtype = key
        cap = max(BUCKET_BYTES // torch.empty((), dtype=dtype).element_size(), 1)
        plan, start = [], 0
        while start < len(members):
            stop, size = start, 0
            while stop < len(members) and (stop == start or size + members[stop].numel() <= cap):
                size += members[stop].numel()
                stop += 1
            buffer = torch.empty(size, dtype=dtype, device=device)
            views, offset = [], 0
            for t in members[start:stop]:
                views.append(buffer[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
            plan.append((buffer, views, list(range(start, stop))))
            start = stop
        self._plans[(key, shapes)] = plan
        return plan

    def overlap_pays(self, tensors: Sequence[Tensor]) -> bool:
        """Whether gradients of ``tensors``' size are worth reducing layer by layer during the
        backward (at least ``OVERLAP_BYTES``)."""
        return sum(t.numel() * t.element_size() for t in tensors) >= OVERLAP_BYTES

    def backward_overlapped(self, model: Any, grad_out: Tensor, saved: Any, out: Any, op: str) -> tuple[Any, tuple[Tensor, ...]]:
        """``model.backward_saved(grad_out, saved, needs_input_grad=False, out=out)`` with each layer's
        parameter gradients all-reduced (``op``) as soon as that layer's backward has run, while the
        layers below run theirs; returns ``(input_grad, grads)`` with every reduction complete. A model
        whose layers share parameters runs its own backward and is reduced after it."""
        if model._has_shared_params():
            g, grads = model.backward_saved(grad_out, saved, needs_input_grad=False, out=out)
            self.all_reduce_(grads, op)
            return g, grads
        outs = model._split_out(out)
        n = len(model.layers)
        per_layer: list[tuple[Tensor, ...]] = [()] * n
        pending = []
        g = grad_out
        for i in range(n - 1, -1, -1):
            layer = model.layers[i]
            if outs is not None and layer.accepts_grad_out:
                g, per_layer[i] = layer.backward_saved(g, saved[i], i > 0, out=outs[i])
            else:
                g, per_layer[i] = layer.backward_saved(g, saved[i], i > 0)
            if per_layer[i]:
                pending.append(self.all_reduce_(list(per_layer[i]), op, async_op=True))
        for finish in pending:
            finish()
        return g, tuple(pg for layer_grads in per_layer for pg in layer_grads)

    # ------------------------------------------------------------------- waiting, bounded
    def timeout_s(self) -> float:
        """The process group's timeout in seconds (``init_process_group(timeout=...)``; the backend's
        default when it cannot be read)."""
        from torch.distributed import distributed_c10d as c10d

        try:
            pg = self.group or c10d._get_default_group()
            device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
            return float(pg._get_backend(device).options._timeout.total_seconds())
        except Exception:  # noqa: BLE001 - an older or other backend: its documented default
            return float(c10d._get_default_timeout(self.backend).total_seconds())

    def wait_device(self, events: Sequence[Any], what: str = "the epoch's steps") -> None:
        """Wait for CUDA ``events`` in order, each within the process group's timeout of the one
        before (a captured step's collectives are not watched by the backend's own timeout). When one
        does not complete in time, another rank has stopped taking part (it raised or died): the
        process group is aborted, so that the collectives waiting for it end and this process can
        exit, and ``RuntimeError`` is raised."""
        import time

        timeout = self.timeout_s()
        for event in events:
            if event.query():
                continue
            deadline = time.monotonic() + timeout
            while not event.query():  # spin and yield, as CUDA's own synchronisation does by default
                if time.monotonic() > deadline:
                    self.abort()
                    raise RuntimeError(
                        f"rank {self.rank}: {what} did not complete within the process group's timeout ({timeout:g} s): "
                        "another rank stopped taking part in the collectives (it raised an error or its process ended); "
                        "the process group was aborted (call torch.distributed.init_process_group again to go on)"
                    )
                time.sleep(0)

    def abort(self) -> None:
        """Abort the process group (NCCL), ending collectives that wait for a rank that is gone; a
        no-op for a backend that cannot abort or a group already destroyed. Only after a timeout."""
        from torch.distributed import distributed_c10d as c10d

        try:
            c10d._abort_process_group(self.group)
        except Exception:  # noqa: BLE001 - gloo cannot abort (its collectives time out on their own)
            pass

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a MAX all-reduce; every rank must call it)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self._scalar_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def any_(self, flag: Tensor) -> Tensor:
        """``flag`` (an int or float tensor) replaced in place by its maximum over the ranks: a
        device-side "any" for decisions, no host read."""
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self.group)
        return flag

    def mean_values(self, values: dict[str, float]) -> dict[str, float]:
        """The mean over the ranks of each float of ``values`` (same keys on every rank), one all-reduce."""
        if not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self._scalar_device())
        tdist.all_reduce(t, group=self.group)
        return dict(zip(values, (t / self.world_size).tolist()))

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._scalar_device())
        tdist.broadcast(t, src=0, group=self.group)
        return int(t.item())

    @torch.no_grad()
    def broadcast_module_(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers copied into every rank's ``module`` (one broadcast per
        device and dtype), so all ranks start equal."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in [*module.parameters(), *module.buffers()]:
            if t.numel():
                groups.setdefault((t.device, t.dtype), []).append(t.data)
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            tdist.broadcast(flat, src=0, group=self.group)
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def check_same_count(self, count: int | None, what: str) -> None:
        """``ValueError`` unless every rank has the same ``count`` (``None``: unknown, not checked)."""
        if count is None:
            return
        t = torch.tensor([count, -count], dtype=torch.int64, device=self._scalar_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self.group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            raise ValueError(
                f"{what}: the ranks have different numbers of batches per epoch (from {lo} to {hi}; this rank "
                f"{self.rank}: {count}); data-parallel training needs the same number on every rank (give every "
                "rank an equal shard of every batch)"
            )

    def agree(self, *flags: bool) -> list[int]:
        """For each flag, on how many ranks it is true (one SUM all-reduce; every rank must call it)."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=self._scalar_device())
        tdist.all_reduce(t, group=self.group)
        return [int(v) for v in t.tolist()]

    def agreed_batches(self, batches: Any, epoch: int) -> Iterator[Any]:
        """``batches`` (one epoch of a streamed source) with every step agreed before it runs (one small
        all-reduce a batch): a rank whose next batch failed to load or convert makes every rank raise
        at once (that rank its own error, the others a ``RuntimeError`` naming it) instead of leaving
        them waiting in the next collective until the process group's timeout; when some ranks have
        no batch left the epoch ends on every rank, with a warning (unequal loaders), rather than
        leaving a collective half-joined."""
        it = iter(batches)
        step = 0
        while True:
            batch, error = None, None
            try:
                batch = next(it)
            except StopIteration:
                pass
            except Exception as e:  # noqa: BLE001 - agreed first, raised below on every rank
                error = e
            have, failed = self.agree(batch is not None, error is not None)
            if failed:
                self.raise_agreed(error, f"epoch {epoch + 1}, batch {step}")
            if have < self.world_size:
                if have and self.is_main:
                    warnings.warn(
                        f"data-parallel training: epoch {epoch + 1} ends after {step} batches on every rank: "
                        f"{self.world_size - have} of {self.world_size} ranks had no batch {step} (loaders of unequal "
                        "length; the other ranks' remaining batches are left out)",
                        UserWarning,
                        stacklevel=2,
                    )
                return
            yield batch
            step += 1

    def raise_agreed(self, error: BaseException | None, where: str) -> None:
        """After ``agree`` found a failure on some rank: this rank's own ``error``, or a
        ``RuntimeError`` saying another rank failed at ``where``."""
        if error is not None:
            raise error
        raise RuntimeError(
            f"data-parallel training stopped at {where}: another rank failed there (its error is in its own "
            f"output); rank {self.rank} stops with it"
        )

    # ------------------------------------------------------------------------------ data
    def shards(self, data: tuple[Any, Any], setting: bool | None, name: str) -> bool:
        """Whether ``(X, Y)`` given to every rank is cut into shards (``TrainingConfig.shard_data``):
        ``True`` / ``False`` as set; ``None``: when every rank holds the same rows (row count and a
        position-weighted checksum agreed in one all-reduce), else the data is each rank's own shard
        (the usual habit of loading one's part per rank), used whole."""
        if setting is not None:
            return setting
        sums = []
        arrays = [m for a in data for m in (a if isinstance(a, (tuple, list)) else (a,))]  # (X1, X2, ...), Y
        for a in arrays:
            t = torch.as_tensor(a).detach().reshape(len(a), -1).to("cpu", torch.float64).nan_to_num(0.0, 1e300, -1e300)
            weights = torch.arange(1, t.numel() + 1, dtype=torch.float64).reshape(t.shape) % 997 + 1
            sums += [float(t.shape[0]), float(t.sum()), float((t * weights).sum())]
        t = torch.tensor(sums + [-v for v in sums], dtype=torch.float64, device=self._scalar_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self.group)
        n = len(sums)
        return bool(torch.equal(t[:n], -t[n:]))

    def local_batch_size(self, batch_size: int | None, name: str) -> int:
        """Rows per step of a rank's own (not sharded) data: the global ``batch_size`` over the ranks."""
        bs = batch_size if batch_size is not None else 32
        if bs % self.world_size:
            raise ValueError(
                f"{name}: batch_size={bs} is the global batch of data-parallel training and must be a multiple of the "
                f"world size {self.world_size} (each rank takes batch_size / {self.world_size} of its own rows a step); "
                f"e.g. batch_size={max(bs // self.world_size, 1) * self.world_size}"
            )
        return bs // self.world_size

    def shard_rows(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor] | None:
        """This rank's contiguous equal share of one global batch of ``b`` rows: rows
        ``r·(b//W) … (r+1)·(b//W) − 1`` (the ``b mod W`` trailing rows are left out); ``None`` when
        ``b < W``."""
        share = x.shape[0] // self.world_size
        if share == 0:
            return None
        lo = self.rank * share
        return x[lo : lo + share], y[lo : lo + share]

    def shard_batches(self, data: Any, batch_size: int | None, name: str) -> Any:
        """A ``Batches`` of global batches (``(X, Y)`` tensors or a ``Dataset``) as this rank's shards;
        the shuffling seed agreed (rank 0's) so every rank cuts the same global batches."""
        bs = batch_size if batch_size is not None else 32
        if bs % self.world_size:
            raise ValueError(
                f"{name}: batch_size={bs} is the global batch of data-parallel training and must be a multiple of the "
                f"world size {self.world_size} (each rank takes an equal share of every batch); e.g. "
                f"batch_size={max(bs // self.world_size, 1) * self.world_size}"
            )
        if data.seed is not None:
            data.seed = self.broadcast_int(data.seed)
        rows = None
        if isinstance(data, _TensorBatches):
            rows = data.X.shape[0]
        elif isinstance(data, _LoaderBatches):
            try:
                rows = len(data.loader.dataset)
            except TypeError:
                rows = None
        return _ShardedBatches(data, self, bs, rows)

    def distribute_loader(self, loader: Any, seed: int | None) -> Any:
        """``loader`` with a ``DistributedSampler`` (same batch size, now per rank; shuffled when the
        loader shuffled, seeded by ``seed`` or a seed agreed from rank 0) in place of its default
        sampler. A loader that already has a ``DistributedSampler`` or a sampler / batch sampler of
        the user's own, or iterates an ``IterableDataset``, is returned as is: its sharding is the
        user's."""
        from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

        if isinstance(loader.dataset, IterableDataset):
            return loader
        sampler = loader.sampler
        if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
            return loader  # the user's own batch sampler
        if type(sampler) not in (SequentialSampler, RandomSampler):
            return loader  # a DistributedSampler, or the user's own sampler: respected
        shuffle = isinstance(sampler, RandomSampler)
        seed = self.broadcast_int(int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)
        dist_sampler = DistributedSampler(
            loader.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=seed, drop_last=loader.drop_last,
        )
        kwargs: dict[str, Any] = dict(
            batch_size=loader.batch_size, sampler=dist_sampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
            timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
            persistent_workers=loader.persistent_workers,
        )
        if loader.num_workers > 0:
            kwargs.update(multiprocessing_context=loader.multiprocessing_context, prefetch_factor=loader.prefetch_factor)
        return DataLoader(loader.dataset, **kwargs)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _flat(members: list[Tensor]) -> Tensor | None:
    """``members`` as one contiguous 1-D tensor when they are back-to-back views of one buffer (or one
    contiguous tensor); else None."""
    if len(members) == 1:
        t = members[0]
        return t.view(-1) if t.is_contiguous() else None
    return _flat_view(members)


def _shard_count(batches: int, rows: int | None, bs: int, world: int, drop_last: bool) -> int:
    """Batches per epoch after sharding: a last batch of fewer than ``world`` rows is left out."""
    if rows is None or drop_last or rows % bs == 0:
        return batches
    return batches - (1 if rows % bs < world else 0)


class _ShardedBatches(Batches):
    """This rank's shard of every global batch of another ``Batches`` (see ``DistContext.shard_rows``)."""

    def __init__(self, inner: Any, ctx: DistContext, batch_size: int, rows: int | None) -> None:
        super().__init__(inner.name)
        self.inner, self.ctx = inner, ctx
        self.is_list = inner.is_list
        self.seed = inner.seed
        n = inner._length()
        drop_last = bool(getattr(inner, "drop_last", False) or getattr(getattr(inner, "loader", None), "drop_last", False))
        self._n = None if n is None else _shard_count(n, rows, batch_size, ctx.world_size, drop_last)

    def _length(self) -> int | None:
        return self._n

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.inner.set_epoch(epoch)

    def _epoch_iter(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        for x, y in self.inner._epoch_iter(epoch):
            shard = self.ctx.shard_rows(x, y)
            if shard is not None:
                yield shard

    def materialise(self) -> list[tuple[Tensor, Tensor]]:
        shards = (self.ctx.shard_rows(x, y) for x, y in self.inner.materialise())
        return [s for s in shards if s is not None]

    def describe(self) -> str:
        return f"rank {self.ctx.rank}'s shard of {self.inner.describe()}"
