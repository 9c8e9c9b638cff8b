"""Per-layer events: ``LayerStats`` of what a layer produced, sent to the observers'
``on_layer_forward(event)`` / ``on_layer_backward(event)``.

* **forward event**: statistics of the layer's **output** (after its activation), whole batch;
* **backward event**: statistics of the gradient of the loss w.r.t. the layer's **input**, i.e.
  what the layer's backward hands on to the layer below. This is what Loom measures: its ``nn``
  package, the only Loom code that emits these events, calls ``notifyObserver(..., gradInput)``
  right after each layer's backward (``legacy/nn/backward.go``, ``step_backward.go``); ``poly``
  defines the same event (``observer.go``) but never emits it. Events come last layer first.

Each event carries the layer's index, its grid position ``(z, y, x, l)`` — a plain chain is one row
of cells, layer ``i`` at ``(0, 0, i, 0)`` — its type name (``layer.loom_type``) and the trainer's
step; its ``LayerStats`` are computed when an observer first reads ``event.stats``. Nothing here runs
unless an observer implements one of the two hooks: ``LayerEvents.for_trainer(trainer)`` is ``None``
otherwise and the trainers keep their lean path (no history, no statistics, no host sync).

How a trainer emits events from its own step::

    events = LayerEvents.for_trainer(self)              # None: nobody listens
    if events is None:
        out, saved = self.model.forward_saved(x)        # lean path
    else:
        out = events.run_forward(self.model, x)         # forward_record + one event per layer
    ...
    grads = events.run_backward(self.model, grad_out)   # Network.backward + one event per layer

or, for a step that walks the layers itself, ``events.forward(i, layer, output)`` and
``events.backward(i, layer, grad_at_input)`` per layer (each does nothing for a hook nobody wants).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import torch
from torch import Tensor

from .base import ObserverList

__all__ = ["ACTIVE_THRESHOLD", "LayerStats", "LayerEvent", "LayerEvents", "layer_stats", "chain_position"]

# |v| above this counts as active (Loom poly's ComputeLayerStats).
ACTIVE_THRESHOLD = 1e-6


@dataclass(frozen=True)
class LayerStats:
    """Summary of one tensor: mean ``avg``, population ``std``, ``min``, ``max``, ``active`` (count
    of elements with ``|v| > 1e-6``) and ``total`` (element count). Loom poly's ``LayerStats``."""

    avg: float
    std: float
    min: float
    max: float
    active: int
    total: int


@torch.no_grad()
def layer_stats(t: Tensor) -> LayerStats:
    """``LayerStats`` of every element of ``t`` (any shape), computed in float64 on ``t``'s device and
    read back in one host sync. An empty tensor gives all zeros (as Loom)."""
    n = t.numel()
    if n == 0:
        return LayerStats(0.0, 0.0, 0.0, 0.0, 0, 0)
    v = t.detach().reshape(-1).double()
    var, mean = torch.var_mean(v, correction=0)  # population variance, as Loom's E[x²] − avg²
    active = (v.abs() > ACTIVE_THRESHOLD).sum().double()
    avg, std, lo, hi, act = torch.stack([mean, var.sqrt(), v.min(), v.max(), active]).tolist()
    return LayerStats(avg, std, lo, hi, int(act), n)


def chain_position(index: int) -> tuple[int, int, int, int]:
    """Grid position ``(z, y, x, l)`` of layer ``index`` of a plain chain: one row of cells."""
    return (0, 0, index, 0)


@dataclass(frozen=True)
class LayerEvent:
    """One per-layer event (Loom's ``PolyLayerEvent``).

    ``kind``: ``"forward"`` or ``"backward"``; ``index``: the layer's index in the network;
    ``position``: grid position ``(z, y, x, l)``; ``layer_type``: e.g. ``"Dense"``; ``step``: the
    trainer's 0-based global step; ``tensor``: what is measured — the layer output ``[batch, ...]``
    (forward) or the gradient w.r.t. the layer input, of the input's shape (backward); a reference,
    not a copy: read it inside the hook. ``stats``: the ``LayerStats`` of ``tensor``, computed on
    first access (so an observer that skips a step, like ``ConsoleObserver(every=100)``, costs no
    statistics and no host sync on that step)."""

    kind: str
    index: int
    position: tuple[int, int, int, int]
    layer_type: str
    step: int
    tensor: Tensor = field(repr=False)

    @cached_property
    def stats(self) -> LayerStats:
        return layer_stats(self.tensor)

    @property
    def z(self) -> int:
        return self.position[0]

    @property
    def y(self) -> int:
        return self.position[1]

    @property
    def x(self) -> int:
        return self.position[2]

    @property
    def l(self) -> int:  # noqa: E743 (Loom's name for the layer slot within a cell)
        return self.position[3]


