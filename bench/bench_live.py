"""Live mode on Welvet's adaptation benchmark (openfluke/aai ``adaptv2``) and a digits label shift.

    OMP_NUM_THREADS=1 python bench/bench_live.py adaptv2                       # 15-s wall clock, every method
    OMP_NUM_THREADS=1 python bench/bench_live.py adaptv2 --clock free          # 8,800 samples per phase
    OMP_NUM_THREADS=1 python bench/bench_live.py adaptv2 --seconds 1           # quick check (1 s in all)
    python bench/bench_live.py adaptv2 --device cuda --modes serial,overlap,stream --stream-k 64
    python bench/bench_live.py digits --seconds 3

``adaptv2``, as Welvet runs it: a Dense 8→32→64→64→64→32→4 (tanh, linear head; weights uniform in
±1/√fan_in, biases 0), MSE on one-hot targets, SGD at 0.05; inputs uniform in [-1, 1]⁸, labels the
argmax of a fixed random teacher (uniform [-1, 1], 4×8); phases chase → avoid (label + 2 mod 4) →
chase, 5 s each on the wall clock (``--clock wall``) or 8,800 samples each (``--clock free``). Every
sample is served, scored, then trained on (test-then-train). Serve and train time are read from the
thread's CPU clock (``time.thread_time``, Welvet's ``RUSAGE_THREAD``); Lucy's metrics come from 1-s
windows (15 in all; ``--clock free``: 15 windows of 1,760 samples). Score = Throughput × Availability ×
Acc / 10⁴. Columns added beside Lucy's: the minimum accuracy over 50-sample windows after each flip,
the samples to get back to 90 % of the accuracy before it, serve latency p50 / p99 (µs), the fraction
of samples trained.

``digits``: scikit-learn's 8×8 digits (64 inputs, 10 classes), Dense 64→64→10, samples drawn at
random; the middle phase relabels every digit as label + 5 mod 10.

Modes (``--modes``): ``serial`` (serve then train in line), ``overlap`` (serve from a snapshot at most
one update old; on CUDA on its own high-priority stream), ``stream`` (device-resident: ``--stream-k``
samples per launch; methods with a device step only). Schedules (``--schedules``): ``sample``,
``periodic`` (Loom: up to 20 samples every 50 ms), ``batch<k>``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchloom  # noqa: E402
import torchloom.methods  # noqa: E402,F401  (registers the methods)
from torchloom import Dense, Network, method_names  # noqa: E402
from torchloom.live import LiveTrainer  # noqa: E402

# Welvet's published CPU board (openfluke/aai adaptv2/README.md, 15 s, workers=1, SIMD off)
WELVET_ADAPTV2 = [  # mode, throughput, availability %, acc %, score
    ("NormalBP", 1762, 63.7, 89.2, 1001),
    ("StepBP", 2181, 9.8, 89.4, 192),
    ("Tween", 1632, 20.0, 46.9, 154),
    ("TweenChain", 1802, 63.5, 89.7, 1027),
    ("FastProxy", 3492, 82.7, 91.2, 2634),
    ("Sparse", 7613, 95.5, 85.9, 6241),
]

ADAPT_WIDTHS = [8, 32, 64, 64, 64, 32, 4]


def dense_net(widths: list[int], gen: torch.Generator, device: str) -> Network:
    layers = []
    for i in range(len(widths) - 1):
        act = "linear" if i == len(widths) - 2 else "tanh"
        d = Dense(widths[i], widths[i + 1], activation=act)
        with torch.no_grad():
            bound = 1 / math.sqrt(widths[i])
            d.weight.copy_((torch.rand(d.weight.shape, generator=gen) * 2 - 1) * bound)
            if d.bias is not None:
                d.bias.zero_()
        layers.append(d)
    return Network(*layers).to(device)


class Adaptv2Task:
    """Welvet's chase/avoid stream: ``draw(n)`` gives inputs [n, 8] and chase labels [n]."""

    classes, shift, widths = 4, 2, ADAPT_WIDTHS

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen
        self.teacher = torch.rand(4, 8, generator=gen) * 2 - 1

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(n, 8, generator=self.gen) * 2 - 1
        return x, (x @ self.teacher.T).argmax(-1)


class DigitsTask:
    """scikit-learn's digits, drawn at random; the middle phase shifts labels by 5."""

    classes, shift, widths = 10, 5, [64, 64, 10]

    def __init__(self, gen: torch.Generator) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        self.x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        self.y = torch.tensor(d.target, dtype=torch.long)
        self.gen = gen

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(self.y), (n,), generator=self.gen)
        return self.x[i], self.y[i]


