"""``LiveTrainer``: serve a prediction for every sample of a stream, train on its label when it comes.

    live = LiveTrainer(net, method="backprop", learning_rate=0.05, loss_type="mse")
    for x, label in stream:
        pred, ticket = live.serve(x)       # the prediction, and a ticket for the sample
        ...                                # use pred; the label may come later
        live.learn(ticket, label)          # test-then-train: scored, then trained per the schedule
    report = live.report()                 # Welvet's Lucy metrics and more (report.py)

The update is the method's own step, the one ``train()`` runs (``Method.step``, with the engine's
weight guard around it): every method of the engine's registry works, by name, config or object.
A sample trained alone at the weights it was served from reuses the serve forward
(``Method.step_from_forward``: backprop and its subclasses skip their forward; other methods run
their own).

Schedules (``LiveConfig.schedule``):

* ``"sample"``: one update per labelled sample, as soon as its label comes;
* ``"batch"``: one update per ``batch_size`` labelled samples (a mini-batch of k);
* ``"periodic"``: Loom's periodic batch: labelled samples wait in a buffer; when ``period_s``
  (50 ms) has passed since the last update, the newest ``period_samples`` (20) of them make one
  update and older ones are dropped (they count as untrained in the report).

Weight versions: every applied update adds one to ``version``. A serve records how many versions its
weights lag (staleness). With ``overlap=True`` serving reads a snapshot of the weights (``serve_model``)
that lags the trained weights by at most ``max_staleness`` (0 or 1) versions: with 1, the snapshot
is taken just before each update (what a server overlapped with a running update sees); with 0, just
after (then every prediction equals serial mode's). On CUDA the overlapped update runs on its own
stream while serving uses a high-priority one (``device.py``); elsewhere the update runs in line,
which gives the same predictions and versions.

On the CPU, backprop's one-sample SGD on a Dense chain runs as ``lean.LeanDense`` (the same update in
about a third of the torch calls) where it applies (``LiveConfig.lean``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from typing import Any

from .._settings import settings

import torch
from torch import Tensor

from ..engine.config import TrainingConfig, as_network
from ..engine.guards import UpdateGuard
from ..engine.loop import Trainer
from ..engine.method import Method, as_flat, flatten_tensors_
from ..engine.types import StepOutput, StepStatus
from ..observers.base import ObserverList
from .lean import LeanDense
from .report import LiveRecord, LiveReport

__all__ = ["LiveConfig", "LiveTrainer", "Ticket", "SCHEDULES"]

SCHEDULES = ("sample", "batch", "periodic")
_LIVE_RATE = 0.05  # LiveConfig.learning_rate=None with a method by name: Welvet adaptv2's SGD rate
_wall, _cpu = time.perf_counter, time.thread_time


@settings({"lr": "learning_rate"})
@dataclass
class LiveConfig:
    """Settings of a live run (``LiveTrainer``); the method's own settings go in ``method``."""

    method: Any = "backprop"
    """A registered name, a method's config, or a Method object."""
    learning_rate: float | None = None
    """A number > 0: the rate, as ``TrainingConfig.learning_rate``. ``None`` (default): 0.05 (Welvet
    adaptv2's SGD rate) for a method given by name, class or ``Method`` object with an optimizer
    given by name; a method config instance (``TargetPropConfig`` / ``TweenConfig``) and an
    optimizer instance or factory keep their own rate."""
    loss_type: str = "mse"
    """Adaptv2: MSE on one-hot targets (integer labels are one-hot encoded)."""
    optimizer: Any = "sgd"
    """Backprop's optimizer (other methods keep their own rule)."""
    gradient_clip: float = 0.0
    """TrainingConfig.gradient_clip: 0 = none."""
    schedule: str = "sample"
    """One of: "sample" | "batch" | "periodic" (module docstring)."""
    batch_size: int = 8
    """With schedule "batch": labelled samples per update."""
    period_s: float = 0.05
    """With schedule "periodic": seconds between updates (Loom: 50 ms)."""
    period_samples: int = 20
    """With schedule "periodic": the newest samples one update takes (Loom: 20)."""
    overlap: bool = False
    """Serve from a weight snapshot while updates run (on CUDA, on another stream)."""
    max_staleness: int = 1
    """Overlap: weight versions the snapshot may lag (0 or 1)."""
    cuda_graph: bool = True
    """CUDA: serve and update steps captured in CUDA graphs."""
    lean: bool = True
    """CPU: backprop's SGD step of a Dense chain runs as ``lean.LeanDense`` (the same update in fewer
    torch calls) where it applies; False: always the method's step."""
    device: Any = None
    """None: the model's device."""
    observers: Sequence[Any] = ()
    """On_train_begin / on_epoch_end every log_every samples / on_train_end."""
    log_every: int = 1000
    """Samples between observer calls (on_epoch_end with the report's logs)."""
    window: int = 50
    """Samples per window of the per-shock minimum accuracy."""

    def validate(self) -> None:
        """Raise ``ValueError`` / ``TypeError`` naming the field, the value and what is allowed."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"LiveConfig: schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {self.schedule!r}")
        for name in ("batch_size", "period_samples", "log_every", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LiveConfig: {name} must be an int >= 1, got {v!r}")
        if not isinstance(self.period_s, (int, float)) or isinstance(self.period_s, bool) or not self.period_s >= 0:
            raise ValueError(f"LiveConfig: period_s must be a number >= 0 (seconds), got {self.period_s!r}")
        if self.max_staleness not in (0, 1) or isinstance(self.max_staleness, bool):
            raise ValueError(f"LiveConfig: max_staleness must be 0 or 1 (weight versions), got {self.max_staleness!r}")
        for name in ("overlap", "cuda_graph", "lean"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LiveConfig: {name} must be True or False, got {getattr(self, name)!r}")
        lr = self.learning_rate
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not lr > 0):
            raise ValueError(
                "LiveConfig: learning_rate must be a finite number > 0 or None (0.05, or a method config's or "
                f"optimizer's own rate), got {lr!r}"
            )


class Ticket:
    """What ``serve`` hands back with a prediction, for ``learn``: the input, the rows of the report
    it fills, the weight version it was served from, and (when the update may reuse it) the serve
    forward's output and saved activations."""

    __slots__ = ("x", "rows", "version", "out", "saved", "learned")

    def __init__(self, x: Tensor, rows: range, version: int, out: Tensor, saved: Any) -> None:
        self.x, self.rows, self.version, self.out, self.saved = x, rows, version, out, saved
        self.learned = False

    def __repr__(self) -> str:
        return f"Ticket(rows={self.rows.start}..{self.rows.stop - 1}, version={self.version}, learned={self.learned})"


