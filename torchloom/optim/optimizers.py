"""Optimizers (SGD, AdamW, RMSprop) as ``torch.optim.Optimizer`` subclasses, and the names ``train()`` accepts.

Each optimizer's ``step`` gathers a group's parameters, gradients and state and makes one call to a
functional update in ``torchloom.kernels`` (``sgd_update_``, ``adamw_update_``, ``rmsprop_update_``):
a fused Triton kernel on CUDA (one pass over each tensor, no host sync), the plain-PyTorch reference
on CPU. Numerics match ``torch.optim`` with the same settings, which is the test reference.

Beyond ``torch.optim``:

* ``clip_value > 0`` clamps every gradient element to ``±clip_value`` inside the update (Loom
  ``poly``'s per-element clip);
* ``step(grad_scale=..., found_inf=...)``: 0-d device tensors; the gradient is multiplied by
  ``grad_scale`` before the clip and the update (a global-norm clip scale computed on the device),
  and a nonzero ``found_inf`` leaves weights and state untouched (the NaN/Inf guard inside a CUDA graph);
* ``lr`` may be a 0-d tensor on the parameters' device, read by the kernel (CUDA-graph replays see
  its current value; ``LRScheduler``s update it in place).

The kernel modules are imported inside ``step``, so importing this file never imports Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..kernels._triton import check_backend
from ..kernels._update import check_number

__all__ = [
    "FusedOptimizer", "SGD", "AdamW", "RMSprop", "make_optimizer", "OPTIMIZERS", "option_names", "check_optimizer_options",
    "flatten_optimizer_", "rehome",
]


def _check_lr(owner: str, lr: Any) -> Any:
    """``lr`` validated: a number > 0 (numpy scalars become floats) or a one-value floating tensor,
    kept as a tensor (a CUDA graph reads its current value)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{owner}: lr as a tensor must be a floating tensor with one value, got shape {list(lr.shape)} dtype {lr.dtype}")
        return lr
    return check_number(owner, "lr", lr, low_inclusive=False)


def _check_backend(owner: str, backend: Any) -> None:
    try:
        check_backend(backend)
    except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None


