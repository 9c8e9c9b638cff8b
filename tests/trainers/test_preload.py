"""The helper thread that imports Triton and a run's kernel modules while the run gets ready
(``torchloom/kernels/_preload.py``), and each method's list of the kernel modules its device step
launches (``Trainer.device_kernel_modules``)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torchloom.kernels._preload import Preload

ROOT = Path(__file__).resolve().parents[2]


def test_preload_imports_the_modules_on_a_thread(tmp_path, monkeypatch):
    (tmp_path / "preload_probe_mod.py").write_text(
        "import threading\nIMPORTED_ON = threading.current_thread().name\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "preload_probe_mod", raising=False)
    preload = Preload(["preload_probe_mod"])
    assert preload.started
    preload.join()
    module = sys.modules["preload_probe_mod"]
    assert module.IMPORTED_ON == "torchloom-preload"
    assert not Preload(["preload_probe_mod"]).started  # imported already: no second thread
    assert not any(t.name.startswith("torchloom-preload") for t in threading.enumerate())


def _probe_module(tmp_path, monkeypatch, name, source="X = 1\n"):
    """A module ``name`` with ``source``, importable and not yet imported."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


@contextlib.contextmanager
def _switch_interval(seconds):
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_preload_leaves_the_process_s_switch_interval_as_it_is(tmp_path, monkeypatch):
    """The interval is a process-wide setting: not torchloom's to change, while threads run or after
    (two overlapping preloads, one of them never joined)."""
    _probe_module(tmp_path, monkeypatch, "preload_slow_mod", "import time\ntime.sleep(0.2)\n")
    _probe_module(tmp_path, monkeypatch, "preload_other_mod", "import time\ntime.sleep(0.1)\n")
    with _switch_interval(0.004):
        first = Preload(["preload_slow_mod"])
        second = Preload(["preload_other_mod"])
        assert first.started and second.started and sys.getswitchinterval() == pytest.approx(0.004)
        first.join()
        for thread in list(second._threads):  # the threads end; the Preload itself is never joined
            thread.join()
        assert sys.getswitchinterval() == pytest.approx(0.004)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_thread_asks_triton_s_remembered_questions_each_on_its_own(tmp_path, monkeypatch):
    """After its imports the thread asks Triton's system questions (``_warm_tools``) and Triton's
    ``triton_key`` (its installation's hash, which every first launch asks): a question that fails
    leaves the next ones asked, and nothing escapes the thread. Triton's functions are called, never
    replaced."""
    pytest.importorskip("triton")
    from triton.runtime import build, cache

    asked = []

    def failing_platform_key():
        asked.append("platform_key")
        raise OSError("no file(1) here")

    def key():
        asked.append("triton_key")
        raise OSError("an unreadable installation")

    monkeypatch.setattr(build, "platform_key", failing_platform_key, raising=False)
    monkeypatch.setattr(cache, "triton_key", key)
    _probe_module(tmp_path, monkeypatch, "preload_tools_mod")
    preload = Preload(["preload_tools_mod"], arch=90)
    assert preload.started
    preload.join()
    assert sorted(asked) == ["platform_key", "triton_key"]  # two threads: either may ask first
    assert cache.triton_key is key and build.platform_key is failing_platform_key


