"""Triton's installation key, remembered across processes: half a second off every process's first kernel.

Before its first compile (and before it may look a compiled kernel up in its on-disk cache) a Triton
process computes ``triton.runtime.cache.triton_key()``: the SHA-256 of Triton's compiler and language
sources and of its ~0.5 GB ``libtriton`` library. Measured on the H100 machine (Triton 3.6): 0.37 s of
a 0.85 s whole training run, paid again by every new process although the installation never changed.

``install()`` (called when the kernel modules first import Triton; nothing happens until Triton first
asks for the key) keeps the key Triton computed in a
small file of Triton's cache directory, named after a stamp of the installation — Triton's version and
the path, size, modification and change times and inode of every ``.py`` and ``.so`` file in the
package, symlinked folders included (~2 ms to stat)
— and hands the stored key to Triton in later processes (Triton's own compile-warm-up workers do the
same: ``triton.runtime.cache.triton_key = lambda: key``). The key is the one Triton computes, so the
on-disk kernel cache is shared with plain Triton; any change to the installation changes the stamp and
the key is computed afresh. ``TORCHLOOM_TRITON_KEY_CACHE=0`` switches this off. Any failure (an
unexpected Triton layout, an unwritable directory) leaves Triton as it is.

**Each kernel's key, too** (``KernelKeys``). Before a kernel's first launch in a process Triton
computes its ``JITFunction.cache_key``: a walk over the kernel's syntax tree and those of the kernels
it calls, hashing their sources and the global values they use. Measured on the H200 machine (Triton
3.6): 0.3–2 ms a kernel timed alone, 26 of the 61 ms that a TargetProp run's first launches of seven
kernels took (profiled). ``_tl.jit`` hands every kernel of ``torchloom/kernels/`` to the process's
``KernelKeys``, which gives it the key an earlier process stored for it (``hash``, the attribute
Triton's ``cache_key`` returns once set), and ``remember()`` (called after a run's warm-up and at
exit) stores the keys Triton computed in this one. The store is one small JSON file per stamp of the
Triton installation, of Python's version and of every ``.py`` file of ``torchloom/kernels/`` (name,
size, modification and change times, inode): change a kernel's source, or any file it could read a
global from, and every key is computed afresh (in a running process too: the folder is stamped again
before the first kernel of each file, and before a kernel defined again by a reload, and the store
is no longer used once it differs). A kernel given its key skips one check Triton makes at every
launch: that the module globals the kernel reads still have the values they had when it was
compiled (torchloom's kernels read none that change). Kernels made inside a function (a closure) are
left to Triton.

**And each kernel's source block** (``TritonInspect``). Making a kernel's ``JITFunction`` (at its
module's import) asks ``inspect.getsourcelines``, which tokenizes the file from the kernel's first
line to its end: 33 of the 58 ms of importing a TargetProp run's kernel modules (H200 machine,
``cProfile``). The store keeps each block's length and digest; Triton's ``jit`` module gets a view of
``inspect`` (``TritonInspect``) that answers torchloom's kernels from it (the file's lines from the
kernel's first line, checked against the digest) and asks ``inspect`` for everything else. The same
switch, ``TORCHLOOM_TRITON_KEY_CACHE=0``, turns all three off.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import inspect
import json
import linecache
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["install", "installation_stamp", "key_file", "KernelKeys", "kernel_keys", "remember_kernel_keys", "sources_stamp"]

KERNEL_DIR = Path(__file__).resolve().parent  # torchloom's kernel sources: a change here is a new store


def _stat_line(name: str, st: os.stat_result) -> bytes:
    """One file's line of a stamp: its name, size, modification and change times and inode."""
    return f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode()


def installation_stamp(triton: Any) -> str:
    """Hex digest of Triton's version and each ``.py``/``.so`` file's relative path, size, modification
    and change times and inode (symlinked folders followed: an editable install links its backends)."""
    root = os.path.dirname(os.path.abspath(triton.__file__))
    h = hashlib.sha256(f"{triton.__version__}\0{root}\n".encode())
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):  # editable installs link backends in
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith((".py", ".so")):
                path = os.path.join(dirpath, name)
                st = os.stat(path)
                h.update(_stat_line(os.path.relpath(path, root), st))
    return h.hexdigest()


