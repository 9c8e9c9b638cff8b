"""Kernel census of one device step per method: which kernels a step launches, how many, how long.

Runs ``torchloom.train`` with ``cuda_graph=False`` (the same kernels a captured step replays; with
``--graphed``, the captured graphs' replay) and profiles the second epoch with ``torch.profiler``; prints per method and batch size the kernels per
step, the GPU time per step, and the kernels grouped by name. A diagnostic for the launch-count work
behind ``bench_trainers.py``'s step ratios.

Run: ``PYTHONPATH=. python bench/profile_steps.py [--batches 1 1024] [--top 40]`` on a CUDA machine.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

import torchloom
from bench_trainers import METHODS, _config, _data, _net


class _Profile:
    """Profiles epoch 1 (the second) of a run."""

    def __init__(self):
        self.prof = None

    def on_epoch_begin(self, trainer, epoch):
        if epoch == 1:
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU])
            self.prof.start()

    def on_epoch_end(self, trainer, epoch, logs):
        if epoch == 1:
            torch.cuda.synchronize()
            self.prof.stop()


def census(method, batch, steps, dev, graphed=False):
    data = _data(steps * batch, batch, dev)
    obs = _Profile()
    torchloom.train(_net(dev), data, _config(method, dev, batch=batch, epochs=2, cuda_graph=None if graphed else False, observers=[obs]))
    kernels = collections.Counter()
    times = collections.Counter()
    for e in obs.prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            times[e.name] += e.device_time
    return kernels, times


class _Keep:
    """Keeps the trainer of a run (its runner holds the captured graphs)."""

    def on_train_begin(self, trainer):
        self.trainer = trainer


def replay_time(method, batch, dev, reps=200, steps=128):
    """Device time per step of the captured chunk graph alone (CUDA events around ``reps`` replays), and
    the epoch-based step time of the same run (what ``bench_trainers`` reports): the difference is
    what an epoch adds on the host (replay launches, slot copies, the read-back and its Python)."""
    data = _data(steps * batch, batch, dev)
    keep = _Keep()
    result = torchloom.train(_net(dev), data, _config(method, dev, batch=batch, epochs=3, observers=[keep]))
    chunk = keep.trainer._runner._chunk
    graph, k = chunk["graph"], chunk["x"].shape[0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * k), min(result.epoch_times[1:]) / len(data) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 1024])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--graphed", action="store_true", help="profile the captured steps' replay instead")
    ap.add_argument("--replay", action="store_true", help="only the chunk graph's device time per step vs the epoch-based step time")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    if args.replay:
        print("| batch | method | graph replay µs/step | epoch-based µs/step |")
        print("|---:|---|---:|---:|")
        for batch in args.batches:
            for method in args.methods:
                r, e = replay_time(method, batch, dev)
                print(f"| {batch} | {method} | {r:.1f} | {e:.1f} |", flush=True)
        return 0
    for batch in args.batches:
        for method in args.methods:
            k, t = census(method, batch, args.steps, dev, args.graphed)
            n = args.steps
            print(f"\n== {method} batch {batch}: {sum(k.values()) / n:.1f} kernels/step, {sum(t.values()) / n:.1f} us GPU/step")
            for name, c in k.most_common(args.top):
                print(f"  {c / n:6.2f}  {t[name] / n:8.2f} us  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
