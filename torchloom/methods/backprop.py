"""Backpropagation, the default method of ``torchloom.train()`` (Loom's ``Train()``).

One host step (``Backprop.step``), as Loom ``poly.Train``'s CPU path:

1. forward through the layers' explicit forward (no autograd graph);
2. loss and output gradient in one pass (``loss_and_grad``: fused kernel on CUDA);
3. if the loss is NaN/Inf, report ``NAN_LOSS`` (the loop abandons the epoch; weights untouched);
4. backward through the layers' hand-written backward;
5. if any gradient is NaN/Inf, report ``NAN_GRAD`` (the update is skipped);
6. optional clip: global L2 norm (``clip_mode="norm"``, Loom's documents) or per element
   (``clip_mode="value"``, Loom ``poly``'s code);
7. optimizer update (the engine checks the weights after it), then one scheduler step.

The device step (``Backprop.device_step``, run by the engine's CUDA runner, graph-captured) is the same rule
with every decision in device tensors: the fused loss writes per-block partial sums, the gradients
land in the optimizer's flat ``.grad`` views, the step guard decides NaN/Inf and the clip scale on the
device, and the fused update obeys its ``found_inf``. With torchloom's SGD and no clip by norm the
gradient pass is ``SGD.probe``: it also computes the values the update would write, so an update
that would overflow is refused before it happens (no backup of the weights, no check after it).

Compiled (``TrainingConfig(compile=True)``, or a mapping of ``torch.compile`` options): steps 1 and 4
run through ``torch.compile`` of the model instead: its forward under autograd (each layer's
``autograd.Function`` holds its hand-written backward), then ``torch.autograd.grad`` of the output
with the loss gradient runs the compiled backward; the loss (step 2) and steps 3 and 5-7 are the
eager step's. Such a run takes the host loop on every device (the CUDA device path and its graph
capture are the eager step's; ``{"mode": "reduce-overhead"}`` gives Inductor's own CUDA graphs).

Per-layer observer events (``on_layer_forward`` / ``on_layer_backward``): only when an observer
implements one of them does the step record history (``forward_record``) and send one event per
layer; otherwise steps 1 and 4 stay the lean ``forward_saved`` / ``backward_saved`` pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import math

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..engine.config import check_factory_lr, check_optimizer_params
from ..engine.guards import state_tensors
from ..engine.losses import check_target, kernel_module, loss_and_grad
from ..engine.method import Method, all_finite, register_method
from ..engine.types import StepOutput, StepStatus
from ..observers.base import ObserverList
from ..kernels._update import coalesce
from ..optim.optimizers import SGD, AdamW, FusedOptimizer, flatten_optimizer_, make_optimizer

__all__ = ["Backprop", "LossScaler"]

_AUTOGRAD = object()  # the "saved" state of a compiled forward: its output carries the autograd graph

def _global_step_hooks() -> bool:
    """Whether any optimizer step hook is registered globally (``register_optimizer_step_*_hook``)."""
    from torch.optim import optimizer as torch_optimizer

    return bool(getattr(torch_optimizer, "_global_optimizer_pre_hooks", None) or getattr(torch_optimizer, "_global_optimizer_post_hooks", None))


class LossScaler:
    """Dynamic loss scaling for ``precision="16-mixed"`` (the rule of ``torch.amp.GradScaler``): the
    output gradient is multiplied by ``scale`` before the backward (so small float16 gradients do not
    flush to zero), the parameter gradients are divided by it after; a step whose gradients came out
    non-finite is skipped and halves the scale, and every ``interval`` finite steps in a row double
    it. ``scale`` and the count are 0-d device tensors updated with ``torch.where``: no host read, so
    the device step stays capturable.

    Args: ``device``; ``init`` (2¹⁶), ``growth`` (2), ``backoff`` (0.5), ``interval`` (2000)."""

    def __init__(self, device: torch.device, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000) -> None:
        self.scale = torch.full((), init, dtype=torch.float32, device=device)
        self.good = torch.zeros((), dtype=torch.float32, device=device)
        self.growth, self.backoff, self.interval = growth, backoff, interval

    def scale_grad(self, grad: Tensor) -> Tensor:
        return grad * self.scale.to(grad.dtype)

    def unscale_(self, grads: Sequence[Tensor]) -> None:
        inv = self.scale.reciprocal()
        for g in grads:
            g.mul_(inv.to(g.dtype))

    def update_(self, overflow: Tensor) -> None:
        overflow = overflow.to(self.scale.device)
        good = torch.where(overflow, 0.0, self.good + 1.0)
        grow = good >= self.interval
        self.scale.copy_(torch.where(overflow, self.scale * self.backoff, torch.where(grow, self.scale * self.growth, self.scale)))
        self.good.copy_(torch.where(grow, 0.0, good))

    def state_dict(self) -> dict[str, Tensor]:
        return {"scale": self.scale.clone(), "good": self.good.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.scale.copy_(state["scale"])
        self.good.copy_(state["good"])


class Backprop(Method):
    """Backpropagation: exact gradients through the layers' hand-written backward, any optimizer.

    Its settings are the engine's: ``TrainingConfig``'s ``optimizer``, ``learning_rate`` (``None``,
    not set: 0.01 for an optimizer given by name), ``loss_type``, ``gradient_clip`` / ``clip_mode``
    and ``precision`` (``"16-mixed"`` adds dynamic loss scaling).

    **A rule of your own on the same machinery.** A subclass that overrides ``backward(grad_out,
    saved)`` (the parameter gradients, aligned with the trainable parameters, from the loss gradient
    at the output and the forward's saved state) keeps everything else: the optimizer, clipping,
    guards, data-parallel averaging and the CUDA device path (when its ``backward`` reads nothing on
    the host). Feedback alignment and sign symmetry are such rules (``examples/08_custom_method.py``).
    A subclass that sets ``backward_out = True`` takes ``backward(grad_out, saved, out=...)``: the
    device step's gradient buffers to write into (aligned with ``model.parameters()``), saving a copy.
    """

    name = "backprop"
    uses_optimizer = True
    multi_input = True  # batches ((x1, x2, ...), y) for a module taking several inputs
    custom_loss = True  # TrainingConfig.loss_fn
    accumulates = True  # TrainingConfig.accumulate_grad_batches
    compiles = True  # TrainingConfig.compile: the step differentiates the model with autograd
    update_pending = False  # an accumulating step that has not updated yet (the engine's schedule waits)
    # a subclass's ``backward(grad_out, saved, out=...)`` takes the flat ``.grad`` views to write into
    # (aligned with ``model.parameters()``, None for frozen ones): the device step then copies nothing
    backward_out = False

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        config, model = self.training, self.model
        all_params = list(model.parameters())
        # frozen parameters (requires_grad=False) are never updated: only the others reach the optimizer
        self._trainable = [p.requires_grad for p in all_params]
        self.params = [p for p in all_params if p.requires_grad]
        if not self.params:
            raise ValueError("model: every parameter has requires_grad=False; nothing to train")
        self.loss_type = config.loss_type
        self.loss_fn = getattr(config, "loss_fn", None)
        self.accumulate = getattr(config, "accumulate_grad_batches", 1)
        self._acc: list[Tensor] | None = None  # gradients summed over the batches of an accumulation
        self._acc_count = 0
        self._acc_epoch = -1
        self.update_pending = False
        if isinstance(config.optimizer, Optimizer):
            check_optimizer_params(config.optimizer, model)
        self.optimizer = make_optimizer(config.optimizer, self.params, config.optimizer_rate(), config.optimizer_options)
        if not isinstance(config.optimizer, (str, Optimizer)):  # a factory's: over the model's parameters, at the rate asked
            check_optimizer_params(self.optimizer, model)
            check_factory_lr(config, self.optimizer)
        self._owns_optimizer = not isinstance(config.optimizer, Optimizer)
        self._value_clip_in_optimizer = False
        if self.clip > 0 and config.clip_mode == "value" and self._owns_optimizer and "clip_value" in self.optimizer.defaults:
            for group in self.optimizer.param_groups:  # fused into the update pass
                group["clip_value"] = self.clip
            self._value_clip_in_optimizer = True
        if self.device.type == "cuda" and self._owns_optimizer and "capturable" in self.optimizer.defaults:
            for group in self.optimizer.param_groups:  # step counts on the device: graph-capturable
                group["capturable"] = True
        self.loss_scaler = LossScaler(self.device) if config.precision == "16-mixed" else None
        self._exact_backward = type(self).backward is Backprop.backward
        self.compiled_model = self._compile(config)
        if self.device.type == "cuda" and config.cuda_graph and (self.loss_fn is not None or self.accumulate > 1):
            raise ValueError(
                "TrainingConfig(cuda_graph=True) cannot be honoured with loss_fn or accumulate_grad_batches > 1 "
                "(their steps run on the host loop); leave cuda_graph at None"
            )
        if self.device.type == "cuda" and config.cuda_graph and not self.device_ready():
            raise ValueError(
                "TrainingConfig(cuda_graph=True) needs one of torchloom's optimizers (AdamW with "
                f"capturable=True), got {type(self.optimizer).__name__}"
            )

    def _compile(self, config: Any) -> Any:
        """``torch.compile`` of the model for ``TrainingConfig.compile`` (``None`` when off): a wrapper
        (``OptimizedModule``) over the model, which itself stays as it is. ``ValueError`` for a subclass
        with its own ``backward`` (the compiled step differentiates the model with autograd) and with
        per-layer observer events (they come from the eager step's layer-by-layer forward)."""
        spec = getattr(config, "compile", False)
        if spec is False:
            return None
        if not self._exact_backward:
            raise ValueError(
                f"TrainingConfig: compile cannot be used with {type(self).__name__}: it overrides backward(), and a "
                "compiled step differentiates the model with autograd (the layers' hand-written backward); leave compile=False"
            )
        wanted = [h for h in ("on_layer_forward", "on_layer_backward") if ObserverList(config.observers).wants(h)]
        if wanted:
            raise ValueError(
                f"TrainingConfig: compile cannot send per-layer observer events ({' / '.join(wanted)}): they come from the "
                "eager step's layer-by-layer forward; leave compile=False or drop those observers"
            )
        return torch.compile(self.model, **({} if spec is True else spec))

    def backward(self, grad_out: Tensor, saved: Any) -> Sequence[Tensor]:
        """The parameter gradients (one per trainable parameter, in ``model.parameters()`` order) from
        the loss gradient ``grad_out`` at the output ``[batch, ...]`` and the forward's ``saved``
        state (``Network.forward_saved``'s, one entry per layer). Backprop: the exact hand-written
        backward. Override it to assign credit another way."""
        _, grads = self.model.backward_saved(grad_out, saved, needs_input_grad=False)
        return grads

    @torch.no_grad()
    def update_direction(self, x: Tensor, y: Tensor) -> list[Tensor]:
        """The gradients this rule's ``backward`` gives on ``(x, y)`` (before the optimizer), one per
        trainable parameter; nothing changes (no metrics, no update). Data-parallel: this rank's shard's
        (the engine averages them)."""
        out, saved = self.model.forward_saved(x)
        _, grad = self._loss_and_grad(out, y)
        grads = tuple(self.backward(grad, saved))
        if len(grads) != len(self.params):
            grads = tuple(g for g, keep in zip(grads, self._trainable) if keep)
        return list(grads)

    def schedulable(self) -> Optimizer:
        return self.optimizer

    def state_tensors(self) -> list[Tensor]:
        return state_tensors(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.optimizer.load_state_dict(state["optimizer"])

    # ------------------------------------------------------------ device path
    def device_ready(self) -> bool:
        """True with one of torchloom's optimizers, whose update takes ``found_inf`` / ``grad_scale``
        tensors and never reads them on the host (AdamW only with ``capturable=True``); never with a
        ``loss_fn``, gradient accumulation or a model of several inputs (host steps)."""
        if self.loss_fn is not None or self.accumulate > 1 or self.engine.__dict__.get("multi_input", False):
            return False
        if self.compiled_model is not None:  # compiled steps run the host loop
            return False
        if isinstance(self.optimizer, AdamW):
            return all(g["capturable"] for g in self.optimizer.param_groups)
        return isinstance(self.optimizer, FusedOptimizer)

    def device_kernel_modules(self) -> list[str]:
        own = [getattr(self.optimizer, "kernel_module", ""), kernel_module(self.loss_type)]
        return [m for m in own if m]

    def device_setup(self, runner: Any) -> None:
        """Parameters, gradients and optimizer state back to back, one buffer per param group, so
        the gradient norm and the update are one launch per group (``flatten_optimizer_``). Each
        step's gradients land in the fixed ``.grad`` views (Dense writes them there; others are
        copied in one launch)."""
        flatten_optimizer_(self.optimizer)
        for p in self.params:  # parameters the optimizer does not update still need a gradient home
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._loss_slot = self._reduce_prefix = None
        grads = [p.grad for p in self.params]
        if self.dist is not None and all(g.dtype == grads[0].dtype and g.device == grads[0].device for g in grads):
            # data-parallel: the gradients and a slot for the loss in one buffer, averaged by one all-reduce
            n = sum(g.numel() for g in grads)
            pad = -n % 4  # the slot 16-byte aligned
            buffer = torch.zeros(n + pad + 4, dtype=grads[0].dtype, device=grads[0].device)
            offset = 0
            for p, g in zip(self.params, grads):
                p.grad = buffer[offset : offset + g.numel()].view_as(g).copy_(g)
                offset += g.numel()
            self._loss_slot, self._reduce_prefix = buffer[n + pad : n + pad + 1], buffer[: n + pad + 1]
        self.grad_views = [p.grad for p in self.params]
        norm_inputs = []
        for group in self.optimizer.param_groups:
            grads = [p.grad for p in group["params"]]
            flat = coalesce(grads)
            norm_inputs.extend(flat[0] if flat is not None else grads)
        in_groups = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        norm_inputs.extend(p.grad for p in self.params if id(p) not in in_groups)
        self.norm_inputs = norm_inputs
        self._all_in_groups = all(id(p) in in_groups for p in self.params)
        # the look-ahead flags values an update would make non-finite, which covers every non-finite
        # value only while all start finite (each update it lets through keeps them so): checked once
        # here (one host read, before any capture; every rank holds the same weights and state)
        state = [t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, Tensor) and t.is_floating_point()]
        self._start_finite = bool(torch.stack([torch.isfinite(t).all() for t in [*self.params, *state]]).all())

    def device_epoch_begin(self, runner: Any, epoch: int) -> None:
        if epoch == 1:  # state the first epoch created lazily (momentum, moments) joins the layout
            # data-parallel: the gradients live in the one all-reduce buffer (``grad_views``) in parameter
            # order; re-homing them per param group would leave the step writing views the optimizer no
            # longer reads (two interleaved groups: the updates froze at epoch 0's last gradients)
            flatten_optimizer_(self.optimizer, grads=self._reduce_prefix is None)

    def guarded_device_tensors(self) -> list[Tensor]:
        """What an update changes, as few tensors as the flat layout allows: per param group its
        parameter buffer and one buffer per kind of state (momentum, moments, step counts). Cached
        while the layout and the optimizer's state entries stay the same (every step asks)."""
        opt = self.optimizer
        key = (len(opt.state), sum(len(st) for st in opt.state.values()), self.params[0].data_ptr(),
               tuple(id(v) for st in list(opt.state.values())[:1] for v in st.values()))
        cached = self.__dict__.get("_guard_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        tensors = self._guarded_device_tensors()
        self._guard_cache = (key, tensors)
        return tensors

    def _guarded_device_tensors(self) -> list[Tensor]:
        out: list[Tensor] = []
        for group in self.optimizer.param_groups:
            params = list(group["params"])
            flat = coalesce(params)
            out.extend(flat[0] if flat is not None else params)
            states = [self.optimizer.state.get(p, {}) for p in params]
            keys = {k for st in states for k, v in st.items() if isinstance(v, Tensor) and v.is_floating_point()}
            for k in sorted(keys):
                tensors = [st[k] for st in states if k in st]
                shared = list({id(v): v for v in tensors}.values())
                flat = coalesce(shared) if len(shared) == len(params) else None
                out.extend(flat[0] if flat is not None else shared)
        return out

    @torch.no_grad()
    def device_step(self, x: Tensor, y: Tensor, slot: int, runner: Any) -> None:
        """One guarded step writing its loss and status into ``slot``; no host read:

        forward; fused loss (per-block partial sums) and output gradient; the hand-written backward
        into the flat ``.grad`` views; their partial sums of squares; the step guard (NaN/Inf loss or
        gradient, clip scale) on the device; the fused update masked by ``found_inf``; the weight
        check after it (``runner.guard_update``), or, with SGD (``_can_probe``), before it: the
        squares and the check of the update's values in one pass (``SGD.probe``)."""
        from ..kernels.grad_norm import grad_sq_partials  # (imported on first use: it imports Triton)

        out, saved = self.model.forward_saved(x)
        self.observe_outputs(out, y)  # training metrics, if any (their steps are not graph-captured)
        loss_parts, grad = loss_and_grad(out, y, self.loss_type, validate=False, unreduced=True)
        scaler = self.loss_scaler
        if scaler is not None:  # float16: the backward runs on the loss scaled up, unscaled below
            grad = scaler.scale_grad(grad)
        overlapped = self._exact_backward and self.dist is not None and self.dist.overlap_pays(self.grad_views)
        loss_reduced = None
        if overlapped and self._loss_slot is not None:  # the loss's average starts now, hidden behind the backward
            torch.sum(loss_parts, 0, keepdim=True, dtype=self._loss_slot.dtype, out=self._loss_slot)
            loss_reduced = self.dist.all_reduce_([self._loss_slot], "mean", async_op=True)
        if not self._exact_backward:  # a rule of a subclass's (feedback alignment, ...)
            grads = tuple(self.backward(grad, saved, out=self._grad_out()) if self.backward_out else self.backward(grad, saved))
        elif overlapped:  # data-parallel, large model: each layer's gradients averaged while the layers below run
            _, grads = self.dist.backward_overlapped(self.model, grad, saved, self._grad_out(), "mean")
        else:
            _, grads = self.model.backward_saved(grad, saved, needs_input_grad=False, out=self._grad_out())
        if len(grads) != len(self.params):
            grads = tuple(g for g, keep in zip(grads, self._trainable) if keep)
        moved = [(v, g) for v, g in zip(self.grad_views, grads) if g.data_ptr() != v.data_ptr()]
        if moved:
            torch._foreach_copy_([v for v, _ in moved], [g for _, g in moved])
        if loss_reduced is not None:  # overlapped: the loss was sent before the backward
            loss_reduced()
            loss_parts = self._loss_slot
        elif self.dist is not None and self._loss_slot is not None:  # data-parallel: gradients and loss averaged, one all-reduce
            held = self._loss_slot
            torch.sum(loss_parts, 0, keepdim=True, dtype=held.dtype, out=held)
            self.dist.all_reduce_([self._reduce_prefix], "mean")
            loss_parts = held
        elif self.dist is not None:  # gradients of several dtypes or devices: reduced apart from the loss
            if not overlapped:
                self.dist.all_reduce_(self.grad_views, "mean")
            self.dist.all_reduce_([loss_parts], "mean")
        if scaler is not None:
            scaler.unscale_(self.grad_views)
        if self._can_probe():  # one pass: the gradients' squares and the update's values checked ahead
            runner.decide(slot, loss_parts, self.optimizer.probe(runner.update_flag), 0.0, update_flag=runner.update_flag)
            if scaler is not None:  # an overflow in the scaled backward (status 2) halves the scale
                scaler.update_(runner.step_status[slot, 0] == 2)
            with runner.guard_update(slot, checked=True):
                self.optimizer_update(found_inf=runner.found_inf)
            return
        clip_norm = self.clip if self.clip_mode == "norm" else 0.0
        runner.decide(slot, loss_parts, grad_sq_partials(self.norm_inputs), clip_norm)
        if scaler is not None:  # an overflow in the scaled backward (status 2) halves the scale
            scaler.update_(runner.step_status[slot, 0] == 2)
        if self.clip > 0 and self.clip_mode == "value" and not self._value_clip_in_optimizer:
            torch._foreach_clamp_min_(self.grad_views, -self.clip)
            torch._foreach_clamp_max_(self.grad_views, self.clip)
        with runner.guard_update(slot):
            self.optimizer_update(grad_scale=runner.grad_scale if clip_norm > 0 else None, found_inf=runner.found_inf)

    def _can_probe(self) -> bool:
        """Whether the device step can check its update ahead (``SGD.probe``) instead of backing the
        weights up and checking them after: torchloom's ``SGD`` (its own ``update`` and ``step``, no
        step hooks, which could change what the update reads), no clip by norm (its scale needs the
        gradients' norm before the look-ahead) nor a value clip outside the optimizer, and every
        trainable parameter in its groups (the probe's squares then cover every gradient), and every
        weight and state value finite when the run's device step was set up (a weight already NaN/Inf
        makes every step ``NAN_WEIGHTS``, as on the host path: the backed-up guard sees it)."""
        opt = self.optimizer
        if not self.__dict__.get("_start_finite", False):
            return False
        if type(opt) is not SGD and (type(opt).update is not SGD.update or type(opt).step is not FusedOptimizer.step):
            return False
        if self.clip > 0 and (self.clip_mode != "value" or not self._value_clip_in_optimizer):
            return False
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_step_hooks():
            return False
        return self.__dict__.get("_all_in_groups", False)

    def _grad_out(self) -> list[Tensor | None] | None:
        """``out=`` buffers for the backward, aligned with ``model.parameters()`` (None for frozen ones)."""
        if all(self._trainable):
            return self.grad_views
        views = iter(self.grad_views)
        return [next(views) if keep else None for keep in self._trainable]

    # --------------------------------------------------------------- batches
    def convert_batch(self, x: Any, y: Any, index: int) -> tuple[Tensor, Tensor]:
        """Move one batch to the device and dtype of the model and check it against the model's
        output shape (a forward without update, once per distinct input shape) and ``loss_type``."""
        where = f"batch {index}: "
        x, y, out_shape = self.engine.prepare_batch(x, y, where)
        if self.loss_fn is not None:  # the user's loss decides what a target is
            return x, y
        try:
            check_target(out_shape, y, self.loss_type)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
        return x, y

    def eval_loss_type(self) -> Any:
        """``val_loss`` reports the training loss: ``loss_fn`` when given, else ``loss_type``."""
        return self.loss_fn if self.loss_fn is not None else self.loss_type

    def _loss_and_grad(self, out: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The batch's loss (0-d) and its gradient with respect to ``out``: the named loss's fused
        pass, or ``loss_fn`` differentiated by autograd."""
        if self.loss_fn is None:
            return loss_and_grad(out, y, self.loss_type, validate=False)
        with torch.enable_grad():
            o = out.detach().requires_grad_(True)
            loss = self.loss_fn(o, y)
            name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(
                    f"loss_fn {name!r} returned {got}; it must return a one-element tensor (the batch's mean "
                    "loss, e.g. reduction='mean') computed from the output"
                )
            if not loss.requires_grad:
                raise ValueError(f"loss_fn {name!r} returned a tensor that does not depend on the model's output (no gradient)")
            (grad,) = torch.autograd.grad(loss.reshape(()), o, allow_unused=True)
        return loss.detach().reshape(()), torch.zeros_like(out) if grad is None else grad

    def _accumulated(self, grads: Sequence[Tensor]) -> Sequence[Tensor] | None:
        """With ``accumulate_grad_batches`` = k > 1: add this batch's gradients to the group's sum;
        the group's mean once it holds k batches or the epoch's last batch came, else ``None`` (no
        update yet)."""
        epoch = self.engine.epoch
        if self._acc is None or self._acc_epoch != epoch:  # an abandoned epoch's group is dropped
            self._acc, self._acc_count, self._acc_epoch = [g.clone() for g in grads], 0, epoch
        else:
            torch._foreach_add_(self._acc, list(grads))
        self._acc_count += 1
        if self._acc_count < self.accumulate and not self.engine.__dict__.get("last_batch", False):
            self.update_pending = True
            return None
        mean = torch._foreach_div(self._acc, float(self._acc_count))
        self._acc, self._acc_count, self.update_pending = None, 0, False
        return mean

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor) -> StepOutput:
        """One host-checked step (steps 1-7 of the module docstring; the engine steps the schedule)."""
        if self.compiled_model is not None:  # forward and backward through torch.compile
            if self.device.type == "cuda":  # a new step: Inductor's CUDA graphs (mode="reduce-overhead") may reuse the last one's outputs
                torch.compiler.cudagraph_mark_step_begin()
            with torch.enable_grad():
                out = self.compiled_model(x)
            return self._step_after_forward(out, _AUTOGRAD, y, None)
        events = self.layer_events()  # None unless an observer wants per-layer events
        if events is None:
            out, saved = self.model.forward_saved(x)
        else:
            out = events.run_forward(self.model, x)
            saved = tuple(record.saved for record in self.model.history)
        return self._step_after_forward(out, saved, y, events)

    @torch.no_grad()
    def step_from_forward(self, x: Tensor, y: Tensor, out: Tensor, saved: Any) -> StepOutput:
        """Steps 2-7 on the forward the caller ran at the current weights (``Network.forward_saved``'s
        ``out, saved`` for ``x``); with per-layer observer events, the whole ``step`` instead."""
        events = self.layer_events()
        if events is not None:  # the events come from a recorded forward
            return self.step(x, y)
        return self._step_after_forward(out, saved, y, None)

    def _step_after_forward(self, out: Tensor, saved: Any, y: Tensor, events: Any) -> StepOutput:
        graph_out, out = (out, out.detach()) if saved is _AUTOGRAD else (None, out)
        loss_t, grad = self._loss_and_grad(out, y)
        scaler = self.loss_scaler
        if scaler is not None:  # float16: the backward runs on the loss scaled up, unscaled after
            grad = scaler.scale_grad(grad)
        if self.dist is not None:  # data-parallel: the global batch's loss (mean over equal shards), agreed
            self.dist.all_reduce_([loss_t], "mean")
        loss = float(loss_t)
        if not math.isfinite(loss):
            return StepOutput(loss, StepStatus.NAN_LOSS)
        self.observe_outputs(out, y)  # training metrics, if any: batches whose loss counted
        if graph_out is not None:  # the compiled backward, through autograd
            grads = self._autograd_grads(graph_out, grad)
        elif not self._exact_backward:  # a rule of a subclass's: no per-layer backward events
            grads = tuple(self.backward(grad, saved))
        elif events is None:
            _, grads = self.model.backward_saved(grad, saved, needs_input_grad=False)
        else:
            grads = events.run_backward(self.model, grad)
        if len(grads) != len(self.params):  # frozen parameters get no gradient and no update
            grads = tuple(g for g, keep in zip(grads, self._trainable) if keep)
        if self.dist is not None:  # data-parallel: the global batch's gradients; a NaN on one rank reaches all
            self.dist.all_reduce_(grads, "mean")
        if scaler is not None:
            scaler.unscale_(grads)
        finite = all_finite(grads)
        if scaler is not None:
            scaler.update_(torch.tensor(not finite))
        if not finite:
            return StepOutput(loss, StepStatus.NAN_GRAD)
        if self.accumulate > 1:
            grads = self._accumulated(grads)
            if grads is None:  # the group is not complete: no update yet
                return StepOutput(loss)
        for p, g in zip(self.params, grads):
            p.grad = g
        self._clip(grads)
        self.optimizer_update()  # the loop checks the weights after it (UpdateGuard)
        return StepOutput(loss)

    def _autograd_grads(self, out: Tensor, grad: Tensor) -> tuple[Tensor, ...]:
        """The trainable parameters' gradients of ``Σ out·grad`` by autograd (the compiled backward
        graph): zeros for a parameter the output does not depend on, as the hand-written backward gives."""
        with torch.enable_grad():
            grads = torch.autograd.grad(out, self.params, grad.to(out.dtype), allow_unused=True)
        return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads))

    def optimizer_update(self, **guards: Tensor | None) -> None:
        """``optimizer.step(**guards)``; for an optimizer ``train()`` made itself, with no step hooks
        and no schedule wrapping its ``step``, the update is called directly (``update()``), which
        skips torch's profiler record around ``step`` (about 60 µs a step on one CPU core)."""
        opt = self.optimizer
        direct = self._owns_optimizer and self.engine.scheduler is None and isinstance(opt, FusedOptimizer)
        if direct and not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_step_hooks()):
            opt.update(**guards)
        else:
            opt.step(**guards)

    def _clip(self, grads: Sequence[Tensor]) -> None:
        if self.clip <= 0 or self._value_clip_in_optimizer:
            return
        if self.clip_mode == "value":
            for g in grads:
                g.clamp_(-self.clip, self.clip)
        else:
            from ..kernels.grad_norm import clip_grad_norm_

            clip_grad_norm_(list(grads), self.clip)


register_method(Backprop)
