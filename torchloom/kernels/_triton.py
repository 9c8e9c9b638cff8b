"""The one place that decides whether an op runs its Triton kernel or its PyTorch reference.

Triton runs on CUDA tensors when it is installed. On CPU tensors it runs only through Triton's
interpreter (``TRITON_INTERPRET=1`` set before the first kernel module is imported), which is how CI,
without a GPU, checks every kernel. ``import torchloom`` never imports Triton: kernel modules import
it when an op is first dispatched.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["triton_available", "interpreter_enabled", "use_triton", "check_backend", "BACKENDS"]

BACKENDS = (None, "triton", "reference")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(backend: str | None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Pick the implementation for an op on ``tensor``.

    ``backend=None``: Triton for CUDA tensors when Triton is installed, else the reference.
    ``backend="reference"``: always the reference. ``backend="triton"``: Triton, required; on a CPU
    tensor this needs the interpreter. Raises ``RuntimeError`` when Triton was asked for and cannot run.
    """
    check_backend(backend)
    if backend == "reference":
        return False
    if backend is None:
        return tensor.is_cuda and triton_available() and not interpreter_enabled()
    if not triton_available():
        raise RuntimeError("backend='triton' was requested but the triton package is not installed")
    if not tensor.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            "backend='triton' on a CPU tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before importing torchloom's kernels"
        )
    return True
