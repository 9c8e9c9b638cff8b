"""``summary(model, input_shape)``: a table of a model's layers, their output shapes and parameters
(Keras' ``model.summary()``, torchinfo's ``summary``), for a torchloom ``Network`` or any ``nn.Module``.

::

    print(torchloom.summary(net, (1, 784)))

    Layer          Type     Output shape  Params
    -------------  -------  ------------  ------
    layers.0       Dense    [1, 128]      100,480
    layers.1       Dense    [1, 10]       1,290
    ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["summary"]


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a row describes: those without children, and torchloom's ``ModuleLayer`` wrappers
    as their wrapped module (the user's own block is one row, under its own type's name)."""
    from .module_layer import ModuleLayer

    rows: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, ModuleLayer):
            rows.append((prefix, module))
            return
        if not children:
            rows.append((prefix, module))
            return
        for name, child in children:
            visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return rows


def _shape_text(out: Any) -> str:
    if isinstance(out, Tensor):
        return str(list(out.shape))
    if isinstance(out, (tuple, list)):
        return "(" + ", ".join(_shape_text(o) for o in out) + ")"
    return type(out).__name__


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if (not isinstance(shape, (tuple, list, torch.Size)) or not shape
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)):
        raise ValueError(
            "summary: input_shape must be the shape of one input batch including the batch dimension, e.g. "
            f"(1, 784), or a list of such shapes for a model of several inputs; got {shape!r}"
        )
    return tuple(shape)


def summary(
    model: nn.Module,
    input_shape: Sequence[int] | Sequence[Sequence[int]],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> str:
    """A table of ``model``'s layers, one row per leaf module: its name (the attribute path), type,
    output shape for an input of ``input_shape`` and its parameter count, then the totals (all and
    trainable parameters). Returns the table as a ``str`` (``print`` it).

    Args:
        model: a torchloom ``Network`` (its layers; a plain module inside it as one row under its own
            type) or any ``nn.Module``.
        input_shape: the shape of one input batch **including the batch dimension**, ``(1, 784)``
            (torchinfo's convention); a list of shapes ``[(1, 3), (1, 4)]`` for a model of several
            inputs (``model(*inputs)``).
        dtype: the input's dtype (default: the model's first floating parameter's dtype, else
            float32); an integer dtype for an ``Embedding`` model's token ids (zeros are used).
        device: where the forward runs (default: the model's device).

    The forward runs once on zeros, in eval mode without gradients; every submodule's mode is put
    back after. Raises ``ValueError`` for a bad ``input_shape`` and ``TypeError`` for a model that is
    not an ``nn.Module``; a model that cannot take the input raises its own error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"summary: model must be a torch.nn.Module (e.g. a torchloom Network), got {type(model).__name__}")
    several = isinstance(input_shape, (list, tuple)) and bool(input_shape) and all(isinstance(s, (list, tuple, torch.Size)) for s in input_shape)
    shapes = [_check_shape(s) for s in input_shape] if several else [_check_shape(input_shape)]
    params = list(model.parameters())
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    if dtype is None:
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    inputs = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]

    rows = _leaves(model)
    outputs: dict[int, Any] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, i=i: outputs.__setitem__(i, out)) for i, (_, m) in enumerate(rows)]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            if several:
                from .network import Network

                model(tuple(inputs)) if isinstance(model, Network) else model(*inputs)
            else:
                model(inputs[0])
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes:
            m.training = mode

    table = [("Layer", "Type", "Output shape", "Params")]
    for i, (name, module) in enumerate(rows):
        wrapped = getattr(module, "module", module) if type(module).__name__ == "ModuleLayer" else module
        count = sum(p.numel() for p in module.parameters())
        shape = _shape_text(outputs[i]) if i in outputs else "(not called)"
        table.append((name or "(model)", type(wrapped).__name__, shape, f"{count:,}"))
    widths = [max(len(r[c]) for r in table) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table[:1]]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table[1:]]
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    lines.append("")
    lines.append(f"Total params: {total:,}")
    lines.append(f"Trainable params: {trainable:,}")
    lines.append(f"Non-trainable params: {total - trainable:,}")
    return "\n".join(lines)