class LiveTrainer:
    """Serve and train on a stream with any method of the engine (see the module docstring).

    Args:
        model: a ``Network`` (or a layer / list of layers), inputs ``[batch, ...]``, outputs
            ``[batch, classes]`` for class labels.
        config: a ``LiveConfig``; keyword ``fields`` replace its fields
            (``LiveTrainer(net, method="tween", schedule="batch", batch_size=4)``).
        clock: the wall clock (seconds) the periodic schedule and the report use; tests pass their own.
    """

    def __init__(self, model: Any, config: LiveConfig | None = None, *, clock: Callable[[], float] = time.perf_counter, **fields: Any) -> None:
        config = config if config is not None else LiveConfig()
        if not isinstance(config, LiveConfig):
            raise TypeError(f"LiveTrainer: config must be a LiveConfig, got {type(config).__name__}")
        if fields:
            names = {f.name for f in dataclasses.fields(LiveConfig)}
            unknown = sorted(set(fields) - names)
            if unknown:
                raise TypeError(f"LiveTrainer got unknown setting(s) {unknown}; LiveConfig fields: {sorted(names)}")
            config = dataclasses.replace(config, **fields)
        config.validate()
        self.config = config
        rate = config.learning_rate
        if rate is None and isinstance(config.method, (str, type, Method)) and isinstance(config.optimizer, str):
            rate = _LIVE_RATE  # a method config or an optimizer instance / factory keeps its own rate
        training = TrainingConfig(
            method=config.method, learning_rate=rate, loss_type=config.loss_type,
            optimizer=config.optimizer, gradient_clip=config.gradient_clip, device=config.device, verbose=0,
            cuda_graph=None if config.cuda_graph else False,
        )
        training.validate()
        net = as_network(model)
        # the trainable parameters as consecutive views of one buffer (same objects, same values),
        # before the method binds: the update guard then copies and checks one tensor per update
        flatten_tensors_([p for p in net.parameters() if p.requires_grad])
        self.engine = Trainer(net, training)  # binds the method, as train() does
        self.engine.setup()  # the method's setup, the model on the training device
        self.model = self.engine.model
        self.method: Method = self.engine.method
        self.device, self.dtype = self.engine.device, self.engine.dtype
        self._guard = UpdateGuard(self._guarded_tensors)
        self._guarded: tuple[tuple[int, int], list[Tensor]] | None = None
        self._labels = config.loss_type in ("cross_entropy", "crossentropy")
        self._reuses = type(self.method).step_from_forward is not Method.step_from_forward
        self.version = 0  # updates applied
        self.serve_model = copy.deepcopy(self.model) if config.overlap else self.model
        self.serve_version = 0  # the version serve_model holds
        self.phase = ""  # the stream's phase, recorded with every serve (set_phase)
        self.clock = clock
        self.record = LiveRecord()
        self.record.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.pending: list[tuple[Ticket, Tensor, int]] = []  # (ticket, target, row) awaiting an update
        self.statuses: dict[str, int] = {s.name: 0 for s in StepStatus}
        self.observers = ObserverList(config.observers)
        self._logs = self.observers.wants("on_epoch_end")
        self._last_update = None
        self._start: float | None = None
        self._cpu_start = 0.0
        self._logged = 0
        self._stream: Any = None  # the device-resident stream (stream_window)
        self._window: tuple | None = None  # its queued window, not yet read (stream_window)
        self._window_read = 0.0  # perf_counter when the last window was read
        self._frac: float | None = None
        self.cuda = None
        if self.device.type == "cuda":
            from .device import CudaLive

            self.cuda = CudaLive(self)
        # the lean host step (lean.py): None where it does not apply; its forward serves when the
        # server reads the trained weights (not overlap's snapshot)
        self._lean = LeanDense.build(self) if config.lean else None
        self._lean_serve = self._lean is not None and self.serve_model is self.model
        self._eye: Tensor | None = None  # one-hot rows for class labels (MSE)

    # ------------------------------------------------------------------ the stream
    def set_phase(self, phase: str) -> None:
        """Name the stream's phase from the next serve on (a change marks a shock in the report)."""
        self.phase = str(phase)

    @torch.no_grad()
    def serve(self, x: Any) -> tuple[Tensor, Ticket]:
        """The prediction for ``x`` (``[batch, ...]``, or one sample without the batch dimension) and
        a ticket for ``learn``. Returns the model's output ``[batch, ...]`` (from ``serve_model``); on
        CUDA with graphs, for one sample, read back to the host (a host tensor: ``device.CudaLive``)."""
        if self._start is None:
            self._begin()
        wall0, cpu0 = _wall(), _cpu()
        x = self._as_input(x, host=True)
        saved = None
        lean = self._lean_serve and self._lean.forward(x)
        if lean:
            out, saved = lean
        elif self.cuda is not None and self.cuda.serves(x):
            out = self.cuda.serve(x)  # read back to the host: a served prediction is one the host has
        else:
            x = x.to(self.device)
            if self._reuses and not (self.config.overlap and self.serve_version != self.version):
                out, saved = self.serve_model.forward_saved(x)
            else:
                out = self.serve_model(x)
        cpu, wall = _cpu() - cpu0, _wall() - wall0
        n = x.shape[0]
        first = self.record.add_serves(n, self.clock() - self._start, self.phase, cpu, wall, self.version - self.serve_version)
        return out, Ticket(x, range(first, first + n), self.serve_version, out, saved)

    def _begin(self) -> None:
        self._start = self.clock()
        self._cpu_start = time.thread_time()
        self.observers("on_train_begin", self)

    @torch.no_grad()
    def learn(self, ticket: Ticket, y: Any) -> int:
        """Score the ticket's prediction against ``y`` (class labels ``[batch]``, or targets of the
        output's shape) and queue it for training; run the updates the schedule calls for now.
        Returns the number of updates run."""
        if not isinstance(ticket, Ticket):
            raise TypeError(f"learn: ticket must be a Ticket from serve(), got {type(ticket).__name__}")
        if ticket.learned:
            raise ValueError(f"learn: {ticket!r} was already given its label")
        target, labels = self._as_target(y, ticket.out)
        ticket.learned = True
        self._score(ticket.rows, ticket.out, labels)
        self.pending.append((ticket, target, ticket.rows.start))
        cpu0 = _cpu()
        steps = self._run_schedule(force=False)
        if steps:
            self.record.train_s[ticket.rows.start] += _cpu() - cpu0
            self.record.train_steps[ticket.rows.start] += steps
        if self._logs:
            self._maybe_log()
        return steps

    def _score(self, rows: range, out: Tensor, labels: list[int]) -> None:
        """Hard accuracy and Lucy's SoftAcc (softmax p(true label) against 1, scale 1) of the served
        predictions ``out`` for ``labels``, into the record (one host read; plain Python for the
        few values of a sample, cheaper than a chain of tensor ops)."""
        if len(rows) >= 16:  # a window: a few tensor ops beat a Python loop over its samples
            p = out.reshape(out.shape[0], -1).to("cpu", torch.float64)
            lab = torch.tensor(labels)
            best = p.argmax(-1)
            top = p.gather(1, best[:, None])
            e = (p - top).exp()
            soft = (100.0 * e.gather(1, lab[:, None]) / e.sum(1, keepdim=True)).clamp_(0.0, 100.0)
            soft = torch.where(torch.isfinite(top), soft, 0.0)
            self.record.correct[rows.start : rows.stop] = (best == lab).int().tolist()
            self.record.soft[rows.start : rows.stop] = soft.reshape(-1).tolist()
            return
        preds = out.reshape(out.shape[0], -1).tolist()
        for row, pred, label in zip(rows, preds, labels):
            top = max(pred)
            best = pred.index(top)  # the first maximum, as argmax
            exps = [math.exp(v - top) for v in pred]
            self.record.correct[row] = int(best == label)
            self.record.soft[row] = min(100.0, max(0.0, 100.0 * exps[label] / sum(exps))) if math.isfinite(top) else 0.0

    @torch.no_grad()
    def flush(self) -> int:
        """Train on every labelled sample still waiting (the end of a stream), and read the device
        stream's queued window; returns the updates run."""
        self._drain_window()
        cpu0 = time.thread_time()
        steps = self._run_schedule(force=True)
        if steps and len(self.record):
            self.record.train_s[-1] += time.thread_time() - cpu0
            self.record.train_steps[-1] += steps
        return steps

    @torch.no_grad()
    def stream_window(self, xs: Any, y: Any) -> Tensor:
        """The device-resident stream: serve and train on ``K`` samples in one launch (``xs[K, ...]``,
        labels ``[K]`` or targets), each sample served then trained in order (as ``serve`` + ``learn``
        with the ``"sample"`` schedule), predictions read back once per window. Needs a method with a
        device step (``Method.device_ready()``); on CUDA the window is one kernel or one CUDA graph
        (same K each call), elsewhere it runs eagerly. Returns the predictions ``[K, ...]`` (on the
        device; the next window overwrites them: copy them to keep them).

        On CUDA the host does not wait for the window it queues: a window's predictions and statuses
        are copied to the host behind it, and read (scored, counted in the report) during the next
        call, while that window runs; ``flush`` and ``report`` read the last one. Host inputs and
        class labels keep the host from waiting at all (they reach the device by one staged copy);
        labels in a device tensor are read to the host first, which waits for the window before."""
        from .device import DeviceStream

        xs = self._as_input(xs, host=True)  # a host window stays on the host: DeviceStream.load stages it
        if self._stream is None:  # set-up (a fused kernel compiles here), before the run's clock starts
            out_shape = self.engine.output_shape(xs[:1].to(self.device))
            target, labels = self._as_target(y, torch.empty(xs.shape[0], *out_shape), where=xs.device)
            self._stream = DeviceStream(self, xs, target, ops=self.cuda.ops if self.cuda is not None else None)
        else:
            target, labels = self._as_target(y, self._stream.preds, where=xs.device)
        if self._start is None:
            self._begin()
        t, wall0 = self.clock() - self._start, time.perf_counter()
        preds = self._stream.window(xs, target)
        frac = self._serve_fraction() if self.device.type == "cuda" else self._stream.serve_fraction()
        self._stream.serve_s = self._stream.train_s = 0.0
        host_preds, status, ready = self._stream.read_back()
        n = preds.shape[0]
        window = (host_preds, status, ready, t, wall0, self.phase, labels, frac)
        previous, self._window = self._window, None
        if previous is not None:  # first: an observer's report there counts only windows already read
            self._finish_window(previous)
        # this window's updates counted as applied now, corrected when its statuses are read
        self.version += n
        self.statuses["OK"] += n
        self.serve_version = self.version
        if ready is None:  # computed in line (no device queue): read now
            self._finish_window(window)
        else:
            self._window = window
        return preds

    def _finish_window(self, window: tuple) -> None:
        """Wait for a queued window's read-back, then its rows: the report's rows (each sample's share
        of the window's wall time, split by the serving share ``frac``), scores, statuses. A window's
        wall time runs from its launch, or from the read of the window before when that came later
        (queued windows: the time between reads)."""
        preds, status, ready, t, wall0, phase, labels, frac = window
        if ready is not None:
            ready.synchronize()
        now = time.perf_counter()
        wall = now - max(wall0, self._window_read)
        self._window_read = now
        n = preds.shape[0]
        first = self.record.add_window(n, t, phase, wall * frac / n, wall * (1 - frac) / n, wall / n)
        self._score(range(first, first + n), preds, labels)  # the window's one read
        bad = int((status != 0).sum())
        if bad:
            self.statuses["OK"] -= bad
            self.statuses["NAN_GRAD"] += bad
            self.version -= bad
            self.serve_version = self.version
        self._maybe_log()

    def _drain_window(self) -> None:
        """Read the queued window, if any (``stream_window``)."""
        if self._window is not None:
            window, self._window = self._window, None
            self._finish_window(window)

    def _serve_fraction(self) -> float:
        """CUDA: the serving share of a captured window's GPU time, measured once (``DeviceStream.
        serve_fraction``); the eager first windows use the thread CPU clock."""
        if self._frac is None:
            frac = self._stream.serve_fraction()
            if (self._stream.graph is not None or self._stream.fused is not None) and frac is not None:
                self._frac = frac
            return frac if frac is not None else 0.0
        return self._frac

    def report(self, **options: Any) -> LiveReport:
        """The run's ``LiveReport`` so far (``LiveRecord.report``'s options: ``window_s``,
        ``n_windows``, ``window_samples``, ``window``, ``pre_samples``, ``adapt_windows``)."""
        self._drain_window()
        if self.cuda is not None:
            self.cuda.synchronize()
        self.record.duration_s = (self.clock() - self._start) if self._start is not None else 0.0
        options.setdefault("window", self.config.window)
        extra = {f"steps_{k.lower()}": float(v) for k, v in self.statuses.items()}
        extra["version"] = float(self.version)
        # the loop's thread-CPU seconds, and samples per such second: on a shared machine, what one
        # idle core would give (Welvet's Throughput is per wall-clock second)
        cpu = time.thread_time() - self._cpu_start if self._start is not None else 0.0
        extra["cpu_seconds"] = cpu
        extra["cpu_throughput"] = len(self.record) / cpu if cpu > 0 else 0.0
        return self.record.report(extra=extra, **options)

    def close(self) -> LiveReport:
        """``flush``, then the report, also given to the observers' ``on_train_end``."""
        self.flush()
        rep = self.report()
        self.observers("on_train_end", self, rep)
        return rep

    # ------------------------------------------------------------------ schedules
    def _run_schedule(self, force: bool) -> int:
        c, steps = self.config, 0
        if c.schedule == "sample" or (c.schedule == "batch" and c.batch_size == 1):
            pending, self.pending = self.pending, []
            for item in pending:
                steps += self._update([item])
        elif c.schedule == "batch":
            while len(self.pending) >= c.batch_size or (force and self.pending):
                group, self.pending = self.pending[: c.batch_size], self.pending[c.batch_size:]
                steps += self._update(group)
        else:  # periodic
            now = self.clock()
            due = self._last_update is None or now - self._last_update >= c.period_s
            if self.pending and (due or force):
                group, self.pending = self.pending[-c.period_samples:], []
                steps += self._update(group)
                self._last_update = now
        return steps

    def _update(self, group: list[tuple[Ticket, Tensor, int]]) -> int:
        """One update of the method on ``group``'s samples, guarded as in ``train()``."""
        if len(group) == 1:
            tickets, y = [group[0][0]], group[0][1]
            x = tickets[0].x
        else:
            tickets = [g[0] for g in group]
            x = torch.cat([t.x.to(self.device) for t in tickets])
            y = torch.cat([g[1].to(self.device) for g in group])
        if self.config.overlap and self.config.max_staleness == 1:
            self._publish()  # the server keeps the weights this update starts from
        if self.cuda is not None and self.cuda.trains(x, y):
            self.cuda.train(x, y)
            status = StepStatus.OK  # decided on the device; counted in the report (cuda.synchronize)
        else:
            status = self._host_step(tickets, x.to(self.device), y.to(self.device))
        self.statuses[status.name] += 1
        if status is StepStatus.OK:
            self.version += 1
            if self.serve_model is self.model:  # serial: the server reads the trained weights
                self.serve_version = self.version
            for t in tickets:
                for row in t.rows:
                    self.record.trained[row] = True
        if self.config.overlap and self.config.max_staleness == 0:
            self._publish()
        return 1

    def _host_step(self, tickets: list[Ticket], x: Tensor, y: Tensor) -> StepStatus:
        one = tickets[0] if len(tickets) == 1 else None
        lean = self._lean
        if lean is not None and lean.ready():
            # the serve forward's outputs when this sample was served at these weights, else its own
            acts = one.saved if one is not None and type(one.saved) is list and one.version == self.version else None
            if acts is None:
                forward = lean.forward(x)
                acts = forward[1] if forward else None
            if acts is not None and acts[-1].shape == y.shape:
                return lean.step(acts, y)  # guarded in itself: the weights change only when OK
        self._guard.save()
        with self.engine.autocast():
            if one is not None and one.saved is not None and type(one.saved) is not list and one.version == self.version:
                step: StepOutput = self.method.step_from_forward(x, y, one.out, one.saved)
            else:
                step = self.method.step(x, y)
        if step.status is StepStatus.OK and not self._guard.check_or_restore():
            return StepStatus.NAN_WEIGHTS
        return step.status

    def _guarded_tensors(self) -> list[Tensor]:
        """``Trainer.guarded_tensors()`` (the parameters and the method's state), the parameters
        listed once: walking the model's modules every update costs more than the update of a small
        net."""
        state = self.method.state_tensors()
        params = self.method.model.parameters()
        key = (len(state), next(params).data_ptr())  # a device step's setup may re-home the parameters
        if self._guarded is None or self._guarded[0] != key:
            self._guarded = (key, as_flat(self.engine.guarded_params()))
        return [*self._guarded[1], *state]

    @torch.no_grad()
    def _publish(self) -> None:
        """The serve snapshot takes the trained weights (and buffers) as they are now."""
        if self.serve_model is self.model:
            return
        if self.cuda is not None:
            self.cuda.publish()  # a copy on the update's stream; serve_version moves when it is done
            return
        else:
            for dst, src in zip(self.serve_model.parameters(), self.model.parameters()):
                dst.copy_(src)
            for dst, src in zip(self.serve_model.buffers(), self.model.buffers()):
                dst.copy_(src)
        self.serve_version = self.version

    def _maybe_log(self) -> None:
        n = len(self.record)
        if self.observers.wants("on_epoch_end") and n - self._logged >= self.config.log_every:
            self.observers("on_epoch_end", self, n // self.config.log_every - 1, self.report(window_samples=self.config.log_every).logs())
            self._logged = n

    # ------------------------------------------------------------------ inputs
    def _as_input(self, x: Any, host: bool = False) -> Tensor:
        """``x`` as ``[batch, ...]`` in the model's dtype, on the training device (``host=True``: a
        host tensor stays on the host; the CUDA serve copies it into its static input itself)."""
        x = x if isinstance(x, Tensor) else torch.as_tensor(x)
        if not x.is_floating_point():
            raise TypeError(f"serve: x must be a floating tensor, got dtype {x.dtype}")
        if x.dim() == 1:  # one sample
            x = x.unsqueeze(0)
        if x.dim() < 2 or x.shape[0] == 0:
            raise ValueError(f"serve: x must be [batch, ...] with batch >= 1, got shape {list(x.shape)}")
        if host and x.device.type == "cpu":
            return x.to(dtype=self.dtype)
        return x.to(self.device, self.dtype)

    def _one_hot(self, label: int, classes: int) -> Tensor:
        """Row ``label`` of a ``[classes, classes]`` identity on the training device, ``[1, classes]``:
        a view for the lean step and the CUDA update (which only read it), a copy for a method's step.
        With CUDA graphs the table is on the host: the update copies the sample and its target to the
        device together (``device.CudaLive.train``)."""
        eye = self._eye
        if eye is None or eye.shape[0] != classes:
            where = "cpu" if self.cuda is not None and self.cuda.graphs else self.device
            eye = self._eye = torch.eye(classes, dtype=self.dtype, device=where)
        row = eye[label : label + 1]
        return row if self._lean is not None or self.cuda is not None else row.clone()

    def _as_target(self, y: Any, out: Tensor, where: Any = None) -> tuple[Tensor, list[int]]:
        """``(target the method trains on, class labels to score against)`` for the prediction ``out``
        ``[batch, ..., classes]``: class labels (an int, a list of ints or an integer tensor
        ``[batch]``) are one-hot encoded unless the loss takes labels; a float target must have the
        prediction's shape (its argmax is the label scored against). The target is made on ``where``
        (None: the training device)."""
        where = self.device if where is None else where
        n, classes = out.shape[0], out.shape[-1]
        if type(y) is list and len(y) == 1 and n == 1:
            y = y[0]
        if type(y) is int and n == 1 and not self._labels and out.dim() == 2 and 0 <= y < classes:
            return self._one_hot(y, classes), [y]  # one sample's class label: one row of a one-hot table
        if isinstance(y, int) and not isinstance(y, bool):
            y = [y]
        if isinstance(y, (list, tuple)) and y and all(type(v) is int for v in y):  # plain labels: checked in Python
            labels = list(y)
        else:
            try:
                y = y if isinstance(y, Tensor) else torch.as_tensor(y)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"learn: y must be class labels or a target tensor, got {type(y).__name__}") from None
            if y.dtype == torch.bool:
                raise TypeError("learn: y must be class labels or a target tensor, got a bool tensor")
            if y.dim() == 0:
                y = y.reshape(1)
            if y.is_floating_point():
                if y.shape == out.shape[1:]:
                    y = y.unsqueeze(0)
                if tuple(y.shape) != tuple(out.shape):
                    raise ValueError(f"learn: a target must have the prediction's shape {list(out.shape)}, got {list(y.shape)}")
                y = y.to(where, self.dtype)
                return y, y.reshape(n, -1).argmax(-1).tolist()
            if y.dim() != 1:
                raise ValueError(f"learn: class labels must have shape [{n}] for a prediction of shape {list(out.shape)}, got {list(y.shape)}")
            labels = y.tolist()
        if len(labels) != n:
            raise ValueError(f"learn: class labels must have shape [{n}] for a prediction of shape {list(out.shape)}, got [{len(labels)}]")
        if min(labels) < 0 or max(labels) >= classes:
            raise ValueError(f"learn: class labels must lie in [0, {classes}), got {labels}")
        index = torch.tensor(labels, dtype=torch.long).to(where, non_blocking=True)
        if self._labels:
            return index, labels
        hot = torch.zeros(n, classes, dtype=self.dtype, device=where)
        return hot.scatter_(-1, index.unsqueeze(-1), 1.0), labels
