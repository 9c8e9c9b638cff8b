"""TargetProp as a method of the engine (``TrainingConfig(method="target_prop")`` or
``method=TargetPropConfig(...)``): the engine's hooks, the host step, and the device step (torch ops,
or ``_FusedTargetProp``'s few fused launches). The rules themselves (settings, state and Loom's
four-call functional API) are in ``target_prop_rules.py``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..engine.guards import finite_flag
from ..engine.method import Method, RateHolder, all_finite, as_flat, flatten_tensors_, register_method
from ..engine.types import StepOutput, StepStatus
from ..layers.base import autocast_off, column_sum
from ._auto_rate import small_batch_scale
from ._fused import FlatLayout, FusedStep, into_views
from .target_prop_rules import (
    LOSSES,
    MODES,
    TargetPropConfig,
    TargetPropState,
    _fill_backward,
    _mse_to_target,
    apply_target_prop_gaps,
    check_target,
    estimate_input_target,
    layer_sums,
    mode_output_target,
    target_loss,
    target_prop_backward,
    target_prop_forward,
)

__all__ = [
    "TargetProp", "MODES", "TargetPropConfig", "TargetPropState", "target_prop_forward", "target_prop_backward",
    "apply_target_prop_gaps", "estimate_input_target", "check_target",
]


class TargetProp(Method):
    """TargetProp as a method of the training engine (``train(..., TrainingConfig(method="target_prop"))``
    or ``method=TargetPropConfig(...)``). One host ``step(x, y)``:

    1. check the batch (``y``: class labels ``[batch]`` or a target of the output's shape); bad input
       raises before anything changes;
    2. ``target_prop_forward``; the loss reported is the **pre-update** MSE ``mean((y − t)²)`` (the
       ``"mse"`` loss, comparable with backprop's; the update itself follows ½Σ(y−t)²), plus the
       accuracy (argmax) when ``y`` holds labels; a NaN/Inf loss skips the step (``NAN_LOSS``);
    3. ``target_prop_backward`` and ``state.calculate_link_budgets()``; a NaN/Inf update direction
       skips the update (``NAN_GRAD``); with ``gradient_clip`` the update directions are clipped
       (global L2 norm, or per element with ``clip_mode="value"``);
    4. ``apply_target_prop_gaps`` at the current rate (``TargetPropConfig.learning_rate``, driven by
       the schedule when there is one; with ``learning_rate=None`` the mode's rate, 0.1 chain rule or
       0.05 pure, times ``min(1, B/16)`` for a step of ``B`` rows); the engine checks the weights after it.

    The device step (CUDA runner, graph-captured) is the same rule with the gate, the per-layer
    rates, the momentum and the NaN/Inf decisions in device tensors.

    Step logs (averaged per epoch into the history): ``accuracy`` (labels only),
    ``mean_link_budget``, ``mean_gap`` (over all layers) and ``skipped_layers`` (layers with
    parameters the gate skipped). Per-layer observer events, only when an observer implements them:
    ``on_layer_forward`` with each layer's output; in chain-rule mode ``on_layer_backward`` with the
    gradient of ½Σ(y−t)² at each layer's input, last layer first (pure mode computes no gradients and
    sends none).

    Args:
        config: a ``TargetPropConfig`` (default settings when ``None``).
    """

    device_log_names = ("mean_link_budget", "mean_gap", "skipped_layers", "accuracy")

    name = "target_prop"
    config_type = TargetPropConfig
    rate_field = "learning_rate"
    losses = LOSSES
    loss_hint = "which moves the output towards a target ('mse': t − y; 'cross_entropy': onehot − softmax(y))"

    @classmethod
    def config_from_training(cls, training: Any) -> TargetPropConfig:
        """By name: the default settings with ``TrainingConfig.learning_rate`` as the rate, any number
        as given (``None``, not set: ``learning_rate=None``, the chain rule's automatic rate)."""
        return TargetPropConfig(learning_rate=training.learning_rate)

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("TargetPropTrainer: model has no trainable parameters (all have requires_grad=False)")
        self.state = TargetPropState(self.model, self.config)
        # the rate a schedule drives: learning_rate, or with learning_rate=None the mode's rate for batches
        # of 16 rows or more, of which a step of B < 16 rows moves B/16 (rate_scale)
        self.auto = self.config.learning_rate is None
        self.rates = RateHolder(params, self.config.base_rate)
        self.loss = self.loss_of(self.training, self.config)

    # ------------------------------------------------------------------ engine hooks
    def schedulable(self) -> RateHolder:
        return self.rates

    def rate_scale(self, rows: int) -> float:
        """What a step over ``rows`` samples (the global batch) multiplies the scheduled rate by:
        ``min(1, rows/16)`` with ``learning_rate=None``, else 1."""
        return small_batch_scale(rows) if self.auto else 1.0

    def state_tensors(self) -> list[Tensor]:
        return [v for vs in self.state.velocities if vs is not None for v in vs]

    def state_dict(self) -> dict[str, Any]:
        st = self.state
        state: dict[str, Any] = {}
        state["target_prop"] = {
            "velocities": [None if vs is None else list(vs) for vs in st.velocities],
            "link_budgets": list(st.link_budgets),
            "gaps": list(st.gaps),
            "steps": st.steps,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, st = state["target_prop"], self.state
        st.velocities = [None if vs is None else tuple(v.clone() for v in vs) for vs in saved["velocities"]]
        st.link_budgets, st.gaps, st.steps = list(saved["link_budgets"]), list(saved["gaps"]), int(saved["steps"])
        if "lr" in saved:  # a checkpoint of an earlier release (the engine keeps every rate now)
            self.rates.param_groups[0]["lr"] = saved["lr"]

    def eval_loss_type(self) -> Any:
        """``val_loss`` is the training loss: the MSE ``mean((y − t)²)`` (labels one-hot), or the
        softmax cross-entropy."""
        return "cross_entropy" if self.loss == "cross_entropy" else _mse_to_target

    def convert_batch(self, x: Any, y: Any, index: int | None = None) -> tuple[Tensor, Tensor]:
        """Move one batch to the model's device (floats to its dtype; labels stay integers) and check it
        against the model's output shape (one forward per distinct input shape)."""
        where = "" if index is None else f"batch {index}: "
        x, y, out_shape = self.engine.prepare_batch(x, y, where)
        check_target(out_shape, y, f"batch {index}" if index is not None else "TargetPropTrainer")
        return x, y

    # ------------------------------------------------------------------------ host step
    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        x, y = self.convert_batch(x, y)
        state = self.state
        state.config.validate()
        out = target_prop_forward(self.model, state, x)
        events = self.layer_events()  # None unless an observer wants per-layer events
        if events is not None:
            for i, layer in enumerate(self.model.layers):
                events.forward(i, layer, state.forward_acts[i + 1])
        labels = y if y.dtype == torch.long else None
        target = mode_output_target(self.config, out, y, self.loss)
        stats = [target_loss(out, y, self.loss)]
        if labels is not None:
            stats.append((out.argmax(-1) == labels).double().mean())
        stats_t = torch.stack(stats)
        if self.dist is not None:  # data-parallel: one all-reduce and one host read (_step_data_parallel)
            return self._step_data_parallel(x, y, out, target, stats_t, events)
        values = stats_t.tolist()
        loss = values[0]
        if not math.isfinite(loss):
            return StepOutput(loss, StepStatus.NAN_LOSS)
        self.observe_outputs(out, y)  # training metrics, if any: batches whose loss counted
        # the input's gradient only for per-layer observers (``on_layer_backward`` of layer 0)
        _fill_backward(self.model, state, target, input_target=events is not None and events.wants_backward)
        if events is not None and state.config.use_chain_rule:  # pure mode takes no gradients
            for i in range(len(self.model.layers) - 1, -1, -1):
                g = state.gradients[i]  # t − y carried back: the loss gradient is its negative
                events.backward(i, self.model.layers[i], None if g is None else -g)
        state.calculate_link_budgets()
        directions = [d for ds in state.weight_gradients if ds for d in ds]
        if not all_finite(directions):
            return StepOutput(loss, StepStatus.NAN_GRAD)
        return self._apply(directions, x.shape[0], loss, values[1] if labels is not None else None)

    def _step_data_parallel(self, x: Tensor, y: Tensor, out: Tensor, target: Tensor, stats: Tensor, events: Any) -> StepOutput:
        """The host step under data-parallel training, with one all-reduce and one host read: the
        update directions (sums over samples), the per-layer sums of the link budgets and gaps, and
        the loss and accuracy (averaged: equal shards) are summed over the ranks in one ``all_reduce_``
        (one collective for a float64 model), then read back with the directions' finiteness. The
        backward runs before the loss is known to be finite (a NaN/Inf loss on any rank still changes
        nothing: the same decision on every rank)."""
        state = self.state
        _fill_backward(self.model, state, target, input_target=events is not None and events.wants_backward)
        index = state.measured_layers()
        rows_of = [layer_sums(state.forward_acts[i + 1], state.backward_targets[i + 1]) for i in index]
        sums = torch.stack(rows_of) if rows_of else stats.new_zeros(0, 5)
        directions = [d for ds in state.weight_gradients if ds for d in ds]
        world = self.dist.world_size
        rows_here = torch.full((1,), float(x.shape[0]), dtype=torch.float64, device=stats.device)
        # the last number: the rows of every rank, counted (a caller's shards may differ in size)
        packed = torch.cat([stats.double() / world, sums.reshape(-1).to(stats.device), rows_here])
        self.dist.all_reduce_([*directions, packed], "sum")  # a NaN on one rank reaches all
        finite = finite_flag(directions) if directions else torch.tensor(True)
        values = torch.cat([packed, finite.reshape(1).double().to(packed.device)]).tolist()
        loss, k, rows = values[0], stats.numel(), int(round(values[-2]))
        if not math.isfinite(loss):
            return StepOutput(loss, StepStatus.NAN_LOSS)
        self.observe_outputs(out, y)
        if events is not None and state.config.use_chain_rule:
            for i in range(len(self.model.layers) - 1, -1, -1):
                g = state.gradients[i]
                events.backward(i, self.model.layers[i], None if g is None else -g)
        state.set_link_budgets(index, [values[k + 5 * j : k + 5 * j + 5] for j in range(len(index))])
        if values[-1] < 0.5:
            return StepOutput(loss, StepStatus.NAN_GRAD)
        return self._apply(directions, rows, loss, values[1] if k > 1 else None)

    def _apply(self, directions: list[Tensor], rows: int, loss: float, accuracy: float | None) -> StepOutput:
        """Clip and apply the (finite) directions, sums over ``rows`` samples; the step's output."""
        state = self.state
        self._clip(directions, rows)
        skipped = apply_target_prop_gaps(self.model, state, float(self.rates.lr) * self.rate_scale(rows), rows=rows)
        logs = {
            "mean_link_budget": sum(state.link_budgets) / len(state.link_budgets),
            "mean_gap": sum(state.gaps) / len(state.gaps),
            "skipped_layers": float(len(skipped)),
        }
        if accuracy is not None:
            logs["accuracy"] = accuracy
        return StepOutput(loss, StepStatus.OK, logs)

    def _clip_bound(self, rows: int) -> float:
        """``gradient_clip`` for the directions as they are held (sums over ``rows`` samples): with
        ``reduction="mean"`` the clip bounds the averaged step, so the bound on the sums is ``rows×``."""
        return self.clip * (rows if self.config.reduction == "mean" else 1)

    def _clip(self, directions: list[Tensor], rows: int) -> None:
        if self.clip <= 0:
            return
        bound = self._clip_bound(rows)
        if self.clip_mode == "value":
            for d in directions:
                d.clamp_(-bound, bound)
        else:
            from ..kernels.grad_norm import clip_grad_norm_

            clip_grad_norm_(directions, bound)

    # ---------------------------------------------------------------------- device step
    def device_ready(self) -> bool:
        return True

    def device_kernel_modules(self) -> list[str]:
        own = ["torchloom.kernels.method_steps", "torchloom.kernels.layer_update"]
        return own

    def device_setup(self, runner: Any) -> None:
        """Velocities exist from the start on the device (zeros: the same first update as the host
        path's lazily made ones), and the link budgets live in a device tensor."""
        st = self.state
        for i, layer in enumerate(self.model.layers):
            params = tuple(layer.parameters())
            if params and st.velocities[i] is None:
                st.velocities[i] = tuple(torch.zeros_like(p) for p in params)
        # parameters, velocities and update directions each in one buffer of one layout: the weight
        # guard checks two tensors and one kernel updates every layer (``momentum_update_flat_``)
        # parameters then velocities in one buffer: the guard saves, checks and restores one tensor
        flatten_tensors_([*self.model.parameters(), *(v for vs in st.velocities if vs is not None for v in vs)])
        self._flat = FlatLayout.build(self.model, [v for vs in st.velocities if vs is not None for v in vs])
        self._budgets = torch.tensor(st.link_budgets, dtype=torch.float64, device=self.device)
        n = st.num_layers
        self._depth = torch.tensor([self.config.depth_scale_factor**i for i in range(n)], dtype=torch.float64, device=self.device)
        self._weighted = torch.tensor([bool(tuple(layer.parameters())) for layer in self.model.layers], device=self.device)
        self._nan = torch.full((), math.nan, dtype=torch.float64, device=self.device)
        self._consts = torch.tensor([self.config.gate_threshold, self.config.momentum], dtype=torch.float64, device=self.device)
        self._fused = _FusedTargetProp.build(self)

    def guarded_device_tensors(self) -> list[Tensor]:
        velocities = [v for vs in self.state.velocities if vs is not None for v in vs]
        params = [p for p in self.model.parameters() if p.requires_grad]
        if getattr(self, "_fused", None) is not None:  # its rule never writes a non-finite budget
            return as_flat([*params, *velocities])
        return [*as_flat([*params, *velocities]), self._budgets]

    @torch.no_grad()
    def device_step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        """The host step's rule with no host read: loss and directions through the runner's guard,
        budgets, gate, rates and momentum as device tensors, every write masked by ``found_inf``."""
        from ..kernels.grad_norm import grad_sq_partials

        st, cfg, model = self.state, self.config, self.model
        n = st.num_layers
        fused = self._fused if self._fused is not None and self._fused.takes(x, y) else None
        if fused is not None:  # every layer's bookkeeping in a few launches (kernels/method_steps.py)
            return fused.step(x, y, slot, runner)
        out = target_prop_forward(model, st, x)
        self.observe_outputs(out, y)  # training metrics, if any (their steps are not graph-captured)
        labels = y if y.dtype == torch.long else None
        target = mode_output_target(self.config, out, y, self.loss)
        loss = target_loss(out, y, self.loss)
        _fill_backward(model, st, target, input_target=False)
        directions = [d for ds in st.weight_gradients if ds for d in ds]
        rows = x.shape[0] * (1 if self.dist is None else self.dist.world_size)  # the samples the directions sum over
        bound = self._clip_bound(rows)
        clip_norm = bound if self.clip_mode == "norm" else 0.0
        accuracy = (out.argmax(-1) == labels).double().mean() if labels is not None else self._nan
        if self.dist is not None:  # data-parallel: directions and per-layer sums summed, loss and accuracy averaged
            world = self.dist.world_size
            sums = torch.stack([layer_sums(st.forward_acts[i + 1], st.backward_targets[i + 1]) for i in range(n)])
            packed = torch.cat([loss.double().reshape(1) / world, accuracy.reshape(1) / world, sums.reshape(-1)])
            self.dist.all_reduce_([*directions, packed], "sum")  # one all_reduce_ (one collective for a float64 model)
            loss, accuracy, sums = packed[0], packed[1], packed[2:].view(n, 5)
        runner.decide(slot, loss.reshape(1), grad_sq_partials(directions), clip_norm)
        ok = runner.found_inf == 0
        if self.dist is None:  # link budgets and gaps: one fused pass per layer (kernels/layer_update.py)
            from ..kernels.layer_update import pair_stats

            stats = torch.stack([pair_stats(st.forward_acts[i + 1], st.backward_targets[i + 1]) for i in range(n)]).double()
            dot, f_mag, b_mag, sq = stats[:, 0], stats[:, 1], stats[:, 2], stats[:, 3]
            mean_sq = torch.stack([sq[i] / max(st.forward_acts[i + 1].numel(), 1) for i in range(n)])
        else:  # data-parallel: budgets and gaps from the per-layer sums over every rank's rows
            dot, f_mag, b_mag, sq, count = sums.unbind(1)
            mean_sq = sq / count.clamp_min(1.0)
        both = (f_mag > 0) & (b_mag > 0)
        cosine = dot / torch.where(both, f_mag.sqrt() * b_mag.sqrt(), 1.0)
        status = runner.step_status[slot, 0]
        measured = (status == 0) | (status == 2)  # as the host step: budgets move unless the loss was NaN/Inf
        budgets = torch.where(both & measured, ((cosine + 1.0) / 2.0).clamp(0.0, 1.0), self._budgets)
        self._budgets.copy_(budgets)
        gaps = mean_sq.sqrt()
        open_gate = budgets >= cfg.gate_threshold
        lr = self.rates.lr  # a float, or a 0-d device tensor (a captured step's row of the lr table)
        rates = (lr.double() if isinstance(lr, Tensor) else lr) * (0.5 + 0.5 * budgets) * self._depth
        scale = self.rate_scale(rows)  # learning_rate=None: rows/16 of the rate for a batch under 16 rows
        if scale != 1.0:
            rates = rates * scale
        if cfg.reduction == "mean":
            rates = rates / rows
        if clip_norm > 0:
            rates = rates * runner.grad_scale.double()
        elif self.clip > 0:
            torch._foreach_clamp_min_(directions, -bound)
            torch._foreach_clamp_max_(directions, bound)
        mu = cfg.momentum
        flat = self._flat
        with runner.guard_update(slot):
            if flat is not None and flat.fits(st.weight_gradients):  # every layer in one launch
                flat.update_(st.weight_gradients, a=torch.full_like(rates, mu), c=(1.0 - mu) * rates, apply=ok & open_gate)
            else:
                for i, layer in enumerate(model.layers):
                    ds = st.weight_gradients[i]
                    if not ds:
                        continue
                    apply = ok & open_gate[i]
                    c = ((1.0 - mu) * rates[i]).to(ds[0].dtype)
                    for p, v, d in zip(layer.parameters(), st.velocities[i], ds):
                        if not p.requires_grad:
                            continue
                        v.copy_(torch.where(apply, v * mu + c * d, v))
                        p.add_(torch.where(apply, v, 0.0))
        runner.log(slot, [budgets.mean(), gaps.mean(), (self._weighted & ~open_gate).double().sum(), accuracy])


class _FusedTargetProp(FusedStep):
    """TargetProp's device step in about eighteen launches (``FusedStep``): chain rule or pure mode;
    the gate, rates and momentum decided by one single-program kernel (``method_steps.tp_rule_``).
    Its output target is the kernels' ``t − y`` (``"mse"``) or ``t − softmax(y)`` (``"cross_entropy"``)."""

    @classmethod
    def accepts(cls, trainer: Any) -> bool:
        return trainer.loss in ("mse", "cross_entropy")

    def pure_into_flat(self, gap: Tensor, target: Tensor, acts: list[Tensor]) -> list[Tensor | None]:
        """Pure TargetProp's backward pass from the output's ``gap = target − out``: each layer's
        delta-rule direction (``gapᵀ x``, bias ``Σ gap``) written into the flat direction buffer, and each
        layer's input target (``estimate_gap``: ``est(v) = v W / Σ|W|`` per input unit, of the gap above
        with ``pure_targets="difference"``, of the target above with ``"loom"``). Returns the targets
        at each layer's output ([0] None: the input's target is never used)."""
        difference = self.t.config.pure_targets == "difference"
        # under bf16 autocast the activations are bfloat16: the delta rule and the estimates read them in
        # float32, like the float32 weights and the flat direction buffer they meet, with autocast off
        # (estimate_gap's product t_out W would otherwise run, and store the targets, in bfloat16)
        gap = gap.float()
        acts = [a if a.dtype == torch.float32 else a.float() for a in acts]
        backend = getattr(self.t, "kernel_backend", None)
        targets: list[Tensor | None] = [None] * (self.n + 1)
        targets[self.n] = target
        with autocast_off(gap.device.type):
            self._pure_layers(gap, targets, acts, difference, backend)
        return targets

    def _pure_layers(self, gap: Tensor, targets: list[Tensor | None], acts: list[Tensor], difference: bool, backend: Any) -> None:
        """``pure_into_flat``'s loop over the layers, last first (fills ``targets[1:n]``)."""
        from ..kernels import dense_small
        from ..kernels.method_steps import estimate_gap

        layers = self.t.model.layers
        for i in range(self.n - 1, -1, -1):
            views, w = self.views[i], layers[i].weight  # w: [out, in]
            if gap.shape[0] <= dense_small.SMALL_BATCH_MAX:  # dW and db in one launch (a linear "activation")
                _, *ds = dense_small.dense_small_backward(gap, gap, acts[i], w, "linear", len(views) > 1, False, backend, out=(views + (None,))[:2])
                into_views(ds, views)
            else:
                torch.mm(gap.t(), acts[i], out=views[0])
                if len(views) > 1:
                    column_sum(gap, out=views[1])
            self.layer_written(i)
            if i > 0:
                targets[i], gap = estimate_gap(gap if difference else targets[i + 1], w, acts[i], difference)

    def step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        from ..kernels.grad_norm import grad_sq_partials
        from ..kernels.method_steps import TP, TP_CE, target_rows, tp_rule_

        t, st, cfg = self.t, self.t.state, self.t.config
        backend = getattr(t, "kernel_backend", None)
        out = target_prop_forward(t.model, st, x)
        t.observe_outputs(out, y)
        # pure mode: the output's gap and target from a float32 copy of a bfloat16 output (as the host step)
        loss_rows, g, target, _, correct = target_rows(out if cfg.use_chain_rule else out.float(), y, TP_CE if t.loss == "cross_entropy" else TP)
        acts = st.forward_acts
        st.weight_gradients = list(self.views)
        if cfg.use_chain_rule:
            grads = self.backward_into_flat(g, st.saved)
            st.gradients = grads
            st.backward_targets = [None] * (self.n + 1)  # never materialised by the fused step
            scale = cfg.gradient_scale
            part = self._stats([(acts[i + 1], grads[i + 1], None, scale) for i in range(self.n - 1)] + [(out, target, None, None)])
        else:
            targets = self.pure_into_flat(g, target, acts)
            st.gradients, st.backward_targets = [None] * (self.n + 1), targets
            part = self._stats([(acts[i + 1], targets[i + 1], None, None) for i in range(self.n)])
        rows = x.shape[0] * self.world  # the samples the directions sum over (data-parallel: every rank's)
        labels = y.dtype == torch.long
        # data-parallel: directions, statistics, loss and correct count in one all-reduce
        loss, correct = self.reduce_(loss_rows, part, correct if labels else None)
        bound = t._clip_bound(rows)
        clip_norm = bound if t.clip_mode == "norm" else 0.0
        runner.decide(slot, loss, grad_sq_partials([self.flat.g], backend=backend), clip_norm)
        if t.clip > 0 and clip_norm == 0:
            self.flat.g.clamp_(-bound, bound)
        a, c, apply = tp_rule_(
            part, self.widths, t._consts, t._budgets, t._depth, self.weighted, runner.step_status[slot, 0], runner.found_inf,
            self._lr(rows if cfg.reduction == "mean" else 1, t.rate_scale(rows)), runner.grad_scale if clip_norm > 0 else None, correct,
            rows, self.seg_layer, self.trainable, runner.step_logs[slot, :4],
        )
        self._update(runner, slot, a, c, apply)


register_method(TargetProp, "targetprop")