def test_preload_switched_off_by_the_environment(tmp_path, monkeypatch):
    (tmp_path / "preload_off_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TORCHLOOM_PRELOAD", "0")
    preload = Preload(["preload_off_mod"])
    preload.join()
    assert not preload.started and "preload_off_mod" not in sys.modules


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_preload_never_raises_for_a_module_that_fails(tmp_path, monkeypatch):
    (tmp_path / "preload_broken_mod.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    preload = Preload(["preload_broken_mod", "torchloom_no_such_module_xyz"])
    preload.join()  # no error here: the code that needs the module imports it again and fails there
    assert "preload_broken_mod" not in sys.modules
    with pytest.raises(RuntimeError, match="broken on import"):
        importlib.import_module("preload_broken_mod")


_BUILD = r"""
def build(method, loss_type, optimizer, dev):
    import torch
    from torchloom import LSTM, RNN, Dense, LayerNorm, MultiHeadAttention, Network, RMSNorm, Softmax, SwiGLU, TrainingConfig
    from torchloom.engine.train import make_trainer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if method == "backprop-layers":  # every layer family with kernels of its own, on sequences [8, 5, 6]
        method = "backprop"
        net = Network(Dense(6, 8, "tanh"), RMSNorm(8), MultiHeadAttention(8, 2), LayerNorm(8), SwiGLU(8, 16),
                      RNN(8, 8), LSTM(8, 8), Dense(8, 4, "linear"), Softmax()).to(dev)
        data = [(torch.randn(8, 5, 6, generator=g).to(dev), torch.rand(8, 5, 4, generator=g).to(dev)) for _ in range(3)]
    else:
        net = Network(Dense(6, 12, "tanh"), Dense(12, 4, "linear")).to(dev)
        labels = loss_type == "cross_entropy"
        data = [(torch.randn(8, 6, generator=g).to(dev), (torch.randint(0, 4, (8,), generator=g) if labels else torch.rand(8, 4, generator=g)).to(dev))
                for _ in range(3)]
    extra = dict(optimizer=optimizer) if method == "backprop" else {}
    cfg = TrainingConfig(method=method, epochs=1, verbose=0, loss_type=loss_type, gradient_clip=0.5, **extra)
    return make_trainer(net, cfg), data
"""

# One fresh process per method: first what the preload thread does (import the declared modules;
# the kernel modules loaded then are the preloaded ones), then the device step. A module the step
# imports that is not among the preloaded ones is what the preload left to the first step.
_PROBE = _BUILD + r"""
import importlib, json, sys
method, loss_type, optimizer, declared = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
for name in declared:
    importlib.import_module(name)
preloaded = sorted(m for m in sys.modules if m.startswith("torchloom.kernels."))
import torch
from torchloom.engine.cuda_path import CudaRunner

dev = "cuda" if torch.cuda.is_available() else "cpu"
trainer, data = build(method, loss_type, optimizer, dev)
if dev == "cpu":  # the device step on CPU tensors, its kernels through Triton's interpreter
    trainer.kernel_backend = "triton"
    trainer._runner = CudaRunner(trainer)
reached = set()  # the kernel modules whose code the step ran (this thread: the preload is off)


def watch(frame, event, arg):
    if event == "call" and "/torchloom/kernels/" in frame.f_code.co_filename.replace("\\", "/"):
        reached.add(frame.f_code.co_filename.replace("\\", "/").rpartition("/")[2])


sys.setprofile(watch)
trainer.fit(data, 1)  # on CUDA: the device path itself (TORCHLOOM_PRELOAD=0: its imports happen where they are used)
sys.setprofile(None)
used = sorted(m for m in sys.modules if m.startswith("torchloom.kernels.") and not m.rpartition(".")[2].startswith("_"))
print(json.dumps({"used": used, "declared": trainer.device_kernel_modules(), "preloaded": preloaded,
                  "reached": sorted(reached)}))
"""

CASES = [
    ("backprop", "cross_entropy", "sgd"), ("backprop", "mse", "adamw"), ("backprop", "crossentropy", "rmsprop"),
    ("target_prop", "mse", "sgd"), ("tween", "cross_entropy", "sgd"), ("tween", "mse", "sgd"),
    ("backprop-layers", "mse", "sgd"),
]


def _declared(method, loss_type, optimizer):
    """The kernel modules the probe's trainer declares, from the probe's own builder, here on the CPU."""
    namespace: dict = {}
    exec(_BUILD, namespace)  # noqa: S102 - the probe's builder, the same string the probe runs
    return namespace["build"](method, loss_type, optimizer, "cpu")[0].device_kernel_modules()


def _probe(method, loss_type, optimizer, declared):
    env = dict(os.environ, TRITON_INTERPRET="0" if torch.cuda.is_available() else "1", TORCHLOOM_PRELOAD="0",
               PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", _PROBE, method, loss_type, optimizer, json.dumps(declared)],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)


@pytest.fixture(scope="module")
def probes(request):
    """The probes of the cases this session runs, started up front two at a time (each is a Python
    process importing torch and Triton, seconds, with this process waiting on it: on a 2-core machine
    two run in the time of one); a case's test waits for its own. ``{case: (declared, future)}``."""
    pytest.importorskip("triton")
    name = "test_declared_kernel_modules_cover_what_the_device_step_imports"
    cases = [tuple(item.callspec.params[k] for k in ("method", "loss_type", "optimizer")) for item in request.session.items
             if getattr(item, "originalname", None) == name and item.module is request.module]
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        started = {}
        for case in cases:
            declared = _declared(*case)
            started[case] = declared, pool.submit(_probe, *case, declared)
        yield started


@pytest.mark.parametrize("method,loss_type,optimizer", CASES, ids=["-".join(c) for c in CASES])
def test_declared_kernel_modules_cover_what_the_device_step_imports(probes, method, loss_type, optimizer):
    """Run a method's device step in a fresh process (on CUDA when there is a GPU, else on CPU tensors
    through Triton's interpreter), the preload off, after importing the method's declared modules (the
    list this process's trainer declares, checked equal to the probe's trainer's): every kernel module
    the step imported was already imported by the declared modules, so the preload leaves no kernel
    module to the first step; and every declared module exists."""
    declared, future = probes[(method, loss_type, optimizer)]
    for name in declared:
        assert importlib.util.find_spec(name) is not None, name
    out = future.result()
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["declared"] == declared  # the modules preloaded are the ones the run declares
    assert report["reached"], "the device step ran no kernel module's code: the probe did not reach the kernels"
    missing = sorted(set(report["used"]) - set(report["preloaded"]))
    assert not missing, f"{method}'s device step imports kernel modules the preload does not: {missing}"


# ------------------------------------------------------------------ the engine's use of it
class _StandIn:
    """Records what ``fit`` does with its preload (the real one needs CUDA to be started)."""

    def __init__(self, log):
        self.log = log

    def join(self):
        self.log.append("join")


def _wired(monkeypatch, log):
    from torchloom.engine import loop

    build = loop.Trainer._build_runner
    monkeypatch.setattr(loop.Trainer, "_start_preload", lambda self, batches: _StandIn(log))
    monkeypatch.setattr(loop.Trainer, "_build_runner", lambda self: (log.append("runner"), build(self))[1])


def _data(bad=False):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, generator=g), torch.rand(4, 2, generator=g)) for _ in range(3)]
    if bad:
        data[2] = (torch.randn(4, 5), data[2][1])  # wrong input width: rejected before any step
    return data


