"""Elman RNN on CUDA (issue 16): the persistent loop kernel (``torchloom.kernels.recurrent``,
``_rnn_loop_kernel``: each direction's time loop in one launch) against the CUDA-graphed per-step
cuBLAS loop it replaces and against cuDNN's ``nn.RNN``.

    PYTHONPATH=. python bench/bench_rnn_loop.py [--sweep [--use-swept]] [--out FILE]

1. ``check``: forward and backward on the kernel and on the graphed loop against a float64 truth
   (fp32 with TF32 off and on, bf16, fp16; several shapes): the kernel's error must stay within twice
   the graphed loop's plus a floor, and the grid's step counters must show no abandoned wait.
2. ``--sweep``: launch settings of the kernel alone (its forward and backward loops, B=64, T=64,
   H=256) for fp32 "ieee", 3-pass TF32 ("tf32x3"), TF32 and bf16; with ``--use-swept`` the best of
   each is used for the table's B=64/T=64/H=256 rows (marked *), else the defaults.
3. The tables: forward + backward of the layer (``y = RNN(x); y.backward(g)``, input gradient
   included) against ``nn.RNN`` (cuDNN, ``bias_hh`` zero), timed as bench/bench_layers.py does:
   "graphed" (ten steps in one CUDA graph, replayed: the device's time, the column issue 16 quotes)
   and eager (host launch overhead included). ``torch.backends.cudnn.allow_tf32`` (cuDNN's RNN, and
   torchloom's loop kernel and projections, which follow the same switch) and
   ``torch.backends.cuda.matmul.allow_tf32`` (cuBLAS) are both on ("tf32") or both off ("ieee"; the
   kernel's "tf32x3" column is TF32 off with 3-pass TF32 products); "graphed"
   is the per-step cuBLAS loop the kernel replaces (``recurrent.USE_PERSISTENT_RNN = False``).
   Target: ≤ 1.5× cuDNN.

``--smoke`` runs every part at tiny sizes (CPU: Triton's interpreter, which must be on), to check the
script, not to time anything.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke on CPU

from torchloom.kernels import recurrent as K  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layers as BL  # noqa: E402
from torchloom.layers.rnn import RNN, rnn_backward, rnn_forward  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def precision(p: str | None):
    """fp32 products of both sides: "tf32" turns TF32 on for cuDNN (whose RNN switch torchloom's loop
    kernel and projections follow) and cuBLAS; "ieee" / "tf32x3" turn it off (the kernel then uses
    that input precision); None: bf16/fp16."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, K._FP32_PRODUCT
    on = p == "tf32"
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = on
    K._FP32_PRODUCT = p if p in ("ieee", "tf32x3") else "ieee"
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, K._FP32_PRODUCT = old


@contextlib.contextmanager
def persistent(on: bool):
    old, K.USE_PERSISTENT_RNN = K.USE_PERSISTENT_RNN, on
    try:
        yield
    finally:
        K.USE_PERSISTENT_RNN = old


# ----------------------------------------------------------------------------------------- timing
# bench/bench_layers.py's timers (its "graphed" column is what issue 16 quotes), here in milliseconds.
_DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def time_fn(fn, target_s: float) -> float:
    """Median ms per call (``bench_layers.time_fn``)."""
    return BL.time_fn(fn, _DEV, target_s) * 1e3


def graphed_time(fn, target_s: float, steps: int = 10) -> float:
    """Median ms per call with ``steps`` calls captured in one CUDA graph and replayed
    (``bench_layers.graphed_time``; on CPU: ``time_fn``)."""
    if _DEV.type != "cuda":
        return time_fn(fn, target_s)
    return BL.graphed_time(fn, _DEV, target_s, steps) * 1e3


def _params(B, T, I, H, dtype, dev):
    g = torch.Generator(device="cpu").manual_seed(B * 1000 + T * 10 + H)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dev, dtype)  # noqa: E731
    return r(B, T, I), r(H, I, scale=I**-0.5), r(H, H, scale=1.2 * H**-0.5), r(H, scale=0.3), r(B, T, H)


def _cudnn(w_ih, w_hh, b):
    H, I = w_ih.shape
    m = torch.nn.RNN(I, H, batch_first=True, device=w_ih.device, dtype=w_ih.dtype)
    with torch.no_grad():
        m.weight_ih_l0.copy_(w_ih), m.weight_hh_l0.copy_(w_hh), m.bias_ih_l0.copy_(b), m.bias_hh_l0.zero_()
    m.flatten_parameters()
    return m