def _cache_dir(triton: Any) -> Path:
    knobs = getattr(triton, "knobs", None)
    cache = getattr(knobs, "cache", None)
    d = getattr(cache, "dir", None) or os.environ.get("TRITON_CACHE_DIR") or os.path.join(Path.home(), ".triton", "cache")
    return Path(d)


def key_file(triton: Any) -> Path:
    """Where the key of this installation is kept."""
    return _cache_dir(triton) / "torchloom" / f"triton_key-{installation_stamp(triton)[:40]}.txt"


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _stored_or_computed(triton: Any, real: Any) -> str:
    path = key_file(triton)
    try:
        key = path.read_text()
    except OSError:
        key = ""
    if not key.startswith(str(triton.__version__)):  # absent or not a key: Triton computes it
        key = real()
        with contextlib.suppress(OSError):  # a read-only cache: the next process computes it again
            _write_atomically(path, key)
    return key


def install(triton: Any) -> bool:
    """Replace Triton's ``triton_key`` by one that, on its first call, reads the stored key of this
    installation, or computes it with Triton's own function and stores it. Nothing is read, hashed or
    written until Triton first asks (a compile). Returns True when installed."""
    if os.environ.get("TORCHLOOM_TRITON_KEY_CACHE", "1") == "0":
        return False
    try:
        from triton.runtime import cache

        real = cache.triton_key
        if getattr(real, "torchloom_cached", False):
            return True
        key: list[str] = []

        def triton_key() -> str:
            if not key:
                try:
                    key.append(_stored_or_computed(triton, real))
                except Exception:  # noqa: BLE001 - an optimisation: Triton's own answer instead
                    key.append(real())
            return key[0]

        triton_key.torchloom_cached = True  # type: ignore[attr-defined]
        triton_key.uncached = real  # type: ignore[attr-defined]
        cache.triton_key = triton_key
        return True
    except Exception:  # noqa: BLE001 - never let it break a kernel module's import
        return False


# ------------------------------------------------------------------------------ each kernel's key
def sources_stamp(folder: Path) -> str:
    """Hex digest of every ``.py`` file directly in ``folder``: name, size, modification and change
    times and inode."""
    h = hashlib.sha256()
    with os.scandir(folder) as entries:
        files = sorted((e.name, e) for e in entries if e.name.endswith(".py"))
    for name, entry in files:
        st = entry.stat()
        h.update(_stat_line(name, st))
    return h.hexdigest()


def _is_key(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_span(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 2 and type(value[0]) is int and value[0] > 0
            and isinstance(value[1], str))


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:32]


