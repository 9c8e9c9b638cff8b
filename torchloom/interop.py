"""Moving networks between Loom and torchloom (SPEC §12).

* ``from_loom_json(cfg)`` builds a ``Network`` from Loom's JSON: the build schema of
  ``BuildNetworkFromJSON`` (``depth, rows, cols, layers_per_cell, layers[{z, y, x, l, type,
  activation, input_height, output_height, ...}]``) or Loom's saved-network JSON, which adds each
  layer's ``"weights"`` (base64 little-endian float32, ``[out, in]`` row-major).
* ``to_loom_json(net)`` writes the saved-network JSON; ``save_loom`` / ``load_loom`` do the same
  with a file.

Layers run in Loom's flat order ``((z·rows + y)·cols + x)·layers_per_cell + l``. Loom's ``poly`` Dense
has no bias, so only ``bias=False`` Dense layers can be written. Loom's ``GELU`` is the tanh
approximation and imports as ``"gelu_tanh"`` (PARITY.md). An unknown layer type or activation is a
``ValueError`` (Loom silently falls back).
"""

from __future__ import annotations

import base64
import json
import os
import numpy as np
import torch

from .layers.dense import Dense
from .layers.network import Network

__all__ = ["from_loom_json", "to_loom_json", "load_loom", "save_loom"]

# Loom activation spelling (upper-cased) → torchloom name. Loom's GELU is the tanh form.
_ACT_FROM_LOOM = {
    "RELU": "relu",
    "SILU": "silu",
    "GELU": "gelu_tanh",
    "TANH": "tanh",
    "SIGMOID": "sigmoid",
    "LEAKYRELU": "leaky_relu",
    "LEAKY_RELU": "leaky_relu",
    "RELU2": "relu2",
    "LINEAR": "linear",
    "": "linear",  # Loom's zero value
}
# torchloom name → Loom's spelling in saved files
_ACT_TO_LOOM = {
    "relu": "ReLU",
    "silu": "Silu",
    "gelu_tanh": "GELU",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
    "leaky_relu": "LeakyReLU",
    "relu2": "ReLU2",
    "linear": "Linear",
}
_SUPPORTED_TYPES = ("dense",)


def _as_spec(cfg: str | bytes | dict | os.PathLike) -> dict:
    if isinstance(cfg, dict):
        return cfg
    if isinstance(cfg, os.PathLike):
        with open(cfg, encoding="utf-8") as f:
            return json.load(f)
    if isinstance(cfg, (str, bytes)):
        try:
            return json.loads(cfg)
        except json.JSONDecodeError as e:
            raise ValueError(f"from_loom_json: cfg is not valid JSON ({e}); pass a dict, a JSON string or a path") from None
    raise TypeError(f"from_loom_json: cfg must be a dict, a JSON string or a path, got {type(cfg).__name__}")


def _grid_int(spec: dict, key: str) -> int:
    v = spec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"from_loom_json: {key!r} must be an int >= 1, got {v!r}")
    return v


def _decode_weights(b64: str, shape: tuple[int, int], where: str) -> torch.Tensor:
    raw = base64.b64decode(b64)
    w = np.frombuffer(raw, dtype="<f4")
    if w.size != shape[0] * shape[1]:
        raise ValueError(f"from_loom_json: {where}: 'weights' holds {w.size} floats, expected {shape[0]}×{shape[1]} = {shape[0] * shape[1]}")
    return torch.from_numpy(w.copy()).view(*shape)


