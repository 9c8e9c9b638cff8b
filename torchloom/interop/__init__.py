"""Moving networks between Loom and torchloom.

* ``from_loom_json(cfg)`` / ``load_loom(path)`` build a ``Network`` from Loom's JSON: the build schema
  of ``BuildNetworkFromJSON`` (``depth, rows, cols, layers_per_cell, layers[{z, y, x, l, type,
  activation, input_height, output_height, ...}]``) or Loom's saved-network JSON (``SerializeNetwork``),
  which adds each layer's ``"weights"`` (base64, little-endian, in the layer's ``dtype``).
* ``to_loom_json(net, example_input=...)`` / ``save_loom(net, path, ...)`` write the saved-network
  JSON (float32 weights), which Loom's ``DeserializeNetwork`` loads.

Layers run in Loom's flat order ``((z·rows + y)·cols + x)·layers_per_cell + l``; disabled layers are
skipped, as Loom's forward skips them (a disabled Parallel branch still runs, as in Loom). Loom passes
flat buffers between layers and every layer reads its input with its own sizes from the file; the
import follows the shape from layer to layer, refuses sizes that do not chain (``ValueError`` naming
both layers and their sizes) and makes Loom's reshapes explicit: a ``Flatten`` before a Dense that
follows a layer with a structured output (convolution, RNN, LSTM, Embedding, ...) and before a norm
that normalises a whole structured sample, a ``LoomReshape`` (``[B, …] → [B, C, *spatial]`` or
``[B, T, I]``) before a convolution / RNN / LSTM that follows a layer of another shape, and a
flattened output for every Parallel branch whose output is not flat (Loom joins flat per-sample
buffers). The network's first layer takes its input as the caller gives it.

Layer mapping (Loom → torchloom; weights in Loom's flat order):

==================  ============================================================================
Dense               ``Dense(in, out, bias=False)``, weights ``[out, in]``
CNN1/2/3            ``Conv1D/2D/3D(bias=False)``, weights ``[F, C, k…]``
ConvTransposed1-3D  ``ConvTranspose1D/2D/3D(bias=False)``; Loom ``[F, C, k…]`` ↔ PyTorch ``[C, F, k…]``
RNN                 ``RNN(I, H)``: ``W_ih [H, I] | W_hh [H, H] | b [H]``
LSTM                ``LSTM(I, H)``: four gate blocks i, f, g, o, each ``W_ih | W_hh | b``
MultiHeadAttention  ``MultiHeadAttention(d, H, K, causal=True, rope=True)``: ``Wq | Wk | Wv | Wo | bq |
                    bk | bv | bo`` (grouped-query heads when ``num_kv_heads < num_heads``)
SwiGLU              ``SwiGLU(h, m)``: ``W_gate [m, h] | W_up [m, h] | W_down [h, m] | b_gate | b_up | b_down``
RMSNorm/LayerNorm   ``RMSNorm(n, eps=1e-6)`` (γ) / ``LayerNorm(n, eps=1e-5)`` (γ | β)
Embedding           ``Embedding(V, E, activation=…)``, weights ``[V, E]`` (must be the first layer)
Softmax             ``Softmax(dim=-1, temperature)`` (Loom's ``Standard`` / ``Temperature``, and ``Grid``
                    with ``softmax_cols`` = the input's last dimension); ``LoomGridSoftmax(cols,
                    temperature)`` for a ``Grid`` softmax over groups of ``softmax_cols`` values
Parallel            ``Parallel(combine=…)`` for ``concat`` (also ``""``, ``grid_scatter``), ``add``, ``avg``
Sequential          ``Sequential`` (nested); a ``Residual`` inside it wraps the sub-layer before it:
                    ``Residual(prev)``. Loom's top-level Residual (no skip input), and one after a
                    sub-layer whose output has another size than its input, is an identity.
==================  ============================================================================

Weights in every dtype Loom writes (float64/32/16, bfloat16, fp8, int64…int2, uint*, fp4, ternary,
binary) are dequantised as Loom's ``GetActive`` does (``code · scale``) and cast to ``dtype``.

The loader treats the file as untrusted data: it is parsed with ``json`` (no ``NaN``/``Infinity``),
every field's type is checked (``is_disabled`` must be a JSON bool), the parameter count is computed
and capped (``max_parameters``) and every weight blob's length checked before anything is allocated;
non-finite weights, an empty ``weights`` string, a ``null`` scalar field (Loom reads it as 0 / "" /
false), malformed base64, wrong nesting and nesting deeper than 32 levels are ``ValueError`` /
``TypeError`` naming the field. Every field that changes what Loom computes is honoured or refused:
what Loom would run differently from the file's face value is refused (``ReLU2``, which Loom reads as
linear; unknown activations or layer types, which Loom silently replaces; a ``filter`` Parallel,
whose gate Loom does not save; KMeans and Metacognition layers; a convolution with ``kernel_size``
0; a ``Grid`` softmax whose groups would span samples or whose ``softmax_rows × softmax_cols`` is no
whole number of samples; an Embedding after another layer; ``add`` / ``avg`` over branches of
different sizes). A ``str`` that is neither an existing file nor JSON text of a network raises
``NotFileNorJSONError`` (a ``ValueError`` and a ``FileNotFoundError``) saying both.

Loom's ``GELU`` is the tanh approximation: it imports as ``"gelu_tanh"`` (correct derivative) or, with
``gelu="gelu_loom"``, as the opt-in activation that reproduces Loom's own GELU training arithmetic.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..layers.base import Layer
from ..layers.network import Network, Sequential
from ._codec import DEFAULT_MAX_PARAMETERS, NotFileNorJSONError, max_bytes_for, parse_spec, read_json_source
from ._convert import GELU_CHOICES, LoomGridSoftmax, LoomReshape, build_network, export_layers, requantize_layer

__all__ = [
    "from_loom_json", "to_loom_json", "load_loom", "save_loom", "LoomReshape", "LoomGridSoftmax",
    "NotFileNorJSONError", "DEFAULT_MAX_PARAMETERS",
]


def _check_import_options(dtype, gelu, max_parameters, func: str) -> None:
    if isinstance(max_parameters, bool) or not isinstance(max_parameters, int) or max_parameters < 1:
        raise ValueError(f"{func}: max_parameters must be an int >= 1, got {max_parameters!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{func}: dtype must be a floating torch.dtype, got {dtype!r}")
    if gelu not in GELU_CHOICES:
        raise ValueError(f"{func}: gelu must be one of {GELU_CHOICES}, got {gelu!r}")


def from_loom_json(
    cfg: str | bytes | dict | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    gelu: str = "gelu_tanh",
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
) -> Network:
    """Build a ``Network`` from Loom's architecture or saved-network JSON.

    Args:
        cfg: a dict, JSON text (``bytes``, or a ``str`` starting with ``{`` or ``[``), or a path (``os.PathLike``
            or any other ``str``; a ``str`` that names no file is a ``NotFileNorJSONError`` whose message
            also says what it is as JSON text).
        dtype: the parameters' dtype (weights are dequantised to it).
        gelu: what Loom's ``GELU`` becomes: ``"gelu_tanh"`` (tanh approximation with its exact
            derivative, default) or ``"gelu_loom"`` (Loom's hybrid derivative, for bit-parity with
            Loom's training).
        max_parameters: refuse a file declaring more weights than this (checked before allocating),
            or longer than such a network can be (``11·max_parameters`` bytes + 16 MiB, checked
            before reading).

    Layers with ``"weights"`` get them; a file without any ``"weights"`` (the build schema) keeps
    torchloom's initialisation. Raises ``ValueError`` / ``TypeError`` naming the bad field (and, for
    layer sizes that do not chain, both layers and their sizes), and ``FileNotFoundError`` for a
    missing path.
    """
    _check_import_options(dtype, gelu, max_parameters, "from_loom_json")
    obj = read_json_source(cfg, "from_loom_json", max_bytes=max_bytes_for(max_parameters))
    spec = parse_spec(obj, max_parameters=max_parameters)
    return build_network(spec, dtype, gelu)


def load_loom(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    gelu: str = "gelu_tanh",
    max_parameters: int = DEFAULT_MAX_PARAMETERS,
) -> Network:
    """Read a Loom JSON file (``str`` or ``os.PathLike`` path) into a ``Network``; options as
    ``from_loom_json``."""
    _check_import_options(dtype, gelu, max_parameters, "load_loom")
    obj = read_json_source(path, "load_loom", path_only=True, max_bytes=max_bytes_for(max_parameters))
    spec = parse_spec(obj, max_parameters=max_parameters)
    return build_network(spec, dtype, gelu)


def _example_shapes(net: nn.Module, example_input) -> dict[int, tuple[int, ...]]:
    """Input shape of every sub-module, recorded by running ``net`` once on the example (zeros when
    only a shape is given)."""
    if example_input is None:
        return {}
    if isinstance(example_input, Tensor):
        if example_input.dim() < 1 or example_input.shape[0] < 1:
            raise ValueError(f"to_loom_json: example_input must be [batch, ...] with batch >= 1, got {list(example_input.shape)}")
        x = example_input
    elif isinstance(example_input, (Sequence, torch.Size)) and not isinstance(example_input, (str, bytes)):
        shape = tuple(example_input)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"to_loom_json: example_input as a shape must be a non-empty sequence of ints >= 1, got {example_input!r}")
        from ..layers.embedding import Embedding

        leaves = (m for m in net.modules() if isinstance(m, Layer) and not any(isinstance(c, Layer) and c is not m for c in m.modules()))
        first = next(leaves, None)
        p = next(net.parameters(), None)
        if isinstance(first, Embedding):
            x = torch.zeros(shape, dtype=torch.long, device=p.device if p is not None else None)
        else:
            x = torch.zeros(shape, dtype=p.dtype if p is not None else torch.float32,
                            device=p.device if p is not None else None)
    else:
        raise TypeError(f"to_loom_json: example_input must be a tensor or a shape (sequence of ints), got {type(example_input).__name__}")
    shapes: dict[int, tuple[int, ...]] = {}
    def record(mod, args) -> None:
        shapes.setdefault(id(mod), tuple(args[0].shape))

    hooks = [m.register_forward_pre_hook(record) for m in net.modules()]
    try:
        with torch.no_grad():
            net(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"to_loom_json: the network does not accept example_input of shape {list(x.shape)}: {e}") from None
    finally:
        for h in hooks:
            h.remove()
    return shapes


def to_loom_json(net: Layer, *, example_input: Tensor | Sequence[int] | None = None, dtype: str | None = None) -> dict:
    """Loom's saved-network JSON (a dict) for ``net``: one grid row, one top-level layer per cell,
    float32 weights. ``example_input`` (a tensor or its shape ``[batch, ...]``) is needed where Loom
    stores sizes that torchloom layers do not hold: the spatial sizes of convolutions and the
    sequence length of RNN / LSTM, and the number of rows a Softmax normalises (Loom fixes it in the
    file: with an example ``[B, …, C]`` the Softmax is written as Loom's ``Grid`` softmax of
    ``B·…`` rows of ``C``, which computes torchloom's row-wise softmax for inputs of that shape;
    without one, as Loom's ``Standard`` softmax over the whole input, which equals torchloom's for a
    single row). Raises ``ValueError`` naming the layer for anything Loom cannot
    represent or would run differently (a Dense or convolution bias, ``relu2``, exact ``gelu``,
    non-causal or RoPE-free attention, a norm ``eps`` other than Loom's, ``LastStep``, ...).

    ``dtype`` (one of Loom's 21 dtype names) writes every layer's weights as native codes of that
    dtype with its one ``scale``; ``None`` writes each layer in the dtype it was trained in
    (``TrainingConfig(weight_dtype=...)``: then bit for bit what the trained network computes, and
    what ``from_loom_json`` and Loom read back) and float32 otherwise. A layer not trained in the
    requested dtype is quantised round-to-nearest with a per-tensor scale (docs/low-bit.md)."""
    return loom_dict(net, example_input, dtype=dtype)


def loom_dict(net: Layer, example_input: Tensor | Sequence[int] | None, *, description: bool = False, dtype: str | None = None) -> dict:
    """``to_loom_json``; ``description=True`` makes torchloom's network description for checkpoints
    (``torchloom.saving``): no weights, and a Dense's or convolution's bias as ``"bias": true``."""
    if not isinstance(net, Layer):
        raise TypeError(f"to_loom_json: net must be a torchloom layer or Network, got {type(net).__name__}")
    if dtype is not None:
        from ..lowbit.codec import dtype_info

        dtype_info(dtype, "to_loom_json: dtype")
    shapes = _example_shapes(net, example_input)
    tops = list(net) if isinstance(net, Sequential) else [net]
    layers: list[dict] = []
    for i, mod in enumerate(tops):
        layers.extend(export_layers(mod, shapes, f"layer {i} ({type(mod).__name__})", description=description))
    if not layers:
        raise ValueError("to_loom_json: the network has no layer Loom can hold")
    for i, d in enumerate(layers):
        requantize_layer(d, dtype, f"layer {i}")  # (a description has no weights: nothing to do)
    for x, d in enumerate(layers):
        d.update(z=0, y=0, x=x, l=0)
    return {"id": "torchloom", "depth": 1, "rows": 1, "cols": len(layers), "layers_per_cell": 1, "layers": layers}


def save_loom(net: Layer, path: str | os.PathLike, *, example_input: Tensor | Sequence[int] | None = None,
              dtype: str | None = None) -> None:
    """Write ``to_loom_json(net, example_input=..., dtype=...)`` to ``path`` atomically: the JSON goes to a
    temporary file in the same directory, which then replaces ``path`` (``os.replace``). A failed
    write leaves an existing file intact and no temporary file behind."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_loom: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"save_loom: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"save_loom: path {path!r} is a directory")
    from ..observers._files import atomic_write

    data = json.dumps(to_loom_json(net, example_input=example_input, dtype=dtype), indent=2).encode("utf-8")
    atomic_write("save_loom", path, lambda f: f.write(data), keep_mode=True)
