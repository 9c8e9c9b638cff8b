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


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``; without Triton, ``fn`` itself (never launched)."""
    if triton is None:
        return fn
    return triton.jit(fn)


__all__ = ["triton", "tl", "jit"]