@pytest.mark.parametrize("method", ["backprop", "target_prop", "tween"])
def test_fit_joins_the_preload_before_the_runner_and_after_a_failure(monkeypatch, method):
    from torchloom import Dense, Network, TrainingConfig, train

    cfg = TrainingConfig(method=method, epochs=1, verbose=0, loss_type="mse")
    log = []
    _wired(monkeypatch, log)
    train(Network(Dense(3, 2)), _data(), cfg)
    assert log[:2] == ["join", "runner"], log  # joined first; the finally's join after it is a no-op
    monkeypatch.undo()
    with pytest.raises(ValueError) as plain:
        train(Network(Dense(3, 2)), _data(bad=True), cfg)
    log.clear()
    _wired(monkeypatch, log)
    with pytest.raises(ValueError) as wired:
        train(Network(Dense(3, 2)), _data(bad=True), cfg)
    assert str(wired.value) == str(plain.value)  # the same error as without the preload
    assert log == ["join"]  # joined although the run failed before its runner


def test_no_preload_beside_dataloader_workers_or_off_cuda(monkeypatch):
    from torchloom import Dense, Network, TrainingConfig
    from torchloom.kernels import _preload
    from torchloom.engine.train import make_trainer

    started = []
    monkeypatch.setattr(_preload, "Preload", lambda modules, arch=None: started.append(list(modules)) or _StandIn([]))
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.rand(8, 2))
    trainer = make_trainer(Network(Dense(3, 2)), TrainingConfig(method="tween", verbose=0))
    assert trainer._start_preload(_data()) is None and not started  # CPU: nothing to preload
    trainer.device = torch.device("cuda")  # only the decision is exercised: no CUDA call is made
    assert trainer._start_preload(torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)) is None
    assert not started
    assert trainer._start_preload(torch.utils.data.DataLoader(data, batch_size=4)) is not None
    assert started == [trainer.device_kernel_modules()]


