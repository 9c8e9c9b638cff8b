"""Optimizers (SPEC §6) as ``torch.optim.Optimizer`` subclasses, and the names ``train()`` accepts.

Each optimizer's step is one functional entry that updates a whole group; numerics match
``torch.optim`` with the same settings (the test reference). ``clip_value > 0`` clamps every gradient
element to ``±clip_value`` inside the update (Loom ``poly``'s per-element clip).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["SGD", "make_optimizer", "OPTIMIZERS", "sgd_step"]


def _check_number(owner: str, name: str, value: Any, *, low: float = 0.0, low_inclusive: bool = True, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value < high
    if not ok:
        bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")


@torch.no_grad()
def sgd_step(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    clip_value: float,
) -> None:
    """SGD as ``torch.optim.SGD``: ``g = clip(g) + wd·w``; with momentum ``v = μv + (1−dampening)g``
    (``v = g`` on the first step, as torch), ``g = g + μv`` for Nesterov else ``v``; ``w −= lr·g``.
    Updates ``params`` and ``momentum_buffers`` in place (a ``None`` buffer is created)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        if clip_value > 0:
            g = g.clamp(-clip_value, clip_value)
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if buf is None:
                buf = momentum_buffers[i] = g.detach().clone()
            else:
                buf.mul_(momentum).add_(g, alpha=1.0 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)


class SGD(Optimizer):
    """Stochastic gradient descent, optionally with momentum (SPEC §6).

    Args: ``lr`` (> 0), ``momentum`` μ (>= 0), ``dampening``, ``nesterov`` (needs μ > 0 and
    dampening 0), ``weight_decay`` (L2, added to the gradient), ``clip_value`` (per-element clip, 0 = off).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.01,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        clip_value: float = 0.0,
    ) -> None:
        _check_number("SGD", "lr", lr, low_inclusive=False)
        _check_number("SGD", "momentum", momentum)
        _check_number("SGD", "dampening", dampening)
        _check_number("SGD", "weight_decay", weight_decay)
        _check_number("SGD", "clip_value", clip_value)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD: nesterov needs momentum > 0 and dampening 0, got momentum={momentum}, dampening={dampening}")
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay, clip_value=clip_value
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                params.append(p)
                grads.append(p.grad)
                bufs.append(self.state[p].get("momentum_buffer"))
            if not params:
                continue
            sgd_step(
                params,
                grads,
                bufs,
                lr=group["lr"],
                momentum=group["momentum"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                clip_value=group["clip_value"],
            )
            if group["momentum"] != 0:
                for p, buf in zip(params, bufs):
                    self.state[p]["momentum_buffer"] = buf
        return loss


# train()'s optimizer names → factory(params, lr)
OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {
    "sgd": lambda params, lr: SGD(params, lr=lr),
    "momentum": lambda params, lr: SGD(params, lr=lr, momentum=0.9),
}


def make_optimizer(spec: str | Optimizer, params: Iterable[Tensor], lr: float) -> Optimizer:
    """An optimizer from ``train()``'s ``optimizer`` setting: a name of ``OPTIMIZERS`` (built over
    ``params`` with ``lr``) or an ``Optimizer`` instance, returned as is (its own ``lr`` applies)."""
    if isinstance(spec, Optimizer):
        return spec
    if isinstance(spec, str):
        key = spec.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {spec!r}; valid names: {', '.join(map(repr, OPTIMIZERS))} or a torch.optim.Optimizer instance")
        return OPTIMIZERS[key](list(params), lr)
    raise TypeError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or a torch.optim.Optimizer, got {type(spec).__name__}")
