"""Encoders of Loom's 21 dtypes against an independent reference, and stochastic rounding.

Reference: the value of every code as torchloom's *decoder* reads it (``interop/_codec.py``: numpy
views for float16 / bfloat16, its fp8 and fp4 decoders, integer grids), the nearest of those values
found by brute force (ties to the even code), and the packed bytes read back by ``decode_weights``.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from torchloom.interop._codec import _FP4, LayerSpec, _e4m3, _e5m2, decode_weights
from torchloom.lowbit import LOOM_DTYPES, decode, dtype_info, encode, pack, quantize, scale_for, uniform

TOP64 = 2 ** 63 - 2 ** 39  # 64-bit codes stop at the largest float32 below 2^63
GRID = {"int64": (-(2 ** 63), TOP64), "int32": (-(2 ** 31), 2 ** 31 - 1), "int16": (-32768, 32767),
        "int8": (-128, 127), "uint64": (0, TOP64), "uint32": (0, 2 ** 32 - 1), "uint16": (0, 65535),
        "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3), "ternary": (-1, 1)}


def _decoder_table(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, float32 values) of every finite code, as torchloom's decoder reads them."""
    if dtype == "float16":
        codes = np.arange(2 ** 16)
        vals = codes.astype(np.uint16).view(np.float16).astype(np.float32)
    elif dtype == "bfloat16":
        codes = np.arange(2 ** 16)
        vals = (codes.astype(np.uint32) << 16).view(np.float32)
    elif dtype in ("fp8e4m3", "fp8e5m2"):
        codes = np.arange(256)
        vals = (_e4m3 if dtype == "fp8e4m3" else _e5m2)(codes.astype(np.uint8))
    else:
        codes = np.arange(16)
        vals = _FP4
    ok = np.isfinite(vals)
    return codes[ok], vals[ok]


def _nearest_table(y: np.ndarray, dtype: str) -> np.ndarray:
    """Brute force: the code whose value is nearest to each y (float64 distances), ties to the even
    code, +0 before -0."""
    codes, vals = _decoder_table(dtype)
    y = np.clip(y, vals.min(), vals.max())  # beyond the table: its end (saturation)
    out = np.empty(y.size, dtype=np.int64)
    for i in range(0, y.size, 64):
        d = np.abs(y[i:i + 64, None].astype(np.float64) - vals[None, :].astype(np.float64))
        best = d.min(axis=1, keepdims=True)
        cand = d == best
        # among the nearest: even code first, then the smaller code (+0 before -0)
        key = np.where(cand, (codes[None, :] % 2) * (1 << 20) + codes[None, :], np.iinfo(np.int64).max)
        out[i:i + 64] = codes[np.argmin(key, axis=1)]
    return out


def _reference_values(x: torch.Tensor, dtype: str, scale: float) -> np.ndarray:
    """Round-to-nearest of x in dtype, as float32 values (code value · scale in float32)."""
    info = dtype_info(dtype)
    y = (x / torch.tensor(scale, dtype=torch.float32)).numpy() if info.scaled else x.numpy()
    s = np.float32(scale if info.scaled else 1.0)
    if info.kind == "table":
        codes, vals = _decoder_table(dtype)
        lut = dict(zip(codes.tolist(), vals.tolist()))
        v = np.array([lut[c] for c in _nearest_table(y, dtype)], dtype=np.float32)
    elif info.kind == "binary":
        v = np.where(y >= 0, 1.0, -1.0).astype(np.float32)
    else:
        lo, hi = GRID[dtype]
        v = (np.clip(np.rint(y.astype(np.float64)), lo, hi) + 0.0).astype(np.float32)  # rint: half to even; code 0 is +0
    return (v * s).astype(np.float32)


