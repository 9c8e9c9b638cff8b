"""Benchmark torchloom's fused kernels (issue 3) against eager PyTorch, torch.optim
(foreach / fused) and torch.compile, and against the device-to-device copy bandwidth.

    python bench/bench_kernels.py                      # on a CUDA GPU: 1M, 16M, 64M float32 elements
    python bench/bench_kernels.py --out bench/h100.md  # also write the table to a file
    python bench/bench_kernels.py --dry-run            # CPU: interpreter correctness + tiny sizes (CI-safe)

Not run in CI. One process; on an H100 it should finish in about 2 minutes (``--budget`` seconds is a
hard stop: anything left is reported as skipped). Each timing is the median of
``triton.testing.do_bench`` (which clears the L2 cache before every call), and every call also
rotates between two sets of input buffers, so no implementation runs from cache. Bytes per element,
each tensor read once and written once: MSE 12 (o, y in; grad out), SGD 12 (w, g in; w out),
momentum 20, AdamW 28, RMSprop 20; "% copy" is the achieved bytes/s over ``dst.copy_(src)``'s.

Targets (issue 3, sizes >= 16M): MSE >= 90 % of copy bandwidth, >= 2.5x eager, not slower than
torch.compile; SGD / momentum / AdamW >= 85 % of copy bandwidth; AdamW faster than
torch.optim.AdamW(fused=True). The table ends with a PASS/FAIL line per target.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}
DRY_SIZES = {"4K": 4096, "16K": 16384}
BYTES = {"mse": 12, "sgd": 12, "momentum": 20, "adamw": 28, "rmsprop": 20}
LR = 1e-3
ADAMW = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ROTATE = 2  # input sets per implementation, used in turn


# ----------------------------------------------------------------------------------------- timing
def cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the GPU (do_bench: L2 cleared before each call)."""
    from triton.testing import do_bench

    out = do_bench(fn, warmup=25, rep=100, quantiles=[0.5])
    return float(out[0] if isinstance(out, (list, tuple)) else out)


