"""Every method on the engine's device path: per-step time and whole-run time, side by side.

One process, one table, a 784-256-256-10 ReLU network on random MNIST-shaped data (timing only):

1. **Per-step time** at batch 1, 32, 1,024 and 16,384 for backprop (SGD, cross-entropy), TargetProp
   (chain rule, pure), Tween and the feedback rules (feedback alignment, DFA, sign symmetry, FastProxy:
   SGD, cross-entropy), each run three ways through ``torchloom.train``:

   * ``graphed``: the engine's device path, steps captured in CUDA graphs (the default);
   * ``eager``: the same device steps without graphs (``cuda_graph=False``);
   * ``host``: the host-checked step of Loom's loop on the GPU (what TargetProp and Tween ran before
     the engine had a device path: one host read per step at least), forced by an observer with an
     ``on_batch_end`` hook.

   Steady state: the best epoch after the first, divided by its steps. The ratio column is each
   method's graphed step over backprop's graphed step (target ≤ 1.5×).

2. **Whole-run wall time**: 4 epochs over 60,000 samples, every warm-up, kernel compile and graph
   capture included, from the first call to the last result, at batch 32, 128 and 1,024: every
   torchloom method (graphed) against an eager PyTorch loop (``nn.Sequential``, ``torch.optim.SGD``,
   ``F.cross_entropy``) and ``torch.compile`` of that loop's step (compile time included). Target:
   torchloom ≤ 0.5× the eager loop. The data sit on the GPU before any timer starts.

The feedback rules' step times: ``--steps-only --methods fa,dfa,"sign sym","fast proxy"``.

Run: ``PYTHONPATH=. python bench/bench_trainers.py`` on a CUDA machine (``--quick`` for a short run,
``--dry-run`` runs the whole pipeline at toy sizes on the CPU, no timings worth reading, and so no
untimed priming runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import torchloom
from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig

SIZES = (784, 256, 256, 10)
METHODS = {
    "backprop": "backprop",
    "tp chain": TargetPropConfig(learning_rate=0.01),
    "tp pure": TargetPropConfig(mode="pure", learning_rate=0.01),
    "tween": TweenConfig(base_rate=0.01),
    # the feedback rules (docs/choosing-a-method.md): backprop's device step with their own backward
    # (targets: ≤ 1.5× backprop's step, DFA ≤ 1.0×)
    "fa": "feedback_alignment",
    "dfa": "dfa",
    "sign sym": "sign_symmetry",
    "fast proxy": "fast_proxy",
}
GRADIENT_METHODS = ("backprop", "fa", "dfa", "sign sym", "fast proxy")  # trained on cross-entropy with SGD
DEFAULT_METHODS = ("backprop", "tp chain", "tp pure", "tween")  # the feedback rules: --methods fa,dfa,"sign sym","fast proxy"


class _ForceHost:
    """An observer with a per-batch hook: the engine then runs Loom's host-checked loop."""

    def on_batch_end(self, trainer, step, logs):
        pass


def _net(dev, sizes=SIZES):
    torch.manual_seed(0)
    layers = [Dense(a, b, "relu" if i < len(sizes) - 2 else "linear") for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
    return Network(*layers).to(dev)


def _data(n_samples, batch, dev, sizes=SIZES):
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(n_samples, sizes[0], generator=g).to(dev)
    y = torch.randint(0, sizes[-1], (n_samples,), generator=g).to(dev)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n_samples, batch)]


def _config(method, dev, batch=None, **kw):
    """``method``'s TrainingConfig. TargetProp sums its update directions over the batch (Loom's rule):
    with ``batch`` its rate is scaled by ``min(1, 32 / batch)`` so that every batch size trains without
    diverging (a diverged run abandons its epochs and times something else)."""
    m = METHODS[method]
    m = m if isinstance(m, str) else type(m)(**{k: getattr(m, k) for k in m.__dataclass_fields__})
    if isinstance(m, TargetPropConfig) and batch:
        m.learning_rate = m.learning_rate * min(1.0, 32 / batch)
    return TrainingConfig(method=m, loss_type="cross_entropy" if method in GRADIENT_METHODS else "mse", verbose=0, device=dev, **kw)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --------------------------------------------------------------------------------- per step