def _inputs(dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(700, generator=g) * torch.exp(torch.randn(700, generator=g) * 2)
    extra = [0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30]
    info = dtype_info(dtype)
    if info.kind == "table":  # exact midpoints between neighbours: the ties
        _, vals = _decoder_table(dtype)
        sv = np.unique(vals.astype(np.float64))
        pick = np.linspace(0, sv.size - 2, 200).astype(int)
        extra += ((sv[pick] + sv[pick + 1]) / 2).tolist()
    elif info.kind == "grid":
        extra += [k + 0.5 for k in range(-10, 10)]
    return torch.cat([x, torch.tensor(extra, dtype=torch.float32)])


def _layer(b64: str, n: int, dtype: str, scale: float) -> LayerSpec:
    return LayerSpec(f={"weights": b64, "scale": scale, "native": True}, kind="Dense", where="t", n_params=n, dtype=dtype)


@pytest.mark.parametrize("dtype", LOOM_DTYPES)
def test_decode_of_encode_is_round_to_nearest_bit_for_bit(dtype):
    x = _inputs(dtype)
    info = dtype_info(dtype)
    for scale in (float(scale_for(x[:700], dtype)), 1.0):  # 1.0: the ties land on exact midpoints
        codes = encode(x, dtype, scale)
        ours = decode(codes, dtype, scale)
        if info.kind == "identity":
            assert torch.equal(ours, x)
            want = x.numpy()
        else:
            want = _reference_values(x, dtype, scale)
            mism = np.nonzero(ours.numpy().view(np.int32) != want.view(np.int32))[0]
            assert mism.size == 0, f"{dtype}: first mismatch at {mism[:1]}: x={x[mism[:1]]}, ours={ours[mism[:1]]}, want={want[mism[:1]]}"
        # the bytes Loom's file holds decode (torchloom's decoder) to the same values, bit for bit
        b64 = base64.b64encode(pack(codes, dtype)).decode()
        back = decode_weights(_layer(b64, x.numel(), dtype, scale)).astype(np.float32)
        assert np.array_equal(back.view(np.int32), want.astype(np.float32).view(np.int32)), dtype


@pytest.mark.parametrize("dtype", [d for d in LOOM_DTYPES if dtype_info(d).kind != "identity"])
def test_stochastic_rounding_is_unbiased_over_a_million_draws(dtype):
    """E[q] = x inside the range: 16 points × 62 500 draws; the total error within 3σ of the
    binomial spread, and each point's mean within 4σ."""
    info = dtype_info(dtype)
    scale = 0.37 if info.scaled else 1.0
    top = {"binary": 0.9, "ternary": 0.9, "int2": 0.9, "uint2": 2.5}.get(dtype, 2.7 if dtype == "fp4" else 6.5)
    lo = 0.1 if not info.signed else -top
    g = torch.Generator().manual_seed(5)
    pts = (lo + (top - lo) * torch.rand(16, generator=g)) * scale
    n = 62_500
    x = pts.repeat_interleave(n)
    u = uniform(x.numel(), seed=11, step=7, index=3)
    q = quantize(x, dtype, scale, "stochastic", u).reshape(16, n).double()
    down = quantize(pts, dtype, scale, "nearest").double()
    lo_v = torch.minimum(q.min(1).values, down)
    hi_v = torch.maximum(q.max(1).values, down)
    p = ((pts.double() - lo_v) / (hi_v - lo_v)).clamp(0, 1)
    var = p * (1 - p) * (hi_v - lo_v) ** 2 / n  # variance of each point's mean
    err = q.mean(1) - pts.double()
    assert bool((q == lo_v[:, None]).logical_or(q == hi_v[:, None]).all()), "only the two neighbours are drawn"
    z_total = err.sum() / var.sum().sqrt()
    assert abs(float(z_total)) <= 3, f"{dtype}: total bias {float(z_total):.2f} sigma"
    assert bool((err.abs() <= 4 * var.sqrt() + 1e-12).all()), f"{dtype}: {err} vs {var.sqrt()}"


def test_nearest_saturates_and_fp4_scale_zero_reads_as_one():
    assert int(encode(torch.tensor([1e9]), "int8", 1.0)) == 127
    assert int(encode(torch.tensor([-1e9]), "uint4", 1.0)) == 0
    assert float(decode(encode(torch.tensor([1e9]), "fp8e4m3", 1.0), "fp8e4m3", 1.0)) == 480.0
    assert float(decode(torch.tensor([5]), "fp4", 0.0)) == 3.0


def test_scale_for_maps_the_largest_weight_to_the_top_code():
    w = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    assert float(scale_for(w, "int8")) == pytest.approx(2.0 / 127)
    # int4, uint4, fp4: of max|w|·r / qmax (r = 1, 0.9, ..., 0.3) the least squared rounding error
    x = torch.randn(500, generator=torch.Generator().manual_seed(0))
    for dtype, qmax in (("int4", 7), ("fp4", 3)):
        errs = {r: float(((torch.from_numpy(_reference_values(x, dtype, float(x.abs().max()) * r / qmax)) - x) ** 2).sum())
                for r in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)}
        best = min(errs, key=errs.get)
        assert float(scale_for(x, dtype)) == pytest.approx(float(x.abs().max()) * best / qmax, rel=1e-6), (dtype, errs)
        assert best < 1.0  # a Gaussian's largest weight is worth clipping at 4 bits
    assert float(scale_for(w, "ternary")) == pytest.approx(0.9375)  # mean |w|
    assert scale_for(w, "int8", dim=0).flatten().tolist() == pytest.approx([2.0 / 127, 1.0 / 127])
    assert float(scale_for(torch.zeros(3), "int8")) == 1.0
    assert float(scale_for(w, "bfloat16")) == 1.0


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match=r"encode: unknown Loom dtype 'int3'; valid: float64, float32"):
        encode(torch.zeros(1), "int3")
    with pytest.raises(ValueError, match=r"encode: rounding must be one of \('stochastic', 'nearest'\), got 'up'"):
        encode(torch.zeros(1), "int8", 1.0, "up")
    with pytest.raises(ValueError, match="encode: rounding='stochastic' needs u"):
        encode(torch.zeros(1), "int8", 1.0, "stochastic")
