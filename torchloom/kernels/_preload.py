"""Triton and a run's kernel modules, imported on helper threads while the run gets ready.

A fresh process pays Triton's start before its first kernel runs: importing Triton, creating every
``JITFunction`` of the kernel modules (parsing their sources), initialising Triton's CUDA driver
state, and (Triton 3.6) importing ``triton.experimental.gluon`` during the first kernel's argument
specialisation. Measured on the H100 machine: ~0.2 s of a 0.3–0.4 s four-epoch run at batch 1,024,
all of it before the first step. Meanwhile the run's own thread spends much of its time outside
Python (copying batches to the GPU, loading cuBLAS's kernels on the first forward, reading label
ranges), with the interpreter lock released: a helper thread can do Triton's imports then.

``Preload(modules, arch)``: one thread imports Triton's modules and then ``modules``; once Triton's
package is imported, a second asks the questions Triton's first launch would ask of the system
(``_warm_tools``: a few subprocesses and file stats whose answers Triton remembers); ``join()`` waits
for both. They only import and ask (Triton's runtime objects, such as its driver, are made by the
run's thread alone). Two threads importing into a package that is still being imported can each
find the other's module half made, so a thread about to launch a Triton kernel first waits for the
importing thread (``wait_for_imports``, asked by ``_triton.use_triton``: a layer's forward that
checks the batches may launch one), and the engine joins both before it builds its device runner.
Python's switch interval is left as the process has it (shortening it while the threads run saved
~18 ms of a 0.2 s run on the H100 machine, but it is a process-wide setting: not torchloom's to
change; bench/RESULTS.md). Nothing here raises: a module that fails to
import is imported again by the code that needs it, which reports the error where it belongs. Once
a process has imported the modules, a later ``Preload`` of them starts no thread. ``TORCHLOOM_PRELOAD=0`` in the environment
switches the threads off (every import then happens where it is first needed).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["Preload", "wait_for_imports"]

# one Event per import thread not yet ended (set when it ends, or fails to start): another thread's
# first Triton launch waits for them (``wait_for_imports``); an import thread never waits
_importing: list[threading.Event] = []
_this_thread = threading.local()


def wait_for_imports() -> None:
    """Wait for every preload thread still importing Triton's modules (none: at once). Called before
    a thread's Triton launch (``_triton.use_triton``): a launch imports Triton's modules lazily (Triton
    3.6's ``triton.experimental.gluon``), and a submodule imported while another thread is still
    importing its package can come out half made. Never raises (a thread not yet started is waited
    for through its Event)."""
    if getattr(_this_thread, "imports", False):
        return
    for ended in list(_importing):
        ended.wait()


def _imports_ended(ended: threading.Event) -> None:
    ended.set()
    with contextlib.suppress(ValueError):
        _importing.remove(ended)


def _warm_triton() -> bool:
    """Import the Triton modules a first kernel launch would import on the run's thread; False when
    there is no Triton."""
    try:  # the package first: a thread importing it meanwhile never sees a half-made submodule
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - no Triton: the kernels fall back to their references
        return False
    try:  # Triton 3.6 imports it while specialising the first kernel's arguments (0.1 s)
        importlib.import_module("triton.experimental.gluon")
    except Exception:  # noqa: BLE001 - absent in other Triton versions: nothing to warm
        pass
    return True


def _ask(module: str, name: str, *args: Any) -> None:
    """Ask Triton's ``module.name(*args)`` now, on this thread, so that its remembered answer is ready
    (each question is a pure function behind ``functools.lru_cache``, asked on its own: one that is
    missing or fails leaves the others to be asked; the run's thread asks again and reports any
    error there)."""
    with contextlib.suppress(Exception):
        fn = getattr(importlib.import_module(module), name, None)
        if fn is None:
            return
        try:
            fn(*args)
        except TypeError:  # an older Triton: get_ptxas_version() takes no architecture
            if args:
                fn()


def _warm_tools(arch: int | None) -> None:
    """Ask what Triton's first kernel launch would find out from the system on the run's thread.
    Measured on the H100 machine (Triton 3.6), ~45 ms of the run's start: ``file -b`` on the Python
    executable (``platform_key``, part of every launcher's cache key, 10 ms), ``ldconfig -p`` (where
    ``libcuda`` is) and ``ptxas --version`` twice (part of every kernel's cache key, for the GPU's
    ``arch``, e.g. 90). Subprocesses, waited for with the interpreter lock released: they run on a
    thread of their own, beside the imports of Triton's languages and of the kernel modules, once
    Triton's package has been imported."""
    _ask("triton.runtime.build", "platform_key")
    _ask("triton.backends.nvidia.driver", "library_dirs")
    if arch is not None:
        _ask("triton.backends.nvidia.compiler", "get_ptxas_version", arch)


class Preload:
    """Imports ``modules`` (dotted names) and warms Triton on two daemon threads; ``join()`` waits.

    No thread starts when every module is already in ``sys.modules`` (a later run in the same
    process)."""

    def __init__(self, modules: Iterable[str], arch: int | None = None) -> None:
        missing = [m for m in dict.fromkeys(modules) if m not in sys.modules]
        if os.environ.get("TORCHLOOM_PRELOAD", "1") == "0":
            missing = []
        self._threads: list[threading.Thread] = []
        if missing:
            # one thread imports; one asks the system's questions, once Triton's package is imported
            imported = threading.Event()  # set once Triton's package is imported, or found missing
            ended = threading.Event()
            _importing.append(ended)
            importer = threading.Thread(target=self._ended_after, args=(self._imports, (missing, imported, ended)),
                                        name="torchloom-preload", daemon=True)
            if not self._start(importer):
                _imports_ended(ended)
                imported.set()  # the questions' thread must not wait for it
            asker = threading.Thread(target=self._ended_after, args=(self._tools, (arch, imported)),
                                     name="torchloom-preload-tools", daemon=True)
            self._start(asker)

    def _start(self, thread: threading.Thread) -> bool:
        try:
            thread.start()
        except Exception:  # noqa: BLE001 - no thread to be had: the run imports what it needs itself
            return False
        self._threads.append(thread)
        return True

    @property
    def started(self) -> bool:
        """Whether a thread was started (False when everything was imported before)."""
        return bool(self._threads)

    @staticmethod
    def _ended_after(target: Any, args: tuple) -> None:
        target(*args)

    @staticmethod
    def _imports(modules: list[str], imported: threading.Event, ended: threading.Event) -> None:
        _this_thread.imports = True
        try:
            try:
                _warm_triton()
            finally:
                imported.set()
            for name in modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - imported again where it is used, which raises there
                    pass
        finally:
            _imports_ended(ended)

    @staticmethod
    def _tools(arch: int | None, imported: threading.Event) -> None:
        # Triton's submodules only once its package is whole: two threads importing into a package
        # that is still being imported can each find the other's module half made
        imported.wait()
        if "triton" in sys.modules:
            # Triton's hash of its own installation (~0.4 s, its files read and hashed with the
            # interpreter lock released), asked by every first launch: first, beside the imports
            _ask("triton.runtime.cache", "triton_key")
            _warm_tools(arch)

    def join(self) -> None:
        """Wait for the threads (at once when none was started or they have finished)."""
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
