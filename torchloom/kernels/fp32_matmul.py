"""Float32 matrix products in a product precision chosen per call, whatever cuBLAS's switch says.

cuBLAS multiplies float32 in TF32 or exactly as ``torch.backends.cuda.matmul`` says: one switch for
the whole process, exact by default. PyTorch's recurrent layers obey another one,
``torch.backends.cudnn.rnn`` (TF32 by default), under which cuDNN computes the whole layer, its input
projections included. torchloom's RNN and LSTM multiply their projections and weight gradients
outside cuDNN; where the two switches disagree, ``mm`` gives those products the recurrent switch's
precision (``kernels.recurrent.projection_mm`` decides), with no process-wide setting touched.

``mm(a, b, precision, bias)``: ``a [M, K] @ b [K, N] (+ bias [N])`` → a fresh ``[M, N]`` float32, any
strides. ``mm_many(products, precision)``: up to ``MAX_PRODUCTS`` independent products in one launch
(a recurrent layer's backward: ``dx``, ``dW_ih`` with the bias gradient as ``gPre``'s row sums, and
``dW_hh``, where four launches ran before). One Triton kernel, ``_mm_many_kernel``: 128 × 64 output
tiles, 8 warps, K in chunks of 32 (the best of nine settings at the layers' shapes on an H200,
bench/RESULTS.md §10 run E), products on TF32 tensor cores with both operands rounded to the nearest
TF32 first (``"tf32"``: as the recurrent loop kernel, whose rounding measured 1.2× the error of
cuDNN's TF32 on an H100, against 2.5× truncated), or fp32 FMA (``"ieee"``); fp32 accumulation. Where a
product has too few tiles to fill the GPU (a weight gradient: ``[H, I]`` summed over ``B·T`` rows), K
is split over more programs, each writing its partial product; one more launch (``_sum_splits_kernel``)
sums the partials of every split product of the call, in a fixed order. ``mm_ref`` is the same math in
PyTorch (TF32 rounding included), which the CPU runs and the tests compare against.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ._launch import launch as _launch_kernel, launch_traced
from ._tl import jit, tl, triton
from ._triton import device_index, sm_count as _sm_count, triton_operator, use_triton

__all__ = ["MAX_PRODUCTS", "PRECISIONS", "Product", "mm", "mm_many", "mm_ref", "mm_traced", "round_tf32_ref"]

PRECISIONS = ("tf32", "ieee")
MAX_PRODUCTS = 3  # products per launch of ``mm_many`` (the kernel's argument slots)
_BLOCK_M, _BLOCK_N, _BLOCK_K = 128, 64, 32
_NUM_WARPS, _NUM_STAGES = 8, 3
_SUM_BLOCK = 1024
_ROUND = True  # "tf32": operands rounded to the nearest TF32 first (False: the tensor cores' truncation)
_MIN_K_PER_SPLIT = 256  # a split's K: at least this many products per output (its partial is written out)
_MAX_SPLIT = 16


class Product(NamedTuple):
    """One product of ``mm_many``: ``a [M, K] @ b [K, N] (+ bias [N])``, or ``a [M, G, K] @ b [G, K, N]``
    summed over both ``G`` and ``K`` (rows no 2-D view holds, e.g. the ``(b, t ≥ 1)`` steps of a
    ``[B, T, H]`` tensor, read in place). ``row_sums``: also ``Σ_k a[m, k] → [M]``, float32 sums of the
    unrounded ``a`` read in the same pass (a bias gradient beside a weight gradient). ``fill``: an
    int32 or float32 ``[M, N]`` tensor, contiguous, whose elements' bits are written as the int32
    ``fill_value`` tile by tile as the product is (a
    persistent loop's sentinel flags, ``kernels.recurrent``, over the tensor the loop will write next to
    reading this product: one launch fewer than a fill of its own)."""

    a: Tensor
    b: Tensor
    bias: Tensor | None = None
    row_sums: bool = False
    fill: Tensor | None = None
    fill_value: int = 0


@jit
def _round_tf32(x):
    """fp32 → the nearest TF32 (10 mantissa bits; ties away from zero), still stored as fp32. NaN and
    ±Inf stay as they are (the bit trick would carry a NaN's payload into the sign: −0)."""
    rounded = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), rounded, x)


