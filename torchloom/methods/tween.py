"""Neural Tweening as a method of the engine (``TrainingConfig(method="tween")`` or
``method=TweenConfig(...)``): the engine's hooks, the host step (``TweenState.step``), and the device
step (torch ops, or ``_FusedTween``'s few fused launches) with the explosion rule decided on the
device. The rules themselves (settings and ``TweenState``, Loom's ``TweenStep``) are in
``tween_rules.py``; the explosion rule in ``explosion.py``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from ..engine.losses import LOSS_TYPES, is_label_target, loss_and_grad, mse_to_target
from ..engine.method import Method, RateHolder, as_flat, flatten_tensors_, register_method
from ..engine.types import StepOutput, StepStatus
from ._auto_rate import small_batch_scale
from ._fused import FlatLayout, FusedStep
from .explosion import EXPLOSION_RULE, ExplosionRule, _TensorOps
from .tween_rules import (
    _TWEEN_SCALARS,
    AUTO_RATE,
    TweenConfig,
    TweenState,
    _check_target_shape,
    _is_bias,
    _sum_squares,
    forward_layers,
    tween_metrics,
    tween_sums,
)

__all__ = ["Tween", "TweenConfig", "TweenState", "ExplosionRule", "EXPLOSION_RULE"]


class Tween(Method):
    """Neural Tweening as a method of the training engine (``train(..., TrainingConfig(method="tween"))``
    or ``method=TweenConfig(...)``): ``step`` runs ``TweenState.step`` per batch.

    Step logs (``on_batch_end``; their per-epoch means in the epoch logs and the history):
    ``mean_gap``, ``mean_link_budget``, ``explosion`` (1.0 when the step detected one; per epoch, the
    fraction of steps that did), ``adaptive_rate``, ``gap_baseline`` and ``explosion_count`` (the total).

    The rate: ``base_rate``, or with ``base_rate=None`` (the default) 0.03, of which a step of ``B < 16``
    rows (the global batch) moves ``B/16`` (``rate_scale``); a schedule drives that 0.03.

    Args:
        config: a ``TweenConfig`` (defaults when ``None``).
    """

    name = "tween"
    config_type = TweenConfig
    rate_field = "base_rate"
    losses = LOSS_TYPES
    loss_hint = "whose backward targets come from a named loss"

    @classmethod
    def config_from_training(cls, training: Any) -> TweenConfig:
        """By name: the default settings with ``TrainingConfig.learning_rate`` as ``base_rate``, any
        number as given (``None``, not set: ``base_rate=None``, the rate chosen from the batch size),
        and its ``loss_type`` as Tween's loss (every method trains on the loss ``TrainingConfig`` names)."""
        return TweenConfig(base_rate=training.learning_rate, loss_type=training.loss_type)

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        # the loss: the config's, else the TrainingConfig's (never Tween's automatic choice, which only
        # the functional TweenState API keeps: through train(), loss_type means the same for every method)
        self.loss = self.loss_of(self.training, self.config)
        settings = self.config if self.config.loss_type else dataclasses.replace(self.config, loss_type=self.loss)
        self.state = TweenState(self.model, settings)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("TweenTrainer: model has no trainable parameters (all have requires_grad=False)")
        # the rate a schedule drives: the ceiling of adaptive_rate (base_rate without a schedule); with
        # base_rate=None, 0.03, and a step of B < 16 rows moves B/16 of it (rate_scale)
        self.auto = self.config.base_rate is None
        self.rates = RateHolder(params, AUTO_RATE if self.auto else float(self.config.base_rate))

    def schedulable(self) -> RateHolder:
        return self.rates

    def rate_scale(self, rows: int) -> float:
        """What a step of ``rows`` rows (the global batch) multiplies its layers' rates by:
        ``min(1, rows/16)`` with ``base_rate=None``, else 1 (``adaptive_rate`` itself is not scaled)."""
        return small_batch_scale(rows) if self.auto else 1.0

    def diagnose(self) -> str | None:
        """A collapse the explosion watch cannot see (the gaps stay small when nothing passes): a layer
        whose outputs were all 0 in the last step although its input was not (its link budget is 0
        after a non-zero one below): every unit died, and the output no longer depends on the input."""
        st = self.state
        if not st.steps or not st.link_budgets:
            return None
        budgets = list(st.link_budgets)
        for i, b in enumerate(budgets):
            if b == 0.0 and (i == 0 or budgets[i - 1] > 0.0):
                layer = self.model.layers[i]
                return (f"layer {i} ({type(layer).__name__}) passes no signal: all its outputs were 0 in the last step "
                        "(its units died), so the output no longer depends on the input")
        return None

    def eval_loss_type(self) -> Any:
        """``val_loss`` is the training loss (the run's ``loss_type``; ``"mse"`` to one-hot targets for
        class labels)."""
        return mse_to_target if self.loss == "mse" else self.loss

    def setup(self) -> None:
        """The engine moves the model to the training device; the velocities go first (the device
        runner, built by ``fit`` after the setup, lays them out in flat buffers there)."""
        st = self.state
        st.weight_velocity = [tuple(v.to(self.device) for v in vs) for vs in st.weight_velocity]
        st.bias_velocity = [tuple(v.to(self.device) for v in vs) for vs in st.bias_velocity]

    def state_tensors(self) -> list[Tensor]:
        return [v for vs in (*self.state.weight_velocity, *self.state.bias_velocity) for v in vs]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        st = self.state
        state["tween"] = {
            "weight_velocity": [list(v) for v in st.weight_velocity],
            "bias_velocity": [list(v) for v in st.bias_velocity],
            "scalars": {k: getattr(st, k) for k in _TWEEN_SCALARS if hasattr(st, k)},
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, st = state["tween"], self.state
        st.weight_velocity = [tuple(t.clone() for t in v) for v in saved["weight_velocity"]]
        st.bias_velocity = [tuple(t.clone() for t in v) for v in saved["bias_velocity"]]
        for k, v in saved["scalars"].items():
            setattr(st, k, v)
        if "lr" in saved:  # a checkpoint of an earlier release (the engine keeps every rate now)
            self.rates.param_groups[0]["lr"] = saved["lr"]

    def convert_batch(self, x: Any, y: Any, index: int) -> tuple[Tensor, Tensor]:
        """Move one batch to the model's device/dtype and validate it (labels range, target shape)."""
        x, y, out_shape = self.engine.prepare_batch(x, y, f"batch {index}: ")
        try:
            _check_target_shape(out_shape[1:], x.shape[0], y)
        except ValueError as e:
            raise ValueError(f"batch {index}: {e}") from None
        return x, y

    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        events = self.layer_events()  # None unless an observer wants per-layer events
        rate = float(self.rates.lr)  # base_rate, or the schedule's value
        clip = self._clip if self.clip > 0 else None
        # an automatic rate's small-batch scale from the step's counted global batch (any shard sizes)
        out = self.state._step(self.model, x, y, None, rate, check_labels=False, events=events, clip=clip, dist=self.dist,
                               auto=self.auto)  # checked in convert_batch
        if out.status is not StepStatus.NAN_LOSS and self.state.forward_acts:
            self.observe_outputs(self.state.forward_acts[-1], y)  # training metrics, if any
        return out

    def _clip(self, grads: list[Tensor], batch: int) -> None:
        """``gradient_clip`` on the batch loss's gradient ``G_i/B``: the global L2 norm, or each element
        (``clip_mode="value"``); the bounds scale by ``B`` since the step holds the sums ``G_i``."""
        bound = self.clip * batch
        if self.clip_mode == "value":
            for g in grads:
                g.clamp_(-bound, bound)
        else:
            from ..kernels.grad_norm import clip_grad_norm_

            clip_grad_norm_(grads, bound)

    # ---------------------------------------------------------------------- device step
    device_log_names = ("mean_gap", "mean_link_budget", "explosion", "adaptive_rate", "gap_baseline", "explosion_count")

    def device_ready(self) -> bool:
        return True

    def device_kernel_modules(self) -> list[str]:
        own = ["torchloom.kernels.explosion_rule", "torchloom.kernels.method_steps", "torchloom.kernels.layer_update"]
        return own

    def device_setup(self, runner: Any) -> None:
        """The state the device step reads and writes lives in device tensors (``self.dev``): the
        explosion rule's scalars, and per-layer constants (depth scales). Synced back into the
        ``TweenState`` fields once per epoch (``device_epoch_end``)."""
        st, dev = self.state, self.device
        f64 = dict(dtype=torch.float64, device=dev)
        from ..kernels.explosion_rule import STATE_FIELDS, rule_constants

        values = {
            "adaptive_rate": float(st.adaptive_rate),
            "explosion_count": float(st.explosion_count),
            "steps": float(st.steps),
            **{k: float(v) for k, v in self._rule_state().items()},
        }
        # one buffer in the explosion rule kernel's field order, 0-d views by name
        self._dev_flat = torch.tensor([values[k] for k in STATE_FIELDS], **f64)
        self.dev = {k: self._dev_flat[i] for i, k in enumerate(STATE_FIELDS)}
        self._rule_constants = rule_constants(EXPLOSION_RULE, self.config, dev)
        scales = [0.0 if s is None else s for s in st.depth_scales]
        self._scales = torch.tensor(scales, **f64)
        # parameters and velocities each in one buffer of one layout (parameter order): the weight
        # guard checks two tensors and one kernel updates every layer (``momentum_update_flat_``)
        ordered = []
        for i, layer in enumerate(self.model.layers):
            wv, bv = iter(st.weight_velocity[i]), iter(st.bias_velocity[i])
            ordered.extend(next(bv) if _is_bias(name) else next(wv) for name, _ in layer.named_parameters())
        # parameters then velocities in one buffer: the guard saves, checks and restores one tensor
        flatten_tensors_([*self.model.parameters(), *ordered])
        self._flat = FlatLayout.build(self.model, ordered)
        self._ordered_velocities = ordered
        self._fused = _FusedTween.build(self)

    def guarded_device_tensors(self) -> list[Tensor]:
        velocities = getattr(self, "_ordered_velocities", None) or [v for vs in (*self.state.weight_velocity, *self.state.bias_velocity) for v in vs]
        params = [p for p in self.model.parameters() if p.requires_grad]
        # the explosion watch (self._dev_flat) is not guarded: an update cannot overflow it, and its
        # "no previous gap" marker is a NaN on purpose
        return as_flat([*params, *velocities])

    @torch.no_grad()
    def device_step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        """``TweenState.step``'s rule with no host read: loss partials and the parameter gradients go
        through the runner's guard; gaps, link budgets and alignments stay device tensors; the
        explosion rule and the adaptive rate are ``torch.where`` decisions; every write is masked by
        the guard's ``found_inf``."""
        from ..kernels.grad_norm import grad_sq_partials

        fused = getattr(self, "_fused", None)
        if fused is not None and fused.takes(x, y):  # every layer's bookkeeping in a few launches
            return fused.step(x, y, slot, runner)
        st, cfg = self.state, self.config
        layers = list(self.model.layers)
        n = len(layers)
        acts, saved = forward_layers(layers, x)
        out = acts[-1]
        self.observe_outputs(out, y)  # training metrics, if any (their steps are not graph-captured)
        loss_type = self.loss
        if is_label_target(y):  # scatter one-hot: F.one_hot reads the labels on the host
            t_out = torch.zeros_like(out).scatter_(-1, y.unsqueeze(-1), 1.0)
        else:
            t_out = y
        batch = out.shape[0]
        loss_parts, grad = loss_and_grad(out, t_out, loss_type, validate=False, unreduced=True)
        y_hat = torch.softmax(out, dim=-1) if loss_type == "cross_entropy" else out
        err = (y_hat - t_out).square().reshape(batch, -1).sum(1)
        g = grad * batch
        if cfg.gap_threshold > 0:
            g = g * (err >= cfg.gap_threshold).view(batch, *([1] * (g.dim() - 1))).to(g.dtype)
        chain: list[Tensor | None] = [None] * (n + 1)
        chain[n] = g
        param_grads: list[tuple[Tensor, ...]] = [()] * n
        reducing = []  # data-parallel: each layer's G_i summed over the ranks while the layers below run
        overlap = self.dist is not None and self.dist.overlap_pays(list(self.model.parameters()))
        for i in range(n - 1, -1, -1):
            g, param_grads[i] = layers[i].backward_saved(g, saved[i], needs_input_grad=i > 0)
            if i > 0:
                chain[i] = g
            if overlap and param_grads[i]:
                reducing.append(self.dist.all_reduce_(list(param_grads[i]), "sum", async_op=True))
        targets = [None] + [acts[i] - cfg.gradient_scale * chain[i] for i in range(1, n)] + [t_out]
        if self.dist is None:
            metrics = self._fused_metrics(acts, y_hat, targets)
        else:  # data-parallel (equal shards): sums over every rank's rows, in the step
            sums = torch.stack([tween_sums(acts[i], acts[i + 1] if i + 1 < n else y_hat, acts[i + 1], targets[i + 1]) for i in range(n)])
            packed = torch.cat([sums.reshape(-1), loss_parts.sum().double().reshape(1) / self.dist.world_size])
            # metric sums, the mean loss and (unless already on their way) the gradients: one all_reduce_
            # (one collective for a float64 model; a float32 model's gradients are a second)
            self.dist.all_reduce_([packed] if overlap else [*(pg for pgs in param_grads for pg in pgs), packed], "sum")
            for finish in reducing:
                finish()
            metrics, loss_parts = tween_metrics(packed[:-1].view(n, 9)), packed[-1:]
            batch = batch * self.dist.world_size
        gaps, budgets, aligns = metrics.unbind(1)
        flat_grads = [pg for pgs in param_grads for pg in pgs]
        clip_norm = self.clip * batch if self.clip > 0 and self.clip_mode == "norm" else 0.0
        runner.decide(slot, loss_parts, grad_sq_partials(flat_grads), clip_norm)
        ok = runner.found_inf == 0
        if self.clip > 0 and self.clip_mode == "value":
            torch._foreach_clamp_min_(flat_grads, -self.clip * batch)
            torch._foreach_clamp_max_(flat_grads, self.clip * batch)

        # explosion handling and the adaptive rate, as device decisions
        lr = self.rates.lr  # a float, or a 0-d device tensor (a captured step's row of the lr table)
        # torch.full, not torch.tensor: a fill kernel, where a host→device copy would synchronise
        base = lr.double() if isinstance(lr, Tensor) else torch.full((), float(lr), dtype=torch.float64, device=self.device)
        avg_gap = gaps.mean()
        exploded = self._device_rule(avg_gap, base, runner.found_inf)
        d = self.dev

        # update: per-layer rate, momentum per parameter, masked by ``ok``
        s = cfg.link_budget_scale
        rates = d["adaptive_rate"] * (1.0 - s / 2 + s / 2 * aligns) * self._scales
        scale = self.rate_scale(batch)  # base_rate=None: B/16 of the rate for a (global) batch under 16 rows
        if scale != 1.0:
            rates = rates * scale
        if clip_norm > 0:
            rates = rates * runner.grad_scale.double()
        keep = (~exploded).double() * cfg.momentum_decay  # an explosion resets every velocity
        flat = getattr(self, "_flat", None)
        with runner.guard_update(slot):
            if flat is not None and flat.fits(param_grads):  # every layer in one launch
                flat.update_(param_grads, a=keep.expand(n), c=-rates / batch, apply=ok.expand(n))
            for i, layer in enumerate(layers):
                if flat is not None and flat.fits(param_grads):
                    break
                if st.depth_scales[i] is None:
                    continue
                c = (rates[i] / batch).to(out.dtype)
                k = keep.to(out.dtype)
                wv, bv = iter(st.weight_velocity[i]), iter(st.bias_velocity[i])
                for (name, p), pg in zip(layer.named_parameters(), param_grads[i]):
                    v = next(bv) if _is_bias(name) else next(wv)
                    if not p.requires_grad:
                        continue
                    v.copy_(torch.where(ok, v * k - c * pg, v))
                    p.add_(torch.where(ok, v, 0.0))
        runner.log(slot, [avg_gap, budgets.mean(), exploded.double(), d["adaptive_rate"], d["gap_baseline"], d["explosion_count"]])
        self._last_metrics = metrics

    def _fused_metrics(self, acts: list[Tensor], y_hat: Tensor, targets: list[Any]) -> Tensor:
        """``[n, 3]`` = per layer ``[gap, link_budget, alignment]`` as ``TweenState._layer_metrics``
        defines them, from one fused pass per layer (``kernels.layer_update.pair_stats``: the sums
        Σf·t, Σf², Σt², Σ(f − t)² and Σa_out²) and a handful of vectorised ops for all layers."""
        from ..kernels.layer_update import pair_stats

        n = len(acts) - 1
        f_list = [acts[i + 1] if i + 1 < n else y_hat for i in range(n)]
        stats = torch.stack([pair_stats(f_list[i], targets[i + 1], acts[i + 1]) for i in range(n)]).double()
        dot, ff, tt, dd, out_sq = stats.unbind(1)
        in_sq = torch.cat([_sum_squares(acts[0]).reshape(1), out_sq[:-1]])
        numel_f = [max(f.numel(), 1) for f in f_list]
        numel_in = [max(acts[i].numel(), 1) for i in range(n)]
        gap = torch.stack([dd[i] / numel_f[i] for i in range(n)])
        rms_in = torch.stack([(in_sq[i] / numel_in[i]).sqrt() for i in range(n)])
        rms_out = torch.stack([(out_sq[i] / numel_f[i]).sqrt() for i in range(n)])
        budget = torch.where(rms_in > 0, rms_out / torch.where(rms_in > 0, rms_in, 1.0), 0.0)
        nf, nt = ff.sqrt(), tt.sqrt()
        both = (nf > 0) & (nt > 0)
        align = torch.where(both, (dot / torch.where(both, nf * nt, 1.0) + 1) / 2, 0.5)
        return torch.stack([gap, budget, align], dim=1)

    def device_epoch_tensors(self) -> list[Tensor]:
        """What ``device_epoch_end`` reads, for the runner's one host read per epoch: the device state
        (``STATE_FIELDS`` order) and, after a step, the last step's per-layer metrics ``[L, 3]``."""
        metrics = getattr(self, "_last_metrics", None)
        return [self._dev_flat] + ([metrics] if metrics is not None else [])

    def device_epoch_end(
        self, runner: Any, losses: list[float], statuses: list[int], logs: list[list[float]] | None,
        values: list[list[float]],
    ) -> None:
        """Once per epoch (after the runner's one host read, which brought ``device_epoch_tensors()`` as
        ``values``): the device state back into the ``TweenState`` fields and per-step histories, so
        both paths leave the same state behind."""
        st, d = self.state, self.dev
        snapshot = dict(zip(d.keys(), values[0]))
        st.adaptive_rate = snapshot.pop("adaptive_rate")
        st.explosion_count = int(snapshot.pop("explosion_count"))
        st.steps = int(snapshot.pop("steps"))
        self._set_rule_state(snapshot)
        count = st.explosion_count - sum(int(r[2]) for r, s in zip(logs or [], statuses) if s == 0)
        for loss, status, row in zip(losses, statuses, logs or []):
            if status != 0:
                continue
            count += int(row[2])
            st.loss_history.append(loss)
            st.gap_history.append(row[0])
            st.link_budget_history.append(row[1])
            st.explosion_history.append(count)
            st.rate_history.append(row[3])
        if len(values) > 1:  # the last step's metrics, [L, 3] row by row
            m = values[1]
            st.gaps, st.link_budgets, st.alignments = m[0::3], m[1::3], m[2::3]

    # The explosion rule's state and its device form (see ``ExplosionRule``).
    def _rule_state(self) -> dict[str, float]:
        st = self.state
        prev = st.prev_avg_gap
        return {
            "prev_avg_gap": math.nan if prev is None else float(prev),
            "gap_baseline": float(st.gap_baseline),
            "gap_growth_rate": float(st.gap_growth_rate),
            "gap_log_mean": float(st.gap_log_mean),
            "gap_log_dev": float(st.gap_log_dev),
            "gap_log_peak": float(st.gap_log_peak),
            "explosion_pressure": float(st.explosion_pressure),
        }

    def _set_rule_state(self, values: dict[str, float]) -> None:
        st = self.state
        prev = values["prev_avg_gap"]
        st.prev_avg_gap = None if math.isnan(prev) else prev
        for key in ("gap_baseline", "gap_growth_rate", "gap_log_mean", "gap_log_dev", "gap_log_peak", "explosion_pressure"):
            setattr(st, key, values[key])

    def _device_rule(self, avg_gap: Tensor, base: Tensor, found_inf: Tensor) -> Tensor:
        """Step 4 on the device: ``ExplosionRule`` over the state in ``self.dev`` (explosion count and
        steps included), every write masked by ``found_inf == 0``; returns the 0-d bool ``exploded``.
        One launch on CUDA (``kernels.explosion_rule``), the rule over ``torch`` ops elsewhere."""
        from ..kernels.explosion_rule import explosion_rule_

        return explosion_rule_(EXPLOSION_RULE, _TensorOps, self.config, self._dev_flat, self._rule_constants, avg_gap, base, found_inf)


class _FusedTween(FusedStep):
    """Tweening's device step in about eighteen launches (``FusedStep``): metrics, the explosion rule,
    the adaptive rate and every layer's rate decided by one single-program kernel
    (``method_steps.tween_rule_``)."""

    def __init__(self, trainer: Any, flat: FlatLayout) -> None:
        super().__init__(trainer, flat)
        f64 = dict(dtype=torch.float64, device=trainer.device)
        # the input's width first: the rule reads each layer's input and output sizes
        self.widths = torch.tensor([float(self.in_width)] + [float(layer.out_features) for layer in trainer.model.layers], **f64)
        cfg = trainer.config
        self.consts = torch.tensor([cfg.link_budget_scale, cfg.momentum_decay], **f64)

    @classmethod
    def accepts(cls, trainer: Any) -> bool:
        return trainer.loss in ("mse", "cross_entropy")

    def step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        from ..kernels.grad_norm import grad_sq_partials
        from ..kernels.method_steps import TWEEN_CE, TWEEN_MSE, target_rows, tween_rule_

        t, cfg = self.t, self.t.config
        backend = getattr(t, "kernel_backend", None)
        acts, saved = forward_layers(t.model.layers, x)
        out = acts[-1]
        t.observe_outputs(out, y)
        loss_type = t.loss
        mode = TWEEN_CE if loss_type == "cross_entropy" else TWEEN_MSE
        loss_rows, g, t_out, y_hat, _ = target_rows(out, y, mode, cfg.gap_threshold)
        grads = self.backward_into_flat(g, saved)
        s = cfg.gradient_scale
        part = self._stats(
            [(x, None, None, None)] + [(acts[i + 1], grads[i + 1], acts[i + 1], -s) for i in range(self.n - 1)] + [(y_hat, t_out, out, None)]
        )
        batch = out.shape[0] * self.world  # data-parallel: the global batch (equal shards)
        loss, _ = self.reduce_(loss_rows, part)  # data-parallel: directions, statistics and loss in one all-reduce
        clip_norm = t.clip * batch if t.clip > 0 and t.clip_mode == "norm" else 0.0
        runner.decide(slot, loss, grad_sq_partials([self.flat.g], backend=backend), clip_norm)
        if t.clip > 0 and clip_norm == 0:
            self.flat.g.clamp_(-t.clip * batch, t.clip * batch)
        a, c, apply, metrics = tween_rule_(
            part, self.widths, self.consts, t._scales, t._dev_flat, t._rule_constants, self._lr(),
            runner.grad_scale if clip_norm > 0 else None, runner.found_inf, batch, self.seg_layer, self.trainable,
            runner.step_logs[slot, :6],
        )
        scale = t.rate_scale(batch)  # base_rate=None: B/16 of every layer's rate for a batch under 16 rows
        if scale != 1.0:
            c.mul_(scale)
        self._update(runner, slot, a, c, apply)
        t._last_metrics = metrics


register_method(Tween, "tweening")