def _type_name(layer: Any) -> str:
    return getattr(layer, "loom_type", type(layer).__name__)


class LayerEvents:
    """Builds and sends the per-layer events of one step.

    Args:
        observers: an ``ObserverList`` or any iterable of observers.
        step: the step number the events carry (a trainer passes its ``global_step``).
    """

    def __init__(self, observers: ObserverList | Iterable[Any], step: int = 0) -> None:
        self.observers = observers if isinstance(observers, ObserverList) else ObserverList(observers)
        self.step = step
        self.wants_forward = self.observers.wants("on_layer_forward")
        self.wants_backward = self.observers.wants("on_layer_backward")

    @classmethod
    def for_trainer(cls, trainer: Any) -> "LayerEvents | None":
        """Events for ``trainer``'s current step, or ``None`` when no observer of the trainer
        implements ``on_layer_forward`` / ``on_layer_backward`` (then skip all of this)."""
        observers = getattr(trainer, "observers", None)
        if not isinstance(observers, ObserverList):
            return None
        if not (observers.wants("on_layer_forward") or observers.wants("on_layer_backward")):
            return None
        return cls(observers, getattr(trainer, "global_step", 0))

    # ------------------------------------------------------------ one layer
    def forward(self, index: int, layer: Any, output: Tensor, position: tuple[int, int, int, int] | None = None) -> None:
        """Send the forward event of layer ``index`` whose output is ``output``."""
        if self.wants_forward:
            self.observers("on_layer_forward", self._event("forward", index, layer, output, position))

    def backward(self, index: int, layer: Any, grad_input: Tensor | None, position: tuple[int, int, int, int] | None = None) -> None:
        """Send the backward event of layer ``index``; ``grad_input`` is the gradient of the loss
        w.r.t. that layer's input (what its backward returns). ``None`` — an input without a
        gradient, such as an Embedding's integer ids — sends no event: there is nothing to measure."""
        if self.wants_backward and grad_input is not None:
            self.observers("on_layer_backward", self._event("backward", index, layer, grad_input, position))

    def _event(self, kind: str, index: int, layer: Any, t: Tensor, position: tuple[int, int, int, int] | None) -> LayerEvent:
        return LayerEvent(
            kind=kind,
            index=index,
            position=chain_position(index) if position is None else position,
            layer_type=_type_name(layer),
            step=self.step,
            tensor=t,
        )

    # ------------------------------------------------------ whole network
    def on_forward_record(self, index: int, layer: Any, record: Any) -> None:
        """``Network.forward_record``'s ``on_layer`` callback: the forward event of that layer."""
        self.forward(index, layer, record.output)

    def run_forward(self, model: Any, x: Tensor) -> Tensor:
        """``model.forward_record(x)`` (records the history ``run_backward`` needs) with one forward
        event per layer, first layer first. Returns the network output."""
        return model.forward_record(x, on_layer=self.on_forward_record if self.wants_forward else None)

    def run_backward(self, model: Any, grad_output: Tensor) -> tuple[Tensor, ...]:
        """``model.backward(grad_output)`` after ``run_forward``, with one backward event per layer,
        last layer first. Returns the parameter gradients in ``model.parameters()`` order (also
        stored in ``.grad``).

        ``Network.backward``'s callback sees the gradient at each layer's *output*; the gradient at
        the input of layer ``i+1`` is the one at the output of layer ``i``, so each event is sent one
        callback later, and the first layer's from the returned input gradient (computed only here,
        where someone reads it)."""
        if not self.wants_backward:
            model.backward(grad_output)
        else:
            layers = model.layers

            def on_layer(i: int, layer: Any, grad_at_output: Tensor) -> None:
                if i + 1 < len(layers):
                    self.backward(i + 1, layers[i + 1], grad_at_output)

            grad_input = model.backward(grad_output, input_grad=True, on_layer=on_layer)
            self.backward(0, layers[0], grad_input)
        return tuple(p.grad for p in model.parameters())