@jit
def _product_tile(
    tile, A, B, C, BIAS, RS, FILL,
    M, N, K, KI, s_am, s_ag, s_ak, s_bg, s_bk, s_bn, s_bias, s_cs, s_rs, K_PER_SPLIT, FILL_VALUE,
    HAS_BIAS: tl.constexpr, ROW_SUMS: tl.constexpr, HAS_FILL: tl.constexpr, PRECISION: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Output tile ``tile`` of one product, numbered split-major, then by rows, columns fastest:
    ``C[split] = A[:, ks] @ B[ks, :]`` over the split's ``K_PER_SPLIT`` of the ``K`` products (a multiple
    of ``BLOCK_K``), plus ``BIAS`` in split 0; ``C[split]`` starts at ``split · s_cs``, ``[M, N]``
    row-major. The contracted index ``k`` is ``(g, i) = divmod(k, KI)``: ``A[m, g, i]`` (strides
    ``s_am, s_ag, s_ak``), ``B[g, i, n]`` (``s_bg, s_bk, s_bn``). ``ROW_SUMS``: the first column tile
    also writes ``Σ_ks A[m, k]`` to ``RS + split · s_rs + m``. ``HAS_FILL``: split 0 also writes the
    bits of the int32 ``FILL_VALUE`` over the tile of ``FILL [M, N]`` (int32 or float32, row-major)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_mn = tl.cdiv(M, BLOCK_M) * tiles_n
    split = tile // tiles_mn
    pid_n = tile % tiles_n
    rm = (tile % tiles_mn) // tiles_n * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm_ = rm < M
    nm = rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_start + k + tl.arange(0, BLOCK_K)
        km = ks < K
        gs = (ks // KI).to(tl.int64)
        ins = (ks % KI).to(tl.int64)
        a = tl.load(A + rm64[:, None] * s_am + (gs * s_ag + ins * s_ak)[None, :], mask=mm_[:, None] & km[None, :], other=0.0)
        b = tl.load(B + (gs * s_bg + ins * s_bk)[:, None] + rn64[None, :] * s_bn, mask=km[:, None] & nm[None, :], other=0.0)
        if ROW_SUMS:
            rs += tl.sum(a, axis=1)
        if ROUND:
            a, b = _round_tf32(a), _round_tf32(b)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(BIAS + rn64 * s_bias, mask=nm, other=0.0)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    tl.store(C + split * s_cs + rm64[:, None] * N + rn64[None, :], acc, mask=mm_[:, None] & nm[None, :])
    if ROW_SUMS:
        if pid_n == 0:
            tl.store(RS + split * s_rs + rm64, rs, mask=mm_)
    if HAS_FILL:
        if split == 0:
            flags = tl.full((BLOCK_M, BLOCK_N), FILL_VALUE, tl.int32).to(FILL.dtype.element_ty, bitcast=True)
            tl.store(FILL + rm64[:, None] * N + rn64[None, :], flags, mask=mm_[:, None] & nm[None, :])


@jit
def _mm_many_kernel(
    A0, B0, C0, BIAS0, RS0, F0, M0, N0, K0, KI0, s_am0, s_ag0, s_ak0, s_bg0, s_bk0, s_bn0, s_bias0, s_cs0, s_rs0, KPS0, FV0, P0,
    A1, B1, C1, BIAS1, RS1, F1, M1, N1, K1, KI1, s_am1, s_ag1, s_ak1, s_bg1, s_bk1, s_bn1, s_bias1, s_cs1, s_rs1, KPS1, FV1, P1,
    A2, B2, C2, BIAS2, RS2, F2, M2, N2, K2, KI2, s_am2, s_ag2, s_ak2, s_bg2, s_bk2, s_bn2, s_bias2, s_cs2, s_rs2, KPS2, FV2,
    HAS_BIAS0: tl.constexpr, ROW_SUMS0: tl.constexpr, HAS_FILL0: tl.constexpr,
    HAS_BIAS1: tl.constexpr, ROW_SUMS1: tl.constexpr, HAS_FILL1: tl.constexpr,
    HAS_BIAS2: tl.constexpr, ROW_SUMS2: tl.constexpr, HAS_FILL2: tl.constexpr, NUM: tl.constexpr,
    PRECISION: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``NUM`` products (``_product_tile``'s arguments, suffixed by the product's slot) over one 1-D
    grid: programs ``[0, P0)`` are product 0's tiles, the next ``P1`` product 1's, the rest product 2's."""
    pid = tl.program_id(0)
    if pid < P0:
        _product_tile(pid, A0, B0, C0, BIAS0, RS0, F0, M0, N0, K0, KI0, s_am0, s_ag0, s_ak0, s_bg0, s_bk0, s_bn0,
                      s_bias0, s_cs0, s_rs0, KPS0, FV0, HAS_BIAS0, ROW_SUMS0, HAS_FILL0, PRECISION, ROUND,
                      BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        if NUM > 1:
            if pid < P0 + P1:
                _product_tile(pid - P0, A1, B1, C1, BIAS1, RS1, F1, M1, N1, K1, KI1, s_am1, s_ag1, s_ak1, s_bg1,
                              s_bk1, s_bn1, s_bias1, s_cs1, s_rs1, KPS1, FV1, HAS_BIAS1, ROW_SUMS1, HAS_FILL1,
                              PRECISION, ROUND, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                if NUM > 2:
                    _product_tile(pid - P0 - P1, A2, B2, C2, BIAS2, RS2, F2, M2, N2, K2, KI2, s_am2, s_ag2,
                                  s_ak2, s_bg2, s_bk2, s_bn2, s_bias2, s_cs2, s_rs2, KPS2, FV2, HAS_BIAS2, ROW_SUMS2,
                                  HAS_FILL2, PRECISION, ROUND, BLOCK_M, BLOCK_N, BLOCK_K)


@jit
def _sum_rows(W, O, E, S, LD, offs):
    """``O[e] = Σ_{s < S} W[s · LD + e]`` for the ``offs < E``, adding in order of ``s``."""
    m = offs < E
    offs = offs.to(tl.int64)
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(W + s * LD + offs, mask=m, other=0.0)
    tl.store(O + offs, acc, mask=m)


@jit
def _sum_splits_kernel(
    W0, O0, E0, S0, LD0, W1, O1, E1, S1, LD1, W2, O2, E2, S2, LD2,
    W3, O3, E3, S3, LD3, W4, O4, E4, S4, LD4, W5, O5, E5, S5, LD5,
    NUM: tl.constexpr, BLOCK: tl.constexpr,
):
    """Item ``tl.program_id(1)`` of ``NUM`` (``_sum_rows``' arguments, suffixed by the item's slot):
    split partials ``W [S, ·]`` (row stride ``LD``) summed into ``O [E]``."""
    item = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if item == 0:
        _sum_rows(W0, O0, E0, S0, LD0, offs)
    if NUM > 1:
        if item == 1:
            _sum_rows(W1, O1, E1, S1, LD1, offs)
    if NUM > 2:
        if item == 2:
            _sum_rows(W2, O2, E2, S2, LD2, offs)
    if NUM > 3:
        if item == 3:
            _sum_rows(W3, O3, E3, S3, LD3, offs)
    if NUM > 4:
        if item == 4:
            _sum_rows(W4, O4, E4, S4, LD4, offs)
    if NUM > 5:
        if item == 5:
            _sum_rows(W5, O5, E5, S5, LD5, offs)


def round_tf32_ref(t: Tensor) -> Tensor:
    """``_round_tf32`` in PyTorch: each fp32 element to the nearest TF32 (NaN, ±Inf unchanged)."""
    rounded = ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)
    return torch.where(t.abs() < float("inf"), rounded, t)


def mm_ref(a: Tensor, b: Tensor, precision: str = "tf32", bias: Tensor | None = None) -> Tensor:
    """``mm``'s math in PyTorch: operands rounded to TF32 for ``"tf32"``, then a float32 product (on
    the CPU an exact one; on CUDA cuBLAS's, in whatever precision its switch says)."""
    _check(a, b, precision, bias)
    a, b = a.reshape(a.shape[0], -1), b.reshape(-1, b.shape[-1])
    if precision == "tf32":
        a, b = round_tf32_ref(a), round_tf32_ref(b)
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _check(a: Tensor, b: Tensor, precision: str, bias: Tensor | None, name: str = "mm") -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"fp32_matmul.{name}: precision must be one of {PRECISIONS}, got {precision!r}")
    for arg, t in (("a", a), ("b", b), ("bias", bias)):
        if t is not None and t.dtype != torch.float32:
            raise TypeError(f"fp32_matmul.{name}: {arg} must be float32, got {t.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim() or a.shape[1:] != b.shape[:-1]:
        raise ValueError(f"fp32_matmul.{name}: a [M, K] and b [K, N], or a [M, G, K] and b [G, K, N], needed, got "
                         f"{list(a.shape)} and {list(b.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[-1]):
        raise ValueError(f"fp32_matmul.{name}: bias must be [N] = [{b.shape[-1]}], got {list(bias.shape)}")


def _splits(a: Tensor, m: int, n: int, k: int) -> int:
    """How many programs share each output tile's K: doubled while the product's grid still fits the
    GPU once and each split keeps at least ``_MIN_K_PER_SPLIT`` products (B = 64, T = 64, H = 256 on an
    H200's 132 SMs: 16 and 8 for the ``[256, 256]`` weight gradients over 4,096 and 4,032 rows, 1 for
    the ``[4096, 256]`` projections)."""
    if not a.is_cuda:
        return 1
    tiles = -(-m // _BLOCK_M) * -(-n // _BLOCK_N)
    sms = _sm_count(device_index(a))
    split = 1
    while split < _MAX_SPLIT and tiles * split * 2 <= sms and k >= split * 2 * _MIN_K_PER_SPLIT:
        split *= 2
    return split


class _Launch(NamedTuple):
    """One product's share of a ``_mm_many_kernel`` launch: its kernel arguments and constants, and
    the sums (``(partials, out, elements, splits, row stride)``) that finish it."""

    args: tuple
    constants: tuple
    programs: int
    sums: list


def _plan(p: Product, precision: str, splits: int | None) -> tuple[Tensor, Tensor | None, _Launch | None]:
    """``(out [M, N], row sums [M] or None, launch or None)`` of one product: the outputs are allocated
    (finished here when there is nothing to multiply)."""
    a, b = p.a, p.b
    if a.dim() == 2:  # one group: read as [M, 1, K] @ [1, K, N], with no view made (a compiled graph's code makes each)
        (m, ki), n, groups = a.shape, b.shape[1], 1
        a_strides, b_strides = (a.stride(0), 0, a.stride(1)), (0, b.stride(0), b.stride(1))
    else:
        (m, groups, ki), n = a.shape, b.shape[2]
        a_strides, b_strides = a.stride(), b.stride()
    k = groups * ki
    if k == 0 or m == 0 or n == 0:  # an empty sum, or an empty output
        if p.fill is not None:
            p.fill.view(torch.int32).fill_(p.fill_value)
        out = a.new_zeros(m, n)
        return (out if p.bias is None else out.add_(p.bias)), (a.new_zeros(m) if p.row_sums else None), None
    split = splits or _splits(a, m, n, k)
    per_split = -(-(-(-k // split)) // _BLOCK_K) * _BLOCK_K  # K of one split, whole chunks
    split = -(-k // per_split)
    if split == 1:
        out, rs = a.new_empty(m, n), (a.new_empty(m) if p.row_sums else None)
        c, rs_ptr, s_cs, s_rs, sums = out, rs, 0, 0, []
    else:  # each split's partial product and row sums in scratch rows, then summed
        c, rs_ptr = a.new_empty(split, m * n), (a.new_empty(split, m) if p.row_sums else None)
        out, rs = a.new_empty(m, n), (a.new_empty(m) if p.row_sums else None)
        s_cs, s_rs = m * n, m
        sums = [(c, out, m * n, split, m * n)] + ([(rs_ptr, rs, m, split, m)] if p.row_sums else [])
    bias = p.bias
    args = (a, b, c, bias if bias is not None else c, rs_ptr if rs_ptr is not None else c,
            p.fill if p.fill is not None else c,
            m, n, k, max(ki, 1), *a_strides, *b_strides,
            bias.stride(0) if bias is not None else 0, s_cs, s_rs, per_split, p.fill_value)
    tiles = -(-m // _BLOCK_M) * -(-n // _BLOCK_N)
    return out, rs, _Launch(args, (bias is not None, p.row_sums, p.fill is not None), tiles * split, sums)


def mm_many(products: Sequence[Product], precision: str = "tf32", backend: str | None = None,
            splits: int | None = None, traced: bool = False) -> list[tuple[Tensor, Tensor | None]]:
    """Each ``Product`` (at most ``MAX_PRODUCTS``) → ``(a @ b (+ bias) [M, N], Σ_k a [M] or None)``,
    fresh float32 tensors, in ``precision`` as ``mm``; on CUDA one launch of ``_mm_many_kernel`` for
    all of them, and one of ``_sum_splits_kernel`` where any product's K was split (``splits``: the
    programs per output tile along each product's contraction, default enough to fill the GPU). Off
    Triton (``backend`` as in ``use_triton``): ``mm_ref`` and PyTorch's row sums. ``traced``: inside a
    ``torch.library.triton_op``, the launches through ``torch.library.wrap_triton`` (``mm_traced``)."""
    if not 1 <= len(products) <= MAX_PRODUCTS:
        raise ValueError(f"fp32_matmul.mm_many: products must hold 1 to {MAX_PRODUCTS} Product, got {len(products)}")
    for p in products:
        if not isinstance(p, Product):
            raise TypeError(f"fp32_matmul.mm_many: products must be Product tuples, got {type(p).__name__}")
        _check(p.a, p.b, precision, p.bias, "mm_many")
        shape = [p.a.shape[0], p.b.shape[-1]]
        if p.fill is not None and (p.fill.dtype not in (torch.int32, torch.float32) or list(p.fill.shape) != shape
                                   or not p.fill.is_contiguous()):
            raise ValueError(f"fp32_matmul.mm_many: fill must be a contiguous int32 or float32 {shape}, got {p.fill.dtype} "
                             f"{list(p.fill.shape)} strides {p.fill.stride()}")
    devices = {t.device for p in products for t in (p.a, p.b, p.bias, p.fill) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"fp32_matmul.mm_many: every operand must be on one device, got {sorted(map(str, devices))}")
    if not use_triton(products[0].a, backend, (torch.float32,)):
        for p in products:
            if p.fill is not None:
                p.fill.view(torch.int32).fill_(p.fill_value)  # the bits, whichever of the two dtypes
        return [(mm_ref(p.a, p.b, precision, p.bias), p.a.reshape(p.a.shape[0], -1).sum(1) if p.row_sums else None)
                for p in products]
    results, launches = [], []
    for p in products:
        out, rs, launch = _plan(p, precision, splits)
        results.append((out, rs))
        if launch is not None:
            launches.append(launch)
    if launches:
        _launch(launches, precision, launch_traced if traced else _launch_kernel)
    return results


def _launch(launches: list[_Launch], precision: str, launch=_launch_kernel) -> None:
    """One ``_mm_many_kernel`` launch over ``launches``' programs (the unused slots take the first
    product's numbers and, for every tensor, its output, which the kernel never touches there: in a
    compiled graph's code a view of an operand is made anew for each argument that takes it), then one
    ``_sum_splits_kernel`` launch over every split's sums; each through ``launch`` (``_launch.launch`` or
    ``launch_traced``). No tensor the kernel writes is passed in another argument that it also writes,
    nor overlaps one: a compiled graph's functionalisation copies each written argument on its own.
    (The spare slots and the absent bias, row sums or fill repeat a product's output, in arguments the
    constexprs leave untouched.)"""
    first = launches[0]
    spare = first._replace(args=tuple(first.args[2] if isinstance(x, Tensor) else x for x in first.args))
    slots = launches + [spare] * (MAX_PRODUCTS - len(launches))
    args = []
    for i, ln in enumerate(slots):
        args += list(ln.args) + ([ln.programs] if i < MAX_PRODUCTS - 1 else [])
    constants = {}
    for i, ln in enumerate(slots):
        constants[f"HAS_BIAS{i}"], constants[f"ROW_SUMS{i}"], constants[f"HAS_FILL{i}"] = ln.constants
    constants.update(NUM=len(launches), PRECISION=precision, ROUND=precision == "tf32" and _ROUND,
                     BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    launch(_mm_many_kernel, (sum(ln.programs for ln in launches),), tuple(args), constants,
           {"num_warps": _NUM_WARPS, "num_stages": _NUM_STAGES})
    sums = [s for ln in launches for s in ln.sums]
    if sums:
        items = sums + [sums[0]] * (2 * MAX_PRODUCTS - len(sums))
        sum_args = [x for item in items for x in item]
        width = max(e for _, _, e, _, _ in sums)
        launch(_sum_splits_kernel, (-(-width // _SUM_BLOCK), len(sums)), tuple(sum_args),
               {"NUM": len(sums), "BLOCK": _SUM_BLOCK}, {"num_warps": 4})


def mm(a: Tensor, b: Tensor, precision: str = "tf32", bias: Tensor | None = None, backend: str | None = None,
       splits: int | None = None) -> Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` → a fresh float32 ``[M, N]`` with products in
    ``precision``: ``"tf32"`` (operands rounded to the nearest TF32, TF32 tensor cores) or ``"ieee"``
    (fp32 FMA); fp32 accumulation, any operand strides. Also ``a [M, G, K]``, ``b [G, K, N]``: the sum
    over both ``G`` and ``K`` (a product over rows that no 2-D view holds, e.g. the ``(b, t ≥ 1)``
    steps of a ``[B, T, H]`` tensor, read in place). The Triton kernel on CUDA (``backend`` as in
    ``use_triton``), else ``mm_ref``. ``splits``: programs per output tile along the contraction
    (default: enough to fill the GPU; the tests set it)."""
    _check(a, b, precision, bias)
    return mm_many([Product(a, b, bias)], precision, backend, splits)[0][0]


def _mm_op(a: Tensor, b: Tensor, bias: Tensor | None, precision: str) -> Tensor:
    return mm_many([Product(a, b, bias)], precision, traced=True)[0][0]


if triton is not None and hasattr(torch.library, "triton_op"):  # else ``recurrent.compiled_plan`` never routes here
    _FP32_MM = triton_operator("torchloom::fp32_mm", _mm_op)  # the operator, as the traced code calls it
else:
    _FP32_MM = None


def mm_traced(a: Tensor, b: Tensor, precision: str, bias: Tensor | None = None) -> Tensor:
    """``mm`` on CUDA for code that ``torch.compile`` traces: ``torchloom::fp32_mm``
    (``torch.library.triton_op``), whose launches Inductor's own code makes."""
    return _FP32_MM(a, b, bias, precision)
