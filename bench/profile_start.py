"""Where a short run's fixed start goes: one whole ``torchloom.train`` run in a fresh process, profiled.

Prints, for one method and batch size (784-256-256-10, 60,000 random samples, 4 epochs, the data on
the GPU before the timer, after ``bench_trainers``' process warm-up):

* the run's wall time, and a second identical run in the same process (what is left when every
  Triton kernel is loaded and every cache warm: the difference is the per-process start);
* every Triton kernel's first launch in the process (host time of the call that compiled or loaded
  it) against its later launches;
* the ``cProfile`` functions with the most cumulative time (``--profile``);
* the first run's timeline (``--phases``): when each step of the start began on which thread and how
  long it took (getting ready, converting the batches, the output-shape probe, the preload threads,
  the masked warm-ups and captures, each epoch), timed by wrapping those functions, with none of
  ``cProfile``'s overhead.

Run: ``PYTHONPATH=. python bench/profile_start.py --method tween --batch 1024 [--profile | --phases]``
on a CUDA machine; each invocation is a fresh process. Run it once first (a priming run: Triton's
kernel cache and torchloom's noted kernel lists), and keep Python's bytecode cache on
(``PYTHONPYCACHEPREFIX=/tmp/pyc``, ``PYTHONDONTWRITEBYTECODE`` unset), as ``bench_trainers.py``'s
whole runs do: otherwise every lazily imported module is compiled inside the timed run.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import io
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_trainers as bt  # noqa: E402

import torchloom  # noqa: E402


def _trace_triton() -> dict[str, list[float]]:
    """Wrap Triton's launcher: host seconds of every launch, per kernel name."""
    from triton.runtime.jit import JITFunction

    calls: dict[str, list[float]] = collections.defaultdict(list)
    run = JITFunction.run

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            calls[self.fn.__name__].append(time.perf_counter() - t)

    JITFunction.run = timed
    return calls


# The steps of a run's start that --phases times: (module, class, methods)
_PHASES = (
    ("torchloom.engine.loop", "Trainer", ("_get_ready", "_build_runner", "output_shape", "join_op_warm")),
    ("torchloom.engine.batches", "BatchSource", ("__init__",)),
    ("torchloom.kernels._preload", "Preload", ("join", "_imports", "_tools")),
    ("torchloom.engine.cuda_path", "CudaRunner", ("_capture", "_replay", "run_epoch")),
    ("torchloom.methods.backprop", "Backprop", ("device_step",)),
    ("torchloom.methods.target_prop", "TargetProp", ("device_step",)),
    ("torchloom.methods.tween", "Tween", ("device_step",)),
)


def _trace_phases() -> list[tuple[str, str, float, float]]:
    """Wrap the functions of ``_PHASES``: every call appends ``(name, thread, start, end)``."""
    events: list[tuple[str, str, float, float]] = []
    for module, cls, methods in _PHASES:
        owner = getattr(importlib.import_module(module), cls)
        for method in methods:
            raw = owner.__dict__.get(method)
            if raw is None:
                continue
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw

            def timed(*args, _fn=fn, _name=f"{cls}.{method}", **kwargs):
                t = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    events.append((_name, threading.current_thread().name, t, time.perf_counter()))

            setattr(owner, method, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
    return events


def _print_phases(events, t0: float, t1: float, shown_ms: float = 0.5) -> None:
    """The calls between ``t0`` and ``t1`` by start time; calls under ``shown_ms`` are counted per name."""
    print(f"{'start ms':>9} {'took ms':>8}  {'thread':<18} step")
    small: dict[str, list[float]] = collections.defaultdict(list)
    for name, thread, start, end in sorted((e for e in events if t0 <= e[2] and e[3] <= t1), key=lambda e: e[2]):
        if (end - start) * 1e3 < shown_ms:
            small[name].append(end - start)
            continue
        print(f"{(start - t0) * 1e3:>9.1f} {(end - start) * 1e3:>8.1f}  {thread[:18]:<18} {name}")
    print(f"{(t1 - t0) * 1e3:>9.1f}           (the run ends)")
    for name, took in small.items():
        print(f"  and {len(took)} calls of {name} under {shown_ms} ms each, {sum(took) * 1e3:.1f} ms in all")


def _print_launches(first_calls: dict[str, list[float]]) -> None:
    """Every Triton kernel's first launch (host ms) against its later launches (median µs)."""
    print(f"{'kernel':<34} {'launches':>8} {'first ms':>9} {'later µs':>9}")
    total_first = 0.0
    for name, times in sorted(first_calls.items(), key=lambda kv: -kv[1][0]):
        later = sorted(times[1:])
        total_first += times[0]
        print(f"{name:<34} {len(times):>8} {times[0] * 1e3:>9.2f} {later[len(later) // 2] * 1e6 if later else float('nan'):>9.1f}")
    print(f"first launches: {len(first_calls)} kernels, {total_first:.3f} s of host time")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="backprop", choices=list(bt.METHODS))
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=60000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="cProfile the first run")
    ap.add_argument("--phases", action="store_true", help="print the first run's timeline of its start")
    ap.add_argument("--no-launch-table", action="store_true",
                    help="leave Triton alone: no first-launch table, so Triton is first imported inside the run (as in "
                         "bench_trainers.py's whole runs) and the timeline shows that import's true cost")
    ap.add_argument("--callers", action="append", default=[], help="with --profile: print who called functions matching this")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = bt._data(args.samples, args.batch, dev)
    bt._warm_process(dev)
    calls = {} if args.no_launch_table else _trace_triton()
    events = _trace_phases() if args.phases else None
    prof = cProfile.Profile() if args.profile else None
    walls = []
    for run in range(2):
        net = bt._net(dev)
        bt._sync(dev)
        t = time.perf_counter()
        if prof is not None and run == 0:
            prof.enable()
        result = torchloom.train(net, data, bt._config(args.method, dev, batch=args.batch, epochs=args.epochs))
        bt._sync(dev)
        if prof is not None and run == 0:
            prof.disable()
        walls.append(time.perf_counter() - t)
        if run == 0:
            span = (t, t + walls[0])
            first_calls = {k: list(v) for k, v in calls.items()}
            epochs = list(result.epoch_times)
            losses = list(result.loss_history)
    print(f"{args.method} batch {args.batch}: first run {walls[0]:.3f} s (epochs {', '.join(f'{e:.3f}' for e in epochs)}), "
          f"second run {walls[1]:.3f} s, per-process start {walls[0] - walls[1]:.3f} s; losses {', '.join(f'{x:.4g}' for x in losses)}")
    if not args.no_launch_table:
        _print_launches(first_calls)
    if events is not None:
        _print_phases(events, *span)
    if prof is not None:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s).sort_stats("cumulative")
        stats.print_stats(45)
        for pattern in args.callers:
            stats.print_callers(pattern)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
