"""The start of a run on CUDA: helper threads that import Triton and load PyTorch's kernels while the
run gets ready (``kernels/_preload.py``, ``op_warm.py``). A part of the engine's ``Trainer``
(``WarmStart`` is one of its bases); nothing here changes what a run computes."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import Tensor

from . import op_warm
from .data import DEFAULT_BATCH_SIZE

__all__ = ["WarmStart"]


class WarmStart:
    """The engine's start-up helpers (mixed into ``Trainer``): ``_start_preload``, ``_start_op_warm``,
    ``op_recorder``, ``finish_op_record`` and ``join_op_warm``."""

    def _on_device_path(self) -> bool:
        """Whether this run's steps run on the CUDA device path (a CUDA device and a method with a
        device step)."""
        return self.device.type == "cuda" and self.device_ready()

    def _start_preload(self, batches: Any) -> Any:
        """On CUDA, with a device step: a ``kernels._preload.Preload`` importing Triton and the device
        step's kernel modules while the data is converted and checked; ``None`` otherwise, and when a
        ``DataLoader`` with worker processes is about to start them (workers forked beside a thread
        that is importing could inherit a half-imported module)."""
        if not self._on_device_path():
            return None
        loaders = (batches, getattr(self.training, "validation_data", None))
        if any(isinstance(d, torch.utils.data.DataLoader) and d.num_workers > 0 for d in loaders):
            return None
        from ..kernels._preload import Preload

        arch = None
        with contextlib.suppress(Exception):  # Triton's key for the GPU, asked on this thread (e.g. 90)
            major, minor = torch.cuda.get_device_capability(self.device)
            arch = 10 * major + minor
        return Preload(self.device_kernel_modules(), arch=arch)

    def _start_op_warm(self, batches: Any) -> None:
        """On CUDA, with a device step over a list of batches: the PyTorch kernels an earlier run of
        the same key noted (``op_warm.py``) loaded on helper threads from now on; without such a list,
        this run notes its own (``op_recorder``)."""
        self._op_warm = None
        self._op_record_key = None
        if not self._on_device_path() or not op_warm.enabled():
            return
        try:  # a hint: anything that goes wrong here means no warming, never a failed run
            data = _data_signature(batches, self.training)
            if data is None:
                return
            cfg = self.training
            settings = [*(getattr(cfg, name, None) for name in _OP_SETTINGS), bool(cfg.gradient_clip)]  # a clip: on or off
            params = [(name, tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()]
            key = op_warm.run_key([
                torch.cuda.get_device_name(self.device), type(self.method).__qualname__, _describe_method(cfg.method),
                _describe(settings), repr(self.model), params, data,
            ])
            specs = op_warm.load(key)
        except Exception:  # noqa: BLE001
            return
        if specs:
            self._op_warm = op_warm.OpWarm(specs, self.device)
        else:
            self._op_record_key = key

    def op_recorder(self) -> contextlib.AbstractContextManager:
        """A context to run the start and the device path's first steps in: an ``op_warm.OpRecorder``
        when this run notes its kernels for the next, else one that does nothing;
        ``finish_op_record()`` keeps what was noted."""
        key = getattr(self, "_op_record_key", None)
        if key is None:
            return contextlib.nullcontext()
        specs = self.__dict__.setdefault("_op_specs", [])
        return op_warm.OpRecorder(self.device, specs)

    def finish_op_record(self) -> None:
        """Keep the noted kernels for the next run of this key (once; nothing raises)."""
        key = getattr(self, "_op_record_key", None)
        specs = self.__dict__.pop("_op_specs", None)
        self._op_record_key = None
        if key is not None and specs:
            op_warm.save(key, specs)

    def join_op_warm(self, cancel: bool = False) -> None:
        """Wait for the helper threads warming kernels, if any (before a CUDA graph capture);
        ``cancel``: the ops not yet started are left (the run is ending)."""
        warm = getattr(self, "_op_warm", None)
        if warm is not None:
            if cancel:
                warm.cancel()
            warm.join()
            self._op_warm = None



# the settings of a TrainingConfig that change which kernels a step launches (with the method, the
# model, the batches' shapes and whether gradients are clipped: ``Trainer._start_op_warm``'s key)
_OP_SETTINGS = (
    "loss_type", "clip_mode", "optimizer", "scheduler", "cuda_graph", "precision",
    "scheduler_interval", "batch_size", "shuffle", "distributed",
)


def _describe(value: Any) -> Any:
    """``value`` for a run key, the same in every process: objects by class name (an optimizer or a
    schedule, whose repr may hold addresses), plain values and containers as they are."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return type(value).__qualname__


def _describe_method(method: Any) -> Any:
    """``TrainingConfig.method`` for a run key: a name as it is; a config by class and field by field,
    each number by whether it is zero (a rate's size launches no other kernel, a switched-off rule
    may), other fields as ``_describe``."""
    if not dataclasses.is_dataclass(method) or isinstance(method, type):
        return _describe(method)
    fields = []
    for f in dataclasses.fields(method):
        v = getattr(method, f.name)
        fields.append((f.name, v != 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else _describe(v)))
    return [type(method).__qualname__, *fields]


def _data_signature(batches: Any, cfg: Any) -> Any:
    """The shapes and dtypes that decide a run's kernels: a list of ``(x, y)`` tensor batches by its
    first and last batch; ``(X, Y)`` tensors by their row shapes, the batch size and the ragged
    remainder; None for anything else (no kernel warming)."""
    def shapes(pair: Any) -> Any:
        if not isinstance(pair, (list, tuple)) or not pair or not all(isinstance(t, Tensor) for t in pair):
            return None
        return [(tuple(t.shape), t.dtype, t.device.type) for t in pair]

    if not isinstance(batches, (list, tuple)) or not batches:
        return None
    if len(batches) == 2 and all(isinstance(t, Tensor) for t in batches):
        size = cfg.batch_size or DEFAULT_BATCH_SIZE
        return ["tensors", [(tuple(t.shape[1:]), t.dtype, t.device.type) for t in batches], size, batches[0].shape[0] % size]
    first, last = shapes(batches[0]), shapes(batches[-1])
    return None if first is None or last is None else ["list", first, last]
