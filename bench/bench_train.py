"""Training-step speed: torchloom ``train()`` against PyTorch on the GPU, and against real Loom on the CPU.

GPU (one process, one table), a 784-256-256-10 ReLU network, MSE, SGD, per-step time at batch
1, 32, 1024 and 16384, side by side:

* torchloom ``train(..., use_gpu=True)`` (fused kernels, graph-captured steps): epoch time / steps;
* an eager PyTorch loop: ``zero_grad / forward / mse_loss / backward / step``;
* the same PyTorch step captured by hand in one CUDA graph (static inputs, copied in per step);
* ``torch.compile(mode="reduce-overhead")`` of the same step;

plus the same four with AdamW at batch 1024.

CPU (``--cpu``): samples/s of torchloom ``train()`` vs real Loom (``welvet.train``) on a 784-128-10
ReLU→sigmoid MSE network at batch 1, 16 and 64, same data, same epochs.

Run: ``PYTHONPATH=. python bench/bench_train.py --gpu`` (on a CUDA machine) or ``--cpu``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "tests")  # loom_oracle, for the CPU comparison

import torchloom  # noqa: E402
from torchloom import Dense, Network, TrainingConfig  # noqa: E402

SIZES = (784, 256, 256, 10)


# ------------------------------------------------------------------------------------------ GPU
def _torch_model(dev):
    return torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(),
        torch.nn.Linear(SIZES[1], SIZES[2]), torch.nn.ReLU(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    ).to(dev)


def _loom_model(dev):
    return Network(Dense(SIZES[0], SIZES[1], "relu"), Dense(SIZES[1], SIZES[2], "relu"), Dense(SIZES[2], SIZES[3])).to(dev)


def _make_opt(params, name, lr, capturable=False):
    """torch's optimizer for the baselines; ``capturable`` for the graph-captured ones (AdamW keeps its
    step count on the device then, as graph capture requires)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, capturable=capturable)


def _time_loop(fn, steps, dev):
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    fn(steps)
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t) / steps


def bench_gpu_case(batch, opt_name, n_batches, repeats, dev, do_compile=True):
    lr = 0.01 if opt_name == "sgd" else 1e-3
    g = torch.Generator(device=dev).manual_seed(0)
    xs = torch.rand(n_batches, batch, SIZES[0], device=dev, generator=g)
    ys = torch.rand(n_batches, batch, SIZES[-1], device=dev, generator=g)
    out = {}

    # torchloom train(): min over epochs after the first (which includes capture)
    net = _loom_model(dev)
    batches = [(xs[i], ys[i]) for i in range(n_batches)]
    cfg = TrainingConfig(epochs=repeats + 1, learning_rate=lr, optimizer=opt_name, use_gpu=True, verbose=False)
    res = torchloom.train(net, batches, cfg)
    out["torchloom"] = min(res.epoch_times[1:]) / n_batches

    # eager PyTorch
    model = _torch_model(dev)
    opt = _make_opt(model.parameters(), opt_name, lr)

    def eager(steps):
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(xs[i % n_batches]), ys[i % n_batches])
            loss.backward()
            opt.step()

    eager(10)
    out["eager"] = min(_time_loop(eager, n_batches, dev) for _ in range(repeats))

    # hand CUDA-graphed PyTorch step
    model = _torch_model(dev)
    opt = _make_opt(model.parameters(), opt_name, lr, capturable=True)
    sx, sy = xs[0].clone(), ys[0].clone()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(sx), sy).backward()
            opt.step()
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = F.mse_loss(model(sx), sy)
        static_loss.backward()
        opt.step()

    def graphed(steps):
        for i in range(steps):
            sx.copy_(xs[i % n_batches])
            sy.copy_(ys[i % n_batches])
            graph.replay()

    graphed(10)
    out["cuda_graph"] = min(_time_loop(graphed, n_batches, dev) for _ in range(repeats))

    # torch.compile(mode="reduce-overhead") of the model and loss (its backward compiled with it);
    # the optimizer step stays eager (foreach), the usual way to compile a training step
    if do_compile:
        model = _torch_model(dev)
        opt = _make_opt(model.parameters(), opt_name, lr)

        @torch.compile(mode="reduce-overhead")
        def fwd_loss(x, y):
            return F.mse_loss(model(x), y)

        def compiled(steps):
            for i in range(steps):
                torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier graph outputs may be reused
                opt.zero_grad(set_to_none=True)
                fwd_loss(xs[i % n_batches], ys[i % n_batches]).backward()
                opt.step()

        try:
            compiled(10)
            out["compile"] = min(_time_loop(compiled, n_batches, dev) for _ in range(repeats))
        except Exception as e:  # report, don't hide: the table shows the failure
            print(f"torch.compile failed at batch {batch} ({opt_name}): {type(e).__name__}: {e}", flush=True)
            out["compile"] = float("nan")
    else:
        out["compile"] = float("nan")
    return out


