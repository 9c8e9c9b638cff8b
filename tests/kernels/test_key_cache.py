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
import hashlib, importlib, inspect, json, pkgutil, sys
tokenized = []  # functions whose source inspect itself looked up (the store did not answer)
real = inspect.getsourcelines
def counted(obj):
    if str(getattr(obj, "__module__", "")).startswith("torchloom.kernels"):
        tokenized.append(obj.__qualname__)
    return real(obj)
inspect.getsourcelines = counted
import triton.runtime.jit as jit_module
import torchloom.kernels as K
from triton.runtime.jit import JITFunction
mods = [importlib.import_module(f"torchloom.kernels.{m.name}") for m in pkgutil.iter_modules(K.__path__)]
kernels = {f"{v.fn.__module__}.{v.fn.__qualname__}": v for m in mods for v in vars(m).values() if isinstance(v, JITFunction)}
given = sorted(n for n, k in kernels.items() if k.hash is not None)  # keys handed over before any launch
sources = {n: [k.starting_line_number, hashlib.sha256("".join(k.raw_src).encode()).hexdigest()] for n, k in kernels.items()}
json.dump({"given": given, "keys": {n: k.cache_key for n, k in kernels.items()}, "sources": sources,
           "inspect": type(jit_module.inspect).__name__, "tokenized": len(tokenized)}, sys.stdout)
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


def test_every_kernels_stored_key_and_source_are_the_ones_triton_finds(tmp_path):
    """Triton's own keys and kernel sources (store off) against: a first process (computes, stores
    at exit), a second (every key and source block from the store, nothing computed), and one whose
    store lost half of each (those are computed again, beside callee kernels that got theirs from
    the store): the same keys, the same source lines and first line numbers each time."""
    import json

    own = _every_kernels_key(tmp_path, stored=False)
    assert own["given"] == [] and len(own["keys"]) > 40 and own["inspect"] == "module"
    assert own["tokenized"] >= len(own["keys"])
    assert not (tmp_path / "torchloom").exists()  # switched off: nothing stored
    first = _every_kernels_key(tmp_path, stored=True)
    assert first["given"] == [] and first["keys"] == own["keys"] and first["sources"] == own["sources"]
    assert first["inspect"] == "TritonInspect" and first["tokenized"] >= len(own["keys"])
    (store,) = (tmp_path / "torchloom").glob("kernel_keys-*.json")
    stored = json.loads(store.read_text())
    assert stored["keys"] == own["keys"] and set(stored["spans"]) == set(own["keys"])
    second = _every_kernels_key(tmp_path, stored=True)
    assert second["given"] == sorted(own["keys"]) and second["keys"] == own["keys"] and second["sources"] == own["sources"]
    assert second["tokenized"] == 0  # every kernel's source block from the store
    half = lambda d: {n: v for i, (n, v) in enumerate(sorted(d.items())) if i % 2}  # noqa: E731
    kept = {"keys": half(stored["keys"]), "spans": half(stored["spans"])}
    store.write_text(json.dumps(kept))
    mixed = _every_kernels_key(tmp_path, stored=True)
    assert mixed["given"] == sorted(kept["keys"]) and mixed["keys"] == own["keys"] and mixed["sources"] == own["sources"]
    assert mixed["tokenized"] == len(own["keys"]) - len(kept["spans"])
    assert json.loads(store.read_text()) == stored  # the lost halves stored again


def _kernel_like(folder, name="k", body="pass", closure=None):
    """A stand-in for a ``JITFunction`` (what ``adopt`` reads and sets: ``fn``, ``hash``) whose
    function is defined in ``folder/kern.py`` (module ``pkg.kern``), not yet asked for its key."""
    if closure is None:
        source = f"def {name}(x_ptr):\n    {body}\n"
    else:  # a kernel made inside a function: a closure over closure's value
        source = f"def outer(v):\n    def {name}(x_ptr):\n        return v\n    return {name}\n"
    scope: dict = {"__name__": "pkg.kern"}
    exec(compile(source, str(folder / "kern.py"), "exec"), scope)
    fn = scope[name] if closure is None else scope["outer"](closure)
    kernel = type("K", (), {})()
    kernel.fn, kernel.hash = fn, None
    return kernel


@pytest.fixture
def folder(tmp_path):
    """A kernel folder with one file, ``kern.py`` (its kernels made by ``_kernel_like``)."""
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "kern.py").write_text("# kernels\n")
    return d.resolve()