def cpu_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the CPU (dry run: exercises the pipeline, not a measurement)."""
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rotating(sets: list[tuple], call: Callable[..., object]) -> Callable[[], object]:
    """A zero-argument function calling ``call(*sets[i])`` with ``i`` cycling through the sets."""
    state = {"i": 0}

    def fn():
        i = state["i"]
        state["i"] = (i + 1) % len(sets)
        return call(*sets[i])

    return fn


# -------------------------------------------------------------------------------- implementations
def mse_eager(o: torch.Tensor, y: torch.Tensor):
    d = o - y
    return (d * d).mean(), 2 * d / d.numel()


def sgd_eager(w, g):
    w.add_(g, alpha=-LR)


def momentum_eager(w, g, v):
    v.mul_(0.9).add_(g)
    w.add_(v, alpha=-LR)


def adamw_eager(w, g, m, v):
    # step 10's bias corrections, fixed: a changing Python number would recompile under torch.compile
    bc1, bc2 = 1 - 0.9**10, 1 - 0.999**10
    w.mul_(1 - LR * 0.01)
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    w.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(1e-8), value=-LR / bc1)


def rmsprop_eager(w, g, s):
    s.mul_(0.99).addcmul_(g, g, value=0.01)
    w.addcdiv_(g, s.sqrt().add_(1e-8), value=-LR)


@dataclass
class Row:
    op: str
    size: str
    n: int
    impl: str
    ms: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _tensors(n: int, k: int, device: str) -> list[tuple]:
    """``ROTATE`` sets of ``k`` float32 tensors of ``n`` elements (state tensors positive where it matters)."""
    return [tuple(torch.rand(n, device=device) + 0.1 for _ in range(k)) for _ in range(ROTATE)]


def _torch_opt_call(factory: Callable, n: int, device: str) -> Callable[[], object]:
    """A torch.optim optimizer per input set, stepped once first so its state exists."""
    opts = []
    for w, g in _tensors(n, 2, device):
        p = torch.nn.Parameter(w)
        p.grad = g
        opt = factory([p])
        opt.step()
        opts.append((opt,))
    return rotating(opts, lambda opt: opt.step())


def implementations(op: str, n: int, device: str, compile_ok: bool) -> dict[str, Callable[[], Callable[[], object]] | None]:
    """label → builder of a timed zero-argument function (None: not available here)."""
    from torchloom.kernels.adamw import adamw_update_
    from torchloom.kernels.mse import mse_loss_grad
    from torchloom.kernels.rmsprop import rmsprop_update_
    from torchloom.kernels.sgd import sgd_update_

    backend = "triton"
    compiled = (lambda f: torch.compile(f, dynamic=True)) if compile_ok else None
    if op == "mse":
        return {
            "torchloom": lambda: rotating(_tensors(n, 2, device), lambda o, y: mse_loss_grad(o, y, backend=backend)),
            "eager": lambda: rotating(_tensors(n, 2, device), mse_eager),
            "compile": (lambda: rotating(_tensors(n, 2, device), compiled(mse_eager))) if compiled else None,
        }
    if op == "sgd":
        return {
            "torchloom": lambda: rotating(_tensors(n, 2, device), lambda w, g: sgd_update_([w], [g], lr=LR, backend=backend)),
            "eager": lambda: rotating(_tensors(n, 2, device), sgd_eager),
            "torch foreach": lambda: _torch_opt_call(lambda p: torch.optim.SGD(p, lr=LR, foreach=True), n, device),
            "torch fused": lambda: _torch_opt_call(lambda p: torch.optim.SGD(p, lr=LR, fused=True), n, device),
            "compile": (lambda: rotating(_tensors(n, 2, device), compiled(sgd_eager))) if compiled else None,
        }
    if op == "momentum":
        def ours():
            sets = [(w, g, [v]) for w, g, v in _tensors(n, 3, device)]
            return rotating(sets, lambda w, g, bufs: sgd_update_([w], [g], bufs, lr=LR, momentum=0.9, backend=backend))
        return {
            "torchloom": ours,
            "eager": lambda: rotating(_tensors(n, 3, device), momentum_eager),
            "torch foreach": lambda: _torch_opt_call(lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, foreach=True), n, device),
            "torch fused": lambda: _torch_opt_call(lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, fused=True), n, device),
            "compile": (lambda: rotating(_tensors(n, 3, device), compiled(momentum_eager))) if compiled else None,
        }
    if op == "adamw":
        kw = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        return {
            "torchloom": lambda: rotating(_tensors(n, 4, device), lambda w, g, m, v: adamw_update_([w], [g], [m], [v], 10, backend=backend, **kw)),
            "eager": lambda: rotating(_tensors(n, 4, device), adamw_eager),
            "torch foreach": lambda: _torch_opt_call(lambda p: torch.optim.AdamW(p, foreach=True, **ADAMW), n, device),
            "torch fused": lambda: _torch_opt_call(lambda p: torch.optim.AdamW(p, fused=True, **ADAMW), n, device),
            "compile": (lambda: rotating(_tensors(n, 4, device), compiled(adamw_eager))) if compiled else None,
        }
    if op == "rmsprop":
        return {
            "torchloom": lambda: rotating(_tensors(n, 3, device), lambda w, g, s: rmsprop_update_([w], [g], [s], lr=LR, backend=backend)),
            "eager": lambda: rotating(_tensors(n, 3, device), rmsprop_eager),
            "torch foreach": lambda: _torch_opt_call(lambda p: torch.optim.RMSprop(p, lr=LR, foreach=True), n, device),
            "compile": (lambda: rotating(_tensors(n, 3, device), compiled(rmsprop_eager))) if compiled else None,
        }
    raise ValueError(op)


# ---------------------------------------------------------------------------------- correctness
def check_correctness(device: str, n: int) -> list[str]:
    """Each kernel against its reference on ``n`` elements (odd on purpose); returns report lines. A
    kernel that fails to compile or run is reported as ERROR and the others still run."""
    from torchloom.kernels.adamw import adamw_ref, adamw_update_
    from torchloom.kernels.grad_norm import grad_norm, grad_norm_ref
    from torchloom.kernels.loom_ce import loom_ce_loss_grad, loom_ce_loss_grad_ref
    from torchloom.kernels.mse import mse_loss_grad, mse_loss_grad_ref
    from torchloom.kernels.rmsprop import rmsprop_ref, rmsprop_update_
    from torchloom.kernels.sgd import sgd_ref, sgd_update_
    from torchloom.kernels.softmax_ce import softmax_ce_loss_grad, softmax_ce_loss_grad_ref

    torch.manual_seed(0)
    rows = 8 if device == "cpu" else 64  # the interpreter runs one program per row
    o, y = torch.randn(n, device=device), torch.randn(n, device=device)
    p, t = torch.rand(n, device=device), torch.rand(n, device=device)
    x = 3 * torch.randn(rows, 1001, device=device)
    labels = torch.randint(0, 1001, (rows,), device=device)
    soft = torch.softmax(torch.randn(rows, 1001, device=device), -1)
    gs = [torch.randn(n, device=device), torch.randn(33, 7, device=device)]
    w, g, m = (torch.randn(n, device=device) for _ in range(3))
    v = torch.rand(n, device=device) + 0.1

    def sgd():
        a, b, ba, bb = [w.clone()], [w.clone()], [m.clone()], [m.clone()]
        sgd_update_(a, [g], ba, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, backend="triton")
        sgd_ref(b, [g], bb, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
        return a + ba, b + bb, 1e-6, 1e-7

    def adamw():
        got, want = [[u.clone()] for u in (w, m, v)], [[u.clone()] for u in (w, m, v)]
        adamw_update_(got[0], [g], got[1], got[2], 3, lr=0.01, backend="triton")
        adamw_ref(want[0], [g], want[1], want[2], [3], lr=0.01)
        return [u[0] for u in got], [u[0] for u in want], 1e-6, 1e-7

    def rmsprop():
        got, want = [[u.clone()] for u in (w, v, m)], [[u.clone()] for u in (w, v, m)]
        rmsprop_update_(got[0], [g], got[1], None, got[2], lr=0.01, momentum=0.9, backend="triton")
        rmsprop_ref(want[0], [g], want[1], None, want[2], lr=0.01, momentum=0.9)
        return [u[0] for u in got], [u[0] for u in want], 1e-6, 1e-6

    checks = {
        "mse": lambda: (mse_loss_grad(o, y, backend="triton"), mse_loss_grad_ref(o, y), 1e-5, 1e-9),
        "crossentropy (Loom)": lambda: (loom_ce_loss_grad(p, t, backend="triton"), loom_ce_loss_grad_ref(p, t), 1e-5, 1e-9),
        "cross_entropy (labels)": lambda: (
            softmax_ce_loss_grad(x, labels, backend="triton"), softmax_ce_loss_grad_ref(x.double(), labels), 1e-5, 1e-7
        ),
        "cross_entropy (soft)": lambda: (
            softmax_ce_loss_grad(x, soft, backend="triton"), softmax_ce_loss_grad_ref(x.double(), soft.double()), 1e-5, 1e-7
        ),
        "grad_norm": lambda: ([grad_norm(gs, backend="triton")], [grad_norm_ref([u.double() for u in gs])], 1e-5, 0),
        "sgd momentum": sgd,
        "adamw": adamw,
        "rmsprop momentum": rmsprop,
    }
    lines = []
    for name, check in checks.items():
        try:
            got, want, rtol, atol = check()
            worst = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, want))
            ok = all(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol) for a, b in zip(got, want))
            lines.append(f"{'PASS' if ok else 'FAIL'}  {name:<28} max |diff| {worst:.2e}")
        except Exception as e:  # report and go on: the timings of the other kernels are still wanted
            lines.append(f"ERROR {name:<28} {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
    return lines


# ----------------------------------------------------------------------------------------- main
def copy_bandwidth(timer, device: str, n: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` on ``n`` float32 elements (read + write counted)."""
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * 4 * n / (ms * 1e-3)