def test_the_system_questions_wait_for_triton_s_package(tmp_path, monkeypatch):
    """The questions' thread imports Triton's submodules only once the other thread has imported the
    package (two threads importing into a half-imported package can each get a half-made module),
    and asks nothing when Triton is missing."""
    from torchloom.kernels import _preload

    events = []

    def slow_package():
        events.append("package started")
        time.sleep(0.2)
        events.append("package imported")
        return True

    monkeypatch.setattr(_preload, "_warm_triton", slow_package)
    monkeypatch.setattr(_preload, "_warm_tools", lambda arch: events.append(f"questions {arch}"))
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or types.ModuleType("triton"))
    _probe_module(tmp_path, monkeypatch, "preload_order_mod")
    Preload(["preload_order_mod"], arch=90).join()
    assert events == ["package started", "package imported", "questions 90"]

    events.clear()
    monkeypatch.setattr(_preload, "_warm_triton", lambda: events.append("no package") or False)
    monkeypatch.delitem(sys.modules, "triton")
    _probe_module(tmp_path, monkeypatch, "preload_order_mod2")
    Preload(["preload_order_mod2"], arch=90).join()
    assert events == ["no package"]


def _slow_package(monkeypatch, seconds=0.25):
    """The preload's import of Triton's package made to take ``seconds``; the list returned gets an
    entry when it has ended."""
    from torchloom.kernels import _preload

    done = []

    def slow_package():
        time.sleep(seconds)
        done.append(True)
        return False

    monkeypatch.setattr(_preload, "_warm_triton", slow_package)
    return done


def test_a_launch_on_another_thread_waits_for_the_imports(tmp_path, monkeypatch):
    """``use_triton`` answering yes (a launch follows, which imports Triton's modules lazily) waits for
    a preload thread still importing; answering no never waits."""
    pytest.importorskip("triton")
    from torchloom.kernels import _preload
    from torchloom.kernels._triton import use_triton

    done = _slow_package(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that a CPU tensor may take the Triton path
    _probe_module(tmp_path, monkeypatch, "preload_wait_mod")
    preload = Preload(["preload_wait_mod"])
    assert not use_triton(torch.zeros(2), "reference") and not done  # the reference: no wait
    assert use_triton(torch.zeros(2), "triton")
    assert done  # returned only once the imports had ended
    preload.join()
    assert not _preload._importing


def test_the_default_backend_waits_too_and_never_raises_while_preloads_start(tmp_path, monkeypatch):
    """``use_triton(t)`` (the default backend, what the layers ask) waits for the imports when it picks
    Triton; a thread asking while preloads are being started (runs started from several threads) never
    gets an error, whatever the moment."""
    from types import SimpleNamespace

    from torchloom.kernels import _preload, _triton

    done = _slow_package(monkeypatch)
    monkeypatch.setattr(_triton, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    on_gpu = SimpleNamespace(is_cuda=True, dtype=torch.float32)  # only the decision is exercised
    _probe_module(tmp_path, monkeypatch, "preload_default_mod")
    preload = Preload(["preload_default_mod"])
    assert _triton.use_triton(on_gpu) and done
    preload.join()

    monkeypatch.setattr(_preload, "_warm_triton", lambda: False)
    errors, stop = [], threading.Event()

    def ask():
        while not stop.is_set():
            try:
                _preload.wait_for_imports()
            except Exception as e:  # noqa: BLE001 - what the test looks for
                errors.append(e)

    # the interpreter lock handed over every 0.1 ms, not every 5 (restored after): the asker runs
    # between the starts' steps at many more points, and each start no longer waits up to 5 ms per
    # handover for the spinning asker (300 starts: ~1.5 s, not ~12)
    with _switch_interval(1e-4):
        asker = threading.Thread(target=ask)
        asker.start()
        try:
            for _ in range(300):
                Preload(["torchloom_no_such_module_xyz"]).join()
        finally:
            stop.set()
            asker.join()
    assert errors == [] and not _preload._importing
