"""Output files of the observers: checking a path before training, and writing it atomically.

``check_output_path`` runs when an observer is made and again in its ``check_ready()`` (before a run
changes anything): the path must name a regular file (or nothing yet) in a directory that exists, or
that is missing only its last level under an existing directory (it is made at the first write), and
that directory must accept a new file (probed with an unnamed temporary file). ``check_directory``
is the same for a directory an observer writes into (TensorBoard's ``log_dir``).

Only the last level is ever made (``mkdir``, never ``mkdir -p``): ``runs/exp1/best.pt`` makes
``runs/exp1`` when ``runs`` exists, and is an error naming the missing ``runs`` otherwise, so that a
mistyped directory fails before training instead of becoming a new tree of folders.

``atomic_write`` writes the whole content to a temporary file in the target's directory and then
renames it over the target (``os.replace``, atomic on POSIX and Windows): an interrupted or failed
write leaves the previous file as it was and no temporary file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO, Any

__all__ = ["text_path", "probe_new_file", "check_output_path", "check_directory", "make_last_level", "atomic_write"]


def text_path(owner: str, path: Any, name: str, kind: str) -> str:
    """``path`` as a non-empty ``str`` without NUL characters (``kind``: "file" or "directory", for the
    messages); ``TypeError``/``ValueError`` naming ``owner``'s argument ``name`` otherwise."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{owner}: {name} must be a str or os.PathLike {kind} path, got {type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"{owner}: {name} must be a text path, got {type(p).__name__} {p!r}")
    if not p or "\x00" in p:
        raise ValueError(f"{owner}: {name} must be a non-empty {kind} path without NUL characters, got {p!r}")
    return p


def probe_new_file(owner: str, name: str, p: str, directory: str, where: str) -> None:
    """Raise ``ValueError`` unless ``directory`` accepts a new file (an unnamed temporary file, gone at
    once); ``where`` names that directory in the message."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(
            f"{owner}: {name} {p!r} cannot be written: no file can be created in {where} "
            f"({type(e).__name__}: {e.strerror or e})"
        ) from None


def _check_creatable_dir(owner: str, name: str, p: str, directory: str) -> None:
    """``directory`` (absolute) must be a directory that accepts a new file, or be missing only its last
    level under such a directory; ``ValueError`` naming ``owner``'s argument ``name`` (value ``p``)."""
    if os.path.isdir(directory):
        probe_new_file(owner, name, p, directory, "it" if directory == os.path.abspath(p) else "its directory")
        return
    if os.path.lexists(directory):
        raise ValueError(f"{owner}: {name} {p!r} cannot be written: {directory!r} exists and is not a directory")
    parent = os.path.dirname(directory)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ValueError(f"{owner}: {name} {p!r} cannot be written: {parent!r} is a file, so the directory "
                         f"{directory!r} cannot exist")
    if not os.path.isdir(parent):
        raise ValueError(
            f"{owner}: {name} {p!r} cannot be written: the directory {directory!r} does not exist and its parent "
            f"{parent!r} does not exist either. torchloom makes only the last missing directory level (a mistyped "
            f"path should fail, not become a new tree of folders): create {parent!r} first, or fix the path"
        )
    probe_new_file(owner, name, p, parent, f"{parent!r}, where {os.path.basename(directory)!r} would be made")


def check_output_path(owner: str, path: Any, name: str = "path") -> str:
    """``path`` as a ``str`` once it is known to be writable; ``TypeError``/``ValueError`` naming
    ``owner``'s argument ``name`` otherwise. Its directory must exist, or miss only its last level
    (made at the first write). Creates nothing."""
    p = text_path(owner, path, name, "file")
    if os.path.isdir(p):
        raise ValueError(f"{owner}: {name} {p!r} is a directory; give the path of a file in it")
    if os.path.lexists(p) and not os.path.isfile(p):
        raise ValueError(f"{owner}: {name} {p!r} exists and is not a regular file (a device, socket or broken link)")
    _check_creatable_dir(owner, name, p, os.path.dirname(os.path.abspath(p)))
    return p


def check_directory(owner: str, path: Any, name: str) -> str:
    """``path`` as a ``str`` once it is known to be usable as a directory of output files: a directory
    that accepts a new file, or a missing last level under one (made when training starts);
    ``TypeError``/``ValueError`` naming ``owner``'s argument ``name`` otherwise. Creates nothing."""
    p = text_path(owner, path, name, "directory")
    if os.path.lexists(p) and not os.path.isdir(p):
        raise ValueError(f"{owner}: {name} {p!r} exists and is not a directory")
    _check_creatable_dir(owner, name, p, os.path.abspath(p))
    return p


def make_last_level(directory: str) -> None:
    """Make ``directory`` if it is missing; only that level (``os.mkdir``): a missing parent is a
    ``FileNotFoundError``."""
    try:
        os.mkdir(directory)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(owner: str, path: str, write: Callable[[IO[Any]], None], mode: str = "wb", *, keep_mode: bool = False) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, flush it to disk, and rename it over
    ``path``. Any failure removes the temporary file, leaves ``path`` untouched and raises ``OSError``
    naming ``owner`` and ``path`` (the original error is chained); ``KeyboardInterrupt`` and other
    ``BaseException``s propagate unchanged after the same clean-up. The new file gets the permissions
    ``open()`` would give it, or with ``keep_mode`` those of the file it replaces."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp: str | None = None
    try:
        make_last_level(directory)
        bits = os.stat(path).st_mode & 0o777 if keep_mode and os.path.exists(path) else 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
        with os.fdopen(fd, mode) as f:
            if hasattr(os, "fchmod"):  # mkstemp makes 0600
                os.fchmod(f.fileno(), bits)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except Exception as e:
        raise OSError(
            f"{owner}: could not write {path!r} ({type(e).__name__}: {e}); the previous file, if any, is unchanged"
        ) from e
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