def format_table(rows: list[Row], copy_bps: float, header: list[str]) -> str:
    out = [*header, "", f"device-to-device copy bandwidth: {copy_bps / 1e9:.2f} GB/s", ""]
    out.append(f"| {'op':<9}| {'size':<5}| {'implementation':<15}| {'time (us)':>10} | {'GB/s':>8} | {'% copy':>7} | {'vs eager':>8} | note")
    out.append("|" + "|".join(["-" * 10, "-" * 6, "-" * 16, "-" * 12, "-" * 10, "-" * 9, "-" * 10, "-" * 6]) + "|")
    eager = {(r.op, r.size): r.ms for r in rows if r.impl == "eager" and r.ms}
    for r in rows:
        if r.ms:
            bps = BYTES[r.op] * r.n / (r.ms * 1e-3)
            base = eager.get((r.op, r.size))
            speed = f"{base / r.ms:.2f}x" if base else ""
            out.append(f"| {r.op:<9}| {r.size:<5}| {r.impl:<15}| {r.ms * 1e3:>10.1f} | {bps / 1e9:>8.1f} | {100 * bps / copy_bps:>6.1f}% | {speed:>8} | {r.note}")
        else:
            out.append(f"| {r.op:<9}| {r.size:<5}| {r.impl:<15}| {'-':>10} | {'-':>8} | {'-':>7} | {'-':>8} | {r.note}")
    return "\n".join(out)


