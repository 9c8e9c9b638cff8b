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
