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

    jit: Callable[[Callable[..., Any]], Any] = triton.jit
except ImportError:  # Triton is an optional dependency
    triton = None
    tl = None

    def jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn


if triton is not None:  # Triton's installation key from the last process, not hashed again (_key_cache)
    from ._key_cache import install as _install_key_cache

    _install_key_cache(triton)

__all__ = ["triton", "tl", "jit"]
