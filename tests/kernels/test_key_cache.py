"""Triton's installation key kept across processes (``kernels/_key_cache.py``): the stored key is the
one Triton computes, it is computed once per installation stamp, and nothing breaks when it cannot be
stored."""

import types

import pytest

from torchloom.kernels._triton import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs the triton package")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A stand-in installation (a package dir with one .py and one .so) and a counting Triton key."""
    from triton.runtime import cache

    pkg = tmp_path / "pkg"
    (pkg / "_C").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    calls = []

    def real_key():
        calls.append(1)
        return "9.9.9-" + "ab" * 8

    monkeypatch.setattr(cache, "triton_key", real_key)
    monkeypatch.delenv("TORCHLOOM_TRITON_KEY_CACHE", raising=False)
    triton = types.SimpleNamespace(
        __version__="9.9.9", __file__=str(pkg / "__init__.py"), knobs=types.SimpleNamespace(cache=types.SimpleNamespace(dir=str(tmp_path / "cache")))
    )
    return triton, calls, cache, pkg


def test_key_is_computed_once_per_installation_then_read(fake):
    from torchloom.kernels import _key_cache

    triton, calls, cache, pkg = fake
    real = cache.triton_key
    assert _key_cache.install(triton)
    assert calls == []  # nothing until Triton asks
    assert cache.triton_key() == real.__call__() and len(calls) == 2  # computed once (+ our direct call)
    assert cache.triton_key() == "9.9.9-" + "ab" * 8 and len(calls) == 2  # remembered in the process
    stored = _key_cache.key_file(triton)
    assert stored.read_text() == "9.9.9-" + "ab" * 8
    # a new process: Triton's function is the real one again, the file answers
    cache.triton_key = real
    assert _key_cache.install(triton)
    assert cache.triton_key() == "9.9.9-" + "ab" * 8 and len(calls) == 2
    # the installation changes (a file's size): another stamp, the key is computed afresh
    (pkg / "_C" / "libtriton.so").write_bytes(b"\0" * 65)
    cache.triton_key = real
    assert _key_cache.key_file(triton) != stored
    _key_cache.install(triton)
    cache.triton_key()
    assert len(calls) == 3


def test_a_corrupt_or_unwritable_store_falls_back_to_tritons_key(fake, tmp_path):
    from torchloom.kernels import _key_cache

    triton, calls, cache, _ = fake
    real = cache.triton_key
    path = _key_cache.key_file(triton)
    path.parent.mkdir(parents=True)
    path.write_text("garbage")
    _key_cache.install(triton)
    assert cache.triton_key() == "9.9.9-" + "ab" * 8 and len(calls) == 1
    cache.triton_key = real
    triton.knobs.cache.dir = str(tmp_path / "file-not-dir")
    (tmp_path / "file-not-dir").write_text("")  # the store cannot be created
    _key_cache.install(triton)
    assert cache.triton_key() == "9.9.9-" + "ab" * 8 and len(calls) == 2


def test_switched_off_by_the_environment(fake, monkeypatch):
    from torchloom.kernels import _key_cache

    triton, calls, cache, _ = fake
    real = cache.triton_key
    monkeypatch.setenv("TORCHLOOM_TRITON_KEY_CACHE", "0")
    assert not _key_cache.install(triton)
    assert cache.triton_key is real


def test_the_stored_key_is_tritons_own():
    import triton
    from triton.runtime import cache

    from torchloom.kernels import _tl  # noqa: F401 - installs the cache on import

    if not getattr(cache.triton_key, "torchloom_cached", False):
        pytest.skip("switched off in this environment")
    assert cache.triton_key() == cache.triton_key.uncached()
    assert cache.triton_key().startswith(triton.__version__)


