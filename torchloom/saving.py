"""``load_checkpoint``: a trained model back from a checkpoint file in one call, for inference.

    model = torchloom.load_checkpoint("best.pt", model=MyNet())   # any model: the weights loaded into it
    net = torchloom.load_checkpoint("best.pt")                      # a torchloom Network: rebuilt without its code

A full-state checkpoint (``Checkpoint(path)``, the default) records, besides the run, a description
of a torchloom ``Network`` under ``"network"``: Loom's network JSON (``to_loom_json``) without the
weights, extended by one field Loom lacks (``"bias": true`` on a Dense or convolution that has one),
and the parameters' dtype. ``load_checkpoint(path)`` rebuilds the network from it (as
``from_loom_json`` does) and loads the weights, like Keras' ``load_model``. The description is made
when the checkpoint is first written, from the network's layers (and, for convolutions and RNNs,
whose sizes Loom's JSON fixes, the shape of the training inputs); it holds no weights, so it costs
next to nothing. A network Loom's JSON cannot describe (a plain ``nn.Module`` inside it, exact GELU,
...) gets the reason instead, and ``load_checkpoint(path)`` without a model says it and asks for the
model; so does a description that rebuilds other parameters (names, shapes, dtypes) than the file's
weights (a ``Flatten`` in a place Loom's JSON has none for, say).

Files are read with ``torch.load(weights_only=True)`` and the description through the Loom JSON
reader, which treats it as untrusted data: a checkpoint never runs code.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ._weights_file import is_full_state, load_weights, read_checkpoint, weights_of
from .interop import loom_dict
from .interop._codec import parse_spec
from .interop._convert import build_network
from .layers.module_layer import ModuleLayer
from .layers.network import Network

__all__ = ["NETWORK_FORMAT", "load_checkpoint", "describe_network", "rebuild_network"]

NETWORK_FORMAT = "torchloom-network-1"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _biased(layers: Any, where: str, out: set[str]) -> None:
    """The layers (named as the Loom JSON reader names them: ``layers[0].sequential_layers[1]``)
    whose description says ``"bias": true``."""
    for i, d in enumerate(layers if isinstance(layers, list) else []):
        if not isinstance(d, dict):
            continue  # the reader reports it
        here = f"{where}[{i}]"
        bias = d.get("bias", False)
        if not isinstance(bias, bool):
            raise ValueError(f"network description: {here}: 'bias' must be true or false, got {bias!r}")
        if bias:
            out.add(here)
        _biased(d.get("sequential_layers"), f"{here}.sequential_layers", out)
        _biased(d.get("parallel_branches"), f"{here}.parallel_branches", out)


def rebuild_network(description: dict[str, Any], *, max_parameters: int | None = None) -> Network:
    """The ``Network`` a description (``describe_network``) names, with fresh weights.
    ``ValueError`` / ``TypeError`` naming the field for a damaged description."""
    if not isinstance(description, dict) or description.get("format") != NETWORK_FORMAT:
        raise ValueError(f"network description: expected a dict of format {NETWORK_FORMAT!r}, got {description!r:.200}")
    if "unavailable" in description:
        raise ValueError(f"network description: none was recorded ({description['unavailable']})")
    dtype = _DTYPES.get(description.get("dtype"))
    if dtype is None:
        raise ValueError(f"network description: dtype must be one of {sorted(_DTYPES)}, got {description.get('dtype')!r}")
    loom = description.get("loom")
    biased: set[str] = set()
    _biased(loom.get("layers") if isinstance(loom, dict) else None, "layers", biased)
    spec = parse_spec(loom, **({} if max_parameters is None else {"max_parameters": max_parameters}))
    return build_network(spec, dtype, "gelu_tanh", frozenset(biased))


def _layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def describe_network(net: Network, example_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """What a checkpoint records to rebuild ``net`` (see the module docstring): ``{"format",
    "loom", "dtype"}``, or ``{"format", "unavailable": reason}`` when Loom's JSON cannot describe it.
    ``example_shape`` (``[batch, ...]`` of a training input) gives convolutions and RNNs their sizes;
    it is used only when the network cannot be described without it. Never raises for a network it
    cannot describe."""
    params = list(net.parameters())
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        return {"format": NETWORK_FORMAT, "unavailable": f"its parameters have several dtypes {sorted(map(str, dtypes))}"}
    dtype = dtypes.pop() if dtypes else torch.float32
    name = next((k for k, v in _DTYPES.items() if v == dtype), None)
    if name is None:
        return {"format": NETWORK_FORMAT, "unavailable": f"its parameters are {dtype}"}
    plain = next((m.module for m in net.modules() if isinstance(m, ModuleLayer)), None)
    if plain is not None:
        return {"format": NETWORK_FORMAT, "unavailable": f"it contains a plain nn.Module ({type(plain).__name__}), whose code a checkpoint does not carry"}
    loom, why = None, ""
    for example in (None, example_shape) if example_shape is not None else (None,):
        try:
            loom = loom_dict(net, example, description=True)
            break
        except (ValueError, TypeError) as e:
            why = str(e).replace("to_loom_json: ", "")
    if loom is None:
        return {"format": NETWORK_FORMAT, "unavailable": f"Loom's network JSON cannot describe it: {why}"}
    return {"format": NETWORK_FORMAT, "loom": loom, "dtype": name}


def load_checkpoint(path: str | os.PathLike, model: nn.Module | None = None, *, map_location: Any = "cpu") -> nn.Module:
    """The model of a checkpoint file, with its weights, in eval mode, ready for inference.

    Args:
        path: a file written by ``Checkpoint`` (the best epoch's with ``save_best_only=True``, the
            default), either kind (``full_state`` or not), or any file holding a ``state_dict``.
        model: the model to load the weights into (returned); any ``nn.Module`` that was trained, or
            one built the same way. ``None``: rebuild the torchloom ``Network`` the checkpoint
            describes (full-state files of networks Loom's JSON can describe; see the module docstring).
        map_location: where the file's tensors are read to (``torch.load``'s); a given model keeps
            its own device and dtype, the weights are copied into it.

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for a file that is not a
    checkpoint, for weights that do not fit ``model`` (naming the missing and unexpected keys), and,
    with ``model=None``, for a file that does not describe its network (saying why, and to pass the
    model); ``TypeError`` for a ``model`` that is not an ``nn.Module``.
    """
    owner = "load_checkpoint"
    state = read_checkpoint(path, owner, map_location)
    path = os.fspath(path)
    weights = weights_of(state, path, owner)
    if model is None:
        description = state.get("network") if is_full_state(state) else None
        if not is_full_state(state):
            why = "it holds a state_dict alone (Checkpoint(full_state=False), or model.state_dict())"
        elif description is None:
            why = "it was written before checkpoints described their network"
        elif isinstance(description, dict) and "unavailable" in description:
            why = description["unavailable"]
        else:
            why = ""
        if why:
            raise ValueError(
                f"{owner}: cannot rebuild the model of {path!r} without its code: {why}; pass the model to "
                f"load the weights into: load_checkpoint({path!r}, model=<the model, built as for training>)"
            )
        model = rebuild_network(description, max_parameters=max(sum(v.numel() for v in weights.values()), 1))
        mine, theirs = _layout(model), {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
        if mine != theirs:  # e.g. a Flatten the description has no place for
            diff = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs[k]]
            raise ValueError(
                f"{owner}: cannot rebuild the model of {path!r} without its code: the network it describes has other "
                f"parameters than the weights it holds (first: {diff[0]!r}); pass the model to load the weights into: "
                f"load_checkpoint({path!r}, model=<the model, built as for training>)"
            )
    return load_weights(model, weights, path, owner)
