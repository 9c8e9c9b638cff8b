"""Peak GPU memory of an LSTM's first forward + backward (issue 36, item 3): torchloom's LSTM against
``nn.LSTM`` (cuDNN), each in a fresh process: once cold, once after a tiny matmul has created the
process's cuBLAS workspaces (which torchloom's input projections allocate on a cold first call, and which
any ``nn.Linear`` of a model creates anyway; cuDNN's LSTM does not use cuBLAS).

Run: ``PYTHONPATH=. python bench/lstm_first_call_memory.py`` on a CUDA machine (default shape
64×64×256×256, float32; ``--shape B,T,I,H``, ``--dtype bfloat16``). Prints, per side, the peak of
``torch.cuda.max_memory_allocated`` above what was allocated before the call (input, parameters and
the output gradient), for the first call and for the second, and the ratio torchloom / cuDNN, for both
processes. Target: the first call's ratio ≤ 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _measure(which: str, shape: tuple[int, int, int, int], dtype_name: str, warm_cublas: bool) -> dict:
    import torch

    b, t, i, h = shape
    dev = torch.device("cuda")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    if warm_cublas:  # the process's cuBLAS workspaces, which any nn.Linear of the model creates anyway
        a = torch.ones(16, 16, device=dev, dtype=dtype)
        torch.mm(a, a), torch.addmm(a[0], a, a)
        torch.cuda.synchronize()
    if which == "torchloom":
        from torchloom import LSTM

        m = LSTM(i, h, device=dev, dtype=dtype)
        fwd = m
    else:
        m = torch.nn.LSTM(i, h, batch_first=True, device=dev, dtype=dtype)
        fwd = lambda x: m(x)[0]  # noqa: E731
    x = torch.randn(b, t, i, device=dev, dtype=dtype, requires_grad=True)
    gy = torch.randn(b, t, h, device=dev, dtype=dtype)
    out = {}
    for call in ("first", "second"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd(x).backward(gy)
        torch.cuda.synchronize()
        out[call] = torch.cuda.max_memory_allocated() - base
        x.grad = None
        m.zero_grad(set_to_none=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64,64,256,256", help="B,T,I,H")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--warm-cublas", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.child:
        print("RESULT " + json.dumps(_measure(args.child, shape, args.dtype, args.warm_cublas)))
        return 0
    for warm in (False, True):
        results = {}
        for which in ("torchloom", "cudnn"):
            cmd = [sys.executable, __file__, "--shape", args.shape, "--dtype", args.dtype, "--child", which]
            proc = subprocess.run(cmd + (["--warm-cublas"] if warm else []), capture_output=True, text=True, env=dict(os.environ))
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{which} failed:\n{proc.stderr[-2000:]}")
                return 1
            results[which] = json.loads(lines[-1][len("RESULT "):])
        mb = lambda v: f"{v / 2**20:.1f} MB"  # noqa: E731
        process = "cuBLAS already used by the process" if warm else "cold process"
        for call in ("first", "second"):
            ours, theirs = results["torchloom"][call], results["cudnn"][call]
            print(f"{call} call ({process}), {args.shape} {args.dtype}: torchloom {mb(ours)}, cuDNN {mb(theirs)}, "
                  f"ratio {ours / max(theirs, 1):.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
