"""Every torchloom layer's forward + backward against the PyTorch module doing the same math (and
``torch.compile`` of that module): time and peak memory, float32 and bfloat16, one table.

Layer rows (one step = gradients set to None, forward, backward of a fixed upstream gradient):

* Dense 1024→4096 on 8×1024 tokens vs ``nn.Linear``;
* Conv2D 32→64 3×3 (padding 1) on 64×32×32×32 vs ``nn.Conv2d``;
* LSTM and RNN 256→256, batch 64, 64 steps vs ``nn.LSTM`` / ``nn.RNN`` (cuDNN; ``bias_hh`` unused);
* MultiHeadAttention d 1024, 16 heads, causal, RoPE, at S = 2,048 (batch 4) and S = 8,192 (batch 1)
  vs the same projections + RoPE + ``F.scaled_dot_product_attention`` (the fused kernel it picks: on
  an H200 with torch 2.11, cuDNN's in bfloat16 and the memory-efficient one in float32 — which
  torchloom's layer now runs as its core too);
* SwiGLU 1024→2816 on 8×1024 tokens vs three ``nn.Linear`` + ``F.silu``;
* RMSNorm / LayerNorm 1024 on 8×1024 tokens vs ``nn.RMSNorm`` / ``nn.LayerNorm``.

Time: median of 5 runs (each about ``--target``/5 seconds of steps), eager (what a plain PyTorch loop
pays, host launch overhead included) and *graphed* (ten steps captured in one CUDA graph and
replayed: the device's time alone, what torchloom's ``train()`` device path and users' CUDA-graphed
steps pay; a layer that cannot be captured shows —). On CUDA every case runs, and is captured, on one
side stream (the parameters' gradient accumulators then live on the capturing stream; on the default
stream the first float32 capture of a run failed for both sides). Peak memory: the largest
``torch.cuda.max_memory_allocated`` during one step above what was allocated before it (inputs and
parameters excluded, the same for both sides). Targets (issue 16): torchloom ≤ 1.0× PyTorch's time
(LSTM/RNN ≤ 1.5× cuDNN) and ≤ 1.1× its peak memory.

``--compiled`` prints instead the *torchloom compiled vs PyTorch compiled* table (issue 36): each side
under ``torch.compile`` with ``fullgraph=True`` (a side with a graph break is reported and compiled
without it), one step timed in pairs of blocks against the other side (host overhead included: what
compiling saves; see ``_paired``), peak memory, the graph breaks, recompiles after the first step and
the first step's compile time. Targets: ≤ 1.0× time, ≤ 1.1× peak memory. A row's time verdict reads
the median ratio's 95 % interval (``time_verdict``), beside a control that times PyTorch's side
against a second compiled copy of itself (``_control``). ``--budget S`` starts no new
row after S seconds, so a run fits a time box (every row is printed as soon as it is measured). Where a
row is host-bound, the GPU host's drift from run to run is larger than what is left between the two
sides; ``bench_compiled_host.py`` measures that host time on the CPU, where it resolves about 1 %.

``--kernels`` adds the older kernel-level rows (RMSNorm, SwiGLU gate, softmax kernels vs eager,
``torch.compile`` and the bandwidth floor).

Run: ``PYTHONPATH=. python bench/bench_layers.py`` on a CUDA machine (``--compiled --target 0.05
--budget 200`` for the compiled table) (``--no-compile`` skips the
``torch.compile`` column); ``PYTHONPATH=. python bench/bench_layers.py --smoke`` checks the script on
the CPU with tiny shapes (kernels through Triton's interpreter; the numbers then mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported

from torchloom.kernels import rmsnorm as KR  # noqa: E402
from torchloom.kernels import softmax as KS  # noqa: E402
from torchloom.kernels import swiglu as KG  # noqa: E402
from torchloom.layers.attention import MultiHeadAttention  # noqa: E402
from torchloom.layers.conv import Conv2D  # noqa: E402
from torchloom.layers.dense import Dense  # noqa: E402
from torchloom.layers.lstm import LSTM  # noqa: E402
from torchloom.layers.norm import LayerNorm, RMSNorm  # noqa: E402
from torchloom.layers.rnn import RNN  # noqa: E402
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
    return statistics.median(_block(fn, dev, n) for _ in range(5))


def _block(fn: Callable[[], object], dev: torch.device, n: int) -> float:
    """Seconds per call of ``n`` calls of ``fn`` in a row, the device synchronised before and after."""
    _sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(dev)
    return (time.perf_counter() - t) / n


def graphed_time(fn: Callable[[], object], dev: torch.device, target_s: float, steps: int = 10) -> float:
    """Median seconds per call when ``steps`` calls are captured in one CUDA graph and replayed: the
    device's time alone, without the host's launch overhead (what a CUDA-graphed training step, such as
    torchloom's ``train()`` device path, pays). Three warm-up calls on a side stream first."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Captured on the current stream when that is not the default one (``main`` runs every case on one
    # side stream): autograd then finds the parameters' gradient accumulators (made by the first step,
    # and kept alive by a compiled step) on the capturing stream. Otherwise their step on the legacy
    # default stream ends the capture ("would make the legacy stream depend on a capturing blocking
    # stream": the first float32 case of a run, both sides, on torch 2.11).
    current = torch.cuda.current_stream(dev)
    own = None if current == torch.cuda.default_stream(dev) else current
    with torch.cuda.graph(graph, stream=own):
        for _ in range(steps):
            fn()
    try:
        return time_fn(graph.replay, dev, target_s) / steps
    finally:
        del graph


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
class Case:
    """One layer row: torchloom's module and PyTorch's, each as ``forward(x)`` on the same input
    shape, with the parameters whose gradients are reset before every step."""

    def __init__(self, name, shape, x, gy, ours, ours_params, theirs, theirs_params, time_target):
        self.name, self.shape, self.x, self.gy = name, shape, x, gy
        self.ours, self.ours_params = ours, list(ours_params)
        self.theirs, self.theirs_params = theirs, list(theirs_params)
        self.time_target = time_target


def _step(fn, x, gy, params):
    """One training step of ``fn`` on ``x`` as a callable: gradients of ``x`` and ``params`` (any
    iterable, read once) set to None, forward, backward of ``gy``."""
    params = list(params)

    def run():
        x.grad = None
        for p in params:
            p.grad = None
        fn(x).backward(gy)

    return run


class _TorchSwiGLU(torch.nn.Module):
    """PyTorch's side of the SwiGLU row: three ``nn.Linear`` and ``F.silu`` in a module (PyTorch has no
    SwiGLU module; a module, like torchloom's, so both sides pay a module call)."""

    def __init__(self, h: int, m: int, **f) -> None:
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(h, m, **f), torch.nn.Linear(h, m, **f), torch.nn.Linear(m, h, **f)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def layer_cases(dev: torch.device, dtype: torch.dtype, smoke: bool):
    f = dict(device=dev, dtype=dtype)

    def inp(*shape):
        return torch.randn(*shape, **f).requires_grad_(), torch.randn(*shape, **f)

    # Dense 1024→4096 on 8×1024 tokens
    n, i, o = (6, 8, 12) if smoke else (8192, 1024, 4096)
    x, _ = inp(n, i)
    gy = torch.randn(n, o, **f)
    dense, lin = Dense(i, o, **f), torch.nn.Linear(i, o, **f)
    yield Case("Dense (nn.Linear)", (n, i, o), x, gy, dense, dense.parameters(), lin, lin.parameters(), 1.0)

    b, c, hw, fo = (2, 3, 6, 4) if smoke else (64, 32, 32, 64)
    x, gy = inp(b, c, hw, hw)
    gy = torch.randn(b, fo, hw, hw, **f)
    conv, tconv = Conv2D(c, fo, 3, padding=1, **f), torch.nn.Conv2d(c, fo, 3, padding=1, **f)
    yield Case("Conv2D 3×3 (nn.Conv2d)", (b, c, hw, hw, fo), x, gy, conv, conv.parameters(), tconv, tconv.parameters(), 1.0)

    b, t, i, h = (3, 4, 5, 7) if smoke else (64, 64, 256, 256)
    for ours_cls, theirs_cls in ((LSTM, torch.nn.LSTM), (RNN, torch.nn.RNN)):
        x, _ = inp(b, t, i)
        gy = torch.randn(b, t, h, **f)
        ours = ours_cls(i, h, **f)
        theirs = theirs_cls(i, h, batch_first=True, **f)
        yield Case(f"{ours_cls.__name__} (cuDNN nn.{theirs_cls.__name__})", (b, t, i, h), x, gy, ours, ours.parameters(),
                   lambda x, m=theirs: m(x)[0], theirs.parameters(), 1.5)

    d, heads = (32, 2) if smoke else (1024, 16)
    hd, half = d // heads, d // heads // 2
    for bq, sq in (((2, 7), (1, 19)) if smoke else ((4, 2048), (1, 8192))):
        x, gy = inp(bq, sq, d)
        mha = MultiHeadAttention(d, heads, **f)
        proj = torch.nn.ModuleList(torch.nn.Linear(d, d, **f) for _ in range(4))
        angle = torch.arange(sq, device=dev)[:, None] * (10000.0 ** (-torch.arange(half, device=dev) * 2 / hd))[None]
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)

        def sdpa_attention(x, proj=proj, cos=cos, sin=sin, bq=bq, sq=sq):
            def rope(t):
                t1, t2 = t[..., :half], t[..., half:]
                return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)

            q = rope(proj[0](x).view(bq, sq, heads, hd).transpose(1, 2))
            k = rope(proj[1](x).view(bq, sq, heads, hd).transpose(1, 2))
            v = proj[2](x).view(bq, sq, heads, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return proj[3](o.transpose(1, 2).reshape(bq, sq, d))

        yield Case(f"MultiHeadAttention S={sq} (SDPA)", (bq, sq, d, heads), x, gy, mha, mha.parameters(),
                   sdpa_attention, proj.parameters(), 1.0)

    n, h, m = (6, 16, 24) if smoke else (8192, 1024, 2816)
    x, gy = inp(n, h)
    swiglu = SwiGLU(h, m, **f)
    torch_swiglu = _TorchSwiGLU(h, m, **f)
    yield Case("SwiGLU (3 nn.Linear + F.silu)", (n, h, m), x, gy, swiglu, swiglu.parameters(),
               torch_swiglu, torch_swiglu.parameters(), 1.0)

    n, h = (6, 16) if smoke else (8192, 1024)
    x, gy = inp(n, h)
    rms = RMSNorm(h, eps=EPS, **f)
    torch_rms = torch.nn.RMSNorm(h, eps=EPS, **f)
    yield Case("RMSNorm (nn.RMSNorm)", (n, h), x, gy, rms, rms.parameters(), torch_rms, torch_rms.parameters(), 1.0)
    x, gy = inp(n, h)
    ln = LayerNorm(h, **f)
    torch_ln = torch.nn.LayerNorm(h, **f)
    yield Case("LayerNorm (nn.LayerNorm)", (n, h), x, gy, ln, ln.parameters(), torch_ln, torch_ln.parameters(), 1.0)


def peak_memory(fn: Callable[[], object], dev: torch.device) -> float:
    """Bytes allocated at the peak of one call above what was allocated before it (nan on CPU)."""
    if dev.type != "cuda":
        return float("nan")
    fn()  # grads and caches exist, as in the timed runs
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return float(torch.cuda.max_memory_allocated(dev) - base)


# -------------------------------------------------------------------------------------------- main
def _us(s: float) -> str:
    return "—" if math.isnan(s) else f"{s * 1e6:.1f}"


def _ms(s: float) -> str:
    return "—" if math.isnan(s) else f"{s * 1e3:.3f}"


def _mb(b: float) -> str:
    return "—" if math.isnan(b) else f"{b / 2**20:.0f}"


def _count(n: int) -> str:
    return "?" if n < 0 else str(n)


def _quartiles(q1: float, q3: float, digits: int = 2) -> str:
    return "—" if math.isnan(q1) or math.isnan(q3) else f"{q1:.{digits}f}×–{q3:.{digits}f}×"


def _times(r: float, digits: int = 2) -> str:
    return "—" if math.isnan(r) else f"{r:.{digits}f}×"


def _ratio(a: float, b: float) -> str:
    return "—" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}×"