def from_loom_json(cfg: str | bytes | dict | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Network:
    """Build a ``Network`` from Loom's architecture or saved-network JSON (a dict, a JSON string or a
    path). Layers with ``"weights"`` get them; others keep torchloom's initialisation. Disabled
    layers (``"is_disabled": true``) are skipped, as Loom's forward skips them."""
    spec = _as_spec(cfg)
    depth, rows, cols, lpc = (_grid_int(spec, k) for k in ("depth", "rows", "cols", "layers_per_cell"))
    entries = spec.get("layers")
    if not isinstance(entries, list) or not entries:
        raise ValueError("from_loom_json: 'layers' must be a non-empty list")
    cells: dict[int, dict] = {}
    for n, ls in enumerate(entries):
        pos = tuple(ls.get(k, 0) for k in ("z", "y", "x", "l"))
        z, y, x, l = pos
        if not (0 <= z < depth and 0 <= y < rows and 0 <= x < cols and 0 <= l < lpc):
            raise ValueError(f"from_loom_json: layer {n} at (z,y,x,l)={pos} lies outside the grid {depth}×{rows}×{cols}×{lpc}")
        flat = ((z * rows + y) * cols + x) * lpc + l
        if flat in cells:
            raise ValueError(f"from_loom_json: two layers at (z,y,x,l)={pos}")
        cells[flat] = ls
    missing = depth * rows * cols * lpc - len(cells)
    if missing:
        raise ValueError(f"from_loom_json: {missing} grid cell(s) have no layer; Loom needs every cell listed")

    layers = []
    for flat in sorted(cells):
        ls = cells[flat]
        where = f"layer at (z,y,x,l)=({ls.get('z', 0)},{ls.get('y', 0)},{ls.get('x', 0)},{ls.get('l', 0)})"
        if ls.get("is_disabled"):
            continue
        kind = str(ls.get("type", "")).lower()
        if kind not in _SUPPORTED_TYPES:
            raise ValueError(f"from_loom_json: {where}: layer type {ls.get('type')!r} is not supported; supported: {_SUPPORTED_TYPES}")
        act_name = str(ls.get("activation", "")).upper()
        if act_name not in _ACT_FROM_LOOM:
            raise ValueError(
                f"from_loom_json: {where}: unknown activation {ls.get('activation')!r}; Loom spellings: "
                f"{sorted(k for k in _ACT_FROM_LOOM if k)}"
            )
        n_in, n_out = ls.get("input_height"), ls.get("output_height")
        if not all(isinstance(v, int) and v >= 1 for v in (n_in, n_out)):
            raise ValueError(f"from_loom_json: {where}: input_height and output_height must be ints >= 1, got {n_in!r}, {n_out!r}")
        layer = Dense(n_in, n_out, _ACT_FROM_LOOM[act_name], bias=False, dtype=dtype)
        if ls.get("weights"):
            with torch.no_grad():
                layer.weight.copy_(_decode_weights(ls["weights"], (n_out, n_in), where))
        layers.append(layer)
    if not layers:
        raise ValueError("from_loom_json: every layer is disabled")
    return Network(*layers)


def to_loom_json(net: Network) -> dict:
    """Loom's saved-network JSON for ``net`` (one grid row, one layer per cell). Every layer must be
    a ``bias=False`` Dense with an activation Loom knows (Loom's Dense has no bias, and its GELU is
    ``"gelu_tanh"``)."""
    if not isinstance(net, Network):
        raise TypeError(f"to_loom_json: net must be a torchloom Network, got {type(net).__name__}")
    layers = []
    for i, layer in enumerate(net):
        if not isinstance(layer, Dense):
            raise ValueError(f"to_loom_json: layer {i} is {layer.loom_type}; only Dense layers can be written to Loom's JSON")
        if layer.bias is not None:
            raise ValueError(f"to_loom_json: layer {i} (Dense) has a bias; Loom's Dense has none (use bias=False)")
        act = _ACT_TO_LOOM.get(layer.activation.name)
        if act is None:
            raise ValueError(f"to_loom_json: layer {i} uses activation {layer.activation.name!r}, which Loom does not have (it has {sorted(_ACT_TO_LOOM)})")
        w = layer.weight.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4")
        layers.append(
            {
                "z": 0, "y": 0, "x": i, "l": 0,
                "type": "Dense",
                "activation": act,
                "dtype": "float32",
                "input_height": layer.in_features,
                "output_height": layer.out_features,
                "weights": base64.b64encode(w.tobytes()).decode("ascii"),
            }
        )
    return {"id": "torchloom", "depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1, "layers": layers}


def save_loom(net: Network, path: str | os.PathLike) -> None:
    """Write ``to_loom_json(net)`` to ``path``."""
    spec = to_loom_json(net)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=2)


def load_loom(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Network:
    """Read a Loom saved-network JSON file into a ``Network``."""
    with open(path, encoding="utf-8") as f:
        return from_loom_json(json.load(f), dtype=dtype)
