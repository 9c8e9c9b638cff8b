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
* ``DeviceStream``: K samples per launch: for each sample, the serve forward into a prediction row,
  then the method's device step on it, all K recorded in one CUDA graph, predictions read once per
  window. It runs eagerly on CPU tensors (the same steps, the engine's runner falls back to the
  kernels' references), which the tests use.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import Tensor

from ..engine.cuda_path import CudaRunner, capturing
from ..layers.base import host_checks

__all__ = ["CudaLive", "DeviceStream"]


class _GraphedUpdate:
    """The method's device step over static inputs: eager on the first call (kernels compile, state is
    created), then ``device_epoch_begin(runner, 1)`` (late state joins the layout), captured on the
    second call and replayed from then on."""

    def __init__(self, live: Any, runner: CudaRunner, x: Tensor, y: Tensor, graph: bool) -> None:
        self.live, self.runner = live, runner
        self.x, self.y = x.clone(), y.clone()
        self.use_graph, self.graph, self.calls = graph, None, 0

    def __call__(self, x: Tensor, y: Tensor) -> None:
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graph and self.calls >= 1:
            runner = self.runner
            with host_checks(False):
                runner.dead.fill_(1)  # masked warm-up: compiles what the graph uses, updates nothing
                self.live.method.device_step(self.x, self.y, 0, runner)
                torch.cuda.synchronize(self.live.device)
                self.graph = torch.cuda.CUDAGraph()
                with capturing(self.graph):
                    self._step()
            self.graph.replay()
        else:
            self._step()
            if self.calls == 0:
                self.live.engine.device_epoch_begin(self.runner, 1)
        self.calls += 1

    def _step(self) -> None:
        self.runner.dead.zero_()  # every update stands alone
        self.live.method.device_step(self.x, self.y, 0, self.runner)


class CudaLive:
    """Captured serve and update steps for a ``LiveTrainer`` on CUDA (see the module docstring)."""

    def __init__(self, live: Any) -> None:
        self.live = live
        self.dev = live.device
        cfg = live.config
        self.graphs = cfg.cuda_graph
        self.device_steps = live.method.device_ready()
        self.runner: CudaRunner | None = None  # made at the first update (its setup may re-home the weights)
        self.skipped = torch.zeros((), dtype=torch.int32, device=self.dev)  # updates the device guard refused
        self.overlap = cfg.overlap
        low, high = 0, -1  # CUDA stream priorities: a smaller number is more urgent (clamped to the device's range)
        self.serve_stream = torch.cuda.Stream(self.dev, priority=high) if self.overlap else torch.cuda.current_stream(self.dev)
        self.train_stream = torch.cuda.Stream(self.dev, priority=low) if self.overlap else torch.cuda.current_stream(self.dev)
        # overlap: two snapshots, the server reads `current` while the update stream fills the other
        self.snapshots = [live.serve_model, copy.deepcopy(live.serve_model)] if self.overlap else [live.serve_model]
        self.current = 0
        self.pending: tuple[torch.cuda.Event, int] | None = None  # (copy done, its version)
        self.served = [torch.cuda.Event() for _ in self.snapshots]  # last serve read of each snapshot
        self.serve_graphs: list[Any] = [None] * len(self.snapshots)
        self.serve_x: Tensor | None = None
        self.serve_out: list[Tensor | None] = [None] * len(self.snapshots)
        self.update: _GraphedUpdate | None = None

    # ------------------------------------------------------------------ serve
    def serves(self, x: Tensor) -> bool:
        return self.graphs and x.shape[0] == 1

    def serve(self, x: Tensor) -> Tensor:
        self._maybe_switch()
        k = self.current
        here = torch.cuda.current_stream(self.dev)
        if self.overlap:
            self.serve_stream.wait_stream(here)  # x was made on the caller's stream
        with torch.cuda.stream(self.serve_stream):
            if self.serve_x is None:
                self.serve_x = x.clone()
            self.serve_x.copy_(x, non_blocking=True)
            if self.serve_graphs[k] is None:
                model = self.snapshots[k]
                model(self.serve_x)  # warm-up: kernels compiled outside the capture
                torch.cuda.synchronize(self.dev)
                graph = torch.cuda.CUDAGraph()
                with host_checks(False), capturing(graph):
                    self.serve_out[k] = model(self.serve_x)
                self.serve_graphs[k] = graph
            self.serve_graphs[k].replay()
            out = self.serve_out[k].clone()  # the next replay overwrites the static output
            self.served[k].record(self.serve_stream)
        if self.overlap:
            here.wait_stream(self.serve_stream)  # the caller reads the prediction on its stream
            out.record_stream(here)
        return out

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
        if self.update is None:
            return True
        return x.shape == self.update.x.shape and y.shape == self.update.y.shape

    def train(self, x: Tensor, y: Tensor) -> None:
        stream = self.train_stream
        if self.overlap:
            stream.wait_stream(torch.cuda.current_stream(self.dev))  # x and y were made on the caller's stream
            x.record_stream(stream)  # their memory is not reused while the update stream reads them
            y.record_stream(stream)
        with torch.cuda.stream(stream):
            if self.update is None:
                self.runner = CudaRunner(self.live.engine)
                self.runner._prepare_arrays(1)
                self.update = _GraphedUpdate(self.live, self.runner, x, y, self.graphs)
            key = self._layout()
            self.update(x, y)
            self.skipped += (self.runner.step_status[0, 0] != 0).to(torch.int32)
        if self._layout() != key:  # the weights moved into the method's device layout: serve graphs read the old memory
            torch.cuda.synchronize(self.dev)
            self.serve_graphs = [None] * len(self.snapshots)

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
        with torch.no_grad(), torch.cuda.stream(stream):
            for dst, src in zip(self.snapshots[spare].parameters(), self.live.model.parameters()):
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.pending = (done, self.live.version)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.dev)
        self._maybe_switch()
        skipped = int(self.skipped)
        if skipped:
            self.live.statuses["NAN_GRAD"] += skipped
            self.live.statuses["OK"] -= skipped
            self.live.version -= skipped
            self.skipped.zero_()


