"""Neural Tweening: Loom's bidirectional trainer, from the ``nn`` package's ``tween.go`` and
its Tweening document.

Forward activations and backward targets meet at every layer; the trainer measures per layer how far
apart they are (gap), how much signal the layer keeps (link budget) and how well activation and
target point the same way (alignment); it updates with momentum at rates modulated by alignment and
depth, leaves already-learned samples alone, and treats a mean gap far above its running baseline as an
explosion (rate cut with a floor, momentum reset; a gap that stays at a new level is absorbed into the
baseline, so learning never freezes: ``ExplosionRule``). Watch ``state.explosion_count``,
``state.adaptive_rate``, ``state.gap_baseline`` and ``state.gap_growth_rate``.

    state = TweenState(net, TweenConfig())
    loss = state.tween_step(net, x, labels)            # one step; batch or a single sample
    result = TweenTrainer(net, TweenConfig()).fit(batches, epochs=10)   # the engine with the Tween method

Indexing (Loom's): the network has ``n`` layers; ``forward_acts[0]`` is the input ``a_0`` and
``forward_acts[i+1] = a_{i+1}`` the output of layer ``i``; ``backward_targets`` and
``chain_gradients`` use the same indices (entry 0, the network input, is ``None``: nothing learns the
input, so its gradient is never computed). ``gaps``, ``link_budgets``, ``alignments``, velocities
and ``layer_rates`` hold one entry per layer ``i``, measured at that layer's output ``a_{i+1}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..engine.config import as_network
from ..engine.guards import finite_flag
from ..engine.losses import LOSS_TYPES, compute_loss, is_label_target, label_bounds, loss_and_grad
from .._settings import python_numbers, settings
from ..engine.types import StepOutput, StepStatus
from ..layers.base import Layer
from ..layers.network import Network
from ._auto_rate import small_batch_scale
from .explosion import EXPLOSION_RULE, _FloatOps

__all__ = ["TweenConfig", "TweenState", "tween_sums", "tween_metrics", "forward_layers", "AUTO_RATE", "auto_rate"]

def _number(owner: str, name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False) -> None:
    """``ValueError`` unless ``value`` is a finite real number in the interval (bounds as named)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open or hi == math.inf else ']'}"
        raise ValueError(f"{owner}: {name} must be a finite number in {interval}, got {value!r}")


# ``TweenConfig(base_rate=None)``: 0.03 for batches of 16 rows or more (bench/RESULTS.md §7 run E: at batch
# 32 and 256 Tween at 0.03 is within a point of backprop on Fashion-MNIST, MNIST-1D and digits, where 0.01
# misses MNIST-1D), and a step of B < 16 rows moves B/16 of it (``small_batch_scale``; §7 run F)
AUTO_RATE = 0.03


def auto_rate(batch: int, rate: float = AUTO_RATE) -> float:
    """``base_rate=None``'s rate for a step of ``batch`` rows: ``rate·min(1, batch/16)`` (``rate`` = 0.03,
    or a schedule's value): 0.001875 online, 0.0075 at batch 4, 0.03 from 16 rows up."""
    return rate * small_batch_scale(batch)


