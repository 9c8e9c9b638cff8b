"""Where one live sample's time goes on CUDA (adaptv2's Dense 8→32→64→64→64→32→4, backprop, SGD 0.05).

    python bench/profile_live.py                       # CUDA: serial and overlap, then the stream (< 2 min)
    python bench/profile_live.py --device cpu          # the same CUDA logic on the CPU (EagerOps): a self-check
    python bench/profile_live.py --stream-only --stream-k 64,128,256 --sweep   # the stream, and the kernel's variants

Prints, per mode:

1. **end to end** through ``LiveTrainer.serve`` / ``learn`` (the bench's loop): per sample the wall
   and thread-CPU µs of serve and of learn, serve latency p50 / p99, samples/s and availability;
2. **split** of the serial per-sample path (``CudaLive``'s own pieces, each followed by a device sync,
   median wall µs): the input's copy into the serve graph's static input, the serve-graph replay, the
   prediction's read-back (device→host copy and the wait), the update's staged ``[x | y]`` copy, the
   update-graph replay; beside each, the host cost of issuing it (thread CPU, no sync);
   **bookkeeping** = the end-to-end host CPU per sample minus the host cost of those pieces (the
   LiveTrainer's Python: tickets, scoring, the report's rows, the schedule);
3. GPU time of one serve-graph and one update-graph replay (CUDA events, mean of 200);
4. the device-resident stream (``--stream-k`` samples per launch, a comma list), as the fused window
   kernel and as one CUDA graph of the method's device steps: samples/s, wall and host CPU ms per
   window, window GPU ms and the serving share (docs/live.md's availability); ``--sweep``: the fused
   kernel alone, GPU µs per sample, weights in registers at 4, 8 and 16 warps and in memory;
5. the top host functions of the serial loop by own time (cProfile, thread CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchloom.methods  # noqa: E402,F401  (registers the methods)
from bench_live import Adaptv2Task, dense_net  # noqa: E402
from torchloom.live import LiveTrainer  # noqa: E402
from torchloom.live.device import CudaLive, EagerOps  # noqa: E402


def make(args: argparse.Namespace, overlap: bool) -> tuple[LiveTrainer, Adaptv2Task]:
    gen = torch.Generator().manual_seed(1)
    task = Adaptv2Task(gen)
    net = dense_net(task.widths, gen, args.device)
    live = LiveTrainer(net, method="backprop", learning_rate=0.05, loss_type="mse", overlap=overlap, device=args.device)
    if args.device == "cpu":  # the CUDA logic with EagerOps (graphs re-run, streams and events do nothing)
        live.cuda = CudaLive(live, ops=EagerOps())
        live._lean = None
        live._lean_serve = False
    return live, task


def sync(args: argparse.Namespace) -> None:
    if args.device != "cpu":
        torch.cuda.synchronize()


def end_to_end(args: argparse.Namespace, overlap: bool) -> dict[str, float]:
    live, task = make(args, overlap)
    xs, ys = task.draw(args.warmup + args.samples)
    labels = ys.tolist()
    for i in range(args.warmup):  # graphs captured, kernels compiled
        _, t = live.serve(xs[i : i + 1])
        live.learn(t, [labels[i]])
    sync(args)
    sw = sc = lw = lc = 0.0
    lat = []
    w0, c0 = time.perf_counter(), time.thread_time()
    for i in range(args.warmup, args.warmup + args.samples):
        a, b = time.perf_counter(), time.thread_time()
        _, t = live.serve(xs[i : i + 1])
        c, d = time.perf_counter(), time.thread_time()
        live.learn(t, [labels[i]])
        e, f = time.perf_counter(), time.thread_time()
        sw += c - a
        sc += d - b
        lw += e - c
        lc += f - d
        lat.append(c - a)
    sync(args)
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    n = args.samples
    lat.sort()
    rep = live.report(window_samples=max(1, n // 10))
    return {
        "serve_wall": 1e6 * sw / n, "serve_cpu": 1e6 * sc / n, "learn_wall": 1e6 * lw / n, "learn_cpu": 1e6 * lc / n,
        "p50": 1e6 * lat[n // 2], "p99": 1e6 * lat[min(n - 1, (99 * n) // 100)], "thru": n / wall, "cpu_per": 1e6 * cpu / n,
        "avail": rep.lucy.availability, "stale": rep.staleness_mean, "live": live, "xs": xs, "labels": labels,
    }


def split(args: argparse.Namespace, r: dict) -> None:
    """The serial path's pieces, each synced (median wall µs), and the host cost of issuing each."""
    live = r["live"]
    cuda = live.cuda
    u = cuda.update
    graph = cuda.serve_graphs[cuda.current]
    if u is None or u.graph is None or graph is None:
        print("  split: the graphs were not captured (cuda_graph off, or no device step)")
        return
    eye = torch.eye(4)
    xs, labels = r["xs"], r["labels"]
    n = min(args.samples, 1000)
    pieces = {
        "serve: input copy": lambda i: cuda.serve_x.copy_(xs[i : i + 1], non_blocking=True),
        "serve: graph replay": lambda i: graph.replay(),
        "serve: read-back (D2H + wait)": lambda i: (cuda.host_out.copy_(graph.result, non_blocking=True),
                                                     cuda.served[cuda.current].record(cuda.serve_stream),
                                                     cuda.served[cuda.current].synchronize()),
        "update: [x|y] copy": lambda i: u.load(xs[i : i + 1], eye[labels[i] : labels[i] + 1]),
        "update: graph replay": lambda i: u.graph.replay(),
    }
    host_total = 0.0
    print(f"  {'piece':34} {'synced wall us (median)':>24} {'host issue us':>14}")
    for name, fn in pieces.items():
        walls = []
        for i in range(n):
            a = time.perf_counter()
            fn(i)
            sync(args)
            walls.append(time.perf_counter() - a)
        c0 = time.thread_time()
        for i in range(n):
            fn(i)
        host = (time.thread_time() - c0) / n
        sync(args)
        host_total += host
        print(f"  {name:34} {1e6 * statistics.median(walls):24.1f} {1e6 * host:14.1f}")
    print(f"  {'bookkeeping (LiveTrainer Python)':34} {'':24} {r['cpu_per'] - 1e6 * host_total:14.1f}"
          f"   (end-to-end host CPU {r['cpu_per']:.1f} us/sample minus the pieces)")
    if args.device != "cpu":
        for name, g in (("serve graph", graph), ("update graph", u.graph)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                g.replay()
            end.record()
            end.synchronize()
            print(f"  GPU time of one {name} replay: {1000 * start.elapsed_time(end) / 200:.1f} us")


def stream(args: argparse.Namespace, kernel: bool, k: int) -> None:
    """End to end through ``LiveTrainer.stream_window``, host windows as the bench draws them."""
    live, task = make(args, False)
    if not kernel:  # the method's device steps in one CUDA graph (the fused window kernel off)
        live.engine.kernel_backend = "reference"
    windows = max(4, args.samples // k)
    batches = [task.draw(k) for _ in range(windows + 3)]
    for x, y in batches[:3]:  # eager, capture, timed window
        live.stream_window(x, y)
    live.flush()
    sync(args)
    w0, c0 = time.perf_counter(), time.thread_time()
    for x, y in batches[3:]:
        live.stream_window(x, y)
    live.flush()
    sync(args)
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    s = live._stream
    rep = live.report(window_samples=k * 4)
    gpu = f"{s.window_ms:.3f} ms" if s.window_ms is not None else "n/a"
    how = f"fused window kernel ({s.fused.kernel})" if s.fused is not None else "graph of the method's steps"
    print(f"  K={k}: {windows * k / wall:,.0f} samples/s, {1e3 * wall / windows:.3f} ms per window (wall), "
          f"host CPU {1e3 * cpu / windows:.3f} ms per window, window GPU {gpu}, "
          f"serving share {live._frac if live._frac is not None else float('nan'):.3f}, {how}, "
          f"one forward per sample: {s.fused is not None or s.reuse_forward}, acc {rep.lucy.avg_accuracy:.1f} %")


def sweep(args: argparse.Namespace) -> None:
    """GPU time of one window of the fused kernel alone (CUDA events, mean of 20 after a compile), per
    kernel (weights in registers / in memory) and warps, training and forwards alone."""
    from torchloom.kernels.live_window import ACT_CODES, kernel_settings, live_window_

    gen = torch.Generator().manual_seed(1)
    task = Adaptv2Task(gen)
    net = dense_net(task.widths, gen, args.device)
    parts, meta, off = [], [], 0
    for layer in net.layers:
        parts += [layer.weight.detach().reshape(-1), layer.bias.detach()]
        meta.append((layer.in_features, layer.out_features, off, off + layer.weight.numel(), ACT_CODES[layer.activation.name]))
        off += layer.weight.numel() + layer.out_features
    flat = torch.cat(parts)
    # the global kernel's scratch and device layout, made once (as _FusedWindow makes them)
    scratch = torch.zeros(2 * flat.numel() + (len(meta) + 1) * 64, device=args.device)
    meta_dev = torch.tensor([v for r in meta for v in r], dtype=torch.int32, device=args.device)
    print(f"fused window kernel alone (adaptv2, default: {kernel_settings(meta)}), GPU us per sample:")
    for k in args.stream_k:
        xs, ys = task.draw(k)
        xs, ts = xs.to(args.device), torch.eye(4)[ys].to(args.device)
        preds = torch.empty(k, 4, device=args.device)
        status = torch.zeros(k, dtype=torch.int32, device=args.device)
        for kernel, warps in [("registers", w) for w in (4, 8, 16)] + [("global", 8)]:
            row = []
            for train in (True, False):
                w = flat.clone()
                run = lambda: live_window_(xs, ts, w, meta, 1e-6, preds, status, train=train, kernel=kernel,  # noqa: E731
                                           scratch=scratch, meta_dev=meta_dev, num_warps=warps)
                run()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    run()
                end.record()
                end.synchronize()
                row.append(1000 * start.elapsed_time(end) / 20 / k)
            print(f"  K={k:4d} {kernel:9} {warps:2d} warps: window {row[0]:6.2f} us/sample "
                  f"({1e6 / row[0]:,.0f} samples/s), forwards alone {row[1]:6.2f} us/sample")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--stream-k", default="64", help="comma list: samples per stream window")
    ap.add_argument("--sweep", action="store_true", help="CUDA: the fused kernel alone per kernel and warps (compiles 8 variants, ~1 min)")
    ap.add_argument("--stream-only", action="store_true", help="skip the serial and overlap sections")
    args = ap.parse_args(argv)
    args.stream_k = [int(v) for v in str(args.stream_k).split(",")]
    card = torch.cuda.get_device_name() if args.device != "cpu" else "CPU (EagerOps: the CUDA logic, no GPU)"
    print(f"# profile_live on {card}; torch {torch.__version__}")
    for mode in () if args.stream_only else ("serial", "overlap"):
        r = end_to_end(args, mode == "overlap")
        print(f"{mode}: {r['thru']:,.0f} samples/s, availability {r['avail']:.1f} %, staleness {r['stale']:.2f}; per sample "
              f"serve {r['serve_wall']:.1f} us wall / {r['serve_cpu']:.1f} us CPU (p50 {r['p50']:.1f}, p99 {r['p99']:.1f}), "
              f"learn {r['learn_wall']:.1f} us wall / {r['learn_cpu']:.1f} us CPU")
        if mode == "serial":
            split(args, r)
            live, xs, labels = r["live"], r["xs"], r["labels"]
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            for i in range(min(500, len(labels))):
                _, t = live.serve(xs[i : i + 1])
                live.learn(t, [labels[i]])
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
            lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
            start = next((j for j, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
            print("  top host functions (500 samples, own thread-CPU time, profiled):")
            for ln in lines[start : start + 13]:
                print("   ", ln)
    print("stream (the fused window kernel where it applies, then the CUDA graph of the method's steps):")
    for k in args.stream_k:
        stream(args, kernel=True, k=k)
    stream(args, kernel=False, k=args.stream_k[0])
    if args.sweep and args.device != "cpu":
        sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