def test_a_kernel_gets_its_stored_key_and_computed_keys_are_stored(tmp_path, folder):
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    store = _key_cache.KernelKeys(path, folder)
    kernel = _kernel_like(folder)
    assert not store.adopt(kernel) and kernel.hash is None  # nothing stored yet
    kernel.hash = "ab" * 32  # Triton computed it
    assert store.remember() == 1 and store.remember() == 0  # written once
    again = _key_cache.KernelKeys(path, folder)  # a later process
    fresh = _kernel_like(folder)
    assert again.adopt(fresh) and fresh.hash == "ab" * 32
    done = _kernel_like(folder)
    done.hash = "cd" * 32  # a key already computed is never replaced
    assert not again.adopt(done) and done.hash == "cd" * 32


def test_a_folder_changed_while_the_process_runs_gets_no_stored_key(tmp_path, folder):
    """A file edited after the store was stamped, before its kernels are defined (a lazily imported
    module) or before they are defined again (a reload): no stored key given, none kept."""
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    first = _key_cache.KernelKeys(path, folder)
    kernel = _kernel_like(folder)
    first.adopt(kernel)
    kernel.hash = "ab" * 32
    first.remember()
    # a later process: its store stamped, then another file of the folder edited before this
    # file's first kernel is defined (one of its kernels may call into the edited file)
    late = _key_cache.KernelKeys(path, folder)
    (folder / "other.py").write_text("# edited\n")
    kernel = _kernel_like(folder)
    assert not late.adopt(kernel) and kernel.hash is None and late.stale
    kernel.hash = "cd" * 32
    assert late.remember() == 0 and '"' + "ab" * 32 + '"' in path.read_text()
    # a reload: the file's kernels were given their keys, then the folder changes and they are
    # defined again
    first = _key_cache.KernelKeys(path, folder)  # stamped as the folder is now
    kernel = _kernel_like(folder)
    kernel.hash = "ef" * 32
    first.adopt(kernel)
    first.remember()
    again = _key_cache.KernelKeys(path, folder)
    kernel = _kernel_like(folder)
    assert again.adopt(kernel) and kernel.hash == "ef" * 32
    (folder / "kern.py").write_text("# kernels, edited\n")
    reloaded = _kernel_like(folder)
    assert not again.adopt(reloaded) and reloaded.hash is None


def test_kernels_from_elsewhere_and_closures_are_left_to_triton(tmp_path, folder):
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    keys = {"tests.kernels.test_key_cache.k": "ab" * 32, "pkg.kern.outer.<locals>.k": "ab" * 32, "pkg.kern.k": "ab" * 32}
    path.write_text(__import__("json").dumps({"keys": keys}))
    store = _key_cache.KernelKeys(path, folder)

    def k(x_ptr):
        pass

    elsewhere = type("K", (), {})()
    elsewhere.fn, elsewhere.hash = k, None  # defined in this test file, outside the folder
    assert not store.adopt(elsewhere) and elsewhere.hash is None
    inner = _kernel_like(folder, closure=3)  # in the folder, but a closure: its key depends on 3
    assert not store.adopt(inner) and inner.hash is None
    plain = _kernel_like(folder)  # in the folder, no closure: the store answers (the test can fail)
    assert store.adopt(plain) and plain.hash == "ab" * 32


def test_a_corrupt_or_unwritable_kernel_store_changes_nothing(tmp_path, folder):
    from torchloom.kernels import _key_cache

    path = tmp_path / "keys.json"
    path.write_text("not json")
    store = _key_cache.KernelKeys(path, folder)
    kernel = _kernel_like(folder)
    assert not store.adopt(kernel) and kernel.hash is None
    path.write_text('{"keys": {"pkg.kern.k": "short"}}')  # not a key: ignored
    kernel = _kernel_like(folder)
    assert not _key_cache.KernelKeys(path, folder).adopt(kernel) and kernel.hash is None
    path.write_text("[" * 100000 + "]" * 100000)  # too deep for the JSON reader
    kernel = _kernel_like(folder)
    assert not _key_cache.KernelKeys(path, folder).adopt(kernel) and kernel.hash is None
    (tmp_path / "file").write_text("")
    unwritable = _key_cache.KernelKeys(tmp_path / "file" / "keys.json", folder)  # its folder is a file
    kernel = _kernel_like(folder)
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


@pytest.fixture
def no_stores(monkeypatch, tmp_path):
    """The process's stores as if none were made yet, in a cache folder of the test's own, and no
    handler left at exit."""
    import atexit

    from torchloom.kernels import _key_cache

    import triton.runtime.jit as jit_module

    monkeypatch.setattr(_key_cache, "_stores", {})
    monkeypatch.setattr(jit_module, "inspect", jit_module.inspect)  # put back whatever view is installed now
    monkeypatch.setattr(_key_cache, "_cache_dir", lambda triton: tmp_path / "cache")
    monkeypatch.setattr(atexit, "register", lambda fn: fn)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TORCHLOOM_TRITON_KEY_CACHE", "1")
    return _key_cache


