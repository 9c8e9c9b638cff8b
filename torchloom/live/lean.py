"""The live loop's lean host step: backprop's serve forward and SGD update of a Dense chain, in the
fewest torch ops (CPU).

For a net as small as Welvet's adaptv2 (Dense 8→32→64→64→64→32→4) one sample's arithmetic is a
few microseconds; what a step costs on the CPU is the number of torch calls and the Python around
them (each call ~2–5 µs on one core). ``Backprop.step_from_forward`` with the engine's weight guard
around it makes ~75 torch calls per sample (the loss in float64, a finite check of the gradients,
the optimizer's argument checks, the guard's copy and check of the weights). ``LeanDense`` runs the
same update in ~27:

* ``forward(x)``: per layer ``addmm(b, h, Wᵀ)`` and the activation, keeping each layer's output
  (the serve forward; its outputs are what the update reuses);
* ``step(acts, target)``: the MSE gradient ``2(o − y)/N``; per layer, last first, the activation's
  backward from its output (``tanh_backward``, ``sigmoid_backward``, ``threshold_backward``) written
  straight into the bias gradient's slot (batch 1), ``dW = gᵀh`` into the weight gradient's slot,
  ``g W`` for the layer below; then the new weights ``w − lr·g`` of the one flat parameter buffer
  into a scratch buffer, **one** host read (their sum: finite exactly when every new weight is, and a
  non-finite loss or gradient always makes a new weight non-finite), and one copy back. When the sum
  is not finite the weights are left as they were and the cause is found the method's way, in its
  order: a non-finite loss (float64, as ``mse_loss_grad_ref``) is ``NAN_LOSS``, non-finite gradients
  ``NAN_GRAD``, otherwise the update overflowed: ``NAN_WEIGHTS`` (the guard's undo).

It is backprop's step (``Backprop._step_after_forward``) with its optimizer's update (``sgd_ref``)
and the engine's ``UpdateGuard``, op for op where they compute (the same ``addmm`` / ``mm``, the same
``w + (−lr)·g``), so the weights and statuses are the method's: the tests check them against the
method's own step and against autograd. It is used only where that holds (``LeanDense.why_not``):
the method is ``Backprop`` itself (not a subclass with another rule), MSE, the engine's own SGD without
momentum, weight decay, clipping, hooks or a schedule, float32 on the CPU, no loss scaling, no
data-parallel run, no metrics or per-layer observers, and a ``Network`` of ``Dense`` layers with
linear, tanh, sigmoid or ReLU activations whose trainable parameters are one flat buffer.
Elsewhere the live loop calls the method's step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..engine.types import StepStatus

__all__ = ["LeanDense"]

_ACTIVATIONS = ("linear", "tanh", "sigmoid", "relu")


def _flat_buffer(params: list[Tensor]) -> Tensor | None:
    """The one buffer ``params`` are consecutive views of, in order and whole, or ``None``."""
    if not params:
        return None
    base = params[0]
    start = base.data_ptr()
    size = base.element_size()
    offset = 0
    for p in params:
        if not p.is_contiguous() or p.dtype != base.dtype or p.data_ptr() != start + offset * size:
            return None
        offset += p.numel()
    storage = base.untyped_storage()
    if base.storage_offset() != 0 or storage.nbytes() != offset * size:
        return None
    return torch.empty(0, dtype=base.dtype, device=base.device).set_(storage, 0, (offset,), (1,))


def _relu_backward(g: Tensor, y: Tensor) -> Tensor:
    return torch.ops.aten.threshold_backward.default(g, y, 0)


# activation → (g ⊙ f'(pre) from the output y, its form writing into grad_input= (None: copy))
_BACKWARD = {
    "tanh": (torch.ops.aten.tanh_backward.default, torch.ops.aten.tanh_backward.grad_input),
    "sigmoid": (torch.ops.aten.sigmoid_backward.default, torch.ops.aten.sigmoid_backward.grad_input),
    "relu": (_relu_backward, None),
}


def _act_backward(op: tuple[Any, Any], g: Tensor, y: Tensor, out: Tensor | None) -> Tensor:
    """``g ⊙ f'(pre)`` from the layer's output ``y``, into ``out`` when given."""
    if out is None:
        return op[0](g, y)
    if op[1] is None:
        return out.copy_(op[0](g, y))
    return op[1](g, y, grad_input=out)


class LeanDense:
    """Lean serve forward and SGD step for a ``LiveTrainer`` (see the module docstring). Build it with
    ``LeanDense.build(live)``, which returns ``None`` where it does not apply."""

    def __init__(self, live: Any, layers: list[Any], flat: Tensor) -> None:
        self.live = live
        self.method = live.method
        self.optimizer = live.method.optimizer
        self.flat = flat
        self.scratch = torch.empty_like(flat)
        self.grad = torch.zeros_like(flat)
        self.layers = layers
        self.acts = [layer.activation.name for layer in layers]
        self.in_features = layers[0].in_features
        self.weights_t: list[Tensor] = []
        self.weights: list[Tensor] = []
        self.biases: list[Tensor | None] = []
        self.grad_w: list[Tensor] = []
        self.grad_b: list[Tensor | None] = []
        self.grad_b_row: list[Tensor | None] = []  # the bias gradient as a [1, out] row (batch 1 writes into it)
        at = 0
        for layer in layers:
            w = layer.weight
            self.weights.append(w)
            self.weights_t.append(w.t())
            self.grad_w.append(self.grad[at : at + w.numel()].view(w.shape))
            at += w.numel()
            if layer.bias is not None:
                b = layer.bias
                self.biases.append(b)
                gb = self.grad[at : at + b.numel()]
                self.grad_b.append(gb)
                self.grad_b_row.append(gb.view(1, -1))
                at += b.numel()
            else:
                self.biases.append(None)
                self.grad_b.append(None)
                self.grad_b_row.append(None)
        self.key = self._key()
        # each layer's activation backward from its output: (op(g, y), its out= form), or None (linear)
        self._backward = [_BACKWARD.get(name) for name in self.acts]
        from torch.optim import optimizer as torch_optimizer

        self._torch_optimizer = torch_optimizer  # its global step hooks, read every step

    # ------------------------------------------------------------------ when it applies
    @staticmethod
    def why_not(live: Any, any_device: bool = False) -> str | None:
        """``None`` when the lean step applies to ``live`` (a ``LiveTrainer``) as it is now, else why
        not. ``any_device``: the same rule off the CPU (the fused stream window, ``device.py``)."""
        from ..layers.dense import Dense
        from ..layers.network import Sequential
        from ..methods.backprop import Backprop
        from ..optim.optimizers import SGD

        method, engine = live.method, live.engine
        if live.device.type != "cpu" and not any_device:
            return "not on the CPU"
        if type(method) is not Backprop:
            return f"method {type(method).__name__} is not Backprop"
        if method.loss_type != "mse" or method.loss_fn is not None:
            return f"loss {method.loss_type!r} is not 'mse'"
        if method.accumulate != 1 or method.loss_scaler is not None or method.dist is not None or method.clip > 0:
            return "gradient accumulation, loss scaling, data-parallel training or clipping"
        if engine.scheduler is not None or engine.__dict__.get("lowbit") is not None or engine.__dict__.get("metric_set") is not None:
            return "a schedule, low-bit weights or training metrics"
        if engine.training.precision != "32" or method.layer_events() is not None:
            return "mixed precision or per-layer observers"
        opt = method.optimizer
        if type(opt) is not SGD or not method._owns_optimizer or len(opt.param_groups) != 1:
            return "not the engine's own SGD with one param group"
        model = live.model
        if not isinstance(model, Sequential) or any(not isinstance(layer, Dense) for layer in model.layers):
            return "the model is not a chain of Dense layers"
        layers = list(model.layers)
        if any(layer.activation.name not in _ACTIVATIONS for layer in layers):
            return f"an activation other than {', '.join(_ACTIVATIONS)}"
        params = list(model.parameters())
        if any(not p.requires_grad or p.dtype != torch.float32 for p in params):
            return "a frozen or non-float32 parameter"
        if list(opt.param_groups[0]["params"]) != params and [id(p) for p in opt.param_groups[0]["params"]] != [id(p) for p in params]:
            return "the optimizer does not hold exactly the model's parameters"
        if _flat_buffer(params) is None:
            return "the parameters are not one flat buffer"
        return None

    @classmethod
    def build(cls, live: Any, any_device: bool = False) -> "LeanDense | None":
        if cls.why_not(live, any_device) is not None:
            return None
        params = list(live.model.parameters())
        return cls(live, list(live.model.layers), _flat_buffer(params))

    def _key(self) -> list[int]:
        return [p.data_ptr() for p in self.weights]

    def ready(self) -> bool:
        """Whether the step may run now: the optimizer's settings still plain SGD at a number rate, no
        step hooks, the parameters where they were."""
        group = self.optimizer.param_groups[0]
        if group["momentum"] or group["weight_decay"] or group["clip_value"] or isinstance(group["lr"], Tensor):
            return False
        opt = self.optimizer
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
            return False
        hooks = self._torch_optimizer
        if getattr(hooks, "_global_optimizer_pre_hooks", None) or getattr(hooks, "_global_optimizer_post_hooks", None):
            return False
        return self._key() == self.key

    # ------------------------------------------------------------------ serve and update
    def forward(self, x: Tensor) -> tuple[Tensor, list[Tensor]] | None:
        """``(output, [x, h1, ..., output])`` for ``x [batch, in]`` (float32, CPU), the ops of
        ``Network.forward_saved``; ``None`` when ``x`` is not such an input (the caller then runs the
        model, which raises the layer's error)."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        acts = [x]
        h = x
        for wt, b, name in zip(self.weights_t, self.biases, self.acts):
            h = torch.mm(h, wt) if b is None else torch.addmm(b, h, wt)
            if name == "tanh":
                h = torch.tanh(h)
            elif name == "sigmoid":
                h = torch.sigmoid(h)
            elif name == "relu":
                h = torch.relu(h)
            acts.append(h)
        return h, acts

    def step(self, acts: list[Tensor], target: Tensor) -> StepStatus:
        """One SGD step of backprop on the sample(s) whose forward ``acts`` holds, towards ``target``
        (the output's shape); the weights change only when the status is ``OK``. Call it under
        ``torch.no_grad()`` (the live loop does)."""
        out = acts[-1]
        rows = out.shape[0]
        diff = out - target
        scale = 2.0 / diff.numel()
        last = len(self.layers) - 1
        g: Tensor = diff
        backward = self._backward
        for i in range(last, -1, -1):
            row = self.grad_b_row[i] if rows == 1 else None
            op = backward[i]
            if i == last:  # the loss gradient 2(o − y)/N, then the output layer's activation
                if op is None:
                    g = torch.mul(diff, scale, out=row) if row is not None else diff * scale
                else:
                    g = _act_backward(op, diff * scale, acts[i + 1], row)
            elif op is not None:
                g = _act_backward(op, g, acts[i + 1], row)
            elif row is not None:
                g = row.copy_(g)
            if self.grad_b[i] is not None and row is None:
                torch.sum(g, 0, out=self.grad_b[i])
            torch.mm(g.t(), acts[i], out=self.grad_w[i])
            if i > 0:
                g = torch.mm(g, self.weights[i])
        lr = self.optimizer.param_groups[0]["lr"]
        new = torch.add(self.flat, self.grad, alpha=-lr, out=self.scratch)
        if math.isfinite(float(new.sum())):
            self.flat.copy_(new)
            return StepStatus.OK
        return self._cause(diff, new)

    def _cause(self, diff: Tensor, new: Tensor) -> StepStatus:
        """The new weights' sum was not finite: why, in the method's order (nothing was changed), or
        ``OK`` (and the update made) when every new weight is finite and only their sum overflowed."""
        from ..engine.guards import finite_flag

        d64 = diff.reshape(-1).double()
        if not math.isfinite(float(torch.dot(d64, d64) / diff.numel())):
            return StepStatus.NAN_LOSS
        if not bool(finite_flag([self.grad])):
            return StepStatus.NAN_GRAD
        if bool(finite_flag([new])):
            self.flat.copy_(new)
            return StepStatus.OK
        return StepStatus.NAN_WEIGHTS
