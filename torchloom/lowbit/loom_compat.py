"""Loom's own re-encoding of a weight after an update (``openfluke/loom`` v0.80, ``poly/weights.go``),
for ``LowBitConfig(loom_compat=True)``.

Loom v0.80 keeps a float32 ``Master`` per layer; its CPU ``Train`` steps ``Master −= lr·g``, clamps
the Master of unsigned dtypes (``clampMasterForDType``) and re-encodes it (``Morph``) with a scale
set **once**, at the first encoding, from the weights of that moment. What differs from
torchloom's round-to-nearest encoders (``codec.py``):

* the scale: ``max|w| / m`` with ``m`` = 7 for int4/uint4, 3 for fp4, 1 for int2/uint2/ternary and
  127 for every other dtype (int16…int64 and fp8 included), ``mean|w|`` for binary; 1 when it is 0;
* float16, bfloat16, fp8e4m3 and fp8e5m2 **truncate** the mantissa, flush subnormals to zero;
  fp8e4m3 saturates at its largest code, float16 and fp8e5m2 overflow to infinity;
* integers round half away from zero (Go's ``math.Round``); int8, int16 and int32 **wrap** (Go's
  integer conversion keeps the low bits: 128 becomes −128); int4, int2 and ternary clamp; uint8,
  uint4 and uint2 clamp at 0 and their maximum; uint16, uint32 and uint64 take the magnitude
  (``math.Abs``), and their Master is clamped to ``[0, scale·65535]`` (uint16) or ``[0, scale·2²⁰]``;
* fp4 picks the first of its 12 finite codes at the smallest float32 distance (ties to the code
  listed first: 0, 0.75, 1, 1.5, 2, 3, −0, −0.75, …).

Codes are returned in torchloom's code space (``codec.decode`` reads them), so the values are what
Loom's ``GetActive`` computes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .codec import dtype_info

__all__ = ["loom_scale", "loom_encode", "loom_clamp_master_"]

_MAX_INT = {"int4": 7.0, "uint4": 7.0, "fp4": 3.0, "int2": 1.0, "uint2": 1.0, "ternary": 1.0}
_FP4_ORDER = (0x0, 0x1, 0x2, 0x3, 0x4, 0x5, 0x8, 0x9, 0xA, 0xB, 0xC, 0xD)
_FP4_VALUES = (0.0, 0.75, 1.0, 1.5, 2.0, 3.0, -0.0, -0.75, -1.0, -1.5, -2.0, -3.0)


@functools.lru_cache(maxsize=16)
def fp4_table(device: torch.device) -> tuple[Tensor, Tensor]:
    """fp4's 12 finite values in Loom's search order, and their codes, on ``device``."""
    return (torch.tensor(_FP4_VALUES, dtype=torch.float32, device=device),
            torch.tensor(_FP4_ORDER, dtype=torch.int64, device=device))


def loom_scale(master: Tensor, dtype: str) -> Tensor:
    """Loom's first-``Morph`` scale of a layer's weights (all of its parameters flattened together):
    a 0-d float32 tensor."""
    a = master.detach().to(torch.float32).reshape(-1).abs()
    if dtype_info(dtype).name == "binary":
        s = (a.to(torch.float64).sum().to(torch.float32) / torch.tensor(float(a.numel()), dtype=torch.float32))
    else:
        s = a.amax() / torch.tensor(_MAX_INT.get(dtype_info(dtype).name, 127.0), dtype=torch.float32)
    return torch.where(s == 0, torch.ones_like(s), s)


def _bits(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (b >> 31) & 1, (b >> 23) & 0xFF, b & 0x7FFFFF


def _truncate_float(x: Tensor, ebits: int, mbits: int, bias: int, saturate: bool) -> Tensor:
    """Loom's ``float32ToE4M3`` / ``float32ToE5M2`` / ``float32ToFloat16``: exponent re-biased,
    mantissa truncated; zero and subnormal results → signed zero; overflow → the largest code
    (``saturate``) or infinity."""
    sign, exp, mant = _bits(x)
    e = exp - 127 + bias
    top = (1 << ebits) - 1
    normal = (sign << (ebits + mbits)) | (e.clamp(0, top) << mbits) | (mant >> (23 - mbits))
    over = (sign << (ebits + mbits)) | ((top << mbits) | ((1 << mbits) - 1) if saturate else (top << mbits))
    zero = sign << (ebits + mbits)
    return torch.where(e <= 0, zero, torch.where(e >= top, over, normal))


def _round_away(y: Tensor) -> Tensor:
    """Go's ``math.Round`` (half away from zero) of float32 ``y``, in float64 (exact)."""
    yd = y.to(torch.float64)
    return torch.sign(yd) * torch.floor(yd.abs() + 0.5)


def loom_encode(master: Tensor, dtype: str, scale: Tensor) -> Tensor:
    """Loom's ``Morph`` codes of ``master`` (float32) with the layer's fixed ``scale``: int64 codes
    in torchloom's code space (float32 values for float64 / float32)."""
    name = dtype_info(dtype).name
    x = master.to(torch.float32)
    s = torch.where(scale == 0, torch.ones_like(scale), scale)
    if name in ("float64", "float32"):
        return x
    if name == "bfloat16":
        return _bits(x)[0] << 15 | (_bits(x)[1] << 7) | (_bits(x)[2] >> 16)
    if name == "float16":
        return _truncate_float(x, 5, 10, 15, saturate=False)
    y = x / s  # float32, as Go's v / ws.Scale
    if name == "fp8e4m3":
        return _truncate_float(y, 4, 3, 7, saturate=True)
    if name == "fp8e5m2":
        return _truncate_float(y, 5, 2, 15, saturate=False)
    if name == "fp4":
        ref, codes = fp4_table(x.device)
        diff = (y.unsqueeze(-1) - ref).abs()  # float32, as Go's float32 subtraction
        return codes[diff.argmin(-1)]
    if name == "binary":
        return torch.where(y >= 0, 1, -1).to(torch.int64)
    q = _round_away(y)
    if name in ("int8", "int16", "int32"):  # int(q) then intN(q): the low bits
        bits = {"int8": 8, "int16": 16, "int32": 32}[name]
        q = q.clamp(-(2.0 ** 62), 2.0 ** 62).to(torch.int64)
        q = ((q + (1 << (bits - 1))) & ((1 << bits) - 1)) - (1 << (bits - 1))
        return q
    if name in ("uint16", "uint32", "uint64"):
        return q.abs().clamp(max=2.0 ** 62).to(torch.int64)
    lo, hi = {"int4": (-8, 7), "int2": (-2, 1), "ternary": (-1, 1), "uint8": (0, 255), "uint4": (0, 15),
              "uint2": (0, 3), "int64": (-(2.0 ** 62), 2.0 ** 62)}[name]
    return q.clamp(lo, hi).to(torch.int64)


def loom_clamp_master_(master: Tensor, dtype: str, scale: Tensor) -> None:
    """Loom's ``clampMasterForDType`` after an update: unsigned dtypes' Master into ``[0, max]``."""
    name = dtype_info(dtype).name
    top = {"uint64": float(1 << 20), "uint32": float(1 << 20), "uint16": 65535.0, "uint8": 255.0,
           "uint4": 15.0, "uint2": 3.0}.get(name)
    if top is None:
        return
    s = torch.where(scale <= 0, torch.ones_like(scale), scale)
    master.clamp_(min=0)
    torch.minimum(master, s * top, out=master)
