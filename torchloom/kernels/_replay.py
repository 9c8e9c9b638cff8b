"""Replaying an opaque operator's kernel launches without re-running its Python.

A compiled LSTM calls its persistent loops through opaque operators (``torch.library.custom_op``), and
so does a compiled RNN where ``recurrent.compiled_plan`` has no plan (by default its graph launches the
kernels itself). Each call's Python chooses the kernels, plans the products, allocates
and launches (``fp32_matmul.mm_many``, ``recurrent._launch_rnn_loop``...): about 1 ms of host time
per compiled float32 RNN step on an H200's host, where the step's other host time (graph wrappers,
dispatch) is about 0.5 ms and PyTorch's compiled ``nn.RNN`` step 0.7–0.9 ms (bench/RESULTS.md §10).
For a given operator, operand layouts and switches, that Python does the same thing every call.

``run(key, fn, args)`` calls ``fn(*args)`` the first time a key is seen, and records what the call
did:

- each kernel launched through ``_launch.launch``: the compiled kernel, grid, arguments and constants;
- each ``fill_`` (a loop's sentinel flags);
- which tensors it allocated, and where each kernel argument, fill target and returned tensor lies:
  in which input or new allocation, at what byte offset.

Later calls with the key only allocate the same buffers, then launch the same compiled kernels on
the new addresses, and return views of the new buffers shaped as the first call's results. The ATen
operators a recorded call may run are allocations, views, ``fill_``, ``clone`` and ``copy_``, watched
through a ``TorchDispatchMode`` while it records. Any other ATen operator disqualifies the key, and
every later call of that key runs ``fn`` itself. Examples: a product cuBLAS computes, a per-step loop
after a kernel could not launch (``unreplayable()``), or a read of a tensor the call neither received
nor allocated. Kernels must be launched through ``_launch.launch``: a launch made otherwise dispatches
no ATen operator and is not seen. As a guard, a call with a result that no recorded launch, fill or
copy touched is not replayed either.

The key must hold everything the call's decisions read: ``key`` from the caller (the operator, the
switches it reads), with each tensor argument's shape, strides, dtype, device and 16-byte alignment
added here. Kernel arguments are passed as addresses on a GPU (``_launch``'s direct launch), and as
tensor views under Triton's interpreter, which is how CI checks the recording without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from . import _launch

__all__ = ["run", "unreplayable", "clear_programs", "program_count"]

_MAX_PROGRAMS = 1024
_UNREPLAYABLE = object()
_programs: dict[tuple, Any] = {}

aten = torch.ops.aten
_ALLOCS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
           aten.new_empty_strided.default}
_VIEWS = {aten.view.default, aten.view.dtype, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.slice.Tensor,
          aten.select.int, aten.as_strided.default, aten.alias.default, aten.detach.default, aten.expand.default,
          # views where they can be (a compiled backward's operator sees them undecomposed); a copy they make
          # lies in no recorded buffer, so any use of it leaves the call unreplayable
          aten.reshape.default, aten._reshape_alias.default, aten.flatten.using_ints}
_FILLS = {aten.fill_.Scalar}
_COPIES = {aten.clone.default, aten.copy_.default}  # a clone: an allocation and a copy into it


class _Ref(NamedTuple):
    """Where a tensor lies: buffer ``source`` (the call's tensor inputs first, then its allocations),
    ``offset`` bytes from the buffer's first element, and the view's dtype, sizes and strides."""

    source: int
    offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Launch(NamedTuple):
    kernel: Any
    grid: tuple[int, ...]
    args: list  # the recorded arguments, tensors replaced by None in the slots below
    slots: tuple[tuple[int, _Ref], ...]  # (argument position, where its tensor lies)
    constants: dict
    options: dict
    tail: tuple  # the constants in signature order (the direct launch)
    runner: Any  # ``compiled[grid]`` of the kept kernel, made once (the direct launch; else None)


class _Fill(NamedTuple):
    target: _Ref
    value: Any


class _Copy(NamedTuple):
    target: _Ref
    source: _Ref


class _Program(NamedTuple):
    allocs: tuple[tuple[int, torch.dtype | None, tuple[int, ...] | None, torch.device], ...]  # (bytes, dtype, sizes, device)
    actions: tuple[_Launch | _Fill | _Copy, ...]
    outputs: tuple[tuple[_Ref, bool], ...]  # each result, and whether it is its allocation itself
    tuple_result: bool
    addresses: bool  # kernel arguments as addresses (else as views: the interpreter)


class _Recording:
    def __init__(self) -> None:
        # in the order they ran: ("launch", kernel, compiled, grid, args, constants, options),
        # ("fill", target, value), ("copy", target, source)
        self.events: list[tuple] = []
        self.pause = 0  # > 0 while a launch runs: its own tensor operations are not watched
        self.allocated: list[Tensor] = []
        self.ok = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pause += 1
        try:
            yield
        finally:
            self.pause -= 1

    def note_launch(self, kernel: Any, compiled: Any, grid: tuple, args: tuple, constants: dict, options: dict) -> None:
        """``_launch.launch``'s report of a launch it made."""
        self.events.append(("launch", kernel, compiled, grid, args, constants, options))


class _Watch(TorchDispatchMode):
    """Lets allocations, views, ``fill_`` and copies through, noting allocations, fills and copies;
    anything else marks the recording unreplayable (and still runs)."""

    def __init__(self, rec: _Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.rec.pause:
            return out
        if func in _ALLOCS:
            self.rec.allocated.append(out)
        elif func in _FILLS:
            self.rec.events.append(("fill", args[0], args[1]))
        elif func in _COPIES:
            if func is aten.clone.default:
                self.rec.allocated.append(out)
                self.rec.events.append(("copy", out, args[0]))
            else:
                self.rec.events.append(("copy", args[0], args[1]))
        elif func not in _VIEWS:
            self.rec.ok = False
        return out


def unreplayable() -> None:
    """Mark the call this thread is recording, if any, as not to be replayed (its Python runs every time)."""
    rec = getattr(_launch._local, "recording", None)
    if rec is not None:
        rec.ok = False


def clear_programs() -> None:
    """Forget every recorded program: the next call of each key runs its Python and records again."""
    _programs.clear()


def program_count() -> tuple[int, int]:
    """``(replayable, unreplayable)`` keys recorded so far (for tests and benchmarks)."""
    bad = sum(p is _UNREPLAYABLE for p in _programs.values())
    return len(_programs) - bad, bad


_PLAIN = (bool, int, float, str, type(None))


def run(key: tuple, fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(*args)``, replayed from its recording where ``key`` (with the layouts of ``args``' tensors)
    has a replayable one (module note). ``fn`` returns a tensor or a tuple of tensors, none of them an
    input or a view of one. A call made while another is recorded runs ``fn``: it is part of that recording."""
    if getattr(_launch._local, "recording", None) is not None:
        return fn(*args)
    full: list = [key, fn]
    inputs: list[Tensor] = []
    cuda = False
    for a in args:
        if isinstance(a, Tensor):
            inputs.append(a)
            cuda = cuda or a.is_cuda
            full.append((a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() % 16))
        elif type(a) in _PLAIN:
            full.append((type(a), a))
        else:
            return fn(*args)
    if cuda:
        full.append(torch.cuda.current_device())  # the kept kernels' device
    full = tuple(full)
    program = _programs.get(full)
    if program is _UNREPLAYABLE:
        return fn(*args)
    if program is None:
        rec = _Recording()
        _launch._local.recording = rec
        try:
            with _Watch(rec):
                result = fn(*args)
        finally:
            _launch._local.recording = None
        try:
            program = _build(rec, inputs, result)
        except Exception:  # noqa: BLE001 - whatever cannot be recorded runs its Python
            program = None
        if len(_programs) >= _MAX_PROGRAMS:
            _programs.clear()
        _programs[full] = program or _UNREPLAYABLE
        return result
    return _replay(program, inputs)


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _build(rec: _Recording, inputs: list[Tensor], result: Any) -> _Program | None:
    """The program of a recorded call, or None where it cannot be replayed."""
    if not rec.ok or not inputs:
        return None
    outputs = result if isinstance(result, tuple) else (result,)
    if not all(isinstance(t, Tensor) for t in outputs):
        return None
    addresses = _launch.direct_launch_usable()
    by_storage: dict[int, tuple[int, int]] = {}  # storage address → (source, its first byte's address)
    for i, t in enumerate(inputs):
        if t.numel() == 0:
            continue
        s = _storage(t)
        if s in by_storage:  # two inputs in one storage: which one a pointer belongs to is ambiguous
            return None
        by_storage[s] = (i, t.data_ptr())
    allocs = []
    for t in rec.allocated:
        s = _storage(t)
        if t.numel() == 0 or s in by_storage:
            continue
        by_storage[s] = (len(inputs) + len(allocs), s)
        allocs.append([t.untyped_storage().nbytes(), None, None, t.device])

    def ref(t: Tensor) -> _Ref | None:
        if t.numel() == 0:
            return None
        found = by_storage.get(_storage(t))
        if found is None:  # neither an input nor allocated here: its contents are not reproduced
            raise LookupError
        source, base = found
        offset = t.data_ptr() - base
        if offset % t.element_size() or (source < len(inputs) and t.dtype != inputs[source].dtype):
            raise LookupError  # not expressible as a view of the buffer in the replay (never the case here)
        return _Ref(source, offset, t.dtype, tuple(t.shape), t.stride())

    try:
        out_refs = []
        for t in outputs:
            r = ref(t)
            if r is None:
                out_refs.append((_Ref(-1, 0, t.dtype, tuple(t.shape), t.stride()), False))  # empty: made afresh
                continue
            if r.source < len(inputs):
                return None  # an operator's results never alias its inputs
            a = allocs[r.source - len(inputs)]
            if r.offset == 0 and a[1] is None and t.is_contiguous() and t.numel() * t.element_size() == a[0]:
                a[1], a[2] = t.dtype, tuple(t.shape)  # allocated as this result itself
                out_refs.append((r, True))
            else:
                out_refs.append((r, False))
        actions: list[_Launch | _Fill | _Copy] = []
        for kind, *event in rec.events:
            if kind == "copy":
                target, source = (ref(t) for t in event)
                if target is None:  # nothing to copy
                    continue
                if source is None:
                    return None
                actions.append(_Copy(target, source))
                continue
            if kind == "fill":
                r = ref(event[0])
                if r is not None:
                    actions.append(_Fill(r, event[1]))
                continue
            kernel, compiled, grid, args, constants, options = event
            slots, plain = [], list(args)
            for pos, a in enumerate(args):
                if isinstance(a, Tensor):
                    r = ref(a)
                    if r is None:
                        return None
                    slots.append((pos, r))
                    plain[pos] = None
            tail, runner, grid = (), None, tuple(grid) + (1,) * (3 - len(grid))
            if addresses:
                names = kernel.arg_names[len(args):]
                if compiled is None or set(names) != set(constants) or len(names) != len(constants):
                    return None
                tail, runner = tuple(constants[n] for n in names), compiled[grid]
            actions.append(_Launch(kernel, grid, plain, tuple(slots), constants, options, tail, runner))
    except LookupError:
        return None
    touched = {r.source for a in actions for r in ((a.target,) if isinstance(a, (_Fill, _Copy)) else (r for _, r in a.slots))}
    if any(r.source >= 0 and r.source not in touched for r, _ in out_refs):
        return None  # a result nothing recorded wrote: a launch that did not go through _launch.launch
    return _Program(tuple(tuple(a) for a in allocs), tuple(actions), tuple(out_refs), isinstance(result, tuple),
                    addresses)


def _view(buffers: list[Tensor], r: _Ref) -> Tensor:
    """The tensor ``r`` describes, over the replay's ``buffers`` (an input in its own dtype, or an
    allocation, contiguous, whose bytes are seen in ``r``'s dtype)."""
    base = buffers[r.source]
    if r.offset == 0 and base.shape == r.size and base.stride() == r.stride:
        if base.dtype == r.dtype:
            return base
        if base.element_size() == r.dtype.itemsize:
            return base.view(r.dtype)  # the same bytes in another dtype of the same width
    if base.dtype != r.dtype:
        base = base.view(-1).view(torch.uint8).view(r.dtype)
    return base.as_strided(r.size, r.stride, base.storage_offset() + r.offset // r.dtype.itemsize)


def _replay(p: _Program, inputs: list[Tensor]) -> Any:
    buffers = list(inputs)
    for nbytes, dtype, size, device in p.allocs:
        buffers.append(torch.empty(size, dtype=dtype, device=device) if dtype is not None
                       else torch.empty(nbytes, dtype=torch.uint8, device=device))
    device = inputs[0].device
    if p.addresses:
        base = [b.data_ptr() for b in buffers]
    for action in p.actions:
        if isinstance(action, _Fill):
            _view(buffers, action.target).fill_(action.value)
            continue
        if isinstance(action, _Copy):
            _view(buffers, action.target).copy_(_view(buffers, action.source))
            continue
        args = list(action.args)
        if p.addresses:
            for pos, r in action.slots:
                args[pos] = base[r.source] + r.offset
            action.runner(*args, *action.tail)
        else:
            for pos, r in action.slots:
                args[pos] = _view(buffers, r)
            action.kernel[action.grid](*args, **action.constants, **action.options)
    outs = tuple(torch.empty(r.size, dtype=r.dtype, device=device) if r.source < 0 else buffers[r.source] if whole
                 else _view(buffers, r) for r, whole in p.outputs)
    return outs if p.tuple_result else outs[0]