def _measure(label: str, fn: Callable | None, dev: torch.device, target: float, graphed: bool = False) -> float:
    if fn is None or (graphed and dev.type != "cuda"):
        return float("nan")
    try:
        return graphed_time(fn, dev, target) if graphed else time_fn(fn, dev, target)
    except Exception as e:  # report, don't hide: e.g. torch.compile failing on this platform
        print(f"{label} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


def _memory(label: str, fn: Callable | None, dev: torch.device) -> float:
    if fn is None:
        return float("nan")
    try:
        return peak_memory(fn, dev)
    except Exception as e:
        print(f"{label} memory failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


def kernel_table(dev, dtypes, smoke, target, bw) -> list[str]:
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for op, shape, nbytes, impls in kernel_cases(dev, dtype, smoke):
            r = {
                "torchloom": _measure(f"{op} {dtype_name} kernel", impls["kernel"], dev, target),
                "eager": _measure(f"{op} {dtype_name} eager", impls["eager"], dev, target),
                "compile": _measure(f"{op} {dtype_name} compile", impls["compile"], dev, target),
                "pytorch": _measure(f"{op} {dtype_name} native", impls["native"], dev, target),
            }
            rows.append((op, dtype_name, shape, r, nbytes / bw))
            print(f"{op} {dtype_name} {list(shape)}: " + ", ".join(f"{k} {_us(v)} µs" for k, v in r.items()), flush=True)
    lines = [
        "",
        "Kernel rows: torchloom = the fused kernel; eager = its PyTorch reference (*_ref); compile = torch.compile(reference);",
        "PyTorch = PyTorch's own op. floor = bytes moved / copy bandwidth.",
        "",
        "| kernel | dtype | shape | torchloom µs | eager µs | compile µs | PyTorch µs | floor µs | floor / torchloom | PyTorch / torchloom |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, dt, shape, r, floor in rows:
        t = r["torchloom"]
        lines.append(
            f"| {case} | {dt} | {'×'.join(map(str, shape))} | {_us(t)} | {_us(r['eager'])} | {_us(r['compile'])} | "
            f"{_us(r['pytorch'])} | {_us(floor)} | {'—' if math.isnan(floor) else f'{100 * floor / t:.0f}%'} | {_ratio(r['pytorch'], t)} |"
        )
    return lines


def _row(case: Case, dt: str, r: dict) -> str:
    t, p = r["torchloom"], r["pytorch"]
    mt, mp = r["mem_torchloom"], r["mem_pytorch"]
    time_ok = not math.isnan(t) and not math.isnan(p) and t <= case.time_target * p
    gt, gp = r["graphed_torchloom"], r["graphed_pytorch"]
    graphed = "" if math.isnan(gt) or math.isnan(gp) else " (graphed ✓)" if gt <= case.time_target * gp else " (graphed ✗)"
    mem = "memory —" if math.isnan(mt) or math.isnan(mp) else "memory ✓" if mt <= 1.1 * mp else "memory ✗"
    met = ("time ✓" if time_ok else f"time ✗ (>{case.time_target}×)") + graphed + ", " + mem
    return (
        f"| {case.name} | {dt} | {'×'.join(map(str, case.shape))} | {_ms(t)} | {_ms(p)} | {_ms(r['compile'])} | "
        f"{_ratio(t, p)} | {_ms(r['graphed_torchloom'])} | {_ms(r['graphed_pytorch'])} | {_ratio(r['graphed_torchloom'], r['graphed_pytorch'])} | "
        f"{_mb(mt)} | {_mb(mp)} | {_mb(r['mem_compile'])} | {_ratio(mt, mp)} | {met} |"
    )


def _graph_breaks(fn: Callable, x: torch.Tensor) -> tuple[int, str]:
    """``(graph breaks, the first break's reason)`` of ``fn(x)`` by ``torch._dynamo.explain`` (-1 and
    the error where explaining fails). Resets Dynamo afterwards, which drops every compiled frame: run
    it before compiling what is timed."""
    import torch._dynamo

    breaks, note = 0, ""
    try:
        explanation = torch._dynamo.explain(fn)(x)
        breaks = explanation.graph_break_count
        if breaks:
            note = str(explanation.break_reasons[0].reason).splitlines()[0][:120]
    except Exception as e:
        breaks, note = -1, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    torch._dynamo.reset()
    return breaks, note


def _compile_and_first_step(label: str, fn: Callable, case: Case, params: list, backend: str, fullgraph: bool):
    """``(compiled step or None, compile counter, first step's seconds, fullgraph)``: ``fn`` under
    ``torch.compile`` (``dynamic=False``), its first step run (and timed: the compile). A
    ``fullgraph=True`` compile that fails is tried once more without it (the last item says which ran)."""
    import torch._dynamo.testing

    dev = case.x.device
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    try:
        compiled = torch.compile(fn, backend=counter, dynamic=False, fullgraph=fullgraph)
        step = _step(compiled, case.x, case.gy, params)
        _sync(dev)
        t = time.perf_counter()
        step()
        _sync(dev)
        return step, counter, time.perf_counter() - t, fullgraph
    except Exception as e:  # report, don't hide
        print(f"{label} compile failed{' with fullgraph=True' if fullgraph else ''}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        if fullgraph:
            return _compile_and_first_step(label, fn, case, params, backend, False)
        return None, counter, float("nan"), fullgraph


def _selected(cases: dict, dtypes: list, only: list | None):
    """``(case, dtype name)`` in table order (each case's dtypes together), keeping the cases whose name
    contains one of ``only`` (all without it)."""
    for idx in range(len(cases[dtypes[0]])):
        for dtype_name in dtypes:
            case = cases[dtype_name][idx]
            if not only or any(o in case.name for o in only):
                yield case, dtype_name


PAIRS = 32  # paired measurements of the two sides per compiled row


class Paired(NamedTuple):
    """A paired timing: each side's seconds per step (the median of its blocks), the median of the pairs'
    ratios, their quartiles, and the 95 % interval of that median (``median_interval``)."""

    ours: float
    theirs: float
    ratio: float
    q1: float
    q3: float
    low: float
    high: float


_NAN_PAIRED = Paired(*(float("nan"),) * 7)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``level`` confidence interval of the median of ``values``: the order statistics
    ``k`` and ``n + 1 − k``, ``k`` the largest with ``P(Binomial(n, ½) < k) ≤ (1 − level) / 2`` (the
    sign test's interval). It assumes the values are independent draws; a host that drifts makes
    neighbouring pairs alike, and the interval then reads narrower than it is (the CPU's bfloat16
    control, two copies of one module, came out 0.997 [0.987–0.999]). ``(nan, nan)`` where there are
    too few values for one (n < 6 at 95 %)."""
    v = sorted(values)
    n, tail = len(v), (1 - level) / 2
    k, below = 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(Binomial(n, ½) ≤ k)
        if below > tail:
            break
        k += 1
    return (v[k - 1], v[n - k]) if k else (float("nan"), float("nan"))


def time_verdict(p: Paired) -> str:
    """The time target (≤ 1.0×) of a paired row: ✓ where the median ratio is at most 1.0; "=" where it is
    above but 1.0 lies inside its 95 % interval (the two sides are not told apart: compare the
    PyTorch-vs-PyTorch control of the row); ✗ where the whole interval is above 1.0 (measurably slower)."""
    if math.isnan(p.ratio):
        return "time —"
    if p.ratio <= 1.0:
        return "time ✓"
    if math.isnan(p.low):
        return "time — (too few pairs for a 95 % interval)"
    return "time = (1.0 inside the 95 % interval)" if p.low <= 1.0 else "time ✗ (slower at 95 %)"


def _paired(label: str, ours: Callable | None, theirs: Callable | None, dev: torch.device, target: float,
            pairs: int = PAIRS) -> Paired:
    """``ours`` against ``theirs`` per step (``Paired``), from ``pairs`` paired measurements taking about
    ``24 × target`` seconds in all (each block about ``6 × target / pairs`` seconds).

    Host overhead dominates most of these steps, and it drifts by ±30 % within a run; measured one
    after the other, the side measured first also paid for its position (two identical cuDNN steps
    came out 1.09–1.22× apart, H200). So each pair is four blocks of steps in the order A B B A (B A A
    B in odd pairs), its ratio ``(A₁ + A₂) / (B₁ + B₂)``, which cancels a drift that is linear over the
    four blocks; the ratio printed is the median of the pairs' ratios, with their quartiles (how far
    they scatter) and the median's 95 % interval (how well it is known); each side's time is the
    median of its blocks."""
    if ours is None or theirs is None:
        return _NAN_PAIRED
    try:
        once = max(_block(fn, dev, 3) for fn in (ours, theirs))  # also the warm-up
        n = max(1, min(500, int(24 * target / (4 * pairs) / once)))
        mine, other, ratios = [], [], []
        for i in range(pairs):
            first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
            t1, t2, t3, t4 = (_block(f, dev, n) for f in (first, second, second, first))
            a, b = ((t1, t4), (t2, t3)) if first is ours else ((t2, t3), (t1, t4))
            mine += a
            other += b
            ratios.append(sum(a) / sum(b))
        q = statistics.quantiles(ratios, n=4)
        low, high = median_interval(ratios)
        return Paired(statistics.median(mine), statistics.median(other), statistics.median(ratios), q[0], q[2], low, high)
    except Exception as e:  # report, don't hide
        print(f"{label} timing failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return _NAN_PAIRED


def _control(label: str, case: Case, backend: str, fullgraph: bool, theirs: Callable | None, dev: torch.device,
             target: float) -> tuple[Paired, str]:
    """PyTorch's side against itself, timed with ``_paired`` against the compiled step ``theirs``, and a
    note ("" when none): a deep copy of its module compiled the same way, or, where that side is a
    function (cuDNN's RNN and LSTM, SDPA attention: a deep copy of a function is the function), the same
    function compiled a second time, on the same parameters. Its interval should hold 1.0; how far it
    reaches from 1.0 is what the measurement cannot tell apart on this row."""
    if theirs is None:
        return _NAN_PAIRED, ""
    try:
        twin = copy.deepcopy(case.theirs)
    except Exception as e:  # report, don't hide
        return _NAN_PAIRED, f"control not built: {type(e).__name__}: {str(e)[:100]}"
    params = list(twin.parameters()) if isinstance(twin, torch.nn.Module) else list(case.theirs_params)
    step, _, _, full = _compile_and_first_step(f"{label} PyTorch (control copy)", twin, case, params, backend, fullgraph)
    if step is None:
        return _NAN_PAIRED, "control's compile failed"
    note = "" if full == fullgraph else "control compiled without fullgraph"
    return _paired(f"{label} control", step, theirs, dev, target), note


def compiled_table(cases: dict, dtypes: list[str], only: list[str], dev: torch.device, target: float, backend: str, budget: float,
                   start: float) -> list[str]:
    """The "torchloom compiled vs PyTorch compiled" rows, printed as measured."""
    import torch._dynamo

    header = [
        "",
        f"torchloom compiled vs PyTorch compiled (torch.compile, backend {backend!r}, dynamic=False, fullgraph=True on",
        "both sides unless that side breaks): forward + backward per step, host overhead included; peak memory above",
        f"the inputs and parameters. Time: {PAIRS} pairs of blocks of steps in the order A B B A (B A A B in every other",
        "pair); the ratio is the median of the pairs' ratios, with their quartiles and the median's 95 % interval (sign",
        "test); each side's ms the median of its blocks (the two can disagree where the host drifted). Control: a second",
        "compiled copy of PyTorch's module (where that side is a function: the function compiled again, on the same",
        "parameters) timed the same way against the first: what this measurement reads where the two sides are the",
        "same code (its interval should hold 1.0). Ratios and intervals to 3 places. Graph breaks (explain), recompiles",
        "after the first step and the first step's seconds (the compile), each torchloom / PyTorch. graphed = ten",
        "compiled steps captured in one CUDA graph and replayed (what mode='reduce-overhead' runs): the device's time",
        "alone. Targets: time ≤ 1.0× (✓; = where the ratio is above 1.0 but 1.0 is inside its 95 % interval; ✗",
        "where the whole interval is above 1.0), peak memory ≤ 1.1×.",
        "",
        "| layer (PyTorch side) | dtype | shape | torchloom compiled ms | PyTorch compiled ms | time ratio | ratio quartiles | 95 % interval | control: PyTorch / PyTorch [95 %] | graphed torchloom ms | graphed PyTorch ms | graphed ratio | torchloom compiled MB | PyTorch compiled MB | memory ratio | graph breaks | recompiles | compile s (torchloom / PyTorch) | targets met |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    print("\n".join(header), flush=True)
    lines = []
    for case, dtype_name in _selected(cases, dtypes, only):
        if budget and time.perf_counter() - start > budget:
            print(f"(--budget {budget:.0f} s spent: {case.name} {dtype_name} and the rows after it not run)", flush=True)
            return header + lines
        label = f"{case.name} {dtype_name}"
        torch._dynamo.reset()
        breaks, note = _graph_breaks(case.ours, case.x)
        their_breaks, their_note = _graph_breaks(case.theirs, case.x)
        # Both sides fullgraph=True where they compile so (each per-call path of torch 2.11's compiled
        # callable costs host time of its own: measured on the CPU, fullgraph=True on one side alone
        # moved a compiled Dense step's ratio from 1.04× to 1.08×).
        # explain itself fails on some modules (cuDNN's nn.RNN / nn.LSTM: an IndexError inside explain):
        # such a side is still compiled fullgraph=True, and without it only if that fails (it does for those).
        ours, c_ours, s_ours, full = _compile_and_first_step(label, case.ours, case, case.ours_params, backend, breaks <= 0)
        theirs, c_theirs, s_theirs, their_full = _compile_and_first_step(f"{label} PyTorch", case.theirs, case,
                                                                         case.theirs_params, backend, their_breaks <= 0)
        notes = [f"torchloom's {'explain failed' if breaks < 0 else 'break'}: {note}"] if note else []
        notes += [f"PyTorch's {'explain failed' if their_breaks < 0 else 'break'}: {their_note}"] if their_note else []
        notes += [f"{side} compiled without fullgraph"
                  for side, f, fn in (("torchloom", full, ours), ("PyTorch", their_full, theirs)) if not f and fn is not None]
        notes += [f"{side}'s compile failed" for side, fn in (("torchloom", ours), ("PyTorch", theirs)) if fn is None]
        first = (c_ours.frame_count, c_theirs.frame_count)
        timed = _paired(label, ours, theirs, dev, target)
        control, control_note = _control(label, case, backend, their_full, theirs, dev, target)
        gt = _measure(f"{label} compiled, graphed", ours, dev, target, graphed=True)
        gp = _measure(f"{label} PyTorch compiled, graphed", theirs, dev, target, graphed=True)
        mt, mp = _memory(f"{label} compiled", ours, dev), _memory(f"{label} PyTorch compiled", theirs, dev)
        recompiles = (c_ours.frame_count - first[0], c_theirs.frame_count - first[1])
        graphed = "" if math.isnan(gt) or math.isnan(gp) else ", graphed ✓" if gt <= gp else ", graphed ✗"
        mem = "memory —" if math.isnan(mt) or math.isnan(mp) else "memory ✓" if mt <= 1.1 * mp else "memory ✗"
        notes += [control_note] if control_note else []
        met = time_verdict(timed) + graphed + ", " + mem + "".join(f"; {n}" for n in notes)
        line = (
            f"| {case.name} | {dtype_name} | {'×'.join(map(str, case.shape))} | {_ms(timed.ours)} | {_ms(timed.theirs)} | "
            f"{_times(timed.ratio, 3)} | {_quartiles(timed.q1, timed.q3)} | {_quartiles(timed.low, timed.high, 3)} | "
            f"{_times(control.ratio, 3)} [{_quartiles(control.low, control.high, 3)}] | {_ms(gt)} | {_ms(gp)} | {_ratio(gt, gp)} | {_mb(mt)} | {_mb(mp)} | {_ratio(mt, mp)} | "
            f"{_count(breaks)} / {_count(their_breaks)} | {recompiles[0]} / {recompiles[1]} | "
            f"{s_ours:.1f} / {s_theirs:.1f} | {met} |"
        )
        lines.append(line)
        print(line, flush=True)
        del ours, theirs
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return header + lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not speed")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--target", type=float, default=0.1, help="seconds of timed calls per measurement")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--compile-only", action="store_true", help="measure only the torch.compile column")
    ap.add_argument("--kernels", action="store_true", help="add the kernel-level rows")
    ap.add_argument("--compiled", action="store_true", help="only the 'torchloom compiled vs PyTorch compiled' table")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of --compiled (aot_eager checks it fast on the CPU)")
    ap.add_argument("--budget", type=float, default=0.0, help="--compiled: start no new row after this many seconds (0: no limit)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the layer rows whose name contains one")
    ap.add_argument("--compiled-kernels", action="store_true",
                    help="--compiled: torchloom's side reaches its registered Triton kernels under compile (the norms, "
                         "softmax and the SwiGLU gate otherwise hand Inductor their reference math)")
    args = ap.parse_args(argv)
    if args.compiled_kernels:
        from torchloom.kernels import _triton

        _triton.COMPILED_AS_REFERENCE.clear()
    start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev.type != "cuda" and not args.smoke:
        raise SystemExit("bench_layers needs a CUDA GPU (or --smoke to check the script on the CPU)")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke test: timings mean nothing)"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"--dtypes: unknown dtype {d!r} (float32, bfloat16, float16)")
    only = [o for o in args.only.split(",") if o]
    if dev.type == "cuda":  # every case on one side stream, captured on it too (see graphed_time)
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            return _run(args, dev, dtypes, only, start)
    return _run(args, dev, dtypes, only, start)


def _run(args: argparse.Namespace, dev: torch.device, dtypes: list[str], only: list[str], start: float) -> int:
    header = [
        "",
        "Forward + backward per step. ratio = torchloom / PyTorch (time and peak memory above the inputs and",
        "parameters). graphed = ten steps captured in one CUDA graph and replayed: the device's time without",
        "the host's launch overhead. Targets: time ≤ 1.0× PyTorch (LSTM/RNN ≤ 1.5× cuDNN), peak memory ≤ 1.1×.",
        "",
        "| layer (PyTorch side) | dtype | shape | torchloom ms | PyTorch ms | compile ms | time ratio | graphed torchloom ms | graphed PyTorch ms | graphed ratio | torchloom MB | PyTorch MB | compile MB | memory ratio | targets met |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    # Layer-major order (each layer in every dtype before the next layer); every row is printed as soon
    # as it is measured, so a run cut short still leaves complete rows.
    order = ("MultiHeadAttention", "LSTM", "RNN", "Dense", "Conv2D", "SwiGLU", "RMSNorm", "LayerNorm")
    cases = {
        dt: sorted(layer_cases(dev, getattr(torch, dt), args.smoke), key=lambda c: [c.name.startswith(o) for o in order].index(True))
        for dt in dtypes
    }
    if args.compiled:
        table = compiled_table(cases, dtypes, only, dev, args.target, args.backend, args.budget, start)
        print("\nThe table again, in one piece:\n" + "\n".join(table), flush=True)
        print(f"\ntotal {time.perf_counter() - start:.0f} s")
        return 0
    lines = []
    for case, dtype_name in _selected(cases, dtypes, only):
        label = f"{case.name} {dtype_name}"
        ours = _step(case.ours, case.x, case.gy, case.ours_params)
        theirs = _step(case.theirs, case.x, case.gy, case.theirs_params)
        compiled = None
        if not args.no_compile and not args.smoke:
            cf = _compiled(case.theirs, label)
            compiled = None if cf is None else _step(cf, case.x, case.gy, case.theirs_params)
        if args.compile_only:
            ours = theirs = None
        r = {
            "torchloom": _measure(label, ours, dev, args.target),
            "pytorch": _measure(f"{label} PyTorch", theirs, dev, args.target),
            "mem_torchloom": _memory(label, ours, dev),
            "mem_pytorch": _memory(f"{label} PyTorch", theirs, dev),
            "graphed_torchloom": _measure(f"{label} graphed", ours, dev, args.target, graphed=True),
            "graphed_pytorch": _measure(f"{label} PyTorch graphed", theirs, dev, args.target, graphed=True),
            "compile": _measure(f"{label} compile", compiled, dev, args.target),
            "mem_compile": _memory(f"{label} compile", compiled, dev),
        }
        if not lines:
            print("\n".join(header), flush=True)
        line = _row(case, dtype_name, r)
        lines.append(line)
        print(line, flush=True)
        if case.name.startswith(("LSTM", "RNN")) and dev.type == "cuda":
            from torchloom.kernels import recurrent

            print(f"  ({case.name} {dtype_name}: CUDA-graphed loop buffers held between calls: "
                  f"{recurrent.graph_cache_bytes() / 2**20:.0f} MB, not in the peak above)", flush=True)
            recurrent.clear_graph_cache()
        del ours, theirs, compiled
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    del cases
    print("\nThe table again, in one piece:\n" + "\n".join(header + lines), flush=True)
    if args.kernels:
        print("\n".join(kernel_table(dev, dtypes, args.smoke, args.target, copy_bandwidth(dev))))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
