"""The PyTorch CUDA kernels of a run's device step, loaded on helper threads while the run gets ready.

A fresh process pays for the first use of every PyTorch CUDA kernel it launches: CUDA loads a
kernel's code on its first launch, and cuBLAS picks and loads the kernels of a product's shape on the
first product of that shape. For the 784-256-256-10 network at batch 1,024 (measured on the H200
machine, fresh processes) the step's kernels cost ~70 ms of host time one after another (cuBLAS's
first products 25–35 ms, ``relu`` 14 ms, the float64 copy 9 ms, the comparison of ReLU's gradient
6 ms, ``stack`` 5 ms, ...) and ~40 ms when each is loaded on a thread of its own: a short run's
start. Which kernels a step launches is known only once a step has run, so the engine remembers it:

* ``OpRecorder``: a ``TorchDispatchMode`` over the run's start (the batches' conversion and checks,
  the device state's layout: ``Trainer._get_ready``), its masked warm-up steps and its first replay.
  It notes every aten op on the run's CUDA device with the shapes, strides and dtypes of its tensors
  and the bytes it returned; it keeps no tensor. Only ops whose kernels read no value as an index or
  a count are noted: pointwise ops, reductions, matrix products, copies, concatenation, the norms',
  softmaxes' and convolutions' own kernels (``_warmable``); ops drawing random numbers never (a
  replay must not move the run's random stream).
* ``save(key, specs)`` / ``load(key)``: one small JSON file per run key (``run_key``: torchloom's,
  PyTorch's and CUDA's versions, the GPU, the method, the model, the batches' shapes, the settings
  that change the step's ops) in torchloom's cache directory (``cache_dir``), written atomically; the
  64 most recently written or read are kept.
* ``OpWarm(specs, device)``: up to 8 daemon threads run every noted op once on scratch tensors of
  the noted layout, never on the run's tensors; ``join()`` waits for them. The engine starts them as
  ``fit`` starts, when the key has a file, and joins them before its first CUDA graph capture (and,
  leaving the ops not yet started, as ``fit`` returns or raises). The run's thread meanwhile converts
  and checks the data and runs its first steps; a kernel a helper is loading is waited for, not
  loaded twice.

A list is a hint: a stale one (a changed step) warms kernels nobody uses and misses some that the
run's thread then loads itself, and an op that fails on scratch tensors is skipped. A replay keeps to
what a recorder would note, and to 64 MB of scratch inputs and outputs per op; with
``torch.backends.cudnn.benchmark`` on, convolutions are left to the run (cuDNN would time its
algorithms under the helpers' load and keep its pick). ``TORCHLOOM_WARM_OPS=0`` in the environment
switches recording and warming off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..observers._files import atomic_write

__all__ = ["OpRecorder", "OpWarm", "cache_dir", "enabled", "load", "run_key", "save"]

_THREADS = 8
_MAX_SCRATCH_BYTES = 64 << 20  # one op's scratch inputs and outputs
_MAX_LISTS = 64  # lists kept in the cache directory (the most recently written)
_FORMAT = 1  # bumped when the file's layout changes

# ops (by name, whatever the overload) whose kernels read no tensor value as an index, a count or a
# size, beside every op PyTorch tags pointwise or reduction
_ALLOWED = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "dot", "_addmm_activation",
    "cat", "stack", "copy", "_to_copy", "clone", "where", "fill", "zero", "zeros", "ones", "full",
    "eq", "ne", "gt", "ge", "lt", "le", "maximum", "minimum", "clamp", "clamp_min", "clamp_max",
    "threshold_backward", "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "convolution", "convolution_backward", "cudnn_convolution", "mse_loss", "mse_loss_backward",
    "sum", "mean", "amax", "amin", "aminmax", "norm", "linalg_vector_norm", "all", "any",
})
_CONVOLUTIONS = frozenset({"convolution", "convolution_backward", "cudnn_convolution"})
_UNSAFE_TAGS = ("nondeterministic_seeded", "data_dependent_output", "dynamic_output_shape")


def enabled() -> bool:
    """False when ``TORCHLOOM_WARM_OPS=0`` is in the environment."""
    return os.environ.get("TORCHLOOM_WARM_OPS", "1") != "0"


def cache_dir() -> Path:
    """Where torchloom keeps what it learns about a machine: ``$TORCHLOOM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/torchloom``, else ``~/.cache/torchloom``."""
    explicit = os.environ.get("TORCHLOOM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "torchloom"


def _warmable(func: Any) -> bool:
    tags = set(getattr(func, "tags", ()))
    if any(getattr(torch.Tag, name, None) in tags for name in _UNSAFE_TAGS):
        return False
    name = func._schema.name.split("::")[-1].rstrip("_")
    if name.startswith("_foreach_"):
        return True
    return name in _ALLOWED or torch.Tag.pointwise in tags or getattr(torch.Tag, "reduction", None) in tags


class _Unwarmable(Exception):
    pass


def _encode(a: Any, device: torch.device) -> Any:
    """JSON for an op argument; ``_Unwarmable`` for one a replay could not rebuild (a tensor elsewhere)."""
    if isinstance(a, Tensor):
        if a.device != device or a.layout != torch.strided or a.is_quantized or a.is_nested:
            raise _Unwarmable
        misalign = (a.storage_offset() * a.element_size()) % 16 // a.element_size()  # vectorised or not
        return {"t": [list(a.shape), list(a.stride()), str(a.dtype).removeprefix("torch."), misalign]}
    if isinstance(a, (list, tuple)):
        return {"l": [_encode(v, device) for v in a]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        if a.type != device.type or (a.index is not None and a.index != device.index):
            raise _Unwarmable
        return {"device": True}
    if isinstance(a, (torch.memory_format, torch.layout)):
        return {"enum": str(a).removeprefix("torch.")}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise _Unwarmable


class OpRecorder(TorchDispatchMode):
    """Within the block (this thread), every warmable aten op on ``device`` is noted once, in order of
    first use, as ``specs``: ``{"op": "aten::name.overload", "args": [...], "kwargs": {...}}``."""

    def __init__(self, device: torch.device, specs: list[dict] | None = None) -> None:
        super().__init__()
        self.device = device
        self.specs: list[dict] = [] if specs is None else specs
        self._seen = {json.dumps(s, sort_keys=True) for s in self.specs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with contextlib.suppress(Exception):  # noting is a hint: it never fails the op it watches
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not _warmable(func):
            return
        try:
            spec = {"op": f"{func._schema.name}.{func._overloadname}", "args": _encode(list(args), self.device),
                    "kwargs": {k: _encode(v, self.device) for k, v in kwargs.items()},
                    "out_bytes": _bytes_of(func, out)}
        except _Unwarmable:
            return
        if not _touches(spec["args"]) and not _touches(list(spec["kwargs"].values())):
            return  # no tensor on the device in or out (a factory op for another device)
        text = json.dumps(spec, sort_keys=True)
        if text not in self._seen:
            self._seen.add(text)
            self.specs.append(spec)


def _bytes_of(func: Any, out: Any) -> int:
    """Bytes a replay of ``func`` allocates for what it returns, beside its inputs: none for an op
    that returns (views of) its inputs (in-place and ``out=`` ops), else each returned tensor's
    extent."""
    if any(r.alias_info is not None for r in func._schema.returns):
        return 0

    def extent(t: Any) -> int:
        if isinstance(t, Tensor):
            return _elements(t.shape, t.stride()) * t.element_size() if t.layout == torch.strided else 0
        if isinstance(t, (list, tuple)):
            return sum(extent(o) for o in t)
        return 0

    return extent(out)


def _elements(shape: Any, stride: Any) -> int:
    """Elements a strided layout spans, from its first to its last (0 when it is empty)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _touches(encoded: Any) -> bool:
    if isinstance(encoded, dict):
        return "t" in encoded or "device" in encoded or any(_touches(v) for v in encoded.values())
    if isinstance(encoded, list):
        return any(_touches(v) for v in encoded)
    return False