def test_the_store_is_named_after_the_installation_python_and_kernel_sources(no_stores, monkeypatch, tmp_path):
    import triton

    _key_cache = no_stores
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(_key_cache, "KERNEL_DIR", folder)
    store = _key_cache.kernel_keys(triton)
    assert store is not None and store.path.parent == tmp_path / "cache" / "torchloom" and store.folder == folder
    names = {store.path.name}
    (folder / "a.py").write_text("x = 22\n")  # a kernel source changes
    monkeypatch.setattr(_key_cache, "_stores", {})
    names.add(_key_cache.kernel_keys(triton).path.name)
    monkeypatch.setattr(_key_cache, "installation_stamp", lambda triton: "another installation")
    monkeypatch.setattr(_key_cache, "_stores", {})
    names.add(_key_cache.kernel_keys(triton).path.name)
    monkeypatch.setattr(_key_cache.sys, "version", "another python")
    monkeypatch.setattr(_key_cache, "_stores", {})
    names.add(_key_cache.kernel_keys(triton).path.name)
    assert len(names) == 4


@pytest.mark.parametrize("env", [{"TORCHLOOM_TRITON_KEY_CACHE": "0"}, {"TRITON_INTERPRET": "1"}, {"TRITON_INTERPRET": "true"}])
def test_no_kernel_store_when_switched_off_or_interpreted(no_stores, monkeypatch, env):
    import triton

    _key_cache = no_stores
    assert _key_cache.kernel_keys(triton) is not None  # on by default (the test can fail)
    monkeypatch.setattr(_key_cache, "_stores", {})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _key_cache.kernel_keys(triton) is None


def test_source_lines_come_from_the_store_only_while_they_match(tmp_path, folder):
    """A kernel's source block (what ``inspect.getsourcelines`` finds) kept by one process and given
    by the next, equal to inspect's; not given when its lines changed or the folder was restamped
    different; foreign functions always go to ``inspect``."""
    import inspect
    import linecache

    from torchloom.kernels import _key_cache

    (folder / "kern.py").write_text("import os\n\n\ndef k(x_ptr):\n    y = x_ptr\n    return y\n\n# after\n")
    path = tmp_path / "keys.json"

    def load():
        scope: dict = {"__name__": "pkg.kern"}
        exec(compile((folder / "kern.py").read_text(), str(folder / "kern.py"), "exec"), scope)
        return scope["k"]

    first = _key_cache.KernelKeys(path, folder)
    view = _key_cache.TritonInspect(first)
    fn = load()
    assert first.source_lines(fn) is None  # nothing stored
    truth = inspect.getsourcelines(fn)
    assert view.getsourcelines(fn) == truth and first.remember() == 1
    again = _key_cache.KernelKeys(path, folder)
    assert again.source_lines(load()) == truth  # the next process: from the store, equal to inspect's
    assert _key_cache.TritonInspect(again).signature is inspect.signature  # everything else is inspect's
    outside = _key_cache.TritonInspect(again)
    assert outside.getsourcelines(test_source_lines_come_from_the_store_only_while_they_match) == inspect.getsourcelines(
        test_source_lines_come_from_the_store_only_while_they_match)
    # the same span, other lines (an edit the stamp would also see): the digest refuses them
    other = _key_cache.KernelKeys(path, folder)
    assert linecache.getlines(str(folder / "kern.py"))  # cached: the view must look again
    (folder / "kern.py").write_text("import os\n\n\ndef k(x_ptr):\n    z = x_ptr\n    return z\n\n# after\n")
    other.sources = _key_cache.sources_stamp(folder)  # as if stamped after the edit: only the digest differs
    assert other.source_lines(load()) is None
    # the folder restamped different: nothing given
    stale = _key_cache.KernelKeys(path, folder)
    (folder / "extra.py").write_text("")
    assert stale.source_lines(load()) is None and stale.stale


def test_the_inspect_view_goes_only_where_triton_uses_the_inspect_module(monkeypatch, tmp_path, folder):
    import inspect

    import triton.runtime.jit as jit_module

    from torchloom.kernels import _key_cache

    store = _key_cache.KernelKeys(tmp_path / "keys.json", folder)
    monkeypatch.setattr(jit_module, "inspect", inspect)
    _key_cache._install_inspect(store)
    assert isinstance(jit_module.inspect, _key_cache.TritonInspect)
    elsewhere = object()
    monkeypatch.setattr(jit_module, "inspect", elsewhere)  # a Triton that names something else so
    _key_cache._install_inspect(store)
    assert jit_module.inspect is elsewhere
