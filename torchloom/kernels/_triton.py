"""The one place that decides whether an op runs its Triton kernel or its PyTorch reference, and how
a kernel is launched (block size, warps, grid).

Triton runs on CUDA tensors when it is installed. On CPU tensors it runs only through Triton's
interpreter (``TRITON_INTERPRET=1`` set before the first kernel module is imported), which is how CI,
without a GPU, checks every kernel. ``import torchloom`` never imports Triton: kernel modules import
it (through ``_tl``) when an op is first dispatched; this file imports it only when asked whether it
is available.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch
from torch import autocast, float32, get_autocast_dtype, is_autocast_enabled
from torch.compiler import is_compiling

from . import _preload

__all__ = [
    "BACKENDS",
    "KERNEL_DTYPES",
    "triton_available",
    "interpreter_enabled",
    "use_triton",
    "use_kernel",
    "constant_under_compile",
    "triton_operator",
    "traced_as_reference",
    "compute_dtype",
    "cast",
    "exact_div",
    "check_backend",
    "elementwise_settings",
    "row_settings",
    "launch_override",
]

BACKENDS = (None, "triton", "reference")

# dtypes the kernels of this package handle (they load these, compute in float32 and store back);
# float64 runs the reference, which is exact in float64.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def constant_under_compile(fn: Callable) -> Callable:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: while ``torch.compile`` traces a
    call of ``fn``, Dynamo runs it once and keeps its result as a constant, without tracing into it and
    without guarding on what it reads (the environment, module state, the Triton import). That public
    decorator sets exactly this attribute (a test checks it), but importing it loads ``torch._dynamo``
    (about a second), which ``import torchloom`` must not. Only for decisions that cannot change
    within a process, or whose change may keep an already compiled graph."""
    fn._dynamo_marked_constant = True
    return fn