def run_gpu(args):
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the same float32 GEMMs for everyone
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    cases = [(b, "sgd") for b in args.batches] + [(1024, "adamw")]
    rows = []
    for batch, opt_name in cases:
        n_batches = args.steps if batch <= 1024 else max(8, args.steps // 16)
        t0 = time.perf_counter()
        r = bench_gpu_case(batch, opt_name, n_batches, args.repeats, dev, do_compile=not args.no_compile)
        rows.append((batch, opt_name, r))
        print(f"batch {batch} {opt_name}: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in r.items())
              + f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    lines = [
        "| batch | optimizer | torchloom µs/step | eager µs | CUDA-graph µs | compile µs | eager / torchloom | graph / torchloom | compile / torchloom |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, opt_name, r in rows:
        t = r["torchloom"]
        lines.append(
            f"| {batch} | {opt_name} | {t * 1e6:.1f} | {r['eager'] * 1e6:.1f} | {r['cuda_graph'] * 1e6:.1f} | "
            f"{r['compile'] * 1e6:.1f} | {r['eager'] / t:.2f}× | {r['cuda_graph'] / t:.2f}× | {r['compile'] / t:.2f}× |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CPU
def run_cpu(args):
    import numpy as np
    from loom_oracle import LoomDense, welvet

    if welvet is None:
        raise SystemExit("the CPU comparison needs Loom's binding: pip install welvet==0.80.0")
    lines = [
        "| batch | Loom samples/s | torchloom samples/s | torchloom / Loom |",
        "|---:|---:|---:|---:|",
    ]
    for batch in (1, 16, 64):
        n = args.cpu_samples if batch > 1 else args.cpu_samples // 4
        nb = n // batch
        torch.manual_seed(0)
        net = Network(Dense(784, 128, "relu", bias=False), Dense(128, 10, "sigmoid", bias=False))
        rng = np.random.RandomState(0)
        x = rng.rand(nb, batch, 784).astype(np.float32)
        y = rng.rand(nb, batch, 10).astype(np.float32)
        loom_rates, ours = [], []
        for _ in range(args.repeats):
            loom = LoomDense([784, 128, 10], ["relu", "sigmoid"], [l.weight.detach().numpy() for l in net])
            t = time.perf_counter()
            loom.train(x, y, epochs=1, learning_rate=0.01)
            loom_rates.append(nb * batch / (time.perf_counter() - t))
            loom.close()
        batches = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(x, y)]
        res = torchloom.train(net, batches, TrainingConfig(epochs=args.repeats + 1, learning_rate=0.01, verbose=False))
        ours = [nb * batch / t for t in res.epoch_times[1:]]
        lo, to = statistics.median(loom_rates), statistics.median(ours)
        lines.append(f"| {batch} | {lo:,.0f} | {to:,.0f} | {to / lo:.1f}× |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 1024, 16384])
    p.add_argument("--steps", type=int, default=200, help="batches per epoch (fewer at batch 16384)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu-samples", type=int, default=4096)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", help="also write the table(s) to this file")
    args = p.parse_args()
    if not (args.gpu or args.cpu):
        p.error("choose --gpu and/or --cpu")
    tables = []
    if args.gpu:
        tables.append(run_gpu(args))
    if args.cpu:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        tables.append(run_cpu(args))
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
