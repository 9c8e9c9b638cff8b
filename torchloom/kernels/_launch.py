"""Launching a Triton kernel again without Triton re-deriving its specialisation on every call.

``kernel[grid](*args, **constants)`` (``JITFunction.run``) binds every argument, specialises it
(dtype and 16-byte alignment of each tensor, value class of each integer), formats a cache key and
looks the compiled kernel up on every call: 20 µs of host time for the RNN loop kernel's 15 arguments
and about 60 µs for ``fp32_matmul``'s 66 on an H200's host (the compiled kernel's own launch: 6 µs).
A host-bound caller, such as the recurrent layers' opaque operators (five kernels per compiled RNN step),
calls ``launch`` instead. The compiled kernel is kept under a key that holds everything Triton
specialises on, and more:

- each tensor's dtype and whether its address is a multiple of 16;
- every other argument's exact value (and its type, unless it is an ``int``);
- the constexprs and launch options;
- the current CUDA device.

A hit launches the kept kernel directly, with the same stream and launch hooks Triton would use. A
miss launches through ``kernel[grid]`` as usual, compiling if needed, and keeps the kernel Triton
returns. What a hit does not re-check: the values of global variables the kernel's source reads
(torchloom's kernels read none that change), and Triton's debug, instrumentation and inspection
settings (knobs that change how a kernel compiles: set them before the first launch). A kernel with
``pre_run_hooks`` always takes the ordinary path.

The direct launch passes every parameter, constexprs included, in signature order: the protocol of
Triton 3.3 to 3.x (checked on 3.6 on the GPU, 3.9 here). On any other Triton, under the interpreter,
and for a kernel whose constexprs are not all given by keyword, every call takes the ordinary path.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

__all__ = ["launch", "clear_cache", "direct_launch_usable", "launch_traced"]

_MAX_ENTRIES = 4096  # kept kernels (per shape and alignment); the cache starts over when full
_cache: dict[tuple, tuple[Any, tuple]] = {}
_usable: list[bool] = []  # decided on the first launch
_local = threading.local()  # .recording: ``_replay``'s recording of this thread's call, told of each launch


def direct_launch_usable() -> bool:
    """Whether a kept compiled kernel can be launched directly here (a supported Triton, no interpreter)."""
    if not _usable:
        from ._tl import triton
        from ._triton import interpreter_enabled

        ok = False
        if triton is not None and not interpreter_enabled():
            try:
                version = tuple(int(p) for p in triton.__version__.split(".")[:2])
            except ValueError:  # a development version string
                version = ()
            ok = (3, 3) <= version < (4, 0)
        _usable.append(ok)
    return _usable[0]


def clear_cache() -> None:
    """Forget every kept kernel (the next launch of each goes through Triton's own lookup)."""
    _cache.clear()


def launch(kernel: Any, grid: tuple[int, ...], args: tuple, constants: dict[str, Any],
           options: dict[str, Any] | None = None) -> None:
    """``kernel[grid](*args, **constants, **options)``, through the kept compiled kernel where one
    matches (module note). ``args``: the positional parameters; ``constants``: every remaining
    parameter by name (the constexprs); ``options``: launch options such as ``num_warps`` and
    ``launch_cooperative_grid``. While ``_replay`` records this thread's call, the launch is reported to it."""
    options = options or {}
    recording = getattr(_local, "recording", None)
    if recording is None:
        _launch(kernel, grid, args, constants, options)
        return
    with recording.paused():  # the launch's own tensor operations (the interpreter's) are not the call's
        compiled = _launch(kernel, grid, args, constants, options)
    recording.note_launch(kernel, compiled, grid, args, constants, options)


def launch_traced(kernel: Any, grid: tuple[int, ...], args: tuple, constants: dict[str, Any],
                  options: dict[str, Any] | None = None) -> None:
    """``launch``'s call for the body of a ``torch.library.triton_op``: through
    ``torch.library.wrap_triton``, so that a compiled graph holds the launch itself and Inductor's
    code makes it (eager calls of the operator launch through Triton's own path)."""
    torch.library.wrap_triton(kernel)[grid](*args, **constants, **(options or {}))


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple, constants: dict[str, Any], options: dict[str, Any]) -> Any:
    """``launch``; returns the compiled kernel kept for these arguments, or None."""
    if not direct_launch_usable() or getattr(kernel, "pre_run_hooks", None):
        kernel[grid](*args, **constants, **options)
        return None
    spec = tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor) else (a if type(a) is int else (type(a), a))
                  for a in args])
    key = (kernel, torch.cuda.current_device(), spec, tuple(constants.items()), tuple(options.items()))
    entry = _cache.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **constants, **options)
        tail = kernel.arg_names[len(args):]
        if compiled is None or not hasattr(compiled, "run") or len(tail) != len(constants) or set(tail) != set(constants):
            return None
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
        _cache[key] = (compiled, tuple(constants[name] for name in tail))
        return compiled
    compiled, tail = entry
    compiled[grid + (1,) * (3 - len(grid))](*args, *tail)
    return compiled
