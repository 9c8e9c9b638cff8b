"""Small-batch Dense backward on CUDA: the fused kernel (kernels/dense_small.py) against the cuBLAS path.

For each batch size M and layer shape, times one backward (activation gradient, ``dW``, ``db``, ``dx``
as four kernels vs one fused kernel) inside a CUDA graph of 50 repetitions, so launch gaps count as
they do in a captured training step. The crossover sets ``SMALL_BATCH_MAX``.
Run: ``PYTHONPATH=. python bench/bench_dense_small.py``.
"""

from __future__ import annotations

import argparse

import torch

from torchloom.kernels import dense_small as ds

REPS = 50


def graph_time(fn, reps=REPS):
    """Microseconds per call of ``fn`` replayed inside one CUDA graph of ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * reps))
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024])
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(784, 256, "relu"), (256, 256, "relu"), (256, 10, "linear")]
    rows = ["| M | layer | bwd torch µs | bwd fused µs | max err |", "|---:|---|---:|---:|---:|"]
    for m in args.batches:
        for k, n, act in shapes:
            x = torch.randn(m, k, device="cuda")
            w = torch.randn(n, k, device="cuda") / k**0.5
            b = torch.randn(n, device="cuda")
            g = torch.randn(m, n, device="cuda")
            pre = torch.addmm(b, x, w.t())
            t_bwd_ref = graph_time(lambda: ds.dense_small_backward_ref(g, pre, x, w, act, True, True))
            t_bwd = graph_time(lambda: ds.dense_small_backward(g, pre, x, w, act, True, True, backend="triton"))
            got = ds.dense_small_backward(g, pre, x, w, act, True, True, backend="triton")
            ref = ds.dense_small_backward_ref(g.double(), pre.double(), x.double(), w.double(), act, True, True)
            err = max(float((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)) for a, r in zip(got, ref))
            rows.append(f"| {m} | {k}→{n} {act} | {t_bwd_ref:.2f} | {t_bwd:.2f} | {err:.1e} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
