"""Triton and a run's kernel modules, imported on a helper thread while the run gets ready.

A fresh process pays Triton's start before its first kernel runs: importing Triton, creating every
``JITFunction`` of the kernel modules (parsing their sources), initialising Triton's CUDA driver
state, and (Triton 3.6) importing ``triton.experimental.gluon`` during the first kernel's argument
specialisation. Measured on the H100 machine: ~0.2 s of a 0.3–0.4 s four-epoch run at batch 1,024,
all of it before the first step. Meanwhile the run's own thread spends much of its time outside
Python (copying batches to the GPU, loading cuBLAS's kernels on the first forward, reading label
ranges), with the interpreter lock released: a helper thread can do Triton's imports then.

``Preload(modules)``: the thread imports Triton's modules and then ``modules``; ``join()`` waits
for it. It only imports, so the run's thread may go on meanwhile, importing and launching what it
needs (Python's module locks hand each module to one importer; Triton's runtime objects, such as its
driver, are made by the run's thread alone). Nothing here raises: a module that fails to import is
imported again by the code that needs it, which reports the error where it belongs. Once a process
has imported the modules, a later ``Preload`` of them starts no thread. ``TORCHLOOM_PRELOAD=0`` in
the environment switches the thread off (every import then happens where it is first needed).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterable

__all__ = ["Preload"]


def _warm_triton() -> None:
    """Import the Triton modules a first kernel launch would import on the run's thread."""
    try:  # the package first: a thread importing it meanwhile never sees a half-made submodule
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - no Triton: the kernels fall back to their references
        return
    try:  # Triton 3.6 imports it while specialising the first kernel's arguments (0.1 s)
        importlib.import_module("triton.experimental.gluon")
    except Exception:  # noqa: BLE001 - absent in other Triton versions: nothing to warm
        pass


class Preload:
    """Imports ``modules`` (dotted names) and warms Triton on a daemon thread; ``join()`` waits for it.

    No thread starts when every module is already in ``sys.modules`` (a later run in the same
    process)."""

    def __init__(self, modules: Iterable[str]) -> None:
        missing = [m for m in dict.fromkeys(modules) if m not in sys.modules]
        if os.environ.get("TORCHLOOM_PRELOAD", "1") == "0":
            missing = []
        self._thread: threading.Thread | None = None
        if missing:
            self._thread = threading.Thread(target=self._run, args=(missing,), name="torchloom-preload", daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        """Whether a thread was started (False when everything was imported before)."""
        return self._thread is not None

    @staticmethod
    def _run(modules: list[str]) -> None:
        _warm_triton()
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - imported again where it is used, which raises there
                pass

    def join(self) -> None:
        """Wait for the thread (at once when none was started or it has finished)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
