"""Host time of compiled layers: torchloom compiled vs PyTorch compiled, on shapes so small that the step is
all host work (issue 36).

``bench_layers.py --compiled`` times the layers at working sizes on a GPU, where a compiled step's host
time (Dynamo's guards, AOTAutograd's wrappers, the autograd engine, the launches) hides behind or beside
the device's time, and where the host's own drift (±5 % from one run to the next on the H200 machines)
is larger than the difference left between the two sides. This script measures what is left: each
layer of ``bench_layers``' smoke shapes (a few rows), compiled with ``fullgraph=True`` on both sides
(not PyTorch's cuDNN RNN and LSTM, which do not compile so), one forward and backward per step, timed
in pairs of blocks in the order A B B A, then B A A B (``bench_layers._paired``), with the
median of the pairs' ratios and their quartiles.

Beside the times it counts the guards of each side's compiled frame: the checks Dynamo runs before
every call of a compiled graph (leaf guards and the accessor nodes that lead to them, from the guard
tree's printed form), and the time of one check run alone, warm. Three rows follow the layers
(``--no-floors`` leaves them out), each against ``nn.Linear`` on the Dense row's shape: a control (a
second ``nn.Linear``: what this measurement reads where both sides are the same code), a user subclass
of ``nn.Linear`` (what any module that is not torch.nn's own pays) and a minimal ``autograd.Function``
linear (what a hand-written backward itself pays). Each ratio comes with its quartiles and the 95 %
interval of the median (``bench_layers.median_interval``). ``--drop-global-guards`` compiles the left
side of each row without its guards on globals (``torch.compile``'s ``guard_filter_fn``; unsound in
general, a measurement only): what those guards cost.

Run: ``PYTHONPATH=. python bench/bench_compiled_host.py`` (CPU; ``--device cuda`` on a GPU machine);
``--only Dense,Conv2D --dtypes float32,bfloat16 --rounds 30``. Results: bench/RESULTS.md §10.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_layers as BL  # noqa: E402


def guard_tree(fn, compiled):
    """The guard manager of the frame Dynamo compiled for ``fn`` (a module's ``forward``, or the frame
    ``torch.compile`` adds around PyTorch's own modules), or None."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    codes = []
    for f in (getattr(getattr(compiled, "forward", None), "_torchdynamo_orig_callable", None),
              getattr(compiled, "_torchdynamo_orig_callable", None)):
        if f is not None and hasattr(f, "__code__"):
            codes.append(f.__code__)
    if isinstance(fn, torch.nn.Module):
        codes.append(type(fn).forward.__code__)
    elif hasattr(fn, "__code__"):
        codes.append(fn.__code__)
    for code in codes:
        entries = _debug_get_cache_entry_list(code)
        if entries:
            return entries[0].guard_manager
    return None


def guard_count(manager) -> tuple[int, int, int]:
    """``(leaf guards, accessor nodes, Python lambda guards)`` of a guard tree."""
    lines = str(manager).splitlines()
    leaves = sum(1 for line in lines if "+- " in line and "GuardManager" not in line)
    nodes = sum(1 for line in lines if "GuardManager:" in line)
    return leaves, nodes, sum("LAMBDA_GUARD" in line for line in lines)


def check_time(manager, fn, x, n: int = 5000) -> float:
    """Seconds of one warm guard check of the frame's locals (nan where they are not known here)."""
    text = str(manager)
    frame = {"args": (x,), "kwargs": {}, "fn": fn} if "L['args']" in text else {"self": fn, "x": x}
    if not manager.check(frame):
        return float("nan")
    for _ in range(300):
        manager.check(frame)
    t = time.perf_counter()
    for _ in range(n):
        manager.check(frame)
    return (time.perf_counter() - t) / n


def _no_global_guards(entries) -> list[bool]:
    """A ``guard_filter_fn`` keeping every guard but those on globals (unsound in general: for measuring)."""
    return [not e.is_global for e in entries]


def measure(case, rounds: int, block_s: float, drop_global_guards: bool = False) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    sides = {}
    for side, fn, params in (("ours", case.ours, case.ours_params), ("theirs", case.theirs, case.theirs_params)):
        cudnn_rnn = side == "theirs" and ("LSTM" in case.name or "RNN" in case.name)
        opts = {"options": {"guard_filter_fn": _no_global_guards}} if drop_global_guards and side == "ours" else {}
        compiled = torch.compile(fn, fullgraph=not cudnn_rnn, dynamic=False, **opts)
        step = BL._step(compiled, case.x, case.gy, params)
        for _ in range(30):
            step()
        manager = guard_tree(fn, compiled)
        sides[side] = (step, manager, guard_count(manager) if manager is not None else None,
                       check_time(manager, fn, case.x) if manager is not None else float("nan"))
    # bench_layers' paired timing: A B B A / B A A B blocks of about block_s seconds each
    timed = BL._paired(case.name, sides["ours"][0], sides["theirs"][0], case.x.device, block_s * rounds / 6, pairs=rounds)
    torch._dynamo.reset()
    return {"timed": timed, "guards": (sides["ours"][2], sides["theirs"][2]), "check": (sides["ours"][3], sides["theirs"][3])}


# ------------------------------------------------------------------------------ floors
# What any module that is not one of torch.nn's own pays on these shapes, next to torchloom's rows: a
# torch.nn module compiled alone is traced through a wrapper frame that folds its ``__call__`` into the
# graph, where a user module's ``__call__`` runs eagerly first; and a hand-written backward adds an
# ``autograd.Function`` (its class, its forward and backward, the functorch frames that trace it) to
# the guards. Each floor is timed against ``nn.Linear`` on the Dense row's shape.
class _UserLinear(torch.nn.Linear):
    """A user module that is ``nn.Linear`` in all but its class: its forward calls ``nn.Linear``'s."""

    def forward(self, x):
        return super().forward(x)


class _MinimalLinearFunction(torch.autograd.Function):
    """The least a hand-written linear backward can be: tensor methods only, no helper, no check."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return bias.addmm(x, weight.t())

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return g.mm(weight), g.t().mm(x), g.sum(0)


class _MinimalFunctionLinear(torch.nn.Linear):
    def forward(self, x):
        return _MinimalLinearFunction.apply(x, self.weight, self.bias)


def floor_cases(dev: torch.device, dtype: torch.dtype):
    """The floor rows (``BL.Case``), on the Dense row's smoke shape."""
    dense = next(BL.layer_cases(dev, dtype, smoke=True))
    (n, i, o), x, gy = dense.shape, dense.x, dense.gy
    theirs = dense.theirs
    for name, cls in (("control: a second nn.Linear", torch.nn.Linear),
                      ("floor: user subclass of nn.Linear", _UserLinear),
                      ("floor: minimal autograd.Function linear", _MinimalFunctionLinear)):
        ours = cls(i, o, device=dev, dtype=dtype)
        ours.load_state_dict(theirs.state_dict())
        yield BL.Case(f"{name} (nn.Linear)", (n, i, o), x, gy, ours, ours.parameters(), theirs, theirs.parameters(), 1.0)


def _us(seconds: float) -> str:
    return "—" if seconds != seconds else f"{seconds * 1e6:.2f}"  # nan: the frame's locals are not known here


def _guards(g) -> str:
    return "—" if g is None else f"{g[0]} + {g[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--only", default="Dense,Conv2D,SwiGLU,RMSNorm,LayerNorm", help="comma-separated name parts ('' for all)")
    ap.add_argument("--rounds", type=int, default=30, help="pairs of blocks per row")
    ap.add_argument("--block", type=float, default=0.02, help="seconds per block of steps")
    ap.add_argument("--no-floors", action="store_true", help="leave out the floor rows")
    ap.add_argument("--drop-global-guards", action="store_true",
                    help="compile torchloom's side without its guards on globals (torch.compile's guard_filter_fn; "
                         "unsound in general): what those guards cost")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the steps are host-bound, and threads add their own noise
    dev = torch.device(args.device)
    only = [o for o in args.only.split(",") if o]
    print(f"torchloom compiled vs PyTorch compiled, host-bound shapes, {dev} ({torch.__version__}); "
          f"{args.rounds} pairs of {args.block:g} s blocks per row. Guards: leaf checks + accessor nodes "
          "of the compiled frame's guard tree; check: one warm guard check alone."
          + (" torchloom's side (the left one of each row) compiled without its guards on globals." if args.drop_global_guards else "")
          + "\n")
    print("| layer (PyTorch side) | dtype | torchloom µs | PyTorch µs | ratio | ratio quartiles | 95 % interval | guards torchloom | guards PyTorch | check µs (torchloom / PyTorch) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        floors = [] if args.no_floors else list(floor_cases(dev, dtype))
        for case in [*BL.layer_cases(dev, dtype, smoke=True), *floors]:
            if only and not any(o in case.name for o in only) and not case.name.startswith(("floor", "control")):
                continue
            r = measure(case, args.rounds, args.block, args.drop_global_guards)
            t = r["timed"]
            print(f"| {case.name} | {dtype_name} | {t.ours * 1e6:.1f} | {t.theirs * 1e6:.1f} | {t.ratio:.3f}× | "
                  f"{t.q1:.3f}–{t.q3:.3f}× | {t.low:.3f}–{t.high:.3f}× | {_guards(r['guards'][0])} | {_guards(r['guards'][1])} | "
                  f"{_us(r['check'][0])} / {_us(r['check'][1])} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
