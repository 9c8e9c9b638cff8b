"""Training in Loom's 21 weight dtypes (issue 38): accuracy per dtype and mode, and the step time.

Modes (``TrainingConfig(weight_dtype=..., low_bit=LowBitConfig(...))``):

* ``fp32``    — float32 master weights, the dtype's values forward and backward (default rounding);
* ``none``    — no master, stochastic rounding (bf16, fp16, int8 and wider only);
* ``nearest`` — no master, round-to-nearest: "storage truth", Loom's successor's update (same dtypes);
* ``compat``  — ``loom_compat=True``: Loom v0.80's own update (float32 Master, scale set once,
  truncation, int8 wrap);

against plain float32 training of the same network, seeds and batches. Prints a markdown table of
test accuracy (mean ± std over seeds) per dtype and mode, and the step time of each mode relative to
float32 (``--time``: the median epoch time over the run's epochs after the first).

  PYTHONPATH=. python bench/bench_lowbit.py --dataset digits --seeds 3            # CPU, ~minutes
  PYTHONPATH=. python bench/bench_lowbit.py --dataset fashion --seeds 3 --gpu      # the lead's GPU run
  PYTHONPATH=. python bench/bench_lowbit.py --dataset fashion --gpu --time --dtypes int8 int4 ternary --seeds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_methods import DataMissing, load_digits, standardise  # noqa: E402

import torchloom  # noqa: E402
from torchloom import Dense, LowBitConfig, Network, TrainingConfig  # noqa: E402
from torchloom.lowbit import LOOM_DTYPES, NO_MASTER_DTYPES  # noqa: E402

MODES = {
    "fp32": dict(master="fp32"),
    "none": dict(master="none", rounding="stochastic"),
    "nearest": dict(master="none", rounding="nearest"),
    "compat": dict(loom_compat=True),
}


def load(name: str):
    if name == "digits":
        return standardise(load_digits()), dict(hidden=64, epochs=15, lr=0.05, batch=32)
    from bench_methods import load_fashion

    return standardise(load_fashion()), dict(hidden=128, epochs=5, lr=0.02, batch=64)


def run(data, hp, seed: int, dtype: str | None, mode: str | None, device: str) -> tuple[float, float]:
    xtr, ytr, xte, yte = data
    torch.manual_seed(seed)
    net = Network(Dense(xtr.shape[1], hp["hidden"], "relu", bias=False), Dense(hp["hidden"], 10, bias=False))
    cfg = TrainingConfig(epochs=hp["epochs"], learning_rate=hp["lr"], loss_type="cross_entropy", optimizer="momentum",
                         batch_size=hp["batch"], shuffle=True, seed=seed, verbose=0, device=device, track_perf=True,
                         weight_dtype=dtype, low_bit=LowBitConfig(**MODES[mode]) if dtype else None)
    res = torchloom.train(net, (xtr, ytr), cfg)
    with torch.no_grad():
        acc = (net(xte.to(device)).argmax(1).cpu() == yte).float().mean().item() * 100
    steps = [p["step_time"] for p in (res.perf or [])[1:]] or [p["step_time"] for p in res.perf or []]
    return acc, statistics.median(steps) if steps else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=("digits", "fashion"), default="digits")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--dtypes", nargs="*", default=list(LOOM_DTYPES))
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--time", action="store_true", help="print the step time of every mode relative to float32")
    ap.add_argument("--limit", type=int, default=None, help="train on the first N training rows only (a quick smoke run)")
    a = ap.parse_args()
    try:
        data, hp = load(a.dataset)
    except DataMissing as e:
        sys.exit(str(e))
    if a.epochs:
        hp["epochs"] = a.epochs
    if a.limit:
        data = (data[0][: a.limit], data[1][: a.limit], data[2], data[3])
    device = "cuda" if a.gpu else "cpu"
    seeds = range(a.seeds)
    base = [run(data, hp, s, None, None, device) for s in seeds]
    b_acc = [r[0] for r in base]
    b_mean, b_step = statistics.mean(b_acc), statistics.median(r[1] for r in base)
    dev = torch.cuda.get_device_name() if a.gpu else "CPU"
    print(f"# {a.dataset}, {len(seeds)} seeds, {hp['epochs']} epochs, device {dev}, {time.strftime('%Y-%m-%d')}")
    print(f"float32: {b_mean:.2f} ± {statistics.pstdev(b_acc):.2f} %   step {b_step * 1e6:.0f} µs\n")
    print("| dtype | " + " | ".join(a.modes) + " |")
    print("|---|" + "---:|" * len(a.modes))
    times: dict[str, list[float]] = {m: [] for m in a.modes}
    for dt in a.dtypes:
        cells = []
        for m in a.modes:
            if m in ("none", "nearest") and dt not in NO_MASTER_DTYPES:
                cells.append("—")
                continue
            rs = [run(data, hp, s, dt, m, device) for s in seeds]
            acc = [r[0] for r in rs]
            times[m] += [r[1] for r in rs]
            mean = statistics.mean(acc)
            cells.append(f"{mean:.2f} ± {statistics.pstdev(acc):.2f} ({mean - b_mean:+.2f})")
        print(f"| {dt} | " + " | ".join(cells) + " |", flush=True)
    if a.time:
        print("\nstep time / float32 step: " + ", ".join(
            f"{m} {statistics.median(t) / b_step:.2f}×" for m, t in times.items() if t))


if __name__ == "__main__":
    main()
