"""The live loop's device paths: captured serve and update steps, the overlapped server, and the
device-resident stream.

* ``CudaLive`` (CUDA only): the serve step (a forward of ``serve_model`` over a static input
  ``[1, ...]``) and the update (the method's ``device_step`` under the engine's ``CudaRunner``, its
  decisions on the device) are each captured in a CUDA graph on their first use after a warm-up, and
  replayed after copying the sample into their static inputs. With ``overlap=True`` the server
  replays on a high-priority stream from one of two weight snapshots while updates replay on a
  low-priority stream; ``publish`` copies the trained weights into the spare snapshot on the update
  stream, and the server switches to it once that copy has finished (an event), so it lags by at most
  one update. A method without a device step updates eagerly (``Method.step``).
* ``DeviceStream``: K samples per launch: for backprop's plain SGD on a Dense chain, one Triton
  kernel over the window (``kernels/live_window.py``); otherwise, for each sample, the method's device
  step, its pre-update forward written into a prediction row (a first eager window ran the serve
  forward and checked the step hands its output over), all K recorded in one CUDA graph;
  predictions read once per window. Host windows arrive by one copy from a staging buffer, and a
  window's predictions and statuses leave by copies into host buffers queued behind it (``load``,
  ``read_back``: two slots each), so the host need not wait for the window it just queued. It runs eagerly on CPU tensors (the same steps, the engine's
  runner falls back to the kernels' references), which the tests use.
* ``CudaOps`` / ``EagerOps``: the CUDA primitives the two use (streams, events, graph capture, pinned
  buffers), and a CPU stand-in whose "graphs" run their function again at each replay, so the tests
  run the per-sample and per-window logic on the CPU and count replays and host waits.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import torch
from torch import Tensor

from ..engine.cuda_path import CudaRunner, capturing
from ..engine.method import as_flat, flatten_tensors_
from ..layers.base import host_checks

__all__ = ["CudaLive", "CudaOps", "EagerOps", "DeviceStream"]


class CudaOps:
    """The CUDA primitives ``CudaLive`` uses: streams, events, graph capture, host buffers."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev

    def stream(self, priority: int) -> Any:
        return torch.cuda.Stream(self.dev, priority=priority)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.dev)

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.dev)

    def host_buffer(self, like: Tensor) -> Tensor:
        """A pinned host tensor of ``like``'s shape and dtype (the prediction's read-back)."""
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def capture(self, fn: Any, warm: Any) -> "_CudaGraph":
        return _CudaGraph(self.dev, fn, warm)


class _CudaGraph:
    """``fn`` captured in a CUDA graph after ``warm()`` ran eagerly (kernels compile outside the
    capture); ``result`` is what ``fn`` returned (static tensors every ``replay()`` rewrites)."""

    def __init__(self, dev: torch.device, fn: Any, warm: Any) -> None:
        with host_checks(False):
            warm()
            torch.cuda.synchronize(dev)
            self.graph = torch.cuda.CUDAGraph()
            with capturing(self.graph):
                self.result = fn()
        self.replay = self.graph.replay