def test_the_stamp_sees_files_in_symlinked_folders(tmp_path):
    """An editable Triton links its backend folders into the package: a change there is a new stamp."""
    from torchloom.kernels import _key_cache

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "compiler.py").write_text("a = 1\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "backend").symlink_to(outside, target_is_directory=True)
    triton = types.SimpleNamespace(__version__="9.9.9", __file__=str(pkg / "__init__.py"))
    before = _key_cache.installation_stamp(triton)
    (outside / "compiler.py").write_text("a = 22\n")
    assert _key_cache.installation_stamp(triton) != before


# ------------------------------------------------------------------------------ each kernel's key
_KEYS_OF_EVERY_KERNEL = r"""
import importlib, json, pkgutil, sys
import torchloom.kernels as K
from triton.runtime.jit import JITFunction
mods = [importlib.import_module(f"torchloom.kernels.{m.name}") for m in pkgutil.iter_modules(K.__path__)]
kernels = {f"{v.fn.__module__}.{v.fn.__qualname__}": v for m in mods for v in vars(m).values() if isinstance(v, JITFunction)}
given = sorted(n for n, k in kernels.items() if k.hash is not None)  # keys handed over before any launch
json.dump({"given": given, "keys": {n: k.cache_key for n, k in kernels.items()}}, sys.stdout)
"""


def _every_kernels_key(cache_dir, stored: bool) -> dict:
    """In a fresh process (compiled kernels, no interpreter): every torchloom kernel's cache_key,
    and which kernels were given theirs from the store before anything asked."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir), "TORCHLOOM_TRITON_KEY_CACHE": "1" if stored else "0"}
    out = subprocess.run([sys.executable, "-c", _KEYS_OF_EVERY_KERNEL], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_every_kernels_stored_key_is_the_one_triton_computes(tmp_path):
    """Triton's own keys (store off) against: a first process (computes, stores at exit), a second
    (every key from the store, none computed), and one whose store lost half its keys (those are
    computed again, beside callee kernels that got theirs from the store): the same keys each time."""
    import json

    own = _every_kernels_key(tmp_path, stored=False)
    assert own["given"] == [] and len(own["keys"]) > 40
    assert not (tmp_path / "torchloom").exists()  # switched off: nothing stored
    first = _every_kernels_key(tmp_path, stored=True)
    assert first["given"] == [] and first["keys"] == own["keys"]
    (store,) = (tmp_path / "torchloom").glob("kernel_keys-*.json")
    assert json.loads(store.read_text()) == own["keys"]
    second = _every_kernels_key(tmp_path, stored=True)
    assert second["given"] == sorted(own["keys"]) and second["keys"] == own["keys"]
    kept = {n: k for i, (n, k) in enumerate(sorted(own["keys"].items())) if i % 2}
    store.write_text(json.dumps(kept))
    mixed = _every_kernels_key(tmp_path, stored=True)
    assert mixed["given"] == sorted(kept) and mixed["keys"] == own["keys"]
    assert json.loads(store.read_text()) == own["keys"]  # the lost half stored again


def _kernel_like(tmp_path, name="k"):
    """A Triton kernel of torchloom's kernel folder, not yet asked for its key."""
    from torchloom.kernels import _key_cache

    source = f"def {name}(x_ptr):\n    pass\n"
    code = compile(source, str(_key_cache.KERNEL_DIR / "sgd.py"), "exec")  # as if written there
    scope: dict = {"__name__": "torchloom.kernels.sgd"}
    exec(code, scope)
    fn = scope[name]
    kernel = type("K", (), {})()  # stands in for a JITFunction: what adopt reads and sets
    kernel.fn, kernel.hash = fn, None
    return kernel


def test_a_kernel_gets_its_stored_key_and_computed_keys_are_stored(tmp_path):
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    store = _key_cache.KernelKeys(path)
    kernel = _kernel_like(tmp_path)
    assert not store.adopt(kernel) and kernel.hash is None  # nothing stored yet
    kernel.hash = "ab" * 32  # Triton computed it
    assert store.remember() == 1 and store.remember() == 0  # written once
    again = _key_cache.KernelKeys(path)  # a later process
    fresh = _kernel_like(tmp_path)
    assert again.adopt(fresh) and fresh.hash == "ab" * 32
    done = _kernel_like(tmp_path)
    done.hash = "cd" * 32  # a key already computed is never replaced
    assert not again.adopt(done) and done.hash == "cd" * 32


def test_kernels_from_elsewhere_and_closures_are_left_to_triton(tmp_path):
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    path.write_text('{"tests.kernels.test_key_cache.k": "%s", "torchloom.kernels.sgd.outer.<locals>.k": "%s"}' % ("ab" * 32, "ab" * 32))
    store = _key_cache.KernelKeys(path)

    def k(x_ptr):
        pass

    elsewhere = type("K", (), {})()
    elsewhere.fn, elsewhere.hash = k, None
    assert not store.adopt(elsewhere) and elsewhere.hash is None
    y = 1

    def closure(x_ptr):
        return y

    inner = type("K", (), {})()
    inner.fn, inner.hash = closure, None
    assert not store.adopt(inner) and inner.hash is None


def test_a_corrupt_or_unwritable_kernel_store_changes_nothing(tmp_path):
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    path.write_text("not json")
    store = _key_cache.KernelKeys(path)
    kernel = _kernel_like(tmp_path)
    assert not store.adopt(kernel) and kernel.hash is None
    path.write_text('{"torchloom.kernels.sgd.k": "short"}')  # not a key: ignored
    kernel = _kernel_like(tmp_path)
    assert not _key_cache.KernelKeys(path).adopt(kernel) and kernel.hash is None
    (tmp_path / "file").write_text("")
    unwritable = _key_cache.KernelKeys(tmp_path / "file" / "keys.json")  # its folder is a file
    kernel = _kernel_like(tmp_path)
    unwritable.adopt(kernel)
    kernel.hash = "ab" * 32
    assert unwritable.remember() == 0


def test_the_sources_stamp_sees_a_changed_kernel_file(tmp_path):
    from torchloom.kernels import _key_cache

    (tmp_path / "a.py").write_text("x = 1\n")
    before = _key_cache.sources_stamp(tmp_path)
    assert _key_cache.sources_stamp(tmp_path) == before
    (tmp_path / "a.py").write_text("x = 22\n")
    assert _key_cache.sources_stamp(tmp_path) != before
    changed = _key_cache.sources_stamp(tmp_path)
    (tmp_path / "b.py").write_text("")
    assert _key_cache.sources_stamp(tmp_path) != changed


def test_no_kernel_store_when_switched_off_or_interpreted(monkeypatch, tmp_path):
    import triton

    from torchloom.kernels import _key_cache

    monkeypatch.setattr(_key_cache, "_stores", {})
    monkeypatch.setattr(_key_cache, "_cache_dir", lambda triton: tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TORCHLOOM_TRITON_KEY_CACHE", "1")
    store = _key_cache.kernel_keys(triton)
    assert store is not None and store.path.parent == tmp_path / "torchloom"
    monkeypatch.setattr(_key_cache, "_stores", {})
    monkeypatch.setenv("TORCHLOOM_TRITON_KEY_CACHE", "0")
    assert _key_cache.kernel_keys(triton) is None
    monkeypatch.setenv("TORCHLOOM_TRITON_KEY_CACHE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter's functions have no cache_key
    assert _key_cache.kernel_keys(triton) is None
