"""The shared machinery of TargetProp's and Tweening's device steps: parameters, velocities and update
directions as flat buffers of one layout (``FlatLayout``: every layer's momentum update in one
launch), and the base of their fused steps (``FusedStep``: each layer's backward writing straight
into the flat direction buffer, per-program partial sums, the learning rate as a device value, the
guarded one-launch update). Each method's own step rule lives in its module."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..kernels._update import coalesce
from ..layers.dense import Dense
from ..layers.network import Network

__all__ = ["FlatLayout", "FusedStep", "into_views"]

_TAIL_HEAD = 4  # the tail's first elements: loss sum, correct count, 2 unused (16-byte alignment)


class FlatLayout:
    """Parameters, velocities and update directions of a network as three flat buffers of one layout
    (consecutive views, parameter order), for the one-launch momentum update of the device steps of
    TargetProp and Tweening (``kernels.layer_update.momentum_update_flat_``). Segments are the
    parameters; each gets its layer's rate, and frozen parameters (``requires_grad=False``) are never
    applied. ``build`` returns ``None`` when the buffers are not laid out so (mixed dtypes, ...)."""

    def __init__(self, params: list[Tensor], velocities: list[Tensor], layer_of: list[int], trainable: list[bool]) -> None:
        self.p = coalesce(params)[0][0]
        self.v = coalesce(velocities)[0][0]
        self._shapes = [t.shape for t in params]
        self.add_tail(0)
        self.bounds = [0]
        for t in params:
            self.bounds.append(self.bounds[-1] + t.numel())
        dev = self.p.device
        self.bounds_t = torch.tensor(self.bounds, dtype=torch.int64, device=dev)
        self.layer_of = torch.tensor(layer_of, dtype=torch.int64, device=dev)
        self.trainable = torch.tensor(trainable, device=dev)
        self.counts = [sum(1 for i in layer_of if i == layer) for layer in range(max(layer_of) + 1)]

    def add_tail(self, tail: int) -> None:
        """A new (zeroed) direction buffer ``g`` followed, in one allocation ``g_all``, by ``tail``
        more elements (``self.tail``, starting 16-byte aligned): data-parallel steps write their loss
        and statistics there and all-reduce directions and statistics as one buffer. Before any step
        (the direction views are made again)."""
        n = self.p.numel()
        pad = -n % 4
        self.g_all = torch.zeros(n + pad + tail, dtype=self.p.dtype, device=self.p.device)
        self.g = self.g_all[:n]
        self.tail = self.g_all[n + pad :]
        self.g_views, offset = [], 0
        for shape in self._shapes:
            numel = math.prod(shape)
            self.g_views.append(self.g[offset : offset + numel].view(shape))
            offset += numel

    @classmethod
    def build(cls, model: Network, velocities: list[Tensor]) -> "FlatLayout | None":
        from ..kernels.layer_update import _MAX_SEGMENTS  # (imported on first use: it imports Triton)

        params, layer_of = [], []
        for i, layer in enumerate(model.layers):
            for p in layer.parameters():
                params.append(p)
                layer_of.append(i)
        if len(params) < 2 or len(params) > _MAX_SEGMENTS or len(velocities) != len(params):
            return None
        if any(v.shape != p.shape or v.dtype != p.dtype or v.device != p.device for v, p in zip(velocities, params)):
            return None
        if coalesce(params) is None or coalesce(velocities) is None:
            return None
        return cls(params, velocities, layer_of, [p.requires_grad for p in params])

    def fits(self, directions: list[tuple[Tensor, ...] | None]) -> bool:
        """Whether every layer with parameters has its full set of directions this step."""
        return all((len(ds) if ds else 0) == c for ds, c in zip(directions, self.counts))

    def update_(self, directions: list[tuple[Tensor, ...] | None], a: Tensor, c: Tensor, apply: Tensor) -> None:
        """``v = a_l·v + c_l·d``, ``p += v`` for every parameter of layer ``l`` where ``apply_l`` (and
        the parameter is trainable); ``a``, ``c``, ``apply``: ``[layers]`` device tensors."""
        from ..kernels.layer_update import momentum_update_flat_

        torch._foreach_copy_(self.g_views, [d for ds in directions if ds for d in ds])
        idx = self.layer_of
        momentum_update_flat_(
            self.p, self.v, self.g, self.bounds, a.index_select(0, idx), c.index_select(0, idx),
            apply.index_select(0, idx) & self.trainable, bounds_t=self.bounds_t,
        )


def into_views(directions: Any, views: tuple[Tensor, ...]) -> None:
    """Copy each direction into its flat-buffer view unless it was written there in place."""
    for d, v in zip(directions, views):
        if d.data_ptr() != v.data_ptr():  # computed elsewhere (a reference path, or a layer that copies)
            v.copy_(d)


class FusedStep:
    """The plumbing of the fused device steps of TargetProp and Tweening (``kernels/method_steps.py``);
    each method's module holds its own step (a subclass with ``step(x, y, slot, runner)``):
    the same rule as the torch-op device step in about eighteen launches instead of 110–130, for a
    network of ``Dense`` layers on CUDA (or on the CPU through Triton's interpreter, when the trainer's
    ``kernel_backend`` is ``"triton"``: the tests). Update directions are written by each layer's
    backward straight into the flat direction buffer of the one-launch momentum update, the link
    budgets / gaps / alignments are per-program partial sums finished, with every decision of the
    step, by one single-program kernel, and the step's log row is written by that kernel.

    Pure TargetProp takes it too: each layer's delta-rule direction is written into the flat buffer (up
    to 128 rows by the small-batch Dense backward kernel, else a matrix product and a column sum), and
    each input target is one ``estimate_gap`` launch (the ``|W|`` column sums, the estimate and the gap
    the next layer down reads; above 16 rows a cuBLAS product ``t·W`` before it).

    Data-parallel (``trainer.dist``): one all-reduce per step. The direction buffer is followed by a
    tail (``FlatLayout.add_tail``) that holds the step's loss sum, correct count and statistic
    partials (``reduce_``), and the whole prefix in use is summed over the ranks at once; from
    ``OVERLAP_BYTES`` of parameters on, each layer's directions are summed as soon as its backward has
    written them (overlapping the layers below) and the tail after. The rules then see the global
    batch (``world_size ×`` the local rows: equal shards) and the loss is the ranks' mean.

    Not taken (the torch-op step runs): float64 or mixed dtypes, layers other than ``Dense``, more than
    ``MAX_LAYERS`` layers, outputs wider than 8,192, inputs that are not ``[batch, features]``, or a
    batch whose shape the flat layout does not fit."""

    def __init__(self, trainer: Any, flat: FlatLayout) -> None:
        from ..kernels.method_steps import _MAX_STATS_PROGRAMS

        dev = trainer.device
        layers = list(trainer.model.layers)
        self.t, self.flat = trainer, flat
        self.n = len(layers)
        self.dist = trainer.dist
        self.world = 1 if self.dist is None else self.dist.world_size
        self._overlap = False
        self._pending: list[Any] = []
        if self.dist is not None:  # room for the loss, the correct count and every pair's partials
            flat.add_tail(_TAIL_HEAD + (self.n + 1) * _MAX_STATS_PROGRAMS * 5)
            self._overlap = self.dist.overlap_pays(list(trainer.model.parameters()))
        f64 = dict(dtype=torch.float64, device=dev)
        self.widths = torch.tensor([float(layer.out_features) for layer in layers], **f64)
        self.seg_layer = flat.layer_of.to(torch.int32)
        self.trainable = flat.trainable.to(torch.int8)
        self.weighted = torch.ones(self.n, dtype=torch.int8, device=dev)
        self.lr = torch.zeros(1, **f64)
        self._lr_value: tuple | None = None
        # each layer's parameters, as views of the flat direction buffer, in parameter order
        self.views: list[tuple[Tensor, ...]] = []
        k = 0
        for layer in layers:
            count = len(tuple(layer.parameters()))
            self.views.append(tuple(flat.g_views[k : k + count]))
            k += count
        self.out_width = layers[-1].out_features
        self.in_width = layers[0].in_features
        # each layer's span of the flat direction buffer (its parameters are consecutive there)
        first = [flat.bounds[sum(flat.counts[:i])] for i in range(self.n)]
        self.spans = [(lo, flat.bounds[sum(flat.counts[: i + 1])]) for i, lo in enumerate(first)]

    @classmethod
    def accepts(cls, trainer: Any) -> bool:
        """Whether the method's settings allow the fused step (a subclass's own conditions)."""
        return True

    @classmethod
    def build(cls, trainer: Any) -> "FusedStep | None":
        """The fused step for ``trainer`` (the method object: its ``model``, ``_flat``, ``dist``,
        ``kernel_backend``), or ``None`` where it is not taken."""
        from ..kernels._triton import use_triton
        from ..kernels.method_steps import _MAX_ROW, MAX_LAYERS, MAX_SEGMENTS

        flat = getattr(trainer, "_flat", None)
        layers = list(trainer.model.layers)
        if flat is None or not layers or len(layers) > MAX_LAYERS:
            return None
        if len(flat.bounds) - 1 > MAX_SEGMENTS or not all(type(layer) is Dense for layer in layers):
            return None
        if not cls.accepts(trainer):
            return None
        params = list(trainer.model.parameters())
        if any(p.dtype != torch.float32 for p in params) or layers[-1].out_features > _MAX_ROW:
            return None
        if not use_triton(params[0], getattr(trainer, "kernel_backend", None)):
            return None
        return cls(trainer, flat)

    def takes(self, x: Tensor, y: Tensor) -> bool:
        """Whether this batch fits the fused step (host checks on shapes and dtypes only)."""
        if x.dim() != 2 or x.shape[1] != self.in_width or x.dtype != torch.float32 or not x.is_contiguous():
            return False
        if y.is_floating_point():
            return y.dtype == torch.float32 and tuple(y.shape) == (x.shape[0], self.out_width)
        return y.dim() == 1 and y.shape[0] == x.shape[0]

    def backward_into_flat(self, g: Tensor, saved: list[Any], first_input: bool = False) -> list[Tensor | None]:
        """Each layer's backward from the output gradient ``g``, its parameter gradients written into the
        flat direction buffer; returns the gradients at each layer's output ([0]: the input's, None
        unless ``first_input``)."""
        layers = self.t.model.layers
        grads: list[Tensor | None] = [None] * (self.n + 1)
        grads[self.n] = g
        for i in range(self.n - 1, -1, -1):
            views = self.views[i]
            g, ds = layers[i].backward_saved(g, saved[i], needs_input_grad=first_input or i > 0, out=views)
            into_views(ds, views)
            self.layer_written(i)
            grads[i] = g
        return grads

    def layer_written(self, i: int) -> None:
        """Layer ``i``'s directions are in the flat buffer: data-parallel with overlap, start summing
        them over the ranks (asynchronously; ``reduce_`` completes it)."""
        if self._overlap and self.spans[i][1] > self.spans[i][0]:
            lo, hi = self.spans[i]
            self._pending.append(self.dist.all_reduce_([self.flat.g[lo:hi]], "sum", async_op=True))

    def reduce_(self, loss_rows: Tensor, part: Tensor, correct: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Data-parallel: the step's numbers summed over the ranks in one all-reduce (see the class
        docstring): returns ``(loss partials, correct count or None)`` of the global batch, with
        ``part`` (``_stats``' output, in the tail) and the directions summed in place. One process:
        ``(loss_rows, correct)`` as they are."""
        if self.dist is None:
            return loss_rows, correct
        flat = self.flat
        tail = flat.tail
        torch.sum(loss_rows, 0, keepdim=True, out=tail[0:1])
        if correct is not None:
            torch.sum(correct, 0, keepdim=True, out=tail[1:2])
        used = _TAIL_HEAD + part.numel()
        start = tail.data_ptr() - flat.g_all.data_ptr()
        start //= flat.g_all.element_size()
        if self._overlap:  # the directions are on their way: the tail alone, then wait for them
            self.dist.all_reduce_([tail[:used]], "sum")
            pending, self._pending = self._pending, []
            for finish in pending:
                finish()
        else:
            self.dist.all_reduce_([flat.g_all[: start + used]], "sum")
        loss = tail[0:1].div_(self.world)  # the ranks' mean of their (local mean) losses: equal shards
        return loss, (tail[1:2] if correct is not None else None)

    def _stats(self, pairs: list[tuple[Tensor, Tensor | None, Tensor | None, float | None]]) -> Tensor:
        """``[len(pairs), P, 5]`` partial sums (``kernels.method_steps.stats_into``: one launch); in the
        flat buffer's tail when data-parallel (summed with the directions by ``reduce_``)."""
        from ..kernels.method_steps import stats_into, stats_partials

        if self.dist is None:
            return stats_into(pairs)
        p = stats_partials(pairs)
        size = len(pairs) * p * 5
        return stats_into(pairs, out=self.flat.tail[_TAIL_HEAD : _TAIL_HEAD + size].view(len(pairs), p, 5))

    def _lr(self, rows: int = 1, scale: float = 1.0) -> Tensor:
        """The rate as a 1-element device tensor, divided by ``rows`` (a step averaged over the batch) and
        multiplied by ``scale`` (an automatic rate's small-batch scale)."""
        lr = self.t.rates.lr  # a float, or a 0-d device tensor (a captured step's row of the lr table)
        if isinstance(lr, Tensor):
            self._lr_value = None
            if scale != 1.0:
                return torch.mul(lr.reshape(1), scale / rows, out=self.lr)
            return self.lr.copy_(lr.reshape(1)) if rows == 1 else torch.div(lr.reshape(1), rows, out=self.lr)
        if (lr, rows, scale) != self._lr_value:  # a fixed rate is written once, not by every (captured) step
            self.lr.fill_(float(lr) / rows if scale == 1.0 else float(lr) * scale / rows)
            self._lr_value = (lr, rows, scale)
        return self.lr

    def _update(self, runner: Any, slot: int, a: Tensor, c: Tensor, apply: Tensor) -> None:
        """The momentum update of every layer in one launch, which also does the weight guard's copy and
        check (three launches fewer) when the guarded tensors are exactly the parameter and velocity
        buffers; else inside the runner's usual guard."""
        from ..kernels.layer_update import momentum_update_flat_

        flat = self.flat
        backend = getattr(self.t, "kernel_backend", None)
        guard = runner.update_guard
        backup = guard.backup_views(flat.p, flat.v)
        if backup is None:
            with runner.guard_update(slot):
                momentum_update_flat_(flat.p, flat.v, flat.g, flat.bounds, a, c, apply, bounds_t=flat.bounds_t, backend=backend)
            return
        flag = guard.device_flag(flat.p.device)
        flag.zero_()
        momentum_update_flat_(
            flat.p, flat.v, flat.g, flat.bounds, a, c, apply, bounds_t=flat.bounds_t, backend=backend, backup=tuple(backup), flag=flag,
        )
        guard.restore_flagged_(runner.step_status[slot, 0])