class KernelKeys:
    """Per kernel of ``folder``, what Triton works out anew in every process, kept in ``path``
    across processes: its ``cache_key``, and the length and a digest of its source block (what
    ``inspect.getsourcelines`` finds by tokenizing the file from the kernel's first line). ``sources``
    is the ``sources_stamp(folder)`` the store belongs to (taken now when not given).
    ``adopt(kernel)`` gives a new ``JITFunction`` its stored key, ``source_lines(fn)`` answers for
    ``inspect.getsourcelines`` (``TritonInspect``), and ``remember()`` stores what Triton worked out
    since.

    The folder's files can change while the process runs (an edit before a kernel module's first
    import, a module reloaded after an edit, of its own file or of one its kernels call into): the
    first kernel of each file, and any kernel defined again, first has the folder stamped anew; from
    the first difference on the store neither gives nor keeps anything in this process. Thread-safe;
    nothing here raises (a store that cannot be read or written is no store)."""

    def __init__(self, path: Path, folder: Path = KERNEL_DIR, sources: str | None = None) -> None:
        self.path = path
        self.folder = folder
        self._folder = str(folder)
        self.sources = sources_stamp(folder) if sources is None else sources
        self._lock = threading.Lock()
        self._stored: dict[str, dict[str, Any]] | None = None  # read on first use: {"keys": …, "spans": …}
        self._kernels: dict[str, Any] = {}  # every adopted kernel, by name
        self._spans: dict[str, list] = {}  # source blocks inspect found in this process: name → [line count, digest]
        self._files: set[str] = set()  # files whose first kernel found the folder as stamped
        self.stale = False  # a file of the folder changed since the stamp: nothing given or kept

    def _read(self) -> dict[str, dict[str, Any]]:
        if self._stored is None:
            try:
                data = json.loads(self.path.read_text())
            except Exception:  # noqa: BLE001 - unreadable, not JSON, too deeply nested: no store
                data = {}
            data = data if isinstance(data, dict) else {}
            keys, spans = data.get("keys"), data.get("spans")
            self._stored = {
                "keys": {k: v for k, v in keys.items() if _is_key(v)} if isinstance(keys, dict) else {},
                "spans": {k: v for k, v in spans.items() if _is_span(v)} if isinstance(spans, dict) else {},
            }
        return self._stored

    def _kernel(self, fn: Any) -> tuple[str, str] | None:
        """``(file, name)`` of a plain function defined in the folder (no closure), else None."""
        code = getattr(fn, "__code__", None)
        if code is None or getattr(fn, "__closure__", None) is not None or "<locals>" in fn.__qualname__:
            return None
        file = code.co_filename
        if os.path.dirname(file) != self._folder:
            file = str(Path(file).resolve())  # a relative or linked path: the folder's own spelling
            if os.path.dirname(file) != self._folder:
                return None
        return file, f"{fn.__module__}.{fn.__qualname__}"

    def _as_stamped(self, file: str, name: str) -> bool:
        """Whether the folder is still as stamped; checked again for a new file or a kernel defined
        again (a reload). Called under the lock."""
        if not self.stale and (file not in self._files or name in self._kernels):
            try:
                self.stale = sources_stamp(self.folder) != self.sources
            except OSError:
                self.stale = True
            self._files.add(file)
        return not self.stale

    def adopt(self, kernel: Any) -> bool:
        """Give ``kernel`` (a ``JITFunction`` of the folder) its stored key, if there is one; True
        when it got one. Other objects (the interpreter's functions, closures, kernels from
        elsewhere) are left alone."""
        try:
            found = self._kernel(kernel.fn)
            if found is None or not hasattr(kernel, "hash"):
                return False
            file, name = found
            with self._lock:
                fresh = self._as_stamped(file, name)
                self._kernels[name] = kernel
                key = self._read()["keys"].get(name) if fresh else None
                if key is None or kernel.hash is not None:
                    return False
                kernel.hash = key  # what Triton's cache_key returns from now on
            return True
        except Exception:  # noqa: BLE001 - an optimisation: Triton computes the key itself
            return False

    def source_lines(self, fn: Any) -> tuple[list[str], int] | None:
        """``inspect.getsourcelines(fn)`` from the store for a kernel of the folder: the file's lines
        from the function's first line on, as many as an earlier process found, when their digest
        is the one it found too; else None (ask ``inspect``)."""
        try:
            found = self._kernel(fn)
            if found is None:
                return None
            file, name = found
            with self._lock:
                span = self._read()["spans"].get(name) if self._as_stamped(file, name) else None
            if span is None:
                return None
            linecache.checkcache(file)
            first = fn.__code__.co_firstlineno - 1  # where inspect.findsource starts a function's block
            block = linecache.getlines(file, fn.__globals__)[first : first + span[0]]
            if len(block) != span[0] or _digest(block) != span[1]:
                return None
            return block, first + 1
        except Exception:  # noqa: BLE001 - an optimisation: inspect answers
            return None

    def note_source_lines(self, fn: Any, lines: list[str]) -> None:
        """Keep what ``inspect.getsourcelines(fn)`` found for a kernel of the folder (for
        ``remember``)."""
        try:
            found = self._kernel(fn)
            if found is not None and lines:
                with self._lock:
                    if self._as_stamped(*found):
                        self._spans[found[1]] = [len(lines), _digest(lines)]
        except Exception:  # noqa: BLE001 - an optimisation
            pass

    def remember(self) -> int:
        """Store the keys Triton computed for adopted kernels, and the source blocks ``inspect``
        found, since the store was read (one atomic write, only when there is something new; none
        once the folder changed). Returns how many entries were new."""
        try:
            with self._lock:
                if self.stale:
                    return 0
                stored = self._read()
                keys = {name: k.hash for name, k in self._kernels.items() if _is_key(k.hash) and stored["keys"].get(name) != k.hash}
                spans = {name: v for name, v in self._spans.items() if stored["spans"].get(name) != v}
                if not keys and not spans:
                    return 0
                stored["keys"].update(keys)
                stored["spans"].update(spans)
                _write_atomically(self.path, json.dumps(stored, sort_keys=True, indent=0))
            return len(keys) + len(spans)
        except Exception:  # noqa: BLE001 - an optimisation: the next process computes them again
            return 0