def run(task_name: str, method: str, schedule: str, mode: str, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    task = (Adaptv2Task if task_name == "adaptv2" else DigitsTask)(gen)
    net = dense_net(task.widths, gen, args.device)
    sched = {"schedule": schedule}
    lr = args.lr
    if schedule.startswith("batch"):
        sched = {"schedule": "batch", "batch_size": int(schedule[5:] or 8)}
        if args.scale_lr:  # MSE averages over the batch: lr × k sums the k samples' steps
            lr = args.lr * sched["batch_size"]
    live = LiveTrainer(net, method=method, learning_rate=lr, loss_type="mse", overlap=(mode == "overlap"),
                       max_staleness=args.staleness, device=args.device, lean=not args.no_lean, **sched)
    phases = [("chase1", 0), ("avoid", task.shift), ("chase2", 0)]
    per_phase = args.samples_per_phase
    wall = args.clock == "wall"
    total_s = args.seconds
    phase_s = total_s / 3
    chunk = args.stream_k if mode == "stream" else 1024
    # every mode takes its samples from the host, as they are drawn: the serve copies one sample to the
    # device; the device-resident stream stages a window and its labels by one copy, without waiting
    # for the window before (stream_window)
    xs, ys = task.draw(chunk)
    k = 0
    n = 0
    start = time.perf_counter()
    while True:
        if wall:
            elapsed = time.perf_counter() - start
            if elapsed >= total_s:
                break
            p = min(int(elapsed // phase_s), 2)
        else:
            if n >= 3 * per_phase:
                break
            p = n // per_phase
        name, shift = phases[p]
        live.set_phase(name)
        if mode == "stream":
            labels = (ys + shift) % task.classes
            live.stream_window(xs, labels)
            n += chunk
            xs, ys = task.draw(chunk)
            continue
        if k == chunk:
            xs, ys = task.draw(chunk)
            k = 0
        if k == 0:
            ylist = ys.tolist()
        x, y = xs[k : k + 1], (ylist[k] + shift) % task.classes
        k += 1
        pred, ticket = live.serve(x)
        live.learn(ticket, [y])
        n += 1
    live.flush()
    if wall:
        rep = live.report(window_s=1.0 * total_s / 15, n_windows=15)
    else:
        rep = live.report(window_samples=max(1, 3 * per_phase // 15))
    logs = rep.logs()
    logs["flips"] = rep.flips
    # Score with the throughput per thread-CPU second of the loop: what one idle core would give
    logs["cpu_score"] = logs["cpu_throughput"] * logs["availability"] * logs["acc"] / 1e4
    return logs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=["adaptv2", "digits"])
    ap.add_argument("--seconds", type=float, default=15.0, help="wall clock of a run (3 phases); Welvet: 15")
    ap.add_argument("--clock", choices=["wall", "free", "both"], default="wall")
    ap.add_argument("--samples-per-phase", type=int, default=8800, help="--clock free: samples per phase")
    ap.add_argument("--methods", default="all", help="'all' (every registered method) or a comma list")
    ap.add_argument("--schedules", default="sample", help="comma list of sample, periodic, batch<k>")
    ap.add_argument("--modes", default="serial", help="comma list of serial, overlap, stream")
    ap.add_argument("--stream-k", type=int, default=64, help="stream mode: samples per launch")
    ap.add_argument("--staleness", type=int, default=1, choices=[0, 1], help="overlap: weight versions of lag")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--scale-lr", action="store_true", help="batch<k>: train at lr × k (the batch's loss is a mean)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-lean", action="store_true", help="CPU: the method's step, not the lean host step (LiveConfig.lean)")
    args = ap.parse_args(argv)
    methods = list(method_names()) if args.methods == "all" else args.methods.split(",")
    clocks = ["wall", "free"] if args.clock == "both" else [args.clock]
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"# {args.task} on {card}; torch {torch.__version__}; torchloom {torchloom.__version__}")
    head = (f"{'clock':5} {'method':18} {'schedule':9} {'mode':8} {'Thru':>7} {'Avail':>6} {'Acc':>5} {'Score':>7} "
            f"{'min50':>11} {'rec90':>11} {'p50us':>6} {'p99us':>7} {'stale':>5} {'trained':>7} {'Thru/cpu':>8} {'Score/cpu':>9}  flips")
    print(head)
    for clock in clocks:
        args.clock = clock
        for method in methods:
            for schedule in args.schedules.split(","):
                for mode in args.modes.split(","):
                    if mode == "stream" and schedule != "sample":
                        continue  # the device-resident stream trains on every sample in order
                    try:
                        r = run(args.task, method, schedule, mode, args)
                    except ValueError as e:
                        print(f"{clock:5} {method:18} {schedule:9} {mode:8} skipped: {e}")
                        continue
                    mins = "/".join(f"{r.get(f'shock{i}_min_acc', float('nan')):.0f}" for i in range(2))
                    recs = "/".join(f"{r.get(f'shock{i}_recover90', float('nan')):.0f}" for i in range(2))
                    flips = "  ".join(f"{b:.0f}→{'—' if a is None else f'{a:.0f}'} {d if d is not None else ''}" for b, a, d in r["flips"])
                    print(f"{clock:5} {method:18} {schedule:9} {mode:8} {r['throughput']:7.0f} {r['availability']:5.1f}% "
                          f"{r['acc']:5.1f} {r['score']:7.0f} {mins:>11} {recs:>11} {r['latency_p50_us']:6.0f} "
                          f"{r['latency_p99_us']:7.0f} {r['staleness_mean']:5.2f} {r['trained_fraction']:7.3f} {r['cpu_throughput']:8.0f} "
                          f"{r['cpu_score']:9.0f}  {flips}", flush=True)
    if args.task == "adaptv2":
        print("\n# Welvet's published CPU board (openfluke/aai adaptv2, 15 s, workers=1, SIMD off)")
        print(f"{'mode':18} {'Thru':>7} {'Avail':>6} {'Acc':>5} {'Score':>7}")
        for name, thru, avail, acc, score in WELVET_ADAPTV2:
            print(f"{name:18} {thru:7d} {avail:5.1f}% {acc:5.1f} {score:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