def triton_operator(qualname: str, fn: Callable, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Register ``fn`` as the operator ``qualname`` ("namespace::name", ``torch.library.triton_op``)
    and return it as the code that torch.compile traces calls it: ``torch.ops.<namespace>.<name>``,
    bound once here. Read at each call instead, the shared ``torch.ops.<namespace>`` object, reached
    from two modules' globals, made Dynamo add an aliasing check to every compiled call's guards."""
    torch.library.triton_op(qualname, fn, mutates_args=mutates_args)
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name)


def triton_available() -> bool:
    """True when the ``triton`` package imports (imported here, on the first question; then a lookup in
    ``sys.modules``). No ``functools.lru_cache``: ``use_triton`` runs while ``torch.compile`` traces a
    CUDA layer, and Dynamo warns the user about every cached function it traces through."""
    from ._tl import triton

    return triton is not None


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The streaming multiprocessors of CUDA device ``index`` (kernels that size their grid to the GPU)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def tf32_capable(index: int) -> bool:
    """Whether CUDA device ``index`` has TF32 tensor cores (compute capability 8.0 or later): below it
    cuBLAS and cuDNN multiply float32 exactly whatever their switches say, and so do the kernels."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _allows_tf32(op: str, legacy: Callable[[], bool]) -> bool:
    """Whether PyTorch's CUDA ``op`` ("matmul": cuBLAS; "rnn": cuDNN's RNN) multiplies float32 in TF32
    now, resolved as PyTorch's own kernels resolve it: the op's ``fp32_precision``, "none" deferring to
    the CUDA backend's setting (``torch.backends.cudnn.fp32_precision``) and then the generic one
    (``torch.backends.fp32_precision``), "none" throughout meaning IEEE. The legacy ``allow_tf32``
    getters refuse to answer after some settings of that API, which the kernels accept; ``legacy()``
    answers on a torch without it."""
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is None:
        return bool(legacy())
    for backend, each in (("cuda", op), ("cuda", "all"), ("generic", "all")):
        precision = getter(backend, each)
        if precision != "none":
            return precision == "tf32"  # "bf16" on CUDA: not TF32
    return False


def cublas_allows_tf32() -> bool:
    """Whether cuBLAS multiplies float32 in TF32 now (``torch.backends.cuda.matmul``; ``_allows_tf32``)."""
    return _allows_tf32("matmul", lambda: torch.backends.cuda.matmul.allow_tf32)


def cudnn_rnn_allows_tf32() -> bool:
    """Whether cuDNN's RNN (``nn.RNN``, ``nn.LSTM``) multiplies float32 in TF32 now
    (``torch.backends.cudnn.rnn``; ``_allows_tf32``)."""
    return _allows_tf32("rnn", lambda: torch.backends.cudnn.allow_tf32)


def device_index(t: torch.Tensor) -> int | None:
    """The CUDA device index of ``t`` (the current device for a bare ``"cuda"``), or None off CUDA: the
    key of ``sm_count`` and ``tf32_capable``."""
    if not t.is_cuda:
        return None
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# ------------------------------------------------------------------------------ autocast
# Kept together, and reached by the names imported above (``nullcontext``, ``autocast``), never as
# ``torch.X`` / ``contextlib.X``: while torch.compile traces a layer, every global it reads is a guard
# checked on each call of the compiled graph, and the ``torch`` module read from a second module's
# globals adds a Python-level aliasing check (``a.torch is b.torch``) to those guards.
@constant_under_compile  # sound: the autocast state is part of every compiled graph's global-state guard
def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matrix products to on ``device_type`` ("cuda", "cpu"), or
    ``None`` when autocast is off there."""
    try:
        if is_autocast_enabled(device_type):
            return get_autocast_dtype(device_type)
    except (RuntimeError, ValueError):  # a device type autocast does not know
        return None
    return None


def cast_for_autocast(
    device_type: str, *tensors: torch.Tensor | None
) -> tuple[torch.dtype | None, tuple[torch.Tensor | None, ...]]:
    """``(dtype, tensors)``: under autocast on ``device_type``, every float32/float16/bfloat16 tensor
    cast to the autocast dtype (float64 and integer tensors and ``None`` pass unchanged, as autocast
    leaves them); otherwise ``(None, tensors)`` unchanged."""
    dt = autocast_dtype(device_type)
    if dt is None:
        return None, tensors
    return dt, tuple(
        t.to(dt) if t is not None and t.is_floating_point() and t.dtype.itemsize <= 4 else t for t in tensors
    )


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on ``device_type``: the hand-written backwards run in the
    dtypes their forward saved, whether or not the caller's ``backward()`` sits inside autocast; and
    an opaque operator of a compiled graph computes in its inputs' dtypes, whether or not the graph
    runs under the caller's autocast."""
    if device_type in ("cuda", "cpu") and autocast_dtype(device_type) is not None:
        return autocast(device_type=device_type, enabled=False)
    return nullcontext()


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Ops (and input dtypes) that, while ``torch.compile`` traces, hand Inductor their PyTorch reference
# (the same forward and hand-written backward formulas, as torch ops) instead of their registered
# Triton kernel: Inductor then generates their kernels itself and can fuse them with the neighbouring
# ops (a residual add before a norm, the bias sums of SwiGLU's backward), which an opaque kernel call
# cannot join. Chosen per op and dtype by the device time of a compiled step against PyTorch's module
# compiled the same way (bench/RESULTS.md §10, H200): the norms' kernels win in float32 (RMSNorm
# 0.95×, LayerNorm 0.86×, against 1.01× / 0.99× as reference) and lose in bfloat16 (1.26× / 1.38×,
# against 0.99× / 0.99×); SwiGLU's gate is at parity or better as reference (1.00× / 0.91×). Softmax
# (not timed on its own) goes as reference in every dtype, as the gate does. ``bench_layers.py
# --compiled --compiled-kernels`` empties the table to time the kernels. An explicit
# ``backend="triton"`` still reaches the kernel under compile; eager calls and CUDA graphs always do.
_HALF = (torch.float16, torch.bfloat16)
_ALL = (torch.float32, *_HALF)
COMPILED_AS_REFERENCE: dict[str, tuple[torch.dtype, ...]] = {
    "rmsnorm": _HALF, "layernorm": _HALF, "softmax": _ALL, "swiglu": _ALL,
}


def traced_as_reference(op: str, dtype: torch.dtype, backend: str | None = None) -> bool:
    """True while ``torch.compile`` traces ``op`` on an input of ``dtype`` that ``COMPILED_AS_REFERENCE``
    names, with the default backend: the caller then returns its reference's result."""
    return is_compiling() and _named_as_reference(op, dtype, backend)


@constant_under_compile
def _named_as_reference(op: str, dtype: torch.dtype, backend: str | None) -> bool:
    return backend is None and dtype in COMPILED_AS_REFERENCE.get(op, ())


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The references' arithmetic dtype: float32 for half-precision inputs (as the kernels compute),
    float32/64 in their own dtype."""
    return float32 if t.dtype.is_floating_point and t.dtype.itemsize == 2 else t.dtype


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, the tensor itself when it already is (no ``.to`` call). Measured on torch
    2.11: a no-op ``.to(dtype)`` of an input or saved tensor inside an ``autograd.Function`` made its
    compiled gradients wrong (RMSNorm's ``dx`` off by 4.5 on an [8, 24] input, CPU and CUDA,
    aot_eager and Inductor); torch 2.13 is right either way. The references use this for every cast."""
    return t if t.dtype == dtype else t.to(dtype)


def exact_div(t: torch.Tensor, by: float) -> torch.Tensor:
    """``t / by`` rounded as IEEE division on every device: CUDA PyTorch divides by a Python number
    (and takes a mean) as a product with its float32 reciprocal, which can differ in the last bit from
    the CPU's division and the kernels' ``div_rn``; a tensor divisor is divided exactly everywhere (a
    device fill: no host sync, graph-capturable)."""
    return t / torch.full_like(t, by)


def check_backend(backend: str | None) -> None:
    if backend not in BACKENDS:
        raise ValueError(_bad_backend(backend))


def _bad_backend(backend: object) -> str:
    return f"backend must be one of {BACKENDS}, got {backend!r}"


def use_triton(tensor: torch.Tensor, backend: str | None = None, dtypes: tuple[torch.dtype, ...] | None = None) -> bool:
    """Pick the implementation for an op on ``tensor``.

    ``backend=None``: Triton for CUDA tensors when Triton is installed (and ``tensor.dtype`` is in
    ``dtypes`` when given), else the reference. ``backend="reference"``: always the reference.
    ``backend="triton"``: Triton, required; on a CPU tensor this needs the interpreter. Raises
    ``RuntimeError`` when Triton was asked for and cannot run, ``ValueError`` when it was asked for
    a dtype outside ``dtypes``.
    """
    return _chosen(*_use_triton(tensor.is_cuda, tensor.dtype, backend, dtypes))


def use_kernel(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """``use_triton(tensor, backend, KERNEL_DTYPES)``: whether an op with kernels for float32, float16
    and bfloat16 runs its kernel on ``tensor`` (the question every layer's op asks)."""
    return _chosen(*_use_kernel(tensor.is_cuda, tensor.dtype, backend))


def _chosen(chosen: bool, error: str, message: str) -> bool:
    # Raised here, outside the folded decision: an exception raised inside a function Dynamo runs
    # while tracing reaches the user as Dynamo's internal error, not as this ValueError/RuntimeError.
    if error:
        raise (ValueError if error == "value" else RuntimeError)(message)
    return chosen


# The decision itself, on plain values (the device and the dtype are fixed while torch.compile traces),
# folded to a constant there: traced, its reads of the environment, the Triton import and the
# tables below would each become a guard that every compiled call checks. (A tensor argument would
# make Dynamo compute the tensor's real value at trace time.) Returns (chosen, error kind, message).
@constant_under_compile
def _use_kernel(is_cuda: bool, dtype: torch.dtype, backend: str | None) -> tuple[bool, str, str]:
    return _use_triton(is_cuda, dtype, backend, KERNEL_DTYPES)


@constant_under_compile
def _use_triton(is_cuda: bool, dtype: torch.dtype, backend: str | None, dtypes: tuple[torch.dtype, ...] | None
                ) -> tuple[bool, str, str]:
    if backend not in BACKENDS:
        return False, "value", _bad_backend(backend)
    if backend == "reference":
        return False, "", ""
    dtype_ok = dtypes is None or dtype in dtypes
    if backend is None:
        chosen = is_cuda and dtype_ok and not interpreter_enabled() and triton_available()
    else:
        if not triton_available():
            return False, "runtime", "backend='triton' was requested but the triton package is not installed"
        if not is_cuda and not interpreter_enabled():
            return False, "runtime", ("backend='triton' on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
                                      "before importing torchloom's kernels")
        if not dtype_ok:
            return False, "value", f"backend='triton': the kernel handles dtypes {dtypes}, got {dtype}; use backend=None or 'reference'"
        chosen = True
    if chosen and _preload._importing:  # a launch follows: Triton's modules must be whole first
        _preload.wait_for_imports()
    return chosen, "", ""


# ------------------------------------------------------------------------------- launch settings
# Streaming kernels (one element per lane, nothing reused): BLOCK 1024 with 4 warps is 8 values per
# thread, two 16-byte vector loads per tensor, the setting of Triton's own vector-add tutorial that
# runs at the copy bandwidth; bench/bench_kernels.py --sweep re-checks it on the GPU at hand.
_CUDA_ELEMENTWISE = (1024, 4)
# The interpreter runs programs one after another in Python: few large blocks keep a 1M-element
# launch to a few hundred milliseconds.
_INTERPRETER_MAX_BLOCK = 1 << 16
# One row per program: a row up to this length sits in registers in one piece; longer rows loop.
_CUDA_MAX_ROW_BLOCK = 8192

_override: tuple[int, int] | None = None


@contextlib.contextmanager
def launch_override(block: int, num_warps: int) -> Iterator[None]:
    """Within the block, streaming kernels on CUDA use ``block`` and ``num_warps`` (for the benchmark's
    sweep; nothing else sets it)."""
    global _override
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    previous, _override = _override, (block, num_warps)
    try:
        yield
    finally:
        _override = previous


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def elementwise_settings(n: int, is_cuda: bool, cuda_default: tuple[int, int] = _CUDA_ELEMENTWISE) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, programs)`` for a kernel where each program streams ``BLOCK`` of ``n``
    elements, on CUDA (``cuda_default`` unless the benchmark's sweep overrides it) or
    (``is_cuda=False``) in the interpreter."""
    if is_cuda:
        block, num_warps = _override or cuda_default
    else:
        block, num_warps = min(max(_next_pow2(n), 16), _INTERPRETER_MAX_BLOCK), 4
    return block, num_warps, max(-(-n // block), 1)


def row_settings(n_cols: int, is_cuda: bool) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for a one-row-per-program kernel: the row length rounded up to a power of
    two (capped: longer rows loop over chunks), one warp per 256 values (8 per thread) up to 16 warps,
    so short rows (10 classes) do not leave three idle warps per program."""
    cap = _CUDA_MAX_ROW_BLOCK if is_cuda else _INTERPRETER_MAX_BLOCK
    block = min(max(_next_pow2(n_cols), 16), cap)
    num_warps = min(max(block // 256, 1), 16)
    return block, num_warps
