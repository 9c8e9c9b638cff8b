"""Reading untrusted Loom JSON: parse, validate every field, count parameters before anything is
allocated, and decode Loom's weight blobs in every dtype Loom writes.

Nothing here builds a module. ``parse_spec`` turns text / bytes / a dict / a path into a validated
``NetSpec`` (a tree of ``LayerSpec``) whose parameter counts and weight byte lengths are known and
capped; ``decode_weights`` then turns one layer's base64 blob into a finite float32 array.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DEFAULT_MAX_PARAMETERS",
    "LayerSpec",
    "NetSpec",
    "parse_spec",
    "decode_weights",
    "encode_float32",
    "read_json_source",
    "max_bytes_for",
    "UNSUPPORTED_TYPES",
    "NotFileNorJSONError",
]

DEFAULT_MAX_PARAMETERS = 50_000_000  # 200 MB of float32 weights
MAX_DEPTH = 32  # nesting of parallel_branches / sequential_layers
MAX_LAYERS = 100_000
MAX_DIM = 2**31 - 1

_INT_FIELDS = (
    "z", "y", "x", "l", "input_height", "input_width", "input_depth", "output_height", "output_width",
    "output_depth", "input_channels", "filters", "kernel_size", "stride", "padding", "output_padding",
    "num_heads", "num_kv_heads", "head_dim", "query_dim", "d_model", "seq_length", "vocab_size",
    "embedding_dim", "num_clusters", "softmax_rows", "softmax_cols", "tile_size",
    "target_z", "target_y", "target_x", "target_l",
)
_STR_FIELDS = ("type", "activation", "dtype", "weights", "combine_mode", "output_mode")
_BOOL_FIELDS = ("is_disabled", "native", "use_tiling", "gumbel_noise", "is_remote_link")
_NUM_FIELDS = ("scale", "temperature", "rope_freq_base", "entmax_alpha", "kmeans_temperature")
_LIST_FIELDS = ("parallel_branches", "sequential_layers", "meta_rules", "mask", "hierarchy_levels")
_OTHER_FIELDS = ("softmax_type", "meta_observed_layer")
# What Loom's decoder makes of a null (the Go zero value), for messages.
_ZERO = {**{k: "0" for k in _INT_FIELDS + _NUM_FIELDS}, **{k: '""' for k in _STR_FIELDS},
         **{k: "false" for k in _BOOL_FIELDS}, "softmax_type": "Standard", "activation": '"" (linear)',
         "type": '"" (Dense)', "dtype": '"" (float32)', "weights": '"" (fresh random weights)'}
_KNOWN = set(_INT_FIELDS + _STR_FIELDS + _BOOL_FIELDS + _NUM_FIELDS + _LIST_FIELDS + _OTHER_FIELDS)
_KNOWN_LOWER = {k.lower(): k for k in _KNOWN}
_NET_KNOWN = {"id": "id", "depth": "depth", "rows": "rows", "cols": "cols", "layers_per_cell": "layers_per_cell", "layers": "layers"}

# Loom's layer type spellings (upper-cased) → canonical name; Loom maps anything else to Dense
# silently, torchloom refuses it.
LAYER_TYPES = {
    "DENSE": "Dense", "MHA": "MultiHeadAttention", "ATTENTION": "MultiHeadAttention",
    "MULTIHEADATTENTION": "MultiHeadAttention", "SWIGLU": "SwiGLU", "RMSNORM": "RMSNorm", "RNN": "RNN",
    "LSTM": "LSTM", "LAYERNORM": "LayerNorm", "CNN1": "CNN1", "CNN2": "CNN2", "CNN3": "CNN3",
    "CONVTRANSPOSED1D": "ConvTransposed1D", "CONVTRANSPOSED2D": "ConvTransposed2D",
    "CONVTRANSPOSED3D": "ConvTransposed3D", "EMBEDDING": "Embedding", "SOFTMAX": "Softmax",
    "PARALLEL": "Parallel", "SEQUENTIAL": "Sequential", "RESIDUAL": "Residual",
    "KMEANS": "KMeans", "META": "Metacognition", "METACOGNITION": "Metacognition",
}

# Loom layer types torchloom recognises but does not import, and why (refused before any other check).
UNSUPPORTED_TYPES = {
    "KMeans": (
        "layer type KMeans is not supported: Loom's KMeans treats its whole input buffer (every sample of "
        "the batch together) as one feature vector and fills only the first sample's outputs, so it is "
        "defined for a batch of one sample only (a larger batch reads past its num_clusters × input_height "
        "cluster centres); torchloom has no layer that computes this per sample"
    ),
    "Metacognition": (
        "layer type Metacognition is not supported: Loom's Metacognition layer watches another layer's "
        "statistics and rewrites layers of the network while it runs (its meta_rules); torchloom has no "
        "equivalent, and the file alone does not say what the network computes"
    ),
}

# dtype spelling (upper-cased) → (canonical name, values per stored unit, bytes per unit)
_DTYPES = {
    "FLOAT64": "float64", "FP64": "float64", "F64": "float64",
    "FLOAT32": "float32", "FP32": "float32", "F32": "float32",
    "FLOAT16": "float16", "FP16": "float16", "F16": "float16",
    "BFLOAT16": "bfloat16", "BF16": "bfloat16",
    "FP8E4M3": "fp8e4m3", "FP8": "fp8e4m3", "FP8E5M2": "fp8e5m2",
    "INT64": "int64", "I64": "int64", "INT32": "int32", "I32": "int32", "INT16": "int16", "I16": "int16",
    "INT8": "int8", "I8": "int8", "UINT64": "uint64", "U64": "uint64", "UINT32": "uint32", "U32": "uint32",
    "UINT16": "uint16", "U16": "uint16", "UINT8": "uint8", "U8": "uint8",
    "INT4": "int4", "UINT4": "uint4", "FP4": "fp4", "F4": "fp4",
    "INT2": "int2", "UINT2": "uint2", "TERNARY": "ternary", "BINARY": "binary",
}
# bits per weight of each native encoding
_BITS = {
    "float64": 64, "float32": 32, "float16": 16, "bfloat16": 16, "fp8e4m3": 8, "fp8e5m2": 8,
    "int64": 64, "int32": 32, "int16": 16, "int8": 8, "uint64": 64, "uint32": 32, "uint16": 16, "uint8": 8,
    "int4": 4, "uint4": 4, "fp4": 4, "int2": 2, "uint2": 2, "ternary": 2, "binary": 1,
}
_SCALED = {"fp8e4m3", "fp8e5m2", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8",
           "int4", "uint4", "fp4", "int2", "uint2", "ternary", "binary"}
_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 40, 40, 4, 4


def _short(v) -> str:
    """A short, depth-limited repr of an untrusted value for messages."""
    return _REPR.repr(v)


def _short_path(p: str) -> str:
    """The repr of a path for messages, cut in the middle beyond 200 characters."""
    return repr(p) if len(p) <= 200 else repr(p[:97] + "..." + p[-100:])


def _err(where: str, msg: str) -> ValueError:
    return ValueError(f"Loom JSON: {where}: {msg}")


@dataclass
class LayerSpec:
    """One validated layer entry: ``f`` its fields (defaults filled in as Loom's zero values),
    ``kind`` its canonical type, ``where`` a path for messages, ``n_params`` its weight count,
    ``children`` nested branches / sub-layers."""

    f: dict
    kind: str
    where: str
    n_params: int
    dtype: str
    children: list["LayerSpec"] = field(default_factory=list)


@dataclass
class NetSpec:
    depth: int
    rows: int
    cols: int
    layers_per_cell: int
    layers: list[LayerSpec]  # in Loom's flat order
    total_params: int


# ------------------------------------------------------------------------------------- sources
def _reject_constant(name: str):
    raise ValueError(f"Loom JSON: the constant {name} is not allowed (weights and settings must be finite)")


def _loads(text: str | bytes, what: str):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"Loom JSON: {what} is nested too deeply to parse") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"Loom JSON: {what} is not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"Loom JSON: {what} is not valid JSON ({e})") from None


def max_bytes_for(max_parameters: int) -> int:
    """The largest file that can hold ``max_parameters`` weights: float64 in base64 is 32/3 bytes per
    weight; 16 MiB more for the structure."""
    return 11 * max_parameters + 16 * 2**20


class NotFileNorJSONError(FileNotFoundError, ValueError):
    """``cfg`` is a ``str`` that names no existing file and is not the JSON text of a Loom network either.
    A ``ValueError`` (a bad argument) that is also a ``FileNotFoundError`` (what a missing path raised
    before, so ``except FileNotFoundError`` keeps working)."""


def _read_file(path, func: str, max_bytes: int | None):
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise ValueError(f"{func}: file {os.fspath(path)!r} has {size:,} bytes, more than a network of "
                                 f"max_parameters weights can need ({max_bytes:,}); pass a larger max_parameters "
                                 "if the file is trusted")
            data = fh.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{func}: no such file: {os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{func}: path {os.fspath(path)!r} is a directory, not a Loom JSON file") from None
    return _loads(data, f"file {os.fspath(path)!r}")


def _neither(cfg: str, func: str, max_bytes: int | None):
    """The error for a ``str`` that is no existing file: say what it is as JSON text, too."""
    where = f"no such file: {_short_path(os.path.abspath(cfg))}" if "\x00" not in cfg else "a path cannot hold a NUL character"
    if max_bytes is not None and len(cfg) > max_bytes:
        return NotFileNorJSONError(f"{func}: cfg is neither an existing file ({where}) nor JSON text of a size a "
                                   f"network of max_parameters weights can need ({len(cfg):,} > {max_bytes:,} characters)")
    try:
        value = json.loads(cfg, parse_constant=float)
    except (json.JSONDecodeError, RecursionError) as e:
        return NotFileNorJSONError(f"{func}: cfg {_short(cfg)} is neither an existing file ({where}) nor valid "
                                   f"JSON ({e.msg if isinstance(e, json.JSONDecodeError) else 'nested too deeply'}); "
                                   "give a path, JSON text of a Loom network, or a dict")
    kind = "null" if value is None else {bool: "a boolean", int: "a number", float: "a number", str: "a string"}.get(type(value), type(value).__name__)
    return NotFileNorJSONError(f"{func}: cfg {_short(cfg)} is neither an existing file ({where}) nor JSON text of a "
                               f"Loom network (as JSON it is {kind}; a Loom network is a JSON object)")


def read_json_source(cfg, func: str, *, path_only: bool = False, max_bytes: int | None = None):
    """The parsed JSON object of ``cfg``: a dict (taken as is), JSON text (``bytes``, or a ``str``
    starting with ``{`` or ``[``), or a path (``os.PathLike``, or any other ``str``). ``path_only``:
    ``cfg`` must be a path. A file or text longer than ``max_bytes`` is refused before it is read or
    parsed. A ``str`` that is neither an existing file nor JSON text of a network raises
    ``NotFileNorJSONError`` (a ``ValueError`` and a ``FileNotFoundError``) whose message says both."""
    if isinstance(cfg, os.PathLike) or (isinstance(cfg, str) and path_only):
        return _read_file(cfg, func, max_bytes)
    if path_only:
        raise TypeError(f"{func}: path must be a str or os.PathLike, got {type(cfg).__name__}")
    if isinstance(cfg, dict):
        return cfg
    if isinstance(cfg, str) and not cfg.lstrip().startswith(("{", "[")):
        if not os.path.exists(cfg):  # False too for a NUL character or a name too long for the file system
            raise _neither(cfg, func, max_bytes)
        return _read_file(cfg, func, max_bytes)
    if isinstance(cfg, (str, bytes, bytearray)):
        if max_bytes is not None and len(cfg) > max_bytes:
            raise ValueError(f"{func}: cfg holds {len(cfg):,} characters, more than a network of max_parameters "
                             f"weights can need ({max_bytes:,}); pass a larger max_parameters if it is trusted")
        return _loads(bytes(cfg) if isinstance(cfg, bytearray) else cfg, "cfg")
    raise TypeError(f"{func}: cfg must be a dict, JSON text (str/bytes) or a path, got {type(cfg).__name__}")


# ------------------------------------------------------------------------------------ validation
def _int(v, where: str, key: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"Loom JSON: {where}: {key!r} must be an integer, got {type(v).__name__} {_short(v)}")
    if not minimum <= v <= MAX_DIM:
        raise _err(where, f"{key!r} must lie in [{minimum}, {MAX_DIM}], got {v}")
    return v


def _check_keys(obj: dict, known_lower: dict, where: str) -> None:
    for k in obj:
        if not isinstance(k, str):
            raise TypeError(f"Loom JSON: {where}: keys must be strings, got {type(k).__name__} {_short(k)}")
        canon = known_lower.get(k.lower())
        if canon is not None and canon != k:
            raise _err(where, f"key {k!r} differs from Loom's {canon!r} only in case (Loom matches keys case-insensitively); spell it {canon!r}")


def _refuse_null(ls: dict, where: str) -> None:
    """A scalar field given as ``null``. Loom's Go decoder leaves such a field at its zero value (``"z":
    null`` reads as layer position 0, ``"activation": null`` as linear) and never writes one itself, so
    a ``null`` means a damaged or hand-edited file: refused rather than guessed. (Lists and
    ``meta_observed_layer`` may be ``null``: Go writes a nil slice or pointer that way.)"""
    for k in _INT_FIELDS + _STR_FIELDS + _BOOL_FIELDS + _NUM_FIELDS + ("softmax_type",):
        if k in ls and ls[k] is None:
            raise _err(where, f"{k!r} is null; Loom would silently read it as {_ZERO[k]}. Give a value "
                       "or leave the key out")


def _layer_fields(ls, where: str) -> dict:
    if not isinstance(ls, dict):
        raise TypeError(f"Loom JSON: {where} must be a JSON object, got {type(ls).__name__}")
    _check_keys(ls, _KNOWN_LOWER, where)
    _refuse_null(ls, where)
    f: dict = {}
    for k in _INT_FIELDS:
        f[k] = _int(ls[k], where, k) if k in ls else 0
    for k in _STR_FIELDS:
        v = ls.get(k)
        if v is not None and not isinstance(v, str):
            raise TypeError(f"Loom JSON: {where}: {k!r} must be a string, got {type(v).__name__} {_short(v)}")
        f[k] = v
    for k in _BOOL_FIELDS:
        v = ls.get(k, False)
        if not isinstance(v, bool):
            raise TypeError(f"Loom JSON: {where}: {k!r} must be true or false, got {type(v).__name__} {_short(v)}")
        f[k] = v
    for k in _NUM_FIELDS:
        v = ls.get(k)
        if v is None:
            f[k] = None
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"Loom JSON: {where}: {k!r} must be a number, got {type(v).__name__} {_short(v)}")
        if not math.isfinite(v) or abs(v) > 3.4e38:
            raise _err(where, f"{k!r} must be a finite float32 number, got {v!r}")
        f[k] = float(v)
    for k in _LIST_FIELDS:
        v = ls.get(k)
        if v is not None and not isinstance(v, list):
            raise TypeError(f"Loom JSON: {where}: {k!r} must be a list, got {type(v).__name__}")
        f[k] = v or []
    st = ls.get("softmax_type")
    if st is not None and (isinstance(st, bool) or not isinstance(st, (str, int))):
        raise TypeError(f"Loom JSON: {where}: 'softmax_type' must be a string or an integer, got {type(st).__name__}")
    f["softmax_type"] = st
    f["meta_observed_layer"] = ls.get("meta_observed_layer")
    return f


def _n_params(kind: str, f: dict, where: str) -> int:
    """Loom's weight count for a layer (its ``initializeWeights``), checking the sizes it needs."""
    def need(*keys):
        for k in keys:
            if f[k] < 1:
                raise _err(where, f"{kind} needs {k!r} >= 1, got {f[k]}")

    if kind == "Dense":
        need("input_height", "output_height")
        return f["input_height"] * f["output_height"]
    if kind == "RMSNorm":
        need("input_height")
        return f["input_height"]
    if kind == "LayerNorm":
        need("input_height")
        return 2 * f["input_height"]
    if kind == "MultiHeadAttention":
        need("d_model", "num_heads")
        heads, kvh = f["num_heads"], f["num_kv_heads"] or f["num_heads"]
        head_dim = f["head_dim"] or f["d_model"] // heads
        q = f["query_dim"] or f["d_model"]
        kv = kvh * head_dim or f["d_model"]
        d = f["d_model"]
        return q * d + 2 * kv * d + d * q + q + 2 * kv + d
    if kind == "RNN":
        need("input_height", "output_height")
        i, h = f["input_height"], f["output_height"]
        return i * h + h * h + h
    if kind == "LSTM":
        need("input_height", "output_height")
        i, h = f["input_height"], f["output_height"]
        return 4 * (i * h + h * h + h)
    if kind == "SwiGLU":
        need("input_height", "output_height")
        h, m = f["input_height"], f["output_height"]
        return 3 * h * m + 2 * m + h
    if kind in ("CNN1", "CNN2", "CNN3", "ConvTransposed1D", "ConvTransposed2D", "ConvTransposed3D"):
        need("input_channels", "filters")
        k = f["kernel_size"] or 1
        nd = int(kind[-1]) if kind.startswith("CNN") else int(kind[-2])
        return f["filters"] * f["input_channels"] * k**nd
    if kind == "Embedding":
        need("vocab_size", "embedding_dim")
        return f["vocab_size"] * f["embedding_dim"]
    return 0


class _Walker:
    def __init__(self, max_parameters: int) -> None:
        self.max_parameters = max_parameters
        self.total = 0
        self.count = 0

    def layer(self, ls, where: str, depth: int) -> LayerSpec:
        if depth > MAX_DEPTH:
            raise _err(where, f"layers are nested more than {MAX_DEPTH} levels deep (parallel_branches / sequential_layers)")
        self.count += 1
        if self.count > MAX_LAYERS:
            raise _err(where, f"more than {MAX_LAYERS} layers in total")
        f = _layer_fields(ls, where)
        type_name = f["type"] or ""
        kind = LAYER_TYPES.get(type_name.upper())
        if kind is None:
            raise _err(where, f"layer type {type_name!r} is not supported; Loom's types torchloom reads: "
                       f"{sorted(set(LAYER_TYPES.values()) - set(UNSUPPORTED_TYPES))}")
        if kind in UNSUPPORTED_TYPES:
            raise _err(where, UNSUPPORTED_TYPES[kind])
        dtype_name = f["dtype"] if f["dtype"] is not None else "float32"
        dtype = _DTYPES.get(dtype_name.upper()) if dtype_name else "float32"
        if dtype is None:
            raise _err(where, f"dtype {dtype_name!r} is not one Loom writes; known: {sorted(set(_DTYPES.values()))}")
        n = _n_params(kind, f, where)
        self.total += n
        if self.total > self.max_parameters:
            raise _err(where, f"the network holds more than max_parameters={self.max_parameters:,} weights "
                       f"(this layer alone {n:,}); pass a larger max_parameters if the file is trusted")
        w = f["weights"]
        if w is not None:
            if w == "":
                raise _err(where, "'weights' is empty; a saved layer must carry its weights (omit the key to "
                           "build the architecture with fresh weights)")
            if n == 0:
                raise _err(where, f"'weights' given for a {kind} layer, which has no weights")
            _check_b64(w, n, dtype, where, f["native"])
        spec = LayerSpec(f, kind, where, n, dtype)
        for key in ("parallel_branches", "sequential_layers"):
            items = f[key]
            if items and kind not in ("Parallel", "Sequential"):
                raise _err(where, f"{key!r} given for a {kind} layer (only Parallel / Sequential hold sub-layers)")
            for i, sub in enumerate(items):
                spec.children.append(self.layer(sub, f"{where}.{key}[{i}]", depth + 1))
        return spec


def _check_b64(w: str, n: int, dtype: str, where: str, native: bool) -> None:
    if not _B64.fullmatch(w) or len(w) % 4:
        raise _err(where, "'weights' is not valid base64 (standard alphabet, padded to a multiple of 4 characters)")
    n_bytes = len(w) // 4 * 3 - (len(w) - len(w.rstrip("=")))
    bits = _BITS[dtype] if native else 32
    want = (n * bits + 7) // 8
    if n_bytes != want:
        enc = f"native {dtype}" if native else "float32 (native=false)"
        raise _err(where, f"'weights' holds {n_bytes} bytes, expected {want} ({n} weights as {enc})")


def parse_spec(obj, *, max_parameters: int = DEFAULT_MAX_PARAMETERS) -> NetSpec:
    """Validate a parsed Loom network JSON object; see the module docstring."""
    if isinstance(max_parameters, bool) or not isinstance(max_parameters, int) or max_parameters < 1:
        raise ValueError(f"from_loom_json: max_parameters must be an int >= 1, got {max_parameters!r}")
    if not isinstance(obj, dict):
        raise TypeError(f"Loom JSON: the top level must be a JSON object, got {type(obj).__name__}")
    _check_keys(obj, _NET_KNOWN, "network")
    dims = []
    for key in ("depth", "rows", "cols", "layers_per_cell"):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"Loom JSON: network: {key!r} must be an integer, got {type(v).__name__} {_short(v)}")
        if v is None or not 1 <= v <= MAX_LAYERS:
            raise ValueError(f"Loom JSON: network: {key!r} must be an int in [1, {MAX_LAYERS}], got {_short(v)}")
        dims.append(v)
    depth, rows, cols, lpc = dims
    entries = obj.get("layers")
    if not isinstance(entries, list):
        raise TypeError(f"Loom JSON: network: 'layers' must be a list, got {type(entries).__name__}")
    if not entries:
        raise ValueError("Loom JSON: network: 'layers' must be a non-empty list, got []")
    n_cells = depth * rows * cols * lpc
    if n_cells != len(entries):
        raise ValueError(f"Loom JSON: network: the grid {depth}×{rows}×{cols}×{lpc} has {n_cells} cells but "
                         f"'layers' lists {len(entries)}; Loom needs exactly one layer per cell")
    walker = _Walker(max_parameters)
    cells: dict[int, LayerSpec] = {}
    for i, ls in enumerate(entries):
        spec = walker.layer(ls, f"layers[{i}]", 0)
        z, y, x, l = (spec.f[k] for k in ("z", "y", "x", "l"))
        if not (z < depth and y < rows and x < cols and l < lpc):
            raise ValueError(f"Loom JSON: layers[{i}]: position (z,y,x,l)=({z},{y},{x},{l}) lies outside the grid {depth}×{rows}×{cols}×{lpc}")
        flat = ((z * rows + y) * cols + x) * lpc + l
        if flat in cells:
            raise ValueError(f"Loom JSON: layers[{i}]: two layers at (z,y,x,l)=({z},{y},{x},{l})")
        cells[flat] = spec
    return NetSpec(depth, rows, cols, lpc, [cells[k] for k in sorted(cells)], walker.total)


# -------------------------------------------------------------------------------------- decoding
_FP4 = np.array([0.0, 0.75, 1.0, 1.5, 2.0, 3.0, np.inf, np.nan, -0.0, -0.75, -1.0, -1.5, -2.0, -3.0, -np.inf, np.nan], dtype=np.float32)


def _e4m3(u: np.ndarray) -> np.ndarray:
    u = u.astype(np.uint32)
    sign, exp, mant = u >> 7, (u >> 3) & 0xF, u & 0x7
    normal = ((sign << 31) | ((exp + 120) << 23) | (mant << 20)).view(np.float32)
    sub = ((sign << 31) | (120 << 23) | (mant << 20)).view(np.float32) * np.float32(0.125)
    zero = (sign << 31).view(np.float32)
    return np.where(exp == 0, np.where(mant == 0, zero, sub), normal).astype(np.float32)


def _e5m2(u: np.ndarray) -> np.ndarray:
    u = u.astype(np.uint32)
    sign, exp, mant = u >> 7, (u >> 2) & 0x1F, u & 0x3
    normal = ((sign << 31) | ((exp + 112) << 23) | (mant << 21)).view(np.float32)
    zero = (sign << 31).view(np.float32)
    special = np.where(mant == 0, np.where(sign == 1, -np.inf, np.inf), np.nan).astype(np.float32)
    return np.where(exp == 31, special, np.where((exp == 0) & (mant == 0), zero, normal)).astype(np.float32)


def _unpack(raw: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Unsigned codes of ``bits`` bits, most significant first in every byte (Loom's packing)."""
    per = 8 // bits
    shifts = np.arange(8 - bits, -1, -bits, dtype=np.uint8)
    return ((raw[:, None] >> shifts[None, :]) & ((1 << bits) - 1)).reshape(-1)[:n]


def decode_weights(spec: LayerSpec) -> np.ndarray:
    """The layer's weights as a flat float32 array of ``spec.n_params`` values, dequantised as Loom's
    ``GetActive`` does (``value · scale`` for the integer and 8/4-bit float types). Raises
    ``ValueError`` for non-finite weights."""
    w, n, dtype, where = spec.f["weights"], spec.n_params, spec.dtype, spec.where
    try:
        raw = base64.b64decode(w, validate=True)
    except (binascii.Error, ValueError):
        raise _err(where, "'weights' is not valid base64") from None
    buf = np.frombuffer(raw, dtype=np.uint8)
    scale = spec.f["scale"]
    if not spec.f["native"]:
        if dtype != "float32":
            raise _err(where, f"'weights' is a float32 master blob (native=false) for dtype {dtype!r}: Loom "
                       "re-quantises it on load with a scale torchloom does not reproduce; save it with "
                       "native weights or as float32")
        out = buf.view("<f4").astype(np.float32)
    elif dtype == "float32":
        out = buf.view("<f4").astype(np.float32)
    elif dtype == "float64":
        out = buf.view("<f8").astype(np.float64)
    elif dtype == "float16":
        out = buf.view("<f2").astype(np.float32)
    elif dtype == "bfloat16":
        out = (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        s = np.float32(1.0 if scale is None else scale)
        if dtype == "fp4" and s == 0:
            s = np.float32(1.0)
        if dtype in ("int64", "int32", "int16", "uint64", "uint32", "uint16"):
            codes = buf.view("<" + {"int": "i", "uint": "u"}[dtype.rstrip("0123456789")] + str(_BITS[dtype] // 8))
            vals = codes.astype(np.float32)
        elif dtype == "int8":
            vals = buf.view(np.int8).astype(np.float32)
        elif dtype == "uint8":
            vals = buf.astype(np.float32)
        elif dtype == "fp8e4m3":
            vals = _e4m3(buf)
        elif dtype == "fp8e5m2":
            vals = _e5m2(buf)
        elif dtype in ("int4", "uint4"):
            c = _unpack(buf, 4, n).astype(np.int16)
            vals = (np.where(c > 7, c - 16, c) if dtype == "int4" else c).astype(np.float32)
        elif dtype == "fp4":
            vals = _FP4[_unpack(buf, 4, n)]
        elif dtype in ("int2", "uint2", "ternary"):
            c = _unpack(buf, 2, n).astype(np.int16)
            vals = (c if dtype == "uint2" else np.where(c > 1, c - 4, c)).astype(np.float32)
        elif dtype == "binary":
            vals = np.where(_unpack(buf, 1, n) == 1, 1.0, -1.0).astype(np.float32)
        else:  # pragma: no cover - _DTYPES and this list agree
            raise _err(where, f"dtype {dtype!r} cannot be decoded")
        if dtype == "fp4":
            out = vals * s
        else:
            out = (vals * s).astype(np.float32)
    out = out[:n]
    if out.size != n:
        raise _err(where, f"'weights' decodes to {out.size} values, expected {n}")
    bad = ~np.isfinite(out)
    if bad.any():
        i = int(np.argmax(bad))
        raise _err(where, f"'weights' holds a non-finite value ({out[i]}) at index {i}")
    if out.dtype == np.float64 and np.abs(out).max(initial=0.0) > 3.4e38:
        raise _err(where, "'weights' holds float64 values beyond float32's range")
    return out


def encode_float32(values: np.ndarray) -> str:
    """Base64 of little-endian float32 values (Loom's native float32 encoding)."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")