class DeviceStream:
    """K samples per launch (see the module docstring): ``window(xs, ys)`` serves and trains on
    ``xs[K, ...]`` with targets ``ys[K, ...]`` (the method's form: one-hot for ``"mse"``) and returns
    the predictions ``[K, ...]`` (overwritten by the next window: read or clone them)."""

    def __init__(self, live: Any, xs: Tensor, ys: Tensor) -> None:
        if not live.method.device_ready():
            raise ValueError(f"DeviceStream: method {type(live.method).__name__} has no device step (device_ready() is False)")
        self.live = live
        self.k = xs.shape[0]
        self.runner = CudaRunner(live.engine)
        self.runner._prepare_arrays(self.k)
        self.xs, self.ys = xs.clone(), ys.clone()
        self.preds: Tensor | None = None
        self.graph: Any = None
        self.calls = 0
        self.use_graph = live.device.type == "cuda" and live.config.cuda_graph
        self.serve_s = 0.0  # thread CPU time of serving and of updating, in the eager windows
        self.train_s = 0.0
        self.window_ms: float | None = None  # GPU time of one captured window (CUDA events)
        self.serve_graph: Any = None  # the K serve forwards alone, for serve_fraction

    def window(self, xs: Tensor, ys: Tensor) -> Tensor:
        if xs.shape != self.xs.shape or ys.shape != self.ys.shape:
            raise ValueError(f"DeviceStream: a window must have the first window's shapes {list(self.xs.shape)} / "
                             f"{list(self.ys.shape)}, got {list(xs.shape)} / {list(ys.shape)}")
        self.xs.copy_(xs, non_blocking=True)
        self.ys.copy_(ys, non_blocking=True)
        if self.graph is not None:
            if self.window_ms is None:  # GPU time of one real window, once (for serve_fraction)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.graph.replay()
                end.record()
                end.synchronize()
                self.window_ms = start.elapsed_time(end)
            else:
                self.graph.replay()
        elif self.use_graph and self.calls >= 1:
            with host_checks(False):
                self._window(timed=False, dead=1)  # masked warm-up: compiles what the graph uses, updates nothing
                torch.cuda.synchronize(self.live.device)
                self.graph = torch.cuda.CUDAGraph()
                with capturing(self.graph):
                    self._window(timed=False)
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
        outs = []
        for i in range(self.k):
            c0 = time.thread_time() if timed else 0.0
            outs.append(live.serve_model(self.xs[i : i + 1]))
            c1 = time.thread_time() if timed else 0.0
            live.method.device_step(self.xs[i : i + 1], self.ys[i : i + 1], i, runner)
            if timed:
                c2 = time.thread_time()
                self.serve_s += c1 - c0
                self.train_s += c2 - c1
        preds = torch.cat(outs)
        if self.preds is None:  # made by the first (eager) window: the captured one copies into it
            self.preds = preds
        else:
            self.preds.copy_(preds)

    @torch.no_grad()
    def serve_fraction(self, repeats: int = 5) -> float | None:
        """The serving share of a window's work. Eager windows: serve over serve + update time on the
        thread's CPU clock. Captured windows: the GPU time of a graph of the K serve forwards alone
        (captured once, replayed ``repeats`` times, CUDA events) over one real window's GPU time;
        ``None`` until a captured window has been timed."""
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
        return self.runner.step_status[: self.k, 0]