# ------------------------------------------------------------------------------------- the cache
def run_key(parts: Iterable[Any]) -> str:
    """A file name for a run: the hash of ``parts`` (reprs of what decides the step's ops) with
    torchloom's, PyTorch's and CUDA's versions."""
    from .._version import __version__

    h = hashlib.sha256(f"{_FORMAT}\0{__version__}\0{torch.__version__}\0{torch.version.cuda}\n".encode())
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _path(key: str) -> Path:
    return cache_dir() / "ops" / f"{key}.json"


def load(key: str) -> list[dict] | None:
    """The noted ops of ``key``'s runs, or None (no file, or one that cannot be read)."""
    path = _path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("ops"), list):
        return None
    with contextlib.suppress(OSError):  # in use: among the newest, so ``save`` keeps it
        os.utime(path)
    return data["ops"]


def save(key: str, specs: list[dict]) -> bool:
    """Keep ``specs`` for ``key`` (atomically: a reader sees the old file or the new one), and only the
    64 most recently written or read lists. False when the cache directory cannot be written; nothing
    raises."""
    try:
        text = json.dumps({"format": _FORMAT, "ops": specs}).encode()
        path = _path(key)
        path.parent.mkdir(parents=True, exist_ok=True)  # torchloom's own cache folder
        atomic_write("op_warm", str(path), lambda f: f.write(text))
    except (OSError, TypeError, ValueError):
        return False
    with contextlib.suppress(OSError):  # the newest lists stay: one per model, method and shapes run lately
        lists = sorted(_path(key).parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in lists[_MAX_LISTS:]:
            old.unlink()
    return True


# ------------------------------------------------------------------------------------ the replay
def _resolve(name: str) -> Any:
    qualified, overload = name.rsplit(".", 1)
    namespace, op = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _torch_attr(name: Any, kind: Any) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise _Unwarmable
    return value


def _decode(e: Any, device: torch.device, budget: list[int]) -> Any:
    if isinstance(e, dict):
        if "t" in e:
            shape, stride, dtype_name, misalign = e["t"]
            dtype = _torch_attr(dtype_name, torch.dtype)
            size = _elements(shape, stride) + misalign
            budget[0] -= size * dtype.itemsize
            if budget[0] < 0:
                raise _Unwarmable
            floating = dtype.is_floating_point or dtype.is_complex
            storage = (torch.empty if floating else torch.zeros)(size, dtype=dtype, device=device)
            return storage.as_strided(shape, stride, misalign)
        if "l" in e:
            return [_decode(v, device, budget) for v in e["l"]]
        if "dtype" in e:
            return _torch_attr(e["dtype"], torch.dtype)
        if "device" in e:
            return device
        if "enum" in e:
            return _torch_attr(e["enum"], (torch.memory_format, torch.layout))
        raise _Unwarmable
    return e


def replay_one(spec: dict, device: torch.device) -> bool:
    """Run one noted op on fresh scratch tensors; False when it cannot be rebuilt or fails (nothing
    raises)."""
    try:
        func = _resolve(spec["op"])
        if not _warmable(func):  # a list from elsewhere, or an older torchloom: only what a recorder keeps
            return False
        if _CONVOLUTIONS & {func._schema.name.split("::")[-1]} and torch.backends.cudnn.benchmark:
            return False  # cuDNN would time its algorithms here, under the helpers' load, and keep its pick
        budget = [_MAX_SCRATCH_BYTES - int(spec.get("out_bytes", 0))]
        if budget[0] < 0:
            return False
        args = _decode(spec["args"], device, budget)
        kwargs = {k: _decode(v, device, budget) for k, v in spec.get("kwargs", {}).items()}
        with torch.no_grad():
            func(*args, **kwargs)
        return True
    except Exception:  # noqa: BLE001 - a hint that no longer fits: the run's thread loads it itself
        return False


class OpWarm:
    """Runs ``specs`` (in their order, spread over up to 8 daemon threads, on each thread's default
    stream: a new stream would cost the run's thread the stream pool's creation) once each;
    ``join()`` waits."""

    def __init__(self, specs: list[dict], device: torch.device) -> None:
        self._queue = list(specs)
        self._next = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.done = 0
        if not self._queue:
            return
        self._device = device
        self._planned = self._live = min(_THREADS, len(self._queue))  # _live: workers not yet ended
        # the run's thread starts one thread, which starts the others: each start waits for the new
        # thread to run, ~1 ms while other threads hold the interpreter lock
        self._start_thread(0)

    def _start_thread(self, i: int) -> bool:
        """Start worker ``i``; when no thread can be had, the workers from ``i`` on count as ended."""
        thread = threading.Thread(target=self._run, args=(i,), name=f"torchloom-warm-ops-{i}", daemon=True)
        with self._lock:
            self._threads.append(thread)
        try:
            thread.start()
            return True
        except Exception:  # noqa: BLE001 - no more threads to be had: those started do the work
            with self._lock:
                self._threads.remove(thread)
            for _ in range(i, self._planned):
                self._thread_ended()
            return False

    def _thread_ended(self) -> None:
        with self._lock:
            self._live -= 1

    def _take(self) -> dict | None:
        with self._lock:
            if self._next >= len(self._queue):
                return None
            self._next += 1
            return self._queue[self._next - 1]

    def _run(self, i: int) -> None:
        try:
            if self._device.type == "cuda":
                # this thread's current device and CUDA context (a new thread has neither): without
                # it cuBLAS warns "no current CUDA context" at the first matmul, and the ops of a
                # run on cuda:1 would load on cuda:0
                try:
                    torch.cuda.set_device(self._device)
                except Exception:  # noqa: BLE001 - a warm-up hint only: its ops then fail and the run loads them itself
                    pass
            if i == 0:
                for j in range(1, self._planned):
                    if not self._start_thread(j):
                        break
            while (spec := self._take()) is not None:
                if replay_one(spec, self._device):
                    with self._lock:
                        self.done += 1
        finally:
            self._thread_ended()

    def cancel(self) -> None:
        """Leave the ops not yet started (a run that ends or fails needs none of them)."""
        with self._lock:
            self._next = len(self._queue)

    def join(self) -> None:
        """Wait for every thread (at once when none was started or all have ended)."""
        while True:
            with self._lock:
                if not self._threads:
                    return
                thread = self._threads[0]
            thread.join()
            with self._lock:
                if self._threads and self._threads[0] is thread:
                    self._threads.pop(0)