def targets(rows: list[Row], copy_bps: float, large: list[str]) -> list[str]:
    """PASS/FAIL per issue-3 target on the sizes in ``large`` (>= 16M elements)."""
    t = {(r.op, r.size, r.impl): r.ms for r in rows if r.ms}
    lines = ["", "Targets (sizes >= 16M):"]

    def line(ok: bool | None, text: str) -> None:
        lines.append(f"  {'PASS' if ok else ('n/a ' if ok is None else 'FAIL')}  {text}")

    for size in large:
        ours = t.get(("mse", size, "torchloom"))
        if ours:
            frac = BYTES["mse"] * SIZES.get(size, 0) / (ours * 1e-3) / copy_bps if size in SIZES else None
            line(frac is not None and frac >= 0.90, f"MSE {size}: {100 * (frac or 0):.1f}% of copy bandwidth (>= 90%)")
            eager = t.get(("mse", size, "eager"))
            line(None if not eager else eager / ours >= 2.5, f"MSE {size}: {eager / ours if eager else float('nan'):.2f}x eager (>= 2.5x)")
            comp = t.get(("mse", size, "compile"))
            line(None if not comp else ours <= comp, f"MSE {size}: {comp / ours if comp else float('nan'):.2f}x torch.compile (>= 1x)")
        for op in ("sgd", "momentum", "adamw"):
            ms = t.get((op, size, "torchloom"))
            if ms and size in SIZES:
                frac = BYTES[op] * SIZES[size] / (ms * 1e-3) / copy_bps
                line(frac >= 0.85, f"{op} {size}: {100 * frac:.1f}% of copy bandwidth (>= 85%)")
        ours, fused = t.get(("adamw", size, "torchloom")), t.get(("adamw", size, "torch fused"))
        if ours:
            line(None if not fused else ours < fused, f"AdamW {size}: {fused / ours if fused else float('nan'):.2f}x torch.optim.AdamW(fused=True) (> 1x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,16M,64M", help="comma-separated subset of 1M,16M,64M (default: all)")
    parser.add_argument("--ops", default="mse,sgd,momentum,adamw,rmsprop", help="comma-separated subset of " + ",".join(BYTES))
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--sweep", action="store_true", help="also time the streaming kernels at other BLOCK/num_warps on the largest size")
    parser.add_argument("--budget", type=float, default=220.0, help="seconds; benchmarks not started by then are skipped (default 220)")
    parser.add_argument("--dry-run", action="store_true", help="CPU only: interpreter correctness and the pipeline at tiny sizes")
    args = parser.parse_args(argv)

    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in BYTES]
    if bad:
        parser.error(f"unknown ops {bad}; choose from {list(BYTES)}")
    if args.dry_run:
        # before any kernel module is imported: the kernels then run on CPU tensors
        os.environ["TRITON_INTERPRET"] = "1"
        device, timer, sizes = "cpu", cpu_timer, dict(DRY_SIZES)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU: use --dry-run to check the script on CPU")
        device, timer = "cuda", cuda_timer
        sizes = {}
        for s in args.sizes.split(","):
            if s not in SIZES:
                parser.error(f"unknown size {s!r}; choose from {list(SIZES)}")
            sizes[s] = SIZES[s]
    start = time.perf_counter()

    header = [f"# torchloom kernel benchmark ({'dry run, CPU interpreter' if args.dry_run else torch.cuda.get_device_name()})",
              f"torch {torch.__version__}"]
    try:
        import triton

        header[-1] += f", triton {triton.__version__}"
    except ImportError:
        print("triton is not installed: nothing to benchmark", file=sys.stderr)
        return 1
    header += ["", "Correctness (kernel vs reference):"]
    header += ["  " + line for line in check_correctness(device, 4097 if args.dry_run else 1000003)]
    print("\n".join(header), flush=True)

    copy_bps = copy_bandwidth(timer, device, 1 << 16 if args.dry_run else 1 << 28)
    rows: list[Row] = []
    compile_ok = not args.no_compile and not args.dry_run
    for size, n in sizes.items():
        for op in ops:
            for impl, build in implementations(op, n, device, compile_ok).items():
                row = Row(op, size, n, impl)
                rows.append(row)
                if build is None:
                    row.note = ("skipped (dry run)" if args.dry_run else "skipped (--no-compile)") if impl == "compile" else "not available"
                    continue
                if time.perf_counter() - start > args.budget:
                    row.note = "skipped (--budget)"
                    continue
                try:
                    row.ms = timer(build())
                except Exception as e:  # one failing implementation must not stop the run
                    row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                    if os.environ.get("BENCH_DEBUG"):
                        traceback.print_exc()
                finally:
                    if device == "cuda":
                        torch.cuda.empty_cache()
                print(f"  {op:<9}{size:<5}{impl:<15}{'-' if row.ms is None else f'{row.ms * 1e3:.1f} us'} {row.note}", flush=True)

    if args.sweep and not args.dry_run:
        rows += sweep(timer, device, max(sizes.values()), list(sizes)[-1], ops)

    table = format_table(rows, copy_bps, header)
    if not args.dry_run:
        table += "\n" + "\n".join(targets(rows, copy_bps, [s for s in sizes if sizes[s] >= 1 << 24]))
    table += f"\n\ntotal time {time.perf_counter() - start:.0f} s"
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
        print(f"written to {args.out}")
    return 0


def sweep(timer, device: str, n: int, size: str, ops: list[str]) -> list[Row]:
    """torchloom's streaming kernels at other (BLOCK, num_warps) settings, largest size only."""
    from torchloom.kernels._triton import launch_override

    rows = []
    for block, warps in [(512, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8)]:
        for op in ops:
            build = implementations(op, n, device, False)["torchloom"]
            row = Row(op, size, n, f"BLOCK {block}/{warps}w")
            try:
                with launch_override(block, warps):
                    row.ms = timer(build())
            except Exception as e:
                row.note = f"error: {type(e).__name__}"
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sys.exit(main())