# ------------------------------------------------------------------------------------------ check
def check(shapes, dev, log) -> bool:
    """Kernel and graphed loop (and, with TF32, cuDNN) against the float64 truth; the kernel's error
    must be at most twice the larger of theirs plus 4 ulp (of the precision used: TF32's with TF32,
    where cuBLAS and cuDNN may not use it at small sizes) of the largest value, with no NaN, and the
    same in ten runs."""
    ok = True
    log(f"{'case':<22} {'hidden: kernel / other':>24} {'dx: kernel / other':>22} {'dW_hh: kernel / other':>24}  result")
    for (B, T, H), name in itertools.product(shapes, ("fp32", "tf32x3", "tf32", "bf16", "fp16")):
        dtype = DTYPES.get(name, torch.float32)
        x, w_ih, w_hh, b, g = _params(B, T, H, H, dtype, dev)
        y64, s64 = rnn_forward(x.double(), w_ih.double(), w_hh.double(), b.double())
        gx64, (_, gw64, _) = rnn_backward(g.double(), s64)
        with precision({"fp32": "ieee", "tf32x3": "tf32x3", "tf32": "tf32"}.get(name)):
            y, s = rnn_forward(x, w_ih, w_hh, b, backend="triton")
            gx, (_, gw, _) = rnn_backward(g, s, backend="triton")
            yo, so = rnn_forward(x, w_ih, w_hh, b, backend="reference")
            gxo, (_, gwo, _) = rnn_backward(g, so, backend="reference")
            others = [(yo, gxo, gwo)]
            if name == "tf32" and dev.type == "cuda":  # cuDNN's TF32, PyTorch's own error at that precision
                m = _cudnn(w_ih, w_hh, b)
                xr = x.clone().requires_grad_()
                yc = m(xr)[0]
                gxc, gwc = torch.autograd.grad(yc, (xr, m.weight_hh_l0), g)
                others.append((yc.detach(), gxc, gwc))
            runs = []  # a race between the programs would show as run-to-run differences
            for _ in range(10):
                runs.append(torch.empty_like(y))
                K._launch_rnn_loop(runs[-1], s.pre.clone(), s.pre, w_hh, backward=False)
            same = all(torch.equal(r, runs[0]) for r in runs[1:])
        cells, good = [], same
        for i, (got, want) in enumerate(((y, y64), (gx, gx64), (gw, gw64))):
            e = (got.double() - want).abs().max().item()
            eo = max((o[i].double() - want).abs().max().item() for o in others)
            eps = 2.0**-10 if name == "tf32" else torch.finfo(dtype).eps  # TF32: 10 mantissa bits
            floor = 4 * eps * want.abs().max().item()
            good &= e <= 2 * eo + floor  # a NaN fails here
            cells.append(f"{e:.2e} / {eo:.2e}")
        ok &= good
        log(f"B{B} T{T} H{H} {name:<7} {cells[0]:>24} {cells[1]:>22} {cells[2]:>24}  {'PASS' if good else 'FAIL'}"
            f"{'' if same else ' (runs differ)'}")
    return ok


