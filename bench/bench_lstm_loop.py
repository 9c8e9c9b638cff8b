"""LSTM on CUDA (issue 36): the persistent loop kernel (``torchloom.kernels.recurrent``,
``_lstm_loop_kernel``: each direction's time loop in one launch) against the CUDA-graphed per-step loop
it replaces (a cuBLAS product and a fused cell kernel per step) and against cuDNN's ``nn.LSTM``.

    PYTHONPATH=. python bench/bench_lstm_loop.py [--sweep] [--shapes B,T,H;...] [--target S]

1. ``--sweep``: launch settings of the kernel alone (its forward and backward loops at the first
   shape): K chunk × warps × tile, for fp32 "ieee" (exact products: the default), 3-pass TF32
   ("tf32x3") and bf16. The best of each went into ``_lstm_loop_settings``.
2. The table: forward + backward of the layer (``y = LSTM(x); y.backward(g)``, input gradient included)
   against ``nn.LSTM`` (cuDNN), "graphed" (ten steps in one CUDA graph, replayed: the device's time)
   and eager (host launch overhead included). torchloom's fp32 products are exact (``torch.backends.
   cuda.matmul.allow_tf32`` off, PyTorch's default); cuDNN's follow ``torch.backends.cudnn.allow_tf32``
   (on by default: TF32), so its fp32 row is given both ways. Targets (issue 36): ≤ 1.0× cuDNN.

Numbers: bench/RESULTS.md §10.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layers as BL  # noqa: E402
from torchloom.kernels import recurrent as K  # noqa: E402
from torchloom.layers.lstm import LSTM  # noqa: E402

DEV = torch.device("cuda")


def _events_ms(fn, n: int = 20) -> float:
    """Median ms of ``fn`` between two CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]


def sweep(B: int, T: int, H: int) -> None:
    print(f"\nSweep of the loop kernel alone, B={B} T={T} H={H} (ms per launch; diff = max |Δ| against the first setting)")
    print("| precision | direction | tile | K chunk | warps | ms | diff |\n|---|---|---|---:|---:|---:|---:|")
    old = K._FP32_PRODUCT
    for prec, dtype in (("ieee", torch.float32), ("tf32x3", torch.float32), ("bf16", torch.bfloat16)):
        K._FP32_PRODUCT = prec if dtype == torch.float32 else "ieee"
        g = torch.Generator(device="cpu").manual_seed(0)
        r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(DEV, dtype)  # noqa: E731
        proj, w, gout = r(B, T, 4 * H), r(4 * H, H, scale=H**-0.5), r(B, T, H)
        ref = None
        for (bb, bn), bk, warps in itertools.product(((16, 16), (16, 32)), (64, 128, 256), (4, 8)):
            st = K.RNNLoopSettings(bb, bn, min(bk, H), 1, -(-H // bn), warps)
            pre, cell, hid = proj.clone(), torch.empty(B, T, H, device=DEV, dtype=dtype), torch.empty(B, T, H, device=DEV, dtype=dtype)
            g_pre = torch.empty(B, T, 4 * H, device=DEV, dtype=dtype)
            fwd = _events_ms(lambda: K._launch_lstm_loop(pre.copy_(proj), cell, w, hidden=hid, settings=st))
            bwd = _events_ms(lambda: K._launch_lstm_loop(pre, cell, w, grad_out=gout, g_pre=g_pre, settings=st))
            ref = ref or (hid.clone(), g_pre.clone())
            for name, ms, out, want in (("forward", fwd, hid, ref[0]), ("backward", bwd, g_pre, ref[1])):
                diff = (out.float() - want.float()).abs().max().item()
                print(f"| {prec} | {name} | {bb}×{bn} | {bk} | {warps} | {ms:.3f} | {diff:.1e} |", flush=True)
    K._FP32_PRODUCT = old


def layer_ms(B, T, H, dtype, mode, cudnn_tf32, target, graphed) -> float:
    """Forward + backward of torchloom's LSTM (mode "kernel" / "steps") or nn.LSTM ("cudnn")."""
    torch.manual_seed(0)
    x = torch.randn(B, T, H, device=DEV, dtype=dtype, requires_grad=True)
    g = torch.randn(B, T, H, device=DEV, dtype=dtype)
    if mode == "cudnn":
        m = torch.nn.LSTM(H, H, batch_first=True, device=DEV, dtype=dtype)
        step = BL._step(lambda x: m(x)[0], x, g, m.parameters())
    else:
        m = LSTM(H, H, device=DEV, dtype=dtype)
        step = BL._step(m, x, g, m.parameters())

    old = K.USE_PERSISTENT_LSTM, torch.backends.cudnn.allow_tf32
    K.USE_PERSISTENT_LSTM, torch.backends.cudnn.allow_tf32 = mode != "steps", cudnn_tf32
    try:
        return (BL.graphed_time(step, DEV, target) if graphed else BL.time_fn(step, DEV, target)) * 1e3
    finally:
        K.USE_PERSISTENT_LSTM, torch.backends.cudnn.allow_tf32 = old


def table(shapes, target: float) -> None:
    for graphed in (True, False):
        print(f"\n{'Graphed (device time)' if graphed else 'Eager (host launch overhead included)'}, forward + backward, ms")
        print("| B | T | H | dtype | loop kernel | per-step loop | cuDNN (TF32) | cuDNN (fp32) | kernel / cuDNN default | kernel / per-step |")
        print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        for (B, T, H), dtype in itertools.product(shapes, (torch.float32, torch.bfloat16)):
            kern = layer_ms(B, T, H, dtype, "kernel", True, target, graphed)
            steps = layer_ms(B, T, H, dtype, "steps", True, target, graphed)
            cud_tf32 = layer_ms(B, T, H, dtype, "cudnn", True, target, graphed)
            cud_fp32 = layer_ms(B, T, H, dtype, "cudnn", False, target, graphed) if dtype == torch.float32 else float("nan")
            name = str(dtype).replace("torch.", "")
            print(f"| {B} | {T} | {H} | {name} | {kern:.3f} | {steps:.3f} | {cud_tf32:.3f} | {cud_fp32:.3f} | "
                  f"{kern / cud_tf32:.2f}× | {kern / steps:.2f}× |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="sweep the kernel's launch settings first")
    ap.add_argument("--shapes", default="64,64,256;32,128,256;64,16,512", help="B,T,H;...")
    ap.add_argument("--target", type=float, default=0.1, help="seconds per timing")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_lstm_loop.py needs a CUDA GPU")
        return 1
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.sweep:
        sweep(*shapes[0])
    table(shapes, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