def _run_closure(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _params_with_grads(group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
    params, grads = [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise TypeError("torchloom optimizers take dense gradients only; got a sparse gradient")
        params.append(p)
        grads.append(p.grad)
    return params, grads


# ------------------------------------------------------------------------------------------ base
class FusedOptimizer(Optimizer):
    """torchloom's optimizers: ``update(grad_scale=, found_inf=)`` does one fused update of every
    parameter with a gradient; ``step`` is the closure (if any) and then ``update``."""

    kernel_module = ""  # the module of its fused update kernel (imported ahead by the engine)

    def step(
        self, closure: Callable[[], float] | None = None, *, grad_scale: Tensor | None = None, found_inf: Tensor | None = None
    ) -> float | None:
        """One update of every parameter with a gradient; returns the closure's loss if given."""
        loss = _run_closure(closure)
        self.update(grad_scale=grad_scale, found_inf=found_inf)
        return loss

    def update(self, *, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ SGD
class SGD(FusedOptimizer):
    """Stochastic gradient descent, optionally with momentum, as ``torch.optim.SGD``.

    One step, per element: ``g = clamp(g·grad_scale, ±clip_value) + weight_decay·w``; with momentum
    ``v = g`` on the first step, then ``v = μ·v + (1 − dampening)·g``, and ``g = g + μ·v`` (Nesterov)
    or ``g = v``; finally ``w −= lr·g``. Note: Loom starts ``v`` at 0, so with ``dampening ≠ 0`` its
    first step is ``(1 − dampening)`` times torch's; torchloom follows torch.

    Args: ``lr`` (> 0, or a 0-d tensor), ``momentum`` μ (>= 0), ``dampening`` (>= 0), ``nesterov``
    (needs μ > 0 and dampening 0), ``weight_decay`` (L2, added to the gradient), ``clip_value``
    (per-element clip, 0 = off), ``backend`` (None: Triton on CUDA, the reference elsewhere;
    ``"triton"`` / ``"reference"`` to force one).
    """

    kernel_module = "torchloom.kernels.sgd"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 0.01,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        clip_value: float = 0.0,
        *,
        backend: str | None = None,
    ) -> None:
        lr = _check_lr("SGD", lr)
        momentum = check_number("SGD", "momentum", momentum)
        dampening = check_number("SGD", "dampening", dampening)
        weight_decay = check_number("SGD", "weight_decay", weight_decay)
        clip_value = check_number("SGD", "clip_value", clip_value)
        _check_backend("SGD", backend)
        if not isinstance(nesterov, bool):
            raise TypeError(f"SGD: nesterov must be a bool, got {nesterov!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD: nesterov needs momentum > 0 and dampening 0, got momentum={momentum}, dampening={dampening}")
        self.backend = backend
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, clip_value=clip_value
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def update(self, *, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
        """The update of ``step`` alone: no closure, and no step hooks or profiler record (which
        torch wraps around ``step``), for trainers that own the optimizer and call it every batch."""
        from ..kernels.sgd import sgd_update_

        for params, grads, bufs, settings in self._groups():
            sgd_update_(params, grads, bufs, **settings, grad_scale=grad_scale, found_inf=found_inf, backend=self.backend)
            if bufs is not None:
                for p, buf in zip(params, bufs):
                    if buf is not None:
                        self.state[p]["momentum_buffer"] = buf

    def _groups(self) -> Iterator[tuple[list[Tensor], list[Tensor], list[Tensor | None] | None, dict[str, Any]]]:
        """Per param group with gradients: its parameters, their gradients, their momentum buffers
        (``None`` entries for new ones; ``None`` without momentum) and the group's update settings."""
        for group in self.param_groups:
            params, grads = _params_with_grads(group)
            if not params:
                continue
            bufs = [self.state[p].get("momentum_buffer") for p in params] if group["momentum"] != 0 else None
            settings = {k: group[k] for k in ("lr", "momentum", "dampening", "nesterov", "weight_decay", "clip_value")}
            yield params, grads, bufs, settings

    @torch.no_grad()
    def probe(self, flag: Tensor) -> Tensor:
        """Look ahead at the next ``update()`` (no ``grad_scale``) without changing anything: the
        partial sums of ``g²`` over every gradient (1-D float32; a NaN/Inf sum means a NaN/Inf
        gradient), and the 0-d int32 ``flag`` raised when the update would write a NaN/±Inf weight or
        momentum value (``kernels.sgd.sgd_probe_``, one read of the weights and gradients). The
        engine's CUDA step decides on these before the update, so it needs no backup of the weights."""
        from ..kernels.sgd import sgd_probe_

        parts = [sgd_probe_(params, grads, bufs, flag, **settings, backend=self.backend)
                 for params, grads, bufs, settings in self._groups()]
        if not parts:
            raise ValueError("SGD.probe: no parameter has a gradient; there is no update to look ahead at")
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# ---------------------------------------------------------------------------------------- AdamW
def _split_decay(params: Iterable[Any]) -> list[Any]:
    """Plain parameters (not groups) → a group of tensors with >= 2 dims (decayed) and a group of the
    rest, biases and norm weights, with ``weight_decay=0`` (Loom decays kernels, never biases)."""
    items = list(params)
    if not items or isinstance(items[0], dict):
        return items
    tensor = lambda item: item[1] if isinstance(item, tuple) else item  # noqa: E731 - (name, param) pairs too
    decay = [it for it in items if tensor(it).dim() >= 2]
    no_decay = [it for it in items if tensor(it).dim() < 2]
    groups = []
    if decay:
        groups.append({"params": decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class AdamW(FusedOptimizer):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    One step ``t``, per element: ``g = clamp(g·grad_scale, ±clip_value)``, ``w = w·(1 − lr·wd)``,
    ``m = β1·m + (1−β1)·g``, ``v = β2·v + (1−β2)·g²``,
    ``w −= lr/(1−β1^t) · m / (√v/√(1−β2^t) + ε)``.

    **No decay on biases by default** (Loom's rule): given plain parameters, those with fewer than 2
    dimensions (biases, norm weights) go into a second param group with ``weight_decay=0``; to decay
    them, pass param groups yourself (groups are used as given). ``torch.optim.AdamW`` with the same
    two groups gives the same numbers.

    Args: ``lr`` (> 0, or a 0-d tensor), ``betas`` (each in [0, 1)), ``eps`` (> 0), ``weight_decay``
    (>= 0), ``clip_value`` (per-element clip, 0 = off), ``capturable`` (keep the step count on the
    parameters' device and let the kernel read it: nothing on the host changes between steps, so a
    CUDA graph can capture ``step()``), ``backend`` (as ``SGD``).
    """

    kernel_module = "torchloom.kernels.adamw"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        clip_value: float = 0.0,
        *,
        capturable: bool = False,
        backend: str | None = None,
    ) -> None:
        lr = _check_lr("AdamW", lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        betas = (check_number("AdamW", "betas[0]", betas[0], high=1.0), check_number("AdamW", "betas[1]", betas[1], high=1.0))
        eps = check_number("AdamW", "eps", eps, low_inclusive=False)  # eps = 0 divides by zero where a moment is 0
        weight_decay = check_number("AdamW", "weight_decay", weight_decay)
        clip_value = check_number("AdamW", "clip_value", clip_value)
        _check_backend("AdamW", backend)
        if not isinstance(capturable, bool):
            raise TypeError(f"AdamW: capturable must be a bool, got {capturable!r}")
        self.backend = backend
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, clip_value=clip_value, capturable=capturable
        )
        super().__init__(_split_decay(params), defaults)

    def _state_of(self, p: Tensor, capturable: bool) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            # float32 step as torch keeps it; on the device only when capturable (else a CPU tensor
            # whose value is read without touching the GPU)
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def update(self, *, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
        """The update of ``step`` alone: no closure, and no step hooks or profiler record (which
        torch wraps around ``step``), for trainers that own the optimizer and call it every batch."""
        from ..kernels.adamw import adamw_update_

        for group in self.param_groups:
            params, grads = _params_with_grads(group)
            if not params:
                continue
            capturable = group["capturable"]
            states = [self._state_of(p, capturable) for p in params]
            step_tensors = [s["step"] for s in states]
            # The step count advances only when the update is applied (found_inf == 0).
            if capturable:
                for t, p in zip(step_tensors, params):
                    if t.device != p.device:
                        raise ValueError(f"AdamW: capturable=True needs the step count on {p.device}, it is on {t.device}")
                advance = 1.0 if found_inf is None else (found_inf.reshape(()) == 0).to(torch.float32)
                # on the device, no host sync; once per distinct tensor (flatten_optimizer_ lets a
                # group's parameters share one step count)
                unique = list({id(t): t for t in step_tensors}.values())
                if isinstance(advance, Tensor):  # the tensor-list form: no host read of ``advance``
                    torch._foreach_add_(unique, [advance] * len(unique))
                else:
                    torch._foreach_add_(unique, advance)
                steps: list[Any] = step_tensors
            else:
                if found_inf is not None and bool(found_inf.item() != 0):  # host read: not capturable
                    continue
                for t in {id(t): t for t in step_tensors}.values():  # once per distinct tensor
                    t += 1.0
                steps = [float(t) for t in step_tensors]  # CPU tensors: no device sync
            beta1, beta2 = group["betas"]
            adamw_update_(
                params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps,
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                clip_value=group["clip_value"], grad_scale=grad_scale, found_inf=found_inf, backend=self.backend,
            )


# -------------------------------------------------------------------------------------- RMSprop
class RMSprop(FusedOptimizer):
    """RMSprop, as ``torch.optim.RMSprop``.

    One step, per element: ``g = clamp(g·grad_scale, ±clip_value) + weight_decay·w``,
    ``s = α·s + (1−α)·g²``, ``avg = √s + ε`` (centered: ``√(s − ḡ²) + ε`` with ``ḡ`` the running mean
    of ``g``); with momentum ``b = μ·b + g/avg``, ``w −= lr·b``, else ``w −= lr·g/avg``. ε sits outside
    the root as in Loom's documents and torch; Loom's code puts it inside.

    Args: ``lr`` (> 0, or a 0-d tensor), ``alpha`` (in [0, 1)), ``eps`` (> 0), ``weight_decay``,
    ``momentum`` (>= 0), ``centered``, ``clip_value`` (per-element clip, 0 = off), ``backend`` (as ``SGD``).
    """

    kernel_module = "torchloom.kernels.rmsprop"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 0.01,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        clip_value: float = 0.0,
        *,
        backend: str | None = None,
    ) -> None:
        lr = _check_lr("RMSprop", lr)
        alpha = check_number("RMSprop", "alpha", alpha, high=1.0)
        eps = check_number("RMSprop", "eps", eps, low_inclusive=False)  # eps = 0 divides by zero where a square average is 0
        weight_decay = check_number("RMSprop", "weight_decay", weight_decay)
        momentum = check_number("RMSprop", "momentum", momentum)
        clip_value = check_number("RMSprop", "clip_value", clip_value)
        _check_backend("RMSprop", backend)
        if not isinstance(centered, bool):
            raise TypeError(f"RMSprop: centered must be a bool, got {centered!r}")
        self.backend = backend
        defaults = dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered, clip_value=clip_value
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def update(self, *, grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
        """The update of ``step`` alone: no closure, and no step hooks or profiler record (which
        torch wraps around ``step``), for trainers that own the optimizer and call it every batch."""
        from ..kernels.rmsprop import rmsprop_update_

        for group in self.param_groups:
            params, grads = _params_with_grads(group)
            if not params:
                continue
            centered, uses_momentum = group["centered"], group["momentum"] > 0
            states = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if uses_momentum:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if centered:
                        state["grad_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                states.append(state)
            rmsprop_update_(
                params, grads, [s["square_avg"] for s in states],
                [s["grad_avg"] for s in states] if centered else None,
                [s["momentum_buffer"] for s in states] if uses_momentum else None,
                lr=group["lr"], alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
                momentum=group["momentum"], centered=centered, clip_value=group["clip_value"],
                grad_scale=grad_scale, found_inf=found_inf, backend=self.backend,
            )


# --------------------------------------------------------------------------------- train()'s names
# train()'s optimizer names → (class, the name's own defaults); TrainingConfig.optimizer_options sets
# any setting but those a name locks. "adam" is AdamW without decay, which is torch.optim.Adam's update
# exactly (Adam's weight_decay is an L2 term added to the gradient, a different rule: 'adamw' decays
# decoupled), so its weight_decay is locked at 0.
_NAMED: dict[str, tuple[type[Optimizer], dict[str, Any]]] = {
    "sgd": (SGD, {}),
    "momentum": (SGD, {"momentum": 0.9}),
    "adam": (AdamW, {"weight_decay": 0.0}),
    "adamw": (AdamW, {}),
    "rmsprop": (RMSprop, {}),
}
_LOCKED = {"adam": ("weight_decay",)}
# constructor arguments that are not options of a name: the parameters, the rate (learning_rate) and
# capturable (the engine sets it on CUDA)
_NOT_OPTIONS = ("self", "params", "lr", "capturable")


def _named_factory(cls: type[Optimizer], fixed: dict[str, Any]) -> Callable[..., Optimizer]:
    def build(params: Iterable[Tensor], lr: float, **options: Any) -> Optimizer:
        return cls(params, lr=lr, **{**fixed, **options})

    return build


# name → factory(params, lr, **options)
OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {name: _named_factory(cls, fixed) for name, (cls, fixed) in _NAMED.items()}


def option_names(name: str) -> tuple[str, ...]:
    """The ``optimizer_options`` an optimizer name takes: its class's constructor arguments other
    than the parameters, ``lr`` and ``capturable``, less those the name locks (``"adam"``'s
    ``weight_decay``)."""
    import inspect

    cls, _ = _NAMED[name.lower()]
    locked = _LOCKED.get(name.lower(), ())
    return tuple(p for p in inspect.signature(cls.__init__).parameters if p not in _NOT_OPTIONS and p not in locked)


def check_optimizer_options(name: str, options: Any, lr: float = 0.01, owner: str = "optimizer_options") -> dict[str, Any]:
    """``options`` for the optimizer named ``name``, checked: a mapping of option names (``option_names``;
    an unknown one is a ``ValueError`` naming the closest valid one) to values the optimizer accepts
    (checked by building it over one dummy parameter: its own message). Returns a plain dict."""
    import difflib

    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{owner} must be a dict of the optimizer's settings, e.g. {{'weight_decay': 0.1}}, got {type(options).__name__}")
    key = name.lower()
    valid = option_names(key)
    for opt in options:
        if opt in valid:
            continue
        if opt == "lr":
            raise ValueError(f"{owner}: 'lr' is TrainingConfig.learning_rate; set it there")
        if opt == "weight_decay" and key == "adam":
            raise ValueError(
                f"{owner}: 'adam' takes no weight_decay; use optimizer='adamw' for decoupled weight decay, or "
                "optimizer=functools.partial(torch.optim.Adam, weight_decay=...) for torch.optim.Adam's L2 term"
            )
        close = difflib.get_close_matches(str(opt), valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{owner}: unknown option {opt!r} for optimizer {name!r}; {hint}valid options: {', '.join(map(repr, valid))}")
    options = dict(options)
    try:
        OPTIMIZERS[key]([torch.zeros(1, requires_grad=True)], lr, **options)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{owner}: {e}") from None
    return options


def make_optimizer(spec: Any, params: Iterable[Tensor], lr: float, options: Mapping[str, Any] | None = None) -> Optimizer:
    """An optimizer from ``train()``'s ``optimizer`` setting:

    * a name of ``OPTIMIZERS`` (``"sgd"``, ``"momentum"``, ``"adam"``, ``"adamw"``, ``"rmsprop"``),
      built over ``params`` with ``lr`` and ``options`` (``TrainingConfig.optimizer_options``);
    * an ``Optimizer`` instance, returned as is (its own ``lr`` applies);
    * a callable ``factory(params) -> Optimizer`` (an optimizer class, or ``functools.partial(
      torch.optim.AdamW, weight_decay=0.1)``), called with the list of parameters."""
    if isinstance(spec, Optimizer):
        return spec
    if isinstance(spec, str):
        key = spec.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {spec!r}; valid names: {', '.join(map(repr, OPTIMIZERS))}, a torch.optim.Optimizer instance or a factory")
        return OPTIMIZERS[key](list(params), lr, **check_optimizer_options(key, options, lr))
    if callable(spec):
        built = spec(list(params))
        if not isinstance(built, Optimizer):
            raise TypeError(f"optimizer: the factory {_name(spec)} returned {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    raise TypeError(
        f"optimizer must be a name ({', '.join(OPTIMIZERS)}), a torch.optim.Optimizer or a factory params -> Optimizer, "
        f"got {type(spec).__name__}"
    )


def _name(factory: Any) -> str:
    """``functools.partial(AdamW, ...)`` or the callable's name, for messages."""
    func = getattr(factory, "func", None)
    if func is not None:
        return f"functools.partial({getattr(func, '__qualname__', type(func).__name__)}, ...)"
    return getattr(factory, "__qualname__", type(factory).__name__)


# ------------------------------------------------------------------------------- flat layout
def rehome(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` as consecutive views of one new buffer (same values)."""
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    views, offset = [], 0
    for t in tensors:
        view = buf[offset : offset + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += t.numel()
    return views


@torch.no_grad()
def flatten_optimizer_(optimizer: Optimizer, *, grads: bool = True) -> None:
    """Lay each param group's parameters, their gradients (``grads=True``: zeros where absent) and
    their per-parameter state back to back, one buffer per group and kind, as views holding the same
    values. torchloom's fused updates and the gradient norm then treat a whole group as one tensor:
    one launch per group instead of one per parameter (``kernels._update.coalesce``).

    Parameters keep their identity (``p.data`` is re-pointed), so the model and the optimizer see
    the same objects. State tensors shaped like their parameter are re-homed; per-parameter step
    counts (AdamW) that are equal become one shared tensor (read once on the host here). Groups
    mixing dtypes or devices, or with a single parameter, are left as they are. Call it again after
    the optimizer's first step to lay out state created lazily; code that later replaces ``p.grad``
    or a state tensor undoes the layout harmlessly (the updates then go tensor by tensor)."""
    for group in optimizer.param_groups:
        params = list(group["params"])
        if len(params) < 2 or any(p.dtype != params[0].dtype or p.device != params[0].device for p in params):
            continue
        if not _flat_already(params):
            for p, view in zip(params, rehome([p.data for p in params])):
                p.data = view
        if grads and not _flat_already([p.grad for p in params]):
            current = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            for p, view in zip(params, rehome(current)):
                p.grad = view
        states = [optimizer.state.get(p, {}) for p in params]
        for key in states[0]:
            values = [st.get(key) for st in states]
            if not all(isinstance(v, Tensor) for v in values):
                continue
            if all(v.shape == p.shape and v.device == p.device for v, p in zip(values, params)):
                if not _flat_already(values):
                    for st, view in zip(states, rehome(values)):
                        st[key] = view
            elif all(v.dim() == 0 for v in values) and all(bool(torch.equal(v, values[0])) for v in values):
                for st in states:  # equal scalars, e.g. AdamW's step count: one shared tensor
                    st[key] = values[0]


def _flat_already(tensors: list[Tensor | None]) -> bool:
    from ..kernels._update import coalesce

    return coalesce(tensors) is not None
