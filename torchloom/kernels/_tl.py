"""Triton for the kernel modules, or stand-ins when it is not installed.

Only the kernel modules import this file, and they are imported on an op's first use, so
``import torchloom`` never imports Triton. Without Triton, ``jit`` leaves the kernel a plain
function that is never launched: ``_triton.use_triton`` picks the reference instead. The kernel
modules use ``from __future__ import annotations`` so ``BLOCK: tl.constexpr`` stays a string that
Triton reads, and needs no ``tl`` when Triton is absent.
"""

from __future__ import annotations

from typing import Any, Callable

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is an optional dependency
    triton = None
    tl = None

_keys: Any = None
if triton is not None:  # Triton's keys from the last process, not hashed again (_key_cache)
    from ._key_cache import install as _install_key_cache
    from ._key_cache import kernel_keys as _kernel_keys

    _install_key_cache(triton)
    _keys = _kernel_keys(triton)


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``, given the ``cache_key`` an earlier process stored for it (its source block
    too, through ``_key_cache.TritonInspect``); without Triton, ``fn`` itself (never launched)."""
    if triton is None:
        return fn
    kernel = triton.jit(fn)
    if _keys is not None:
        _keys.adopt(kernel)
    return kernel


__all__ = ["triton", "tl", "jit"]