@settings({"lr": "base_rate", "learning_rate": "base_rate", "rate": "base_rate", "momentum": "momentum_decay", "loss": "loss_type"})
@dataclass
class TweenConfig:
    """Settings of Neural Tweening (the Tweening document's names, snake_case, plus ``recovery_growth``,
    ``depth_scaling``, ``explosion_detection``, ``gradient_scale`` and ``loss_type``).

    ``base_rate`` is the learning rate; momentum is applied as ``v = μv − rate·g``, so the long-run
    step of a steady gradient is ``rate/(1−μ)``, ten times ``base_rate`` at the default ``μ = 0.9``.
    Its default ``None`` chooses the rate from each step's batch size ``B`` (``auto_rate``): ``0.03`` from
    16 rows up, ``0.03·B/16`` below (``0.001875`` online); ``rate_for(B)`` gives it.
    Every field is checked when the config is built; numbers may be NumPy scalars (stored as Python
    numbers).
    """

    base_rate: float | None = None
    """The learning rate (> 0): what ``adaptive_rate`` recovers towards. ``None`` (default): chosen from
    each step's batch size ``B``, ``0.03·min(1, B/16)`` (0.03 from 16 rows up, 0.001875 online; measured
    in docs/tweening.md's rate table). The Tweening document's (and Loom's) value is ``0.01``."""
    momentum_decay: float = 0.9
    """Momentum μ in [0, 1); 0 = no momentum (the document's value)."""
    link_budget_scale: float = 1.0
    """``s`` in [0, 2]: a layer's rate is scaled by ``1 − s/2 + s/2·alignment``; 1 = Loom's
    ``0.5 + 0.5·budget``, 0 = off."""
    gap_threshold: float = 0.1
    """Samples whose output error ``Σ(ŷ − t)²`` is below this count as learned and give no gradient
    (>= 0; 0 = off)."""
    explosion_limit: float = 10.0
    """A step whose mean gap exceeds ``explosion_limit × gap_baseline`` is an explosion (> 1)."""
    recovery_rate: float = 0.5
    """``adaptive_rate`` is multiplied by this on an explosion, in (0, 1] (the document's value)."""
    recovery_growth: float = 1.05
    """``adaptive_rate`` grows by this factor per stable step, up to ``base_rate`` (>= 1; Loom's 5 %)."""
    depth_scaling: bool = True
    """Scale weighted layer ``k`` of ``L`` by ``1/sqrt(L − k)`` (the document's formula)."""
    explosion_detection: bool = True
    """Watch the gap's growth; ``False`` = a constant rate and momentum never reset."""
    gradient_scale: float = 1.0
    """Backward targets ``t_i = a_i − gradient_scale·chain_gradients[i]`` (> 0)."""
    loss_type: str | None = None
    """``None``: ``"cross_entropy"`` for class labels, ``"mse"`` for float targets; or a loss name of
    ``torchloom.LOSS_TYPES``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` unless every field is valid (cheap host checks). Called at
        construction, when a ``TweenState`` is made, at the start of ``TweenTrainer.fit`` and by the
        public ``tween_step``/``step``, so a field changed after construction is checked too."""
        python_numbers(self)
        o = "TweenConfig"
        if self.base_rate is not None:
            try:
                _number(o, "base_rate", self.base_rate, 0.0, lo_open=True)
            except ValueError as e:
                raise ValueError(f"{e} (or None: chosen from each step's batch size)") from None
        _number(o, "momentum_decay", self.momentum_decay, 0.0, 1.0, hi_open=True)
        _number(o, "link_budget_scale", self.link_budget_scale, 0.0, 2.0)
        _number(o, "gap_threshold", self.gap_threshold, 0.0)
        _number(o, "explosion_limit", self.explosion_limit, 1.0, lo_open=True)
        _number(o, "recovery_rate", self.recovery_rate, 0.0, 1.0, lo_open=True)
        _number(o, "recovery_growth", self.recovery_growth, 1.0)
        _number(o, "gradient_scale", self.gradient_scale, 0.0, lo_open=True)
        for name in ("depth_scaling", "explosion_detection"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{o}: {name} must be a bool, got {getattr(self, name)!r}")
        if self.loss_type is not None and self.loss_type not in LOSS_TYPES:
            raise ValueError(f"{o}: loss_type must be None (automatic) or one of {LOSS_TYPES}, got {self.loss_type!r}")

    def rate_for(self, batch: int) -> float:
        """The rate of a step of ``batch`` rows while nothing exploded: ``base_rate``, or with
        ``base_rate=None`` ``auto_rate(batch)`` = ``0.03·min(1, batch/16)`` (``adaptive_rate`` then
        holds the 0.03, and a step of fewer than 16 rows moves ``batch/16`` of it)."""
        return float(self.base_rate) if self.base_rate is not None else auto_rate(batch)


def _is_bias(name: str) -> bool:
    """Whether a parameter (by its name inside its layer) is a bias: ``bias``, ``b``, ``bias_ih``,
    ``b_ih``, ``q_bias``, ... Biases keep their own velocity (``bias_velocity``), as in Loom."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("bias", "b") or leaf.startswith(("bias_", "b_")) or leaf.endswith("_bias")


def _rate(owner: str, rate: Any) -> float:
    _number(owner, "rate", rate, 0.0, lo_open=True)
    return float(rate)


class TweenState:
    """Everything Neural Tweening keeps between steps, for one network.

    Args:
        model: a ``Network`` (a torchloom layer or list of layers is wrapped in one).
        config: a ``TweenConfig`` (default settings when ``None``).

    Fields (``n`` = layers of the network, ``B`` = batch size of the last step):

    * ``forward_acts``: ``n+1`` tensors ``a_0 … a_n`` of the last step (``a_0`` the input);
    * ``backward_targets``: ``[None, t_1, …, t_n]``; ``t_i = a_i − gradient_scale·chain_gradients[i]``
      for hidden activations, ``t_n`` the target itself (one-hot ``[B, C]`` for class labels);
    * ``chain_gradients``: ``[None, g_1, …, g_n]``, ``g_i = ∂ℓ_b/∂a_i`` row by row (the per-sample
      loss gradient, after gating; shapes of ``a_i``);
    * ``gaps``, ``link_budgets``, ``alignments``: ``n`` floats (step 3 of ``tween_step``);
    * ``weight_velocity``, ``bias_velocity``: per layer, a tuple of tensors aligned with the layer's
      non-bias / bias parameters (in ``named_parameters()`` order; empty for layers without any);
    * the explosion watch (``ExplosionRule``): ``prev_avg_gap`` (the last step's mean gap, ``None``
      before the first step), ``gap_baseline`` (the running baseline of the mean gap, 0 before the
      first step), ``gap_growth_rate`` (the last step's mean gap / the baseline it was compared with),
      ``explosion_count`` (total explosions detected), ``adaptive_rate`` (the rate in use: starts at
      ``base_rate``, cut on an explosion, never below 1 % of it; with ``base_rate=None`` it starts at
      0.03 and a step of ``B < 16`` rows moves ``B/16`` of it), ``steps`` (counted steps);
    * ``depth_scales`` (per layer, ``None`` for layers without parameters), ``layer_rates`` (the rate
      each layer used in the last step, ``0.0`` where none), ``active`` (``[B]`` bool: samples that
      contributed a gradient), ``last_status`` (a ``StepStatus``);
    * histories for plotting, one entry per completed step: ``loss_history``, ``gap_history`` (mean
      gap), ``link_budget_history`` (mean link budget), ``explosion_history`` (``explosion_count``
      after the step), ``rate_history`` (``adaptive_rate`` used).
    """

    def __init__(self, model: Network | Layer | Iterable[Layer], config: TweenConfig | None = None) -> None:
        net = as_network(model)
        config = TweenConfig() if config is None else config
        if not isinstance(config, TweenConfig):
            raise TypeError(f"TweenState: config must be a TweenConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        self._net = net  # tween_step on this same object skips the compatibility check
        n = len(net.layers)
        self._shapes = [tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()) for layer in net.layers]
        weighted = [i for i in range(n) if self._shapes[i]]
        if not weighted:
            raise ValueError("TweenState: the model has no parameters to train")
        big_l = len(weighted)
        # Document: "scale = 1/sqrt(totalLayers − layerIndex)", counted over the weighted layers.
        self.depth_scales: list[float | None] = [None] * n
        for k, i in enumerate(weighted):
            self.depth_scales[i] = 1.0 / math.sqrt(big_l - k) if config.depth_scaling else 1.0

        self.weight_velocity: list[tuple[Tensor, ...]] = []
        self.bias_velocity: list[tuple[Tensor, ...]] = []
        for layer in net.layers:
            named = list(layer.named_parameters())
            self.weight_velocity.append(tuple(torch.zeros_like(p, memory_format=torch.contiguous_format) for nm, p in named if not _is_bias(nm)))
            self.bias_velocity.append(tuple(torch.zeros_like(p, memory_format=torch.contiguous_format) for nm, p in named if _is_bias(nm)))

        self.forward_acts: list[Tensor] = []
        self.backward_targets: list[Tensor | None] = []
        self.chain_gradients: list[Tensor | None] = []
        self.gaps: list[float] = [0.0] * n
        self.link_budgets: list[float] = [1.0] * n
        self.alignments: list[float] = [1.0] * n
        self.layer_rates: list[float] = [0.0] * n
        self.active: Tensor | None = None
        self.prev_avg_gap: float | None = None
        self.gap_growth_rate: float = 1.0
        self.gap_baseline: float = 0.0
        self.gap_log_mean: float = 0.0  # the explosion watch's running mean of log(avg_gap) (ExplosionRule)
        self.gap_log_dev: float = 0.0  # ... its running mean absolute deviation
        self.gap_log_peak: float = -math.inf  # ... its slowly forgetting running peak of log(avg_gap)
        self.explosion_pressure: float = 0.0  # ... its leaky count of recent explosions
        self.explosion_count: int = 0
        # base_rate=None: the rate of batches of 16 rows or more (a smaller step moves B/16 of it)
        self.adaptive_rate: float = float(config.base_rate) if config.base_rate is not None else AUTO_RATE
        self.steps: int = 0
        self.last_status: StepStatus = StepStatus.OK
        self.loss_history: list[float] = []
        self.gap_history: list[float] = []
        self.link_budget_history: list[float] = []
        self.explosion_history: list[int] = []
        self.rate_history: list[float] = []

    # ------------------------------------------------------------------ checks
    def _check_model(self, model: Any) -> Network:
        if model is self._net:
            return model
        net = as_network(model)
        shapes = [tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()) for layer in net.layers]
        if shapes != self._shapes:
            raise ValueError(
                "tween_step: model does not match the network this TweenState was created for "
                f"(parameters per layer {shapes} vs {self._shapes})"
            )
        return net

    def _output_target(self, out: Tensor, target: Any, num_classes: int | None, check_labels: bool = True) -> tuple[Tensor, str]:
        """Validate ``target`` against the output ``[B, ..., C]``; return the float target ``t_n``
        (labels → one-hot) and the loss type. Raises before anything is changed."""
        if not isinstance(target, Tensor):
            raise TypeError(f"tween_step: target must be a torch.Tensor, got {type(target).__name__}")
        c = out.shape[-1]
        if num_classes is not None:
            if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
                raise ValueError(f"tween_step: num_classes must be a positive int or None, got {num_classes!r}")
            if num_classes != c:
                raise ValueError(f"tween_step: num_classes={num_classes} does not match the network's output size {c}")
        labels = is_label_target(target)
        loss_type = self.config.loss_type or ("cross_entropy" if labels else "mse")
        if labels:
            if tuple(target.shape) != tuple(out.shape[:-1]):
                raise ValueError(
                    f"tween_step: class labels must have shape {list(out.shape[:-1])} for an output of shape "
                    f"{list(out.shape)}, got {list(target.shape)}"
                )
            lo, hi = (int(target.min()), int(target.max())) if check_labels else (0, 0)
            if lo < 0 or hi >= c:
                raise ValueError(f"tween_step: class labels must lie in [0, {c}), got values in [{lo}, {hi}]")
            t = torch.nn.functional.one_hot(target.to(out.device, torch.long), c).to(out.dtype)
        else:
            if not target.is_floating_point():
                raise TypeError(f"tween_step: target must be integer class labels or a float tensor, got dtype {target.dtype}")
            if tuple(target.shape) != tuple(out.shape):
                raise ValueError(f"tween_step: target shape {list(target.shape)} does not match output shape {list(out.shape)}")
            t = target.to(out.device, out.dtype)
        return t, loss_type

    # -------------------------------------------------------------------- step
    def tween_step(self, model: Network, x: Tensor, target: Tensor, num_classes: int | None = None, rate: float | None = None) -> float:
        """One complete bidirectional step; returns the (pre-update) loss. See ``step``."""
        return self.step(model, x, target, num_classes, rate).loss

    def step(self, model: Network, x: Tensor, target: Tensor, num_classes: int | None = None, rate: float | None = None) -> StepOutput:
        """One Tween step on a batch, reported as a ``StepOutput`` (loss, status, logs).

        ``x [B, ...]``; ``target``: integer class labels (the output's shape without its last
        dimension, values in ``[0, C)``) or a float tensor of the output's shape. ``num_classes``
        (optional) must equal the output size ``C``. ``rate`` (optional, > 0) replaces the configured
        rate (``config.rate_for(B)``: ``base_rate``, or with ``base_rate=None`` the rate for this batch's
        ``B`` rows) for this step as the ceiling of ``adaptive_rate``. Bad arguments, and a ``TweenConfig`` field
        made invalid after construction, raise ``ValueError`` / ``TypeError`` before anything changes.

        With ``B`` rows, ``ℓ_b`` the loss of sample ``b`` (so the batch loss is ``mean_b ℓ_b``), ``ŷ``
        the output as the loss reads it (``softmax(a_n)`` for ``"cross_entropy"``, ``a_n`` otherwise),
        ``L`` the number of weighted layers (layers with parameters):

        1. **Forward**: ``a_{i+1}, saved_i = layer_i.forward_saved(a_i)`` for every layer.
        2. **Backward**: ``t_n`` = the target (one-hot for labels). Loss and its gradient:
           ``"cross_entropy"`` (default for labels: softmax cross-entropy, ``∂ℓ_b/∂a_n = softmax(a_n) −
           t_n`` for ``[B, C]`` outputs) or ``"mse"`` (default for float targets: ``(1/N)Σ(a_n − t_n)²``,
           ``∂ℓ_b/∂a_n = 2(a_n − t_n)·B/N``); in general ``∂ℓ_b/∂a_n = B·∂loss/∂a_n``. **Gating**: a sample whose output error ``e_b = Σ_j (ŷ − t_n)²_bj`` is
           below ``gap_threshold`` gets ``∂ℓ_b/∂a_n = 0``. ``chain_gradients[n]`` = that per-sample
           gradient; each layer's hand-written ``backward_saved`` carries it back:
           ``chain_gradients[i]`` for ``i ≥ 1`` and each layer's parameter gradient ``G_i = Σ_b ∂ℓ_b/∂θ``.
           Hidden targets ``t_i = a_i − gradient_scale·chain_gradients[i]``.
        3. **Metrics**, per layer ``i`` with ``f = a_{i+1}`` (``ŷ`` for the last layer) and ``t = t_{i+1}``:
           ``gaps[i] = mean((f − t)²)``; ``link_budgets[i] = rms(a_{i+1}) / rms(a_i)`` (0 when
           ``rms(a_i) = 0``); ``alignments[i] = (cos(f, t) + 1)/2`` over the whole batch tensor (0.5
           when either is zero).
        4. **Explosion handling** (``ExplosionRule``): ``avg_gap = mean(gaps)`` is compared with a
           running baseline ``gap_baseline = exp(min(m + 3·s, λ))`` of ``log avg_gap`` (``m``, ``s``: its
           running mean and mean absolute deviation; ``λ``: its slowly forgetting running peak; built
           over a 10-step warm-up without detection). ``gap_growth_rate = avg_gap/gap_baseline``. If
           ``explosion_detection`` and ``avg_gap > explosion_limit·gap_baseline``: ``explosion_count +=
           1``, ``adaptive_rate = min(base, max(adaptive_rate·recovery_rate, 0.01·base))``, every
           velocity (weights and biases) set to 0; such a step pulls the baseline only part of the
           way, and after explosions on about 4 steps in a row the baseline jumps to the new gap level
           (a persistent change is absorbed, so learning never freezes). Else ``adaptive_rate =
           min(base, adaptive_rate·recovery_growth)`` with ``base = rate or config.rate_for(B)`` (never above
           it, also after a cut). ``prev_avg_gap = avg_gap``.
        5. **Update**, weighted layer ``k`` (of ``L``) at index ``i``: ``r_i = adaptive_rate · (1 − s/2
           + s/2·alignments[i]) · scale_k · b`` with ``s = link_budget_scale``, ``scale_k = 1/sqrt(L − k)``
           (1 when ``depth_scaling`` is off) and ``b = min(1, B/16)`` when ``base_rate`` is ``None`` and no
           ``rate`` is given (else 1); per parameter ``v = momentum_decay·v − r_i·G_i/B``;
           ``θ += v``. ``G_i/B`` is the gradient of the batch loss, so with depth scaling off, ``s = 0``,
           ``gap_threshold = 0`` and ``momentum_decay = 0`` a step is exactly one SGD step of rate
           ``adaptive_rate·b`` (= ``config.rate_for(B)`` while nothing exploded) on the batch loss.
        6. **Loss**: the batch loss of step 2 (before the update) is appended to ``loss_history`` and
           returned.

        A NaN/Inf loss (status ``NAN_LOSS``) or parameter gradient (``NAN_GRAD``) changes nothing but
        ``last_status``. This follows the Tweening document; Loom's ``nn`` code differs
        (docs/PARITY.md): its error is the residual ``one_hot − output`` with no softmax and its loss
        the summed squared error; its chain-rule backward clips every gradient to ±10, divides by
        ``sqrt(outputs)``, clips each weight delta to ±1 and uses ``f'`` of the output (+0.01 for
        sigmoid/tanh, 1.1 for ReLU); its depth factor is ``1.2^(depth from output)``; its velocity is
        ``μv + (1−μ)·δ``; its cosine "link budget" does not modulate the chain-rule update; there is no
        gap gating; its explosion test (off by default) uses a fixed 1.5× growth or 10× a 10-step
        baseline, cuts by 0.7 and never lets the multiplier fall below 0.01.
        """
        self.config.validate()
        return self._step(model, x, target, num_classes, rate, check_labels=True)

    @torch.no_grad()
    def _step(
        self, model: Any, x: Any, target: Any, num_classes: Any, rate: Any, check_labels: bool, events: Any = None,
        clip: Any = None, dist: Any = None, auto: bool | None = None,
    ) -> StepOutput:
        """``step``'s body. ``events``: a ``LayerEvents`` (observers/layer_stats.py) that gets each layer's
        output and input gradient (the batch loss's, as in backprop), or ``None``. ``clip``: a callable
        applied in place to the list of parameter gradients once they are known to be finite, before
        the update, with the batch size ``B`` (``clip(grads, B)``; the gradients are sums over the
        batch, ``G_i``), or ``None``. ``auto``: whether the rate is the automatic one, whose step of
        ``B < 16`` rows moves ``B/16`` of it, ``B`` the step's batch (under ``dist`` the rows of every
        rank, as counted); ``None``: automatic when no rate is given and ``base_rate`` is ``None``."""
        cfg = self.config
        base = _rate("tween_step", rate) if rate is not None else (float(cfg.base_rate) if cfg.base_rate is not None else AUTO_RATE)
        net = self._check_model(model)
        if not isinstance(x, Tensor):
            raise TypeError(f"tween_step: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"tween_step: x must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        if auto is None:
            auto = rate is None and cfg.base_rate is None
        layers = list(net.layers)
        n = len(layers)

        # 1. Forward (no state is touched until the target is validated).
        acts, saved = forward_layers(layers, x)
        out = acts[-1]
        t_out, loss_type = self._output_target(out, target, num_classes, check_labels)
        if events is not None:
            for i, layer in enumerate(layers):
                events.forward(i, layer, acts[i + 1])
        batch = out.shape[0]

        # 2. Backward: loss, gating, chain gradients, targets.
        loss_t, grad = loss_and_grad(out, t_out, loss_type, validate=False)
        y_hat = torch.softmax(out, dim=-1) if loss_type == "cross_entropy" else out
        err = (y_hat - t_out).square().reshape(batch, -1).sum(1)
        active = err >= cfg.gap_threshold
        g = grad * batch  # per-sample gradient ∂ℓ_b/∂a_n: the batch loss is the mean of ℓ_b
        if cfg.gap_threshold > 0:
            g = g * active.view(batch, *([1] * (g.dim() - 1))).to(g.dtype)
        chain: list[Tensor | None] = [None] * (n + 1)
        chain[n] = g
        param_grads: list[tuple[Tensor, ...]] = [()] * n
        input_grad = events is not None and events.wants_backward
        for i in range(n - 1, -1, -1):
            g, param_grads[i] = layers[i].backward_saved(g, saved[i], needs_input_grad=i > 0 or input_grad)
            if i > 0:
                chain[i] = g
            if input_grad and g is not None:
                events.backward(i, layers[i], g / batch)
        targets: list[Tensor | None] = [None] + [acts[i] - cfg.gradient_scale * chain[i] for i in range(1, n)] + [t_out]

        # 3. Metrics, computed on the device and read back with the loss and the finiteness test in one sync.
        flat_grads = [pg for pgs in param_grads for pg in pgs]
        if dist is None:
            metrics = [self._layer_metrics(acts[i], acts[i + 1] if i + 1 < n else y_hat, acts[i + 1], targets[i + 1]) for i in range(n)]
        else:  # data-parallel (``dist``, a DistContext): sums over every rank's rows, as one process on the global batch
            loss_t, metrics, batch = _global_step_numbers(dist, loss_t, batch, flat_grads, acts, y_hat, targets)
        finite = finite_flag(flat_grads) if flat_grads else torch.tensor(True)
        numbers = torch.cat([loss_t.reshape(1).double().to(out.device), finite.reshape(1).double().to(out.device), *metrics]).tolist()
        loss, ok = numbers[0], numbers[1] > 0.5
        gaps, budgets, aligns = numbers[2::3], numbers[3::3], numbers[4::3]
        if not math.isfinite(loss):
            self.last_status = StepStatus.NAN_LOSS
            return StepOutput(loss, StepStatus.NAN_LOSS)
        if not ok:
            self.last_status = StepStatus.NAN_GRAD
            return StepOutput(loss, StepStatus.NAN_GRAD)

        scale = small_batch_scale(batch) if auto else 1.0  # the counted batch: every rank alike, whatever its shard
        if clip is not None:
            clip(flat_grads, batch)
        self.forward_acts, self.backward_targets, self.chain_gradients = acts, targets, chain
        self.gaps, self.link_budgets, self.alignments = gaps, budgets, aligns
        self.active = active

        # 4. Explosion handling.
        avg_gap = sum(gaps) / n
        watch = (self.gap_log_mean, self.gap_log_dev, self.gap_log_peak, self.explosion_pressure)
        exploded, self.adaptive_rate, watch, self.gap_baseline, self.gap_growth_rate = EXPLOSION_RULE(
            _FloatOps, avg_gap, watch, self.adaptive_rate, self.steps, base, cfg
        )
        self.gap_log_mean, self.gap_log_dev, self.gap_log_peak, self.explosion_pressure = watch
        if exploded:
            self.explosion_count += 1
            for v in (*self.weight_velocity, *self.bias_velocity):
                for t in v:
                    t.zero_()
        self.prev_avg_gap = avg_gap

        # 5. Update: per-layer rate, momentum per parameter.
        s = cfg.link_budget_scale
        for i, layer in enumerate(layers):
            depth = self.depth_scales[i]
            if depth is None:
                self.layer_rates[i] = 0.0
                continue
            r = self.adaptive_rate * (1.0 - s / 2 + s / 2 * aligns[i]) * depth * scale
            self.layer_rates[i] = r
            wv, bv = iter(self.weight_velocity[i]), iter(self.bias_velocity[i])
            for (name, p), pg in zip(layer.named_parameters(), param_grads[i]):
                v = next(bv) if _is_bias(name) else next(wv)
                if v.device != p.device or v.dtype != p.dtype:  # the model moved since the state was made
                    v = self._move_velocity(i, name, v, p)
                if not p.requires_grad:  # frozen parameter: left as it is
                    continue
                v.mul_(cfg.momentum_decay).add_(pg, alpha=-r / batch)
                p.add_(v)

        # 6. Loss and histories.
        self.steps += 1
        self.last_status = StepStatus.OK
        mean_budget = sum(budgets) / n
        self.loss_history.append(loss)
        self.gap_history.append(avg_gap)
        self.link_budget_history.append(mean_budget)
        self.explosion_history.append(self.explosion_count)
        self.rate_history.append(self.adaptive_rate)
        logs = {
            "mean_gap": avg_gap,
            "mean_link_budget": mean_budget,
            "explosion": 1.0 if exploded else 0.0,
            "adaptive_rate": self.adaptive_rate,
            "gap_baseline": self.gap_baseline,
            "explosion_count": float(self.explosion_count),
        }
        return StepOutput(loss, StepStatus.OK, logs)

    @staticmethod
    def _layer_metrics(a_in: Tensor, f: Tensor, a_out: Tensor, t: Tensor) -> Tensor:
        """``[gap, link_budget, alignment]`` of one layer as a float64 tensor (no host sync)."""
        f64, t64 = f.double(), t.double()
        gap = (f64 - t64).square().mean()
        rms_in = a_in.double().square().mean().sqrt()  # a_0 may be integer token ids
        rms_out = a_out.double().square().mean().sqrt()
        budget = torch.where(rms_in > 0, rms_out / torch.where(rms_in > 0, rms_in, 1.0), 0.0)
        nf, nt = torch.linalg.vector_norm(f64), torch.linalg.vector_norm(t64)
        both = (nf > 0) & (nt > 0)
        cos = (f64 * t64).sum() / torch.where(both, nf * nt, 1.0)
        align = torch.where(both, (cos + 1) / 2, 0.5)
        return torch.stack([gap, budget, align])

    def _move_velocity(self, i: int, name: str, v: Tensor, p: Tensor) -> Tensor:
        new = v.to(device=p.device, dtype=p.dtype)
        bucket = "bias_velocity" if _is_bias(name) else "weight_velocity"
        old = getattr(self, bucket)[i]
        getattr(self, bucket)[i] = tuple(new if o is v else o for o in old)
        return new


def forward_layers(layers: Any, x: Tensor) -> tuple[list[Tensor], list[Any]]:
    """Every layer's explicit forward in turn: the activations ``[x, a_1, …, a_n]`` and each layer's
    saved backward state (what every Tween step, host or device, starts with)."""
    acts: list[Tensor] = [x]
    saved: list[Any] = []
    for layer in layers:
        out, s = layer.forward_saved(acts[-1])
        acts.append(out)
        saved.append(s)
    return acts, saved


def _tween_auto_loss(output: Tensor, target: Tensor) -> Tensor:
    """Tween's default loss: softmax cross-entropy for class labels, MSE for float targets."""
    return compute_loss(output, target, "cross_entropy" if is_label_target(target) else "mse")


# TweenState's plain (non-tensor) fields a snapshot or checkpoint keeps
_TWEEN_SCALARS = (
    "prev_avg_gap", "gap_growth_rate", "explosion_count", "adaptive_rate", "steps", "gap_baseline",
    "gap_log_mean", "gap_log_dev", "gap_log_peak", "explosion_pressure",
    "loss_history", "gap_history", "link_budget_history", "explosion_history", "rate_history",
)


def _sum_squares(a: Tensor) -> Tensor:
    """``Σ a²`` as a 0-d float64 tensor. A float CUDA input (the network's input, ``[batch, in]``: at a
    wide input the largest tensor of a Tween step) goes through one fused pass with float32 partial
    sums; elsewhere, and for integer token ids, ``a`` is cast to float64 first."""
    if a.is_cuda and a.dtype in (torch.float32, torch.float16, torch.bfloat16) and a.numel():
        from ..kernels.grad_norm import grad_sq_partials

        return grad_sq_partials([a]).double().sum()
    return a.double().square().sum()


def tween_sums(a_in: Tensor, f: Tensor, a_out: Tensor, t: Tensor) -> Tensor:
    """The sums Tweening's per-layer metrics are formed from, float64 ``[9]``: ``Σ(f − t)²``, count of
    ``f``, ``Σa_in²``, count of ``a_in``, ``Σa_out²``, count of ``a_out``, ``Σf·t``, ``Σf²``, ``Σt²``."""
    f64, t64 = f.double().reshape(-1), t.double().reshape(-1)
    i64, o64 = a_in.double().reshape(-1), a_out.double().reshape(-1)
    d = f64 - t64
    dev = f64.device
    n = lambda v: torch.full((), float(v.numel()), dtype=torch.float64, device=dev)  # noqa: E731
    return torch.stack([d @ d, n(f64), i64 @ i64, n(i64), o64 @ o64, n(o64), f64 @ t64, f64 @ f64, t64 @ t64])


def tween_metrics(sums: Tensor) -> Tensor:
    """``[layers, 3]`` (gap, link budget, alignment) from summed ``tween_sums`` rows ``[layers, 9]``:
    gap = mean of squares, link budget = rms(a_out)/rms(a_in) (0 when rms(a_in) = 0), alignment =
    (cos(f, t) + 1)/2 (0.5 when either is zero)."""
    sq, nf, ii, ni, oo, no, ft, ff, tt = sums.unbind(1)
    gap = sq / nf.clamp_min(1.0)
    rms_in = (ii / ni.clamp_min(1.0)).sqrt()
    rms_out = (oo / no.clamp_min(1.0)).sqrt()
    budget = torch.where(rms_in > 0, rms_out / torch.where(rms_in > 0, rms_in, 1.0), 0.0)
    nrm_f, nrm_t = ff.sqrt(), tt.sqrt()
    both = (nrm_f > 0) & (nrm_t > 0)
    cos = ft / torch.where(both, nrm_f * nrm_t, 1.0)
    align = torch.where(both, (cos + 1) / 2, 0.5)
    return torch.stack([gap, budget, align], 1)


def _global_step_numbers(dist: Any, loss_t: Tensor, batch: int, grads: list[Tensor], acts: list[Tensor], y_hat: Tensor, targets: list[Any]) -> tuple[Tensor, list[Tensor], int]:
    """Data-parallel ``_step``: the parameter gradients ``G_i`` (sums over samples) summed over the
    ranks in place; the loss (weighted by each rank's rows), the per-layer metrics (from summed
    ``tween_sums``) and the global batch size, as one process would find them on the global batch."""
    n = len(acts) - 1
    sums = torch.stack([tween_sums(acts[i], acts[i + 1] if i + 1 < n else y_hat, acts[i + 1], targets[i + 1]) for i in range(n)])
    head = torch.stack([loss_t.detach().double().reshape(()) * batch, torch.full((), float(batch), dtype=torch.float64, device=sums.device)])
    packed = torch.cat([head, sums.reshape(-1)])
    dist.all_reduce_([*grads, packed], "sum")  # one all_reduce_ (one collective for a float64 model)
    rows = packed[0:1] / packed[1]
    return rows.reshape(()), list(tween_metrics(packed[2:].view(n, 9)).unbind(0)), int(round(float(packed[1])))


def _check_target_shape(out_shape: tuple[int, ...], batch: int, y: Tensor) -> None:
    """Shape and label-range check of one batch's target against an output ``[batch, *out_shape]``."""
    full = (batch, *out_shape)
    if is_label_target(y):
        if tuple(y.shape) != full[:-1]:
            raise ValueError(f"class labels must have shape {list(full[:-1])} for an output of shape {list(full)}, got {list(y.shape)}")
        lo, hi = label_bounds(y)
        if lo < 0 or hi >= full[-1]:
            raise ValueError(f"class labels must lie in [0, {full[-1]}), got values in [{lo}, {hi}]")
    elif tuple(y.shape) != full:
        raise ValueError(f"target shape {list(y.shape)} does not match output shape {list(full)}")