class TritonInspect:
    """What ``triton.runtime.jit`` sees as ``inspect``: the ``inspect`` module itself, except that
    ``getsourcelines`` answers torchloom's kernels from ``store`` (``KernelKeys.source_lines``) and
    asks ``inspect`` for anything else (noting what it found for a kernel of the store's folder).
    Measured on the H200 machine (Triton 3.6, Python 3.12): 33 of the 58 ms that importing a
    TargetProp run's kernel modules took under ``cProfile`` was ``inspect.getsourcelines`` tokenizing
    the kernels' sources, one by one, in every process. Every kernel Triton makes in the process
    (torch.compile's, a user's) passes through ``getsourcelines`` here; only torchloom's are answered
    from the store."""

    def __init__(self, store: KernelKeys) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    def getsourcelines(self, obj: Any) -> tuple[list[str], int]:
        got = self._store.source_lines(obj)
        if got is not None:
            return got
        lines, lnum = inspect.getsourcelines(obj)
        self._store.note_source_lines(obj, lines)
        return lines, lnum


def _install_inspect(store: KernelKeys) -> None:
    """Give ``triton.runtime.jit`` a ``TritonInspect`` over ``store`` for its ``inspect`` (only
    where that name is the ``inspect`` module: another Triton keeps its own)."""
    import triton.runtime.jit as jit_module

    if getattr(jit_module, "inspect", None) is inspect:
        jit_module.inspect = TritonInspect(store)


_stores: dict[str, KernelKeys | None] = {}  # per Triton installation (its folder)
_stores_lock = threading.Lock()
_TRUE = ("1", "true", "on", "yes")  # what Triton reads as on in TRITON_INTERPRET


def _supports_stored_keys() -> bool:
    """Whether this Triton's ``cache_key`` is the one this file knows: a property that returns the
    instance's ``hash`` once set."""
    from triton.runtime.jit import JITFunction

    prop = getattr(JITFunction, "cache_key", None)
    fget = getattr(prop, "fget", None)
    return isinstance(prop, property) and fget is not None and "hash" in fget.__code__.co_names


def kernel_keys(triton: Any) -> KernelKeys | None:
    """The process's store of kernel keys and source blocks for this Triton installation (made on
    the first call, with ``TritonInspect`` installed over it; what it learns is kept at exit too),
    or None when switched off (``TORCHLOOM_TRITON_KEY_CACHE=0``), when Triton's interpreter runs
    the kernels, or when this Triton keeps its keys in another way. The store's file is named after
    the installation's stamp, Python's version and ``KERNEL_DIR``'s."""
    if os.environ.get("TORCHLOOM_TRITON_KEY_CACHE", "1") == "0" or os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE:
        return None
    with _stores_lock:
        root = os.path.dirname(os.path.abspath(triton.__file__))
        if root not in _stores:
            store = None
            try:
                if _supports_stored_keys():
                    sources = sources_stamp(KERNEL_DIR)
                    h = hashlib.sha256(f"{sys.version}\0{installation_stamp(triton)}\0{sources}".encode())
                    store = KernelKeys(_cache_dir(triton) / "torchloom" / f"kernel_keys-{h.hexdigest()[:40]}.json", KERNEL_DIR, sources)
                    _install_inspect(store)
                    if not _stores:  # once per process: every store's new keys kept at exit
                        atexit.register(remember_kernel_keys)
            except Exception:  # noqa: BLE001 - an optimisation: Triton computes every key itself
                store = None
            _stores[root] = store
        return _stores[root]


def remember_kernel_keys() -> None:
    """Store the kernel keys and source blocks this process worked out (every Triton installation it
    used)."""
    for store in list(_stores.values()):
        if store is not None:
            store.remember()