# ------------------------------------------------------------------------------------------ sweep
def sweep(dev, log, budget_s, smoke) -> dict:
    """Best settings of the loop kernel (forward, B=64, T=64, H=256) per product precision."""
    B, T, H = (20, 2, 64) if smoke else (64, 64, 256)
    sms = K._sm_count(dev.index or 0) if dev.type == "cuda" else 10**9
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    # (block_b, block_n, block_k, num_warps), the likeliest first: each costs a compile
    grids = {
        "ieee": [(16, 16, 256, 4), (16, 16, 256, 8), (16, 16, 128, 4), (16, 16, 64, 4), (16, 32, 256, 4),
                 (32, 16, 256, 4), (16, 16, 256, 2), (32, 32, 256, 8), (16, 16, 128, 8), (16, 16, 64, 8)],
        "tf32x3": [(16, 16, 256, 4), (16, 16, 128, 4), (16, 16, 256, 8), (16, 16, 64, 2), (16, 16, 128, 2)],
        "tf32": [(16, 16, 256, 2), (16, 16, 128, 2), (16, 16, 256, 4), (16, 16, 64, 2), (16, 16, 64, 1), (16, 32, 256, 4)],
        "bf16": [(16, 16, 256, 2), (16, 16, 128, 2), (16, 16, 256, 4), (16, 16, 64, 2), (16, 16, 128, 1), (16, 32, 256, 4)],
    }
    best = {}
    for case, grid in grids.items():
        t_start = time.perf_counter()
        dtype = torch.bfloat16 if case == "bf16" else torch.float32
        pre0 = torch.randn(B, T, H, device=dev, dtype=dtype)
        w = (torch.randn(H, H, device=dev) * H**-0.5).to(dtype)
        g = torch.randn(B, T, H, device=dev, dtype=dtype)
        hid, gp = torch.empty_like(pre0), torch.empty_like(pre0)
        rows = []
        with precision(None if case == "bf16" else case):
            for bb, bn, bk, warps in grid:
                if cdiv(B, bb) * cdiv(H, bn) > sms or bk > H:
                    continue
                if time.perf_counter() - t_start > budget_s / len(grids):
                    log(f"  {case}: sweep stopped at its time budget ({budget_s / len(grids):.0f} s)")
                    break
                st = K.RNNLoopSettings(bb, bn, bk, 1, cdiv(H, bn), warps)
                if dev.type != "cuda":
                    st = st._replace(col_tiles=cdiv(H, bn), col_programs=1)
                pre = pre0.clone()
                try:
                    fwd = graphed_time(lambda st=st, pre=pre: K._launch_rnn_loop(hid, pre, pre, w, False, st), 0.1)
                    bwd = graphed_time(lambda st=st: K._launch_rnn_loop(gp, g, hid, w, True, st), 0.1)
                except Exception as e:  # noqa: BLE001 (a setting the compiler refuses is skipped)
                    log(f"  {case} {st}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                if hid.isnan().any() or gp.isnan().any():
                    log(f"  {case} {st}: NaN (a wait gave up)")
                    continue
                rows.append((fwd + bwd, fwd, bwd, st))
        rows.sort(key=lambda r: r[0])
        for _, fwd, bwd, st in rows[:3]:
            log(f"  {case:<6} loops: forward {fwd * 1e3:6.1f} µs, backward {bwd * 1e3:6.1f} µs  "
                f"bb={st.block_b} bn={st.block_n} bk={st.block_k} warps={st.num_warps}")
        if rows:
            best[case] = rows[0][3]
    return best


# ------------------------------------------------------------------------------------------ table
def layer_ms(B, T, H, dtype, dev, mode, prec, target, graphed) -> float:
    """Forward + backward of the layer (mode "kernel" / "graphed") or nn.RNN ("cudnn")."""
    x, w_ih, w_hh, b, g = _params(B, T, H, H, dtype, dev)
    x.requires_grad_()
    if mode == "cudnn":
        m = _cudnn(w_ih, w_hh, b)
        step = BL._step(lambda x: m(x)[0], x, g, m.parameters())
    else:
        m = RNN(H, H, device=dev, dtype=dtype)
        with torch.no_grad():
            m.weight_ih.copy_(w_ih), m.weight_hh.copy_(w_hh), m.bias.copy_(b)
        step = BL._step(m, x, g, m.parameters())

    with precision(prec), persistent(mode != "graphed"):
        return graphed_time(step, target) if graphed else time_fn(step, target)


COLUMNS = [("cudnn", "tf32"), ("cudnn", "ieee"), ("kernel", "tf32"), ("kernel", "tf32x3"), ("kernel", "ieee"),
           ("graphed", "tf32"), ("graphed", "ieee")]


def table(shapes, dev, log, target, tuned, graphed) -> None:
    head = " | ".join(f"{m} {p}" for m, p in COLUMNS)
    log(f"| B | T | H | dtype | {head} | kernel/cuDNN (tf32) | kernel ieee/cuDNN (ieee) | kernel x3/cuDNN (tf32) "
        "| kernel ieee/cuDNN (tf32) | graphed/kernel (ieee) |")
    log("|" + "---|" * (4 + len(COLUMNS) + 5))
    f = lambda v: "—" if v != v else f"{v:.3f}"  # noqa: E731
    q = lambda a, b: "—" if a != a or b != b else f"{a / b:.2f}×"  # noqa: E731
    for B, T, H in shapes:
        for name in ("fp32", "bf16"):
            dtype, r, star = DTYPES[name], {}, ""
            for mode, prec in COLUMNS:
                if dtype != torch.float32 and prec != "ieee":
                    r[mode, prec] = float("nan")  # one row per half dtype: the product precision is its own
                    continue
                if mode != "kernel" and prec == "tf32x3":
                    continue
                p = prec if dtype == torch.float32 else None
                with _tuned(tuned, B, T, H, p or name) as hit:
                    r[mode, prec] = layer_ms(B, T, H, dtype, dev, mode, p, target, graphed)
                    star = star or ("*" if hit and mode == "kernel" else "")
            c = " | ".join(f(r[k]) for k in COLUMNS)
            log(f"| {B} | {T} | {H} | {name}{star} | {c} | {q(r['kernel', 'tf32'], r['cudnn', 'tf32'])} "
                f"| {q(r['kernel', 'ieee'], r['cudnn', 'ieee'])} | {q(r['kernel', 'tf32x3'], r['cudnn', 'tf32'])} "
                f"| {q(r['kernel', 'ieee'], r['cudnn', 'tf32'])} | {q(r['graphed', 'ieee'], r['kernel', 'ieee'])} |")


@contextlib.contextmanager
def _tuned(tuned: dict, B, T, H, case):
    """The sweep's best settings for the sweep's shape (else the defaults) while timing."""
    st = tuned.get(case) if (B, T, H) == (64, 64, 256) else None
    if st is None:
        yield False
        return
    default = K._rnn_loop_settings
    K._rnn_loop_settings = lambda x, b, h: st if (b, h) == (B, H) else default(x, b, h)
    try:
        yield True
    finally:
        K._rnn_loop_settings = default


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="sweep the kernel's launch settings first")
    ap.add_argument("--sweep-budget", type=float, default=60.0, help="seconds for the sweep (shared by its cases)")
    ap.add_argument("--use-swept", action="store_true", help="time the 64/64/256 rows with the sweep's best settings")
    ap.add_argument("--target", type=float, default=0.25, help="seconds per timing")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="only the graphed (device-time) table")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; on CPU through Triton's interpreter")
    ap.add_argument("--w-reload", action="store_true",
                    help="the kernel re-reads W_hh every step (no W_RESIDENT): the A/B of holding it in registers")
    ap.add_argument("--w-copy", action="store_true",
                    help="the kernel holds a row-major copy of W_hhᵀ (no in-place read): the A/B of reading it in place")
    ap.add_argument("--out", default=None, help="also write the log here")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        print("needs a CUDA GPU (or --smoke)")
        return 0
    K._RNN_W_RESIDENT = not args.w_reload
    K._RNN_W_IN_PLACE = not args.w_copy
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter)"
    log(f"# {name}, torch {torch.__version__}, triton {triton.__version__}")
    target = 0.02 if args.smoke else args.target
    ok = True
    if not args.no_check:
        t0 = time.perf_counter()
        shapes = ([(3, 4, 24), (20, 2, 40)] if args.smoke
                  else [(64, 64, 256), (32, 128, 256), (64, 16, 512), (7, 33, 100), (130, 12, 48)])
        ok = check(shapes, dev, log)
        log(f"check: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s)")
    tuned = {}
    if args.sweep:
        t0 = time.perf_counter()
        best = sweep(dev, log, args.sweep_budget, args.smoke)
        log(f"sweep: {time.perf_counter() - t0:.0f} s; best: {best}")
        tuned = best if args.use_swept else {}
    x = torch.empty(1, device=dev)
    log(f"default settings at B=64, H=256: {K._rnn_loop_settings(x, 64, 256)}")
    shapes = [(3, 4, 24)] if args.smoke else [(64, 64, 256), (32, 128, 256), (64, 64, 512)]
    for graphed in (True,) if args.no_eager else (True, False):
        t0 = time.perf_counter()
        log(f"\n{'graphed (device time: ten steps in one CUDA graph)' if graphed else 'eager (host launch overhead included)'}: "
            "ms per forward + backward (input gradient included); * = swept settings at 64/64/256")
        table(shapes, dev, log, target, tuned, graphed)
        log(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
