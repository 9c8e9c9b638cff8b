"""``Sequential`` (a chain of torchloom layers) and ``Network`` (Loom's network: a chain that can
record per-layer history and offers Loom's manual-loop API).

Two ways to run a ``Network``:

* **autograd mode** (default): ``net(x)`` chains the layers' ``autograd.Function``s, so
  ``loss.backward()`` and any ``torch.optim`` optimizer work as with any ``nn.Module``;
* **Loom mode** (``Network(..., record_history=True)`` or ``net.forward_record(x)``): the forward runs
  the explicit path without an autograd graph and records every layer's input, pre-activation and
  output (``net.history``); ``net.backward(grad_output)`` then fills ``.grad`` through the hand-written
  backward, and ``apply_gradients`` / ``clip_gradients`` finish Loom's loop::

      net = Network(Dense(4, 8, "relu"), Dense(8, 1), record_history=True)
      out = net(x)
      net.backward(torchloom.loss_gradient(out, y, "mse"))
      net.clip_gradients(1.0)
      net.apply_gradients(lr=0.01)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.compiler import is_compiling

from .base import Layer, LayerRecord, gather_param_grads

__all__ = ["Sequential", "Network", "chain_of"]

# Called once per layer by the recording paths: (index, layer, record_or_grad) — used by observers.
LayerCallback = Callable[[int, Layer, Any], None]


def _as_layer_list(layers: tuple[Any, ...], owner: str) -> list[Layer]:
    if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
        layers = tuple(layers[0])
    if len(layers) == 1 and isinstance(layers[0], Iterator):
        layers = tuple(layers[0])
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Module) and not isinstance(layer, Layer):
            from .module_layer import ModuleLayer

            layer = ModuleLayer(layer)  # a plain module: its backward comes from autograd
        if not isinstance(layer, Layer):
            raise TypeError(
                f"{owner}: layer {i} must be a torchloom layer or a torch.nn.Module, got {type(layer).__name__}"
            )
        out.append(layer)
    return out


class Sequential(Layer):
    """A chain of torchloom layers; itself a layer (its backward runs the children's backwards in
    reverse). Input ``[batch, ...]`` of the first layer → output of the last."""

    def __init__(self, *layers: Layer) -> None:
        super().__init__()
        layer_list = _as_layer_list(layers, type(self).__name__)
        if not layer_list:
            raise ValueError(f"{type(self).__name__}: needs at least one layer, got none")
        self.layers = nn.ModuleList(layer_list)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward_saved(self, x: Tensor) -> tuple[Tensor, tuple[Any, ...]]:
        saved = []
        for layer in self.layers:
            x, s = layer.forward_saved(x)
            saved.append(s)
        return x, tuple(saved)

    accepts_grad_out = True

    def backward_saved(self, grad_out, saved, needs_input_grad=True, out=None):
        """The children's backwards, last first. ``out``: optional buffers aligned with
        ``parameters()``, handed to the children that take them (ignored when parameters are shared)."""
        outs = self._split_out(out)
        grads: list[tuple[Tensor, ...]] = [()] * len(self.layers)
        g = grad_out
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            if outs is not None and layer.accepts_grad_out:
                g, grads[i] = layer.backward_saved(g, saved[i], needs_input_grad or i > 0, out=outs[i])
            else:
                g, grads[i] = layer.backward_saved(g, saved[i], needs_input_grad or i > 0)
        if self._has_shared_params():
            return g, gather_param_grads(self, self.layers, grads)
        return g, tuple(pg for layer_grads in grads for pg in layer_grads)

    def _has_shared_params(self) -> bool:
        """Whether a parameter appears in more than one child (then gradients are summed per
        parameter). Found at the first backward and kept: the chain's structure is fixed by then.
        While ``torch.compile`` traces, found and not kept (a traced backward may not set attributes)."""
        shared = self.__dict__.get("_shared_params")
        if shared is None:
            shared = sum(1 for layer in self.layers for _ in layer.parameters()) != sum(1 for _ in self.parameters())
            if not is_compiling():
                self.__dict__["_shared_params"] = shared
        return shared

    def _split_out(self, out):
        """``out`` cut into one slice per child, or None when there is none or parameters repeat."""
        if out is None:
            return None
        counts = [sum(1 for _ in layer.parameters()) for layer in self.layers]
        if sum(counts) != len(out):  # a shared parameter: gradients are summed, not written in place
            return None
        outs, start = [], 0
        for c in counts:
            outs.append(tuple(out[start : start + c]))
            start += c
        return outs

    def pre_activation(self, saved):
        return None

    def reset_parameters(self) -> None:
        for layer in self.layers:
            if hasattr(layer, "reset_parameters"):
                layer.reset_parameters()


def _device_hint(model: nn.Module, x: Any) -> str | None:
    """A sentence for an input on another device than the model's (``train(use_gpu=True)`` leaves
    the model on the GPU), or ``None`` when the devices agree."""
    first = next(model.parameters(), None)
    inputs = x if isinstance(x, tuple) else (x,)
    other = next((t.device for t in inputs if isinstance(t, Tensor) and first is not None and t.device != first.device), None)
    if other is None:
        return None
    return (
        f"Network: the input is on {other} but the model is on {first.device} (training with use_gpu=True or "
        f"device= leaves the model there); move the input with x.to('{first.device}'), use torchloom.predict(net, x) "
        "(which moves each batch to the model), or bring the model back with net.cpu()"
    )


class Network(Sequential):
    """Loom's network: a ``Sequential`` that records history and has Loom's manual-loop API.

    Args:
        *layers: torchloom layers (or one list of them).
        record_history: when True, ``forward`` records ``history`` and builds no autograd graph
            (Loom mode); when False (default) ``forward`` is the ordinary autograd path.
    """

    def __init__(self, *layers: Layer, record_history: bool = False) -> None:
        super().__init__(*layers)
        if not isinstance(record_history, bool):
            raise TypeError(f"Network: record_history must be a bool, got {record_history!r}")
        self.record_history = record_history
        self.history: list[LayerRecord] | None = None

    # ---------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> Tensor:
        try:
            if self.record_history:
                return self.forward_record(x)
            return super().forward(x)
        except RuntimeError as e:
            hint = _device_hint(self, x)
            if hint is None:
                raise
            raise RuntimeError(f"{hint} ({e})") from None

    @torch.no_grad()
    def forward_record(self, x: Tensor, on_layer: LayerCallback | None = None) -> Tensor:
        """Explicit forward that records ``history``: one ``LayerRecord(input, pre, output, saved)``
        per layer. Builds no autograd graph. ``on_layer(i, layer, record)`` is called per layer."""
        history = []
        for i, layer in enumerate(self.layers):
            y, saved = layer.forward_saved(x)
            record = LayerRecord(x, layer.pre_activation(saved), y, saved)
            history.append(record)
            if on_layer is not None:
                on_layer(i, layer, record)
            x = y
        self.history = history
        return x

    @property
    def forward_acts(self) -> list[Tensor]:
        """Loom's activation list from the last recorded forward: index 0 the network input,
        ``i+1`` the output of layer ``i``."""
        history = self._require_history()
        return [history[0].input] + [r.output for r in history]

    def _require_history(self) -> list[LayerRecord]:
        if self.history is None:
            raise RuntimeError(
                "Network has no recorded forward pass: construct it with record_history=True "
                "or call net.forward_record(x) before net.backward(...)"
            )
        return self.history

    # --------------------------------------------------------------- backward
    @torch.no_grad()
    def backward(
        self,
        grad_output: Tensor,
        *,
        input_grad: bool = False,
        on_layer: LayerCallback | None = None,
    ) -> Tensor | None:
        """Hand-written backward through the recorded history; sets every parameter's ``.grad``
        (overwriting, as Loom does: no ``zero_grad`` needed).

        ``grad_output`` has the shape of the last output. Returns the gradient w.r.t. the network
        input when ``input_grad=True`` (else ``None``, which skips the first layer's input
        gradient). ``on_layer(i, layer, grad_at_output_i)`` is called per layer, last first."""
        history = self._require_history()
        out = history[-1].output
        if not isinstance(grad_output, Tensor) or grad_output.shape != out.shape:
            got = list(grad_output.shape) if isinstance(grad_output, Tensor) else type(grad_output).__name__
            raise ValueError(f"Network.backward: grad_output must have shape {list(out.shape)}, got {got}")
        g = grad_output
        grads: list[tuple[Tensor, ...]] = [()] * len(self.layers)
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            if on_layer is not None:
                on_layer(i, layer, g)
            g, grads[i] = layer.backward_saved(g, history[i].saved, input_grad or i > 0)
        for p, pg in zip(self.parameters(), gather_param_grads(self, self.layers, grads)):
            p.grad = pg
        return g

    # ----------------------------------------------------------------- update
    @torch.no_grad()
    def apply_gradients(self, lr: float) -> None:
        """Plain SGD with the stored gradients: ``p −= lr · p.grad`` (Loom ``ApplyGradients``)."""
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0 or not math.isfinite(lr):
            raise ValueError(f"apply_gradients: lr must be a finite number > 0, got {lr!r}")
        for p in self.parameters():
            if p.grad is not None:
                p.sub_(p.grad, alpha=lr)

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> float:
        """Scale all gradients so their global L2 norm is at most ``max_norm`` (Loom
        ``ClipGradients``: scale = max_norm / norm when norm > max_norm). Returns the norm before."""
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ValueError(f"clip_gradients: max_norm must be a number > 0, got {max_norm!r}")
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / norm)
        return norm

    # -------------------------------------------------------------- inspection
    @torch.no_grad()
    def gradient_stats(self) -> list[dict[str, Any]]:
        """Per layer with a weight gradient: ``{"layer", "type", "min", "max", "mean", "norm"}`` of
        that layer's weight gradient (all its parameters' gradients taken together)."""
        stats = []
        for i, layer in enumerate(self.layers):
            grads = [p.grad.reshape(-1) for p in layer.parameters() if p.grad is not None]
            if not grads:
                continue
            g = torch.cat(grads).double()
            stats.append(
                {
                    "layer": i,
                    "type": layer.loom_type,
                    "min": float(g.min()),
                    "max": float(g.max()),
                    "mean": float(g.mean()),
                    "norm": float(torch.linalg.vector_norm(g)),
                }
            )
        return stats

    def print_gradient_stats(self) -> None:
        """Print ``gradient_stats()`` as one line per layer."""
        stats = self.gradient_stats()
        if not stats:
            print("no gradients: run backward first")
            return
        for s in stats:
            print(
                f"Layer {s['layer']} ({s['type']}): min={s['min']:.6g} max={s['max']:.6g} "
                f"mean={s['mean']:.6g} norm={s['norm']:.6g}"
            )

    def extra_repr(self) -> str:
        return f"record_history={self.record_history}"

    @staticmethod
    def wrap(model: Layer | Iterable[Layer]) -> "Network":
        """``model`` as a Network: itself when it is one, else a Network around the layer(s)."""
        if isinstance(model, Network):
            return model
        if isinstance(model, Layer):
            return Network(model)
        return Network(*model)


def chain_of(model: Any) -> Network:
    """``model`` as a ``Network``: a Network as is; a torchloom layer, a list of layers and modules,
    or an ``nn.Sequential`` as the chain of its items; any other ``nn.Module`` as a one-link chain.
    Plain modules train through autograd on that module alone (``ModuleLayer``), torchloom layers
    through their hand-written backward. The parameters are the model's own (nothing is copied), so
    the chain's ``state_dict`` keys (``layers.0.module.weight``, ...) are what ``train()`` and its
    checkpoints see."""
    if isinstance(model, Network):
        return model
    if isinstance(model, Layer):
        return Network(model)
    if isinstance(model, nn.Sequential) and len(model):
        return Network(*model)
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return Network(*model)
    if isinstance(model, nn.Module):
        return Network(model)
    raise TypeError(
        f"model must be a torchloom Network, a torchloom layer, an nn.Module or a list of them, got {type(model).__name__}"
    )