class EagerOps:
    """``CudaOps``'s protocol on the CPU, for tests and the profile script's self-check: streams and
    events do nothing, a "graph" runs its function again at every replay (and counts the replays)."""

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

        def wait_event(self, event: Any) -> None:
            pass

    class Event:
        def record(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class Graph:
        def __init__(self, fn: Any, warm: Any) -> None:
            warm()
            self.fn, self.replays = fn, 0
            self.result: Any = None  # as after a capture: nothing ran yet

        def replay(self) -> None:
            self.replays += 1
            self.result = self.fn()

    def __init__(self) -> None:
        self.graphs: list[EagerOps.Graph] = []
        self.host_syncs = 0  # event synchronisations (host waits)

    def stream(self, priority: int) -> Any:
        return EagerOps.Stream()

    def current(self) -> Any:
        return EagerOps.Stream()

    def on(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def event(self) -> Any:
        ops = self

        class Counted(EagerOps.Event):
            def synchronize(self) -> None:
                ops.host_syncs += 1

        return Counted()

    def synchronize(self) -> None:
        self.host_syncs += 1

    def host_buffer(self, like: Tensor) -> Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def capture(self, fn: Any, warm: Any) -> "EagerOps.Graph":
        graph = EagerOps.Graph(fn, warm)
        self.graphs.append(graph)
        return graph


class _GraphedUpdate:
    """The method's device step over static inputs: eager on the first call (kernels compile, state is
    created), then ``device_epoch_begin(runner, 1)`` (late state joins the layout), captured on the
    second call (after a masked warm-up) and replayed from then on. A sample and its target of one
    dtype sit in one device buffer, filled from the host by one copy (``load``)."""

    def __init__(self, cuda: "CudaLive", x: Tensor, y: Tensor) -> None:
        self.cuda, self.live, self.runner = cuda, cuda.live, cuda.runner
        dev = cuda.dev
        self.stage: Tensor | None = None
        if x.dtype == y.dtype:  # [x | y] back to back: one host-to-device copy per update
            self.xy = torch.empty(x.numel() + y.numel(), dtype=x.dtype, device=dev)
            self.x, self.y = self.xy[: x.numel()].view(x.shape), self.xy[x.numel() :].view(y.shape)
            self.stage = torch.empty(self.xy.shape, dtype=x.dtype)  # pageable: reusable once copy_ returns
        else:
            self.x = torch.empty(x.shape, dtype=x.dtype, device=dev)
            self.y = torch.empty(y.shape, dtype=y.dtype, device=dev)
        self.use_graph, self.graph, self.calls = cuda.graphs, None, 0

    def load(self, x: Tensor, y: Tensor) -> None:
        stage = self.stage
        if stage is not None and x.device.type == "cpu" and y.device.type == "cpu":
            torch.cat((x.reshape(-1), y.reshape(-1)), out=stage)
            self.xy.copy_(stage, non_blocking=True)
        else:
            self.x.copy_(x, non_blocking=True)
            self.y.copy_(y, non_blocking=True)

    def __call__(self, x: Tensor, y: Tensor) -> None:
        self.load(x, y)
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graph and self.calls >= 1:
            self.graph = self.cuda.ops.capture(self._step, warm=self._masked)
            self.graph.replay()
        else:
            self._step()
            if self.calls == 0:
                self.live.engine.device_epoch_begin(self.runner, 1)
        self.calls += 1

    def _masked(self) -> None:
        """A step with every update masked (the runner's ``dead`` flag): compiles what the graph uses,
        changes nothing."""
        self.runner.dead.fill_(1)
        self.live.method.device_step(self.x, self.y, 0, self.runner)

    def _step(self) -> None:
        runner = self.runner
        runner.dead.zero_()  # every update stands alone
        self.live.method.device_step(self.x, self.y, 0, runner)
        # updates the device guard refused, counted on the device (read at report time)
        self.cuda.skipped.add_((runner.step_status[0, 0] != 0).to(torch.int32))


class CudaLive:
    """Captured serve and update steps for a ``LiveTrainer`` on CUDA (see the module docstring).

    Per sample (graphs, one sample per serve and per update): the serve is one copy of the input
    into the static input, one serve-graph replay, one device-to-host copy of the prediction into a
    pinned buffer and one wait on an event of the serve stream (the prediction handed back is a host
    tensor); the update is one copy of the sample and its target (``[x | y]``, staged on the host)
    and one update-graph replay (its status counted inside the graph). ``ops``: the primitives
    (``CudaOps``; ``EagerOps`` runs the same logic on the CPU for the tests)."""

    def __init__(self, live: Any, ops: Any = None) -> None:
        self.live = live
        self.dev = live.device
        self.ops = ops if ops is not None else CudaOps(self.dev)
        cfg = live.config
        self.graphs = cfg.cuda_graph
        self.device_steps = live.method.device_ready()
        self.runner: CudaRunner | None = None  # made at the first update (its setup may re-home the weights)
        self.skipped = torch.zeros((), dtype=torch.int32, device=self.dev)  # updates the device guard refused
        self.overlap = cfg.overlap
        ops = self.ops
        low, high = 0, -1  # CUDA stream priorities: a smaller number is more urgent (clamped to the device's range)
        self.serve_stream = ops.stream(high) if self.overlap else ops.current()
        self.train_stream = ops.stream(low) if self.overlap else ops.current()
        # overlap: two snapshots, the server reads `current` while the update stream fills the other;
        # each snapshot's weights are one buffer, so a publish is one copy
        self.snapshots = [live.serve_model, copy.deepcopy(live.serve_model)] if self.overlap else [live.serve_model]
        if self.overlap:
            for m in self.snapshots:
                flatten_tensors_(list(m.parameters()))
        self.current = 0
        self.pending: tuple[Any, int] | None = None  # (copy done, its version)
        self.copied = ops.event()  # the publish copy in flight (at most one)
        self.served = [ops.event() for _ in self.snapshots]  # last serve of each snapshot (its read-back)
        self.serve_graphs: list[Any] = [None] * len(self.snapshots)
        self.serve_x: Tensor | None = None
        self.host_out: Tensor | None = None
        self.update: _GraphedUpdate | None = None
        self._pairs: list[tuple[list[Tensor], list[Tensor]] | None] = [None] * len(self.snapshots)

    # ------------------------------------------------------------------ serve
    def serves(self, x: Tensor) -> bool:
        return self.graphs and x.shape[0] == 1 and (self.serve_x is None or x.shape == self.serve_x.shape)

    def serve(self, x: Tensor) -> Tensor:
        """The prediction for one sample ``x`` (host or device), read back: a host tensor."""
        if self.pending is not None:
            self._maybe_switch()
        k = self.current
        if self.overlap:
            if x.device.type != "cpu":  # x was made on the caller's stream
                self.serve_stream.wait_stream(self.ops.current())
            with self.ops.on(self.serve_stream):
                self._serve(k, x)
        else:
            self._serve(k, x)
        self.served[k].synchronize()  # the read-back of this serve only: never the update stream
        return self.host_out.clone()  # the next serve overwrites the pinned buffer

    def _serve(self, k: int, x: Tensor) -> None:
        graph = self.serve_graphs[k]
        if self.serve_x is None:
            self.serve_x = torch.empty(x.shape, dtype=x.dtype, device=self.dev)
        self.serve_x.copy_(x, non_blocking=True)
        if graph is None:
            model, static = self.snapshots[k], self.serve_x
            graph = self.serve_graphs[k] = self.ops.capture(lambda: model(static), warm=lambda: model(static))
        graph.replay()
        if self.host_out is None:
            self.host_out = self.ops.host_buffer(graph.result)
        self.host_out.copy_(graph.result, non_blocking=True)
        self.served[k].record(self.serve_stream)

    def _maybe_switch(self, wait: bool = False) -> None:
        if self.pending is None:
            return
        done, version = self.pending
        if wait:
            done.synchronize()
        if done.query():
            self.current = 1 - self.current
            self.live.serve_version = version
            self.pending = None

    # ------------------------------------------------------------------ update
    def trains(self, x: Tensor, y: Tensor) -> bool:
        if not self.device_steps:
            return False
        u = self.update
        return u is None or (x.shape == u.x.shape and y.shape == u.y.shape and y.dtype == u.y.dtype)

    def train(self, x: Tensor, y: Tensor) -> None:
        """One update on ``x``, ``y`` (host or device tensors) on the update stream; no host wait."""
        u = self.update
        if u is None or u.graph is None:
            self._first_trains(x, y)
        elif self.overlap:
            stream = self.train_stream
            if x.device.type != "cpu" or y.device.type != "cpu":
                self._wait_for_inputs(stream, x, y)
            with self.ops.on(stream):
                u.load(x, y)
                u.graph.replay()
        else:
            u.load(x, y)
            u.graph.replay()

    def _wait_for_inputs(self, stream: Any, x: Tensor, y: Tensor) -> None:
        """Device inputs were made on the caller's stream: the update stream waits for them, and their
        memory is not reused while it reads them."""
        stream.wait_stream(self.ops.current())
        for t in (x, y):
            if t.device.type != "cpu" and hasattr(t, "record_stream") and isinstance(stream, torch.cuda.Stream):
                t.record_stream(stream)

    def _first_trains(self, x: Tensor, y: Tensor) -> None:
        """The updates until the graph is captured: the runner is made, the weights may move into the
        method's device layout (the serve graphs are then captured again)."""
        stream = self.train_stream
        if self.overlap:
            self._wait_for_inputs(stream, x, y)
        with self.ops.on(stream) if self.overlap else contextlib.nullcontext():
            if self.update is None:
                self.runner = CudaRunner(self.live.engine)
                self.runner._prepare_arrays(1)
                self.update = _GraphedUpdate(self, x, y)
            key = self._layout()
            self.update(x, y)
        if self._layout() != key:  # the weights moved: serve graphs read the old memory
            self.ops.synchronize()
            self.serve_graphs = [None] * len(self.snapshots)
        self._pairs = [None] * len(self.snapshots)

    def _layout(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for m in self.snapshots for p in m.parameters())

    def publish(self) -> None:
        """Copy the trained weights into the spare snapshot on the update stream (after the updates
        queued there); the server switches to it when the copy is done."""
        if not self.overlap:
            self.live.serve_version = self.live.version
            return
        self._maybe_switch(wait=True)  # at most one copy in flight: the lag stays at one version
        spare = 1 - self.current
        stream = self.train_stream
        stream.wait_event(self.served[spare])  # the server no longer reads it
        pairs = self._pairs[spare]
        if pairs is None:
            pairs = self._copy_pairs(spare)
            if self.update is not None and self.update.graph is not None:  # the layout is final
                self._pairs[spare] = pairs
        with torch.no_grad(), self.ops.on(stream):
            dst, src = pairs
            if len(dst) == 1:
                dst[0].copy_(src[0], non_blocking=True)
            else:
                torch._foreach_copy_(dst, src)
            self.copied.record(stream)
        self.pending = (self.copied, self.live.version)

    def _copy_pairs(self, k: int) -> tuple[list[Tensor], list[Tensor]]:
        """(snapshot ``k``'s tensors, the trained model's): one flat buffer each when both are."""
        dst_p, src_p = list(self.snapshots[k].parameters()), list(self.live.model.parameters())
        dst_b, src_b = list(self.snapshots[k].buffers()), list(self.live.model.buffers())
        dst, src = as_flat(dst_p), as_flat(src_p)
        if len(dst) != len(src) or any(d.shape != s.shape for d, s in zip(dst, src)):
            dst, src = dst_p, src_p
        return [*dst, *dst_b], [*src, *src_b]

    def synchronize(self) -> None:
        self.ops.synchronize()
        self._maybe_switch()
        skipped = int(self.skipped)
        if skipped:
            self.live.statuses["NAN_GRAD"] += skipped
            self.live.statuses["OK"] -= skipped
            self.live.version -= skipped
            self.skipped.zero_()


class _Predictions:
    """Stands in for the engine's training metrics during a window: ``update(output, target)`` (the
    method's ``observe_outputs``: its step's pre-update output) writes the output into row ``row`` of
    ``preds`` (when given) and counts the calls."""

    def __init__(self, preds: Tensor | None) -> None:
        self.preds, self.row, self.calls = preds, 0, 0

    def update(self, output: Tensor, target: Tensor) -> None:
        self.calls += 1
        if self.preds is not None:
            self.preds[self.row : self.row + 1].copy_(output.reshape(1, *self.preds.shape[1:]))


class _FusedWindow:
    """The whole window as one kernel (``kernels/live_window.py``) where backprop's plain SGD step of a
    Dense chain applies (``LeanDense``'s rule, on any device) and Triton runs (CUDA; the interpreter
    when the engine's ``kernel_backend`` is ``"triton"``, as in the tests), every layer at most
    ``MAX_WIDTH`` wide."""

    def __init__(self, lean: Any, xs: Tensor, out_width: int) -> None:
        from ..kernels.live_window import ACT_CODES, kernel_settings

        self.lean = lean
        flat = lean.flat
        size = flat.element_size()
        self.meta = []
        for layer, w, b in zip(lean.layers, lean.weights, lean.biases):
            wo = (w.data_ptr() - flat.data_ptr()) // size
            bo = (b.data_ptr() - flat.data_ptr()) // size if b is not None else -1
            self.meta.append((layer.in_features, layer.out_features, wo, bo, ACT_CODES[layer.activation.name]))
        # the weights in registers through the window where they fit, else read and written in memory
        # every sample (that kernel's scratch and device copy of the layout made once here)
        self.kernel = kernel_settings(self.meta)[0]
        self.scratch = self.meta_dev = None
        if self.kernel == "global":
            block = max(16, 1 << (max(max(r[0], r[1]) for r in self.meta) - 1).bit_length())
            self.scratch = torch.zeros(2 * flat.numel() + (len(self.meta) + 1) * block, dtype=flat.dtype, device=flat.device)
            self.meta_dev = torch.tensor([v for r in self.meta for v in r], dtype=torch.int32, device=flat.device)
        k = xs.shape[0]
        self.preds = torch.zeros(k, out_width, dtype=flat.dtype, device=flat.device)
        self.spare = torch.zeros_like(self.preds)  # the forwards-only launches (serve_fraction) write here
        self.status = torch.zeros(k, dtype=torch.int32, device=flat.device)
        self.num_warps: int | None = None  # None: the kernel's own choice (profile_live.py sweeps it)

    @classmethod
    def build(cls, live: Any, xs: Tensor, ys: Tensor) -> "_FusedWindow | None":
        from ..kernels._triton import triton_available, use_triton
        from .lean import LeanDense

        backend = live.engine.kernel_backend
        if not triton_available() or backend == "reference" or ys.dtype != xs.dtype or ys.dim() != 2:
            return None
        try:
            if not use_triton(xs, backend, (torch.float32,)):
                return None
        except (RuntimeError, ValueError):
            return None
        lean = LeanDense.build(live, any_device=True)
        if lean is None or not lean.ready() or xs.dim() != 2:
            return None
        from ..kernels.live_window import MAX_WIDTH

        if any(max(layer.in_features, layer.out_features) > MAX_WIDTH for layer in lean.layers):
            return None
        return cls(lean, xs, ys.shape[1])

    def run(self, xs: Tensor, ys: Tensor, train: bool = True, flat: Tensor | None = None) -> None:
        """One window (``train=False``: the forwards alone, into ``spare``); ``flat``: other weights
        than the model's (the warm-up)."""
        from ..kernels.live_window import live_window_

        lr = self.lean.optimizer.param_groups[0]["lr"]
        status = self.status if flat is None else torch.zeros_like(self.status)
        live_window_(xs, ys, self.lean.flat if flat is None else flat, self.meta, lr, self.preds if train else self.spare,
                     status, train=train, kernel=self.kernel, scratch=self.scratch, meta_dev=self.meta_dev,
                     num_warps=self.num_warps)

    def warm(self, xs: Tensor, ys: Tensor) -> None:
        """Compile both variants of the kernel (a window on a copy of the weights, and the forwards
        alone): set-up, before the stream's clock starts, like a graph's capture."""
        self.run(xs, ys, flat=self.lean.flat.clone())
        self.run(xs, ys, train=False)


class DeviceStream:
    """K samples per launch (see the module docstring): ``window(xs, ys)`` serves and trains on
    ``xs[K, ...]`` with targets ``ys[K, ...]`` (the method's form: one-hot for ``"mse"``) and returns
    the predictions ``[K, ...]`` (overwritten by the next window: read or clone them)."""

    def __init__(self, live: Any, xs: Tensor, ys: Tensor, ops: Any = None) -> None:
        if not live.method.device_ready():
            raise ValueError(f"DeviceStream: method {type(live.method).__name__} has no device step (device_ready() is False)")
        self.live = live
        self.k = xs.shape[0]
        dev = live.device
        # a window's inputs and targets of one dtype sit in one device buffer: host windows arrive by
        # one copy from a staging buffer (pinned on CUDA), the host never waiting (``load``)
        self.xy: Tensor | None = None
        if xs.dtype == ys.dtype:
            self.xy = torch.empty(xs.numel() + ys.numel(), dtype=xs.dtype, device=dev)
            self.xs, self.ys = self.xy[: xs.numel()].view(xs.shape), self.xy[xs.numel() :].view(ys.shape)
            self.xs.copy_(xs)
            self.ys.copy_(ys)
        else:
            self.xs = torch.empty(xs.shape, dtype=xs.dtype, device=dev).copy_(xs)
            self.ys = torch.empty(ys.shape, dtype=ys.dtype, device=dev).copy_(ys)
        self._stages: list[tuple[Tensor, Any]] = []  # (staging buffer, its copy's event) per slot
        self._host: list[tuple[Tensor, Tensor, Any]] = []  # (predictions, statuses, ready event) per slot
        # backprop's plain SGD on a Dense chain: the window is one kernel; else the method's device steps
        self.fused = _FusedWindow.build(live, self.xs, self.ys)
        self.runner: CudaRunner | None = None
        if self.fused is None:
            self._make_runner()
        else:
            self.fused.warm(self.xs, self.ys)
        self.preds: Tensor | None = None
        self.graph: Any = None
        self.calls = 0
        # the primitives (CudaOps on CUDA; the tests pass EagerOps to run the captured path on the CPU)
        self.ops = ops if ops is not None else (CudaOps(live.device) if live.device.type == "cuda" else None)
        self.use_graph = self.ops is not None and live.config.cuda_graph
        self.serve_s = 0.0  # thread CPU time of serving and of updating, in the eager windows
        self.train_s = 0.0
        self.window_ms: float | None = None  # GPU time of one captured window (CUDA events)
        self.serve_graph: Any = None  # the K serve forwards alone, for serve_fraction
        # a captured window takes each prediction from the method's own forward of the sample (its
        # pre-update output, at the weights the sample is served from) instead of a second forward
        self.reuse_forward = False

    def _make_runner(self) -> None:
        self.runner = CudaRunner(self.live.engine)
        self.runner._prepare_arrays(self.k)

    def load(self, xs: Tensor, ys: Tensor) -> None:
        """The window's inputs and targets into the static buffers: host tensors (with ``ops``) through
        a staging buffer by one copy, without a host wait (two slots alternate; a slot is refilled once
        its last copy has run, which the window after it has already waited for); otherwise device
        copies."""
        if xs.shape != self.xs.shape or ys.shape != self.ys.shape:
            raise ValueError(f"DeviceStream: a window must have the first window's shapes {list(self.xs.shape)} / "
                             f"{list(self.ys.shape)}, got {list(xs.shape)} / {list(ys.shape)}")
        host = xs.device.type == "cpu" and ys.device.type == "cpu" and ys.dtype == xs.dtype
        if self.xy is None or self.ops is None or not host:
            self.xs.copy_(xs, non_blocking=True)
            self.ys.copy_(ys, non_blocking=True)
            return
        slot = self.calls % 2
        if len(self._stages) <= slot:
            self._stages.append((self.ops.host_buffer(self.xy), self.ops.event()))
        stage, copied = self._stages[slot]
        copied.synchronize()
        torch.cat((xs.reshape(-1), ys.reshape(-1)), out=stage)
        self.xy.copy_(stage, non_blocking=True)
        copied.record()

    def read_back(self) -> tuple[Tensor, Tensor, Any]:
        """``(predictions [K, ...], statuses [K], ready)`` of the window just queued: with ``ops``, copies
        into host buffers (pinned on CUDA) queued behind it and an event recorded after them (two slots
        alternate: a window's copies stay until the one after next is read back); without, the
        window's own tensors (already computed) and None."""
        if self.ops is None:
            return self.preds, self.statuses(), None
        slot = (self.calls - 1) % 2
        if len(self._host) <= slot:
            self._host.append((self.ops.host_buffer(self.preds), self.ops.host_buffer(self.statuses()), self.ops.event()))
        preds, status, ready = self._host[slot]
        preds.copy_(self.preds, non_blocking=True)
        status.copy_(self.statuses(), non_blocking=True)
        ready.record()
        return preds, status, ready

    def window(self, xs: Tensor, ys: Tensor) -> Tensor:
        self.load(xs, ys)
        fused = self.fused
        if fused is not None and not fused.lean.ready():  # the optimizer's settings changed: the method's steps
            self.fused = fused = None
            self._make_runner()
        if fused is not None:
            if self.window_ms is None and isinstance(self.ops, CudaOps):  # GPU time of one real window, once
                self.window_ms = self._timed(lambda: fused.run(self.xs, self.ys))
            else:
                fused.run(self.xs, self.ys)
            self.preds = fused.preds
            self.calls += 1
            return self.preds
        if self.graph is not None:
            if self.window_ms is None and isinstance(self.ops, CudaOps):  # GPU time of one real window, once
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.graph.replay()
                end.record()
                end.synchronize()
                self.window_ms = start.elapsed_time(end)
            else:
                self.graph.replay()
        elif self.use_graph and self.calls >= 1:
            # a masked warm-up compiles what the graph uses and updates nothing
            self.graph = self.ops.capture(lambda: self._window(timed=False), warm=lambda: self._window(timed=False, dead=1))
            self.graph.replay()
        else:
            self._window(timed=True)
            if self.calls == 0:
                self.live.engine.device_epoch_begin(self.runner, 1)
        self.calls += 1
        return self.preds

    @torch.no_grad()
    def _window(self, timed: bool, dead: int = 0) -> None:
        live, runner = self.live, self.runner
        runner.dead.fill_(dead)  # 1: every update masked (a warm-up)
        reuse = self.reuse_forward and not timed
        sink = _Predictions(self.preds if reuse else None)
        engine, kept = live.engine, live.engine.__dict__.get("metric_set")
        engine.metric_set = sink  # the device step hands its forward's output to the training metrics
        outs = []
        try:
            for i in range(self.k):
                sink.row = i
                c0 = time.thread_time() if timed else 0.0
                if not reuse:
                    outs.append(live.serve_model(self.xs[i : i + 1]))
                c1 = time.thread_time() if timed else 0.0
                live.method.device_step(self.xs[i : i + 1], self.ys[i : i + 1], i, runner)
                if timed:
                    c2 = time.thread_time()
                    self.serve_s += c1 - c0
                    self.train_s += c2 - c1
        finally:
            engine.metric_set = kept
        if self.calls == 0:  # the step's forward serves (in a captured window) when every step hands it over once
            self.reuse_forward = self.use_graph and sink.calls == self.k and live.serve_model is live.model
        if reuse:
            return
        preds = torch.cat(outs)
        if self.preds is None:  # made by the first (eager) window: the captured one copies into it
            self.preds = preds
        else:
            self.preds.copy_(preds)

    @staticmethod
    def _timed(fn: Any, repeats: int = 1) -> float:
        """GPU milliseconds of ``fn()`` (mean of ``repeats``), by CUDA events."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    @torch.no_grad()
    def serve_fraction(self, repeats: int = 5) -> float | None:
        """The serving share of a window's work. Eager windows: serve over serve + update time on the
        thread's CPU clock. Captured windows: the GPU time of a graph of the K serve forwards alone
        (captured once, replayed ``repeats`` times, CUDA events) over one real window's GPU time;
        ``None`` until a captured window has been timed."""
        if self.fused is not None and self.live.device.type == "cuda":  # the kernel's forwards alone
            if self.window_ms is None:
                return None
            self.fused.run(self.xs, self.ys, train=False)  # compiled outside the timing
            ms = self._timed(lambda: self.fused.run(self.xs, self.ys, train=False), repeats)
            return min(1.0, ms / self.window_ms) if self.window_ms > 0 else None
        if self.live.device.type != "cuda" or self.graph is None:
            total = self.serve_s + self.train_s
            return self.serve_s / total if total > 0 else 0.0
        if self.window_ms is None:
            return None
        if self.serve_graph is None:
            with host_checks(False):
                for i in range(self.k):  # warm-up outside the capture
                    self.live.serve_model(self.xs[i : i + 1])
                torch.cuda.synchronize(self.live.device)
                self.serve_graph = torch.cuda.CUDAGraph()
                with capturing(self.serve_graph):
                    for i in range(self.k):
                        self.live.serve_model(self.xs[i : i + 1])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            self.serve_graph.replay()
        end.record()
        end.synchronize()
        return min(1.0, start.elapsed_time(end) / repeats / self.window_ms) if self.window_ms > 0 else None

    def statuses(self) -> Tensor:
        """The last window's per-sample step statuses ``[K]`` (0 = applied; a device read)."""
        if self.fused is not None:
            return self.fused.status
        return self.runner.step_status[: self.k, 0]