def step_times(batches_sizes, dev, epochs=3, max_steps=128, methods=tuple(METHODS)):
    rows = []
    for batch in batches_sizes:
        steps = max(2, min(max_steps, 65536 // batch))
        data = _data(steps * batch, batch, dev)
        times = {}
        for method in ("backprop", *(m for m in methods if m != "backprop")):
            for way in ("graphed", "eager", "host"):
                kw = dict(cuda_graph=False) if way == "eager" else {}
                if way == "host":
                    kw["observers"] = [_ForceHost()]
                net = _net(dev)
                eps = epochs if way != "host" else 2
                result = torchloom.train(net, data, _config(method, dev, batch=batch, epochs=eps, **kw))
                times[(method, way)] = min(result.epoch_times[1:]) / len(data) * 1e6
        base = times[("backprop", "graphed")]
        for method in ("backprop", *(m for m in methods if m != "backprop")):
            rows.append((batch, method, times[(method, "graphed")], times[(method, "eager")], times[(method, "host")], times[(method, "graphed")] / base))
    return rows


# -------------------------------------------------------------------------------- whole run
def _torch_model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(), torch.nn.Linear(SIZES[1], SIZES[2]), torch.nn.ReLU(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    ).to(dev)


def _eager_run(data, dev, epochs, compiled=False):
    model = _torch_model(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    fn = torch.compile(step) if compiled else step
    _sync(dev)
    t = time.perf_counter()
    for _ in range(epochs):
        total = torch.zeros((), device=dev)
        for x, y in data:
            total += fn(x, y)
        float(total)  # one read per epoch, as torchloom's loop
    _sync(dev)
    return time.perf_counter() - t


def _loom_run(method, data, dev, epochs):
    net = _net(dev)
    _sync(dev)
    t = time.perf_counter()
    torchloom.train(net, data, _config(method, dev, batch=data[0][0].shape[0], epochs=epochs))
    _sync(dev)
    return time.perf_counter() - t


def _warm_process(dev):
    """What every PyTorch training process pays once, before its first step, whoever trains: the first
    ``torch.optim`` optimizer imports ``torch._dynamo`` (seconds: ``Optimizer.add_param_group`` is
    wrapped by ``torch._disable_dynamo``, which imports it on first call), and the first matrix product
    creates the cuBLAS handle. Done before any timer starts, in every contender's process alike."""
    torch.optim.SGD([torch.zeros(1, device=dev, requires_grad=True)], lr=0.1)
    a = torch.ones(8, 8, device=dev)
    (a @ a).sum().item()


def one_run(contender, batch, dev, n_samples, epochs):
    """One whole run in this process: ``contender`` is ``eager``, ``compile`` or a torchloom method."""
    data = _data(n_samples, batch, dev)
    _warm_process(dev)
    if contender in ("eager", "compile"):
        return _eager_run(data, dev, epochs, compiled=contender == "compile")
    return _loom_run(contender, data, dev, epochs)


def _child_env(pycache: str, cold: bool) -> dict:
    """The environment of a whole-run child process: Python's bytecode cache on (under ``pycache``), as
    on any installation pip made (the GPU machine sets ``PYTHONDONTWRITEBYTECODE``, so every process
    would compile each lazily imported module from source inside its timed run); with ``cold``, empty
    Triton and Inductor caches of its own."""
    import os
    import tempfile

    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", pycache)
    if cold:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    return env


def whole_runs(batch_sizes, dev, n_samples=60000, epochs=4, with_compile=True, methods=tuple(METHODS), cold=False,
               repeats=1, no_preload=False, prime=True):
    """Every contender in a fresh process of its own (``--one-run``), so none inherits another's
    imports, kernel loads or caches. Each contender first runs once, untimed, in a process of its own
    at a tiny size with the same last-batch size (a ragged last batch has kernel variants of its own):
    after that its bytecode and (unless ``cold``) Triton's and Inductor's on-disk kernel caches are
    warm, as on any machine after its first run, whatever the order of the contenders. ``cold``: every timed process starts from empty Triton and Inductor caches (every
    kernel compiled inside the timed run). ``repeats``: every contender timed that many times, the
    contenders taking turns (so a slow spell of the machine spreads over all of them); the rows give the
    median and the range. ``no_preload``: each torchloom method also as ``<method>/no-preload``, with
    ``TORCHLOOM_PRELOAD=0`` (no helper thread importing Triton while the run gets ready). ``prime=False``
    (the dry run, whose times mean nothing): no priming runs."""
    import contextlib
    import os
    import signal
    import subprocess
    import tempfile

    pycache = tempfile.mkdtemp(prefix="bench-pycache-")
    variants = [*methods, *(f"{m}/no-preload" for m in methods if no_preload)]
    contenders = ["eager"] + (["compile"] if with_compile else []) + variants

    def run(c, batch, n, eps, cold_env):
        env = _child_env(pycache, cold_env)
        if c.endswith("/no-preload"):
            c, env["TORCHLOOM_PRELOAD"] = c.split("/")[0], "0"
        cmd = [sys.executable, __file__, "--one-run", c, str(batch), str(n), str(eps), "--device", dev.type]
        # a session of its own, ended with the run: torch.compile's worker processes outlive their
        # parent otherwise and would share the machine with the next contenders
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if res.returncode != 0:
            raise RuntimeError(f"{c} at batch {batch} failed:\n{res.stderr[-2000:]}")
        return float(res.stdout.strip().splitlines()[-1])

    for batch in batch_sizes if prime else ():  # untimed priming runs: bytecode and kernel caches, the ragged last batch's too
        for c in contenders:
            run(c, batch, 2 * batch + n_samples % batch, 1, False)
    rows = []
    for batch in batch_sizes:
        times = {c: [] for c in contenders}
        for _ in range(repeats):
            for c in contenders:
                times[c].append(run(c, batch, n_samples, epochs, cold))
        med = {c: statistics.median(v) for c, v in times.items()}
        spread = {c: (min(v), max(v)) for c, v in times.items()}
        for method in variants:
            rows.append((batch, method, med[method], med["eager"], med.get("compile", float("nan")), med[method] / med["eager"],
                         spread[method], spread["eager"]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU, no priming runs: checks the pipeline only")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--whole-run-only", action="store_true", help="only the whole-run table")
    ap.add_argument("--steps-only", action="store_true", help="only the per-step table")
    ap.add_argument("--cold", action="store_true", help="whole runs from empty Triton/Inductor caches (compiles timed)")
    ap.add_argument("--repeats", type=int, default=1, help="whole runs: time each contender this many times (median, range)")
    ap.add_argument("--no-preload-too", action="store_true", help="whole runs: each method also with TORCHLOOM_PRELOAD=0")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)} (default: {', '.join(DEFAULT_METHODS)}; backprop's step is always timed: the ratio's base)")
    ap.add_argument("--sizes", default=None, help="comma-separated batch sizes for both tables")
    ap.add_argument("--one-run", nargs=4, metavar=("CONTENDER", "BATCH", "SAMPLES", "EPOCHS"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_run:  # a child process of whole_runs: print the seconds of one whole run
        c, batch, n, epochs = args.one_run
        print(one_run(c, int(batch), torch.device(args.device), int(n), int(epochs)))
        return 0
    if args.dry_run:
        dev = torch.device("cpu")
        step_sizes, run_sizes, n_samples, max_steps = (4,), (32,), 256, 4
    else:
        if not torch.cuda.is_available():
            print("bench_trainers.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
        dev = torch.device("cuda")
        step_sizes = (1, 32, 1024) if args.quick else (1, 32, 1024, 16384)
        run_sizes = (128,) if args.quick else (32, 128, 1024)
        n_samples, max_steps = 60000, (64 if args.quick else 128)
    methods = tuple(m.strip() for m in args.methods.split(","))
    if any(m not in METHODS for m in methods):
        ap.error(f"--methods: each must be one of {', '.join(METHODS)}, got {args.methods!r}")
    if args.sizes:
        step_sizes = run_sizes = tuple(int(b) for b in args.sizes.split(","))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"# bench_trainers.py on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    if not args.whole_run_only:
        print("\n## Per step (µs), 784-256-256-10, steady state\n")
        print("| batch | method | graphed | eager device | host loop | graphed / backprop graphed |")
        print("|---:|---|---:|---:|---:|---:|")
        for batch, method, g, e, h, r in step_times(step_sizes, dev, max_steps=max_steps, methods=methods):
            print(f"| {batch} | {method} | {g:.1f} | {e:.1f} | {h:.1f} | {r:.2f}× |", flush=True)
    if args.steps_only:
        return 0
    print("\n## Whole run (s): 4 epochs over 60,000 samples, warm-up, compile and capture included\n")
    caches = ("empty Triton and Inductor caches: every compile timed" if args.cold
              else "no untimed priming run (--dry-run)" if args.dry_run
              else "Triton's and Inductor's disk caches warm from an untimed tiny run")
    print(f"Each contender in a fresh process (imports, kernel loads and graph captures its own; {caches}).\n")
    if args.repeats > 1:
        print(f"Medians of {args.repeats} runs each, the contenders taking turns; ranges in brackets.\n")
    print("| batch | torchloom method | torchloom | eager PyTorch | torch.compile | torchloom / eager |")
    print("|---:|---|---:|---:|---:|---:|")
    rows = whole_runs(run_sizes, dev, n_samples=n_samples, with_compile=not (args.no_compile or args.dry_run), methods=methods,
                      cold=args.cold, repeats=max(1, args.repeats), no_preload=args.no_preload_too, prime=not args.dry_run)
    for batch, method, t, e, c, r, (t0, t1), (e0, e1) in rows:
        rng = (lambda a, b: f" [{a:.3f}–{b:.3f}]") if args.repeats > 1 else (lambda a, b: "")
        print(f"| {batch} | {method} | {t:.3f}{rng(t0, t1)} | {e:.3f}{rng(e0, e1)} | {c:.3f} | {r:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
