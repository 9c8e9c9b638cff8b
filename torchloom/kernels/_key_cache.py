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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["install", "installation_stamp", "key_file"]


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
                h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
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
