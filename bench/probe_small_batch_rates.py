"""Which rates TargetProp's chain rule and Tweening learn at, at small batches (issue 31, item 4).

The rates of bench/bench_methods.py (TargetProp chain rule 0.1, Tween 0.03) meet issue 31's targets at
batch 32 and 256; Tween at 0.03 collapses online (batch 1). This probe trains short runs at batch 1 … 32
and reports test accuracy per (data set, network, method, rate, batch), mean over seeds, for choosing
the defaults (``TweenConfig(base_rate=None)``'s rule, ``TargetPropConfig(learning_rate=None)``).

Networks: ``bench`` = bench_methods' 784-256-256-10 ReLU (64 inputs for digits); ``small`` = the guides'
64-64-10 tanh (digits) or 784-256-10 ReLU (Fashion-MNIST, ``tests/trainers/test_tween_watch.py``'s).
Data: bench_methods' digits split (1,347 / 450) or Fashion-MNIST's first ``--max-train`` training
images (all 10,000 test images), inputs standardised as there; cross-entropy; ``torchloom.train`` with
``batch_size``, ``shuffle=True``, ``seed``. One torch thread::

    PYTHONPATH=. python bench/probe_small_batch_rates.py --method tween --rates 0.01,0.02,0.03 --batches 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings

import torch

import torchloom
from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench_methods as bm  # noqa: E402


def net_for(kind: str, n_in: int, n_out: int, seed: int) -> Network:
    torch.manual_seed(seed)
    if kind == "bench":
        return Network(Dense(n_in, 256, "relu"), Dense(256, 256, "relu"), Dense(256, n_out))
    if n_in == 64:  # the TargetProp guide's digits network
        return Network(Dense(64, 64, "tanh"), Dense(64, n_out))
    return Network(Dense(n_in, 256, "relu"), Dense(256, n_out))  # test_tween_watch's Fashion-MNIST network


def method_config(method: str, rate: float | None):
    if method == "tween":
        return TweenConfig(base_rate=rate, loss_type="cross_entropy")
    if method == "tp-chain":
        return TargetPropConfig(learning_rate=rate)
    if method == "tp-pure":
        return TargetPropConfig(use_chain_rule=False, learning_rate=rate)
    raise ValueError(method)


def run(method, split, kind, batch, rate, epochs, seed):
    xtr, ytr, xte, yte = split
    net = net_for(kind, xtr.shape[1], 10, seed)
    cfg = TrainingConfig(epochs=epochs, batch_size=batch, shuffle=True, seed=seed, verbose=0,
                         method=method_config(method, rate), loss_type="cross_entropy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchloom.DivergenceWarning)
        result = torchloom.train(net, (xtr, ytr), cfg)
    acc = torchloom.evaluate(net, (xte, yte), loss_type="cross_entropy", metrics=("accuracy",), batch_size=2048)["accuracy"]
    return 100 * acc, result.final_loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="tween", choices=("tween", "tp-chain", "tp-pure"))
    ap.add_argument("--dataset", default="digits", choices=("digits", "fashion"))
    ap.add_argument("--nets", default="bench,small")
    ap.add_argument("--rates", default="0.01,0.03", help="comma-separated; 'auto' = the config's default (None)")
    ap.add_argument("--batches", default="1,4,8,32")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-train", type=int, default=2000, help="Fashion-MNIST: first N training images")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.dataset == "digits":
        split = bm.standardise(bm.load_digits())
    else:
        xtr, ytr, xte, yte = bm.load_fashion()
        split = bm.standardise((xtr[: args.max_train], ytr[: args.max_train], xte, yte))
    rates = [None if r == "auto" else float(r) for r in args.rates.split(",")]
    print(f"# {args.method} on {args.dataset}, {args.epochs} epochs, seeds 0..{args.seeds - 1}, torch {torch.__version__}")
    print("| data | net | batch | rate | acc per seed (%) | mean | final loss | s |")
    print("|---|---|---:|---|---|---:|---|---:|")
    for kind in args.nets.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for rate in rates:
                t0 = time.perf_counter()
                out = [run(args.method, split, kind, batch, rate, args.epochs, s) for s in range(args.seeds)]
                accs = [a for a, _ in out]
                losses = " / ".join(f"{l:.3g}" if math.isfinite(l) else "nan" for _, l in out)
                print(f"| {args.dataset} | {kind} | {batch} | {'auto' if rate is None else rate} | "
                      f"{' / '.join(f'{a:.1f}' for a in accs)} | {statistics.mean(accs):.1f} | {losses} | "
                      f"{time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
