"""Layer kernels (RMSNorm, SwiGLU gate, softmax; forward and backward) against eager PyTorch,
``torch.compile`` and the memory-bandwidth floor, then whole layers (forward + backward through
autograd) on the kernels, on the references and in plain PyTorch. One process, one table, under two
minutes on an H100.

Kernel rows, per op and dtype:

* ``kernel``: torchloom's fused Triton kernel (``torchloom.kernels.<op>``);
* ``eager``: the same math as eager PyTorch (the op's ``*_ref`` function, which the layers run on CPU);
* ``compile``: ``torch.compile`` of that reference;
* ``native``: PyTorch's own op where one exists (``F.rms_norm`` / its autograd backward, ``F.silu(g)*u``
  / its autograd backward, ``torch.softmax`` / ``aten._softmax_backward_data``);
* ``floor``: bytes the op must move / the device's measured copy bandwidth.

Layer rows: the torchloom layer on the kernels, the same layer with every launcher switched to
its reference (``eager``), and the plain-PyTorch equivalent (``nn.RMSNorm``, three ``nn.Linear`` +
``F.silu``, SDPA attention, ``torch.softmax``). The kernels pay where ``eager / torchloom`` is clearly
above 1 (in the kernel rows and, diluted by the matrix products, in the layer rows).

Run: ``PYTHONPATH=. python bench/bench_layers.py`` on a CUDA machine;
``PYTHONPATH=. python bench/bench_layers.py --smoke`` checks the script on the CPU with tiny shapes
(kernels through Triton's interpreter; the timings then mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

from torchloom.kernels import rmsnorm as KR  # noqa: E402
from torchloom.kernels import softmax as KS  # noqa: E402
from torchloom.kernels import swiglu as KG  # noqa: E402
from torchloom.layers.attention import MultiHeadAttention  # noqa: E402
from torchloom.layers.norm import RMSNorm  # noqa: E402
from torchloom.layers.softmax import Softmax  # noqa: E402
from torchloom.layers.swiglu import SwiGLU  # noqa: E402

T = 0.7  # softmax temperature: exercises the fused 1/T scaling
EPS = 1e-6


# ----------------------------------------------------------------------------------------- timing
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn: Callable[[], object], dev: torch.device, target_s: float) -> float:
    """Median seconds per call: 3 warm-up calls, then 5 timed runs of ``n`` calls (``n`` sized so a
    run lasts about ``target_s / 5``)."""
    for _ in range(3):
        fn()
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    once = max(time.perf_counter() - t, 1e-6)
    n = max(1, min(1000, int(target_s / 5 / once)))
    runs = []
    for _ in range(5):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(dev)
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)


def copy_bandwidth(dev: torch.device) -> float:
    """Achievable bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 20)
    a = torch.empty(n, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    s = time_fn(lambda: b.copy_(a), dev, 0.2)
    return 2 * a.numel() * a.element_size() / s


def _compiled(fn: Callable, label: str) -> Callable | None:
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as e:  # the table shows nan; say why
        print(f"torch.compile unavailable for {label}: {type(e).__name__}: {e}", flush=True)
        return None


# -------------------------------------------------------------------------------------- kernel ops
def kernel_cases(dev: torch.device, dtype: torch.dtype, smoke: bool):
    """``(op, shape, bytes moved, {impl: callable})`` for every op at one dtype."""
    e = torch.tensor([], dtype=dtype).element_size()
    kb = "triton" if smoke else None  # smoke: force the kernels (through the interpreter on the CPU)
    rows, n = (8, 33) if smoke else (8192, 4096)  # RMSNorm: 8 sequences × 1024 tokens, LLaMA-7B width
    x, g = torch.randn(rows, n, device=dev, dtype=dtype), torch.randn(rows, n, device=dev, dtype=dtype)
    w = torch.randn(n, device=dev, dtype=dtype)
    _, rstd = KR.rmsnorm(x, w, EPS)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_nat = F.rms_norm(xr, (n,), wr, EPS)
    ref_f, ref_b = _compiled(KR.rmsnorm_ref, "rmsnorm"), _compiled(KR.rmsnorm_backward_ref, "rmsnorm backward")
    yield "rmsnorm fwd", (rows, n), 2 * rows * n * e, {
        "kernel": lambda: KR.rmsnorm(x, w, EPS, kb),
        "eager": lambda: KR.rmsnorm_ref(x, w, EPS),
        "compile": ref_f and (lambda: ref_f(x, w, EPS)),
        "native": lambda: F.rms_norm(x, (n,), w, EPS),
    }
    yield "rmsnorm bwd", (rows, n), 3 * rows * n * e, {
        "kernel": lambda: KR.rmsnorm_backward(g, x, w, rstd, kb),
        "eager": lambda: KR.rmsnorm_backward_ref(g, x, w, rstd),
        "compile": ref_b and (lambda: ref_b(g, x, w, rstd)),
        "native": lambda: torch.autograd.grad(y_nat, (xr, wr), g, retain_graph=True),
    }

    rows, m = (8, 45) if smoke else (8192, 11008)  # SwiGLU gate: LLaMA-7B intermediate width
    gate, up, da = (torch.randn(rows, m, device=dev, dtype=dtype) for _ in range(3))
    gr, ur = gate.clone().requires_grad_(), up.clone().requires_grad_()
    a_nat = F.silu(gr) * ur
    ref_f, ref_b = _compiled(KG.swiglu_ref, "swiglu"), _compiled(KG.swiglu_backward_ref, "swiglu backward")
    yield "swiglu gate fwd", (rows, m), 3 * rows * m * e, {
        "kernel": lambda: KG.swiglu(gate, up, kb),
        "eager": lambda: KG.swiglu_ref(gate, up),
        "compile": ref_f and (lambda: ref_f(gate, up)),
        "native": lambda: F.silu(gate) * up,
    }
    yield "swiglu gate bwd", (rows, m), 5 * rows * m * e, {
        "kernel": lambda: KG.swiglu_backward(da, gate, up, kb),
        "eager": lambda: KG.swiglu_backward_ref(da, gate, up),
        "compile": ref_b and (lambda: ref_b(da, gate, up)),
        "native": lambda: torch.autograd.grad(a_nat, (gr, ur), da, retain_graph=True),
    }

    # Attention-shaped rows (batch·heads·queries × keys) and vocabulary-wide rows (longer than one block).
    for rows, c in ((((4, 37), (3, 300)) if smoke else ((65536, 1024), (4096, 32000)))):
        s, gs = (torch.randn(rows, c, device=dev, dtype=dtype) for _ in range(2))
        p = KS.softmax(s, T)
        ref_f, ref_b = _compiled(KS.softmax_ref, "softmax"), _compiled(KS.softmax_backward_ref, "softmax backward")
        yield "softmax fwd", (rows, c), 2 * rows * c * e, {
            "kernel": lambda s=s: KS.softmax(s, T, kb),
            "eager": lambda s=s: KS.softmax_ref(s, T),
            "compile": ref_f and (lambda s=s, f=ref_f: f(s, T)),
            "native": lambda s=s: torch.softmax(s / T, dim=-1),
        }
        yield "softmax bwd", (rows, c), 3 * rows * c * e, {
            "kernel": lambda gs=gs, p=p: KS.softmax_backward(gs, p, T, kb),
            "eager": lambda gs=gs, p=p: KS.softmax_backward_ref(gs, p, T),
            "compile": ref_b and (lambda gs=gs, p=p, f=ref_b: f(gs, p, T)),
            "native": lambda gs=gs, p=p: torch.ops.aten._softmax_backward_data(gs, p, -1, p.dtype) / T,
        }


# ------------------------------------------------------------------------------------------ layers
_LAUNCHERS = ((KR, "rmsnorm"), (KR, "rmsnorm_backward"), (KG, "swiglu"), (KG, "swiglu_backward"), (KS, "softmax"), (KS, "softmax_backward"))


@contextlib.contextmanager
def reference_launchers():
    """Within the block the layers run the PyTorch references instead of the kernels: the launchers
    they call are swapped for ``backend="reference"`` versions (benchmark only)."""
    originals = [(mod, name, getattr(mod, name)) for mod, name in _LAUNCHERS]
    for mod, name, fn in originals:
        setattr(mod, name, functools.partial(fn, backend="reference"))
    try:
        yield
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)


