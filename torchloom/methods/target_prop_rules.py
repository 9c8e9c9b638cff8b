"""TargetProp: Loom's target propagation (``poly`` ``tween.go``, formerly ``target_prop.go``).

Target propagation asks what every layer *should* have produced (its **backward target**) instead of
only how the loss changes with each weight. Every layer then moves its output towards its target,
with a step that depends on how well output and target agree (the **link budget**).

Functional API, as Loom's (one state object, four calls)::

    state = TargetPropState(model, TargetPropConfig())
    out = target_prop_forward(model, state, x)        # 1. forward, keep every activation
    target_prop_backward(model, state, target)         # 2. backward targets (chain rule or pure)
    state.calculate_link_budgets()                     # 3. link budgets and gaps
    apply_target_prop_gaps(model, state, lr)           # 4. gated, depth-scaled momentum update

``TargetProp`` is the method (``train(..., TrainingConfig(method="target_prop"))``): its ``step(x, y)``
does all four; ``TargetPropTrainer(model, cfg)`` is the engine with it (``.step(x, y)``,
``.fit(batches, epochs)``).

The rules, for a ``Network`` of ``L`` layers, activations ``a_0 = x, a_1 … a_L = y`` and target ``t``:

1. **Chain-rule mode** (``mode="chain_rule"``, Loom's default): ``g_L = t − y`` (the negative
   gradient of ½Σ(y−t)², no 1/N), carried back through every layer's hand-written backward
   (``g_i`` = gradient at layer i's input); ``backward_targets[i] = a_i + gradient_scale·g_i``,
   ``backward_targets[L] = t``; ``weight_gradients[i]`` = layer i's parameter gradients (the negated
   loss gradient).
2. **Pure mode** (``mode="pure"``, no derivatives between layers): ``backward_targets[L] = t``; going
   down, each layer turns the target of its output into a target for its input with a weight-based
   estimate, for every batch row (Dense, ``W [out, in]``)::

       est[b, j] = Σ_o W[o, j]·t[b, o] / Σ_o |W[o, j]|   if that denominator > 0.01, else 0

   RNN and LSTM apply it with ``weight_ih`` per time step (LSTM: the four gate blocks summed, in the
   numerator and in the denominator); MultiHeadAttention goes back through ``o_weight`` and then
   through ``v_weight`` as the query heads see it (each kv head's rows repeated for the query heads of
   its group). With ``pure_targets="difference"`` (the default; difference target propagation) the
   estimate is applied to the gap, ``t_i = a_i + est(t_{i+1} − a_{i+1})``; with ``"loom"`` (Loom's
   rule) to the target itself, ``t_i = est(t_{i+1})`` (measured: Loom's rule stays at chance on
   Fashion-MNIST at every rate, the difference rule learns; docs/target-prop.md). Any other layer passes its **input** through as the target (Loom's fallback: the
   layers below then see no gap). Update directions: Dense, ``δW = gapᵀ x`` summed over the batch,
   ``δb = Σ_b gap`` with ``gap = t_{i+1} − a_{i+1}`` (Loom's delta rule, no ``f'``); every other layer
   with parameters gets the gradient of its **own** local loss ½‖t_{i+1} − a_{i+1}‖² through its
   hand-written backward (nothing crosses a layer boundary; for a linear Dense both rules coincide).
   Loom uses ad-hoc Hebbian rules there instead (see the PARITY note below).
3. **Link budget** of layer i: ``(cos(a_{i+1}, t_{i+1}) + 1) / 2`` in [0, 1], left unchanged when
   either vector is 0 (initially 0); **gap**: ``sqrt(mean((a_{i+1} − t_{i+1})²))``.
4. **Update** of layer i: skipped when ``link_budget < gate_threshold`` (weights *and* velocity
   untouched); otherwise ``rate_i = lr·(0.5 + 0.5·budget_i)·depth_scale_factor^i`` (i counted from
   the input), ``v = μ·v + (1−μ)·rate_i·weight_gradient``, ``W += v``.

With ``momentum=0``, ``gate_threshold=0``, ``depth_scale_factor=1`` and every budget 1, chain-rule mode
is exactly SGD with rate ``lr`` on ½Σ(y−t)² (the tests check this against autograd).

Pure mode's estimates and delta-rule directions are in ``target_prop_pure.py``. They are formed in
float32 at least, with autocast off: under ``precision="bf16-mixed"`` the bfloat16 activations (and the
output, for its target) are read as float32, so a hidden gap, an estimate divided by a column sum of
``|W|``, is not rounded to 8 bits (that cost 13 points on Fashion-MNIST at batch 32). Float32 and
float64 runs are unchanged.

Departures from Loom's code (docs/PARITY.md): pure-mode estimates and updates index ``[out, in]``
weights correctly and use every batch row (Loom reads them as ``[in, out]`` and uses the first
sample); ``depth_scale_factor`` is applied (Loom never reads it); the gate threshold is a setting
(Loom hard-codes 0.2); pure-mode updates of RNN/LSTM/MHA are local-loss gradients (Loom: Hebbian rules
with fixed factors 0.5/0.25/0.1, MHA's applied to the wrong input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..engine.losses import as_float_target, label_bounds, mse_to_target
from .._settings import python_numbers, settings
from ..layers.base import autocast_off
from ..layers.network import Network
from ._auto_rate import small_batch_scale
from .target_prop_pure import _pure_direction, _work, estimate_input_target

__all__ = [
    "MODES",
    "DEFAULT_RATES",
    "REDUCTIONS",
    "PURE_TARGETS",
    "LOSSES",
    "output_target",
    "target_loss",
    "TargetPropConfig",
    "TargetPropState",
    "layer_sums",
    "target_prop_forward",
    "target_prop_backward",
    "apply_target_prop_gaps",
    "estimate_input_target",
    "check_target",
]

MODES = ("chain_rule", "pure")
# ``TargetPropConfig(learning_rate=None)``: each mode's measured rate for batches of 16 rows or more
# (bench/RESULTS.md §7 runs D and E): the chain rule at 0.1 is within a point of backprop on Fashion-MNIST,
# MNIST-1D and digits at batch 32 and 256 (0.05 misses MNIST-1D); pure mode's best is 0.05 (0.1 is unstable
# over ten epochs of Fashion-MNIST). A step of B < 16 rows moves B/16 of it (``small_batch_scale``: the
# chain rule at 0.1 collapsed online on digits, §7 run F)
DEFAULT_RATES = {"chain_rule": 0.1, "pure": 0.05}
REDUCTIONS = ("mean", "sum")
PURE_TARGETS = ("difference", "loom")  # pure mode's input targets: a_i + est(gap) (default) | est(t) (Loom's)
LOSSES = ("mse", "cross_entropy")  # the losses TargetProp can train on (the output target of each: output_target)

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ================================================================================================
# Config


@settings({"lr": "learning_rate", "rate": "learning_rate", "base_rate": "learning_rate", "chain_rule": "use_chain_rule", "loss": "loss_type"})
@dataclass
class TargetPropConfig:
    """Settings of TargetProp (Loom's ``TweenConfig`` in snake_case).

    ``use_chain_rule`` (Loom's name) and ``mode`` are one switch under two names: give either (neither:
    chain rule, Loom's default); giving both with different meanings is a ``ValueError``. Afterwards
    both are set and must stay in agreement (``dataclasses.replace`` passes both: change ``mode`` and
    ``use_chain_rule`` together, or build a new config). Every field is checked when the config is
    built; numbers may be NumPy scalars (stored as Python numbers)."""

    use_chain_rule: bool | None = None
    """Loom's switch: ``True`` = chain rule (targets from the exact gradient), ``False`` = pure
    (derivative-free targets); ``None`` = from ``mode``, else ``True``."""
    mode: str | None = None
    """``"chain_rule"`` or ``"pure"``, the same switch by name; ``None`` = from ``use_chain_rule``."""
    gradient_scale: float = 0.1
    """Chain rule: each layer's target is ``a_i + gradient_scale·g_i`` (>= 0)."""
    depth_scale_factor: float = 1.1
    """Layer ``i``'s rate is ``learning_rate·factor^i``: each deeper layer gets 1.1× the rate before it (> 0)."""
    momentum: float = 0.9
    """Momentum of the update ``v = μv + (1−μ)·rate·grad``, in [0, 1)."""
    learning_rate: float | None = None
    """The base rate (> 0). ``None`` (default): the mode's measured rate, ``0.1`` for the chain rule and
    ``0.05`` for pure mode (``DEFAULT_RATES``) at batches of 16 rows or more, ``B/16`` of it for a step of
    ``B < 16`` rows (``rate_for(B)``; the rate table of docs/target-prop.md)."""
    gate_threshold: float = 0.2
    """Layers whose link budget is below this are not updated, in [0, 1]."""
    reduction: str = "mean"
    """``"mean"``: the step averaged over the batch (one rate serves every batch size); ``"sum"``:
    Loom's summed step."""
    loss_type: str | None = None
    """The output target: ``"mse"`` (``t − y``) or ``"cross_entropy"`` (``onehot − softmax(y)``);
    ``None`` = ``TrainingConfig.loss_type`` (``"mse"`` outside ``train()``)."""
    pure_targets: str = "difference"
    """Pure mode: ``"difference"`` (``t_i = a_i + est(t_{i+1} − a_{i+1})``, the default) or ``"loom"``
    (``t_i = est(t_{i+1})``, Loom's rule)."""

    def __post_init__(self) -> None:
        python_numbers(self)
        if self.use_chain_rule is not None and not isinstance(self.use_chain_rule, bool):
            raise TypeError(f"TargetPropConfig: use_chain_rule must be a bool, got {self.use_chain_rule!r}")
        if self.mode is not None:
            mode = self.mode.lower() if isinstance(self.mode, str) else self.mode
            if mode not in MODES:
                raise ValueError(f"TargetPropConfig: unknown mode {self.mode!r}; valid: {', '.join(map(repr, MODES))}")
            if self.use_chain_rule is not None and self.use_chain_rule != (mode == "chain_rule"):
                raise ValueError(
                    f"TargetPropConfig: mode={mode!r} contradicts use_chain_rule={self.use_chain_rule!r}; give one of them"
                )
            self.mode = mode
            self.use_chain_rule = mode == "chain_rule"
        else:
            self.use_chain_rule = True if self.use_chain_rule is None else self.use_chain_rule
            self.mode = "chain_rule" if self.use_chain_rule else "pure"
        self.validate()

    @property
    def base_rate(self) -> float:
        """The rate a schedule drives: ``learning_rate``, or with ``learning_rate=None`` the mode's
        ``DEFAULT_RATES`` entry (0.1 chain rule, 0.05 pure)."""
        return float(self.learning_rate) if self.learning_rate is not None else DEFAULT_RATES[self.mode]

    def rate_for(self, batch: int) -> float:
        """The rate of a step of ``batch`` rows: ``learning_rate``, or with ``learning_rate=None`` the
        mode's rate times ``min(1, batch/16)`` (chain rule: 0.1 from 16 rows up, 0.00625 online)."""
        if self.learning_rate is not None:
            return float(self.learning_rate)
        return DEFAULT_RATES[self.mode] * small_batch_scale(batch)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` unless every field is valid. The TargetProp functions call
        this before touching any state, so a config changed after construction is checked too."""
        python_numbers(self)
        if not isinstance(self.use_chain_rule, bool):
            raise TypeError(f"TargetPropConfig: use_chain_rule must be a bool, got {self.use_chain_rule!r}")
        if self.mode not in MODES:
            raise ValueError(f"TargetPropConfig: unknown mode {self.mode!r}; valid: {', '.join(map(repr, MODES))}")
        if (self.mode == "chain_rule") != self.use_chain_rule:
            raise ValueError(
                f"TargetPropConfig: mode={self.mode!r} and use_chain_rule={self.use_chain_rule!r} disagree; "
                "set both or build a new config"
            )
        checks = (
            ("gradient_scale", self.gradient_scale, lambda v: v >= 0, ">= 0"),
            ("depth_scale_factor", self.depth_scale_factor, lambda v: v > 0, "> 0"),
            ("momentum", self.momentum, lambda v: 0 <= v < 1, "in [0, 1)"),
            *((("learning_rate", self.learning_rate, lambda v: v > 0, "> 0"),) if self.learning_rate is not None else ()),
            ("gate_threshold", self.gate_threshold, lambda v: 0 <= v <= 1, "in [0, 1]"),
        )
        for name, value, ok, allowed in checks:
            if not _is_number(value) or not ok(value):
                hint = " (or None: the mode's default, 0.1 chain rule / 0.05 pure)" if name == "learning_rate" else ""
                raise ValueError(f"TargetPropConfig: {name} must be a finite number {allowed}, got {value!r}{hint}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"TargetPropConfig: reduction must be one of {', '.join(map(repr, REDUCTIONS))} ('mean': the step averaged "
                f"over the batch; 'sum': Loom's summed step), got {self.reduction!r}"
            )
        if self.pure_targets not in PURE_TARGETS:
            raise ValueError(
                f"TargetPropConfig: pure_targets must be one of {', '.join(map(repr, PURE_TARGETS))} ('difference': each "
                "input target is the activation plus the estimate of the gap above; 'loom': the estimate of the target "
                f"above, Loom's rule), got {self.pure_targets!r}"
            )
        if self.loss_type is not None and self.loss_type not in LOSSES:
            raise ValueError(
                f"TargetPropConfig: loss_type must be None (TrainingConfig's) or one of {', '.join(map(repr, LOSSES))}, "
                f"got {self.loss_type!r} (TargetProp moves the output towards a target: Loom's probability "
                "'crossentropy' and loss callables give it none)"
            )


# ================================================================================================
# State


class TargetPropState:
    """Everything TargetProp keeps between its four calls (Loom's ``TweenState``), for a ``Network``
    of ``L`` layers. Lists indexed like Loom's:

    * ``forward_acts[0..L]``: network input, then every layer's output (``[batch, ...]`` tensors);
    * ``pre_acts[0..L]``: ``pre_acts[i+1]`` = layer i's pre-activation (``None`` without one; index 0
      unused);
    * ``backward_targets[0..L]``: what each activation should have been; ``[L]`` = the target;
      ``[0]`` (the input's) only from ``target_prop_backward``: a training step skips it (``None``),
      as no update uses it;
    * ``gradients[0..L]``: chain rule only: ``gradients[i]`` = ``g_i`` at layer i's input, ``[L] = t − y``
      (``None`` in pure mode, which takes no derivatives);
    * ``weight_gradients[0..L-1]``: per layer, a tuple aligned with ``layer.parameters()``: the update
      direction before the rate (chain rule: negated loss gradient; pure: ``gapᵀx`` or the local one);
    * ``link_budgets``, ``gaps``: one float per layer (budgets start at 0);
    * ``velocities[0..L-1]``: per layer, momentum buffers aligned with ``layer.parameters()`` (created
      at the first update);
    * ``saved``: each layer's saved forward state for its hand-written backward;
    * ``skipped_layers``: indices of the layers the gate skipped at the last update; ``steps``: updates
      applied so far.
    """

    def __init__(self, model: Network, config: TargetPropConfig | None = None) -> None:
        if not isinstance(model, Network):
            raise TypeError(f"TargetPropState: model must be a torchloom Network, got {type(model).__name__}")
        config = TargetPropConfig() if config is None else config
        if not isinstance(config, TargetPropConfig):
            raise TypeError(f"TargetPropState: config must be a TargetPropConfig, got {type(config).__name__}")
        config.validate()
        n = len(model.layers)
        self.config = config
        self.num_layers = n
        self.forward_acts: list[Tensor | None] = [None] * (n + 1)
        self.pre_acts: list[Tensor | None] = [None] * (n + 1)
        self.backward_targets: list[Tensor | None] = [None] * (n + 1)
        self.gradients: list[Tensor | None] = [None] * (n + 1)
        self.weight_gradients: list[tuple[Tensor, ...] | None] = [None] * n
        self.link_budgets: list[float] = [0.0] * n
        self.gaps: list[float] = [0.0] * n
        self.velocities: list[tuple[Tensor, ...] | None] = [None] * n
        self.saved: list[Any] = [None] * n
        self.skipped_layers: list[int] = []
        self.steps = 0
        self.rows = 0  # samples of the last forward's batch (the "mean" reduction divides by them)

    @torch.no_grad()
    def calculate_link_budgets(self, reduce: Callable[[Tensor], None] | None = None) -> None:
        """Link budget ``(cos(f, b) + 1)/2`` and gap ``sqrt(mean((f − b)²))`` of every layer, between its
        output ``f = forward_acts[i+1]`` and target ``b = backward_targets[i+1]`` over the whole batch
        (sums in float64, as Loom). A budget stays as it was when ``f`` or ``b`` is all zeros; layers
        without a target are left alone. One host sync for all layers. ``reduce`` (data-parallel
        training): sums, in place, the per-layer sums ``[layers, 5]`` (``dot(f, b)``, ``|f|²``,
        ``|b|²``, ``Σ(f − b)²``, element count) over the ranks before budgets and gaps are formed."""
        if reduce is not None:
            index = [i for i in range(self.num_layers) if self.forward_acts[i + 1] is not None and self.backward_targets[i + 1] is not None]
            if not index:
                return
            sums = torch.stack([layer_sums(self.forward_acts[i + 1], self.backward_targets[i + 1]) for i in index])
            reduce(sums)
            self.set_link_budgets(index, sums.tolist())
            return
        rows, index = [], []
        for i in range(self.num_layers):
            f, b = self.forward_acts[i + 1], self.backward_targets[i + 1]
            if f is None or b is None:
                continue
            f64, b64 = f.detach().double().reshape(-1), b.detach().double().reshape(-1)
            diff = f64 - b64
            rows.append(torch.stack([f64 @ b64, f64 @ f64, b64 @ b64, diff @ diff / max(f64.numel(), 1)]))
            index.append(i)
        if not rows:
            return
        for i, (dot, f_mag, b_mag, mean_sq) in zip(index, torch.stack(rows).tolist()):
            if f_mag > 0 and b_mag > 0:
                cosine = dot / (math.sqrt(f_mag) * math.sqrt(b_mag))
                self.link_budgets[i] = min(1.0, max(0.0, (cosine + 1.0) / 2.0))
            self.gaps[i] = math.sqrt(mean_sq)


    def measured_layers(self) -> list[int]:
        """The layers with both an output and a target (those ``calculate_link_budgets`` measures)."""
        return [i for i in range(self.num_layers) if self.forward_acts[i + 1] is not None and self.backward_targets[i + 1] is not None]

    def set_link_budgets(self, index: list[int], sums: list[list[float]]) -> None:
        """Link budgets and gaps of layers ``index`` from their ``layer_sums`` rows (summed over every
        rank's rows, in data-parallel training), as ``calculate_link_budgets`` forms them."""
        for i, (dot, f_mag, b_mag, sq, count) in zip(index, sums):
            if f_mag > 0 and b_mag > 0:
                cosine = dot / (math.sqrt(f_mag) * math.sqrt(b_mag))
                self.link_budgets[i] = min(1.0, max(0.0, (cosine + 1.0) / 2.0))
            self.gaps[i] = math.sqrt(sq / max(count, 1.0))


def layer_sums(f: Tensor, b: Tensor) -> Tensor:
    """``[dot(f, b), |f|², |b|², Σ(f − b)², count]`` of two tensors of one shape, in float64 (no host
    read): the per-layer sums TargetProp's link budget and gap are formed from."""
    f64, b64 = f.detach().double().reshape(-1), b.detach().double().reshape(-1)
    diff = f64 - b64
    count = torch.full((), float(f64.numel()), dtype=torch.float64, device=f64.device)
    return torch.stack([f64 @ b64, f64 @ f64, b64 @ b64, diff @ diff, count])


def _check_model_state(model: Any, state: Any, fn: str) -> None:
    if not isinstance(model, Network):
        raise TypeError(f"{fn}: model must be a torchloom Network, got {type(model).__name__}")
    if not isinstance(state, TargetPropState):
        raise TypeError(f"{fn}: state must be a TargetPropState, got {type(state).__name__}")
    if len(model.layers) != state.num_layers:
        raise ValueError(f"{fn}: state was built for {state.num_layers} layers, the model has {len(model.layers)}")
    state.config.validate()


# ================================================================================================
# 1. Forward


@torch.no_grad()
def target_prop_forward(model: Network, state: TargetPropState, x: Tensor) -> Tensor:
    """Run ``x [batch, ...]`` through the layers' explicit forward (no autograd graph) and keep every
    activation, pre-activation and saved backward state in ``state``. Returns the output. Targets,
    gradients and update directions of an earlier step are cleared."""
    _check_model_state(model, state, "target_prop_forward")
    if not isinstance(x, Tensor):
        raise TypeError(f"target_prop_forward: x must be a torch.Tensor, got {type(x).__name__}")
    out = model.forward_record(x)  # validates shapes layer by layer before state is touched
    history = model.history
    n = state.num_layers
    state.forward_acts = [x] + [r.output for r in history]
    state.pre_acts = [None] + [r.pre for r in history]
    state.saved = [r.saved for r in history]
    state.backward_targets = [None] * (n + 1)
    state.gradients = [None] * (n + 1)
    state.weight_gradients = [None] * n
    state.rows = int(x.shape[0])
    return out


# ================================================================================================
# 2. Backward targets


def check_target(output_shape: tuple[int, ...], target: Any, fn: str = "target") -> None:
    """Raise unless ``target`` fits an output of ``output_shape``: a float tensor of that shape, or
    integer class labels of shape ``output_shape[:-1]`` with values in ``[0, C)``, ``C = output_shape[-1]``
    (the range check reads the labels: one device sync)."""
    if not isinstance(target, Tensor):
        raise TypeError(f"{fn}: target must be a torch.Tensor, got {type(target).__name__}")
    out_shape = tuple(output_shape)
    if target.dtype in _INT_DTYPES:
        if tuple(target.shape) != out_shape[:-1]:
            raise ValueError(
                f"{fn}: class labels must have shape {list(out_shape[:-1])} for an output of shape "
                f"{list(out_shape)}, got {list(target.shape)}"
            )
        if target.numel():
            lo, hi = label_bounds(target)
            if lo < 0 or hi >= out_shape[-1]:
                raise ValueError(f"{fn}: class labels must lie in [0, {out_shape[-1]}), got values in [{lo}, {hi}]")
        return
    if not target.is_floating_point():
        raise TypeError(f"{fn}: target must be a floating tensor or integer class labels, got dtype {target.dtype}")
    if tuple(target.shape) != out_shape:
        raise ValueError(f"{fn}: target must have the output's shape {list(out_shape)}, got {list(target.shape)}")


_mse_to_target = mse_to_target  # (the name this module used)
_as_float_target = as_float_target


def output_target(output: Tensor, target: Tensor, loss_type: str = "mse") -> Tensor:
    """The output's target ``t_L`` for a checked ``target`` (labels or a float target): ``"mse"``: the
    target itself (labels one-hot), so ``g_L = t_L − y``; ``"cross_entropy"``: ``y + p − softmax(y)``
    with ``p`` the target's probabilities (labels one-hot), so that ``g_L = p − softmax(y)``, the negative
    gradient of the sample's cross-entropy (Welvet's target: MSE on a one-hot target "never leaves
    chance" for classification). No host read."""
    t = _as_float_target(output, target)
    if loss_type == "cross_entropy":
        return output + (t - torch.softmax(output, dim=-1))
    return t


def mode_output_target(config: "TargetPropConfig", output: Tensor, target: Tensor, loss_type: str = "mse") -> Tensor:
    """``output_target`` as ``config``'s mode uses it: pure mode forms it from a float32 copy of a
    half-precision output (under ``precision="bf16-mixed"`` the output is bfloat16, and its
    cross-entropy target ``y + p − softmax(y)`` rounded to bfloat16 would lose most of the gap
    ``t − y``: bfloat16 keeps 8 significant bits); chain-rule mode uses the output as it is."""
    return output_target(output if config.use_chain_rule else _work(output), target, loss_type)


def target_loss(output: Tensor, target: Tensor, loss_type: str = "mse") -> Tensor:
    """The loss TargetProp reports, a 0-d float64 tensor: ``mean((y − t)²)`` for ``"mse"`` (the
    ``"mse"`` loss of every method), the mean softmax cross-entropy for ``"cross_entropy"``."""
    if loss_type == "cross_entropy":
        t = _as_float_target(output, target).double()
        return -(t * torch.log_softmax(output.double(), dim=-1)).sum(-1).mean()
    return ((output - _as_float_target(output, target)) ** 2).mean(dtype=torch.float64)


@torch.no_grad()
def target_prop_backward(model: Network, state: TargetPropState, target: Tensor) -> None:
    """Fill ``backward_targets``, ``gradients`` (chain rule) and ``weight_gradients`` from the output's
    ``target`` (float, the output's shape, or integer class labels ``[batch]`` one-hot encoded).

    Chain rule: ``g_L = t_L − y`` (``t_L``: ``output_target`` of the config's ``loss_type``, "mse"
    when unset) through every layer's hand-written backward,
    ``backward_targets[i] = a_i + gradient_scale·g_i``. Pure: weight-based estimates layer by layer
    (``estimate_input_target``), update directions from each layer's gap. Validates everything first:
    on bad input nothing in ``state`` changes."""
    _check_model_state(model, state, "target_prop_backward")
    n = state.num_layers
    if any(a is None for a in state.forward_acts):
        raise RuntimeError("target_prop_backward: run target_prop_forward(model, state, x) first")
    acts = state.forward_acts
    check_target(tuple(acts[n].shape), target, "target_prop_backward")
    _fill_backward(model, state, mode_output_target(state.config, acts[n], target, state.config.loss_type or "mse"))


def _fill_backward(model: Network, state: TargetPropState, target: Tensor, input_target: bool = True) -> None:
    """``target_prop_backward``'s body for a checked float ``target``: no host read (the device step
    calls it too). ``input_target=False`` (the trainers' steps) skips ``backward_targets[0]``, the
    input's target, which no update uses: at a wide input it is the step's largest matrix product."""
    n = state.num_layers
    acts = state.forward_acts
    targets: list[Tensor | None] = [None] * (n + 1)
    grads: list[Tensor | None] = [None] * (n + 1)
    weight_grads: list[tuple[Tensor, ...] | None] = [None] * n
    targets[n] = target
    if state.config.use_chain_rule:
        g = target - acts[n]
        grads[n] = g
        scale = state.config.gradient_scale
        for i in range(n - 1, -1, -1):
            g, weight_grads[i] = model.layers[i].backward_saved(g, state.saved[i], needs_input_grad=input_target or i > 0)
            if g is None:  # e.g. an embedding's integer input: no signal goes further down
                break
            grads[i] = g
            targets[i] = acts[i] + scale * g
    else:
        # targets, gaps and delta-rule directions in float32 at least, with autocast off: under bf16-mixed
        # the activations are bfloat16, and a hidden gap (an estimate divided by Σ|W|) rounded to 8 bits,
        # or a target a + gap rounded before the gap is taken back out of it, loses the step's signal
        difference = state.config.pure_targets == "difference"
        with autocast_off(target.device.type):
            for i in range(n - 1, -1, -1):
                layer, t_out = model.layers[i], targets[i + 1]
                weight_grads[i] = _pure_direction(layer, acts[i], acts[i + 1], t_out, state.saved[i])
                if input_target or i > 0:
                    targets[i] = estimate_input_target(layer, t_out, acts[i], acts[i + 1] if difference else None)
    state.backward_targets, state.gradients, state.weight_gradients = targets, grads, weight_grads


# ================================================================================================
# 4. Update


@torch.no_grad()
def apply_target_prop_gaps(model: Network, state: TargetPropState, lr: float | None = None, *, rows: int | None = None) -> list[int]:
    """Update every layer from ``state.weight_gradients`` (after ``target_prop_backward`` and
    ``state.calculate_link_budgets()``); ``lr`` defaults to ``state.config.rate_for(rows)`` (its
    ``learning_rate``, or with ``learning_rate=None`` the mode's rate for a batch of ``rows`` rows).

    The directions are sums over the batch's samples; with ``reduction="mean"`` (the default) the step
    is divided by ``rows``, the number of samples they sum over (default: the last forward's batch,
    ``state.rows``; data-parallel training passes the global batch's), so one rate means the same step
    at every batch size. ``reduction="sum"`` is Loom's summed step.

    Layer i is skipped when ``link_budgets[i] < gate_threshold``; otherwise
    ``rate_i = lr·(0.5 + 0.5·budget_i)·depth_scale_factor^i`` (÷ rows for the mean), ``v = μv + (1−μ)·rate_i·direction``,
    ``p += v`` for each parameter (a parameter with ``requires_grad=False`` is left alone). Returns the indices of the layers with parameters the gate skipped
    (also kept in ``state.skipped_layers``)."""
    _check_model_state(model, state, "apply_target_prop_gaps")
    cfg = state.config
    if lr is not None and (not _is_number(lr) or lr <= 0):
        raise ValueError(f"apply_target_prop_gaps: lr must be a finite number > 0, got {lr!r}")
    rows = state.rows if rows is None else rows
    if isinstance(rows, bool) or not isinstance(rows, int) or (cfg.reduction == "mean" and rows < 1):
        raise ValueError(f"apply_target_prop_gaps: rows must be an int >= 1 (the samples the directions sum over), got {rows!r}")
    lr = cfg.rate_for(max(rows, 1)) if lr is None else lr
    layer_params = [tuple(layer.parameters()) for layer in model.layers]
    for i, params in enumerate(layer_params):
        direction = state.weight_gradients[i]
        if params and direction is not None and len(direction) != len(params):
            raise ValueError(
                f"apply_target_prop_gaps: layer {i} has {len(params)} parameters but "
                f"{len(direction)} update directions; run target_prop_backward again"
            )
    if all(d is None for p, d in zip(layer_params, state.weight_gradients) if p):
        raise RuntimeError("apply_target_prop_gaps: no update directions; run target_prop_backward first")

    mu = cfg.momentum
    skipped = []
    for i, params in enumerate(layer_params):
        direction = state.weight_gradients[i]
        if not params or direction is None:
            continue
        budget = state.link_budgets[i]
        if budget < cfg.gate_threshold:  # mesh-fidelity gate: leave the layer exactly as it is
            skipped.append(i)
            continue
        rate = lr * (0.5 + 0.5 * budget) * cfg.depth_scale_factor**i
        if cfg.reduction == "mean":
            rate /= rows
        velocity = state.velocities[i]
        if velocity is None or any(v.shape != p.shape or v.device != p.device for v, p in zip(velocity, params)):
            velocity = tuple(torch.zeros_like(p) for p in params)
            state.velocities[i] = velocity
        for p, v, d in zip(params, velocity, direction):
            if not p.requires_grad:  # frozen parameter: never updated
                continue
            v.mul_(mu).add_(d, alpha=(1.0 - mu) * rate)
            p.add_(v)
    state.skipped_layers = skipped
    state.steps += 1
    return skipped