def layer_cases(dev: torch.device, dtype: torch.dtype, smoke: bool):
    """``(layer, shape, torchloom step, PyTorch step)``: one forward + backward through autograd of
    torchloom's layer and of the plain-PyTorch equivalent (same sizes, own weights: only speed is
    compared)."""
    b, s, d = (2, 5, 16) if smoke else (8, 1024, 4096)
    x = torch.randn(b, s, d, device=dev, dtype=dtype, requires_grad=True)
    gy = torch.randn(b, s, d, device=dev, dtype=dtype)
    ours = RMSNorm(d, device=dev, dtype=dtype)
    theirs = torch.nn.RMSNorm(d, eps=EPS, device=dev, dtype=dtype)
    yield "RMSNorm layer", (b, s, d), lambda: ours(x).backward(gy), lambda: theirs(x).backward(gy)

    h, m = (16, 24) if smoke else (2048, 5632)
    xs = torch.randn(b, s, h, device=dev, dtype=dtype, requires_grad=True)
    gs = torch.randn(b, s, h, device=dev, dtype=dtype)
    swiglu = SwiGLU(h, m, device=dev, dtype=dtype)
    lin = [torch.nn.Linear(i, o, device=dev, dtype=dtype) for i, o in ((h, m), (h, m), (m, h))]
    yield "SwiGLU layer", (b, s, h, m), lambda: swiglu(xs).backward(gs), lambda: lin[2](F.silu(lin[0](xs)) * lin[1](xs)).backward(gs)

    bq, sq, dq, heads, kv = (2, 7, 16, 4, 2) if smoke else (8, 512, 1024, 16, 4)
    xq = torch.randn(bq, sq, dq, device=dev, dtype=dtype, requires_grad=True)
    gq = torch.randn(bq, sq, dq, device=dev, dtype=dtype)
    mha = MultiHeadAttention(dq, heads, kv, device=dev, dtype=dtype)
    hd, half = dq // heads, dq // heads // 2
    proj = [torch.nn.Linear(dq, o, device=dev, dtype=dtype) for o in (dq, kv * hd, kv * hd, dq)]
    angle = torch.arange(sq, device=dev)[:, None] * (10000.0 ** (-torch.arange(half, device=dev) * 2 / hd))[None]
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)

    def rope(t):
        t1, t2 = t[..., :half], t[..., half:]
        return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)

    def sdpa_attention():  # the same attention with PyTorch's fused (flash) SDPA
        q = rope(proj[0](xq).view(bq, sq, heads, hd).transpose(1, 2))
        k = rope(proj[1](xq).view(bq, sq, kv, hd).transpose(1, 2))
        v = proj[2](xq).view(bq, sq, kv, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        proj[3](o.transpose(1, 2).reshape(bq, sq, dq)).backward(gq)

    yield "MultiHeadAttention layer (PyTorch: SDPA)", (bq, sq, dq, heads, kv), lambda: mha(xq).backward(gq), sdpa_attention

    rows, c = (4, 37) if smoke else (65536, 1024)
    xsm = torch.randn(rows, c, device=dev, dtype=dtype, requires_grad=True)
    gsm = torch.randn(rows, c, device=dev, dtype=dtype)
    sm = Softmax(temperature=T)
    yield "Softmax layer", (rows, c), lambda: sm(xsm).backward(gsm), lambda: torch.softmax(xsm / T, dim=-1).backward(gsm)


# -------------------------------------------------------------------------------------------- main
def _us(s: float) -> str:
    return "—" if math.isnan(s) else f"{s * 1e6:.1f}"


def _ratio(a: float, b: float) -> str:
    return "—" if math.isnan(a) or math.isnan(b) else f"{a / b:.2f}×"


def _measure(label: str, fn: Callable | None, dev: torch.device, target: float) -> float:
    if fn is None:
        return float("nan")
    try:
        return time_fn(fn, dev, target)
    except Exception as e:  # report, don't hide: e.g. torch.compile failing on this platform
        print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not speed")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--target", type=float, default=0.05, help="seconds of timed calls per measurement")
    args = ap.parse_args()
    start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev.type != "cuda" and not args.smoke:
        raise SystemExit("bench_layers needs a CUDA GPU (or --smoke to check the script on the CPU)")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke test: timings mean nothing)"
    bw = copy_bandwidth(dev)
    print(f"device: {name}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    rows = []  # (case, dtype, shape, {torchloom, eager, compile, pytorch}, floor seconds or nan)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for op, shape, nbytes, impls in kernel_cases(dev, dtype, args.smoke):
            r = {
                "torchloom": _measure(f"{op} {dtype_name} kernel", impls["kernel"], dev, args.target),
                "eager": _measure(f"{op} {dtype_name} eager", impls["eager"], dev, args.target),
                "compile": _measure(f"{op} {dtype_name} compile", impls["compile"], dev, args.target),
                "pytorch": _measure(f"{op} {dtype_name} native", impls["native"], dev, args.target),
            }
            rows.append((op, dtype_name, shape, r, nbytes / bw))
            print(f"{op} {dtype_name} {list(shape)}: " + ", ".join(f"{k} {_us(v)} µs" for k, v in r.items()), flush=True)
        for layer, shape, ours, theirs in layer_cases(dev, dtype, args.smoke):
            r = {"torchloom": _measure(f"{layer} {dtype_name}", ours, dev, args.target)}
            with reference_launchers():
                r["eager"] = _measure(f"{layer} {dtype_name} on references", ours, dev, args.target)
            r["compile"] = float("nan")
            r["pytorch"] = _measure(f"{layer} {dtype_name} PyTorch", theirs, dev, args.target)
            rows.append((layer, dtype_name, shape, r, float("nan")))
            print(f"{layer} {dtype_name} {list(shape)}: " + ", ".join(f"{k} {_us(v)} µs" for k, v in r.items()), flush=True)

    lines = [
        "",
        "Kernel rows: torchloom = the fused kernel; eager = its PyTorch reference (*_ref); compile = torch.compile(reference);",
        "PyTorch = PyTorch's own op. Layer rows (forward + backward): torchloom = the layer on the kernels; eager = the",
        "same layer on the references; PyTorch = the plain-PyTorch equivalent. floor = bytes moved / copy bandwidth.",
        "",
        "| case | dtype | shape | torchloom µs | eager µs | compile µs | PyTorch µs | floor µs | floor / torchloom | eager / torchloom | compile / torchloom | PyTorch / torchloom |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, dt, shape, r, floor in rows:
        t = r["torchloom"]
        lines.append(
            f"| {case} | {dt} | {'×'.join(map(str, shape))} | {_us(t)} | {_us(r['eager'])} | {_us(r['compile'])} | "
            f"{_us(r['pytorch'])} | {_us(floor)} | {'—' if math.isnan(floor) else f'{100 * floor / t:.0f}%'} | "
            f"{_ratio(r['eager'], t)} | {_ratio(r['compile'], t)} | {_ratio(r['pytorch'], t)} |"
        )
    print("\n".join(lines))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
